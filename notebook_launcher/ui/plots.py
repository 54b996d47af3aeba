"""Metric plots: one panel per logged metric, one line per rank.

Two renderers of the same picture:

* :func:`render_svg`, the **live** plot: an inline SVG (polylines, a few hundred points per
  panel at most) built from the model with string formatting, in a few milliseconds and a
  few tens of kilobytes, so the dashboard redraws it about twice a second -- it keeps up with
  the bars (a PNG took 50-300 ms to draw, and was redrawn every 2-10 s). Pure Python: it
  needs neither matplotlib nor JavaScript.
* :func:`render_png`, the **saved** plot: drawn once at the end with matplotlib's Agg
  backend (``matplotlib.figure.Figure``, never ``pyplot``: the user's backend and figures
  are left alone) and kept as an ``image/png`` output, which GitHub, nbviewer and an
  untrusted JupyterLab all show (they may strip inline SVG). matplotlib is optional
  (``pip install 'notebook_launcher[plots]'``): without it the saved notebook keeps the
  last values as a table, and the live session's final SVG.

Both draw rank ``r`` in matplotlib's colour ``C{r % 10}``. Example::

    svg = render_svg(model)          # HTML, "" when nothing was logged
    png = render_png(model)          # bytes, or None when nothing was logged
"""

from __future__ import annotations

import html
import importlib.util
import io
import math
from statistics import median

from .model import LaunchModel, MetricSeries

#: What the saved dashboard says when matplotlib is missing.
INSTALL_HINT = "a saved plot needs matplotlib: pip install 'notebook_launcher[plots]'"
#: Panels drawn at most (the others are named in the last panel's title).
MAX_PANELS = 6
#: Up to this many ranks get a line and a legend entry each; with more, every rank is a
#: thin grey line and the ranks farthest from the median are drawn in colour.
LABELLED_RANKS = 10


def available() -> bool:
    """Whether matplotlib is installed: found, not imported (importing it takes about half
    a second, paid only when the first metric is drawn)."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a broken install counts as missing
        return False


def load() -> None:
    """Import matplotlib's parts (about half a second, once): so that the time a redraw is
    measured to take, which sets how often it is redrawn, is the drawing alone."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
    from matplotlib.figure import Figure  # noqa: F401


def _finite(values: list[float]) -> list[float]:
    return [v if math.isfinite(v) else math.nan for v in values]


def _highlighted(per: dict[int, MetricSeries]) -> list[int]:
    """With many ranks: the (at most 3) ranks whose last value is far from the others'."""
    last = {r: latest[1] for r, s in per.items() if (latest := s.latest) is not None}
    finite = {r: v for r, v in last.items() if math.isfinite(v)}
    mid = median(finite.values()) if finite else 0.0
    spread = median(abs(v - mid) for v in finite.values()) if finite else 0.0
    gap = {r: abs(v - mid) if math.isfinite(v) else math.inf for r, v in last.items()}
    return [r for r in sorted(gap, key=lambda r: -gap[r]) if gap[r] > 3 * spread][:3]


def render_png(m: LaunchModel, *, width: float = 7.0, dpi: int = 80) -> bytes | None:
    """The metrics of ``m`` as a PNG (``width`` inches at ``dpi``), None without metrics."""
    if not m.metrics:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(m.metrics)
    shown = names[:MAX_PANELS]
    cols = 1 if len(shown) == 1 else 2
    rows = math.ceil(len(shown) / cols)
    height = 2.1 * rows + 0.2
    fig = Figure(figsize=(width, height), dpi=dpi)  # a fixed layout: a layout engine
    FigureCanvasAgg(fig)  # draws every figure twice, and this is redrawn while training
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    fig.subplots_adjust(
        left=0.8 / width,
        right=1 - 0.15 / width,
        top=1 - 0.3 / height,
        bottom=0.45 / height,
        wspace=0.25,
        hspace=0.5 * 2.1 / height * rows,
    )
    for ax, name in zip(axes, shown, strict=False):
        per = m.metrics[name]
        ranks = sorted(per)
        if len(ranks) <= LABELLED_RANKS:
            for r in ranks:
                steps, values = per[r].points()
                marker = "o" if len(steps) == 1 else None
                ax.plot(
                    steps,
                    _finite(values),
                    lw=1.3,
                    color=f"C{r % 10}",
                    marker=marker,
                    ms=3,
                    label=f"rank {r}",
                )
        else:
            highlight = _highlighted(per)  # in colour: the ranks far from the others
            for r in ranks:
                if r not in highlight:
                    steps, values = per[r].points()
                    ax.plot(steps, _finite(values), lw=0.6, color="#90a4ae", alpha=0.6)
            for i, r in enumerate(highlight):
                steps, values = per[r].points()
                ax.plot(steps, _finite(values), lw=1.4, color=f"C{i + 1}", label=f"rank {r}")
            others = len(ranks) - len(highlight)
            ax.plot(
                [],
                [],
                lw=0.6,
                color="#90a4ae",
                label=f"{others} {'others' if highlight else 'ranks'}",
            )
        seen = [v for r in ranks for v in per[r].values if math.isfinite(v)]
        if seen and min(seen) > 0 and max(seen) / min(seen) > 100:  # a loss over decades
            ax.set_yscale("log")
        title = name
        if name == shown[-1] and len(names) > len(shown):
            title += f"   (+{len(names) - len(shown)} more: {', '.join(names[len(shown) :][:3])})"
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right", ncols=2 if len(ranks) > 4 else 1, frameon=False)
    for ax in axes[len(shown) :]:
        ax.set_visible(False)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# -- the live plot: inline SVG ------------------------------------------------------------

