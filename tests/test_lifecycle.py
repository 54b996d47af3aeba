"""How a run ended, decided from its frozen records alone: ``lifecycle.decide`` as a table.

Every way of running ranks (a launch's attempt, a session's start, a session's task, a
cluster's ranks) ends in a ``RunEnd``; one pure function turns it into the outcome the view
shows (``LaunchFinished``) and the caller gets (results, or the exception). No process here.
"""

from __future__ import annotations

from typing import Any

import pytest

from notebook_launcher import ProcessGroupMismatch, SessionBroken, WorkerDied
from notebook_launcher._launch.lifecycle import (
    RunEnd,
    decide,
    finished_event,
    value_of,
)
from notebook_launcher._serialization import dump_exception, dumps
from notebook_launcher.errors import LaunchError, RankFailedError, RankFailure

pytestmark = pytest.mark.unit

T = 1000.0


def raised(
    rank: int, t: float = T, collateral: bool = False, exc: str = "ValueError"
) -> RankFailure:
    return RankFailure(rank, "raised", 100 + rank, exc, "boom", time=t, collateral=collateral)


def died(rank: int, t: float = T) -> RankFailure:
    return RankFailure(rank, "died", 100 + rank, exitcode=-9, signal_name="SIGKILL", time=t)


def stopped(rank: int, t: float = T + 1) -> RankFailure:
    return RankFailure(rank, "stopped", 100 + rank, time=t)


def end(purpose: str = "launch", ranks: tuple[int, ...] = (0, 1), **kw: Any) -> RunEnd:
    kw.setdefault("world_size", 2)
    return RunEnd(purpose, ranks, **kw)


# purpose / what happened -> (kind, ok, summary, root cause rank, what the caller gets)
TABLE = [
    pytest.param(
        end(results={0: "a", 1: "b"}, finished_at={0: T, 1: T}),
        ("ok", True, "all 2 ranks finished", None, ["a", "b"]),
        id="launch-ok",
    ),
    pytest.param(
        end(results={0: 1}, failures=(raised(1), stopped(0)), stop_kind="failed"),
        ("failed", False, "rank 1 raised ValueError: boom", 1, RankFailedError),  # no data
        id="launch-a-rank-raised",
    ),
    pytest.param(
        end(failures=(died(0, T + 2), raised(1, T + 1, collateral=True))),
        ("failed", False, "rank 0 (pid 100) died: killed by SIGKILL(-9)", 0, WorkerDied),
        id="launch-a-death-before-collateral",
    ),
    pytest.param(
        end(failures=(stopped(0), stopped(1)), stop_kind="interrupted", interrupted=True),
        ("interrupted", False, "interrupted: all 2 ranks stopped", None, KeyboardInterrupt),
        id="launch-interrupted",
    ),
    pytest.param(
        end(failures=(raised(1), stopped(0)), interrupted=True, restarts=2),
        (
            "interrupted",
            False,
            "interrupted: all 2 ranks stopped (after 2 restarts)",
            None,
            KeyboardInterrupt,
        ),
        id="launch-interrupted-after-restarts-and-a-failure",
    ),
    pytest.param(
        end(start_error=KeyboardInterrupt()),
        ("interrupted", False, "interrupted while starting", None, KeyboardInterrupt),
        id="launch-interrupted-while-starting",
    ),
    pytest.param(
        end(start_error=LaunchError("the nodes never met\nmore")),
        ("not started", False, "LaunchError: the nodes never met", None, LaunchError),
        id="launch-could-not-start",
    ),
    pytest.param(
        end(results={0: 1}),
        ("short", False, "ranks [1] ended without a result", None, LaunchError),
        id="launch-never-a-short-list",
    ),
    pytest.param(
        end(
            failures=(
                RankFailure(
                    2,
                    "raised",
                    exc_type="builtins.KeyboardInterrupt",
                    message="interrupted on node 1",
                    time=T,
                ),
                stopped(0),
            ),
            world_size=4,
        ),
        (
            "failed",
            False,
            "rank 2 raised builtins.KeyboardInterrupt: interrupted on node 1",
            2,
            RankFailedError,
        ),
        id="launch-interrupted-on-another-node",
    ),
    pytest.param(
        end("start", results={0: None, 1: None}),
        ("ready", True, "2 ranks ready", None, [None, None]),
        id="session-start-ready",
    ),
    pytest.param(
        end("start", results={0: None}, failures=(died(1),)),
        ("failed", False, "rank 1 (pid 101) died: killed by SIGKILL(-9)", 1, WorkerDied),
        id="session-start-a-rank-died",
    ),
    pytest.param(
        end("start", results={0: None}),
        ("short", False, "the session's ranks ended while starting", None, LaunchError),
        id="session-start-ended-short",
    ),
    pytest.param(
        end("task", ranks=(1, 0), results={0: "zero", 1: "one"}),
        ("ok", True, "all 2 ranks finished", None, ["one", "zero"]),
        id="task-values-in-the-order-asked",
    ),
    pytest.param(
        end("task", ranks=(1,), failures=(stopped(1),), interrupted=True, world_size=4),
        (
            "interrupted",
            False,
            "interrupted: ranks [1] stopped their task; the session lives on",
            None,
            KeyboardInterrupt,
        ),
        id="task-interrupted",
    ),
    pytest.param(
        end("task", failures=(stopped(0),), interrupted=True, broken="rank 1 died"),
        ("broken", False, "interrupted: all 2 ranks stopped", None, SessionBroken),
        id="task-interrupted-but-broken",
    ),
    pytest.param(
        end("task", ranks=(0,), mismatch="rank 0 waits in barrier at x.py:3. Run it on every rank"),
        ("mismatch", False, "rank 0 waits in barrier at x.py:3", None, ProcessGroupMismatch),
        id="task-mismatch",
    ),
    pytest.param(
        end("task", results={0: 1, 1: 2}, broken="rank 1 did not stop"),
        ("broken", False, "the session broke: rank 1 did not stop", None, SessionBroken),
        id="task-broken-after-answers",
    ),
    pytest.param(
        end("task", results={0: 1}, closing=True),
        ("closed", False, "the session was closed while the task ran", None, LaunchError),
        id="task-closed",
    ),
]


