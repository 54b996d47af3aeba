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

import ast
import atexit
import contextlib
import itertools
import linecache
import secrets
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._launch import compare as compare_values
from ._launch import preflight, stall
from ._launch.lifecycle import RunEnd, decide, finished_event
from ._launch.plan import plan_launch
from ._launch.session import SessionCore, TaskHandle
from ._posix import deferred_interrupts
from ._serialization import dumps_checked
from ._worker import compare as rank_compare
from ._worker import session as rank_side
from .errors import LaunchError, PreflightError, at_callers_line, interrupted
from .ui import View, view_for
from .ui.lazy import InCell, LazyView
from .ui.stall import Stacks

if TYPE_CHECKING:
    from .cluster import Cluster

_live: weakref.WeakSet[Session] = weakref.WeakSet()
_cells = itertools.count(1)
#: The kernel's current session, the one the magics (``%dist``, ``%%distributed``,
#: ``%%rank``, ``%rankdiff``) use: the last one started or attached, whichever way
#: (``start()``, ``attach(id)``, ``%dist start``, ``%dist attach``), until it is closed,
#: stopped or let go (``%dist detach``); then the one current before it, if still open.
_current: Session | None = None
#: the sessions current before it, oldest first (weakly: one the notebook dropped goes)
_earlier: list[weakref.ref[Session]] = []


def current() -> Session | None:
    """The kernel's current session (the magics'), or None."""
    return _current


def make_current(session: Session) -> None:
    """``session`` is the kernel's current session from now on."""
    global _current
    if session is _current:
        return
    if _current is not None:
        _earlier.append(weakref.ref(_current))
    _current = session
    _earlier[:] = [r for r in _earlier if r() not in (None, session)]


