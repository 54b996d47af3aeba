"""Ranks forked ahead of their run: a detached run's spare supervisor (``_supervise.spare``)
forks them while it waits for its run, so that the run's start does not wait for a fork per
rank (each one a copy of a process that imported torch: 5-10 ms, one after the other).

A *blank* rank is a child of the supervisor that holds its ends of a rank's channels (the
control socket, stdout, stderr) and waits on the socket for its go: one byte, with the
rendezvous listener for rank 0 (SCM_RIGHTS). It answers the go at once (one byte back): a
blank that does not within :data:`BLANK_ANSWER` (stopped, or stuck) is killed and the next
one (or one forked then) takes its place, so that no run waits on it. It then runs the rank's entry as a forkserver's
rank does: its :class:`~notebook_launcher._wire.control.Setup` (who it is, the kernel's
environment, directory and path) and :class:`~notebook_launcher._wire.control.Task` (the
function, pickled) come down the socket. It dies with its supervisor (a parent-death
signal), before and after its go; blanks nobody took are killed and reaped by
:meth:`RankPool.close`.

Used by a run whose task is small (:data:`MAX_TASK`): a large one is unpickled once in the
supervisor and its ranks inherit it (fork), rather than once per rank.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from .._posix import close_quietly, die_with_parent, quiet_fork
from .._wire.control import Channel

if TYPE_CHECKING:
    from .group import StartRequest, WorkerProcess

#: Largest pickled task the pool's ranks each unpickle themselves (bytes); a larger one is
#: unpickled once, in the supervisor, and forked ranks inherit it.
MAX_TASK = 1 << 20
#: Seconds a blank forked ahead has to answer its go (one that does not is replaced); one
#: forked for the rank that moment has :data:`FRESH_ANSWER`.
BLANK_ANSWER = 2.0
FRESH_ANSWER = 30.0
#: A blank's answer to its go.
_ANSWER = b"A"


@dataclass
class Blank:
    """A rank forked ahead, waiting for its go: the supervisor's ends of its channels."""

    pid: int
    sock: socket.socket
    out_r: int
    err_r: int

    def close(self) -> None:
        self.sock.close()
        close_quietly(self.out_r, self.err_r)


class RankPool:
    """The blank ranks of one supervisor (see the module's docstring)."""

    def __init__(self, close_in_child: tuple[int, ...] = ()) -> None:
        #: fds of the supervisor a blank closes first (its link to the forkserver)
        self.close_in_child = close_in_child
        self.blanks: list[Blank] = []

    def prefork(self, count: int) -> None:
        for _ in range(count):
            self.blanks.append(self._fork())

    def covers(self, ranks: int) -> bool:
        return len(self.blanks) >= ranks

    def _fork(self, stale: Sequence[int] = ()) -> Blank:
        """A blank, forked now; it closes ``stale`` first (a running group's fds: its
        other ranks' ends, the listener) besides :attr:`close_in_child`."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        parent = os.getpid()
        pid = quiet_fork()
        if pid == 0:
            try:
                close_quietly(ours.detach(), out_r, err_r, *self.close_in_child, *stale)
                for blank in self.blanks:  # its siblings' ends
                    close_quietly(blank.sock.detach(), blank.out_r, blank.err_r)
                _wait_for_go(theirs, out_w, err_w, parent)
            finally:
                os._exit(1)
        theirs.close()
        close_quietly(out_w, err_w)
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
        return Blank(pid, ours, out_r, err_r)

    def start(self, req: StartRequest, parent_fds: list[int]) -> WorkerProcess:
        """A starter of :class:`~notebook_launcher._launch.group.WorkerGroup`: the rank of
        ``req`` is a blank (one forked now if none is left: a restart's ranks), given its
        go; the group then sends its Setup and Task."""
        from .group import WorkerProcess

        # a blank forked now leaves the group's fds and the ends made for this rank (still
        # open: closed below, once it has its own, so that no number is reused meanwhile)
        stale = [*parent_fds, req.child_conn.fileno(), req.out_w, req.err_w]
        if req.listen_fd is not None:  # (rank 0's copy comes with its go)
            stale.append(req.listen_fd)
        while True:
            fresh = not self.blanks
            blank = self._fork(stale) if fresh else self.blanks.pop(0)
            fds = [req.listen_fd] if req.listen_fd is not None else []
            try:
                socket.send_fds(blank.sock, [b"L" if fds else b"N"], fds)
                if _answered(blank.sock, FRESH_ANSWER if fresh else BLANK_ANSWER):
                    break
            except OSError:  # it died while it waited: the next one
                pass
            self._kill(blank)  # (stopped, or stuck: the next one, or one forked now)
            if fresh:
                raise OSError(
                    f"rank {req.spec.rank}, forked for it, did not answer its go within "
                    f"{FRESH_ANSWER:.0f} s (a machine out of memory or processes?)"
                )
        req.close()  # the fresh ends made for it: a blank has its own
        blank.sock.setblocking(True)
        from multiprocessing.connection import Connection

        return WorkerProcess(
            rank=req.spec.rank,
            pid=blank.pid,
            channel=Channel(Connection(blank.sock.detach())),
            pipes={"stdout": blank.out_r, "stderr": blank.err_r},
            pidfd=os.pidfd_open(blank.pid),
        )

    def trim(self, keep: int) -> None:
        """Kill and reap the blanks beyond the first ``keep``."""
        while len(self.blanks) > keep:
            self._kill(self.blanks.pop())

    def close(self) -> None:
        """Kill and reap the blanks nobody took."""
        self.trim(0)

    @staticmethod
    def _kill(blank: Blank) -> None:
        try:
            os.kill(blank.pid, signal.SIGKILL)
            os.waitpid(blank.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        blank.close()


def _answered(sock: socket.socket, timeout: float) -> bool:
    """A blank answered its go within ``timeout``."""
    import select

    if not select.select([sock], [], [], timeout)[0]:
        return False
    return sock.recv(1) == _ANSWER


def _wait_for_go(sock: socket.socket, out_w: int, err_w: int, parent: int) -> NoReturn:
    """A blank rank: wait for the go, answer it, then be the rank (``_worker.entry.run``)."""
    die_with_parent(parent)
    try:
        go, fds, _, _ = socket.recv_fds(sock, 1, 1)
        if go:
            sock.sendall(_ANSWER)
    except OSError:
        os._exit(0)
    if not go:  # the supervisor closed it: no run for this one
        os._exit(0)
    from multiprocessing.connection import Connection

    from .._worker import entry  # a forked rank's one crossing to the rank side

    entry.run(Connection(sock.detach()), out_w, err_w, fds[0] if fds else None, parent)