@pytest.mark.parametrize(("run_end", "expected"), TABLE)
def test_decide(run_end: RunEnd, expected: tuple[Any, ...]) -> None:
    kind, ok, summary, root, value = expected
    outcome = decide(run_end)
    assert (outcome.kind, outcome.ok, outcome.summary, outcome.root_cause_rank) == (
        kind,
        ok,
        summary,
        root,
    )
    got = value_of(run_end, outcome)
    if isinstance(value, list):
        assert got == value
    else:
        assert isinstance(got, value), got
    event = finished_event(run_end, outcome, now=T + 5)
    assert (event.ok, event.summary, event.root_cause_rank) == (ok, summary, root)


def test_a_verdict_reached_with_every_node_wins_over_this_nodes_records() -> None:
    """A launch across nodes judges with every node's reports: the end carries that
    verdict, and this node's records (fine here) do not overrule it."""
    from notebook_launcher._launch.diagnosis import diagnose

    elsewhere = diagnose([raised(3)], {})
    run_end = end(results={0: 1, 1: 1}, world_size=4, verdict=elsewhere)
    outcome = decide(run_end)
    assert outcome.kind == "failed" and outcome.root_cause_rank == 3


def test_the_ranks_own_exception_comes_back_with_its_message() -> None:
    try:
        raise KeyError("rank 1's own")
    except KeyError as exc:
        data = dump_exception(exc)
    run_end = end(
        failures=(RankFailure(1, "raised", 101, "builtins.KeyError", "'rank 1'", time=T),),
        exc_data={1: data},
    )
    got = value_of(run_end, decide(run_end))
    assert isinstance(got, KeyError) and got.args == ("rank 1's own",)
    assert any("Raised on rank 1 of 2" in note for note in got.__notes__)


def test_a_start_that_failed_names_no_failed_ranks() -> None:
    run_end = end(start_error=OSError("no fds"), failures=(stopped(0),))
    assert finished_event(run_end, decide(run_end)).failed_ranks == ()


# ---- the group contract (issue 27's seam): both groups keep it --------------------------


def _members(protocol: type) -> set[str]:
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n in vars(protocol) if not n.startswith("_")}
    return names


@pytest.mark.parametrize(
    ("protocol", "kind"),
    [
        ("Group", "notebook_launcher._launch.group.WorkerGroup"),
        ("Group", "notebook_launcher._launch.remote.RemoteGroup"),
        ("RankHandle", "notebook_launcher._launch.group.WorkerProcess"),
        ("RankHandle", "notebook_launcher._launch.remote.RemoteRank"),
    ],
)
def test_every_group_and_rank_handle_keeps_the_contract(protocol: str, kind: str) -> None:
    """What GroupRun relies on, written down in _launch/contract.py (mypy holds the groups
    to it where they are made; this holds the rank handles and the names at run time)."""
    import importlib
    import inspect

    from notebook_launcher._launch import contract

    module, _, name = kind.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    proto = getattr(contract, protocol)
    fields = set(getattr(cls, "__dataclass_fields__", {}))
    missing = [m for m in _members(proto) if not hasattr(cls, m) and m not in fields]
    assert missing == [], f"{name} lacks {missing} of contract.{protocol}"
    for member in _members(proto):
        expected = getattr(proto, member, None)
        actual = getattr(cls, member, None)
        if inspect.isfunction(expected) and inspect.isfunction(actual):
            want = list(inspect.signature(expected).parameters)
            assert list(inspect.signature(actual).parameters) == want, (name, member)


