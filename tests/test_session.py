"""Sessions (issue 11): ranks that live across calls, driven from this process.

What the issue promises, each for real on 2 gloo ranks: namespaces persist; some ranks
only; a failing task keeps the session and every variable, with or without a peer waiting
in a collective; an interrupt keeps it; a rank that dies breaks it, says which rank and
why, and ``restart()`` brings fresh ranks; a collective on a subset of ranks fails fast
naming its call site; push/pull; the notebook's classes come back as its own; post-mortem;
``Future``-like handles (``submit``, ``notebook_launcher(block=False)``); ``close()`` and
``with`` leave nothing (the autouse ``no_leftovers`` fixture checks processes, ports,
threads and env after every test).

One session per start method serves the tests that do not break it (``shared``); tests
that break or close theirs start their own (a session starts in ~50 ms once torch is
imported, ~1 s with spawn).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import notebook_launcher
from notebook_launcher import (
    LaunchError,
    ProcessGroupMismatch,
    Session,
    SessionBroken,
    WorkerDied,
)
from notebook_launcher._launch import session as core_module

from .helpers import Recorder

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

METHODS = ["fork", "forkserver"]

# Classes and functions "defined in the notebook": in ``__main__``, which cloudpickle ships
# by value (a rank cannot import it), as it does for a notebook's cells.
NOTEBOOK: dict = {"__name__": "__main__"}
exec(
    """
class Box:
    def __init__(self, value):
        self.value = value

class BadBatch(Exception):
    pass

def make_box(value):
    import torch.distributed as dist
    return Box(value * (dist.get_rank() + 1))

def check_batch(batch):
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise BadBatch(f"batch {batch} is bad on rank 1")
    return batch
""",
    NOTEBOOK,
)
Box, BadBatch = NOTEBOOK["Box"], NOTEBOOK["BadBatch"]


def start(method: str = "fork", **options: object) -> Session:
    options.setdefault("dashboard", False)
    return notebook_launcher.start(num_processes=2, start_method=method, **options)


def group_works(session: Session) -> None:
    """The ranks' process group is sound: a collective over every rank gives the sum."""
    assert session.run_cell("_t = torch.ones(1) * (rank + 1); dist.all_reduce(_t); _t.item()") == [
        "3.0",
        "3.0",
    ]


