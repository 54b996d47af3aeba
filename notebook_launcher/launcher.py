"""``notebook_launcher()``: validate -> preflight -> start ranks -> pump events -> return or raise.

The one module where the process side (``_launch``) meets the views (``ui``). Who runs
where, and what crosses which channel::

    kernel (this process)                                  rank r (one process each)
    ---------------------                                  -------------------------
    _launch.plan        check arguments and kernel state,
                        choose fork / forkserver / spawn,
                        bind the rendezvous port
    _launch.group       WorkerGroup.start() ---- starts --->  _worker.entry.run()
                                                                env, init_process_group
      control channel   <== events (progress, barriers) ===   _worker.runtime.emit()
      (_wire.control)   <== Returned(value) | Raised(exc) ==  fn(*args, **kwargs) ends
                        === Setup(spec), Task(fn) =======>   (not with fork: inherited)
      stdout/stderr     <== bytes, split into lines ======    print(), C++, subprocesses
      pidfd             <-- readable when the rank exits
    WorkerGroup.pump()  waits on all of them at once, in the one loop that drives every run
                        (GroupRun.drive, under the launch's policy); every event and output
                        line goes to RunRecord.on_event (stderr tails, barrier progress) and
                        the view

From a rank's exit to the exception the user catches:

    pidfd readable -> WorkerProcess.reap() (exit code) -> drain its channel and pipes
    -> RunRecord.on_exit(): Returned = a result; Raised = a "raised" RankFailure (with
       the pickled exception); an exit code or signal = "died"; killed by us = "stopped"
    -> the first failure: WorkerGroup.terminate() stops the others (SIGTERM, SIGKILL
       after grace_period); Ctrl-C does the same and re-raises KeyboardInterrupt
    -> every rank ended: diagnosis.diagnose(records) picks the root cause (a Verdict)
    -> LaunchFinished to the view; return the results, or raise
       diagnosis.exception_for(verdict): the rank's own exception type, WorkerDied or
       ProcessGroupMismatch, with every rank's record in ``exc.launch_failure``.

Across nodes, and with restarts (``_launch.rendezvous``: torch's own rendezvous, one
notebook or script per machine; ``_launch.nodes``: this node's side of each attempt)::

    rendezvous.join()   the nodes meet (static: node_rank; c10d: torch assigns the ranks);
                        this node's ranks, the job's world size; its ranks join the store
                        of the node that holds it, under a prefix per attempt
    drive               + a node's bell (wake fd, _Attending): another node announced a
                        failure -> stop ours, as collateral; ours failed -> announce it
    every rank ended    -> publish this node's records, collect every node's: the same
                        verdict everywhere (the root cause's rank and exception included)
    a death (or, when asked, an exception) with restarts left, on every node's word
                        -> LaunchRestarting to the view, the next attempt's ranks start
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ._events import LaunchRestarting, RendezvousStarted
from ._launch import preflight, rendezvous, stall
from ._launch.diagnosis import RestartPolicy, Verdict, as_child_failed
from ._launch.handover import LaunchJob
from ._launch.lifecycle import (
    GroupRun,
    Kind,
    Outcome,
    Policy,
    Purpose,
    RunEnd,
    add_note,
    decide,
    finished_event,
    value_of,
)
from ._launch.nodes import NodeLink
from ._launch.plan import LaunchPlan, finished, plan_launch, prepare_task
from ._launch.record import RunRecord, Stop
from ._launch.session import TaskHandle
from .detached import attach, runs
from .errors import LaunchError, PreflightError, interrupted
from .session import start as start_session
from .tracking import log
from .ui import View
from .ui.lazy import launch_view as _view
from .ui.stall import Stacks

if TYPE_CHECKING:
    from .cluster import Cluster


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str | int | None = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    *,
    kwargs: dict[str, Any] | None = None,
    start_method: str | None = None,
    dashboard: bool | str | View = "auto",
    grace_period: float = 1.0,
    block: bool = True,
    join_timeout: float = preflight.DEFAULT_JOIN_TIMEOUT,
    restart_on_exception: bool
    | type[BaseException]
    | tuple[type[BaseException], ...]
    | None = None,
    raise_child_failed: bool | None = None,
    cluster: Cluster | None = None,
    stall_after: float | None = stall.DEFAULT_STALL_AFTER,
    devices: str | list[int] | tuple[int, ...] = "auto",
    detach: bool = False,
) -> Any:
    """Run ``function(*args, **kwargs)`` on ``num_processes`` ranks and return their results.

    Accelerate's signature and meaning, so existing notebooks keep working. Each rank
    runs in its own process with ``torch.distributed`` initialised (NCCL, one GPU per
    rank, when GPUs are visible; gloo on CPU otherwise) and the usual env
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...).

    ``args`` (a tuple) and ``kwargs`` (a dict, keyword only; Accelerate's launcher has no
    such argument) are what every rank calls ``function`` with:
    ``notebook_launcher(train, args=(model,), kwargs={"lr": 1e-3}, num_processes=2)``.
    Ranks that are not forked get them pickled (cloudpickle), as they get ``function``.
    ``mixed_precision`` (``"no"``, ``"fp16"``, ``"bf16"``) is Accelerate's;
    ``use_port`` and ``master_addr`` are the rendezvous (a busy port is replaced by a free
    one, said in the launch line; ``"auto"``: a free one); ``monitor_interval`` is accepted
    and unused (the launcher waits on the ranks' exits instead of polling them).

    Returns the list of per-rank return values (index = rank on this node). If a rank
    fails, the caller gets that rank's own exception (with its traceback), or
    :class:`~notebook_launcher.WorkerDied` / :class:`~notebook_launcher.ProcessGroupMismatch`;
    the other ranks are stopped and the kernel stays usable.

    Several machines: run the same call on each, with ``num_nodes=M`` and the same
    rendezvous: ``rdzv_backend="static"`` (each node its own ``node_rank``; node 0 holds the
    store at ``master_addr:use_port``) or ``"c10d"`` (torch assigns the node ranks; the node
    whose address is ``rdzv_endpoint`` holds the store); ``rdzv_id`` names the job and
    ``rdzv_conf`` passes options to torch's handler. Every node waits up to
    ``join_timeout`` seconds for the others, then raises
    :class:`~notebook_launcher.errors.RendezvousError` naming the missing ones. A failure on
    any node stops the ranks of every node, and every node raises the root cause.

    ``max_restarts=n``: a rank that dies (a signal, an exit code) stops every rank and
    starts them all again, up to ``n`` times (``TORCHELASTIC_RESTART_COUNT`` tells the
    ranks which attempt they are). An exception the function raises is a bug and ends the
    launch, unless ``restart_on_exception`` is True (any exception, as torch elastic), an
    exception class or a tuple of them (``None``: env
    ``NOTEBOOK_LAUNCHER_RESTART_ON_EXCEPTION=1`` means True).
    ``raise_child_failed=True`` (``None``: env ``NOTEBOOK_LAUNCHER_RAISE_CHILD_FAILED=1``)
    raises torch elastic's ``ChildFailedError`` instead, as Accelerate's launcher does, with
    the rank's own exception as its ``__cause__``: for code that catches ``ChildFailedError``.
    ``log_line_prefix_template`` (``"[${rank}]: "``; torch elastic's ``${rank}``,
    ``${local_rank}``, ``${role_name}``) replaces the ``[rankN]`` label of output lines.

    ``cluster``: run on the nodes of a :class:`~notebook_launcher.SlurmCluster` (or an
    :class:`~notebook_launcher.AgentCluster`), driven from this kernel: ``num_processes``
    is then the job's total, split evenly over its nodes (None: one per GPU of every
    node). The cluster starts with the first launch that needs it and stays for the next.

    ``stall_after`` (seconds, default 30; ``None``: off): when no rank made progress (no
    event, output line or progress update) for that long, the dashboard (and the text
    view) shows where every rank is -- each thread's Python stack, the odd rank(s) out
    named -- until progress resumes. ``handle.stacks()`` shows it on demand for a
    ``block=False`` launch, and an interrupted stuck launch says where each rank was.

    ``devices`` (where the ranks run; the kernel itself never touches CUDA):

    * ``"auto"`` (default): one rank per GPU on NCCL; more ranks than GPUs share them on
      gloo, each held to its share of the GPU's memory (said in a banner: lessons written
      for two ranks run on Colab's one GPU); CPU ranks on gloo where there is no GPU. One
      rank alone is not a distributed job: ``distributed_type`` NO, no NCCL communicator.
    * ``"gpu"``: one rank per GPU on NCCL (a lone rank too), refused when there are fewer
      GPUs than ranks.
    * ``"cpu"``: CPU ranks on gloo, the GPUs hidden from them.
    * ``[0, 2]``: those GPUs, one rank each (``num_processes`` may be left out).

    Extras beyond Accelerate: ``kwargs`` (above), ``start_method``
    (``None`` chooses: fork unless CUDA is initialised here, then a forkserver),
    ``dashboard`` (``"auto"``, ``True``, ``False``, or any object with the
    ``notebook_launcher.ui.View`` methods, which then receives every event), ``grace_period`` (seconds between
    SIGTERM and SIGKILL when stopping ranks), ``block=False`` (return at once a
    ``concurrent.futures.Future``-like handle: ``result(timeout)``, ``exception()``,
    ``done()``, ``cancel()`` stops the ranks, ``add_done_callback``; the dashboard stays in
    this cell and keeps updating while other cells run), ``join_timeout`` and
    ``restart_on_exception`` (above).

    ``detach=True``: the ranks run under a supervisor process of their own, not this
    kernel's child: killing, restarting or shutting down the kernel leaves the run going.
    Returns at once a handle as ``block=False`` does, plus ``.id`` (printed) and
    ``.stop()``; ``notebook_launcher.attach(id)`` follows the run again from any kernel of
    yours on this machine (its dashboard with the whole history, then live), and
    ``notebook_launcher.runs()`` lists the runs (``notebook_launcher.detached``). With
    ``cluster=`` (a cluster not started in this kernel): the supervisor starts the cluster
    (submits the Slurm job, holds its agents' hub and the store), runs the launch there
    and ends the job when the run ends, is stopped, or the supervisor dies. With
    ``num_nodes > 1`` (a launch across machines started by hand): this node's ranks, under
    this machine's supervisor, which meets the other nodes as the kernel would have.

    Example::

        def train(lr):
            from notebook_launcher import PartialState
            state = PartialState()
            return state.process_index * lr

        notebook_launcher(train, args=(0.1,), num_processes=2)   # -> [0.0, 0.1]

        # the same function on two machines: this cell on each, node_rank 0 and 1
        notebook_launcher(train, args=(0.1,), num_processes=2, num_nodes=2, node_rank=0,
                          master_addr="10.0.0.1", use_port=29500)
    """
    __tracebackhide__ = True  # IPython and pytest show the caller's frames, then the rank's
    watch_after = stall.check_stall_after(stall_after)
    preflight.check_detach(detach, cluster)
    if cluster is not None:
        launch = _on_cluster(
            cluster, function, args, kwargs, num_processes, mixed_precision, max_restarts,
            log_line_prefix_template, dashboard, grace_period, block, restart_on_exception,
            raise_child_failed,
            devices,
            others=dict(num_nodes=(num_nodes, 1), node_rank=(node_rank, 0),
                        rdzv_backend=(rdzv_backend, "static"), rdzv_endpoint=(rdzv_endpoint, ""),
                        start_method=(start_method, None)),
            detach=detach, stall_after=watch_after,
        )  # fmt: skip
        if not isinstance(launch, _Launch):  # detached: the supervisor's job, followed here
            return launch
        launch.watch.stall_after = watch_after
        if not block:
            return _in_background(launch, function)
        outcome = launch.run_to_end()
        launch._release()
        del launch  # (see below)
        if isinstance(outcome, BaseException):
            raise outcome  # here, so that the traceback shows the caller, then the rank
        return outcome
    preflight.check_args(args, kwargs)
    preflight.check_dashboard(dashboard)
    del monitor_interval  # we wait on sentinels instead of polling
    preflight.check_nodes(num_nodes, node_rank)
    preflight.check_master_addr(master_addr)
    policy = RestartPolicy(
        preflight.check_max_restarts(max_restarts),
        preflight.check_restart_on_exception(restart_on_exception),
    )
    line_prefix = preflight.check_log_line_prefix_template(log_line_prefix_template)
    child_failed = preflight.check_raise_child_failed(raise_child_failed)
    meeting = preflight.check_rendezvous(
        rdzv_backend,
        rdzv_endpoint,
        rdzv_conf,
        rdzv_id,
        master_addr=master_addr,
        use_port=use_port,
        num_nodes=num_nodes,
        node_rank=node_rank,
        join_timeout=join_timeout,
        max_restarts=policy.max_restarts,
    )
    plan = plan_launch(
        function,
        num_processes,
        mixed_precision=mixed_precision,
        use_port=use_port,
        master_addr=master_addr,
        node_rank=node_rank,
        num_nodes=num_nodes,
        start_method=start_method,
        grace_period=grace_period,
        rendezvous=meeting,
        max_restarts=policy.max_restarts,
        devices=devices,
        supervised=detach,
    )
    elastic_name = getattr(function, "__name__", "function") if child_failed else None
    if detach:  # the same plan, run by a supervisor of its own (notebook_launcher.detached)
        from .detached import launch as launch_detached

        job = LaunchJob(policy, line_prefix, elastic_name, watch_after)
        return launch_detached(plan, function, tuple(args), dict(kwargs or {}), job, dashboard)
    try:
        task = prepare_task(function, tuple(args), dict(kwargs or {}), plan.start_method)
        view = _view(dashboard, block)
    except BaseException:
        plan.close()
        raise
    launch = _Launch(plan, task, view, policy, line_prefix, elastic_name)
    launch.watch.stall_after = watch_after
    if not block:
        return _in_background(launch, function)
    outcome = launch.run_to_end()
    launch._release()
    # The traceback of what is raised keeps this frame: not the launch's records (the
    # rank's pickled exception), nor the task (the pickled function and its args).
    del launch, task
    if isinstance(outcome, BaseException):
        raise outcome  # here, so that the traceback shows the caller, then the rank
    return outcome


def _in_background(launch: _Launch, function: Any) -> TaskHandle:
    """A non-blocking launch: its ranks start here, a thread of its own pumps them."""
    launch.start()  # in this thread: the ranks die with the thread that started them
    handle = TaskHandle(
        launch.interrupt,
        getattr(function, "__name__", ""),
        stacks=lambda: Stacks(launch.watch.take()),
    )
    # In this cell's context: what the thread shows belongs to this cell (ipykernel keeps
    # the cell of an output in context variables), not to the cell that runs meanwhile.
    cell = contextvars.copy_context()
    threading.Thread(
        target=cell.run, args=(launch.finish_into, handle), name="notebook-launcher", daemon=True
    ).start()
    return handle


def _on_cluster(
    cluster: Cluster,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    num_processes: int | None,
    mixed_precision: str,
    max_restarts: int,
    log_line_prefix_template: str | None,
    dashboard: bool | str | View,
    grace_period: float,
    block: bool,
    restart_on_exception: Any,
    raise_child_failed: bool | None,
    devices: Any,
    others: dict[str, tuple[Any, Any]],
    detach: bool = False,
    stall_after: float | None = None,
) -> Any:
    """A launch on a cluster's nodes: one controller, every rank of the job planned here
    (a :class:`_Launch`); with ``detach``, handed to a supervisor that starts the cluster
    and runs the launch (``detached.launch_on_cluster``; its handle)."""
    __tracebackhide__ = True
    from .cluster import check_cluster

    check_cluster(cluster)
    for name, (value, default) in others.items():
        if value != default:
            raise PreflightError(
                f"{name}={value!r} with cluster=...: the cluster's nodes are the job's nodes "
                "and this kernel drives them all (leave num_nodes, node_rank, the rendezvous "
                "and start_method as they are)."
            )
    preflight.check_not_in_a_rank()
    preflight.check_function(function)
    preflight.check_args(args, kwargs)
    preflight.check_dashboard(dashboard)
    policy = RestartPolicy(
        preflight.check_max_restarts(max_restarts),
        preflight.check_restart_on_exception(restart_on_exception),
    )
    line_prefix = preflight.check_log_line_prefix_template(log_line_prefix_template)
    child_failed = preflight.check_raise_child_failed(raise_child_failed)
    task = prepare_task(function, tuple(args), dict(kwargs or {}), "agent")
    elastic_name = getattr(function, "__name__", "function") if child_failed else None
    options = dict(
        mixed_precision=mixed_precision, grace_period=grace_period,
        max_restarts=policy.max_restarts, devices=devices,
    )  # fmt: skip
    if detach:  # what can be checked without the nodes is checked here, before any sbatch
        from ._launch.remote import cluster_ranks
        from ._placement import check_devices
        from .detached import launch_on_cluster

        total, _ = cluster_ranks(
            num_processes, cluster.num_nodes, cluster.gpus_per_node, devices=devices
        )
        preflight.check_grace_period(grace_period)
        check_devices(devices)
        job = LaunchJob(
            policy, line_prefix, elastic_name, stall_after, task=task, cluster=cluster,
            num_processes=num_processes, options=options,
        )  # fmt: skip
        name = getattr(function, "__name__", "function")
        return launch_on_cluster(name, total, cluster.num_nodes, job, dashboard)
    view = _view(dashboard, block)
    return _cluster_launch(cluster, task, view, num_processes, options, policy, line_prefix,
                           elastic_name)  # fmt: skip


def _cluster_launch(
    cluster: Cluster,
    task: Any,
    view: View,
    num_processes: int | None,
    options: dict[str, Any],
    policy: RestartPolicy,
    line_prefix: str | None,
    elastic_name: str | None,
) -> _Launch:
    """The cluster started (if need be: the wait shown in ``view``) and the launch planned
    on its nodes; a detached run's supervisor does the same (``_supervise``)."""
    __tracebackhide__ = True
    try:
        plan = cluster.plan(view.handle, num_processes, tick=view.tick, **options)
    except BaseException as exc:  # the nodes could not be had: said, then raised
        never = RunEnd(Purpose.LAUNCH, (), 0, start_error=exc)
        view.handle(finished_event(never, decide(never)))
        view.close()
        raise
    return _Launch(plan, task, view, policy, line_prefix, elastic_name)


class _Launch:
    """One launch from start to verdict: the rendezvous when there is one, then each
    attempt's ranks (a :class:`~notebook_launcher._launch.lifecycle.GroupRun`: start, pump,
    stop, close), the other nodes' word, restarts, and the end (``lifecycle.decide``)."""

    def __init__(
        self,
        plan: LaunchPlan,
        task: Any,
        view: View,
        policy: RestartPolicy | None = None,
        line_prefix: str | None = None,
        child_failed_name: str | None = None,
    ) -> None:
        self.plan, self.task, self.view = plan, task, view
        self.policy = policy or RestartPolicy()
        self.line_prefix = line_prefix
        #: the function's name when failures are raised as torch elastic's ChildFailedError
        self.child_failed_name = child_failed_name
        self._listen, plan.listen = plan.listen, None  # ours now
        self.job: rendezvous.NodeJob | None = None
        self.link: NodeLink | None = None  # with a job: the other nodes
        self.attempt = 0
        #: how each earlier attempt ended, one line each
        self.history: list[str] = []
        #: this attempt's ranks
        self.run: GroupRun | None = None
        #: the verdict of the last attempt (reached with every node, across nodes)
        self.verdict: Verdict | None = None
        self.exc_data: Mapping[int, bytes | None] = {}
        #: the user interrupted (Ctrl-C, cancel()): every attempt's ranks stop for it
        self.interrupted = False
        self._announced = False
        self.end: RunEnd | None = None
        #: ``decide(end)``, once
        self.outcome: Outcome | None = None
        self.t0 = time.time()
        #: where every rank is when nothing moves (fed events, ticked by the pump)
        self.watch = stall.StallWatch(None, view.handle)
        #: where each rank was when the user interrupted a stuck launch
        self.interrupt_report: Any = None

    @property
    def world_size(self) -> int:
        return self.job.world_size if self.job is not None else self.plan.world_size

    @property
    def record(self) -> RunRecord:
        """This attempt's records (an empty one before the first attempt starts)."""
        if self.run is None:
            return RunRecord([s.rank for s in self.plan.specs])
        return self.run.record

    # -- start -------------------------------------------------------------------------

    def start(self) -> None:
        """Meet the other nodes (if any), then start this node's ranks."""
        try:
            c = self.plan.rendezvous
            if c is not None and c.num_nodes > 1:  # the others may take a while
                self.view.handle(
                    RendezvousStarted(
                        c.backend,
                        c.endpoint,
                        c.run_id,
                        c.num_nodes,
                        c.node_rank,
                        c.join_timeout,
                        time.time(),
                    )
                )
            if c is not None:
                self.job = rendezvous.join(c, len(self.plan.specs))
                self.link = NodeLink(self.job)
            self.view.handle(self.plan.started_event(self.job, self.line_prefix))
            self._start_attempt()
        except BaseException as exc:
            self._tell_others(exc)
            self._end(error=exc)
            raise

    def _tell_others(self, error: BaseException) -> None:
        """This node's ranks could not start (or were interrupted while starting): the
        other nodes must not wait for them."""
        if self.link is None:
            return
        if isinstance(error, KeyboardInterrupt):
            self.link.tell_interrupted(self.attempt, self.record)
        else:
            kind = f"{type(error).__module__}.{type(error).__qualname__}"
            what = f"its ranks could not start ({type(error).__name__}: {error})"
            self.link.tell_ended(self.attempt, self.record, what, kind)

    def _start_attempt(self) -> None:
        specs = self.plan.for_attempt(self.job, self.attempt)
        listen, self._listen = self._listen, None  # the group owns it now

        def make_group(on_event: Any, on_exit: Any, on_message: Any) -> Any:
            return self.plan.group(
                specs, self.task, listen, on_event, on_exit, on_message, attempt=self.attempt
            )

        self._announced = False
        self.run = GroupRun(make_group, [s.rank for s in specs], self.view, self.watch)
        self.run.start()

    # -- run ---------------------------------------------------------------------------

    def run_to_end(self) -> list[Any] | BaseException:
        """Start, pump until every rank ended (restarting as the policy says); the results,
        or the exception to raise. Ctrl-C, once or many times, at any moment: every rank
        stopped, and the exception is an interrupt that says so (raised by the caller, so
        that its traceback shows the caller's line, not where the launch waited)."""
        try:
            self.start()
        except KeyboardInterrupt:
            return interrupted("interrupted while starting: no rank was left running")
        except LaunchError as exc:  # the nodes could not meet, a rank could not start:
            return exc.with_traceback(None)  # said at the caller's line, as a failure is
        try:
            self._attempts()
        except KeyboardInterrupt:
            self._interrupted()  # the outcome says so (with where the ranks were, if stuck)
        finally:
            self._end()
        return self._outcome()

    def _attempts(self) -> None:
        while True:
            assert self.run is not None
            self.run.drive(_Attending(self))  # (a failure stops the others)
            if not self._next_attempt():
                return

    def interrupt(self) -> None:
        """Stop every rank (a non-blocking launch's ``cancel()``, or Ctrl-C on its result)."""
        if not self.interrupted:
            self.interrupt_report = self.watch.on_interrupt()
        self.interrupted = True
        if self.run is not None:
            self.run.stop(Stop.INTERRUPTED)

    def _interrupted(self) -> None:
        """Ctrl-C: stop this node's ranks now (another Ctrl-C meanwhile: at once); tell the
        other nodes (see :meth:`NodeLink.tell_interrupted`)."""
        if not self.interrupted:
            self.interrupt_report = self.watch.on_interrupt()
            if self.interrupt_report is not None:
                self.view.handle(self.interrupt_report)
        self.interrupted = True
        while True:
            try:
                if self.run is not None:
                    self.run.stop(Stop.INTERRUPTED, wait=True)  # a second Ctrl-C: kill the rest
                if self.link is not None:
                    self.link.tell_interrupted(self.attempt, self.record)
                return
            except KeyboardInterrupt:
                continue

    def finish_into(self, handle: TaskHandle) -> None:
        """A non-blocking launch's thread: pump (and restart), then settle ``handle``."""
        try:
            try:
                self._attempts()
            finally:
                self._end()
            outcome = self._outcome()
        except BaseException as exc:  # noqa: BLE001 - the handle carries whatever happened
            outcome = exc
        self._release()  # the handle keeps this launch (its cancel()): not its big data
        if isinstance(outcome, BaseException):
            handle.set_exception(outcome)
        else:
            handle.set_result(outcome)

    # -- between attempts --------------------------------------------------------------

    def _next_attempt(self) -> bool:
        """Every rank of this attempt ended: judge it (with every node), and start the
        next attempt when the policy (and every node) says so."""
        run, link = self.run, self.link
        assert run is not None
        end = run.close(Purpose.LAUNCH, self.world_size)
        interrupted = self.interrupted or end.interrupted
        if link is not None and interrupted:
            link.tell_interrupted(self.attempt, run.record)
        if link is None or interrupted:
            self.verdict, self.exc_data = end.judged(), end.exc_data
        else:
            self.verdict, self.exc_data = link.judge(self.attempt, run.record, self.view.tick)
        verdict = self.verdict
        if verdict.ok or interrupted:
            return False
        restart = self.attempt < self.policy.max_restarts and self.policy.restarts(
            verdict, self.exc_data
        )
        if link is not None:
            restart = link.agree(self.attempt, restart)
        if not restart or self.interrupted:
            return False
        assert verdict.cause is not None
        cause = verdict.cause.describe()
        self.history.append(cause)
        self.attempt += 1
        self.view.handle(
            LaunchRestarting(self.attempt, self.policy.max_restarts, cause, time.time())
        )
        self.verdict = None
        try:
            self._start_attempt()
        except BaseException as exc:
            self._tell_others(exc)
            self._end(error=exc)
            raise
        return True

    # -- the end -----------------------------------------------------------------------

    def _end(self, error: BaseException | None = None) -> None:
        """Close what is left (the ranks, the job), and tell the view how the launch ended
        (``lifecycle.decide``). Idempotent."""
        if self.end is not None:
            return
        self.watch.stop()
        attempt: RunEnd | None = None
        try:
            try:
                if self.run is not None:
                    attempt = self.run.close(Purpose.LAUNCH, self.world_size)
            finally:
                if self.job is not None:
                    self.job.close()
                elif self._listen is not None:
                    self._listen.close()
        except KeyboardInterrupt:  # while leaving the job: nothing of ours runs any more
            self.interrupted = True
        ranks = tuple(self.record.ranks)
        if attempt is None:  # the nodes never met, or the first ranks could not start
            attempt = RunEnd(
                Purpose.LAUNCH, ranks, self.world_size, wall_time=time.time() - self.t0
            )
        self.end = dataclasses.replace(
            attempt,
            world_size=self.world_size,
            interrupted=attempt.interrupted or self.interrupted,
            start_error=error if error is not None else attempt.start_error,
            wall_time=time.time() - self.t0,
            restarts=self.attempt,
            verdict=self.verdict,
            exc_data=dict(self.exc_data) if self.verdict is not None else attempt.exc_data,
        )
        self.outcome = decide(self.end)
        self.view.handle(finished_event(self.end, self.outcome))
        self.view.close()
        finished(self.plan)

    def _release(self) -> None:
        """Forget what the outcome was made from: the ranks' pickled exceptions and the
        task (a 200 MB exception must not stay in the kernel three times)."""
        self.exc_data = {}
        if self.end is not None:
            self.end = dataclasses.replace(self.end, exc_data={})
        if self.run is not None:
            self.run.record.exc_data.clear()
        self.task = None

    def _outcome(self) -> list[Any] | BaseException:
        assert self.end is not None and self.outcome is not None
        outcome = self.outcome
        value = value_of(self.end, outcome, tuple(self.history))
        if outcome.kind is Kind.INTERRUPTED and isinstance(value, BaseException):
            add_note(value, stall.note(self.interrupt_report))
        if outcome.kind is Kind.FAILED and self.child_failed_name is not None:
            assert isinstance(value, BaseException)
            per_node = len(self.plan.specs)
            return as_child_failed(value, outcome.verdict, self.child_failed_name, per_node)
        return value


class _Attending(Policy):
    """A launch attempt's policy (the controller is :meth:`GroupRun.drive`): a plain run's,
    and, across nodes, the other nodes' word -- another node's end stops ours, and our
    failure is announced to them once."""

    def __init__(self, launch: _Launch) -> None:
        self.launch = launch
        link = launch.link
        self.link = link if link is not None and link.job.num_nodes > 1 else None
        self.wake = self.link.wake_fd if self.link is not None else None

    def after_pump(self, run: GroupRun) -> None:
        super().after_pump(run)
        link, launch = self.link, self.launch
        if link is None:
            return
        if not run.record.stopping:
            reason = link.heard(launch.attempt)
            if reason is not None:  # collateral of another node's end
                launch._announced = True  # nothing of ours to announce
                run.stop(Stop.ELSEWHERE, reason)
        if run.record.failed and not launch._announced:
            launch._announced = True
            link.announce(launch.attempt)


# ``from notebook_launcher import notebook_launcher``, then ``notebook_launcher.runs()``: the
# function carries the package's verbs (sessions, detached runs, metrics), so a cell reads
# the same whether the name is the package or the function (the package is callable as the
# function too: ``notebook_launcher/__init__.py``).
notebook_launcher.start = start_session  # type: ignore[attr-defined]
notebook_launcher.runs = runs  # type: ignore[attr-defined]
notebook_launcher.attach = attach  # type: ignore[attr-defined]
notebook_launcher.log = log  # type: ignore[attr-defined]

__all__ = ["notebook_launcher"]
