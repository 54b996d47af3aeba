"""What one run's ranks reported, folded into per-rank records as it happens.

The worker group calls :meth:`RunRecord.on_event` for every event and output line and
:meth:`RunRecord.on_exit` once per rank that ended. The record keeps results, failures,
each rank's stderr tail (the last words of a rank that dies) and barrier progress (a rank
stranded in a barrier by a peer that returned), and says as soon as the run has failed so
that the launcher stops the other ranks. It judges nothing: :mod:`.diagnosis` does, from
:meth:`RunRecord.verdict`.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from typing import Any

from .._events import (
    BarrierEnter,
    BarrierExit,
    Event,
    Output,
    WorkerExited,
    WorkerFailed,
    WorkerFinished,
    WorkerStopped,
)
from .._serialization import loads, safe_str
from ..errors import RankFailure, signal_name
from .diagnosis import Stranded, Verdict, diagnose
from .group import WorkerProcess

STDERR_TAIL_LINES = 400
#: why a rank that exited with code 0 and sent no value failed (the README lists these deaths)
NO_VALUE = (
    "it exited with code 0 before returning a value (sys.exit() or os._exit() inside the "
    "function?); return from the function instead, or raise to stop with an error"
)
DIED_REPORT_LINES = 25


class Word(str, enum.Enum):
    """An enum whose members are their words (``enum.StrEnum`` from Python 3.11 on): printed,
    formatted, compared or pickled to another process, a member reads as its word."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Stop(Word):
    """Why a run's ranks are being stopped (:meth:`RunRecord.stop`). A ``str``: a record
    pickled to another process, or compared with its word, reads the same."""

    #: a rank of this run failed
    FAILED = "failed"
    #: the user (Ctrl-C, ``cancel()``, the interrupt button)
    INTERRUPTED = "interrupted"
    #: another node ended the job
    ELSEWHERE = "elsewhere"
    #: starting them failed
    ABORTED = "aborted"
    #: a collective they cannot finish (a session's task)
    MISMATCH = "mismatch"
    #: a session gave up on them
    BROKEN = "broken"
    CLOSING = "closing"


class BarrierTracker:
    """Finds a rank waiting in barrier #i for a rank that returned after entering fewer
    than i+1 barriers: it would wait forever (NCCL does not even notice the peer is gone)."""

    def __init__(self) -> None:
        self.waiting: dict[int, BarrierEnter] = {}
        self.entered_by_returned: dict[int, int] = {}
        self.stranded: Stranded | None = None

    def on_event(self, event: Event) -> bool:
        """Fold ``event`` in; True when it reveals a stranded rank (the first time)."""
        if isinstance(event, BarrierEnter):
            self.waiting[event.rank] = event
        elif isinstance(event, BarrierExit):
            self.waiting.pop(event.rank, None)
            return False
        elif isinstance(event, WorkerFinished) and event.barriers >= 0:
            self.entered_by_returned[event.rank] = event.barriers
        else:
            return False
        if self.stranded is not None:
            return False
        for waiter in self.waiting.values():
            gone = [r for r, n in self.entered_by_returned.items() if n <= waiter.index]
            if gone:
                self.stranded = Stranded(waiter, tuple(sorted(gone)))
                return True
        return False


