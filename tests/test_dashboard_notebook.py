"""The dashboard in a real kernel: a notebook executed by nbclient, the saved outputs read back.

``tests/notebooks_for_tests/dashboard.ipynb`` launches 2 ranks (an epoch bar and a nested
step bar each, a ``wait_for_everyone`` per epoch, a printed line and a logged loss per
step); then a launch whose rank 1 raises while rank 0 waits at a barrier; then replays the
events of 24 ranks into a dashboard. What nbclient saves is what GitHub, nbviewer and an
untrusted JupyterLab show later, without a kernel: each dashboard became a static HTML
snapshot, the loss curve a PNG. The comm messages it recorded show the dashboard was live.
"""

from __future__ import annotations

import base64
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

from .helpers import kernel_env

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


def _outputs(nb: Any, cell: int) -> list[Any]:
    return list(nb.cells[cell].outputs)


def _snapshot(nb: Any, cell: int) -> str:
    """The dashboard a saved notebook shows for ``cell``: the live widgets were replaced
    by a static snapshot (``text/html``), with the fixed ``text/plain`` nbval compares."""
    display = _outputs(nb, cell)[0]
    assert display["output_type"] == "display_data"
    assert VIEW_KEY not in display["data"]  # no widget view is left to need a kernel
    assert display["data"]["text/plain"] == "notebook_launcher dashboard"
    return str(display["data"]["text/html"])


def _rows(snap: str) -> dict[int, tuple[str, str, list[tuple[str, str, str]]]]:
    rows = {}
    for m in re.finditer(
        r"<div class='nl-row nl-row-(\d+) ' data-rank='\d+' data-status='(\w+)'", snap
    ):
        end = snap.find("<div class='nl-row ", m.end())
        chunk = snap[m.start() : end if end > 0 else None]
        status = html.unescape(re.search(r"class='nl-status' title='([^']*)'", chunk).group(1))  # type: ignore[union-attr]
        bars = re.findall(
            r"data-desc='([^']*)' data-style='(\w*)'.*?class='nl-fill' style='[^']*width:([\d.]+)%",
            chunk,
        )
        rows[int(m.group(1))] = (m.group(2), status, [(d, st, w) for d, st, w in bars])
    return rows


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
    env = kernel_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_PARENT, env.get("PYTHONPATH")]))
    client.execute(env=env)
    return client, nb


@pytest.mark.timeout(120)
def test_saved_notebook_shows_the_finished_run_without_a_kernel(
    executed: tuple[RecordingClient, Any],
) -> None:
    client, nb = executed
    assert "ALL DONE" in "".join(o.get("text", "") for o in nb.cells[5].outputs)
    snap = _snapshot(nb, 2)
    assert _text(snap).startswith("notebook_launcher · 2 ranks · fork: fast, nothing to pickle")
    assert re.search(r"✔ 2 ranks, [\d.]+s: ok$", _text(snap))
    rows = _rows(snap)
    for rank in (0, 1):
        status, text, bars = rows[rank]
        assert (status, text) == ("done", "done")
        assert bars == [("epoch", "success", "100"), ("step", "success", "100")]
    for index in (0, 1):  # the barrier history: both ranks arrived at both barriers
        assert re.search(rf"#{index}In\[1\]:18wait_for_everyone0, 1-passed \(", _text(snap))
    assert "rank 1 finished epoch 1" in snap and "[rank0] rank 0 finished epoch 1" in snap
    # the loss curve: a PNG output after the dashboard, one line per rank
    (plot,) = [o for o in _outputs(nb, 2)[1:] if "image/png" in o.get("data", {})]
    assert plot["data"]["text/plain"] == "notebook_launcher metrics: loss"
    assert base64.b64decode(plot["data"]["image/png"]).startswith(b"\x89PNG")
    assert len(_outputs(nb, 2)) == 2  # nothing else: no tqdm text, no rank lines


