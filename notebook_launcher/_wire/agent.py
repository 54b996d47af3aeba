"""The agents' channel: the kernel drives one agent per node over TCP, authenticated.

The kernel listens (``_launch.remote.AgentHub``); each node's agent (``_agent``, started by
a scheduler or by hand) connects. Both ends hold the job's secret, handed to the agents out
of band (a file only the user can read, or the environment of what starts them). Nothing is
unpickled before the peer has proven it holds the secret::

    kernel (hub)                                      agent
      <--- connect ------------------------------------
      ---- HELLO | nonce_k ------------------------->       a plain frame, 36 bytes
      <--- nonce_a | mac_a | claim --------------------     mac_a = HMAC(secret, "agent" nonce_k
                                                            nonce_a claim); claim: JSON (job, node)
      ---- OK | mac_k ------------------------------>       mac_k = HMAC(secret, "kernel" nonce_a
           (or NO | reason, and close)                      nonce_k claim): the kernel is proven too
      <==> sealed frames, both ways ==================>     len | tag | pickle of one message

Each side draws a fresh nonce per connection, so a recorded handshake is worth nothing on
the next one (replay), and a wrong secret fails at the first check. Frames before the
handshake ends are at most :data:`MAX_PLAIN_FRAME` bytes. After it, every frame carries a
tag, ``HMAC(session key, direction, sequence number, payload)`` cut to 16 bytes, with the
session key derived from the secret and both nonces: a frame that was changed, replayed,
reordered, reflected back or injected into the stream fails its tag: the frames verified
before it are kept, nothing after it is read (:attr:`Link.failed` says why) and the
connection ends, before it is unpickled. Frames are authenticated, not encrypted: whoever
watches the network reads them. The messages are the dataclasses below (one standard pickle each; what needs
cloudpickle -- the user's function, results, exceptions -- travels inside as bytes, as on
the ranks' control channel, :mod:`.control`).

Messages after the handshake::

    kernel -> agent                                   agent -> kernel
      Start(NodeSetup, task)  start this node's ranks   NodeHello(host, gpus, versions) first
      ToRank(rank, message)   a control message          Batch([...]) what the ranks said:
      Signal(rank, sig)       (SIGINT: its main thread)     events and Output lines, FromRank(
      Terminate()             staged stop of the ranks      rank, Returned|Raised|Reformed),
      TakeStacks(ranks)       where they are (stall view)   RankStarted(rank, pid),
      CloseRanks()            kill, reap, release ->        RankExited(rank, pid, code, ...)
      Leave()                 the agent exits            StacksOf(stacks), RanksClosed(),
                                                         AgentEnding(why, Ending)
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import os
import pickle
import queue
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

from .._spec import WorkerSpec

#: The protocol's name and version, the first bytes the kernel sends.
HELLO = b"NLA1"
NONCE_BYTES = 32
TAG_BYTES = 16
#: The largest frame accepted before the peer proved the secret.
MAX_PLAIN_FRAME = 4096
#: The largest sealed frame (a task or a result): 4 GiB, the length field's limit.
MAX_FRAME = (1 << 32) - 1
_LEN = struct.Struct("!I")
#: How the agent finds the secret when no file is given (a job step's environment).
SECRET_ENV = "NOTEBOOK_LAUNCHER_AGENT_SECRET"


class AuthError(Exception):
    """The peer did not prove it holds the job's secret, or broke the protocol."""


# --- kernel -> agent ------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSetup:
    """What an agent needs to start its node's ranks for one attempt.

    ``specs`` are the ranks' specs as the kernel planned them; the agent completes what only
    the node knows (its environment, which the ranks inherit, and a working directory that
    exists there)."""

    specs: tuple[WorkerSpec, ...]
    attempt: int = 0
    grace_period: float = 1.0


