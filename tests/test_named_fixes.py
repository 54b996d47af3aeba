"""Errors that name the fix (issue 25, item 15), without starting a process.

A ``cluster=`` that is not a cluster, a rank count that does not split over a cluster's
nodes (refused before any job is submitted), ``SlurmCluster.from_sbatch`` and the magics'
rank lists given nonsense: each is refused with what to write instead. The job directories
of kernels that ended (killed: they could not remove them) go at the next cluster's start.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from notebook_launcher import PreflightError, SlurmCluster, notebook_launcher, start
from notebook_launcher._launch import scheduler as schedulers
from notebook_launcher.ipython_extension import DistMagics, UsageError, parse_ranks

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def nothing() -> None:
    pass


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("slurm", r"cluster='slurm' \(str\) is not a cluster: pass a SlurmCluster or AgentCluster"),
        (42, r"cluster=42 \(int\) is not a cluster: pass a SlurmCluster or AgentCluster"),
        (SlurmCluster, r"cluster=SlurmCluster is the class, not a cluster: .* cluster=SlurmCluster\(nodes=2\)"),
    ],
)  # fmt: skip
def test_a_cluster_that_is_not_one_is_named(given: Any, says: str) -> None:
    with pytest.raises(PreflightError, match=says):
        notebook_launcher(nothing, num_processes=2, cluster=given, dashboard=False)
    with pytest.raises(PreflightError, match=says):
        start(num_processes=2, cluster=given, dashboard=False)


def test_ranks_that_do_not_split_over_the_nodes_are_refused_before_submitting() -> None:
    cluster = SlurmCluster(nodes=2)
    with pytest.raises(PreflightError, match=r"num_processes=3 does not split evenly over .* 2"):
        notebook_launcher(nothing, num_processes=3, cluster=cluster, dashboard=False)
    with pytest.raises(PreflightError, match="one rank per GPU, and the cluster has no GPUs"):
        start(num_processes=None, cluster=cluster, dashboard=False)
    assert not cluster.running and cluster.job_id is None  # nothing was submitted


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ("--nodes two", r"--nodes 'two' is not a whole number \(a count of nodes\)"),
        ("--partition", r"--partition needs a value"),
        ("--job-name 'half", r"No closing quotation; e.g. '--nodes 2"),
    ],
)
def test_from_sbatch_says_what_is_wrong_with_the_options(options: str, says: str) -> None:
    with pytest.raises(PreflightError, match=says):
        SlurmCluster.from_sbatch(options)


def test_the_magics_rank_lists_and_quotes_are_usage_errors() -> None:
    with pytest.raises(UsageError, match=r"ranks 'one': 'one' is not a rank; write them as 1"):
        parse_ranks("one")
    magics = DistMagics(shell=None)
    with pytest.raises(UsageError, match="No closing quotation"):
        magics.rankdiff("model 'half")
    with pytest.raises(UsageError, match="'x' is not a rank"):
        magics.rankdiff("model --ranks 0,x")


class _TwoRanks:
    """A session of ranks 0 and 1 that refuses other ranks as ``Session`` does
    (``_launch/session.py``: ``ValueError("ranks must be some of ...")``)."""

    ranks = [0, 1]

    def _refuse(self, ranks: Any) -> None:
        if ranks is not None and set(ranks) - set(self.ranks):
            raise ValueError(f"ranks must be some of {self.ranks}, got {ranks}")

    def compare(self, *names: str, ranks: Any = None) -> str:
        self._refuse(ranks)
        return "compared"

    def pull(self, name: str, ranks: Any = None) -> list[int]:
        self._refuse(ranks)
        return [1, 1]


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (
            lambda m: m.rankdiff("t --ranks 0,7"),
            "rank 7 is not in this session, whose ranks are 0, 1",
        ),
        (lambda m: m.rankdiff("t --ranks 5-7"), "ranks 5, 6, 7 are not in this session"),
        (lambda m: m.dist("pull t --ranks 9"), "rank 9 is not in this session"),
    ],
)
def test_the_magics_name_the_ranks_a_session_has(call: Any, says: str) -> None:
    """``%rankdiff t --ranks 0,7`` raised a raw ValueError from the session's insides."""
    magics = DistMagics(shell=SimpleNamespace(user_ns={}))
    magics.session = _TwoRanks()
    with pytest.raises(UsageError, match=says):
        call(magics)
    assert magics.rankdiff("t --ranks 0,1") == "compared"


def test_job_directories_of_ended_kernels_go_at_the_next_start(tmp_path: Path) -> None:
    root = tmp_path / "jobs"
    host = socket.gethostname()
    with open("/proc/sys/kernel/pid_max") as f:
        never = int(f.read())  # no process ever has this pid
    parent = schedulers.kernel_id(os.getppid())
    made = {
        "killed": f"{host} {never} 123",  # its kernel is gone
        "reused": f"{parent.rsplit(' ', 1)[0]} 1",  # its pid now belongs to another process
        "alive": parent,  # a kernel that still runs
        "elsewhere": f"another-login-node {never} 123",  # not this host's to judge
    }
    for name, owner in made.items():
        (root / name).mkdir(parents=True)
        (root / name / schedulers.OWNER).write_text(owner)
    (root / "not-ours").mkdir()
    mine = schedulers.jobs_dir(str(root), "new")
    assert sorted(os.listdir(root)) == ["alive", "elsewhere", "new", "not-ours"]
    assert (Path(mine) / schedulers.OWNER).read_text() == schedulers.kernel_id(os.getpid())


def test_more_ranks_than_the_machine_holds_are_refused_naming_the_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 25, item 11: num_processes=10**6 built specs until the kernel ran out of
    memory, and 1,000 on 2 cores forked 60+ ranks before anything said no."""
    import resource

    monkeypatch.setenv("NOTEBOOK_LAUNCHER_MAX_PROCESSES", "3")
    with pytest.raises(
        PreflightError,
        match=r"num_processes=4: 4 ranks are more than this machine can hold: at most 3 "
        r"\(NOTEBOOK_LAUNCHER_MAX_PROCESSES=3\)",
    ):
        notebook_launcher(nothing, num_processes=4, dashboard=False)
    monkeypatch.delenv("NOTEBOOK_LAUNCHER_MAX_PROCESSES")
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(PreflightError, match=rf"at most \d+ \(.*{cores} CPU core\(s\), 16 ranks"):
        notebook_launcher(nothing, num_processes=10**6, dashboard=False)
    with pytest.raises(PreflightError, match=r"1,000,000 ranks are more than this machine"):
        start(num_processes=10**6, dashboard=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 64 + 5 * 2, hard))
    try:
        with pytest.raises(PreflightError, match=r"at most 2 \(this process may open .* ulimit -n"):
            notebook_launcher(nothing, num_processes=4, dashboard=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
