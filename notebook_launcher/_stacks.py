"""Where each rank is: its Python stacks, read, compared and put into words (pure).

A rank's fault handler dumps every Python thread's stack when the kernel asks
(``_worker.stacks``; ``_launch.stall`` asks and reads). This module turns such a dump into
:class:`~notebook_launcher._events.ThreadStack` data (:func:`parse_dump`), finds where
each rank is -- its innermost frame of the user's code, and what it waits in there --
and names the rank(s) whose place differs from the others' (:func:`findings`)::

    rank 1 is in `loss.backward()` at Cell In[3], line 9; ranks 0, 2, 3 wait in
    `all_reduce` at line 12

:func:`format_report` writes a whole report as text (the text view, the note on a
``KeyboardInterrupt``, ``stacks()``), each thread folded the way a rank's traceback is
(:func:`notebook_launcher.errors.format_remote_traceback`: cells as ``Cell In[3], line 12``
with their source line, runs of library frames in one line). The dashboard draws the same
data side by side (``ui.html``). No torch, no widgets: plain data in, text out.
"""

from __future__ import annotations

import linecache
import os
import re
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ._events import RankStacks, StackFrame, StacksTaken, ThreadStack
from .errors import format_remote_traceback, library_module, notebook_cell_name

#: The signal that asks a rank for its stacks (``_worker.stacks`` catches it, ``_launch.stall``
#: sends it): a real-time signal no library we know uses (SIGUSR1 is a common choice of
#: training scripts, Slurm and Lightning). Its default action would end the process, so the
#: kernel sends it only to processes that have a dump file open (their handler is in place).
#: (Not Linux: no real-time signals, and no rank starts there, ``preflight.check_platform``;
#: a stand-in keeps the import working.)
STACK_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2
#: The start of a dump file's name (then the main thread's id in hex, then the pid).
FILE_PREFIX = "notebook_launcher-stacks-"
#: The start of the names of the flight recorder's request pipe and answer file.
FLIGHT_PREFIX = "notebook_launcher-flight-"
#: The start of the names of a rank's stack helper's request pipe and answer file (its
#: stacks read from Python, without a signal: ``_worker.stacks``).
PYSTACKS_PREFIX = "notebook_launcher-pystacks-"
#: The last line of the helper's answer.
PYSTACKS_END = "# end of stacks"

#: torch.distributed's blocking collectives that need every rank of their group (the rank
#: side wraps these, ``_worker.collectives``; a stack in one of them "waits in" it).
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "monitored_barrier",
)
#: What a rank can be said to *wait in*: those, point-to-point calls, and this package's API,
#: when one of them is called from the user's innermost frame.
WAIT_CALLS = frozenset(
    {
        *COLLECTIVES,
        "all_gather_single",
        "send",
        "recv",
        "wait",
        "pad_across_processes",
        "wait_for_everyone",
        "init_process_group",
        "new_group",
    }
)
#: Modules whose functions of those names are collectives (not a user's ``gather``).
_WAIT_MODULES = ("torch.distributed", "notebook_launcher", "accelerate")
#: This package's own machinery: never where a rank "is".
_MACHINERY = "notebook_launcher._worker"
#: ... except for its wrappers of torch's collectives, whose frames have their names.
_WRAPPERS = "notebook_launcher._worker.collectives"

_HEADER = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+|\?\?\?) in (.*)$')


# --- a dump -------------------------------------------------------------------------------


