"""The magics on a real Slurm cluster, in a real ipykernel: ``%dist start --slurm``.

``%dist start -n 4 --slurm "--nodes 2"`` submits a job (a count it cannot run is refused
first) and starts a session on its nodes, showing the wait;
``%%distributed`` and ``%%rank`` cells run there; ``%dist stop`` ends the session and the
job the magic submitted (``squeue`` is empty after).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .helpers import SlurmTestCluster, agent_processes, run_cell, started_kernel, wait_until

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(240)]


@pytest.fixture
def kernel(slurm: SlurmTestCluster) -> Iterator[object]:
    with started_kernel() as kc:  # (its environment names the test cluster: SLURM_CONF)
        yield kc
    wait_until(lambda: slurm.jobs() == [], 30, "Slurm holds no job")
    left = lambda: agent_processes(slurm_conf=slurm.conf)  # noqa: E731 - (this cluster's)
    wait_until(lambda: left() == [], 30, "no agent or rank is left")


def test_dist_start_on_slurm_then_cells_then_stop(kernel: object, slurm: SlurmTestCluster) -> None:
    out, reply, tb = run_cell(kernel, "%load_ext notebook_launcher")
    assert reply["status"] == "ok", tb
    # no rank count and no GPUs asked for: said before anything is submitted, in the
    # magic's words, without the library's frames
    out, reply, tb = run_cell(kernel, '%dist start --slurm "--nodes 2 --job-name magic"')
    assert not tb and out.strip() == (  # IPython prints a UsageError alone, no frames
        "UsageError: %dist start without -n means one rank per GPU, and the cluster has no "
        "GPUs (no --gpus-per-node in --slurm). Say how many ranks in all, a multiple of its 2 "
        'node(s): e.g. %dist start -n 4 --slurm "--nodes 2 --job-name magic".'
    ), (out, tb)
    assert slurm.jobs() == []
    out, reply, tb = run_cell(
        kernel,
        'status = %dist start -n 4 --slurm "--nodes 2 --job-name magic" --dashboard text\n'
        "print(status)",
    )
    assert not tb, tb
    assert "session: ready, 4 ranks (gloo, agent)" in out, out
    assert len(slurm.jobs()) == 1
    # the wait for the job and its agents shows, then the ranks ready (not a finished
    # launch), on one clock
    said = [line for line in out.splitlines() if line.startswith("notebook_launcher: ")]
    assert said[0].startswith("notebook_launcher: waiting for Slurm job "), out
    assert "RUNNING, 2/2 agents joined" in out, out
    ready = [line for line in said if line.endswith(": ready")]
    assert len(ready) == 1 and ready[0].startswith("notebook_launcher: 4 ranks, "), out
    assert " done" not in out, out
    out, reply, tb = run_cell(
        kernel, "%%distributed\nimport os\nprint('on', os.environ['SLURMD_NODENAME'])"
    )
    assert reply["status"] == "ok", tb
    said = sorted(line for line in out.splitlines() if " on n" in line)
    labels = [line.split()[0] for line in said]  # each line labelled [host:rankN]
    assert [label.split(":")[1] for label in labels] == ["rank0]", "rank1]", "rank2]", "rank3]"]
    assert all(line.split()[0][1:].split(":")[0] == line.split()[-1] for line in said), said
    out, reply, tb = run_cell(kernel, "%%rank 3\nprint('value', rank * 100)")
    assert reply["status"] == "ok" and ":rank3] value 300" in out, (out, tb)
    out, reply, tb = run_cell(kernel, "%dist stop")
    assert reply["status"] == "ok", tb
    wait_until(lambda: slurm.jobs() == [], 30, "the job the magic submitted ends")
