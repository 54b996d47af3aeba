"""Errors the launcher raises, and the per-rank failure records behind them.

A launch that fails raises, in the caller:

* the failing rank's **own exception type** (e.g. ``ValueError``, or a class defined in
  the notebook: the very same class object) when a rank raised and that exception could
  be rebuilt in the kernel. Its ``__traceback__`` continues into the rank's own frames,
  so IPython shows them as it shows a local error (``Cell In[2], line 7``, source lines),
  and it carries ``exc.launch_failure`` (a :class:`LaunchFailure`) with every rank's
  record and traceback (``exc.launch_failure.print_traceback(rank)``);
* :class:`RankFailedError` when the rank's exception could not be rebuilt (its message
  names the original type and why);
* :class:`WorkerDied` when a rank exited or was killed without raising;
* :class:`ProcessGroupMismatch` when a rank returned while others still waited for it
  in a collective;
* :class:`RendezvousError` when the nodes of a launch across machines could not form one
  job (a node never showed up, or the node holding the rendezvous went away);
* :class:`LaunchError` for everything else (and as the base of the above).

Every exception here that carries fields defines ``__reduce__`` so it survives pickling.
"""

from __future__ import annotations

import functools
import linecache
import os
import re
import sys
from dataclasses import dataclass, field
from types import TracebackType
from typing import TextIO, TypeVar

#: How much of an exception's message a summary line or a note repeats; the exception
#: itself keeps all of it.
SUMMARY_CHARS = 500


_SENTENCE_END = re.compile(r"[.!?](?=\s+[A-Z])")


def first_sentence(text: str) -> str:
    """The first sentence of ``text`` (its first line when it has no sentence end).

    >>> first_sentence("[pair.cc:553] Connection closed by peer [127.0.0.1]:1. This is "
    ...                "typically caused by a remote worker crashing. GLHF!")
    '[pair.cc:553] Connection closed by peer [127.0.0.1]:1.'
    """
    line = text.strip().split("\n", 1)[0]
    end = _SENTENCE_END.search(line)
    return line[: end.end()] if end else line


def shorten(text: str, limit: int = SUMMARY_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit:,} more characters]"


class LaunchError(RuntimeError):
    """A launch could not start, or one of its ranks failed."""

    def _render_traceback_(self) -> list[str]:
        """IPython's rendering of this error (it calls this on the error it displays):
        the caller's frames, up to the line that called the launcher, then the sentence
        (see :func:`_render_to_caller`). A plain Python traceback shows every frame."""
        return _render_to_caller(self)


