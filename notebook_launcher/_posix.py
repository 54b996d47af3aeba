"""POSIX process helpers shared by the kernel side, the forkserver and the ranks.

Bottom layer: imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


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


def become_subreaper() -> None:
    """Make this process the reaper of its orphaned descendants (Linux 3.4+).

    A daemon a rank starts (``setsid``, a double fork, ``nohup cmd &``) leaves the rank's
    process group and loses its parent: without this it would be adopted by init and
    outlive the launch. Adopted by the rank instead, it stays in the rank's tree, where
    :func:`kill_descendants` finds it when the rank ends."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: daemons may outlive the rank
        pass


def start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from ``/proc``), None when no
    such process: a pid and its start time name one process, never a later one that
    reuses the pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every live descendant of ``pid`` (children first) as ``(pid, start time)``: the
    start time tells a process from a later one that reuses its pid."""
    found: list[tuple[int, str]] = []
    todo = [pid]
    seen = {pid}
    while todo:
        parent = todo.pop(0)
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):
                continue
            for kid in kids:
                started = start_time(kid)
                if kid not in seen and started is not None:
                    seen.add(kid)
                    found.append((kid, started))
                    todo.append(kid)
    return found


def kill_descendants(pid: int, known: list[tuple[int, str]] | None = None) -> None:
    """SIGKILL ``pid``'s descendants (``known``: a list taken earlier, from
    :func:`descendants`; each is killed only if its pid still names that process)."""
    for kid, started in descendants(pid) if known is None else known:
        if known is not None and start_time(kid) != started:
            continue  # gone, and its pid taken by another process
        try:
            os.kill(kid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def close_quietly(*fds: int) -> None:
    """Close file descriptors, ignoring ones already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def lead_own_process_group() -> None:
    """Make this process the leader of a new process group (its pid is the group id).

    A rank does this first thing: Jupyter's interrupt signals the kernel's whole process
    group, and that interrupt is the kernel's to handle (it stops the ranks), not a failure
    of a rank; and the processes a rank starts stay in its group, so they can be killed
    with it. The parent calls ``setpgid(pid, pid)`` too, so there is no window.
    """
    try:
        os.setpgid(0, 0)
    except OSError:  # already a group or session leader
        pass


def kill_process_group(pgid: int) -> None:
    """SIGKILL every process left in group ``pgid`` (what a rank started: subprocesses,
    shell pipelines, DataLoader workers). Call it while the rank is still unreaped (a
    zombie keeps its pid, so the group id cannot have been reused)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass


_guard: subprocess.Popen[bytes] | None = None


def guard_process_group() -> None:
    """Start a tiny watcher that kills this process group once this process has gone.

    For when nobody else can: the kernel (and the forkserver) was killed, the rank died
    with it, and what the rank started would live on, re-parented to init. The watcher
    is ``sh`` reading a pipe whose only write end this process holds (children forked
    from here close it at once; exec closes it anyway), so end-of-file means this
    process is gone. It holds no other file descriptor of ours.
    """
    global _guard
    if _guard is not None or not os.path.exists("/bin/sh"):
        return
    if os.getpgrp() != os.getpid():  # never kill a group we do not lead (a shell's job)
        return
    read_end, write_end = os.pipe()
    try:
        _guard = subprocess.Popen(
            ["/bin/sh", "-c", "read _; kill -KILL 0"],
            stdin=read_end,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
    except OSError:
        os.close(write_end)
        return
    finally:
        os.close(read_end)
    os.register_at_fork(after_in_child=lambda: close_quietly(write_end))


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[list[Any]]:
    """Hold back Ctrl-C (SIGINT) until the block is done, then deliver it.

    For short sections that must not stop half way (a process started but not yet
    recorded; fds being released; a message half sent). Works in the main thread, where
    Python runs signal handlers; elsewhere the block runs as it is (no SIGINT is handled
    there anyway). Yields the list of interrupts held back so far: a block that loops
    can look at it and stop at the next safe point. Nested blocks pass theirs outwards:
    the outermost delivers.
    """
    caught: list[Any] = []
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    except (ValueError, OSError):  # no signal support here (embedded interpreter)
        yield caught
        return
    try:
        yield caught
    finally:
        if previous is not None:  # None: a handler not installed from Python; keep ours off
            signal.signal(signal.SIGINT, previous)
        else:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if caught:
            if callable(previous):
                previous(signal.SIGINT, caught[0])
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


def socket_inodes() -> set[str]:
    """The inodes of this process's open sockets (from ``/proc/self/fd``)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def import_quietly(names: tuple[str, ...]) -> None:
    """Import ``names``; one that cannot be imported (an optional module, absent) is left
    to whoever needs it, to fail there with its own error."""
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - optional modules may be absent
            pass


#: Modules :func:`import_without_cuda` found touching CUDA: never probed again here.
_touch_cuda: set[str] = set()


def import_without_cuda(names: tuple[str, ...]) -> None:
    """Import ``names`` (those not imported yet) in this process, so that the children it
    forks next start with them -- only where importing them touches no CUDA: a probe child
    imports them first and says. For processes that fork ranks and must never touch CUDA
    (the forkserver, a node's agent): a module that does so at import (some do: a
    ``torch.compile`` at import, a device query) stays the ranks' own to import, and is
    not probed again (a probe costs the import)."""
    names = tuple(n for n in names if n not in sys.modules and n not in _touch_cuda)
    if not names:
        return
    pid = quiet_fork()
    if pid == 0:
        clean = False
        try:
            import_quietly(names)
            clean = not cuda_touched()
        finally:
            os._exit(0 if clean else 1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        import_quietly(names)
    else:
        _touch_cuda.update(names)


def cuda_touched() -> bool:
    """This process initialised CUDA, or loaded its driver (``libcuda``): a child forked
    now could not use CUDA."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return True
    except Exception:  # noqa: BLE001 - a torch without CUDA support
        pass
    try:
        with open("/proc/self/maps") as f:
            return "libcuda.so" in f.read()
    except OSError:
        return False


__all__ = [
    "become_subreaper",
    "close_quietly",
    "cuda_touched",
    "deferred_interrupts",
    "descendants",
    "die_with_parent",
    "guard_process_group",
    "import_quietly",
    "import_without_cuda",
    "kill_descendants",
    "kill_process_group",
    "lead_own_process_group",
    "quiet_fork",
    "socket_inodes",
    "start_time",
]
