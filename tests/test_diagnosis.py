"""The root-cause rule and the exceptions it leads to, as tables: no process is started.

Each row of :data:`ROOT_CAUSES` is a set of per-rank records (what ranks reported), and
the verdict the launcher must reach from them. The crash table (``test_crash_table.py``)
proves the same rules with real processes.
"""

from __future__ import annotations

import pytest

from notebook_launcher import ProcessGroupMismatch, RankFailedError, SerializationError, WorkerDied
from notebook_launcher._events import BarrierEnter, BarrierExit, WorkerFinished
from notebook_launcher._launch.diagnosis import (
    Stranded,
    Verdict,
    diagnose,
    exception_for,
    summary_line,
)
from notebook_launcher._launch.record import BarrierTracker, last_words
from notebook_launcher._serialization import dump_exception
from notebook_launcher.errors import RankFailure

pytestmark = pytest.mark.unit  # the tier: see tests/conftest.py


def raised(rank: int, t: float, exc: str = "ValueError", collateral: bool = False) -> RankFailure:
    return RankFailure(
        rank,
        "raised",
        100 + rank,
        exc,
        f"{exc} on {rank}",
        f"tb of {rank}",
        collateral=collateral,
        time=t,
    )


def died(rank: int, t: float, code: int = -9, sig: str | None = "SIGKILL") -> RankFailure:
    return RankFailure(rank, "died", 100 + rank, exitcode=code, signal_name=sig, time=t)


def stopped(rank: int, t: float) -> RankFailure:
    return RankFailure(rank, "stopped", 100 + rank, time=t)


GLOO = "RuntimeError"  # what a peer gets from gloo when the other side went away
WAITER = BarrierEnter(0, 2, "train.py:7", "wait_for_everyone", 10.0)

# name: (failures, finished_at, stranded, expected kind, expected root-cause rank)
ROOT_CAUSES: dict[
    str, tuple[list[RankFailure], dict[int, float], Stranded | None, str, int | None]
] = {
    "all returned": ([], {0: 1.0, 1: 1.1}, None, "ok", None),
    "one raised, the other collateral": (
        [raised(1, 1.0), raised(0, 1.1, GLOO, collateral=True)],
        {},
        None,
        "raised",
        1,
    ),
    "collateral arrived first, own error still wins": (
        [raised(0, 0.5, GLOO, collateral=True), raised(1, 1.0)],
        {},
        None,
        "raised",
        1,
    ),
    "earliest of two raised": (
        [raised(2, 2.0), raised(1, 1.0), stopped(0, 2.5)],
        {},
        None,
        "raised",
        1,
    ),
    "raised beats died": ([died(0, 0.5), raised(1, 1.0)], {}, None, "raised", 1),
    "died, the peer collateral": (
        [died(1, 1.0), raised(0, 1.2, GLOO, collateral=True)],
        {},
        None,
        "died",
        1,
    ),
    "earliest death": ([died(2, 2.0, 3, None), died(1, 1.0)], {}, None, "died", 1),
    "only collateral, a peer had returned": (
        [raised(0, 2.0, GLOO, collateral=True)],
        {1: 1.5},
        None,
        "left",
        1,
    ),
    "only collateral, nobody returned": (
        [raised(1, 2.0, GLOO, collateral=True), raised(0, 1.0, GLOO, collateral=True)],
        {},
        None,
        "raised",
        0,
    ),
    "stranded in a barrier, the waiter stopped": (
        [stopped(0, 11.0)],
        {1: 10.5},
        Stranded(WAITER, (1,)),
        "left",
        1,
    ),
    "stranded, but a rank raised": (
        [raised(2, 10.8), stopped(0, 11.0)],
        {1: 10.5},
        Stranded(WAITER, (1,)),
        "raised",
        2,
    ),
    "interrupted: only stopped ranks": ([stopped(0, 1.0), stopped(1, 1.0)], {}, None, "ok", None),
}


