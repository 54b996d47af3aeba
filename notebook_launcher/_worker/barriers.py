"""Barrier telemetry: which rank waits in which ``wait_for_everyone``, and for how long.

The process-control API (``PartialState.wait_for_everyone``, ``main_process_first``, ...)
calls :func:`barrier` with the real barrier as a function. Outside a launched rank that is
just the barrier. Inside one, the rank notes the barrier in a slot that a watchdog thread
looks at every ``quiet / 2`` seconds: a barrier still running after the quiet period (env
``NOTEBOOK_LAUNCHER_BARRIER_QUIET_MS``, default 50) is reported with ``BarrierEnter`` (the
user's call site, the time the rank entered) and, once everybody arrived, ``BarrierExit``.
Shorter barriers send nothing: no front end could show them, and two messages per barrier
would cost more than the barrier itself. A quiet period of 0 reports every barrier.

Dashboard plumbing, kept out of the state API; rank side, no UI.

Example::

    from notebook_launcher._worker import barriers
    barriers.barrier(lambda: dist.barrier(), rank=0, kind="wait_for_everyone")
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TypeVar

from .._events import BarrierEnter, BarrierExit
from . import runtime

#: Barriers shorter than this (seconds) are not reported (see the module docstring). The
#: watchdog wakes every half of it: at 20 ms those wake-ups cost a busy rank's barriers
#: 17-30% (bench/barrier.py), at 50 ms about 3%, and no one sees a 50 ms wait anyway.
DEFAULT_QUIET = 0.05
#: Seconds without a barrier after which the watchdog thread sleeps until the next one.
IDLE_AFTER = 1.0
QUIET_ENV = "NOTEBOOK_LAUNCHER_BARRIER_QUIET_MS"


def quiet_from_env() -> float:
    """The quiet period in seconds, from ``NOTEBOOK_LAUNCHER_BARRIER_QUIET_MS``."""
    value = os.environ.get(QUIET_ENV)
    try:
        return max(float(value), 0.0) / 1000 if value is not None else DEFAULT_QUIET
    except ValueError:
        return DEFAULT_QUIET


# --- where the user called it ---------------------------------------------------------------


def _ours(module: str) -> bool:
    return (
        module == "notebook_launcher"
        or module.startswith("notebook_launcher.")
        or module.startswith("contextlib")
    )


def _short(filename: str) -> str:
    """Notebook cells keep their full pseudo-path (the UI turns it into ``Cell In[n]``)."""
    if filename.startswith("<ipython-input") or "ipykernel_" in filename:
        return filename
    return os.path.basename(filename)


def location_of(frame: FrameType | None) -> str:
    """``file:line`` of the first frame, from ``frame`` outwards, that is not ours."""
    while frame is not None:
        if not _ours(frame.f_globals.get("__name__", "")):
            return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>:0"


def caller_location() -> str:
    """``file:line`` of the user's call site, seen from inside our own code."""
    return location_of(sys._getframe(1))


def _waiting_location(frame: FrameType | None) -> str:
    """The user's call site from a waiting thread's stack: skip torch's frames (innermost)
    up to this module, then ours."""
    while frame is not None and frame.f_globals.get("__name__") != __name__:
        frame = frame.f_back
    return location_of(frame)


# --- the watchdog ---------------------------------------------------------------------------


class _Pending:
    """A barrier a rank is in; ``location`` is set once it has been reported."""

    __slots__ = ("rank", "index", "kind", "entered", "since", "thread", "location")

    def __init__(self, rank: int, index: int, kind: str) -> None:
        self.rank = rank
        self.index = index
        self.kind = kind
        self.entered = time.time()
        self.since = time.monotonic()
        self.thread = threading.get_ident()
        self.location: str | None = None


