"""The crash table: every way a rank can fail, with real processes.

Each row: the right exception in the caller, naming the rank and the cause, the
failing rank's traceback attached, the other ranks stopped, nothing left behind (the
autouse ``no_leftovers`` fixture), and the next launch in the same process works.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import pytest

from notebook_launcher import (
    ProcessGroupMismatch,
    RankFailedError,
    SerializationError,
    WorkerDied,
    notebook_launcher,
)
from notebook_launcher._events import WorkerFailed, WorkerStopped
from notebook_launcher.errors import RemoteTraceback

from .helpers import Recorder

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

FAILING = 1  # the rank that misbehaves in every row


def _rank() -> int:
    return int(os.environ["RANK"])


def _others_wait() -> None:
    import torch.distributed as dist

    dist.barrier()


class CustomError(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"custom failure {code}")
        self.code = code


def raises_value_error() -> None:
    if _rank() == FAILING:
        time.sleep(0.2)  # the others are inside the barrier by now
        raise ValueError("bad value on purpose")
    _others_wait()


def raises_custom_error() -> None:
    if _rank() == FAILING:
        time.sleep(0.2)
        raise CustomError(7)
    _others_wait()


def raises_in_collective_after_work() -> None:
    import torch
    import torch.distributed as dist

    t = torch.ones(3)
    dist.all_reduce(t)
    if _rank() == FAILING:
        raise KeyError("missing key")
    dist.all_reduce(t)


def calls_sys_exit() -> None:
    if _rank() == FAILING:
        time.sleep(0.2)
        sys.exit(3)
    _others_wait()


def calls_os_exit() -> None:
    if _rank() == FAILING:
        time.sleep(0.2)
        os._exit(3)
    _others_wait()


def gets_sigkill() -> None:
    if _rank() == FAILING:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    _others_wait()


def segfaults() -> None:
    if _rank() == FAILING:
        time.sleep(0.2)
        ctypes.string_at(0)
    _others_wait()


def leaves_early() -> str:
    if _rank() == FAILING:
        return "I am done"
    _others_wait()
    return "never"


def returns_unpicklable() -> object:
    _others_wait()
    return threading.Lock() if _rank() == FAILING else 1


class Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("carries a lock")
        self.lock = threading.Lock()


def raises_unpicklable() -> None:
    if _rank() == FAILING:
        raise Unpicklable()
    _others_wait()


Row = tuple[Callable[..., object], type[BaseException], list[str]]

CRASH_TABLE: dict[str, Row] = {
    "raise-while-others-in-barrier": (raises_value_error, ValueError, ["bad value on purpose"]),
    "custom-exception-type": (raises_custom_error, CustomError, ["custom failure 7"]),
    "raise-between-collectives": (raises_in_collective_after_work, KeyError, ["missing key"]),
    "sys-exit": (calls_sys_exit, WorkerDied, ["rank 1", "exit code 3"]),
    "os-exit": (calls_os_exit, WorkerDied, ["rank 1", "exit code 3"]),
    "sigkill": (gets_sigkill, WorkerDied, ["rank 1", "SIGKILL(-9)"]),
    "segfault": (segfaults, WorkerDied, ["rank 1", "SIGSEGV(-11)", "Fatal Python error"]),
    "returns-while-others-wait": (
        leaves_early,
        ProcessGroupMismatch,
        ["rank(s) [1] returned", "rank(s) [0]"],
    ),
    "unpicklable-return": (
        returns_unpicklable,
        SerializationError,
        ["rank 1 returned a _thread.lock"],
    ),
    "unpicklable-exception": (raises_unpicklable, RankFailedError, ["rank 1", "Unpicklable"]),
}


@pytest.mark.parametrize("method", ["fork", "forkserver"])
@pytest.mark.parametrize("case", list(CRASH_TABLE))
def test_crash_table(case: str, method: str) -> None:
    fn, expected, fragments = CRASH_TABLE[case]
    rec = Recorder()
    with pytest.raises(expected) as info:
        notebook_launcher(fn, (), 2, start_method=method, dashboard=rec)
    text = str(info.value) + "\n".join(getattr(info.value, "__notes__", []))
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} missing from:\n{text}"
    failure = info.value.launch_failure  # type: ignore[attr-defined]
    assert failure.root_cause.rank == FAILING
    if failure.root_cause.kind in ("raised", "left"):
        cause = info.value.__cause__
        assert isinstance(cause, RemoteTraceback)
        if expected is not SerializationError:  # (a return value has no frame to show)
            assert fn.__name__ in cause.tb  # the user's frames...
            assert "_worker.py" not in cause.tb  # ...and none of the launcher's
    # The other rank is collateral or stopped, never blamed.
    assert all(f.rank != FAILING for f in failure.collateral)
    assert rec.of(WorkerStopped) or rec.of(WorkerFailed)
    # The next launch in the same process works.
    assert notebook_launcher(_rank, (), 2, start_method=method, dashboard=Recorder()) == [0, 1]


def rank0_blocked_in_barrier_rank1_raises() -> None:
    """Rank 0 sits in a C++ collective (ignores SIGINT/Python signals); rank 1 fails."""
    if _rank() == 1:
        time.sleep(0.3)
        raise RuntimeError("rank 1 broke")
    import torch.distributed as dist

    dist.barrier()


def test_collateral_errors_are_listed_not_blamed() -> None:
    with pytest.raises(RuntimeError, match="rank 1 broke") as info:
        notebook_launcher(rank0_blocked_in_barrier_rank1_raises, (), 3, dashboard=Recorder())
    failure = info.value.launch_failure  # type: ignore[attr-defined]
    assert failure.root_cause.rank == 1
    summary = failure.summary()
    assert summary.startswith("Root cause: rank 1 raised RuntimeError: rank 1 broke")
    notes = "\n".join(info.value.__notes__)
    assert "Raised on rank 1 of 3" in notes


def test_ipython_renders_the_remote_traceback() -> None:
    with pytest.raises(ValueError) as info:
        notebook_launcher(raises_value_error, (), 2, dashboard=Recorder())
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    rendered = "\n".join(cause._render_traceback_())
    assert "Traceback from rank 1" in rendered
    assert 'raise ValueError("bad value on purpose")' in rendered


def test_many_launches_do_not_leak() -> None:
    """200 launches in a row: no growth in threads, fds or child processes."""

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    notebook_launcher(_rank, (), 2, dashboard=Recorder())
    before = (fds(), threading.active_count())
    for _ in range(200):
        assert notebook_launcher(_rank, (), 2, dashboard=Recorder()) == [0, 1]
    after = (fds(), threading.active_count())
    assert after == before


def waits_while_peer_returns() -> None:
    from notebook_launcher import PartialState

    state = PartialState()
    if state.process_index == 1:
        return
    state.wait_for_everyone()  # the line the dashboard must point at


def test_barrier_a_peer_left_is_reported_with_its_call_site() -> None:
    from notebook_launcher._events import BarrierEnter

    rec = Recorder()
    with pytest.raises(ProcessGroupMismatch, match=r"rank\(s\) \[1\] returned"):
        notebook_launcher(waits_while_peer_returns, (), 2, dashboard=rec)
    enters = [e for e in rec.of(BarrierEnter) if e.rank == 0]
    assert len(enters) == 1 and enters[0].kind == "wait_for_everyone"
    line = waits_while_peer_returns.__code__.co_firstlineno + 6
    assert enters[0].location == f"test_crash_table.py:{line}"


def two_ranks_exit_together() -> None:
    import torch.distributed as dist

    dist.barrier()
    if _rank() > 0:
        os._exit(7)
    time.sleep(5)


@pytest.mark.timeout(90)
def test_forkserver_reports_every_exit_code_when_ranks_exit_together() -> None:
    """The forkserver may send several exit reports in one read: none may be lost (a lost
    one was taken for SIGKILL after a 2 s wait)."""
    for _ in range(5):
        with pytest.raises(WorkerDied) as info:
            notebook_launcher(
                two_ranks_exit_together, (), 3, start_method="forkserver", dashboard=Recorder()
            )
        records = info.value.launch_failure.failures  # type: ignore[attr-defined]
        died = {f.rank: f.exitcode for f in records if f.kind == "died"}
        assert died == {1: 7, 2: 7}, records


def test_forkserver_frames_split_across_reads_lose_no_message() -> None:
    """Two ranks exiting together send two reports in one read, and a report may arrive
    in two pieces: the codec shared by the client and the server keeps every message."""
    import socket

    from notebook_launcher._wire.forkserver import Exited, Forked, FrameReader, send

    ours, theirs = socket.socketpair()
    try:
        for msg in (Exited(11, 7), Exited(12, -9), Forked(13)):
            send(theirs, msg)
        theirs.close()
        data = b""
        while chunk := ours.recv(4096):
            data += chunk
    finally:
        ours.close()
    reader = FrameReader()
    assert reader.feed(data[:-3]) == [Exited(11, 7), Exited(12, -9)]
    assert reader.feed(data[-3:]) == [Forked(13)]
    assert reader.feed(b"") == []