@pytest.mark.parametrize("name", list(ROOT_CAUSES))
def test_root_cause(name: str) -> None:
    failures, finished_at, stranded, kind, rank = ROOT_CAUSES[name]
    verdict = diagnose(failures, finished_at, stranded)
    assert verdict.kind == kind
    assert (verdict.cause.rank if verdict.cause else None) == rank
    times = [f.time for f in verdict.failures]
    assert times == sorted(times)  # every record, in time order
    assert {id(f) for f in failures} <= {id(f) for f in verdict.failures}


def test_a_left_verdict_records_who_left_and_where_the_others_wait() -> None:
    v = diagnose([stopped(0, 11.0)], {1: 10.5}, Stranded(WAITER, (1,)))
    assert v.cause is not None and v.cause.kind == "left" and v.cause.time == 10.5
    assert v.cause.describe() == (
        "rank 1 returned while rank 0 still waited for it at train.py:7 "
        "(wait_for_everyone, barrier #2)"
    )
    assert v.cause in v.failures and v.failed_ranks == (1,)


class Custom(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"custom {code}")
        self.code = code


# name: (verdict, exc_data for the root rank, expected type, phrases in the message)
def _exceptions() -> dict[str, tuple[Verdict, bytes | None, type, list[str]]]:
    own = raised(1, 1.0, "tests.test_diagnosis.Custom")
    return {
        "own type, rebuilt": (diagnose([own], {}), dump_exception(Custom(7)), Custom, ["custom 7"]),
        "own type lost": (
            diagnose([own], {}),
            None,
            RankFailedError,
            ["rank 1 raised tests.test_diagnosis.Custom", "Root cause"],
        ),
        "serialization": (
            diagnose([raised(0, 1.0, "notebook_launcher.errors.SerializationError")], {}),
            None,
            SerializationError,
            ["rank 0 raised"],
        ),
        "killed": (
            diagnose([died(1, 1.0)], {}),
            None,
            WorkerDied,
            ["rank 1 of 2 died without raising", "SIGKILL(-9)", "out of memory"],
        ),
        "exit code": (
            diagnose([died(1, 1.0, 3, None)], {}),
            None,
            WorkerDied,
            ["exit code 3"],
        ),
        "stranded": (
            diagnose([stopped(0, 11.0)], {1: 10.5}, Stranded(WAITER, (1,))),
            None,
            ProcessGroupMismatch,
            ["rank(s) [1] returned", "rank 0 still waited for them at train.py:7"],
        ),
        "returned while peers waited": (
            diagnose([raised(0, 2.0, GLOO, collateral=True)], {1: 1.5}),
            None,
            ProcessGroupMismatch,
            ["rank(s) [1] returned", "rank(s) [0] still waited for them in a collective"],
        ),
    }


@pytest.mark.parametrize("name", list(_exceptions()))
def test_exception_for(name: str) -> None:
    verdict, data, cls, phrases = _exceptions()[name]
    assert verdict.cause is not None
    exc = exception_for(verdict, 2, {verdict.cause.rank: data})
    assert type(exc) is cls
    text = str(exc) + "".join(getattr(exc, "__notes__", []))
    for phrase in phrases:
        assert phrase in text, (phrase, text)
    report = exc.launch_failure  # type: ignore[attr-defined]
    assert report.root_cause is verdict.cause
    assert exc.__cause__ is None  # no header pair of a separate "remote" exception


def test_exception_for_refuses_a_good_run() -> None:
    with pytest.raises(ValueError):
        exception_for(diagnose([], {0: 1.0}), 1)


def test_summary_lines() -> None:
    assert summary_line(diagnose([], {0: 1.0}), 2) == "all 2 ranks finished"
    assert summary_line(diagnose([stopped(0, 1.0)], {}), 2, interrupted=True) == (
        "interrupted: all 2 ranks stopped"
    )
    assert (
        summary_line(diagnose([raised(1, 1.0)], {}), 2)
        == "rank 1 raised ValueError: ValueError on 1"
    )


