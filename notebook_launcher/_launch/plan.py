"""Validate and preflight a launch: from the user's arguments to a :class:`LaunchPlan`.

Everything that can be refused is refused here, before any process starts: the
arguments, the state of the kernel (a process group or a ``PartialState`` already created,
CUDA initialised), the start method, and the rendezvous port (bound now, so no other
process can take it). The plan holds one :class:`~notebook_launcher._spec.WorkerSpec` per
local rank and the task in the form the start method needs. Shared by one-shot launches
and persistent sessions.

A launch across nodes (or with restarts) binds nothing here: its rendezvous
(:mod:`.rendezvous`) decides this node's ranks, and :meth:`LaunchPlan.for_attempt` gives
the specs of each attempt.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .. import _placement, _settings
from .._accelerate_env import accelerate_env
from .._events import LaunchStarted
from .._placement import Placement
from .._serialization import dumps_checked, payload_size_warning, share_class_identities
from .._spec import WorkerSpec
from ..errors import LargePayloadWarning
from . import preflight
from .contract import Group
from .rendezvous import NodeJob, RendezvousConfig

#: Imported in the kernel before forking, so that every rank inherits them instead of
#: importing them itself (tqdm's patch and the state module are used by most functions).
FORK_PRELOAD = ("notebook_launcher._worker.progress", "tqdm.std", "notebook_launcher.state")


@dataclass
class LaunchPlan:
    """What a launch will start, decided before anything starts."""

    specs: list[WorkerSpec]
    start_method: str
    #: one line: why this start method (and a replaced port)
    reason: str
    #: the rendezvous store's listening socket (rank 0 gets it); None on nodes > 0
    listen: socket.socket | None
    num_nodes: int
    node_rank: int
    grace_period: float
    #: the rendezvous of a launch across nodes, or with restarts; None: one plain node
    rendezvous: RendezvousConfig | None = None
    max_restarts: int = 0
    #: "port 29500 is busy, using 41234" when the port asked for was taken (also in reason)
    port_note: str | None = None
    #: where the ranks run and why (:func:`notebook_launcher._placement.place`)
    placement: Placement | None = None
    #: ranks forked ahead of the run (a detached run's supervisor: ``_launch.pool``)
    pool: Any = None

    @property
    def world_size(self) -> int:
        return self.specs[0].world_size

    @property
    def ranks(self) -> list[int]:
        return [s.rank for s in self.specs]

    def started_event(
        self, job: NodeJob | None = None, line_prefix: str | None = None
    ) -> LaunchStarted:
        specs = self.for_attempt(job, 0) if job is not None else self.specs
        first = specs[0]
        return LaunchStarted(
            world_size=first.world_size,
            local_world_size=len(specs),
            node_rank=first.node_rank,
            num_nodes=first.num_nodes,
            start_method=self.start_method,
            start_reason=self.reason,
            master_addr=first.master_addr,
            master_port=first.master_port,
            backend=first.backend,
            ranks=tuple(s.rank for s in specs),
            time=time.time(),
            max_restarts=self.max_restarts,
            rendezvous=job.describe() if job is not None and self._shown(job) else "",
            log_line_prefix_template=line_prefix,
            placement=self._placement_shown(),
            banner=(self.placement.banner or "") if self.placement is not None else "",
        )

    def _placement_shown(self) -> str:
        """The placement line the views show: on GPUs (or GPUs hidden from CPU ranks);
        plain CPU ranks on a machine without GPUs say nothing new."""
        p = self.placement
        if p is None or not (p.on_gpu or p.env):
            return ""
        return p.reason

    @staticmethod
    def _shown(job: NodeJob) -> bool:
        """Whether the views name the rendezvous (not for one node that only restarts)."""
        return job.num_nodes > 1 or job.config.backend != "static"

    def for_attempt(self, job: NodeJob | None, attempt: int) -> list[WorkerSpec]:
        """The specs of attempt ``attempt`` (0: the first): with a job, this node's ranks in
        it, joining the job's store under the attempt's own prefix."""
        if job is None:
            return self.specs
        first = job.first_rank()
        return [
            dataclasses.replace(
                spec,
                rank=first + spec.local_rank,
                world_size=job.world_size,
                node_rank=job.group_rank,
                num_nodes=job.num_nodes,
                master_addr=job.host,
                master_port=job.port,
                store_prefix=job.worker_prefix(attempt),
                restart_count=attempt,
                max_restarts=self.max_restarts,
            )
            for spec in self.specs
        ]

    def group(
        self,
        specs: list[WorkerSpec],
        task: Any,
        listen: socket.socket | None,
        on_event: Callable[..., None],
        on_exit: Callable[..., None],
        on_message: Callable[..., None] | None = None,
        attempt: int = 0,
    ) -> Group:
        """The group that runs ``specs``: this machine's ranks (a cluster's plan answers
        with its nodes' ranks instead, :class:`.remote.ClusterPlan`)."""
        from .group import WorkerGroup

        return WorkerGroup(
            specs, self.start_method, task, listen, on_event, on_exit, self.grace_period,
            on_message, pool=self.pool,
        )  # fmt: skip

    def finished(self) -> None:
        """The run on this plan ended, its ranks gone: what its nodes need then (a
        cluster's: :class:`~notebook_launcher._launch.remote.ClusterPlan`); nothing here."""

    def close(self) -> None:
        """Release the listening socket if nobody took it (a launch that never started)."""
        if self.listen is not None:
            self.listen.close()
            self.listen = None


