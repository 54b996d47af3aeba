"""The dashboard as HTML: one renderer for the live widgets and the saved snapshot.

Pure functions of a :class:`~notebook_launcher.ui.model.LaunchModel` (no ipywidgets), so
what the live dashboard shows and what a saved notebook keeps are the same markup. Only
inline styles are used, and only properties JupyterLab's sanitizer keeps for untrusted
notebooks (GitHub and nbviewer keep them too): no ``<style>``, no scripts, no classes
needed for the looks. Classes and ``data-`` attributes are there for tests and for the
live view's rank picker (``widgets.py``).

Layout rules that hold from phone-narrow to wide: text never wraps inside a bar or a
status (it is cut with an ellipsis, the full text is the ``title`` shown on hover); a
rank's bars move under its name as a whole when the row gets narrow.

Example::

    from notebook_launcher.ui.html import snapshot
    html = snapshot(model, now=time.time())   # the final dashboard, as saved
"""

from __future__ import annotations

import html as _html
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .._events import PHASES
from .model import (
    DIED,
    DONE,
    FAILED,
    READY,
    RUNNING,
    STARTING,
    STOPPED,
    STOPPED_REASON,
    WAITING,
    BarState,
    LaunchModel,
    RankState,
    fmt_duration,
    fmt_number,
    notebook_cell_traceback,
)
from .stall import stall_html

STATUS_COLOURS = {
    STARTING: "#757575",
    RUNNING: "#1565c0",
    WAITING: "#e65100",
    DONE: "#2e7d32",
    READY: "#2e7d32",
    FAILED: "#c62828",
    DIED: "#c62828",
    STOPPED: "#757575",
}
BAR_COLOURS = {"": "#1976d2", "success": "#43a047", "danger": "#e53935", "stopped": "#9e9e9e"}
RED = "#c62828"
GREY = "#757575"
AMBER = "#e65100"
GREEN = "#2e7d32"
MONO = "font-family:var(--jp-code-font-family,monospace)"
CUT = "white-space:nowrap;overflow:hidden;text-overflow:ellipsis;min-width:0"
#: Ranks shown as one row each; more than this get the spread summary and a grid.
COMPACT_ROWS_MAX = 8


def esc(text: str) -> str:
    return _html.escape(text, quote=False)


def attr(text: str) -> str:
    return _html.escape(text, quote=True)


Clock = Callable[[float | None], str]


# -- header, alerts, summary ---------------------------------------------------------------


def header_parts(m: LaunchModel, now: float, clock: Clock = fmt_duration) -> list[str]:
    """``["notebook_launcher", "2 ranks", "fork: fast, nothing to pickle", "gloo on
    127.0.0.1:29500", "running 12s"]`` (a busy port: ``"... :41234 (port 29500 is busy)"``)."""
    parts = ["notebook_launcher"]
    s = m.started
    if s is not None and s.task:  # a session's task: its ranks started long ago
        parts += [f"session {s.task}", f"{s.local_world_size} of {s.world_size} ranks"]
        parts.append(f"{s.backend} on {s.master_addr}:{s.master_port}")
    elif s is not None:
        n = s.local_world_size
        if s.detached:
            parts.append(f"detached run {s.detached}")
        parts.append(f"{n} rank{'s' if n != 1 else ''}")
        if s.num_nodes > 1 and not s.hosts:  # one node's share of the job
            parts.append(f"node {s.node_rank} of {s.num_nodes}, world size {s.world_size}")
        reason, _, port_note = s.start_reason.partition("; ")
        port_note = port_note.rsplit(", using ", 1)[0]
        parts.append(f"{s.start_method}: {reason}" if reason else s.start_method)
        where = f"{s.backend} on {s.master_addr}:{s.master_port}"
        if s.rendezvous:
            where = f"{s.backend}, {s.rendezvous}"
        parts.append(f"{where} ({port_note})" if port_note else where)
        if s.placement:
            parts.append(s.placement)
    elif m.rendezvous is not None or m.nodes_waiting is not None:
        parts.append(m.waiting_text())
    if m.restarts:
        parts.append(m.restart_text())
    if m.finished is None and m.stopped_following is not None:
        parts.append(f"stopped following after {fmt_duration(m.elapsed(m.stopped_following))}")
    elif m.finished is None:
        parts.append(f"running {clock(m.elapsed(now))}")
    else:
        done = "ready in" if m.session_start and m.finished.ok else "finished in"
        parts.append(f"{done} {fmt_duration(m.elapsed(now))}")
    return parts


