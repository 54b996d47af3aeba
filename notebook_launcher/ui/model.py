"""The dashboard's model: plain events in, per-rank state out (pure Python, no Jupyter).

:class:`LaunchModel` folds the events of one launch (``_events``) into per-rank state:
status, pid, device, elapsed time, progress bars, the barrier a rank waits at, the
barrier history, and bounded stdout/stderr. The widget view and the text view only
*render* this state, so everything a person sees can be tested by feeding events in::

    >>> m = LaunchModel()
    >>> m.apply(WorkerStarted(rank=0, local_rank=0, pid=7, device="cpu", time=1.0))
    frozenset({('rank', 0)})
    >>> m.ranks[0].status
    'running'

:meth:`LaunchModel.apply` returns what changed (keys like ``("rank", 0)``,
``("bars", 0)``, ``("output", 0)``, ``("barriers",)``, ``("metrics",)``, ``("launch",)``)
so a view can redraw only those parts. Output is kept as a terminal shows it: lines ended
by ``\\n`` are committed (bounded, per rank and merged); a line ended by ``\\r`` is the
rank's transient line until the next piece replaces it. Logged metrics are kept per name
and rank, thinned out to stay bounded. Time is the events' own wall-clock ``time``; functions that
show "elapsed" or "waiting for" take ``now`` so tests need no real clock.
"""

from __future__ import annotations

import re
import string
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._events import (
    IMPORTING,
    PHASES,
    RUNNING_PHASES,
    BarrierEnter,
    BarrierExit,
    Event,
    FollowingStopped,
    LaunchFinished,
    LaunchRestarting,
    LaunchStarted,
    MetricsLogged,
    NodesWaiting,
    Output,
    ProgressUpdate,
    RendezvousStarted,
    StacksTaken,
    StallOver,
    WorkerExited,
    WorkerFailed,
    WorkerFinished,
    WorkerPhase,
    WorkerStarted,
    WorkerStopped,
)
from .._stacks import COLLECTIVES
from ..errors import format_remote_traceback, notebook_cell_name

# Rank statuses, in the words the dashboard shows.
STARTING = "starting"
RUNNING = "running"
WAITING = "waiting"  # at a barrier
DONE = "done"
FAILED = "failed"
DIED = "died"
STOPPED = "stopped"
#: a session's rank once the session started: alive, waiting for its tasks
READY = "ready"
ENDED = frozenset({DONE, FAILED, DIED, STOPPED})
#: Why a rank the launcher stopped left the run (an interrupt, a peer's failure).
STOPPED_REASON = "was stopped"
#: Barrier-table kinds named as collectives (``all_reduce #2``) rather than barriers.
COLLECTIVE_KINDS = frozenset(COLLECTIVES) - {"barrier", "monitored_barrier"}

#: Bars kept per rank (open bars are never dropped; the oldest closed ones are).
MAX_BARS_PER_RANK = 12
#: Characters kept of a line that has no newline yet.
MAX_TAIL_CHARS = 10_000
#: Passed barriers kept for the barrier history (a long run may pass thousands).
MAX_BARRIERS = 200
#: Points kept per metric and rank: beyond it every other point is dropped (the whole run
#: stays visible, at half the resolution), so memory is bounded however long the run.
MAX_POINTS = 2000
#: A rank this far (fraction of the whole run) behind the median is called a straggler.
STRAGGLER_GAP = 0.05

Change = tuple[object, ...]


def ranks_changed(changes: set[Change] | frozenset[Change], kind: str) -> set[int]:
    """The ranks whose ``kind`` (``"rank"``, ``"bars"``, ``"output"``) changed."""
    return {c[1] for c in changes if len(c) == 2 and c[0] == kind and isinstance(c[1], int)}


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def clean_line(text: str) -> str:
    """What a terminal would show for one output line: no ANSI codes, last ``\\r`` segment."""
    if "\x1b" in text:  # (most lines have no escape: no regex pass for them)
        text = _ANSI.sub("", text)
    body = text[:-1] if text.endswith("\n") else text
    if "\r" in body:
        segments = [s for s in body.split("\r") if s]
        body = segments[-1] if segments else ""
    return body


def last_segment(text: str) -> str:
    """What is still shown of an unterminated piece of output: from the start of its last
    non-empty ``\\r`` segment on (``"10%\\r50%\\r"`` -> ``"50%\\r"``); a trailing ``\\r``
    only moves a terminal's cursor, so ``"50%\\r\\r"`` still shows ``50%``."""
    if "\r" not in text:
        return text
    segments = text.split("\r")
    for i in range(len(segments) - 1, -1, -1):
        if segments[i]:
            return segments[i] + ("\r" if i < len(segments) - 1 else "")
    return ""


def notebook_cell_location(location: str) -> str:
    """``/tmp/ipykernel_7/123.py:14`` -> ``In[2]:14`` when this process's IPython compiled
    that cell (workers keep the kernel's file names); anything else is left as it is."""
    path, sep, line = location.rpartition(":")
    named = notebook_cell_name(path) if sep else None
    return f"{named}:{line}" if named else location


def notebook_cell_traceback(traceback: str) -> str:
    """A worker's traceback as the notebook user reads it: cells named as IPython names
    them (``Cell In[2], line 4``), runs of library frames folded into one line
    (:func:`notebook_launcher.errors.format_remote_traceback`)."""
    return format_remote_traceback(traceback)


