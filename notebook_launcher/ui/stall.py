"""The stall view: where every rank is, side by side (HTML and text, no torch).

Drawn from a :class:`~notebook_launcher._events.StacksTaken`: the findings first (the odd
rank(s) out named: ``rank 1 is in `loss.backward()` at Cell In[3], line 9; ranks 0, 2, 3
wait in `all_reduce` at line 12``), then one column per group of ranks whose stacks are
the same (eight ranks stuck in the same ``all_reduce`` are one column), the odd ones
marked, each thread folded as a rank's traceback is (``_stacks.format_rank``). The live
dashboard shows it while a stall lasts (``widgets``), the saved snapshot keeps the last
one (``html.snapshot``), the text view prints it (``text``), and :class:`Stacks` is what
``session.stacks()`` / ``handle.stacks()`` / ``%dist stacks`` return.

Example::

    from notebook_launcher.ui.stall import stall_html
    html = stall_html(report, now=time.time())
"""

from __future__ import annotations

import html as _html
from typing import Any

from .. import _stacks
from .._events import StacksTaken

ORANGE = "#e65100"
GREY = "#757575"
MONO = "font-family:var(--jp-code-font-family,monospace)"
PRE = (
    f"margin:0;padding:4px 6px;{MONO};font-size:11.5px;line-height:1.35;white-space:pre;"
    "overflow:auto;max-height:320px;background:#fafafa;border:none"
)


def _esc(text: str) -> str:
    return _html.escape(text, quote=False)


def _attr(text: str) -> str:
    return _html.escape(text, quote=True)


def stall_html(report: StacksTaken | None, now: float | None = None, live: bool = True) -> str:
    """The stall view as HTML (empty without a report). ``live``: it refreshes while the
    stall lasts (said in the header); a saved or on-demand report says when it was taken."""
    if report is None:
        return ""
    if _stacks.all_idle(report):  # nothing to look at: one quiet line
        return (
            f"<div class='nl-stall nl-stall-idle' style='color:{GREY};margin-top:4px'>"
            f"{_esc(' '.join(report.findings))}</div>"
        )
    head = _stacks.headline(report)
    if report.reason == "stall" and live:
        head = head.removesuffix(":") + " (refreshed while it lasts):"
    findings = "".join(
        f"<div class='nl-stall-finding' style='color:{ORANGE};font-weight:600;"
        f"white-space:normal'>{_esc(f)}</div>"
        for f in report.findings
    )
    flight = "".join(
        f"<div class='nl-stall-flight' style='color:{GREY};font-size:12px'>rank {rank} "
        f"flight recorder: {_esc(text)}</div>"
        for rank, text in report.flight
    )
    columns = []
    for group in _stacks.same_stacks(report.ranks):
        ranks = [r.rank for r in group]
        odd = bool(set(ranks) & set(report.odd))
        who = _stacks.rank_list(ranks)
        pids = ", ".join(str(r.pid) for r in group)
        title = f"{who} (pid {pids})" + (" \u00b7 the same stacks" if len(group) > 1 else "")
        mark = f" <span style='color:{ORANGE}'>\u25c0 odd one out</span>" if odd else ""
        border = ORANGE if odd else "#dddddd"
        body = _stacks.format_rank(group[0]).rstrip("\n")
        data_ranks = ",".join(str(r) for r in ranks)
        columns.append(
            f"<div class='nl-stall-col{' nl-stall-odd' if odd else ''}' "
            f"data-ranks='{data_ranks}' style='flex:1 1 0;width:0;min-width:min(22em,100%);"
            f"border:1px solid {border};border-radius:3px;overflow:hidden'>"
            f"<div title='{_attr(title)}' style='padding:2px 6px;font-weight:600;"
            f"white-space:nowrap;overflow:hidden;text-overflow:ellipsis'>{_esc(title)}{mark}"
            f"</div><pre style='{PRE}'>{_esc(body)}</pre></div>"
        )
    return (
        f"<div class='nl-stall' style='margin-top:4px;border-left:3px solid {ORANGE};"
        "padding-left:6px;max-width:100%;box-sizing:border-box;overflow:hidden'>"
        f"<div style='font-weight:600'>{_esc(head)}</div>{findings}{flight}"
        "<div class='nl-stall-columns' style='display:flex;gap:6px;overflow-x:auto;"
        f"width:100%;margin-top:3px;align-items:flex-start'>{''.join(columns)}</div></div>"
    )


def stall_text(report: StacksTaken) -> str:
    """The report as the text view prints it."""
    return "notebook_launcher: " + _stacks.format_report(report)


class Stacks:
    """Where every rank is (``session.stacks()``, ``handle.stacks()``, ``%dist stacks``):
    printed as text, shown as the stall view in a notebook. ``findings`` and ``odd`` say
    which rank(s) differ; ``report`` is the data (every rank's threads and frames)."""

    def __init__(self, report: StacksTaken) -> None:
        self.report = report

    @property
    def findings(self) -> tuple[str, ...]:
        return self.report.findings

    @property
    def odd(self) -> tuple[int, ...]:
        return self.report.odd

    def __str__(self) -> str:
        return _stacks.format_report(self.report).rstrip("\n")

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        return stall_html(self.report, live=False)


__all__ = ["Stacks", "stall_html", "stall_text"]