def header(m: LaunchModel, now: float, clock: Clock = fmt_duration) -> str:
    parts = header_parts(m, now, clock)
    full = " \u00b7 ".join(parts)
    live = m.finished is None and m.stopped_following is None
    cells = [f"<b style='flex:none'>{esc(parts[0])}</b>"]
    for i, part in enumerate(parts[1:], 1):
        # parts move to the next line as a whole; one longer than the line is cut
        clock_part = " class='nl-clock'" if live and i == len(parts) - 1 else ""
        cells.append(
            f"<span{clock_part} style='flex:0 1 auto;{CUT}'>"
            f"<span style='color:{GREY}'>\u00b7</span> {esc(part)}</span>"
        )
    return (
        (
            f"<div class='nl-head' title='{attr(full)}' style='display:flex;flex-wrap:wrap;"
            "column-gap:6px;align-items:baseline;padding:2px 0'>" + " ".join(cells) + "</div>"
        )
        + (left_behind(m, now) if live else "")
        + banner(m)
    )


#: What shows a live view's note instead of its clock once its widgets lost their kernel
#: (ipywidgets marks each such widget ``jupyter-widgets-disconnected``, and draws a
#: broken-link icon before it: the note says it in words).
ORPHAN_STYLE = (
    "<style>.jupyter-widgets-disconnected .nl-orphan{display:block!important}"
    ".jupyter-widgets-disconnected .nl-clock{display:none}"
    ".jupyter-widgets-disconnected .nl-row{opacity:.6}"
    ".nl-dashboard.jupyter-widgets-disconnected::before,"
    ".nl-dashboard .jupyter-widgets-disconnected::before{display:none}</style>"
)


def left_behind(m: LaunchModel, now: float) -> str:
    """A live view's note for when it is left behind (a kernel that restarts, or dies, takes
    the widgets' kernel side with it; what the page shows stays): hidden until then, and
    saying what it is as of ``now``, the latest redraw (the clock redraws the header every
    second). See :data:`ORPHAN_STYLE`."""
    return (
        f"<div class='nl-orphan' style='display:none;color:{GREY};font-weight:600;{CUT}'>"
        f"\u25a0 {esc(m.left_behind(now))}</div>{ORPHAN_STYLE}"
    )


def banner(m: LaunchModel) -> str:
    """What the user should read before the ranks start (ranks sharing a GPU), if any."""
    text = m.started.banner if m.started is not None else ""
    if not text:
        return ""
    return f"<div class='nl-banner' style='color:{AMBER};padding:2px 0'>\u2139 {esc(text)}</div>"


def alerts(m: LaunchModel) -> str:
    return "".join(
        f"<div style='color:{RED};font-weight:600'>\u26a0 {esc(a)}</div>" for a in m.alerts()
    )


def summary(m: LaunchModel) -> str:
    if m.finished is None and m.stopped_following is not None:  # the run goes on
        line = m.left_behind(m.stopped_following)
        return (
            f"<div class='nl-summary' title='{attr(line)}' style='color:{GREY};"
            f"font-weight:600;margin-top:4px;{CUT}'>\u25a0 {esc(line)}</div>"
        )
    if m.finished is None:
        return ""
    ok = m.finished.ok
    colour, mark = (GREEN, "\u2714") if ok else (RED, "\u2718")
    if m.finished.interrupted:  # the user stopped it: no alarm
        colour, mark = GREY, "\u25a0"
    line = m.summary_line()
    return (
        f"<div class='nl-summary' title='{attr(line)}' style='color:{colour};font-weight:600;"
        f"margin-top:4px;{CUT}'>{mark} {esc(line)}</div>"
    )


# -- ranks ---------------------------------------------------------------------------------


