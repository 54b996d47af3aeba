"""From per-rank records to the truth about a run: pure functions, no processes.

A run ends with what each rank reported (:class:`~notebook_launcher.errors.RankFailure`
records, the times ranks returned, a rank found stranded in a barrier). :func:`diagnose`
picks the root cause; :func:`exception_for` builds what the user catches. Both are plain
functions of data, tested as a table (``tests/test_diagnosis.py``), and shared by one-shot
launches and persistent sessions.

The rule (torch elastic's ``ChildFailedError.get_first_failure``, refined):

1. a rank stranded in a barrier by a peer that returned -- with no real failure -- means
   the peer **left** (the program's ranks called different barriers);
2. else the earliest rank that **raised** an exception of its own (not collateral: a gloo
   "connection closed" is what a rank gets when another one went away);
3. else the earliest rank that **died** (an exit code or a signal, no exception);
4. else, when only collateral errors were raised and some rank had returned, that rank
   **left** the others waiting in a collective;
5. else the earliest collateral error.

:class:`RestartPolicy` says, from a verdict, whether a launch with ``max_restarts`` starts
its ranks again: for a death (a signal, an exit code, a node gone), and for an exception
only when asked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .._events import BarrierEnter
from .._serialization import rebuild_exception
from ..errors import (
    LaunchFailure,
    ProcessGroupMismatch,
    RankFailedError,
    RankFailure,
    SerializationError,
    WorkerDied,
    first_sentence,
    notebook_cell_name,
    rank_list,
    shorten,
)


@dataclass(frozen=True)
class Stranded:
    """Rank ``waiter.rank`` waits in a barrier that ranks ``gone`` returned before reaching."""

    waiter: BarrierEnter
    gone: tuple[int, ...]

    def where(self) -> str:
        """``Cell In[4], line 7 (wait_for_everyone, barrier #2)``: a notebook cell is named
        as IPython names it; any other file as ``path:line``."""
        w = self.waiter
        path, sep, line = w.location.rpartition(":")
        cell = notebook_cell_name(path) if sep else None
        location = f"Cell {cell}, line {line}" if cell else w.location
        return f"{location} ({w.kind}, barrier #{w.index})"


@dataclass(frozen=True)
class Verdict:
    """The diagnosis of a run: ``kind`` is ``"ok"``, ``"raised"``, ``"died"`` or ``"left"``."""

    kind: str
    cause: RankFailure | None = None
    #: every rank's record, the synthesised "left" one included, in time order
    failures: tuple[RankFailure, ...] = ()
    stranded: Stranded | None = None
    #: ranks that returned, earliest first
    returned: tuple[int, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.cause is None

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({f.rank for f in self.failures if f.kind != "stopped"}))


def _by_time(failures: Iterable[RankFailure]) -> list[RankFailure]:
    return sorted(failures, key=lambda f: f.time)


def diagnose(
    failures: Iterable[RankFailure],
    finished_at: Mapping[int, float],
    stranded: Stranded | None = None,
) -> Verdict:
    """The root cause among ``failures``, given when ranks returned (``finished_at``)."""
    records = _by_time(failures)
    returned = tuple(sorted(finished_at, key=finished_at.__getitem__))

    def verdict(kind: str, cause: RankFailure, extra: RankFailure | None = None) -> Verdict:
        every = _by_time([*records, extra]) if extra is not None else records
        return Verdict(kind, cause, tuple(every), stranded, returned)

    own = [f for f in records if f.kind != "stopped" and not f.collateral]
    if stranded is not None and not own:
        first = stranded.gone[0]
        left = RankFailure(
            first,
            "left",
            message=f"rank {stranded.waiter.rank} still waited for it at {stranded.where()}",
            time=finished_at.get(first, stranded.waiter.time),
        )
        return verdict("left", left, left)
    real = [f for f in records if f.kind in ("raised", "died")]
    if not real:
        return Verdict("ok", None, tuple(records), stranded, returned)
    raised = [f for f in real if f.kind == "raised" and not f.collateral]
    if raised:
        return verdict("raised", raised[0])
    died = [f for f in real if f.kind == "died"]
    if died:
        return verdict("died", died[0])
    if returned:  # only collateral errors: the waiting ranks lost a peer that had returned
        left = RankFailure(returned[0], "left", time=finished_at[returned[0]])
        return verdict("left", left, left)
    return verdict("raised", real[0])


def summary_line(verdict: Verdict, world_size: int, interrupted: bool = False) -> str:
    """One line for the end of the run (the views put "N ranks, wall time" before it)."""
    if interrupted:
        return f"interrupted: all {world_size} ranks stopped"
    if verdict.cause is None:
        return f"all {world_size} ranks finished"
    return verdict.cause.describe()


def exception_for(
    verdict: Verdict,
    world_size: int,
    exc_data: Mapping[int, bytes | None] | None = None,
    restarts: Iterable[str] = (),
) -> BaseException:
    """What the user catches for a failed run.

    ``raised``: the rank's own exception (rebuilt from ``exc_data``, see
    :func:`~notebook_launcher._serialization.rebuild_exception`), its ``__traceback__``
    the rank's frames, the launch summary as a note; :class:`RankFailedError` naming the
    type and why when it cannot be rebuilt. ``died``: :class:`WorkerDied` with the exit
    code or signal and the last lines the rank wrote. ``left``:
    :class:`ProcessGroupMismatch` naming who left and where the others waited (with the
    waiting rank's frames). Every one carries ``launch_failure`` (all ranks' records, and
    how each earlier attempt ended when ``restarts`` were made).
    Raising it adds the caller's frames in front of the rank's, as for a local error.
    """
    failure = verdict.cause
    if failure is None:
        raise ValueError("exception_for() needs a failed verdict")
    exc_data = exc_data or {}
    report = LaunchFailure(failure, list(verdict.failures), world_size, list(restarts))
    if verdict.kind == "left":
        return _left_error(verdict, report, exc_data)
    if verdict.kind == "died":
        return _died_error(failure, world_size, report)
    rebuilt = rebuild_exception(exc_data.get(failure.rank))
    same = report.same_failure
    where = f"rank {failure.rank}" if len(same) == 1 else f"{rank_list(same)} (the same error)"
    note = f"Raised on {where} of {world_size}.\n{report.summary()}"
    others = [f.rank for f in report.failures if f.traceback and f.rank != failure.rank]
    if others:
        note += f"\nTracebacks of ranks {others} too: exc.launch_failure.print_traceback(rank)"
    exc = rebuilt.exc
    if exc is None:
        message = rebuilt.message or failure.message
        kind = (failure.exc_type or "").rpartition(".")[2]
        why = f"\nThe {kind} itself could not be rebuilt in the kernel: {rebuilt.reason}."
        text = f"rank {failure.rank} raised {failure.exc_type}: {message}{why}\n{note}"
        if "SerializationError" in (failure.exc_type or ""):
            text = f"{message}\n{note}"
            exc = SerializationError(text)
        else:
            exc = RankFailedError(text, report)
        exc = exc.with_traceback(rebuilt.traceback)
    elif hasattr(exc, "add_note"):
        exc.add_note(note)
    try:
        exc.launch_failure = report  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return exc


def _died_error(failure: RankFailure, world_size: int, report: LaunchFailure) -> WorkerDied:
    if not failure.started:
        return WorkerDied(
            f"rank {failure.rank} of {world_size} never started: {failure.context}.\n"
            + report.summary(),
            report,
        )
    tail = failure.message.strip()
    told = failure.exitcode is None and not failure.signal_name  # describe() says it
    hint = f" {failure.context[0].upper()}{failure.context[1:]}." if failure.context else ""
    hint = "" if told else hint
    if failure.signal_name == "SIGKILL" and not any(
        who in failure.context for who in ("forkserver", "agent")
    ):
        hint += " It was killed from outside (out of memory is a common reason: check `dmesg`)."
    how = failure.describe().split(": ", 1)[1]
    return WorkerDied(
        f"rank {failure.rank} of {world_size} died without raising an exception ({how}).{hint}\n"
        + report.summary()
        + (f"\nLast lines rank {failure.rank} wrote to stderr:\n{tail}" if tail else ""),
        report,
    )


def _left_error(
    verdict: Verdict, report: LaunchFailure, exc_data: Mapping[int, bytes | None]
) -> ProcessGroupMismatch:
    """Some rank returned while others still waited for it: say who, and where."""
    stuck = [f for f in verdict.failures if f.kind == "raised"]
    if verdict.stranded is not None:
        left = list(verdict.stranded.gone)
        waiting = (
            f"rank {verdict.stranded.waiter.rank} still waited for them at "
            f"{verdict.stranded.where()}"
        )
    else:
        left = list(verdict.returned)
        first = stuck[0]
        got = first_sentence(first.message) if first.message else ""  # (gloo's boilerplate)
        waiting = (
            f"rank(s) {sorted({f.rank for f in stuck})} still waited for them in a "
            f"collective or barrier (rank {first.rank} got {first.exc_type}: {shorten(got, 200)})"
        )
    err = ProcessGroupMismatch(
        f"rank(s) {left} returned from the function while {waiting}. Every rank must "
        "call the same collectives (barrier, all_reduce, wait_for_everyone, gather...) "
        "in the same order; look for one inside an `if` that only some ranks take, or a "
        "rank that returns early.\n" + report.summary(),
        report,
    )
    if stuck:  # where the waiting rank was: its frames, as if it raised this
        err = err.with_traceback(rebuild_exception(exc_data.get(stuck[0].rank)).traceback)
    return err


def as_child_failed(
    error: BaseException, verdict: Verdict, name: str, procs_per_node: int
) -> BaseException:
    """torch elastic's ``ChildFailedError`` for a failed launch, ``error`` (the rank's own
    exception, with its traceback) as its ``__cause__``: for code written against
    Accelerate's launcher (torch elastic underneath) that catches ``ChildFailedError``.

    Its ``failures`` hold the ranks that failed by themselves, as elastic's would (a
    raised exception is exit code 1, with its traceback as the message); the ranks
    stopped because of them are not failures."""
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
        ProcessFailure,
    )

    failures: dict[int, ProcessFailure] = {}
    for f in _by_time(x for x in verdict.failures if x.kind in ("raised", "died")):
        if f.collateral and failures:
            continue
        exitcode = 1 if f.kind == "raised" else (f.exitcode if f.exitcode is not None else 1)
        process = ProcessFailure(f.rank % procs_per_node, f.pid or -1, exitcode, "<N/A>")
        if f.kind == "raised":
            text = f"{f.exc_type}: {f.message}"
            stack = f.traceback if f.message in f.traceback else f"{f.traceback}{text}"
            process.message = {  # type: ignore[assignment]  # elastic's error-file form
                "message": text,
                "extraInfo": {"py_callstack": stack, "timestamp": str(int(f.time))},
            }
        process.timestamp = int(f.time) if f.time else process.timestamp
        failures[f.rank] = process
    if not failures:  # interrupted, stranded...: nothing elastic would call a child failure
        return error
    child = ChildFailedError(name, failures)
    child.__cause__ = error
    return child


@dataclass(frozen=True)
class RestartPolicy:
    """When an attempt that failed starts again: ``max_restarts`` times at most, for a
    death (signal, exit code, a node gone), and for exceptions only when asked."""

    max_restarts: int = 0
    on_exception: bool | tuple[type[BaseException], ...] = False

    def restarts(self, verdict: Verdict, exc_data: Mapping[int, bytes | None]) -> bool:
        """Whether ``verdict`` (a failed attempt) calls for a restart, attempts left aside.
        A node interrupted elsewhere (a ``KeyboardInterrupt`` record) never does."""
        cause = verdict.cause
        if cause is None or cause.exc_type == "builtins.KeyboardInterrupt":
            return False
        if verdict.kind == "died" or (verdict.kind == "raised" and cause.collateral):
            return True
        if verdict.kind != "raised" or self.on_exception is False:
            return False
        if self.on_exception is True:
            return True
        exc = rebuild_exception(exc_data.get(cause.rank)).exc
        return isinstance(exc, self.on_exception)


__all__ = [
    "RestartPolicy",
    "Stranded",
    "Verdict",
    "as_child_failed",
    "diagnose",
    "exception_for",
    "summary_line",
]
