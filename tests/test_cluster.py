"""One kernel, many nodes: a real Slurm cluster of three nodes on this machine.

The session fixture ``slurm`` starts ``slurmctld`` and three ``slurmd`` (``tests/slurm/``);
every test here drives it as a user would, through :class:`SlurmCluster`, and proves
afterwards that no job, agent or rank is left (``cluster_clean``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from notebook_launcher import ClusterError, SlurmCluster
from notebook_launcher._events import NodesWaiting

from .helpers import SlurmTestCluster, agent_processes, wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


@pytest.fixture
def cluster_clean(slurm: SlurmTestCluster) -> Iterator[SlurmTestCluster]:
    """After the test: no job in Slurm, no agent or rank process (waits a little: a job
    ends a moment after its agents)."""
    yield slurm
    wait_until(lambda: slurm.jobs() == [], 30, f"Slurm holds no job (it has {slurm.jobs()})")
    wait_until(lambda: agent_processes() == [], 30, "no agent or rank process is left")


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
        assert sorted(n.host for n in nodes) == ["n1", "n2"]
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
