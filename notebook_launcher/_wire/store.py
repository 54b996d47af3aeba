"""The ranks' rendezvous store on a cluster, reachable only by the job.

torch's TCPStore authenticates nobody, and whoever holds a connection to it can stall every
rank (each idle connection costs its server a turn). So the kernel's store listens on
127.0.0.1 only, and the nodes reach it through a pair of forwarders that prove the job's
secret to each other before a byte of the store's protocol passes::

    node (agent)                                        kernel
      rank --TCPStore client--> StoreForwarder          StoreProxy  --> TCPStore
             127.0.0.1:F          (loopback, this         (the hub's     127.0.0.1:S
                                  user's ranks only)       interface)
                                  --- connect --------------->
                                  <-- MAGIC | nonce_p ---------     a plain frame, 36 bytes
                                  --- nonce_f | mac_f -------->     mac_f = HMAC(secret,
                                                                    "store-forwarder" nonce_p nonce_f)
                                  <-- OK | mac_p --------------     mac_p = HMAC(secret,
                                                                    "store-proxy" nonce_f nonce_p)
                                  <== the store's bytes, spliced as they are ==>

The labels keep these MACs apart from the agents' own handshake (:mod:`.agent`), which uses
the same secret. A connection to the proxy that has not answered within
:data:`HANDSHAKE_TIMEOUT` seconds, or answers wrong, is closed and counted; at most
:data:`MAX_UNAUTHENTICATED` wait at once (the oldest goes first), so idle connections never
reach the store and cannot fill the proxy. Each side is one thread around a selector
(no thread per connection). What passes after the handshake is authenticated at its start,
not encrypted, nor checked frame by frame: whoever can change packets on the network can
change it (as with Gloo's and NCCL's own connections between the ranks).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import threading
import time
import weakref

from .._posix import close_quietly
from .refusals import Refusals

log = logging.getLogger("notebook_launcher.cluster")

MAGIC = b"NLS1"
NONCE_BYTES = 32
_MAC_BYTES = 32
_LEN = struct.Struct("!I")
#: Seconds a connection to the proxy has to prove the secret.
HANDSHAKE_TIMEOUT = 3.0
#: Seconds a forwarder gives the kernel's proxy to connect and prove itself.
UPSTREAM_TIMEOUT = 10.0
#: Connections to the proxy that may wait for their proof at once; the oldest goes first.
MAX_UNAUTHENTICATED = 64
#: Refusals logged one by one; then one line at most every REFUSED_SUMMARY_EVERY seconds.
REFUSED_LOGGED = 1
REFUSED_SUMMARY_EVERY = 10.0
#: Bytes a spliced direction holds before it stops reading (the other side is slow).
_HIGH_WATER = 1 << 20
_READ = selectors.EVENT_READ
_WRITE = selectors.EVENT_WRITE

_CHALLENGE_LEN = _LEN.size + len(MAGIC) + NONCE_BYTES
_ANSWER_LEN = _LEN.size + NONCE_BYTES + _MAC_BYTES
_VERDICT_LEN = _LEN.size + 2 + _MAC_BYTES


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"\0".join((label, *parts)), hashlib.sha256).digest()


def _frame(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload


def challenge() -> tuple[bytes, bytes]:
    """The proxy's first frame and its nonce."""
    nonce = os.urandom(NONCE_BYTES)
    return _frame(MAGIC + nonce), nonce


def answer(secret: bytes, data: bytes) -> tuple[bytes, bytes, bytes]:
    """The forwarder's answer to the proxy's challenge ``data`` (the whole frame):
    ``(frame, proxy's nonce, forwarder's nonce)``; ValueError when it is not a challenge."""
    if len(data) != _CHALLENGE_LEN or data[_LEN.size : _LEN.size + len(MAGIC)] != MAGIC:
        raise ValueError("what answered is not the kernel's store proxy")
    nonce_p = data[_LEN.size + len(MAGIC) :]
    nonce_f = os.urandom(NONCE_BYTES)
    return _frame(nonce_f + _mac(secret, b"store-forwarder", nonce_p, nonce_f)), nonce_p, nonce_f


def check_answer(secret: bytes, nonce_p: bytes, data: bytes) -> bytes | None:
    """The proxy's check of a forwarder's answer (the whole frame): the proxy's verdict
    frame, or None for a wrong one."""
    if len(data) != _ANSWER_LEN or _LEN.unpack_from(data)[0] != NONCE_BYTES + _MAC_BYTES:
        return None
    nonce_f, mac = data[_LEN.size : _LEN.size + NONCE_BYTES], data[_LEN.size + NONCE_BYTES :]
    if not hmac.compare_digest(mac, _mac(secret, b"store-forwarder", nonce_p, nonce_f)):
        return None
    return _frame(b"OK" + _mac(secret, b"store-proxy", nonce_f, nonce_p))


