"""The forkserver process: import torch once, then fork CUDA-safe workers in ~50 ms.

Started by the kernel (:mod:`notebook_launcher._launch.forkserver`) as
``python -m notebook_launcher._worker.forkserver FD PARENT`` where FD is its end of a
private socketpair (no listener anywhere). The protocol is
:mod:`notebook_launcher._wire.forkserver`: requests carry the rank's file descriptors
(SCM_RIGHTS); the server forks, the child becomes the rank, and the server reports
:class:`Forked` and later :class:`Exited`. It never initialises CUDA, so its children may.
It exits when the kernel closes the socket or dies (parent-death signal).
"""

from __future__ import annotations

import importlib
import os
import select
import signal
import socket
import sys

from .._posix import die_with_parent, quiet_fork
from .._wire.forkserver import Exited, Fork, Forked, Ready, recv_request, send

PRELOAD = (
    "torch",
    "torch.distributed",
    "cloudpickle",
    "numpy",
    "notebook_launcher.state",
    "notebook_launcher.utils",
    "notebook_launcher.accelerator",
    "notebook_launcher._worker.progress",
    "tqdm.auto",
)


def _preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - optional modules may be absent
            pass


def serve(sock: socket.socket) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    send(sock, Ready())
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
                msg, fds = recv_request(sock)
            except (EOFError, OSError):
                return
            if isinstance(msg, Fork):
                pid = _fork_worker(sock, fds, has_listen=msg.has_listen, wake=(wake_r, wake_w))
                for fd in fds:
                    os.close(fd)
                send(sock, Forked(pid))


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send(sock, Exited(pid, os.waitstatus_to_exitcode(status)))


def _fork_worker(
    sock: socket.socket, fds: list[int], has_listen: bool, wake: tuple[int, int]
) -> int:
    server = os.getpid()
    pid = quiet_fork()
    if pid:
        return pid
    from multiprocessing.connection import Connection

    from . import entry

    sock.close()
    for fd in wake:
        os.close(fd)
    conn_fd, out_w, err_w = fds[:3]
    listen_fd = fds[3] if has_listen else None
    entry.run(Connection(conn_fd), out_w, err_w, listen_fd, server)


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