def fmt_duration(seconds: float | None) -> str:
    """``3.2s``, ``1:05``, ``1:02:03``."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(seconds)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def fmt_clock(seconds: float | None) -> str:
    """A clock for live views, in whole seconds (``12s``, ``1:05``): it changes once a
    second, not at every redraw."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    return f"{int(seconds)}s" if seconds < 60 else fmt_duration(seconds)


def fmt_number(x: float) -> str:
    """Integers without a decimal point, other numbers with up to 3 significant decimals."""
    if float(x).is_integer():
        return str(int(x))
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def fmt_rate(rate: float | None, unit: str) -> str:
    if rate is None or rate <= 0:
        return f"?{unit}/s"
    if rate < 1:
        return f"{1 / rate:.2f}s/{unit}"
    if rate < 100:
        return f"{rate:.1f}{unit}/s"
    if rate < 10_000:
        return f"{rate:.0f}{unit}/s"
    for div, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if rate >= div:
            return f"{rate / div:.3g}{prefix}{unit}/s"
    return f"{rate:.0f}{unit}/s"


@dataclass
class BarState:
    """One tqdm bar of one rank, as last reported."""

    bar_id: int
    desc: str
    n: float
    total: float | None
    unit: str = "it"
    rate: float | None = None
    elapsed: float = 0.0
    postfix: str = ""
    level: int = 0
    closed: bool = False
    updated: float = 0.0
    #: "" while running; "success", "danger" (where it broke) or "stopped" (a rank that was
    #: stopped, or fell over, because another failed) once decided
    style: str = ""
    frozen: bool = False  # its rank ended with the bar open: no eta, it will not move again

    @property
    def complete(self) -> bool:
        return self.total is not None and self.total > 0 and self.n >= self.total

    @property
    def fraction(self) -> float | None:
        if not self.total:
            return None
        return max(0.0, min(1.0, self.n / self.total))

    @property
    def average_rate(self) -> float | None:
        if self.rate:
            return self.rate
        return self.n / self.elapsed if self.elapsed > 0 and self.n else None

    @property
    def eta(self) -> float | None:
        rate = self.average_rate
        if self.total is None or not rate or self.closed or self.frozen:
            return None
        return max(0.0, (self.total - self.n) / rate)

    def label(self) -> str:
        """Its ``desc``; a bar without one (Transformers' Trainer draws its steps so) is
        ``progress``, a nested one ``inner progress``."""
        return self.desc or ("progress" if self.level == 0 else "inner progress")

    def counts(self) -> str:
        """``40/100 [40%]`` or ``40`` when the total is unknown."""
        if self.total is None:
            return f"{fmt_number(self.n)}{self.unit}"
        pct = int(100 * (self.fraction or 0.0))
        return f"{fmt_number(self.n)}/{fmt_number(self.total)} [{pct}%]"

    def stats(self) -> str:
        """``40/100 [40%] 12.3it/s eta 0:05 loss=0.1`` (``in 2.1s`` once closed)."""
        parts = [self.counts(), fmt_rate(self.average_rate, self.unit)]
        if self.closed or self.frozen:
            parts.append(f"in {fmt_duration(self.elapsed)}")
        elif self.eta is not None:
            parts.append(f"eta {fmt_duration(self.eta)}")
        if self.postfix:
            parts.append(self.postfix)
        return " ".join(parts)


@dataclass
class BarrierWait:
    """The barrier a rank is in right now."""

    index: int
    location: str
    kind: str
    since: float


@dataclass
class BarrierRecord:
    """One barrier (the ``index``-th barrier of every rank), for the barrier summary.

    Workers report only barriers that take noticeable time (a rank that passes at once
    sends nothing), so ``arrived`` holds the ranks that *waited*; once any rank reports
    leaving, the barrier has ``completed`` and every rank must have arrived.
    """

    index: int
    kind: str
    locations: dict[int, str] = field(default_factory=dict)  # rank -> "file:line"
    arrived: dict[int, float] = field(default_factory=dict)  # rank -> enter time
    exited: dict[int, float] = field(default_factory=dict)  # rank -> exit time
    left: dict[int, str] = field(default_factory=dict)  # rank -> why it left the run instead
    completed: float | None = None  # when the first rank reported leaving it

    @property
    def label(self) -> str:
        """``barrier #2`` (``barrier``, ``wait_for_everyone``, ...); a collective by its
        kind: ``all_reduce #2`` (the number is the row of the barrier table)."""
        if self.kind in COLLECTIVE_KINDS:
            return f"{self.kind} #{self.index}"
        return f"barrier #{self.index}"

    @property
    def name(self) -> str:
        """``at barrier #2``, ``in all_reduce #2``."""
        return f"{'in' if self.kind in COLLECTIVE_KINDS else 'at'} {self.label}"

    @property
    def location(self) -> str:
        locs = sorted(set(self.locations.values()))
        return " / ".join(locs) if locs else "?"

    @property
    def mismatched(self) -> bool:
        return len(set(self.locations.values())) > 1

    def waiting(self) -> list[int]:
        return sorted(r for r in self.arrived if r not in self.exited)

    def arrived_ranks(self, ranks: list[int]) -> list[int]:
        return list(ranks) if self.completed is not None else sorted(self.arrived)

    def missing(self, ranks: list[int]) -> list[int]:
        if self.completed is not None:
            return []
        return [r for r in ranks if r not in self.arrived]

    def took(self) -> float | None:
        if self.completed is None or not self.arrived:
            return None
        return max(self.exited.values(), default=self.completed) - min(self.arrived.values())


