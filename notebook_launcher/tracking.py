"""Experiment trackers (Accelerate's ``accelerate.tracking``) and the dashboard's live plots.

Two consumers of the same ``accelerator.log({...}, step=...)`` call:

* the **dashboard**: inside a rank started by :func:`notebook_launcher.notebook_launcher`,
  every rank's call sends one :class:`~notebook_launcher._events.MetricsLogged` event to the
  kernel, where the dashboard draws one line per rank for each metric (so a rank that
  diverges stands out). Anywhere else (a plain script, ``torchrun``) that part does nothing.
  :func:`log` is that part alone.
* the **trackers** named by ``Accelerator(log_with=...)``: TensorBoard (torch's
  ``SummaryWriter``), W&B, MLflow, Comet, Aim, ClearML, DVCLive, SwanLab and Trackio, each
  through its own package, or your own :class:`GeneralTracker` subclass. As in Accelerate
  they start in ``accelerator.init_trackers(project, config)``, receive ``accelerator.log``
  on the main process only (unless a tracker sets ``main_process_only = False``) and finish
  in ``accelerator.end_training()``. Asking for a tracker whose package is not installed
  raises ``ImportError`` at ``Accelerator(...)`` (Accelerate skips it silently, losing the
  logs).

For the dashboard, values may be Python numbers or anything with ``.item()`` (a one-element
tensor, a numpy scalar); others (strings, images) are skipped. Without ``step``, each rank
counts its own calls (0, 1, 2...). Every call is one small event (about as costly as a
``print``): log every step of a fast loop if you like, the kernel keeps a bounded,
thinned-out history.

Example (in the launched function)::

    accelerator = Accelerator(log_with="tensorboard", project_dir="runs")
    accelerator.init_trackers("my_run", config={"lr": 1e-3})
    for step, batch in enumerate(loader):
        loss = train_step(batch)
        accelerator.log({"loss": loss.item()}, step=step)   # TensorBoard + dashboard
    accelerator.end_training()

    notebook_launcher.log({"loss": 0.3}, step=10)         # the dashboard alone

This module runs in ranks and stays light (the event definitions and the worker runtime:
``from notebook_launcher import log`` imports no torch); the tracker classes live in
:mod:`notebook_launcher.trackers` and are reachable here by name, on first use, as
Accelerate's ``accelerate.tracking`` offers them.
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._events import MetricsLogged
from ._worker import runtime

if TYPE_CHECKING:
    from .trackers import (
        LOGGER_TYPE_TO_CLASS,
        AimTracker,
        ClearMLTracker,
        CometMLTracker,
        DVCLiveTracker,
        GeneralTracker,
        MLflowTracker,
        SwanLabTracker,
        TensorBoardTracker,
        TrackioTracker,
        WandBTracker,
        filter_trackers,
        get_available_trackers,
        on_main_process,
        register_tracker_class,
    )

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


__all__ = [
    "log",
    "AimTracker",
    "ClearMLTracker",
    "CometMLTracker",
    "DVCLiveTracker",
    "GeneralTracker",
    "LOGGER_TYPE_TO_CLASS",
    "MLflowTracker",
    "SwanLabTracker",
    "TensorBoardTracker",
    "TrackioTracker",
    "WandBTracker",
    "filter_trackers",
    "get_available_trackers",
    "on_main_process",
    "register_tracker_class",
]
#: Accelerate's tracker names, at its module path (``notebook_launcher.trackers``' own)
_TRACKER_NAMES = frozenset(__all__) - {"log"}


def __getattr__(name: str) -> Any:
    # Accelerate's tracker names at Accelerate's module path, without making log() heavy.
    if name in _TRACKER_NAMES:
        return getattr(importlib.import_module("notebook_launcher.trackers"), name)
    raise AttributeError(f"module 'notebook_launcher.tracking' has no attribute {name!r}")
