"""One owner of a group's lifecycle, one loop that drives it, and the one decision of how
a run ended.

Every way of running ranks -- a one-shot launch (each attempt of it), a session's start and
each of its tasks, the ranks on a cluster's nodes -- goes through the same steps, in the
same phases (:class:`Phase`; torch elastic's ``WorkerState`` and its one ``_invoke_run`` loop
are the model):

    GroupRun            start -> drive(policy): the one loop that waits on the ranks
    (a group's life)    (events to the policy: the record, the view and the stall watch;
    STARTING, RUNNING,  a failure stops the others) -> stop(Stop, reason) -> close()
    STOPPING, ENDED           |                                               |
         |                    +-- Policy: done? how long a wait? the wake fd;  |
         v                        after each wait; what the ranks said         v
    RunRecord           results, failures, barriers, the stop flags    ->   RunEnd (frozen)
                                                                               |
    decide(RunEnd)      pure, once per end: records + flags -> Outcome (its Kind, the
                        summary line, the root cause's rank): a table, tested as one
                        (tests/test_lifecycle.py)
         |
         +--> finished_event(end, outcome): the one ``LaunchFinished`` the view gets
         +--> value_of(end, outcome): the per-rank results, or the exception to raise

:class:`GroupRun` owns a ``WorkerGroup`` or a ``RemoteGroup`` (anything that keeps the
group contract, :class:`.contract.Group`: ``start / pump / terminate / stop / close`` and
callbacks, given once when it is made) and its :class:`RunRecord`; the stop flags are set
in one place (``RunRecord.stop``). :meth:`GroupRun.drive` is the only loop outside the
groups' own stop and close that waits on ranks. What differs between runs is a
:class:`Policy`: a launch attempt's (``launcher._Attending``: the other nodes' word), a
session's start (``session._StartingUp``: until every rank serves), its tasks
(``session._Serving``: the pump thread, its deadlines, interrupts, re-forming the group)
and its close (``session._Closing``) -- and each judges with :func:`decide`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._events import Event, LaunchFinished
from ..errors import (
    LaunchError,
    LaunchFailure,
    ProcessGroupMismatch,
    RankFailedError,
    RankFailure,
    SessionBroken,
    interrupted,
    rank_list,
)
from . import stall
from .contract import Group
from .diagnosis import Stranded, Verdict, diagnose, exception_for, summary_line
from .record import RunRecord, Stop, Word


class Purpose(Word):
    """What a run was (the words of its end differ). A ``str``: compared with its word,
    or carried in a record to another process, it reads the same."""

    #: an attempt of a one-shot launch
    LAUNCH = "launch"
    #: a session's ranks coming up
    START = "start"
    #: a session's task
    TASK = "task"


class Kind(Word):
    """How a run ended (:attr:`Outcome.kind`); a ``str`` as :class:`Purpose` is."""

    OK = "ok"
    #: a session's ranks came up
    READY = "ready"
    INTERRUPTED = "interrupted"
    #: a rank's failure is the root cause
    FAILED = "failed"
    NOT_STARTED = "not started"
    #: a session's task waits in a collective that needs ranks outside it
    MISMATCH = "mismatch"
    BROKEN = "broken"
    #: the session was closed while the task ran
    CLOSED = "closed"
    #: ranks without a result and no failure to say why: never returned as a short list
    SHORT = "short"


@dataclass(frozen=True)
class RunEnd:
    """What one run of ranks left, frozen when it closed: the input of :func:`decide`."""

    #: what the run was, for the words of its end (:class:`Purpose`; its word will do)
    purpose: Purpose | str
    #: the run's ranks in the order asked (a task's values follow it)
    ranks: tuple[int, ...]
    #: the job's world size (a task's ranks are some of it)
    world_size: int
    results: Mapping[int, Any] = field(default_factory=dict)
    failures: tuple[RankFailure, ...] = ()
    finished_at: Mapping[int, float] = field(default_factory=dict)
    exc_data: Mapping[int, bytes | None] = field(default_factory=dict)
    stranded: Stranded | None = None
    #: why the ranks were stopped (``RunRecord.stop``'s kinds), and whether the user
    #: interrupted them
    stop_kind: Stop | str | None = None
    interrupted: bool = False
    #: the run never ran: the nodes never met, or its ranks could not start (Ctrl-C
    #: included)
    start_error: BaseException | None = None
    wall_time: float = 0.0
    #: a launch: how many times its ranks were started again
    restarts: int = 0
    #: a session's task: a collective it cannot finish (cells on some ranks), why the
    #: session broke, whether the session was closing
    mismatch: str | None = None
    broken: str | None = None
    closing: bool = False
    #: a verdict already reached with every node (a launch across nodes); else the
    #: records decide
    verdict: Verdict | None = None
    #: rank -> why its stop (or end) is not confirmed: its node's agent did not answer
    unconfirmed: Mapping[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "purpose", Purpose(self.purpose))

    @classmethod
    def of(
        cls,
        record: RunRecord,
        purpose: Purpose | str,
        world_size: int,
        wall_time: float,
        ranks: tuple[int, ...] | None = None,
        **extra: Any,
    ) -> RunEnd:
        """A frozen copy of what ``record`` holds; ``extra``: the other fields (or ones
        that replace the record's, e.g. a session's ready ranks as its ``results``)."""
        fields: dict[str, Any] = {
            "purpose": purpose,
            "ranks": tuple(record.ranks) if ranks is None else ranks,
            "world_size": world_size,
            "results": dict(record.results),
            "failures": tuple(record.failures),
            "finished_at": dict(record.finished_at),
            "exc_data": dict(record.exc_data),
            "stranded": record.barriers.stranded,
            "stop_kind": record.stop_kind,
            "interrupted": record.interrupted,
            "wall_time": wall_time,
        }
        fields.update(extra)
        return cls(**fields)

    def judged(self) -> Verdict:
        """The root cause among the ranks' records (``diagnosis.diagnose``)."""
        if self.verdict is not None:
            return self.verdict
        return diagnose(self.failures, self.finished_at, self.stranded)


