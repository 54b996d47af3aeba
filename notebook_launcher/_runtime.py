"""Worker-side link to the launcher: the one place worker code sends events from.

Inside a worker started by :func:`notebook_launcher.notebook_launcher`, the worker
entry installs a sender with :func:`install`; everywhere else (a plain script,
``torchrun``, the notebook's own process) :func:`emit` is a cheap no-op. The
worker-side API (``state``, ``utils``, ``accelerator``) imports this module and
``_events`` only: never the process machinery or the UI.

Example (what ``wait_for_everyone`` does)::

    from notebook_launcher import _runtime
    from notebook_launcher._events import BarrierEnter
    if _runtime.active():
        _runtime.emit(BarrierEnter(rank=..., index=..., location="cell.py:3",
                                   kind="wait_for_everyone", time=time.time()))
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

_sender: Callable[[Any], None] | None = None
_lock = threading.Lock()
_count_lock = threading.Lock()
_barriers_entered = 0

#: Environment variable set in every worker the launcher starts.
LAUNCHER_ENV = "NOTEBOOK_LAUNCHER_WORKER"


def install(sender: Callable[[Any], None] | None) -> None:
    """Install (or with ``None`` remove) the function that ships an event to the parent."""
    global _sender, _barrier_counter
    _sender = sender
    _barriers_entered = 0


def active() -> bool:
    """True inside a worker of our launcher that can report events."""
    return _sender is not None


def emit(event: Any) -> None:
    """Send one plain event to the launcher; no-op outside a launched worker.

    Thread-safe. Never raises: a dashboard event is not worth killing training for
    (a parent that went away is detected by the process-death machinery instead).
    """
    sender = _sender
    if sender is None:
        return
    try:
        with _lock:
            sender(event)
    except Exception:  # noqa: BLE001 - reporting must never break the user's program
        pass


def next_barrier_index() -> int:
    """Sequence number of the next barrier this rank enters (0, 1, 2, ...)."""
    global _barriers_entered
    with _count_lock:
        index = _barriers_entered
        _barriers_entered += 1
    return index


def barriers_entered() -> int:
    """How many process-control barriers this rank has entered so far."""
    return _barriers_entered


def caller_location(skip_modules: tuple[str, ...] = ("notebook_launcher",)) -> str:
    """``"file:line"`` of the first stack frame outside ``skip_modules`` (the user's call site)."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not any(module == m or module.startswith(m + ".") for m in skip_modules) and not (
            module.startswith("contextlib")
        ):
            filename = frame.f_code.co_filename
            if filename.startswith("<ipython-input") or "ipykernel_" in filename:
                short = filename
            else:
                short = os.path.basename(filename)
            return f"{short}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "<unknown>:0"
