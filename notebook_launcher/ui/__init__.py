"""Views of a launch: they render plain events and never import torch.

The launcher calls ``view.handle(event)`` for every event, ``view.tick()`` after every
wait (at least twice a second, and after every batch of events: a view redraws at its
own pace, so a tick must be cheap when nothing is due), and ``view.close()`` once at the
end (before it returns or raises). A view may also have ``replay(events)``: a history at
once (``attach`` to a detached run), shown as ``handle`` would show each event in turn,
drawn once (:func:`replay` falls back to ``handle`` for views without it); one that shows
only a rank's latest lines says how many (``history_lines``), and older ones are not read. :func:`create_view` picks the widget dashboard inside a notebook front end
with ipywidgets, and the text view everywhere else. Both render one pure
:class:`~notebook_launcher.ui.model.LaunchModel`.

Example::

    view = create_view("auto")
    view.handle(event)   # for every event, in the order the parent receives them
    view.tick()          # after every wait; cheap when nothing is due
    view.close()
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TextIO

from .._events import Event
from .model import LaunchModel
from .shell import has_kernel, in_notebook_kernel
from .text import TextView


class View(Protocol):
    def handle(self, event: Event) -> None: ...

    def tick(self) -> None: ...

    def close(self) -> None: ...


def history_lines(view: View) -> int | None:
    """How many of a rank's latest output lines of a history ``view`` shows, when it shows
    only those (the dashboard: the most it can show; the text view: ``HISTORY_LINES``);
    None when it shows every line."""
    return getattr(view, "history_lines", None)


def replay(view: View, events: Sequence[Event], left_out: Mapping[int, int] | None = None) -> None:
    """Show a history: ``view.replay(events)`` where the view has it (it folds them all,
    then draws once), else ``view.handle`` for each. ``left_out``: rank -> output lines
    older than :func:`history_lines` that were counted, not read (only for a view that
    has ``history_lines``)."""
    bulk = getattr(view, "replay", None)
    if bulk is not None:
        if left_out:
            bulk(events, left_out)
        else:
            bulk(events)
        return
    for event in events:
        view.handle(event)


class NullView:
    """Shows nothing (for callers that render events themselves)."""

    def handle(self, event: Event) -> None:
        pass

    def tick(self) -> None:
        pass

    def close(self) -> None:
        pass


class SafeView:
    """Wraps a view so that a failure to draw never breaks a launch: the first exception
    from ``handle``, ``tick`` or ``close`` is reported once on stderr and the view is
    replaced by ``fallback`` (the widget dashboard falls back to text; a custom view is
    switched off). A dashboard is not worth a failed training run."""

    def __init__(self, inner: View, fallback: Callable[[View], View] | None = None) -> None:
        self.inner = inner
        self._fallback = fallback

    def _failed(self, exc: BaseException) -> None:
        name = type(self.inner).__name__
        if self._fallback is not None:
            replacement = self._fallback(self.inner)
            what = f"using {type(replacement).__name__} instead"
        else:
            replacement, what = NullView(), "continuing without it"
        print(f"notebook_launcher: the view {name} failed ({exc!r}); {what}", file=sys.stderr)
        self.inner, self._fallback = replacement, None

    def handle(self, event: Event) -> None:
        try:
            self.inner.handle(event)
        except Exception as exc:  # noqa: BLE001 - any failure of a view
            self._failed(exc)

    @property
    def history_lines(self) -> int | None:
        return history_lines(self.inner)

    def replay(self, events: Sequence[Event], left_out: Mapping[int, int] | None = None) -> None:
        try:
            replay(self.inner, events, left_out)
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)

    def tick(self) -> None:
        try:
            self.inner.tick()
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)

    def close(self) -> None:
        try:
            self.inner.close()
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)
            try:
                self.inner.close()
            except Exception:  # noqa: BLE001 - the fallback failed too: nothing left to show
                pass


def _text_fallback(stream: TextIO | None) -> Callable[[View], View]:
    def fallback(broken: View) -> View:
        model = getattr(broken, "model", None)
        return TextView(stream, model=model if isinstance(model, LaunchModel) else None)

    return fallback


def widgets_available() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install counts as missing
        return False
    return True


def create_view(
    dashboard: bool | str = "auto",
    stream: TextIO | None = None,
    *,
    interval: float = 5.0,
) -> View:
    """The view for this launch.

    ``"auto"``: the widget dashboard inside a notebook kernel with ipywidgets, else text.
    ``True``/``"widgets"``: widgets in any IPython shell with a kernel (one a front end
    can draw widgets for; not terminal IPython) when ipywidgets is there, else text with
    no error. ``"text"``: the text view. ``False``: no dashboard, but rank output and the
    final summary are still printed as rank-prefixed text. ``interval`` is the text
    view's seconds between progress lines of one rank.
    """
    if dashboard is False or dashboard == "none":
        return TextView(stream, progress=False)
    if dashboard not in (True, "auto", "widgets", "text"):
        raise ValueError(
            f"dashboard must be True, False, 'auto', 'widgets' or 'text', not {dashboard!r}"
        )
    if dashboard == "auto":
        want_widgets = in_notebook_kernel()
    else:
        want_widgets = dashboard in (True, "widgets") and has_kernel()
    if want_widgets and widgets_available():
        try:
            from .widgets import WidgetView

            return SafeView(WidgetView(), _text_fallback(stream))
        except Exception as exc:  # noqa: BLE001 - never let the dashboard break a launch
            print(f"notebook_launcher: no dashboard ({exc!r}); using text", file=sys.stderr)
    return TextView(stream, interval=interval)


def view_for(dashboard: bool | str | View, stream: TextIO | None = None) -> View:
    """The guarded view for a launcher's ``dashboard=`` argument: a choice for
    :func:`create_view`, or any object with the :class:`View` methods."""
    if isinstance(dashboard, (bool, str)):
        view = create_view(dashboard, stream)
        return view if isinstance(view, SafeView) else SafeView(view)
    return SafeView(dashboard)


__all__ = [
    "LaunchModel",
    "NullView",
    "SafeView",
    "TextView",
    "View",
    "create_view",
    "history_lines",
    "replay",
    "view_for",
]
