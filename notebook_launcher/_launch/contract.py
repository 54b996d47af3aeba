"""The group contract: what every owner of ranks offers, and what a rank handle says.

Two groups keep ranks today -- :class:`~.group.WorkerGroup` (this machine's processes) and
:class:`~.remote.RemoteGroup` (a cluster's, through its nodes' agents) -- and one owner drives
either through every phase (:class:`~.lifecycle.GroupRun`: a launch attempt, a session's
start, a session's task). This module writes down what that owner relies on, so that a third
group -- a supervisor that outlives the kernel, which the kernel attaches to -- is written
against a contract rather than against two examples. mypy holds the two groups to it where
they are made (``LaunchPlan.group``), and ``tests/test_lifecycle.py`` holds it at run time.

::

    GroupRun ── start(on_abort) ───────────────▶ Group ── forks/asks ──▶ ranks
    .drive() ── pump(timeout, wake) ───────────▶       ◀── events, exits ──
             ── terminate() / stop() / close() ▶
                   callbacks: on_event(Event), on_exit(RankHandle), on_message(RankHandle, msg)
                   (given once, when the group is made: the run hands them to its policy)

Plain protocols: nothing here imports the groups, torch, or the UI.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from .._events import Event


@runtime_checkable
class RankHandle(Protocol):
    """One rank as its group reports it (a local process, or a rank an agent runs)."""

    rank: int
    pid: int
    #: its exit status once it ended (``-signal`` when killed); None while it runs
    returncode: int | None
    #: its pickled return value, its failure record and pickled exception, when it sent one
    result: bytes | None
    failure: Any
    exc_data: bytes | None
    #: what it was doing when it ended ("starting", "receiving its task", "running")
    stage: str
    #: why it ended, when the group knows better than its exit status
    note: str
    #: the group sent it SIGTERM or SIGKILL: a signal it ends by is ours, not a death
    signalled: bool

    @property
    def exited(self) -> bool: ...

    @property
    def conn_open(self) -> bool: ...

    def send_signal(self, sig: int) -> None: ...

    def interrupt(self) -> None:
        """SIGINT to the rank's main thread (a session task's Ctrl-C)."""


@runtime_checkable
class Group(Protocol):
    """Ranks of one run, from their start to their end, driven by one owner.

    ``start`` starts every rank (on any failure, Ctrl-C included, it stops those started,
    tells ``on_abort`` and raises); ``pump`` waits once on everything the ranks may say,
    hands it to the callbacks, and drives a staged stop; ``terminate`` begins that stop
    (SIGTERM now, SIGKILL after the grace period); ``stop`` stops and waits; ``close`` kills
    what is left, reaps it and releases every resource (idempotent)."""

    @property
    def running(self) -> Sequence[Any]: ...

    @property
    def finished(self) -> bool: ...

    def start(self, on_abort: Callable[[BaseException], None] | None = None) -> None: ...

    def pump(self, timeout: float | None, wake: int | None = None) -> None: ...

    def send(self, proc: Any, message: Any) -> bool: ...

    def proc(self, rank: int) -> Any: ...

    def terminate(self) -> None: ...

    def stop(self) -> None: ...

    def close(self) -> None: ...


#: What builds a run's group, given the run's callbacks (``GroupRun``'s ``make_group``).
MakeGroup = Callable[
    [Callable[[Event], None], Callable[[Any], None], Callable[[Any, Any], None] | None], Group
]

__all__ = ["Group", "MakeGroup", "RankHandle"]
