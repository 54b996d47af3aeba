"""The live dashboard: an ipywidgets view of :class:`~notebook_launcher.ui.model.LaunchModel`.

Layout (one ``VBox``, displayed once when the view is created)::

    header    notebook_launcher · 2 ranks · fork: fast, nothing to pickle · gloo on ... · running 12s
    alerts    (red) rank 1 returned while rank(s) 0 waited at barrier #2 (train.py:30)
    ranks     rank 0 ● running      12s  epoch [####      ] 2/4   step [########  ] 80/100 95it/s
              (more than 8 ranks: slowest / median / fastest, a grid of every rank, stragglers)
    barriers  #  where  kind  arrived  missing  state     (html.SECTIONS: the parts under
                                                          the ranks; one more is one entry)
    picker    output of: [all ranks] [0] [1]        (front-end only: CSS on radio buttons)
    log       the newest lines of every rank, following the tail like a terminal
    plots     one panel per logged metric, one line per rank (inline SVG, redrawn ~2/s)

The parts are HTML widgets drawn by :mod:`~notebook_launcher.ui.html`, the same markup
the saved snapshot uses; a redraw of the rank table is one message whatever the number
of ranks and bars.

Message economy: the launcher calls :meth:`handle` for every event and :meth:`tick`
after every wait; both only fold the event in and, at most every ``interval`` seconds,
redraw what changed. Every widget message is paid from a token bucket that holds the
whole dashboard to ``max_messages`` per second (parts in order of importance: ranks,
plots (which pace themselves), log, header, barriers; what does not fit is drawn at the
next turn). The plot is
an inline SVG drawn from the model in milliseconds (:func:`~notebook_launcher.ui.plots.render_svg`),
so it is redrawn every ``PLOT_INTERVAL`` seconds and stays within about a second of the
bars; the PNG matplotlib draws (tens to hundreds of milliseconds) is made once, for the
snapshot.

The log follows the tail without any JavaScript: its scroll box is a ``column-reverse``
flex box (it opens at the bottom and stays there as lines arrive), and its lines live in
a ring of chunk widgets of which only the newest is redrawn, so the lines a user scrolled
up to keep their DOM nodes and the browser's scroll anchoring holds them in place;
scrolling back to the bottom follows again. Which rank's lines are shown is picked in
the browser alone (radio buttons and a CSS ``:has()`` rule), because a kernel busy with
the launch cannot hear a widget's click until the cell ends.

At :meth:`close` the display is replaced by a static HTML snapshot of the final state
(plus the final plot as an ``image/png`` output; without matplotlib the last SVG, and
the values as a table in the snapshot) and the widgets are closed: a saved
notebook shows the finished run in JupyterLab (trusted or not), on GitHub and on
nbviewer, without a kernel and without saved widget state.
"""

from __future__ import annotations

import base64
import itertools
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._events import Event, Output
from . import html as H
from . import plots
from .model import (
    LaunchModel,
    fmt_clock,
)
from .stall import stall_html

#: Widget messages per second, at most, for the whole dashboard.
MAX_MESSAGES = 20.0
#: Lines per log chunk before a new one is started, and most new lines shown in one turn.
CHUNK_LINES = 50
BURST_LINES = 200
#: Chunk widgets in the log's ring (the live log keeps about CHUNK_LINES * LOG_CHUNKS lines).
LOG_CHUNKS = 8
#: Seconds between two plot redraws, at least; slower when drawing takes long.
PLOT_INTERVAL = 0.5
#: A plot redraw may use about 1/PLOT_COST_RATIO of the kernel's time (but the plot is
#: redrawn at least every PLOT_MAX_INTERVAL seconds while metrics come in).
PLOT_COST_RATIO = 25.0
PLOT_MAX_INTERVAL = 1.0
#: What a redraw's cost is measured with (tests replace it to make the cost known).
_cost_clock = time.perf_counter
TEXT_PLAIN = "notebook_launcher dashboard"
#: The snapshot's font and line height, also inside widgets (which set a 28px line height).
BASE_STYLE = "font-size:13px;line-height:1.45"


