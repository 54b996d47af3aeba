"""Beyond one machine, on one machine: two launcher processes on loopback are two nodes.

This test process is one node; ``tests/_node_script.py`` (a subprocess) is the other. Both
rendezvous backends: the ranks of both nodes form one group (gather across nodes), a rank
killed on one node restarts the whole job (``max_restarts``), a failure on one node is the
root cause on both, a node that never comes is named after ``join_timeout``, and neither
process leaves anything behind. Then restarts on one node, the command line, Slurm's
environment, and -- where this sandbox lets us create network namespaces -- two nodes with
their own addresses.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from notebook_launcher import RankFailedError, WorkerDied, notebook_launcher
from notebook_launcher._events import (
    LaunchRestarting,
    LaunchStarted,
    WorkerExited,
    WorkerFailed,
    WorkerFinished,
    WorkerStarted,
    WorkerStopped,
)
from notebook_launcher.errors import RendezvousError
from notebook_launcher.state import first_host, launch_env

from ._node_script import NODE_ENV, work
from .helpers import PlainKernel, Recorder

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parent.parent
BACKENDS = ("static", "c10d")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def _options(backend: str, port: int, node_rank: int, **extra: Any) -> dict[str, Any]:
    return {
        "num_nodes": 2,
        "node_rank": node_rank,
        "rdzv_backend": backend,
        "rdzv_endpoint": f"127.0.0.1:{port}",
        "rdzv_id": "test-job",
        "join_timeout": 30.0,
        **extra,
    }


class OtherNode:
    """The other node, a subprocess: ``result()`` waits for it and reads what it wrote."""

    def __init__(
        self, tmp: Path, options: dict[str, Any], prefix: tuple[str, ...] = (), **env: str
    ) -> None:
        self.out = tmp / "other.json"
        command = [sys.executable, "-m", "tests._node_script", str(self.out), json.dumps(options)]
        self.proc = subprocess.Popen(
            [*prefix, *command],
            cwd=REPO,
            env=_env(**{NODE_ENV: "other", **env}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def result(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            output, _ = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        assert self.proc.returncode == 0 and self.out.exists(), output
        record: dict[str, Any] = json.loads(self.out.read_text())
        assert record["leftovers"] == {"children": [], "ports": [], "threads": []}, record
        return record


# --- two nodes ----------------------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_nodes_gather_and_restart_together(backend: str, tmp_path: Path) -> None:
    """A rank killed on the other node stops every rank of both; both nodes start again
    (restart 1), and the second attempt's four ranks gather across the nodes."""
    port = _free_port()
    other = OtherNode(tmp_path, {"mode": "kill", **_options(backend, port, 1, max_restarts=1)})
    view = Recorder()
    mine = notebook_launcher(
        work,
        ("kill",),
        num_processes=2,
        dashboard=view,
        **_options(backend, port, 0, max_restarts=1),
    )
    theirs = other.result()["results"]
    everyone = sorted(mine + theirs, key=lambda r: r["rank"])
    assert [r["rank"] for r in everyone] == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["attempt"] == 1 for r in everyone)
    for node in (mine, theirs):  # a node's ranks: consecutive, local 0 and 1
        assert [r["local"] for r in node] == [0, 1]
        assert [r["local_main"] for r in node] == [True, False]
        assert node[1]["rank"] == node[0]["rank"] + 1
    expected = [[r["rank"], "other" if r in theirs else "test"] for r in everyone]
    assert all(r["seen"] == expected for r in everyone)
    (started,) = view.of(LaunchStarted)
    assert started.world_size == 4 and started.num_nodes == 2
    assert list(started.ranks) == [r["rank"] for r in mine]
    assert backend in started.rendezvous and f":{port}" in started.rendezvous
    (restart,) = view.of(LaunchRestarting)
    assert restart.attempt == 1 and "SIGKILL" in restart.cause


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_failure_on_one_node_is_the_root_cause_on_both(backend: str, tmp_path: Path) -> None:
    port = _free_port()
    other = OtherNode(tmp_path, {"mode": "raise", **_options(backend, port, 1)})
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"boom on rank \d") as caught:
        notebook_launcher(
            work, ("raise",), num_processes=2, dashboard=Recorder(), **_options(backend, port, 0)
        )
    theirs = other.result()
    assert time.monotonic() - t0 < 30
    failure = caught.value.launch_failure  # type: ignore[attr-defined]
    culprit = failure.root_cause.rank
    assert caught.value.args[0] == f"boom on rank {culprit}"
    assert culprit in theirs["started"]["ranks"] and culprit == theirs["started"]["ranks"][1]
    assert theirs["error"]["type"] == "ValueError"
    assert theirs["error"]["root_rank"] == culprit
    assert len({f.rank for f in failure.failures}) == 4  # every rank's record, on both nodes