def finished(plan: LaunchPlan) -> None:
    """Tell ``plan`` that its run ended (:meth:`LaunchPlan.finished`). What that fails at
    (Ray unreachable while a lost node's leftovers are freed) is said, never raised over
    the run's own outcome."""
    try:
        plan.finished()
    except Exception as exc:  # noqa: BLE001 - the run's outcome comes first
        print(
            f"notebook_launcher: could not free what the run left on its cluster ({exc!r}); "
            "cluster.close() tries again",
            file=sys.stderr,
        )


def plan_launch(
    function: Callable[..., Any] | None,
    num_processes: int | None,
    *,
    mixed_precision: str = "no",
    use_port: str | int | None = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    start_method: str | None = None,
    grace_period: Any = 1.0,
    rendezvous: RendezvousConfig | None = None,
    max_restarts: int = 0,
    devices: Any = "auto",
    supervised: bool = False,
) -> LaunchPlan:
    """Check everything, choose the start method, bind the rendezvous port (unless a
    ``rendezvous`` of nodes will decide where the store is).

    ``supervised``: the ranks start from a detached run's supervisor, not from this
    kernel: a clean process (no CUDA, none of this kernel's threads or OpenMP pool), so
    this kernel's state has no say in the start method.

    ``function`` is checked when given (a session has none at start). Raises
    :class:`~notebook_launcher.errors.PreflightError` naming the fix.
    """
    preflight.check_platform()
    preflight.check_not_in_a_rank()
    if function is not None:
        preflight.check_function(function)
    preflight.check_nodes(num_nodes, node_rank)
    preflight.check_master_addr(master_addr)
    grace = preflight.check_grace_period(grace_period)
    wanted = _placement.check_devices(devices)
    found = _placement.inventory()
    nprocs = preflight.resolve_num_processes(
        num_processes, _placement.num_processes_for(wanted, found) or 0
    )
    preflight.check_capacity(nprocs)
    where = _placement.place(found, nprocs, wanted, world_size=nprocs * num_nodes, given=devices)
    preflight.check_placement(where, found)
    precision = preflight.check_mixed_precision(mixed_precision, where.on_gpu)
    preflight.check_no_process_group_in_parent()
    state = sys.modules.get("notebook_launcher.state")
    preflight.check_no_state_in_parent(getattr(state, "state_in_use", None))
    if supervised:
        method, reason = preflight.resolve_start_method(start_method, False)
        if start_method in (None, "auto"):
            reason = "from its supervisor, a clean process"  # (no CUDA, none of our threads)
        fork_safe = True
    else:
        may_fork = start_method in (None, "auto", "fork")
        cuda = preflight.cuda_unusable_in_fork(where.on_gpu) if may_fork else None  # a canary
        wants_fork = may_fork and not cuda
        fork_safe = preflight.fork_is_safe() if wants_fork else True  # may fork a probe
        busy = preflight.busy_threads() if wants_fork else []
        method, reason = preflight.resolve_start_method(start_method, cuda, fork_safe, busy)
    listen = None
    try:  # the socket is the plan's once made; until then (Ctrl-C included) ours to close
        if rendezvous is None:
            listen, port, port_note = preflight.bind_rendezvous(master_addr, use_port, node_rank)
            if port_note:
                port_note += f", using {port}"
                reason += f"; {port_note}"
        else:  # the rendezvous binds, on the node that holds its store
            master_addr, port, port_note = rendezvous.host, rendezvous.port, None
        threads = 1 if (method == "fork" and not fork_safe) else threads_per_rank(nprocs)
        specs = rank_specs(
            where,
            first_rank=node_rank * nprocs,
            world_size=nprocs * num_nodes,
            node_rank=node_rank,
            num_nodes=num_nodes,
            store=(master_addr, port),
            precision=precision,
            threads=threads,
            method=method,
        )
        return LaunchPlan(
            specs, method, reason, listen, num_nodes, node_rank, grace, rendezvous,
            max_restarts, port_note, where,
        )  # fmt: skip
    except BaseException:
        if listen is not None:
            listen.close()
        raise