class Budget:
    """A token bucket: in any ``T`` seconds at most ``0.8 * rate * T + 0.2 * rate``
    messages, plus the few one multi-message part may borrow (so about ``rate`` in any
    one second)."""

    def __init__(self, rate: float, now: float) -> None:
        self.fill = 0.8 * rate
        self.cap = max(1.0, 0.2 * rate)
        self.tokens = self.cap
        self.t = now
        self.spent = 0

    def refill(self, now: float) -> None:
        self.tokens = min(self.cap, self.tokens + max(0.0, now - self.t) * self.fill)
        self.t = now

    def take(self, n: int = 1) -> bool:
        """Pay ``n`` messages. A part that needs several (a new widget) may borrow from the
        next turns once the bucket has one token, so it is never starved by the parts that
        need one each; what it borrowed is paid back before anything else is sent."""
        if self.tokens + 1e-9 < min(n, 1):
            return False
        self.tokens -= n
        self.spent += n
        return True


def _style_block(d: str, ranks: list[int], many: bool) -> str:
    rules = [
        # an empty part takes no room; log chunks join without a gap
        f".{d} .widget-html:has(> .widget-html-content:empty){{display:none}}",
        # no output yet (a silent cell): no empty log box, no picker for it
        f".{d} .nl-log:not(:has(.nl-l)){{display:none!important}}",
        f".{d}:not(:has(.nl-log .nl-l)) .nl-pick{{display:none}}",
        f".{d} .nl-log .widget-html{{margin:0;min-height:0;height:auto}}",
        f".{d} .nl-log .widget-html-content{{line-height:normal}}",
        f".{d} .nl-l{{white-space:pre-wrap;overflow-wrap:anywhere;padding:0 6px;"
        "font-family:var(--jp-code-font-family,monospace);font-size:12px;line-height:1.35}",
        f".{d} .nl-e{{color:#c62828}}",
        f".{d} .nl-t{{color:#546e7a}}",
        f".{d} .nl-p{{color:#9e9e9e}}",
        f".{d} .nl-n{{color:#757575;font-style:italic}}",
        f".{d} .nl-pick{{display:flex;flex-wrap:wrap;gap:3px 4px;align-items:center;"
        "font-size:12px;margin:6px 0 2px 0}",
        f".{d} .nl-pick input{{position:absolute;opacity:0;width:0;height:0;margin:0}}",
        f".{d} .nl-pick label{{cursor:pointer}}",
        f".{d} .nl-pick label span{{display:inline-block;padding:0 6px;border:1px solid #cfcfcf;"
        "border-radius:3px;background:var(--jp-layout-color1,#fff)}",
        f".{d} .nl-pick input:checked+span{{background:#1565c0;color:#fff;border-color:#1565c0}}",
        f".{d} .nl-pick input:focus-visible+span{{outline:2px solid #90caf9}}",
    ]
    for r in ranks:
        on = f".{d}:has(#{d}-p{r}:checked)"
        rules += [
            f"{on} .nl-l:not(.nl-r{r}){{display:none}}",
            f"{on} .nl-p{{display:none}}",
            f"{on} .nl-row-{r}{{display:flex!important;background:#e3f2fd}}",
            f"{on} .nl-cell-{r}{{box-shadow:0 0 0 2px #212121}}",
        ]
    if many:
        rules += [
            f".{d}:has(#{d}-pall:checked) .nl-more{{display:flex!important}}",
            f".{d} .nl-pick .nl-rk{{display:none}}",
            f".{d} .nl-pick .nl-rk:has(input:checked){{display:inline}}",
        ]
    return "<style>" + "\n".join(rules) + "</style>"


def _picker(d: str, ranks: list[int], many: bool) -> str:
    tabs = [
        "<span style='color:#757575;margin-right:2px'>output of</span>",
        f"<label><input type='radio' name='{d}' id='{d}-pA' checked><span>all ranks</span></label>",
    ]
    # many ranks: a rank's tab shows only while it is picked (click its cell in the grid)
    css = " class='nl-rk'" if many else ""
    tabs += [
        f"<label{css}><input type='radio' name='{d}' id='{d}-p{r}'><span>rank {r}</span></label>"
        for r in ranks
    ]
    if many:
        tabs.append(
            "<span style='color:#757575'>(click a rank in the grid for its output)</span>"
            f"<label style='margin-left:auto'><input type='checkbox' id='{d}-pall'>"
            "<span>every rank's row</span></label>"
        )
    return _style_block(d, ranks, many) + "<div class='nl-pick'>" + "".join(tabs) + "</div>"


