"""Detached runs on a cluster (issue 27): the supervisor, not the kernel, owns the Slurm job.

On the loopback Slurm cluster (the session fixture ``slurm``): a detached 2-node run started
by an interpreter that is then SIGKILLed goes on (its supervisor is the job's batch script
and holds its hub and store), this process attaches and gets every line and the result, and
then no job, agent or supervisor is left; ``stop()`` of a detached cluster run ends its
job, and so does its supervisor's death; a run whose job is queued says so and ``stop()``
cancels the job; a job that ends before its supervisor starts says why; an
``AgentCluster`` detached shows the command that starts its agents in the run's dashboard. The
refusal of a cluster this kernel already started is in ``test_cluster.py`` (it reuses that
module's running cluster).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from notebook_launcher import AgentCluster, SlurmCluster, attach, notebook_launcher, runs
from notebook_launcher._events import LaunchFinished, NodesWaiting, Output
from notebook_launcher._launch import detach as record
from notebook_launcher.errors import LaunchError

from .helpers import (
    ROOT,
    PlainKernel,
    Recorder,
    SlurmTestCluster,
    agent_processes,
    kernel_env,
    wait_until,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


@pytest.fixture
def runs_dir(slurm: SlurmTestCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Run records under a directory of this test's; afterwards (even when the test
    failed): no supervisor, no job in Slurm, no agent or rank process."""
    base = Path(tempfile.mkdtemp(prefix="nl-runs-"))
    root = base / "runs"
    monkeypatch.setenv(record.ROOT_ENV, str(root))
    supervisors: list[int] = []
    try:
        yield root
    finally:
        for path in record.records():
            meta = record.read_meta(path)
            if meta.pid is not None and record.supervisor_alive(meta):
                supervisors.append(meta.pid)
                os.kill(meta.pid, signal.SIGKILL)  # a failed test: its job goes with it
        shutil.rmtree(base, ignore_errors=True)
        wait_until(lambda: slurm.jobs() == [], 30, f"Slurm holds no job ({slurm.jobs()})")
        wait_until(
            lambda: agent_processes(slurm_conf=slurm.conf) == [], 30, "no agent or rank is left"
        )
    assert not supervisors, f"supervisors outlived the test: {supervisors}"


def _started(run_id: str, timeout: float = 90) -> record.Meta:
    """The run's meta once its job runs and both ranks printed."""
    reader = record.EventReader(record.find(run_id))
    printed: set[int] = set()

    def both() -> bool:
        printed.update(e.rank for e in reader.read() if isinstance(e, Output))
        return printed == {0, 1}

    try:
        wait_until(both, timeout, "both ranks of the detached cluster run to print")
    finally:
        reader.close()
    return record.read_meta(record.find(run_id))


def test_a_cluster_run_outlives_a_killed_kernel_and_ends_its_job(
    runs_dir: Path, slurm: SlurmTestCluster, tmp_path: Path
) -> None:
    jobs = tmp_path / "jobs"
    code = textwrap.dedent(
        f"""
        import time
        from notebook_launcher import SlurmCluster, notebook_launcher

        def train(n):
            import time
            import torch.distributed as dist
            for i in range(n):
                print(f"step {{i}} of rank {{dist.get_rank()}}", flush=True)
                time.sleep(0.1)
            return dist.get_rank() + 100

        cluster = SlurmCluster(nodes=2, job_dir={str(jobs)!r})
        handle = notebook_launcher(train, args=(30,), num_processes=2, cluster=cluster,
                                   detach=True, dashboard=False)
        assert not cluster.running  # the supervisor's job, not this kernel's
        print("ID", handle.id, flush=True)
        time.sleep(600)
        """
    )
    env = {**kernel_env(), "PYTHONPATH": str(ROOT), record.ROOT_ENV: str(runs_dir)}
    with PlainKernel(code, env) as kernel:
        run_id = kernel.id
        meta = _started(run_id)
        assert meta.cluster.startswith("Slurm job ") and meta.nodes == 2, meta
        job_id = meta.cluster.split()[2].rstrip(",")
        assert slurm.jobs() == [job_id]
        # its supervisor runs inside that job (its batch script), not on this host's side
        log = (Path(record.find(run_id)) / record.LOG).read_text()
        assert f"supervisor: in Slurm job {job_id}" in log, log
        with open(f"/proc/{meta.pid}/environ", "rb") as f:
            assert f"SLURM_JOB_ID={job_id}".encode() in f.read().split(b"\0")
        [info] = runs()
        assert (info.id, info.state, info.ranks, info.nodes) == (run_id, "running", 2, 2)
        assert f"2 ranks on 2 nodes  train (Slurm job {job_id}" in str(info)
    # the kernel SIGKILLed, mid-run
    assert meta.pid is not None and record.supervisor_alive(meta)  # the run goes on
    view = Recorder()
    handle = attach(run_id, dashboard=view)
    assert handle.result(timeout=90) == [100, 101]
    for rank in (0, 1):  # nothing lost while no kernel was attached
        assert view.lines(rank) == [f"step {i} of rank {rank}\n" for i in range(30)]
    assert view.of(NodesWaiting)[-1].joined == 2  # the job's start, recorded too
    assert view.of(LaunchFinished)[-1].ok
    wait_until(lambda: not record.running(meta.pid), 15, "the supervisor to exit")
    wait_until(lambda: slurm.jobs() == [], 30, "the job to end with the run")
    assert not os.path.exists(handle.path) and runs() == []
    assert not jobs.exists() or not any(jobs.iterdir())  # the job's directory went too


