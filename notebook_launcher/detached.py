"""Runs that outlive the kernel: ``notebook_launcher(..., detach=True)``, ``attach(id)``,
``runs()``.

A detached launch is planned here as any launch is (every preflight check, the rendezvous
port bound), then handed to a supervisor process that is not this kernel's child
(``_supervise``); the kernel only follows the run's record (``_launch.detach``)::

    kernel (any, of the same user)                 supervisor (parent: init)
    ------------------------------                 -------------------------
    notebook_launcher(detach=True)
      plan_launch()  (preflight, port)
      task.pkl (a HandedOver), sealed -----------> (forked, or a spare forked ahead)
      _launch.handover: forked, pid back <-------  meta: running, its pid
      the go: the run's key (a pipe) ------------> the task checked against the key, then
      attach(id)                                   _Launch.run_to_end(): the ranks, as a
                                                     blocking launch runs them; every event
                                                     appended to events.log
        replay events.log into a fresh view
        tail it (every 0.1 s) in a thread   <----- result.pkl, meta.json: ok|failed|stopped
        the handle settles with the result
      handle.stop()  -- SIGINT --------------------> every rank stopped (as Ctrl-C)
      Ctrl-C in handle.result(): this kernel stops following; the run goes on

On a cluster whose scheduler can run it (``Scheduler.submit_supervisor``) the supervisor
runs inside the run's own job (``queued`` until the job starts); a kernel on another host
than the supervisor's (the record on a shared home) judges it alive by its heartbeat file
and stops it with a stop file instead of a signal.

Example::

    handle = notebook_launcher(train, num_processes=2, detach=True)   # prints its id
    # ... the kernel restarts ...
    from notebook_launcher import attach, runs
    runs()                      # every run of yours (its record here), and its state
    attach("3fa9c1").result()   # the dashboard with its history, then the values
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import pickle
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ._events import (
    FollowingStopped,
    LaunchFinished,
    LaunchRestarting,
    LaunchStarted,
    NodesWaiting,
    Output,
    WorkerStarted,
)
from ._launch import detach as record
from ._launch.detach import Meta
from ._launch.handover import Handover, LaunchJob, supervisor_code
from ._launch.plan import LaunchPlan
from ._launch.scheduler import kind_of, tail
from ._launch.session import TaskHandle
from ._posix import deferred_interrupts
from ._serialization import dumps, dumps_checked
from ._wire.supervisor import HandedOver
from .errors import LaunchError, at_callers_line
from .ui import View, history_lines, replay
from .ui.lazy import launch_view

#: Seconds between two looks at a followed run's log (the live dashboard's latency).
POLL = 0.1


def launch(
    plan: LaunchPlan,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    job: LaunchJob,
    dashboard: bool | str | View,
) -> RunHandle:
    """Start ``plan`` under a supervisor of its own and follow it (``notebook_launcher``'s
    ``detach=True``). ``job``: what the supervisor's ``_Launch`` takes besides the plan."""
    name = getattr(function, "__name__", "function")
    listen, plan.listen = plan.listen, None  # the supervisor gets a copy; ours closes here
    try:

        def body() -> LaunchJob:
            task = dumps_checked((function, args, kwargs), "the launched function and its args")
            return dataclasses.replace(job, plan=plan, task=task)

        def said(run_id: str) -> str:
            return (
                f"notebook_launcher: run {run_id} detached ({name}, {len(plan.specs)} ranks): "
                f"it goes on without this kernel. notebook_launcher.attach({run_id!r}) follows "
                "it from any kernel of yours on this machine; .stop() stops it."
            )

        return _hand_over(
            name, len(plan.specs), 1, body, listen.fileno() if listen is not None else -1,
            said, dashboard, forks=len(plan.specs),
        )  # fmt: skip
    finally:
        if listen is not None:
            listen.close()


