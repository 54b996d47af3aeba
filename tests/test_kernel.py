"""Launches from inside a real ipykernel, with the function defined in the kernel's __main__."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .helpers import run_cell, started_kernel

pytestmark = pytest.mark.kernel

jupyter_client = pytest.importorskip("jupyter_client")


@pytest.fixture
def kernel() -> Iterator[object]:
    with started_kernel() as kc:
        yield kc


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_launch_from_a_live_kernel(kernel: object, method: str) -> None:
    out, reply, tb = run_cell(
        kernel,
        f"""
        from notebook_launcher import notebook_launcher

        class Scale:                      # a class defined in a cell travels too
            def __init__(self, k): self.k = k

        def train(x):
            import torch.distributed as dist
            print("hello from", dist.get_rank())
            return Scale(x * (dist.get_rank() + 1)).k

        print("RESULT", notebook_launcher(train, args=(3,), num_processes=2,
                                          start_method={method!r}, dashboard=False))
        """,
    )
    assert reply["status"] == "ok", out
    assert "RESULT [3, 6]" in out
    assert "[rank0] hello from 0" in out and "[rank1] hello from 1" in out
    # Re-running the cell with a new definition ships the new code, never a stale one.
    out, reply, tb = run_cell(
        kernel,
        f"""
        def train(x):
            return "new definition"

        print("RESULT", notebook_launcher(train, args=(3,), num_processes=2,
                                          start_method={method!r}, dashboard=False))
        """,
    )
    assert "RESULT ['new definition', 'new definition']" in out, out
    # A failing rank: the user's exception type, the kernel stays usable.
    out, reply, tb = run_cell(
        kernel,
        f"""
        def bad():
            import os
            if os.environ["RANK"] == "1":
                raise ZeroDivisionError("rank one divides by zero")
        try:
            notebook_launcher(bad, num_processes=2, start_method={method!r}, dashboard=False)
        except ZeroDivisionError as e:
            print("CAUGHT", type(e).__name__, e)
        print("AFTER", notebook_launcher(lambda: 7, num_processes=2,
                                         start_method={method!r}, dashboard=False))
        """,
    )
    assert "CAUGHT ZeroDivisionError rank one divides by zero" in out, out
    assert "AFTER [7, 7]" in out, out


@pytest.mark.timeout(60)
def test_a_reply_to_another_request_is_not_taken_for_the_cells(kernel: object) -> None:
    """A kernel slower than 1 s to answer jupyter_client's first kernel_info_request (a
    loaded machine) gets a second one; its reply waits on the shell channel. The cell's
    own reply is read, not that one, and every later cell keeps its own (issue 26)."""
    kernel.kernel_info()  # type: ignore[attr-defined]  # the second request, its reply unread
    out, reply, tb = run_cell(kernel, "1 / 0")
    assert reply["status"] == "error" and reply["ename"] == "ZeroDivisionError", reply
    out, reply, tb = run_cell(kernel, "print('the next cell')")
    assert reply["status"] == "ok" and out == "the next cell\n", (reply, out)


@pytest.mark.timeout(120)
def test_uncaught_failure_shows_the_rank_traceback(kernel: object) -> None:
    out, reply, tb = run_cell(
        kernel,
        """
        from notebook_launcher import notebook_launcher
        def bad():
            import os
            if os.environ["RANK"] == "1":
                raise ValueError("shown to the user")
        notebook_launcher(bad, num_processes=2, dashboard=False)
        """,
    )
    assert reply["status"] == "error" and reply["ename"] == "ValueError"
    plain = "\n".join(tb)  # the traceback, without IPython's colours
    assert "Cell In[" in plain and "in bad()" in plain  # the rank's frame, as IPython names cells
    assert 'raise ValueError("shown to the user")' in plain
    assert "Raised on rank 1 of 2" in plain
