"""The session magics in a real ipykernel (issue 11), driven over jupyter_client.

``%dist start``, ``%%distributed``, ``%%rank``, ``--ranks``, ``%dist auto``, ``%dist
pull/push``, ``%dist restart``; a failing cell and the notebook's interrupt
(``km.interrupt_kernel()``: SIGINT to the kernel's process group) keep the session; a
killed rank, then ``%dist restart``; a kernel shut down or killed leaves no rank; and a
non-blocking run's output stays with the cell that started it (every iopub message of
it carries that cell's msg id).
"""

from __future__ import annotations

import os
import re
import textwrap
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .helpers import Kept, kept_for, shell_reply

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(60)]

jupyter_client = pytest.importorskip("jupyter_client")

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Reply:
    status: str
    ename: str = ""
    evalue: str = ""
    text: str = ""  # streams and the traceback, without colours
    results: list[str] = field(default_factory=list)  # text/plain of execute_result

    @property
    def result(self) -> str:
        return self.results[-1] if self.results else ""


class Kernel:
    """A kernel and every iopub message it sent, by the msg id of the cell it names."""

    def __init__(self, env: dict[str, str]) -> None:
        self.km, self.kc = jupyter_client.manager.start_new_kernel(
            kernel_name="python3", env={**env, "PYTHONPATH": str(ROOT)}, cwd=str(ROOT)
        )
        self.by_parent: dict[str, list[dict]] = defaultdict(list)

    def execute(self, code: str, interrupt_after: float | list[float] | None = None) -> Reply:
        """Run a cell; ``interrupt_after``: the notebook's interrupt (SIGINT to the kernel's
        process group), that many seconds after the cell was sent (a list: one press each,
        those the cell does not outlast are not pressed)."""
        msg_id = self.kc.execute(textwrap.dedent(code))
        sent = time.monotonic()
        if interrupt_after is None:
            presses = []
        elif isinstance(interrupt_after, list):
            presses = list(interrupt_after)
        else:
            presses = [interrupt_after]
        self.pressed = 0
        while True:
            if presses and time.monotonic() - sent >= presses[0]:
                self.km.interrupt_kernel()
                presses.pop(0)
                self.pressed += 1
            try:
                msg = self.kc.get_iopub_msg(timeout=0.01 if presses else 30)
            except Exception:  # noqa: BLE001 - queue.Empty: nothing yet
                continue
            self.by_parent[msg["parent_header"].get("msg_id", "")].append(msg)
            if (
                msg["parent_header"].get("msg_id") == msg_id
                and msg["msg_type"] == "status"
                and msg["content"]["execution_state"] == "idle"
            ):
                break
        # (skips the replies of cells sent without waiting, and of a second kernel_info)
        return self.reply(msg_id, shell_reply(self.kc, msg_id, timeout=30)["content"])

    def reply(self, msg_id: str, content: dict) -> Reply:
        text, results = [], []
        for msg in self.by_parent[msg_id]:
            kind, c = msg["msg_type"], msg["content"]
            if kind == "stream":
                text.append(c["text"])
            elif kind == "error":
                text.append("\n".join(c["traceback"]))
            elif kind == "execute_result":
                results.append(c["data"].get("text/plain", ""))
        return Reply(
            content["status"],
            content.get("ename", ""),
            content.get("evalue", ""),
            ANSI.sub("", "".join(text)),
            results,
        )

    def drain(self, seconds: float) -> None:
        """Collect what arrives for ``seconds`` (a background run's late messages)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.05)
            except Exception:  # noqa: BLE001 - queue.Empty
                continue
            self.by_parent[msg["parent_header"].get("msg_id", "")].append(msg)

    def shutdown(self, now: bool = True) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=now)


def rank_pids(kernel: Kernel) -> list[int]:
    status = kernel.execute("%dist status").result
    return [int(p) for p in re.search(r"pids \[([\d, ]+)\]", status).group(1).split(", ")]


def gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1][0] != "Z":
                    return False
        except OSError:
            continue
    return True


def wait_gone(pids: list[int], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return gone(pids)


@contextmanager
def session_kernel() -> Iterator[Kernel]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    k = Kernel(env)
    try:
        assert k.execute("%load_ext notebook_launcher").status == "ok"
        started = k.execute("%dist start -n 2")
        assert started.status == "ok" and "session: ready, 2 ranks" in started.result, started
        yield k
    finally:
        k.shutdown()


@pytest.fixture(scope="module")
def kept() -> Iterator[Kept]:
    kept = Kept(session_kernel)
    yield kept
    kept.drop()


@pytest.fixture
def kernel(kept: Kept, request: pytest.FixtureRequest) -> Iterator[Kernel]:
    """The module's kernel and session; a new one after a test that failed with it."""
    yield from kept_for(kept, request)


