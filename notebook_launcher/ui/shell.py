"""Where the kit runs: which IPython shell, if any (never imported just to ask).

The views ask it (a dashboard needs a kernel that talks to a front end); kept apart from
the package's face so that a view imports it without importing the face back."""

from __future__ import annotations

import sys


def _shell() -> object | None:
    ipython = sys.modules.get("IPython")  # never import IPython just to ask
    if ipython is None:
        return None
    try:
        return ipython.get_ipython()
    except Exception:  # noqa: BLE001
        return None


def in_notebook_kernel() -> bool:
    """True inside an IPython kernel that talks to a front end (a ``ZMQInteractiveShell``,
    or a subclass such as Colab's)."""
    shell = _shell()
    if shell is None:
        return False
    zmqshell = sys.modules.get("ipykernel.zmqshell")
    base = getattr(zmqshell, "ZMQInteractiveShell", None)
    if base is not None and isinstance(shell, base):
        return True
    return type(shell).__name__ == "ZMQInteractiveShell"


def has_kernel() -> bool:
    """An IPython shell with a kernel (widgets can reach a front end): not terminal IPython."""
    shell = _shell()
    return shell is not None and getattr(shell, "kernel", None) is not None


__all__ = ["has_kernel", "in_notebook_kernel"]
