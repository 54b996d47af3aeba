"""The forkserver process: import torch once, then fork CUDA-safe workers in ~50 ms.

Started by the kernel (:mod:`notebook_launcher._launch.forkserver`) as
``python -m notebook_launcher._worker.forkserver FD PARENT`` where FD is its end of a
private socketpair (no listener anywhere). The protocol is
:mod:`notebook_launcher._wire.forkserver`: requests carry the rank's file descriptors
(SCM_RIGHTS); the server forks, the child becomes the rank, and the server reports
:class:`Forked` and later :class:`Exited`. It never initialises CUDA, so its children may.
It exits when its socket reaches end-of-file: the kernel closed it or died. (Not by a
parent-death signal: that fires when the kernel *thread* that started the server ends,
and a launch from a worker thread would take the server, and the next launch's ranks,
with it.) Each rank leads its own process group; before reaping a rank the server kills
what is left in that group (what the rank started).

It also forks the supervisors of detached runs (:class:`Supervise`): warm (torch imported,
no CUDA, none of the kernel's memory or fds), where a fresh interpreter would spend seconds
importing torch. A supervisor leaves at once (``_supervise.spare``: a session of its own,
one more fork), so that neither this server nor the kernel is its parent; it is forked
ahead of need (one spare, waiting on a socket to this server for its run, gone with the
server), and it forks its ranks ahead too (as many as the last run had: ``_launch.pool``),
so that a detached run's ranks start about as soon as an attached run's.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from .. import _settings
from .._posix import (
    close_quietly,
    import_quietly,
    import_without_cuda,
    kill_process_group,
    quiet_fork,
)
from .._wire.forkserver import (
    Exited,
    Fork,
    Forked,
    FrameReader,
    Ready,
    Spare,
    Supervise,
    Taken,
    recv_request,
    send,
)

PRELOAD = (
    "torch",
    "torch.distributed",
    "cloudpickle",
    # numpy >= 2 imports numpy.random on first use: a kernel that uses numpy hands its
    # random state to every rank (_settings), which would import it each time (~0.1-0.3 s)
    "numpy.random",
    "notebook_launcher.state",
    "notebook_launcher.utils",
    "notebook_launcher.utils.operations",  # utils loads its torch parts on first use
    "notebook_launcher.accelerator",
    "notebook_launcher._worker.progress",
    "tqdm.auto",
)


def _preload() -> None:
    import_quietly(PRELOAD)
    # Every rank applies the kernel's RNG and torch settings; the first time costs ~15 ms
    # (NumPy's global generator, torch's switches): pay it here, once, not in every rank.
    try:
        _settings.apply(_settings.capture())
    except Exception:  # noqa: BLE001 - a warm-up only
        pass


def serve(sock: socket.socket, spare_now: int | None = None) -> None:
    """Serve the kernel's requests until its socket ends. ``spare_now``: fork a spare
    supervisor at once, with that many ranks ahead (a server started behind a kernel's
    first detached run, for its next one)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    send(sock, Ready())
    # when to fork the next spare supervisor, and the ranks it forks ahead: as many as the
    # last run started
    spare_due = time.monotonic() if spare_now is not None else None
    ahead = spare_now or 0
    global _spare
    while True:
        due = [t for t in (spare_due, *(h.deadline for h in _handing)) if t is not None]
        wait = None if not due else max(0.0, min(due) - time.monotonic())
        links = [h.spare.link.fileno() for h in _handing]
        readable, _, _ = select.select([sock.fileno(), wake_r, *links], [], [], wait)
        if spare_due is not None and time.monotonic() >= spare_due:
            spare_due = None
            _spare = _fork_spare(sock, (wake_r, wake_w), ahead)  # for the next detached run
        for handing in list(_handing):
            _follow(handing, handing.spare.link.fileno() in readable, sock, (wake_r, wake_w))
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
                # what the kernel has (see _launch.forkserver.WARM)
                import_without_cuda(msg.preload)
                pid = _fork_worker(sock, fds, has_listen=msg.has_listen, wake=(wake_r, wake_w))
                for fd in fds:
                    os.close(fd)
                send(sock, Forked(pid))
            elif isinstance(msg, Supervise):  # (its fds: kept until a supervisor took it)
                pid = _fork_supervisor(sock, fds, msg, wake=(wake_r, wake_w))
                send(sock, Forked(pid))
                # the next spare a little later: not while this run's ranks start
                spare_due = time.monotonic() + SPARE_DELAY
                ahead = msg.forks