class MetricSeries:
    """One metric of one rank: ``(step, value)`` points, bounded by thinning.

    Up to :data:`MAX_POINTS` points are kept; then every other one is dropped and only
    every 2nd (4th, ...) new point is kept, so the whole run stays on the plot at a
    coarser resolution. ``latest`` is always the last point logged.
    """

    __slots__ = ("steps", "values", "stride", "_count", "latest")

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.values: list[float] = []
        self.stride = 1
        self._count = 0
        self.latest: tuple[int, float] | None = None

    def add(self, step: int, value: float, max_points: int = MAX_POINTS) -> None:
        self.latest = (step, value)
        self._count += 1
        if (self._count - 1) % self.stride:
            return
        self.steps.append(step)
        self.values.append(value)
        if len(self.steps) >= max_points:
            del self.steps[1::2], self.values[1::2]
            self.stride *= 2

    def points(self) -> tuple[list[int], list[float]]:
        """The kept points, ending with the latest one."""
        steps, values = list(self.steps), list(self.values)
        if self.latest is not None and (not steps or steps[-1] != self.latest[0]):
            steps.append(self.latest[0])
            values.append(self.latest[1])
        return steps, values


@dataclass
class Spread:
    """How far apart the ranks are (the many-ranks summary): progress per rank (0..1),
    the slowest, median and fastest rank, stragglers (live ranks more than
    :data:`STRAGGLER_GAP` behind the median) and the ranks that broke."""

    progress: dict[int, float]
    slowest: tuple[int, float] | None
    median: tuple[int, float] | None  # the rank nearest the median, and the median
    fastest: tuple[int, float] | None
    stragglers: list[int]
    broken: list[int]
    counts: dict[str, int]


class OutputBuffer:
    """The last ``max_lines`` lines of output, with a count of what was dropped."""

    def __init__(self, max_lines: int) -> None:
        self.lines: deque[tuple[int, str, str]] = deque(maxlen=max_lines)  # (rank, stream, text)
        self.dropped = 0
        self.total = 0

    def append(self, rank: int, stream: str, text: str) -> None:
        if len(self.lines) == self.lines.maxlen:
            self.dropped += 1
        self.lines.append((rank, stream, text))
        self.total += 1

    def dropped_note(self) -> str:
        return f"[{self.dropped} earlier line(s) dropped]" if self.dropped else ""


@dataclass
class RankState:
    """What the dashboard knows about one rank."""

    rank: int
    output: OutputBuffer
    local_rank: int | None = None
    #: a cluster's launch: the host the rank runs on ("" on this machine)
    host: str = ""
    pid: int | None = None
    device: str = ""
    status: str = STARTING
    #: while it starts: its :data:`~notebook_launcher._events.PHASES` key, since when, and
    #: (joining) how many ranks have come to the group so far: ``3/8 joined``
    phase: str = ""
    phase_since: float | None = None
    #: while it runs: a :data:`~notebook_launcher._events.RUNNING_PHASES` key, or what it
    #: imports (``importing transformers``); "" for the user's own code
    activity: str = ""
    joined: str = ""
    started: float | None = None
    ended: float | None = None
    bars: dict[int, BarState] = field(default_factory=dict)  # display order
    dropped_bars: int = 0
    barrier: BarrierWait | None = None
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    collateral: bool = False
    exitcode: int | None = None
    signal_name: str | None = None
    stop_reason: str = ""
    end_reason: str = ""  # "returned", "raised ValueError", "died (SIGKILL)", ...

    def elapsed(self, now: float) -> float | None:
        if self.started is None:
            return None
        return (self.ended if self.ended is not None else now) - self.started

    def waiting_for(self, now: float) -> float | None:
        return None if self.barrier is None else max(0.0, now - self.barrier.since)

    @property
    def shown_status(self) -> str:
        """The status a view shows: a collateral failure (fallout of another rank's end,
        e.g. gloo's "connection closed") is shown as ``stopped``, in grey."""
        return STOPPED if self.status == FAILED and self.collateral else self.status

    def progress(self) -> float | None:
        """How far the rank is, 0..1, from its bars: nested bars count as one (epoch 1 of
        4 with its step bar at 50% is 37.5%); None without a bar that has a total."""
        bars = sorted(
            (b for b in self.bars.values() if b.total and not (b.closed and b.level > 0)),
            key=lambda b: b.level,
        )
        if not bars:
            return None
        outer = bars[0]
        fraction = outer.fraction or 0.0
        if len(bars) > 1 and not outer.complete and outer.total:
            inner = bars[-1].fraction or 0.0
            fraction = min(1.0, (min(outer.n, outer.total) + inner) / outer.total)
        return fraction

    def outcome(self) -> str:
        """One phrase for the end of this rank: ``done``, ``raised ValueError: x``, ..."""
        if self.status == FAILED:
            if self.collateral:  # fallout of another rank's end: its message is noise
                return f"stopped: collateral {self.exc_type}"
            message = self.failure_message()
            return f"raised {self.exc_type}: {message}" if message else f"raised {self.exc_type}"
        if self.status == DIED:
            if self.exitcode is None and not self.signal_name and self.end_reason:
                return self.end_reason  # no process to tell of: "never started: ..."
            how = (
                f"killed by {self.signal_name}"
                + (f"({self.exitcode})" if self.exitcode is not None else "")
                if self.signal_name
                else f"exit code {self.exitcode}"
            )
            return f"died: {how}"
        if self.status == STOPPED:
            return f"stopped: {self.stop_reason}" if self.stop_reason else "stopped"
        return self.status

    def failure_message(self, limit: int = 160) -> str:
        """The first line of the exception's message, at most ``limit`` characters; empty
        unless the rank raised by itself (not as fallout of another's failure)."""
        if self.status != FAILED or self.collateral or not self.message.strip():
            return ""
        message = self.message.strip().splitlines()[0]
        return message if len(message) <= limit else message[: limit - 3] + "..."

    def status_text(self, now: float, clock: Callable[[float | None], str] = fmt_duration) -> str:
        """``running``, ``waiting at train.py:12 for 3.0s``, ``failed``; while it starts,
        what it does: ``importing torch``, ``joining the process group (3/8 joined)``."""
        if self.status == WAITING and self.barrier is not None:
            return f"waiting at {self.barrier.location} for {clock(self.waiting_for(now))}"
        if self.status == STARTING and self.phase:
            return PHASES.get(self.phase, self.phase) + self.joined_note()
        if self.status == RUNNING and self.activity:
            return RUNNING_PHASES.get(self.activity, self.activity)  # or "importing x"
        return self.status

    def joined_note(self) -> str:
        """`` (3/8 joined)`` while this rank waits in the group for the others."""
        if self.phase != "joining" or not self.joined or self.status != STARTING:
            return ""
        return f" ({self.joined})"

    def in_phase(self, now: float) -> float | None:
        """Seconds in its current start-up phase (None once started, or before any)."""
        if self.status != STARTING or self.phase_since is None:
            return None
        return max(0.0, now - self.phase_since)

    def open_bars(self) -> list[BarState]:
        return [b for b in self.bars.values() if not b.closed]