def wait_until(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def rank_waits_in_collective(session: Session, rank: int) -> Callable[[], bool]:
    """True once the running task's ``rank`` reported that it waits in a collective."""

    def check() -> bool:
        task = session.core.task
        return task is not None and rank in task.record.barriers.waiting

    return check


@pytest.fixture(scope="module", params=METHODS)
def _module_session(request: pytest.FixtureRequest) -> Iterator[Session]:
    session = start(request.param)
    yield session
    session.close()


@pytest.fixture
def shared(_module_session: Session) -> Iterator[Session]:
    """The module's session; it must be ready again after the test (else it is restarted
    so that the next tests start from a sound one, and this test fails)."""
    yield _module_session
    status = _module_session.status()
    if status.state != "ready":
        _module_session.restart()
        pytest.fail(f"the test left the shared session {status.state}: {status}")
    group_works(_module_session)


# --- namespaces, ranks, values -------------------------------------------------------------


def test_namespaces_persist_with_the_rank_names_at_hand(shared: Session) -> None:
    assert shared.run_cell("x = rank * 10") == [None, None]
    assert shared.run_cell("x + 1") == ["1", "11"]
    assert shared.run_cell("(rank, local_rank, world_size, str(device), dist.get_rank())") == [
        "(0, 0, 2, 'cpu', 0)",
        "(1, 1, 2, 'cpu', 1)",
    ]
    assert shared.run_cell("type(state).__name__, state.process_index, torch.__name__") == [
        "('PartialState', 0, 'torch')",
        "('PartialState', 1, 'torch')",
    ]
    assert shared.run_cell("_") == ["('PartialState', 0, 'torch')", "('PartialState', 1, 'torch')"]
    assert shared.run(os.getpid) == list(shared.status().pids)  # the same processes throughout


def test_some_ranks_only(shared: Session) -> None:
    assert shared.run_cell("only_here = rank + 100", ranks=[1]) == [None]
    assert shared.run_cell("only_here", ranks=[1]) == ["101"]
    assert shared.run(os.getenv, "RANK", ranks=[1]) == ["1"]
    assert shared.pull("only_here", ranks=[1]) == [101]
    with pytest.raises(NameError, match="'only_here' is not defined on rank 0"):
        shared.pull("only_here")
    with pytest.raises(ValueError, match=r"ranks must be some of \[0, 1\]"):
        shared.run(os.getpid, ranks=[2])


def test_push_and_pull(shared: Session) -> None:
    shared.push(lr=1e-3, steps=[1, 2])
    assert shared.pull("lr") == [1e-3, 1e-3]
    shared.push(lr=0.5, ranks=[0])
    assert shared.pull("lr") == [0.5, 1e-3]
    shared.run_cell("steps.append(rank)")  # each rank has its own copy
    assert shared.pull("steps") == [[1, 2, 0], [1, 2, 1]]


def test_notebook_classes_come_back_as_the_notebooks_own(shared: Session) -> None:
    shared.push(box=Box(3))
    assert shared.run_cell("type(box).__name__, box.value") == ["('Box', 3)", "('Box', 3)"]
    pulled = shared.pull("box")
    assert all(type(b) is Box for b in pulled) and [b.value for b in pulled] == [3, 3]
    made = shared.run(NOTEBOOK["make_box"], 5)  # made in the rank from the shipped class
    assert all(isinstance(b, Box) for b in made) and [b.value for b in made] == [5, 10]
    with pytest.raises(BadBatch, match="batch 7 is bad on rank 1"):  # `except` works
        shared.run(NOTEBOOK["check_batch"], 7)


# --- failures that keep the session ------------------------------------------------------


def raises_alone() -> int:
    import torch
    import torch.distributed as dist

    batch = torch.zeros(4, 3)
    labels = [0, 1, 2]
    if dist.get_rank() == 1:
        raise ValueError(f"{len(labels)} labels for {len(batch)} samples")
    return len(labels)


def raises_while_peer_waits() -> int:
    """Rank 0 waits in a barrier for rank 1, which raises instead of coming."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    if dist.get_rank() == 0:
        store.set("entering", "1")
        dist.barrier()  # never completes: rank 1 raised
        return 0
    store.wait(["entering"])
    time.sleep(0.2)  # rank 0 is in its barrier (in C++) by now
    batch = torch.zeros(4, 3)
    labels = [0, 1, 2]
    raise ValueError(f"{len(labels)} labels for {len(batch)} samples")


def raises_while_peer_waits_and_torch_holds_the_group() -> int:
    """The same, after creating an optimizer: from then on torch keeps the process group
    alive after ``destroy_process_group`` (its connections open), so re-forming must shut
    its sockets down itself to free rank 0."""
    import torch

    torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    return raises_while_peer_waits()


@pytest.mark.parametrize(
    ("task", "reformed"),
    [
        (raises_alone, False),
        (raises_while_peer_waits, True),
        (raises_while_peer_waits_and_torch_holds_the_group, True),
    ],
    ids=["no-collective-pending", "peer-waits-in-collective", "group-held-by-torch"],
)
def test_a_failing_task_keeps_the_session_and_the_variables(
    shared: Session, task: Callable[[], int], reformed: bool
) -> None:
    shared.run_cell("kept = [rank] * 3")
    generation = shared.status().generation
    with pytest.raises(ValueError, match="3 labels for 4 samples") as info:
        shared.run(task)
    notes = "\n".join(info.value.__notes__)
    assert "Raised on rank 1 of 2" in notes
    # The failing frame's variables, summarised (post-mortem at a glance).
    assert "Variables in rank 1's failing frame:" in notes
    assert "batch: Tensor 4x3 float32 on cpu" in notes and "labels: list of 3" in notes
    assert ("re-formed their process group" in notes) is reformed
    assert "intact" in notes  # the session lives on, and says so
    assert info.value.launch_failure.root_cause.rank == 1
    assert shared.status().generation == generation + reformed
    assert shared.status().state == "ready"
    assert shared.pull("kept") == [[0, 0, 0], [1, 1, 1]]


def test_a_failure_stops_the_others_where_they_wait_not_half_way(shared: Session) -> None:
    """Rank 1 raises while rank 0 is still computing its step: rank 0 is not interrupted
    at whatever line it is on (its step half taken), but where it waits for rank 1."""
    shared.run_cell("import time\nsteps, done = 0, 0")
    cell = (
        "if rank == 1:\n    raise ValueError('bad batch')\n"
        "steps += 1\ntime.sleep(0.3)  # the rest of the step\ndone += 1\n"
        "dist.barrier()  # waits for rank 1, which raised: interrupted here"
    )
    with pytest.raises(ValueError, match="bad batch"):
        shared.run_cell(cell)
    assert shared.run_cell("steps, done") == ["(1, 1)", "(0, 0)"]
    assert shared.status().state == "ready"
    assert shared.run_cell("dist.barrier(); 'sound'") == ["'sound'"] * 2


def test_a_failing_cells_variables_are_its_data(shared: Session) -> None:
    """A cell fails at the namespace's top level: its summary shows the data there, not
    what the namespace imported or defined, nor ``_``."""
    shared.run_cell("import math\nfrom collections import OrderedDict\ndef helper(): pass")
    shared.run_cell("batch = torch.zeros(2, 3)\n7")  # binds _ = 7
    with pytest.raises(ZeroDivisionError) as info:
        shared.run_cell("ratio = 1 / (rank - 1)", ranks=[1])
    notes = "\n".join(info.value.__notes__)
    assert "batch: Tensor 2x3 float32 on cpu" in notes and "rank: int = 1" in notes
    assert "device: device = cpu" in notes
    for noise in ("math", "OrderedDict", "helper", "_:"):
        assert f"\n  {noise}" not in notes, notes


def test_post_mortem_runs_in_the_failing_frame(shared: Session) -> None:
    with pytest.raises(ValueError):
        shared.run(raises_alone)
    assert shared.post_mortem(1, "batch.shape, labels") == "(torch.Size([4, 3]), [0, 1, 2])"
    # Code runs with the frame's variables at hand, as pdb's `interact` gives them.
    assert shared.post_mortem(1, "fixed = batch[: len(labels)]\nfixed.shape[0]") == "3"
    # A mistake while looking does not lose what we look at.
    with pytest.raises(NameError, match="nope"):
        shared.post_mortem(1, "nope")
    with pytest.raises(NameError, match="not defined on rank 1"):
        shared.pull("not_a_name", ranks=[1])
    assert shared.post_mortem(1, "len(labels)") == "3"


def test_a_collective_on_some_ranks_fails_fast_naming_its_call_site(shared: Session) -> None:
    shared.run_cell("kept = rank")
    generation = shared.status().generation
    with pytest.raises(ProcessGroupMismatch) as info:
        shared.run_cell("y = 1\ndist.all_reduce(torch.ones(1))", ranks=[0])
    message = str(info.value)
    # refused before anything was sent: the group needs no re-forming
    assert shared.status().generation == generation
    assert "rank 0 calls all_reduce at <distributed-cell-" in message
    assert ":2, which needs every rank" in message  # the cell's line 2
    assert "ranks [1] do not run it" in message
    assert shared.pull("kept") == [0, 1]

    def barrier_on_one_rank() -> None:
        import torch.distributed as dist

        dist.barrier()  # the call site the error names

    with pytest.raises(ProcessGroupMismatch, match=r"rank 1 calls barrier at test_session.py:"):
        shared.run(barrier_on_one_rank, ranks=[1])


# --- interrupts ------------------------------------------------------------------------------


def sleep_everywhere() -> None:
    time.sleep(60)


def in_collective_while_peer_sleeps() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.barrier()  # stuck in C++: only re-forming the group frees it
    else:
        time.sleep(60)


def collective_queued_when_interrupted() -> None:
    """Rank 0 is interrupted after torch queued a collective and before it completed (the
    window between ``work = pg.barrier()`` and ``work.wait()``, made wide here): it answers
    from Python, but its group still holds the collective."""
    import torch.distributed as dist

    from notebook_launcher._worker import barriers

    if dist.get_rank() == 0:
        barriers.barrier(lambda: (dist.barrier(async_op=True), time.sleep(60)), 0, "barrier")
    else:
        time.sleep(60)


@pytest.mark.parametrize(
    ("task", "how", "reformed"),
    [
        (sleep_everywhere, "cancel", False),
        (in_collective_while_peer_sleeps, "interrupt", True),
        (collective_queued_when_interrupted, "cancel", True),
    ],
    ids=["python", "one-rank-in-collective", "collective-queued"],
)
def test_an_interrupt_keeps_the_session(
    shared: Session, task: Callable[[], None], how: str, reformed: bool
) -> None:
    shared.run_cell("kept = rank + 1")
    generation = shared.status().generation
    handle = shared.submit(task)
    if task is not sleep_everywhere:
        wait_until(rank_waits_in_collective(shared, 0))
    assert handle.running() and not handle.done()
    if how == "cancel":
        assert handle.cancel() is True
        assert handle.cancelled() and handle.done()
        with pytest.raises(cf.CancelledError):
            handle.result()
    else:
        shared.interrupt()
        with pytest.raises(KeyboardInterrupt, match=r"interrupted: ranks \[0, 1\]") as info:
            handle.result(timeout=30)
        assert "re-formed their process group" in "\n".join(info.value.__notes__)
    assert shared.status().generation == generation + reformed
    assert shared.pull("kept") == [1, 2]


def test_a_ranks_keyboardinterrupt_after_our_interrupt_is_a_stop() -> None:
    """handle.cancel() read "rank 0 raised KeyboardInterrupt" (issue 26): the rank's
    answer to our SIGINT, stamped before the kernel noted the signal sent, was taken for an
    error of its own (the check compared "builtins.KeyboardInterrupt", a name the ranks
    never send). An error of its own raised before the stop is still reported."""
    from notebook_launcher._serialization import type_name
    from notebook_launcher.errors import RankFailure

    task = core_module.TaskRun(1, [0, 1], Recorder(), core_module.TaskHandle(lambda: None))
    task.signalled_at = {0: 100.0}
    answer = RankFailure(0, "raised", exc_type=type_name(KeyboardInterrupt), time=99.99)
    assert answer.exc_type == "KeyboardInterrupt"
    assert not core_module._raised_before(answer, task)
    own = RankFailure(0, "raised", exc_type="ValueError", time=99.0)
    assert core_module._raised_before(own, task)


def test_a_sessions_start_and_each_task_are_decided_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34: ``decide()`` runs once per end: the start's, then each task's (ok, failed,
    interrupted), driven by one loop (``GroupRun.drive``) under the start's, the serving
    and the closing policies."""
    decided: list[str] = []
    real = core_module.decide

    def counting(end: Any) -> Any:
        outcome = real(end)
        decided.append(f"{end.purpose}: {outcome.kind}")
        return outcome

    monkeypatch.setattr(core_module, "decide", counting)
    session = start()
    try:
        assert decided == ["start: ready"]
        assert session.run(os.getpid) != []
        with pytest.raises(ValueError, match="3 labels for 4 samples"):
            session.run(raises_alone)
        assert session.submit(sleep_everywhere).cancel() is True
        assert decided == ["start: ready", "task: ok", "task: failed", "task: interrupted"]
    finally:
        session.close()
    assert session.status().state == "closed"


def test_an_interrupt_right_after_submit_is_not_lost(shared: Session) -> None:
    """The interrupt may reach a rank before its task does: it must still stop the task."""
    for _ in range(3):
        handle = shared.submit(sleep_everywhere)
        assert handle.cancel() is True


# --- handles ---------------------------------------------------------------------------------


def test_submit_returns_a_future_at_once(shared: Session, tmp_path: Path) -> None:
    release = str(tmp_path / "release")
    called: list[cf.Future] = []
    done = threading.Event()
    handle = shared.submit(
        lambda path: (wait_for_file(path), os.getpid())[1], release, ranks=[0, 1]
    )
    handle.add_done_callback(lambda f: (called.append(f), done.set()))
    try:
        assert not handle.done() and handle.running()
        with pytest.raises(cf.TimeoutError):
            handle.result(timeout=0.05)
        with pytest.raises(LaunchError, match="is still running"):
            shared.submit(os.getpid)
        assert shared.status().state == "busy"
    finally:
        open(release, "w").close()
    assert handle.result(timeout=30) == list(shared.status().pids)
    assert done.wait(10) and called == [handle]
    assert handle.done() and not handle.cancelled() and handle.exception() is None
    assert handle.cancel() is False  # it had ended
    failing = shared.submit(raises_alone)
    finished, _ = cf.wait([failing], timeout=30)
    assert finished == {failing}
    assert isinstance(failing.exception(), ValueError)


def wait_for_file(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.01)


def slow_rank() -> int:
    import torch.distributed as dist

    time.sleep(0.2)
    return dist.get_rank()


@pytest.mark.parametrize("method", METHODS)
def test_a_non_blocking_launch_is_a_future(method: str) -> None:
    handle = notebook_launcher.notebook_launcher(
        slow_rank, num_processes=2, start_method=method, dashboard=False, block=False
    )
    called = threading.Event()
    handle.add_done_callback(lambda f: called.set())
    assert not handle.done()
    assert handle.result(timeout=30) == [0, 1] and called.wait(10)

    handle = notebook_launcher.notebook_launcher(
        NOTEBOOK["check_batch"], (7,), 2, start_method=method, dashboard=False, block=False
    )
    assert isinstance(handle.exception(timeout=30), BadBatch)

    handle = notebook_launcher.notebook_launcher(
        sleep_everywhere, num_processes=2, start_method=method, dashboard=False, block=False
    )
    assert handle.cancel() is True and handle.cancelled()
    with pytest.raises(cf.CancelledError):
        handle.result()


# --- what breaks a session, and what brings it back -------------------------------------------


def _gone(pids: tuple[int, ...]) -> bool:
    return not any(os.path.exists(f"/proc/{p}") and _alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(60)
def test_a_rank_that_dies_while_spared_after_a_failure_ends_the_task() -> None:
    """Rank 0 raises; rank 1, still computing (spared until it waits), dies meanwhile: the
    session is broken and the cell ends at once -- it hung when the spared rank's end set
    a re-forming deadline on a broken session that never re-forms."""
    with start() as session:
        with pytest.raises(ValueError, match="first") as info:
            session.run_cell(
                "import os, signal, time\n"
                "if rank == 0:\n"
                "    raise ValueError('first')\n"
                "time.sleep(0.2)\n"
                "os.kill(os.getpid(), signal.SIGKILL)"
            )
        assert "The session is broken (rank 1 died (killed by SIGKILL))" in "\n".join(
            info.value.__notes__
        )
        assert session.status().state == "broken"
        session.restart()
        assert session.run_cell("rank") == ["0", "1"]


@pytest.mark.parametrize("method", METHODS)
def test_a_killed_rank_breaks_the_session_and_restart_brings_fresh_ranks(
    method: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with start(method) as session:
        session.run_cell("x = 1")
        old = session.status().pids
        with pytest.raises(WorkerDied) as info:
            session.run_cell(
                "import os, signal\n"
                "if rank == 1:\n"
                "    os.kill(os.getpid(), signal.SIGKILL)\n"
                "dist.barrier()"
            )
        root = info.value.launch_failure.root_cause
        assert (root.rank, root.kind, root.signal_name) == (1, "died", "SIGKILL")
        assert "The session is broken (rank 1 died (killed by SIGKILL))" in "\n".join(
            info.value.__notes__
        )
        status = session.status()
        assert status.state == "broken" and "rank 1 died (killed by SIGKILL)" in str(status)
        assert "restart()" in str(status)
        with pytest.raises(SessionBroken, match="restart"):
            session.run(os.getpid)
        capsys.readouterr()
        session.restart()
        assert "variables are lost" in capsys.readouterr().out
        assert session.status().state == "ready" and _gone(old)
        assert session.run_cell("'x' in dir()") == ["False", "False"]
        group_works(session)


@pytest.mark.timeout(60)
def test_a_collateral_error_read_after_the_break_still_ends_the_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1 dies; rank 0's gloo error about it is read only after the session broke (on a
    loaded machine the death is seen first, and the error was on its way as the session
    killed rank 0). It set a re-forming deadline on a broken session, which never re-forms:
    the cell hung. Here rank 0 outlives the break (the kill is held back) to send it late."""
    from notebook_launcher._launch.group import WorkerProcess

    with start() as session:
        with monkeypatch.context() as held:
            held.setattr(WorkerProcess, "send_signal", lambda self, sig: None)
            with pytest.raises(WorkerDied, match="rank 1 of 2 died"):
                session.run_cell(
                    "import os, signal, time\n"
                    "if rank == 1:\n"
                    "    os.kill(os.getpid(), signal.SIGKILL)\n"
                    "time.sleep(1.0)\n"
                    "raise RuntimeError('[gloo/pair.cc:553] Connection closed by peer')"
                )
        assert session.status().state == "broken"
        session.restart()
        group_works(session)


def test_a_rank_that_dies_between_tasks_breaks_the_session() -> None:
    with start() as session:
        os.kill(session.status().pids[1], signal.SIGKILL)
        wait_until(lambda: session.status().state == "broken")
        assert "rank 1 died (killed by SIGKILL)" in str(session.status())
        session.restart()
        group_works(session)


def test_a_rank_that_does_not_stop_breaks_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deaf to the interrupt and not in a collective: the session gives up on it after
    the grace period (shortened here), stops every rank and says so."""
    monkeypatch.setattr(core_module, "REFORM_TIMEOUT", 0.5)
    with start() as session:
        handle = session.submit(
            lambda: (signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}), time.sleep(60))
        )
        wait_until(lambda: session.core.task is not None and session.core.task.started == {0, 1})
        assert handle.cancel() is False  # it did not end as an interrupt
        with pytest.raises(SessionBroken, match=r"rank\(s\) \[0, 1\] did not stop"):
            handle.result()
        assert session.status().state == "broken"
        session.restart()
        group_works(session)


