"""The channel between a kernel and the supervisor of what outlives it: one protocol.

A detached run or session lives under a supervisor process that is not the kernel's child
(``_supervise``); every kernel of the same user reaches it through a Unix socket in the
run's private record (``_launch.detach``), checked to be served by the same uid. Two
sockets speak this protocol: a session's ``session.sock`` (``detached_session``: its
client and its server) and a run's ``result.sock`` (``_launch.detach.hold`` /
``take_held``: a result held in memory when the disk is full). Each frame is an 8-byte
little-endian length, then a standard pickle of one message below (what needs
cloudpickle -- a task, its values, an exception -- travels inside as ``bytes``, pickled by
``_serialization``). The first frame of a session's connection is the run's secret, bare
(:func:`send_secret`): nothing of a connection is unpickled before it proved it::

    kernel                                          supervisor
    ------                                          ----------
    new_run() + task.pkl: HandedOver, sealed ---->  takes on the kernel (path, env, cwd)
    connect; the secret -------------------------->  same uid, hmac.compare_digest
                               <--- Refused(why) --  not its user, not the run's secret
      Start(options)  ----------------------------->  the session's ranks start
      Call(data, label, ranks)  ------------------->  a task on the ranks
                     <--- any _events event ... ---  what the task shows, as it comes
      Interrupt()  (on the call's connection) ----->  that task interrupted, as Ctrl-C
                             <--- Reply(...) ------  its value, or its exception as data,
                                                     with what the call printed
      Ask(Question.STATUS | RANKS | STACKS) ------->  answered at once, beside a task
      Interrupt()  (a connection of its own) ------>  whatever task runs
      Stop(StopKind.CLOSE | RESTART) -------------->  the ranks leave (and come back)
      Follow()  ----------------------------------->  a kernel that attaches:
                  <--- Missed(label, events, ..) --  each task that ended while away
                  <--- its events ... -------------  the task that runs now, live
                  <--- Ended(label, summary) ------  how it ended (label None: none ran)

    take_held: connect (result.sock)  ------------>  same uid
                  <--- Held(meta, result) ---------  the run's end, from memory
      Taken() ------------------------------------->  the supervisor then ends

Events travel bare (they are the hot path: a task's every output line and progress
update), as on a rank's control channel (:mod:`.control`); everything else is one of the
classes here, so both ends dispatch on the message's type (``match``), never on a string.
The kernel and the supervisor are the same install (a kernel restarted meanwhile runs the
same code): the frames carry no version.
"""

from __future__ import annotations

import enum
import pickle
import select
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

from .._posix import deferred_interrupts

#: A frame's head: the length of the pickle that follows.
FRAME = struct.Struct("<Q")
#: The longest secret a connection may open with (a longer first frame is no secret: it is
#: read as none, and nothing of it is unpickled).
SECRET_BYTES = 32


# --- kernel -> supervisor --------------------------------------------------------------------


@dataclass(frozen=True)
class HandedOver:
    """What the kernel hands a new supervisor in the run's ``task.pkl`` (sealed with the
    run's key): the kernel as it is (``_launch.detach.the_kernel``: path, environment,
    directory), which the supervisor takes on, and a launch's ``job`` (pickled by
    ``_serialization``: what the supervisor's launch needs; None for a session, whose
    options come in :class:`Start`)."""

    kernel: dict[str, Any]
    job: bytes | None = None


@dataclass(frozen=True)
class Start:
    """Start the session's ranks: ``options`` is ``start()``'s keywords, pickled by
    ``_serialization`` (a cluster's configuration among them)."""

    options: bytes


@dataclass(frozen=True)
class Call:
    """Run a task on the session's ranks: cloudpickled ``(fn, args, kwargs)``, its
    ``label`` (what a view and a missed task are called), the ranks that run it (None:
    all)."""

    data: bytes
    label: str
    ranks: list[int] | int | None = None


@dataclass(frozen=True)
class Interrupt:
    """Interrupt a task as Ctrl-C does: on a :class:`Call`'s own connection, that task (it
    cannot overtake the call it interrupts); on a connection of its own, whatever runs."""


class StopKind(enum.Enum):
    CLOSE = "close"  # the ranks leave, the supervisor ends, the record goes
    RESTART = "restart"  # the ranks leave and fresh ones start


@dataclass(frozen=True)
class Stop:
    """End the session's ranks: for good (:attr:`StopKind.CLOSE`), or to start fresh ones."""

    kind: StopKind = StopKind.CLOSE


class Question(enum.Enum):
    STATUS = "status"  # SessionStatus
    RANKS = "ranks"  # list[int]
    STACKS = "stacks"  # ui.stall.Stacks: where every rank is now