@pytest.mark.timeout(120)
def test_the_dashboard_was_live_while_the_cell_ran(executed: tuple[RecordingClient, Any]) -> None:
    """The rank table's updates arrived spread over the run, with the step bars between
    0% and 100%; the whole dashboard stayed within its message budget."""
    client, nb = executed
    classes: dict[str, set[str]] = {}
    for _cell, _kind, cid, d, _ in client.comm_log:
        classes.setdefault(cid, set()).update(d.get("state", {}).get("_dom_classes", ()))
    ranks_ids = {cid for cid, names in classes.items() if "nl-ranks" in names}
    assert len(ranks_ids) == 3  # one per dashboard
    updates = [
        (cell, d["state"]["value"], date)
        for cell, kind, cid, d, date in client.comm_log
        if cid in ranks_ids and kind == "comm_msg" and "value" in d.get("state", {})
    ]
    first = [(v, date) for cell, v, date in updates if cell == 2]
    widths = {w for v, _ in first for w in re.findall(r"nl-fill' style='[^']*width:([\d.]+)%", v)}
    assert len(widths - {"0", "100"}) >= 3, sorted(widths)
    times = [d if isinstance(d, datetime) else datetime.fromisoformat(str(d)) for _, d in first]
    assert (times[-1] - times[0]).total_seconds() > 1.0  # spread over the run
    per_second: dict[tuple[int, int], int] = {}
    for cell, kind, _cid, _d, date in client.comm_log:
        if kind == "comm_msg":
            t = date if isinstance(date, datetime) else datetime.fromisoformat(str(date))
            key = (cell, int(t.timestamp()))
            per_second[key] = per_second.get(key, 0) + 1
    assert max(per_second.values()) <= 30, per_second  # ~20 a second (+ the final closes)


@pytest.mark.timeout(120)
def test_failed_launch_keeps_the_red_rank_and_its_traceback(
    executed: tuple[RecordingClient, Any],
) -> None:
    client, nb = executed
    snap = _snapshot(nb, 3)
    assert re.search(
        r"✘ 2 ranks, [\d.]+s: failed: rank 1 raised ValueError: rank 1 broke$", _text(snap)
    )
    assert "⚠ rank 1 raised ValueError while rank(s) 0 waited at barrier #0 (In[3]:8)" in _text(
        snap
    )
    rows = _rows(snap)
    assert rows[1] == ("failed", "raised ValueError: rank 1 broke", [("work", "danger", "50")])
    # rank 0 is stopped (grey), or its barrier failed first as fallout of rank 1's end
    status, text, bars = rows[0]
    assert status == "stopped" and bars == [("work", "success", "100")], rows[0]
    assert re.fullmatch(r"stopped: (another rank failed|collateral \w+)", text), text
    assert "#0In[3]:8wait_for_everyone01rank 1 raised ValueError" in _text(snap)
    pane = re.search(r"<details class='nl-pane nl-pane-1' open>(.*?)</details>", snap, re.S)
    assert pane is not None
    tb = _text(pane.group(1))
    assert "Cell In[3], line 6, in broken" in tb and tb.rstrip().endswith(
        "ValueError: rank 1 broke"
    )


@pytest.mark.timeout(120)
def test_many_ranks_snapshot_and_what_nbviewer_renders(
    executed: tuple[RecordingClient, Any],
) -> None:
    client, nb = executed
    snap = _snapshot(nb, 4)
    assert re.search(r"slowest rank 13 \d+% · median \d+% · fastest rank \d+ \d+%", _text(snap))
    assert snap.count("class='nl-cell ") == 24
    assert "<details class='nl-pane nl-pane-7' open>" in snap and "RuntimeError: NaN loss" in snap
    assert len(snap) < 120_000  # a saved notebook stays small
    from nbconvert import HTMLExporter  # what nbviewer runs

    body, _ = HTMLExporter().from_notebook_node(nb)
    assert body.count("nl-snapshot") >= 3 and "image/png;base64" in body
