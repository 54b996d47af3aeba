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
    WorkerGroup.pump()  waits on all of them at once; every event and output line goes to
                        RunRecord.on_event (stderr tails, barrier progress) and the view

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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ._events import Event, LaunchFinished
from ._launch import preflight
from ._launch.diagnosis import exception_for, summary_line
from ._launch.group import WorkerGroup, WorkerProcess
from ._launch.plan import plan_launch, prepare_task
from ._launch.record import RunRecord
from .errors import LaunchError
from .ui import View, view_for


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
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` ranks and return their results.

    Accelerate's signature and meaning, so existing notebooks keep working. Each rank
    runs in its own process with ``torch.distributed`` initialised (NCCL, one GPU per
    rank, when GPUs are visible; gloo on CPU otherwise) and the usual env
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...).

    Returns the list of per-rank return values (index = rank on this node). If a rank
    fails, the caller gets that rank's own exception (with its traceback), or
    :class:`~notebook_launcher.WorkerDied` / :class:`~notebook_launcher.ProcessGroupMismatch`;
    the other ranks are stopped and the kernel stays usable.

    Extras beyond Accelerate: ``kwargs`` for the function, ``start_method``
    (``None`` chooses: fork unless CUDA is initialised here, then a forkserver),
    ``dashboard`` (``"auto"``, ``True``, ``False``, or any object with the
    ``notebook_launcher.ui.View`` methods, which then receives every event), ``grace_period`` (seconds between
    SIGTERM and SIGKILL when stopping ranks).

    Example::

        def train(lr):
            from notebook_launcher import PartialState
            state = PartialState()
            return state.process_index * lr

        notebook_launcher(train, args=(0.1,), num_processes=2)   # -> [0.0, 0.1]
    """
    preflight.check_args(args, kwargs)
    preflight.check_dashboard(dashboard)
    del monitor_interval  # we wait on sentinels instead of polling
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
        unsupported={
            "rdzv_backend": (rdzv_backend, "static"),
            "rdzv_endpoint": (rdzv_endpoint, ""),
            "rdzv_conf": (rdzv_conf, None),
            "rdzv_id": (rdzv_id, "none"),
            "max_restarts": (max_restarts, 0),
            "log_line_prefix_template": (log_line_prefix_template, None),
        },
    )
    try:
        task = prepare_task(function, tuple(args), dict(kwargs or {}), plan.start_method)
        view = view_for(dashboard)
    except BaseException:
        plan.close()
        raise
    record = RunRecord(plan.ranks)

    def on_event(event: Event) -> None:
        record.on_event(event)
        view.handle(event)

    def on_exit(proc: WorkerProcess) -> None:
        for event in record.on_exit(proc):
            view.handle(event)

    group = WorkerGroup(
        plan.specs, plan.start_method, task, plan.listen, on_event, on_exit, plan.grace_period
    )
    plan.listen = None  # the group owns it now
    t0 = time.time()
    view.handle(plan.started_event())
    try:
        group.start()
        while not group.finished:
            group.pump(0.5)
            view.tick()
            if record.failed and not record.stopping:
                record.stopping = True
                group.terminate()
    except KeyboardInterrupt:
        record.stopping = record.interrupted = True
        group.stop()
        raise
    finally:
        group.close()
        verdict = record.verdict()
        n = len(plan.specs)
        summary = summary_line(verdict, n, record.interrupted)
        ok = verdict.ok and not record.interrupted
        rank = None if record.interrupted else getattr(verdict.cause, "rank", None)
        now = time.time()
        view.handle(LaunchFinished(ok, summary, rank, now - t0, now, verdict.failed_ranks))
        view.close()
    if not verdict.ok:
        raise exception_for(verdict, n, record.exc_data)
    missing = [r for r in plan.ranks if r not in record.results]
    if missing:  # cannot happen without a failure record; never return a short list
        raise LaunchError(f"ranks {missing} ended without a result")
    return [record.results[r] for r in plan.ranks]


__all__ = ["notebook_launcher"]