def _chatty(n: int, every: float) -> list[tuple[float, str, bool]]:
    return [(i * every, "stdout" if i % 2 else "conn", False) for i in range(n)]


@pytest.mark.parametrize(
    ("looks", "paced"),
    [
        # (seconds after the first look, what it brought, whether it was paced) ...
        ([(0.0, "stdout", False)], False),  # one line: the next look is not held back
        (_chatty(4, 0.01), False),  # a launch's start (joining, running): not chatty
        (_chatty(8, 0.01), True),  # lines and progress, 100 looks a second: chatty
        (_chatty(8, 0.05), False),  # 20 looks a second: not worth pacing
        ([*_chatty(8, 0.01), (0.13, "stdout", True)], True),  # paced, and still chatty
        ([*_chatty(8, 0.01), (0.13, "answer", True)], False),  # an answer ends the pace
        ([*_chatty(8, 0.01), (0.13, "exit", True)], False),  # and so does an exit
        ([*_chatty(8, 0.01), (0.13, "exit", True), (0.14, "conn", False)], False),
    ],
)
def test_the_pump_paces_chatty_ranks_until_an_answer_or_an_exit(
    monkeypatch: pytest.MonkeyPatch, looks: list[tuple[float, str, bool]], paced: bool
) -> None:
    """Issue 33, item 9: ranks that print and report fast (a tqdm bar and 100 lines a second
    each) woke the kernel ~100 times a second; while they are chatty the pump looks at them
    every PACE_S, taking what came together. A launch's start is not chatty (a failure
    then is not held back), and an answer or an exit ends the pace: the next look is not
    held back (a session's next quick task is not paced)."""
    from notebook_launcher._launch import group as G

    clock = [100.0]
    monkeypatch.setattr(G.time, "monotonic", lambda: clock[0])
    wg = G.WorkerGroup([], "fork", None, None, lambda e: None, lambda p: None)
    try:
        for at, what, was_paced in looks:
            clock[0] = 100.0 + at
            wg._answered = what == "answer"
            kind = "conn" if what == "answer" else what  # (an answer comes on the channel)
            wg._keep_pace([(kind, None)], was_paced)  # type: ignore[list-item]
        assert (wg._paced_until > clock[0]) == paced
    finally:
        wg.close()


# --- one controller: GroupRun.drive, the run's policy, its phases (issue 34, item 1) ---------


class _FakeRank:
    def __init__(self, rank: int) -> None:
        self.rank, self.pid, self.returncode = rank, 100 + rank, None
        self.failure = self.exc_data = None
        self.result: bytes | None = None


class _FakeGroup:
    """A group whose ranks say, at each pump, what the test scripted (no process)."""

    def __init__(self, on_event: Any, on_exit: Any, on_message: Any, script: list[Any]) -> None:
        self.on_event, self.on_exit, self.on_message = on_event, on_exit, on_message
        self.script = script
        self.procs = [_FakeRank(0), _FakeRank(1)]
        self.pumps: list[tuple[float | None, int | None]] = []
        self.terminated = self.closed = False

    @property
    def running(self) -> list[_FakeRank]:
        return [p for p in self.procs if p.returncode is None]

    @property
    def finished(self) -> bool:
        return not self.running

    def start(self, on_abort: Any = None) -> None:
        pass

    def pump(self, timeout: float | None, wake: int | None = None) -> None:
        self.pumps.append((timeout, wake))
        step = self.script.pop(0) if self.script else None
        if step == "message":
            assert self.on_message is not None, "a launch's group keeps its ranks' answers"
            self.on_message(self.procs[0], "answer")
        elif step == "exit":  # every rank returned its rank
            for p in self.running:
                p.returncode, p.result = 0, dumps(p.rank)
                self.on_exit(p)

    def terminate(self) -> None:
        self.terminated = True

    def stop(self) -> None:
        self.terminate()

    def close(self) -> None:
        self.closed = True


class _View:
    def __init__(self) -> None:
        self.ticks = 0
        self.events: list[Any] = []

    def handle(self, event: Any) -> None:
        self.events.append(event)

    def tick(self) -> None:
        self.ticks += 1