@dataclass(frozen=True)
class Start:
    """Start this node's ranks; ``task`` is the cloudpickled ``(fn, args, kwargs)`` (None for
    a session's ranks, which get their tasks as :class:`ToRank` messages)."""

    setup: NodeSetup
    task: bytes | None = None
    #: modules the kernel has that torch imports lazily at a cost (``torch._dynamo``):
    #: the agent imports them before it forks the ranks (as the forkserver does)
    warm: tuple[str, ...] = ()


@dataclass(frozen=True)
class ToRank:
    """A control message for one rank (``_wire.control``: Run, Reform, Shutdown)."""

    rank: int
    message: Any


@dataclass(frozen=True)
class Signal:
    """Signal ``signum`` to ``rank``; ``main_thread``: to its main thread only (a session's
    interrupt, see ``_launch.session``)."""

    rank: int
    signum: int
    main_thread: bool = False


@dataclass(frozen=True)
class TakeStacks:
    """Take the stacks of this node's running ranks (of ``ranks``, or all), waiting up to
    ``timeout`` seconds for them; answered by :class:`StacksOf` with the same ``request``."""

    request: int
    ranks: tuple[int, ...] | None
    timeout: float


@dataclass(frozen=True)
class Terminate:
    """Stop this node's ranks in stages: SIGTERM now, SIGKILL after the grace period."""


@dataclass(frozen=True)
class CloseRanks:
    """Kill what is left of this node's ranks, reap them, release their fds; answered by
    :class:`RanksClosed` once every exit was reported."""


@dataclass(frozen=True)
class Leave:
    """The job is over: the agent exits (its ranks with it)."""


# --- agent -> kernel ------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeHello:
    """The agent's first message: what the kernel checks before it plans ranks there."""

    host: str
    pid: int
    gpus: int
    python: str
    torch: str
    package: str
    cwd: str
    #: what started the agent says of it (its scheduler's names: ``{"node": "n1", "job":
    #: "12"}``); ``node``, when given, names the node where the host name would
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RankStarted:
    rank: int
    pid: int


@dataclass(frozen=True)
class FromRank:
    """A rank's control message that is not an event (Returned, Raised, Reformed)."""

    rank: int
    message: Any


@dataclass(frozen=True)
class RankExited:
    """A rank's process ended: what ``WorkerProcess.reap`` found, and what it was doing."""

    rank: int
    pid: int
    returncode: int
    stage: str = "running"
    note: str = ""
    #: the agent had sent it SIGTERM or SIGKILL (its end by a signal is a stop, not a death)
    signalled: bool = False


@dataclass(frozen=True)
class Batch:
    """Everything the agent heard in one turn of its loop, in order: events, output lines,
    :class:`RankStarted`, :class:`FromRank`, :class:`RankExited`."""

    items: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class StacksOf:
    """This node's answer to :class:`TakeStacks`: each rank's stacks (``_events.RankStacks``)
    and what its flight recorder last saw (rank, line)."""

    request: int
    stacks: tuple[Any, ...]
    flight: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class RanksClosed:
    """Every rank of the node is gone, and reported."""


class Ending(enum.Enum):
    """Why an agent ends on its own: what the kernel decides on (``AgentEnding.why`` is
    for people)."""

    #: it got SIGTERM: whatever started it is ending it (a scheduler's time limit or
    #: cancel: every process of the job is signalled at about the same time, so a run's
    #: supervisor inside that job takes the failure it causes for the job's end)
    TERMINATED = "terminated"
    #: its ranks could not start (``why`` says what it found)
    COULD_NOT_START = "could not start"
    #: the kernel's connection, or the store's, was tampered with
    TAMPERED = "tampered"


@dataclass(frozen=True)
class AgentEnding:
    """The agent is about to exit on its own: ``reason``, and ``why`` in words (its SIGTERM,
    with what that means where it runs; its ranks could not start; tampering)."""

    why: str
    reason: Ending