def _reap(sock: socket.socket) -> None:
    while True:
        try:  # which child ended, without reaping it yet: its pid still names its group
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == 0:
            return
        kill_process_group(info.si_pid)
        _, status = os.waitpid(info.si_pid, 0)
        send(sock, Exited(info.si_pid, os.waitstatus_to_exitcode(status)))


def _fork_worker(
    sock: socket.socket, fds: list[int], has_listen: bool, wake: tuple[int, int]
) -> int:
    server = os.getpid()
    pid = quiet_fork()
    if pid:
        try:
            os.setpgid(pid, pid)  # as the rank does itself: whoever runs first
        except OSError:
            pass
        return pid
    from multiprocessing.connection import Connection

    from . import entry

    sock.close()
    for fd in wake:
        os.close(fd)
    if _spare is not None:  # (else the spare would wait as long as this rank lives)
        _spare.link.close()
    for handing in _handing:  # (nor a run being handed over)
        handing.spare.link.close()
        close_quietly(*handing.fds)
    conn_fd, out_w, err_w = fds[:3]
    listen_fd = fds[3] if has_listen else None
    entry.run(Connection(conn_fd), out_w, err_w, listen_fd, server)


#: Seconds after a detached run's start before the next spare supervisor is forked.
SPARE_DELAY = 0.25


class _Spare:
    """A spare supervisor, seen from here: this server's end of the link to it, and its pid
    once it said it (:class:`Spare`)."""

    def __init__(self, link: socket.socket) -> None:
        self.link = link
        self.pid: int | None = None
        self.said = FrameReader()
        self.ended = False  # it closed the link (its last words heard first)

    def hear(self) -> list[Any]:
        """What it said since the last look (its pid noted); :attr:`ended` once it closed
        the link (a spare that took its run closes it at once)."""
        self.link.setblocking(False)
        heard: list[Any] = []
        try:
            while not self.ended:
                data = self.link.recv(4096)
                self.ended = not data
                heard += self.said.feed(data)
        except BlockingIOError:
            pass
        except OSError:
            self.ended = True
        finally:
            self.link.setblocking(True)
        for said in heard:
            if isinstance(said, Spare):
                self.pid = said.pid
        return heard

    def close(self, kill: bool = False) -> None:
        """Let go of it (``kill``: one that did not take its run -- stopped, or stuck --
        killed, its ranks forked ahead with it; one that never said its pid leaves when it
        sees the link closed)."""
        if kill:
            self.hear()
            if self.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
        close_quietly(self.link.detach())


@dataclass
class _Handing:
    """A run sent to a spare supervisor, until it says it took it (:class:`Taken`): its
    request and fds (the kernel's) are kept until then."""

    spare: _Spare
    msg: Supervise
    fds: list[int]
    deadline: float
    fresh: bool  # a supervisor forked for this run (not one that waited)


#: The spare supervisor waiting for the next detached run (:func:`_fork_supervisor`), once
#: one was asked for; every process forked here closes its link.
_spare: _Spare | None = None
#: The runs sent to a supervisor that has not said it took them yet.
_handing: list[_Handing] = []
#: Seconds a spare that waited has to say it took its run: one that does not (stopped, or
#: stuck) is killed, and a supervisor forked then gets the run. One forked for the run has
#: :data:`FRESH_ANSWER`. Checked beside the server's other work: the kernel, told at once,
#: waits for its supervisor's pid as it always does.
SPARE_ANSWER = 2.0
FRESH_ANSWER = 30.0


