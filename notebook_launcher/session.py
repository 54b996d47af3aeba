"""Ranks that live across cells: ``start()`` and :class:`Session`.

The second way to use the kit, for debugging rank-specific code interactively. The ranks
come up once -- process group, ``PartialState`` and all -- and stay; each call runs on
them and returns, and their variables survive from one cell to the next::

    session = notebook_launcher.start(num_processes=2)
    session.run(torch.distributed.get_rank)          # [0, 1]
    session.run(load_shard, "data/", ranks=[1])      # on rank 1 only
    session.push(lr=1e-3); session.pull("lr")       # into and out of each rank's namespace
    session.close()

The magics (``%dist``, ``%%distributed``, ``%%rank``) in
:mod:`notebook_launcher.ipython_extension` drive one session from cells. Like
:func:`~notebook_launcher.launcher.notebook_launcher`, a failing rank raises its own
exception in the cell; unlike a launch, the session lives on (see
:mod:`notebook_launcher._launch.session` for what happens when it cannot).

The orchestrating layer for sessions: where the session core (``_launch``) meets the views
(``ui``), as :mod:`notebook_launcher.launcher` is for one-shot launches.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._launch import preflight, stall
from ._launch.lifecycle import RunEnd, decide, finished_event
from ._launch.plan import plan_launch
from ._launch.session import SessionCore, TaskHandle
from ._posix import deferred_interrupts
from ._sessions import SessionBase, SessionStatus, cell_code, current, let_go, make_current
from .errors import LaunchError, PreflightError, interrupted
from .ui import View
from .ui.stall import Stacks

if TYPE_CHECKING:
    from .cluster import Cluster

_live: weakref.WeakSet[Session] = weakref.WeakSet()


def start(
    num_processes: int | None = None,
    *,
    mixed_precision: str = "no",
    use_port: str | int | None = "auto",
    master_addr: str = "127.0.0.1",
    start_method: str | None = None,
    dashboard: bool | str | View = "auto",
    grace_period: float = 1.0,
    stall_after: float | None = stall.DEFAULT_STALL_AFTER,
    cluster: Cluster | None = None,
    devices: str | list[int] | tuple[int, ...] = "auto",
    detach: bool = False,
) -> SessionBase:
    """Start ``num_processes`` ranks that stay until :meth:`Session.close`.

    The options are :func:`notebook_launcher`'s (``stall_after``: a task that makes no
    progress for that many seconds shows where every rank is; None: off; ``cluster``: the
    ranks live on a cluster's nodes, ``num_processes`` of them in all, split evenly). Call
    it from the notebook's own thread (the ranks die with the thread that started them).
    ``devices``: where the ranks run (:func:`notebook_launcher`'s ``devices``). The new
    session is the kernel's current one: ``%dist status``, ``%%distributed`` and the other
    magics use it, as they use one ``%dist start`` made. Also a context manager::

        with notebook_launcher.start(num_processes=2) as session:
            session.run(train_step)

        cluster = SlurmCluster(nodes=2)
        session = notebook_launcher.start(num_processes=4, cluster=cluster)  # 2 x 2 ranks

    ``detach=True``: the ranks and their variables live under a supervisor process of
    their own, not this kernel's children; the session (a :class:`~notebook_launcher.
    detached_session.DetachedSession`, the same methods) has an ``id``, printed, and
    outlives the kernel: ``notebook_launcher.attach(id)`` (``%dist attach ID``) gives it
    back in any kernel of yours on this machine, ``stop()`` ends it::

        session = notebook_launcher.start(num_processes=2, detach=True)
        session.run_cell("model = load_model()")     # still there after a kernel restart
    """
    __tracebackhide__ = True  # a preflight error reads as raised by the caller's line
    preflight.check_detach(detach, cluster, session=True)
    if detach:
        from .detached_session import start_detached

        preflight.check_dashboard(dashboard)
        session: SessionBase = start_detached(
            num_processes,
            dashboard,
            mixed_precision=mixed_precision,
            use_port=use_port,
            master_addr=master_addr,
            start_method=start_method,
            grace_period=grace_period,
            stall_after=stall_after,
            devices=devices,
            cluster=cluster,
        )
    else:
        session = Session(
            num_processes,
            mixed_precision=mixed_precision,
            use_port=use_port,
            master_addr=master_addr,
            start_method=start_method,
            dashboard=dashboard,
            grace_period=grace_period,
            stall_after=stall_after,
            cluster=cluster,
            devices=devices,
        )
    make_current(session)  # the magics' too
    return session


class Session(SessionBase):
    """Ranks that live across cells (see :func:`start`)."""

    def __init__(self, num_processes: int | None, **options: Any) -> None:
        __tracebackhide__ = True
        preflight.check_dashboard(options.get("dashboard", "auto"))
        options["stall_after"] = stall.check_stall_after(
            options.get("stall_after", stall.DEFAULT_STALL_AFTER)
        )
        super().__init__(options)
        self._num_processes = num_processes
        self._core: SessionCore | None = None
        #: why there are no ranks although the session was not closed (a restart that was
        #: interrupted or failed); None otherwise
        self._down: str | None = None
        self._start()

    def _start(self, renew: bool = False) -> None:
        __tracebackhide__ = True  # a preflight error reads as raised by the caller's line
        options = dict(self._options)
        dashboard = options.pop("dashboard")
        stall_after = options.pop("stall_after")
        cluster = options.pop("cluster", None)
        plan = None
        # One view from the wait for a cluster's nodes to the ranks' start: the wait shows
        # (a queued job's state, the agents that joined) and its clock runs on.
        view = self._view(dashboard)
        try:
            if cluster is not None:
                plan = self._on_cluster(cluster, view, options, renew)
            else:
                plan = plan_launch(None, self._num_processes, **options)
            core = SessionCore(plan, stall_after)
        except BaseException as exc:
            if plan is not None:  # (Ctrl-C may land between its making and this line)
                plan.close()
            if cluster is not None:  # the view showed the wait: it says how it ended
                never = RunEnd("start", (), 0, start_error=exc)
                view.handle(finished_event(never, decide(never)))
            view.close()
            raise
        try:
            core.start(view)  # (cleans up after itself when it fails)
            self._core = core
            if not _live:
                atexit.register(_close_all)
            _live.add(self)
        except BaseException:  # Ctrl-C just after the ranks came up: they go too
            self._core = None
            _live.discard(self)
            core.close(grace=0.0)
            raise
        note = core.port_note()
        if note:  # as a launch's header says it
            print(f"notebook_launcher: {note}", file=sys.stderr)

    def _on_cluster(
        self, cluster: Cluster, view: View, options: dict[str, Any], renew: bool
    ) -> Any:
        """The plan of a session on a cluster's nodes (started if need be: ``view`` shows
        the wait for its job and agents; ``renew``, a restart: on fresh nodes if the
        cluster lost some)."""
        __tracebackhide__ = True
        from .cluster import check_cluster

        check_cluster(cluster)
        for name, default in (
            ("use_port", "auto"),
            ("master_addr", "127.0.0.1"),
            ("start_method", None),
        ):
            if options.get(name, default) != default:
                raise PreflightError(
                    f"{name}={options[name]!r} with cluster=...: the cluster's nodes hold the "
                    "ranks and this kernel drives them (leave it as it is)."
                )
        preflight.check_not_in_a_rank()
        return cluster.plan(
            view.handle,
            self._num_processes,
            mixed_precision=options.get("mixed_precision", "no"),
            grace_period=options.get("grace_period", 1.0),
            session=True,
            devices=options.get("devices", "auto"),
            renew=renew,
            tick=view.tick,
        )

    @property
    def core(self) -> SessionCore:
        __tracebackhide__ = True
        if self._core is None:
            if self._down is not None and not self._closed:
                raise LaunchError(
                    f"this session has no ranks: {self._down}. session.restart() (or "
                    "%dist restart) starts fresh ones."
                )
            raise LaunchError("this session is closed; start a new one")
        return self._core

    def restart(self) -> None:
        """Stop every rank and start fresh ones, and say so: their variables are lost
        (what a broken session needs; the kernel keeps running). A restart that is
        interrupted or fails leaves a session without ranks that says so (``status()``);
        ``restart()`` again brings them up."""
        __tracebackhide__ = True
        if self._closed:
            raise LaunchError("this session is closed; start a new one")
        core, self._core = self._core, None
        self._down = "its restart was interrupted"
        try:
            if core is not None:
                core.close(grace=0.0)
            self._start(renew=True)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            self._down = f"its restart failed ({type(exc).__name__}: {exc})"
            raise
        self._down = None
        print(
            f"restarted: {self.world_size} fresh ranks; the old ranks' variables are lost "
            "(push or re-run what they need)"
        )

    def close(self) -> None:
        """Let the ranks leave (then stop what is left). Idempotent."""
        self._closed = True
        let_go(self)
        if self._core is not None:
            self._core.close()
        _live.discard(self)

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None and not core.closed:
            core.close(grace=0.0)

    @property
    def world_size(self) -> int:
        return len(self.core.world)

    @property
    def ranks(self) -> list[int]:
        return list(self.core.world)

    def submit(
        self, fn: Callable[..., Any], *args: Any, ranks: list[int] | None = None, **kwargs: Any
    ) -> TaskHandle:
        """Run ``fn(*args, **kwargs)`` on ``ranks`` (default: all); returns a future-like
        handle at once (``result()``, ``exception()``, ``done()``, ``cancel()``, callbacks)."""
        __tracebackhide__ = True
        data, label = self._pickled(fn, args, kwargs)
        return self.core.submit(
            data, self._ranks(ranks), self._view(), label=label, stacks=self.stacks
        )

    def _run_pickled(self, data: bytes, label: str, ranks: list[int] | int | None) -> list[Any]:
        """:meth:`run` of a task pickled already (a detached session's supervisor gets it
        so from the kernel)."""
        __tracebackhide__ = True
        handle: TaskHandle | None = None
        try:
            with deferred_interrupts():  # Ctrl-C inside submit: delivered once we hold it
                handle = self.core.submit(
                    data, self._ranks(ranks), self._view(), label, stacks=self.stacks
                )
            del data  # (a traceback keeps this frame: not the pickled values)
            return handle.result()
        except KeyboardInterrupt:
            if handle is None or handle.done():
                raise
            exc = handle.interrupt_and_wait()
        raise exc if exc is not None else interrupted("interrupted")

    def interrupt(self) -> None:
        """Interrupt the task that runs (what the notebook's interrupt button does)."""
        self.core.interrupt()

    def stacks(self) -> Stacks:
        """Where every rank is now: each thread's Python stack (cells as ``Cell In[3],
        line 12``, library frames folded), the odd rank(s) out named; ranks between tasks
        say they are idle. Works while a task runs (from another thread, or for a task
        started with :meth:`submit`) as well as between tasks.

        Example::

            handle = session.submit(train)
            session.stacks()      # rank 1 is in `loss.backward()` at Cell In[3], line 9; ...
        """
        return Stacks(self.core.stacks())

    def status(self) -> SessionStatus:
        core = self._core
        if core is None and self._down is not None and not self._closed:
            return SessionStatus("down", 0, "-", "-", 0, 0, (), why_down=self._down)
        if core is None or core.closed:
            return SessionStatus("closed", 0, "-", "-", 0, 0, ())
        group = core.group
        state = "broken" if core.broken else "busy" if core.task is not None else "ready"
        plan = core.plan
        pids = tuple(p.pid for p in group.procs if not p.exited) if group else ()
        return SessionStatus(
            state,
            len(core.world),
            plan.start_method,
            plan.specs[0].backend,
            core.tasks_run,
            core.generation,
            pids,
            core.broken,
            core.port_note(),
        )

    def __repr__(self) -> str:
        return f"<notebook_launcher.Session {self.status()}>"


def _close_all() -> None:
    for session in list(_live):
        try:
            session.close()
        except Exception:  # noqa: BLE001 - at exit: do what can be done
            pass


__all__ = [
    "Session",
    "SessionBase",
    "SessionStatus",
    "cell_code",
    "current",
    "let_go",
    "make_current",
    "start",
]