def test_barrier_tracker_finds_a_rank_stranded_by_a_peer_that_returned() -> None:
    """NCCL does not notice a peer that left: the barrier events must. Rank 0 waits in
    barrier #2; rank 1 returned after entering only 2 barriers (#0, #1): it never comes."""
    tracker = BarrierTracker()
    assert not tracker.on_event(WorkerFinished(1, 10.0, barriers=3))  # passed #0..#2
    assert not tracker.on_event(BarrierEnter(0, 2, "train.py:7", "wait_for_everyone", 10.0))
    assert tracker.stranded is None

    tracker = BarrierTracker()
    assert not tracker.on_event(BarrierEnter(0, 2, "train.py:7", "wait_for_everyone", 10.0))
    assert tracker.on_event(WorkerFinished(1, 10.5, barriers=2))  # the launcher stops now
    assert tracker.stranded == Stranded(
        BarrierEnter(0, 2, "train.py:7", "wait_for_everyone", 10.0), (1,)
    )
    assert not tracker.on_event(WorkerFinished(1, 10.6, barriers=2))  # reported once

    tracker = BarrierTracker()
    tracker.on_event(BarrierEnter(0, 2, "train.py:7", "wait_for_everyone", 10.0))
    tracker.on_event(BarrierExit(0, 2, "train.py:7", 10.2))  # it got through
    assert not tracker.on_event(WorkerFinished(1, 10.5, barriers=2))


def test_last_words_start_at_a_fatal_error_banner() -> None:
    lines = [f"line {i}\n" for i in range(40)] + ["Fatal Python error: Segmentation fault\n", "x\n"]
    assert last_words(lines).startswith("Fatal Python error")
    assert last_words([f"{i}\n" for i in range(40)]).splitlines()[0] == "15"


# --- restarts: which failed attempts start again (max_restarts) -------------------------------


RESTARTS = [
    # (records, restart_on_exception, restarts?)
    ([died(1, 1.0)], False, True),
    ([raised(1, 1.0, "builtins.KeyError")], False, False),
    ([raised(1, 1.0, "builtins.KeyError")], True, True),
    ([raised(1, 1.0, "builtins.KeyError")], (KeyError,), True),
    ([raised(1, 1.0, "builtins.KeyError")], (ValueError, OSError), False),
    ([raised(0, 1.0, "RuntimeError", collateral=True)], False, True),  # a peer vanished
    ([raised(1, 1.0, "builtins.KeyboardInterrupt")], True, False),  # interrupted elsewhere
]


@pytest.mark.parametrize(("records", "on_exception", "expected"), RESTARTS)
def test_restart_policy(records: list[RankFailure], on_exception: object, expected: bool) -> None:
    from notebook_launcher._launch.diagnosis import RestartPolicy

    verdict = diagnose(records, {})
    exc_data = {1: dump_exception(KeyError("k"))}
    policy = RestartPolicy(3, on_exception)  # type: ignore[arg-type]
    assert policy.restarts(verdict, exc_data) is expected


def test_a_rank_that_left_never_restarts() -> None:
    from notebook_launcher._launch.diagnosis import RestartPolicy

    verdict = diagnose([raised(1, 2.0, "RuntimeError", collateral=True)], {0: 1.0})
    assert verdict.kind == "left"
    assert not RestartPolicy(3, True).restarts(verdict, {})


# --- the same failure on several ranks is not collateral -------------------------------------


def same(rank: int, t: float) -> RankFailure:
    return RankFailure(rank, "raised", exc_type="ModuleNotFoundError", message="No module", time=t)


