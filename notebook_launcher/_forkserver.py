"""The forkserver process: import torch once, then fork CUDA-safe workers in ~50 ms.

Started by the kernel with ``python -m notebook_launcher._forkserver FD`` where FD is
its end of a private socketpair (no listener anywhere). Requests carry the worker's
file descriptors (SCM_RIGHTS); the server forks, the child becomes the worker, and the
server reports ``("forked", pid)`` and later ``("exited", pid, returncode)``. It never
initialises CUDA, so its children may. It exits when the kernel closes the socket or
dies (parent-death signal).
"""

from __future__ import annotations

import importlib
import os
import pickle
import select
import signal
import socket
import sys
from typing import Any

from ._process import _HDR, _send_msg
from ._worker import die_with_parent

PRELOAD = (
    "torch",
    "torch.distributed",
    "cloudpickle",
    "numpy",
    "notebook_launcher.state",
    "notebook_launcher.utils",
    "notebook_launcher.accelerator",
    "notebook_launcher._progress",
    "tqdm.auto",
)


def _preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - optional modules may be absent
            pass


def _recv_request(sock: socket.socket) -> tuple[Any, list[int]]:
    """One request and the fds that came with it (the kernel sends one at a time)."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 65536, 8)
    if not data:
        raise EOFError("the kernel closed the forkserver's socket")
    while len(data) < _HDR.size or len(data) < _HDR.size + _HDR.unpack_from(data)[0]:
        more = sock.recv(65536)
        if not more:
            raise EOFError("the kernel closed the forkserver's socket")
        data += more
    (size,) = _HDR.unpack_from(data)
    return pickle.loads(data[_HDR.size : _HDR.size + size]), list(fds)


def serve(sock: socket.socket) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _send_msg(sock, ("ready",))
    while True:
        readable, _, _ = select.select([sock.fileno(), wake_r], [], [])
        if wake_r in readable:
            try:
                os.read(wake_r, 4096)
            except BlockingIOError:
                pass
            _reap(sock)
        if sock.fileno() in readable:
            try:
                msg, fds = _recv_request(sock)
            except (EOFError, OSError):
                return
            if msg[0] == "fork":
                pid = _fork_worker(sock, fds, has_listen=bool(msg[1]), wake=(wake_r, wake_w))
                for fd in fds:
                    os.close(fd)
                _send_msg(sock, ("forked", pid))


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send_msg(sock, ("exited", pid, os.waitstatus_to_exitcode(status)))


def _fork_worker(
    sock: socket.socket, fds: list[int], has_listen: bool, wake: tuple[int, int]
) -> int:
    server = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    from multiprocessing.connection import Connection

    from . import _worker

    sock.close()
    for fd in wake:
        os.close(fd)
    conn_fd, out_w, err_w = fds[:3]
    listen_fd = fds[3] if has_listen else None
    _worker.run(Connection(conn_fd), out_w, err_w, listen_fd, server)


def main() -> None:
    die_with_parent(int(sys.argv[2]))
    # Jupyter interrupts the kernel's whole process group: that is for the workers
    # (they reset SIGINT when forked), not for the server that outlives launches.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    _preload()
    try:
        serve(sock)
    finally:
        sock.close()


if __name__ == "__main__":
    main()
