"""Worker-side link to the launcher: the one place worker code sends events from.

Inside a worker started by :func:`notebook_launcher.notebook_launcher`, the worker
entry installs a sender with :func:`install`; everywhere else (a plain script,
``torchrun``, the notebook's own process) :func:`emit` is a cheap no-op. The
worker-side API (``state``, ``utils``, ``accelerator``) imports this module and
``_events`` only: never the process machinery or the UI.

Example (what barrier telemetry does)::

    from notebook_launcher._worker import runtime
    from notebook_launcher._events import BarrierEnter
    if runtime.active():
        runtime.emit(BarrierEnter(rank=..., index=..., location="cell.py:3",
                                  kind="wait_for_everyone", time=time.time()))
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .._spec import LAUNCHER_ENV

_sender: Callable[[Any], None] | None = None
_lock = threading.Lock()
_count_lock = threading.Lock()
_barriers_entered = 0
_start_hooks: list[Callable[[], None]] = []


def install(sender: Callable[[Any], None] | None) -> None:
    """Install (or with ``None`` remove) the function that ships an event to the parent.

    Also starts the rank's barrier count afresh (a forked rank inherits the kernel's).
    """
    global _sender, _barriers_entered
    _sender = sender
    with _count_lock:
        _barriers_entered = 0


def on_rank_start(hook: Callable[[], None]) -> None:
    """Register ``hook`` to run in every rank before the user's function.

    Worker-side modules use it to forget state a forked rank inherited from the kernel
    (``state`` registers its reset when imported), so the rank entry never has to know
    which modules exist.
    """
    if hook not in _start_hooks:
        _start_hooks.append(hook)


def run_start_hooks() -> None:
    """Called by the rank entry once the environment is set, before the function."""
    for hook in list(_start_hooks):
        hook()


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


@contextmanager
def phase(rank: int, name: str) -> Iterator[None]:
    """Say what the rank does meanwhile (a key of ``_events.RUNNING_PHASES``), and that it
    is done when the block ends, also by an exception; a no-op outside a launched worker."""
    from .._events import WorkerPhase

    if not active():
        yield
        return
    emit(WorkerPhase(rank, os.getpid(), name, time.time()))
    try:
        yield
    finally:
        emit(WorkerPhase(rank, os.getpid(), "", time.time()))


def send(message: Any) -> None:
    """Send a control message (a session's answers) on the same channel, under the same
    lock as :func:`emit`; unlike ``emit`` it raises when the kernel is gone."""
    sender = _sender
    if sender is None:
        raise RuntimeError("not a launched rank: no channel to the kernel")
    with _lock:
        sender(message)


def next_barrier_index() -> int:
    """Sequence number of the next barrier this rank enters (0, 1, 2, ...)."""
    global _barriers_entered
    with _count_lock:
        index = _barriers_entered
        _barriers_entered += 1
    return index


def reset_barrier_count() -> None:
    """Start counting barriers afresh (a session rank, at the start of each task)."""
    global _barriers_entered
    with _count_lock:
        _barriers_entered = 0


def barriers_entered() -> int:
    """How many process-control barriers this rank has entered so far."""
    return _barriers_entered


def flush_output() -> None:
    """Flush the rank's stdout and stderr (before it answers, or exits): what it printed
    reaches the kernel ahead of the answer. A closed or broken stream is no error here."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


__all__ = [
    "LAUNCHER_ENV",
    "active",
    "barriers_entered",
    "emit",
    "flush_output",
    "install",
    "next_barrier_index",
    "on_rank_start",
    "reset_barrier_count",
    "run_start_hooks",
    "send",
]
