"""The text view: the same events as the dashboard, as plain lines (terminal, CI, nbval).

What it writes (no ANSI codes, no carriage returns)::

    notebook_launcher: 2 ranks, fork (...), gloo on 127.0.0.1:29500
    [rank0] a line the rank printed
    [rank1] epoch 1/3 [33%] 1.0it/s eta 0:02 | step 40/100 [40%] 95.0it/s eta 0:01
    [rank3] starting 5.0s: joining the process group (6/8 joined)
    [rank0] waiting at train.py:12 for 5.0s (barrier #1: missing rank 1)
    [rank0] done: epoch 3/3 [100%] 1.2it/s in 2.5s
    notebook_launcher: loss (step 99): rank 0 0.12, rank 1 0.13
    notebook_launcher: 2 ranks, 3.1s: ok

Rank output goes out at once (stderr lines to ``sys.stderr`` unless a ``stream`` was
given); a line still being redrawn with ``\\r`` (another library's progress display) is
written once, when a newline ends it. Logged metrics are summed up at the end. Progress is periodic: at most one line per rank every ``interval`` seconds,
plus one final line per outermost bar when it closes (nested bars, e.g. an epoch's
step bar, close once per outer step; their state is in the periodic lines). With ``progress=False`` (what
``dashboard=False`` gives) only the rank output and the final summary are written.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from .._events import (
    BarrierEnter,
    Event,
    LaunchFinished,
    LaunchRestarting,
    LaunchStarted,
    NodesWaiting,
    Output,
    ProgressUpdate,
    RendezvousStarted,
    StacksTaken,
    StallOver,
    WorkerExited,
    WorkerFailed,
    WorkerStopped,
)
from .model import STARTING, WAITING, LaunchModel, RankState, fmt_duration, fmt_number

#: Seconds between two flushes of the stream by :meth:`TextView.tick`.
FLUSH_INTERVAL = 0.2

#: Of a history replayed at once (``attach``), the latest output lines of each rank that
#: are written; older ones are counted in one line (the run's handle has them all).
HISTORY_LINES = 1000


class TextView:
    """Renders a :class:`~notebook_launcher.ui.model.LaunchModel` as rank-prefixed lines.

    Example::

        view = TextView(interval=10.0)
        for event in events:
            view.handle(event)
        view.close()
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        progress: bool = True,
        interval: float = 5.0,
        alert_delay: float = 1.0,
        clock: Callable[[], float] = time.time,
        model: LaunchModel | None = None,
    ) -> None:
        self._stream = stream
        self.progress = progress
        self.interval = interval
        self.clock = clock
        self.model = model if model is not None else LaunchModel()
        self._last_line: dict[int, float] = {}  # rank -> time of its last progress line
        self._dirty: set[int] = set()  # ranks whose progress changed since their last line
        self.alert_delay = alert_delay
        self._alerts_seen: dict[str, float] = {}  # alert -> when the model first had it
        self._alerts_shown: set[str] = set()
        self._ticked = float("-inf")
        self._closed = False
        self._stall_shown: tuple[object, ...] | None = None  # what the last stall report said
        self._stall_last: tuple[str, ...] = ()  # the findings of the last look
        self._labels: dict[int, str] = {}  # rank -> the label of its lines, until an event
        #: while a history is replayed: what it writes, (target, text), written at the end
        self._held: list[tuple[TextIO, str]] | None = None
        #: rank -> its older output lines a replayed history left out, said before its first
        self._left_out: dict[int, int] = {}

    #: of a history, the latest output lines of each rank it writes (see ``ui.replay``)
    history_lines = HISTORY_LINES

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def _write(self, text: str, stderr: bool = False) -> None:
        target = sys.stderr if stderr and self._stream is None else self.stream
        if self._held is not None:
            self._held.append((target, text))
            return
        target.write(text)

    # -- View protocol ---------------------------------------------------------------------
    def handle(self, event: Event) -> None:
        if isinstance(event, LaunchFinished):
            self._flush_tails()  # before the model folds them in silently
        if type(event) is Output:  # the hot path: every line a rank prints
            self._output(event)
            return
        self._labels.clear()  # (a label changes with the launch's start, a rank's host)
        self.model.apply(event)
        if isinstance(event, LaunchFinished):
            self._finish()
            return
        if isinstance(event, (StacksTaken, StallOver)):  # shown with or without progress
            self._stall(event)
            return
        if isinstance(event, (RendezvousStarted, NodesWaiting)):  # even without progress
            self._write(f"notebook_launcher: {self.model.waiting_text()}\n")
        elif isinstance(event, LaunchRestarting):
            self._last_line.clear()
            self._dirty.clear()
            self._write(f"notebook_launcher: {self.model.restart_text()}\n")
        if not self.progress:
            return
        now = self.clock()
        if isinstance(event, LaunchStarted):
            self._write(f"notebook_launcher: {self._header(event)}\n")
            if event.banner:
                self._write(f"notebook_launcher: note: {event.banner}\n")
        elif isinstance(event, ProgressUpdate):
            if event.disabled:
                return
            self._last_line.setdefault(event.rank, now)
            if event.closed:
                # nested bars (an epoch's step bar) close once per outer step: their
                # final state shows in the periodic lines, a line each would be noise
                bar = self.model.ranks[event.rank].bars.get(event.bar_id)
                if bar is not None and bar.level == 0:
                    label = self.model.line_label(event.rank)
                    self._write(f"{label} {bar.label()}: {bar.stats()}\n")
            else:
                self._dirty.add(event.rank)
                self._periodic(now, only=event.rank)
        elif isinstance(event, BarrierEnter):
            self._last_line[event.rank] = now  # first "waiting" line after `interval`
        elif isinstance(event, (WorkerFailed, WorkerExited, WorkerStopped)):
            state = self.model.ranks[event.rank]
            self._write(f"{self.model.line_label(event.rank)} {state.outcome()}\n")
        self._show_alerts(now)

    def _say_left_out(self, only: int | None = None) -> None:
        for rank in sorted(self._left_out) if only is None else (only,):
            lines = self._left_out.pop(rank)
            self._write(
                f"{self.model.line_label(rank)} ... {lines:,} earlier line(s) not "
                f"shown here: the run's handle has them all (handle.output({rank}))\n"
            )

    def _output(self, event: Output) -> None:
        if self._left_out and event.rank in self._left_out:
            self._say_left_out(event.rank)
        out = self.model.rank(event.rank).output
        before = out.total
        self.model._on_Output(event)
        new = min(out.total - before, len(out.lines))
        if not new:
            return
        label = self._labels.get(event.rank)
        if label is None:
            label = self._labels[event.rank] = self.model.line_label(event.rank)
        stderr = event.stream == "stderr"
        if new == 1:  # most events: one line
            self._write(f"{label} {out.lines[-1][2]}\n", stderr=stderr)
            return
        committed = list(itertools.islice(reversed(out.lines), new))
        for _, _, line in reversed(committed):
            self._write(f"{label} {line}\n", stderr=stderr)

    def replay(self, events: Sequence[Event], left_out: Mapping[int, int] | None = None) -> None:
        """A history at once (``attach``): what ``handle`` would write for each event in
        turn, written as one block per run of lines to one stream, not a write per line.
        ``left_out``: rank -> its output lines older than :attr:`history_lines`, not read:
        one line before the rank's first line says how many, and where they are."""
        for rank, lines in (left_out or {}).items():
            self.model.lines_left_out(rank, lines)
            self._left_out[rank] = self._left_out.get(rank, 0) + lines
        if self._held is not None:  # (a replay within a replay: one block at the end)
            for event in events:
                self.handle(event)
            return
        self._held = []
        try:
            for event in events:
                self.handle(event)
            self._say_left_out()  # (a rank with no line after its cut)
        finally:
            held, self._held = self._held, None
            blocks: list[tuple[TextIO, list[str]]] = []
            for target, text in held:
                if blocks and blocks[-1][0] is target:
                    blocks[-1][1].append(text)
                else:
                    blocks.append((target, [text]))
            for target, texts in blocks:
                target.write("".join(texts))
            for target in {id(t): t for t, _ in blocks}.values():
                target.flush()

    def tick(self) -> None:
        """At most every ``FLUSH_INTERVAL`` seconds: periodic lines, alerts, one flush (the
        launcher ticks after every wait; a flush per tick sent a message per line)."""
        if self._closed:
            return
        now = self.clock()
        if now - self._ticked < FLUSH_INTERVAL:
            return
        self._ticked = now
        if self.progress:
            self._periodic(now)
            self._show_alerts(now)
        self.stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._flush_tails()
        self.stream.flush()
        if self._stream is None:
            sys.stderr.flush()

    # -- rendering -------------------------------------------------------------------------
    def _flush_tails(self) -> None:
        for rank, stream, line in self.model.flush_tails():
            self._write(f"{self.model.line_label(rank)} {line}\n", stderr=stream == "stderr")

    @staticmethod
    def _header(e: LaunchStarted) -> str:
        if e.task:  # a session's task: its ranks started long ago
            return f"session {e.task}, {e.local_world_size} of {e.world_size} ranks"
        nodes = (
            f" on node {e.node_rank} of {e.num_nodes} (world size {e.world_size})"
            if e.num_nodes > 1 and not e.hosts
            else ""
        )
        where = e.rendezvous or f"on {e.master_addr}:{e.master_port}"
        restarts = f", up to {e.max_restarts} restarts" if e.max_restarts else ""
        placed = f"; {e.placement}" if e.placement else ""
        return (
            (f"detached run {e.detached}: " if e.detached else "")
            + f"{e.local_world_size} rank{'s' if e.local_world_size != 1 else ''}{nodes}, "
            f"{e.start_method} ({e.start_reason}), {e.backend} {where}{restarts}{placed}"
        )

    def rank_line(self, state: RankState, now: float) -> str:
        """``running 0:12 | epoch 1/3 [33%] ... | step ...`` for one rank."""
        parts = []
        if state.status == STARTING:  # a slow start, said while it lasts
            since = self.model.start_time
            took = f" {fmt_duration(now - since)}" if since is not None else ""
            return f"starting{took}: {state.status_text(now)}"
        if state.status == WAITING and state.barrier is not None:
            rec = self.model.barriers.get(state.barrier.index)
            missing = rec.missing(self.model.rank_ids) if rec is not None else []
            who = f"missing rank {', '.join(map(str, missing))}" if missing else "all arrived"
            label = rec.label if rec is not None else f"barrier #{state.barrier.index}"
            parts.append(f"{state.status_text(now)} ({label}: {who})")
        else:
            elapsed = state.elapsed(now)
            parts.append(
                state.status_text(now)
                + (f" {fmt_duration(elapsed)}" if elapsed is not None else "")
            )
        for bar in state.open_bars():
            parts.append(f"{bar.label()} {bar.stats()}")
        return " | ".join(parts)

    def _periodic(self, now: float, only: int | None = None) -> None:
        ranks = [only] if only is not None else self.model.rank_ids
        for rank in ranks:
            state = self.model.ranks.get(rank)
            if state is None or state.ended is not None:
                continue
            waiting = state.status == WAITING
            start = self.model.start_time
            slow_start = (
                state.status == STARTING and start is not None and now - start >= self.interval
            )
            if rank not in self._dirty and not (waiting or slow_start):
                continue
            if not (waiting or slow_start) and not state.open_bars():
                continue
            last = self._last_line.get(rank)
            if last is not None and now - last < self.interval:
                continue
            self._last_line[rank] = now
            self._dirty.discard(rank)
            self._write(f"{self.model.line_label(rank)} {self.rank_line(state, now)}\n")

    def _stall(self, event: StacksTaken | StallOver) -> None:
        """Where every rank is: the whole report when a stall begins (and when an interrupt
        says where the ranks were); while it lasts, a line with the findings when they
        changed and then held for two looks in a row (ranks that compute silently change
        places at every look, and a terminal is not a live view)."""
        from .stall import stall_text

        if isinstance(event, StallOver):
            if self._stall_shown is not None:
                self._write(
                    f"notebook_launcher: progress again (the stall lasted "
                    f"{fmt_duration(event.lasted)})\n"
                )
            self._stall_shown = None
            return
        if event.reason == "request":
            return
        held = event.findings == self._stall_last
        self._stall_last = event.findings
        if self._stall_shown is None or event.reason != "stall":
            self._write(stall_text(event))
        elif event.findings != self._stall_shown[0] and held:
            findings = "; ".join(event.findings)
            self._write(
                f"notebook_launcher: still no progress ({fmt_duration(event.quiet)}): {findings}\n"
            )
        else:
            return
        self._stall_shown = (event.findings,)
        self.stream.flush()

    def _show_alerts(self, now: float, final: bool = False) -> None:
        """Print "rank k left while others waited" once it held ``alert_delay`` seconds (or
        at the end): events of different ranks race, and a barrier that completes right
        after clears a premature one."""
        for alert in self.model.alerts():
            first = self._alerts_seen.setdefault(alert, now)
            if alert not in self._alerts_shown and (final or now - first >= self.alert_delay):
                self._alerts_shown.add(alert)
                self._write(f"notebook_launcher: {alert}\n")

    def metric_lines(self) -> list[str]:
        """The last logged value of each metric: ``loss (step 99): rank 0 0.12, rank 1 0.13``
        (with many ranks: the lowest, median and highest)."""
        out = []
        for name, per in self.model.metrics.items():
            last = {r: p for r, s in sorted(per.items()) if (p := s.latest) is not None}
            if not last:
                continue
            step = max(p[0] for p in last.values())
            if len(last) > 8:
                order = sorted(last, key=lambda r: last[r][1])
                picks = [
                    ("lowest", order[0]),
                    ("median", order[len(order) // 2]),
                    ("highest", order[-1]),
                ]
                values = ", ".join(
                    f"{what} {fmt_number(last[r][1])} (rank {r})" for what, r in picks
                )
            else:
                values = ", ".join(f"rank {r} {fmt_number(p[1])}" for r, p in last.items())
            out.append(f"{name} (step {step}): {values}")
        return out

    def _finish(self) -> None:
        if self.progress:
            self._show_alerts(self.clock(), final=True)
            for line in self.metric_lines():
                self._write(f"notebook_launcher: {line}\n")
        self._write(f"notebook_launcher: {self.model.summary_line()}\n")
        self.stream.flush()


__all__ = ["TextView"]