def _line(rank: int, stream: str, text: str, label: str | None = None, css: str = "") -> str:
    """One line of the combined log, ``label`` in front (None: no label)."""
    cls = f"nl-l nl-r{rank}" + (" nl-e" if stream == "stderr" else "") + css
    prefix = f"<span class='nl-p'>{H.esc(label)} </span>" if label is not None else ""
    return f"<div class='{cls}'>{prefix}{H.esc(text)}</div>"


class _Chunk:
    __slots__ = ("widget", "lines", "html")

    def __init__(self, widget: Any) -> None:
        self.widget = widget
        self.lines: list[str] = []
        self.html = ""


class LiveLog:
    """The merged log: a ring of chunk widgets in a scroll box that follows the tail.

    Per turn it costs one message when the newest chunk takes the new lines, two when the
    oldest chunk of a full ring is reused for them (its content, and its CSS ``order`` so
    it shows last), and four while the ring is still growing (a new widget). Transient
    lines (``\\\\r`` progress of other libraries) are a separate small widget, shown last.
    """

    def __init__(self, W: Any, height: str = "260px") -> None:
        self.W = W
        self.tail = W.HTML(value="", layout=W.Layout(order="2000000000"))
        self.tail.add_class("nl-tail")
        self.inner = W.VBox([self.tail], layout=W.Layout(flex="0 0 auto"))
        self.box = W.VBox(
            [self.inner],
            layout=W.Layout(
                display="flex",
                flex_flow="column-reverse",
                overflow="auto",
                max_height=height,
                min_height="1.6em",
                border="1px solid #dddddd",
            ),
        )
        self.box.add_class("nl-log")
        self.chunks: list[_Chunk] = []
        self.live: _Chunk | None = None
        self.seq = itertools.count()
        self.seen = 0  # lines of the model's combined buffer drawn (or skipped) so far
        self.tail_html = ""

    def widgets(self) -> list[Any]:
        return [self.box, self.inner, self.tail, *(c.widget for c in self.chunks)]

    def draw(self, m: LaunchModel, budget: Budget) -> bool:
        """Draw new lines and transient lines; False when the budget stopped it."""
        done = self._draw_lines(m, budget)
        tail = "".join(
            _line(r, stream, text, m.line_label(r), css=" nl-t")
            for r, stream, text in m.transient_lines()
        )
        if tail != self.tail_html:
            if not budget.take():
                return False
            self.tail.value = self.tail_html = tail
        return done

    def _draw_lines(self, m: LaunchModel, budget: Budget) -> bool:
        buf = m.combined
        fresh = buf.total - self.seen
        if fresh <= 0:
            return True
        k = min(fresh, len(buf.lines))
        skipped = fresh - k
        live = self.live
        if live is not None and not skipped and len(live.lines) + k <= CHUNK_LINES:
            if not budget.take():
                return False
            new = itertools.islice(reversed(buf.lines), k)
            live.lines += [_line(r, st, t, m.line_label(r)) for r, st, t in new][::-1]
            live.html = "".join(live.lines)
            live.widget.value = live.html
            self.seen = buf.total
            return True
        if k > BURST_LINES:
            skipped += k - BURST_LINES
            k = BURST_LINES
        reuse = len(self.chunks) >= LOG_CHUNKS
        if not budget.take(2 if reuse else 4):
            return False
        newest = itertools.islice(reversed(buf.lines), k)
        lines = [_line(r, st, t, m.line_label(r)) for r, st, t in newest][::-1]
        if skipped:
            note = f"[{skipped} line(s) went by too fast to show; the final output keeps the last ones of every rank]"
            lines.insert(0, f"<div class='nl-l nl-n'>{H.esc(note)}</div>")
        order = str(next(self.seq))
        if reuse:
            chunk = self.chunks.pop(0)
            self.chunks.append(chunk)
            chunk.lines, chunk.html = lines, "".join(lines)
            with chunk.widget.hold_sync():
                chunk.widget.value = chunk.html
            chunk.widget.layout.order = order
        else:
            chunk = _Chunk(self.W.HTML(value="".join(lines), layout=self.W.Layout(order=order)))
            chunk.lines, chunk.html = lines, chunk.widget.value
            self.chunks.append(chunk)
            self.inner.children = (*self.inner.children, chunk.widget)
        self.live = chunk
        self.seen = buf.total
        return True


