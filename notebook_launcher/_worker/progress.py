"""Worker side of the progress bars: tqdm bars become :class:`ProgressUpdate` events.

The worker entry calls :func:`install` right before the user's function runs. From then
on every tqdm bar created in the worker (``tqdm.tqdm``, ``tqdm.auto.tqdm``,
``tqdm.notebook.tqdm``, ``trange``, subclasses, and names imported *before* the
launch, e.g. ``from tqdm.auto import tqdm`` at the top of the notebook) draws nothing
and reports its state with :func:`notebook_launcher._worker.runtime.emit` instead.

How: the one thing every tqdm class shares is ``tqdm.std.tqdm.__new__``. While
installed, it hands out an instance of a per-class subclass that puts
:class:`_EventBar` first in the MRO: ``status_printer``/``display`` report an event
instead of drawing (the notebook class's widget set-up is skipped), ``file`` is a null
sink, and ``close`` always reports the final state. Coalescing is tqdm's own: it only
calls ``display`` after ``miniters`` iterations *and* ``mininterval`` (0.1 s) seconds, so
a tight loop costs what plain tqdm costs; :data:`MIN_INTERVAL` caps explicit
``refresh()``/``set_postfix()`` floods at ~10 events per second per bar. Disabled bars
(``disable=True``, e.g. ``disable=not accelerator.is_local_main_process``) emit nothing.

This module must not import the UI (it runs in the worker).

Example::

    from notebook_launcher._worker import progress, runtime
    events = []
    runtime.install(events.append)
    progress.install(rank=0)
    for _ in tqdm(range(3)):
        pass
    progress.uninstall(); runtime.install(None)
    assert events[-1].closed and events[-1].n == 3
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from typing import Any

from .._events import ProgressUpdate
from . import runtime

#: Seconds between two events of one bar (the final state is always sent).
MIN_INTERVAL = 0.1

_rank: int | None = None
_bar_ids = itertools.count()  # only uniqueness within a process matters
_lock = threading.Lock()
_original_new: Any = None  # tqdm.std.tqdm.__dict__["__new__"] while installed
_event_classes: dict[type, type] = {}


class _NullFile:
    """Where installed bars "draw": nothing. ``isatty`` is true so ``disable=None``
    (tqdm's "hide when not a terminal") still shows the bar in the dashboard."""

    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


_NULL = _NullFile()


def _is_notebook_class(cls: type) -> bool:
    nb = sys.modules.get("tqdm.notebook")
    base = getattr(nb, "tqdm_notebook", None)
    return base is not None and issubclass(cls, base)


class _EventBar:
    """Mixin put in front of a tqdm class: report events instead of drawing."""

    _nl_bar_id: int
    _nl_last_emit: float

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # tqdm(iterable, desc, total, leave, file, ...): ``file`` is the 5th argument
        if len(args) > 4:
            args = (*args[:4], _NULL, *args[5:])
        else:
            kwargs["file"] = _NULL
        self._nl_bar_id = next(_bar_ids)
        self._nl_last_emit = float("-inf")
        self._nl_rank = _rank
        cls = type(self)
        if _is_notebook_class(cls):
            # skip tqdm_notebook.__init__ (it builds and displays ipywidgets), keep the rest
            nb_base = sys.modules["tqdm.notebook"].tqdm_notebook
            kwargs.pop("display", None)
            kwargs["gui"] = False
            self.disp = lambda *_, **__: None  # tqdm_notebook's own error/close hooks
            super(nb_base, self).__init__(*args, **kwargs)
        else:
            super().__init__(*args, **kwargs)

    @staticmethod
    def status_printer(file: Any, *_: Any, **__: Any) -> Any:
        return lambda s: None

    def display(self, msg: str | None = None, pos: int | None = None, **_: Any) -> bool:
        if getattr(self, "_nl_closing", False):
            return True
        now = time.time()
        # 0.9: tqdm's own gate measures the same 0.1 s with another clock
        if now - self._nl_last_emit >= 0.9 * MIN_INTERVAL:
            self._nl_emit(closed=False, now=now)
        return True

    def clear(self, *_: Any, **__: Any) -> None:
        pass

    def reset(self, total: float | None = None) -> None:
        import tqdm.std

        tqdm.std.tqdm.reset(self, total=total)

    def close(self) -> None:
        if getattr(self, "disable", True):
            return  # disabled, or already closed
        self._nl_closing = True
        try:
            super().close()  # type: ignore[misc]
        finally:
            self._nl_emit(closed=True, now=time.time())

    def _nl_emit(self, closed: bool, now: float) -> None:
        self._nl_last_emit = now
        bar: Any = self
        try:
            start = getattr(bar, "start_t", now)
            elapsed = max(0.0, bar._time() - start) if hasattr(bar, "_time") else 0.0
            rate = None
            dt = bar._ema_dt() if hasattr(bar, "_ema_dt") else None
            if dt:
                rate = bar._ema_dn() / dt
            if rate is None and elapsed > 0:
                rate = (bar.n - getattr(bar, "initial", 0)) / elapsed or None
            unit_scale = bar.unit_scale
            scale = unit_scale if not isinstance(unit_scale, bool) and unit_scale else 1
            total = bar.total * scale if bar.total is not None else None
            event = ProgressUpdate(
                rank=self._nl_rank if self._nl_rank is not None else 0,
                bar_id=self._nl_bar_id,
                desc=str(bar.desc or "").rstrip(": "),
                n=bar.n * scale,
                total=total,
                unit=str(bar.unit),
                rate=rate * scale if rate is not None else None,
                elapsed=elapsed,
                closed=closed,
                postfix=str(bar.postfix or "").lstrip(", "),
                level=abs(getattr(bar, "pos", 0) or 0),
                time=now,
            )
        except Exception:  # noqa: BLE001 - a progress bar must never break training
            return
        runtime.emit(event)


def _event_class(cls: type) -> type:
    """``cls`` with :class:`_EventBar` in front (cached; same name, so reprs look normal)."""
    if issubclass(cls, _EventBar):
        return cls
    with _lock:
        sub = _event_classes.get(cls)
        if sub is None:
            sub = type(
                cls.__name__,
                (_EventBar, cls),
                {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
            )
            _event_classes[cls] = sub
        return sub


def _patched_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    original = _original_new
    if original is None:  # uninstalled while a call was on its way
        import tqdm.std

        original = tqdm.std.tqdm.__dict__["__new__"]
    return original.__func__(_event_class(cls), *args, **kwargs)


def install(rank: int) -> None:
    """Route every tqdm bar created from now on to ``ProgressUpdate`` events of ``rank``.

    A no-op when tqdm is not installed. Idempotent (a second call just changes the rank).
    """
    global _rank, _original_new
    try:
        import tqdm.std
    except ImportError:
        return
    _rank = rank
    base = tqdm.std.tqdm
    _forget_the_kernels_shell()
    _forget_the_kernels_bars(tqdm.std)
    if _original_new is None:
        _original_new = base.__dict__["__new__"]
        base.__new__ = staticmethod(_patched_new)


def _forget_the_kernels_shell() -> None:
    """A forked worker inherits the kernel's IPython shell, so libraries that ask
    ``get_ipython()`` think they run in a notebook and draw with ``display()``, which
    ipykernel refuses to send from a forked process: Transformers' ``Trainer`` picked its
    notebook progress bar and nothing of it reached the dashboard. A rank is not a kernel
    (a spawned one has no shell either): it forgets the shell, and such libraries print
    (and use tqdm), which the dashboard shows."""
    interactiveshell = sys.modules.get("IPython.core.interactiveshell")
    if interactiveshell is None:
        return
    shell_class = interactiveshell.InteractiveShell
    try:
        if shell_class.initialized():
            shell_class.clear_instance()  # clears the subclasses' instance too
    except Exception:  # noqa: BLE001 - best effort: a shell that will not go is harmless
        pass


def _forget_the_kernels_bars(std: Any) -> None:
    """A forked worker inherits the kernel's tqdm bookkeeping: bars still open there
    (which would push every bar of the rank one level down) and a thread lock that a
    kernel thread (tqdm's monitor) may have held at the fork (the first bar would hang).
    The bars' new lock is made when the first bar takes it (:class:`_LockOnFirstUse`)."""
    std.tqdm._instances.clear()
    std.tqdm.monitor = None  # its thread did not survive the fork; the next bar starts one
    std.TqdmDefaultWriteLock.th_lock = threading.RLock()
    std.tqdm.set_lock(_LockOnFirstUse(std))


class _LockOnFirstUse:
    """tqdm's write lock (a ``TqdmDefaultWriteLock``), made when it is first taken: making
    it makes a ``multiprocessing`` lock (an import and a semaphore: ~2 ms of every rank's
    start, issue 33) that a rank without a bar never takes. Sent to another process, it
    goes as the lock itself."""

    def __init__(self, std: Any) -> None:
        self._std = std
        self._made: Any = None

    def _lock(self) -> Any:
        if self._made is None:
            with self._std.TqdmDefaultWriteLock.th_lock:  # (two threads' first bars: one lock)
                if self._made is None:
                    self._made = self._std.TqdmDefaultWriteLock()
        return self._made

    def acquire(self, *args: Any, **kwargs: Any) -> Any:
        return self._lock().acquire(*args, **kwargs)

    def release(self) -> None:
        self._lock().release()

    def __enter__(self) -> None:
        self._lock().acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock().release()

    def __getattr__(self, name: str) -> Any:  # (``locks``, and what a later tqdm adds)
        if name.startswith("_"):  # (not made yet: never the lock's)
            raise AttributeError(name)
        return getattr(self._lock(), name)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._lock().__reduce_ex__(protocol)


def uninstall() -> None:
    """Undo :func:`install` (bars created while installed keep reporting)."""
    global _rank, _original_new
    if _original_new is not None:
        import tqdm.std

        tqdm.std.tqdm.__new__ = _original_new
        _original_new = None
    _rank = None


def installed() -> bool:
    return _original_new is not None


__all__ = ["MIN_INTERVAL", "install", "installed", "uninstall"]