def let_go(session: Session) -> None:
    """``session`` was closed, stopped or let go: no longer current (the one before it is,
    if still open), nor to come back."""
    global _current
    _earlier[:] = [r for r in _earlier if r() not in (None, session)]
    if _current is not session:
        return
    _current = None
    while _earlier and _current is None:
        _current = _earlier.pop()()


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
) -> Session:
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
        session: Session = start_detached(
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


@dataclass(frozen=True)
class SessionStatus:
    """What ``%dist status`` shows."""

    state: str  # "ready" | "busy" | "broken" | "closed" | "down"
    world_size: int
    start_method: str
    backend: str
    tasks_run: int
    generation: int
    pids: tuple[int, ...]
    why_broken: str | None = None
    #: what the user should know of how it started ("port 29500 is busy, using 41234")
    note: str | None = None
    #: "down": why the session has no ranks (its restart was interrupted, or failed)
    why_down: str | None = None

    def __str__(self) -> str:
        if self.state == "down":
            return (
                f"session: no ranks ({self.why_down}); restart() (or %dist restart) starts "
                "fresh ones"
            )
        text = (
            f"session: {self.state}, {self.world_size} ranks ({self.backend}, "
            f"{self.start_method}), {self.tasks_run} tasks run"
        )
        if self.generation:
            text += f", process group re-formed {self.generation}x"
        if self.pids:
            text += f", pids {list(self.pids)}"
        if self.note:
            text += f"\n{self.note}"
        if self.why_broken:
            text += f"\nbroken: {self.why_broken}; restart() (or %dist restart) starts fresh ranks"
        return text

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


class Session:
    """Ranks that live across cells (see :func:`start`)."""

    def __init__(self, num_processes: int | None, **options: Any) -> None:
        __tracebackhide__ = True
        preflight.check_dashboard(options.get("dashboard", "auto"))
        options["stall_after"] = stall.check_stall_after(
            options.get("stall_after", stall.DEFAULT_STALL_AFTER)
        )
        self._num_processes = num_processes
        self._options = options
        self._core: SessionCore | None = None
        #: why there are no ranks although the session was not closed (a restart that was
        #: interrupted or failed); None otherwise
        self._down: str | None = None
        self._closed = False
        self._start()

    # -- life ----------------------------------------------------------------------------

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

    def _view(self, dashboard: Any = None) -> View:
        choice = self._options["dashboard"] if dashboard is None else dashboard
        if not isinstance(choice, (bool, str)):
            return view_for(choice)  # the caller's own view gets every event
        # The pump thread serves it: what it shows belongs to the cell that asked.
        return InCell(LazyView(lambda: view_for(choice)))

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

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None and not core.closed:
            core.close(grace=0.0)

    # -- running ---------------------------------------------------------------------------

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

    def _pickled(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[bytes, str]:
        __tracebackhide__ = True
        preflight.check_function(fn)
        data = dumps_checked((fn, args, kwargs), "the function and its args")
        return data, getattr(fn, "__qualname__", type(fn).__name__)

    def run(
        self, fn: Callable[..., Any], *args: Any, ranks: list[int] | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ``ranks`` (default: all) and return the per-rank
        list (index ``i`` is ``ranks[i]``'s value). A failing rank raises its own exception;
        the session and every rank's variables live on. Ctrl-C at any moment (while the
        task is sent included) interrupts the task: ``KeyboardInterrupt`` once its ranks
        stopped, and the session goes on."""
        __tracebackhide__ = True
        return self._run_pickled(*self._pickled(fn, args, kwargs), ranks)

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

    def run_cell(
        self, source: str, ranks: list[int] | None = None, *, _raw_cell: str | None = None
    ) -> list[str | None]:
        """Run a cell's source in each rank's namespace (what ``%%distributed`` does); the
        ``repr`` of each rank's last expression, in the order of ``ranks``. Plain Python:
        a syntax error, or IPython's own syntax (``%time``, ``!ls``), is refused here,
        before any rank runs it."""
        __tracebackhide__ = True
        code, name = cell_code(source, _raw_cell)
        return self.run(rank_side.run_cell, code, name, ranks=ranks)

    def push(self, ranks: list[int] | None = None, **values: Any) -> None:
        """Bind ``values`` in every rank's namespace (the same values everywhere). Ctrl-C
        while a large value is sent: the push is interrupted, the session goes on."""
        __tracebackhide__ = True
        self.run(rank_side.push, values, ranks=ranks)

    def pull(self, name: str, ranks: list[int] | None = None) -> list[Any]:
        """The per-rank values of ``name`` from the ranks' namespaces."""
        __tracebackhide__ = True
        return self.run(rank_side.pull, name, ranks=ranks)

    def post_mortem(self, rank: int, source: str, *, _raw_cell: str | None = None) -> str | None:
        """Run ``source`` in the frame where ``rank``'s last task failed (its variables at
        hand, as pdb's ``interact`` gives them); the ``repr`` of the last expression."""
        __tracebackhide__ = True
        code, name = cell_code(source, _raw_cell)
        (value,) = self.run(rank_side.post_mortem, code, name, ranks=[rank])
        return value

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

    def compare(self, *names: str, ranks: list[int] | None = None) -> compare_values.Comparison:
        """Compare values across ranks: for each name in the ranks' namespaces (a tensor, a
        module's parameters and buffers, an optimizer's state, a dict or list of them, a
        plain value; ``"rng"``: the random state; ``"model.module"``: an attribute), say
        whether every rank has the same, and where not, which entries differ on which
        ranks, in how many elements and by how much at most. Digests first: only the
        entries that differ are sent whole. ``%rankdiff model optimizer`` does the same.

        Example::

            session.compare("model", "optimizer", "rng")
            # model: ranks differ in 1 of 2 entries (1 identical)
            #   weight (float32 [2, 4]): rank 1 differs from rank 0 in 8 of 8 elements; ...
            # optimizer: identical on ranks 0, 1 (4 entries)
        """
        __tracebackhide__ = True
        if not names:
            raise at_callers_line(
                ValueError("compare(): name at least one variable, e.g. compare('model')")
            )
        odd = [n for n in names if not isinstance(n, str) or not n.strip()]
        if odd:
            raise at_callers_line(
                TypeError(
                    f"compare(): variables are named by strings, e.g. compare('model', 'rng'); "
                    f"got {odd[0]!r} ({type(odd[0]).__name__})"
                )
            )
        asked = sorted(self._ranks(ranks))
        token = secrets.token_hex(8)  # (the ranks keep what they walked for its rounds)
        try:
            rows = self.run(rank_compare.digests, list(names), None, True, token, ranks=asked)
            found = compare_values.compare(dict(zip(asked, rows, strict=True)), names)
            split = compare_values.wholes_wanted(found)
            if split:  # a large value that differs somewhere: its groups (in any order)
                rows = self.run(rank_compare.digests, split, None, False, token, ranks=asked)
                compare_values.expand(found, dict(zip(asked, rows, strict=True)))
            groups = compare_values.groups_wanted(found)
            if groups:  # a large value whose group digests differ: its entries, one by one
                rows = self.run(
                    rank_compare.digests, list(groups), groups, True, token, ranks=asked
                )
                compare_values.expand(found, dict(zip(asked, rows, strict=True)))
            want = compare_values.wanted(found)
            if want:
                values = self.run(rank_compare.values, want, token, ranks=asked)
                compare_values.details(found, dict(zip(asked, values, strict=True)))
        finally:
            with contextlib.suppress(Exception):  # (best effort: a new comparison does it too)
                self.run(rank_compare.forget, token, ranks=asked)
        return found

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

    def _ranks(self, ranks: list[int] | int | None) -> list[int]:
        if ranks is None:
            return self.ranks
        return [ranks] if isinstance(ranks, int) else list(ranks)

    def __repr__(self) -> str:
        return f"<notebook_launcher.Session {self.status()}>"


def cell_code(source: str, raw_cell: str | None = None) -> tuple[str, str]:
    """``(code, file name)`` for a cell the ranks run: the name tracebacks show (IPython's
    own for this cell when it runs in a kernel: the dashboard and IPython make it
    ``Cell In[n]``), and the code, checked here (a syntax error is the cell's, raised
    before any rank runs it).

    ``raw_cell``: the whole cell as the user typed it, when ``source`` is its body (a
    ``%%distributed`` cell): the code then keeps the body's lines where the editor shows
    them (``%%distributed`` is line 1, the body's first line is line 2), and tracebacks
    show the cell as it was typed, magic line included. The rank's own functions defined
    in such a cell keep those names and lines for later cells' tracebacks."""
    __tracebackhide__ = True
    offset = _body_offset(source, raw_cell)
    code = "\n" * offset + source if offset is not None else source
    shown = raw_cell if offset is not None and raw_cell is not None else source
    name = _cached_name(shown)
    _check_cell(code, name)
    return code, name


def _body_offset(source: str, raw_cell: str | None) -> int | None:
    """How many lines of ``raw_cell`` come before ``source`` (its body); None when the
    body is not found there (the magic was called from code)."""
    body = source.rstrip("\n")
    if raw_cell is None or not body:
        return None
    at = raw_cell.rfind(body)
    if at < 0 or (at > 0 and raw_cell[at - 1] != "\n"):
        return None
    return raw_cell.count("\n", 0, at)


def _cached_name(text: str) -> str:
    """The file name of ``text`` in ``linecache`` (IPython's cache: ``Cell In[n]``)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    compiler = getattr(shell, "compile", None)
    if compiler is not None and hasattr(compiler, "cache"):
        # IPython counts the cell that runs before running it: it is In[count - 1]
        count = max(int(getattr(shell, "execution_count", 1)) - 1, 0)
        try:  # the cell's execution count makes it "Cell In[n]" in tracebacks
            return str(compiler.cache(text, count, raw_code=text))
        except Exception:  # noqa: BLE001 - a nicer name is optional
            pass
    name = f"<distributed-cell-{next(_cells)}>"
    # (the stall view and tracebacks show its lines)
    linecache.cache[name] = (len(text), None, text.splitlines(keepends=True), name)
    return name


def _check_cell(code: str, filename: str) -> None:
    """Raise the cell's ``SyntaxError`` now, in the kernel (every rank would raise it);
    IPython's syntax, which only IPython understands, is named as such."""
    __tracebackhide__ = True
    try:
        ast.parse(code, filename, "exec")
        return
    except SyntaxError as exc:
        error = exc
    problem = _ipython_syntax(code)
    if problem is not None:
        lineno, line = problem
        error = SyntaxError(
            f"IPython syntax ({line.strip()[:40]}) does not run on the ranks: each rank "
            "runs plain Python, without IPython's magics, !commands or ?help. "
            "Time code with time.perf_counter(), run a command with "
            "subprocess.run(...), or run the line in a cell of its own here.",
            (filename, lineno, 1, line),
        )
    raise at_callers_line(error.with_traceback(None)) from None


def _ipython_syntax(code: str) -> tuple[int, str] | None:
    """The first line of ``code`` that only IPython understands (``%time``, ``!ls``,
    ``x?``): (its number, its text); None when there is none or IPython is not here."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:
        return None
    manager = TransformerManager()
    try:
        if "get_ipython()" not in manager.transform_cell(code):
            return None
    except Exception:  # noqa: BLE001 - a cell IPython cannot read either
        return None
    for number, line in enumerate(code.splitlines(), 1):
        try:
            if line.strip() and "get_ipython()" in manager.transform_cell(line.lstrip()):
                return number, line
        except Exception:  # noqa: BLE001
            continue
    return None


def _close_all() -> None:
    for session in list(_live):
        try:
            session.close()
        except Exception:  # noqa: BLE001 - at exit: do what can be done
            pass


__all__ = ["Session", "SessionStatus", "current", "let_go", "make_current", "start"]