class LaunchModel:
    """Folds the events of one launch into per-rank state. See the module docstring."""

    def __init__(self, max_lines_per_rank: int = 500, max_lines_combined: int = 1000) -> None:
        self.max_lines_per_rank = max_lines_per_rank
        self.started: LaunchStarted | None = None
        self.finished: LaunchFinished | None = None
        #: a launch across nodes: the rendezvous it waits in (or waited in)
        self.rendezvous: RendezvousStarted | None = None
        #: a launch on a cluster: what the kernel last heard while it waited for the nodes
        self.nodes_waiting: NodesWaiting | None = None
        #: when this view stopped following the run (which goes on without it)
        self.stopped_following: float | None = None
        #: ``max_restarts``: every restart so far, oldest first
        self.restarts: list[LaunchRestarting] = []
        self.ranks: dict[int, RankState] = {}
        self.barriers: dict[int, BarrierRecord] = {}
        self.dropped_barriers = 0  # passed barriers forgotten to keep the history bounded
        self.combined = OutputBuffer(max_lines_combined)
        self._tails: dict[tuple[int, str], str] = {}
        self.start_time: float | None = None
        #: metric name -> rank -> its points (names in the order first logged)
        self.metrics: dict[str, dict[int, MetricSeries]] = {}
        self.metrics_logged = 0  # MetricsLogged events folded in (views redraw on change)
        #: where every rank is while no rank makes progress (or was, when interrupted):
        #: the stall view; None once progress resumed
        self.stall: StacksTaken | None = None

    # -- reading ---------------------------------------------------------------------------
    @property
    def rank_ids(self) -> list[int]:
        return sorted(self.ranks)

    @property
    def world_size(self) -> int:
        return self.started.world_size if self.started else len(self.ranks)

    def nodes(self) -> dict[int, list[int]]:
        """Ranks grouped by node (one group unless the launch spans several nodes)."""
        if self.started is not None and self.started.hosts:  # a cluster: every node's ranks
            order = list(dict.fromkeys(self.started.hosts))
            groups: dict[int, list[int]] = {}
            for r, host in zip(self.started.ranks, self.started.hosts, strict=False):
                groups.setdefault(order.index(host), []).append(r)
            return groups
        if self.started is None or self.started.num_nodes <= 1:
            return {self.started.node_rank if self.started else 0: self.rank_ids}
        per_node = max(1, self.started.local_world_size)
        groups = {}
        for r in self.rank_ids:
            groups.setdefault(r // per_node, []).append(r)
        return groups

    def node_label(self, node: int) -> str:
        """``node 1`` (``node 1 (n2)`` on a cluster, named by its host)."""
        if self.started is not None and self.started.hosts:
            hosts = list(dict.fromkeys(self.started.hosts))
            if node < len(hosts):
                return f"node {node} ({hosts[node]})"
        return f"node {node}"

    def elapsed(self, now: float) -> float | None:
        if self.start_time is None:
            return None
        if self.finished is not None:
            if self.nodes_waiting is not None:  # the clock ran from the wait for the nodes
                return self.finished.time - self.start_time
            return self.finished.wall_time
        return now - self.start_time

    @property
    def session_start(self) -> bool:
        """This run starts a session's ranks (they stay, ready for its tasks)."""
        return self.started is not None and self.started.session

    def open_barriers(self) -> list[BarrierRecord]:
        """Barriers some rank is waiting in right now."""
        return [b for b in self.barriers.values() if b.waiting()]

    def alerts(self) -> list[str]:
        """Ranks that left the run by themselves (returned, raised, died) while others
        waited for them in a barrier or a collective. A rank the launcher stopped (an
        interrupt, a peer's failure) is not one: that was not its doing."""
        out = []
        for b in sorted(self.barriers.values(), key=lambda b: b.index):
            for rank, why in sorted(b.left.items()):
                if why == STOPPED_REASON:
                    continue
                waiting = b.waiting()
                others = ", ".join(str(r) for r in waiting) if waiting else "the others"
                out.append(
                    f"rank {rank} {why} while rank(s) {others} waited {b.name} ({b.location})"
                )
        return out

    def root_cause(self) -> RankState | None:
        if self.finished is not None and self.finished.root_cause_rank is not None:
            return self.ranks.get(self.finished.root_cause_rank)
        bad = [
            r
            for r in self.ranks.values()
            if r.status in (FAILED, DIED) and not (r.status == FAILED and r.collateral)
        ]
        bad.sort(key=lambda r: r.ended if r.ended is not None else float("inf"))
        return bad[0] if bad else None

    def spread(self) -> Spread:
        """The spread of the ranks' progress (see :class:`Spread`)."""
        progress = {}
        counts: dict[str, int] = {}
        broken = []
        for r in self.rank_ids:
            s = self.ranks[r]
            counts[s.shown_status] = counts.get(s.shown_status, 0) + 1
            if s.status in (FAILED, DIED) and not s.collateral:
                broken.append(r)
            p = s.progress()
            if p is not None:
                progress[r] = p
        if not progress:
            return Spread(progress, None, None, None, [], broken, counts)
        order = sorted(progress, key=lambda r: (progress[r], r))
        values = sorted(progress.values())
        mid = len(values) // 2
        median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
        near = min(order, key=lambda r: (abs(progress[r] - median), r))
        fastest = max(order, key=lambda r: (progress[r], -r))
        stragglers = [
            r
            for r in order
            if progress[r] < median - STRAGGLER_GAP
            and self.ranks[r].ended is None
            and self.ranks[r].status != WAITING
        ]
        return Spread(
            progress,
            (order[0], progress[order[0]]),
            (near, median),
            (fastest, progress[fastest]),
            stragglers,
            broken,
            counts,
        )

    def summary_line(self) -> str:
        """``2 ranks, 3.1s: ok`` or ``2 ranks, 3.1s: failed: rank 1 raised ValueError: boom``."""
        n = self.world_size
        head = f"{n} rank{'s' if n != 1 else ''}"
        if self.started is None and self.rendezvous is not None:  # the nodes never met
            head = f"{self.rendezvous.num_nodes} nodes"
        elif self.started is None and self.nodes_waiting is not None:  # nor did the agents
            head = f"{self.nodes_waiting.nodes} nodes"
        if self.finished is None:
            return f"{head}: running"
        head += f", {fmt_duration(self.elapsed(self.finished.time))}"
        k = self.finished.restarts
        if k:
            head += f", {k} restart{'s' if k > 1 else ''}"
        if self.finished.ok:
            return f"{head}: {'ready' if self.session_start else 'ok'}"
        if self.finished.interrupted:  # the user's act: nobody failed
            return f"{head}: {self.finished.summary}"
        cause = self.root_cause()
        if cause is not None and cause.status in (FAILED, DIED, STOPPED):
            return f"{head}: failed: rank {cause.rank} {cause.outcome()}"
        return f"{head}: failed: {self.finished.summary}"

    def left_behind(self, at: float) -> str:
        """What a view says of itself once it no longer follows its run (``at``: since
        when): ``detached run 3fa9c1 · this view stopped following at 12:03:07 ·
        attach('3fa9c1')``; the kernel's own ranks end with the kernel instead."""
        when = time.strftime("%H:%M:%S", time.localtime(at))
        s = self.started
        if s is not None and s.detached:
            run = s.detached
            what = f"detached session {run} ({s.task})" if s.task else f"detached run {run}"
            return f"{what} \u00b7 this view stopped following at {when} \u00b7 attach({run!r})"
        return f"this view stopped at {when}: its kernel went away, and its ranks with it"

    def restart_text(self) -> str:
        """``restart 2 of 3 (rank 1 (pid 12) died: killed by SIGKILL(-9))``; empty before
        any restart."""
        if not self.restarts:
            return ""
        last = self.restarts[-1]
        return f"restart {last.attempt} of {last.max_restarts} ({last.cause})"

    def waiting_text(self) -> str:
        """While the nodes meet: ``waiting for 2 nodes: c10d rendezvous 'job' at h:p``; a
        cluster's: ``waiting for Slurm job 12, 2 node(s): PENDING (Resources), 0/2 agents
        joined``."""
        if self.started is not None:
            return ""
        w = self.nodes_waiting
        if w is not None:
            return f"waiting for {w.where}: {w.state}, {w.joined}/{w.nodes} agents joined"
        r = self.rendezvous
        if r is None:
            return ""
        return (
            f"waiting up to {fmt_duration(r.timeout)} for {r.num_nodes} nodes: "
            f"{r.backend} rendezvous '{r.run_id}' at {r.endpoint}"
        )

    def line_label(self, rank: int) -> str:
        """The label of a rank's output lines: ``[rank3]``, or the launch's
        ``log_line_prefix_template`` filled in (torch elastic's ``${rank}``,
        ``${local_rank}``, ``${role_name}``) without the trailing space it may end with."""
        template = self.started.log_line_prefix_template if self.started else None
        if not template:
            host = self.ranks[rank].host if rank in self.ranks else ""
            return f"[{host}:rank{rank}]" if host else f"[rank{rank}]"
        state = self.ranks.get(rank)
        local = state.local_rank if state is not None else None
        if local is None and self.started is not None and rank in self.started.ranks:
            local = self.started.ranks.index(rank)
        values = {"rank": rank, "local_rank": "" if local is None else local}
        return string.Template(template).safe_substitute(role_name="default", **values).rstrip()

    # -- folding ---------------------------------------------------------------------------
    def rank(self, rank: int) -> RankState:
        state = self.ranks.get(rank)
        if state is None:
            state = self.ranks[rank] = RankState(
                rank=rank, output=OutputBuffer(self.max_lines_per_rank)
            )
        return state

    def apply(self, event: Event) -> frozenset[Change]:
        """Fold one event in; return the keys of what changed.

        Dispatch is by type through :data:`HANDLERS` (every event type has an entry, a
        test holds that), so renaming an event cannot silently stop its handling.
        """
        handler = HANDLERS.get(type(event))
        if handler is None:
            return frozenset()
        return frozenset(handler(self, event))

    def _on_RendezvousStarted(self, e: RendezvousStarted) -> list[Change]:
        self.rendezvous = e
        if self.start_time is None:
            self.start_time = e.time
        return [("launch",)]

    def _on_FollowingStopped(self, e: FollowingStopped) -> list[Change]:
        if self.finished is None:  # (an end seen first is the end)
            self.stopped_following = e.time
        return [("launch",)]

    def _on_NodesWaiting(self, e: NodesWaiting) -> list[Change]:
        self.nodes_waiting = e
        if self.start_time is None:
            self.start_time = e.time
        return [("launch",)]

    def _on_LaunchStarted(self, e: LaunchStarted) -> list[Change]:
        self.started = e
        if (self.rendezvous is None and self.nodes_waiting is None) or self.start_time is None:
            self.start_time = e.time  # (from when the nodes met, when they had to)
        for r in e.ranks:
            self.rank(r)
        for r, host in zip(e.ranks, e.hosts, strict=False):
            self.ranks[r].host = host
        return [("launch",), *(("rank", r) for r in e.ranks)]

    def _on_LaunchRestarting(self, e: LaunchRestarting) -> list[Change]:
        """Every rank starts again: each row from scratch (its log goes on), barriers
        counted afresh (the new attempt's ranks number theirs from 0)."""
        self.restarts.append(e)
        self.barriers.clear()
        self.dropped_barriers = 0
        changes: list[Change] = [("launch",), ("barriers",)]
        for r, old in list(self.ranks.items()):
            self.ranks[r] = RankState(
                rank=r, output=old.output, local_rank=old.local_rank, host=old.host
            )
            changes += [("rank", r), ("bars", r)]
        return changes

    def _on_WorkerPhase(self, e: WorkerPhase) -> list[Change]:
        s = self.rank(e.rank)
        if s.status in (RUNNING, WAITING) and (
            e.phase in RUNNING_PHASES or not e.phase or e.phase.startswith(IMPORTING)
        ):
            s.activity = e.phase  # e.g. wrapping the model in DDP; "" once done
            return [("rank", e.rank)]
        if s.status != STARTING:  # it started (or ended) already: nothing to show
            return []
        s.pid, s.phase, s.phase_since = e.pid, e.phase, e.time
        return [("rank", e.rank), *self._count_joined()]

    def _count_joined(self) -> list[Change]:
        """Tell the ranks waiting in the group how many of this node's ranks have come
        (joining, started or ended); returns their changes."""
        expected = list(self.started.ranks) if self.started is not None else self.rank_ids
        states = [self.ranks[r] for r in expected if r in self.ranks]
        have = sum(1 for s in states if s.phase == "joining" or s.status != STARTING)
        note = f"{have}/{len(expected)} joined"
        if self.started is not None and self.started.num_nodes > 1 and not self.started.hosts:
            note = f"{have}/{len(expected)} of this node joined"
        changes: list[Change] = []
        for s in states:
            if s.phase == "joining" and s.status == STARTING and s.joined != note:
                s.joined = note
                changes.append(("rank", s.rank))
        return changes

    def starting_phases(self) -> dict[str, int]:
        """How many ranks are in each start-up phase (``""``: no word from the rank yet)."""
        counts: dict[str, int] = {}
        for s in self.ranks.values():
            if s.status == STARTING:
                counts[s.phase] = counts.get(s.phase, 0) + 1
        return counts

    def _on_WorkerStarted(self, e: WorkerStarted) -> list[Change]:
        s = self.rank(e.rank)
        s.local_rank, s.pid, s.device = e.local_rank, e.pid, e.device
        s.started = e.time
        if s.status == STARTING:
            s.status = RUNNING
        return [("rank", e.rank), *self._count_joined()]

    def _on_Output(self, e: Output) -> list[Change]:
        """Lines ended by ``\\n`` are committed to the log. What is left -- a line ended by
        ``\\r`` (a progress display another library draws), or a bounded piece of a long
        unterminated line -- is the rank's *transient* line: shown last, replaced by the
        next piece, committed (as a terminal leaves it) when a ``\\n`` ends it."""
        key = (e.rank, e.stream)
        text = self._tails.pop(key, "") + e.text
        s = self.rank(e.rank)
        if "\n" in text:
            *lines, text = text.split("\n")
            for raw in lines:
                line = clean_line(raw)
                s.output.append(e.rank, e.stream, line)
                self.combined.append(e.rank, e.stream, line)
        if text:
            # only what a terminal still shows is kept: the last \r segment, bounded
            self._tails[key] = last_segment(text)[-MAX_TAIL_CHARS:]
        return [("output", e.rank)]

    def lines_left_out(self, rank: int, lines: int) -> None:
        """``lines`` of ``rank``'s output older than any the buffers keep, counted but not
        folded in (a history replayed to its latest lines: ``attach``)."""
        for buffer in (self.rank(rank).output, self.combined):
            buffer.total += lines
            buffer.dropped += lines

    def pending_tail(self, rank: int, stream: str) -> str:
        """The rank's transient (uncommitted) line on ``stream``, as a terminal shows it."""
        return clean_line(self._tails.get((rank, stream), ""))

    def transient_lines(self) -> list[tuple[int, str, str]]:
        """Every rank's transient line, ``(rank, stream, text)`` by rank."""
        out = []
        for (rank, stream), raw in sorted(self._tails.items()):
            text = clean_line(raw)
            if text:
                out.append((rank, stream, text))
        return out

    def flush_tails(self) -> list[tuple[int, str, str]]:
        """Turn unterminated tails into lines (at the end of a launch); return them."""
        lines: list[tuple[int, str, str]] = []
        for (rank, stream), text in sorted(self._tails.items()):
            line = clean_line(text)
            if line:
                self.rank(rank).output.append(rank, stream, line)
                self.combined.append(rank, stream, line)
                lines.append((rank, stream, line))
        self._tails.clear()
        return lines

    def _on_ProgressUpdate(self, e: ProgressUpdate) -> list[Change]:
        s = self.rank(e.rank)
        if e.disabled:
            return []
        bar = s.bars.get(e.bar_id)
        if bar is None:
            bar = BarState(bar_id=e.bar_id, desc=e.desc, n=e.n, total=e.total, level=e.level)
            self._place_bar(s, bar)
        bar.desc, bar.n, bar.total, bar.unit = e.desc, e.n, e.total, e.unit
        bar.rate, bar.elapsed, bar.postfix = e.rate, e.elapsed, e.postfix
        bar.closed = bar.closed or e.closed
        bar.updated = e.time
        if bar.closed and not bar.style:
            bar.style = "success" if (bar.complete or bar.total is None) else "danger"
        if s.status == STARTING:
            s.status = RUNNING
        return [("bars", e.rank)]

    def _place_bar(self, s: RankState, bar: BarState) -> None:
        """Add a bar; a nested bar takes the slot of a closed bar of the same level
        (like tqdm redrawing line ``level``), so an epoch loop doesn't pile up step bars."""
        if bar.level > 0:
            for old_id, old in list(s.bars.items()):
                if old.closed and old.level == bar.level:
                    s.bars = {
                        (bar.bar_id if k == old_id else k): (bar if k == old_id else v)
                        for k, v in s.bars.items()
                    }
                    return
        s.bars[bar.bar_id] = bar
        while len(s.bars) > MAX_BARS_PER_RANK:
            closed = [k for k, v in s.bars.items() if v.closed]
            if not closed:
                break
            del s.bars[closed[0]]
            s.dropped_bars += 1

    def _on_BarrierEnter(self, e: BarrierEnter) -> list[Change]:
        s = self.rank(e.rank)
        location = notebook_cell_location(e.location)
        s.barrier = BarrierWait(index=e.index, location=location, kind=e.kind, since=e.time)
        if s.status in (STARTING, RUNNING):
            s.status = WAITING
        rec = self.barriers.get(e.index)
        if rec is None:
            rec = self.barriers[e.index] = BarrierRecord(index=e.index, kind=e.kind)
        rec.locations[e.rank] = location
        rec.arrived[e.rank] = e.time
        if rec.completed is None:
            # ranks that already left the run will never come (their end may be reported
            # before the waiting rank's enter: events of different ranks race)
            for other in self.ranks.values():
                if other.ended is not None and other.rank not in rec.arrived:
                    rec.left.setdefault(other.rank, other.end_reason)
        return [("rank", e.rank), ("barriers",)]

    def _on_BarrierExit(self, e: BarrierExit) -> list[Change]:
        s = self.rank(e.rank)
        if s.barrier is not None and s.barrier.index == e.index:
            s.barrier = None
            if s.status == WAITING:
                s.status = RUNNING
        rec = self.barriers.get(e.index)
        if rec is not None:
            rec.exited[e.rank] = e.time
            if rec.completed is None:
                rec.completed = e.time
            rec.left.clear()  # it completed: everybody came (an end seen first was a race)
        if len(self.barriers) > MAX_BARRIERS:
            for index in sorted(self.barriers):
                if len(self.barriers) <= MAX_BARRIERS:
                    break
                old = self.barriers[index]
                if old.completed is not None and not old.waiting():
                    del self.barriers[index]
                    self.dropped_barriers += 1
        return [("rank", e.rank), ("barriers",)]

    def _end_rank(self, rank: int, status: str, time: float, why: str) -> list[Change]:
        s = self.rank(rank)
        # A rank that already failed may still be reported as died/stopped afterwards:
        # the first real ending wins.
        if s.status in ENDED and not (s.status == STOPPED and status in (FAILED, DIED)):
            return []
        s.status, s.ended, s.end_reason = status, time, why
        s.barrier = None
        self._freeze_bars(s)
        changes: list[Change] = [("rank", rank), ("bars", rank)]
        for rec in self.barriers.values():
            if (
                rec.completed is None
                and rec.waiting()
                and rank not in rec.arrived
                and rank not in rec.left
            ):
                rec.left[rank] = why
                changes.append(("barriers",))
        return changes

    @staticmethod
    def _freeze_bars(s: RankState) -> None:
        """A rank ended: its open bars stop (no eta) and take their final colour."""
        broke = s.status in (FAILED, DIED) and not s.collateral
        for bar in s.bars.values():
            if not bar.closed:
                bar.frozen = True
            if bar.complete or s.status == DONE:
                bar.style = "success"
            elif not (bar.closed and bar.style):  # a bar closed short keeps its red
                bar.style = "danger" if broke else "stopped"

    def _on_WorkerFinished(self, e: WorkerFinished) -> list[Change]:
        return self._end_rank(e.rank, DONE, e.time, "returned")

    def _on_WorkerFailed(self, e: WorkerFailed) -> list[Change]:
        s = self.rank(e.rank)
        s.exc_type, s.message, s.traceback, s.collateral = (
            e.exc_type,
            e.message,
            e.traceback,
            e.collateral,
        )
        return self._end_rank(e.rank, FAILED, e.time, f"raised {e.exc_type}")

    def _on_WorkerExited(self, e: WorkerExited) -> list[Change]:
        s = self.rank(e.rank)
        s.pid = e.pid or s.pid
        s.exitcode, s.signal_name = e.exitcode, e.signal_name
        if e.exitcode is None and e.signal_name is None and e.note:
            return self._end_rank(e.rank, DIED, e.time, e.note)  # no process to tell of
        how = e.signal_name or f"exit code {e.exitcode}"
        return self._end_rank(e.rank, DIED, e.time, f"died ({how})")

    def _on_WorkerStopped(self, e: WorkerStopped) -> list[Change]:
        self.rank(e.rank).stop_reason = e.reason
        return self._end_rank(e.rank, STOPPED, e.time, STOPPED_REASON)

    def _on_MetricsLogged(self, e: MetricsLogged) -> list[Change]:
        for name, value in e.values:
            per_rank = self.metrics.get(name)
            if per_rank is None:
                per_rank = self.metrics[name] = {}
            series = per_rank.get(e.rank)
            if series is None:
                series = per_rank[e.rank] = MetricSeries()
            series.add(e.step, value)
        self.metrics_logged += 1
        return [("metrics",)]

    def _on_StacksTaken(self, e: StacksTaken) -> list[Change]:
        """A stall (or an interrupt of stuck ranks): where every rank is. Reports asked
        for on demand are shown where they were asked, not here."""
        if e.reason == "request":
            return []
        self.stall = e
        return [("stall",)]

    def _on_StallOver(self, e: StallOver) -> list[Change]:
        self.stall = None
        return [("stall",)]

    def _on_LaunchFinished(self, e: LaunchFinished) -> list[Change]:
        self.finished = e
        changes: list[Change] = [("launch",)]
        if e.ok and self.stall is not None:  # every rank returned: whatever stall was seen
            self.stall = None  # is over (a look that came as the last ones returned, on a
            changes.append(("stall",))  # loaded machine, saw them in their teardown)
        changes += [("output", rank) for rank, _, _ in self.flush_tails()]
        cause = e.root_cause_rank
        for s in self.ranks.values():
            if s.status not in ENDED:
                s.status, s.ended = (DONE if e.ok else STOPPED), e.time
                if e.ok and self.session_start:  # the ranks stay, ready for tasks
                    s.status = READY
            self._freeze_bars(s)
            if s.rank == cause and s.status == STOPPED:  # the launcher names it the cause
                for bar in s.bars.values():
                    bar.style = "success" if bar.complete else "danger"
            changes += [("rank", s.rank), ("bars", s.rank)]
        return changes


#: Event type -> the model's handler for it.
HANDLERS: dict[type, Callable[[LaunchModel, Any], list[Change]]] = {
    RendezvousStarted: LaunchModel._on_RendezvousStarted,
    NodesWaiting: LaunchModel._on_NodesWaiting,
    FollowingStopped: LaunchModel._on_FollowingStopped,
    LaunchStarted: LaunchModel._on_LaunchStarted,
    LaunchRestarting: LaunchModel._on_LaunchRestarting,
    WorkerPhase: LaunchModel._on_WorkerPhase,
    WorkerStarted: LaunchModel._on_WorkerStarted,
    Output: LaunchModel._on_Output,
    ProgressUpdate: LaunchModel._on_ProgressUpdate,
    BarrierEnter: LaunchModel._on_BarrierEnter,
    BarrierExit: LaunchModel._on_BarrierExit,
    WorkerFinished: LaunchModel._on_WorkerFinished,
    WorkerFailed: LaunchModel._on_WorkerFailed,
    WorkerExited: LaunchModel._on_WorkerExited,
    WorkerStopped: LaunchModel._on_WorkerStopped,
    MetricsLogged: LaunchModel._on_MetricsLogged,
    StacksTaken: LaunchModel._on_StacksTaken,
    StallOver: LaunchModel._on_StallOver,
    LaunchFinished: LaunchModel._on_LaunchFinished,
}

__all__ = [
    "HANDLERS",
    "DIED",
    "DONE",
    "ENDED",
    "READY",
    "FAILED",
    "RUNNING",
    "STARTING",
    "STOPPED",
    "WAITING",
    "BarState",
    "BarrierRecord",
    "BarrierWait",
    "LaunchModel",
    "MetricSeries",
    "OutputBuffer",
    "Spread",
    "RankState",
    "clean_line",
    "last_segment",
    "ranks_changed",
    "fmt_clock",
    "fmt_duration",
    "fmt_number",
    "fmt_rate",
    "notebook_cell_location",
    "notebook_cell_traceback",
]
