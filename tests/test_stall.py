"""Real hangs on CPU/gloo, and what the user is told about each (issue 19).

Every test starts real ranks that really hang: a rank sleeping in Python while the others
wait in ``all_reduce`` (a stall that then resolves by itself: the view goes away), DDP
whose forward skips a layer on one rank (a hang in backward), a thread deadlock in one
rank, a DataLoader worker stuck, a session cell that stalls (then ``stacks()``, then an
interrupt that keeps the session), and an interrupted stuck launch. Each checks what the
text view prints -- the findings that name the odd rank out, with cells' or files' line
numbers -- and the dashboard's stall view drawn from the same events. Mismatched
collectives (type, shape, count) through the package's API and raw ``torch.distributed``
are named on every rank; collectives of the whole group in a cell on some ranks fail at
once (issue 17).
"""

from __future__ import annotations

import inspect
import io
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import notebook_launcher
from notebook_launcher import notebook_launcher as launch
from notebook_launcher._events import Event, LaunchStarted, StacksTaken, StallOver, WorkerFailed
from notebook_launcher._stacks import thread_label
from notebook_launcher._worker import session as rank_side
from notebook_launcher.errors import DistributedOperationException, ProcessGroupMismatch
from notebook_launcher.session import cell_code
from notebook_launcher.ui import TextView
from notebook_launcher.ui.model import LaunchModel
from notebook_launcher.ui.stall import stall_html

from .helpers import wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]

HERE = os.path.basename(__file__)


class Seen:
    """A view that records every event and prints the text view into a buffer."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.out = io.StringIO()
        self.text = TextView(self.out)
        self.lock = threading.Lock()

    def handle(self, event: Event) -> None:
        with self.lock:
            self.events.append(event)
        self.text.handle(event)

    def tick(self) -> None:
        self.text.tick()

    def close(self) -> None:
        self.text.close()

    def reports(self) -> list[StacksTaken]:
        with self.lock:
            return [e for e in self.events if isinstance(e, StacksTaken)]

    def wait_report(self, showing: str = "", timeout: float = 30.0) -> StacksTaken:
        """The first stall report whose findings contain ``showing`` (a slow import at the
        start of a rank on a loaded machine is a stall too, and is shown first)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [r for r in self.reports() if showing in "\n".join(r.findings)]
            if found:
                return found[0]
            assert time.monotonic() < deadline, f"no such report; text:\n{self.out.getvalue()}"
            time.sleep(0.02)

    def dashboard(self) -> str:
        """The dashboard's stall view, from the same events (what the widget shows)."""
        return stall_html(self.model().stall)

    def model(self) -> LaunchModel:
        """The dashboard's model of the latest run (a session's latest task)."""
        model = LaunchModel()
        with self.lock:
            starts = [i for i, e in enumerate(self.events) if isinstance(e, LaunchStarted)]
            for e in self.events[starts[-1] if starts else 0 :]:
                model.apply(e)
        return model


