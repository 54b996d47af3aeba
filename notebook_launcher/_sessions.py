"""What every session is to the notebook, wherever its ranks live.

A session's ranks live in this kernel (:class:`~notebook_launcher.session.Session`) or
under a supervisor of their own (:class:`~notebook_launcher.detached_session.
DetachedSession`, ``start(..., detach=True)``); both are a :class:`SessionBase`: the
methods built on one call that runs a pickled task on the ranks (``run``, ``run_cell``,
``push``, ``pull``, ``post_mortem``, ``compare``), the status they report
(:class:`SessionStatus`), and the kernel's current session, the one the magics use
(:func:`current`). Below both faces, so that neither imports the other's module back.
"""

from __future__ import annotations

import abc
import ast
import contextlib
import itertools
import linecache
import secrets
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._launch import compare as compare_values
from ._launch import preflight
from ._launch.session import TaskHandle
from ._serialization import dumps_checked
from ._worker import compare as rank_compare
from ._worker import session as rank_side
from .errors import at_callers_line
from .ui import View, view_for
from .ui.lazy import InCell, LazyView
from .ui.stall import Stacks

_cells = itertools.count(1)


#: The kernel's current session, the one the magics (``%dist``, ``%%distributed``,
#: ``%%rank``, ``%rankdiff``) use: the last one started or attached, whichever way
#: (``start()``, ``attach(id)``, ``%dist start``, ``%dist attach``), until it is closed,
#: stopped or let go (``%dist detach``); then the one current before it, if still open.
_current: SessionBase | None = None
#: the sessions current before it, oldest first (weakly: one the notebook dropped goes)
_earlier: list[weakref.ref[SessionBase]] = []


def current() -> SessionBase | None:
    """The kernel's current session (the magics'), or None."""
    return _current


def make_current(session: SessionBase) -> None:
    """``session`` is the kernel's current session from now on."""
    global _current
    if session is _current:
        return
    if _current is not None:
        _earlier.append(weakref.ref(_current))
    _current = session
    _earlier[:] = [r for r in _earlier if r() not in (None, session)]


def let_go(session: SessionBase) -> None:
    """``session`` was closed, stopped or let go: no longer current (the one before it is,
    if still open), nor to come back."""
    global _current
    _earlier[:] = [r for r in _earlier if r() not in (None, session)]
    if _current is not session:
        return
    _current = None
    while _earlier and _current is None:
        _current = _earlier.pop()()


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


class SessionBase(abc.ABC):
    """Ranks that live across cells, wherever they live: what a session offers the
    notebook, built on :meth:`_run_pickled` (a pickled task run on some ranks, their
    values returned). ``options``: the session's options (``dashboard`` among them)."""

    def __init__(self, options: dict[str, Any]) -> None:
        self._options = options
        self._closed = False

    # -- what each kind of session does its own way -----------------------------------------

    @abc.abstractmethod
    def _run_pickled(self, data: bytes, label: str, ranks: list[int] | int | None) -> list[Any]:
        """:meth:`run` of a task pickled already."""

    @property
    @abc.abstractmethod
    def ranks(self) -> list[int]:
        """The session's ranks."""

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @abc.abstractmethod
    def submit(
        self, fn: Callable[..., Any], *args: Any, ranks: list[int] | None = None, **kwargs: Any
    ) -> TaskHandle:
        """Run ``fn(*args, **kwargs)`` on ``ranks`` (default: all); returns a future-like
        handle at once (``result()``, ``exception()``, ``done()``, ``cancel()``, callbacks)."""

    @abc.abstractmethod
    def interrupt(self) -> None:
        """Interrupt the task that runs (what the notebook's interrupt button does)."""

    @abc.abstractmethod
    def stacks(self) -> Stacks:
        """Where every rank is now."""

    @abc.abstractmethod
    def status(self) -> SessionStatus:
        """What ``%dist status`` shows."""

    @abc.abstractmethod
    def restart(self) -> None:
        """Stop every rank and start fresh ones."""

    @abc.abstractmethod
    def close(self) -> None:
        """End the session (idempotent)."""

    # -- built on them ------------------------------------------------------------------------

    def _view(self, dashboard: Any = None) -> View:
        choice = self._options["dashboard"] if dashboard is None else dashboard
        if not isinstance(choice, (bool, str)):
            return view_for(choice)  # the caller's own view gets every event
        # The pump thread serves it: what it shows belongs to the cell that asked.
        return InCell(LazyView(lambda: view_for(choice)))

    def __enter__(self) -> SessionBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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

    def _ranks(self, ranks: list[int] | int | None) -> list[int]:
        if ranks is None:
            return self.ranks
        return [ranks] if isinstance(ranks, int) else list(ranks)


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


__all__ = ["SessionBase", "SessionStatus", "cell_code", "current", "let_go", "make_current"]