def _two_nodes(
    tmp_path: Path, mode: str = "sleep", until: type = WorkerStarted
) -> tuple[OtherNode, Recorder, Any]:
    """Node 1 in another process, node 0 here as a non-blocking launch, both running
    ``work(mode)``; returns once both ranks here sent ``until`` (WorkerStarted: the group
    of four works)."""
    port = _free_port()
    other = OtherNode(tmp_path, {"mode": mode, **_options("static", port, 1)})
    view = Recorder()
    handle = notebook_launcher(
        work,
        (mode,),
        num_processes=2,
        dashboard=view,
        block=False,
        **_options("static", port, 0),
    )
    deadline = time.monotonic() + 30
    while len(view.of(until)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return other, view, handle


@pytest.mark.timeout(90)
def test_ctrl_c_on_one_node_stops_both(tmp_path: Path) -> None:
    """Ctrl-C on the other node: it stops its ranks, and this node (a non-blocking launch)
    stops its own and says where the launch was interrupted."""
    other, view, handle = _two_nodes(tmp_path)
    other.proc.send_signal(signal.SIGINT)
    with pytest.raises(RankFailedError, match="interrupted on node 1 .*every rank of the job"):
        handle.result(timeout=30)
    theirs = other.result()
    assert theirs["error"]["type"] == "KeyboardInterrupt"
    stopped = {e.rank: e.reason for e in view.of(WorkerStopped)}
    fallout = {e.rank for e in view.of(WorkerFailed) if e.collateral}  # a peer went first
    # each rank here is stopped because of node 1, or (when the other node's ranks went
    # before this node heard why) failed as collateral: never a failure of its own
    assert set(stopped.values()) <= {"interrupted on node 1"}
    assert set(stopped) | fallout == {0, 1} and not view.of(WorkerExited)


@pytest.mark.timeout(90)
def test_cancel_on_one_node_stops_both(tmp_path: Path) -> None:
    """``cancel()`` of a non-blocking launch here: the other node stops its ranks and says
    the launch was interrupted on this node."""
    other, view, handle = _two_nodes(tmp_path)
    assert handle.cancel()
    theirs = other.result()
    assert theirs["error"]["type"] == "RankFailedError"
    assert "the launch was interrupted on node 0" in theirs["error"]["message"]


DETACHED_NODE = """
import sys, time
sys.path.insert(0, {repo!r})
from notebook_launcher import notebook_launcher
from tests._node_script import work
handle = notebook_launcher(work, ("gather",), num_processes=2, dashboard=False, detach=True,
                           **{options!r})
print("ID", handle.id, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_a_detached_node_outlives_its_kernel_and_meets_the_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch across machines started by hand, detached on node 0: its kernel is
    SIGKILLed while the node waits for the other; the other node comes afterwards, the four
    ranks gather across both, and this process attaches to node 0's run for its result.
    Nothing of it is left."""
    from notebook_launcher import attach
    from notebook_launcher._launch import detach as record

    runs = tmp_path / "runs"
    monkeypatch.setenv(record.ROOT_ENV, str(runs))
    port = _free_port()
    code = DETACHED_NODE.format(repo=str(REPO), options=_options("static", port, 0))
    with PlainKernel(code, _env()) as kernel:  # SIGKILLed, while node 0 waits for node 1
        run_id = kernel.id
    meta = record.read_meta(record.find(run_id))
    assert meta.pid is not None and record.supervisor_alive(meta)
    other = OtherNode(tmp_path, {"mode": "gather", **_options("static", port, 1)})
    mine = attach(run_id, dashboard=False).result(timeout=60)
    theirs = other.result()["results"]
    assert [r["rank"] for r in mine] == [0, 1] and [r["rank"] for r in theirs] == [2, 3]
    expected = [[0, "test"], [1, "test"], [2, "other"], [3, "other"]]
    assert all(r["seen"] == expected and r["world"] == 4 for r in mine + theirs)
    deadline = time.monotonic() + 10
    while record.running(meta.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not record.running(meta.pid) and not any(runs.iterdir())


@pytest.mark.timeout(60)
def test_a_node_whose_kernel_dies_is_noticed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This node's ranks returned and it waits for the other node's report; that node's
    kernel is killed (its ranks die with it): its heartbeat stops, and this node says so
    instead of waiting forever."""
    from notebook_launcher._launch import rendezvous

    monkeypatch.setattr(rendezvous, "LOST_AFTER", 1.5)
    # both ranks here returned; the other node's still sleep
    other, view, handle = _two_nodes(tmp_path, "linger", until=WorkerFinished)
    other.proc.kill()
    other.proc.communicate(timeout=10)
    t0 = time.monotonic()
    with pytest.raises(WorkerDied, match="node 1 .* stopped answering"):
        handle.result(timeout=30)
    assert time.monotonic() - t0 < 10


@pytest.mark.timeout(30)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_node_that_never_comes_is_named(backend: str) -> None:
    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(RendezvousError) as caught:
        notebook_launcher(
            work,
            ("gather",),
            num_processes=2,
            dashboard=Recorder(),
            **_options(backend, port, 0, join_timeout=1.0),
        )
    assert time.monotonic() - t0 < 10
    message = str(caught.value)
    assert "node 1 did not join" in message and f"127.0.0.1:{port}" in message
    assert "within 1 s" in message and "join_timeout" in message


@pytest.mark.timeout(60)
def test_a_node_killed_while_its_ranks_train_is_named_at_once(tmp_path: Path) -> None:
    """The other node's kernel is killed while every rank all-reduces: this node's ranks
    fail at once, and it names that node within seconds (it does not answer its bell),
    not after the 20 s heartbeat."""
    other, view, handle = _two_nodes(tmp_path, "loop")
    time.sleep(0.5)  # a few steps together
    t0 = time.monotonic()
    other.proc.kill()
    other.proc.communicate(timeout=10)
    with pytest.raises(WorkerDied, match=r"node 1 .* is gone: its kernel stopped answering"):
        handle.result(timeout=30)
    assert time.monotonic() - t0 < 15  # ANSWER_TIMEOUT (3 s), not LOST_AFTER (20 s)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_squatted_endpoint_is_named_after_join_timeout(backend: str) -> None:
    """A program listens on the endpoint and never answers: a joining node (static
    node_rank=1, or c10d) ends in RendezvousError after join_timeout, naming it."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(RendezvousError) as caught:
            notebook_launcher(
                work,
                ("gather",),
                num_processes=1,
                dashboard=Recorder(),
                **_options(backend, port, 1, join_timeout=1.5),
            )
        assert time.monotonic() - t0 < 15
    message = str(caught.value)
    assert f"127.0.0.1:{port}" in message and "does not answer as a rendezvous store" in message
    assert "another program holds that port" in message


DIFFERENCES = {
    "num_nodes": ({"num_nodes": 3}, "num_nodes=3", "num_nodes=2"),
    "rdzv_id": ({"rdzv_id": "another-job"}, "rdzv_id='another-job'", "rdzv_id='test-job'"),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("what", list(DIFFERENCES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_nodes_whose_settings_differ_are_told_at_once(
    backend: str, what: str, tmp_path: Path
) -> None:
    """Both nodes say which settings differ as soon as they see each other, not after
    join_timeout, and not with a raw torch error."""
    port = _free_port()
    theirs_differ, said_there, said_here = DIFFERENCES[what]
    other = OtherNode(tmp_path, {"mode": "gather", **_options(backend, port, 1), **theirs_differ})
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match="the nodes' settings differ") as caught:
        notebook_launcher(
            work, ("gather",), num_processes=1, dashboard=Recorder(), **_options(backend, port, 0)
        )
    assert time.monotonic() - t0 < 25  # join_timeout is 30
    message = str(caught.value)
    assert f"with {said_there}" in message and f"has {said_here}" in message
    theirs = other.result()
    assert theirs["error"]["type"] == "RendezvousError"
    assert "the nodes' settings differ" in theirs["error"]["message"]
    assert f"has {said_there}" in theirs["error"]["message"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ctrl_c_on_the_holder_while_the_nodes_meet(backend: str, tmp_path: Path) -> None:
    """The node holding the store is interrupted while the nodes meet (a third node never
    comes): the other says so, in a RendezvousError, without torch's C++ frames."""
    port = _free_port()
    holds = {"rdzv_conf": {"is_host": True}} if backend == "c10d" else {}
    other = OtherNode(
        tmp_path, {"mode": "gather", **_options(backend, port, 0, num_nodes=3), **holds}
    )
    threading.Thread(target=_interrupt_once_both_arrived, args=(other, port), daemon=True).start()
    t0 = time.monotonic()
    joins = {"rdzv_conf": {"is_host": False}} if backend == "c10d" else {}
    with pytest.raises(RendezvousError) as caught:
        notebook_launcher(
            work,
            ("gather",),
            num_processes=1,
            dashboard=Recorder(),
            **_options(backend, port, 1, num_nodes=3),
            **joins,
        )
    assert time.monotonic() - t0 < 25
    message = str(caught.value)
    assert "node_rank 0 on" in message and "was interrupted while the nodes met" in message
    assert "frame #" not in message and caught.value.__cause__ is None
    assert other.result()["error"]["type"] == "KeyboardInterrupt"


def _interrupt_once_both_arrived(other: OtherNode, port: int) -> None:
    """Ctrl-C to the other node once both nodes wait in the rendezvous's lobby."""
    from datetime import timedelta

    import torch.distributed as dist

    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            time.sleep(0.05)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    while store.add("notebook_launcher/arrivals", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    del store
    other.proc.send_signal(signal.SIGINT)


@pytest.mark.timeout(30)
def test_a_node_whose_holder_never_comes_is_told_so() -> None:
    port = _free_port()
    with pytest.raises(RendezvousError, match=f"node 0 did not hold .* 127.0.0.1:{port}"):
        notebook_launcher(
            work,
            ("gather",),
            num_processes=1,
            dashboard=Recorder(),
            **_options("static", port, 1, join_timeout=0.5),
        )


# --- restarts on one node -----------------------------------------------------------------


def _flaky(how: str) -> int:
    """Fails on rank 1 in every attempt but the last allowed (see TORCHELASTIC_*)."""
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if int(os.environ["RANK"]) == 1 and attempt < int(os.environ["TORCHELASTIC_MAX_RESTARTS"]):
        if how == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "exit":
            os._exit(3)
        raise KeyError(f"attempt {attempt}")
    return attempt


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["signal", "exit"])
def test_a_death_restarts_every_rank(how: str) -> None:
    view = Recorder()
    assert notebook_launcher(_flaky, (how,), 2, max_restarts=2, dashboard=view) == [2, 2]
    restarts = view.of(LaunchRestarting)
    assert [r.attempt for r in restarts] == [1, 2]
    word = "SIGKILL" if how == "signal" else "exit code 3"
    assert all(word in r.cause and r.max_restarts == 2 for r in restarts)
    # Rank 1 ran (to its end) in all three attempts, each time a new process; rank 0 ran in
    # the last one ([2, 2]). In a failed attempt rank 0 may be stopped between its group's
    # first barrier and saying it started (rank 1 ends that fast), so its count is not fixed.
    started = view.of(WorkerStarted)
    ones = [e.pid for e in started if e.rank == 1]
    assert len(ones) == 3 and len(set(ones)) == 3, started
    assert len({e.pid for e in started}) == len(started), started  # never the same process


@pytest.mark.timeout(60)
def test_restarts_that_run_out_are_in_the_report() -> None:
    def always_dies() -> None:
        if int(os.environ["RANK"]) == 1:
            os._exit(5)

    with pytest.raises(WorkerDied, match="exit code 5") as caught:
        notebook_launcher(always_dies, (), 2, max_restarts=1, dashboard=Recorder())
    failure = caught.value.launch_failure
    assert failure is not None and len(failure.restarts) == 1
    assert "exit code 5" in failure.restarts[0]
    assert "Restarted 1 time before this attempt" in str(caught.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("restart_on", "restarted"),
    [(None, False), (True, True), (KeyError, True), ((ValueError, OSError), False)],
)
def test_an_exception_restarts_only_when_asked(restart_on: Any, restarted: bool) -> None:
    view = Recorder()
    call = {"max_restarts": 1, "dashboard": view, "restart_on_exception": restart_on}
    if restarted:
        assert notebook_launcher(_flaky, ("raise",), 2, **call) == [1, 1]
    else:
        with pytest.raises(KeyError, match="attempt 0"):
            notebook_launcher(_flaky, ("raise",), 2, **call)
    assert len(view.of(LaunchRestarting)) == int(restarted)


def _nut(queue: Any) -> int:
    """Rank 0 takes a count from an inherited multiprocessing queue, puts it back one lower
    and raises until it reaches 0 (Accelerate's tough nut, without the race for the queue)."""
    if int(os.environ["RANK"]) == 0:
        trial = queue.get(timeout=10)
        if trial > 0:
            queue.put(trial - 1)
            raise RuntimeError("not yet")
    return int(os.environ["TORCHELASTIC_RESTART_COUNT"])


@pytest.mark.timeout(60)
def test_restarts_around_an_inherited_queue() -> None:
    """What a forked rank puts in a queue it inherited reaches the next attempt (the rank
    adopts it as multiprocessing's own children do); the queue's feeder thread in this
    process does not stand in the way of fork (fork itself is asked for: an earlier test
    may have started this process's OpenMP pool, which would choose a forkserver)."""
    import multiprocessing

    from notebook_launcher._launch import preflight

    queue = multiprocessing.get_context("fork").Queue()
    try:
        queue.put(2)
        assert preflight.busy_threads() == []  # the feeder runs
        view = Recorder()
        call = {"max_restarts": 2, "restart_on_exception": RuntimeError, "dashboard": view}
        assert notebook_launcher(_nut, (queue,), 2, start_method="fork", **call) == [2, 2]
        assert len(view.of(LaunchRestarting)) == 2 and queue.empty()
    finally:
        queue.close()
        queue.join_thread()


# --- torchrun, Slurm and the command line -------------------------------------------------


def test_slurm_env_describes_the_group() -> None:
    assert first_host("node[07-09,12],gpu1") == "node07"
    assert first_host("rack[1-2]-n[01-04],x") == "rack1-n01"
    step = {
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu[2-3]",
        "SLURM_JOB_ID": "4242",
    }
    env = launch_env(step)
    assert env is not None and (env.rank, env.world_size, env.local_rank) == (3, 4, 1)
    assert env.init_method == "tcp://gpu2:19242"
    assert launch_env({**step, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}).init_method == (  # type: ignore[union-attr]
        "tcp://10.0.0.1:1234"
    )
    assert launch_env({k: v for k, v in step.items() if k != "SLURM_STEP_ID"}) is None  # sbatch
    assert launch_env({**step, "SLURM_NTASKS": "1"}) is None  # a kernel in an allocation


@pytest.mark.timeout(90)
def test_the_check_script_under_slurm_env(tmp_path: Path) -> None:
    """``srun -n 2 python script.py``, as Slurm runs it: each task one rank of a group the
    state API creates from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID."""
    from .test_operations import _normal, expected

    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "_torchrun_target.py"), str(tmp_path)],
            env=_env(
                SLURM_STEP_ID="0",
                SLURM_PROCID=str(rank),
                SLURM_NTASKS="2",
                SLURM_LOCALID=str(rank),
                SLURM_JOB_NODELIST="127.0.0.1",
                MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME="lo",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=80)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results == [_normal(expected(r, 2)) for r in range(2)]


SCRIPT = """\
import sys
from notebook_launcher import PartialState
from notebook_launcher.utils import gather_object
state = PartialState()
print("ranks", gather_object([state.process_index]), "args", sys.argv[1:])
if "--fail" in sys.argv and state.process_index == 1:
    raise KeyError("rank 1 fails")
sys.exit(0)  # how a script ends well (in a launched function: a death, no value came back)
"""


@pytest.mark.timeout(60)
def test_the_command_line_runs_a_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    base = [sys.executable, "-m", "notebook_launcher", "run", "-n", "2", "--master-port", "auto"]
    prefix = ["--log-line-prefix-template", "${rank}/${local_rank}>"]
    ok = subprocess.run(
        [*base, *prefix, str(script), "a"], env=_env(), capture_output=True, text=True, timeout=50
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "0/0> ranks [0, 1] args ['a']" in ok.stdout
    assert "1/1> ranks [0, 1] args ['a']" in ok.stdout
    assert "2 ranks" in ok.stdout and ": ok" in ok.stdout
    bad = subprocess.run(
        [*base, str(script), "--fail"], env=_env(), capture_output=True, text=True, timeout=50
    )
    assert bad.returncode == 1
    assert "failed: rank 1 raised KeyError: 'rank 1 fails'" in bad.stdout
    tb = bad.stderr
    assert tb.startswith("Traceback") and f'File "{script}", line 7' in tb, tb
    assert "Root cause: rank 1 raised KeyError" in tb and "notebook_launcher/" not in tb


# --- network namespaces -------------------------------------------------------------------


@pytest.fixture
def namespaces() -> Iterator[list[tuple[str, str]]]:
    """Two network namespaces joined by a veth pair: 10.231.0.1 and 10.231.0.2, nothing
    else (addresses no other network sees); (namespace, device) each. Skips where they
    cannot be created."""
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("network namespaces need the ip command and root")
    tag = f"nl{os.getpid() % 100000}"
    names = (f"{tag}a", f"{tag}b")
    steps = [
        ["ip", "netns", "add", names[0]],
        ["ip", "netns", "add", names[1]],
        ["ip", "link", "add", f"{tag}x", "type", "veth", "peer", "name", f"{tag}y"],
        ["ip", "link", "set", f"{tag}x", "netns", names[0]],
        ["ip", "link", "set", f"{tag}y", "netns", names[1]],
    ]
    for i, (ns, dev) in enumerate(zip(names, (f"{tag}x", f"{tag}y"), strict=True)):
        steps += [
            ["ip", "-n", ns, "addr", "add", f"10.231.0.{i + 1}/24", "dev", dev],
            ["ip", "-n", ns, "link", "set", dev, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
        ]
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=10)
            if done.returncode != 0:
                pytest.skip(
                    f"cannot create network namespaces here: {' '.join(step)}: {done.stderr.strip()}"
                )
        yield [(names[0], f"{tag}x"), (names[1], f"{tag}y")]
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@pytest.mark.timeout(90)
def test_two_nodes_with_their_own_addresses(
    namespaces: list[tuple[str, str]], tmp_path: Path
) -> None:
    """c10d between two network namespaces: node A holds the store on 10.231.0.1."""
    port = 29400
    nodes = []
    for i, (ns, device) in enumerate(namespaces):
        options = {
            "mode": "gather",
            **_options("c10d", port, i),
            "rdzv_endpoint": f"10.231.0.1:{port}",
        }
        node_dir = tmp_path / ns
        node_dir.mkdir()
        nodes.append(
            OtherNode(node_dir, options, ("ip", "netns", "exec", ns), GLOO_SOCKET_IFNAME=device)
        )
    records = [node.result() for node in nodes]
    everyone = sorted((r for rec in records for r in rec["results"]), key=lambda r: r["rank"])
    assert [r["rank"] for r in everyone] == [0, 1, 2, 3]
    assert all(r["world"] == 4 and len(r["seen"]) == 4 for r in everyone)
