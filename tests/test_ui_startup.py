"""What a rank says while it starts (``WorkerPhase``), from real ranks, as the views show it.

A cold start of many spawned ranks takes seconds (each imports torch; they join the process
group one by one): the ranks report each step before ``WorkerStarted``, so a slow start reads
"importing torch" or "joining the process group (3/8 joined)" instead of a silent "running".
"""

from __future__ import annotations

import io
import os
import re
import signal
import time
from typing import Any

import pytest

from notebook_launcher import notebook_launcher
from notebook_launcher._events import Event, WorkerPhase, WorkerStarted
from notebook_launcher.errors import WorkerDied
from notebook_launcher.ui import html as H
from notebook_launcher.ui.model import LaunchModel
from notebook_launcher.ui.text import TextView

pytestmark = pytest.mark.multiprocess


def _rank(x: int) -> int:
    return int(os.environ["RANK"]) + x


class Recorder:
    """A view that keeps every event, and can act on one as it arrives."""

    def __init__(self, on_event: Any = None) -> None:
        self.events: list[Event] = []
        self.on_event = on_event

    def handle(self, event: Event) -> None:
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def tick(self) -> None:
        pass

    def close(self) -> None:
        pass


def _phases(events: list[Event], rank: int) -> list[str]:
    """The rank's start-up steps, up to its WorkerStarted."""
    out = []
    for e in events:
        if isinstance(e, WorkerPhase) and e.rank == rank:
            out.append(e.phase)
        elif isinstance(e, WorkerStarted) and e.rank == rank:
            out.append("started")
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("method", "steps"),
    [
        ("spawn", ["importing", "loading", "joining", "started"]),  # a fresh interpreter
        ("fork", ["joining", "started"]),  # torch and the function are inherited
    ],
)
def test_ranks_say_what_they_do_while_they_start(method: str, steps: list[str]) -> None:
    view = Recorder()
    assert notebook_launcher(_rank, args=(0,), num_processes=2, start_method=method,
                             dashboard=view) == [0, 1]  # fmt: skip
    for rank in (0, 1):
        assert _phases(view.events, rank) == steps
    pids = {e.rank: e.pid for e in view.events if isinstance(e, WorkerStarted)}
    assert {e.rank: e.pid for e in view.events if isinstance(e, WorkerPhase)} == pids

    # Replayed into the model, each moment of the start reads as it happened: the dashboard's
    # row and the text view say what the rank did, and how many ranks had joined the group.
    model, seen = LaunchModel(), set()
    for event in view.events:
        model.apply(event)
        if isinstance(event, (WorkerPhase, WorkerStarted)):
            for r in (0, 1):
                row = H.rank_row(model.ranks[r], event.time)
                seen.add(re.search(r"class='nl-status'[^>]*>● ([^<]*)<", row).group(1))  # type: ignore[union-attr]
    expected = {"starting", "joining the process group (1/2 joined)", "running"}
    if method == "spawn":
        expected |= {"importing torch", "loading the function"}
    assert expected <= seen, seen


@pytest.mark.timeout(90)
def test_a_rank_that_dies_while_it_starts_is_said_to_have_died_there() -> None:
    """Rank 1 killed while it imports torch: the error says so, not just "died"."""

    def kill_rank_1(event: Event) -> None:
        if isinstance(event, WorkerPhase) and event.rank == 1 and event.phase == "importing":
            os.kill(event.pid, signal.SIGKILL)

    with pytest.raises(WorkerDied) as caught:
        notebook_launcher(_rank, args=(0,), num_processes=2, start_method="spawn",
                          dashboard=Recorder(kill_rank_1))  # fmt: skip
    assert "rank 1" in str(caught.value) and "SIGKILL" in str(caught.value)
    assert "while importing torch" in str(caught.value), str(caught.value)


@pytest.mark.timeout(30)
def test_the_text_view_says_what_a_slow_start_waits_for() -> None:
    """A terminal shows a start that takes longer than ``interval``: one line per rank and
    interval while it lasts (a fast start prints none)."""
    from notebook_launcher._events import LaunchStarted

    out, now = io.StringIO(), [100.0]
    view = TextView(out, interval=5.0, clock=lambda: now[0])
    view.handle(LaunchStarted(2, 2, 0, 1, "spawn", "asked for", "127.0.0.1", 29500, "gloo",
                              (0, 1), 100.0))  # fmt: skip
    view.handle(WorkerPhase(0, 10, "joining", 101.0))
    view.handle(WorkerPhase(1, 11, "importing", 101.0))
    now[0] = 103.0
    view.tick()
    assert "starting" not in out.getvalue()  # not slow yet
    now[0] = 105.5
    view.tick()
    lines = [line for line in out.getvalue().splitlines() if "starting" in line]
    assert lines == [
        "[rank0] starting 5.5s: joining the process group (1/2 joined)",
        "[rank1] starting 5.5s: importing torch",
    ]
    view.handle(WorkerStarted(0, 0, 10, "cpu", time.time()))
    view.handle(WorkerStarted(1, 1, 11, "cpu", time.time()))
    now[0] = 112.0
    view.tick()
    assert len([line for line in out.getvalue().splitlines() if "starting" in line]) == 2