_DASHBOARD_CLASS: Any = None
_ANCHOR: Any = None


def _keep_widget_subshell(W: Any) -> None:
    """Keep one small widget open for the kernel's lifetime (never displayed).

    JupyterLab 4.4+ sends widget messages over a kernel subshell, one per comm target,
    which it creates for the first widget it sees and deletes when the last one closes.
    ipykernel answers the request that creates it with busy/idle status messages, and
    JupyterLab takes that "idle" for the kernel's state: its status bar reads "Idle" while
    the cell still runs (jupyterlab/jupyterlab#10701, jupyter/jupyter_client#838). The
    dashboard closes its widgets at the end, so every launch made a new subshell and read
    "Idle" throughout; with this widget alive the subshell stays, and only the first
    widget of a kernel's life (ours or anyone's, ``tqdm.notebook`` too) does it.
    """
    global _ANCHOR
    if _ANCHOR is None or getattr(_ANCHOR, "comm", None) is None:
        _ANCHOR = W.Layout()


def _dashboard_class(W: Any) -> Any:
    """A ``VBox`` whose ``text/plain`` is one fixed line instead of a repr of every child.

    That line is what nbval compares (it skips widget views and display updates); it is
    fixed, so a strict nbval run of a cell that launches needs no sanitizing for it.
    """
    global _DASHBOARD_CLASS
    if _DASHBOARD_CLASS is None:

        class Dashboard(W.VBox):
            def __repr__(self) -> str:
                return TEXT_PLAIN

        _DASHBOARD_CLASS = Dashboard
    return _DASHBOARD_CLASS