#: matplotlib's default colour cycle (``C0`` ... ``C9``): a rank has one colour in both plots.
COLOURS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
GREY_LINE = "#90a4ae"
#: Points drawn per panel, all its lines together (each line gets its share, at least 40):
#: what bounds the size of a redraw, however long the run and however many ranks.
SVG_POINTS = 1600
#: A panel's drawing units (it scales to the width it gets) and its margins.
PANEL_W, PANEL_H = 380.0, 170.0
LEFT, RIGHT, TOP, BOTTOM = 46.0, 8.0, 24.0, 20.0


def _thin(steps: list[int], values: list[float], k: int) -> tuple[list[int], list[float]]:
    """About ``k`` evenly spaced points, the last one always kept, and every non-finite one
    (a gap in the line stays a gap)."""
    n = len(steps)
    if n <= k:
        return steps, values
    stride = math.ceil(n / k)
    idx = [i for i in range(n) if i % stride == 0 or i == n - 1 or not math.isfinite(values[i])]
    return [steps[i] for i in idx], [values[i] for i in idx]


def _ticks(lo: float, hi: float, n: int = 4, integer: bool = False) -> list[float]:
    """About ``n`` round values between ``lo`` and ``hi`` (1, 2, 2.5 or 5 times a power of 10)."""
    span = hi - lo
    if span <= 0 or not math.isfinite(span):
        return [lo]
    raw = span / n
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    if integer:
        step = max(1.0, round(step))
    first = math.ceil(lo / step - 1e-9) * step
    out, v = [], first
    while v <= hi + 1e-9 * step:
        out.append(v)
        v += step
    return out


def _label(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.0e}".replace("e-0", "e-").replace("e+0", "e")
    return f"{v:.4g}"


