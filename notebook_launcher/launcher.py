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

import contextvars
import threading
import time
from collections.abc import Callable
from typing import Any

from ._events import Event, LaunchFinished
from ._launch import preflight
from ._launch.diagnosis import exception_for, summary_line
from ._launch.group import WorkerGroup, WorkerProcess
from ._launch.plan import LaunchPlan, plan_launch, prepare_task
from ._launch.record import RunRecord
from ._launch.session import TaskHandle
from .errors import LaunchError
from .ui import TextView, View, in_notebook_kernel, view_for
from .ui.lazy import DisplayedTextView


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
) -> Any:
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
    SIGTERM and SIGKILL when stopping ranks), ``block=False`` (return at once a
    ``concurrent.futures.Future``-like handle: ``result(timeout)``, ``exception()``,
    ``done()``, ``cancel()`` stops the ranks, ``add_done_callback``; the dashboard stays in
    this cell and keeps updating while other cells run).

    Example::

        def train(lr):
            from notebook_launcher import PartialState
            state = PartialState()
            return state.process_index * lr

        notebook_launcher(train, args=(0.1,), num_processes=2)   # -> [0.0, 0.1]
    """
    __tracebackhide__ = True  # IPython and pytest show the caller's frames, then the rank's
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
        view = _view(dashboard, block)
    except BaseException:
        plan.close()
        raise
    launch = _Launch(plan, task, view)
    if block:
        outcome = launch.run()
        if isinstance(outcome, BaseException):
            raise outcome  # here, so that the traceback shows the caller, then the rank
        return outcome
    launch.start()  # in this thread: the ranks die with the thread that started them
    handle = TaskHandle(launch.interrupt)
    # In this cell's context: what the thread shows belongs to this cell (ipykernel keeps
    # the cell of an output in context variables), not to the cell that runs meanwhile.
    cell = contextvars.copy_context()
    threading.Thread(
        target=cell.run, args=(launch.finish_into, handle), name="notebook-launcher", daemon=True
    ).start()
    return handle


def _view(dashboard: bool | str | View, block: bool) -> View:
    """The launch's view. A non-blocking launch in a notebook that would print text keeps
    it in its own output area instead: the cell that runs later must not receive it."""
    view = view_for(dashboard)
    if block or not isinstance(dashboard, (bool, str)) or not in_notebook_kernel():
        return view
    if isinstance(getattr(view, "inner", view), TextView):
        progress = dashboard is not False
        return DisplayedTextView(lambda stream: TextView(stream, progress=progress))
    return view


class _Launch:
    """One launch from start to verdict: the pipeline's last three steps."""

    def __init__(self, plan: LaunchPlan, task: Any, view: View) -> None:
        self.plan, self.view = plan, view
        self.record = record = RunRecord(plan.ranks)

        def on_event(event: Event) -> None:
            record.on_event(event)
            view.handle(event)

        def on_exit(proc: WorkerProcess) -> None:
            for event in record.on_exit(proc):
                view.handle(event)

        self.group = WorkerGroup(
            plan.specs, plan.start_method, task, plan.listen, on_event, on_exit, plan.grace_period
        )
        plan.listen = None  # the group owns it now
        self.t0 = time.time()

    def start(self) -> None:
        self.view.handle(self.plan.started_event())
        try:
            self.group.start()
        except BaseException:
            self._end()
            raise

    def run(self) -> list[Any] | BaseException:
        """Start, pump until every rank ended; the results, or the exception to raise
        (Ctrl-C: stop every rank and re-raise)."""
        self.start()
        try:
            self._pump()
        except KeyboardInterrupt:
            self.record.stopping = self.record.interrupted = True
            self.group.stop()
            raise
        finally:
            self._end()
        return self._outcome()

    def _pump(self) -> None:
        group, record = self.group, self.record
        while not group.finished:
            group.pump(0.5)
            self.view.tick()
            if record.failed and not record.stopping:
                record.stopping = True
                group.terminate()

    def interrupt(self) -> None:
        """Stop every rank (a non-blocking launch's ``cancel()``, or Ctrl-C on its result)."""
        self.record.stopping = self.record.interrupted = True
        self.group.terminate()

    def finish_into(self, handle: TaskHandle) -> None:
        """A non-blocking launch's thread: pump, then settle ``handle``."""
        try:
            try:
                self._pump()
            finally:
                self._end()
            outcome = self._outcome()
        except BaseException as exc:  # noqa: BLE001 - the handle carries whatever happened
            outcome = exc
        if isinstance(outcome, BaseException):
            handle.set_exception(outcome)
        else:
            handle.set_result(outcome)

    def _end(self) -> None:
        self.group.close()
        record = self.record
        self.verdict = verdict = record.verdict()
        n = len(self.plan.specs)
        summary = summary_line(verdict, n, record.interrupted)
        ok = verdict.ok and not record.interrupted
        rank = None if record.interrupted else getattr(verdict.cause, "rank", None)
        now = time.time()
        self.view.handle(
            LaunchFinished(ok, summary, rank, now - self.t0, now, verdict.failed_ranks)
        )
        self.view.close()

    def _outcome(self) -> list[Any] | BaseException:
        record, ranks = self.record, self.plan.ranks
        if record.interrupted:
            return KeyboardInterrupt(f"interrupted: all {len(ranks)} ranks stopped")
        if not self.verdict.ok:
            return exception_for(self.verdict, len(ranks), record.exc_data)
        missing = [r for r in ranks if r not in record.results]
        if missing:  # cannot happen without a failure record; never return a short list
            return LaunchError(f"ranks {missing} ended without a result")
        return [record.results[r] for r in ranks]


__all__ = ["notebook_launcher"]
