"""The worker group: start this node's ranks, pump what they send, stop them in stages.

Channels between the kernel and each rank (see :mod:`notebook_launcher.launcher` for the
whole flow)::

    kernel (WorkerGroup)                                 rank r (_worker.entry)
      control socketpair  <== events, Returned/Raised ==   runtime.emit(), the function's end
      (_wire.control)     === Setup, Task (non-fork) ==>
      stdout pipe         <== raw bytes (fd 1) ========   print(), C++ logs, subprocesses
      stderr pipe         <== raw bytes (fd 2) ========   warnings, tracebacks
      pidfd (sentinel)    <-- readable when it exits

``pump()`` waits on all of these at once (no timer polling), turns bytes into
rank-labelled :class:`~notebook_launcher._events.Output` lines, and hands every event
and every exit to the caller's callbacks. Knows nothing of torch or widgets.
"""

from __future__ import annotations

import codecs
import collections
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from .._events import PHASES, Event, Output, WorkerPhase, WorkerStarted
from .._posix import (
    close_quietly,
    deferred_interrupts,
    descendants,
    kill_descendants,
    kill_process_group,
    quiet_fork,
)
from .._spec import WorkerSpec
from .._wire.control import Channel, Raised, Reformed, Returned, Setup, Task
from ..errors import RankFailure
from . import forkserver

#: ``pidfd_send_signal`` flag (Linux 6.9): to the thread the pidfd names, not the process.
PIDFD_SIGNAL_THREAD = 1
#: Unterminated output kept per stream before it is passed on as it is (bounded memory).
MAX_PARTIAL_CHARS = 1 << 16
#: When only output is ready, wait this long for more before reading: ranks that print
#: line by line then cost the kernel one wake-up per batch, not per line. A rank's answer
#: takes the output it printed first along. 8 ranks printing 100 lines/s (bench/
#: dashboard.py, "no view"): 2 ms cost the kernel 3.3-4.4% of a core, 10 ms 2.1%; no one
#: sees 10 ms.
OUTPUT_BATCH_S = 0.01
#: While the ranks are chatty -- PACE_AFTER looks within PACE_WITHIN seconds that brought
#: only output and plain events (progress, barriers, metrics) -- the pump looks at them at
#: most every PACE_S, taking what came meanwhile together: an exit, or the wake fd, is seen
#: at once; an answer (Returned, Raised) waits PACE_S at most, and ends the pace. A launch's
#: start (each rank says it joins, then that it runs) is not chatty: its failures are not
#: held back. 8 ranks with a tqdm bar each and 100 lines/s (bench/dashboard.py): their ~80
#: progress events a second each woke the kernel, on top of the output (~100 wake-ups a
#: second, 3.4-3.7% of a core with the dashboard at load 4-9; paced, 1.5-1.7%; issue 33);
#: the dashboard redraws every 0.25 s at most, so no one sees 50 ms.
PACE_S = 0.05
PACE_AFTER = 8
PACE_WITHIN = 0.2

# --- one worker process -------------------------------------------------------------------


