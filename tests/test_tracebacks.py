"""What a notebook user meets when a rank fails, in a real ipykernel.

* Types defined in a cell (an exception class, a dataclass, an Enum, a nested class)
  come back as the notebook's own classes under fork, forkserver and spawn: ``except``
  catches them, ``isinstance``, ``==`` and ``is`` hold, and their methods stay the
  notebook's.
* An uncaught failure reads like IPython's own traceback of a local error: the cell
  that called the launcher, then the rank's frames named ``Cell In[n], line k`` with
  their source lines, library frames folded, none of the launcher's frames, no
  "remote traceback" header pair; the final error line right after the frame that raised.
* Every rank's traceback is reachable from the exception (``print_traceback``).

The assertions read the ``error`` message's ``traceback`` field: what the front end shows.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator

import pytest

from .helpers import Kept, kept_for, run_cell, started_kernel

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(240)]

jupyter_client = pytest.importorskip("jupyter_client")


@pytest.fixture(scope="module")
def kept() -> Iterator[Kept]:
    kept = Kept(started_kernel)
    yield kept
    kept.drop()


@pytest.fixture
def kernel(kept: Kept, request: pytest.FixtureRequest) -> Iterator[object]:
    """The module's kernel; a new one after a test that failed with it."""
    yield from kept_for(kept, request)


DEFINITIONS = """
    import os
    from dataclasses import dataclass
    from enum import Enum

    from notebook_launcher import notebook_launcher

    class MyError(Exception):
        def hint(self):
            return "mine"

    class Color(Enum):
        RED = 1
        BLUE = 2

    @dataclass
    class Result:
        rank: int
        color: Color

    class Outer:
        class Inner(Exception):
            pass

    HINT = MyError.hint

    def raise_mine():
        if os.environ["RANK"] == "1":
            raise MyError("from a cell")

    def return_results():
        return Result(int(os.environ["RANK"]), Color.BLUE)

    def raise_inner():
        raise Outer.Inner("nested")
"""

IDENTITY = """
    def identity(method):
        try:
            notebook_launcher(raise_mine, num_processes=2, start_method=method, dashboard=False)
        except MyError as exc:
            assert type(exc) is MyError and exc.hint() == "mine", exc
        results = notebook_launcher(
            return_results, num_processes=2, start_method=method, dashboard=False
        )
        assert all(isinstance(r, Result) for r in results), results
        assert results == [Result(0, Color.BLUE), Result(1, Color.BLUE)], results
        assert results[1].color is Color.BLUE
        if method != "spawn":  # (a third spawn launch adds time, not coverage)
            try:
                notebook_launcher(raise_inner, num_processes=2, start_method=method, dashboard=False)
            except Outer.Inner:
                pass
        assert MyError.hint is HINT  # the notebook's own method, not a copy from a rank
        print("IDENTITY", method, "OK")

    for method in ("fork", "forkserver", "spawn"):
        identity(method)
"""


def test_notebook_types_keep_their_identity_in_every_start_method(kernel: object) -> None:
    out, reply, error = run_cell(kernel, DEFINITIONS)
    assert reply["status"] == "ok", error
    out, reply, error = run_cell(kernel, IDENTITY)
    assert reply["status"] == "ok", "\n".join(error)
    for method in ("fork", "forkserver", "spawn"):
        assert f"IDENTITY {method} OK" in out, out
    # Re-running the cell makes new classes: the next launch gives back the new ones.
    out, reply, error = run_cell(kernel, DEFINITIONS)
    out, reply, error = run_cell(kernel, 'identity("fork")\nidentity("forkserver")')
    assert reply["status"] == "ok", "\n".join(error)
    assert "IDENTITY fork OK" in out and "IDENTITY forkserver OK" in out, out


TRAIN = """
    import torch
    import torch.distributed as dist
    from notebook_launcher import notebook_launcher

    def train():
        model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 2)))
        batch = torch.ones(3, 5) if dist.get_rank() == 1 else torch.ones(3, 4)
        return model(batch).sum().item()  # rank 1's batch has the wrong width
"""
#: the line of TRAIN's cell that rank 1 fails on (IPython drops a cell's leading blank lines)
TRAIN_LINE = (
    textwrap.dedent(TRAIN)
    .lstrip("\n")
    .splitlines()
    .index("    return model(batch).sum().item()  # rank 1's batch has the wrong width")
    + 1
)


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_an_uncaught_failure_reads_like_a_local_ipython_traceback(
    kernel: object, method: str
) -> None:
    """Under every start method: forkserver and spawn ship the function with cloudpickle,
    whose newer releases rename the code objects they rebuild (``<dynamic-code>``)."""
    out, reply, error = run_cell(kernel, TRAIN)
    assert reply["status"] == "ok", error
    train_cell = reply["execution_count"]
    out, reply, tb = run_cell(
        kernel,
        f"notebook_launcher(train, num_processes=2, dashboard=False, start_method={method!r})",
    )
    launch_cell = reply["execution_count"]
    text = "\n".join(tb)
    assert reply["status"] == "error" and reply["ename"] == "RuntimeError", text
    # IPython's own header, once; no second exception in front of it
    assert sum("Traceback (most recent call last)" in line for line in tb) == 1, text
    assert "Remote" not in text and "Traceback from rank" not in text
    # the caller's cell, then the rank's frames by cell name, with the source lines
    assert f"Cell In[{launch_cell}], line 1" in text
    rank_frame = f"Cell In[{train_cell}], line {TRAIN_LINE}, in train()"
    assert rank_frame in text, text
    assert "/tmp/ipykernel_" not in text and "<dynamic-code>" not in text
    user_line = next(i for i, line in enumerate(tb) if line.startswith(f"----> {TRAIN_LINE}"))
    assert "model(batch)" in tb[user_line]
    # none of the launcher's frames, none of its machinery
    for noise in ("launcher.py", "group.py", "selectors", "failed resolving", "_worker"):
        assert noise not in text, (noise, text)
    # torch's frames folded; the frame that raised and the error line close to the user's
    assert "[... skipping hidden" in text
    error_line = next(i for i, line in enumerate(tb) if line.startswith("RuntimeError: mat1"))
    assert error_line - user_line <= 16, text
    assert tb[error_line + 1] == "Raised on rank 1 of 2."
    assert len(tb) <= 40, text  # the whole of it fits a screen