def line_of(function: Callable[..., Any], text: str) -> int:
    """The line number of the first line of ``function`` that contains ``text``."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


# --- a rank sleeps while the others wait; the stall resolves by itself --------------------------


def sleeps_then_reduces() -> int:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(2.5)
    dist.all_reduce(torch.ones(4))
    return dist.get_rank()


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_sleeping_rank_while_the_others_wait_then_the_stall_resolves(method: str) -> None:
    seen = Seen()
    result = launch(
        sleeps_then_reduces,
        num_processes=3,
        start_method=method,
        dashboard=seen,
        stall_after=1.0,
    )
    assert result == [0, 1, 2]
    sleep = line_of(sleeps_then_reduces, "time.sleep")
    finding = (
        f"rank 1 is in `time.sleep(2.5)` at {HERE}:{sleep}; ranks 0, 2 wait in `all_reduce` "
        f"at line {sleep + 1}"
    )
    report = seen.wait_report("time.sleep")
    assert report.findings == (finding,) and report.odd == (1,)
    assert report.reason == "stall" and report.quiet >= 1.0
    text = seen.out.getvalue()
    assert f"no rank made progress for 1.0s; where each rank is:\n  {finding}\n" in text
    assert "--- ranks 0, 2 (pid" in text and "(the same stacks)" in text  # shown once
    assert "--- rank 1 (pid" in text and "<- the odd one out" in text
    assert text.count(finding) == 1  # looked at again, printed once
    assert "progress again (the stall lasted" in text  # ... and the view went away
    assert isinstance(seen.events[-2], StallOver) or any(
        isinstance(e, StallOver) for e in seen.events
    )
    html = seen.dashboard()
    assert html == ""  # gone from the dashboard once progress resumed
    model = LaunchModel()
    model.apply(report)
    html = stall_html(model.stall)
    assert "nl-stall-odd" in html and "data-ranks='1'" in html and "data-ranks='0,2'" in html
    assert "time.sleep(2.5)" in html


# --- DDP: one rank's forward skips a layer; the others hang in backward --------------------------


def ddp_skips_a_layer() -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
            x = self.a(x)
            return x if skip else self.b(x)

    model = DistributedDataParallel(Net())
    x = torch.ones(2, 4)
    for step in range(2):
        out = model(x, skip=dist.get_rank() == 1 and step == 1)  # rank 1 skips `b` once
        out.sum().backward()
    dist.barrier()
    return dist.get_rank()


def test_ddp_where_one_rank_skips_a_layer_hangs_in_backward() -> None:
    seen = Seen()
    handle = launch(
        ddp_skips_a_layer, num_processes=2, dashboard=seen, stall_after=1.0, block=False
    )
    try:
        seen.wait_report("backward")
        stacks = handle.stacks()  # on demand, the same places
        backward = line_of(ddp_skips_a_layer, "out.sum().backward()")
        barrier = line_of(ddp_skips_a_layer, "dist.barrier()")
        finding = (
            f"rank 0 is in `out.sum().backward()` at {HERE}:{backward}; "
            f"rank 1 waits in `barrier` at line {barrier}"
        )
        assert stacks.findings == (finding,)
        assert finding in str(stacks)
        assert finding in seen.dashboard()  # what the live dashboard draws
        assert "[... 2 frames in torch]" in str(stacks)  # library frames folded
    finally:
        assert handle.cancel() is True


# --- a thread deadlock in one rank; Ctrl-C says where each rank was -------------------------------


def deadlocks_in_rank_1() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        first, second = threading.Lock(), threading.Lock()

        def grab() -> None:
            with second:
                time.sleep(0.3)
                with first:  # waits for the main thread, which waits for this one
                    pass

        worker = threading.Thread(target=grab, daemon=True)
        worker.start()
        with first:
            time.sleep(0.3)
            with second:  # waits for the thread
                pass
    dist.barrier()
    return dist.get_rank()


def test_a_thread_deadlock_in_one_rank_and_ctrl_c() -> None:
    seen = Seen()
    main = threading.main_thread().ident
    assert main is not None

    def interrupt_once_shown() -> None:
        seen.wait_report("with second")
        signal.pthread_kill(main, signal.SIGINT)  # what Ctrl-C does

    threading.Thread(target=interrupt_once_shown, daemon=True).start()
    with pytest.raises(KeyboardInterrupt) as info:
        launch(deadlocks_in_rank_1, num_processes=2, dashboard=seen, stall_after=1.0)
    report = seen.wait_report("with second")
    inner = line_of(deadlocks_in_rank_1, "with second:  # waits for the thread")
    assert report.findings == (
        f"rank 1 is in `with second:  # waits for the thread` at {HERE}:{inner}; rank 0 waits in `barrier` at line "
        f"{line_of(deadlocks_in_rank_1, 'dist.barrier()')}",
    )
    (rank1,) = [r for r in report.ranks if r.rank == 1]
    assert [thread_label(t) for t in rank1.threads][0] == "main thread"
    assert any(thread_label(t).endswith("(grab)") for t in rank1.threads)
    assert "nl-stall-odd' data-ranks='1'" in seen.dashboard()  # the saved one keeps it
    note = "\n".join(getattr(info.value, "__notes__", []))
    assert note.startswith("where each rank was when it was interrupted:")
    assert "rank 1 is in `with second:  # waits for the thread`" in note
    assert "thread 0x" in note and "(grab)" in note and "with first:" in note


# --- a DataLoader worker is stuck -------------------------------------------------------------------


class StuckOnRank1:
    """A dataset whose items never come on rank 1."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        import torch
        import torch.distributed as dist

        if dist.get_rank() == 1:
            time.sleep(60)  # the worker is stuck here
        return torch.ones(2)


