"""Sessions that outlive the kernel: ``start(..., detach=True)``, ``attach(id)``.

The ranks and their namespaces live in a real :class:`~notebook_launcher.session.Session`
(the ordinary ``start()``, which the supervisor is given: ``serve``) inside a supervisor
process that is not the kernel's child (``_supervise``, as a detached launch's); the kernel
holds a :class:`DetachedSession` (a :class:`~notebook_launcher._sessions.SessionBase`, as
``Session`` is) whose calls go to the supervisor over a Unix socket in the run's private
record (``_launch.detach``). The messages and their framing are ``_wire.supervisor``'s;
this module is the socket's client and its server::

    kernel (any of the same user)                  supervisor (parent: init)
    -----------------------------                  -------------------------
    start(detach=True)
      record: meta (kind "session"), secret
      Handover().start() -> its pid  ---------->   binds session.sock (0600, in the 0700 dir)
    each call: connect, then two frames:           admits a peer of its own uid (SO_PEERCRED)
      the run's secret, a request  ----------->    that sent the secret (hmac.compare_digest)
                                                   the main thread runs a Start, Call or Stop
                                                   on the Session (it forked the ranks: they
                                                   die with it); Interrupt and Ask run at
      the cell's view  <--- its events ...         once, beside a task
                       <--- Reply(ok, value or the exception as data, what it printed)
      Ctrl-C: Interrupt() on it  -------------->   that task is interrupted as Ctrl-C does
      stop(): Stop(CLOSE)  -------------------->   the ranks leave; the record is removed

Every event is appended to the record's ``events.log`` as well, and sent to the connection
whose call runs: a kernel that dies mid-cell loses neither the session nor the cell's
output, however it ends (a kernel shut down or restarted politely is interrupted first by
jupyter_client: that Ctrl-C is not sent on, see ``_kernel_ending``). The supervisor keeps the events of a task whose kernel went away; the next
``attach`` (its ``Follow``) shows them, then follows that task live to its end, and
says how it ended. The ranks die with the supervisor (their parent-death signal); a
supervisor that died is said on the next call or attach.

Example::

    session = notebook_launcher.start(num_processes=2, detach=True)   # prints its id
    session.run_cell("model = load()")
    # ... the kernel restarts ...
    session = notebook_launcher.attach("3fa9c1")
    session.run_cell("model.config")
    session.stop()            # the ranks leave; the record goes
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import io
import os
import pickle
import queue
import secrets
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ._events import FollowingStopped, LaunchStarted
from ._launch import detach as record
from ._launch.detach import Meta
from ._launch.handover import Handover, abandon
from ._launch.session import TaskHandle
from ._posix import deferred_interrupts
from ._serialization import dump_exception, dumps, dumps_checked, loads, rebuild_exception
from ._sessions import SessionBase, SessionStatus, let_go, make_current
from ._wire import supervisor as wire
from ._wire.supervisor import (
    Ask,
    Call,
    Ended,
    Follow,
    HandedOver,
    Interrupt,
    Missed,
    Question,
    Refused,
    Reply,
    Start,
    Stop,
    StopKind,
)
from .errors import LaunchError, interrupted
from .ui import View
from .ui.stall import Stacks

#: The socket and the secret in the run's record.
SOCKET, SECRET = "session.sock", "secret"
#: Seconds a new supervisor may take to listen, and to be asked to start its ranks.
START_TIMEOUT = 60.0
#: How often a waiting call ticks the cell's view (its clock, the quick-task delay).
TICK = 0.5
#: Seconds the supervisor waits for a slow kernel to take an event before giving up on it.
SEND_TIMEOUT = 10.0
#: Events of one task the supervisor keeps for a kernel that attaches after the task's own
#: kernel went away (its newest; ``events.log`` keeps them all).
KEPT_EVENTS = 100_000
#: Tasks whose kernel went away that the supervisor keeps for the next attach to show.
KEPT_TASKS = 10

#: Seconds a Ctrl-C in a session's cell waits, in a Jupyter kernel, for the kernel's
#: shutdown that may follow it (``_kernel_ending``): the task is interrupted after that.
SHUTDOWN_WINDOW = 0.5


class SessionRefused(LaunchError, PermissionError):
    """The supervisor refused a connection: not its user, or not the run's secret."""


