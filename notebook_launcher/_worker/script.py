"""What ``python -m notebook_launcher run`` runs in every rank: a script, a module, a function.

The process group already exists when these start (the rank's entry made it), so a script
that uses the state API (``PartialState()``, ``Accelerator()``) adopts it, exactly as it
would create one under ``torchrun``. Module-level functions: pickled by reference, they
reach ranks under every start method.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import runpy
import sys
from collections.abc import Iterator
from typing import Any


def run_script(path: str, argv: list[str]) -> None:
    """``python path argv...``: ``__main__`` is the script, ``sys.argv`` its arguments and
    its directory first on ``sys.path``, as the interpreter does."""
    path = os.path.abspath(path)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    with _exit_zero_is_the_end():
        runpy.run_path(path, run_name="__main__")


def run_module(module: str, argv: list[str]) -> None:
    """``python -m module argv...``."""
    sys.argv = [module, *argv]
    sys.path.insert(0, os.getcwd())
    with _exit_zero_is_the_end():
        runpy.run_module(module, run_name="__main__", alter_sys=True)


@contextlib.contextmanager
def _exit_zero_is_the_end() -> Iterator[None]:
    """A script's ``sys.exit(0)`` (``sys.exit(main())``) is how it ends well: its rank then
    returns None. In a launched function it is a death (no value came back); any other
    code stays one here too."""
    try:
        yield
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise


def run_function(target: str, argv: list[str]) -> Any:
    """``module:function`` called with the command line's arguments (strings); its return
    value comes back to the launcher."""
    module_name, _, name = target.partition(":")
    sys.argv = [target, *argv]
    sys.path.insert(0, os.getcwd())
    function: Any = importlib.import_module(module_name)
    for part in name.split("."):
        function = getattr(function, part)
    return function(*argv)


__all__ = ["run_function", "run_module", "run_script"]
