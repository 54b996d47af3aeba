"""Metrics for the dashboard's live plots: ``log({"loss": 0.3}, step=10)`` in a rank.

Inside a rank started by :func:`notebook_launcher.notebook_launcher`, every call sends one
:class:`~notebook_launcher._events.MetricsLogged` event to the kernel, where the dashboard
draws one line per rank for each metric (so a rank that diverges stands out). Anywhere
else (a plain script, ``torchrun``, the notebook's own process) it does nothing.
``Accelerator.log`` calls it, so Accelerate's tracker API feeds the same plots.

Values may be Python numbers or anything with ``.item()`` (a one-element tensor, a numpy
scalar); others (strings, images) are skipped. Without ``step``, each rank counts its own
calls (0, 1, 2...). Every call is one small event (about as costly as a ``print``): log
every step of a fast loop if you like, the kernel keeps a bounded, thinned-out history.

Example (in the launched function)::

    import notebook_launcher
    for step, batch in enumerate(loader):
        loss = train_step(batch)
        notebook_launcher.log({"loss": loss.item()}, step=step)

This module runs in ranks: it imports only the event definitions and the worker runtime.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from ._events import MetricsLogged
from ._worker import runtime

_next_step: int = 0


def _forget_steps() -> None:
    """A forked rank must not continue the kernel's (or a previous launch's) count."""
    global _next_step
    _next_step = 0


runtime.on_rank_start(_forget_steps)


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            value = item()
        except Exception:  # noqa: BLE001 - a multi-element tensor, a device error: skip it
            return None
        if isinstance(value, (int, float)):
            return float(value)
    return None


def log(values: Mapping[str, Any], step: int | None = None) -> None:
    """Send ``values`` (metric name -> number) of this rank at ``step`` to the dashboard.

    A no-op outside a launched rank; never raises for a value it cannot plot (it is left
    out). Example: ``notebook_launcher.log({"loss": 0.25, "lr": 1e-3}, step=100)``.
    """
    global _next_step
    if not runtime.active():
        return
    if step is None:
        step = _next_step
    _next_step = int(step) + 1
    pairs = []
    for name, value in values.items():
        number = _number(value)
        if number is not None:
            pairs.append((str(name), number))
    if not pairs:
        return
    rank = int(os.environ.get("RANK", "0"))
    runtime.emit(MetricsLogged(rank=rank, step=int(step), values=tuple(pairs), time=time.time()))


__all__ = ["log"]