def bar_html(bar: BarState, weight: int = 1) -> str:
    """One bar: ``label [#####     ] 40/100 12it/s eta 5s``, cut (never wrapped) when narrow."""
    label = bar.label()
    stats = bar.stats()
    fraction = bar.fraction
    if fraction is None:
        fraction = 1.0 if bar.closed or bar.frozen else 0.0
    colour = BAR_COLOURS.get(bar.style, BAR_COLOURS[""])
    width = f"{100 * fraction:.1f}".rstrip("0").rstrip(".")
    return (
        f"<div class='nl-bar' data-desc='{attr(label)}' data-style='{bar.style}' "
        f"title='{attr(label + ': ' + stats)}' style='flex:{weight} 1 auto;"
        "min-width:0;max-width:100%;display:flex;align-items:center;gap:6px;white-space:nowrap'>"
        f"<span style='flex:0 1 auto;max-width:20em;{CUT}'>{esc(label)}</span>"
        "<span class='nl-track' style='display:block;flex:1 0 40px;min-width:40px;height:10px;"
        "background-color:#e4e4e4;border-radius:3px;overflow:hidden'>"
        f"<span class='nl-fill' style='display:block;height:100%;width:{width}%;"
        f"background-color:{colour}'></span></span>"
        f"<span style='flex:0 1 auto;{CUT};{MONO};font-size:11px'>{esc(stats)}</span></div>"
    )


def status_phrase(s: RankState, now: float, clock: Clock = fmt_duration) -> str:
    """What a rank's row says it does: ``running``, ``importing torch``, ``waiting at
    In[2]:5 for 3s``, the outcome once it ended (``raised ValueError: boom``, ``stopped:
    rank 1 failed``)."""
    if s.ended is not None or s.status in (FAILED, DIED, STOPPED):
        return s.outcome()
    return s.status_text(now, clock)


def _message_line(s: RankState) -> str:
    """Under a failed rank's row, its exception's message on a line of its own (wrapped,
    never cut: the row's status says ``raised ValueError`` and stays short)."""
    message = s.failure_message()
    if not message:
        return ""
    return (
        f"<div class='nl-msg' title='{attr(s.outcome())}' style='flex:1 0 100%;min-width:0;"
        f"color:{RED};{MONO};font-size:12px;white-space:pre-wrap;overflow-wrap:anywhere;"
        f"padding:0 0 2px 1.5em'>{esc(s.exc_type)}: {esc(message)}</div>"
    )


