"""The ranks' store on a cluster: a TCPStore on 127.0.0.1, reached only through forwarders
that prove the job's secret (``_wire.store``), with a real TCPStore and torch's own client.

Issue 25 item 2: the store was open to anyone who reached its port; 200 idle connections
turned a 1 s launch into 20 s, 1,100 into a hang. ``test_agent_hub.py`` runs a whole
cluster through the forwarders with such connections held open.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from notebook_launcher._wire import agent as agent_wire
from notebook_launcher._wire import store as wire
from notebook_launcher._wire.store import StoreForwarder, StoreProxy
from notebook_launcher.cluster import _store_server

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

SECRET = os.urandom(32)


@pytest.fixture
def port() -> Iterator[int]:
    """The port of a store as a cluster's kernel holds it (the fixture holds its only
    reference: it closes when the test ends)."""
    server = _store_server()
    yield int(server.port)
    del server


@pytest.fixture
def proxy(port: int) -> Iterator[StoreProxy]:
    proxy = StoreProxy("127.0.0.1", port, SECRET, handshake_timeout=0.5)
    yield proxy
    proxy.close()


@pytest.fixture
def forwarder(proxy: StoreProxy) -> Iterator[StoreForwarder]:
    forwarder = StoreForwarder(("127.0.0.1", proxy.port), SECRET)
    yield forwarder
    forwarder.close()


def client(address: tuple[str, int], seconds: float = 10.0) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(*address, is_master=False, timeout=timedelta(seconds=seconds))


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on ``port`` (from /proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(address)
    return found


def test_the_store_listens_on_loopback_only(port: int) -> None:
    assert _listening_addresses(port) == {"0100007F"}  # 127.0.0.1, nothing else


def test_an_authenticated_round_trip_goes_through_while_idle_connections_are_held(
    port: int, proxy: StoreProxy, forwarder: StoreForwarder
) -> None:
    """300 idle connections held open to the proxy: at most MAX_UNAUTHENTICATED wait there
    at once, none reaches the store, and a rank's store client through its forwarder still
    sets and gets."""
    idle = [socket.create_connection(("127.0.0.1", proxy.port)) for _ in range(300)]
    try:
        ranks, probe = client(forwarder.address), client(("127.0.0.1", port))
        ranks.set("key", "value")
        assert ranks.get("key") == b"value" and probe.get("key") == b"value"
        assert proxy.waiting <= wire.MAX_UNAUTHENTICATED
        assert proxy.refused_count >= 300 - wire.MAX_UNAUTHENTICATED
        del ranks, probe
    finally:
        for sock in idle:
            sock.close()


def test_an_unauthenticated_client_is_closed_by_the_deadline_and_never_reaches_the_store(
    port: int, proxy: StoreProxy
) -> None:
    """A client that speaks the store's protocol without the handshake: what it sends is
    never read past the answer's length, never forwarded, and it is closed at the deadline."""
    import torch.distributed as dist

    probe = client(("127.0.0.1", port))  # what a store request looks like
    sock = socket.create_connection(("127.0.0.1", proxy.port))
    sock.settimeout(10)
    challenge = sock.recv(100)
    assert challenge.startswith(wire._LEN.pack(36) + wire.MAGIC)
    with pytest.raises(dist.DistNetworkError):
        client(("127.0.0.1", proxy.port), seconds=1.0)  # torch's own client, no proof
    t0 = time.monotonic()
    assert sock.recv(100) == b""  # closed, having said nothing more
    assert time.monotonic() - t0 < 5
    sock.close()
    assert probe.num_keys() == 0  # nothing reached the store
    assert proxy.refused_count >= 2  # torch's client (it retried), and the silent one
    del probe


def test_a_wrong_secret_is_refused_both_ways(
    port: int, proxy: StoreProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forwarder without the secret is refused by the proxy (it is not tampering for the
    forwarder: the rank retries); a forwarder whose proxy cannot prove the secret
    (something else answering there) names it as tampering."""
    import torch.distributed as dist

    outsider = StoreForwarder(("127.0.0.1", proxy.port), os.urandom(32))
    try:
        with pytest.raises(dist.DistNetworkError):
            client(outsider.address, seconds=0.5)
        assert "did not prove the cluster's secret (unauthenticated)" in proxy.last_refused
        assert outsider.tampered is None
        assert "closed the connection during the handshake" in outsider.failures[-1]
    finally:
        outsider.close()
    # an impostor that lets anyone in, without knowing the secret to prove itself
    monkeypatch.setattr(wire, "check_answer", lambda *args: wire._frame(b"OK" + bytes(32)))
    fooled = StoreForwarder(("127.0.0.1", proxy.port), SECRET)
    try:
        with pytest.raises(dist.DistNetworkError):
            client(fooled.address, seconds=0.5)
        assert fooled.tampered is not None, fooled.failures
        assert "did not prove it holds the cluster's secret" in fooled.tampered
    finally:
        fooled.close()


def test_the_handshake_is_its_own() -> None:
    """The store's proofs and the agents' channel's share the secret, never their MACs:
    an answer made for one is worth nothing to the other."""
    hello, nonce_p = wire.challenge()
    reply, got_nonce, nonce_f = wire.answer(SECRET, hello)
    assert got_nonce == nonce_p
    verdict = wire.check_answer(SECRET, nonce_p, reply)
    assert verdict is not None and wire.check_verdict(SECRET, nonce_p, nonce_f, verdict)
    assert wire.check_answer(os.urandom(32), nonce_p, reply) is None
    assert wire.check_answer(SECRET, os.urandom(32), reply) is None  # replayed
    assert not wire.check_verdict(SECRET, nonce_f, nonce_p, verdict)  # reflected
    agent_mac = agent_wire._mac(SECRET, b"agent", nonce_p, nonce_f)
    assert wire.check_answer(SECRET, nonce_p, wire._frame(nonce_f + agent_mac)) is None
    with pytest.raises(ValueError, match="not the kernel's store proxy"):
        wire.answer(SECRET, agent_wire.challenge()[0])


def test_refusals_are_summed_up_not_logged_one_by_one(
    proxy: StoreProxy, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "notebook_launcher.cluster")
    for _ in range(50):
        socket.create_connection(("127.0.0.1", proxy.port)).close()
    deadline = time.monotonic() + 10
    while proxy.refused_count < 50 and time.monotonic() < deadline:
        time.sleep(0.05)
    proxy.close()
    lines = [r.getMessage() for r in caplog.records]
    assert proxy.refused_count == 50 and len(lines) == 2, lines
    assert "possible tampering" in lines[0] and "refused 49 more" in lines[1]


def test_a_forwarder_lets_in_this_users_processes() -> None:
    listen = socket.create_server(("127.0.0.1", 0))
    with listen, socket.create_connection(listen.getsockname()) as sock:
        accepted, peer = listen.accept()
        with accepted:
            assert wire.peer_uid(listen.getsockname(), peer) == os.getuid()
            assert sock.getsockname() == peer
