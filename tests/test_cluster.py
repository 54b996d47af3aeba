"""One kernel, many nodes: a real Slurm cluster of three nodes on this machine.

The session fixture ``slurm`` starts ``slurmctld`` and three ``slurmd`` (``tests/slurm/``);
every test here drives it as a user would, through :class:`SlurmCluster`, and proves
afterwards that no job, agent or rank is left (``cluster_clean``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from notebook_launcher import ClusterError, SlurmCluster, WorkerDied, notebook_launcher
from notebook_launcher._events import (
    LaunchFinished,
    LaunchRestarting,
    LaunchStarted,
    NodesWaiting,
    Output,
    WorkerStarted,
    WorkerStopped,
)

from .helpers import Recorder, SlurmTestCluster, agent_processes, kernel_env, wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


@pytest.fixture(scope="module", autouse=True)
def time_limited(slurm: SlurmTestCluster) -> Iterator[tuple[SlurmCluster, Any]]:
    """A one-node job with a time limit of one minute, running a launch that would sleep
    for ten, for the whole module: Slurm enforces time limits on a 30-second timer, so this
    case runs beside the others and the module's last test reads how it ended."""
    cluster = SlurmCluster(nodes=1, time="1", job_name="time-limited")
    cluster.start()
    _module_clusters.append(cluster)
    handle = notebook_launcher(
        sleeps, num_processes=1, cluster=cluster, dashboard=False, block=False
    )
    yield cluster, handle
    cluster.close()


#: clusters that live for the whole module (their job and agents are not leftovers)
_module_clusters: list[SlurmCluster] = []


@pytest.fixture
def cluster_clean(slurm: SlurmTestCluster) -> Iterator[SlurmTestCluster]:
    """After the test: no job in Slurm, no agent or rank process (waits a little: a job
    ends a moment after its agents) -- but those of the module's own clusters."""
    yield slurm

    def jobs() -> list[str]:
        kept = {c.job_id for c in _module_clusters if c.running}
        return [j for j in slurm.jobs() if j not in kept]

    def processes() -> list[int]:
        kept = {p for c in _module_clusters if c.running for p in agent_processes(c.job_key)}
        return [p for p in agent_processes(slurm_conf=slurm.conf) if p not in kept]

    wait_until(lambda: jobs() == [], 30, f"Slurm holds no job (it has {jobs()})")
    wait_until(lambda: processes() == [], 30, "no agent or rank process is left")


def test_a_slurm_cluster_starts_one_agent_per_node_and_its_job_ends_with_it(
    cluster_clean: SlurmTestCluster, tmp_path: Path
) -> None:
    seen: list[Any] = []
    cluster = SlurmCluster(nodes=2, job_dir=str(tmp_path / "jobs"))
    key = ""
    try:
        cluster.start(report=seen.append)
        assert cluster.running and cluster.job_id in cluster_clean.jobs()
        nodes = cluster.nodes_for_launch()
        hosts = [n.host for n in nodes]
        assert len(set(hosts)) == 2 and set(hosts) <= {"n1", "n2", "n3"}, hosts
        waiting = [e for e in seen if isinstance(e, NodesWaiting)]
        assert waiting[0].joined == 0 and waiting[-1].joined == 2, waiting
        assert all(f"Slurm job {cluster.job_id}" in e.where for e in waiting)
        key = cluster.job_key
        job_dir = tmp_path / "jobs" / key
        script = (job_dir / "job.sh").read_text()
        assert "#SBATCH --nodes=2" in script and "--secret-file" in script
        assert not (job_dir / "secret").exists()  # removed once every agent joined
        assert cluster.hub is not None
        secret_hex = cluster.hub.secret_env()["NOTEBOOK_LAUNCHER_AGENT_SECRET"]
        assert secret_hex not in script and secret_hex not in repr(cluster)
        for line in (job_dir / f"slurm-{cluster.job_id}.out").read_text().splitlines():
            assert secret_hex not in line
    finally:
        cluster.close()
    assert not cluster.running
    assert key and not (tmp_path / "jobs" / key).exists()