@dataclass(frozen=True)
class Outcome:
    """How a run ended: its :class:`Kind`, the summary line, the verdict, the root cause's
    rank, and the ranks without a result (``Kind.SHORT``)."""

    kind: Kind
    summary: str
    verdict: Verdict
    root_cause_rank: int | None = None
    missing: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return self.kind in (Kind.OK, Kind.READY)


def decide(end: RunEnd) -> Outcome:
    """The outcome of a run, from its frozen records and flags alone (pure)."""
    verdict = end.judged()
    n = len(end.ranks) if end.purpose is Purpose.TASK else end.world_size
    cause = getattr(verdict.cause, "rank", None)
    if end.start_error is not None:
        if isinstance(end.start_error, KeyboardInterrupt):
            return Outcome(Kind.INTERRUPTED, "interrupted while starting", verdict)
        text = f"{type(end.start_error).__name__}: {end.start_error}"
        return Outcome(Kind.NOT_STARTED, text.splitlines()[0] if text else text, verdict)
    if end.purpose is Purpose.TASK and end.closing:
        return Outcome(Kind.CLOSED, "the session was closed while the task ran", verdict, cause)
    if end.mismatch is not None:
        return Outcome(Kind.MISMATCH, end.mismatch.split(". ", 1)[0], verdict, cause)
    stopped = end.interrupted
    if stopped:
        if end.purpose is Purpose.TASK and end.broken is None:
            text = f"interrupted: ranks {list(end.ranks)} stopped their task; the session lives on"
        else:
            text = summary_line(verdict, n, True)
        if end.unconfirmed:
            text = _unconfirmed(end, n)
        kind = Kind.BROKEN if end.broken is not None else Kind.INTERRUPTED
        return Outcome(kind, _restarted(text, end.restarts), verdict)
    if not verdict.ok:
        return Outcome(
            Kind.FAILED, _restarted(summary_line(verdict, n), end.restarts), verdict, cause
        )
    if end.broken is not None:
        return Outcome(Kind.BROKEN, f"the session broke: {end.broken}", verdict)
    missing = tuple(r for r in end.ranks if r not in end.results)
    if end.purpose is Purpose.START:
        if missing:
            return Outcome(Kind.SHORT, "the session's ranks ended while starting", verdict)
        return Outcome(Kind.READY, f"{n} ranks ready", verdict)
    if missing:
        what = f"ranks {list(missing)} ended without a result"
        return Outcome(Kind.SHORT, what, verdict, missing=missing)
    return Outcome(Kind.OK, _restarted(summary_line(verdict, n), end.restarts), verdict)


