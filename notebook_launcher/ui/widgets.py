"""The live dashboard: an ipywidgets view of :class:`~notebook_launcher.ui.model.LaunchModel`.

Layout (one ``VBox``, displayed once when the view is created)::

    header    notebook_launcher · 2 ranks · fork · gloo · running 0:12
    alerts    (red) rank 1 returned while rank(s) 0 waited at barrier #2 (train.py:30)
    rows      rank 0 · pid 4242 · cpu | epoch  [#####     ] 2/4 [50%] 1.9it/s eta 0:01
              running 0:12            | ↳ step [########  ] 80/100 [80%] 95it/s eta 0:00
              rank 1 ...              (grouped under "node k" headings when several nodes)
    barriers  #  where         kind               arrived  missing / left  state
    output    Tab: all ranks | rank 0 | rank 1   (bounded, newest at the bottom)
    summary   2 ranks, 3.1s: ok     (or the root cause, in red)

The launcher calls :meth:`WidgetView.handle` from its event loop in the kernel's main
thread, so comm messages go out while the cell runs. Updates are coalesced: the view
redraws what changed at most every ``min_interval`` seconds (output panes every
``output_interval``), each widget's attributes in one ``hold_sync`` message.
:meth:`close` draws the final state (bar styles, summary, the failing rank's pane
opened) before the launch returns.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable
from typing import Any

from .._events import Event, LaunchFinished
from .model import (
    DIED,
    DONE,
    FAILED,
    RUNNING,
    STARTING,
    STOPPED,
    WAITING,
    BarState,
    LaunchModel,
    OutputBuffer,
    RankState,
    fmt_duration,
    notebook_cell_traceback,
    ranks_changed,
)

STATUS_COLOURS = {
    STARTING: "#757575",
    RUNNING: "#1565c0",
    WAITING: "#e65100",
    DONE: "#2e7d32",
    FAILED: "#c62828",
    DIED: "#c62828",
    STOPPED: "#757575",
}
RED = "#c62828"
PANE_STYLE = (
    "display:flex;flex-direction:column-reverse;max-height:260px;overflow-y:auto;"
    "border:1px solid #ddd;background:#fafafa"
)
PRE_STYLE = "margin:0;padding:4px 6px;font-size:12px;line-height:1.35;white-space:pre-wrap"


def _esc(text: str) -> str:
    return html.escape(text, quote=False)


class _BarRow:
    """One progress bar: ``[desc][bar][n/total rate eta]``."""

    def __init__(self, W: Any) -> None:
        self.progress = W.FloatProgress(
            value=0.0,
            min=0.0,
            max=1.0,
            description="",
            style={"description_width": "140px"},
            layout=W.Layout(width="420px"),
        )
        self.stats = W.HTML(value="", layout=W.Layout(margin="0 0 0 8px"))
        self.box = W.HBox([self.progress, self.stats])
        self.box.add_class("nl-bar")

    def render(self, bar: BarState) -> None:
        label = bar.label() if bar.level == 0 else "\u21b3 " + bar.label()
        total = float(bar.total) if bar.total else 1.0
        done = 1.0 if bar.closed else 0.0
        value = min(float(bar.n), total) if bar.total else done
        with self.progress.hold_sync():
            self.progress.description = label
            self.progress.tooltip = bar.label()
            self.progress.max = total
            self.progress.value = value
            self.progress.bar_style = bar.style
        self.stats.value = f"<span style='font-family:monospace'>{_esc(bar.stats())}</span>"


class _RankRow:
    """One rank: an info cell on the left, its bars on the right."""

    def __init__(self, W: Any, rank: int) -> None:
        self.W = W
        self.info = W.HTML(value="", layout=W.Layout(width="300px", min_width="300px"))
        self.bars_box = W.VBox([])
        self.bars: list[_BarRow] = []
        self.box = W.HBox([self.info, self.bars_box])
        self.box.add_class("nl-rank")
        self.box.add_class(f"nl-rank-{rank}")
        self.box.layout.border_bottom = "1px solid #eee"
        self.box.layout.padding = "2px 0"

    def render_info(self, s: RankState, now: float) -> None:
        colour = STATUS_COLOURS.get(s.status, "#000")
        who = [f"<b>rank {s.rank}</b>"]
        if s.pid is not None:
            who.append(f"pid {s.pid}")
        if s.device:
            who.append(_esc(s.device))
        elapsed = s.elapsed(now)
        status = _esc(s.status_text(now))
        if s.status in (FAILED, DIED, STOPPED):
            status = _esc(s.outcome())
        line2 = f"<span style='color:{colour};font-weight:600'>\u25cf {status}</span>"
        if elapsed is not None:
            line2 += f" \u00b7 {fmt_duration(elapsed)}"
        head = " \u00b7 ".join(who)
        self.info.value = f"<div class='nl-info' style='line-height:1.3'>{head}<br>{line2}</div>"

    def render_bars(self, s: RankState) -> None:
        bars = list(s.bars.values())
        while len(self.bars) < len(bars):
            self.bars.append(_BarRow(self.W))
        for row, bar in zip(self.bars, bars, strict=False):
            row.render(bar)
        children = tuple(row.box for row in self.bars[: len(bars)])
        if self.bars_box.children != children:
            self.bars_box.children = children


def _pane_html(buf: OutputBuffer, labels: bool, tail: str = "", traceback: str = "") -> str:
    lines = []
    note = buf.dropped_note()
    if note:
        lines.append(f"<span style='color:#757575'>{_esc(note)}</span>")
    for rank, stream, text in buf.lines:
        prefix = f"[rank{rank}] " if labels else ""
        body = _esc(prefix + text)
        lines.append(f"<span style='color:{RED}'>{body}</span>" if stream == "stderr" else body)
    if tail:
        lines.append(_esc(tail))
    if traceback:
        lines.append(f"<span style='color:{RED}'>{_esc(traceback.rstrip())}</span>")
    if not lines:
        lines.append("<span style='color:#9e9e9e'>(no output)</span>")
    return f"<div style='{PANE_STYLE}'><pre style='{PRE_STYLE}'>{chr(10).join(lines)}</pre></div>"


_DASHBOARD_CLASS: Any = None


def _dashboard_class(W: Any) -> Any:
    """A ``VBox`` whose ``text/plain`` is one fixed line instead of a repr of every child.

    That line is what nbval compares (it skips widget views) and what viewers without
    widgets show; it is fixed at display time, so it says nothing that changes: a strict
    nbval run of a cell that launches needs no sanitizing for the dashboard.
    """
    global _DASHBOARD_CLASS
    if _DASHBOARD_CLASS is None:

        class Dashboard(W.VBox):
            def __repr__(self) -> str:
                return "notebook_launcher dashboard"

        _DASHBOARD_CLASS = Dashboard
    return _DASHBOARD_CLASS


class WidgetView:
    """The ipywidgets dashboard. See the module docstring for what it shows.

    Example (what the launcher does)::

        view = WidgetView()          # displays itself in the running cell
        for event in events:
            view.handle(event)
        view.close()
    """

    def __init__(
        self,
        *,
        model: LaunchModel | None = None,
        clock: Callable[[], float] = time.time,
        display: bool = True,
        min_interval: float = 0.1,
        output_interval: float = 0.25,
    ) -> None:
        import ipywidgets as W

        self.W = W
        self.model = model if model is not None else LaunchModel()
        self.clock = clock
        self.min_interval = min_interval
        self.output_interval = output_interval
        self.header = W.HTML(value="<b>notebook_launcher</b> \u00b7 starting")
        self.alerts = W.HTML(value="")
        self.ranks_box = W.VBox([])
        self.barriers = W.HTML(value="")
        self.tabs = W.Tab(children=(), layout=W.Layout(margin="6px 0 0 0"))
        self.summary = W.HTML(value="")
        self.root = _dashboard_class(W)(
            [self.header, self.alerts, self.ranks_box, self.barriers, self.tabs, self.summary]
        )
        self.root.add_class("nl-dashboard")
        self.header.add_class("nl-header")
        self.alerts.add_class("nl-alerts")
        self.barriers.add_class("nl-barriers")
        self.tabs.add_class("nl-output")
        self.summary.add_class("nl-summary")
        self.rows: dict[int, _RankRow] = {}
        self.panes: dict[int | None, Any] = {}  # None: the combined pane
        self._dirty: set[tuple[object, ...]] = set()
        self._last_flush = float("-inf")
        self._last_output_flush = float("-inf")
        self._closed = False
        if display:
            from IPython.display import display as ipy_display

            ipy_display(self.root)

    # -- View protocol ---------------------------------------------------------------------
    def handle(self, event: Event) -> None:
        self._dirty |= self.model.apply(event)
        now = self.clock()
        if isinstance(event, LaunchFinished) or now - self._last_flush >= self.min_interval:
            self.flush(now)

    def tick(self) -> None:
        if not self._closed:
            self.flush(self.clock(), ticking=True)

    def close(self) -> None:
        if self._closed:
            return
        self._dirty |= {("output", rank) for rank, _, _ in self.model.flush_tails()}
        self.flush(self.clock(), force=True)
        self._closed = True

    # -- drawing ---------------------------------------------------------------------------
    def flush(self, now: float, force: bool = False, ticking: bool = False) -> None:
        """Redraw what changed (and, when ``ticking``, the clocks of live ranks)."""
        m = self.model
        dirty, self._dirty = self._dirty, set()
        self._last_flush = now
        self._ensure_structure()
        live = [r for r in m.rank_ids if m.ranks[r].ended is None]
        if ticking or force or ("launch",) in dirty:
            self._render_header(now)
        info = ranks_changed(dirty, "rank")
        if ticking:
            info |= set(live)
        for r in sorted(info):
            self.rows[r].render_info(m.ranks[r], now)
        for r in sorted(ranks_changed(dirty, "bars")):
            self.rows[r].render_bars(m.ranks[r])
        if ("barriers",) in dirty or (ticking and m.open_barriers()) or force:
            self._render_barriers(now)
            self._render_alerts()
        outputs = ranks_changed(dirty, "output")
        if outputs and not force and now - self._last_output_flush < self.output_interval:
            self._dirty |= {("output", r) for r in outputs}  # later, in one go
        elif outputs or force:
            self._last_output_flush = now
            self._render_outputs(outputs if not force else set(m.rank_ids))
        if force or m.finished is not None:
            self._render_end()

    def _ensure_structure(self) -> None:
        m = self.model
        new = [r for r in m.rank_ids if r not in self.rows]
        if not new:
            return
        for r in new:
            self.rows[r] = _RankRow(self.W, r)
        groups = m.nodes()
        children: list[Any] = []
        for node, ranks in sorted(groups.items()):
            if len(groups) > 1 or (m.started is not None and m.started.num_nodes > 1):
                heading = self.W.HTML(value=f"<b>node {node}</b>")
                children.append(heading)
            children += [self.rows[r].box for r in ranks]
        self.ranks_box.children = tuple(children)
        keys: list[int | None] = [None, *m.rank_ids]
        for key in keys:
            if key not in self.panes:
                pane = self.W.HTML(value=_pane_html(OutputBuffer(1), labels=key is None))
                pane.add_class("nl-pane-all" if key is None else f"nl-pane-{key}")
                self.panes[key] = pane
        with self.tabs.hold_sync():
            self.tabs.children = tuple(self.panes[k] for k in keys)
            self.tabs.titles = tuple("all ranks" if k is None else f"rank {k}" for k in keys)

    def _render_header(self, now: float) -> None:
        m = self.model
        parts = ["<b>notebook_launcher</b>"]
        if m.started is not None:
            s = m.started
            parts.append(f"{s.local_world_size} rank{'s' if s.local_world_size != 1 else ''}")
            if s.num_nodes > 1:
                parts.append(f"node {s.node_rank} of {s.num_nodes}")
            parts += [_esc(s.start_method), _esc(s.backend)]
        if m.finished is None:
            parts.append(f"running {fmt_duration(m.elapsed(now))}")
        else:
            parts.append(f"finished in {fmt_duration(m.finished.wall_time)}")
        self.header.value = " \u00b7 ".join(parts)

    def _render_alerts(self) -> None:
        alerts = self.model.alerts()
        self.alerts.value = "".join(
            f"<div style='color:{RED};font-weight:600'>\u26a0 {_esc(a)}</div>" for a in alerts
        )

    def _render_barriers(self, now: float, keep: int = 8) -> None:
        m = self.model
        if not m.barriers:
            self.barriers.value = ""
            return
        ranks = m.rank_ids
        rows = []
        records = sorted(m.barriers.values(), key=lambda b: b.index)
        shown_from = max(0, len(records) - keep)
        hidden = shown_from + m.dropped_barriers
        for rec in records[shown_from:]:
            arrived = ", ".join(str(r) for r in rec.arrived_ranks(ranks)) or "-"
            missing = rec.missing(ranks)
            colour = "#2e7d32"
            took = rec.took()
            if rec.completed is not None:
                state = f"passed ({fmt_duration(took)})" if took is not None else "passed"
            elif rec.left:
                colour = RED
                state = "; ".join(f"rank {r} {why}" for r, why in sorted(rec.left.items()))
            elif rec.waiting():
                colour = "#e65100"
                since = min(rec.arrived[r] for r in rec.waiting())
                state = f"waiting {fmt_duration(now - since)}"
            else:
                state = "in progress"
            where = _esc(rec.location) + (" (mismatch!)" if rec.mismatched else "")
            miss = ", ".join(str(r) for r in missing) or "-"
            rows.append(
                f"<tr><td>#{rec.index}</td><td>{where}</td><td>{_esc(rec.kind)}</td>"
                f"<td>{arrived}</td><td>{miss}</td>"
                f"<td style='color:{colour};font-weight:600'>{_esc(state)}</td></tr>"
            )
        more = (
            f"<div style='color:#757575'>{hidden} earlier barrier(s) not shown</div>"
            if hidden
            else ""
        )
        self.barriers.value = (
            "<div style='margin-top:4px'><b>barriers</b>"
            "<table style='border-collapse:collapse;font-size:12px' cellpadding='3'>"
            "<tr style='text-align:left'><th>#</th><th>where</th><th>kind</th><th>arrived</th>"
            "<th>missing</th><th>state</th></tr>" + "".join(rows) + f"</table>{more}</div>"
        )

    def _render_outputs(self, ranks: set[int]) -> None:
        m = self.model
        for r in sorted(ranks):
            s = m.ranks[r]
            tail = m.pending_tail(r, "stdout") or m.pending_tail(r, "stderr")
            tb = notebook_cell_traceback(s.traceback) if m.finished and s.status == FAILED else ""
            self.panes[r].value = _pane_html(s.output, labels=False, tail=tail, traceback=tb)
        if ranks:
            self.panes[None].value = _pane_html(m.combined, labels=True)

    def _render_end(self) -> None:
        m = self.model
        if m.finished is None:
            return
        ok = m.finished.ok
        colour = "#2e7d32" if ok else RED
        mark = "\u2714" if ok else "\u2718"
        self.summary.value = (
            f"<div style='color:{colour};font-weight:600;margin-top:4px'>{mark} "
            f"{_esc(m.summary_line())}</div>"
        )
        cause = m.root_cause()
        if not ok and cause is not None and cause.rank in m.rank_ids:
            self.tabs.selected_index = 1 + m.rank_ids.index(cause.rank)


__all__ = ["WidgetView"]
