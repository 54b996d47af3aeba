"""The widget view against a stub comm: what a front end would hold after the messages."""

from __future__ import annotations

import html
import io
import json
import re
import sys
from collections.abc import Iterator
from typing import Any

import comm
import pytest
from comm.base_comm import BaseComm

from notebook_launcher._events import BarrierEnter, Event, WorkerStarted
from notebook_launcher.ui import NullView, SafeView, TextView, _text_fallback, create_view, view_for
from notebook_launcher.ui.widgets import WidgetView

from .test_ui_model import T0, bar, script, started

pytestmark = pytest.mark.unit

Log = list[tuple[str, str, dict[str, Any]]]


class RecordingComm(BaseComm):
    """A comm that keeps every message the kernel side would publish."""

    log: Log = []

    def publish_msg(
        self,
        msg_type: str,
        data: Any = None,
        metadata: Any = None,
        buffers: Any = None,
        **keys: Any,
    ) -> None:
        self.log.append((msg_type, self.comm_id, json.loads(json.dumps(data or {}))))


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> Iterator[Log]:
    messages: Log = []
    monkeypatch.setattr(RecordingComm, "log", messages)
    monkeypatch.setattr(comm, "create_comm", RecordingComm)
    yield messages


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def frontend(log: Log) -> dict[str, dict[str, Any]]:
    """Fold comm_open/update messages into model states, like a front end does."""
    state: dict[str, dict[str, Any]] = {}
    for msg_type, cid, data in log:
        if msg_type == "comm_open":
            state[cid] = dict(data["state"])
        elif msg_type == "comm_msg" and data.get("method") == "update":
            state[cid].update(data["state"])
    return state


def kids(state: dict[str, dict[str, Any]], model_id: str) -> list[str]:
    return [c.removeprefix("IPY_MODEL_") for c in state[model_id].get("children", [])]