def _unconfirmed(end: RunEnd, n: int) -> str:
    """``interrupted: 2 of 4 ranks stopped; ranks 2, 3: not confirmed (node 1 (h2) did not
    answer ...)``: a stop is said only of the ranks whose end was reported."""
    by_why: dict[str, list[int]] = {}
    for rank, why in sorted(end.unconfirmed.items()):
        by_why.setdefault(why, []).append(rank)
    told = "; ".join(f"{rank_list(rs)}: not confirmed ({why})" for why, rs in by_why.items())
    return f"interrupted: {n - len(end.unconfirmed)} of {n} ranks stopped; {told}"


def _restarted(summary: str, restarts: int) -> str:
    if not restarts:
        return summary
    return f"{summary} (after {restarts} restart{'s' if restarts > 1 else ''})"


def finished_event(end: RunEnd, outcome: Outcome, now: float | None = None) -> LaunchFinished:
    """The one ``LaunchFinished`` a run's view gets."""
    now = time.time() if now is None else now
    failed = outcome.verdict.failed_ranks
    return LaunchFinished(
        outcome.ok,
        outcome.summary,
        outcome.root_cause_rank,
        end.wall_time,
        now,
        failed if end.start_error is None else (),
        end.restarts,
        outcome.kind is Kind.INTERRUPTED,
    )


def value_of(
    end: RunEnd, outcome: Outcome, history: tuple[str, ...] = ()
) -> list[Any] | BaseException:
    """What the caller gets: the per-rank results (in the order asked), or the exception to
    raise (the rank's own, rebuilt; ``WorkerDied``; ``ProcessGroupMismatch``; an interrupt
    that says so...). ``history``: how each earlier attempt ended (restarts)."""
    verdict = outcome.verdict
    kind = outcome.kind
    if kind in (Kind.OK, Kind.READY):
        return [end.results.get(r) for r in end.ranks]
    if kind is Kind.CLOSED:
        return LaunchError("the session was closed while the task ran")
    if kind is Kind.NOT_STARTED:
        assert end.start_error is not None
        return end.start_error
    if kind is Kind.MISMATCH:
        assert end.mismatch is not None
        failure = RankFailure(min(end.ranks), "left", message=end.mismatch, time=time.time())
        report = LaunchFailure(failure, list(end.failures), len(end.ranks))
        return ProcessGroupMismatch(end.mismatch, report)
    if kind is Kind.INTERRUPTED:
        if end.start_error is not None:
            return interrupted("interrupted while starting: no rank was left running")
        what = (
            f"interrupted: ranks {sorted(end.ranks)} stopped their task"
            if end.purpose is Purpose.TASK
            else f"interrupted: all {len(end.ranks)} ranks stopped"
        )
        if end.unconfirmed:
            what = _unconfirmed(end, len(end.ranks))
        return interrupted(what)
    if kind is Kind.BROKEN:
        if end.interrupted:
            return SessionBroken(f"interrupted, but the session broke: {end.broken}")
        return SessionBroken(f"the session broke while the task ran: {end.broken}")
    cause = verdict.cause
    if cause is not None and cause.exc_type == "builtins.KeyboardInterrupt":  # elsewhere
        report = LaunchFailure(cause, list(verdict.failures), end.world_size, list(history))
        return RankFailedError(
            f"the launch was {cause.message}: every rank of the job was stopped.\n"
            + report.summary(),
            report,
        )
    if kind is Kind.FAILED:
        return exception_for(verdict, end.world_size, end.exc_data, history)
    if end.purpose is Purpose.START:
        return LaunchError("the session's ranks ended while starting")
    return LaunchError(f"ranks {list(outcome.missing)} ended without a result")


