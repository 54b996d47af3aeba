"""Out-of-memory helpers with Accelerate's names (``accelerate.utils.memory``).

:func:`find_executable_batch_size` retries a training function with a smaller batch size
(times 0.9) whenever it runs out of memory; :func:`release_memory` drops references and empties
the device cache.

Example::

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size):
        loader = DataLoader(dataset, batch_size=batch_size)
        ...

    train()   # tries 128, then 115, 103, ... until one fits
"""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

#: Messages of the RuntimeErrors that mean "out of memory" on the devices torch supports.
_OUT_OF_MEMORY = (
    " out of memory.",  # CUDA, HIP, XPU
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # HPU
)


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Empty the accelerator's cache (after a garbage collection if asked)."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    elif hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.empty_cache()
    elif torch.backends.mps.is_available():
        torch.mps.empty_cache()


def release_memory(*objects: Any) -> list[Any]:
    """Drop the references in ``objects`` and empty the device cache; rebind your names to
    the returned ``None``\\ s: ``model, optimizer = release_memory(model, optimizer)``."""
    released: list[Any] = [None] * len(objects)
    del objects
    clear_device_cache(garbage_collection=True)
    return released


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` is an out-of-memory error (or cuDNN's "not supported")."""
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        message = exception.args[0]
        return isinstance(message, str) and any(m in message for m in _OUT_OF_MEMORY)
    return False


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
) -> Any:
    """Decorator: call ``function(batch_size, *args, **kwargs)`` from ``starting_batch_size``
    down, multiplying the size by 0.9 (or calling ``reduce_batch_size_fn()``) after each
    out-of-memory error, until a call returns. Call the decorated function *without* the
    batch size. Raises ``RuntimeError`` when the size reaches zero; other errors go through.

    >>> @find_executable_batch_size(starting_batch_size=10)
    ... def fits(batch_size):
    ...     if batch_size > 8:
    ...         raise RuntimeError("CUDA out of memory.")
    ...     return batch_size
    >>> fits()
    8
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )

    batch_size = starting_batch_size

    def smaller() -> int:
        return int(batch_size * 0.9)

    reduce = reduce_batch_size_fn or smaller

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        nonlocal batch_size
        clear_device_cache(garbage_collection=True)
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            given = ", ".join(f"{p}={v!r}" for p, v in zip(params[1:], args[1:], strict=False))
            raise TypeError(
                f"Batch size was passed into `{function.__name__}` as the first argument when "
                f"called. Remove it, the decorator passes it: `{function.__name__}({given})`"
            )
        while True:
            if batch_size == 0:
                raise RuntimeError("No executable batch size found, reached zero.")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not should_reduce_batch_size(exc):
                    raise
                del exc
                clear_device_cache(garbage_collection=True)
                batch_size = reduce()

    return decorator


__all__ = [
    "clear_device_cache",
    "find_executable_batch_size",
    "release_memory",
    "should_reduce_batch_size",
]