def _kernel_ending(window: float = SHUTDOWN_WINDOW) -> bool:
    """Whether the Ctrl-C just caught opens this Jupyter kernel's end rather than comes
    from the user: jupyter_client's shutdown and restart (JupyterLab's Kernel -> Restart,
    Shut Down, closing the notebook) interrupt the kernel first, then send it a
    ``shutdown_request``, which ipykernel's control thread answers by setting the shell's
    ``exit_now`` while this (the main) thread still waits. Watched for ``window`` seconds;
    False at once outside an ipykernel, and on a second Ctrl-C meanwhile (the user's)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    deadline = time.monotonic() + window
    try:
        while not getattr(shell, "exit_now", False):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
    except KeyboardInterrupt:  # pressed again: the user's, and meant
        return False
    return True


def _peer(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of ``sock`` (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


def _peer_gone(sock: socket.socket) -> bool:
    """The other end of ``sock`` closed it (a kernel that waits sends nothing more)."""
    try:
        ready, _, _ = select.select([sock], [], [], 0)
        return bool(ready) and sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except OSError:
        return True


@contextlib.contextmanager
def _bindable(path: str) -> Any:
    """An address for the socket at ``path`` that fits a ``sockaddr_un``: the path itself,
    or, when it is too long, the same file through an fd of its directory."""
    if len(os.fsencode(path)) < 100:
        yield path
        return
    fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{os.path.basename(path)}"
    finally:
        os.close(fd)


# --- the supervisor's side ---------------------------------------------------------------


class _Job:
    """One call the supervisor's main thread runs (a start, a task, a stop), and its reply."""

    def __init__(self, message: Start | Call | Stop, conn: socket.socket) -> None:
        self.message, self.conn = message, conn
        #: a task on the ranks (what an interrupt interrupts, a missed task is)
        self.task = isinstance(message, Call)
        #: the process of the kernel that made the call
        self.caller = _peer(conn)[0]
        self.label = message.label if isinstance(message, Call) else type(message).__name__
        self.reply: Reply | None = None
        #: its kernel asked to interrupt it
        self.interrupted = False
        self.done = threading.Event()
        self.replied = threading.Event()
        #: its events, for a kernel that attaches after its own went away
        self.events: deque[Any] = deque(maxlen=KEPT_EVENTS)

    def summary(self) -> str:
        """How it ended, in a few lines."""
        if self.reply is not None and self.reply.ok and self.reply.data is not None:
            try:
                value = repr(loads(self.reply.data))
            except Exception as exc:  # noqa: BLE001 - a summary only
                value = f"(values that cannot be loaded here: {exc!r})"
            return f"returned {value if len(value) <= 300 else value[:300] + '...'}"
        text = self.reply.summary if self.reply is not None else "failed"
        lines = text.splitlines()
        return "raised " + "\n".join(lines[:20]) + ("\n..." if len(lines) > 20 else "")


