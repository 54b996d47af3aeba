"""POSIX process helpers shared by the kernel side, the forkserver and the ranks.

Bottom layer: imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
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


#: The pid of the process that forked last (set in it just before): a child's hooks tell
#: from it whether they run in a child of the process that registered them.
_forked_by = [0]


def _note_forking() -> None:
    _forked_by[0] = os.getpid()


os.register_at_fork(before=_note_forking)


def close_in_children(*fds: int) -> None:
    """Close ``fds`` in each child this process forks from now on, at once -- in its own
    children only. A hook that closed them by number in every descendant would, in a
    grandchild, close whatever the child had opened under those numbers since (the child
    closed them, so they were free): the fork-answer child of a forkserver's or agent's
    probe lost its pipe so, and its answer with it."""
    owner = os.getpid()

    def close() -> None:
        if _forked_by[0] == owner:
            close_quietly(*fds)

    os.register_at_fork(after_in_child=close)


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
    close_in_children(write_end)


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
    ``torch.compile`` at import, a device query, a ``get_arch_list()``) stays the ranks' own
    to import, and is not probed again (a probe costs the import)."""
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
    """This process initialised CUDA, loaded its driver (``libcuda``), or registered
    torch's CUDA fork handler: a child forked now could not use CUDA. For the package's own
    processes that fork ranks (a probe of what the forkserver or an agent may import)."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return True
    except Exception:  # noqa: BLE001 - a torch without CUDA support
        pass
    return _maps_libcuda() or fork_handler_registered() is not False


#: Whether torch's CUDA fork handler is registered here, once it is (it never goes away).
_registered: list[bool] = []


def fork_handler_registered() -> bool | None:
    """Whether torch's CUDA fork handler is registered in this process: then every child
    forked from it is a "bad fork", where the first CUDA call raises "Cannot re-initialize
    CUDA in forked subprocess" -- whatever registered it (``torch.cuda.get_arch_list()``,
    ``is_available()`` without NVML, ``torch._C._cuda_getDeviceCount()``, CUDA's
    initialisation; ``torch/csrc/cuda/Module.cpp``'s ``poison_fork``), and although
    ``torch.cuda.is_initialized()`` may still say False. Nothing in the process shows it:
    a throwaway child (a canary, a few ms: one fork) reads torch's own flag,
    ``torch.cuda._is_in_bad_fork()``. None when the canary did not answer (stuck or
    killed); False without torch's CUDA module loaded (nothing could have registered it)."""
    if _registered:
        return True
    if sys.modules.get("torch.cuda") is None:
        return False
    answer = fork_answer(_bad_fork_here, timeout=CANARY_TIMEOUT)
    if answer == b"bad":
        _registered.append(True)
        return True
    return False if answer == b"ok" else None


#: Seconds a canary child may take (it reads one flag; it is stuck if it takes this long).
CANARY_TIMEOUT = 5.0


def _bad_fork_here() -> bytes:
    """In a forked child: whether CUDA would refuse this process (torch's own flag)."""
    cuda = sys.modules.get("torch.cuda")
    is_bad = getattr(cuda, "_is_in_bad_fork", None)
    return b"bad" if callable(is_bad) and is_bad() else b"ok"


def _maps_libcuda() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libcuda.so" in f.read()
    except OSError:
        return False


def fork_answer(ask: Any, timeout: float) -> bytes | None:
    """Fork a throwaway child that runs ``ask()`` (returning bytes) and sends that back;
    what it sent, or None when it failed, crashed or took longer than ``timeout`` seconds
    (then it is killed). For questions only a child can answer, or that may crash the
    asker (a broken driver library).

    The answer is read as soon as the child has written it: the child's exit (tearing down
    a copy of a kernel's address space: milliseconds for a large one) is waited for by a
    reaper thread, not by the caller. Ctrl-C at any moment leaves no child behind: it is
    killed and reaped first."""
    parent = os.getpid()
    read_end, write_end = os.pipe()
    pid = None
    data = b""
    answered = False
    try:
        with deferred_interrupts():  # the child and its reaping, or neither
            pid = quiet_fork()
            if pid == 0:
                try:
                    os.close(read_end)
                    die_with_parent(parent)
                    out = ask()
                    out = len(out).to_bytes(8, "little") + out
                    while out:
                        out = out[os.write(write_end, out) :]
                    os.close(write_end)  # the answer is whole: the parent need not wait more
                finally:
                    os._exit(0)
        os.close(write_end)
        write_end = -1
        data = _read_to_end(read_end, time.monotonic() + timeout)
        answered = len(data) >= 8 and int.from_bytes(data[:8], "little") == len(data) - 8
    finally:
        with deferred_interrupts():
            close_quietly(read_end, *([write_end] if write_end >= 0 else []))
            if pid and answered:
                _reap_later(pid)
            elif pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
    return data[8:] if answered else None


def _read_to_end(fd: int, deadline: float) -> bytes:
    """What ``fd`` gives until its end, or until ``deadline`` (then what came so far)."""
    chunks = []
    while (left := deadline - time.monotonic()) > 0 and select.select([fd], [], [], left)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


#: The reaper thread's name as the OS knows it (``/proc/self/task/*/comm``): the fork-safety
#: check, which counts threads Python did not start, leaves it out.
REAPER_NAME = "nl-reaper"
_PR_SET_NAME = 15
_reaper: dict[str, Any] = {}


def _reap_later(pid: int) -> None:
    """Reap child ``pid`` (which is ending) in this process's reaper thread: a daemon,
    started at the first such child and waiting for the next one after (a thread per child
    would cost its start, and a fork-safety probe for each new thread id)."""
    if _reaper.get("pid") != os.getpid():  # the first here (a forked child starts afresh)
        wanted = threading.Condition()
        _reaper.update(pid=os.getpid(), wanted=wanted, pids=[])
        thread = threading.Thread(target=_reap, args=(wanted, _reaper["pids"]), daemon=True)
        thread.name = "notebook-launcher-reaper"
        thread.start()
    with _reaper["wanted"]:
        _reaper["pids"].append(pid)
        _reaper["wanted"].notify()


def _reap(wanted: threading.Condition, pids: list[int]) -> None:
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, REAPER_NAME.encode(), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    while True:
        with wanted:
            while not pids:
                wanted.wait()
            pid = pids.pop(0)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:  # reaped already (someone waited on every child)
            pass


__all__ = [
    "become_subreaper",
    "close_quietly",
    "cuda_touched",
    "deferred_interrupts",
    "descendants",
    "fork_answer",
    "fork_handler_registered",
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