def launch_on_cluster(
    name: str, ranks: int, nodes: int, job: LaunchJob, dashboard: bool | str | View
) -> RunHandle:
    """A launch on a cluster (``job.cluster``, not started: its configuration) handed to
    a supervisor of its own, followed here. A cluster whose scheduler can host it gets its
    supervisor *inside* a job of its own (:func:`_hand_over_to_job`): the job holds the
    hub, the store and the ranks, and nothing of the run is left on this host. Otherwise
    (an ``AgentCluster``, an allocation this kernel runs in, Ray) the supervisor runs on
    this host, starts the cluster (holds its hub and store), runs the launch and ends the
    cluster when the run ends. ``job``: the task (pickled for the agents) and what
    ``launcher._cluster_launch`` takes."""
    scheduler = job.cluster.scheduler
    if scheduler.can_host_supervisor():
        run_id = _hand_over_to_job(name, ranks, nodes, job, scheduler)
        print(
            f"notebook_launcher: run {run_id} detached ({name}, {ranks} ranks on {nodes} "
            f"node(s)): {scheduler.describe()} runs it, its supervisor included; it goes on "
            f"without this kernel. notebook_launcher.attach({run_id!r}) follows it from any "
            "kernel of yours that reads this record; .stop() stops it and ends the job.",
            flush=True,
        )
        return attach(run_id, dashboard=dashboard)

    def said(run_id: str) -> str:
        return (
            f"notebook_launcher: run {run_id} detached ({name}, {ranks} ranks on {nodes} "
            f"node(s)): its supervisor starts the cluster's job and owns it; it goes on "
            f"without this kernel. notebook_launcher.attach({run_id!r}) follows it from any "
            "kernel of yours on this machine; .stop() stops it and ends the job."
        )

    return _hand_over(name, ranks, nodes, lambda: job, -1, said, dashboard)


def _hand_over_to_job(name: str, ranks: int, nodes: int, job: LaunchJob, scheduler: Any) -> str:
    """A new run's record (on a file system the job's nodes read: a shared home), its task
    written there, and a job submitted by ``scheduler`` whose first process is the run's
    supervisor (``_supervise.in_job``), the job written into the record
    (``record.write_job``: any kernel that attaches reads it back); the run id. The run is
    "queued" until that supervisor starts."""
    submitted = False
    key = secrets.token_bytes(record.KEY_BYTES)
    made: list[str] = []
    try:
        run_id = _new_record(name, ranks, nodes, dumps(job), record.QUEUED, key, made)
        run_dir = made[0]
        code = supervisor_code("in_job(sys.argv[1], sys.argv[2])")
        argv = (scheduler.python or sys.executable, "-c", code, run_dir, kind_of(type(scheduler)))
        # the run's key goes in the job's environment as submitted: never in the record
        with deferred_interrupts():  # a job submitted and not written down: none
            submitted = scheduler.submit_supervisor(argv, run_dir, {record.KEY_ENV: key.hex()})
            record.write_job(run_dir, scheduler)
    except BaseException:  # Ctrl-C while it is submitted too: no job, no record left
        if submitted:
            scheduler.cancel(now=True)
        for run_dir in made:
            record.remove(run_dir)
        raise
    return run_id


def _new_record(
    name: str, ranks: int, nodes: int, job: bytes, state: str, key: bytes, made: list[str]
) -> str:
    """A new run's record: its meta (``state``) and its task (``job``: what the
    supervisor's launch needs, pickled; with this kernel's path, environment and
    directory, which the supervisor takes on), sealed with the run's ``key``. Its id; its
    directory is put in ``made`` as soon as it exists (whatever comes next, the caller
    knows what to remove). All of it or (an error, an interrupt) none of it."""
    record.sweep()
    payload = pickle.dumps(HandedOver(record.the_kernel(), job))
    try:
        with deferred_interrupts():  # a record whole, or none: never an empty folder
            run_id, run_dir = record.new_run(name)
            made.append(run_dir)
            record.write_meta(run_dir, Meta(run_id, name, time.time(), ranks, state, nodes=nodes))
            record.write_private(os.path.join(run_dir, record.TASK), record.seal(key, payload))
    except BaseException:
        with deferred_interrupts():
            for run_dir in made:
                record.remove(run_dir)
        raise
    return run_id