def loads_from_a_stuck_worker() -> int:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    loader = DataLoader(StuckOnRank1(), batch_size=2, num_workers=1)
    for batch in loader:
        dist.all_reduce(batch)
    return dist.get_rank()


def test_a_stuck_dataloader_worker() -> None:
    seen = Seen()
    handle = launch(
        loads_from_a_stuck_worker, num_processes=2, dashboard=seen, stall_after=1.0, block=False
    )
    try:
        report = seen.wait_report("loader")
        loop = line_of(loads_from_a_stuck_worker, "for batch in loader")
        assert report.findings == (
            f"rank 1 is in `for batch in loader:` at {HERE}:{loop}; rank 0 waits in "
            f"`all_reduce` at line {loop + 1}",
        )
        (rank1,) = [r for r in report.ranks if r.rank == 1]
        assert rank1.children, "the DataLoader worker's stack"
        (child_pid, threads) = rank1.children[0]
        frames = [f for t in threads for f in t.frames]
        assert any(f.function == "__getitem__" and "time.sleep(60)" in f.source for f in frames)
        text = seen.out.getvalue()
        assert f"child process {child_pid}, main thread:" in text
        assert "    time.sleep(60)  # the worker is stuck here\n" in text
        assert f"child process {child_pid}" in seen.dashboard()
    finally:
        assert handle.cancel() is True


# --- sessions: a stalled cell, stacks(), an interrupt that keeps the session -----------------------


@pytest.fixture(scope="module")
def session() -> Iterator[notebook_launcher.Session]:
    s = notebook_launcher.start(num_processes=2, start_method="fork", dashboard=False)
    yield s
    s.close()


@pytest.fixture
def shared(session: notebook_launcher.Session) -> Iterator[notebook_launcher.Session]:
    yield session
    status = session.status()
    if status.state != "ready":
        session.restart()
        pytest.fail(f"the test left the session {status.state}")
    assert session.run_cell("_t = torch.ones(1); dist.all_reduce(_t); _t.item()") == ["2.0"] * 2


