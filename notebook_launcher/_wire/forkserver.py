"""The forkserver's channel: the kernel asks for a rank, the server forks it.

A private ``AF_UNIX`` stream socketpair; each frame is a 4-byte big-endian length and a
standard pickle of one message below. :class:`Fork` carries the new rank's file
descriptors with it (``SCM_RIGHTS``: its control socket, stdout and stderr pipes, and for
rank 0 the rendezvous listener)::

    kernel (client, _launch.forkserver)           server (_worker.forkserver)
      <--- Ready() -----------------------------    torch imported, serving
      ---- Fork(has_listen, preload) + fds ---->    imports preload (once), forks; the
                                                    child becomes the rank
      <--- Forked(pid) -------------------------
      <--- Exited(pid, returncode) -------------    it reaps its children (their parent)
      ---- Supervise(run_dir, has_listen) + fds ->  forks a detached run's supervisor,
                                                    which forks once more and leaves
      <--- Forked(pid) -------------------------    (that first child, reaped already)

The server and a spare supervisor it forked ahead (``_supervise.spare``) speak the same
frames on a socketpair of their own::

    server                                          spare supervisor
      <--- Spare(pid) --------------------------    out of the server's session
      ---- Supervise(...) + fds --------------->    its run
      <--- Taken() -----------------------------    within SPARE_ANSWER, or it is killed
                                                    and a supervisor forked then gets it
"""

from __future__ import annotations

import pickle
import socket
import struct
from dataclasses import dataclass
from typing import Any

_HDR = struct.Struct("!I")
_MAX_FDS = 8


@dataclass(frozen=True)
class Ready:
    """The server finished its imports and takes requests."""


@dataclass(frozen=True)
class Fork:
    """Start one rank with the fds that come with this frame (rank 0: + the listener),
    after importing ``preload`` in the server (modules the kernel has and the server lacks:
    the rank then starts with them, as a rank forked by the kernel would)."""

    has_listen: bool
    preload: tuple[str, ...] = ()


@dataclass(frozen=True)
class Supervise:
    """Fork the supervisor of the detached run recorded in ``run_dir`` (``_supervise``),
    with the fds that come with this frame: the write end of its handshake pipe, its log
    (``supervisor.log``), the read end of its go pipe (the run's key comes there), and the
    rendezvous listener when ``has_listen``. ``forks``: how
    many ranks it forks on this machine (0: none, a session's or a cluster's): the next
    spare forks as many ahead (``_launch.pool``)."""

    run_dir: str
    has_listen: bool
    forks: int = 0


@dataclass(frozen=True)
class Spare:
    """A spare supervisor is out of the server's session: its pid (the server kills a spare
    that does not say :class:`Taken` in time)."""

    pid: int


@dataclass(frozen=True)
class Taken:
    """A spare supervisor has its run (the server then lets go of the run's fds)."""


@dataclass(frozen=True)
class Forked:
    pid: int


@dataclass(frozen=True)
class Exited:
    pid: int
    returncode: int


def send(sock: socket.socket, message: Any, fds: list[int] | None = None) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    frame = _HDR.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], fds)
    else:
        sock.sendall(frame)


class FrameReader:
    """Splits a byte stream into messages; one read may hold several (or half of one)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out = []
        while len(self._buf) >= _HDR.size:
            (size,) = _HDR.unpack_from(self._buf)
            if len(self._buf) < _HDR.size + size:
                break
            out.append(pickle.loads(self._buf[_HDR.size : _HDR.size + size]))
            self._buf = self._buf[_HDR.size + size :]
        return out


def recv_request(sock: socket.socket) -> tuple[Any, list[int]]:
    """Server side: one request and the fds that came with it (requests come one at a
    time: the client waits for :class:`Forked` before it sends the next)."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 65536, _MAX_FDS)
    if not data:
        raise EOFError("the kernel closed the forkserver's socket")
    reader = FrameReader()
    messages = reader.feed(data)
    while not messages:
        more = sock.recv(65536)
        if not more:
            raise EOFError("the kernel closed the forkserver's socket")
        messages = reader.feed(more)
    return messages[0], list(fds)


__all__ = [
    "Exited",
    "Fork",
    "Forked",
    "FrameReader",
    "Ready",
    "Spare",
    "Supervise",
    "Taken",
    "recv_request",
    "send",
]
