"""Handing a run (or a session) over to a supervisor of its own, which outlives the kernel.

The kernel makes the run's record (``_launch.detach``), then :class:`Handover` starts the
supervisor (``_supervise``: forked warm by the kernel's forkserver, or a cold interpreter)
and reads its pid; the supervisor runs nothing before its go (:meth:`Handover.commit`:
the run's key, down a pipe), and without one (:meth:`Handover.abandon`, or the kernel's
death) it ends and removes the record. Shared by the detached launch (``detached``) and
the detached session (``detached_session``)::

    kernel                                   supervisor (its own session, parent: init)
    Handover().start(run_dir) --- fork ---->  setsid, fork; says its pid
                  <------ pid (a pipe) -----  waits for its go
    commit(): the run's key (a pipe) ------>  task.pkl checked with the key, loaded, run
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._posix import deferred_interrupts
from ..errors import LaunchError
from . import detach as record
from . import forkserver

if TYPE_CHECKING:
    from .diagnosis import RestartPolicy
    from .plan import LaunchPlan


@dataclass(frozen=True)
class LaunchJob:
    """What a detached launch's supervisor runs (``_supervise``), handed over pickled in
    the run's sealed task: the launch as the kernel checked it. On this host: its ``plan``
    and ``task`` (the function with its args, pickled); on a cluster: the cluster's
    configuration (not started: the supervisor starts it), the task, ``num_processes`` and
    the cluster's ``options``."""

    policy: RestartPolicy
    line_prefix: str | None
    child_failed_name: str | None
    stall_after: float | None
    task: Any = None
    plan: LaunchPlan | None = None
    cluster: Any = None
    num_processes: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


#: Seconds a kernel waits for a new supervisor to say its pid.
START_TIMEOUT = 30.0


class Handover:
    """A run handed to a supervisor: :meth:`start` forks it (warm: by this kernel's
    forkserver, which has imported torch and holds none of this kernel's memory or fds;
    cold while that server is not up: a fresh interpreter, which imports torch after the
    hand-over -- a kernel's first detached run returns at once rather than wait a second or
    two for the server, which then starts behind it, for the next runs), and it says its
    pid; then it waits for its go (:meth:`commit`: the run's key) before it runs anything.
    Without one (:meth:`abandon`, or this kernel's death) it ends and removes the record.
    Made before anything starts, so that whatever point an error or a Ctrl-C cuts it at,
    :meth:`abandon` knows what to undo."""

    def __init__(self) -> None:
        #: the run's key: the supervisor's go, and the seal of its task
        self.key = secrets.token_bytes(record.KEY_BYTES)
        self.pid: int | None = None
        self.said = self.go = -1  # our ends of the pid pipe and of the go pipe
        self.heard = bytearray()  # what the supervisor said there so far (its pid)
        self.ended = False  # the pid pipe was read to its end
        self.committed = False
        #: started cold: the forkserver is started behind the run once it is up
        self.behind: tuple[str, int] | None = None

    def start(self, run_dir: str, listen_fd: int, forks: int) -> None:
        """Fork the supervisor of ``run_dir`` and read its pid (``forks``: the ranks it
        forks; the server's next spare forks as many ahead of its run)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_APPEND
        log = record.open_private(run_dir, record.LOG, flags)  # (read here if it fails)
        said_w = go_r = -1
        try:
            try:
                with deferred_interrupts():  # every end of the pipes known, or none opened
                    self.said, said_w = os.pipe()
                    go_r, self.go = os.pipe()
                server = forkserver.running()
                with deferred_interrupts():  # a request half sent, a process nobody knows of
                    warm = server is not None and _start_warm(
                        server, run_dir, [said_w, log, go_r], listen_fd, forks
                    )
                    if not warm:
                        _start_cold(run_dir, said_w, log, go_r, listen_fd)
                        self.behind = (run_dir, forks)
            finally:
                for fd in (said_w, go_r):  # the supervisor holds the only copies left
                    if fd >= 0:
                        os.close(fd)
            _read_until_closed(self.said, START_TIMEOUT, self.heard)
            self.ended = True
            self.pid = _said_pid(self.heard)
            if self.pid is not None:
                return
            why = os.pread(log, 1 << 16, max(0, os.fstat(log).st_size - (1 << 16)))
        finally:
            os.close(log)
        tail = why.decode(errors="replace")[-2000:].strip()
        raise LaunchError(
            "the supervisor of the detached run could not start"
            + (f":\n{tail}" if tail else f" within {START_TIMEOUT:.0f} s (a loaded machine?)")
        )

    def commit(self) -> None:
        """The go: the run's key down its pipe (the supervisor checks the task with it)."""
        try:
            os.write(self.go, self.key)  # (32 bytes into an empty pipe: never blocks)
        except BrokenPipeError:
            raise LaunchError(
                f"the supervisor (pid {self.pid}) of the detached run ended before its go; "
                "its log (supervisor.log in the run's record) may say why"
            ) from None
        finally:
            self._close()
        self.committed = True
        if self.behind is not None:
            run_dir, forks = self.behind
            events = os.path.join(run_dir, record.EVENTS)
            # once the cold supervisor has done its imports (it writes its first event
            # then), not beside them: on a small machine the two would slow each other
            forkserver.start_behind(forks, after=lambda: _has_data(events))

    def abandon(self) -> None:
        """No go: a supervisor that got the request runs nothing and ends; returns once
        it has."""
        with deferred_interrupts():
            if self.go >= 0:
                os.close(self.go)
                self.go = -1
            if self.pid is None and self.said >= 0:
                if not self.ended:  # (what was read before the interrupt is kept)
                    _read_until_closed(self.said, START_TIMEOUT, self.heard)
                self.pid = _said_pid(self.heard)
            self._close()
            if self.pid is not None:
                _wait_gone(self.pid, START_TIMEOUT)

    def _close(self) -> None:
        for fd in (self.said, self.go):
            if fd >= 0:
                os.close(fd)
        self.said = self.go = -1