# name: (failures, the summary's phrases, phrases it must not have)
SUMMARIES: dict[str, tuple[list[RankFailure], list[str], list[str]]] = {
    "the same error on both ranks, each its own": (
        [same(1, 1.0), same(0, 1.01)],
        ["Root cause: rank 1 raised", "The same failure on ranks 0 and 1: each raised it"],
        ["Collateral"],
    ),
    "another error of its own": (
        [raised(1, 1.0), raised(0, 1.1, "KeyError"), raised(2, 1.2, GLOO, collateral=True)],
        [
            "Also failed, on their own (separate errors, not consequences):\n  - rank 0 raised KeyError",
            "Collateral (a consequence of the root cause, not a separate bug):\n  - rank 2 raised",
        ],
        ["The same failure"],
    ),
    "a peer's connection closed is collateral": (
        [raised(1, 1.0), raised(0, 1.1, GLOO, collateral=True), stopped(2, 1.2)],
        ["Collateral", "Stopped by the launcher: ranks [2]"],
        ["The same failure", "Also failed"],
    ),
}


@pytest.mark.parametrize("name", list(SUMMARIES))
def test_only_consequences_are_collateral(name: str) -> None:
    failures, phrases, absent = SUMMARIES[name]
    verdict = diagnose(failures, {})
    exc = exception_for(verdict, 3, {})
    report = exc.launch_failure  # type: ignore[attr-defined]
    summary = report.summary()
    for phrase in phrases:
        assert phrase in summary, (phrase, summary)
    for phrase in absent:
        assert phrase not in summary, (phrase, summary)
    if name.startswith("the same"):
        assert report.same_failure == [0, 1] and report.collateral == []
        assert "Raised on ranks 0 and 1 (the same error) of 3" in str(exc)


# --- what the notebook shows of remote ranks and collateral errors ---------------------------

GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:19846. This is typically caused by a remote worker crashing. Check "
    "the logs of the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f"
)


def test_a_collateral_error_says_its_first_sentence() -> None:
    """torch's boilerplate after it ("... GLHF!" and an emoji that renders as a box) is
    noise in the list of collateral failures and in a left rank's verdict."""
    peer = RankFailure(0, "raised", 11, "RuntimeError", GLOO_PEER_GONE, collateral=True)
    assert peer.describe() == (
        "rank 0 raised RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/"
        "tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:19846."
    )
    own = RankFailure(1, "raised", 12, "ValueError", "Bad value. Fix It.")
    assert own.describe() == "rank 1 raised ValueError: Bad value. Fix It."  # its own: whole
    waiting = RankFailure(
        0, "raised", 11, "RuntimeError", GLOO_PEER_GONE, collateral=True, time=2.0
    )
    text = str(exception_for(diagnose([waiting], {1: 1.0}), 2))  # rank 1 left, rank 0 waited
    assert "returned from the function while rank(s) [0] still waited" in text, text
    assert "GLHF" not in text and "Connection closed by peer [127.0.0.1]:19846.)" in text, text


def test_a_remote_ranks_traceback_gets_its_source_lines_here() -> None:
    """A rank on another node, or a session's rank started before the cell ran, has no copy
    of the cell: its traceback comes without source lines. The kernel has them (IPython
    keeps every cell in ``linecache``), so the dashboard shows them, as a local launch's."""
    import linecache

    from notebook_launcher.ui.model import notebook_cell_traceback

    cell = "/tmp/ipykernel_4242/3141592653.py"  # how ipykernel names cell 7's code
    linecache.cache[cell] = (40, None, ["def train():\n", "    return 1 / 0\n"], cell)
    try:
        remote = (
            "Traceback (most recent call last):\n"
            f'  File "{cell}", line 2, in train\n'
            "ZeroDivisionError: division by zero\n"
        )
        shown = notebook_cell_traceback(remote).splitlines()
        assert shown[1].endswith("line 2, in train")
        assert shown[2] == "    return 1 / 0"
        assert shown[3] == "ZeroDivisionError: division by zero"
    finally:
        del linecache.cache[cell]