def _fork_supervisor(
    sock: socket.socket, fds: list[int], msg: Supervise, wake: tuple[int, int]
) -> int:
    """Hand a detached run to a supervisor forked ahead of need (a *spare*: out of our
    session and parentage already, waiting for its run); :func:`serve` forks the next one
    a little later, so that a kernel's second and later detached runs wait for no fork.
    The first run's spare is forked for it. The spare must say it took the run
    (:func:`_follow`). Returns 0; no :class:`Exited` follows, a supervisor is not our
    child."""
    global _spare
    spare, fresh = _spare, False
    _spare = None  # (it is the run's now)
    if spare is None:
        spare, fresh = _fork_spare(sock, wake), True
    _hand(spare, msg, fds, fresh, sock, wake)
    return 0  # (the next spare is forked a little later: serve())


def _hand(
    spare: _Spare,
    msg: Supervise,
    fds: list[int],
    fresh: bool,
    sock: socket.socket,
    wake: tuple[int, int],
) -> None:
    for _ in range(2):  # a spare that died meanwhile: one more, forked now
        try:
            send(spare.link, msg, fds)
        except OSError:
            spare.close()
            spare, fresh = _fork_spare(sock, wake), True
            continue
        wait = FRESH_ANSWER if fresh else SPARE_ANSWER
        _handing.append(_Handing(spare, msg, fds, time.monotonic() + wait, fresh))
        return
    spare.close()
    close_quietly(*fds)  # (the kernel hears no pid, and says the supervisor did not start)


def _follow(handing: _Handing, readable: bool, sock: socket.socket, wake: tuple[int, int]) -> None:
    """A run being handed over: done when its supervisor says it took it; handed to a
    supervisor forked now when the spare does not say so in time (or ends first)."""
    took = readable and any(isinstance(said, Taken) for said in handing.spare.hear())
    if not took and handing.spare.ended:
        handing.deadline = 0.0  # (it ended before it took the run)
    if took:
        _handing.remove(handing)
        handing.spare.close()
        close_quietly(*handing.fds)
    elif time.monotonic() >= handing.deadline:
        _handing.remove(handing)
        handing.spare.close(kill=True)
        if handing.fresh:  # (one forked for it did not take it either: given up)
            close_quietly(*handing.fds)
            return
        _hand(_fork_spare(sock, wake), handing.msg, handing.fds, True, sock, wake)


def _fork_spare(sock: socket.socket, wake: tuple[int, int], ahead: int = 0) -> _Spare:
    """Fork a spare supervisor (``_supervise.spare``; it forks ``ahead`` ranks while it
    waits); returns once its go-between left."""
    from .. import _supervise  # the first time: its modules, for this one and the next

    _supervise.preload()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = quiet_fork()
    if pid:
        theirs.close()
        os.waitpid(pid, 0)  # it forks the spare and leaves
        return _Spare(ours)
    try:
        signal.set_wakeup_fd(-1)
        sock.detach()  # (closed below, with every fd of the server's: no object owns them)
        ours.detach()
        keep = theirs.detach()
        # nothing of the server's: the kernel sees its end of file, not the spare's, and
        # the fds of a request being served (a handshake pipe) end when their run says
        os.closerange(3, keep)
        os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
        _supervise.spare(keep, ahead)
    finally:
        os._exit(1)  # (spare() never returns)


def main() -> None:
    if os.getppid() != int(sys.argv[2]):  # the kernel is gone already
        sys.exit(1)
    # Jupyter interrupts the kernel's whole process group: that is for the workers
    # (they reset SIGINT when forked), not for the server that outlives launches.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    spare_now = int(sys.argv[3]) if len(sys.argv) > 3 else None
    _preload()
    try:
        serve(sock, spare_now)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the kernel went away (or gave up on us while we imported): nothing to say
    finally:
        sock.close()


if __name__ == "__main__":
    main()