def rank_row(
    s: RankState,
    now: float,
    clock: Clock = fmt_duration,
    *,
    css: str = "",
    hidden: bool = False,
    pick: str | None = None,
) -> str:
    """One rank, one line: ``rank 0 ● running 12s | epoch [###] 2/4 | step [#####] 80/100``."""
    full = status_phrase(s, now, clock)
    message = _message_line(s)
    status = f"raised {s.exc_type}" if message else full  # the message has its own line
    colour = STATUS_COLOURS.get(s.shown_status, "#000")
    who = [f"rank {s.rank}"]
    if s.host:
        who.append(s.host)
    if s.pid is not None:
        who.append(f"pid {s.pid}")
    if s.device:
        who.append(s.device)
    elapsed = s.elapsed(now)
    if elapsed is None:  # still starting: how long it has been at what it does
        elapsed = s.in_phase(now)
    clock_text = clock(elapsed) if elapsed is not None else ""
    bars = list(s.bars.values())
    deepest = max((b.level for b in bars), default=0)
    bar_cells = "".join(bar_html(b, 2 if b.level == deepest and deepest else 1) for b in bars)
    # without bars (starting, or a function that draws none) the status has the row, up to
    # a width where its clock still reads as its own
    grow = "0 1 24em" if bars else "1 1 24em;max-width:48em"
    display = "none" if hidden else "flex"
    tag, target, pointer = ("b", "", "")
    if pick is not None:  # the live view: clicking the name shows the rank's output
        tag, target, pointer = ("label", f" for='{pick}-p{s.rank}'", ";cursor:pointer")
    host = (
        f"<span class='nl-host' style='flex:none;color:{GREY}'>{esc(s.host)}</span>"
        if s.host
        else ""
    )
    return (
        f"<div class='nl-row nl-row-{s.rank} {css}' data-rank='{s.rank}' "
        f"data-status='{s.shown_status}' style='display:{display};flex-wrap:wrap;"
        "align-items:center;column-gap:14px;row-gap:2px;padding:2px 0;"
        "border-bottom:1px solid #eeeeee'>"
        f"<div style='flex:{grow};min-width:10em;display:flex;gap:6px;"
        "align-items:baseline;white-space:nowrap;overflow:hidden'>"
        f"<{tag} class='nl-who'{target} title='{attr(' · '.join(who))}' "
        f"style='flex:none;font-weight:700{pointer}'>rank {s.rank}</{tag}>{host}"
        f"<span class='nl-status' title='{attr(full)}' style='flex:0 1 auto;color:{colour};"
        f"font-weight:600;{CUT}'>\u25cf {esc(status)}</span>"
        f"<span style='flex:none;margin-left:auto;color:{GREY};{MONO};font-size:11px'>"
        f"{esc(clock_text)}</span></div>"
        + (
            "<div class='nl-bars' style='flex:1 1 320px;min-width:0;display:flex;"
            f"flex-wrap:wrap;column-gap:14px'>{bar_cells}</div>"
            if bars
            else ""
        )
        + f"{message}</div>"
    )


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _cell(s: RankState, p: float | None, straggler: bool, pick: str | None) -> str:
    """One rank in the grid: its number on a mini bar of its progress, coloured by status."""
    colour, width = _fill(s, p)
    bars = " | ".join(f"{b.label()} {b.counts()}" for b in s.bars.values())
    tip = f"rank {s.rank}: {s.outcome() if s.ended is not None else s.status}"
    tip += f" \u00b7 {bars}" if bars else ""
    tip += " \u00b7 straggler" if straggler else ""
    ring = f"box-shadow:0 0 0 2px {WAITING_RING};" if straggler else ""
    tag, target = ("label", f" for='{pick}-p{s.rank}'") if pick else ("span", "")
    return (
        f"<{tag}{target} class='nl-cell nl-cell-{s.rank}' data-rank='{s.rank}' "
        f"title='{attr(tip)}' style='position:relative;display:inline-block;width:30px;"
        "height:16px;margin:0 4px 4px 0;background-color:#e4e4e4;border-radius:2px;"
        f"overflow:hidden;cursor:pointer;{ring}'>"
        "<span style='position:absolute;left:0;top:0;bottom:0;"
        f"width:{width}%;background-color:{colour};opacity:0.45'></span>"
        "<span style='position:relative;display:block;text-align:center;font-size:10px;"
        f"line-height:16px;{MONO}'>{s.rank}</span></{tag}>"
    )


def _fill(s: RankState, p: float | None) -> tuple[str, int]:
    """A grid cell's colour (its status) and fill (its progress, in percent)."""
    colour = STATUS_COLOURS.get(s.shown_status, "#000")
    return colour, 100 if p is None and s.ended is not None else round(100 * (p or 0.0))


def _grid(m: LaunchModel, cell: Callable[[int], str]) -> str:
    """Every rank's cell, a row of them per node."""
    groups = m.nodes()
    out = []
    for node, ranks in sorted(groups.items()):
        title = f"<span style='color:{GREY};font-size:11px;margin-right:4px'>node {node}</span>"
        cells = "".join(cell(r) for r in ranks)
        out.append(
            f"<div style='display:flex;flex-wrap:wrap;align-items:flex-end'>"
            f"{title if len(groups) > 1 else ''}{cells}</div>"
        )
    return "".join(out)


def live_grid(m: LaunchModel, pick: str) -> str:
    """The live view's grid (many ranks): labels of the picker that stay put while the ranks
    step -- a click is a press and a release on the same element, and a grid redrawn under
    the pointer loses it -- so it is drawn again only when the ranks change; their fills
    and colours come from :func:`live_grid_fills`."""
    if len(m.ranks) <= COMPACT_ROWS_MAX:
        return ""

    def cell(r: int) -> str:
        return (
            f"<label for='{pick}-p{r}' class='nl-cell nl-cell-{r}' data-rank='{r}' "
            f"title='rank {r}: click for its output' style='position:relative;"
            "display:inline-block;width:30px;height:16px;margin:0 4px 4px 0;"
            "background-color:#e4e4e4;border-radius:2px;overflow:hidden;cursor:pointer'>"
            # (no width or colour inline: an inline style would win over the fills')
            "<span class='nl-fill' style='position:absolute;left:0;top:0;bottom:0;"
            "opacity:0.45'></span><span style='position:relative;display:block;"
            f"text-align:center;font-size:10px;line-height:16px;{MONO}'>{r}</span></label>"
        )

    return _grid(m, cell)