def parse_dump(text: str, main_ident: str | None = None) -> tuple[ThreadStack, ...]:
    """The threads of a ``faulthandler`` dump (``all_threads=True``), frames outermost
    first, source lines read here (``linecache``: the kernel knows the notebook's cells);
    ``main_ident`` (``0x...``) marks the main thread, which comes first."""
    threads: list[ThreadStack] = []
    ident: str | None = None
    frames: list[StackFrame] = []
    cut = False

    def close() -> None:
        if ident is not None:
            main = main_ident is not None and int(ident, 16) == int(main_ident, 16)
            threads.append(ThreadStack(ident, tuple(reversed(frames)), main, cut))

    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            close()
            ident, frames, cut = header.group(1), [], False
            continue
        if line.strip() == "..." and ident is not None:
            cut = True
            continue
        frame = _FRAME.match(line)
        if frame and ident is not None:
            filename, lineno, function = frame.groups()
            number = int(lineno) if lineno.isdigit() else 0
            frames.append(StackFrame(filename, number, function, _source(filename, number)))
    close()
    threads.sort(key=lambda t: not t.main)
    return tuple(threads)


def _source(filename: str, lineno: int) -> str:
    if lineno <= 0:
        return ""
    try:
        return linecache.getline(filename, lineno).strip()
    except Exception:  # noqa: BLE001 - a source line is a nicety
        return ""


def own_frames(thread: ThreadStack) -> ThreadStack:
    """The frames that are the process's own: a rank's main thread starts below the rank's
    entry and the session's loop (a forked rank also has the kernel's frames above them;
    the user's code comes first then), a forked child (a DataLoader worker) below
    ``multiprocessing``'s bootstrap."""
    frames = thread.frames
    cut = -1
    for i, f in enumerate(frames):
        module = _module(f) or ""
        if module == "notebook_launcher._worker.entry" or (
            module == "multiprocessing.process" and f.function == "_bootstrap"
        ):
            cut = i
    if cut < 0:
        return thread
    rest = list(frames[cut + 1 :])
    while len(rest) > 1 and (_module(rest[0]) or "").startswith(_MACHINERY):
        rest.pop(0)
    return ThreadStack(thread.ident, tuple(rest), thread.main, thread.truncated)


# --- where a rank is ----------------------------------------------------------------------


def _module(frame: StackFrame) -> str | None:
    return library_module(frame.filename)


def is_users(frame: StackFrame) -> bool:
    """A frame of the user's code (a cell, a script), not of a library or of Python."""
    return _module(frame) is None and not frame.filename.startswith("<frozen")


def is_machinery(thread: ThreadStack) -> bool:
    """One of this package's own threads (barrier watchdog, progress flusher, ...)."""
    modules = [_module(f) or "" for f in thread.frames]
    ours = [m for m in modules if m.startswith("notebook_launcher.")]
    return (
        bool(ours)
        and not thread.main
        and all(m.startswith(("notebook_launcher.", "threading")) for m in modules)
    )


def is_idle(thread: ThreadStack) -> bool:
    """A session's rank between tasks: its main thread waits for the next one."""
    functions = {(_module(f), f.function) for f in thread.frames}
    return ("notebook_launcher._worker.session", "serve") in functions and (
        "notebook_launcher._worker.session",
        "_run_task",
    ) not in functions


def location(frame: StackFrame) -> str:
    """``Cell In[3], line 12`` for a notebook cell, ``train.py:12`` for a file."""
    cell = notebook_cell_name(frame.filename)
    if cell is not None:
        return f"Cell {cell}, line {frame.lineno}"
    return f"{os.path.basename(frame.filename)}:{frame.lineno}"


@dataclass(frozen=True)
class Place:
    """Where one rank is: ``key`` groups the ranks at the same place; ``waits`` when it
    waits in a collective (then ``what`` is its name), else ``what`` is the user's line."""

    key: tuple[object, ...]
    what: str
    waits: bool
    frame: StackFrame | None = None
    note: str = ""  # "idle", "did not answer", ... when there is no frame to point at