class _Server:
    """Serves one session from the supervisor (``serve``)."""

    def __init__(
        self, run_dir: str, meta: Meta, start: Callable[..., SessionBase] | None = None
    ) -> None:
        self.run_dir, self.meta = run_dir, meta
        #: ``session.start``: how the ranks start (the supervisor's, given to ``serve``)
        self.start = start
        self.secret = record.read_private(run_dir, SECRET)
        self.session: Any = None  # (a notebook_launcher.session.Session, once started)
        #: the session's cluster, started here (its job is this supervisor's)
        self.cluster: Any = None
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.finished = False
        self.lock = threading.Lock()
        self.sink: socket.socket | None = None  # the connection whose call runs
        self.current: _Job | None = None  # the call that runs
        #: calls that ended while their kernel was gone (the next attach shows them)
        self.missed: list[_Job] = []
        #: calls that ended and are not replied to yet (a kernel that attaches now waits
        #: for them: each is then replied, or missed)
        self.unreplied: list[_Job] = []
        self.writer = record.EventWriter(run_dir)
        #: why the log stopped being written (a full disk), once it did
        self.unrecorded = ""
        #: why the session ends while a task may run (said to that task's kernel)
        self.ending = ""

    # events: to the log, and to the kernel whose call runs

    def handle(self, event: Any) -> None:
        with self.lock:  # (the main thread starts the ranks; the pump runs the tasks)
            if not self.unrecorded:
                try:
                    self.writer.write(event)
                except record.RecordFull as exc:  # the log stops; the calls go on
                    self.unrecorded = str(exc)
                    with contextlib.suppress(OSError):
                        print(f"supervisor: recording stopped: {exc}", file=sys.stderr)
            if self.current is not None:
                self.current.events.append(event)
            if self.sink is None:
                return
            try:
                wire.send(self.sink, event)  # (bare: the hot path)
            except OSError:  # that kernel is gone (or stuck): the call goes on without it
                self.sink = None

    def tick(self) -> None:
        pass

    def close(self) -> None:
        pass

    # connections

    def accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self.serve_connection, args=(conn,), daemon=True).start()

    def admit(self, conn: socket.socket) -> str | None:
        """Why ``conn`` is refused (None: admitted): its peer must be of this uid and send
        the run's secret first."""
        pid, uid = _peer(conn)
        if uid != os.getuid():
            return (
                f"process {pid} of uid {uid} may not use session {self.meta.id} of uid "
                f"{os.getuid()}: a session is its user's alone"
            )
        offered = wire.recv_secret(conn)
        if not hmac.compare_digest(offered, self.secret):
            return (
                f"the secret offered is not session {self.meta.id}'s (attach reads it from "
                f"{os.path.join(self.run_dir, SECRET)})"
            )
        return None

    def serve_connection(self, conn: socket.socket) -> None:
        job: _Job | None = None
        try:
            conn.settimeout(SEND_TIMEOUT)
            why = self.admit(conn)
            if why is not None:
                wire.send(conn, Refused(why))
                _hang_up(conn)
                return
            match wire.recv(conn):
                case Follow():
                    self.follow(conn)
                case Interrupt() | Ask() as beside:  # they only look, or interrupt: never
                    wire.send(conn, self.call(beside))  # queued behind a task
                case Start() | Call() | Stop() as message:
                    if message == Stop(StopKind.CLOSE):  # a task that runs (another
                        self.ending = self._stopped_by(_peer(conn)[0])  # kernel's) ends first
                        self.call(Interrupt())
                    job = _Job(message, conn)
                    self.jobs.put(job)
                    self.watch(job, conn)
                    assert job.reply is not None
                    self.reply(job, conn, job.reply)
                case other:
                    raise ValueError(f"not a request of {wire.__name__}: {other!r}")
        except (OSError, EOFError, ValueError, pickle.UnpicklingError):
            pass  # that kernel went away (or spoke nonsense): the session is unharmed
        finally:
            if job is not None:
                with self.lock:
                    if job in self.unreplied:
                        self.unreplied.remove(job)
                job.replied.set()
            conn.close()

    def watch(self, job: _Job, conn: socket.socket) -> None:
        """Wait for ``job``'s end, taking its kernel's interrupts (frames on the call's own
        connection: one cannot overtake the call it interrupts)."""
        while not job.done.wait(0.05):
            ready, _, _ = select.select([conn], [], [], 0)
            if not ready:
                continue
            try:
                frame = wire.recv(conn)
            except (OSError, EOFError, ValueError, pickle.UnpicklingError):
                job.done.wait()  # that kernel is gone: the call goes on without it
                return
            if isinstance(frame, Interrupt):
                self.interrupt(job)

    def reply(self, job: _Job, conn: socket.socket, reply: Reply | Ended) -> None:
        """Send ``job``'s end on ``conn`` if that is still the kernel that waits for it;
        keep it for the next attach if that kernel is gone."""
        with self.lock:
            if job.conn is not conn:  # another kernel took it over (``follow``)
                return
        try:
            wire.send(conn, reply)
        except OSError:
            if job.task:
                with self.lock:
                    self.missed = [*self.missed, job][-KEPT_TASKS:]
            raise

    def follow(self, conn: socket.socket) -> None:
        """A kernel that attaches: the tasks that ended while no kernel was there (their
        events, how they ended), then the task that runs now if its kernel went away: its
        events so far, then live, then its end. A task that has ended but whose kernel is
        not told yet is waited for first: told, or missed -- never neither (an attach
        then showed none of a cell its dead kernel ran)."""
        waited: list[_Job] = []
        while True:
            with self.lock:
                ending = [j for j in self.unreplied if j not in waited]
            if not ending:
                break
            for told in ending:  # (its reply goes out, or fails: missed, just below)
                told.replied.wait(SEND_TIMEOUT)
            waited += ending
        with self.lock:
            missed, self.missed = self.missed, []
            job = self.current
            if self.sink is not None and _peer_gone(self.sink):
                self.sink = None  # its kernel died while the task printed nothing
            adopt = job is not None and job.task and self.sink is None
            try:
                for old in missed:
                    wire.send(conn, Missed(old.label, tuple(old.events), old.summary()))
                if job is not None and adopt:
                    for event in job.events:
                        wire.send(conn, event)
                    self.sink = job.conn = conn
            except OSError:
                self.missed = missed + self.missed
                raise
        if job is None or not adopt:
            wire.send(conn, Ended())
            return
        job.done.wait()
        self.reply(job, conn, Ended(job.label, job.summary()))

    # calls

    def call(self, message: Any) -> Reply:
        """Run one call; its reply: its value or its exception, and what it printed (a
        restart says what was lost)."""
        out, err = io.StringIO(), io.StringIO()
        try:
            if threading.current_thread() is threading.main_thread():
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    value = self.dispatch(message)
            else:
                value = self.dispatch(message)
            try:
                reply = Reply(True, dumps(value))
            except Exception as exc:  # noqa: BLE001 - said to the kernel
                raise LaunchError(
                    f"the ranks' values could not be pickled for the kernel "
                    f"({type(exc).__name__}: {exc}): return plain data"
                ) from None
        except BaseException as exc:  # noqa: BLE001 - the kernel raises it
            if self.ending and isinstance(exc, KeyboardInterrupt):
                exc = interrupted(self.ending)  # not "interrupted": why
            tb = exc.__traceback__
            exc.__traceback__ = tb.tb_next if tb is not None else None  # not this frame
            reply = Reply(False, dump_exception(exc), f"{type(exc).__name__}: {exc}")
        return dataclasses.replace(reply, out=out.getvalue(), err=err.getvalue())

    def dispatch(self, message: Any) -> Any:
        __tracebackhide__ = True  # the kernel shows the rank's frames, not the server's
        if isinstance(message, Start):
            assert self.start is not None, "serve() gives the server session.start"
            options = loads(message.options)
            self.cluster = options.get("cluster")  # (ended with the session: serve())
            self.session = self.start(dashboard=self, **options)
            self.meta.ranks = self.session.world_size
            if self.cluster is not None:
                self.meta.cluster = self.cluster.describe()
            record.write_meta(self.run_dir, self.meta)
            return self.session.status()
        session = self.session
        if session is None:
            raise LaunchError(f"session {self.meta.id} has not started its ranks")
        match message:
            case Call(data, label, ranks):
                return session._run_pickled(data, label, ranks)
            case Stop(StopKind.CLOSE):
                self.finished = True
                session.close()
            case Stop(StopKind.RESTART):
                session.restart()
            case Interrupt():  # (session.interrupt(): whatever runs now)
                job = self.current
                if job is not None:
                    self.interrupt(job)
            case Ask(Question.STACKS):
                return session.stacks()
            case Ask(Question.STATUS):
                return session.status()
            case Ask(Question.RANKS):
                return session.ranks
            case _:
                raise LaunchError(f"a detached session has no call {message!r}")
        return None

    def _stopped_by(self, pid: int) -> str:
        """What a task that runs is told when process ``pid`` stops the session."""
        job = self.current
        if job is not None and job.caller == pid:
            who = "this kernel (stop())"
        else:
            who = f"another kernel (process {pid}: its stop() or %dist stop)"
        return (
            f"session {self.meta.id} was stopped by {who} while this task ran: its ranks "
            "left and their variables are gone"
        )

    def end(self, why: str) -> None:
        """End the session from a thread of its own (its record removed): the task that
        runs is interrupted and told ``why``; the main loop then ends, and with it the
        session (``serve``: its ranks leave)."""
        self.ending = why
        self.finished = True
        self.call(Interrupt())

    def interrupt(self, job: _Job) -> None:
        """Interrupt ``job``'s task: at once if it runs on the ranks; a job still queued
        here never runs; one on its way to the ranks is interrupted there (an interrupt
        is never lost, nor given to another call's task)."""
        job.interrupted = True
        if not job.task:
            return  # not a task (a start, a restart): it ends as it does
        while not job.done.is_set():
            with self.lock:
                running = self.current is job
            core = self.session._core if self.session is not None else None
            if running and core is not None and core.task is not None:
                core.interrupt()  # (the session's own: any number, from any thread)
                return
            time.sleep(0.01)

    def main_loop(self) -> None:
        """Run the calls in this (the main) thread, until the session is closed (or none
        asked it to start in time)."""
        deadline = time.monotonic() + START_TIMEOUT
        while not self.finished:
            try:
                job = self.jobs.get(timeout=1.0)
            except queue.Empty:
                if self.session is None and time.monotonic() > deadline:
                    return  # the kernel that made it went away before it started
                continue
            except KeyboardInterrupt:  # a SIGINT between calls: nothing to interrupt
                continue
            try:
                self.run_job(job)
            except KeyboardInterrupt:  # (a SIGINT just after the call: it is done)
                pass
            if isinstance(job.message, Start) and self.session is None:
                job.replied.wait(SEND_TIMEOUT)
                return  # it could not start: the kernel has the error
            if self.finished:
                job.replied.wait(SEND_TIMEOUT)

    def run_job(self, job: _Job) -> None:
        if job.interrupted and job.task:  # Ctrl-C before it was sent: not run
            exc = interrupted("interrupted before any rank began it")
            job.reply = Reply(False, dump_exception(exc), "KeyboardInterrupt")
            job.done.set()
            return
        with self.lock:
            self.sink, self.current = job.conn, job
        try:
            job.reply = self.call(job.message)
        finally:
            with self.lock:
                self.sink = self.current = None
                if not job.replied.is_set():
                    self.unreplied.append(job)
            if job.reply is None:
                job.reply = Reply(False, None, "interrupted")
            job.done.set()


