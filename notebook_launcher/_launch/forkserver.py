"""The kernel's client of the forkserver: a process that imported torch once and forks
CUDA-safe ranks on request (~50 ms each instead of a fresh interpreter's ~1.5 s), and
the supervisors of detached runs (``detached``), warm for the same reason.

One server per kernel, started on the first launch that needs it and kept for the next
ones (like ``multiprocessing``'s forkserver). It talks to the kernel over a private
socketpair only (:mod:`notebook_launcher._wire.forkserver`), reports each child's exit code
(it is their parent), and dies with the kernel (parent-death signal).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import wait
from typing import Any

from .._posix import deferred_interrupts
from .._wire.forkserver import Exited, Fork, Forked, FrameReader, Ready, Supervise, send
from ..errors import LaunchError

#: Modules torch imports lazily, at a cost, in whichever process first needs them:
#: ``torch._dynamo`` (1.5-2.5 s) on the first construction of any ``torch.optim``
#: optimizer (``torch._disable_dynamo``) or ``torch.compile``. A rank forked by the kernel
#: inherits those the kernel imported; a forkserver rank would import each again, in every
#: rank of every launch. So once the kernel has one, the server imports it too (once, before
#: it forks the next rank). Not at the server's start: a kernel that never needed one does
#: not pay for it (nor does a rank that never builds an optimizer).
WARM = ("torch._dynamo",)


def warm_modules() -> tuple[str, ...]:
    """The modules of :data:`WARM` this kernel has imported."""
    return tuple(m for m in WARM if m in sys.modules)


def child_env() -> dict[str, str]:
    """Environment for a fresh interpreter of ours: the kernel's, able to import this
    package, without pytest's marker (a rank is not a test)."""
    env = dict(os.environ)
    env.pop("PYTEST_CURRENT_TEST", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])
    return env


class ForkServer:
    """The running server, seen from the kernel: ``fork(fds)`` a rank, learn exit codes."""

    #: the pid of a server whose start is under way (behind the kernel: :func:`start_behind`)
    starting: int | None = None

    def __init__(self, spare_ahead: int | None = None) -> None:
        """Start the server (about 1 s of imports); ``spare_ahead``: it forks a detached
        run's spare supervisor at once, with that many ranks ahead."""
        self._lock = threading.Lock()
        self._reader = FrameReader()
        self._exits: dict[int, int] = {}
        self._forked: list[int] = []
        #: the modules of WARM the server was asked to import
        self._warm: set[str] = set()
        self._ready = False
        self._dead = False
        with deferred_interrupts():  # the process and both socket ends, or none of them
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self._popen = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "notebook_launcher._worker.forkserver",
                        str(theirs.fileno()),
                        str(os.getpid()),
                        *([str(spare_ahead)] if spare_ahead is not None else []),
                    ],
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    env=child_env(),
                    cwd=os.getcwd(),
                )
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            self._sock = ours
        ForkServer.starting = self._popen.pid
        try:
            while not (self._ready or self._dead):  # ~1 s of imports: Ctrl-C may come
                self._read(None)
        except BaseException:
            self.close(kill=True)
            raise
        finally:
            ForkServer.starting = None
        if self._dead:
            self.close(kill=True)
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
        for msg in self._reader.feed(data):
            if isinstance(msg, Exited):
                self._exits[msg.pid] = msg.returncode
            elif isinstance(msg, Forked):
                self._forked.append(msg.pid)
            elif isinstance(msg, Ready):
                self._ready = True
        return True

    def fork(self, fds: list[int], has_listen: bool) -> int:
        """Start a rank with ``fds`` (control socket, stdout, stderr[, listener]); the
        server imports first the modules of :data:`WARM` this kernel has and it lacks."""
        preload = tuple(m for m in warm_modules() if m not in self._warm)
        self._warm.update(preload)
        return self._request(Fork(has_listen, preload), fds, "a worker")

    def supervise(self, run_dir: str, fds: list[int], has_listen: bool, forks: int = 0) -> None:
        """Fork the supervisor of the detached run in ``run_dir`` with ``fds`` (its
        handshake pipe's write end, its log[, the listener]; ``forks``: the ranks it forks);
        returns once it is forked (it is not the server's child: the kernel learns its pid
        from the handshake)."""
        message = Supervise(run_dir, has_listen, forks)
        self._request(message, fds, "a detached run's supervisor")

    def _request(self, message: Fork | Supervise, fds: list[int], what: str) -> int:
        with self._lock:
            send(self._sock, message, fds)
            while not self._forked:
                if self._dead:
                    raise LaunchError(f"the forkserver died while starting {what}")
                self._read(None)
            return self._forked.pop(0)

    def drain(self, timeout: float = 0.0) -> None:
        """Take any exit reports waiting on the socket (waits up to ``timeout``)."""
        with self._lock:
            while self._read(timeout):
                timeout = 0.0

    def wait_returncode(self, pid: int, timeout: float) -> int | None:
        """The exit code of rank ``pid`` once the server reports it; None if it does not
        within ``timeout`` (the server died, and its children with it)."""
        deadline = time.monotonic() + timeout
        while pid not in self._exits and not self._dead and time.monotonic() < deadline:
            self.drain(min(0.05, max(0.0, deadline - time.monotonic())))
        return self._exits.pop(pid, None)

    def close(self, kill: bool = False) -> None:
        """Stop the server: it leaves when its socket closes (``kill``: at once, for one
        that is still importing), and is reaped here (no zombie)."""
        with deferred_interrupts():
            self._dead = True
            if kill:
                self._popen.send_signal(signal.SIGKILL)
            self._sock.close()
            try:
                self._popen.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._popen.send_signal(signal.SIGKILL)
                self._popen.wait()


