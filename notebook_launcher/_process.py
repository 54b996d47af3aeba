"""The worker group: start ranks, pump what they send, stop them in stages.

Who runs where, and what crosses which channel::

    kernel (parent)                                      worker (rank r)
    ---------------                                      ---------------
    WorkerGroup.start()  --fork / forkserver / spawn-->  _worker.run()
      control socketpair  <== ("event", Event) ========   _runtime.emit()
      (inherited fd,      <== ("result", bytes) =======   fn(*args) returned
       never a listener)  <== ("failed", RankFailure) =   fn(*args) raised
                          === spec, task (non-fork) ==>
      stdout pipe         <== raw bytes (fd 1) ========   print(), C++ logs
      stderr pipe         <== raw bytes (fd 2) ========   warnings, tracebacks
      pidfd (sentinel)    <-- readable when it exits
    WorkerGroup.pump()   waits on all of these at once (no timer polling), turns
                         bytes into rank-labelled Output lines, and hands every event
                         to the launcher.

This module knows nothing of torch or widgets; it imports only ``_events``,
``errors`` and ``_serialization``'s plain helpers. A group is one launch today; its
``start / pump / stop`` split is what a persistent group or a non-blocking handle
will drive later.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from ._events import Event, Output
from ._worker import WorkerSpec
from .errors import LaunchError, RankFailure

# --- one worker process -------------------------------------------------------------------


@dataclass
class WorkerProcess:
    rank: int
    pid: int
    conn: Connection
    #: "stdout"/"stderr" -> the parent's read end; removed at EOF
    pipes: dict[str, int]
    pidfd: int
    popen: subprocess.Popen[bytes] | None = None
    forkserver: ForkServer | None = None
    returncode: int | None = None
    result: bytes | None = None
    failure: RankFailure | None = None
    exc_data: bytes | None = None
    conn_open: bool = True
    partial: dict[str, bytes] = field(default_factory=lambda: {"stdout": b"", "stderr": b""})

    @property
    def exited(self) -> bool:
        return self.returncode is not None

    def reap(self, report_timeout: float) -> int:
        """The return code (``-signal`` when killed) of a process that has ended or is
        being killed. Whoever forked it reaps it: us, ``subprocess``, or the forkserver
        (which reports within ``report_timeout``; a missing report means it died, and
        its children with it: SIGKILL)."""
        if self.returncode is None:
            if self.popen is not None:
                self.returncode = self.popen.wait()
            elif self.forkserver is not None:
                code = self.forkserver.wait_returncode(self.pid, report_timeout)
                self.returncode = code if code is not None else -int(signal.SIGKILL)
            else:
                self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            return
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


def _quiet_fork() -> int:
    with warnings.catch_warnings():
        # Python 3.12+ warns about forking a multi-threaded process (Jupyter kernels
        # always are). We fork only before any CUDA or process group exists in the
        # parent, and the child touches none of the parent's threads' state.
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def start_fork(req: StartRequest, parent_fds: list[int]) -> WorkerProcess:
    from . import _worker

    parent = os.getpid()
    pid = _quiet_fork()
    if pid == 0:  # child
        for fd in parent_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        conn = Connection(req.child_conn.detach())
        _worker.run(conn, req.out_w, req.err_w, req.listen_fd, parent, spec=req.spec, task=req.task)
    return _finish_start(req, pid)


def start_spawn(req: StartRequest, parent_fds: list[int]) -> WorkerProcess:
    conn_fd = req.child_conn.fileno()
    fds = [conn_fd, req.out_w, req.err_w] + ([req.listen_fd] if req.listen_fd is not None else [])
    argv = [sys.executable, "-m", "notebook_launcher._spawn", *map(str, fds[:3])]
    argv.append(str(req.listen_fd) if req.listen_fd is not None else "-")
    argv.append(str(os.getpid()))
    popen = subprocess.Popen(
        argv,
        pass_fds=fds,
        stdin=subprocess.DEVNULL,
        stdout=req.out_w,
        stderr=req.err_w,
        env=child_env(),
        cwd=req.spec.cwd or None,
    )
    proc = _finish_start(req, popen.pid, popen=popen)
    _send_spec_and_task(proc, req)
    return proc


def start_forkserver(req: StartRequest, parent_fds: list[int]) -> WorkerProcess:
    server = get_forkserver()
    fds = [req.child_conn.fileno(), req.out_w, req.err_w]
    if req.listen_fd is not None:
        fds.append(req.listen_fd)
    pid = server.fork(fds, has_listen=req.listen_fd is not None)
    proc = _finish_start(req, pid, forkserver=server)
    _send_spec_and_task(proc, req)
    return proc


STARTERS: dict[str, Callable[[StartRequest, list[int]], WorkerProcess]] = {
    "fork": start_fork,
    "spawn": start_spawn,
    "forkserver": start_forkserver,
}


def child_env() -> dict[str, str]:
    """Environment for a fresh interpreter: ours, able to import this package."""
    env = dict(os.environ)
    env.pop("PYTEST_CURRENT_TEST", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


def _send_spec_and_task(proc: WorkerProcess, req: StartRequest) -> None:
    proc.conn.send_bytes(pickle.dumps(req.spec, protocol=pickle.HIGHEST_PROTOCOL))
    proc.conn.send_bytes(req.task)


def _finish_start(
    req: StartRequest,
    pid: int,
    popen: subprocess.Popen[bytes] | None = None,
    forkserver: ForkServer | None = None,
) -> WorkerProcess:
    """Parent side after the child exists: drop the child's ends, keep ours."""
    req.child_conn.close()
    os.close(req.out_w)
    os.close(req.err_w)
    return WorkerProcess(
        rank=req.spec.rank,
        pid=pid,
        conn=req.parent_conn,
        pipes={"stdout": req.out_r, "stderr": req.err_r},
        pidfd=os.pidfd_open(pid),
        popen=popen,
        forkserver=forkserver,
    )