class _Stop(Exception):
    """SIGTERM: close the session and end."""


def _terminate(signum: int, frame: Any) -> None:
    raise _Stop


def serve(run_dir: str, meta: Meta, key: bytes, start: Callable[..., SessionBase]) -> None:
    """The supervisor of a detached session (``_supervise.main`` after its fork): listen,
    run the calls, and at the end remove the record. ``key``: the run's, from the kernel
    (its task, sealed with it, is the kernel's path, environment and directory);
    ``start``: ``session.start``, which starts the ranks here."""
    server: _Server | None = None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        signal.signal(signal.SIGTERM, _terminate)
        # the kernel's path, environment and directory (a task that is not the kernel's:
        # refused before anything listens, and the session ends)
        handed = pickle.loads(record.read_task(run_dir, key))
        if not isinstance(handed, HandedOver):
            raise LaunchError(f"the task of session {meta.id} is not a session's hand-over")
        record.take_on(handed.kernel)
        _listen(listener, run_dir)
        server = _Server(run_dir, meta, start)
        threading.Thread(target=server.accept, args=(listener,), daemon=True).start()
        threading.Thread(target=_heartbeat, args=(server,), daemon=True).start()
        server.main_loop()
    except _Stop:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        listener.close()
        try:
            if server is not None:
                _end(server)
        finally:
            record.remove(run_dir)


