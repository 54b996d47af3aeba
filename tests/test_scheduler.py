"""Schedulers behind one small interface (issue 34, item 3): what a cluster asks of the
scheduler that starts its agents, and what nothing outside a scheduler's module may know.

A fake scheduler that follows the interface's rules (``_launch.scheduler``'s docstring:
``status()`` is asked while the kernel waits, an impossible request or an ended job stops
the wait, ``cancel(now=True)`` ends an aborted start) drives the real :class:`Cluster` and
its real hub; no agent ever joins, as none would from a job that cannot start. The real
schedulers run in ``test_cluster.py`` (Slurm, loopback) and ``test_ray.py`` (Ray, in a
network namespace).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest

import notebook_launcher
from notebook_launcher._launch import scheduler
from notebook_launcher._launch.remote import RemoteNode, _refused_or_gone
from notebook_launcher._launch.scheduler import HandStarted, JobStatus, Phase, Reason, Scheduler
from notebook_launcher._wire import agent as wire
from notebook_launcher.cluster import Cluster
from notebook_launcher.errors import ClusterError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

PACKAGE = Path(notebook_launcher.__file__).resolve().parent


class Fake(Scheduler):
    """A scheduler whose job says ``said`` (a list of statuses, the last one repeated) --
    as a real one does, it is asked twice a second while the kernel waits."""

    FRESH: ClassVar[dict[str, Any]] = {"submitted": False, "cancelled": None, "asked": 0}

    def __init__(self, said: list[JobStatus]) -> None:
        super().__init__(1)
        self.said = said

    def submit(self, hub: Any) -> None:
        self.submitted = True

    def status(self, settled: bool = False) -> JobStatus:
        self.asked += 1
        return self.said[min(self.asked - 1, len(self.said) - 1)]

    def cancel(self, now: bool = False) -> None:
        self.cancelled = now

    def describe(self) -> str:
        return "fake job 7, 1 node(s)"

    def dump(self) -> dict[str, Any]:
        return {"said": [s.text for s in self.said]}

    @classmethod
    def load(cls, data: Any) -> Fake:
        return cls([JobStatus(Phase.PENDING, Reason.WAITING, t) for t in data["said"]])

    def address(self) -> str:
        return "127.0.0.1"


@pytest.mark.parametrize(
    ("said", "message"),
    [
        (
            [
                JobStatus(
                    Phase.PENDING, Reason.IMPOSSIBLE, "fake job 7: PENDING", fix="ask for less"
                )
            ],
            r"^fake job 7: PENDING: it can never start \(ask for less\)\. It was cancelled\.$",
        ),
        (
            [
                JobStatus(Phase.PENDING, Reason.WAITING, brief="queued"),
                JobStatus(Phase.ENDED, Reason.FAILED, "fake job 7: FAILED", output="no module x"),
            ],
            r"^fake job 7: FAILED, before its agents joined \(0 of 1\)\. Its output ends with:\nno module x\n$",
        ),
    ],
)
def test_a_job_that_can_never_start_or_ended_stops_the_wait_and_is_cancelled(
    said: list[JobStatus], message: str
) -> None:
    fake = Fake(said)
    cluster = Cluster(1, scheduler=fake)
    with pytest.raises(ClusterError, match=message):
        cluster.start()
    assert fake.submitted and fake.cancelled is True  # an aborted start: ended at once
    assert not cluster.running


def test_start_timeout_bounds_a_pending_job_whatever_its_scheduler() -> None:
    fake = Fake([JobStatus(Phase.PENDING, Reason.WAITING, "fake job 7: PENDING (Priority)")])
    cluster = Cluster(1, scheduler=fake, start_timeout=0.0)
    with pytest.raises(ClusterError, match=r"PENDING \(Priority\) after 0 s \(start_timeout\)"):
        cluster.start()
    assert fake.cancelled is True


def test_a_scheduler_pickles_as_its_configuration_and_loads_from_its_dump() -> None:
    fake = Fake([JobStatus(Phase.RUNNING, text="up")])
    fake.submitted, fake.asked = True, 3
    copy = pickle.loads(pickle.dumps(fake))
    assert (copy.submitted, copy.asked, copy.said) == (False, 0, fake.said)
    dumped = scheduler.dump(fake)
    assert dumped["kind"] == f"{__name__}:Fake"
    with pytest.raises(ClusterError, match="unknown scheduler"):  # a record names ours only
        scheduler.load(dumped)
    hand = scheduler.load(scheduler.dump(HandStarted(3)))
    assert isinstance(hand, HandStarted) and hand.nodes == 3


def test_an_outcome_is_decided_on_its_typed_reason_not_on_the_words() -> None:
    """An agent's words that read like another reason decide nothing: only ``Ending``."""
    hello = wire.NodeHello("n2", 1, 0, "3.11", "2", "0", "/", labels={"node": "gpu-2"})
    node = RemoteNode(1, None, hello, gone="its connection ended")  # type: ignore[arg-type]
    assert node.label == "node 1 (gpu-2)"  # a label names the node, over the host name
    node.ending = "its ranks could not start: this is what an agent that got SIGTERM said"
    node.end_reason = wire.Ending.TERMINATED
    assert (
        _refused_or_gone(node) == "node 1 (gpu-2) was gone before it started: its connection ended"
    )

    from notebook_launcher import _supervise

    job = Fake([JobStatus(Phase.RUNNING)])
    failure = RuntimeError("its agent got SIGTERM: the scheduler is ending the job")
    _supervise._terminated.clear()
    _supervise._agents_told_to_end.clear()
    assert _supervise._why_terminated(failure, job) is failure  # words alone: a failure
    _supervise._terminated.append(True)
    _supervise._agents_told_to_end.append(True)
    try:
        ended = _supervise._why_terminated(failure, job)
    finally:
        _supervise._terminated.clear()
        _supervise._agents_told_to_end.clear()
    assert isinstance(ended, KeyboardInterrupt)
    assert str(ended).startswith(
        "fake job 7, 1 node(s) was ended (SIGTERM to the run's supervisor)"
    )


#: where no scheduler's own names may be (the issue's "Done when"): the kernel side but for
#: each scheduler's module, the wire, the agent, the supervisor, the detached modules
SCHEDULER_FREE = (
    "_launch",
    "_wire",
    "_agent",
    "_supervise.py",
    "detached.py",
    "detached_session.py",
)
OWN_MODULES = {"_launch/slurm.py", "_launch/ray.py"}


def test_no_scheduler_names_outside_their_own_module() -> None:
    found = []
    for part in SCHEDULER_FREE:
        paths = [PACKAGE / part] if part.endswith(".py") else sorted((PACKAGE / part).rglob("*.py"))
        for path in paths:
            rel = path.relative_to(PACKAGE).as_posix()
            if rel in OWN_MODULES:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"slurm|sbatch|scancel|srun\b", line, re.IGNORECASE):
                    found.append(f"{rel}:{number}: {line.strip()}")
    assert found == []


def test_no_cluster_class_is_tested_for_outside_its_module() -> None:
    found = [
        f"{path.relative_to(PACKAGE)}: {m.group(0)}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "cluster.py"
        for m in re.finditer(r"isinstance\([^)]*(Slurm|Ray|Agent)Cluster\)", path.read_text())
    ]
    assert found == []
