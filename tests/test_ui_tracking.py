"""``notebook_launcher.log`` and ``Accelerator.log``: what a rank sends for the live plots."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

import notebook_launcher
from notebook_launcher import tracking
from notebook_launcher._events import MetricsLogged
from notebook_launcher._worker import runtime

pytestmark = pytest.mark.unit


class Item:
    """Looks like a one-element tensor (or a numpy scalar) to ``log``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def item(self) -> Any:
        if self.value is None:
            raise ValueError("only one element tensors can be converted to Python scalars")
        return self.value


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    events: list[Any] = []
    monkeypatch.setitem(os.environ, "RANK", "3")
    runtime.install(events.append)
    runtime.run_start_hooks()
    try:
        yield events
    finally:
        runtime.install(None)


def test_log_sends_numbers_and_counts_steps(sent: list[Any]) -> None:
    assert notebook_launcher.log is tracking.log
    tracking.log({"loss": 0.5, "acc": Item(0.9), "epoch": 1, "note": "text", "bad": Item(None)})
    tracking.log({"loss": 0.25})
    tracking.log({"loss": 0.1}, step=10)
    tracking.log({"loss": 0.05})
    tracking.log({"note": "nothing to plot"})
    assert [(e.rank, e.step, e.values) for e in sent] == [
        (3, 0, (("loss", 0.5), ("acc", 0.9), ("epoch", 1.0))),
        (3, 1, (("loss", 0.25),)),
        (3, 10, (("loss", 0.1),)),
        (3, 11, (("loss", 0.05),)),
    ]
    assert all(isinstance(e, MetricsLogged) for e in sent)
    runtime.run_start_hooks()  # a new launch counts from 0 again
    tracking.log({"loss": 1.0})
    assert sent[-1].step == 0


def test_log_outside_a_launched_rank_does_nothing() -> None:
    assert not runtime.active()
    tracking.log({"loss": 0.5})  # no error, nowhere to send it


def test_accelerator_log_feeds_the_same_plots(sent: list[Any]) -> None:
    """One ``accelerator.log`` call: the dashboard's plot and the trackers of ``log_with``."""
    from notebook_launcher.accelerator import Accelerator
    from notebook_launcher.trackers import GeneralTracker

    class Keep(GeneralTracker):
        name = "keep"
        requires_logging_directory = False
        tracker = None
        logged: list[Any] = []

        def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
            self.logged.append((values, step))

    keep = Keep()
    accelerator = Accelerator(log_with=keep)
    accelerator.init_trackers("run")
    accelerator.log({"loss": Item(0.75)}, step=5)
    (event,) = sent
    assert (event.step, event.values) == (5, (("loss", 0.75),))
    assert [(v["loss"].value, s) for v, s in keep.logged] == [(0.75, 5)]
