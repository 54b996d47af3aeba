"""POSIX process helpers shared by the kernel side, the forkserver and the ranks.

Bottom layer: imports nothing of ours.
"""

from __future__ import annotations

import ctypes
import os
import signal
import warnings

_PR_SET_PDEATHSIG = 1


def quiet_fork() -> int:
    """``os.fork()`` without Python 3.12's warning about forking a threaded process.

    Jupyter kernels always have threads. We fork only before any CUDA or process group
    exists in the parent, and the child touches none of the other threads' state (the
    launcher's preflight refuses or avoids fork where that is not so).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def die_with_parent(expected_parent: int) -> None:
    """Ask the OS to SIGKILL this process when its parent goes (kernel restart, crash).

    Exits at once if the parent is already gone (it died before ``prctl`` took effect).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the control socket's EOF still stops us
        pass
    if os.getppid() != expected_parent:
        os._exit(1)


def close_quietly(*fds: int) -> None:
    """Close file descriptors, ignoring ones already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


__all__ = ["close_quietly", "die_with_parent", "quiet_fork"]