def test_cells_run_on_the_ranks_and_their_variables_stay(kernel: Kernel) -> None:
    out = kernel.execute("%%distributed\nx = rank * 10\nprint('hello from', rank)\nx")
    assert out.status == "ok"
    assert "[rank0] hello from 0" in out.text and "[rank1] hello from 1" in out.text
    assert out.result == "[rank0] 0\n[rank1] 10"
    assert kernel.execute("%%distributed\nx + world_size").result == "[rank0] 2\n[rank1] 12"
    assert kernel.execute("%%rank 1\ny = x + 5\ny").result == "[rank1] 15"
    assert kernel.execute("%%distributed --ranks 0\n'y' in dir()").result == "[rank0] False"
    assert kernel.execute("%dist pull x\nx").result == "[0, 10]"  # bound here, per rank
    assert kernel.execute("lr = 0.25\n%dist push lr").status == "ok"
    assert kernel.execute("%%distributed\nlr * (rank + 1)").result == "[rank0] 0.25\n[rank1] 0.5"
    assert kernel.execute("%%distributed\nz = 1").results == []  # no value: nothing shown


def test_a_failing_cell_keeps_the_session(kernel: Kernel) -> None:
    kernel.execute("%%distributed\nkept = rank + 1")
    out = kernel.execute(
        "%%distributed\ndef step(batch):\n    if rank == 1:\n        raise ValueError(f'bad {batch}')\nstep(7)"
    )
    assert (out.status, out.ename, out.evalue) == ("error", "ValueError", "bad 7")
    # the lines the editor shows: %%distributed is line 1
    assert re.search(r"Cell In\[\d+\], line 4, in step\(\)", out.text), out.text
    assert "raise ValueError(f'bad {batch}')" in out.text  # the rank's own line
    assert "Raised on rank 1 of 2" in out.text and "batch: int = 7" in out.text
    assert "_launch/session.py" not in out.text and "concurrent/futures" not in out.text
    assert kernel.execute("%%distributed --ranks 1 --post-mortem\nbatch * 2").result == (
        "[rank1] 14"
    )
    assert kernel.execute("%%distributed\nkept").result == "[rank0] 1\n[rank1] 2"


@pytest.mark.parametrize(
    ("cell", "reformed"),
    [
        ("import time\ntime.sleep(30)", False),
        ("import time\nif rank == 0:\n    dist.barrier()\nelse:\n    time.sleep(30)", True),
    ],
    ids=["python", "one-rank-in-collective"],
)
def test_the_notebooks_interrupt_keeps_the_session(
    kernel: Kernel, cell: str, reformed: bool
) -> None:
    kernel.execute("%%distributed\nkept = rank + 1")
    pids = rank_pids(kernel)
    out = kernel.execute("%%distributed\n" + cell, interrupt_after=1.0)
    assert (out.status, out.ename) == ("error", "KeyboardInterrupt"), out
    assert out.evalue == "interrupted: ranks [0, 1] stopped their task"
    assert ("re-formed their process group" in out.text) is reformed
    assert "session: ready" in kernel.execute("%dist status").result
    assert rank_pids(kernel) == pids  # the same ranks live on
    assert kernel.execute("%%distributed\nkept").result == "[rank0] 1\n[rank1] 2"
    assert kernel.execute(
        "%%distributed\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()"
    ).result == ("[rank0] 3.0\n[rank1] 3.0")