def live_grid_fills(m: LaunchModel, pick: str) -> str:
    """The fills of :func:`live_grid`'s cells now: one ``<style>``, scoped to this view."""
    if len(m.ranks) <= COMPACT_ROWS_MAX:
        return ""
    sp = m.spread()
    stragglers = set(sp.stragglers)
    rules = []
    for r in m.rank_ids:
        colour, width = _fill(m.ranks[r], sp.progress.get(r))
        at = f".{pick} .nl-cell-{r}"
        rules.append(f"{at} .nl-fill{{width:{width}%;background-color:{colour}}}")
        if r in stragglers:
            rules.append(f"{at}{{box-shadow:0 0 0 2px {WAITING_RING}}}")
    return "<style>" + "".join(rules) + "</style>"


WAITING_RING = "#e65100"
_PHASE_ORDER = {"": 0, **{p: i + 1 for i, p in enumerate(PHASES)}}


def spread_html(m: LaunchModel, now: float, clock: Clock, pick: str | None) -> str:
    """Many ranks at a glance: the spread line, a grid of every rank, the ranks to look at."""
    sp = m.spread()
    line = []
    if sp.slowest and sp.median and sp.fastest:
        line.append(
            f"slowest <b>rank {sp.slowest[0]}</b> {_pct(sp.slowest[1])} \u00b7 "
            f"median {_pct(sp.median[1])} \u00b7 "
            f"fastest <b>rank {sp.fastest[0]}</b> {_pct(sp.fastest[1])}"
        )
    order = (RUNNING, WAITING, STARTING, READY, DONE, STOPPED, FAILED, DIED)
    counts = ", ".join(
        f"<span style='color:{STATUS_COLOURS[k]}'>{sp.counts[k]} {k}</span>"
        for k in order
        if sp.counts.get(k)
    )
    line.append(counts)
    phases = m.starting_phases()
    if phases:  # a slow start is not a hang: what the starting ranks do
        line.append(
            ", ".join(
                f"{n} {PHASES.get(p, p) if p else 'not heard from yet'}"
                for p, n in sorted(phases.items(), key=lambda kv: _PHASE_ORDER.get(kv[0], 9))
            )
        )
    head = f"<div class='nl-spread' style='{CUT};padding:2px 0'>" + " \u00b7 ".join(line) + "</div>"
    stragglers = set(sp.stragglers)
    grid = ""
    if pick is None:  # (the live view draws its grid apart: live_grid)
        grid = _grid(m, lambda r: _cell(m.ranks[r], sp.progress.get(r), r in stragglers, None))
    look = [r for r in sp.broken] + [r for r in sp.stragglers if r not in sp.broken]
    note = ""
    if sp.stragglers:
        note = (
            f"<div style='color:{WAITING_RING};font-size:12px'>stragglers (more than "
            f"{_pct(0.05)} behind the median): "
            + ", ".join(f"rank {r} {_pct(sp.progress[r])}" for r in sp.stragglers[:8])
            + (" ..." if len(sp.stragglers) > 8 else "")
            + "</div>"
        )
    rows = "".join(rank_row(m.ranks[r], now, clock, css="nl-look", pick=pick) for r in look[:8])
    # every rank's row, hidden: the live picker shows the one clicked (widgets.py)
    hidden = ""
    if pick is not None:
        hidden = "".join(
            rank_row(m.ranks[r], now, clock, css="nl-more", hidden=True, pick=pick)
            for r in m.rank_ids
            if r not in look[:8]
        )
    return head + grid + note + rows + hidden