def text(value: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", value))


def run(events: list[Event], clock: Clock | None = None, **kw: Any) -> WidgetView:
    clock = clock or Clock()
    view = WidgetView(display=False, clock=clock, **kw)
    for e in events:
        clock.t = max(clock.t, e.time)
        view.handle(e)
    view.close()
    return view


def dashboard(state: dict[str, dict[str, Any]], view: WidgetView) -> dict[str, Any]:
    """Read the dashboard back from the front-end state alone (not from the view's objects)."""
    header, alerts, ranks_box, barriers, tabs, summary = kids(state, view.root.model_id)
    rows = {}
    for row in kids(state, ranks_box):
        info, bars_box = kids(state, row)
        rank = int(re.search(r"nl-rank-(\d+)", " ".join(state[row]["_dom_classes"])).group(1))  # type: ignore[union-attr]
        bars = []
        for bar_row in kids(state, bars_box):
            progress, stats = kids(state, bar_row)
            p = state[progress]
            bars.append(
                (
                    p["description"],
                    p["value"],
                    p["max"],
                    p["bar_style"],
                    text(state[stats]["value"]),
                )
            )
        rows[rank] = {"info": text(state[info]["value"]), "bars": bars}
    t = state[tabs]
    return {
        "header": text(state[header]["value"]),
        "alerts": text(state[alerts]["value"]),
        "barriers": text(state[barriers]["value"]),
        "summary": text(state[summary]["value"]),
        "summary_html": state[summary]["value"],
        "rows": rows,
        "titles": t["titles"],
        "selected": t["selected_index"],
        "panes": [text(state[p]["value"]) for p in kids(state, tabs)],
    }


def test_successful_run_as_the_front_end_sees_it(log: Log) -> None:
    view = run(script(2))
    d = dashboard(frontend(log), view)
    assert d["header"] == "notebook_launcher · 2 ranks · fork · gloo · finished in 10.0s"
    assert d["summary"] == "✔ 2 ranks, 10.0s: ok" and "#2e7d32" in d["summary_html"]
    for r in (0, 1):
        row = d["rows"][r]
        assert row["info"] == f"rank {r} · pid {100 + r} · cpu● done · {fmt(7 + 2 - 0.1)}"
        assert row["bars"] == [
            ("epoch", 3.0, 3.0, "success", "3/3 [100%] 1.0it/s in 3.0s"),
            ("↳ step", 30.0, 30.0, "success", "30/30 [100%] ?it/s in 0.0s"),
        ]
    assert d["barriers"].startswith("barriers#wherekindarrivedmissingstate")
    assert "#0train.py:12wait_for_everyone0, 1-passed (" in d["barriers"]
    assert d["alerts"] == ""
    assert d["titles"] == ["all ranks", "rank 0", "rank 1"] and d["selected"] == 0
    assert d["panes"] == [
        "[rank0] hello from 0\n[rank1] hello from 1",
        "hello from 0",
        "hello from 1",
    ]


def fmt(seconds: float) -> str:
    return f"{seconds:.1f}s"


def test_failed_run_opens_the_failing_rank_and_names_it(log: Log) -> None:
    view = run(script(2, fail_rank=1))
    d = dashboard(frontend(log), view)
    assert d["summary"] == "✘ 2 ranks, 10.0s: failed: rank 1 raised ValueError: boom"
    assert "#c62828" in d["summary_html"]
    assert d["selected"] == 2 and d["titles"][2] == "rank 1"
    assert (
        d["alerts"]
        == "⚠ rank 1 raised ValueError while rank(s) 0 waited at barrier #0 (train.py:12)"
    )
    assert "rank 1 raised ValueError" in d["barriers"] and "-1" not in d["barriers"]
    assert "● raised ValueError: boom" in d["rows"][1]["info"]
    assert "● stopped: rank 1 failed" in d["rows"][0]["info"]
    assert d["panes"][2] == "hello from 1\nTraceback:\nValueError: boom"
    # complete bars stay green even on the failed rank
    assert {b[3] for r in (0, 1) for b in d["rows"][r]["bars"]} == {"success"}


def test_updates_are_coalesced_and_sent_in_one_message(log: Log) -> None:
    clock = Clock()
    view = WidgetView(display=False, clock=clock, min_interval=0.1)
    view.handle(started(1))
    view.handle(WorkerStarted(rank=0, local_rank=0, pid=1, device="cpu", time=T0))
    for i in range(1000):  # 1000 updates over 1 s of (fake) time
        clock.t = T0 + i / 1000
        view.handle(bar(0, 0, i, 1000, i / 1000, desc="step"))
    progress = view.rows[0].bars[0].progress
    updates = [d["state"] for t, cid, d in log if cid == progress.model_id and t == "comm_msg"]
    assert 5 <= len(updates) <= 12, len(updates)  # ~10 redraws per second, not 1000
    # hold_sync: the first redraw set description, max and value in one message; later
    # ones only what changed (traitlets sends no unchanged keys)
    assert {"description", "max", "value"} <= set(updates[0])
    assert all(set(u) == {"value"} for u in updates[1:])
    values = [u["value"] for u in updates if "value" in u]
    assert values == sorted(values) and values[-1] >= 900
    view.close()
    assert frontend(log)[progress.model_id]["value"] == 999  # close draws the last state


def test_tick_advances_waiting_time_and_elapsed(log: Log) -> None:
    clock = Clock()
    view = WidgetView(display=False, clock=clock)
    for e in [
        started(2),
        *[WorkerStarted(rank=r, local_rank=r, pid=r, device="cpu", time=T0) for r in (0, 1)],
    ]:
        view.handle(e)
    view.handle(
        BarrierEnter(rank=0, index=0, location="nb.py:3", kind="wait_for_everyone", time=T0)
    )
    clock.t = T0 + 3
    view.tick()
    d = dashboard(frontend(log), view)
    assert d["rows"][0]["info"].endswith("● waiting at nb.py:3 for 3.0s · 3.0s")
    assert d["rows"][1]["info"].endswith("● running · 3.0s")
    assert d["header"].endswith("running 3.0s")
    assert "#0nb.py:3wait_for_everyone01waiting 3.0s" in d["barriers"]
    clock.t = T0 + 75
    view.tick()
    d = dashboard(frontend(log), view)
    assert "waiting at nb.py:3 for 1:15" in d["rows"][0]["info"] and "waiting 1:15" in d["barriers"]


def test_output_panes_are_bounded_and_refreshed_at_most_four_times_a_second(log: Log) -> None:
    from notebook_launcher._events import Output

    clock = Clock()
    view = WidgetView(display=False, clock=clock, output_interval=0.25)
    view.model.max_lines_per_rank = 50
    view.handle(started(1))
    for i in range(300):  # 300 lines in 1.5 s
        clock.t = T0 + i * 0.005
        view.handle(
            Output(rank=0, stream="stderr" if i % 2 else "stdout", text=f"<{i}>\n", time=clock.t)
        )
    view.close()
    pane = view.panes[0]
    sends = [d for t, cid, d in log if cid == pane.model_id and t == "comm_msg"]
    assert len(sends) <= 8, len(sends)
    shown = text(frontend(log)[pane.model_id]["value"])
    assert shown.splitlines()[0] == "[250 earlier line(s) dropped]"
    assert shown.splitlines()[1:] == [f"<{i}>" for i in range(250, 300)]  # escaped, in order
    assert "color:#c62828'>&lt;251&gt;" in frontend(log)[pane.model_id]["value"]  # stderr in red


def test_several_nodes_get_headings(log: Log) -> None:
    view = run([started(2, num_nodes=2, node_rank=1, ranks=(2, 3))])
    state = frontend(log)
    _, _, ranks_box, *_ = kids(state, view.root.model_id)
    first = kids(state, ranks_box)[0]
    assert text(state[first]["value"]) == "node 1"
    assert "node 1 of 2" in text(state[kids(state, view.root.model_id)[0]]["value"])


def test_create_view_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = io.StringIO()
    auto = create_view("auto", buf)  # no kernel here: text
    assert isinstance(auto, TextView) and auto.progress and auto.stream is buf
    quiet = create_view(False, buf)
    assert isinstance(quiet, TextView) and not quiet.progress
    assert isinstance(create_view("text"), TextView)
    assert isinstance(create_view(True), TextView)  # no IPython shell to show widgets in
    with pytest.raises(ValueError, match="dashboard must be"):
        create_view("fancy")

    class Kernel:
        pass

    class ZMQInteractiveShell:  # what a notebook kernel's shell looks like from here
        kernel = Kernel()

    class TerminalInteractiveShell:
        kernel = None

    shells: list[object] = [ZMQInteractiveShell()]
    fake_ipython = type(sys)("IPython")
    fake_ipython.get_ipython = lambda: shells[0]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", fake_ipython)
    import notebook_launcher.ui.widgets as widgets_module

    shown: list[object] = []
    monkeypatch.setattr(widgets_module, "WidgetView", lambda: shown.append(1) or NullView())
    view = create_view("auto")
    assert isinstance(view, SafeView) and shown == [1]  # a notebook kernel: widgets
    shells[0] = TerminalInteractiveShell()
    assert isinstance(create_view("auto"), TextView)
    assert isinstance(create_view(True), TextView)  # no kernel: nowhere to draw widgets
    shells[0] = ZMQInteractiveShell()
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # ipywidgets missing: still a view
    assert isinstance(create_view(True, buf), TextView)
    assert isinstance(create_view("auto", buf), TextView)


def test_a_broken_widget_view_falls_back_to_text(capsys: pytest.CaptureFixture[str]) -> None:
    class Broken(NullView):
        model = None

        def handle(self, event: Event) -> None:
            raise RuntimeError("comm went away")

    buf = io.StringIO()
    safe = SafeView(Broken(), _text_fallback(buf))
    safe.handle(started(1))
    from notebook_launcher._events import Output

    safe.handle(Output(rank=0, stream="stdout", text="still shown\n", time=T0))
    safe.close()
    err = capsys.readouterr().err
    assert "the view Broken failed (RuntimeError('comm went away')); using TextView" in err
    assert buf.getvalue() == "[rank0] still shown\n"


@pytest.mark.parametrize("method", ["handle", "tick", "close"])
def test_a_custom_view_that_raises_anywhere_is_switched_off(
    method: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's own view (``dashboard=obj``) may fail in any of its three methods: the
    launch goes on without it, and says so once."""
    calls: list[str] = []

    class Flaky:
        def handle(self, event: Event) -> None:
            calls.append("handle")
            if method == "handle":
                raise ValueError("bad view")

        def tick(self) -> None:
            calls.append("tick")
            if method == "tick":
                raise ValueError("bad view")

        def close(self) -> None:
            calls.append("close")
            if method == "close":
                raise ValueError("bad view")

    view = view_for(Flaky())
    for _ in range(2):
        view.handle(started(1))
        view.tick()
    view.close()
    assert calls.count(method) == 1  # called until it failed, never again
    err = capsys.readouterr().err
    assert err.count("the view Flaky failed (ValueError('bad view')); continuing without it") == 1