def test_a_subset_cell_with_a_collective_fails_fast(kernel: Kernel) -> None:
    out = kernel.execute("%%rank 0\nt = torch.ones(1)\ndist.all_reduce(t)")
    assert (out.status, out.ename) == ("error", "ProcessGroupMismatch")
    # line 3 as the editor counts: %%rank 0 is line 1
    assert re.search(r"rank 0 calls all_reduce at Cell In\[\d+\], line 3", out.evalue)
    assert kernel.execute("%%distributed\nrank").result == "[rank0] 0\n[rank1] 1"


def test_auto_mode(kernel: Kernel) -> None:
    assert kernel.execute("%dist auto on").status == "ok"
    try:
        assert kernel.execute("w = rank + 100\nw").result == "[rank0] 100\n[rank1] 101"
        assert "session: ready" in kernel.execute("%dist status").result  # magics stay here
    finally:
        assert kernel.execute("%dist auto off").status == "ok"
    out = kernel.execute("w = 'local'\nw")
    assert out.result == "'local'"


def test_a_killed_rank_then_dist_restart(kernel: Kernel) -> None:
    old = rank_pids(kernel)
    out = kernel.execute(
        "%%distributed\nimport os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "dist.barrier()"
    )
    assert (out.status, out.ename) == ("error", "WorkerDied")
    assert "rank 1 of 2 died" in out.evalue and "SIGKILL" in out.evalue
    assert "The session is broken" in out.text and "%dist restart" in out.text
    status = kernel.execute("%dist status").result
    assert "session: broken" in status and "rank 1 died (killed by SIGKILL)" in status
    refused = kernel.execute("%%distributed\nrank")
    assert (refused.status, refused.ename) == ("error", "SessionBroken")
    restarted = kernel.execute("%dist restart")
    assert restarted.status == "ok" and "variables are lost" in restarted.text
    assert wait_gone(old)
    assert kernel.execute("%%distributed\n'x' in dir()").result == "[rank0] False\n[rank1] False"


def test_a_background_run_stays_in_its_cell(kernel: Kernel) -> None:
    """A non-blocking launch and a session's submitted task keep updating the cell that
    started them while later cells run; nothing of theirs is sent as a later cell's."""
    before = set(kernel.by_parent)
    launch = kernel.kc.execute(
        textwrap.dedent(
            """
            from notebook_launcher import notebook_launcher, start

            def work():
                import time, torch.distributed as dist
                for i in range(4):
                    print("step", i, "rank", dist.get_rank(), flush=True)
                    time.sleep(0.3)
                return dist.get_rank()

            handle = notebook_launcher(work, num_processes=2, block=False)
            session = start(num_processes=2)
            task = session.submit(work)
            """
        )
    )
    later = [kernel.execute("print('a later cell')") for _ in range(3)]
    assert [r.text for r in later] == ["a later cell\n"] * 3
    assert kernel.execute("handle.result(timeout=20), task.result(timeout=20)").result == (
        "([0, 1], [0, 1])"
    )
    kernel.drain(0.5)
    kernel.execute("session.close()")
    launched = kernel.by_parent[launch]
    assert {m["msg_type"] for m in launched} >= {"display_data", "comm_msg"}
    later_ids = [k for k in kernel.by_parent if k not in before and k != launch]
    assert len(later_ids) == 5
    for msg_id in later_ids:
        for msg in kernel.by_parent[msg_id]:
            assert msg["msg_type"] in {"status", "execute_input", "stream", "execute_result"}, (
                msg["msg_type"],
                str(msg["content"])[:200],
            )
            if msg["msg_type"] == "stream":
                assert "rank" not in msg["content"]["text"], msg["content"]