# --- the end ---------------------------------------------------------------------------------


@pytest.mark.parametrize("method", [*METHODS, "spawn"])
def test_close_and_with_leave_nothing(method: str) -> None:
    """Checked by ``no_leftovers`` too: no process, port, thread or env var stays."""
    with start(method) as session:
        pids = session.status().pids
        assert session.run_cell("x = rank\nx") == ["0", "1"]
        with pytest.raises(RuntimeError, match="rank 0 has no failure to look into"):
            session.post_mortem(0, "1")
        with pytest.raises(BadBatch):  # spawn too: the notebook's classes
            session.run(NOTEBOOK["check_batch"], 1)
    assert session.status().state == "closed"
    wait_until(lambda: _gone(pids))
    with pytest.raises(LaunchError, match="closed"):
        session.run(os.getpid)
    session.close()  # idempotent


def test_close_while_a_task_runs() -> None:
    session = start()
    handle = session.submit(sleep_everywhere)
    session.close()
    with pytest.raises(LaunchError, match="closed while the task ran"):
        handle.result(timeout=10)


def test_the_default_view_prints_a_quick_tasks_output_by_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with notebook_launcher.start(num_processes=2) as session:
        capsys.readouterr()
        session.run_cell("print('hello from', rank)")
        out = capsys.readouterr().out
    assert "[rank0] hello from 0" in out and "[rank1] hello from 1" in out
    assert "notebook_launcher" not in out  # a quick task: its output, no dashboard


def test_the_current_session_is_the_last_one_made_then_the_one_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The magics' session (issue 33, item 5): the last one started or attached, whichever
    way; when it is closed, stopped or let go, the one current before it, if still open;
    a session the notebook dropped does not come back."""
    from notebook_launcher import _sessions as registry
    from notebook_launcher import session as sessions

    monkeypatch.setattr(registry, "_current", None)
    monkeypatch.setattr(registry, "_earlier", [])

    class Made:  # stands for a Session: the registry only keeps and compares them
        pass

    a, b, c = Made(), Made(), Made()
    for made in (a, b, c):
        sessions.make_current(made)  # type: ignore[arg-type]
    assert sessions.current() is c
    sessions.let_go(b)  # (closed while not current: it never comes back)
    sessions.let_go(c)
    assert sessions.current() is a
    sessions.make_current(b)  # type: ignore[arg-type]
    del a  # dropped by the notebook
    sessions.let_go(b)
    assert sessions.current() is None