def test_a_stalled_cell_then_stacks_then_an_interrupt_keeps_the_session() -> None:
    seen = Seen()
    with notebook_launcher.start(num_processes=2, dashboard=seen, stall_after=1.0) as s:
        s.run_cell("kept = rank + 1")
        cell = "import time\nif rank == 1:\n    time.sleep(60)\ndist.all_reduce(torch.ones(1))"
        code, name = cell_code(cell)  # what %%distributed runs (IPython's name in a kernel)
        handle = s.submit(rank_side.run_cell, code, name)
        report = seen.wait_report("time.sleep")
        finding = (
            f"rank 1 is in `time.sleep(60)` at {name}:3; rank 0 waits in `all_reduce` at line 4"
        )
        assert report.findings == (finding,)
        assert "no rank made progress for 1.0s" in seen.out.getvalue()
        now = s.stacks()  # while the cell runs
        assert now.findings == (finding,) and now.odd == (1,)
        assert handle.stacks().findings == (finding,)
        s.interrupt()
        with pytest.raises(KeyboardInterrupt) as info:
            handle.result(timeout=30)
        notes = "\n".join(info.value.__notes__)
        assert notes.startswith(f"where each rank was when it was interrupted:\n  {finding}")
        # The dashboard says it as a launch does (issue 26): the stall box now tells where
        # each rank was when interrupted; every rank stopped, nobody raised or is blamed.
        model = seen.model()
        assert model.stall is not None and model.stall.reason == "interrupt"
        assert seen.dashboard().count("where each rank was when it was interrupted:") == 1
        assert "refreshed while it lasts" not in seen.dashboard()
        assert {r.status for r in model.ranks.values()} == {"stopped"} and model.alerts() == []
        assert model.finished is not None and model.finished.interrupted
        assert model.summary_line().endswith(
            ": interrupted: ranks [0, 1] stopped their task; the session lives on"
        )
        assert s.status().state == "ready"
        assert s.pull("kept") == [1, 2]
        idle = s.stacks()  # between tasks: one quiet line, no stacks of our machinery
        assert idle.findings == ("every rank is idle (waits for the next task)",)
        assert str(idle) == "every rank is idle (waits for the next task)"
        assert idle._repr_html_() == (
            "<div class='nl-stall nl-stall-idle' style='color:#757575;margin-top:4px'>"
            "every rank is idle (waits for the next task)</div>"
        )
        # handle.cancel() of a running task: the user's act, every rank "stopped"
        handle = s.submit(rank_side.run_cell, *cell_code("time.sleep(60)"))
        wait_until(
            lambda: [r.started is not None for r in seen.model().ranks.values()] == [True] * 2,
            30,
            "both ranks began the task",
        )
        assert handle.cancel() is True
        model = seen.model()
        assert {r.status for r in model.ranks.values()} == {"stopped"}, seen.out.getvalue()
        assert not [e for e in seen.events if isinstance(e, WorkerFailed)]
        assert model.summary_line().endswith(": interrupted: ranks [0, 1] stopped their task; "
                                             "the session lives on")  # fmt: skip
        assert s.run_cell("_t = torch.ones(1); dist.all_reduce(_t); _t.item()") == ["2.0"] * 2


# --- issue 17: a collective of the whole group in a cell on some ranks fails at once --------------

PREPARE = """
from notebook_launcher import Accelerator
from notebook_launcher.utils import gather, reduce, broadcast, pad_across_processes
acc = Accelerator()
net = torch.nn.Linear(4, 2)
net = acc.prepare(net)
x = torch.ones(3, 4)
"""


@pytest.mark.parametrize(
    ("cell", "call", "reformed"),
    [
        ("y = 1\ngather(torch.ones(2))", "calls gather at", False),
        ("y = 1\nacc.gather(torch.ones(2))", "calls gather at", False),
        ("y = 1\nreduce(torch.ones(2))", "calls reduce at", False),
        ("y = 1\nbroadcast(torch.ones(2))", "calls broadcast at", False),
        ("y = 1\npad_across_processes(torch.ones(2))", "calls pad_across_processes at", False),
        ("y = 1\nacc.wait_for_everyone()", "calls barrier at", False),
        ("y = 1\ndist.all_reduce(torch.ones(2))", "calls all_reduce at", False),
        (
            "loss = net(x).sum()\nloss.backward()",
            "waits in a collective of the whole group run by `loss.backward()` at",
            True,
        ),
    ],
    ids=["gather", "accelerator-gather", "reduce", "broadcast", "pad", "barrier", "raw", "ddp"],
)
def test_a_collective_of_the_whole_group_in_a_cell_on_some_ranks_fails_at_once(
    shared: notebook_launcher.Session, cell: str, call: str, reformed: bool
) -> None:
    shared.run_cell(PREPARE)
    generation = shared.status().generation
    t0 = time.monotonic()
    with pytest.raises(ProcessGroupMismatch) as info:
        shared.run_cell(cell, ranks=[1])
    took = time.monotonic() - t0
    message = str(info.value)
    assert message.startswith(f"rank 1 {call} <distributed-cell-"), message
    assert ":2, which needs every rank, but this cell runs on ranks [1] only" in message
    assert "(ranks [0] do not run it)" in message
    # refused before anything was sent (the group stays); DDP's C++ all-reduce is caught by
    # the group's short timeout in such a cell, and the group is re-formed
    assert shared.status().generation == generation + reformed
    assert took < (10.0 if reformed else 5.0)  # not the group's 30-minute timeout