def ranks_html(
    m: LaunchModel, now: float, clock: Clock = fmt_duration, pick: str | None = None
) -> str:
    """Every rank as a row (up to :data:`COMPACT_ROWS_MAX`), else the spread summary.
    ``pick``: the live view's picker id (grid cells become its labels)."""
    if len(m.ranks) > COMPACT_ROWS_MAX:
        return spread_html(m, now, clock, pick)
    groups = m.nodes()
    out = []
    for node, ranks in sorted(groups.items()):
        if len(groups) > 1 or (m.started is not None and m.started.num_nodes > 1):
            label = esc(m.node_label(node))
            out.append(f"<div class='nl-node' style='font-weight:600'>{label}</div>")
        out += [rank_row(m.ranks[r], now, clock, pick=pick) for r in ranks]
    return "".join(out)


# -- barriers ------------------------------------------------------------------------------


def barriers(m: LaunchModel, now: float, keep: int = 8, clock: Clock = fmt_duration) -> str:
    if not m.barriers:
        return ""
    ranks = m.rank_ids
    rows = []
    records = sorted(m.barriers.values(), key=lambda b: b.index)
    shown_from = max(0, len(records) - keep)
    hidden = shown_from + m.dropped_barriers
    many = len(ranks) > COMPACT_ROWS_MAX
    for rec in records[shown_from:]:
        arrived_ranks = rec.arrived_ranks(ranks)
        arrived = (
            f"{len(arrived_ranks)} of {len(ranks)}"
            if many
            else ", ".join(str(r) for r in arrived_ranks) or "-"
        )
        missing = rec.missing(ranks)
        colour = GREEN
        took = rec.took()
        if rec.completed is not None:
            state = f"passed ({fmt_duration(took)})" if took is not None else "passed"
        elif rec.left:  # a rank the launcher stopped did not leave by its own doing
            own = sorted((r, why) for r, why in rec.left.items() if why != STOPPED_REASON)
            colour = RED if own else GREY
            state = "; ".join(f"rank {r} {why}" for r, why in own)
            state = state or "not passed: the run was stopped"
        elif rec.waiting():
            colour = WAITING_RING
            since = min(rec.arrived[r] for r in rec.waiting())
            state = f"waiting {clock(now - since)}"
        else:
            state = "in progress"
        where = rec.location + (" (mismatch!)" if rec.mismatched else "")
        miss = ", ".join(str(r) for r in missing[:16]) + (" ..." if len(missing) > 16 else "")
        cells = [f"#{rec.index}", where, rec.kind, arrived, miss or "-"]
        rows += [f"<span title='{attr(c)}' style='{CUT}'>{esc(c)}</span>" for c in cells]
        rows.append(
            f"<span title='{attr(state)}' style='{CUT};color:{colour};font-weight:600'>"
            f"{esc(state)}</span>"
        )
    more = (
        f"<div style='color:{GREY}'>{hidden} earlier barrier(s) not shown</div>" if hidden else ""
    )
    head = "".join(
        f"<span style='font-weight:600;color:{GREY};{CUT}'>{h}</span>"
        for h in ("#", "where", "kind", "arrived", "missing", "state")
    )
    # a grid, not a <table>: JupyterLab styles tables in outputs (right-aligned, striped)
    return (
        "<div class='nl-barriers' style='margin-top:4px'><b>barriers</b>"
        "<div style='display:grid;grid-template-columns:auto minmax(4em,max-content) "
        "minmax(4em,max-content) minmax(2em,max-content) minmax(2em,max-content) "
        "minmax(4em,1fr);column-gap:12px;font-size:12px'>"
        + head
        + "".join(rows)
        + f"</div>{more}</div>"
    )


# -- sections: the parts under the rank table ---------------------------------------------


@dataclass(frozen=True)
class Section:
    """A part of the dashboard under the rank table, drawn from the model alone: the live
    view gives it a widget of its own (class ``nl-<name>``) and redraws it when the model
    reports one of the ``redraw_on`` change kinds (``LaunchModel.apply``'s keys, e.g.
    ``("barriers",)``), or each second when ``clock`` (it shows durations); the snapshot
    draws it once, in the same place. ``render(model, now, clock)`` returns HTML, ``""``
    when there is nothing to show (the part then takes no room).

    A new part (say, where stalled ranks wait) is: its events folded by the model (a
    handler in ``model.HANDLERS`` that returns its change kind), its renderer here, and
    one entry in :data:`SECTIONS`; the text view prints its own lines (``text.py``)."""

    name: str
    render: Callable[[LaunchModel, float, Clock], str]
    redraw_on: frozenset[str]
    clock: bool = False