def _listen(listener: socket.socket, run_dir: str) -> None:
    """Bind ``listener`` to the record's socket, through a checked descriptor of the
    record's directory (``_launch.detach``), and listen: bound under another name,
    listening, then renamed into place, so that a kernel that sees the socket can connect
    (one that connected between the bind and listen() was refused, and said the
    supervisor "does not answer": a loaded machine's test)."""
    bound = SOCKET + ".new"
    with record._in(run_dir) as d:
        old = os.umask(0o177)
        try:
            listener.bind(f"/proc/self/fd/{d}/{bound}")
        finally:
            os.umask(old)
        os.chmod(bound, 0o600, dir_fd=d, follow_symlinks=False)
        listener.listen(16)
        os.rename(bound, SOCKET, src_dir_fd=d, dst_dir_fd=d)


def _end(server: _Server) -> None:
    """The session's ranks, then its cluster's job (a failed start's too), then its log."""
    try:
        if server.session is not None:
            server.session.close()
    finally:
        try:
            if server.cluster is not None:
                server.cluster.close()
        finally:
            server.writer.close()


def _hang_up(conn: socket.socket) -> None:
    """End a connection whose peer may still be sending (its call, after a secret that was
    refused): kept open until the peer closes (within ``SEND_TIMEOUT``), what it sends
    read and dropped. Closed at once, the peer's send of its call failed (a broken pipe)
    before it read the refusal already sent, and the kernel said "does not answer"
    instead of why it was refused."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + SEND_TIMEOUT
        while (left := deadline - time.monotonic()) > 0:
            if select.select([conn], [], [], left)[0] and not conn.recv(1 << 16):
                return  # the peer read the refusal and closed


def _heartbeat(server: _Server) -> None:
    """The session's heartbeat, for ``runs()`` on another host (its record on a shared
    home; a session is attached to only on its own host, through its Unix socket) -- and
    its record's watch: a record removed (by hand, a script, a cleaner) leaves no kernel a
    way to reach the session, so it ends within a beat or two, its ranks with it, rather
    than holding their memory (and GPUs) until someone finds its pid."""
    run_dir = server.run_dir
    said_unsafe = False
    while not server.finished:
        time.sleep(record.HEARTBEAT_INTERVAL)
        try:
            record.beat(run_dir)
        except record.RecordNotPrivate as exc:  # not written to, and said once; it lives on
            # (a chmod of the folder is no reason to end the ranks and lose their variables)
            if not said_unsafe:
                said_unsafe = True
                with contextlib.suppress(OSError):
                    print(f"supervisor: heartbeat not written: {exc}", file=sys.stderr, flush=True)
            continue
        except FileNotFoundError:
            if server.finished:
                return  # (the session is ending: it removes its record itself)
            why = (
                f"session {server.meta.id} ended: its record ({run_dir}) was removed, so no "
                "kernel could reach it any more; its ranks left and their variables are gone"
            )
            with contextlib.suppress(OSError):
                print(f"supervisor: {why}", file=sys.stderr, flush=True)
            server.end(why)
            return
        except OSError:
            continue


# --- the kernel's side -------------------------------------------------------------------


class _Line:
    """The connection of a submitted task, for its handle's interrupts: sent on it (after
    the call, never before), as many as were asked, also before it was connected."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.asked = 0

    def connected(self, sock: socket.socket) -> None:
        with self.lock:
            self.sock = sock
            for _ in range(self.asked):
                wire.send(sock, Interrupt())

    def interrupt(self) -> None:
        with self.lock:
            if self.sock is None:
                self.asked += 1
                return
            with contextlib.suppress(OSError):  # (the call has ended)
                wire.send(self.sock, Interrupt())