def _hand_over(
    name: str,
    ranks: int,
    nodes: int,
    body: Callable[[], LaunchJob],
    listen_fd: int,
    said: Callable[[str], str],
    dashboard: bool | str | View,
    forks: int = 0,
) -> RunHandle:
    """A new run's record, its task written there (``body()``: what the supervisor's
    launch needs), its supervisor started (``forks``: how many ranks it forks), then its
    go, ``said(id)`` printed and the run's handle (``attach``) -- or, for an error or a
    Ctrl-C before the go, nothing: no record, no supervisor, nothing run.

    The go is the one point of no return: the supervisor runs nothing before it. It is
    given, the run announced and its handle made as one step that Ctrl-C does not cut; a
    Ctrl-C that comes during it is too late to undo the run, so its handle is returned
    and the interrupt said."""
    job = dumps(body())  # (before the record: a task that cannot be pickled leaves none)
    handover = Handover()
    made: list[str] = []
    try:
        run_id = _new_record(name, ranks, nodes, job, record.STARTING, handover.key, made)
        handover.start(made[0], listen_fd, forks)
        with deferred_interrupts() as caught:
            handover.commit()
            print(said(run_id), flush=True)
            handle = attach(run_id, dashboard=dashboard)
            late = bool(caught)
            caught.clear()
    except BaseException:
        if not handover.committed:  # nothing ran: nothing is left (another Ctrl-C waits)
            with deferred_interrupts():
                handover.abandon()
                for run_dir in made:
                    record.remove(run_dir)
        raise
    if late:
        print(
            f"notebook_launcher: Ctrl-C came as run {run_id} started: it goes on (this is "
            "its handle); .stop() stops it.",
            file=sys.stderr,
            flush=True,
        )
    return handle


# --- following a run -------------------------------------------------------------------

#: An ended run whose result its supervisor is about to hand over (the next look takes it).
_NOT_YET = object()


