"""A persistent group of ranks that runs one task after another (kernel side, no UI).

The ranks start once (``WorkerSpec.session``) and serve :class:`~notebook_launcher._wire.
control.Run` messages (``_worker.session``). One thread per session, the *pump*, owns all
reading from the ranks: while a task runs it feeds the task's record and view; while the
session is idle it blocks in ``select`` with no timeout (no CPU), draining anything a rank
prints meanwhile. Callers (the notebook's thread) submit tasks and wait on their handles.

The ranks are one :class:`~.lifecycle.GroupRun`, driven by its one loop
(:meth:`~.lifecycle.GroupRun.drive`) under three policies in turn: :class:`_StartingUp`
(until every rank serves), :class:`_Serving` (the pump thread: tasks, deadlines, the wake
pipe) and :class:`_Closing` (until the ranks left, or the grace period passed).

What happens when a task goes wrong, and what the session makes of it:

* a rank raises while others still run: the others are interrupted (SIGINT to their main
  thread, once they began the task): at once where they are seen waiting in a collective
  (they wait for the failed rank), the ones still computing when they next wait in one or
  after :data:`FAILED_GRACE` seconds, so that they stop where they wait for it, their
  state whole, not at whatever line the signal finds (a step half taken); a rank that does not answer within
  :data:`REFORM_AFTER` seconds while it is seen in a collective (its ``BarrierEnter``; or
  within :data:`REFORM_UNSEEN_AFTER` seconds, seen nowhere: a collective torch runs for
  it, such as DDP's, is not reported, and a loaded machine may just be slow to deliver the
  interrupt) waits for a peer that moved on (so does one that answered but left a
  collective queued: its ``BarrierEnter`` had no exit), so every
  rank **re-forms** the process group (``_wire.control.Reform``): the idle ranks shut
  their connections down, the stuck collective fails, and all join a new group on the
  same store. Namespaces survive; the cell raises the root cause.
* a rank of the task waits in a collective that needs a rank outside the task (a cell
  run on some ranks only): the task fails at once with
  :class:`~notebook_launcher.ProcessGroupMismatch` naming the call site, and the group is
  re-formed the same way.
* the notebook's interrupt: the task's ranks are interrupted likewise; the caller gets
  ``KeyboardInterrupt`` (``TaskHandle.cancel()``: a cancelled handle) and the session
  lives on. Any number of interrupts, from any thread, at any moment (while the task is
  sent included) end it the same way: a later one only stops waiting for ranks seen in no
  collective. Every wait has a deadline: none is without end.
* a rank that still does not stop (stuck in C++ outside a collective), or a rank that
  dies: the session is **broken**; every rank is stopped (never only marked broken: a
  task would wait for them forever), and ``restart()`` brings up fresh ones.

The pump completes tasks but never runs the user's code: a handle's done-callbacks run on
a thread of their own (``TaskHandle``), so one may wait for another task, or close the
session, without blocking the machinery that would complete it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any, Protocol

from .._events import (
    BarrierEnter,
    Event,
    LaunchStarted,
    Output,
    WorkerStarted,
)
from .._posix import close_quietly, deferred_interrupts
from .._serialization import safe_str, type_name
from .._wire.control import Raised, Reform, Reformed, Returned, Run, Shutdown
from ..errors import (
    LaunchError,
    RankFailure,
    SessionBroken,
    at_callers_line,
    notebook_cell_name,
    shorten,
)
from . import stall
from .group import WorkerProcess
from .lifecycle import (
    GroupRun,
    Kind,
    Policy,
    Purpose,
    RunEnd,
    add_note,
    decide,
    finished_event,
    value_of,
)
from .plan import LaunchPlan, finished
from .record import RunRecord, Stop

#: Seconds an interrupted rank seen waiting in a collective may take before its peers
#: re-form the group to free it.
REFORM_AFTER = 0.3
#: The same for a rank not seen in any collective: most likely in Python, and its
#: interrupt only late (a loaded machine); perhaps in a collective nobody reported.
REFORM_UNSEEN_AFTER = 2.0
#: Seconds the ranks still computing when another rank of the task failed may run on
#: before they are interrupted (they are as soon as they are seen waiting in a collective).
FAILED_GRACE = 1.0
#: Seconds the re-forming may take before the session gives up on a rank (it is stuck).
REFORM_TIMEOUT = 5.0
#: Lines a rank may print between tasks that are kept for the next task's view.
IDLE_LINES = 200
#: How often the pump ticks the view of a running task.
TICK = 0.5


class _View(Protocol):
    """What the core needs of a view (``notebook_launcher.ui.View``)."""

    def handle(self, event: Event) -> None: ...

    def tick(self) -> None: ...

    def close(self) -> None: ...


class TaskHandle(Future[Any]):
    """A task of a session (or a non-blocking launch): a ``concurrent.futures.Future``.

    ``result(timeout)`` returns the per-rank list or raises what the ranks raised;
    ``cancel()`` interrupts a running task and waits for its ranks to stop (a session's
    ranks live on); the handle then ends *cancelled*, as a ``Future`` does: ``cancelled()``
    is True and ``result()`` raises ``concurrent.futures.CancelledError``. Ctrl-C while
    waiting in ``result()`` (or ``session.interrupt()``) interrupts it too, and the task
    ends with ``KeyboardInterrupt``; any number of Ctrl-C, from any number of threads,
    ends it the same way.

    The handle stays *pending* in ``Future``'s terms until it ends (``running()`` says
    whether it runs): that is what lets ``cancel()`` end it cancelled, with the waiters of
    ``concurrent.futures.wait`` and the done-callbacks told once, by the public API.

    Done-callbacks never run on the thread that completes the task (a session's pump, a
    launch's thread): a callback may itself wait for a task (``session.run``), or close
    the session. They run on a thread of their own, in the context of the code that added
    them (in a notebook: what they print goes to that cell).
    """

    def __init__(
        self,
        interrupt: Callable[[], None],
        label: str = "",
        stacks: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__()
        self._interrupt = interrupt
        self._stacks = stacks
        self._cancelling = False
        self._callbacks_later: list[tuple[Callable[[Any], object], contextvars.Context]] = []
        #: what the task runs (``train``, ``run_cell``): for its repr
        self.label = label

    def stacks(self) -> Any:
        """Where every rank is now: each thread's Python stack, the odd rank(s) out named
        (``_launch.stall``), while the task runs or after."""
        if self._stacks is None:
            raise RuntimeError("this handle cannot take its ranks' stacks")
        return self._stacks()

    def running(self) -> bool:
        return not self.done()

    def cancel(self) -> bool:
        """Interrupt the task and wait until it stopped: True when it ended interrupted
        (it is *cancelled* then), False when it had ended otherwise first."""
        if self.done():
            return self.cancelled()
        self._cancelling = True
        self.interrupt_and_wait()
        return self.cancelled()

    def interrupt_and_wait(self) -> BaseException | None:
        """Interrupt the task and wait for its end; its exception (None: it returned first).
        Ctrl-C while waiting asks again (the session then stops waiting for slow ranks)."""
        while True:
            try:
                self._interrupt()
                return super().exception()
            except KeyboardInterrupt:
                continue
            except CancelledError:
                return None

    def set_result(self, result: Any) -> None:
        super().set_result(result)
        self._settled()

    def set_exception(self, exception: BaseException | None) -> None:
        """How the task ended with an error; an interrupt asked for by ``cancel()`` ends it
        cancelled instead."""
        if self._cancelling and isinstance(exception, KeyboardInterrupt):
            super().cancel()  # pending -> cancelled: wakes result()/exception()
            self.set_running_or_notify_cancel()  # and the waiters of futures.wait()
        else:
            super().set_exception(exception)
        self._settled()

    def add_done_callback(self, fn: Callable[[Any], object]) -> None:
        """Call ``fn(handle)`` once the task ended (at once, here, if it has): on a thread of
        its own, never on the one that completes tasks (see the class docstring)."""
        context = contextvars.copy_context()
        with self._condition:
            if not self.done():
                self._callbacks_later.append((fn, context))
                return
        context.run(_call_back, fn, self)

    def _settled(self) -> None:
        with self._condition:
            callbacks, self._callbacks_later = self._callbacks_later, []
        if callbacks:
            threading.Thread(
                target=_call_backs,
                args=(callbacks, self),
                name="notebook-launcher-callbacks",
                daemon=True,
            ).start()

    def result(self, timeout: float | None = None) -> Any:
        __tracebackhide__ = True  # the cell's traceback: the caller's frames, then the rank's
        try:
            exc = super().exception(timeout)  # the task's error is returned, not raised
        except KeyboardInterrupt:  # Ctrl-C while waiting: interrupt the task, wait for its end
            exc = self.interrupt_and_wait()
            if self.cancelled():  # a cancel() from another thread came first
                raise CancelledError() from None
        if exc is not None:
            raise exc  # what the task raised (raised here: no machinery in the traceback)
        return super().result(0)

    def __repr__(self) -> str:
        name = f" {self.label}" if self.label else ""
        if self.cancelled():
            state = "cancelled"
        elif not self.done():
            state = "running"
        elif (exc := super().exception(0)) is not None:
            state = f"raised {type(exc).__name__}: {shorten(safe_str(exc), 200)}"
        else:
            state = f"finished: {shorten(repr(super().result(0)), 200)}"
        return f"<TaskHandle{name}: {state}>"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def _ipython_display_(self) -> None:
        """In a notebook: the handle's state, updated in place when the task ends (a cell
        that shows a running handle does not say "running" forever)."""
        from IPython.display import display

        shown = display({"text/plain": repr(self)}, raw=True, display_id=True)
        if shown is not None and not self.done():
            self.add_done_callback(lambda h: shown.update({"text/plain": repr(h)}, raw=True))


def _call_back(fn: Callable[[Any], object], handle: TaskHandle) -> None:
    try:
        fn(handle)
    except Exception:
        logging.getLogger("concurrent.futures").exception(
            "exception calling callback for %r", handle
        )


def _call_backs(
    callbacks: list[tuple[Callable[[Any], object], contextvars.Context]], handle: TaskHandle
) -> None:
    for fn, context in callbacks:
        context.run(_call_back, fn, handle)


class TaskRun:
    """One task: its ranks, its record, its view, and where its unwinding stands."""

    def __init__(
        self,
        task_id: int,
        ranks: list[int],
        view: _View,
        handle: TaskHandle,
        watch: stall.StallWatch | None = None,
    ) -> None:
        self.id = task_id
        #: where every rank is when the task makes no progress (fed and ticked by the pump)
        self.watch = watch or stall.StallWatch(None, view.handle)
        #: where each rank was when the user interrupted it while it was stuck
        self.interrupt_report: Any = None
        #: in the order asked: the per-rank list of values follows it (index i: ranks[i])
        self.asked = list(ranks)
        self.ranks = sorted(ranks)
        self.view = view
        self.handle = handle
        self.record = RunRecord(ranks)
        self.pending = set(ranks)
        #: ranks that were sent the task (an interrupt may stop the sending half way)
        self.sent: set[int] = set()
        self.values: dict[int, Any] = {}
        self.local_vars: dict[int, tuple[str, ...]] = {}
        self.interrupted: set[int] = set()
        #: ranks that began this task (WorkerStarted): only these can take an interrupt;
        #: a signal to a rank still reading its Run would overtake it and be lost
        self.started: set[int] = set()
        self.interrupt_on_start: set[int] = set()
        #: when each rank was sent its interrupt (time.time(), as the ranks' records)
        self.signalled_at: dict[int, float] = {}
        self.user_interrupt = False
        #: when the task's ranks were first told to stop (monotonic)
        self.unwound_at: float | None = None
        self.mismatch: str | None = None
        self.t0 = time.time()
        self.reform_at: float | None = None
        #: the latest a re-forming waits for ranks that are seen in no collective
        self.reform_unseen_at: float | None = None
        self.reform_generation: int | None = None
        self.reformed: set[int] = set()
        self.give_up_at: float | None = None
        #: after a rank failed: the ranks left to run on until they wait in a collective,
        #: and until when at most (``FAILED_GRACE``)
        self.spared: set[int] = set()
        self.spare_until: float | None = None

    def next_deadline(self) -> float | None:
        times = [t for t in (self.reform_at, self.give_up_at, self.spare_until) if t is not None]
        return min(times) if times else None


class SessionCore:
    """The ranks of a session and the thread that listens to them."""

    def __init__(self, plan: LaunchPlan, stall_after: float | None = None) -> None:
        self.plan = plan
        self.stall_after = stall_after
        self.world = [s.rank for s in plan.specs]
        #: the ranks' lifecycle (started, then routed to this core's callbacks)
        self.run: GroupRun | None = None
        self.task: TaskRun | None = None
        self.broken: str | None = None
        self.generation = 0
        self.tasks_run = 0
        self.idle_output: deque[Output] = deque(maxlen=IDLE_LINES)
        self._lock = threading.RLock()
        #: the pump's wake-up pipe, made once the ranks are up (a start that fails or is
        #: interrupted leaves no fd behind)
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._closing = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._pump: threading.Thread | None = None

    @property
    def group(self) -> Any:
        """The ranks (``run.group``: a ``WorkerGroup``, or a cluster's ``RemoteGroup``);
        None until they are up."""
        return self.run.group if self.run is not None else None

    def port_note(self) -> str | None:
        """ "port 29500 is busy, using 41234" when the session could not have its port."""
        return self.plan.port_note

    # -- start ---------------------------------------------------------------------------

    def start(self, view: _View) -> None:
        """Start the ranks (in this thread: they die with it, so call it from the
        notebook's main thread) and wait until each has its process group. A start that
        fails, or Ctrl-C meanwhile, stops every rank started and leaves nothing open."""
        try:
            self._start(view)
        except BaseException:
            self.plan.close()  # the port, if the ranks never took it
            raise

    def _start(self, view: _View) -> None:
        plan = self.plan
        for spec in plan.specs:
            spec.session = True

        def make_group(on_event: Any, on_exit: Any, on_message: Any) -> Any:
            group = plan.group(plan.specs, None, plan.listen, on_event, on_exit, on_message)
            plan.listen = None  # the group's now (until here plan.close() releases it)
            return group

        starting = _StartingUp(len(self.world))
        run = GroupRun(make_group, self.world, view, policy=starting)
        ready = starting.ready
        world = len(self.world)
        told = False  # the view heard how the start ended
        try:
            view.handle(dataclasses.replace(plan.started_event(), session=True))
            run.start()
            run.drive()
            end = run.snapshot(Purpose.START, world, results=dict.fromkeys(ready))
            outcome = decide(end)
            if not outcome.ok:
                run.stop(Stop.FAILED)
                end = run.close(Purpose.START, world, results=dict.fromkeys(ready))
            told = True
            view.handle(finished_event(end, outcome))
            view.close()
            if not outcome.ok:
                value = value_of(end, outcome)
                assert isinstance(value, BaseException)
                raise value
            with deferred_interrupts():  # the pipe and the pump, or neither
                self._wake_r, self._wake_w = os.pipe()
                for fd in (self._wake_r, self._wake_w):
                    os.set_blocking(fd, False)
                self.run = run
                run.policy = _Serving(self, self._wake_r)  # what the ranks say: to the tasks
                self._pump = threading.Thread(
                    target=self._pump_loop, name="notebook-launcher-session", daemon=True
                )
                self._pump.start()
        except BaseException:
            # Ctrl-C (or an error) at any moment before the pump runs: nothing is left --
            # no rank, no fd -- and the view says how the start ended
            if self._pump is None:
                self.run = None
                end = run.close(Purpose.START, world)
                self._close_wake()
                if not told:
                    view.handle(finished_event(end, decide(end)))
                    view.close()
            raise

    # -- tasks ---------------------------------------------------------------------------

    def submit(
        self,
        data: bytes,
        ranks: list[int],
        view: _View,
        label: str = "",
        stacks: Callable[[], Any] | None = None,
    ) -> TaskHandle:
        """Run cloudpickled ``(fn, args, kwargs)`` on ``ranks`` (values come back in that
        order); returns at once.

        Ctrl-C while the task is sent (a large value takes a while) stops the sending at
        the next rank, never inside a message: the ranks that have the task are
        interrupted, the others never run it, and the task ends interrupted like any other.
        The ``KeyboardInterrupt`` is delivered once the handle exists, so a caller that
        wraps this in :func:`~notebook_launcher._posix.deferred_interrupts` holds it.
        ``stacks``: what the handle's ``stacks()`` calls (where every rank is)."""
        __tracebackhide__ = True  # SessionBroken & co. end at the caller's line
        with deferred_interrupts() as caught, self._lock:
            if self.group is None or self._closing:
                raise LaunchError("this session is closed; start a new one")
            if self.broken:
                raise SessionBroken(
                    f"the session is broken ({self.broken}). session.restart() (or "
                    "%dist restart) starts fresh ranks; their variables are lost."
                )
            if self.task is not None:
                raise LaunchError(
                    f"task {self.task.id} is still running on ranks {self.task.ranks}: wait "
                    "for it (handle.result()) or interrupt it (handle.cancel()) first."
                )
            unknown = sorted(set(ranks) - set(self.world))
            if unknown or not ranks:
                raise at_callers_line(
                    ValueError(f"ranks must be some of {self.world}, got {ranks}")
                )
            if len(set(ranks)) != len(ranks):
                raise at_callers_line(ValueError(f"ranks must be different ranks, got {ranks}"))
            self.tasks_run += 1
            task_id = self.tasks_run
            handle = TaskHandle(lambda: self.interrupt(task_id), label, stacks)
            watch = stall.StallWatch(self.stall_after, view.handle, stall.of_group(self.group))
            task = TaskRun(task_id, list(ranks), view, handle, watch)
            self.task = task
            started = self.plan.started_event()
            view.handle(
                LaunchStarted(
                    started.world_size, len(task.ranks), started.node_rank, started.num_nodes,
                    started.start_method, started.start_reason,
                    started.master_addr, started.master_port, started.backend,
                    tuple(task.ranks), time.time(),
                    task=f"task {task.id}: {label}" if label else f"task {task.id}",
                    hosts=_hosts_of(started, task.ranks),
                )
            )  # fmt: skip
            for line in self.idle_output:  # what the ranks printed while nothing ran
                if line.rank in task.ranks:
                    view.handle(line)
            self.idle_output.clear()
            for rank in task.ranks:
                if caught:  # Ctrl-C: the ranks not sent the task yet never run it
                    break
                self.group.send(self.group.proc(rank), Run(task.id, data, tuple(task.ranks)))
                task.sent.add(rank)
            if caught:
                self._interrupted_while_sending(task)
            self._wake()
        return handle

    def _interrupted_while_sending(self, task: TaskRun) -> None:
        task.user_interrupt = True
        task.record.stop(Stop.INTERRUPTED)
        assert self.group is not None
        for rank in sorted(task.pending - task.sent):
            task.pending.discard(rank)
            for e in task.record.stopped(rank, self.group.proc(rank).pid):
                task.view.handle(e)
        self._unwind(task, Stop.INTERRUPTED)
        self._advance()

    def interrupt(self, task_id: int | None = None) -> None:
        """Interrupt the running task (the notebook's interrupt button, ``cancel()``); with
        ``task_id``, only if that task is the one that runs.

        Any number of calls, from any thread, at any moment, end the task the same way:
        the first tells its ranks to stop; a later one only stops giving ranks seen in no
        collective their extra time to answer (:data:`REFORM_UNSEEN_AFTER`). A rank that
        never answers is given up after :data:`REFORM_TIMEOUT` (the session breaks):
        never a wait without end."""
        task = self.task
        report = None
        if (
            task is not None
            and (task_id is None or task.id == task_id)
            and not task.user_interrupt
            and task.interrupt_report is None
        ):
            report = task.interrupt_report = task.watch.on_interrupt()  # where it was stuck
        with deferred_interrupts(), self._lock:
            task = self.task
            if task is None or (task_id is not None and task.id != task_id):
                return
            if report is not None and report is task.interrupt_report:
                task.view.handle(report)  # the stall view: where each rank was, as a launch's
                task.watch.replaced()
            if task.user_interrupt:
                self._hurry(task)
            else:
                task.user_interrupt = True
                self._unwind(task, Stop.INTERRUPTED)
            self._wake()

    def _hurry(self, task: TaskRun) -> None:
        """Asked again while the ranks stop: re-form the group as soon as a rank seen in a
        collective would be freed (lock held)."""
        if task.reform_generation is not None or task.unwound_at is None:
            return  # re-forming already, or nothing asked of the ranks yet
        soon = max(time.monotonic(), task.unwound_at + REFORM_AFTER)
        task.reform_unseen_at = min(task.reform_unseen_at or soon, soon)
        if task.reform_at is not None:
            task.reform_at = min(task.reform_at, soon)

    def _fail(self, task: TaskRun) -> None:
        """A rank of the task raised (lock held): interrupt the ranks seen waiting in a
        collective now (they wait for it); spare the ones still computing until they wait
        in one (``_on_event``) or ``FAILED_GRACE`` passed (``_advance``)."""
        waiting = task.record.barriers.waiting
        # (a rank yet to begin the task is spared too: it runs until it waits, as the rest)
        computing = {r for r in task.pending - task.interrupted if r not in waiting}
        if not computing or FAILED_GRACE <= 0:
            self._unwind(task, Stop.FAILED)
            return
        task.spared = computing
        task.spare_until = time.monotonic() + FAILED_GRACE
        self._unwind(task, Stop.FAILED, spare=computing)

    def _unwind(self, task: TaskRun, kind: Stop, spare: set[int] | None = None) -> None:
        """Interrupt the task's ranks that still run (but ``spare``); free them by
        re-forming the group if they do not answer soon (they wait in a collective), once
        none is spared. ``kind``: why (``RunRecord.stop``'s kinds)."""
        task.record.stop(kind)
        if not spare:
            task.spared, task.spare_until = set(), None
        for rank in task.pending - task.interrupted - (spare or set()):
            assert self.group is not None
            if rank in task.started:
                self.group.proc(rank).interrupt()  # SIGINT to its main thread
                task.signalled_at[rank] = time.time()
            else:
                task.interrupt_on_start.add(rank)
            task.interrupted.add(rank)
        if not spare and task.reform_at is None and task.reform_generation is None:
            now = time.monotonic()
            task.unwound_at = task.unwound_at or now
            task.reform_at = now + REFORM_AFTER
            task.reform_unseen_at = now + REFORM_UNSEEN_AFTER

    def _reform(self, task: TaskRun) -> None:
        assert self.group is not None
        self.generation += 1
        task.reform_generation = self.generation
        task.reform_at = None
        task.give_up_at = time.monotonic() + REFORM_TIMEOUT
        for rank in self.world:
            self.group.send(self.group.proc(rank), Reform(self.generation))

    # -- what the pump hears -------------------------------------------------------------

    def _on_event(self, event: Event) -> None:
        with self._lock:
            task = self.task
            if task is None or getattr(event, "rank", None) not in task.ranks:
                if isinstance(event, Output):
                    self.idle_output.append(event)
                return
            task.record.on_event(event)
            task.watch.saw(event)
            task.view.handle(event)
            if isinstance(event, WorkerStarted):
                task.started.add(event.rank)
                if event.rank in task.interrupt_on_start and self.group is not None:
                    self.group.proc(event.rank).interrupt()
                    task.signalled_at[event.rank] = time.time()
            if isinstance(event, BarrierEnter):
                task.spared.discard(event.rank)  # it waits now: interrupt it (_advance)
                outside = [r for r in self.world if r not in task.ranks]
                if outside and task.mismatch is None:
                    task.mismatch = (
                        f"rank {event.rank} waits "
                        f"in {event.kind} at {_where(event.location)}, which needs every rank, but "
                        f"this cell runs on ranks {task.ranks} only (ranks {outside} do not "
                        "run it). Run it on every rank, or make the collective use a "
                        "subgroup (dist.new_group(ranks=...))."
                    )
            if (task.mismatch or task.record.barriers.stranded) and not task.record.stopping:
                self._unwind(task, Stop.MISMATCH)
                task.reform_at = time.monotonic()  # they wait in a collective: free them now

    def _on_message(self, proc: WorkerProcess, message: Any) -> None:
        with self._lock:
            task = self.task
            if isinstance(message, Reformed):
                if task is not None and message.generation == task.reform_generation:
                    task.reformed.add(proc.rank)
            elif task is None or message.task != task.id:
                return  # an answer to a task that was given up
            elif isinstance(message, Returned):
                task.pending.discard(proc.rank)
                if proc.rank in task.interrupted:
                    events = task.record.stopped(proc.rank, proc.pid)
                else:
                    events = task.record.returned(proc.rank, proc.pid, message.data)
                for e in events:
                    task.view.handle(e)
            elif isinstance(message, Raised):
                task.pending.discard(proc.rank)
                if proc.rank in task.interrupted and not _raised_before(message.failure, task):
                    events = task.record.stopped(proc.rank, proc.pid)
                else:
                    events = task.record.raised(message.failure, message.exc_data)
                    task.local_vars[proc.rank] = message.local_vars
                    if message.failure.collateral and task.reform_generation is None:
                        task.reform_at = time.monotonic()  # its group is broken
                for e in events:
                    task.view.handle(e)
                if task.pending and not task.record.stopping:
                    self._fail(task)
            self._advance()

    def _on_exit(self, proc: WorkerProcess) -> None:
        with self._lock:
            task = self.task
            died = not self._closing and not (
                task is not None and task.record.stopping and self.broken
            )
            if died and self.broken is None:
                how = f"died (exit code {proc.returncode})"
                if proc.returncode is not None and proc.returncode < 0:
                    how = f"died (killed by {signal.Signals(-proc.returncode).name})"
                if getattr(proc, "never_started", ""):
                    how = f"never started ({proc.never_started})"  # type: ignore[attr-defined]
                self._break(f"rank {proc.rank} {how}")
            if task is not None and proc.rank in task.pending:
                task.pending.discard(proc.rank)
                events = (
                    task.record.died(proc) if died else task.record.stopped(proc.rank, proc.pid)
                )
                for e in events:
                    task.view.handle(e)
            self._advance()

    # -- the pump ------------------------------------------------------------------------

    def _wake(self) -> None:
        if self._wake_w is None:
            return
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # full (a wake is pending anyway), or closed with the session
            pass

    def _close_wake(self) -> None:
        fds = [fd for fd in (self._wake_r, self._wake_w) if fd is not None]
        self._wake_r = self._wake_w = None
        close_quietly(*fds)

    def _pump_loop(self) -> None:
        """The session's thread: the controller's loop under the serving policy, until the
        session closes."""
        assert self.run is not None and self._wake_r is not None
        self.run.drive()

    def _advance(self) -> None:
        """Deadlines, and the end of the task once every rank answered (lock held)."""
        task = self.task
        if task is None:
            return
        if self.broken is not None:
            # A broken session re-forms nothing: only its ranks' exits are waited for. (A
            # collateral error read after the break -- sent just before the rank was killed
            # -- set a re-forming deadline here once, and the task never ended.)
            task.reform_at = task.give_up_at = task.spare_until = None
        now = time.monotonic()
        if task.spare_until is not None and (
            now >= task.spare_until or not task.spared & task.pending
        ):
            self._unwind(task, Stop.FAILED)  # the spared ranks wait (or took too long): stop them
        # Once every rank answered there is nothing to wait for: decide now.
        due = task.reform_at is not None and (now >= task.reform_at or not task.pending)
        if due and self.broken is None:
            barriers = task.record.barriers
            # A rank interrupted inside a collective (between torch enqueuing it and its
            # wait) answers from Python, but leaves the collective queued in its group: the
            # next collective would pair with it and hang. Its BarrierEnter without a
            # BarrierExit says so.
            seen = bool(task.mismatch or barriers.stranded or barriers.waiting)
            broken = any(f.collateral for f in task.record.failures)
            unseen_at = task.reform_unseen_at
            if task.pending and not (seen or broken) and unseen_at is not None and now < unseen_at:
                task.reform_at = unseen_at  # no one is seen in a collective: give it time
            elif task.pending or seen or broken:
                self._reform(task)
            else:  # every rank answered the interrupt from Python, outside any collective
                task.reform_at = None
        if task.give_up_at is not None and now >= task.give_up_at and self.broken is None:
            stuck = sorted(task.pending or set(self.world) - task.reformed)
            self._break(
                f"rank(s) {stuck} did not stop after an interrupt; they are stuck outside "
                "Python (in C++ or a collective)",
            )
        reforming = task.reform_generation is not None and task.reformed != set(self.world)
        if task.pending or (reforming and self.broken is None) or task.reform_at is not None:
            return
        self._finish(task)

    def _finish(self, task: TaskRun) -> None:
        """The task ended: tell its view, settle its handle (lock held). The handle is
        settled whatever happens here: a caller must never wait for a task that is gone."""
        self.task = None
        task.watch.stop()
        try:
            outcome = self._outcome(task)
        except Exception as exc:  # noqa: BLE001 - a bug of ours: say it, never hang
            error = LaunchError(f"the session could not settle task {task.id}: {exc!r}")
            error.__cause__ = exc
            outcome = error
        finally:
            try:
                task.view.close()
            except Exception:  # noqa: BLE001 - views are wrapped; this is the last guard
                pass
        if isinstance(outcome, BaseException):
            task.handle.set_exception(outcome)
        else:
            task.handle.set_result(outcome)

    def _outcome(self, task: TaskRun) -> list[Any] | BaseException:
        """The task's per-rank values (in the order asked), or the exception to raise:
        ``lifecycle.decide`` on the task's frozen end, and what only a session adds (where
        the ranks were when interrupted, the failing frame's variables, its own state)."""
        end = RunEnd.of(
            task.record,
            Purpose.TASK,
            len(self.world),
            time.time() - task.t0,
            ranks=tuple(task.asked),
            interrupted=task.user_interrupt,
            mismatch=task.mismatch,
            broken=self.broken,
            closing=self._closing,
        )
        outcome = decide(end)
        task.view.handle(finished_event(end, outcome))
        value = value_of(end, outcome)
        if not isinstance(value, BaseException):
            return value
        notes = self._notes(task)
        if outcome.kind is Kind.INTERRUPTED:
            where = stall.note(task.interrupt_report)
            if where:
                notes.insert(0, where)
        cause = outcome.verdict.cause
        if outcome.kind is Kind.FAILED and cause is not None and task.local_vars.get(cause.rank):
            rows = task.local_vars[cause.rank]
            notes.insert(
                0, f"Variables in rank {cause.rank}'s failing frame:\n  " + "\n  ".join(rows)
            )
        if outcome.kind is not Kind.CLOSED:
            for note in notes:
                add_note(value, note)
        return value

    def _notes(self, task: TaskRun) -> list[str]:
        notes = []
        if self.broken is not None:
            notes.append(
                f"The session is broken ({self.broken}): session.restart() (%dist restart) "
                "starts fresh ranks; their variables are lost."
            )
        elif task.reform_generation is not None:
            notes.append(
                "The ranks re-formed their process group to stop the task (the variables of "
                "every rank are intact). Objects built on the old group, such as models "
                "already wrapped by accelerator.prepare() for DDP, must be prepared again."
            )
        elif task.mismatch is None and task.record.failures:
            notes.append("The session lives on: every rank's variables are intact.")
        return notes

    def _break(self, why: str) -> None:
        """Mark the session broken and stop every rank now (lock held): their exits end
        the task, if one runs. Never only the mark: a task whose ranks are left running
        would be waited for without end."""
        if self.broken is None:
            self.broken = why
        if self.group is not None:
            task = self.task
            if task is not None:
                task.record.stop(Stop.BROKEN)
            for p in self.group.running:
                p.send_signal(signal.SIGKILL)
        task = self.task
        if task is not None:  # nothing left to wait for but their exits
            task.reform_at = task.give_up_at = task.spare_until = None
            task.spared = set()

    # -- the end -------------------------------------------------------------------------

    def close(self, grace: float | None = None) -> None:
        """Ask every rank to leave, wait up to ``grace`` seconds, then stop what is left.
        Idempotent, from any thread but the pump's; Ctrl-C meanwhile skips the waiting,
        never the cleaning up (no rank, fd or thread is left behind)."""
        with self._close_lock:
            if self._closed:
                return
            with self._lock:
                self._closing = True
                task = self.task
            try:
                self._wake()
                self._join_pump()
                run = self.run
                if run is not None:
                    group = run.group
                    for p in group.running:
                        group.send(p, Shutdown())
                    wait = self.plan.grace_period if grace is None else grace
                    run.drive(_Closing(self, time.monotonic() + wait))
            finally:
                with deferred_interrupts():
                    self._wake()
                    self._join_pump()
                    if self.run is not None:
                        self.run.close(Purpose.START, len(self.world))
                    if task is not None and not task.handle.done():
                        task.handle.set_exception(
                            LaunchError("the session was closed while the task ran")
                        )
                    self.plan.close()
                    self._close_wake()
                    self._closed = True
                finished(self.plan)

    def _join_pump(self) -> None:
        if self._pump is not None and self._pump is not threading.current_thread():
            self._pump.join()

    @property
    def closed(self) -> bool:
        return self._closing

    def stacks(self) -> Any:
        """Where every rank is now (a :class:`~notebook_launcher._events.StacksTaken`),
        while a task runs or between tasks."""
        if self.group is None or self._closing:
            raise LaunchError("this session is closed; start a new one")
        return stall.report(stall.of_group(self.group), "request")


class _StartingUp(Policy):
    """A session's start (the controller: :meth:`GroupRun.drive`): a plain run's policy,
    done once every rank serves -- ready once it answers ``Reformed(0)``, not when it has
    its process group (``WorkerStarted``): in between, an interrupt would still kill it --
    or a rank failed, or every rank ended."""

    answers = True

    def __init__(self, world: int) -> None:
        self.world = world
        self.ready: set[int] = set()

    def done(self, run: GroupRun) -> bool:
        return len(self.ready) >= self.world or run.record.failed or run.finished

    def on_message(self, run: GroupRun, proc: Any, message: Any) -> None:
        if isinstance(message, Raised):
            for e in run.record.raised(message.failure, message.exc_data):
                run.view.handle(e)
        elif isinstance(message, Reformed) and message.generation == 0:
            self.ready.add(proc.rank)


class _Serving(Policy):
    """A session's ranks between and during tasks (its pump thread): what they say goes to
    the task that runs (:class:`SessionCore`'s callbacks); the wait is the task's (its
    view's tick, its stall watch, its deadlines), or without end while the session is idle
    (woken by ``wake``: a new task, an interrupt, the close); a failure of the loop breaks
    the session rather than end the thread silently."""

    answers = True

    def __init__(self, core: SessionCore, wake: int | None) -> None:
        self.core = core
        self.wake = wake

    def done(self, run: GroupRun) -> bool:
        return self.core._closing

    def timeout(self, run: GroupRun) -> float | None:
        core = self.core
        with core._lock:
            task = core.task
            if task is None:
                return None  # idle: sleep until a rank speaks, or we are woken
            deadline = task.next_deadline()
        timeout = task.watch.timeout(TICK) or 0.0
        if deadline is not None:
            timeout = max(0.0, min(timeout, deadline - time.monotonic()))
        return timeout

    def after_pump(self, run: GroupRun) -> None:
        core = self.core
        if self.wake is not None:
            try:
                os.read(self.wake, 4096)
            except BlockingIOError:
                pass
        with core._lock:
            task = core.task
            if task is not None:
                task.view.tick()
            core._advance()
        if task is not None and core.task is task:
            task.watch.tick()  # (this thread owns the view; the lock is not needed)

    def survives(self, run: GroupRun, error: Exception) -> bool:
        core = self.core  # the pump must never die silently
        with core._lock:
            core._break(f"the session's pump failed: {error!r}")
            core._advance()
        return True

    def on_event(self, run: GroupRun, event: Event) -> None:
        self.core._on_event(event)

    def on_exit(self, run: GroupRun, proc: Any) -> None:
        self.core._on_exit(proc)

    def on_message(self, run: GroupRun, proc: Any, message: Any) -> None:
        self.core._on_message(proc, message)


class _Closing(_Serving):
    """A session's close (the caller's thread, the pump thread gone): the ranks were told
    to leave; wait for them until ``deadline`` (monotonic), nothing else."""

    def __init__(self, core: SessionCore, deadline: float) -> None:
        super().__init__(core, None)
        self.deadline = deadline

    def done(self, run: GroupRun) -> bool:
        return run.finished or time.monotonic() >= self.deadline

    def timeout(self, run: GroupRun) -> float | None:
        return 0.05

    def after_pump(self, run: GroupRun) -> None:
        pass

    def survives(self, run: GroupRun, error: Exception) -> bool:
        return False


def _hosts_of(started: LaunchStarted, ranks: list[int]) -> tuple[str, ...]:
    """A cluster's hosts of ``ranks`` (the view labels their rows and lines with them)."""
    if not started.hosts:
        return ()
    host = dict(zip(started.ranks, started.hosts, strict=False))
    return tuple(host.get(r, "") for r in ranks)


def _raised_before(failure: RankFailure, task: TaskRun) -> bool:
    """Whether a rank that was told to stop had raised an error of its own before that
    (the same bug as a peer's, met independently): a failure to report, not a stop."""
    if failure.exc_type == type_name(KeyboardInterrupt):  # its answer to our interrupt
        return False
    signalled = task.signalled_at.get(failure.rank)
    return signalled is None or failure.time < signalled


def _where(location: str) -> str:
    """``Cell In[4], line 7`` for a notebook cell's ``file:line``; other files as they are."""
    path, sep, line = location.rpartition(":")
    cell = notebook_cell_name(path) if sep else None
    return f"Cell {cell}, line {line}" if cell else location


__all__ = ["REFORM_AFTER", "REFORM_UNSEEN_AFTER", "SessionCore", "TaskHandle", "TaskRun"]