# --- mismatched collectives: type, shape, count; raw and the package's ----------------------------


@pytest.mark.parametrize(
    ("cell", "expected"),
    [
        (
            "dist.all_reduce(torch.ones(4)) if rank == 0 else dist.broadcast(torch.ones(4), 0)",
            [
                "different collective operations at the same point: process 0: all_reduce, "
                "process 1: broadcast",
                "Process 0: all_reduce(float32 [4])",
                "Process 1: broadcast(float32 [4], src=0)",
            ],
        ),
        (
            "dist.all_reduce(torch.ones(4 + rank))",
            [
                "The ranks called all_reduce with different inputs",
                "Process 0: all_reduce(float32 [4])",
                "Process 1: all_reduce(float32 [5])",
            ],
        ),
        (  # one rank a collective ahead: its extra all_reduce meets the other's barrier
            "t = torch.ones(2)\n"
            "for _ in range(2 if rank == 0 else 1):\n"
            "    dist.all_reduce(t)\n"
            "dist.barrier()",
            [
                "process 0: all_reduce, process 1: barrier",
                "Process 0: all_reduce(float32 [2])",
                "Process 1: barrier()",
                ":3\n",
                ":4",
            ],
        ),
        (
            "gather(torch.ones(2)) if rank == 0 else dist.all_reduce(torch.ones(2))",
            [
                "process 0: gather, process 1: all_reduce",
                "Process 0: [2] float32",
                "Process 1: all_reduce(float32 [2])",
            ],
        ),
        (
            "gather(torch.ones(2 + rank))",
            ["Process 0: [2] float32", "Process 1: [3] float32"],
        ),
    ],
    ids=["type", "shape", "count", "ours-vs-raw", "ours-shape"],
)
def test_mismatched_collectives_are_named_on_every_rank(
    shared: notebook_launcher.Session, cell: str, expected: list[str]
) -> None:
    shared.run_cell(PREPARE)
    with pytest.raises(DistributedOperationException) as info:
        shared.run_cell(cell)
    message = str(info.value)
    for part in expected:
        assert part in message, message
    assert "Called at:\n  - Process 0: <distributed-cell-" in message
    assert "\n  - Process 1: <distributed-cell-" in message


def test_every_rank_raises_the_mismatch(shared: notebook_launcher.Session) -> None:
    cell = """
from notebook_launcher.errors import DistributedOperationException
try:
    dist.all_reduce(torch.ones(4)) if rank == 0 else dist.broadcast(torch.ones(4), 0)
except DistributedOperationException as exc:
    seen = str(exc)
"""
    shared.run_cell(cell)
    for text in shared.pull("seen"):  # each rank caught it, naming both ranks' calls
        assert "Process 0: all_reduce(float32 [4])" in text
        assert "Process 1: broadcast(float32 [4], src=0)" in text


def mismatched_in_a_launch() -> None:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(4))
    else:
        dist.broadcast(torch.ones(4), 0)


def test_debug_mode_checks_a_launchs_raw_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTEBOOK_LAUNCHER_DEBUG", "1")
    with pytest.raises(DistributedOperationException) as info:
        launch(mismatched_in_a_launch, num_processes=2, dashboard=False)
    message = str(info.value)
    assert "process 0: all_reduce, process 1: broadcast" in message
    call = line_of(mismatched_in_a_launch, "dist.all_reduce")
    assert f"Process 0: {HERE}:{call}" in message
    assert f"Process 1: {HERE}:{call + 2}" in message


# --- the flight recorder (gloo records too when asked) ----------------------------------------------


def one_collective_behind() -> int:
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        time.sleep(60)
    dist.all_reduce(t)
    return 0