@pytest.mark.parametrize("how", ["shutdown", "killed"])
def test_the_kernels_end_leaves_no_rank(how: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    kernel = Kernel(env)
    try:
        kernel.execute("%load_ext notebook_launcher")
        assert kernel.execute("%dist start -n 2").status == "ok"
        pids = rank_pids(kernel)
        assert not gone(pids)
    finally:
        kernel.shutdown(now=how == "killed")
    assert wait_gone(pids), f"ranks {pids} outlived the kernel"


def test_dist_stop_leaves_no_rank() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    kernel = Kernel(env)
    try:
        kernel.execute("%load_ext notebook_launcher")
        kernel.execute("%dist start -n 2 --start-method forkserver --dashboard False --port auto")
        pids = rank_pids(kernel)
        stopped = kernel.execute("%dist stop")
        assert stopped.status == "ok"
        assert stopped.text == "session stopped: 2 ranks ended\n", stopped  # (issue 33, item 7)
        assert wait_gone(pids)
        assert kernel.execute("%dist stop").text == "no session to stop\n"
        _no_session_left(kernel)
    finally:
        kernel.shutdown()


def _no_session_left(kernel: Kernel) -> None:
    """The magics see no session: ``%dist status`` says so, ``%%distributed`` is refused."""
    assert kernel.execute("%dist status").result == "'no session'"
    out = kernel.execute("%%distributed\nrank")
    assert (out.status, out.ename) == ("error", "UsageError")


def test_the_magics_use_the_session_that_start_made() -> None:
    """One kernel, one current session, whichever way it was made (issue 33, item 5):
    ``%dist status`` said "no session" and ``%%distributed`` "start one with %dist start"
    after ``notebook_launcher.start()``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    kernel = Kernel(env)
    try:
        kernel.execute("%load_ext notebook_launcher")
        made = kernel.execute(
            "from notebook_launcher import notebook_launcher\n"
            "s = notebook_launcher.start(num_processes=2, dashboard=False)"
        )
        assert made.status == "ok", made
        assert "session: ready, 2 ranks" in kernel.execute("%dist status").result
        cell = kernel.execute("%%distributed\nx = rank * 10\nx")
        assert cell.result == "[rank0] 0\n[rank1] 10", cell
        assert kernel.execute("s.pull('x')").result == "[0, 10]"  # the same ranks
        started = kernel.execute("%dist start -n 2")  # over it: refused, as over its own
        assert (started.status, started.ename) == ("error", "UsageError"), started
        assert kernel.execute("s.close()").status == "ok"
        _no_session_left(kernel)
    finally:
        kernel.shutdown()


def test_argument_errors_are_usage_errors(kernel: Kernel) -> Any:
    out = kernel.execute("%dist frobnicate")
    assert (out.status, out.ename) == (
        "error",
        "UsageError",
    ) and "unknown %dist command" in out.evalue
    out = kernel.execute("%%distributed --ranks 0,1 --post-mortem\nx")
    assert out.ename == "UsageError" and "needs one rank" in out.evalue
    assert kernel.execute("%dist start -n 2").ename == "UsageError"  # one runs already
    assert kernel.execute("%dist auto maybe").ename == "UsageError"


@pytest.mark.parametrize(
    "presses", [[1.0, 1.05], [1.0, 1.2], [1.0, 1.1, 1.2]], ids=["50ms", "200ms", "three"]
)
def test_interrupts_pressed_again_end_the_cell(kernel: Kernel, presses: list[float]) -> None:
    """The stop button pressed twice (or three times) while rank 0 waits in a barrier: the
    cell ends interrupted -- before: it never returned -- and the session lives on. The
    traceback ends at the cell's line: none of the session's frames."""
    kernel.execute("%%distributed\nkept = rank + 1")
    cell = (
        "%%distributed\nimport time\nif rank == 0:\n    dist.barrier()\nelse:\n    time.sleep(30)"
    )
    t0 = time.monotonic()
    out = kernel.execute(cell, interrupt_after=presses)
    assert kernel.pressed >= 2 and time.monotonic() - t0 < 10
    assert (out.status, out.ename) == ("error", "KeyboardInterrupt"), out
    assert out.evalue == "interrupted: ranks [0, 1] stopped their task"
    assert "session.py" not in out.text and "raise exc" not in out.text, out.text
    assert "session: ready" in kernel.execute("%dist status").result
    assert kernel.execute("%%distributed\nkept").result == "[rank0] 1\n[rank1] 2"


def test_tracebacks_count_lines_as_the_editor(kernel: Kernel) -> None:
    """An error in a function defined in an earlier %%distributed cell: each frame names
    its cell and the line the editor shows (%%distributed is line 1), with its source."""
    defined = kernel.execute(
        "%%distributed\n"
        "import torch\n\n\n"
        "def f(x):\n"
        "    y = x + 1\n"
        "    z = y * 2\n"
        "    if rank == 1:\n"
        "        raise ValueError('bad')\n"
        "    return z\n\n\n"
        "def g(x):\n"
        "    a = 1\n"
        "    return f(x)\n"
    )
    assert defined.status == "ok"
    out = kernel.execute("%%distributed\ng(3)")
    assert out.ename == "ValueError"
    text = out.text
    here = re.search(r"Cell In\[(\d+)\], line 2\n", text)
    assert here and "----> 2 g(3)" in text, text
    earlier = re.search(r"Cell In\[(\d+)\], line 15, in g\(\)\n", text)
    assert earlier and int(earlier.group(1)) == int(here.group(1)) - 1, text
    assert "---> 15     return f(x)" in text
    assert re.search(r"Cell In\[\d+\], line 9, in f\(\)\n", text), text
    assert "----> 9         raise ValueError('bad')" in text


def test_ranks_come_back_in_the_order_asked(kernel: Kernel) -> None:
    assert kernel.execute("%%distributed --ranks 1,0\nrank * 10").result == "[rank1] 10\n[rank0] 0"


def test_a_cell_that_is_not_python_says_so(kernel: Kernel) -> None:
    out = kernel.execute("%%distributed\nx = 1\n%time y = 2")
    assert (out.status, out.ename) == ("error", "SyntaxError")
    assert "IPython syntax (%time y = 2) does not run on the ranks" in out.evalue
    out = kernel.execute("%%distributed\nx = 1\nx = = 2")
    assert out.ename == "SyntaxError" and re.search(r"Cell In\[\d+\], line 3", out.text)
    assert "Variables in rank" not in out.text and "ast.py" not in out.text


def test_an_interrupted_launch_ends_at_the_callers_line(kernel: Kernel) -> None:
    out = kernel.execute(
        "from notebook_launcher import notebook_launcher\n"
        "def nap():\n"
        "    import time\n"
        "    time.sleep(30)\n"
        "notebook_launcher(nap, num_processes=2, dashboard=False)",
        interrupt_after=2.5,
    )
    assert (out.status, out.ename) == ("error", "KeyboardInterrupt"), out
    assert out.evalue == "interrupted: all 2 ranks stopped"
    for machinery in ("_attempts", "_pump", "select", "launcher.py", "group.py"):
        assert machinery not in out.text, (machinery, out.text)
    assert "----> 5 notebook_launcher(nap, num_processes=2, dashboard=False)" in out.text


def test_a_background_handle_shows_how_it_ended(kernel: Kernel) -> None:
    cell = kernel.kc.execute(
        "from notebook_launcher import notebook_launcher\n"
        "def short():\n"
        "    import time\n"
        "    time.sleep(0.5)\n"
        "    return 7\n"
        "handle = notebook_launcher(short, num_processes=2, dashboard=False, block=False)\n"
        "handle"
    )
    assert kernel.execute("handle.result(timeout=30)").result == "[7, 7]"
    kernel.drain(1.0)
    shown = [
        text
        for m in kernel.by_parent[cell]
        if m["msg_type"] in ("display_data", "update_display_data")
        and (text := m["content"]["data"].get("text/plain", "")).startswith("<TaskHandle")
    ]
    assert shown[0] == "<TaskHandle short: running>", shown
    assert shown[-1] == "<TaskHandle short: finished: [7, 7]>", shown