class RunHandle(TaskHandle):
    """A detached run, followed by this kernel: a ``concurrent.futures.Future`` as a
    ``block=False`` launch's handle is (``result(timeout)``, ``done()``, ``stacks()``,
    ``add_done_callback``), plus ``id`` and ``stop()``.

    ``result()`` returns every rank's value, or raises the root cause as a launch does; the
    run's record is then removed (``attach(id, keep=True)`` keeps it). Ctrl-C while waiting
    in ``result()`` stops following (the run goes on; ``attach(id)`` again); ``stop()`` (or
    ``cancel()``) stops the run: every rank stopped, the handle *cancelled*."""

    def __init__(self, run_id: str, run_dir: str, label: str, keep: bool) -> None:
        super().__init__(self._signal_stop, label, stacks=self._take_stacks)
        #: the run's id (``attach(id)``, ``runs()``)
        self.id = run_id
        #: where its record lives
        self.path = run_dir
        self.keep = keep
        self.detached = False
        #: rank -> pid of the ranks of its latest attempt (from its log)
        self.pids: dict[int, int] = {}

    def stop(self) -> bool:
        """Stop the run (every rank, as Ctrl-C stops a launch) and wait for its end: True
        when it ended stopped, False when it had ended otherwise first (a handle that
        stopped following asks the supervisor and returns at once: True)."""
        if self.detached:
            self._signal_stop()
            return True
        return self.cancel()

    def detach(self) -> None:
        """Stop following the run here (it goes on; ``attach(id)`` follows it again)."""
        self.detached = True

    def _signal_stop(self) -> None:
        try:
            meta = record.read_meta(self.path)
        except OSError:
            return  # the record is gone: the run ended, and a kernel took its result
        if meta.state == record.QUEUED and meta.pid is None:  # its job waits in the queue
            with contextlib.suppress(OSError):
                record.ask_to_stop(self.path)  # (should its supervisor start meanwhile)
            job = record.job_of(self.path)
            if job is not None:
                job.cancel(now=True)
            return
        if record.elsewhere(meta):  # not ours to signal: asked through the record
            with contextlib.suppress(OSError):
                record.ask_to_stop(self.path)
            return
        if meta.pid is not None and record.supervisor_alive(meta):
            try:
                os.kill(meta.pid, signal.SIGINT)
            except ProcessLookupError:
                pass

    def output(self, rank: int | None = None) -> str:
        """Every output line the run's ranks printed so far, from its record (the views
        show each rank's latest lines of a long history): of ``rank``, or of every rank,
        each line labelled ``[rankN]``, in the order the supervisor read them."""
        reader = record.EventReader(self.path)
        try:
            events = reader.read()
        finally:
            reader.close()
        if reader.damaged:  # (what follows it cannot be read: not "every line")
            raise record.RecordDamaged(
                f"{reader.damaged}. The lines before it: attach({self.id!r}) shows them"
            )
        if rank is not None:
            return "".join(e.text for e in events if type(e) is Output and e.rank == rank)
        lines: list[str] = []
        partial: dict[tuple[int, str], str] = {}  # (rank, stream) -> its line being written
        for e in events:
            if type(e) is Output:
                *ended, rest = (partial.pop((e.rank, e.stream), "") + e.text).split("\n")
                lines.extend(f"[rank{e.rank}] {line}\n" for line in ended)
                if rest:
                    partial[e.rank, e.stream] = rest
        lines.extend(f"[rank{r}] {text}\n" for (r, _), text in sorted(partial.items()))
        return "".join(lines)

    def _take_stacks(self) -> Any:
        from ._launch import stall
        from .ui.stall import Stacks

        with contextlib.suppress(OSError):
            meta = record.read_meta(self.path)
            if record.elsewhere(meta):
                raise LaunchError(
                    f"stacks() of run {self.id}: its supervisor and ranks run on host "
                    f"{meta.host}, not this one ({record.this_host()}); call it from a "
                    "kernel there, or let the dashboard show where every rank is when the "
                    "run stalls (stall_after=...)"
                )
            if meta.nodes > 1 or meta.cluster:
                raise LaunchError(
                    f"stacks() of run {self.id}: its ranks run on the cluster's nodes, out "
                    "of this kernel's reach; the dashboard shows where every rank is when "
                    f"the run stalls (stall_after=...), attached or not"
                )

        alive = {r: (pid, None) for r, pid in self.pids.items() if record.running(pid)}
        return Stacks(stall.report(alive, "request"))

    def result(self, timeout: float | None = None) -> Any:
        __tracebackhide__ = True  # the caller's frames, then the rank's
        if self.detached:
            raise at_callers_line(
                RuntimeError(
                    f"this kernel stopped following run {self.id}: "
                    f"notebook_launcher.attach({self.id!r}) follows it again"
                )
            )
        try:
            exc = Future.exception(self, timeout)
        except KeyboardInterrupt:
            self.detach()
            raise KeyboardInterrupt(
                f"detached from run {self.id}: it goes on without this kernel. "
                f"notebook_launcher.attach({self.id!r}) follows it again; .stop() stops it"
            ) from None
        self._taken(exc)
        if exc is not None:
            raise exc
        return Future.result(self, 0)

    def _taken(self, exc: BaseException | None) -> None:
        """The result was taken: the record has done its work (a damaged one is kept, for
        whoever can mend it)."""
        if not self.keep and not isinstance(exc, record.RecordDamaged):
            record.remove(self.path)

    def __repr__(self) -> str:
        return super().__repr__().replace("<TaskHandle", f"<RunHandle {self.id}", 1)