# --- the forkserver -----------------------------------------------------------------------

_HDR = struct.Struct("!I")


def _send_msg(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
    data = pickle.dumps(obj)
    frame = _HDR.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], fds)
    else:
        sock.sendall(frame)


class ForkServer:
    """A process that imported torch once and forks workers on request (CUDA-safe).

    Talks to the kernel over an inherited socketpair only. It reports each child's
    exit code (it is their parent), and dies with the kernel.
    """

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._popen = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "notebook_launcher._forkserver",
                str(theirs.fileno()),
                str(os.getpid()),
            ],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=child_env(),
            cwd=os.getcwd(),
        )
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self._forked: list[int] = []
        self._ready = False
        self._dead = False
        self._buf = b""
        while not (self._ready or self._dead):
            self._read(None)
        if self._dead:
            raise LaunchError(
                "the forkserver failed to start (see the kernel's log for its error); "
                "start_method='spawn' does not need it"
            )

    @property
    def pid(self) -> int:
        return self._popen.pid

    def fileno(self) -> int:
        return self._sock.fileno()

    def alive(self) -> bool:
        return not self._dead and self._popen.poll() is None

    def _read(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` (None: forever) for data; take every complete message.

        One read may bring several messages (two ranks exiting together): all are kept.
        """
        if self._dead or (timeout is not None and not wait([self._sock], timeout)):
            return False
        try:
            data = self._sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._dead = True  # it died: its children died with it (parent-death signal)
            return False
        self._buf += data
        while len(self._buf) >= _HDR.size:
            (size,) = _HDR.unpack_from(self._buf)
            if len(self._buf) < _HDR.size + size:
                break
            msg = pickle.loads(self._buf[_HDR.size : _HDR.size + size])
            self._buf = self._buf[_HDR.size + size :]
            if msg[0] == "exited":
                self._exits[int(msg[1])] = int(msg[2])
            elif msg[0] == "forked":
                self._forked.append(int(msg[1]))
            elif msg[0] == "ready":
                self._ready = True
        return True

    def fork(self, fds: list[int], has_listen: bool) -> int:
        with self._lock:
            _send_msg(self._sock, ("fork", has_listen), fds)
            while not self._forked:
                if self._dead:
                    raise LaunchError("the forkserver died while starting a worker")
                self._read(None)
            return self._forked.pop(0)

    def drain(self, timeout: float = 0.0) -> None:
        """Take any exit reports waiting on the socket (waits up to ``timeout``)."""
        with self._lock:
            while self._read(timeout):
                timeout = 0.0

    def wait_returncode(self, pid: int, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while pid not in self._exits and not self._dead and time.monotonic() < deadline:
            self.drain(min(0.05, max(0.0, deadline - time.monotonic())))
        return self._exits.pop(pid, None)

    def close(self) -> None:
        try:
            self._sock.close()
        finally:
            try:
                self._popen.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.wait()


_forkserver: ForkServer | None = None
_forkserver_lock = threading.Lock()


def get_forkserver() -> ForkServer:
    global _forkserver
    with _forkserver_lock:
        if _forkserver is None or not _forkserver.alive():
            _forkserver = ForkServer()
            atexit.register(shutdown_forkserver)
        return _forkserver


def forkserver_pid() -> int | None:
    server = _forkserver
    return server.pid if server is not None and server.alive() else None


def shutdown_forkserver() -> None:
    """Stop the forkserver (it starts again on the next CUDA-safe launch)."""
    global _forkserver
    with _forkserver_lock:
        if _forkserver is not None:
            _forkserver.close()
            _forkserver = None


# --- the group ----------------------------------------------------------------------------

Message = tuple[Any, ...]


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
    ) -> None:
        self.specs = specs
        self.start_method = start_method
        self._task = task
        self._listen = listen_sock
        self._on_event = on_event
        self._on_exit = on_exit
        self.grace = grace
        self.procs: list[WorkerProcess] = []
        self._kill_at: float | None = None
        self._closed = False

    # -- start -------------------------------------------------------------------------

    def start(self) -> None:
        starter = STARTERS[self.start_method]
        try:
            for spec in self.specs:
                req = self._request(spec)
                self.procs.append(starter(req, self._parent_fds(req)))
        except BaseException:
            self.close()
            raise
        finally:
            if self._listen is not None:  # rank 0 has its own copy now
                self._listen.close()
                self._listen = None

    def _request(self, spec: WorkerSpec) -> StartRequest:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
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
        for p in self.procs:
            fds += [p.conn.fileno(), p.pidfd, *p.pipes.values()]
        if self._listen is not None and req.listen_fd is None:
            fds.append(self._listen.fileno())
        if _forkserver is not None and not _forkserver._dead:
            fds.append(_forkserver.fileno())  # so the server sees EOF when the kernel dies
        return fds

    # -- pump --------------------------------------------------------------------------

    @property
    def running(self) -> list[WorkerProcess]:
        return [p for p in self.procs if not p.exited]

    @property
    def finished(self) -> bool:
        return all(p.exited for p in self.procs)

    def pump(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` for anything from any rank, and handle all that is ready."""
        if self._kill_at is not None:
            now = time.monotonic()
            if now >= self._kill_at:
                self.kill()
                self._kill_at = None
            else:
                timeout = (
                    self._kill_at - now if timeout is None else min(timeout, self._kill_at - now)
                )
        waitables: dict[Any, tuple[str, WorkerProcess]] = {}
        for p in self.procs:
            if p.conn_open:
                waitables[p.conn] = ("conn", p)
            for stream, fd in p.pipes.items():
                waitables[fd] = (stream, p)
            if not p.exited:
                waitables[p.pidfd] = ("exit", p)
        if not waitables:
            return
        ready = wait(list(waitables), timeout)
        for obj in ready:
            kind, proc = waitables[obj]
            if kind == "conn":
                self._read_conn(proc)
            elif kind == "exit":
                continue
            else:
                self._read_output(proc, kind)
        for obj in ready:  # exits last: a rank's final messages were read above
            kind, proc = waitables[obj]
            if kind == "exit" and not proc.exited:
                proc.reap(report_timeout=2.0)  # its pidfd is readable: it has ended
                self._drain(proc)
                self._on_exit(proc)

    def _read_conn(self, proc: WorkerProcess) -> None:
        try:
            data = proc.conn.recv_bytes()
        except (EOFError, OSError):
            proc.conn_open = False
            return
        self._handle(proc, pickle.loads(data))

    def _handle(self, proc: WorkerProcess, msg: Message) -> None:
        kind = msg[0]
        if kind == "event":
            self._on_event(msg[1])
        elif kind == "result":
            proc.result = msg[1]
        elif kind == "failed":
            proc.failure, proc.exc_data = msg[1], msg[2]

    def _read_output(self, proc: WorkerProcess, stream: str) -> None:
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
            self._flush_partial(proc, stream)
            os.close(proc.pipes.pop(stream))
            return
        data = proc.partial[stream] + chunk
        cut = data.rfind(b"\n") + 1
        proc.partial[stream] = data[cut:]
        if cut:
            now = time.time()
            for line in data[:cut].decode("utf-8", "replace").splitlines(keepends=True):
                self._on_event(Output(proc.rank, stream, line, now))

    def _flush_partial(self, proc: WorkerProcess, stream: str) -> None:
        tail = proc.partial[stream]
        if tail:
            proc.partial[stream] = b""
            self._on_event(Output(proc.rank, stream, tail.decode("utf-8", "replace"), time.time()))

    def _drain(self, proc: WorkerProcess) -> None:
        """After a rank exited: take everything still buffered in its channels."""
        while proc.conn_open and proc.conn.poll(0):
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
        """Kill anything still running, reap it, and release every fd. Idempotent."""
        if self._closed:
            return
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
            for fd in (*p.pipes.values(), p.pidfd):
                try:
                    os.close(fd)
                except OSError:
                    pass
            p.pipes.clear()
            p.conn.close()
            p.conn_open = False