def add_note(exc: BaseException, note: str | None) -> None:
    if note and hasattr(exc, "add_note"):
        exc.add_note(note)


class Phase(enum.Enum):
    """Where a :class:`GroupRun` stands (torch elastic's ``WorkerState``, for one run)."""

    #: made, its ranks not started yet (or starting)
    STARTING = "starting"
    #: its ranks started: the controller's loop drives it
    RUNNING = "running"
    #: its ranks are being stopped (``RunRecord.stop``: a failure, an interrupt...)
    STOPPING = "stopping"
    #: closed: every rank reaped, its :class:`RunEnd` frozen
    ENDED = "ended"


class Policy:
    """What the owner of a run (a launch attempt, a session's start, a session's tasks, its
    close) does differently from the others: the controller (:meth:`GroupRun.drive`)
    consults it, and the run's group hands it everything the ranks say (the callbacks are
    the run's, given once when the group is made; the policy is what changes).

    This one is a plain run's (a launch attempt's, a session's start): its ranks' events go
    to the run's record, stall watch and view; a failure stops the others; the loop ends
    when every rank ended. A policy that needs more overrides what it needs."""

    #: an fd that ends the wait early (the other nodes' link, a session's wake pipe)
    wake: int | None = None
    #: the ranks' answers (``Returned``, ``Raised``, ``Reformed``) come to
    #: :meth:`on_message` (a session's ranks serve tasks); False: the group keeps them on
    #: the rank's handle, read when it exits (a launch's ranks answer once). Fixed for a
    #: run's life: its group is made with it.
    answers: bool = False

    def done(self, run: GroupRun) -> bool:
        """Whether the loop ends now."""
        return run.finished

    def timeout(self, run: GroupRun) -> float | None:
        """How long the next wait may be (None: until a rank speaks or ``wake``)."""
        return run.watch.timeout(TICK)

    def after_pump(self, run: GroupRun) -> None:
        """After each wait: the view and the stall watch tick; a rank that failed stops
        the others."""
        run.view.tick()
        run.watch.tick()
        if run.record.failed:
            run.stop(Stop.FAILED)

    def survives(self, run: GroupRun, error: Exception) -> bool:
        """An error in a turn of the loop: True when the policy dealt with it and the loop
        goes on (a session's pump thread must never die silently); False: it is raised."""
        return False

    # -- what the ranks say (the group's callbacks, through the run) -------------------------

    def on_event(self, run: GroupRun, event: Event) -> None:
        run.record.on_event(event)
        run.watch.saw(event)
        run.view.handle(event)

    def on_exit(self, run: GroupRun, proc: Any) -> None:
        for event in run.record.on_exit(proc):
            run.view.handle(event)

    def on_message(self, run: GroupRun, proc: Any, message: Any) -> None:
        pass


#: Seconds a plain run's wait lasts at most (the view ticks between waits).
TICK = 0.5