def _barriers_section(m: LaunchModel, now: float, clock: Clock) -> str:
    return barriers(m, now, clock=clock)


#: The parts under the rank table, in the order they are shown.
SECTIONS: tuple[Section, ...] = (
    Section("barriers", _barriers_section, frozenset({"barriers"}), clock=True),
)


# -- output --------------------------------------------------------------------------------

LOG_BOX = (
    "display:flex;flex-direction:column-reverse;overflow:auto;max-height:{height}px;"
    "border:1px solid #dddddd;background-color:#fafafa"
)
LOG_PRE = (
    f"flex:none;overflow:visible;margin:0;padding:4px 6px;{MONO};font-size:12px;"
    "line-height:1.35;white-space:pre-wrap;overflow-wrap:anywhere;border:none;background:none"
)


def log_block(
    lines: Iterable[tuple[int, str, str]],
    *,
    labels: bool | Callable[[int], str],
    note: str = "",
    tail: str = "",
    traceback: str = "",
    height: int = 220,
) -> str:
    """A scrollable block of output lines that opens at its newest line (a column-reverse
    box starts scrolled to the bottom, no script needed). ``labels``: a rank's label in
    front of each line (a function: the label, e.g. ``LaunchModel.line_label``)."""
    label = labels if callable(labels) else (lambda rank: f"[rank{rank}]")
    body = []
    if note:
        body.append(f"<span style='color:{GREY}'>{esc(note)}</span>")
    for rank, stream, text in lines:
        line = esc((f"{label(rank)} " if labels else "") + text)
        body.append(f"<span style='color:{RED}'>{line}</span>" if stream == "stderr" else line)
    if tail:
        body.append(esc(tail))
    if traceback:
        body.append(f"<span style='color:{RED}'>{esc(traceback.rstrip())}</span>")
    if not body:
        body.append("<span style='color:#9e9e9e'>(no output)</span>")
    return (
        f"<div style='{LOG_BOX.format(height=height)}'><pre style='{LOG_PRE}'>"
        + "\n".join(body)
        + "</pre></div>"
    )


def rank_log(m: LaunchModel, rank: int, limit: int) -> str:
    s = m.ranks[rank]
    lines = list(s.output.lines)[-limit:]
    skipped = s.output.total - len(lines)
    note = f"[{skipped} earlier line(s) not kept]" if skipped else ""
    tail = m.pending_tail(rank, "stdout") or m.pending_tail(rank, "stderr")
    tb = notebook_cell_traceback(s.traceback) if s.status == FAILED and not s.collateral else ""
    return log_block(lines, labels=False, note=note, tail=tail, traceback=tb)


# -- metrics without a plotting library ----------------------------------------------------