class WidgetView:
    """The ipywidgets dashboard. See the module docstring for what it shows.

    ``display``: True shows it in the running cell (IPython's ``display``), False does
    not (tests), or a function with ``IPython.display.display``'s signature.

    Example (what the launcher does)::

        view = WidgetView()          # displays itself in the running cell
        for event in events:
            view.handle(event)
        view.close()                 # the final snapshot replaces the widgets
    """

    def __init__(
        self,
        *,
        model: LaunchModel | None = None,
        clock: Callable[[], float] = time.time,
        display: bool | Callable[..., Any] = True,
        interval: float = 0.25,
        max_messages: float = MAX_MESSAGES,
        plot: bool | None = None,
    ) -> None:
        import ipywidgets as W

        from .shell import in_notebook_kernel

        self.W = W
        if in_notebook_kernel():  # a front end that may use kernel subshells
            _keep_widget_subshell(W)
        self.model = model if model is not None else LaunchModel()
        self.clock = clock
        self.interval = interval
        now = clock()
        self.budget = Budget(max_messages, now)
        self.id = "nl-d" + secrets.token_hex(4)
        self.plots_available = plots.available() if plot is None else plot
        self.header = W.HTML(value="<b>notebook_launcher</b> \u00b7 starting")
        self.alerts = W.HTML(value="")
        self.stall = W.HTML(value="")  # where every rank is, while none makes progress
        self.ranks = W.HTML(value="")
        #: many ranks: their grid, redrawn only when the ranks change (a click on a cell
        #: must find it still there), and its fills (a ``<style>``, redrawn as they step)
        self.grid = W.HTML(value="")
        self.grid_fills = W.HTML(value="", layout=W.Layout(display="none"))
        #: the parts under the rank table (``html.SECTIONS``), by name
        self.sections = {section.name: W.HTML(value="") for section in H.SECTIONS}
        self.barriers = self.sections["barriers"]
        self.picker = W.HTML(value="")
        self.log = LiveLog(W)
        self.summary = W.HTML(value="")
        self.plot: Any = None  # an HTML widget (the SVG, or the table) once a metric is logged
        self.plot_id = self.id + "-plot"
        self._plot_shown = False
        self.root = _dashboard_class(W)(
            [
                self.header,
                self.alerts,
                self.stall,
                self.grid,
                self.grid_fills,
                self.ranks,
                *self.sections.values(),
                self.picker,
                self.log.box,
                self.summary,
            ],
            layout=W.Layout(width="100%", min_width="0"),
        )
        for widget, cls in (
            (self.root, "nl-dashboard"),
            (self.root, self.id),
            (self.header, "nl-header"),
            (self.alerts, "nl-alerts"),
            (self.stall, "nl-stall-box"),
            (self.ranks, "nl-ranks"),
            (self.grid, "nl-grid"),
            *((widget, f"nl-{name}") for name, widget in self.sections.items()),
            (self.picker, "nl-picker"),
            (self.summary, "nl-summary"),
        ):
            widget.add_class(cls)
        self._redraws: dict[object, set[str]] = {}  # change kind -> sections it redraws
        for section in H.SECTIONS:
            for kind in section.redraw_on:
                self._redraws.setdefault(kind, set()).add(section.name)
        self._sent: dict[int, str] = {}  # id(widget) -> the value it shows
        self._dirty: set[str] = {"header"}
        self._next_flush = float("-inf")
        self._picked_ranks: tuple[int, ...] = ()
        self._clock_second = -1
        self._plot_seen = 0
        self._plot_due = float("-inf")
        self._plot_interval = PLOT_INTERVAL
        self._plot_error = ""  # why the PNG failed (the snapshot says it)
        self._svg_error = ""  # why the live SVG failed (the live table says it)
        self._closed = False
        self._display: Callable[..., Any] | None
        if display is True:
            from IPython.display import display as ipy_display

            self._display = ipy_display
        else:
            self._display = display or None
        if self._display is not None:
            self._display(self.root, display_id=self.id)

    # -- View protocol ---------------------------------------------------------------------
    def handle(self, event: Event) -> None:
        self._fold(event)
        now = self.clock()
        if now >= self._next_flush and not self._closed:
            self.flush(now)

    @property
    def history_lines(self) -> int:
        """The latest output lines of a rank it can show: of a history, only those are
        worth reading (``replay``'s ``left_out``)."""
        m = self.model
        return max(m.max_lines_per_rank, m.combined.lines.maxlen or 0)

    def replay(self, events: Sequence[Event], left_out: Mapping[int, int] | None = None) -> None:
        """A history at once (``attach``): every event folded in, then one redraw.
        ``left_out``: rank -> its output lines older than :attr:`history_lines`, which were
        not read (counted as dropped, as folding them would have)."""
        for event in events:
            self._fold(event)
        for rank, lines in (left_out or {}).items():
            self.model.lines_left_out(rank, lines)
        if not self._closed:
            self.flush(self.clock())

    def _fold(self, event: Event) -> None:
        m = self.model
        if type(event) is Output:  # the hot path: hundreds a second while ranks print
            m._on_Output(event)
            self._dirty.add("log")
        else:
            for change in m.apply(event):
                kind = change[0]
                if kind in ("rank", "bars"):
                    self._dirty.add("ranks")
                elif kind == "output":
                    self._dirty.add("log")
                elif kind == "barriers":
                    self._dirty |= {"barriers", "alerts", "ranks"}
                if kind in self._redraws:  # a section under the rank table
                    self._dirty |= self._redraws[kind]
                elif kind == "metrics":
                    self._dirty.add("plot")
                elif kind == "stall":
                    self._dirty.add("stall")
                elif kind == "launch":
                    self._dirty |= {"header", "ranks", "structure"}

    def tick(self) -> None:
        """Cheap: redraws only when ``interval`` has passed (the launcher calls it after
        every wait, hundreds of times a second while ranks print)."""
        now = self.clock()
        if now >= self._next_flush and not self._closed:
            self.flush(now)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.model.flush_tails()
        if self._display is None:  # nobody sees a snapshot: draw the end into the widgets
            self.flush(self.clock(), final=True)
            return
        self._publish_snapshot()
        for widget in self._widgets():
            for part in (widget, getattr(widget, "layout", None), getattr(widget, "style", None)):
                if part is not None and getattr(part, "comm", None) is not None:
                    part.close()

    # -- the final snapshot ----------------------------------------------------------------
    def snapshot_html(self) -> str:
        """The final dashboard as static HTML (with the metrics as a table when there is no
        plot: matplotlib missing, or drawing failed)."""
        m = self.model
        hint = ""
        if m.metrics and not self.plots_available:
            hint = self._plot_error_hint() if self._plot_error else plots.INSTALL_HINT
        return H.snapshot(m, self.clock(), metrics_hint=hint)

    def _plot_error_hint(self) -> str:
        return f"the plot failed ({self._plot_error}); showing the last values"

    def _publish_snapshot(self) -> None:
        assert self._display is not None
        m = self.model
        png = self._render_plot() if m.metrics and self.plots_available else None
        bundle = {"text/html": self.snapshot_html(), "text/plain": TEXT_PLAIN}
        self._display(bundle, raw=True, display_id=self.id, update=True)
        names = ", ".join(m.metrics)
        if png is not None:
            picture = {
                "image/png": base64.b64encode(png).decode("ascii"),
                "text/plain": f"notebook_launcher metrics: {names}",
            }
            self._display(picture, raw=True, display_id=self.plot_id, update=self._plot_shown)
        elif m.metrics and not self._svg_error:
            # no PNG (no matplotlib, or it failed): the final SVG stays (this session shows it; an untrusted
            # renderer may strip it, and the snapshot has the values as a table)
            svg = {
                "text/html": plots.render_svg(m),
                "text/plain": f"notebook_launcher metrics: {names}",
            }
            self._display(svg, raw=True, display_id=self.plot_id, update=self._plot_shown)
        elif self._plot_shown:  # no picture: the snapshot has the values as a table
            self._display({"text/plain": ""}, raw=True, display_id=self.plot_id, update=True)

    def _widgets(self) -> list[Any]:
        parts = [
            self.root,
            self.header,
            self.alerts,
            self.stall,
            self.grid,
            self.grid_fills,
            self.ranks,
            *self.sections.values(),
            self.picker,
            self.summary,
            *self.log.widgets(),
        ]
        return parts + ([self.plot] if self.plot is not None else [])

    # -- drawing ---------------------------------------------------------------------------
    def _set(self, widget: Any, value: str, force: bool = False) -> bool:
        """Show ``value`` in ``widget``: one message, paid from the budget (``force``: the
        final redraw, not paid). False when the budget had nothing left."""
        if self._sent.get(id(widget)) == value:
            return True
        if not force and not self.budget.take():
            return False
        widget.value = f"<div style='{BASE_STYLE}'>{value}</div>" if value else ""
        self._sent[id(widget)] = value
        return True

    def _set_raw(self, widget: Any, value: str) -> None:
        """Show ``value`` in ``widget`` as it is (no wrapper), when it changed."""
        if self._sent.get(id(widget)) != value:
            widget.value = value
            self._sent[id(widget)] = value

    def flush(self, now: float, final: bool = False) -> None:
        """Redraw what changed, most important first, as far as the budget allows."""
        self._next_flush = now + self.interval
        self.budget.refill(now)
        m = self.model
        dirty = self._dirty
        if "structure" in dirty or len(m.ranks) != len(self._picked_ranks):
            dirty.discard("structure")
            self._structure()
        second = int(m.elapsed(now) or 0)
        if second != self._clock_second:  # the clocks shown move once a second
            self._clock_second = second
            dirty |= {"header", "ranks"} if m.finished is None else set()
            dirty |= {section.name for section in H.SECTIONS if section.clock}
        clock = fmt_clock
        if "ranks" in dirty and self._set(
            self.ranks, H.ranks_html(m, now, clock, pick=self.id), final
        ):
            dirty.discard("ranks")
            # the grid's cells change only with the ranks (not sent otherwise), their fills
            # at every step
            self._set(self.grid, H.live_grid(m, self.id), True)
            self._set_raw(self.grid_fills, H.live_grid_fills(m, self.id))
        # the plot paces itself (at most ~2 redraws a second): ahead of the log, whose new
        # chunks would otherwise take its turns while lines pour in and leave it seconds behind
        due = final or now >= self._plot_due
        if "plot" in dirty and due and self._draw_plot(now, final):
            dirty.discard("plot")
        if "log" in dirty and self.log.draw(m, Budget(1e9, now) if final else self.budget):
            dirty.discard("log")
        if "header" in dirty and self._set(self.header, H.header(m, now, clock), final):
            dirty.discard("header")
        if "alerts" in dirty and self._set(self.alerts, H.alerts(m), final):
            dirty.discard("alerts")
        if "stall" in dirty and self._set(self.stall, stall_html(m.stall), final):
            dirty.discard("stall")
        for section in H.SECTIONS:
            if section.name in dirty and self._set(
                self.sections[section.name], section.render(m, now, clock), final
            ):
                dirty.discard(section.name)
        if final:
            self._set(self.header, H.header(m, now), True)
            self._set(self.summary, H.summary(m), True)

    def _structure(self) -> None:
        """The parts that depend on which ranks exist (and the plot, once metrics come)."""
        m = self.model
        ranks = tuple(m.rank_ids)
        if ranks != self._picked_ranks:
            self._picked_ranks = ranks
            many = len(ranks) > H.COMPACT_ROWS_MAX
            self.picker.value = _picker(self.id, list(ranks), many)
        if m.metrics and self.plot is None:
            self._dirty.add("plot")

    def _show_plot(self, widget: Any) -> None:
        """Show ``widget`` (the plot, or the table instead) in its own output under the
        dashboard, one display id for the whole run: the final picture replaces it there
        (an update reaches its output from any thread, even once the cell has ended)."""
        widget.add_class("nl-plot")
        old = self.plot
        self.plot = widget
        if self._display is not None:
            self._display(widget, display_id=self.plot_id, update=old is not None)
            self._plot_shown = True
        if old is not None:
            old.close()

    def _render_plot(self) -> bytes | None:
        try:
            plots.load()
            return plots.render_png(self.model)
        except Exception as exc:  # noqa: BLE001 - a plot is not worth the dashboard
            self.plots_available = False
            self._plot_error = repr(exc)
            return None

    def _draw_plot(self, now: float, final: bool) -> bool:
        """The live plot: an SVG, redrawn when metrics came in and ``_plot_interval`` has
        passed (what drawing costs stretches it: at most 1/PLOT_COST_RATIO of the kernel)."""
        m = self.model
        if m.metrics_logged == self._plot_seen:
            return True
        if not final and not self.budget.take(1 if self.plot is not None else 4):
            return False
        self._plot_seen = m.metrics_logged
        if not self._svg_error:
            t0 = _cost_clock()
            try:
                svg = plots.render_svg(m)
            except Exception as exc:  # noqa: BLE001 - a plot is not worth the dashboard
                self._svg_error = repr(exc)
            else:
                cost = _cost_clock() - t0
                interval = max(PLOT_INTERVAL, PLOT_COST_RATIO * cost)
                self._plot_due = now + min(PLOT_MAX_INTERVAL, interval)
                self._show_or_update(svg)
                return True
        # drawing failed: a table of the last values, once a second
        self._plot_due = now + 1.0
        hint = f"the plot failed ({self._svg_error}); showing the last values"
        self._show_or_update(f"<div style='{BASE_STYLE}'>{H.metrics_table(m, hint)}</div>")
        return True

    def _show_or_update(self, value: str) -> None:
        if self.plot is None:
            self._show_plot(self.W.HTML(value=value))
        else:
            self.plot.value = value


__all__ = ["Budget", "LiveLog", "WidgetView"]
