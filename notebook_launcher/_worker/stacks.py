"""A rank's stacks on demand, even while it is stuck in C++ (rank side).

:func:`install` registers a fault handler (``faulthandler.register``) for
:data:`STACK_SIGNAL`: whenever the kernel sends that signal, the C-level handler writes the
Python stack of every thread of the rank into a file of the rank's own. It needs no
Python code to run: it works while the main thread waits in a gloo or NCCL collective
with the GIL released, in a ``time.sleep``, on a lock, or even while some C extension
holds the GIL -- where a Python thread asked to report would never run. Nothing happens
until the signal comes: the rank pays nothing while it runs.

Why not py-spy, the other known way: it is a separate binary to install, it must be
allowed to ``ptrace`` the rank (containers, Kubernetes and hardened kernels forbid that by
default), and it stops the process while it reads it. The fault handler needs none of
that; what it lacks (native frames, variables) is not what the stall view shows.

The file is a memory file (``memfd_create``; where there is none, a file of the temporary
directory, unlinked at once), so nothing is left behind whatever happens to the rank; the
kernel finds it as ``/proc/<pid>/fd/<n>``, whose link names it
``/memfd:notebook_launcher-stacks-<main thread id>-...`` (``(deleted)``): the kernel
learns which thread is the main one, and that the handler is in place, from the rank's
open files alone. The file is opened in append mode: the kernel empties it, sends the
signal, and reads what was written. A process the rank forks from Python (a DataLoader
worker) inherits the handler and gets a file of its own at the fork. Memory files cost no
file system: every launch starts them, on every rank (issue 33: the temporary files, the
probe of the temporary directory and the wait for the helper thread to start cost a
launch ~2 ms of CPU per rank, and more under load).

**Without a signal, where Python can answer**: a signal cuts short what the rank waits in
(``sleep`` and ``nanosleep``, ``poll``, ``select`` and timed waits are never restarted: they
return early, with ``EINTR``), and the fault handler writes at most 100 threads (a rank with
more loses its main thread, the oldest). So :func:`install` also starts a helper thread
that sleeps on a pipe of its own until the kernel writes to it, then writes every thread's
stack, from ``sys._current_frames()``, in the fault handler's format, to an answer file
(a memory file too, named ``...out-<pid>-<pipe's fd>-<pipe's inode>``: the kernel opens
the pipe as ``/proc/<pid>/fd/<fd>`` once its link says ``pipe:[<inode>]``).
A rank that waits in C with the GIL released (a collective, a sleep, a lock) lets it run at
once; the kernel sends the signal only to a rank whose helper did not answer in time (a C
extension that holds the GIL).

**The flight recorder** (torch's record of each process group's last collectives, with
their sequence numbers): on when ``TORCH_FR_BUFFER_SIZE`` (or
``TORCH_NCCL_TRACE_BUFFER_SIZE``) is set, and on NCCL ranks by default (2000 entries; on
gloo it costs a small step ~10%: set the variable to turn it on). Reading it takes Python,
so :func:`install_flight` starts a thread that sleeps on a pipe of its own until the kernel
writes to it, then writes the recorder's last entries (JSON) to an answer file. A rank
stuck in a collective has released the GIL, so the thread runs.
"""

from __future__ import annotations

import _thread
import faulthandler
import fcntl
import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from .._stacks import FILE_PREFIX, FLIGHT_PREFIX, PYSTACKS_END, PYSTACKS_PREFIX, STACK_SIGNAL

#: Entries of each process group the flight recorder's answer keeps (the newest).
FLIGHT_ENTRIES = 8
FLIGHT_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: The buffer size set on NCCL ranks when the user set none.
NCCL_FLIGHT_DEFAULT = "2000"

_fd: int | None = None
_pid: int | None = None
_hooked = False
_flight_pid: int | None = None
_helper_pid: int | None = None
_helper_fds: tuple[int, ...] = ()
#: Frames written of one thread at most (then ``...``, as the fault handler does).
MAX_FRAMES = 500