class GroupRun:
    """One group of ranks from its start to its end: the one owner of its lifecycle, and
    the controller of every run -- its one loop, :meth:`drive`, is the only place outside
    the groups themselves that waits on ranks.

    ``make_group(on_event, on_exit, on_message)`` builds the group (a ``WorkerGroup`` or a
    ``RemoteGroup``) with this run's callbacks, once; each hands what it gets to the run's
    :class:`Policy` of the moment (``policy``: the first; :meth:`drive` may be given
    another: a session's ranks are started under one, then serve tasks under another).
    :meth:`close` returns the frozen :class:`RunEnd`. ``phase``: where it stands.
    """

    def __init__(
        self,
        make_group: Callable[..., Group],
        ranks: list[int],
        view: Any,
        watch: stall.StallWatch | None = None,
        policy: Policy | None = None,
    ) -> None:
        self.record = RunRecord(ranks)
        self.view = view
        self.watch = watch if watch is not None else stall.StallWatch(None, view.handle)
        self.t0 = time.time()
        self.phase = Phase.STARTING
        self.policy = policy if policy is not None else Policy()
        on_message = self._on_message if self.policy.answers else None
        self.group: Group = make_group(self._on_event, self._on_exit, on_message)
        self.watch.watch(stall.of_group(self.group))
        self.start_error: BaseException | None = None
        self._end: RunEnd | None = None

    def _on_event(self, event: Event) -> None:
        self.policy.on_event(self, event)

    def _on_exit(self, proc: Any) -> None:
        self.policy.on_exit(self, proc)

    def _on_message(self, proc: Any, message: Any) -> None:
        self.policy.on_message(self, proc, message)

    @property
    def finished(self) -> bool:
        return bool(self.group.finished)

    def start(self) -> None:
        """Start the ranks; a start that fails (Ctrl-C included) stops those started,
        notes why, and raises."""
        try:
            self.group.start(on_abort=self.record.abort)
        except BaseException as exc:
            self.start_error = exc
            raise
        if self.phase is Phase.STARTING:
            self.phase = Phase.RUNNING

    def drive(self, policy: Policy | None = None) -> None:
        """The controller's loop: until ``policy`` (from now on the run's) says it is done,
        wait on the ranks (as long as it says: less when the stall watch is due), fold in
        what they said (the callbacks: through the policy), then let it look (ticks,
        deadlines, a failure that stops the others)."""
        if policy is not None:
            assert policy.answers == self.policy.answers, "a run's group was made for the other"
            self.policy = policy
        policy = self.policy
        group = self.group
        while not policy.done(self):
            try:
                group.pump(policy.timeout(self), wake=policy.wake)
                policy.after_pump(self)
            except Exception as error:
                if not policy.survives(self, error):
                    raise

    def stop(self, kind: Stop | str, reason: str = "", *, wait: bool = False) -> None:
        """Stop the ranks (``RunRecord.stop``'s kinds): SIGTERM, SIGKILL after the grace
        period (driven by :meth:`drive`); ``wait``: until they are gone (Ctrl-C: a second
        one kills what is left)."""
        kind = Stop(kind)
        if self.record.stop(kind, reason) or kind is Stop.INTERRUPTED:
            if self.phase is not Phase.ENDED:
                self.phase = Phase.STOPPING
            if wait:
                self.group.stop()
            else:
                self.group.terminate()

    def snapshot(
        self, purpose: Purpose | str, world_size: int | None = None, **extra: Any
    ) -> RunEnd:
        """What the run's records say now, frozen (a session's start: its ranks live on)."""
        return RunEnd.of(
            self.record,
            purpose,
            len(self.record.ranks) if world_size is None else world_size,
            time.time() - self.t0,
            start_error=self.start_error,
            **extra,
        )

    def close(
        self, purpose: Purpose | str = Purpose.LAUNCH, world_size: int | None = None, **extra: Any
    ) -> RunEnd:
        """Kill what is left, reap, release; the run's frozen end (the same on every call).
        Not stopped half way by Ctrl-C (the group's close holds it back)."""
        if self._end is None:
            self.watch.stop()
            self.group.close()
            unconfirmed = dict(getattr(self.group, "unconfirmed", {}))
            self._end = self.snapshot(purpose, world_size, unconfirmed=unconfirmed, **extra)
            self.phase = Phase.ENDED
        return self._end


__all__ = [
    "GroupRun",
    "Kind",
    "Outcome",
    "Phase",
    "Policy",
    "Purpose",
    "RunEnd",
    "add_note",
    "decide",
    "finished_event",
    "value_of",
]