def _render_to_caller(exc: BaseException) -> list[str]:
    """``exc`` as IPython shows it, ending at the caller's line.

    An error the launcher raises in words (a refused argument, a function that cannot be
    pickled, a rank that died) is the user's to act on, and its sentence says how: the
    user's frames, down to the line that called the launcher, then that sentence -- none
    of the launcher's frames, nor the exception it was raised from (its message quotes
    what matters). A rank's error (its frames stand in for the rank's) keeps them, less
    the launcher's trailing hidden frames (IPython always shows the last frame, hidden or
    not). ``%xmode Verbose`` shows everything, as IPython would."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("_render_traceback_ is IPython's hook")
    render = shell.InteractiveTB.structured_traceback
    if getattr(shell.InteractiveTB, "mode", "") == "Verbose":
        return list(render(type(exc), exc, exc.__traceback__))
    tb = _to_callers_line(exc.__traceback__)
    if tb is None:  # a rank's frames, or nothing of the caller's
        return list(render(type(exc), exc, _without_trailing_hidden_frames(exc.__traceback__)))
    cause, context, suppress = exc.__cause__, exc.__context__, exc.__suppress_context__
    exc.__cause__, exc.__context__, exc.__suppress_context__ = None, None, True
    try:
        return list(render(type(exc), exc, tb))
    finally:
        exc.__cause__, exc.__context__, exc.__suppress_context__ = cause, context, suppress


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: the module name of the frames that stand in for a rank's (``_serialization``)
_RANK_FRAMES = "__rank__"


def _to_callers_line(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` up to the last of the user's own frames before the launcher's first: the
    line that called it (through a library, such as IPython's magics, or not). None when
    ``tb`` holds a rank's frames, or nothing of the user's before the launcher's."""
    entries = []
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") == _RANK_FRAMES:
            return None
        entries.append(tb)
        tb = tb.tb_next
    ours = next(
        (
            i
            for i, e in enumerate(entries)
            if e.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR)
        ),
        len(entries),
    )
    users = [
        i for i in range(ours) if library_module(entries[i].tb_frame.f_code.co_filename) is None
    ]
    if not users or users[-1] == 0:  # (the first frame is IPython's run_code, never shown)
        return None
    out: TracebackType | None = None
    for entry in reversed(entries[: users[-1] + 1]):
        out = TracebackType(out, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return out


_E = TypeVar("_E", bound=BaseException)


def at_callers_line(exc: _E) -> _E:
    """``exc``, rendered by IPython up to the caller's line (the launcher's frames that
    raised it left out, as for :class:`LaunchError`), whatever its type: for an error of
    the user's (a refused argument) raised as a ``ValueError`` or a ``TypeError``."""
    exc._render_traceback_ = functools.partial(_render_to_caller, exc)  # type: ignore[attr-defined]
    return exc


def interrupted(message: str) -> KeyboardInterrupt:
    """The ``KeyboardInterrupt`` a launch or a session task raises once its ranks stopped
    after an interrupt: ``message`` says so ("interrupted: all 2 ranks stopped").

    A plain ``KeyboardInterrupt`` (``except KeyboardInterrupt`` and ``type(exc)`` work as
    ever) whose IPython rendering ends at the caller's line, as a failure's does: where
    the launcher waited when the interrupt came is machinery, not the user's business."""
    return at_callers_line(KeyboardInterrupt(message))


def _without_trailing_hidden_frames(tb: TracebackType | None) -> TracebackType | None:
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    while len(entries) > 1 and entries[-1].tb_frame.f_locals.get("__tracebackhide__"):
        entries.pop()
    out: TracebackType | None = None
    for entry in reversed(entries):
        out = TracebackType(out, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return out


class PreflightError(LaunchError, ValueError):
    """A problem found before any worker started: nothing was launched."""


class SerializationError(LaunchError, TypeError):
    """Something could not be shipped between the kernel and a worker."""


class LargePayloadWarning(UserWarning):
    """The launched function (with what it captures) is large: every worker gets a copy."""


class DistributedOperationException(RuntimeError):
    """Ranks called a collective with incompatible inputs (shapes, dtypes, order).

    Raised on every rank; the message names each rank's call and call site (cells named
    as IPython names them once the error reaches the notebook)."""

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str):
            args = (name_cells(args[0]), *args[1:])
        super().__init__(*args)


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank: plain data, safe to pickle and to show."""

    rank: int
    kind: str  # "raised" | "died" | "left" | "stopped"
    pid: int | None = None
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None
    signal_name: str | None = None
    collateral: bool = False
    time: float = 0.0
    #: what the launcher knows of a death that the exit code does not say (e.g. "it died
    #: while receiving its task"; "its forkserver process died")
    context: str = ""
    #: the host the rank ran on, for a launch across a cluster's nodes ("" on one machine)
    host: str = ""
    #: False: the rank never started (its node refused it, or was gone first): no process,
    #: no pid, no exit status; ``context`` says why
    started: bool = True

    def describe(self) -> str:
        on = f" on {self.host}" if self.host else ""
        if self.kind == "raised":
            # a collateral error is torch's word on a peer that went away: its first
            # sentence says it (gloo goes on "This is typically caused by... GLHF!")
            message = first_sentence(self.message) if self.collateral else self.message
            return f"rank {self.rank}{on} raised {self.exc_type}: {shorten(message)}"
        if self.kind == "died" and not self.started:
            return f"rank {self.rank}{on} never started: {self.context}"
        if self.kind == "died":
            if self.signal_name:
                how = f"killed by {self.signal_name}({self.exitcode})"
            elif self.exitcode is not None:
                how = f"exit code {self.exitcode}"
            else:  # no process of ours to tell: e.g. a node whose kernel went away
                how = self.context or "no exit status"
            pid = f" (pid {self.pid})" if self.pid is not None else ""
            return f"rank {self.rank}{pid}{on} died: {how}"
        if self.kind == "left":
            waiting = shorten(self.message) or "other ranks still waited for it"
            return f"rank {self.rank} returned while {waiting}"
        return f"rank {self.rank} was stopped by the launcher"


@dataclass
class LaunchFailure:
    """Every rank's record of a failed launch; ``root_cause`` is the rank to look at."""

    root_cause: RankFailure
    failures: list[RankFailure] = field(default_factory=list)
    world_size: int = 0
    #: how each earlier attempt of a launch with ``max_restarts`` ended, oldest first
    restarts: list[str] = field(default_factory=list)

    def _own(self, f: RankFailure) -> bool:
        """A failure of the rank's own: an exception it raised by itself, not the error a
        rank gets when a peer went away (``collateral``)."""
        return (
            f.kind == "raised" and not f.collateral and f.exc_type != "builtins.KeyboardInterrupt"
        )

    @property
    def same_failure(self) -> list[int]:
        """The ranks that raised the root cause's very error (type and message) each on
        its own, the root cause's rank included: one bug met by several ranks."""
        root = self.root_cause
        if not self._own(root):
            return [root.rank]
        same = {
            f.rank
            for f in self.failures
            if self._own(f) and (f.exc_type, f.message) == (root.exc_type, root.message)
        }
        return sorted(same | {root.rank})

    @property
    def independent(self) -> list[RankFailure]:
        """Other errors that ranks raised by themselves (not the root cause's error, not a
        consequence of it): separate failures to look at."""
        same = set(self.same_failure)
        return [
            f
            for f in self.failures
            if f is not self.root_cause and self._own(f) and f.rank not in same
        ]

    @property
    def collateral(self) -> list[RankFailure]:
        """Failures caused by the root cause's: a peer's "connection closed", a rank that
        died with the group. Ranks stopped by the launcher are listed apart."""
        own = set(self.same_failure) | {f.rank for f in self.independent}
        return [
            f
            for f in self.failures
            if f is not self.root_cause
            and f.kind != "stopped"
            and not (self._own(f) and f.rank in own)
        ]

    def summary(self) -> str:
        lines = [f"Root cause: {self.root_cause.describe()}"]
        same = self.same_failure
        if len(same) > 1:
            lines.append(
                f"The same failure on {rank_list(same)}: each raised it on its own (not a "
                "consequence of another rank's failure)."
            )
        independent = self.independent
        if independent:
            lines.append("Also failed, on their own (separate errors, not consequences):")
            lines += [f"  - {f.describe()}" for f in independent]
        others = self.collateral
        if others:
            lines.append("Collateral (a consequence of the root cause, not a separate bug):")
            lines += [f"  - {f.describe()}" for f in others]
        stopped = sorted(f.rank for f in self.failures if f.kind == "stopped")
        if stopped:
            lines.append(f"Stopped by the launcher: ranks {stopped}")
        if self.restarts:
            n = len(self.restarts)
            lines.append(f"Restarted {n} time{'s' if n != 1 else ''} before this attempt:")
            lines += [f"  - attempt {i}: {why}" for i, why in enumerate(self.restarts, 1)]
        return "\n".join(lines)

    @property
    def tracebacks(self) -> dict[int, str]:
        """Every rank that raised -> its traceback, as :meth:`format_traceback` shows it."""
        return {f.rank: self.format_traceback(f.rank) for f in self.failures if f.traceback}

    def format_traceback(self, rank: int | None = None, full: bool = False) -> str:
        """Rank ``rank``'s traceback (default: the root cause's) with notebook cells named
        as IPython names them; runs of library frames (torch, the standard library, this
        launcher) are folded into one line unless ``full``."""
        rank = self.root_cause.rank if rank is None else rank
        records = [f for f in self.failures if f.rank == rank]
        if not records:
            raise KeyError(f"no record of rank {rank} in this launch")
        record = next((f for f in records if f.traceback), records[0])
        if not record.traceback:
            return record.describe()
        return format_remote_traceback(record.traceback, collapse=not full)

    def print_traceback(
        self, rank: int | None = None, full: bool = False, file: TextIO | None = None
    ) -> None:
        """Print rank ``rank``'s traceback (default: the root cause's); see
        :meth:`format_traceback`.

        Example::

            try:
                notebook_launcher(train, num_processes=4)
            except Exception as exc:
                exc.launch_failure.print_traceback(2)   # what rank 2 saw
        """
        print(self.format_traceback(rank, full).rstrip("\n"), file=file or sys.stdout)


def rank_list(ranks: list[int]) -> str:
    """``rank 1``, ``ranks 0 and 1``, ``ranks 0, 1 and 3``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


class RankFailedError(LaunchError):
    """A rank raised an exception that could not be rebuilt in the kernel."""

    def __init__(self, message: str, failure: LaunchFailure | None = None) -> None:
        super().__init__(message)
        self.launch_failure = failure

    def __reduce__(self) -> tuple[type, tuple[str, LaunchFailure | None]]:
        return (type(self), (str(self), self.launch_failure))


class WorkerDied(RankFailedError):
    """A rank's process ended (exit code, signal) without raising an exception."""


class ProcessGroupMismatch(RankFailedError):
    """A rank left the function while other ranks still waited for it in a collective, or
    (in a session) a collective of the whole group was called in a cell that runs on some
    ranks only. The message names the call site."""

    def __init__(self, message: str, failure: LaunchFailure | None = None) -> None:
        super().__init__(name_cells(message), failure)


class RendezvousError(LaunchError):
    """The nodes of a launch across machines could not form one job: a node never joined
    within ``join_timeout`` (the message names it and the rendezvous endpoint), or the
    node holding the rendezvous store went away."""


class SessionBroken(LaunchError):
    """A session's ranks can no longer run cells together (a rank died, or one did not
    stop when asked). ``session.restart()`` (``%dist restart``) brings up fresh ranks."""


class ClusterError(LaunchError):
    """The nodes of a cluster (``SlurmCluster``, ``AgentCluster``) could not be had, or
    were lost: an agent could not join or went away, or the job around them ended. The
    message says which node and why (with what the scheduler says of the job)."""


# --- a rank's traceback as text ------------------------------------------------------------


def notebook_cell_name(filename: str) -> str | None:
    """``/tmp/ipykernel_7/123.py`` -> ``In[2]`` when this process's IPython compiled that
    cell (ranks keep the kernel's file names); None for any other file."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    try:
        shell = ipython.get_ipython()
        named = shell.compile.format_code_name(filename) if shell is not None else None
    except Exception:  # noqa: BLE001 - a nicer name is optional
        return None
    return str(named[1]) if named else None


_LOCATION = re.compile(r"(?P<path>(?:/[^\s:,()'\"]+|<[^\s>]+>)):(?P<line>\d+)")


def name_cells(text: str) -> str:
    """``... at /tmp/ipykernel_7/123.py:14 ...`` -> ``... at Cell In[2], line 14 ...`` for
    every location in ``text`` that this process's IPython knows as a cell."""
    if ":" not in text or "IPython" not in sys.modules:
        return text

    def named(match: re.Match[str]) -> str:
        cell = notebook_cell_name(match.group("path"))
        return f"Cell {cell}, line {match.group('line')}" if cell else match.group(0)

    return _LOCATION.sub(named, text)


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[tuple[str, str], ...]:
    """(directory, dotted prefix) of code that is not the user's, longest first."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    try:
        dirs.update(site.getsitepackages())
        dirs.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site.py
        pass
    roots = [(os.path.normpath(d), "") for d in dirs if d]
    package = os.path.dirname(os.path.abspath(__file__))
    roots.append((package, "notebook_launcher."))
    return tuple(sorted(roots, key=lambda r: -len(r[0])))


def library_module(filename: str) -> str | None:
    """The dotted module of a file in the standard library, an installed package or this
    launcher (``torch.distributed.c10d_logger``); None for the user's own code."""
    if filename.startswith("<frozen ") and filename.endswith(">"):
        return filename[len("<frozen ") : -1]
    for root, prefix in _library_roots():
        if filename.startswith(root + os.sep):
            rel = os.path.splitext(filename[len(root) + 1 :])[0]
            return prefix + rel.replace(os.sep, ".").removesuffix(".__init__")
    return None


_FRAME_LINE = re.compile(r'^  File "([^"]+)", line (\d+)(.*)$')


def _common_package(modules: list[str]) -> str:
    parts = [m.split(".")[:2] for m in modules]
    common = parts[0]
    for p in parts[1:]:
        n = 0
        while n < min(len(common), len(p)) and common[n] == p[n]:
            n += 1
        common = common[:n]
    if common:
        return ".".join(common)
    return ", ".join(dict.fromkeys(p[0] for p in parts))


def format_remote_traceback(traceback: str, collapse: bool = True) -> str:
    """A rank's traceback (the standard format) as the notebook user reads it: cells named
    as IPython names them (``Cell In[2], line 7, in train``), and -- when ``collapse`` --
    each run of library frames folded into one line
    (``[... 3 frames in torch.distributed]``). The frame where the error was raised and the
    error line itself always stay. A frame without its source line (a rank on another node,
    or one started before the cell was run, has no copy of the cell) gets it from this
    process's ``linecache``, as IPython shows the rebuilt exception's frames."""
    out: list[str] = []
    #: the frames of the current traceback section: (library module or None, lines)
    frames: list[tuple[str | None, list[str]]] = []

    def flush() -> None:
        run: list[str] = []
        for i, (module, lines) in enumerate(frames):
            if collapse and module is not None and i < len(frames) - 1:
                run.append(module)
                continue
            if run:
                n = len(run)
                out.append(f"  [... {n} frame{'s' if n > 1 else ''} in {_common_package(run)}]\n")
                run = []
            out.extend(lines)
        frames.clear()

    lines = traceback.splitlines(keepends=True)
    for i, line in enumerate(lines):
        match = _FRAME_LINE.match(line)
        if match:
            filename, lineno, rest = match.groups()
            cell = notebook_cell_name(filename)
            if cell is not None:
                line = f"  Cell {cell}, line {lineno}{rest}" + ("\n" if line.endswith("\n") else "")
            frame = [line]
            following = lines[i + 1] if i + 1 < len(lines) else ""
            if line.endswith("\n") and not following.startswith("    "):  # no source with it
                source = linecache.getline(filename, int(lineno)).strip()
                if source:
                    frame.append(f"    {source}\n")
            frames.append((None if cell else library_module(filename), frame))
        elif frames and line.startswith("    "):
            frames[-1][1].append(line)  # the frame's source line, its carets
        else:
            flush()
            out.append(line)
    flush()
    return "".join(out)


def signal_name(returncode: int | None) -> str | None:
    """``-9`` -> ``"SIGKILL"``; ``None`` for normal exit codes."""
    import signal

    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


__all__ = [
    "DistributedOperationException",
    "LaunchError",
    "LaunchFailure",
    "LargePayloadWarning",
    "PreflightError",
    "ProcessGroupMismatch",
    "RankFailedError",
    "RankFailure",
    "RendezvousError",
    "format_remote_traceback",
    "at_callers_line",
    "first_sentence",
    "interrupted",
    "rank_list",
    "library_module",
    "name_cells",
    "notebook_cell_name",
    "shorten",
    "SerializationError",
    "SessionBroken",
    "WorkerDied",
    "signal_name",
]
