"""Shared test helpers."""

from __future__ import annotations

from notebook_launcher._events import Event, Output


class Recorder:
    """A launcher view that keeps every event (the output path is pluggable: any object
    with the ``notebook_launcher.ui.View`` methods can be passed as ``dashboard=``)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ticks = 0
        self.closed = 0

    def handle(self, event: Event) -> None:
        self.events.append(event)

    def tick(self) -> None:
        self.ticks += 1

    def close(self) -> None:
        self.closed += 1

    def of(self, cls: type) -> list:
        return [e for e in self.events if isinstance(e, cls)]

    def lines(self, rank: int, stream: str = "stdout") -> list[str]:
        return [e.text for e in self.of(Output) if e.rank == rank and e.stream == stream]
