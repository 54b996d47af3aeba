"""Views for many small runs: a session's cells, a non-blocking launch.

:class:`LazyView` shows a quick task as IPython shows a local cell -- just what it printed,
each line labelled with its rank -- and only a task that lasts (or draws a progress bar)
as the full view. :class:`DisplayedTextView` keeps a text view in one output area of the
notebook (a display id), so that a run that goes on in the background never prints into
the cell that happens to run later.

Both take plain events only (``_events``); neither imports torch.
"""

from __future__ import annotations

import contextvars
import io
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .._events import Event, LaunchStarted, NodesWaiting, Output, ProgressUpdate
from .model import LaunchModel, clean_line

#: The most text a displayed text view keeps (its newest lines).
MAX_SHOWN_CHARS = 200_000


class _View(Protocol):
    def handle(self, event: Event) -> None: ...

    def tick(self) -> None: ...

    def close(self) -> None: ...


class LazyView:
    """Hold a task's events for ``delay`` seconds; then (or at the first progress bar, or
    a wait for a cluster's nodes) hand them to the view ``make()`` builds. A task that ends sooner prints its output
    lines alone (``[rank1] ...``); its failure, if any, is the exception the caller gets."""

    def __init__(self, make: Callable[[], _View], delay: float = 0.5) -> None:
        self._make = make
        self._delay = delay
        self._buffer: list[Event] = []
        self._inner: _View | None = None
        self._started: float | None = None

    def handle(self, event: Event) -> None:
        if self._inner is not None:
            self._inner.handle(event)
            return
        if isinstance(event, LaunchStarted):
            self._started = time.monotonic()
        self._buffer.append(event)
        if (
            isinstance(event, ProgressUpdate)
            and not event.disabled
            or isinstance(event, NodesWaiting)
        ):
            self._show()

    def tick(self) -> None:
        if self._inner is not None:
            self._inner.tick()
        elif self._started is not None and time.monotonic() - self._started >= self._delay:
            self._show()

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
            return
        model = LaunchModel()  # the labels the full view would give: [rank1], [n2:rank3]
        for event in self._buffer:
            if isinstance(event, LaunchStarted):
                model.apply(event)
            if isinstance(event, Output):
                stream = sys.stderr if event.stream == "stderr" else sys.stdout
                line = clean_line(event.text)
                if line or event.text.endswith("\n"):
                    stream.write(f"{model.line_label(event.rank)} {line}\n")
        self._buffer.clear()

    def _show(self) -> None:
        self._inner = self._make()
        for event in self._buffer:
            self._inner.handle(event)
        self._buffer.clear()


class InCell:
    """A view whose every call runs in the context of the cell that made it.

    ipykernel keeps the cell an output belongs to (its parent message) in context
    variables. A thread that serves the view -- a session's pump, a non-blocking launch --
    would otherwise send its updates, widget messages and printed lines as if they came
    from whichever cell runs at that moment."""

    def __init__(self, inner: _View) -> None:
        self.inner = inner
        self._context = contextvars.copy_context()

    def handle(self, event: Event) -> None:
        self._context.run(self.inner.handle, event)

    def tick(self) -> None:
        self._context.run(self.inner.tick)

    def close(self) -> None:
        self._context.run(self.inner.close)


class DisplayedTextView:
    """A text view (``make(stream)``) whose output lives in one display area, updated at
    most every ``interval`` seconds from whatever thread runs the launch."""

    def __init__(self, make: Callable[[io.StringIO], _View], interval: float = 0.5) -> None:
        from IPython.display import display

        self._buffer = io.StringIO()
        self._inner = make(self._buffer)
        self._interval = interval
        self._shown = ""
        self._last = 0.0
        self._handle: Any = display({"text/plain": ""}, raw=True, display_id=True)

    def handle(self, event: Event) -> None:
        self._inner.handle(event)

    def replay(self, events: Sequence[Event]) -> None:
        from . import replay

        replay(self._inner, events)

    def tick(self) -> None:
        self._inner.tick()
        if time.monotonic() - self._last >= self._interval:
            self._update()

    def close(self) -> None:
        self._inner.close()
        self._update()

    def _update(self) -> None:
        text = self._buffer.getvalue()
        if len(text) > MAX_SHOWN_CHARS:  # bounded: the newest lines, as a terminal keeps them
            text = text[-MAX_SHOWN_CHARS:].split("\n", 1)[-1]
            self._buffer.seek(0)
            self._buffer.truncate()
            self._buffer.write(text)
        if text != self._shown and self._handle is not None:
            self._handle.update({"text/plain": text}, raw=True)
            self._shown = text
        self._last = time.monotonic()


def launch_view(dashboard: bool | str | Any, block: bool) -> Any:
    """A launch's view (``dashboard``: its argument). A non-blocking launch in a notebook
    that would print text keeps it in its own output area instead: the cell that runs
    later must not receive it."""
    from . import view_for
    from .shell import in_notebook_kernel
    from .text import TextView

    view = view_for(dashboard)
    if block or not isinstance(dashboard, (bool, str)) or not in_notebook_kernel():
        return view
    if isinstance(getattr(view, "inner", view), TextView):
        progress = dashboard is not False
        return DisplayedTextView(lambda stream: TextView(stream, progress=progress))
    return view


__all__ = ["DisplayedTextView", "InCell", "LazyView", "launch_view"]
