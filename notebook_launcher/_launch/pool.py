"""Ranks forked ahead of their run: a detached run's spare supervisor (``_supervise.spare``)
forks them while it waits for its run, so that the run's start does not wait for a fork per
rank (each one a copy of a process that imported torch: 5-10 ms, one after the other).

A *blank* rank is a child of the supervisor that holds its ends of a rank's channels (the
control socket, stdout, stderr) and waits on the socket for its go: one byte, with the
rendezvous listener for rank 0 (SCM_RIGHTS). Before any go, the supervisor asks every
blank to answer (:meth:`RankPool.ask`, as its run comes: the answers come while it reads
the run's task) and takes only those that did within :data:`BLANK_ANSWER`
(:meth:`RankPool.keep_answering`): one that did not (stopped, or stuck) is killed, and
ranks forked then take its place, so that no run waits on it. It then runs the rank's entry as a forkserver's
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
import time
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
#: Seconds a blank forked ahead has to answer (:meth:`RankPool.ask`) before its run uses it.
BLANK_ANSWER = 2.0
#: The supervisor's question to a blank, and the blank's answer (a go is ``L`` or ``N``).
_ASK, _ANSWER = b"?", b"!"


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

    def ask(self) -> None:
        """Ask every blank to answer (:meth:`keep_answering` takes the answers)."""
        for blank in self.blanks:
            try:
                blank.sock.send(_ASK)
            except OSError:
                pass  # (it died: it gives no answer)

    def keep_answering(self, timeout: float = BLANK_ANSWER) -> None:
        """Keep the blanks that answered :meth:`ask` within ``timeout``; kill the others
        (stopped, stuck or dead: a run must not wait on them)."""
        import select

        waiting = {blank.sock: blank for blank in self.blanks}
        failed = []
        deadline = time.monotonic() + timeout
        while waiting and (left := deadline - time.monotonic()) > 0:
            for sock in select.select(list(waiting), [], [], left)[0]:
                blank = waiting.pop(sock)
                try:
                    answered = sock.recv(1) == _ANSWER
                except OSError:
                    answered = False
                if not answered:  # (it died)
                    failed.append(blank)
        for blank in [*failed, *waiting.values()]:
            self.blanks.remove(blank)
            self._kill(blank)

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
            blank = self.blanks.pop(0) if self.blanks else self._fork(stale)
            fds = [req.listen_fd] if req.listen_fd is not None else []
            try:
                socket.send_fds(blank.sock, [b"L" if fds else b"N"], fds)
                break
            except OSError:  # it died while it waited: the next one
                self._kill(blank)
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


def _wait_for_go(sock: socket.socket, out_w: int, err_w: int, parent: int) -> NoReturn:
    """A blank rank: answer the supervisor's questions (:meth:`RankPool.ask`), wait for
    the go, then be the rank (``_worker.entry.run``)."""
    die_with_parent(parent)
    try:
        while (said := socket.recv_fds(sock, 1, 1))[0] == _ASK:
            sock.sendall(_ANSWER)
        go, fds, _, _ = said
    except OSError:
        os._exit(0)
    if not go:  # the supervisor closed it: no run for this one
        os._exit(0)
    from multiprocessing.connection import Connection

    from .._worker import entry  # a forked rank's one crossing to the rank side

    entry.run(Connection(sock.detach()), out_w, err_w, fds[0] if fds else None, parent)