class DetachedSession(SessionBase):
    """A session whose ranks live under a supervisor of their own (``start(...,
    detach=True)``, ``attach(id)``): the methods of :class:`Session`, each a call to it;
    what a task prints, its dashboard and its exceptions show in the calling cell as a
    local session's do. ``id``: its id (``attach(id)``, ``runs()``); ``detach()``: stop
    using it here (it goes on); ``stop()`` (or ``close()``): its ranks leave, its record
    goes."""

    def __init__(self, run_id: str, run_dir: str, dashboard: bool | str | View = "auto") -> None:
        super().__init__({"dashboard": dashboard})
        self.id, self.path = run_id, run_dir
        self._detached = False
        self._secret = record.read_private(run_dir, SECRET)

    # -- calls ---------------------------------------------------------------------------

    def _call(self, message: Any, view: Any = None, line: _Line | None = None) -> Any:
        __tracebackhide__ = True
        if self._closed:
            raise LaunchError(f"session {self.id} is stopped; start a new one")
        if self._detached:
            raise LaunchError(
                f"this kernel detached from session {self.id}: "
                f"notebook_launcher.attach({self.id!r}) uses it again"
            )
        sock = self._connect()
        try:
            wire.send_secret(sock, self._secret)
            wire.send(sock, message)
            if line is not None:
                line.connected(sock)
            reply = self._wait(sock, view, interrupts=isinstance(message, Call))
        except (ConnectionError, BrokenPipeError):
            raise self._gone() from None
        finally:
            sock.close()
            if view is not None:
                view.close()
        if isinstance(reply, Refused):
            raise SessionRefused(f"session {self.id} refused this kernel: {reply.why}")
        if not isinstance(reply, Reply):
            raise LaunchError(f"session {self.id} answered {reply!r}, not a reply")
        if reply.out:
            sys.stdout.write(reply.out)
        if reply.err:
            sys.stderr.write(reply.err)
        if reply.ok and reply.data is not None:
            return loads(reply.data)
        rebuilt = rebuild_exception(reply.data)
        exc = rebuilt.exc
        if exc is None:
            exc = LaunchError(f"session {self.id}: {reply.summary} ({rebuilt.reason})")
        if type(exc) is KeyboardInterrupt:
            exc = interrupted(str(exc) or "interrupted")
        raise exc

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with _bindable(os.path.join(self.path, SOCKET)) as address:
                sock.connect(address)
        except OSError:
            sock.close()
            raise self._gone() from None
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", creds)
        if uid != os.getuid():  # (what it says is unpickled here: never another user's)
            sock.close()
            raise SessionRefused(
                f"the socket of session {self.id} ({os.path.join(self.path, SOCKET)}) is "
                f"served by process {pid} of uid {uid}, not by one of yours: refused"
            )
        return sock

    def _wait(self, sock: socket.socket, view: Any, interrupts: bool) -> Any:
        """The reply, showing the call's events in ``view`` meanwhile. ``interrupts``: Ctrl-C
        interrupts the task (as many times as pressed, as a local session's); else it
        stops the wait (a start: the supervisor is then ended by the caller)."""
        __tracebackhide__ = True
        frames = wire.Frames(sock)
        while True:
            try:
                frame = frames.next(TICK)
            except KeyboardInterrupt:
                if not interrupts:
                    raise
                if _kernel_ending():  # not the user's: the task goes on without this kernel
                    raise KeyboardInterrupt(
                        f"the kernel is shutting down: the task goes on in session {self.id}; "
                        f"notebook_launcher.attach({self.id!r}) shows it from the next kernel"
                    ) from None
                with contextlib.suppress(OSError):
                    wire.send(sock, Interrupt())
                continue
            match frame:
                case None:
                    if view is not None:
                        view.tick()
                case Reply() | Refused():
                    return frame
                case event:  # (events travel bare)
                    if view is not None:
                        view.handle(self._named(event))

    def _follow(self) -> None:
        """Show what ran while no kernel was attached: each task that ended meanwhile (its
        output, its dashboard, how it ended), then the task that runs now if its kernel
        went away, live, to its end. Ctrl-C stops following (the task goes on)."""
        sock = self._connect()
        view: Any = None
        try:
            wire.send_secret(sock, self._secret)
            wire.send(sock, Follow())
            frames = wire.Frames(sock)
            while True:
                try:
                    frame = frames.next(TICK)
                except KeyboardInterrupt:
                    if view is not None:  # what it shows stays, and says so
                        view.handle(FollowingStopped(time.time()))
                    raise KeyboardInterrupt(
                        f"stopped following the task that runs in session {self.id} (it goes "
                        f"on): notebook_launcher.attach({self.id!r}) follows it again"
                    ) from None
                match frame:
                    case None:
                        if view is not None:
                            view.tick()
                    case Missed(label, events, summary):
                        shown = self._view()
                        for event in events:
                            shown.handle(self._named(event))
                        shown.close()
                        print(self._while_away(label, summary), flush=True)
                    case Refused(why):
                        raise SessionRefused(f"session {self.id} refused this kernel: {why}")
                    case Ended(label, summary):
                        if view is not None:
                            view.close()
                            view = None
                        if label is not None:
                            print(self._while_away(label, summary or ""), flush=True)
                        return
                    case event:  # (events travel bare): the task followed, live
                        if view is None:
                            view = self._view()
                        view.handle(self._named(event))
        except (ConnectionError, BrokenPipeError):
            raise self._gone() from None
        finally:
            sock.close()
            if view is not None:
                view.close()

    def _named(self, event: Any) -> Any:
        """``event``, a task's start naming this session (a view left behind says which
        session to attach to)."""
        if isinstance(event, LaunchStarted) and not event.detached:
            return dataclasses.replace(event, detached=self.id)
        return event

    def _while_away(self, label: str, summary: str) -> str:
        return (
            f"notebook_launcher: {label}, whose kernel went away, ran on in session "
            f"{self.id}: it {summary}"
        )

    def _gone(self) -> LaunchError:
        """Why the supervisor cannot be reached."""
        try:
            meta = record.read_meta(self.path)
        except OSError:
            return LaunchError(
                f"session {self.id} is gone: it was stopped (stop(), %dist stop) or its "
                f"record was removed from {os.path.dirname(self.path)}; start a new one"
            )
        if not record.supervisor_alive(meta):
            return LaunchError(
                f"the supervisor (pid {meta.pid}) of session {self.id} died: its ranks were "
                "ended with it and their variables are lost; start a new session. "
                + record.log_said(self.path)
            )
        return LaunchError(
            f"session {self.id}'s supervisor (pid {meta.pid}) does not answer at "
            f"{os.path.join(self.path, SOCKET)}"
        )

    # -- the Session's methods -------------------------------------------------------------

    def _run_pickled(self, data: bytes, label: str, ranks: list[int] | int | None) -> list[Any]:
        __tracebackhide__ = True
        return self._call(Call(data, label, ranks), view=self._view())

    @property
    def ranks(self) -> list[int]:
        return self._call(Ask(Question.RANKS))

    def submit(
        self, fn: Callable[..., Any], *args: Any, ranks: list[int] | None = None, **kwargs: Any
    ) -> TaskHandle:
        """:meth:`Session.submit`: the call waits on a thread of its own; ``cancel()``
        interrupts the task. Calls made meanwhile (from this kernel or another) wait for
        it on the supervisor, but ``stacks()``, ``status()`` and ``interrupt()``."""
        __tracebackhide__ = True
        data, label = self._pickled(fn, args, kwargs)
        line = _Line()
        handle = TaskHandle(line.interrupt, label, stacks=self.stacks)
        view = self._view()  # (what the thread shows belongs to this cell)

        def wait() -> None:
            try:
                handle.set_result(self._call(Call(data, label, ranks), view=view, line=line))
            except BaseException as exc:  # noqa: BLE001 - the handle raises it
                handle.set_exception(exc)

        threading.Thread(target=wait, name=f"notebook-launcher-{self.id}", daemon=True).start()
        return handle

    def interrupt(self) -> None:
        self._call(Interrupt())

    def stacks(self) -> Stacks:
        return self._call(Ask(Question.STACKS))

    def status(self) -> SessionStatus:
        if self._closed:
            return SessionStatus("closed", 0, "-", "-", 0, 0, ())
        status: SessionStatus = self._call(Ask(Question.STATUS))
        meta = record.read_meta(self.path)
        where = f"detached session {self.id} (supervisor pid {meta.pid}; attach({self.id!r}))"
        return dataclasses.replace(status, note=f"{status.note}\n{where}" if status.note else where)

    def restart(self) -> None:
        __tracebackhide__ = True
        self._call(Stop(StopKind.RESTART), view=self._view())

    def stop(self) -> None:
        """End the session: its ranks leave, its supervisor ends, its record goes."""
        if self._closed:
            return
        try:
            meta = record.read_meta(self.path)
        except OSError:
            self._closed = True
            let_go(self)
            return
        try:
            self._call(Stop(StopKind.CLOSE))
        except LaunchError:
            if meta.pid is not None and record.supervisor_alive(meta):
                os.kill(meta.pid, signal.SIGTERM)
        self._closed = True
        let_go(self)
        deadline = time.monotonic() + 10
        while meta.pid is not None and record.supervisor_alive(meta):
            if time.monotonic() > deadline:
                os.kill(meta.pid, signal.SIGKILL)
                break
            time.sleep(0.02)
        record.remove(self.path)

    def close(self) -> None:
        """:meth:`stop` (a ``with`` block, ``%dist stop``)."""
        self.stop()

    def detach(self) -> None:
        """Stop using the session here: it goes on; ``attach(id)`` uses it again."""
        self._detached = True
        let_go(self)

    def __del__(self) -> None:
        pass  # it lives on without this kernel

    def __repr__(self) -> str:
        try:
            return f"<notebook_launcher.DetachedSession {self.id} {self.status()}>"
        except LaunchError as exc:
            return f"<notebook_launcher.DetachedSession {self.id}: {exc}>"


