"""The crash table: every way a rank can fail, with real processes.

Each row: the right exception in the caller (that very class, also when the notebook
defined it), naming the rank and the cause or the stage that failed, the failing rank's
frames in its traceback after the caller's, short notes, the other ranks stopped, nothing
left behind (the autouse ``no_leftovers`` fixture), and the next launch in the same
process works.

Rows cover every stage a task passes (as loky's ``crash_cases`` do): the function and its
arguments unpickled in the rank (forkserver, spawn), the function running, its result or
exception pickled there, and unpickled in the kernel.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from notebook_launcher import (
    ProcessGroupMismatch,
    RankFailedError,
    SerializationError,
    WorkerDied,
    notebook_launcher,
)
from notebook_launcher._events import WorkerFailed, WorkerStopped
from notebook_launcher._serialization import safe_str

from .helpers import Recorder

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]

FAILING = 1  # the rank that misbehaves in every row


def _rank() -> int:
    return int(os.environ["RANK"])


T = TypeVar("T")


def in_notebook(obj: T) -> T:
    """As if defined in a notebook cell: in ``__main__``, so cloudpickle ships it by value
    (and a class comes back as the kernel's own only if its identity is kept)."""
    for member in [obj, *vars(obj).values()] if isinstance(obj, type) else [obj]:
        if callable(member) and hasattr(member, "__module__"):
            member.__module__ = "__main__"
    return obj


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


def calls_sys_exit_0() -> None:
    """Exit code 0, yet no value came back: not a success (issue 25 item 9)."""
    if _rank() == FAILING:
        time.sleep(0.2)
        sys.exit(0)
    _others_wait()


def calls_os_exit_0() -> None:
    if _rank() == FAILING:
        time.sleep(0.2)
        os._exit(0)
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


@in_notebook
class NotebookError(Exception):
    pass


@in_notebook
def raises_notebook_error() -> None:
    if _rank() == FAILING:
        time.sleep(0.2)
        raise NotebookError("defined in a cell")
    _others_wait()


@in_notebook
class NeedsTwo(Exception):
    def __init__(self, a: int, b: str) -> None:
        super().__init__(f"{a} and {b}")  # args alone cannot call __init__ again
        self.a, self.b = a, b


@in_notebook
def raises_needs_two() -> None:
    if _rank() == FAILING:
        raise NeedsTwo(3, "x")
    _others_wait()


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


def raises_bad_str() -> None:
    if _rank() == FAILING:
        raise BadStr()
    _others_wait()


def raises_huge_message() -> None:
    if _rank() == FAILING:
        raise ValueError("x" * (20 * 2**20))
    _others_wait()


class ReduceRaises(Exception):
    def __reduce__(self) -> Any:
        raise RuntimeError("this class refuses to be pickled")


def raises_reduce_raises() -> None:
    if _rank() == FAILING:
        raise ReduceRaises("boom")
    _others_wait()


def _load(where: str) -> object:
    in_rank = os.environ.get("RANK")
    if (where == "kernel" and in_rank == str(FAILING)) or (where == "ranks" and not in_rank):
        raise RuntimeError(f"loads only in the {where}")
    return LoadsOnlyIn(where)


class LoadsOnlyIn:
    """Pickles anywhere; unpickling raises outside ``where`` (the kernel or the ranks)."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __reduce__(self) -> tuple[Any, ...]:
        return (_load, (self.where,))


KERNEL_ONLY = LoadsOnlyIn("kernel")


@in_notebook
def uses_a_kernel_only_global() -> None:
    assert KERNEL_ONLY is not None  # shipped with the function: rank 1 cannot load it
    _others_wait()


def returns_what_only_ranks_load() -> object:
    _others_wait()
    return LoadsOnlyIn("ranks") if _rank() == FAILING else 1


class CarriesRankOnly(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.payload = LoadsOnlyIn("ranks")


def raises_what_only_ranks_load() -> None:
    if _rank() == FAILING:
        raise CarriesRankOnly("cannot come back")
    _others_wait()


Row = tuple[Callable[..., object], type[BaseException], list[str]]
EXITED_0 = "It exited with code 0 before returning a value (sys.exit() or os._exit() inside"

CRASH_TABLE: dict[str, Row] = {
    "raise-while-others-in-barrier": (raises_value_error, ValueError, ["bad value on purpose"]),
    "custom-exception-type": (raises_custom_error, CustomError, ["custom failure 7"]),
    "raise-between-collectives": (raises_in_collective_after_work, KeyError, ["missing key"]),
    "sys-exit": (calls_sys_exit, WorkerDied, ["rank 1", "exit code 3"]),
    "os-exit": (calls_os_exit, WorkerDied, ["rank 1", "exit code 3"]),
    "sys-exit-0": (calls_sys_exit_0, WorkerDied, ["rank 1", "exit code 0", EXITED_0]),
    "os-exit-0": (calls_os_exit_0, WorkerDied, ["rank 1", "exit code 0", EXITED_0]),
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
    "unpicklable-exception": (
        raises_unpicklable,
        RankFailedError,
        ["rank 1 raised tests.test_crash_table.Unpicklable", "its attribute 'lock'"],
    ),
    "notebook-exception-class": (raises_notebook_error, NotebookError, ["defined in a cell"]),
    "init-with-required-args": (raises_needs_two, NeedsTwo, ["3 and x", "Raised on rank 1"]),
    "str-raises": (raises_bad_str, BadStr, ["rank 1 raised tests.test_crash_table.BadStr"]),
    "huge-message": (raises_huge_message, ValueError, ["more characters]"]),
    "exception-reduce-raises": (
        raises_reduce_raises,
        RankFailedError,
        ["rank 1 raised tests.test_crash_table.ReduceRaises: boom", "refuses to be pickled"],
    ),
    "task-unpickle-fails-in-rank": (
        uses_a_kernel_only_global,
        SerializationError,
        ["rank 1 could not unpickle the launched function", "loads only in the kernel"],
    ),
    "result-unpickle-fails-in-kernel": (
        returns_what_only_ranks_load,
        SerializationError,
        ["the result of rank 1 could not be unpickled in the kernel", "loads only in the ranks"],
    ),
    "exception-unpickle-fails-in-kernel": (
        raises_what_only_ranks_load,
        RankFailedError,
        [
            "rank 1 raised tests.test_crash_table.CarriesRankOnly: cannot come back",
            "could not be unpickled in the kernel",
            "loads only in the ranks",
        ],
    ),
}
#: start methods per row: fork inherits the task (nothing to unpickle in the rank); the rows
#: about classes and pickling stages also run under spawn (a fresh interpreter)
METHODS: dict[str, tuple[str, ...]] = {
    "task-unpickle-fails-in-rank": ("forkserver", "spawn"),
    "sys-exit-0": ("fork",),  # the kernel's judgement, the same for every start method
    "os-exit-0": ("forkserver",),
    **{
        case: ("fork", "forkserver", "spawn")
        for case in (
            "notebook-exception-class",
            "init-with-required-args",
            "result-unpickle-fails-in-kernel",
            "exception-unpickle-fails-in-kernel",
        )
    },
}
#: rows whose failure has no frame of the function (a stage before or after it ran)
NO_USER_FRAME = {
    "unpicklable-return",
    "task-unpickle-fails-in-rank",
    "result-unpickle-fails-in-kernel",
}
CASES = [
    pytest.param(case, method, id=f"{case}-{method}")
    for case in CRASH_TABLE
    for method in METHODS.get(case, ("fork", "forkserver"))
]


@pytest.mark.parametrize(("case", "method"), CASES)
def test_crash_table(case: str, method: str) -> None:
    fn, expected, fragments = CRASH_TABLE[case]
    rec = Recorder()
    with pytest.raises(expected) as info:
        notebook_launcher(fn, (), 2, start_method=method, dashboard=rec)
    exc = info.value
    assert type(exc) is expected  # the very class, also one the notebook defined
    notes = "\n".join(getattr(exc, "__notes__", []))
    text = safe_str(exc) + notes
    for fragment in fragments:
        assert fragment in text, f"{fragment!r} missing from:\n{text[:5000]}"
    assert len(notes) < 5000  # a long message is not repeated in the notes
    failure = exc.launch_failure  # type: ignore[attr-defined]
    assert failure.root_cause.rank == FAILING
    if failure.root_cause.kind == "raised":
        _assert_reads_like_a_local_traceback(exc, None if case in NO_USER_FRAME else fn)
    # The other rank is collateral or stopped, never blamed.
    assert all(f.rank != FAILING for f in failure.collateral)
    assert rec.of(WorkerStopped) or rec.of(WorkerFailed)
    # The next launch in the same process works.
    assert notebook_launcher(_rank, (), 2, start_method=method, dashboard=Recorder()) == [0, 1]


def _assert_reads_like_a_local_traceback(exc: BaseException, fn: Callable[..., Any] | None) -> None:
    """The caller's frame, then the rank's (the user's function among them), with the
    launcher's own frames marked for IPython and pytest to hide; no "remote" exception
    in front of it."""
    assert exc.__cause__ is None or not type(exc.__cause__).__name__.startswith("Remote")
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    names = [t.tb_frame.f_code.co_name for t in frames]
    assert names[0] == "test_crash_table", names
    if fn is not None:
        assert fn.__name__ in names, names
    package = os.path.dirname(notebook_launcher.__code__.co_filename)
    for t in frames[:-1]:  # (IPython always shows the frame that raised)
        if t.tb_frame.f_code.co_filename.startswith(package):
            assert t.tb_frame.f_locals.get("__tracebackhide__"), t.tb_frame.f_code
    assert not any("_worker" in t.tb_frame.f_code.co_filename for t in frames)


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


def killed_from_outside_while_the_others_are_stopped() -> None:
    """Rank 1 is killed (SIGKILL: the OOM killer) while the kernel stops the ranks: its
    peers' collateral errors can reach the kernel before its death does, when its process
    takes a while to end after its sockets closed. Here: rank 0's collateral error comes
    first, and rank 1, deaf to the kernel's SIGTERM, is SIGKILLed before the grace
    period ends."""
    if _rank() == 0:
        raise RuntimeError("[gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_kill_we_did_not_send_is_a_death_even_while_we_stop_the_ranks() -> None:
    with pytest.raises(WorkerDied, match="rank 1 of 2 died") as info:
        notebook_launcher(
            killed_from_outside_while_the_others_are_stopped,
            (),
            2,
            dashboard=Recorder(),
            grace_period=5.0,
        )
    failure = info.value.launch_failure  # type: ignore[attr-defined]
    assert (failure.root_cause.rank, failure.root_cause.kind) == (1, "died")
    assert failure.root_cause.signal_name == "SIGKILL"


def test_the_rank_traceback_renders_like_a_local_one() -> None:
    """IPython's own renderer (what a kernel calls) shows the rank's line where it raised,
    after the caller's, with the launcher's frame folded; no "remote" header."""
    from IPython.core.ultratb import VerboseTB

    with pytest.raises(ValueError) as info:
        notebook_launcher(raises_value_error, (), 2, dashboard=Recorder())
    exc = info.value
    text = "\n".join(
        VerboseTB(theme_name="nocolor").structured_traceback(type(exc), exc, exc.__traceback__)
    )
    assert "Remote" not in text
    assert "[... skipping hidden 1 frame]" in text  # notebook_launcher() itself
    assert 'raise ValueError("bad value on purpose")' in text
    assert text.index("notebook_launcher(raises_value_error") < text.index("in raises_value_error")
    lines = text.rstrip().splitlines()  # the error line, then the short note
    at = lines.index("ValueError: bad value on purpose")
    assert lines[at + 1] == "Raised on rank 1 of 2." and len(lines) - at <= 8, lines[at:]


def test_many_launches_do_not_leak() -> None:
    """100 launches in a row: no growth in threads, fds or child processes (a leak of one
    per launch shows as 100; bench/soak.py runs 1000)."""

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    notebook_launcher(_rank, (), 2, dashboard=Recorder())
    before = (fds(), threading.active_count())
    for _ in range(100):
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
    import signal

    import torch.distributed as dist

    if _rank() > 0:  # the stop that the first exit seen brings must not reach the other
        # exiting rank before its os._exit(7) (a loaded machine: it was "stopped")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
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


def every_rank_misses_a_module() -> None:
    """Each rank meets the same bug on its own (a missing module): with SIGTERM held back,
    both report it before the launcher can stop the second one."""
    import torch.distributed as dist

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.barrier()
    import no_such_module_for_the_crash_table  # noqa: F401


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_the_same_error_on_every_rank_is_one_failure_not_collateral(method: str) -> None:
    with pytest.raises(ModuleNotFoundError) as info:
        notebook_launcher(
            every_rank_misses_a_module, (), 2, start_method=method, dashboard=Recorder()
        )
    failure = info.value.launch_failure  # type: ignore[attr-defined]
    assert failure.same_failure == [0, 1] and failure.collateral == []
    summary = failure.summary()
    assert "The same failure on ranks 0 and 1" in summary and "Collateral" not in summary
    assert "Raised on ranks 0 and 1 (the same error) of 2" in "\n".join(info.value.__notes__)