def _panel(name: str, per: dict[int, MetricSeries], title_note: str = "") -> str:
    ranks = sorted(per)
    if len(ranks) <= LABELLED_RANKS:
        lines = [(r, COLOURS[r % 10], 1.4, 1.0) for r in ranks]
        legend = [(f"{r}", COLOURS[r % 10]) for r in ranks]
    else:
        far = _highlighted(per)
        lines = [(r, GREY_LINE, 0.7, 0.6) for r in ranks if r not in far]
        lines += [(r, COLOURS[(i + 1) % 10], 1.5, 1.0) for i, r in enumerate(far)]
        legend = [(f"{len(ranks) - len(far)} {'others' if far else 'ranks'}", GREY_LINE)]
        legend += [(f"{r}", COLOURS[(i + 1) % 10]) for i, r in enumerate(far)]
    share = max(40, SVG_POINTS // max(1, len(lines)))
    data = {r: _thin(*per[r].points(), share) for r, *_ in lines}
    xs = [x for steps, _ in data.values() for x in steps]
    ys = [y for _, values in data.values() for y in values if math.isfinite(y)]
    log = bool(ys) and min(ys) > 0 and max(ys) / min(ys) > 100  # a loss over decades

    def tf(y: float) -> float:
        return math.log10(y) if log else y

    x0, x1 = (min(xs), max(xs)) if xs else (0, 1)
    if x1 == x0:  # one step so far
        x0, x1 = max(0, x0 - 1), x0 + 1
    y0, y1 = (min(map(tf, ys)), max(map(tf, ys))) if ys else (0.0, 1.0)
    pad = (y1 - y0) * 0.06 or (abs(y0) * 0.1 or 1.0)
    y0, y1 = y0 - pad, y1 + pad
    pw, ph = PANEL_W - LEFT - RIGHT, PANEL_H - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return TOP + (1 - (tf(y) - y0) / (y1 - y0)) * ph

    out = [
        f"<text x='2' y='13' font-size='11' font-weight='600' fill='currentColor'>"
        f"{html.escape(name + title_note)}</text>"
    ]
    # legend: ranks as coloured swatches at the right of the title line
    x = PANEL_W - RIGHT
    for text, colour in reversed(legend):
        x -= 5.8 * len(text) + 4
        out.append(
            f"<text x='{x + 12:.1f}' y='13' font-size='10' fill='currentColor'>"
            f"{html.escape(text)}</text><rect x='{x + 2:.1f}' y='6' width='8' height='8' "
            f"fill='{colour}'/>"
        )
        x -= 8
    if len(legend) <= LABELLED_RANKS and ranks:
        out.append(
            f"<text x='{x:.1f}' y='13' font-size='10' text-anchor='end' fill='currentColor' "
            f"opacity='0.7'>rank{'s' if len(ranks) > 1 else ''}</text>"
        )
    grid = "stroke='currentColor' stroke-opacity='0.15' stroke-width='0.7'"
    label = "font-size='9' fill='currentColor' fill-opacity='0.75'"
    if log:
        yticks = [10.0**e for e in range(math.ceil(y0), math.floor(y1) + 1)]
    else:
        yticks = _ticks(y0, y1, 5)
    for v in yticks:
        y = py(v)
        out.append(f"<line x1='{LEFT}' x2='{PANEL_W - RIGHT}' y1='{y:.1f}' y2='{y:.1f}' {grid}/>")
        out.append(
            f"<text x='{LEFT - 4}' y='{y + 3:.1f}' text-anchor='end' {label}>{_label(v)}</text>"
        )
    for v in _ticks(x0, x1, 5, integer=True):
        x = px(v)
        if x > PANEL_W - RIGHT - 28:  # where "step" is written
            continue
        out.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{TOP}' y2='{TOP + ph}' {grid}/>")
        out.append(
            f"<text x='{x:.1f}' y='{PANEL_H - 6}' text-anchor='middle' {label}>{_label(v)}</text>"
        )
    out.append(
        f"<text x='{PANEL_W - RIGHT}' y='{PANEL_H - 6}' text-anchor='end' {label}>step</text>"
    )
    for r, colour, width, opacity in lines:
        steps, values = data[r]
        latest = per[r].latest
        tip = f"rank {r}: {latest[1]:.4g} at step {latest[0]}" if latest else f"rank {r}"
        runs: list[list[str]] = [[]]
        for s, v in zip(steps, values, strict=True):
            if math.isfinite(v) and (v > 0 or not log):
                runs[-1].append(f"{px(s):.1f},{py(v):.1f}")
            elif runs[-1]:
                runs.append([])  # a gap where the value is not finite
        for points in runs:
            if len(points) == 1:
                cx, cy = points[0].split(",")
                out.append(
                    f"<circle cx='{cx}' cy='{cy}' r='2.2' fill='{colour}'><title>{tip}</title>"
                    "</circle>"
                )
            elif points:
                out.append(
                    f"<polyline fill='none' stroke='{colour}' stroke-width='{width}' "
                    f"stroke-opacity='{opacity}' stroke-linejoin='round' "
                    f"points='{' '.join(points)}'><title>{tip}</title></polyline>"
                )
    return (
        f"<svg class='nl-panel' viewBox='0 0 {PANEL_W:g} {PANEL_H:g}' "
        "style='flex:1 1 300px;min-width:240px;max-width:560px;height:auto;overflow:visible;"
        f"font-family:var(--jp-ui-font-family,sans-serif)'>{''.join(out)}</svg>"
    )


def render_svg(m: LaunchModel) -> str:
    """The metrics of ``m`` as inline SVG panels (HTML), ``""`` without metrics.

    ``data-step`` on the outer ``div`` is the newest step drawn (tests and
    ``bench/dashboard.py`` read how far behind the bars the plot is)."""
    if not m.metrics:
        return ""
    names = list(m.metrics)
    shown = names[:MAX_PANELS]
    panels = []
    for name in shown:
        note = ""
        if name == shown[-1] and len(names) > len(shown):
            note = f"   (+{len(names) - len(shown)} more: {', '.join(names[len(shown) :][:3])})"
        panels.append(_panel(name, m.metrics[name], note))
    newest = max(
        (s.latest[0] for per in m.metrics.values() for s in per.values() if s.latest is not None),
        default=0,
    )
    return (
        f"<div class='nl-svgplot' data-step='{newest}' style='display:flex;flex-wrap:wrap;"
        f"gap:6px 18px;margin-top:6px;max-width:100%'>{''.join(panels)}</div>"
    )


__all__ = ["INSTALL_HINT", "available", "load", "render_png", "render_svg"]
