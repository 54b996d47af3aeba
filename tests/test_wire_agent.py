"""The agents' channel, both ends in one process: the handshake and the sealed frames.

What a peer without the secret, or a tampering network, can and cannot do: nothing is
unpickled before the handshake proved the secret, a frame changed, replayed, reordered,
reflected or injected fails its check, and a handshake recorded once is worth nothing on
the next connection. (``test_agent_hub.py`` does the same against real agent processes.)
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
from collections.abc import Callable, Iterator

import pytest

from notebook_launcher._wire import agent as wire

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SECRET = os.urandom(32)


class Boom:
    """Unpickling it would run code: a check that comes after pickle.loads is too late."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned > /dev/null",))


def _handshake(secret_a: bytes = SECRET) -> tuple[bytes, bytes, bytes, bytes, dict]:
    """A whole handshake in memory: (kernel nonce, agent nonce, claim bytes, answer, claim)."""
    hello, nonce_k = wire.challenge()
    claim = {"job": "j1", "node": 0}
    reply, nonce_a, text = wire.answer(secret_a, hello[4:], claim)
    return nonce_k, nonce_a, text, reply[4:], claim


def test_the_right_secret_passes_both_ways() -> None:
    nonce_k, nonce_a, text, answer, claim = _handshake()
    got, got_nonce, got_text = wire.check_answer(SECRET, nonce_k, answer)
    assert got == claim and got_nonce == nonce_a and got_text == text
    verdict = wire.accepted(SECRET, nonce_k, nonce_a, text)[4:]
    wire.check_accepted(SECRET, nonce_k, nonce_a, text, verdict)  # the kernel is proven too


def test_a_wrong_secret_fails_at_the_first_check() -> None:
    nonce_k, _, _, answer, _ = _handshake(os.urandom(32))
    with pytest.raises(wire.AuthError, match="wrong secret"):
        wire.check_answer(SECRET, nonce_k, answer)


def test_a_recorded_handshake_fails_on_the_next_connection() -> None:
    _, _, _, answer, _ = _handshake()
    _, fresh_nonce = wire.challenge()  # the next connection's challenge
    with pytest.raises(wire.AuthError, match="wrong secret"):
        wire.check_answer(SECRET, fresh_nonce, answer)


def test_a_changed_claim_fails() -> None:
    nonce_k, _, _, answer, _ = _handshake()
    forged = answer[:64] + answer[64:].replace(b'"node": 0', b'"node": 1')
    with pytest.raises(wire.AuthError, match="wrong secret"):
        wire.check_answer(SECRET, nonce_k, forged)


def test_an_impostor_kernel_is_caught_by_the_agent() -> None:
    nonce_k, nonce_a, text, _, _ = _handshake()
    fake = wire.accepted(os.urandom(32), nonce_k, nonce_a, text)[4:]
    with pytest.raises(wire.AuthError, match="did not prove"):
        wire.check_accepted(SECRET, nonce_k, nonce_a, text, fake)
    with pytest.raises(wire.AuthError, match="refused this agent: go away"):
        wire.check_accepted(SECRET, nonce_k, nonce_a, text, wire.refused("go away")[4:])


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (struct.pack("!I", 1 << 30), "garbage"),  # a huge frame header
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "garbage"),  # another protocol
    ],
)
def test_garbage_before_the_handshake_is_refused_unread(data: bytes, error: str) -> None:
    reader = wire.PlainReader()
    with pytest.raises(wire.AuthError, match=error):
        reader.feed(data)


def test_an_answer_that_is_not_a_handshake() -> None:
    nonce_k, _ = wire.challenge()
    with pytest.raises(wire.AuthError, match="not a handshake"):
        wire.check_answer(SECRET, nonce_k, b"short")
    with pytest.raises(wire.AuthError, match="does not speak this protocol"):
        wire.answer(SECRET, b"SSH-2.0-OpenSSH", {})


def _read_all(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        data += sock.recv(n - len(data))
    return data


def _wire_bytes(link: wire.Link, peer: socket.socket, message: object) -> bytes:
    link.send(message)
    header = _read_all(peer, 4)
    (size,) = struct.unpack("!I", header)
    return header + _read_all(peer, size)


@pytest.fixture
def decoder() -> Iterator[Callable[..., wire.Link]]:
    """Links that only decode what a test hands them (closed afterwards)."""
    made: list[wire.Link] = []

    def make(key: bytes, side: str = "agent") -> wire.Link:
        link = (wire.agent_link if side == "agent" else wire.kernel_link)(socket.socket(), key)
        made.append(link)
        return link

    yield make
    for link in made:
        link.close()


def test_sealed_frames_arrive_in_order_and_cannot_be_tampered_with(
    decoder: Callable[..., wire.Link],
) -> None:
    a, b = socket.socketpair()
    key = os.urandom(32)
    kernel = wire.kernel_link(a, key)
    try:
        first = _wire_bytes(kernel, b, wire.Leave())
        second = _wire_bytes(kernel, b, wire.ToRank(1, "hello"))
    finally:
        kernel.close()
        b.close()
    assert decoder(key).receive(first + second) == [wire.Leave(), wire.ToRank(1, "hello")]
    changed = bytearray(second)
    changed[-1] ^= 1
    short = struct.pack("!I", 3) + b"abc"
    for link, data, kept, why in (
        (decoder(key), first + first, [wire.Leave()], "frame 1 failed its check"),  # replayed
        (decoder(key), second, [], "frame 0 failed its check"),  # reordered
        (decoder(key), first + bytes(changed), [wire.Leave()], "frame 1 failed its check"),
        (decoder(key, "kernel"), first, [], "frame 0 failed its check"),  # reflected back
        (decoder(os.urandom(32)), first, [], "frame 0 failed its check"),  # another key
        (decoder(key), first + short, [wire.Leave()], "frame 1 is 3 bytes, too short"),
    ):
        # every frame verified before the one that failed is kept, in the same read...
        assert link.receive(data) == kept
        assert link.failed is not None and link.failed.startswith(why), link.failed
        # ...and nothing after it is accepted, not even a genuine frame: the link is done
        assert link.receive(first) == [] and link.read() is None


def test_an_injected_frame_is_refused_before_it_is_unpickled(
    decoder: Callable[..., wire.Link],
) -> None:
    receiver = decoder(os.urandom(32))
    payload = pickle.dumps(Boom())
    injected = struct.pack("!I", len(payload) + wire.TAG_BYTES) + b"\0" * wire.TAG_BYTES + payload
    ran: list[str] = []
    original = os.system
    os.system = lambda cmd: ran.append(cmd) or 0  # type: ignore[assignment]
    try:
        assert receiver.receive(injected) == []
        assert receiver.failed is not None
    finally:
        os.system = original
    assert ran == []


def test_a_link_sends_from_many_threads_without_interleaving() -> None:
    a, b = socket.socketpair()
    key = os.urandom(32)
    sender = wire.kernel_link(a, key)
    receiver = wire.agent_link(b, key)
    big = b"x" * 200_000

    def send(i: int) -> None:
        for j in range(20):
            sender.send((i, j, big))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got: list[object] = []
    while len(got) < 80:
        got += receiver.read() or []
    assert sorted((i, j) for i, j, _ in got) == [(i, j) for i in range(4) for j in range(20)]
    sender.close()
    receiver.close()


def test_a_link_never_shows_its_key() -> None:
    a, b = socket.socketpair()
    key = os.urandom(32)
    link = wire.kernel_link(a, key)
    assert key.hex() not in repr(link) and "key" not in repr(link)
    link.close()
    b.close()
