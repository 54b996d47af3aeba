"""This node's side of each attempt of a job across nodes: hear, announce, report, judge.

The launcher (``launcher._Launch``) pumps this node's ranks; :class:`NodeLink` is what it
asks about the other nodes, over the job's store (:mod:`.rendezvous`, whose module
docstring shows the keys). Every call on the store is guarded: a store that goes away
(its node died) ends the attempt here with a verdict naming that node, never with a
``DistNetworkError`` in the user's face.
"""

from __future__ import annotations

import select
import time
from collections.abc import Callable
from typing import Any

from ..errors import RankFailure
from . import rendezvous
from .diagnosis import Verdict, diagnose
from .record import RunRecord

#: what a node that was interrupted announces to the others
INTERRUPTED = "interrupted"


class NodeLink:
    """One node's link to the others of its job, across attempts."""

    def __init__(self, job: rendezvous.NodeJob) -> None:
        self.job = job
        #: nodes whose kernel stopped answering (see rendezvous.LOST_AFTER)
        self.gone: set[int] = set()

    @property
    def wake_fd(self) -> int:
        return self.job.wake_fd

    def guarded(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` on the job's store; an error means the store is gone (the bell
        says so too): noted in ``job.lost``, and None."""
        try:
            return call(*args)
        except Exception as exc:  # noqa: BLE001 - whatever the store raised
            message = str(exc).splitlines()[0] if str(exc) else ""
            self.job.lost = self.job.lost or f"{type(exc).__name__}: {message}"
            return None

    # -- while the ranks run -----------------------------------------------------------

    def heard(self, attempt: int) -> str | None:
        """Why this node's ranks must stop, if another node rang to say so (a failure or
        an interrupt there, or the job's store gone); None otherwise. Beats too."""
        job = self.job
        self.guarded(job.beat)
        if not job.drain() and job.lost is None:
            return None
        found = self.guarded(job.failed_elsewhere, attempt) if job.lost is None else None
        if job.lost is not None:
            return f"the {job.describe()} is gone"
        if found is None or found[0] == job.group_rank:
            return None
        return f"{found[1]} on node {found[0]}"

    def announce(self, attempt: int, what: str = "a rank failed") -> None:
        self.guarded(self.job.announce_failure, attempt, what)

    def tell_interrupted(self, attempt: int, record: RunRecord) -> None:
        """This node was interrupted: the others stop their ranks and report that as the
        cause (not the "connection closed" their ranks get), and nobody restarts."""
        self.tell_ended(attempt, record, INTERRUPTED, "builtins.KeyboardInterrupt")

    def tell_ended(self, attempt: int, record: RunRecord, what: str, exc_type: str) -> None:
        """This node's part of the attempt ended early (``what``, e.g. interrupted, or its
        ranks could not start): the others stop theirs, with this as the root cause."""
        job = self.job
        if job.num_nodes == 1 or job.lost is not None:
            return
        failure = RankFailure(
            job.first_rank(),
            "raised",
            exc_type=exc_type,
            message=f"{what} on node {job.group_rank} ({job.nodes[job.group_rank].label})",
            time=time.time(),
        )
        report = rendezvous.NodeReport(job.group_rank, [failure, *record.failures], {})
        self.announce(attempt, what)
        self.guarded(job.publish, attempt, report)
        self.guarded(job.decide, attempt, False)

    # -- once they all ended -----------------------------------------------------------

    def judge(
        self, attempt: int, record: RunRecord, tick: Callable[[], None]
    ) -> tuple[Verdict, dict[int, bytes | None]]:
        """The attempt's verdict and the exceptions to rebuild, from every node's records:
        this node publishes its own and collects the others' (the same verdict on all).
        ``tick`` keeps the view alive while it waits."""
        job = self.job
        if job.num_nodes == 1:
            return record.verdict(), dict(record.exc_data)
        mine = rendezvous.NodeReport(
            job.group_rank,
            list(record.failures),
            dict(record.finished_at),
            dict(record.exc_data),
            record.barriers.stranded,
        )
        self.guarded(job.publish, attempt, mine)  # lost: judge what we have
        reports = self._collect(attempt, record.failed or record.stopping, tick)
        reports[job.group_rank] = mine
        failures = [f for r in reports.values() for f in r.failures]
        finished: dict[int, float] = {}
        exc_data: dict[int, bytes | None] = {}
        for r in reports.values():
            finished.update(r.finished_at)
            exc_data.update(r.exc_data)
        for g in range(job.num_nodes):
            if g not in reports and (job.lost is None or job.nodes[g].holds_store):
                failures.append(self._silent_node(g))  # lost: the holder is the one gone
        stranded = next((r.stranded for r in reports.values() if r.stranded), None)
        return diagnose(failures, finished, stranded), exc_data

    def _collect(
        self, attempt: int, failed: bool, tick: Callable[[], None]
    ) -> dict[int, rendezvous.NodeReport]:
        """Every node's report. While the job runs fine elsewhere, wait as long as it runs
        (a node whose kernel stops beating is gone); once any node failed, at most
        ``REPORT_TIMEOUT`` seconds."""
        job = self.job
        deadline = time.monotonic() + rendezvous.REPORT_TIMEOUT if failed else None
        reports: dict[int, rendezvous.NodeReport] = {}
        while job.lost is None:
            reports.update(self.guarded(job.reports, attempt, reports) or {})
            pending = [g for g in range(job.num_nodes) if g not in reports]
            self.gone.update(self.guarded(job.gone, pending) or ())
            if not set(pending) - self.gone or job.lost is not None:
                break
            if deadline is None and self.guarded(job.failed_elsewhere, attempt):
                deadline = time.monotonic() + rendezvous.REPORT_TIMEOUT
            if deadline is not None and time.monotonic() >= deadline:
                break
            select.select([job.wake_fd], [], [], 0.5)
            job.drain()
            tick()
        return reports

    def _silent_node(self, group_rank: int) -> RankFailure:
        job = self.job
        node = job.nodes[group_rank]
        if job.lost:
            why = f"the {job.describe()} went away ({job.lost})"
        elif group_rank in self.gone:
            why = (
                f"its kernel stopped answering (no answer within {rendezvous.ANSWER_TIMEOUT:g} "
                f"s, no heartbeat for {rendezvous.LOST_AFTER:g} s at most)"
            )
        else:
            why = f"it sent no report within {rendezvous.REPORT_TIMEOUT:g} s"
        return RankFailure(
            job.first_rank(group_rank),
            "died",
            time=time.time(),
            context=f"node {group_rank} ({node.label}) is gone: {why}",
        )

    def agree(self, attempt: int, restart: bool) -> bool:
        """Restart only if every node says so (one gone, or a lost store: no)."""
        if self.job.num_nodes == 1:
            return restart
        agreed = self.guarded(self.job.decide, attempt, restart and not self.gone)
        return bool(agreed) and self.job.lost is None


__all__ = ["INTERRUPTED", "NodeLink"]
