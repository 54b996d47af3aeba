"""Live metric plots: one panel per logged metric, one line per rank, as a PNG.

Drawn with matplotlib's Agg backend into a PNG (``matplotlib.figure.Figure``, never
``pyplot``: the user's backend and figures are left alone). Why a PNG: it needs no
JavaScript and no front-end extension, so the same picture works live (an
``ipywidgets.Image``), in JupyterLab for untrusted notebooks, on GitHub and on nbviewer
(the saved notebook keeps it as an ``image/png`` output); matplotlib is the most widely
installed and longest-kept plotting library there is. Interactive libraries (plotly,
bqplot) need JavaScript that none of the static renderers run.

matplotlib is optional (``pip install 'notebook_launcher[plots]'``): without it,
:func:`available` is false and the dashboard shows a table of the last values instead.

Example::

    png = render_png(model)          # bytes, or None when nothing was logged
"""

from __future__ import annotations

import importlib.util
import io
import math
from statistics import median

from .model import LaunchModel

#: What the dashboard says when matplotlib is missing.
INSTALL_HINT = "live plots need matplotlib: pip install 'notebook_launcher[plots]'"
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
        last = {r: latest[1] for r in ranks if (latest := per[r].latest) is not None}
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
            finite = {r: v for r, v in last.items() if math.isfinite(v)}
            mid = median(finite.values()) if finite else 0.0
            spread = median(abs(v - mid) for v in finite.values()) if finite else 0.0
            gap = {r: abs(v - mid) if math.isfinite(v) else math.inf for r, v in last.items()}
            # in colour: the (at most 3) ranks far from the others, if any is
            far = [r for r in sorted(gap, key=lambda r: -gap[r]) if gap[r] > 3 * spread]
            highlight = far[:3]
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


__all__ = ["INSTALL_HINT", "available", "load", "render_png"]