def start_detached(
    num_processes: int | None, dashboard: bool | str | View, **options: Any
) -> DetachedSession:
    """``start(..., detach=True)``: a supervisor of its own, its ranks started there. On a
    cluster (``options["cluster"]``, not started) that supervisor, on this host, starts the
    cluster (submits its job, holds its hub: the agents connect to it) and ends it
    with the session."""
    cluster = options.get("cluster")
    nodes = 1
    if cluster is not None:  # what can be checked without the nodes: before submitting
        from ._launch.remote import cluster_ranks
        from .cluster import check_cluster

        check_cluster(cluster)
        nodes = cluster.num_nodes
        cluster_ranks(
            num_processes, nodes, cluster.gpus_per_node, devices=options.get("devices", "auto")
        )
    payload = dumps_checked({"num_processes": num_processes, **options}, "the session's options")
    record.sweep()
    handover = Handover()
    made: list[str] = []
    try:
        with deferred_interrupts():  # a record whole, or none
            run_id, run_dir = record.new_run("session")
            made.append(run_dir)
            record.write_private(
                os.path.join(run_dir, SECRET), secrets.token_bytes(wire.SECRET_BYTES)
            )
            meta = Meta(
                run_id, "session", time.time(), num_processes or 0, kind="session", nodes=nodes
            )
            record.write_meta(run_dir, meta)
            payload_file = pickle.dumps(HandedOver(record.the_kernel()))
            sealed = record.seal(handover.key, payload_file)
            record.write_private(os.path.join(run_dir, record.TASK), sealed)
        handover.start(run_dir, -1, 0)
        handover.commit()
        assert handover.pid is not None
        session = DetachedSession(run_id, run_dir, dashboard)
        _wait_listening(run_dir, handover.pid)
        status = session._call(Start(payload), view=session._view())
    except BaseException:  # a failed start, Ctrl-C: no supervisor, no record left
        with deferred_interrupts():
            if not handover.committed:
                handover.abandon()
            for run_dir in made:
                abandon(run_dir)
        raise
    where = f" on {nodes} node(s), its supervisor here owning the cluster's job" if cluster else ""
    print(
        f"notebook_launcher: session {run_id} detached ({status.world_size} ranks{where}): it "
        f"goes on without this kernel. notebook_launcher.attach({run_id!r}) (or %dist attach "
        f"{run_id}) uses it from any kernel of yours on this machine; .stop() ends it"
        + (" and the job." if cluster else "."),
        flush=True,
    )
    return session