# --- the handshake ----------------------------------------------------------------------------


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"\0".join(parts), hashlib.sha256).digest()


def challenge() -> tuple[bytes, bytes]:
    """The kernel's first frame and its nonce."""
    nonce = os.urandom(NONCE_BYTES)
    return frame(HELLO + nonce), nonce


def answer(secret: bytes, hello: bytes, claim: dict[str, Any]) -> tuple[bytes, bytes, bytes]:
    """The agent's answer to the kernel's first frame: ``(frame, its nonce, the claim)``."""
    if len(hello) != len(HELLO) + NONCE_BYTES or not hello.startswith(HELLO):
        raise AuthError("the peer does not speak this protocol (is it a notebook_launcher kernel?)")
    nonce_k = hello[len(HELLO) :]
    nonce_a = os.urandom(NONCE_BYTES)
    text = json.dumps(claim, sort_keys=True).encode()
    mac = _mac(secret, b"agent", nonce_k, nonce_a, text)
    return frame(nonce_a + mac + text), nonce_a, text


def check_answer(secret: bytes, nonce_k: bytes, data: bytes) -> tuple[dict[str, Any], bytes, bytes]:
    """The kernel's check of an agent's answer: ``(claim, agent's nonce, claim bytes)``, or
    :class:`AuthError`."""
    if len(data) < NONCE_BYTES + 32 + 2:
        raise AuthError(f"a {len(data)}-byte answer is not a handshake")
    nonce_a, mac, text = data[:NONCE_BYTES], data[NONCE_BYTES : NONCE_BYTES + 32], data[64:]
    if not hmac.compare_digest(mac, _mac(secret, b"agent", nonce_k, nonce_a, text)):
        raise AuthError("wrong secret (or a replayed handshake)")
    try:
        claim = json.loads(text)
    except ValueError as exc:
        raise AuthError(f"a claim that is not JSON ({exc})") from None
    if not isinstance(claim, dict):
        raise AuthError("a claim that is not a JSON object")
    return claim, nonce_a, text


def accepted(secret: bytes, nonce_k: bytes, nonce_a: bytes, claim: bytes) -> bytes:
    """The kernel's frame that accepts an agent (and proves the kernel holds the secret)."""
    return frame(b"OK" + _mac(secret, b"kernel", nonce_a, nonce_k, claim))


def refused(reason: str) -> bytes:
    return frame(b"NO" + reason.encode()[: MAX_PLAIN_FRAME - 2])


def check_accepted(
    secret: bytes, nonce_k: bytes, nonce_a: bytes, claim: bytes, data: bytes
) -> None:
    """The agent's check of the kernel's verdict: returns when accepted by a kernel that
    holds the secret; :class:`AuthError` otherwise."""
    if data.startswith(b"NO"):
        raise AuthError(f"the kernel refused this agent: {data[2:].decode(errors='replace')}")
    expected = _mac(secret, b"kernel", nonce_a, nonce_k, claim)
    if not (data.startswith(b"OK") and hmac.compare_digest(data[2:], expected)):
        raise AuthError("the kernel did not prove it holds the secret")


def session_key(secret: bytes, nonce_k: bytes, nonce_a: bytes) -> bytes:
    return _mac(secret, b"session", nonce_k, nonce_a)


