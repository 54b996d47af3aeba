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
import itertools
import linecache
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._launch import compare as compare_values
from ._launch import preflight, stall
from ._launch.plan import plan_launch
from ._launch.session import SessionCore, TaskHandle
from ._serialization import dumps_checked
from ._worker import compare as rank_compare
from ._worker import session as rank_side
from .ui import View, view_for
from .ui.lazy import InCell, LazyView
from .ui.stall import Stacks

_live: weakref.WeakSet[Session] = weakref.WeakSet()
_cells = itertools.count(1)


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
) -> Session:
    """Start ``num_processes`` ranks that stay until :meth:`Session.close`.

    The options are :func:`notebook_launcher`'s (``stall_after``: a task that makes no
    progress for that many seconds shows where every rank is; None: off). Call it from the notebook's own thread
    (the ranks die with the thread that started them). Also a context manager::

        with notebook_launcher.start(num_processes=2) as session:
            session.run(train_step)
    """
    return Session(
        num_processes,
        mixed_precision=mixed_precision,
        use_port=use_port,
        master_addr=master_addr,
        start_method=start_method,
        dashboard=dashboard,
        grace_period=grace_period,
        stall_after=stall_after,
    )


@dataclass(frozen=True)
class SessionStatus:
    """What ``%dist status`` shows."""

    state: str  # "ready" | "busy" | "broken" | "closed"
    world_size: int
    start_method: str
    backend: str
    tasks_run: int
    generation: int
    pids: tuple[int, ...]
    why_broken: str | None = None

    def __str__(self) -> str:
        text = (
            f"session: {self.state}, {self.world_size} ranks ({self.backend}, "
            f"{self.start_method}), {self.tasks_run} tasks run"
        )
        if self.generation:
            text += f", process group re-formed {self.generation}x"
        if self.pids:
            text += f", pids {list(self.pids)}"
        if self.why_broken:
            text += f"\nbroken: {self.why_broken}; restart() (or %dist restart) starts fresh ranks"
        return text

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


class Session:
    """Ranks that live across cells (see :func:`start`)."""

    def __init__(self, num_processes: int | None, **options: Any) -> None:
        preflight.check_dashboard(options.get("dashboard", "auto"))
        options["stall_after"] = stall.check_stall_after(
            options.get("stall_after", stall.DEFAULT_STALL_AFTER)
        )
        self._num_processes = num_processes
        self._options = options
        self._core: SessionCore | None = None
        self._start()

    # -- life ----------------------------------------------------------------------------

    def _start(self) -> None:
        options = dict(self._options)
        dashboard = options.pop("dashboard")
        stall_after = options.pop("stall_after")
        plan = plan_launch(None, self._num_processes, **options)
        core = SessionCore(plan, stall_after)
        core.start(self._view(dashboard))
        self._core = core
        if not _live:
            atexit.register(_close_all)
        _live.add(self)

    def _view(self, dashboard: Any = None) -> View:
        choice = self._options["dashboard"] if dashboard is None else dashboard
        if not isinstance(choice, (bool, str)):
            return view_for(choice)  # the caller's own view gets every event
        # The pump thread serves it: what it shows belongs to the cell that asked.
        return InCell(LazyView(lambda: view_for(choice)))

    @property
    def core(self) -> SessionCore:
        if self._core is None:
            raise RuntimeError("the session is not started")
        return self._core

    def restart(self) -> None:
        """Stop every rank and start fresh ones, and say so: their variables are lost
        (what a broken session needs; the kernel keeps running)."""
        if self._core is not None:
            self._core.close(grace=0.0)
        self._core = None
        self._start()
        print(
            f"restarted: {self.world_size} fresh ranks; the old ranks' variables are lost "
            "(push or re-run what they need)"
        )

    def close(self) -> None:
        """Let the ranks leave (then stop what is left). Idempotent."""
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
        preflight.check_function(fn)
        data = dumps_checked((fn, args, kwargs), "the function and its args")
        label = getattr(fn, "__qualname__", type(fn).__name__)
        return self.core.submit(
            data, self._ranks(ranks), self._view(), label=label, stacks=self.stacks
        )

    def run(
        self, fn: Callable[..., Any], *args: Any, ranks: list[int] | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ``ranks`` (default: all) and return the per-rank
        list (index ``i`` is ``ranks[i]``'s value). A failing rank raises its own exception;
        the session and every rank's variables live on."""
        __tracebackhide__ = True
        return self.submit(fn, *args, ranks=ranks, **kwargs).result()

    def run_cell(self, source: str, ranks: list[int] | None = None) -> list[str | None]:
        """Run a cell's source in each rank's namespace (what ``%%distributed`` does); the
        ``repr`` of each rank's last expression."""
        __tracebackhide__ = True
        return self.submit(rank_side.run_cell, source, _cell_name(source), ranks=ranks).result()

    def push(self, ranks: list[int] | None = None, **values: Any) -> None:
        """Bind ``values`` in every rank's namespace (the same values everywhere)."""
        __tracebackhide__ = True
        self.submit(rank_side.push, values, ranks=ranks).result()

    def pull(self, name: str, ranks: list[int] | None = None) -> list[Any]:
        """The per-rank values of ``name`` from the ranks' namespaces."""
        __tracebackhide__ = True
        return self.run(rank_side.pull, name, ranks=ranks)

    def post_mortem(self, rank: int, source: str) -> str | None:
        """Run ``source`` in the frame where ``rank``'s last task failed (its variables at
        hand, as pdb's ``interact`` gives them); the ``repr`` of the last expression."""
        __tracebackhide__ = True
        (value,) = self.run(rank_side.post_mortem, source, _cell_name(source), ranks=[rank])
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
            raise ValueError("compare(): name at least one variable, e.g. compare('model')")
        asked = sorted(self._ranks(ranks))
        rows = self.run(rank_compare.digests, list(names), ranks=asked)
        found = compare_values.compare(dict(zip(asked, rows, strict=True)), names)
        want = compare_values.wanted(found)
        if want:
            values = self.run(rank_compare.values, want, ranks=asked)
            compare_values.details(found, dict(zip(asked, values, strict=True)))
        return found

    def status(self) -> SessionStatus:
        core = self._core
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
        )

    def _ranks(self, ranks: list[int] | int | None) -> list[int]:
        if ranks is None:
            return self.ranks
        return [ranks] if isinstance(ranks, int) else list(ranks)

    def __repr__(self) -> str:
        return f"<notebook_launcher.Session {self.status()}>"


def _cell_name(source: str) -> str:
    """The file name tracebacks show for a cell: IPython's own for this cell when it runs
    in a kernel (the dashboard turns it into ``Cell In[n]``), else a stable pseudo-name."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    compiler = getattr(shell, "compile", None)
    if compiler is not None and hasattr(compiler, "cache"):
        # IPython counts the cell that runs before running it: it is In[count - 1]
        count = max(int(getattr(shell, "execution_count", 1)) - 1, 0)
        try:  # the cell's execution count makes it "Cell In[n]" in tracebacks
            return str(compiler.cache(source, count))
        except Exception:  # noqa: BLE001 - a nicer name is optional
            pass
    name = f"<distributed-cell-{next(_cells)}>"
    lines = source.splitlines(keepends=True)
    linecache.cache[name] = (len(source), None, lines, name)  # the stall view shows its lines
    return name


def _close_all() -> None:
    for session in list(_live):
        try:
            session.close()
        except Exception:  # noqa: BLE001 - at exit: do what can be done
            pass


__all__ = ["Session", "SessionStatus", "start"]
