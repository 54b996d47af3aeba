"""The dashboard in a real kernel: a notebook executed by nbclient, its saved widget state read back.

``tests/notebooks_for_tests/dashboard.ipynb`` launches 2 ranks, each with an epoch bar and a
nested step bar (``from tqdm.auto import tqdm``) and a ``wait_for_everyone`` per epoch; then
a launch whose rank 1 raises while rank 0 waits at a barrier. The widget state nbclient
stores in the notebook's metadata is what a front end would show after the run; the comm
messages it recorded show the bars moved while the cell ran.
"""

from __future__ import annotations

import html
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

import notebook_launcher

pytestmark = pytest.mark.notebook

HERE = Path(__file__).resolve().parent
NOTEBOOK = HERE / "notebooks_for_tests" / "dashboard.ipynb"
PACKAGE_PARENT = str(Path(notebook_launcher.__file__).resolve().parents[1])
STATE_KEY = "application/vnd.jupyter.widget-state+json"
VIEW_KEY = "application/vnd.jupyter.widget-view+json"


class RecordingClient(NotebookClient):
    """Keeps every comm message, in arrival order, with the kernel's timestamp."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.comm_log: list[tuple[int, str, str, dict[str, Any], Any]] = []

    def handle_comm_msg(self, outs: Any, msg: dict[str, Any], cell_index: int) -> None:
        c = msg["content"]
        self.comm_log.append(
            (
                cell_index,
                msg["msg_type"],
                c.get("comm_id"),
                c.get("data", {}),
                msg["header"]["date"],
            )
        )
        super().handle_comm_msg(outs, msg, cell_index)


def _text(value: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", value))


def _dashboard(nb: Any, cell: int) -> tuple[dict[str, Any], list[str]]:
    """(widget states by model id, the dashboard's six parts) of the dashboard ``cell`` shows."""
    state = {k: v["state"] for k, v in nb.metadata["widgets"][STATE_KEY]["state"].items()}
    (display,) = nb.cells[cell].outputs  # the dashboard and nothing else: no tqdm, no rank lines
    assert display["output_type"] == "display_data"
    # what nbval compares, and viewers without widgets show: one fixed line
    assert display["data"]["text/plain"] == "notebook_launcher dashboard"
    return state, _kids(state, display["data"][VIEW_KEY]["model_id"])


def _kids(state: dict[str, Any], model_id: str) -> list[str]:
    return [c.removeprefix("IPY_MODEL_") for c in state[model_id].get("children", [])]


@pytest.fixture(scope="module")
def executed() -> tuple[RecordingClient, Any]:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = RecordingClient(
        nb,
        timeout=90,
        kernel_name="python3",
        resources={"metadata": {"path": str(HERE)}},
        store_widget_state=True,
    )
    # no PYTEST_CURRENT_TEST in the kernel's env (shared/TESTING.md, pitfall 1)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_PARENT, env.get("PYTHONPATH")]))
    client.execute(env=env)
    return client, nb


@pytest.mark.timeout(120)
def test_saved_widget_state_shows_both_bars_of_both_ranks_done(
    executed: tuple[RecordingClient, Any],
) -> None:
    client, nb = executed
    assert "ALL DONE" in "".join(o.get("text", "") for o in nb.cells[4].outputs)
    state, (header, alerts, ranks_box, barriers, tabs, summary) = _dashboard(nb, 2)

    def kids(model_id: str) -> list[str]:
        return _kids(state, model_id)

    assert _text(state[header]["value"]).startswith(
        "notebook_launcher · 2 ranks · fork · gloo · finished in "
    )
    assert re.fullmatch(r"✔ 2 ranks, [\d.]+s: ok", _text(state[summary]["value"]))
    assert _text(state[alerts]["value"]) == ""

    rows = kids(ranks_box)
    assert len(rows) == 2
    for rank, row in enumerate(rows):
        info, bars_box = kids(row)
        assert re.fullmatch(
            rf"rank {rank} · pid \d+ · cpu● done · [\d.]+s", _text(state[info]["value"])
        )
        shown = []
        for bar_row in kids(bars_box):
            progress, stats = kids(bar_row)
            p = state[progress]
            shown.append((p["description"], p["value"], p["max"], p["bar_style"]))
            assert re.match(
                r"(2/2|20/20) \[100%\] [\d.]+(it/s|s/it) in [\d.]+s", _text(state[stats]["value"])
            )
        assert shown == [("epoch", 2.0, 2.0, "success"), ("↳ step", 20.0, 20.0, "success")]

    # the barrier history: two wait_for_everyone calls, both ranks arrived, both passed
    table = _text(state[barriers]["value"])
    for index in (0, 1):
        assert re.search(rf"#{index}In\[1\]:14wait_for_everyone0, 1-passed \(", table), table

    t = state[tabs]
    assert t["titles"] == ["all ranks", "rank 0", "rank 1"] and t["selected_index"] == 0
    panes = [_text(state[p]["value"]) for p in kids(tabs)]
    for rank in (0, 1):
        assert panes[1 + rank] == f"rank {rank} finished epoch 0\nrank {rank} finished epoch 1"
        assert f"[rank{rank}] rank {rank} finished epoch 1" in panes[0]


@pytest.mark.timeout(120)
def test_bars_moved_while_the_cell_ran(executed: tuple[RecordingClient, Any]) -> None:
    client, nb = executed
    state = nb.metadata["widgets"][STATE_KEY]["state"]
    steps = {
        mid
        for mid, m in state.items()
        if m["model_name"] == "FloatProgressModel" and m["state"]["description"] == "↳ step"
    }
    assert len(steps) == 2
    for mid in steps:
        updates = [
            (data["state"]["value"], date)
            for cell, kind, cid, data, date in client.comm_log
            if cid == mid and kind == "comm_msg" and "value" in data.get("state", {})
        ]
        assert {cell for cell, _, cid, _, _ in client.comm_log if cid == mid} == {2}
        values = [v for v, _ in updates]
        partial = [v for v in values if 0 < v < 20]
        assert len(set(partial)) >= 3, values  # intermediate states were sent, not only the end
        times = [
            d if isinstance(d, datetime) else datetime.fromisoformat(str(d)) for _, d in updates
        ]
        assert (times[-1] - times[0]).total_seconds() > 0.5  # spread over the run, not one burst


@pytest.mark.timeout(120)
def test_failed_launch_turns_red_and_opens_the_failing_rank(
    executed: tuple[RecordingClient, Any],
) -> None:
    client, nb = executed
    state, (header, alerts, ranks_box, barriers, tabs, summary) = _dashboard(nb, 3)
    assert re.fullmatch(
        r"✘ 2 ranks, [\d.]+s: failed: rank 1 raised ValueError: rank 1 broke",
        _text(state[summary]["value"]),
    )
    assert re.fullmatch(
        r"⚠ rank 1 raised ValueError while rank\(s\) 0 waited at barrier #0 \(In\[3\]:8\)",
        _text(state[alerts]["value"]),
    )
    bars = {}
    infos = {}
    for rank, row in enumerate(_kids(state, ranks_box)):
        info, bars_box = _kids(state, row)
        infos[rank] = _text(state[info]["value"])
        ((progress, _stats),) = [_kids(state, b) for b in _kids(state, bars_box)]
        p = state[progress]
        bars[rank] = (p["description"], p["value"], p["max"], p["bar_style"])
    assert bars == {0: ("work", 20.0, 20.0, "success"), 1: ("work", 10.0, 20.0, "danger")}
    # rank 0 is stopped, or its barrier fails first as fallout of rank 1's end
    assert re.search(r"● (stopped: another rank failed|raised \w+ \(collateral\))", infos[0])
    assert "● raised ValueError: rank 1 broke" in infos[1]
    table = _text(state[barriers]["value"])
    assert "#0In[3]:8wait_for_everyone01rank 1 raised ValueError" in table
    t = state[tabs]
    assert t["titles"][t["selected_index"]] == "rank 1"  # the failing rank's pane opened
    pane = _text(state[_kids(state, tabs)[2]]["value"])
    assert "Cell In[3], line 6, in broken" in pane and pane.endswith("ValueError: rank 1 broke")
