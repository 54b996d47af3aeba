"""Views of a launch: they render plain events and never import torch.

The launcher calls ``view.handle(event)`` for every event, ``view.tick()`` about twice
a second while it waits, and ``view.close()`` once at the end (before it returns or
raises). :func:`create_view` picks the widget dashboard inside a notebook front end
with ipywidgets, and the text view everywhere else.
"""

from __future__ import annotations

import sys
from typing import Protocol, TextIO

from .._events import Event, LaunchFinished, LaunchStarted, Output


class View(Protocol):
    def handle(self, event: Event) -> None: ...

    def tick(self) -> None: ...

    def close(self) -> None: ...


class TextView:
    """Rank-prefixed output lines for terminals, CI and nbval (placeholder, see ui.text)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def handle(self, event: Event) -> None:
        if isinstance(event, Output):
            text = event.text if event.text.endswith("\n") else event.text + "\n"
            target = sys.stderr if event.stream == "stderr" and self._stream is None else self.stream
            target.write(f"[rank{event.rank}] {text}")
        elif isinstance(event, LaunchStarted):
            self.stream.write(
                f"Launching {event.local_world_size} rank(s) with {event.start_method} "
                f"({event.start_reason}); {event.backend} on {event.master_addr}:{event.master_port}\n"
            )
        elif isinstance(event, LaunchFinished) and event.ok:
            self.stream.write(f"{event.summary}\n")

    def tick(self) -> None:
        pass

    def close(self) -> None:
        self.stream.flush()


class NullView:
    def handle(self, event: Event) -> None:
        pass

    def tick(self) -> None:
        pass

    def close(self) -> None:
        pass


def create_view(dashboard: bool | str = "auto", stream: TextIO | None = None) -> View:
    """The view for this launch: ``dashboard=False`` still prints rank output as text."""
    return TextView(stream)


__all__ = ["NullView", "TextView", "View", "create_view"]