def prepare_task(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any], method: str) -> Any:
    """The task as the start method needs it: the objects themselves for ``fork`` (the
    child inherits them), cloudpickled bytes otherwise (checked, naming what fails)."""
    if method == "fork":
        for name in FORK_PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
        share_class_identities(function, *args, *kwargs.values())  # see _serialization
        return (function, args, kwargs)
    data = dumps_checked((function, args, kwargs), "the launched function and its args")
    note = payload_size_warning(len(data))
    if note:
        warnings.warn(note, LargePayloadWarning, stacklevel=4)
    return data


def threads_per_rank(nprocs: int) -> int | None:
    """CPU threads for each rank's torch ops: the cores shared out, unless the user chose
    (OMP_NUM_THREADS), so that N ranks do not fight over the same cores."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // nprocs)


def rank_specs(
    placement: Placement,
    *,
    first_rank: int,
    world_size: int,
    node_rank: int,
    num_nodes: int,
    store: tuple[str, int],
    precision: str,
    threads: int | None,
    method: str = "fork",
    store_prefix: str | None = None,
    max_restarts: int = 0,
    session: bool = False,
) -> list[WorkerSpec]:
    """One node's specs: local rank ``i`` is global rank ``first_rank + i`` on the device
    ``placement`` gave it. The one builder of specs, for this machine's launches and
    sessions and for every node of a cluster (whose agent completes what only the node
    knows: its environment, a working directory that exists there)."""
    extra = {  # what real Accelerate (and Transformers' Trainer) reads to join the group
        **accelerate_env(precision, placement.backend, threads, os.environ, placement.on_gpu),
        "NOTEBOOK_LAUNCHER_START_METHOD": method,
    }
    inherit = method == "fork" or store_prefix is not None  # forked here, or by an agent
    base = {} if inherit else dict(os.environ)
    settings = _settings.capture()  # fork too: Python reseeds `random` in a forked child
    nprocs = len(placement.devices)
    return [
        WorkerSpec(
            rank=first_rank + local,
            local_rank=local,
            world_size=world_size,
            local_world_size=nprocs,
            node_rank=node_rank,
            master_addr=store[0],
            master_port=store[1],
            backend=placement.backend,
            env={**base, **extra, **placement.rank_env(local)},
            cwd=os.getcwd(),
            sys_path=list(sys.path),
            replace_environ=not inherit,
            num_threads=threads,
            settings=settings,
            session=session,
            store_prefix=store_prefix,
            num_nodes=num_nodes,
            max_restarts=max_restarts,
            device=placement.devices[local],
            memory_fraction=placement.memory_fraction,
        )
        for local in range(nprocs)
    ]


__all__ = [
    "FORK_PRELOAD",
    "LaunchPlan",
    "finished",
    "plan_launch",
    "prepare_task",
    "rank_specs",
    "threads_per_rank",
]