def _named_file(name: str) -> int:
    """An fd open on a new file named ``name`` that is on no file system (a memory file),
    found by its name in /proc/<pid>/fd; where memory files are refused, a temporary file
    renamed ``name`` and unlinked: never left on disk either way."""
    try:
        return os.memfd_create(name, os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        pass
    fd, path = tempfile.mkstemp(prefix="notebook_launcher-tmp-")
    final = os.path.join(os.path.dirname(path), name)
    try:
        os.rename(path, final)
        os.unlink(final)
    except BaseException:
        for p in (path, final):
            try:
                os.unlink(p)
            except OSError:
                pass
        os.close(fd)
        raise
    return fd


def install(helper: bool = True, first: Callable[[], None] | None = None) -> Callable[[], None]:
    """Make this process dump its stacks on :data:`STACK_SIGNAL`, and (``helper``) answer
    the kernel's requests from a helper thread without one (idempotent per process).

    ``first``: work of the rank's start that must not hold it up (its process group's
    guard, whose start waits for a new process to be scheduled): the helper thread does it
    before it waits for requests -- one thread, not one more that starts and ends on every
    rank (each costs a wake-up on a loaded machine, at its start and at the rank's exit).
    Returns a call that waits until ``first`` is done."""
    done = _thread.allocate_lock()
    done.acquire()

    def first_then_done() -> None:
        try:
            if first is not None:
                first()
        finally:
            done.release()

    if not helper or not _install_helper(first_then_done):
        first_then_done()

    def wait() -> None:
        with done:
            pass

    _install_handler()
    return wait


def _install_handler() -> None:
    global _fd, _pid, _hooked
    if _pid == os.getpid():
        return
    inherited = _fd if _pid is not None else None
    # Found by the kernel before the handler is in place, the file is not used: the kernel
    # signals only a process whose status says it catches the signal (its default action
    # would kill it).
    fd = _named_file(f"{FILE_PREFIX}{threading.get_ident():x}-{os.getpid()}")
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_APPEND)
        faulthandler.register(STACK_SIGNAL, file=fd, all_threads=True, chain=False)
    except BaseException:
        os.close(fd)
        raise
    _fd, _pid = fd, os.getpid()
    if inherited is not None:  # a forked child: the parent's file is the parent's
        try:
            os.close(inherited)
        except OSError:
            pass
    if not _hooked:
        _hooked = True
        os.register_at_fork(after_in_child=_after_fork)


def _install_helper(first: Callable[[], None]) -> bool:
    """The helper thread that writes every thread's stack when the kernel asks (see the
    module docstring), once it has done ``first``; False if it was there already."""
    global _helper_pid, _helper_fds
    pid = os.getpid()
    if _helper_pid == pid:
        return False
    _helper_pid, _helper_fds = pid, _serve_requests(PYSTACKS_PREFIX, pid, _stacks_answer, first)
    return True


def _stacks_answer() -> bytes | None:
    try:
        return python_dump().encode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - no answer: the kernel falls back to the signal
        return None


def _serve_requests(
    prefix: str,
    pid: int,
    answer_for: Callable[[], bytes | None],
    first: Callable[[], None] = lambda: None,
) -> tuple[int, int, int]:
    """A daemon thread that does ``first()``, then writes ``answer_for()`` to the answer file
    each time the kernel writes to the request pipe (the answer file is named for
    ``prefix``, this pid and the pipe); returns their fds. The pipe is made first: the kernel asks only a rank whose
    pipe it finds."""
    request, keep_open = os.pipe()  # (its write end kept: the read never sees an end)
    inode = os.fstat(request).st_ino
    answer = _named_file(f"{prefix}out-{pid}-{keep_open}-{inode}")
    flags = fcntl.fcntl(answer, fcntl.F_GETFL)
    fcntl.fcntl(answer, fcntl.F_SETFL, flags | os.O_APPEND)

    def serve() -> None:
        first()
        while os.getpid() == pid:
            try:
                if not os.read(request, 64):
                    return
            except OSError:
                return
            data = answer_for()
            if data is None:
                continue
            try:
                os.write(answer, data)
            except OSError:
                return

    # Not threading.Thread: its start() waits until the thread has run, a wake-up that a
    # loaded machine makes the rank wait for; nothing here needs the thread to be running
    # (a request waits in the pipe), and threads of this module are said to be ours by
    # their frames (``_stacks.is_machinery``), not by a name.
    _thread.start_new_thread(serve, ())
    return request, keep_open, answer