class _Watch:
    """One daemon thread per rank that reports barriers lasting longer than ``quiet``.

    The rank only stores a :class:`_Pending` before the barrier and clears it after (a
    couple of microseconds); the thread reads the call site from the waiting thread's stack.
    After :data:`IDLE_AFTER` seconds without a barrier the thread sleeps until the next one
    (a session's rank between cells costs nothing); the barrier that wakes it pays for an
    ``Event.set()``, the ones that follow it while the thread is awake do not.
    """

    _instance: _Watch | None = None

    def __init__(self, quiet: float) -> None:
        self.quiet = quiet
        self.lock = threading.Lock()
        self.pending: _Pending | None = None
        self.last: _Pending | None = None  # the latest barrier, ended or not
        self.idle = False  # the thread waits on `wake` (set it when storing a barrier)
        self.wake = threading.Event()
        self.pid = os.getpid()
        thread = threading.Thread(target=self._run, name="notebook-launcher-barriers")
        thread.daemon = True
        thread.start()

    @classmethod
    def get(cls, quiet: float) -> _Watch:
        watch = cls._instance
        if watch is None or watch.pid != os.getpid() or watch.quiet != quiet:
            if watch is not None:
                watch.quiet = -1.0  # tells an old thread of this process to stop
            watch = cls._instance = cls(quiet)
        return watch

    def _run(self) -> None:
        quiet = self.quiet
        started = time.monotonic()
        while self.quiet == quiet and runtime.active():
            last = self.last
            since = last.since if last is not None else started
            if self.pending is None and time.monotonic() - since > IDLE_AFTER:
                self.idle = True
                if self.pending is None:  # stored before `idle` was seen: no wait
                    self.wake.wait(1.0)  # (and look at `quiet` and `active` now and then)
                self.idle = False
                self.wake.clear()
                continue
            time.sleep(quiet / 2)
            pending = self.pending
            if pending is None or pending.location is not None:
                continue
            if time.monotonic() - pending.since < quiet:
                continue
            with self.lock:
                if self.pending is not pending:
                    continue  # it finished meanwhile
                pending.location = _waiting_location(sys._current_frames().get(pending.thread))
                runtime.emit(
                    BarrierEnter(
                        pending.rank, pending.index, pending.location, pending.kind, pending.entered
                    )
                )
        if _Watch._instance is self:
            _Watch._instance = None


def _entered(exc: BaseException) -> bool:
    """Whether a call that raised ``exc`` had entered its collective: not when it was
    refused before (a cell on some ranks), nor when the ranks' calls did not match (the
    check runs first, and nothing was sent)."""
    from ..errors import DistributedOperationException, ProcessGroupMismatch

    return not isinstance(exc, (ProcessGroupMismatch, DistributedOperationException))


T = TypeVar("T")
_inside = threading.local()


def barrier(wait: Callable[[], T], rank: int, kind: str, quiet: float = DEFAULT_QUIET) -> T:
    """Run ``wait()`` (the real barrier or collective) and return what it returns,
    reported to the launcher when it is noticeable. A call made inside another reported
    one (``wait_for_everyone`` calls ``dist.barrier``, itself reported in a session) is
    not reported again."""
    if not runtime.active() or getattr(_inside, "active", False):
        return wait()
    _inside.active = True
    try:
        return _reported(wait, rank, kind, quiet)
    finally:
        _inside.active = False


def _reported(wait: Callable[[], T], rank: int, kind: str, quiet: float) -> T:
    if quiet <= 0:
        index = runtime.next_barrier_index()
        location = caller_location()
        runtime.emit(BarrierEnter(rank, index, location, kind, time.time()))
        value = wait()
        runtime.emit(BarrierExit(rank, index, location, time.time()))
        return value
    watch = _Watch.get(quiet)
    pending = _Pending(rank, runtime.next_barrier_index(), kind)
    watch.pending = watch.last = pending
    if watch.idle:
        watch.wake.set()
    try:
        value = wait()
    except BaseException as exc:
        with watch.lock:
            watch.pending = None
            reported = pending.location
        if not _entered(exc):  # refused or mismatched: nothing is left in flight
            if reported is not None:
                runtime.emit(BarrierExit(rank, pending.index, reported, time.time()))
        elif reported is None:  # failed fast (a peer left): still say where we waited
            runtime.emit(
                BarrierEnter(rank, pending.index, caller_location(), kind, pending.entered)
            )
        raise
    with watch.lock:
        watch.pending = None
        reported = pending.location
    if reported is not None:
        runtime.emit(BarrierExit(rank, pending.index, reported, time.time()))
    return value


__all__ = ["DEFAULT_QUIET", "QUIET_ENV", "barrier", "caller_location", "quiet_from_env"]