@dataclass
class WorkerProcess:
    rank: int
    pid: int
    channel: Channel
    #: "stdout"/"stderr" -> the parent's read end; removed at EOF
    pipes: dict[str, int]
    pidfd: int
    popen: subprocess.Popen[bytes] | None = None
    server: forkserver.ForkServer | None = None  # our forkserver, when it is the parent
    returncode: int | None = None
    result: bytes | None = None
    failure: RankFailure | None = None
    exc_data: bytes | None = None
    conn_open: bool = True
    #: we sent it SIGTERM or SIGKILL: a signal it ends by is then ours, not a death (a rank
    #: killed from outside while we stop the others is still a death)
    signalled: bool = False
    #: the signals we sent it (SIGTERM, SIGKILL) while it lived: a signal it ends by that we
    #: never sent is a death, even while we stop the others (see :meth:`reap`)
    sent: set[int] = field(default_factory=set)
    #: what the rank was doing, for a rank that dies: "starting", "receiving its task", "running"
    stage: str = "starting"
    #: why it ended when we know better than its exit code (e.g. its forkserver died)
    note: str = ""
    #: its descendants when it was asked to stop (SIGTERM): killed once it has ended,
    #: daemons that left its process group included
    tree: list[tuple[int, str]] | None = None
    partial: dict[str, str] = field(default_factory=lambda: {"stdout": "", "stderr": ""})
    decoders: dict[str, Any] = field(
        default_factory=lambda: {
            s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")
        }
    )

    @property
    def exited(self) -> bool:
        return self.returncode is not None

    def reap(self, report_timeout: float) -> int:
        """The return code (``-signal`` when killed) of a process that has ended or is
        being killed. Whoever forked it reaps it: us, ``subprocess``, or the forkserver
        (which reports within ``report_timeout``; a missing report means it died, and
        its children with it: SIGKILL)."""
        if self.returncode is None:
            self.returncode = self._reap(report_timeout)
            if self.returncode < 0 and -self.returncode not in self.sent:
                # Killed by a signal we did not send: a death, though we were stopping it (a
                # rank SIGKILLed from outside, or by itself, while its process was still
                # tearing down -- its sockets closed, the others failed, we sent SIGTERM --
                # was taken for one we stopped).
                self.signalled = False
        return self.returncode

    def _reap(self, report_timeout: float) -> int:
        if self.tree:  # what it started, as it was when we asked it to stop
            kill_descendants(self.pid, self.tree)
        if self.server is not None:  # it kills the rank's group before it reaps
            code = self.server.wait_returncode(self.pid, report_timeout)
            if code is None:
                code = -int(signal.SIGKILL)
                self.note = "its forkserver process died, and took it along"
                self.sent.add(signal.SIGKILL)  # (its end is said by the note)
            return code
        kill_process_group(self.pid)  # what it started goes with it (still unreaped)
        if self.popen is not None:
            return self.popen.wait()
        return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])

    def interrupt(self) -> None:
        """SIGINT to the rank's main thread, where a session's task runs.

        Sent to the process, the kernel may hand the signal to any of the rank's threads
        (gloo's, OpenMP's): Python then notes it, but the main thread sleeps on in a blocking
        call (``time.sleep``) until something else wakes it -- the interrupt is seen seconds
        later or never. Sent to the main thread (the process's first, whose tid is its pid),
        it interrupts that call. Older kernels lack the flag: then to the process."""
        if self.returncode is not None:
            return
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGINT, None, PIDFD_SIGNAL_THREAD)
        except ProcessLookupError:
            pass
        except OSError:  # EINVAL: a kernel before 6.9
            self.send_signal(signal.SIGINT)

    def _ended_unreaped(self) -> bool:
        """It has exited, not yet reaped (only a child of ours can say; else False)."""
        try:
            flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
            return os.waitid(os.P_PIDFD, self.pidfd, flags) is not None
        except OSError:  # not our child (the forkserver's), or its pidfd is closed
            return False

    def send_signal(self, sig: int) -> None:
        """Signal the rank (its pidfd: never another process that took its pid). SIGKILL
        takes its descendants first, SIGTERM notes them (killed when it has ended): the
        daemons a rank started outside its process group end with it too."""
        if self.returncode is not None:
            return
        if sig in (signal.SIGTERM, signal.SIGKILL) and not self._ended_unreaped():
            self.signalled = True  # (one that had died already, e.g. SIGKILLed, is a death)
            self.sent.add(sig)
        if sig == signal.SIGKILL:
            kill_descendants(self.pid)
        elif sig == signal.SIGTERM and self.tree is None:
            self.tree = descendants(self.pid)
        try:
            signal.pidfd_send_signal(self.pidfd, sig)
        except (ProcessLookupError, OSError):
            pass


# --- how workers are started --------------------------------------------------------------


@dataclass
class StartRequest:
    """Everything needed to start rank ``spec.rank``: the child's ends and the parent's."""

    spec: WorkerSpec
    task: Any  # (fn, args, kwargs) for fork; cloudpickled bytes otherwise
    listen_fd: int | None
    child_conn: socket.socket
    parent_conn: Connection
    out_r: int
    out_w: int
    err_r: int
    err_w: int

    def close(self) -> None:
        """Release every end (the rank could not be started)."""
        self.child_conn.close()
        self.parent_conn.close()
        close_quietly(self.out_r, self.out_w, self.err_r, self.err_w)


def start_fork(req: StartRequest, parent_fds: list[int]) -> WorkerProcess:
    from .._worker import entry  # the child runs it: fork's one crossing to the rank side

    parent = os.getpid()
    pid = quiet_fork()
    if pid == 0:  # child
        close_quietly(*parent_fds)
        conn = Connection(req.child_conn.detach())
        entry.run(conn, req.out_w, req.err_w, req.listen_fd, parent, spec=req.spec, task=req.task)
    _own_group(pid)
    return _finish_start(req, pid)