_server: ForkServer | None = None
_server_lock = threading.Lock()


def get(spare_ahead: int | None = None) -> ForkServer:
    """The kernel's forkserver, started (about 1 s) if it is not running (``spare_ahead``:
    see :class:`ForkServer`)."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            _server = ForkServer(spare_ahead)
            atexit.register(shutdown)
        return _server


def running() -> ForkServer | None:
    """The kernel's forkserver if it is up, without starting it."""
    server = _server
    return server if server is not None and server.alive() else None


#: Seconds :func:`start_behind` waits at most for its ``after`` to say go.
BEHIND_WAIT = 10.0


#: A start behind (:func:`start_behind`) that has not started the server yet ("pending"),
#: the spare size the latest caller asked for, and the :func:`shutdown` calls so far (one
#: since it was asked cancels it).
_behind: dict[str, Any] = {"pending": 0, "ahead": None, "shutdowns": 0}


def start_behind(spare_ahead: int | None = None, after: Any = None) -> None:
    """Start the forkserver in a thread of its own, for later launches and detached runs,
    unless it is up or about to start: the caller does not wait for its ~1 s of imports
    (``spare_ahead``: see :class:`ForkServer`; ``after``: a check the thread waits for, up
    to :data:`BEHIND_WAIT` s, before it starts the server). A :func:`shutdown` meanwhile
    (the kernel ending) cancels it."""
    with _server_lock:
        _behind["ahead"] = spare_ahead  # (the latest run's size, if one is pending)
        if running() is not None or _behind["pending"]:
            return
        _behind["pending"] += 1
        asked = _behind["shutdowns"]

    def start() -> None:
        global _server
        deadline = time.monotonic() + BEHIND_WAIT
        while after is not None and not after() and time.monotonic() < deadline:
            time.sleep(0.05)
        with _server_lock:
            _behind["pending"] -= 1
            if _behind["shutdowns"] != asked or running() is not None:
                return
            try:
                _server = ForkServer(_behind["ahead"])
                atexit.register(shutdown)
            except (LaunchError, OSError):  # the next caller that needs it says why
                pass

    threading.Thread(target=start, name="notebook-launcher-forkserver", daemon=True).start()


def fileno_if_running() -> int | None:
    """The socket a forked rank must close (so the server sees EOF when the kernel dies)."""
    server = _server
    return server.fileno() if server is not None and not server._dead else None


def pid() -> int | None:
    """The server's pid: the running one's, or the one's being started behind."""
    server = _server
    return server.pid if server is not None and server.alive() else ForkServer.starting


def shutdown() -> None:
    """Stop the forkserver (it starts again on the next CUDA-safe launch); a start behind
    that has not begun is cancelled."""
    global _server
    with _server_lock:
        _behind["shutdowns"] += 1
        if _server is not None:
            _server.close()
            _server = None


__all__ = [
    "WARM",
    "ForkServer",
    "child_env",
    "get",
    "pid",
    "running",
    "shutdown",
    "start_behind",
    "warm_modules",
]