def place_of(stacks: RankStacks) -> Place:
    """Where the rank's main thread is (see :class:`Place`)."""
    if stacks.error:
        return Place(("error", stacks.error), stacks.error, False, note=stacks.error)
    main = next(
        (t for t in stacks.threads if t.main), stacks.threads[0] if stacks.threads else None
    )
    if main is None or not main.frames:
        return Place(("empty",), "no Python frame", False, note="has no Python frame")
    if stacks.idle or is_idle(main):
        return Place(("idle",), "idle", False, note="is idle (waits for the next task)")
    frames = main.frames
    users = [i for i, f in enumerate(frames) if is_users(f)]
    if not users:  # still starting, or in library code only: name the innermost call
        inner = frames[-1]
        called = _waited_call(frames)
        if called:
            return Place(("lib", called), called, True, inner)
        imported = _importing(frames)
        if imported:
            return Place(("import", imported), f"import {imported}", False, inner)
        return Place(("lib", inner.filename, inner.lineno), f"{inner.function}()", False, inner)
    at = users[-1]
    frame = frames[at]
    called = _waited_call(frames[at + 1 :])
    if called:
        return Place((frame.filename, frame.lineno, called), called, True, frame)
    imported = _importing(frames[at + 1 :])
    what = f"import {imported}" if imported else frame.source or f"{frame.function}()"
    if len(what) > 60:
        what = what[:57] + "..."
    return Place((frame.filename, frame.lineno), what, False, frame)


def _importing(frames: Sequence[StackFrame]) -> str:
    """The module being imported, when a run of library frames is an import: the outermost
    module whose top level runs under ``importlib``."""
    if not any((_module(f) or "").startswith("importlib") for f in frames):
        return ""
    for frame in frames:
        module = _module(frame)
        if frame.function == "<module>" and module and not module.startswith("importlib"):
            return module
    return ""


def _waited_call(frames: Sequence[StackFrame]) -> str:
    """The collective a run of library frames (outermost first) is in: the outermost frame
    of torch.distributed, accelerate or this package's API with a known name."""
    for frame in frames:
        module = _module(frame)
        if module is None or (module.startswith(_MACHINERY) and module != _WRAPPERS):
            continue
        if frame.function in WAIT_CALLS and module.startswith(_WAIT_MODULES):
            return frame.function
    return ""


def rank_list(ranks: Sequence[int]) -> str:
    """``rank 1``, ``ranks 0, 2, 3``, ``ranks 0-6``."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 3 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def findings(ranks: Iterable[RankStacks]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Sentences that say where the ranks are, the odd one(s) out first, and the odd ranks.

    The odd ranks: when some ranks wait in a collective and others do not, those that do
    not (the others wait for them); when all wait, but in different collectives or places,
    the ranks outside the largest group (a mismatch); when none wait, the ranks outside
    the largest group, if there is one."""
    places = {r.rank: place_of(r) for r in ranks}
    groups: dict[tuple[object, ...], list[int]] = {}
    for rank, place in sorted(places.items()):
        groups.setdefault(place.key, []).append(rank)
    if not groups:
        return (), ()
    if len(groups) == 1:
        ((key, members),) = groups.items()
        place = places[members[0]]
        who = "every rank" if len(members) > 1 else rank_list(members)
        return (_sentence(who, place, True if len(members) == 1 else None),), ()
    waiting = [k for k, m in groups.items() if places[m[0]].waits]
    busy = [k for k, m in groups.items() if not places[m[0]].waits and places[m[0]].note == ""]
    others = [k for k in groups if k not in waiting and k not in busy]
    biggest = max(len(m) for m in groups.values())
    largest = [k for k, m in groups.items() if len(m) == biggest]
    if waiting and busy:
        odd_keys = busy
    elif waiting and others and not busy:
        odd_keys = others
    elif len(largest) == 1:
        odd_keys = [k for k in groups if k != largest[0]]
    else:
        odd_keys = []
    order = odd_keys + [k for k in groups if k not in odd_keys]
    sentences: list[str] = []
    last_file: str | None = None
    parts = []
    for key in order:
        members = groups[key]
        place = places[members[0]]
        parts.append(_sentence(rank_list(members), place, len(members) == 1, last_file))
        if place.frame is not None:
            last_file = place.frame.filename
    sentences.append("; ".join(parts))
    odd = tuple(sorted(r for k in odd_keys for r in groups[k]))
    return tuple(sentences), odd