def check_verdict(secret: bytes, nonce_p: bytes, nonce_f: bytes, data: bytes) -> bool:
    """The forwarder's check that the proxy holds the secret too."""
    expected = _frame(b"OK" + _mac(secret, b"store-proxy", nonce_f, nonce_p))
    return len(data) == _VERDICT_LEN and hmac.compare_digest(data, expected)


# --- one thread around a selector ---------------------------------------------------------------

#: Live loops: a process forked from this one (a rank) closes their descriptors at once,
#: or a spliced connection would outlive its end here.
_live: weakref.WeakSet[_Loop] = weakref.WeakSet()


def _close_in_child() -> None:
    for loop in list(_live):
        close_quietly(*loop._fds)
    # the child's children must not close those numbers again: by then they may be the
    # child's own files
    _live.clear()


os.register_at_fork(after_in_child=_close_in_child)


class _End:
    """One socket of a spliced pair: what waits to be written to it, and its partner."""

    __slots__ = ("sock", "peer", "out", "events", "done")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.peer: _End | None = None
        self.out = bytearray()
        self.events = 0
        #: its peer ended: close once ``out`` is written
        self.done = False


class _Loop:
    """A daemon thread serving callbacks registered on a selector, and spliced pairs."""

    def __init__(self, name: str) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._fds: set[int] = {self._wake_r, self._wake_w, self._selector.fileno()}
        self._socks: dict[int, socket.socket] = {}
        self._selector.register(self._wake_r, _READ, lambda mask: None)
        self._closing = False
        self._started = False
        #: spliced connections now open
        self.spliced = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        _live.add(self)

    def _listen_on(self, family: int, address: tuple[str, int], reuse: bool = False) -> None:
        """Listen on ``address`` (its port 0: a free one) for :meth:`_accept`; on failure,
        release everything and raise."""
        self._listen = socket.socket(family, socket.SOCK_STREAM)
        try:
            if reuse:
                self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listen.bind(address)
            self._listen.listen(128)
        except OSError:
            self._listen.close()
            self.close()
            raise
        self._own(self._listen)
        self._selector.register(self._listen, _READ, self._accept)

    def _accept(self, mask: int) -> None:  # the listener's callback: each loop has its own
        raise NotImplementedError

    def _begin(self) -> None:
        self._thread.start()
        self._started = True

    def _run(self) -> None:
        try:
            while not self._closing:
                for key, mask in self._selector.select(self._timeout()):
                    try:
                        key.data(mask)
                    except Exception:  # a bug here must not end every connection
                        log.exception("%r: a connection failed", self)
                        if isinstance(key.fileobj, socket.socket):
                            self._drop(key.fileobj)
                self._tick()
        finally:
            self._release()

    def _release(self) -> None:
        for sock in list(self._socks.values()):
            sock.close()
        self._socks.clear()
        self._selector.close()
        close_quietly(self._wake_r, self._wake_w)
        self._fds.clear()
        _live.discard(self)

    def _timeout(self) -> float | None:
        return None

    def _tick(self) -> None:
        """After each turn (deadlines)."""

    def close(self) -> None:
        """End the thread and close every connection. Idempotent."""
        if self._closing:
            return
        self._closing = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if not self._started:
            self._release()
        elif self._thread is not threading.current_thread():
            self._thread.join(5.0)

    # -- sockets -----------------------------------------------------------------------------

    def _own(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._fds.add(sock.fileno())
        self._socks[sock.fileno()] = sock

    def _drop(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        if fd >= 0:
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            self._fds.discard(fd)
            self._socks.pop(fd, None)
        sock.close()

    # -- splicing ----------------------------------------------------------------------------

    def _splice(self, a: socket.socket, b: socket.socket, a_out: bytes = b"") -> None:
        """From now on, what one says goes to the other, byte for byte (``a_out``: what is
        already due to ``a``)."""
        end_a, end_b = _End(a), _End(b)
        end_a.peer, end_b.peer = end_b, end_a
        end_a.out += a_out
        for sock in (a, b):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.spliced += 1
        self._update(end_a)
        self._update(end_b)

    def _update(self, end: _End) -> None:
        peer = end.peer
        assert peer is not None
        events = 0
        if not end.done and not peer.done and len(peer.out) < _HIGH_WATER:
            events |= _READ
        if end.out:
            events |= _WRITE
        if events == end.events:
            return
        if events == 0:
            self._selector.unregister(end.sock)
        elif end.events == 0:
            self._selector.register(end.sock, events, lambda mask: self._on_end(end, mask))
        else:
            self._selector.modify(end.sock, events, lambda mask: self._on_end(end, mask))
        end.events = events

    def _on_end(self, end: _End, mask: int) -> None:
        peer = end.peer
        assert peer is not None
        try:
            if mask & _WRITE and end.out:
                sent = end.sock.send(end.out)
                del end.out[:sent]
            if mask & _READ:
                data = end.sock.recv(1 << 16)
                if not data:  # its side ended: what is due to the other still goes
                    end.done = peer.done = True
                else:
                    peer.out += data
                    if not peer.events & _WRITE:  # most often it all goes at once
                        sent = peer.sock.send(peer.out)
                        del peer.out[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # either side reset: both end
            end.done = peer.done = True
            end.out.clear()
            peer.out.clear()
        self._settle(end)
        self._settle(peer)

    def _settle(self, end: _End) -> None:
        """Watch ``end`` for what it can do now; close it once it is done and written."""
        if end.events == -1:  # closed already
            return
        if end.done and not end.out:
            self._drop(end.sock)
            end.events = -1
            if end.peer is not None and end.peer.events == -1:
                self.spliced -= 1
            return
        self._update(end)


# --- the kernel's side ----------------------------------------------------------------------------


class _Pending:
    __slots__ = ("sock", "peer", "nonce", "deadline", "got")

    def __init__(self, sock: socket.socket, peer: str, nonce: bytes, deadline: float) -> None:
        self.sock = sock
        self.peer = peer
        self.nonce = nonce
        self.deadline = deadline
        self.got = bytearray()


class StoreProxy(_Loop):
    """In the kernel: listens on ``host`` (the hub's interface), and splices every connection
    that proves ``secret`` to the store at ``127.0.0.1:store_port``; the others are closed
    and counted (:attr:`refused_count`, a log line now and then, never one each)."""

    def __init__(
        self,
        host: str,
        store_port: int,
        secret: bytes,
        *,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_unauthenticated: int = MAX_UNAUTHENTICATED,
    ) -> None:
        super().__init__("notebook-launcher-store-proxy")
        self._secret = secret
        self._target = ("127.0.0.1", store_port)
        self.handshake_timeout = handshake_timeout
        self.max_unauthenticated = max_unauthenticated
        self._pending: dict[int, _Pending] = {}  # in the order they came
        self.refusals = Refusals(
            log,
            "the ranks' store refused a connection from %s: %s (possible tampering: only "
            "the job's nodes hold the secret)",
            "the ranks' store refused %d more unauthenticated connection(s) (%d in all; the "
            "last: %s)",
            one_by_one=REFUSED_LOGGED,
            every=REFUSED_SUMMARY_EVERY,
        )
        self._paused_until = 0.0
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listen_on(family, (host, 0), reuse=True)
        self.host = host
        self.port: int = self._listen.getsockname()[1]
        self._begin()

    def __repr__(self) -> str:  # never the secret
        return f"<StoreProxy {self.host}:{self.port} -> 127.0.0.1:{self._target[1]}>"

    def close(self) -> None:
        super().close()
        self.refusals.flush()

    def _accept(self, mask: int) -> None:
        for _ in range(256):  # then the others get a turn
            try:
                sock, addr = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._out_of_descriptors()
                    return
                raise
            if len(self._pending) >= self.max_unauthenticated:
                oldest = next(iter(self._pending.values()))
                self._refuse(
                    oldest,
                    f"more than {self.max_unauthenticated} connections waiting to authenticate",
                )
            self._own(sock)
            hello, nonce = challenge()
            try:
                sock.send(hello)  # a fresh socket's buffer takes 40 bytes
            except OSError:
                self._drop(sock)
                continue
            pending = _Pending(
                sock, f"{addr[0]}:{addr[1]}", nonce, time.monotonic() + self.handshake_timeout
            )
            self._pending[sock.fileno()] = pending
            self._selector.register(sock, _READ, lambda mask, p=pending: self._advance(p))

    def _out_of_descriptors(self) -> None:
        """The process has no descriptor left: free the oldest waiting connection, or stop
        accepting for a moment (the listening socket would wake us in a loop)."""
        if self._pending:
            self._refuse(next(iter(self._pending.values())), "out of file descriptors")
            return
        self._selector.unregister(self._listen)
        self._paused_until = time.monotonic() + 0.5

    def _advance(self, pending: _Pending) -> None:
        try:
            data = pending.sock.recv(_ANSWER_LEN - len(pending.got))  # never beyond it
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._refuse(pending, f"connection failed before authenticating ({exc})")
            return
        if not data:
            self._refuse(pending, "closed the connection before authenticating")
            return
        pending.got += data
        if len(pending.got) < _ANSWER_LEN:
            return
        verdict = check_answer(self._secret, pending.nonce, bytes(pending.got))
        if verdict is None:
            self._refuse(pending, "did not prove the cluster's secret (unauthenticated)")
            return
        self._forget(pending)
        store = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            store.connect(self._target)  # loopback: at once
        except OSError as exc:
            store.close()
            self._drop(pending.sock)
            log.error("the ranks' store at 127.0.0.1:%d is gone (%s)", self._target[1], exc)
            return
        self._own(store)
        self._splice(pending.sock, store, a_out=verdict)

    def _forget(self, pending: _Pending) -> None:
        self._pending.pop(pending.sock.fileno(), None)
        try:
            self._selector.unregister(pending.sock)
        except (KeyError, ValueError):
            pass

    def _refuse(self, pending: _Pending, why: str) -> None:
        self._forget(pending)
        self._drop(pending.sock)
        self.refusals.note(pending.peer, why)

    def _timeout(self) -> float | None:
        wake = [p.deadline for p in self._pending.values()][:1]  # the oldest ends first
        if self._paused_until:
            wake.append(self._paused_until)
        if self.refusals.due is not None:
            wake.append(self.refusals.due)
        return max(0.0, min(wake) - time.monotonic()) if wake else None

    def _tick(self) -> None:
        now = time.monotonic()
        for pending in list(self._pending.values()):
            if pending.deadline > now:
                break
            self._refuse(
                pending, f"did not authenticate within {self.handshake_timeout:g} s (idle)"
            )
        if self._paused_until and now >= self._paused_until and not self._closing:
            self._paused_until = 0.0
            self._selector.register(self._listen, _READ, self._accept)
        self.refusals.tick(now)

    @property
    def refused_count(self) -> int:
        """Connections refused in all."""
        return self.refusals.count

    @property
    def last_refused(self) -> str:
        """The last refusal: ``peer: why``."""
        return self.refusals.last[-1] if self.refusals.last else ""

    @property
    def waiting(self) -> int:
        """Connections now waiting to authenticate."""
        return len(self._pending)


# --- the node's side ------------------------------------------------------------------------------


class _Upstream:
    """A rank's connection, while its forwarder proves itself to the kernel's proxy."""

    __slots__ = ("rank", "sock", "stage", "got", "nonces", "deadline")

    def __init__(self, rank: socket.socket, sock: socket.socket, deadline: float) -> None:
        self.rank = rank
        self.sock = sock
        self.stage = "connect"
        self.got = bytearray()
        self.nonces = (b"", b"")
        self.deadline = deadline


class StoreForwarder(_Loop):
    """On a node (in its agent): listens on 127.0.0.1 for this node's ranks' store clients;
    each one is spliced to the kernel's :class:`StoreProxy` at ``proxy`` once the forwarder
    proved ``secret`` and the proxy proved it back. Connections from other users of the
    node are refused (where ``/proc/net/tcp`` tells the peer's owner). :attr:`failures` says
    why a rank's connection was closed; :attr:`tampered`, that the kernel's end failed its
    proof."""

    def __init__(self, proxy: tuple[str, int], secret: bytes) -> None:
        super().__init__("notebook-launcher-store-forwarder")
        self.proxy = proxy
        self._secret = secret
        self._upstream: dict[int, _Upstream] = {}
        #: why connections were closed before reaching the store (the last ones)
        self.failures: list[str] = []
        #: why the kernel's end failed its proof, once it did: what answers there is not the
        #: kernel's proxy, or the network changes what passes (the rank's connection is
        #: closed; a flood that made the proxy drop us is not this, and the rank retries)
        self.tampered: str | None = None
        self._listen_on(socket.AF_INET, ("127.0.0.1", 0))
        self.address: tuple[str, int] = ("127.0.0.1", self._listen.getsockname()[1])
        self._begin()

    def __repr__(self) -> str:
        return f"<StoreForwarder 127.0.0.1:{self.address[1]} -> {self.proxy[0]}:{self.proxy[1]}>"

    def _fail(self, why: str) -> None:
        self.failures.append(why)
        del self.failures[:-20]

    def _accept(self, mask: int) -> None:
        while True:
            try:
                rank, addr = self._listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors: the rank's client retries
                time.sleep(0.1)
                return
            self._own(rank)
            owner = peer_uid(self.address, (addr[0], addr[1]))
            if owner is not None and owner != os.getuid():
                self._fail(f"refused a connection of user {owner} from {addr[0]}:{addr[1]}")
                self._drop(rank)
                continue
            family = socket.AF_INET6 if ":" in self.proxy[0] else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            self._own(sock)
            up = _Upstream(rank, sock, time.monotonic() + UPSTREAM_TIMEOUT)
            self._upstream[sock.fileno()] = up
            err = sock.connect_ex(self.proxy)
            if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
                self._give_up(up, f"cannot reach the kernel's store proxy: {os.strerror(err)}")
                continue
            self._selector.register(sock, _WRITE, lambda mask, u=up: self._advance(u))

    def _advance(self, up: _Upstream) -> None:
        where = f"{self.proxy[0]}:{self.proxy[1]}"
        try:
            if up.stage == "connect":
                err = up.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    self._give_up(
                        up, f"cannot reach the kernel's store proxy at {where}: {os.strerror(err)}"
                    )
                    return
                up.stage = "challenge"
                self._selector.modify(up.sock, _READ, lambda mask, u=up: self._advance(u))
                return
            need = _CHALLENGE_LEN if up.stage == "challenge" else _VERDICT_LEN
            data = up.sock.recv(need - len(up.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._give_up(
                up, f"the connection to the kernel's store proxy at {where} failed ({exc})"
            )
            return
        if not data:
            self._give_up(
                up,
                f"the kernel's store proxy at {where} closed the connection during the "
                "handshake (a flood of connections there, or it did not accept this node's "
                "proof of the secret)",
            )
            return
        up.got += data
        if len(up.got) < need:
            return
        got, up.got = bytes(up.got), bytearray()
        if up.stage == "challenge":
            try:
                reply, nonce_p, nonce_f = answer(self._secret, got)
            except ValueError as exc:
                self.tampered = f"{exc} ({where})"
                self._give_up(up, self.tampered)
                return
            up.nonces = (nonce_p, nonce_f)
            up.sock.send(reply)  # 68 bytes to a fresh socket
            up.stage = "verdict"
            return
        if not check_verdict(self._secret, *up.nonces, got):
            self.tampered = (
                f"the kernel's store proxy at {where} did not prove it holds the cluster's secret"
            )
            self._give_up(up, self.tampered)
            return
        del self._upstream[up.sock.fileno()]
        self._selector.unregister(up.sock)
        self._splice(up.rank, up.sock)

    def _give_up(self, up: _Upstream, why: str) -> None:
        self._upstream.pop(up.sock.fileno(), None)
        self._fail(why)
        self._drop(up.sock)
        self._drop(up.rank)

    def _timeout(self) -> float | None:
        if not self._upstream:
            return None
        return max(0.0, min(u.deadline for u in self._upstream.values()) - time.monotonic())

    def _tick(self) -> None:
        now = time.monotonic()
        for up in list(self._upstream.values()):
            if now >= up.deadline:
                self._give_up(
                    up,
                    f"the kernel's store proxy at {self.proxy[0]}:{self.proxy[1]} did not "
                    f"complete the handshake within {UPSTREAM_TIMEOUT:g} s",
                )


def peer_uid(mine: tuple[str, int], peer: tuple[str, int]) -> int | None:
    """The user owning the loopback socket at ``peer`` connected to ``mine`` (from
    ``/proc/net/tcp``); None where that cannot be told (no ``/proc``, the peer is gone)."""
    want = (_proc_address(peer), _proc_address(mine))
    try:
        with open("/proc/net/tcp") as f:
            next(f)
            for line in f:
                fields = line.split()
                if (fields[1], fields[2]) == want:
                    return int(fields[7])
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    return None


def _proc_address(address: tuple[str, int]) -> str:
    (number,) = struct.unpack("=I", socket.inet_aton(address[0]))
    return f"{number:08X}:{address[1]:04X}"


__all__ = [
    "HANDSHAKE_TIMEOUT",
    "MAX_UNAUTHENTICATED",
    "StoreForwarder",
    "StoreProxy",
    "answer",
    "challenge",
    "check_answer",
    "check_verdict",
    "peer_uid",
]
