"""The stall view in a real ipykernel's dashboard (issue 19), driven over jupyter_client.

A launch whose rank 1 sleeps while rank 0 waits in a barrier: the live dashboard's stall
widget names rank 1 and the cell's line (``Cell In[n], line 4``), then empties once the
stall resolves. A session cell that stalls: the dashboard shows it, the notebook's interrupt
says where each rank was (a note on the ``KeyboardInterrupt``), the session lives on,
``%dist stacks`` says every rank is idle, and ``%rankdiff`` compares a value.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from .helpers import Kept, kept_for
from .test_session_kernel import Kernel

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(120)]


@contextmanager
def extension_kernel() -> Iterator[Kernel]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    k = Kernel(env)
    try:
        assert k.execute("%load_ext notebook_launcher").status == "ok"
        yield k
    finally:
        k.shutdown()


@pytest.fixture(scope="module")
def kept() -> Iterator[Kept]:
    kept = Kept(extension_kernel)
    yield kept
    kept.drop()


@pytest.fixture
def kernel(kept: Kept, request: pytest.FixtureRequest) -> Iterator[Kernel]:
    """The module's kernel; a new one after a test that failed with it."""
    yield from kept_for(kept, request)


def widget_values(kernel: Kernel, msg_id: str) -> list[str]:
    """Every HTML value a widget of this cell was given, in order (live updates)."""
    out = []
    for msg in kernel.by_parent[msg_id]:
        if msg["msg_type"] == "comm_msg":
            state = msg["content"].get("data", {}).get("state", {})
            if isinstance(state.get("value"), str):
                out.append(state["value"])
    return out


def ran(kernel: Kernel, code: str) -> tuple[str, int]:
    """The msg id of the cell that ran ``code``, and its number (``In[n]``)."""
    for msg_id, msgs in kernel.by_parent.items():
        for msg in msgs:
            if msg["msg_type"] == "execute_input" and msg["content"]["code"] == code:
                return msg_id, int(msg["content"]["execution_count"])
    raise AssertionError(f"no cell ran {code!r}")


def test_a_launchs_dashboard_shows_the_stall_then_lets_it_go(kernel: Kernel) -> None:
    code = (
        "from notebook_launcher import notebook_launcher\n"
        "def train():\n"
        "    import time, torch.distributed as dist\n"
        "    if dist.get_rank() == 1:\n"
        "        time.sleep(4)\n"
        "    dist.barrier()\n"
        "    return dist.get_rank()\n"
        "notebook_launcher(train, num_processes=2, stall_after=1.0)"
    )
    reply = kernel.execute(code)
    assert reply.status == "ok" and reply.result == "[0, 1]", reply
    msg_id, n = ran(kernel, code)
    values = widget_values(kernel, msg_id)
    stalls = [v for v in values if "nl-stall'" in v]
    assert stalls, "the dashboard never showed the stall view"
    finding = (
        f"rank 1 is in `time.sleep(4)` at Cell In[{n}], line 5; rank 0 waits in `barrier` at line 6"
    )
    assert finding in stalls[0], stalls[0][:2000]
    assert "nl-stall-odd' data-ranks='1'" in stalls[0]
    last = values.index(stalls[-1])
    assert "" in values[last:], "the stall view did not go away"
    snapshot = [m for m in kernel.by_parent[msg_id] if m["msg_type"] == "update_display_data"][-1][
        "content"
    ]["data"]["text/html"]
    assert "nl-stall'" not in snapshot  # it resolved: the saved dashboard shows no stall


def test_a_stalled_session_cell_the_interrupt_and_the_session_after(kernel: Kernel) -> None:
    started = kernel.execute("%dist start -n 2 --stall-after 1")
    assert started.status == "ok" and "session: ready, 2 ranks" in started.result, started
    try:
        kernel.execute("%%distributed\nkept = rank + 1")
        code = "%%distributed\nimport time\nif rank == 1:\n    time.sleep(60)\ndist.barrier()"
        out = kernel.execute(code, interrupt_after=6.0)
        assert (out.status, out.ename) == ("error", "KeyboardInterrupt"), out
        msg_id, n = ran(kernel, code)
        finding = (
            f"rank 1 is in `time.sleep(60)` at Cell In[{n}], line 4; rank 0 waits in `barrier` "
            "at line 5"  # as the editor counts: %%distributed is line 1
        )
        values = widget_values(kernel, msg_id)
        assert any(finding in v for v in values), "no live stall view"
        # then the box says where each rank was when interrupted, as a launch's does
        assert any("where each rank was when it was interrupted:" in v for v in values)
        assert "where each rank was when it was interrupted:" in out.text
        assert finding in out.text
        assert "session: ready" in kernel.execute("%dist status").result
        assert kernel.execute("%%distributed\nkept").result == "[rank0] 1\n[rank1] 2"
        idle = kernel.execute("%dist stacks")
        assert idle.status == "ok" and idle.result == "every rank is idle (waits for the next task)"
        # (one quiet line, in the notebook too: no stall box, no frame of our machinery)
        html = [m for m in kernel.by_parent[ran(kernel, "%dist stacks")[0]]
                if m["msg_type"] == "execute_result"][-1]["content"]["data"]["text/html"]  # fmt: skip
        assert "nl-stall-idle" in html and "multiprocessing" not in html, html
        kernel.execute("%%distributed\nw = torch.ones(2) * (1 + (rank == 1))")
        diff = kernel.execute("%rankdiff w kept")
        assert diff.status == "ok", diff
        assert re.search(
            r"the value \(float32 \[2\]\): rank 1 differs from rank 0 in 2 of 2", diff.result
        )
        assert "kept: ranks differ in 1 of 1 entries" in diff.result
        code = "%%distributed\nt = torch.ones(4)\ndist.all_reduce(t) if rank == 0 else dist.broadcast(t, 0)"
        mismatch = kernel.execute(code)
        assert mismatch.ename == "DistributedOperationException", mismatch
        _, n = ran(kernel, code)
        assert f"Called at:\n  - Process 0: Cell In[{n}], line 3\n" in mismatch.text, mismatch.text
    finally:
        kernel.execute("%dist stop")