def _run(script: list[Any], policy: Any = None) -> Any:
    from notebook_launcher._launch.lifecycle import GroupRun

    def make(on_event: Any, on_exit: Any, on_message: Any) -> _FakeGroup:
        return _FakeGroup(on_event, on_exit, on_message, script)

    return GroupRun(make, [0, 1], _View(), policy=policy)


def test_the_controller_loop_asks_its_policy_and_walks_the_phases() -> None:
    """One loop (``GroupRun.drive``) drives every run: it waits as long as the policy says,
    on the policy's wake fd, lets the policy look after each wait, and ends when the policy
    says so; the run's phase goes STARTING -> RUNNING -> STOPPING -> ENDED."""
    from notebook_launcher._launch.lifecycle import Phase, Policy
    from notebook_launcher._launch.record import Stop

    looked: list[int] = []

    class Counting(Policy):
        wake = 42

        def done(self, run: Any) -> bool:
            return len(looked) == 3

        def timeout(self, run: Any) -> float | None:
            return 0.25

        def after_pump(self, run: Any) -> None:
            looked.append(len(run.group.pumps))

    run = _run([], Counting())
    assert run.phase is Phase.STARTING
    run.start()
    assert run.phase is Phase.RUNNING
    run.drive()
    assert run.group.pumps == [(0.25, 42)] * 3 and looked == [1, 2, 3]
    run.stop("failed")  # (a word, as a record pickled elsewhere carries it)
    assert run.phase is Phase.STOPPING and run.group.terminated
    assert run.record.stop_kind is Stop.FAILED and run.record.stop_kind == "failed"
    end = run.close()
    assert run.phase is Phase.ENDED and run.group.closed and end.stop_kind == "failed"


def test_a_run_hands_its_ranks_words_to_the_policy_of_the_moment() -> None:
    """No ``route``: the group's callbacks are given once, when it is made; what the ranks
    say goes to the run's policy of the moment (a session's start-up, then its tasks)."""
    from notebook_launcher._launch.lifecycle import Policy

    heard: list[str] = []

    class Listening(Policy):
        answers = True

        def __init__(self, name: str) -> None:
            self.name = name

        def done(self, run: Any) -> bool:
            return run.finished or (bool(heard) and heard[-1].startswith(self.name))

        def on_message(self, run: Any, proc: Any, message: Any) -> None:
            heard.append(f"{self.name}: {message} from {proc.rank}")

    run = _run(["message", "message", "exit"], Listening("start-up"))
    run.start()
    run.drive()
    run.drive(Listening("tasks"))
    assert heard == ["start-up: answer from 0", "tasks: answer from 0"]
    run.drive(Listening("the close"))  # (until every rank ended)
    assert run.finished and run.record.results == {0: 0, 1: 1}
    with pytest.raises(AssertionError, match="made for the other"):
        run.drive(Policy())  # a group made to hand answers over cannot keep them now


def test_a_plain_run_stops_the_others_when_a_rank_fails_and_ends_when_all_ended() -> None:
    """The default policy (a launch attempt's, a session's start): events to the record and
    the view, a failure stops the others, done when every rank ended; the group keeps its
    ranks' answers (no ``on_message``)."""
    run = _run([None, "exit"])
    run.start()
    run.record.failed = True
    run.drive()
    assert run.group.on_message is None and run.group.terminated and run.finished
    assert run.record.stop_kind == "failed" and run.view.ticks == 2
    run.close()


def test_one_place_pumps_a_group_and_nothing_routes() -> None:
    """Issue 34's "done when": one loop pumps a group outside the groups' own stop and
    close (``_launch/group.py``, ``_launch/remote.py``): ``GroupRun.drive``. The node
    agent's loop (``_agent/serve.py``) pumps its own ``WorkerGroup`` as the node half of a
    ``RemoteGroup`` -- the group's own machinery across the wire, not a run's owner: it
    keeps no record and decides nothing (the kernel's ``GroupRun.drive`` does). And no
    ``route``: a run's callbacks are given once."""
    import ast
    from pathlib import Path

    import notebook_launcher

    root = Path(notebook_launcher.__file__).parent
    groups = {"_launch/group.py", "_launch/remote.py", "_agent/serve.py"}
    pumps, routes = [], []
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "route":
                routes.append(f"{name}:{node.lineno}")
            if name in groups:
                continue
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "pump"
            ):
                pumps.append(f"{name}:{node.lineno}")
    assert routes == []
    assert len(pumps) == 1 and pumps[0].startswith("_launch/lifecycle.py:"), pumps
    serve = (root / "_agent" / "serve.py").read_text()
    assert serve.count(".pump(") == 1  # the agent's one loop, and no other