def _own_group(pid: int) -> None:
    """The rank leads its own process group (it does the same: whoever runs first wins)."""
    try:
        os.setpgid(pid, pid)
    except OSError:  # it did it already, or exec'd
        pass


def start_spawn(req: StartRequest, parent_fds: list[int]) -> WorkerProcess:
    conn_fd = req.child_conn.fileno()
    fds = [conn_fd, req.out_w, req.err_w] + ([req.listen_fd] if req.listen_fd is not None else [])
    argv = [sys.executable, "-m", "notebook_launcher._worker", *map(str, fds[:3])]
    argv.append(str(req.listen_fd) if req.listen_fd is not None else "-")
    argv.append(str(os.getpid()))
    popen = subprocess.Popen(
        argv,
        pass_fds=fds,
        stdin=subprocess.DEVNULL,
        stdout=req.out_w,
        stderr=req.err_w,
        env=forkserver.child_env(),
        cwd=req.spec.cwd or None,
    )
    _own_group(popen.pid)
    return _finish_start(req, popen.pid, popen=popen)


def start_forkserver(req: StartRequest, parent_fds: list[int]) -> WorkerProcess:
    server = forkserver.get()
    fds = [req.child_conn.fileno(), req.out_w, req.err_w]
    if req.listen_fd is not None:
        fds.append(req.listen_fd)
    pid = server.fork(fds, has_listen=req.listen_fd is not None)
    return _finish_start(req, pid, server=server)


STARTERS: dict[str, Callable[[StartRequest, list[int]], WorkerProcess]] = {
    "fork": start_fork,
    "spawn": start_spawn,
    "forkserver": start_forkserver,
}


def _finish_start(
    req: StartRequest,
    pid: int,
    popen: subprocess.Popen[bytes] | None = None,
    server: forkserver.ForkServer | None = None,
) -> WorkerProcess:
    """Parent side after the child exists: drop the child's ends, keep ours."""
    req.child_conn.close()
    os.close(req.out_w)
    os.close(req.err_w)
    return WorkerProcess(
        rank=req.spec.rank,
        pid=pid,
        channel=Channel(req.parent_conn),
        pipes={"stdout": req.out_r, "stderr": req.err_r},
        pidfd=os.pidfd_open(pid),
        popen=popen,
        server=server,
    )


# --- the group ----------------------------------------------------------------------------