def attach(run_id: str, dashboard: bool | str | View = "auto", keep: bool = False) -> Any:
    """Follow run ``run_id`` (``notebook_launcher.runs()`` lists them) from this kernel: its
    dashboard with the whole history at once, then live. Returns its :class:`RunHandle`;
    for a detached session's id (``start(..., detach=True)``), the session
    (:class:`~notebook_launcher.detached_session.DetachedSession`).

    ``keep=True``: the record stays after ``result()`` (else it is removed then).

    Example::

        handle = attach("3fa9c1")
        handle.result()      # every rank's return value, or the root cause raised
    """
    run_dir = record.find(run_id)
    meta = record.read_meta(run_dir)
    if meta.kind == "session":
        from .detached_session import attach_session

        return attach_session(run_id, run_dir, dashboard)
    handle = RunHandle(run_id, run_dir, meta.function, keep)
    follower = _Follower(run_dir, launch_view(dashboard, False), handle)
    follower.step()  # the history, shown here and now
    if not follower.ended:
        cell = contextvars.copy_context()  # what the thread shows belongs to this cell
        threading.Thread(
            target=cell.run, args=(follower.follow,), name=f"notebook-launcher-{run_id}",
            daemon=True,
        ).start()  # fmt: skip
    return handle


class _Follower:
    """Replays a run's log into a view, then follows it until the run ends (or the handle
    stops following); settles the handle."""

    def __init__(self, run_dir: str, view: View, handle: RunHandle) -> None:
        self.run_dir, self.view, self.handle = run_dir, view, handle
        self.reader = record.EventReader(run_dir)
        self.ended = False
        self.replayed = False  # the history (the first read) is shown at once
        #: while the run's job is queued: when to ask its scheduler again, what it said
        self.next_look = 0.0
        self.waiting: str | None = None
        #: a supervisor on another host: its heartbeat's last time seen, when it was seen
        #: to change (this host's monotonic clock), and whether its silence was said
        self.beat = -1.0
        self.beat_seen = time.monotonic()
        self.unheard = False
        #: the run's end taken from its supervisor's memory (a full disk): (meta, result)
        self.held: tuple[Meta, bytes] | None = None
        #: the log told the view how the run ended
        self.finished = False
        #: a damaged log was said (once)
        self.told_damage = False

    def follow(self) -> None:
        try:
            while not self.ended:
                if self.handle.detached:  # what it shows stays, and says so
                    self.reader.close()
                    self.view.handle(FollowingStopped(time.time()))
                    self.view.close()
                    return
                time.sleep(POLL)
                self.step()
        except BaseException as exc:  # noqa: BLE001 - the handle says what went wrong
            self._end(exc)

    def step(self) -> None:
        """Show what the log holds now; settle the handle when the run has ended."""
        try:
            if self.held is None:  # (a full disk: its end, from its supervisor's memory)
                self.held = record.take_held(self.run_dir)
            meta = self.held[0] if self.held else record.read_meta(self.run_dir)
            state = record.state_of(meta, self.run_dir)  # (before the log: a final state
            # means a full log)
            if self.replayed:
                self._show(self.reader.read())
            else:  # the history: only what the view can show is read (the rest counted)
                self._show(*self.reader.read_history(history_lines(self.view)))
            if state in record.ENDED and self.reader.pending() and not self.reader.damaged:
                self.reader.damaged = (  # (an ended run's log is whole)
                    f"the event log of run {meta.id} ({self.reader.path}) is damaged: it "
                    f"ends with {self.reader.pending()} bytes that are not a whole frame"
                )
            if self.reader.damaged and not self.told_damage:
                self.told_damage = True
                print(
                    f"notebook_launcher: {self.reader.damaged}. What it held before is "
                    "shown; the run's end and result are read from the rest of its record.",
                    file=sys.stderr,
                    flush=True,
                )
            self.view.tick()
            outcome = self._outcome(meta) if state in record.ENDED else None
        except OSError:
            self._end(self._gone())
            return
        if state in record.ENDED:
            if outcome is _NOT_YET:
                return
            self._ended(meta)
            self._end(outcome)
        elif state == record.QUEUED:
            self._queued(meta)
        elif record.elsewhere(meta) and state != record.DIED:
            self._listen(meta)
        elif state == record.DIED and meta.pid is None and meta.state == record.QUEUED:
            self._end(self._never_started(meta))
        elif state == record.DIED:
            where = f" on host {meta.host}" if record.elsewhere(meta) else ""
            found = f" (its host {meta.host} found it gone)" if where else ""
            why = (
                f"the supervisor (pid {meta.pid}{where}) of run {meta.id} died before the "
                f"run ended{found}: its ranks were ended with it. " + record.log_said(self.run_dir)
            )
            wall = time.time() - meta.started
            self.view.handle(LaunchFinished(False, why, None, wall, time.time()))
            self._end(LaunchError(why))

    def _outcome(self, meta: Meta) -> Any:
        """The ended run's values or exception: from its record, or from its supervisor's
        memory where the disk was full (``_NOT_YET`` until it listens)."""
        if self.held is not None:
            held = self.held
            with contextlib.suppress(OSError):  # the record whole again, if there is room
                record.write_private(os.path.join(self.run_dir, record.RESULT), held[1])
                record.write_meta(self.run_dir, dataclasses.replace(held[0], held=False))
            return record.decode_result(held[1], self.run_dir)
        if not meta.held:
            try:
                return record.read_result(self.run_dir)
            except record.RecordDamaged as exc:  # (the history is shown; result() says it)
                return exc
        if record.elsewhere(meta):
            return LaunchError(
                f"run {meta.id} ended ({meta.state}), but its record's disk was full: its "
                f"result is held in memory by its supervisor on host {meta.host}. Attach from "
                f"a kernel there to take it: notebook_launcher.attach({meta.id!r}).result()"
            )
        if not record.running(meta.pid or 0):
            return LaunchError(
                f"run {meta.id} ended ({meta.state}), but its record's disk was full and its "
                "supervisor, which held its result in memory, has ended: the result is lost. "
                f"{meta.note}"
            )
        return _NOT_YET  # (its supervisor is about to listen)

    def _ended(self, meta: Meta) -> None:
        """What befell the record itself (a full disk), said; and the end drawn where the
        log stopped before it (the view would wait for it)."""
        if meta.note:
            print(f"notebook_launcher: run {meta.id}: {meta.note}", file=sys.stderr, flush=True)
        if not self.finished:
            ok = meta.state == record.OK
            wall = (meta.ended or time.time()) - meta.started
            self.view.handle(LaunchFinished(ok, meta.summary, None, wall, time.time()))

    def _listen(self, meta: Meta) -> None:
        """A run whose supervisor runs on another host: say when its heartbeat has not
        changed for longer than ``HEARTBEAT_STALE`` (by this host's own clock: how long
        this kernel has seen no beat, whatever the other clocks say), and when it beats
        again. Never taken for its end: only its own host can tell that."""
        try:
            beat = os.stat(os.path.join(self.run_dir, record.HEARTBEAT)).st_mtime
        except OSError:
            return
        now = time.monotonic()
        if beat != self.beat:
            if self.unheard:
                self.unheard = False
                print(f"notebook_launcher: run {meta.id}: heard from again", file=sys.stderr)
            self.beat, self.beat_seen = beat, now
        elif now - self.beat_seen > record.HEARTBEAT_STALE and not self.unheard:
            self.unheard = True
            print(
                f"notebook_launcher: run {meta.id}: its supervisor on host {meta.host} has "
                f"not been heard from for {now - self.beat_seen:.0f} s (its heartbeat file "
                "unchanged): still following. Only its own host can tell whether it ended "
                "(a stalled or swapping machine, or a slow file server, catches up); "
                "stop() asks it to stop through the record.",
                file=sys.stderr,
                flush=True,
            )

    def _queued(self, meta: Meta) -> None:
        """The run's job waits in its scheduler's queue: say its state when it changes."""
        now = time.monotonic()
        if now < self.next_look:
            return
        self.next_look = now + record.QUEUED_LOOK
        job = record.job_of(self.run_dir)
        what = "submitted"
        with contextlib.suppress(LaunchError):
            if job is not None:
                what = job.status().brief or what
        if what != self.waiting:
            self.waiting = what
            self.view.handle(
                NodesWaiting(
                    job.describe() if job is not None else f"a job, {meta.nodes} node(s)",
                    f"{what}: the run's supervisor starts in the job",
                    0,
                    meta.nodes,
                    time.time(),
                )  # fmt: skip
            )

    def _never_started(self, meta: Meta) -> BaseException:
        """The run's job ended before its supervisor started in it: stopped (by us, while
        it was queued), or the job's end and its output."""
        job = record.job_of(self.run_dir)
        named = job.describe().split(",")[0] if job is not None else "job"
        if os.path.exists(os.path.join(self.run_dir, record.STOP)):
            why = f"stopped while its {named} was queued: nothing ran"
            self.view.handle(LaunchFinished(False, why, None, 0.0, time.time()))
            return KeyboardInterrupt(why)
        output = ""
        try:
            status = job.status(settled=True) if job is not None else None
            ended = status.line if status is not None else "it was never submitted"
            output = status.log if status is not None else ""
        except LaunchError as exc:
            ended = str(exc)
        said = tail(output) if output else ""
        said = said or tail(os.path.join(self.run_dir, record.LOG))
        why = (
            f"run {meta.id}'s {named} ended before the run's supervisor started in it "
            f"({ended}). Its output ({output}):\n{said or '(empty)'}\nThe job's first node "
            f"must read this record ({self.run_dir}): NOTEBOOK_LAUNCHER_RUNS_DIR on a file "
            "system the nodes share, as your home usually is."
        )
        self.view.handle(LaunchFinished(False, why, None, 0.0, time.time()))
        return LaunchError(why)

    def _gone(self) -> LaunchError:
        run_id = self.handle.id
        return LaunchError(
            f"the record of run {run_id} is gone: another handle took its result (result() "
            f"removes the record; attach({run_id!r}, keep=True) keeps it), or it was removed "
            f"from {os.path.dirname(self.run_dir)} by hand"
        )

    def _show(self, events: list[Any], left_out: dict[int, int] | None = None) -> None:
        for i, event in enumerate(events):
            if type(event) is Output:  # (most of them)
                continue
            if isinstance(event, LaunchStarted) and not event.detached:
                # the header names the run: its ranks are its supervisor's, not this kernel's
                events[i] = dataclasses.replace(event, detached=self.handle.id)
            elif isinstance(event, LaunchRestarting):
                self.handle.pids.clear()
            elif isinstance(event, WorkerStarted):
                self.handle.pids[event.rank] = event.pid
            elif isinstance(event, LaunchFinished):
                self.finished = True
        if not self.replayed:  # the history: folded whole, drawn once
            self.replayed = True
            replay(self.view, events, left_out)
            return
        for event in events:  # live: as a launch shows them
            self.view.handle(event)

    def _end(self, outcome: Any) -> None:
        self.ended = True
        self.reader.close()
        try:
            self.view.close()
        finally:
            handle = self.handle
            if isinstance(outcome, BaseException):
                stopping = handle._cancelling and isinstance(outcome, KeyboardInterrupt)
                if stopping and not handle.keep:  # stopped by us: nobody wants its record
                    record.remove(self.run_dir)
                handle.set_exception(outcome)
            else:
                handle.set_result(outcome)