_PLURAL = {"is": "are", "has": "have", "was": "were"}


def _sentence(who: str, place: Place, one: bool | None, last_file: str | None = None) -> str:
    """``rank 1 is in `x` at Cell In[3], line 9`` (``one``: singular verb; None: "every
    rank", singular too). ``at line 12`` when the file is the one named just before."""
    singular = one is None or one
    if place.note:  # a predicate: "is idle (...)", "did not answer ...", "has ended"
        verb, _, rest = place.note.partition(" ")
        verb = verb if singular else _PLURAL.get(verb, verb)
        return f"{who} {verb} {rest}".rstrip()
    where = ""
    if place.frame is not None:
        if last_file is not None and place.frame.filename == last_file:
            where = f" at line {place.frame.lineno}"
        else:
            where = f" at {location(place.frame)}"
    if place.waits:
        verb = "waits" if singular else "wait"
        return f"{who} {verb} in `{place.what}`{where}"
    verb = "is" if singular else "are"
    return f"{who} {verb} in `{place.what}`{where}"


# --- as text --------------------------------------------------------------------------------


def thread_label(thread: ThreadStack) -> str:
    """``main thread``, or ``thread 0x7f..66c0 (loader_loop)`` named by its target."""
    if thread.main:
        return "main thread"
    target = ""
    for i, frame in enumerate(thread.frames):
        if _module(frame) == "threading" and frame.function == "run":
            if i + 1 < len(thread.frames):
                target = thread.frames[i + 1].function
            break
    if not target and thread.frames:
        target = next((f.function for f in thread.frames if _module(f) != "threading"), "")
    return f"thread {thread.ident}" + (f" ({target})" if target else "")


def traceback_text(frames: Sequence[StackFrame]) -> str:
    """Frames in the standard traceback format (most recent call last)."""
    out = []
    for f in frames:
        out.append(f'  File "{f.filename}", line {f.lineno}, in {f.function}\n')
        if f.source:
            out.append(f"    {f.source}\n")
    return "".join(out)


#: Frames a fault handler dumps of one thread at most (the outermost are left out).
MAX_DUMPED_FRAMES = 100


def format_thread(thread: ThreadStack, collapse: bool = True) -> str:
    """One thread's stack as a rank's traceback is shown: cells named, library folded."""
    if not thread.frames:
        return "  <no Python frame>\n"
    frames, inner = list(thread.frames), 0
    while collapse and len(frames) > 1 and (_module(frames[-1]) or "").startswith(_MACHINERY):
        frames.pop()  # the package's own innermost frames (a collective's check, a wrapper)
        inner += 1
    text = format_remote_traceback(traceback_text(frames), collapse=collapse)
    if inner:
        text += f"  [... {inner} frame{'s' if inner > 1 else ''} in notebook_launcher]\n"
    if thread.truncated:
        text = f"  [deeper than {MAX_DUMPED_FRAMES} frames: the outermost are not shown]\n" + text
    return text


def shown_threads(stacks: RankStacks) -> tuple[list[ThreadStack], int]:
    """The threads worth showing (the main thread, then the user's, then libraries'), and
    how many of this package's own threads were left out."""
    mine = [t for t in stacks.threads if is_machinery(t)]
    rest = [t for t in stacks.threads if not is_machinery(t)]
    rest.sort(key=lambda t: (not t.main, not any(is_users(f) for f in t.frames)))
    return rest, len(mine)


def signature(stacks: RankStacks) -> tuple[object, ...]:
    """Ranks with equal signatures show the same stacks (shown once, for all of them)."""
    threads, _ = shown_threads(stacks)
    return (
        stacks.error,
        stacks.idle,
        tuple(tuple((f.filename, f.lineno, f.function) for f in t.frames) for t in threads),
        tuple(
            (tuple((f.filename, f.lineno, f.function) for t in ts for f in t.frames))
            for _, ts in stacks.children
        ),
    )