def test_a_rank_count_the_cluster_cannot_run_is_refused_before_submitting(
    cluster_clean: SlurmTestCluster,
) -> None:
    """No rank count and no GPUs asked for (and the other counts a cluster cannot split)
    are known before ``sbatch``: refused then, not after the queue and the agents; the
    traceback ends at the caller's line (every frame below it is hidden from IPython)."""
    from notebook_launcher import PreflightError, start

    before = cluster_clean.jobs()
    for count, phrase in (
        (None, "num_processes=None means one rank per GPU, and the cluster has no GPUs"),
        (3, "num_processes=3 does not split evenly over the cluster's 2 nodes"),
    ):
        cluster = SlurmCluster(nodes=2)
        with pytest.raises(PreflightError, match=phrase) as info:
            start(count, cluster=cluster, dashboard=False)
        assert cluster.job_id is None and not cluster.running
        assert cluster_clean.jobs() == before
        frames = []
        tb = info.value.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        assert (
            frames[0].f_code.co_name
            == "test_a_rank_count_the_cluster_cannot_run_is_refused_before_submitting"
        )
        assert all(f.f_locals.get("__tracebackhide__") for f in frames[1:])
    with pytest.raises(PreflightError, match="e.g. num_processes=4"):
        notebook_launcher(sleeps, cluster=SlurmCluster(nodes=2), dashboard=False)
    assert cluster_clean.jobs() == before