class RunRecord:
    """Per-rank results and failures of one run on this node."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        self.results: dict[int, Any] = {}
        self.failures: list[RankFailure] = []
        self.exc_data: dict[int, bytes | None] = {}
        self.finished_at: dict[int, float] = {}
        self.stderr_tail: dict[int, deque[str]] = {
            r: deque(maxlen=STDERR_TAIL_LINES) for r in ranks
        }
        self.barriers = BarrierTracker()
        #: why the ranks are being stopped, once they are (see :meth:`stop`); None: they run
        self.stop_kind: Stop | None = None
        #: an interrupt came (the user's), whatever else stopped the ranks first
        self.interrupted = False
        self.failed = False
        #: why the caller stopped the ranks, in words, when not for a failure here or an
        #: interrupt (e.g. "a rank on node 1 failed"): what a stopped rank's row says
        self.stop_reason = ""

    @property
    def stopping(self) -> bool:
        """The ranks are being stopped: their exits from now on are stops, not deaths."""
        return self.stop_kind is not None

    def stop(self, kind: Stop | str, reason: str = "") -> bool:
        """The ranks are being stopped, and why: the one place a run's stop flags are set.

        ``kind``: ``"failed"`` (a rank of this run failed), ``"interrupted"`` (the user),
        ``"elsewhere"`` (another node ended the job), ``"aborted"`` (starting them failed),
        ``"mismatch"`` (a collective they cannot finish), ``"broken"`` (a session gave up
        on them) or ``"closing"``; ``reason``: the words a stopped rank's row shows. The
        first kind stays (an interrupt is noted whenever it comes). True the first time."""
        kind = Stop(kind)
        first = self.stop_kind is None
        if first:
            self.stop_kind = kind
            if reason:
                self.stop_reason = reason
        if kind is Stop.INTERRUPTED:
            self.interrupted = True
        return first

    def abort(self, error: BaseException) -> None:
        """The ranks are being stopped because starting them failed with ``error`` (Ctrl-C
        included): their exits are stops, not deaths."""
        if isinstance(error, KeyboardInterrupt):
            self.stop(Stop.INTERRUPTED)
        else:
            self.stop(Stop.ABORTED, f"the ranks could not start ({type(error).__name__})")

    def on_event(self, event: Event) -> None:
        if isinstance(event, Output):
            if event.stream == "stderr":
                self.stderr_tail[event.rank].append(event.text)
        elif self.barriers.on_event(event):
            self.failed = True

    def on_exit(self, proc: WorkerProcess) -> list[Event]:
        """Record how rank ``proc.rank`` ended; returns the events that tell the views."""
        if proc.result is not None:
            return self.returned(proc.rank, proc.pid, proc.result)
        if proc.failure is not None:
            return self.raised(proc.failure, proc.exc_data)
        code = proc.returncode
        if self.stopping and code == 0:  # a SIGTERM handler of its own that exits: stopped
            return self.stopped(proc.rank, proc.pid)
        stopped = (code is not None and code < 0) or bool(getattr(proc, "never_started", ""))
        if self.stopping and stopped and getattr(proc, "signalled", True):
            return self.stopped(proc.rank, proc.pid, getattr(proc, "unconfirmed", ""))
        if code == 0 and not proc.note:
            # sys.exit(0) or os._exit(0) in the function: no value came back, so not a success
            return self.died(proc, NO_VALUE)
        return self.died(proc)

    def returned(self, rank: int, pid: int, data: bytes) -> list[Event]:
        """The rank's function returned ``data`` (its cloudpickled value)."""
        now = time.time()
        try:
            self.results[rank] = loads(data)
        except Exception as exc:  # noqa: BLE001 - whatever unpickling raises
            f = RankFailure(
                rank,
                "raised",
                pid,
                "notebook_launcher.errors.SerializationError",
                f"the result of rank {rank} could not be unpickled in the "
                f"kernel: {type(exc).__name__}: {safe_str(exc)}",
                time=now,
            )
            self._fail(f, None)
            return [WorkerFailed(f.rank, f.exc_type or "", f.message, "", False, now)]
        self.finished_at[rank] = now
        return []

    def raised(self, failure: RankFailure, exc_data: bytes | None) -> list[Event]:
        """The rank's function raised."""
        f = failure
        self._fail(f, exc_data)
        return [
            WorkerFailed(
                f.rank, f.exc_type or "", f.message, f.traceback, f.collateral, time.time()
            )
        ]

    def stopped(self, rank: int, pid: int | None, unconfirmed: str = "") -> list[Event]:
        """We stopped the rank (it was interrupted, or another rank failed);
        ``unconfirmed``: why its end was not reported (its node did not answer)."""
        now = time.time()
        self.failures.append(RankFailure(rank, "stopped", pid, time=now))
        reason = "interrupted" if self.interrupted else self.stop_reason or "another rank failed"
        if unconfirmed:
            reason += f"; its stop is not confirmed: {unconfirmed}"
        return [WorkerStopped(rank, reason, now)]

    def died(self, proc: WorkerProcess, context: str = "") -> list[Event]:
        """The rank's process ended (an exit code or a signal) without a word -- or it
        never started (``proc.never_started`` says why: a cluster's node refused it)."""
        now = time.time()
        never = getattr(proc, "never_started", "")
        if never:
            host = getattr(proc, "host", "")
            self._fail(
                RankFailure(proc.rank, "died", time=now, context=never, host=host, started=False),
                None,
            )
            return [WorkerExited(proc.rank, 0, None, None, now, f"never started: {never}")]
        code = proc.returncode
        sig = signal_name(code)
        context = (
            proc.note
            or (f"it died while {proc.stage}" if proc.stage != "running" else "")
            or context
        )
        self._fail(
            RankFailure(
                proc.rank,
                "died",
                proc.pid,
                exitcode=code,
                signal_name=sig,
                message=last_words(self.stderr_tail[proc.rank]),
                time=now,
                context=context,
                host=getattr(proc, "host", ""),
            ),
            None,
        )
        return [WorkerExited(proc.rank, proc.pid, code, sig, now)]

    def _fail(self, failure: RankFailure, exc_data: bytes | None) -> None:
        self.failures.append(failure)
        self.exc_data[failure.rank] = exc_data
        self.failed = True

    def verdict(self) -> Verdict:
        return diagnose(self.failures, self.finished_at, self.barriers.stranded)


def last_words(lines: deque[str] | list[str]) -> str:
    """What a dead rank wrote last; from its fatal-error banner (segfault) when there is one."""
    text = list(lines)
    for i in range(len(text) - 1, -1, -1):
        if text[i].startswith("Fatal Python error"):
            return "".join(text[i : i + DIED_REPORT_LINES])
    return "".join(text[-DIED_REPORT_LINES:])


__all__ = ["BarrierTracker", "RunRecord", "Stop", "last_words"]