def python_dump() -> str:
    """Every thread's stack but this one's, in the fault handler's format (innermost frame
    first), ending with :data:`PYSTACKS_END`; no limit on the number of threads."""
    me = threading.get_ident()
    lines: list[str] = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        lines.append(f"Thread 0x{ident:016x} (most recent call first):")
        depth = 0
        at: Any = frame
        while at is not None:
            if depth == MAX_FRAMES:
                lines.append("  ...")
                break
            code = at.f_code
            lineno = at.f_lineno if at.f_lineno is not None else "???"
            lines.append(f'  File "{code.co_filename}", line {lineno} in {code.co_name}')
            at, depth = at.f_back, depth + 1
        lines.append("")
        del frame, at
    lines.append(PYSTACKS_END)
    return "\n".join(lines) + "\n"


def flight_enabled(backend: str) -> bool:
    """Whether this rank records its collectives (sets the NCCL default, see above)."""
    if backend == "nccl" and not any(k in os.environ for k in FLIGHT_ENV):
        os.environ[FLIGHT_ENV[0]] = NCCL_FLIGHT_DEFAULT
    for key in FLIGHT_ENV:
        value = os.environ.get(key, "")
        if value.strip().isdigit() and int(value) > 0:
            return True
    return False


def install_flight(backend: str) -> None:
    """Answer the kernel's requests for the flight recorder's entries (see above); call
    before the process group is created (torch reads the buffer size then)."""
    global _flight_pid
    if _flight_pid == os.getpid() or not flight_enabled(backend):
        return
    pid = os.getpid()
    _serve_requests(FLIGHT_PREFIX, pid, _flight_answer)
    _flight_pid = pid


def _flight_answer() -> bytes:
    try:
        entries = flight_entries()
    except Exception:  # noqa: BLE001 - an answer, whatever torch says
        entries = []
    return json.dumps(entries).encode() + b"\n"


def flight_entries() -> list[dict[str, Any]]:
    """The newest :data:`FLIGHT_ENTRIES` entries of each process group, without stacks."""
    import pickle

    c10d = sys.modules.get("torch._C._distributed_c10d")
    if c10d is None:
        return []
    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        return []
    try:
        raw = dump(includeStackTraces=False)
    except TypeError:
        raw = dump()
    entries = pickle.loads(raw).get("entries", [])
    keep = (
        "collective_seq_id", "p2p_seq_id", "profiling_name", "input_sizes", "state",
        "time_discovered_completed_ns", "is_p2p", "retired", "process_group",
    )  # fmt: skip
    by_group: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        row = {k: e.get(k) for k in keep}
        row["process_group"] = list(e.get("process_group") or ())
        by_group.setdefault(str(row["process_group"]), []).append(row)
    return [row for rows in by_group.values() for row in rows[-FLIGHT_ENTRIES:]]


def _after_fork() -> None:
    global _helper_fds
    for fd in _helper_fds:  # the parent's helper's pipe and answer: not this child's
        try:
            os.close(fd)
        except OSError:
            pass
    _helper_fds = ()
    if _pid is None:
        return
    try:
        _install_handler()  # (a child forked by the rank: no thread of ours started there)
    except Exception:  # noqa: BLE001 - a child without stacks is still a working child
        pass


__all__ = [
    "FILE_PREFIX",
    "FLIGHT_PREFIX",
    "STACK_SIGNAL",
    "flight_enabled",
    "flight_entries",
    "install",
    "install_flight",
    "python_dump",
]