class WorkerGroup:
    """This node's ranks of one launch.

    ``start()`` starts every rank; ``pump(timeout)`` waits once on all sentinels, sockets
    and pipes and handles what is ready; ``terminate()`` begins a staged stop (SIGTERM
    now, SIGKILL after ``grace``, both driven by ``pump``); ``close()`` kills what is
    left, reaps it and releases every fd. Callbacks: ``on_event(Event)`` for worker
    events and output lines, ``on_exit(WorkerProcess)`` once per rank that ended.
    """

    def __init__(
        self,
        specs: list[WorkerSpec],
        start_method: str,
        task: Any,
        listen_sock: socket.socket | None,
        on_event: Callable[[Event], None],
        on_exit: Callable[[WorkerProcess], None],
        grace: float = 1.0,
        on_message: Callable[[WorkerProcess, Any], None] | None = None,
        pool: Any = None,
    ) -> None:
        """``on_message(proc, message)``, when given, receives every control message
        that is not an event (a session's per-task outcomes); without it a rank's one
        ``Returned``/``Raised`` is kept on its :class:`WorkerProcess`. ``pool``: ranks
        forked ahead (:class:`~notebook_launcher._launch.pool.RankPool`), which get their
        Setup and Task (pickled) as a forkserver's do."""
        self.specs = specs
        self.start_method = start_method
        self._pool = pool
        self._task = task
        self._listen = listen_sock
        self._on_event = on_event
        self._on_exit = on_exit
        self._on_message = on_message
        self.grace = grace
        self.procs: list[WorkerProcess] = []
        self._kill_at: float | None = None
        self._closed = False
        # One epoll set for the group's life: each fd is registered once, not on every
        # wake-up (a pump wakes hundreds of times a second under chatty ranks).
        self._selector = selectors.DefaultSelector()
        # ...and one of what is never held back (exits, the wake fd): while the ranks are
        # chatty the pump waits on it alone, until ``_paced_until`` (see PACE_S)
        self._urgent = selectors.DefaultSelector()
        self._paced_until = float("-inf")
        #: when the last looks that brought nothing urgent were (PACE_AFTER of them)
        self._plain_looks: collections.deque[float] = collections.deque(maxlen=PACE_AFTER)
        self._answered = False  # a message that is not a plain event was read
        self._wake: int | None = None

    # -- start -------------------------------------------------------------------------

    def start(self, on_abort: Callable[[BaseException], None] | None = None) -> None:
        """Start every rank; on any failure (Ctrl-C included) stop those started and raise.

        Starting one rank -- its fds, the process, its record -- happens with Ctrl-C held
        back, so an interrupt finds either no trace of that rank or a recorded one that
        ``close()`` cleans up; never a process or an fd nobody knows about.
        ``on_abort(error)`` is told before the ranks started so far are stopped: their
        exits are then the caller's doing, not deaths (see ``RunRecord.abort``).
        """
        starter = self._pool.start if self._pool is not None else STARTERS[self.start_method]
        sent = self._pool is not None or self.start_method != "fork"
        try:
            for spec in self.specs:
                with deferred_interrupts():
                    req = self._request(spec)
                    try:
                        proc = starter(req, self._parent_fds(req))
                    except BaseException:
                        req.close()
                        raise
                    self.procs.append(proc)
                    self._watch(proc)
                if sent:  # a fresh process (or one forked ahead): who it is, what to do
                    proc.stage = "receiving its task"
                    self.send(proc, Setup(spec))
                    if self._task is not None:  # a session's ranks get theirs later
                        self.send(proc, Task(self._task))
        except BaseException as exc:
            if on_abort is not None:
                on_abort(exc)
            self.close()
            raise
        finally:
            if self._listen is not None:  # rank 0 has its own copy now
                self._listen.close()
                self._listen = None

    def send(self, proc: WorkerProcess, message: Any) -> bool:
        """Send ``message`` to a rank; False when it is gone (its exit tells the rest:
        a rank killed while it receives a large task is reported as the death it is)."""
        if not proc.conn_open:
            return False
        try:
            proc.channel.send(message)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._conn_closed(proc)
            return False
        return True

    # -- the fds the pump waits on ---------------------------------------------------------

    def _watch(self, proc: WorkerProcess) -> None:
        self._selector.register(proc.channel.fileno(), selectors.EVENT_READ, ("conn", proc))
        for stream, fd in proc.pipes.items():
            self._selector.register(fd, selectors.EVENT_READ, (stream, proc))
        self._selector.register(proc.pidfd, selectors.EVENT_READ, ("exit", proc))
        self._urgent.register(proc.pidfd, selectors.EVENT_READ, ("exit", proc))

    def _unwatch(self, fd: int) -> None:
        for selector in (self._selector, self._urgent):
            try:
                selector.unregister(fd)
            except (KeyError, ValueError, OSError):
                pass

    def _conn_closed(self, proc: WorkerProcess) -> None:
        if proc.conn_open:
            proc.conn_open = False
            self._unwatch(proc.channel.fileno())

    def _request(self, spec: WorkerSpec) -> StartRequest:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds: list[int] = []
        try:
            for _ in range(2):
                fds += os.pipe()
            for fd in (fds[0], fds[2]):
                os.set_blocking(fd, False)
        except BaseException:
            parent_sock.close()
            child_sock.close()
            close_quietly(*fds)
            raise
        out_r, out_w, err_r, err_w = fds
        listen_fd = self._listen.fileno() if self._listen is not None and spec.rank == 0 else None
        return StartRequest(
            spec=spec,
            task=self._task,
            listen_fd=listen_fd,
            child_conn=child_sock,
            parent_conn=Connection(parent_sock.detach()),
            out_r=out_r,
            out_w=out_w,
            err_r=err_r,
            err_w=err_w,
        )

    def _parent_fds(self, req: StartRequest) -> list[int]:
        """Fds a forked child must close: the parent's ends, its siblings', the listener."""
        fds = [req.parent_conn.fileno(), req.out_r, req.err_r]
        fds += [self._selector.fileno(), self._urgent.fileno()]
        for p in self.procs:
            fds += [p.channel.fileno(), p.pidfd, *p.pipes.values()]
        if self._listen is not None and req.listen_fd is None:
            fds.append(self._listen.fileno())
        server_fd = forkserver.fileno_if_running()
        if server_fd is not None:
            fds.append(server_fd)  # so the server sees EOF when the kernel dies
        return fds

    # -- pump --------------------------------------------------------------------------

    @property
    def running(self) -> list[WorkerProcess]:
        return [p for p in self.procs if not p.exited]

    @property
    def finished(self) -> bool:
        return all(p.exited for p in self.procs)

    def pump(self, timeout: float | None, wake: int | None = None) -> None:
        """Wait up to ``timeout`` for anything from any rank, and handle all that is ready.

        ``wake``: another fd to wait on (a pipe another thread writes to, to end the wait);
        it is not read here."""
        if self._kill_at is not None:
            now = time.monotonic()
            if now >= self._kill_at:
                self.kill()
                self._kill_at = None
            else:
                timeout = (
                    self._kill_at - now if timeout is None else min(timeout, self._kill_at - now)
                )
        if wake is not None and wake != self._wake:
            if self._wake is not None:
                self._unwatch(self._wake)
            self._selector.register(wake, selectors.EVENT_READ, ("wake", None))
            self._urgent.register(wake, selectors.EVENT_READ, ("wake", None))
            self._wake = wake
        if not self._selector.get_map():
            return
        paced, timeout = self._pace(timeout)  # (chatty ranks: waited on exits alone)
        ready = self._ready(timeout)
        if not paced and ready and all(kind in ("stdout", "stderr") for kind, _ in ready):
            time.sleep(OUTPUT_BATCH_S)  # more lines are on their way: take them together
            ready = self._ready(0)
        self._answered = False
        for kind, proc in ready:
            if kind == "conn":
                self._read_conn(proc)
            elif kind in ("stdout", "stderr"):
                self._read_output(proc, kind)
        for kind, proc in ready:  # exits last: a rank's final messages were read above
            if kind == "exit" and not proc.exited:
                proc.reap(report_timeout=2.0)  # its pidfd is readable: it has ended
                self._unwatch(proc.pidfd)
                self._drain(proc)
                self._on_exit(proc)
        self._keep_pace(ready, paced)

    def _pace(self, timeout: float | None) -> tuple[bool, float | None]:
        """While paced (see PACE_S): wait on exits and the wake fd alone until the pace
        ends (or ``timeout``); then whether it did, and what is left of ``timeout`` for the
        look that follows (at once when it was waited out)."""
        start = time.monotonic()
        if self._paced_until <= start:
            return False, timeout
        pause = self._paced_until - start
        if timeout is not None and timeout < pause:
            pause = timeout
        self._urgent.select(pause)
        if timeout is None:
            return True, None
        return True, max(0.0, timeout - (time.monotonic() - start))

    def _keep_pace(self, ready: list[tuple[str, WorkerProcess]], paced: bool) -> None:
        """Pace the next looks when this look brought only output and plain events, and
        either it was paced or PACE_AFTER such looks came within PACE_WITHIN; an exit or an
        answer ends the pace."""
        if not ready:
            return
        now = time.monotonic()
        looks = self._plain_looks
        if self._answered or any(kind == "exit" for kind, _ in ready):
            self._paced_until = float("-inf")
            looks.clear()
            return
        looks.append(now)
        if paced or (len(looks) == PACE_AFTER and now - looks[0] < PACE_WITHIN):
            self._paced_until = now + PACE_S

    def _ready(self, timeout: float | None) -> list[tuple[str, WorkerProcess]]:
        return [key.data for key, _ in self._selector.select(timeout) if key.data[0] != "wake"]

    def _read_conn(self, proc: WorkerProcess) -> None:
        """Take every message waiting on the rank's channel (not just one per wake-up)."""
        while proc.conn_open:
            try:
                msg = proc.channel.recv()
            except (EOFError, OSError):
                self._conn_closed(proc)
                return
            self._handle(proc, msg)
            try:
                if not proc.channel.poll(0):
                    return
            except (EOFError, OSError):
                self._conn_closed(proc)
                return

    def _handle(self, proc: WorkerProcess, msg: Any) -> None:
        if isinstance(msg, WorkerStarted):
            proc.stage = "running"
        elif isinstance(msg, WorkerPhase):  # "it died while importing torch"
            proc.stage = PHASES.get(msg.phase, msg.phase)
        if isinstance(msg, (Returned, Raised)):
            self._take_output(proc)
        if isinstance(msg, (Returned, Raised, Reformed)):
            self._answered = True
            if self._on_message is not None:
                self._on_message(proc, msg)
            elif isinstance(msg, Returned):
                proc.result = msg.data
            elif isinstance(msg, Raised):
                proc.failure, proc.exc_data = msg.failure, msg.exc_data
        else:
            self._on_event(msg)

    def _read_output(self, proc: WorkerProcess, stream: str) -> None:
        """Read what is there and pass it on: whole lines; a line ended by ``\r`` (a
        progress display redrawn in place) as soon as it is complete, so it shows live;
        and an endless line in pieces of :data:`MAX_PARTIAL_CHARS` (linear cost, bounded
        memory)."""
        fd = proc.pipes.get(stream)
        if fd is None:
            return
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            proc.partial[stream] += proc.decoders[stream].decode(b"", final=True)
            self._flush_partial(proc, stream)
            fd = proc.pipes.pop(stream)
            self._unwatch(fd)
            os.close(fd)
            return
        text = proc.partial[stream] + proc.decoders[stream].decode(chunk)
        now = time.time()
        cut = text.rfind("\n") + 1
        if cut:
            for line in text[:cut].splitlines(keepends=True):
                self._on_event(Output(proc.rank, stream, line, now))
            text = text[cut:]
        cr = text.rfind("\r") + 1
        if cr:
            self._on_event(Output(proc.rank, stream, text[:cr], now))
            text = text[cr:]
        while len(text) >= MAX_PARTIAL_CHARS:
            self._on_event(Output(proc.rank, stream, text[:MAX_PARTIAL_CHARS], now))
            text = text[MAX_PARTIAL_CHARS:]
        proc.partial[stream] = text

    def _flush_partial(self, proc: WorkerProcess, stream: str) -> None:
        tail = proc.partial[stream]
        if tail:
            proc.partial[stream] = ""
            self._on_event(Output(proc.rank, stream, tail, time.time()))

    def _take_output(self, proc: WorkerProcess) -> None:
        """Before a rank's answer: what it printed first. It flushed its streams before it
        sent the answer, so that output waits in the pipes: pass it on now (whole, the last
        unterminated line included), not after the caller already has the answer."""
        for stream in list(proc.pipes):
            for _ in range(64):  # bounded: a grandchild may keep writing to the pipe
                if stream not in proc.pipes or not wait([proc.pipes[stream]], 0):
                    break
                self._read_output(proc, stream)
            if stream in proc.pipes:
                self._flush_partial(proc, stream)

    def _drain(self, proc: WorkerProcess) -> None:
        """After a rank exited: take everything still buffered in its channels."""
        while proc.conn_open and proc.channel.poll(0):
            self._read_conn(proc)
        for stream in list(proc.pipes):
            while stream in proc.pipes:
                if not wait([proc.pipes[stream]], 0):
                    # A grandchild may still hold the pipe: keep what we have, stop here.
                    self._flush_partial(proc, stream)
                    break
                self._read_output(proc, stream)

    # -- stop --------------------------------------------------------------------------

    def terminate(self) -> None:
        """SIGTERM every running rank now; ``pump`` sends SIGKILL after ``grace``."""
        for p in self.running:
            p.send_signal(signal.SIGTERM)
        if self._kill_at is None:
            self._kill_at = time.monotonic() + self.grace

    def kill(self) -> None:
        for p in self.running:
            p.send_signal(signal.SIGKILL)

    def proc(self, rank: int) -> WorkerProcess:
        for p in self.procs:
            if p.rank == rank:
                return p
        raise KeyError(rank)

    def stop(self) -> None:
        """Staged stop, blocking until every rank is gone (a second Ctrl-C kills at once)."""
        try:
            self.terminate()
            deadline = time.monotonic() + self.grace + 5.0
            while not self.finished and time.monotonic() < deadline:
                self.pump(0.05)
        finally:
            self.close()

    def close(self) -> None:
        """Kill anything still running, reap it, and release every fd. Idempotent, and
        not stopped half way by Ctrl-C (which is delivered once it is done)."""
        if self._closed:
            return
        with deferred_interrupts():
            self._close()

    def _close(self) -> None:
        self._closed = True
        if self._listen is not None:
            self._listen.close()
            self._listen = None
        for p in self.procs:
            if not p.exited:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            if not p.exited:
                p.reap(report_timeout=5.0)
                self._drain(p)
                self._on_exit(p)
            close_quietly(*p.pipes.values(), p.pidfd)
            p.pipes.clear()
            p.channel.close()
            p.conn_open = False
        self._selector.close()  # forgets every registration with its epoll fd
        self._urgent.close()