def _wait_listening(run_dir: str, pid: int) -> None:
    path = os.path.join(run_dir, SOCKET)
    deadline = time.monotonic() + START_TIMEOUT
    while not os.path.exists(path):
        if not record.running(pid) or time.monotonic() > deadline:
            try:
                why = record.read_private(run_dir, record.LOG).decode(errors="replace")
            except OSError:
                why = ""
            why = why[-2000:].strip()
            raise LaunchError(
                "the supervisor of the detached session could not start"
                + (f":\n{why}" if why else f" within {START_TIMEOUT:.0f} s")
            )
        time.sleep(0.01)


def attach_session(run_id: str, run_dir: str, dashboard: bool | str | View) -> DetachedSession:
    """``attach(id)`` of a session: it must still live; said when its supervisor died."""
    meta = record.read_meta(run_dir)
    if record.elsewhere(meta):
        raise LaunchError(
            f"session {run_id} runs on host {meta.host}, not on this one "
            f"({record.this_host()}): a session is reached through a socket on its own "
            f"host. Attach from a kernel there: notebook_launcher.attach({run_id!r})"
        )
    session = DetachedSession(run_id, run_dir, dashboard)
    if record.state_of(meta) == record.DIED:  # (on this host: the pid says it for sure)
        error = session._gone()
        record.remove(run_dir)  # said: nothing of it can be had again (no result, no ranks)
        raise LaunchError(f"{error} Its record is cleared: runs() lists it no more.")
    status = session.status()  # refused, or gone: said now
    print(f"notebook_launcher: attached to session {run_id}: {status}", flush=True)
    session._follow()
    make_current(session)  # the magics' session from now on
    return session


__all__ = ["DetachedSession", "SessionRefused", "attach_session", "serve", "start_detached"]