def test_the_flight_recorder_names_the_rank_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "64")
    seen = Seen()
    handle = launch(
        one_collective_behind, num_processes=2, dashboard=seen, stall_after=1.0, block=False
    )
    try:
        report = seen.wait_report("time.sleep")
        lines = dict(report.flight)
        assert "all_reduce [4]" in lines[0] and "behind" not in lines[0], lines
        assert "all_reduce [4]" in lines[1] and "behind: the others are at #" in lines[1], lines
        assert "flight recorder:" in seen.out.getvalue()
    finally:
        assert handle.cancel() is True


def sleeps_in_c_among_many_threads(seconds: int) -> tuple[int, float]:
    import ctypes

    import torch.distributed as dist

    stop = threading.Event()
    pool = [threading.Thread(target=stop.wait, daemon=True) for _ in range(120)]
    for thread in pool:
        thread.start()
    libc = ctypes.CDLL(None)
    began = time.monotonic()
    try:
        if dist.get_rank() == 0:  # noqa: SIM108 - two lines: two places to be told apart
            unslept = libc.sleep(seconds)  # rank 0 sleeps here
        else:
            unslept = libc.sleep(seconds)  # rank 1 sleeps there
    finally:
        stop.set()
    return unslept, time.monotonic() - began


def test_looking_at_a_rank_does_not_change_what_it_does() -> None:
    """Issue 25, item 14: the stack signal cut libc's sleep short (EINTR: a sleep(10)
    returned after 2 s), and with more than 100 threads the fault handler lost the main
    thread, so that two ranks in different places were 'the same stacks'. Their helper
    thread answers now: every thread, the main one first, and no signal."""
    seen = Seen()
    handle = launch(
        sleeps_in_c_among_many_threads, (4,), num_processes=2, dashboard=seen, stall_after=0.5,
        block=False,
    )  # fmt: skip
    try:
        seen.wait_report("sleep")  # the stall view looked (the old signal's moment)
        report = handle.stacks().report
        lines = {
            0: line_of(sleeps_in_c_among_many_threads, "rank 0 sleeps here"),
            1: line_of(sleeps_in_c_among_many_threads, "rank 1 sleeps there"),
        }
        for rank in report.ranks:
            assert len(rank.threads) > 120, (rank.rank, len(rank.threads))
            main = rank.threads[0]
            assert main.main and main.frames[-1].lineno == lines[rank.rank], main
        assert len(notebook_launcher._stacks.same_stacks(report.ranks)) == 2
        results = handle.result(timeout=60)
    finally:
        handle.cancel()
    for unslept, took in results:
        assert unslept == 0 and took >= 4.0, results  # the whole sleep, uninterrupted


# --- values compared across ranks ---------------------------------------------------------------


def test_a_sets_digest_is_the_same_under_any_hash_seed() -> None:
    """Issue 25, item 13: equal sets differed between ranks started by spawn or on another
    node (pickle writes a set in the order of the interpreter's hash seed)."""
    import subprocess
    import sys

    from .helpers import kernel_env

    code = (
        "from notebook_launcher._worker.compare import digest\n"
        "print(digest({'tags': {f'w{i}' for i in range(50)}, 'f': frozenset('abc')}))"
    )
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**kernel_env(), "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(seen) == 1, seen