def metrics_table(m: LaunchModel, hint: str = "") -> str:
    """The last value of every metric per rank (what is shown when matplotlib is missing)."""
    if not m.metrics:
        return ""
    ranks = sorted({r for per in m.metrics.values() for r in per})
    many = len(ranks) > COMPACT_ROWS_MAX
    head = (
        "<th>metric</th><th>step</th><th>min</th><th>median</th><th>max</th>"
        if many
        else "<th>metric</th><th>step</th>" + "".join(f"<th>rank {r}</th>" for r in ranks)
    )
    rows = []
    for name, per in m.metrics.items():
        last = {r: s.latest for r, s in per.items() if s.latest is not None}
        step = max((p[0] for p in last.values()), default=0)
        if many:
            order = sorted(last, key=lambda r: last[r][1])
            mid = order[len(order) // 2]
            cells = [f"{fmt_number(last[r][1])} (rank {r})" for r in (order[0], mid, order[-1])]
        else:
            cells = [fmt_number(last[r][1]) if r in last else "-" for r in ranks]
        rows.append(
            f"<tr><td>{esc(name)}</td><td>{step}</td>"
            + "".join(f"<td>{esc(c)}</td>" for c in cells)
            + "</tr>"
        )
    note = f"<div style='color:{GREY};font-size:11px'>{esc(hint)}</div>" if hint else ""
    return (
        "<div class='nl-metrics' style='margin-top:4px;overflow-x:auto'><b>metrics</b>"
        f"<table style='border-collapse:collapse;font-size:12px;white-space:nowrap;{MONO}'>"
        f"<tr style='text-align:left'>{head}</tr>" + "".join(rows) + f"</table>{note}</div>"
    )


# -- the saved snapshot --------------------------------------------------------------------


def _pane(m: LaunchModel, r: int, now: float, limit: int, cause: RankState | None) -> str:
    s = m.ranks[r]
    has_tail = m.pending_tail(r, "stdout") or m.pending_tail(r, "stderr")
    if not (s.output.total or has_tail or (s.status == FAILED and not s.collateral)):
        return ""
    is_open = " open" if cause is not None and cause.rank == r else ""
    colour = STATUS_COLOURS.get(s.shown_status, "#000")
    return (
        f"<details class='nl-pane nl-pane-{r}'{is_open}><summary style='cursor:pointer'>"
        f"rank {r} <span style='color:{colour}'>\u25cf {esc(status_phrase(s, now))}</span>"
        f" \u00b7 {s.output.total} line(s)</summary>{rank_log(m, r, limit)}</details>"
    )


def snapshot(
    m: LaunchModel, now: float, *, lines_per_rank: int = 60, metrics_hint: str = ""
) -> str:
    """The finished dashboard as one static block: header, alerts, every rank, barriers,
    output (each rank's pane folded, the failing rank's opened with its traceback), the
    metrics table when no plot can be drawn, and the summary. Bounded in size: at most
    ``lines_per_rank`` lines of each rank (fewer with many ranks)."""
    many = len(m.ranks) > COMPACT_ROWS_MAX
    limit = max(10, lines_per_rank // 4) if many else lines_per_rank
    rows = ranks_html(m, now)
    if m.finished is None and m.stopped_following is not None:  # as last seen: greyed
        rows = f"<div style='opacity:.6' title='as this view last saw them'>{rows}</div>"
    parts = [header(m, now), alerts(m), stall_html(m.stall, live=False), rows]
    if many:
        rows = "".join(rank_row(m.ranks[r], now) for r in m.rank_ids)
        parts.append(
            f"<details><summary style='cursor:pointer'>all {len(m.ranks)} ranks</summary>"
            f"{rows}</details>"
        )
    parts += [section.render(m, now, fmt_duration) for section in SECTIONS]
    cause = m.root_cause()
    panes = []
    combined = list(m.combined.lines)[-limit:]
    if combined:
        panes.append(
            "<details open><summary style='cursor:pointer'>output, all ranks "
            f"(last {len(combined)} lines)</summary>"
            + log_block(combined, labels=m.line_label, height=180)
            + "</details>"
        )
    sp = m.spread() if many else None
    first = [*sp.broken, *sp.stragglers] if sp is not None else m.rank_ids
    others = [r for r in m.rank_ids if r not in first]
    for r in first:
        panes.append(_pane(m, r, now, limit, cause))
    rest = "".join(_pane(m, r, now, limit, cause) for r in others)
    if rest:
        panes.append(
            f"<details><summary style='cursor:pointer'>output of the other {len(others)} "
            f"ranks</summary><div style='margin-left:1em'>{rest}</div></details>"
        )
    if panes:
        parts.append("<div class='nl-output' style='margin-top:4px'>" + "".join(panes) + "</div>")
    if metrics_hint:
        parts.append(metrics_table(m, metrics_hint))
    parts.append(summary(m))
    return (
        "<div class='nl-dashboard nl-snapshot' style='font-size:13px;line-height:1.45;"
        "max-width:100%;overflow:hidden'>" + "".join(parts) + "</div>"
    )


__all__ = [
    "COMPACT_ROWS_MAX",
    "SECTIONS",
    "Section",
    "alerts",
    "bar_html",
    "barriers",
    "header",
    "header_parts",
    "log_block",
    "metrics_table",
    "rank_row",
    "ranks_html",
    "snapshot",
    "status_phrase",
    "summary",
]