def test_every_ranks_traceback_is_reachable_from_the_exception(kernel: object) -> None:
    run_cell(kernel, TRAIN)
    out, reply, error = run_cell(
        kernel,
        """
        try:
            notebook_launcher(train, num_processes=2, dashboard=False)
        except RuntimeError as exc:
            err = exc
        err.launch_failure.print_traceback(1)
        print("RANKS", sorted(err.launch_failure.tracebacks))
        """,
    )
    assert reply["status"] == "ok", error
    assert re.search(rf"Cell In\[\d+\], line {TRAIN_LINE}, in train", out), out
    assert "frames in torch.nn]" in out and "RuntimeError: mat1" in out, out
    assert "RANKS [1]" in out or "RANKS [0, 1]" in out, out


def test_an_error_the_launcher_raises_itself_ends_at_the_callers_line(kernel: object) -> None:
    """A rank that dies has no frames to show: the traceback ends at the cell's call, not
    inside the launcher (IPython always shows the last frame, hidden or not)."""
    run_cell(
        kernel,
        """
        import os, signal
        from notebook_launcher import notebook_launcher

        def killed():
            if os.environ["RANK"] == "1":
                os.kill(os.getpid(), signal.SIGKILL)
            import torch.distributed as dist
            dist.barrier()
        """,
    )
    out, reply, tb = run_cell(kernel, "notebook_launcher(killed, num_processes=2, dashboard=False)")
    text = "\n".join(tb)
    assert reply["ename"] == "WorkerDied", text
    assert "----> 1 notebook_launcher(killed" in text
    for noise in ("launcher.py", "failed resolving", "raise exception_for", "skipping hidden"):
        assert noise not in text, (noise, text)
    assert any(line.startswith("WorkerDied: rank 1 of 2 died") for line in tb), text


#: Errors of the user's own making, raised by the launcher in the kernel (issue 33, item
#: 6): (the cell, the error's type, how its sentence starts).
USERS_ERRORS = [
    (
        "notebook_launcher(print, num_processes=2, devices=[0])",
        "PreflightError",
        "devices=[0] names GPU(s) [0]",
    ),
    (
        "def go():\n    return notebook_launcher(print, num_processes=0)\ngo()",
        "PreflightError",
        "num_processes must be at least 1",
    ),
    (
        "import threading\n"
        "notebook_launcher(print, args=(threading.Lock(),), num_processes=2, start_method='spawn')",
        "SerializationError",
        "Cannot pickle the launched function and its args[1][0]",
    ),
    ("notebook_launcher.attach('nosuch')", "RunNotFound", "no run 'nosuch'"),
    ("%load_ext notebook_launcher\n%dist start -n 2 --devices 7", "PreflightError", "devices=[7]"),
    (
        "from notebook_launcher import SlurmCluster\nSlurmCluster(nodes=0)",
        "ValueError",
        "nodes must be a positive int",
    ),
]


@pytest.mark.parametrize(("cell", "ename", "said"), USERS_ERRORS)
def test_an_error_of_the_users_shows_their_line_and_the_sentence(
    kernel: object, cell: str, ename: str, said: str
) -> None:
    """The user's frames down to the line that called the launcher, then the sentence: not
    the ~25 lines of the launcher's own source that came between, nor the exception it
    was raised from (a SerializationError's message quotes cloudpickle's)."""
    run_cell(kernel, "from notebook_launcher import notebook_launcher")
    out, reply, tb = run_cell(kernel, cell)
    text = "\n".join(tb)
    assert reply["status"] == "error" and reply["ename"] == ename, text
    last = len(cell.splitlines())
    assert any(line.startswith(f"----> {last} ") for line in tb), text  # the cell's call
    assert tb[-1].startswith(f"{ename}: {said}"), text
    for noise in ("File ", "skipping hidden", "The above exception", "raise "):
        assert noise not in text, (noise, text)
    assert len(tb) <= 12, text


def test_a_plain_python_traceback_keeps_the_launchers_frames(tmp_path: object) -> None:
    """Outside IPython nothing is cut: the frame that refused, for whoever debugs it."""
    import subprocess
    import sys

    from .helpers import ROOT, kernel_env

    done = subprocess.run(
        [sys.executable, "-c", "from notebook_launcher import notebook_launcher\n"
         "notebook_launcher(print, num_processes=2, devices=[0])"],
        env={**kernel_env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert "notebook_launcher.errors.PreflightError: devices=[0]" in done.stderr, done.stderr
    assert "_placement.py" in done.stderr and "plan.py" in done.stderr, done.stderr