def _wait_gone(pid: int, timeout: float) -> None:
    """Wait until process ``pid`` (not a child of ours) has ended; SIGKILL it after
    ``timeout``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if not select.select([fd], [], [], timeout)[0]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            select.select([fd], [], [], 5.0)
    finally:
        os.close(fd)


def abandon(run_dir: str) -> None:
    """A run that could not be handed over: its supervisor (if it got that far) killed,
    which ends its ranks with it, and its record removed."""
    try:
        meta = record.read_meta(run_dir)
        if meta.pid is not None and record.supervisor_alive(meta):
            os.kill(meta.pid, signal.SIGKILL)
    except (OSError, ValueError, TypeError):
        pass
    record.remove(run_dir)


def _said_pid(said: bytes | bytearray) -> int | None:
    try:
        return int(said.decode().strip())
    except ValueError:
        return None


def _has_data(path: str) -> bool:
    try:
        return os.stat(path).st_size > 0
    except OSError:
        return True  # gone (ended, removed): nothing to wait for


def _start_warm(server: Any, run_dir: str, fds: list[int], listen_fd: int, forks: int) -> bool:
    """Ask the forkserver to fork the supervisor with ``fds`` (its handshake pipe, its log,
    its go pipe); False where the request could not be sent (the server had died: nothing
    was forked). A server that dies once it has the request raises: a supervisor may be
    running, so no second one is started."""
    fds = fds + ([listen_fd] if listen_fd >= 0 else [])
    try:
        server.supervise(run_dir, fds, listen_fd >= 0, forks)
    except OSError:
        return False
    return True


def supervisor_code(call: str) -> str:
    """``python -c`` code that imports this package (from where this one lives) and makes
    ``call`` of ``_supervise`` (a fresh interpreter's supervisor)."""
    parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    name = call.split("(", 1)[0]
    return (
        f"import sys; sys.path.insert(0, {parent!r}); "
        f"from notebook_launcher._supervise import {name}; {call}"
    )


def _start_cold(run_dir: str, said: int, log: int, go: int, listen_fd: int) -> None:
    code = supervisor_code("main(sys.argv[1:])")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, run_dir, str(listen_fd)],
        stdin=go,  # its go comes on its stdin
        stdout=said,
        stderr=log,
        pass_fds=(listen_fd,) if listen_fd >= 0 else (),
        start_new_session=True,  # Jupyter's interrupt and the terminal's hang-up: not its
    )
    proc.wait()  # the first process forks the supervisor and exits: no zombie of ours


def _read_until_closed(fd: int, timeout: float, into: bytearray) -> None:
    """Read ``fd`` into ``into`` until its end or a whole line (the supervisor's pid), or
    ``timeout``; each chunk is kept as it comes, so an interrupt loses nothing that was
    read."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not into.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 64) if ready else b""
        if not chunk:
            break
        into += chunk


__all__ = ["START_TIMEOUT", "Handover", "LaunchJob", "abandon", "supervisor_code"]