def _agent_step(job_id: str) -> str:
    """The job's step that runs its agents (``JOB.0``; the batch step is the supervisor)."""
    out = subprocess.run(
        ["squeue", "-h", "-s", "-j", job_id, "-o", "%i"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout.split()  # fmt: skip
    steps = [s for s in out if s.split(".")[-1].isdigit()]
    assert steps, f"job {job_id} has no agent step: {out}"
    return steps[0]


@pytest.mark.parametrize(
    "end", ["stop", "supervisor killed", "scancel", "scancel, agents first", "agents' step only"]
)
def test_stop_or_a_killed_supervisor_ends_the_job_of_a_detached_cluster_run(
    runs_dir: Path, slurm: SlurmTestCluster, end: str, tmp_path: Path
) -> None:
    def forever() -> None:
        import time

        while True:
            print("step", flush=True)
            time.sleep(0.1)

    cluster = SlurmCluster(nodes=2, job_dir=str(tmp_path / "jobs"))
    handle = notebook_launcher(
        forever, num_processes=2, cluster=cluster, detach=True, dashboard=False
    )
    meta = _started(handle.id)
    assert not cluster.running and slurm.jobs() and agent_processes(slurm_conf=slurm.conf)
    assert meta.pid is not None
    with pytest.raises(LaunchError, match="its ranks run on the cluster's nodes"):
        handle.stacks()
    if end == "stop":
        assert handle.stop() and handle.cancelled()
        assert not os.path.exists(handle.path)
    elif end == "scancel":  # Slurm's SIGTERM to the batch script: the supervisor stops it
        job_id = meta.cluster.split()[2].rstrip(",")
        subprocess.run(["scancel", job_id], check=True, timeout=30)
        with pytest.raises(KeyboardInterrupt, match=rf"Slurm ended job {job_id} \(scancel"):
            handle.result(timeout=30)
    elif end == "scancel, agents first":  # the race a scancel can run (seen on CI): the
        # agents' step hears it first, its ranks stop, then the supervisor's SIGTERM comes.
        # The job was ended: a cancel, blaming no rank
        job_id = meta.cluster.split()[2].rstrip(",")
        step = _agent_step(job_id)
        subprocess.run(["scancel", "-s", "TERM", step], check=True, timeout=30)
        wait_until(lambda: agent_processes(slurm_conf=slurm.conf) == [], 30, "the agents to go")
        subprocess.run(["scancel", job_id], check=True, timeout=30)
        with pytest.raises(KeyboardInterrupt, match=rf"Slurm ended job {job_id} .*agents got it"):
            handle.result(timeout=30)
    elif end == "agents' step only":  # the agents got SIGTERM, the supervisor never did: a
        # node failure's kind of end, said as the agents said it
        step = _agent_step(meta.cluster.split()[2].rstrip(","))
        subprocess.run(["scancel", "-s", "TERM", step], check=True, timeout=30)
        with pytest.raises(Exception, match="Slurm is ending the job") as failed:
            handle.result(timeout=30)
        assert not isinstance(failed.value, KeyboardInterrupt)
    else:  # its agents leave when their connection to its hub drops, and the job ends
        handle.detach()
        os.kill(meta.pid, signal.SIGKILL)
        with pytest.raises(LaunchError, match=rf"the supervisor \(pid {meta.pid}\) .* died"):
            attach(handle.id, dashboard=False).result(timeout=10)
    wait_until(lambda: not record.running(meta.pid), 20, "the supervisor to exit")
    wait_until(lambda: slurm.jobs() == [], 30, f"the job to end ({end})")
    wait_until(lambda: agent_processes(slurm_conf=slurm.conf) == [], 30, "the agents to end")


def test_a_detached_session_on_a_cluster_outlives_a_killed_kernel_and_stop_ends_its_job(
    runs_dir: Path, slurm: SlurmTestCluster, tmp_path: Path
) -> None:
    """``start(..., cluster=SlurmCluster(...), detach=True)`` from a kernel that is then
    SIGKILLed: the session's supervisor (on the kernel's host) submitted the job and holds
    its hub, so the ranks on the job's nodes and their variables live on; this process
    attaches and uses them, and ``stop()`` ends the ranks, the agents and the job."""
    jobs = tmp_path / "jobs"
    code = textwrap.dedent(
        f"""
        import time
        from notebook_launcher import SlurmCluster, start

        cluster = SlurmCluster(nodes=2, job_dir={str(jobs)!r})
        session = start(num_processes=2, cluster=cluster, detach=True, dashboard=False)
        assert not cluster.running  # the supervisor's job, not this kernel's
        session.run_cell("weights = [rank * 10] * 3")
        print("ID", session.id, flush=True)
        time.sleep(600)
        """
    )
    env = {**kernel_env(), "PYTHONPATH": str(ROOT), record.ROOT_ENV: str(runs_dir)}
    with PlainKernel(code, env) as kernel:
        session_id = kernel.id
        meta = record.read_meta(record.find(session_id))
        assert meta.kind == "session" and meta.nodes == 2 and meta.ranks == 2, meta
        assert meta.cluster.startswith("Slurm job "), meta
        job_id = meta.cluster.split()[2].rstrip(",")
        assert slurm.jobs() == [job_id]
        [info] = runs()
        assert (info.id, info.state, info.nodes) == (session_id, "running", 2)
    # the kernel SIGKILLed, with the session's variables on the job's nodes
    assert meta.pid is not None and record.supervisor_alive(meta)
    session = attach(session_id, dashboard=False)
    assert session.pull("weights") == [[0, 0, 0], [10, 10, 10]]  # still there
    session.run_cell("weights = [w + 1 for w in weights]")
    assert session.pull("weights") == [[1, 1, 1], [11, 11, 11]]
    assert slurm.jobs() == [job_id]
    session.stop()
    wait_until(lambda: not record.running(meta.pid), 20, "the supervisor to exit")
    wait_until(lambda: slurm.jobs() == [], 30, "the session's job to end with it")
    wait_until(lambda: agent_processes(slurm_conf=slurm.conf) == [], 30, "the agents to end")
    assert runs() == []


def test_a_detached_agent_cluster_shows_its_agents_command_and_runs(runs_dir: Path) -> None:
    """An :class:`AgentCluster` detached: its hub is the supervisor's, so the command that
    starts an agent (``agent_command``) is shown in the run's dashboard, recorded as
    every event is; an agent started with it runs the ranks, and leaves with the run."""

    def rank() -> int:
        import torch.distributed as dist

        return dist.get_rank()

    view = Recorder()
    cluster = AgentCluster(nodes=1, host="127.0.0.1")
    handle = notebook_launcher(rank, num_processes=2, cluster=cluster, detach=True, dashboard=view)

    def command() -> str:
        said = [e.state for e in view.of(NodesWaiting) if "start an agent" in e.state]
        return said[-1].split(": ", 1)[1] if said else ""

    wait_until(command, 30, "the dashboard to show the agents' command")
    agent = subprocess.Popen(shlex.split(command()), env=kernel_env())
    try:
        assert handle.result(timeout=60) == [0, 1]
        assert agent.wait(timeout=20) == 0  # it left with the run
    finally:
        agent.kill()
        agent.wait()


def test_a_queued_run_says_so_and_stop_cancels_its_job(
    runs_dir: Path, slurm: SlurmTestCluster, tmp_path: Path
) -> None:
    """The supervisor starts inside the job: while the job waits in the queue the run is
    "queued", the dashboard says the job's state, and stop() cancels the job (nothing
    ran, nothing is left)."""
    view = Recorder()
    cluster = SlurmCluster(
        nodes=2, job_dir=str(tmp_path / "jobs"), sbatch_options=["--begin=now+1hour"]
    )
    handle = notebook_launcher(print, num_processes=2, cluster=cluster, detach=True, dashboard=view)
    said = lambda: [e.state for e in view.of(NodesWaiting)]  # noqa: E731
    wait_until(lambda: any(s.startswith("PENDING") for s in said()), 30, "PENDING shown")
    assert "the run's supervisor starts in the job" in said()[-1], said()
    [info] = runs()
    job_id = (Path(handle.path) / record.JOB).read_text().strip()
    assert info.state == record.QUEUED and f"(Slurm job {job_id}, 2 node(s))" in str(info)
    assert slurm.jobs() == [job_id]
    assert handle.stop() and handle.cancelled()
    assert "stopped while its Slurm job" in view.of(LaunchFinished)[-1].summary
    wait_until(lambda: slurm.jobs() == [], 30, "the queued job to be cancelled")
    assert not os.path.exists(handle.path) and runs() == []


def test_a_job_that_ends_before_its_supervisor_starts_says_why(
    runs_dir: Path, slurm: SlurmTestCluster, tmp_path: Path
) -> None:
    cluster = SlurmCluster(
        nodes=2, job_dir=str(tmp_path / "jobs"), setup=["echo no such module >&2", "exit 3"]
    )
    handle = notebook_launcher(
        print, num_processes=2, cluster=cluster, detach=True, dashboard=False
    )
    with pytest.raises(LaunchError, match="ended before the run's supervisor started") as info:
        handle.result(timeout=60)
    text = str(info.value)
    assert "FAILED" in text and "no such module" in text and "must read this record" in text
    wait_until(lambda: slurm.jobs() == [], 30, "the job to be gone")