def same_stacks(ranks: Iterable[RankStacks]) -> list[list[RankStacks]]:
    """The ranks grouped by equal stacks, in rank order of each group's first rank."""
    groups: dict[tuple[object, ...], list[RankStacks]] = {}
    for r in sorted(ranks, key=lambda r: r.rank):
        groups.setdefault(signature(r), []).append(r)
    return list(groups.values())


def format_rank(stacks: RankStacks, collapse: bool = True) -> str:
    """Every thread of one rank (and of its child processes), as text."""
    if stacks.error:
        return f"  (rank {stacks.rank} {stacks.error})\n"
    out = []
    threads, hidden = shown_threads(stacks)
    for thread in threads:
        label = thread_label(thread)
        if thread.main and (stacks.idle or is_idle(thread)):  # its frames are ours alone
            out.append(f" {label}: idle, waits for the next task\n")
            continue
        out.append(f" {label}:\n")
        out.append(format_thread(thread, collapse))
    for pid, child in stacks.children:
        for thread in child:
            out.append(f" child process {pid}, {thread_label(thread)}:\n")
            out.append(format_thread(thread, collapse))
    if hidden:
        out.append(
            f" ({hidden} thread{'s' if hidden > 1 else ''} of notebook_launcher not shown)\n"
        )
    return "".join(out)


def all_idle(report: StacksTaken) -> bool:
    """Whether every rank of the report is a session's rank between tasks: nothing to look
    at, said in one quiet line (its finding: ``every rank is idle (waits for the next
    task)``) rather than as a stall."""
    return bool(report.ranks) and all(place_of(r).key == ("idle",) for r in report.ranks)


def headline(report: StacksTaken) -> str:
    """What the report is, in one line."""
    if report.reason == "stall":
        return f"no rank made progress for {_seconds(report.quiet)}; where each rank is:"
    if report.reason == "interrupt":
        return "where each rank was when it was interrupted:"
    return "where each rank is:"


def _seconds(s: float) -> str:
    return f"{s:.0f}s" if s >= 10 else f"{s:.1f}s"


def format_report(report: StacksTaken, collapse: bool = True) -> str:
    """The whole report as text: the headline, the findings, then the stacks of each group
    of ranks whose stacks are the same. Every rank idle: one line that says so."""
    if all_idle(report):
        return "".join(f"{f}\n" for f in report.findings)
    lines = [headline(report) + "\n"]
    lines += [f"  {f}\n" for f in report.findings]
    lines += [f"  rank {rank} flight recorder: {text}\n" for rank, text in report.flight]
    for group in same_stacks(report.ranks):
        ranks = [r.rank for r in group]
        pids = ", ".join(str(r.pid) for r in group)
        same = " (the same stacks)" if len(group) > 1 else ""
        odd = " <- the odd one out" if set(ranks) & set(report.odd) else ""
        lines.append(f"--- {rank_list(ranks)} (pid {pids}){same}{odd}\n")
        lines.append(format_rank(group[0], collapse))
    return "".join(lines)


__all__ = [
    "COLLECTIVES",
    "FILE_PREFIX",
    "FLIGHT_PREFIX",
    "PYSTACKS_END",
    "PYSTACKS_PREFIX",
    "STACK_SIGNAL",
    "WAIT_CALLS",
    "Place",
    "all_idle",
    "findings",
    "format_rank",
    "format_report",
    "format_thread",
    "headline",
    "is_idle",
    "is_machinery",
    "is_users",
    "location",
    "own_frames",
    "parse_dump",
    "place_of",
    "rank_list",
    "same_stacks",
    "shown_threads",
    "signature",
    "thread_label",
    "traceback_text",
]