@dataclass(frozen=True)
class Ask:
    """A look at the session, answered at once (beside a task that runs)."""

    what: Question


@dataclass(frozen=True)
class Follow:
    """A kernel attaches: show it what ran while no kernel was there, then follow the task
    whose kernel went away to its end."""


# --- supervisor -> kernel --------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """How a call ended: ``ok``, ``data`` is its value pickled by ``_serialization``; else
    its exception as data (``_serialization.dump_exception``; None: it could not be had)
    and ``summary`` says it in a line. ``out``/``err``: what the call printed on the
    supervisor (a restart says what was lost)."""

    ok: bool
    data: bytes | None
    summary: str = ""
    out: str = ""
    err: str = ""


@dataclass(frozen=True)
class Refused:
    """The connection is refused, and why (not the session's user, not its secret)."""

    why: str


@dataclass(frozen=True)
class Missed:
    """A task that ended while no kernel was attached: its ``label``, its ``events`` (the
    newest the supervisor kept) and how it ended, in a few lines."""

    label: str
    events: tuple[Any, ...] = ()
    summary: str = ""


@dataclass(frozen=True)
class Ended:
    """The end of a :class:`Follow`: the task followed (``label``) and how it ended; both
    None when no task was left to follow."""

    label: str | None = None
    summary: str | None = None


@dataclass(frozen=True)
class Held:
    """A run's end held in memory by its supervisor (a full disk): its meta's fields and
    its result (``_launch.detach.encode_result``)."""

    meta: dict[str, Any] = field(default_factory=dict)
    result: bytes = b""


@dataclass(frozen=True)
class Taken:
    """The kernel took the held result: the supervisor may end."""


# --- the framing -------------------------------------------------------------------------------


def encode(message: Any) -> bytes:
    """``message`` as one frame."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME.pack(len(data)) + data


def send(sock: socket.socket, message: Any) -> None:
    sock.sendall(encode(message))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes of ``sock``; ``ConnectionResetError`` at the end of the stream first."""
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionResetError("the other end closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv(sock: socket.socket) -> Any:
    """The next message on ``sock`` (blocking, as its timeout allows)."""
    (n,) = FRAME.unpack(recv_exact(sock, FRAME.size))
    return pickle.loads(recv_exact(sock, n))


def send_secret(sock: socket.socket, secret: bytes) -> None:
    """The first frame of a connection: the secret's bytes as they are (nothing of a
    connection is unpickled before it proved the secret)."""
    sock.sendall(FRAME.pack(len(secret)) + secret)


def recv_secret(sock: socket.socket) -> bytes:
    """The secret a connection opened with; empty when it was longer than a secret."""
    (n,) = FRAME.unpack(recv_exact(sock, FRAME.size))
    return recv_exact(sock, n) if n <= SECRET_BYTES else b""


class Frames:
    """The messages one connection receives, read a chunk at a time (a Ctrl-C between two
    reads loses nothing)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer, self.eof = sock, b"", False

    def next(self, timeout: float) -> Any:
        """The next whole message, or None after ``timeout`` seconds without one; raises
        ``ConnectionResetError`` at the end of the stream."""
        while True:
            if len(self.buffer) >= FRAME.size:
                (n,) = FRAME.unpack_from(self.buffer)
                if len(self.buffer) >= FRAME.size + n:
                    data = self.buffer[FRAME.size : FRAME.size + n]
                    self.buffer = self.buffer[FRAME.size + n :]
                    return pickle.loads(data)
            if self.eof:
                raise ConnectionResetError("the supervisor closed the connection")
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                return None
            with deferred_interrupts():  # what was read is kept, whatever comes
                chunk = self.sock.recv(1 << 20)
                self.buffer += chunk
                self.eof = not chunk


#: What a kernel may send a supervisor, and what it answers (the serve loop matches these).
REQUESTS = (Start, Call, Interrupt, Stop, Ask, Follow)
#: (and, bare, the events of the call that runs)
ANSWERS = (Reply, Refused, Missed, Ended)

__all__ = [
    "ANSWERS",
    "FRAME",
    "REQUESTS",
    "SECRET_BYTES",
    "Ask",
    "Call",
    "Ended",
    "Follow",
    "Frames",
    "HandedOver",
    "Held",
    "Interrupt",
    "Missed",
    "Question",
    "Refused",
    "Reply",
    "Start",
    "Stop",
    "StopKind",
    "Taken",
    "encode",
    "recv",
    "recv_exact",
    "recv_secret",
    "send",
    "send_secret",
]