def frame(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload


class PlainReader:
    """Frames of the handshake: at most :data:`MAX_PLAIN_FRAME` bytes each."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> bytes | None:
        """One whole frame once it is here (None before); :class:`AuthError` for a frame
        too long to be a handshake (garbage, or a peer of another protocol)."""
        self._buf += data
        if len(self._buf) < _LEN.size:
            return None
        (size,) = _LEN.unpack_from(self._buf)
        if size > MAX_PLAIN_FRAME:
            raise AuthError(f"a {size}-byte frame before the handshake (garbage?)")
        if len(self._buf) < _LEN.size + size:
            return None
        payload = self._buf[_LEN.size : _LEN.size + size]
        self._buf = self._buf[_LEN.size + size :]
        return payload

    def rest(self) -> bytes:
        """What came after the handshake's frame (the first sealed frames)."""
        rest, self._buf = self._buf, b""
        return rest


# --- after the handshake: sealed frames --------------------------------------------------------


class Link:
    """One authenticated connection, either end: ``send(message)`` from any thread (a writer
    thread does the socket's writes, so a slow peer never blocks the sender), and
    ``receive(data) -> messages`` for what the owner's loop read from :attr:`sock`.

    ``outgoing`` / ``incoming`` name the directions (``b"k"`` kernel to agent, ``b"a"`` the
    other way), so a frame can never be reflected back to its sender.
    """

    def __init__(self, sock: socket.socket, key: bytes, outgoing: bytes, incoming: bytes) -> None:
        self.sock = sock
        self._key = key
        self._out, self._in = outgoing, incoming
        self._sent = 0
        self._received = 0
        self._buf = bytearray()
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        #: why writing failed (the peer went away), once it did
        self.broken: str | None = None
        #: why a frame received failed its check (tampering), once one did: nothing from the
        #: peer is trusted any more, and the connection must end
        self.failed: str | None = None
        self.closed = False
        self._writer: threading.Thread | None = None  # started when a send must wait
        #: frames handed to the writer and not yet written (later ones queue behind them)
        self._queued = 0

    def __repr__(self) -> str:  # never the key
        return f"<Link fd={self.fileno()} sent={self._sent} received={self._received}>"

    def fileno(self) -> int:
        return self.sock.fileno()

    def _tag(self, direction: bytes, seq: int, payload: bytes) -> bytes:
        mac = hmac.new(self._key, direction + seq.to_bytes(8, "big"), hashlib.sha256)
        mac.update(payload)
        return mac.digest()[:TAG_BYTES]

    def send(self, message: Any) -> None:
        """Send ``message``; never blocks on the network. While nothing waits to be
        written, what the socket takes at once goes out from this thread (a session's
        round trip: no thread hand-off); the rest, and whatever comes after it, goes to
        the writer thread, in order. A broken link drops it: the reader sees the end of
        the connection."""
        if self.closed:
            return
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(payload) + TAG_BYTES > MAX_FRAME:
            raise ValueError(f"a {len(payload)}-byte message is larger than a frame can carry")
        with self._lock:  # the sequence number and the order on the wire agree
            tag = self._tag(self._out, self._sent, payload)
            self._sent += 1
            data = _LEN.pack(len(payload) + TAG_BYTES) + tag + payload
            if not self._queued and self.broken is None:
                try:
                    sent = self.sock.send(data, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError as exc:
                    self.broken = f"{type(exc).__name__}: {exc}"
                    return
                if sent == len(data):
                    return
                data = data[sent:]
            if self._writer is None:
                self._writer = threading.Thread(target=self._write, name="notebook-launcher-link")
                self._writer.daemon = True
                self._writer.start()
            self._queued += 1
            self._queue.put(data)

    def _write(self) -> None:
        while True:
            data = self._queue.get()
            if data is None:
                return
            try:
                self.sock.sendall(data)
            except OSError as exc:
                self.broken = self.broken or f"{type(exc).__name__}: {exc}"
                return
            finally:
                with self._lock:
                    self._queued -= 1

    def receive(self, data: bytes) -> list[Any]:
        """The messages completed by ``data``, in order. A frame whose tag is wrong (changed,
        replayed, reflected back or injected) ends what this link accepts: the messages
        verified before it are returned, :attr:`failed` says why, and nothing after it is
        read -- the owner must then close the connection (see :meth:`read`)."""
        if self.failed is not None:
            return []
        self._buf += data
        out = []
        while len(self._buf) >= _LEN.size:
            (size,) = _LEN.unpack_from(self._buf)
            if size < TAG_BYTES:
                self._fail(f"frame {self._received} is {size} bytes, too short to carry a tag")
                break
            end = _LEN.size + size
            if len(self._buf) < end:
                break
            tag = bytes(self._buf[_LEN.size : _LEN.size + TAG_BYTES])
            payload = bytes(self._buf[_LEN.size + TAG_BYTES : end])
            del self._buf[:end]
            if not hmac.compare_digest(tag, self._tag(self._in, self._received, payload)):
                self._fail(
                    f"frame {self._received} failed its check (replayed, reflected back, "
                    "changed or injected)"
                )
                break
            self._received += 1
            message = pickle.loads(payload)
            out.append(message)
        return out

    def _fail(self, why: str) -> None:
        self.failed = why
        self._buf = bytearray()

    def read(self) -> list[Any] | None:
        """Read what is there (the socket is readable): its messages, or None at the end
        of the connection -- or once a frame failed its check (:attr:`failed`): the
        messages verified before it come first, then None."""
        if self.failed is not None:
            return None
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return []
        except OSError:
            return None
        if not data:
            return None
        return self.receive(data)

    def close(self) -> None:
        """Let the writer send what is queued, then close. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._queue.put(None)
        writer = self._writer
        if writer is not None and writer is not threading.current_thread():
            writer.join(5.0)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def kernel_link(sock: socket.socket, key: bytes) -> Link:
    return Link(sock, key, b"k", b"a")


def agent_link(sock: socket.socket, key: bytes) -> Link:
    return Link(sock, key, b"a", b"k")


def connect(
    host: str, port: int, secret: bytes, claim: dict[str, Any], timeout: float = 30.0
) -> tuple[Link, bytes]:
    """The agent's side: connect, prove the secret, check the kernel's proof; the link and
    whatever sealed bytes arrived with the verdict (feed them to ``link.receive``)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keepalive(sock)
        sock.settimeout(timeout)
        reader = PlainReader()
        hello = None
        while hello is None:
            data = sock.recv(MAX_PLAIN_FRAME)
            if not data:
                raise AuthError("the kernel closed the connection during the handshake")
            hello = reader.feed(data)
        reply, nonce_a, text = answer(secret, hello, claim)
        sock.sendall(reply)
        verdict = None
        while verdict is None:
            data = sock.recv(MAX_PLAIN_FRAME)
            if not data:
                raise AuthError("the kernel closed the connection during the handshake")
            verdict = reader.feed(data)
        nonce_k = hello[len(HELLO) :]
        check_accepted(secret, nonce_k, nonce_a, text, verdict)
        sock.settimeout(None)
        return agent_link(sock, session_key(secret, nonce_k, nonce_a)), reader.rest()
    except BaseException:
        sock.close()
        raise


def keepalive(sock: socket.socket, idle: int = 5, interval: int = 2, count: int = 3) -> None:
    """TCP keepalives: a peer whose host died (no FIN ever comes) is noticed within about
    ``idle + interval * count`` seconds, by the OS, whatever the program is doing."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", idle),
        ("TCP_KEEPINTVL", interval),
        ("TCP_KEEPCNT", count),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


__all__ = [
    "HELLO",
    "MAX_PLAIN_FRAME",
    "SECRET_ENV",
    "AgentEnding",
    "AuthError",
    "Batch",
    "CloseRanks",
    "FromRank",
    "Leave",
    "Link",
    "NodeHello",
    "NodeSetup",
    "PlainReader",
    "RankExited",
    "RankStarted",
    "RanksClosed",
    "Signal",
    "StacksOf",
    "Start",
    "TakeStacks",
    "Terminate",
    "ToRank",
    "accepted",
    "agent_link",
    "answer",
    "challenge",
    "check_accepted",
    "check_answer",
    "connect",
    "frame",
    "kernel_link",
    "keepalive",
    "refused",
    "session_key",
]