# --- the runs of this user -------------------------------------------------------------


@dataclass(frozen=True)
class RunInfo:
    """One run in :func:`runs`."""

    id: str
    function: str
    started: float
    state: str
    ranks: int
    #: where its record lives
    path: str
    summary: str = ""
    #: "launch" or "session"
    kind: str = "launch"
    #: the nodes its ranks run on
    nodes: int = 1
    #: a cluster run's job (its scheduler's words: ``Scheduler.describe``), once started
    cluster: str = ""
    #: the host its supervisor runs on
    host: str = ""

    def __str__(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        tail = f"  {self.summary}" if self.summary else ""
        where = f" on {self.nodes} nodes" if self.nodes > 1 else ""
        job = f" ({self.cluster})" if self.cluster else ""
        if self.host and self.host != record.this_host():
            job += f" [supervisor on {self.host}]"
        return (
            f"{self.id}  {when}  {self.state:<15} {self.ranks} ranks{where}  "
            f"{self.function}{job}{tail}"
        )


class Runs(list[RunInfo]):
    """The runs, one line each; then the records that could not be read (:attr:`damaged`:
    what is wrong with each)."""

    def __init__(self) -> None:
        super().__init__()
        #: why each damaged record was left out
        self.damaged: list[str] = []

    def __repr__(self) -> str:
        lines = [str(run) for run in self] or [f"no detached runs (records under {record.root()})"]
        return "\n".join(lines + [f"left out: {why}" for why in self.damaged])

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


def runs() -> Runs:
    """The detached runs (and sessions: function "session", kind "session") of this user
    under the records' root (``~/.notebook_launcher/runs``: on a home that hosts share, the
    runs of every host, a supervisor elsewhere named ``[supervisor on HOST]``), oldest
    first: id, function, start,
    state (running, ok, failed, stopped, or "supervisor died": its supervisor ended
    without a word, killed or crashed, and its ranks with it), ranks, nodes (and a
    cluster run's job), where its record lives. Records of ended runs whose result nobody took go after
    ``NOTEBOOK_LAUNCHER_RUN_RETENTION`` seconds (7 days); that of a session whose supervisor
    died, as soon as ``attach(id)`` said so (nothing of it can be had again).

    Example::

        runs()
        # 3fa9c1  2026-11-27 12:30:05  running         2 ranks  train
    """
    record.sweep()
    found = Runs()
    for path in record.records():
        try:
            record.check_private(path)
            meta = record.read_meta(path)
        except record.RecordDamaged as exc:
            found.damaged.append(str(exc))
            continue
        except (OSError, ValueError, TypeError, LaunchError):
            continue
        state = record.state_of(meta, path)
        job = record.job_of(path) if meta.state == record.QUEUED and not meta.cluster else None
        if job is not None:  # (once it runs, its supervisor names it)
            meta.cluster = job.describe()
        unheard = record.unheard_for(meta, path) if state != record.DIED else None
        if unheard is not None:
            meta.summary = (
                f"not heard from for {unheard:.0f} s by this host's clock (its host "
                f"{meta.host} can tell whether it ended)"
            )
        info = RunInfo(meta.id, meta.function, meta.started, state, meta.ranks, path)
        summary = meta.summary
        if meta.kind == "session" and state == record.DIED:  # nothing of it can be had
            summary = (
                f"its ranks and variables are lost: attach({meta.id!r}) says why, and clears it"
            )
        found.append(
            dataclasses.replace(
                info, summary=summary, kind=meta.kind, nodes=meta.nodes,
                cluster=meta.cluster, host=meta.host,
            )
        )  # fmt: skip
    found.sort(key=lambda run: run.started)
    return found


__all__ = ["RunHandle", "RunInfo", "Runs", "attach", "launch", "runs"]