def test_a_detached_run_is_checked_here_and_refuses_a_cluster_this_kernel_started(
    cluster_clean: SlurmTestCluster,
    time_limited: tuple[SlurmCluster, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``detach=True`` on a cluster: the kernel's preflight runs before any supervisor or
    job starts; a cluster this kernel started (its job is the kernel's) is refused, naming
    the fix."""
    from notebook_launcher import PreflightError, start
    from notebook_launcher._launch import detach as record

    monkeypatch.setenv(record.ROOT_ENV, str(tmp_path / "runs"))
    before = cluster_clean.jobs()
    with pytest.raises(PreflightError, match="num_processes=3 does not split evenly"):
        notebook_launcher(
            sleeps, num_processes=3, cluster=SlurmCluster(nodes=2), detach=True, dashboard=False
        )
    started, _ = time_limited
    assert started.running
    with pytest.raises(PreflightError, match=r"a cluster this kernel started .*Pass a new"):
        notebook_launcher(sleeps, num_processes=1, cluster=started, detach=True, dashboard=False)
    with pytest.raises(PreflightError, match=r"started .*the detached session's supervisor"):
        start(1, cluster=started, detach=True, dashboard=False)
    assert cluster_clean.jobs() == before and not (tmp_path / "runs").exists()


def test_ctrl_c_while_the_job_is_queued_cancels_it(cluster_clean: SlurmTestCluster) -> None:
    cluster = SlurmCluster(nodes=2, sbatch_options=["--begin=now+600"])  # it pends

    def report(event: Any) -> None:
        if isinstance(event, NodesWaiting) and event.state.startswith("PENDING"):
            raise KeyboardInterrupt  # the notebook's interrupt button, while it pends

    with pytest.raises(KeyboardInterrupt):
        cluster.start(report=report)
    assert cluster.job_id is not None
    assert cluster.job_id not in cluster_clean.jobs()  # cancelled at once
    assert not cluster.running


def test_a_job_that_can_never_start_says_why_and_is_cancelled(
    cluster_clean: SlurmTestCluster,
) -> None:
    """Issue 25, item 12: 5 nodes of a 3-node partition pended forever; Slurm says why
    (PartitionConfig, then PartitionNodeLimit): said, with the fix, and the job is gone."""
    cluster = SlurmCluster(nodes=5)
    started = time.monotonic()
    with pytest.raises(ClusterError) as caught:
        cluster.start()
    said = str(caught.value)
    assert f"Slurm job {cluster.job_id}: PENDING (Partition" in said, said
    assert (
        "it can never start (it asks for 5 nodes, and partition debug has 3 node(s): ask for "
        "at most 3 (nodes=3), or another partition" in said
    ), said
    assert time.monotonic() - started < 30
    assert cluster.job_id not in cluster_clean.jobs() and not cluster.running


def test_agents_that_cannot_start_are_explained(
    cluster_clean: SlurmTestCluster, tmp_path: Path
) -> None:
    """The package missing on the nodes: the job ends before its agents join, and the error
    shows what its output said and what to do."""
    python = tmp_path / "python-without-the-package"
    python.write_text(
        f'#!/bin/sh\nexec env -u PYTHONPATH {os.sys.base_exec_prefix}/bin/python3 -I "$@"\n'
    )  # type: ignore[attr-defined]
    python.chmod(0o755)
    cluster = SlurmCluster(nodes=2, python=str(python))
    with pytest.raises(ClusterError) as info:
        cluster.start()
    text = str(info.value)
    assert "before its agents joined (0 of 2)" in text, text
    assert "No module named notebook_launcher" in text, text
    assert "Install notebook_launcher in the same environment on every node" in text, text
    assert not cluster.running


def test_a_space_in_the_job_name_and_directory_reaches_slurm_as_given(
    cluster_clean: SlurmTestCluster, tmp_path: Path
) -> None:
    """sbatch splits #SBATCH lines at spaces: quoted, the job is named as asked, and writes
    its output (and the agents find their secret) under a directory with a space."""
    jobs = tmp_path / "my jobs"
    cluster = SlurmCluster(nodes=1, job_name='my "first" job', job_dir=str(jobs))
    try:
        cluster.start()
        name = subprocess.run(
            ["squeue", "-h", "-j", str(cluster.job_id), "-o", "%j"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        assert name == 'my "first" job'
        assert (jobs / cluster.job_key / f"slurm-{cluster.job_id}.out").exists()
    finally:
        cluster.close()


# --- launches on a cluster that the module shares ------------------------------------------


@pytest.fixture(scope="module")
def shared(slurm: SlurmTestCluster) -> Iterator[SlurmCluster]:
    """One job of two nodes for the launches that leave it usable (started before the tests'
    leak guard looks, so its store's port is not taken for a leak)."""
    cluster = SlurmCluster(nodes=2)
    cluster.start()
    _module_clusters.append(cluster)
    yield cluster
    cluster.close()


def where(x: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from notebook_launcher import PartialState

    state = PartialState()
    total = torch.ones(1) * state.process_index
    dist.all_reduce(total)
    print(f"on {os.environ['SLURMD_NODENAME']}", flush=True)
    return {
        "rank": state.process_index,
        "local": state.local_process_index,
        "world": state.num_processes,
        "node": os.environ["SLURMD_NODENAME"],
        "sum": int(total.item()),
        "x": x,
        "restart": os.environ["TORCHELASTIC_RESTART_COUNT"],
        "local_main": state.is_local_main_process,
    }


def test_one_cell_runs_a_job_on_two_nodes(shared: SlurmCluster) -> None:
    rec = Recorder()
    results = notebook_launcher(where, (7,), num_processes=4, cluster=shared, dashboard=rec)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    a, b = (n.host for n in shared.nodes_for_launch())
    assert [r["node"] for r in results] == [a, a, b, b]
    assert [r["local"] for r in results] == [0, 1, 0, 1]
    assert [r["local_main"] for r in results] == [True, False, True, False]
    assert {r["world"] for r in results} == {4} and {r["sum"] for r in results} == {6}
    started = rec.of(LaunchStarted)[0]
    assert started.hosts == (a, a, b, b) and started.num_nodes == 2
    lines = {(o.rank, o.text.strip()) for o in rec.of(Output)}
    assert lines == {(0, f"on {a}"), (1, f"on {a}"), (2, f"on {b}"), (3, f"on {b}")}
    job = shared.job_id
    again = notebook_launcher(where, (8,), num_processes=2, cluster=shared, dashboard=False)
    assert [(r["node"], r["x"]) for r in again] == [(a, 8), (b, 8)]  # 1 rank per node
    assert shared.job_id == job  # the same allocation, reused


def raise_on_rank_3() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 3:
        raise KeyError("rank 3's own failure")
    dist.barrier()


def killed_on_rank_2() -> None:
    import signal

    import torch.distributed as dist

    if dist.get_rank() == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
    dist.barrier()


def test_a_failure_on_another_node_is_the_root_cause_in_the_cell(shared: SlurmCluster) -> None:
    with pytest.raises(KeyError, match="rank 3's own failure") as info:
        notebook_launcher(raise_on_rank_3, num_processes=4, cluster=shared, dashboard=False)
    report = info.value.launch_failure  # type: ignore[attr-defined]
    assert report.root_cause.rank == 3
    others = [f for f in report.failures if f.rank != 3]
    assert {f.rank for f in others} == {0, 1, 2}  # stopped, or collateral of rank 3's end
    assert all(f.kind == "stopped" or f.collateral for f in others), others
    with pytest.raises(WorkerDied) as died:
        notebook_launcher(killed_on_rank_2, num_processes=4, cluster=shared, dashboard=False)
    text = str(died.value)
    assert "rank 2 of 4 died" in text and "SIGKILL" in text and "out of memory" in text, text
    # the nodes are still there for the next cell
    assert (
        len(notebook_launcher(where, (1,), num_processes=4, cluster=shared, dashboard=False)) == 4
    )


def dies_once() -> str:
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "3":
        os._exit(3)
    import torch.distributed as dist

    dist.barrier()
    return os.environ["TORCHELASTIC_RESTART_COUNT"]


def test_max_restarts_starts_every_node_again(shared: SlurmCluster) -> None:
    rec = Recorder()
    out = notebook_launcher(
        dies_once, num_processes=4, cluster=shared, max_restarts=1, dashboard=rec
    )
    assert out == ["1", "1", "1", "1"]
    assert len(rec.of(LaunchRestarting)) == 1


def sleeps() -> None:
    time.sleep(600)


def test_ctrl_c_stops_every_rank_on_every_node(shared: SlurmCluster) -> None:
    rec = Recorder()
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            notebook_launcher(sleeps, num_processes=4, cluster=shared, dashboard=rec)
    finally:
        timer.cancel()
    finished = rec.of(LaunchFinished)[-1]
    assert "interrupted" in finished.summary, finished
    assert {e.rank for e in rec.of(WorkerStopped)} == {0, 1, 2, 3}
    agents = {n.hello.pid for n in shared.nodes_for_launch()}
    wait_until(
        lambda: set(agent_processes(shared.job_key)) == agents, 10, "only the agents are left"
    )


def test_a_non_blocking_launch_on_the_cluster(shared: SlurmCluster) -> None:
    handle = notebook_launcher(
        where, (3,), num_processes=4, cluster=shared, dashboard=False, block=False
    )
    assert [r["x"] for r in handle.result(timeout=60)] == [3, 3, 3, 3]
    handle = notebook_launcher(
        sleeps, num_processes=4, cluster=shared, dashboard=False, block=False
    )
    time.sleep(2.0)
    assert handle.cancel() and handle.cancelled()


def late_on_rank_3(gate: str) -> int:
    import torch.distributed as dist

    if dist.get_rank() == 3:  # on the second node, late: the others wait in the barrier
        for _ in range(600):  # until the test has seen it (at most a minute)
            if os.path.exists(gate):
                break
            time.sleep(0.1)
    dist.barrier()
    return dist.get_rank()


def test_the_stall_view_sees_every_node(shared: SlurmCluster, tmp_path: Path) -> None:
    """The agents take their ranks' stacks on their nodes: the stall view names the rank of
    the second node that sleeps while the others wait, and on demand too (handle.stacks())."""
    from notebook_launcher._events import StacksTaken

    rec = Recorder()
    gate = tmp_path / "seen"
    handle = notebook_launcher(
        late_on_rank_3, (str(gate),), num_processes=4, cluster=shared, dashboard=rec,
        block=False, stall_after=1.5,
    )  # fmt: skip
    try:
        # (on a loaded machine a first look may find the ranks still importing this
        # module; the view looks again every few seconds while the stall lasts)
        odd = lambda: [t for t in rec.of(StacksTaken) if t.odd == (3,)]  # noqa: E731
        wait_until(odd, 60, "the stall view to single out rank 3")
        taken = odd()[0]
        assert taken.reason == "stall" and [r.rank for r in taken.ranks] == [0, 1, 2, 3]
        assert all(r.threads for r in taken.ranks), taken
        assert "rank 3 is in `time.sleep(0.1)" in " ".join(taken.findings), taken.findings
        asked = handle.stacks()
        assert [r.rank for r in asked.report.ranks] == [0, 1, 2, 3]
    finally:
        gate.touch()
    assert handle.result(timeout=60) == [0, 1, 2, 3]


def test_a_session_across_nodes(shared: SlurmCluster) -> None:
    """What a notebook does with a session, on 2 nodes x 2 ranks: cells on every rank and on
    one of the second node, values in and out, a failing cell and its frame, a rank that
    fails while the others wait in a collective (the group is re-formed), an interrupt, a
    restart on the same allocation, and the end (the agents stay for the next)."""
    from notebook_launcher import start

    job = shared.job_id
    with start(num_processes=4, cluster=shared, dashboard=False) as session:
        where = session.run_cell("import os\nhost = os.environ['SLURMD_NODENAME']\n(rank, host)")
        a, b = (n.host for n in shared.nodes_for_launch())
        assert where == [f"(0, '{a}')", f"(1, '{a}')", f"(2, '{b}')", f"(3, '{b}')"]
        assert session.run_cell("rank * 10", ranks=[3]) == ["30"]  # %%rank 3
        assert session.run_cell("rank", ranks=[3, 0]) == ["3", "0"]  # in the order asked
        session.push(lr=0.5)
        assert session.pull("lr") == [0.5] * 4
        with pytest.raises(ZeroDivisionError) as info:
            session.run_cell("if rank == 3:\n    bad = 1 / 0\ndist.barrier()")
        notes = "\n".join(info.value.__notes__)
        assert f"rank 3 on {b} raised ZeroDivisionError" in notes, notes
        assert "re-formed their process group" in notes, notes  # 0, 1, 2 waited in barrier
        assert session.post_mortem(3, "host") == repr(b)  # in rank 3's failing frame
        assert session.run_cell("t = torch.ones(1); dist.all_reduce(t); t.item()") == ["4.0"] * 4
        handle = session.submit(time.sleep, 60)
        time.sleep(1.0)
        session.interrupt()
        with pytest.raises(KeyboardInterrupt):
            handle.result(timeout=30)
        assert session.pull("lr") == [0.5] * 4  # lives on, variables kept
        old = set(session.status().pids)
        session.restart()
        assert shared.job_id == job and not old & set(session.status().pids)
        assert session.run_cell("'lr' in dir()") == ["False"] * 4  # fresh ranks
    agents = {n.hello.pid for n in shared.nodes_for_launch()}
    wait_until(lambda: set(agent_processes(shared.job_key)) == agents, 10, "only the agents stay")


# --- faults: each names the node and why, and leaves nothing ------------------------------


def test_a_killed_agent_is_named_and_the_next_launch_gets_fresh_nodes(
    cluster_clean: SlurmTestCluster,
) -> None:
    cluster = SlurmCluster(nodes=2)
    seen = Recorder()
    try:
        handle = notebook_launcher(
            sleeps, num_processes=4, cluster=cluster, dashboard=seen, block=False
        )
        # running, as the kernel knows (an agent killed before it reported its ranks'
        # start is another case: they "never started", test_agent_hub)
        wait_until(lambda: len(seen.of(WorkerStarted)) == 4, 60, "the kernel to hear 4 ranks")
        first_job = cluster.job_id
        victim = cluster.nodes_for_launch()[1]
        os.kill(victim.hello.pid, signal.SIGKILL)
        with pytest.raises(WorkerDied) as info:
            handle.result(timeout=60)
        text = str(info.value)
        assert f"({victim.host})'s agent is gone: its connection ended" in text, text
        assert "rank 2 (pid" in text and f"on {victim.host} died" in text, text
        assert "out of memory" not in text, text
        with pytest.raises(ClusterError, match=rf"lost 1 node\(s\): node 1 \({victim.host}\)"):
            notebook_launcher(where, (1,), num_processes=4, cluster=cluster, dashboard=False)
        wait_until(lambda: first_job not in cluster_clean.jobs(), 30, "the old job ends")
        out = notebook_launcher(where, (1,), num_processes=4, cluster=cluster, dashboard=False)
        a, b = (n.host for n in cluster.nodes_for_launch())
        assert [r["node"] for r in out] == [a, a, b, b] and a != b
        assert cluster.job_id != first_job
    finally:
        cluster.close()


def test_scancel_ends_the_launch_saying_so(cluster_clean: SlurmTestCluster) -> None:
    cluster = SlurmCluster(nodes=2)
    try:
        handle = notebook_launcher(
            sleeps, num_processes=4, cluster=cluster, dashboard=False, block=False
        )
        wait_until(lambda: len(agent_processes(cluster.job_key)) == 2 + 4, 60, "4 ranks run")
        # the leftover checks find this cluster's agents and ranks by its SLURM_CONF
        mine = set(agent_processes(slurm_conf=cluster_clean.conf))
        assert set(agent_processes(cluster.job_key)) <= mine
        assert cluster.job_id is not None
        subprocess.run(["scancel", cluster.job_id], check=True, timeout=30)
        with pytest.raises(WorkerDied) as info:
            handle.result(timeout=60)
        text = str(info.value)
        assert "Slurm is ending the job" in text, text
        assert f"Slurm job {cluster.job_id}: CANCELLED" in text, text
    finally:
        cluster.close()


KERNEL = """
import os, sys, time
sys.path.insert(0, {root!r})
from notebook_launcher import SlurmCluster, notebook_launcher
from tests.test_cluster import sleeps
cluster = SlurmCluster(nodes=2)
handle = notebook_launcher(sleeps, num_processes=4, cluster=cluster, dashboard=False, block=False)
print("JOB", cluster.job_id, cluster.job_key, flush=True)
time.sleep(600)
"""


def test_a_killed_kernel_ends_its_agents_ranks_and_job(cluster_clean: SlurmTestCluster) -> None:
    root = str(Path(__file__).resolve().parents[1])
    kernel = subprocess.Popen(
        [sys.executable, "-c", KERNEL.format(root=root)],
        env=kernel_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert kernel.stdout is not None
        words: list[str] = []
        while words[:1] != ["JOB"]:  # (after the lines that say it waits for the job)
            line = kernel.stdout.readline()
            assert line, "the kernel ended"
            words = line.split()
        job, key = words[1], words[2]
        wait_until(lambda: len(agent_processes(key)) == 2 + 4, 60, "4 ranks run")
        kernel.kill()
        kernel.wait(10)
        wait_until(lambda: agent_processes(key) == [], 15, "the agents and ranks end")
        wait_until(lambda: job not in cluster_clean.jobs(), 30, "the job ends")
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait()
        if kernel.stdout is not None:
            kernel.stdout.close()


ALLOCATED = """
import os, subprocess, sys
sys.path.insert(0, {root!r})
from notebook_launcher import SlurmCluster, notebook_launcher
from tests.test_cluster import where
cluster = SlurmCluster(nodes=2)
out = notebook_launcher(where, (5,), num_processes=4, cluster=cluster, dashboard=False)
jobs = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
print("NODES", " ".join(r["node"] for r in out), flush=True)
print("JOBS", os.environ["SLURM_JOB_ID"], cluster.job_id, " ".join(jobs), flush=True)
cluster.close()
print("CLOSED", flush=True)
"""


def test_inside_an_allocation_the_agents_are_a_step_and_nothing_is_submitted(
    cluster_clean: SlurmTestCluster,
) -> None:
    root = str(Path(__file__).resolve().parents[1])
    done = subprocess.run(
        ["salloc", "-N2", "--job-name=jupyter", sys.executable, "-c", ALLOCATED.format(root=root)],
        env=kernel_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines() if line.strip()}
    a, _, b, _ = lines["NODES"]
    assert lines["NODES"] == [a, a, b, b] and a != b, done.stdout
    allocation, used, *jobs = lines["JOBS"]
    others = {c.job_id for c in _module_clusters}
    assert used == allocation, done.stdout
    assert [j for j in jobs if j not in others] == [allocation], done.stdout  # none of its own
    assert "CLOSED" in lines, done.stdout


def test_a_node_whose_slurmd_dies_fails_the_job_naming_it(cluster_clean: SlurmTestCluster) -> None:
    cluster = SlurmCluster(nodes=2)
    victim = ""
    try:
        handle = notebook_launcher(
            sleeps, num_processes=4, cluster=cluster, dashboard=False, block=False
        )
        wait_until(lambda: len(agent_processes(cluster.job_key)) == 2 + 4, 60, "4 ranks run")
        victim = cluster.nodes_for_launch()[1].host
        pid_file = cluster_clean.dir / f"slurmd.{victim}.pid"
        os.kill(int(pid_file.read_text()), signal.SIGKILL)  # that node's slurmd dies
        with pytest.raises(WorkerDied) as info:
            handle.result(timeout=120)  # Slurm takes its node for down after SlurmdTimeout
        text = str(info.value)
        assert "NODE_FAIL" in text and f"{victim} (Not responding)" in text, text
    finally:
        cluster.close()
        if victim:
            cluster_clean.restart_node(victim)


def test_zz_the_time_limit_ends_the_launch_saying_so(
    cluster_clean: SlurmTestCluster, time_limited: tuple[SlurmCluster, Any]
) -> None:
    """Last in the module: the job of ``time_limited`` reached its limit meanwhile."""
    cluster, handle = time_limited
    with pytest.raises(WorkerDied) as info:
        handle.result(timeout=150)
    text = str(info.value)
    assert "Slurm is ending the job" in text, text
    assert f"Slurm job {cluster.job_id}: TIMEOUT" in text, text
    assert "it reached its time limit (00:01:00)" in text, text
    cluster.close()


@pytest.mark.timeout(60)
def test_the_wait_for_a_clusters_nodes_keeps_the_views_clock_going(tmp_path: Path) -> None:
    """While the kernel waits for a cluster's agents (a Slurm job queued, then running,
    its agents not yet joined) nothing happens but the wait: the view was told of each
    change of it and never ticked, so the dashboard's clock stopped at "running 1s"
    (issue 33, item 7). It is ticked as a launch's pump ticks it."""
    from notebook_launcher import AgentCluster
    from notebook_launcher._events import NodesWaiting

    cluster = AgentCluster(
        nodes=1, host="127.0.0.1", secret_file=str(tmp_path / "job.secret"), join_timeout=1.0
    )
    view = Recorder()
    try:
        with pytest.raises(ClusterError, match="did not join"):
            notebook_launcher(print, num_processes=1, cluster=cluster, dashboard=view)
    finally:
        cluster.close()
    assert len(view.of(NodesWaiting)) == 1  # one state all along: nothing else to say
    assert view.ticks >= 1
