"""Environment-variable helpers with Accelerate's names (``accelerate.utils.environment``).

``patch_environment`` and ``clear_environment`` change ``os.environ`` for a block and put it
back afterwards, also when the block raises; ``purge_accelerate_environment`` removes the
``ACCELERATE_*`` variables a test or function set. Torch-free.

Example::

    with patch_environment(omp_num_threads=1):     # keys are upper-cased: OMP_NUM_THREADS=1
        ...
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

# Accelerate's logger name, so that logging set up for Accelerate applies (README).
logger = logging.getLogger("accelerate.utils.environment")

T = TypeVar("T")

_ACCELERATE_PREFIX = "ACCELERATE_"


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set ``KEY=str(value)`` for each keyword (upper-cased) inside the block, then restore
    the previous values (or remove the keys that were not set), also on an exception.

    >>> import os
    >>> with patch_environment(nl_doctest_key=1):
    ...     os.environ["NL_DOCTEST_KEY"]
    '1'
    >>> "NL_DOCTEST_KEY" in os.environ
    False
    """
    before: dict[str, str | None] = {}
    for key, value in kwargs.items():
        key = key.upper()
        before.setdefault(key, os.environ.get(key))
        os.environ[key] = str(value)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """Run the block with an empty ``os.environ``; the whole environment comes back after it
    (the same ``os.environ`` object: references to it stay valid)."""
    saved = dict(os.environ)
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _accelerate_variables_restored() -> Iterator[None]:
    before = {k: v for k, v in os.environ.items() if k.startswith(_ACCELERATE_PREFIX)}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(_ACCELERATE_PREFIX)]:
            if key not in before:
                del os.environ[key]
        os.environ.update(before)


def purge_accelerate_environment(func_or_cls: T) -> T:
    """Decorator: the ``ACCELERATE_*`` variables a function (or each ``test*`` method of a
    class and of its subclasses) sets are removed again when it returns or raises.

    Example::

        @purge_accelerate_environment
        def test_fp16():
            TrainingArguments(fp16=True)   # sets ACCELERATE_MIXED_PRECISION; gone afterwards
    """

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _accelerate_variables_restored():
                return function(*args, **kwargs)

        wrapper._accelerate_is_purged_environment_wrapped = True  # type: ignore[attr-defined]
        return wrapper

    if not isinstance(func_or_cls, type):
        return wrap(func_or_cls)  # type: ignore[arg-type,return-value]

    def wrap_methods(cls: type) -> type:
        for name in dir(cls):
            if not name.startswith("test"):
                continue
            method = getattr(cls, name)
            if callable(method) and not hasattr(
                method, "_accelerate_is_purged_environment_wrapped"
            ):
                setattr(cls, name, wrap(method))
        return cls

    wrap_methods(func_or_cls)
    func_or_cls.__init_subclass__ = classmethod(  # type: ignore[assignment,method-assign]
        lambda cls, **kwargs: wrap_methods(cls)
    )
    return func_or_cls


def convert_dict_to_env_variables(current_env: dict[str, str]) -> list[str]:
    """``KEY=value\\n`` lines for an environment file, leaving out (with a warning) entries
    with an empty key or value or one of ``; \\n < >`` or a space in them."""
    forbidden = (";", "\n", "<", ">", " ")
    lines = []
    for key, value in current_env.items():
        if key and value and not any(c in key + value for c in forbidden):
            lines.append(f"{key}={value}\n")
        else:
            logger.warning(
                "Skipping %s=%s: it contains forbidden characters or missing values.", key, value
            )
    return lines


def check_os_kernel() -> None:
    """Warn (through logging) on Linux kernels older than 5.5, where training can hang."""
    info = platform.uname()
    if info.system != "Linux":
        return
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", info.release)
    if match is None:
        return
    version = tuple(int(x) for x in match.groups())
    if version < (5, 5, 0):
        found = ".".join(map(str, version))
        logger.warning(
            f"Detected kernel version {found}, which is below the recommended minimum of 5.5.0; "
            "this can cause the process to hang. Upgrade the kernel to 5.5.0 or higher."
        )


def get_int_from_env(env_keys: list[str], default: int) -> int:
    """The first of ``env_keys`` set to a non-negative integer, else ``default``."""
    for key in env_keys:
        value = int(os.environ.get(key, "-1"))
        if value >= 0:
            return value
    return default


__all__ = [
    "check_os_kernel",
    "clear_environment",
    "convert_dict_to_env_variables",
    "get_int_from_env",
    "patch_environment",
    "purge_accelerate_environment",
]