def test_compare_says_which_ranks_differ_where_and_by_how_much(
    shared: notebook_launcher.Session,
) -> None:
    shared.run_cell(
        "torch.manual_seed(0); import random; random.seed(0)\n"
        "model = torch.nn.Linear(4, 2)\n"
        "ddp = torch.nn.parallel.DistributedDataParallel(model)\n"
        "opt = torch.optim.Adam(model.parameters())\n"
        "model(torch.ones(1, 4)).sum().backward(); opt.step()\n"
        "cfg = {'lr': 0.1, 'shape': (2, 3)}\n"
    )
    same = shared.compare("model", "ddp", "opt", "cfg", "rng")
    assert same.identical
    assert str(same).splitlines() == [
        "model: identical on ranks 0, 1 (2 entries)",
        "ddp: identical on ranks 0, 1 (2 entries)",  # the wrapper is looked through
        "opt: identical on ranks 0, 1 (17 entries)",
        "cfg: identical on ranks 0, 1 (2 entries)",
        "rng: identical on ranks 0, 1 (3 entries)",
    ]
    shared.run_cell(
        "with torch.no_grad():\n"
        "    model.bias[1] += 0.25 * rank\n"
        "cfg['lr'] = 0.1 * (rank + 1)\n"
        "opt.state_dict()  # (unchanged)\n"
        "torch.manual_seed(rank)\n"
    )
    bias = [float(b) for b in shared.run_cell("model.bias[1].item()")]
    found = str(shared.compare("ddp", "opt", "cfg", "rng"))
    assert found.splitlines() == [
        "ddp: ranks differ in 1 of 2 entries (1 identical)",
        "  bias (float32 [2]): rank 1 differs from rank 0 in 1 of 2 elements; largest "
        f"|difference| 0.25 at [1] ({bias[1]:.6g} vs {bias[0]:.6g})",
        "opt: identical on ranks 0, 1 (17 entries)",
        "cfg: ranks differ in 1 of 2 entries (1 identical)",
        "  lr (0.1): rank 1 differs from rank 0 (0.2 vs 0.1)",
        "rng: ranks differ in 1 of 3 entries (2 identical)",
        "  torch: rank 1 differs from rank 0 (a different random state: seed every rank alike)",
    ]
    missing = str(shared.compare("not_there"))
    assert (
        missing
        == "not_there: could not be read on ranks 0, 1 (NameError: name 'not_there' is not defined)"
    )


def test_compare_walks_a_large_value_once_and_lets_it_go(
    shared: notebook_launcher.Session,
) -> None:
    """Issue 33, item 9: the rounds of one comparison of a large value (its whole, its
    groups, their entries, the values that differ) take its entries from one walk, kept in
    the rank between them; nothing of it is kept once the comparison is over."""
    shared.run_cell("walked = {i: i for i in range(20_000)}\nif rank == 1:\n    walked[7] = -7\n")
    assert str(shared.compare("walked")).splitlines() == [
        "walked: ranks differ in 1 of 20,000 entries (19,999 identical)",
        "  7 (7): rank 1 differs from rank 0 (-7 vs 7)",
    ]
    kept = "from notebook_launcher._worker import compare as _c\nlen(_c._walks['by_name'])"
    assert shared.run_cell(kept) == ["0", "0"]
    shared.run_cell("del walked")


def test_compare_leaves_nothing_out_and_names_what_it_cannot_compare(
    shared: notebook_launcher.Session,
) -> None:
    """Issue 25, item 13: a dict past 10,000 entries is compared whole (the entry that
    differs is named); equal sets are equal whatever order their items were put in (as
    under another hash seed); an entry that cannot be pickled is named with why, and the
    rest of its value is compared."""
    shared.run_cell(
        "import threading\n"
        "big = {i: i for i in range(30_000)}\n"
        "if rank == 1:\n    big[29_999] = -1\n"
        "alike = {f'k{i}': i for i in range(30_000)}\n"
        "tags = {0, 8} if rank == 0 else {8, 0}\n"  # one set, items in another order
        "odd = {'lock': threading.Lock(), 'step': rank, 'lr': 0.1}\n"
    )
    assert str(shared.compare("big", "alike", "tags", "odd")).splitlines() == [
        "big: ranks differ in 1 of 30,000 entries (29,999 identical)",
        "  29999 (29999): rank 1 differs from rank 0 (-1 vs 29999)",
        "alike: identical on ranks 0, 1 (30,000 entries)",
        "tags: identical on ranks 0, 1 (1 entry)",
        "odd: ranks differ in 1 of 3 entries, 1 could not be compared (1 identical)",
        "  lock: could not be compared on ranks 0, 1 (TypeError: cannot pickle '_thread.lock' "
        "object)",
        "  step (0): rank 1 differs from rank 0 (1 vs 0)",
    ]
    with pytest.raises(
        TypeError, match=r"named by strings, e.g. compare\('model', 'rng'\); got 42"
    ):
        shared.compare(42)  # type: ignore[arg-type]
