"""Where every rank is when nothing moves: the stall watch and the stacks it takes (kernel side).

:func:`take` asks ranks for their stacks and reads them: it finds each rank's files among
its open files (``/proc/<pid>/fd``; ``_worker.stacks`` made them) and asks its helper
thread through its pipe -- no signal: a signal would cut short the sleep or wait the rank
is in -- and reads every thread's stack from its answer. A rank whose helper does not
answer within :data:`HELPER_WAIT` (a C extension holds the GIL) is sent
:data:`~notebook_launcher._worker.stacks.STACK_SIGNAL`, as are the Python processes a rank
started (a DataLoader's workers), and what their fault handlers wrote is read: all of them
at once, in a few milliseconds, whether a rank runs Python or waits in C++.
With torch's flight recorder on (``TORCH_FR_BUFFER_SIZE``; on NCCL ranks by default) each
rank's last collectives are read too (``_worker.stacks``' helper thread answers).

:class:`StallWatch` is what a launch (or a session's task) feeds and ticks::

    pump loop                              StallWatch
      every event, every output line  -->  saw(event): the ranks made progress
      group.pump(watch.timeout(0.5))       (wakes the pump when the stall is due)
      watch.tick()                    -->  no progress for ``stall_after`` s: take(),
                                           show(StacksTaken("stall")); again every
                                           REFRESH s while it lasts; the next progress:
                                           show(StallOver)
      Ctrl-C / cancel()               -->  on_interrupt(): the stacks, if it was stuck

The views draw :class:`~notebook_launcher._events.StacksTaken`;
:func:`notebook_launcher._stacks.format_report` writes it as text.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .. import _stacks
from .._events import Event, RankStacks, StacksTaken, StallOver, ThreadStack
from .._posix import descendants
from .._stacks import FILE_PREFIX, FLIGHT_PREFIX, PYSTACKS_END, PYSTACKS_PREFIX, STACK_SIGNAL

#: Default seconds without progress before the stall view shows (launch and session option).
DEFAULT_STALL_AFTER = 30.0
#: Seconds between two looks while a stall lasts.
REFRESH = 5.0
#: How long the kernel waits for the ranks' dumps, at most.
ANSWER_TIMEOUT = 0.5
#: How long a rank's helper thread has to answer before the rank is sent the signal.
HELPER_WAIT = 0.25
#: A dump is complete once it has not grown for this long.
SETTLE = 0.01
#: An interrupt attaches where each rank was when they had been quiet this long.
INTERRUPT_QUIET = 1.0
#: The most bytes read of one dump.
MAX_DUMP = 1 << 20

_lock = threading.Lock()
Procs = Callable[[], Mapping[int, tuple[int, int | None]]]
#: What a rank without stacks is (predicates of a sentence: "rank 1 is starting ...").
STARTING = "is starting (no stacks yet)"
ENDED = "has ended"


def check_stall_after(value: Any) -> float | None:
    """``stall_after``: seconds (> 0) or None (no stall view)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        from ..errors import PreflightError

        raise PreflightError(
            f"stall_after must be a number of seconds > 0, or None to turn the stall view "
            f"off; got {value!r}"
        )
    return float(value)


# --- reading stacks ---------------------------------------------------------------------------


@dataclass
class _Dump:
    rank: int
    pid: int
    fd: int
    main: str  # the main thread's id, 0x...
    data: bytes = b""
    settled_at: float | None = None
    done: bool = False
    pidfd: int | None = None
    #: the helper thread's answer file, while its answer is awaited (no signal sent)
    helper: int | None = None


def _find(pid: int, prefix: str) -> tuple[str, str] | None:
    """(``/proc/pid/fd/n``, what follows the prefix in the file's name) for the open file of
    ``pid`` whose name starts with ``prefix``; None if it has none (or is gone)."""
    base = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(base)
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"{base}/{fd}")
        except OSError:
            continue
        name = os.path.basename(target).removeprefix("memfd:")  # (a memory file's link)
        if name.startswith(prefix):
            return f"{base}/{fd}", name[len(prefix) :].split(" ")[0]
    return None


def _catches(pid: int, sig: int) -> bool:
    """Whether ``pid`` has a handler for ``sig`` (``SigCgt`` in /proc/pid/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _open(rank: int, pid: int) -> _Dump | None:
    found = _find(pid, FILE_PREFIX)
    if found is None or not _catches(pid, STACK_SIGNAL):
        return None
    path, rest = found
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    main = "0x" + rest.split("-", 1)[0]
    return _Dump(rank, pid, fd, main)


def ask_through_pipe(pid: int, prefix: str) -> int | None:
    """Ask a rank's helper thread (``_worker.stacks._serve_requests``) through its request
    pipe: the emptied answer file's fd, to read once it has answered; None if the rank has
    no such helper (or it is gone)."""
    answer = _find(pid, f"{prefix}out-")
    if answer is None:
        return None
    try:  # its name: out-<pid>-<the pipe's fd>-<the pipe's inode>
        _, pipe_fd, inode = answer[1].split("-")
        pipe = f"/proc/{pid}/fd/{int(pipe_fd)}"
        if os.readlink(pipe) != f"pipe:[{int(inode)}]":
            return None  # (not the rank's pipe: an fd it closed, and reused)
        fd = os.open(answer[0], os.O_RDWR | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        os.ftruncate(fd, 0)
        w = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.write(w, b"?")
        finally:
            os.close(w)
    except OSError:
        os.close(fd)
        return None
    return fd


def _ask_helper(dump: _Dump) -> bool:
    """Ask the rank's helper thread for its stacks (no signal); False if it has none."""
    fd = ask_through_pipe(dump.pid, PYSTACKS_PREFIX)
    if fd is None:
        return False
    dump.helper = fd
    return True


def _helper_answer(dump: _Dump) -> bytes | None:
    """The helper's whole answer, or None while it is not complete."""
    assert dump.helper is not None
    try:
        size = min(os.fstat(dump.helper).st_size, MAX_DUMP)
        data = os.pread(dump.helper, size, 0) if size else b""
    except OSError:
        return None
    return data if data.endswith(PYSTACKS_END.encode() + b"\n") else None


def _drop_helper(dump: _Dump) -> None:
    if dump.helper is not None:
        try:
            os.close(dump.helper)
        except OSError:
            pass
        dump.helper = None


def _signal(dump: _Dump, pidfd: int | None) -> bool:
    try:
        os.ftruncate(dump.fd, 0)
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, STACK_SIGNAL)
        else:
            os.kill(dump.pid, STACK_SIGNAL)
    except OSError:  # gone meanwhile
        return False
    return True


def _read(dump: _Dump) -> bytes:
    try:
        size = min(os.fstat(dump.fd).st_size, MAX_DUMP)
        return os.pread(dump.fd, size, 0) if size else b""
    except OSError:
        return b""


def _complete(data: bytes) -> bool:
    return data.endswith(b"\n") and b"(most recent call first)" in data


def take(
    procs: Mapping[int, tuple[int, int | None]],
    timeout: float = ANSWER_TIMEOUT,
    children: bool = True,
) -> tuple[RankStacks, ...]:
    """Every rank's stacks: ``procs`` maps rank -> (pid, pidfd or None). Ranks (and the
    Python processes they started) are asked at once and read as they answer; a rank that
    does not answer within ``timeout`` seconds is reported as such."""
    with _lock:
        return _take(procs, timeout, children)


def _take(
    procs: Mapping[int, tuple[int, int | None]], timeout: float, children: bool
) -> tuple[RankStacks, ...]:
    dumps: list[_Dump] = []
    missing: dict[int, str] = {}
    kids: dict[int, list[_Dump]] = {}
    try:
        for rank, (pid, pidfd) in sorted(procs.items()):
            dump = _open(rank, pid)
            if dump is None:
                alive = os.path.exists(f"/proc/{pid}")
                missing[rank] = STARTING if alive else ENDED
                continue
            dump.pidfd = pidfd
            dumps.append(dump)
            if not _ask_helper(dump) and not _signal(dump, pidfd):
                missing[rank] = ENDED
            if children:
                for child, _ in descendants(pid):
                    kid = _open(rank, child)
                    if kid is not None:
                        kids.setdefault(rank, []).append(kid)
                        _signal(kid, None)
        everything = [*dumps, *(k for ks in kids.values() for k in ks)]
        start = time.monotonic()
        deadline = start + timeout
        helper_deadline = start + min(HELPER_WAIT, timeout / 2)
        while True:
            now = time.monotonic()
            pending = [d for d in everything if not d.done]
            if not pending or now >= deadline:
                break
            if now >= helper_deadline:  # no answer from Python: the fault handler's, then
                for d in pending:
                    if d.helper is not None:
                        _drop_helper(d)
                        _signal(d, d.pidfd)
            time.sleep(0.002)
            now = time.monotonic()
            for d in pending:
                if d.helper is not None:
                    answer = _helper_answer(d)
                    if answer is not None:
                        d.data, d.done = answer, True
                    continue
                data = _read(d)
                if data != d.data or not _complete(data):
                    d.data, d.settled_at = data, now
                elif d.settled_at is not None and now - d.settled_at >= SETTLE:
                    d.done = True
        out = []
        for rank, (pid, _) in sorted(procs.items()):
            if rank in missing:
                out.append(RankStacks(rank, pid, error=missing[rank]))
                continue
            dump = next(d for d in dumps if d.rank == rank)
            text = dump.data.decode("utf-8", "replace")
            if not text.strip():
                why = f"did not answer within {timeout:g}s (stopped, or stuck in the OS kernel)"
                out.append(RankStacks(rank, pid, error=why))
                continue
            threads = _stacks.parse_dump(text, dump.main)
            child_stacks = tuple(
                (k.pid, _own(_stacks.parse_dump(k.data.decode("utf-8", "replace"), k.main)))
                for k in kids.get(rank, [])
                if k.data.strip()
            )
            main = next((t for t in threads if t.main), None)
            idle = main is not None and _stacks.is_idle(main)
            out.append(RankStacks(rank, pid, _own(threads), child_stacks, idle=idle))
        return tuple(out)
    finally:
        for d in [*dumps, *(k for ks in kids.values() for k in ks)]:
            _drop_helper(d)
            try:
                os.close(d.fd)
            except OSError:
                pass


def _own(threads: tuple[ThreadStack, ...]) -> tuple[ThreadStack, ...]:
    return tuple(_stacks.own_frames(t) for t in threads)


Taken = tuple[tuple[RankStacks, ...], tuple[tuple[int, str], ...]]


class Ranks(Protocol):
    """Ranks whose stacks can be taken: this machine's (:class:`LocalRanks`), or a cluster's
    (``_launch.remote.RemoteGroup.stall_ranks``: each node's agent takes its own)."""

    def alive(self) -> bool:
        """Whether any of them runs."""
        ...

    def take(self, timeout: float) -> Taken:
        """Their stacks, and one line per rank of what its flight recorder last saw."""
        ...


class LocalRanks:
    """Ranks of this machine, by pid: ``procs()`` maps rank -> (pid, pidfd or None)."""

    def __init__(self, procs: Procs) -> None:
        self.procs = procs

    def alive(self) -> bool:
        return bool(self.procs())

    def take(self, timeout: float) -> Taken:
        procs = self.procs()
        flight = tuple((rank, line) for rank, line in flight_lines(procs, timeout) if line)
        return take(procs, timeout), flight


def report(
    ranks: Ranks | Mapping[int, tuple[int, int | None]],
    reason: str,
    quiet: float = 0.0,
    timeout: float = ANSWER_TIMEOUT,
) -> StacksTaken:
    """Take the stacks of ``ranks`` (or of a mapping rank -> (pid, pidfd)) and say where
    the ranks are (a :class:`StacksTaken`)."""
    source = _as_ranks(ranks)
    stacks, flight = source.take(timeout)
    findings, odd = _stacks.findings(stacks)
    hint = nccl_hint(flight)
    if hint:
        findings = (*findings, hint)
    return StacksTaken(reason, quiet, stacks, findings, odd, time.time(), flight)


#: What to try when every rank waits inside the same NCCL collective.
NCCL_HINT = (
    "every rank is inside the same NCCL collective ({what}), none behind: NCCL's own "
    "transfer is stuck. On consumer, PCIe-only or virtualised GPUs peer-to-peer copies can "
    "hang: try NCCL_P2P_DISABLE=1 (os.environ before launching: the ranks inherit it); "
    "NCCL_DEBUG=INFO makes the ranks say which transport they use."
)


def nccl_hint(flight: Sequence[tuple[int, str]]) -> str | None:
    """The hint for a hang inside NCCL: every rank's flight recorder at the same
    collective, started and not completed, nobody behind; None otherwise."""
    lines = [line for _, line in flight]
    if len(lines) < 2 or any("behind" in line or "(completed)" in line for line in lines):
        return None
    places = {line.split(" (")[0] for line in lines}
    if len(places) != 1 or not lines[0].startswith("last collective #"):
        return None
    return NCCL_HINT.format(what=places.pop().removeprefix("last collective "))


def _as_ranks(ranks: Any) -> Ranks:
    if hasattr(ranks, "take") and hasattr(ranks, "alive"):
        return ranks
    if callable(ranks):
        return LocalRanks(ranks)
    fixed = dict(ranks)
    return LocalRanks(lambda: fixed)


# --- the flight recorder ----------------------------------------------------------------------


def flight_lines(
    procs: Mapping[int, tuple[int, int | None]], timeout: float = ANSWER_TIMEOUT
) -> list[tuple[int, str]]:
    """One line per rank of what its flight recorder last saw, the rank(s) behind named;
    empty when no rank records (``TORCH_FR_BUFFER_SIZE`` unset on gloo)."""
    summaries = read_flight(procs, timeout)
    return flight_findings(summaries)


def read_flight(
    procs: Mapping[int, tuple[int, int | None]], timeout: float = ANSWER_TIMEOUT
) -> dict[int, list[dict[str, Any]]]:
    """rank -> its flight recorder's last entries (``_worker.stacks`` writes them when
    asked through its request pipe); ranks without a recorder are left out."""
    asked: dict[int, tuple[int, int]] = {}
    out: dict[int, list[dict[str, Any]]] = {}
    try:
        for rank, (pid, _) in procs.items():
            fd = ask_through_pipe(pid, FLIGHT_PREFIX)
            if fd is None:
                continue
            asked[rank] = (pid, fd)
        deadline = time.monotonic() + timeout
        while asked.keys() - out.keys() and time.monotonic() < deadline:
            time.sleep(0.005)
            for rank, (_, fd) in asked.items():
                if rank in out:
                    continue
                size = os.fstat(fd).st_size
                data = os.pread(fd, size, 0) if size else b""
                if data.endswith(b"\n"):
                    try:
                        out[rank] = json.loads(data)
                    except ValueError:
                        out[rank] = []
    finally:
        for _, fd in asked.values():
            try:
                os.close(fd)
            except OSError:
                pass
    return out


def flight_findings(summaries: Mapping[int, list[dict[str, Any]]]) -> list[tuple[int, str]]:
    """``(rank, "last collective #12 all_reduce [4] (started, not completed)")`` for each
    rank, with "behind" on the rank(s) whose last collective comes before the others'."""
    last: dict[int, dict[str, Any]] = {}
    for rank, entries in summaries.items():
        collectives = [e for e in entries if not e.get("is_p2p")]
        if collectives:
            last[rank] = max(collectives, key=lambda e: e.get("collective_seq_id", 0))
    if not last:
        return []
    newest = max(e.get("collective_seq_id", 0) for e in last.values())
    lines = []
    for rank in sorted(summaries):
        entry = last.get(rank)
        if entry is None:
            lines.append((rank, "no collective recorded"))
            continue
        seq = entry.get("collective_seq_id", 0)
        name = str(entry.get("profiling_name", "?")).split(":")[-1]
        sizes = entry.get("input_sizes") or []
        shape = " ".join(str(list(s)) for s in sizes[:3])
        state = entry.get("state", "")
        done = entry.get("time_discovered_completed_ns") is not None or state == "completed"
        how = "completed" if done else state or "?"
        behind = f", behind: the others are at #{newest}" if seq < newest else ""
        lines.append((rank, f"last collective #{seq} {name} {shape} ({how}){behind}"))
    return lines


# --- the watch --------------------------------------------------------------------------------


class StallWatch:
    """Tells a launch's (or a session task's) view where every rank is once no rank made
    progress for ``stall_after`` seconds (see the module docstring). ``show`` receives the
    :class:`StacksTaken` and :class:`StallOver` events; ``procs`` says which are the ranks
    now (a :class:`Ranks`, or a function rank -> (pid, pidfd) for this machine's).
    ``stall_after=None``: never on its own; :meth:`take` still works."""

    def __init__(
        self,
        stall_after: float | None,
        show: Callable[[Event], None],
        procs: Ranks | Procs | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stall_after = stall_after
        self.show = show
        self.ranks: Ranks = _as_ranks(procs or dict)
        self.clock = clock
        self.last = clock()
        self.stalled_since: float | None = None
        self.next_look: float | None = None
        #: the latest report shown while the stall lasts
        self.shown: StacksTaken | None = None
        self.stopped = False

    def watch(self, procs: Ranks | Procs) -> None:
        """Watch these ranks from now on (a launch's next attempt)."""
        self.ranks = _as_ranks(procs)
        self.saw(None)

    def saw(self, event: object) -> None:
        """Progress: any event or output line of a rank."""
        now = self.clock()
        self.last, self.next_look = now, None
        if self.stalled_since is not None:
            lasted = now - self.stalled_since
            self.stalled_since, self.shown = None, None
            self.show(StallOver(lasted, time.time()))

    def due(self) -> float | None:
        """When (``clock`` time) the next look is due; None for never."""
        if self.stall_after is None or self.stopped:
            return None
        if self.next_look is not None:
            return self.next_look
        return self.last + self.stall_after

    def timeout(self, cap: float | None) -> float | None:
        """How long the pump may wait: ``cap``, or less when a look is due sooner."""
        due = self.due()
        if due is None:
            return cap
        left = max(0.0, due - self.clock())
        return left if cap is None else min(cap, left)

    def tick(self) -> None:
        """Look when a look is due (cheap otherwise)."""
        due = self.due()
        if due is None or self.clock() < due:
            return
        try:
            alive = self.ranks.alive()
        except Exception:  # noqa: BLE001 - a look that fails must not stop the launch
            alive = False
        if not alive:
            self.last = self.clock()  # nothing alive to look at
            return
        now = self.clock()
        self.next_look = now + REFRESH
        try:
            found = report(self.ranks, "stall", now - self.last)
        except Exception:  # noqa: BLE001 - a look that fails must not stop the launch
            return
        if all(r.error in (STARTING, ENDED) for r in found.ranks):  # nothing to show yet
            return  # (ranks that do not answer are news: shown)
        if self.stalled_since is None:
            self.stalled_since = self.last
        self.shown = found
        self.show(found)

    def take(self, reason: str = "request") -> StacksTaken:
        """Where every rank is now (``stacks()``)."""
        return report(self.ranks, reason, self.clock() - self.last)

    def on_interrupt(self) -> StacksTaken | None:
        """Where each rank was, when the user interrupts ranks that were stuck (quiet for
        :data:`INTERRUPT_QUIET` seconds or more); None otherwise."""
        quiet = self.clock() - self.last
        if quiet < INTERRUPT_QUIET:
            return None
        try:
            if not self.ranks.alive():
                return None
            return report(self.ranks, "interrupt", quiet, timeout=0.3)
        except BaseException:  # noqa: BLE001 - an interrupt must never fail for a report:
            return None  # not even a second Ctrl-C while it is read (the first goes on)

    def stop(self) -> None:
        self.stopped = True

    def replaced(self) -> None:
        """The ranks were interrupted and :meth:`on_interrupt`'s report shown: it is the
        last word. No more looks, and the ranks' stopping does not clear it (no
        :class:`StallOver`)."""
        self.stopped, self.stalled_since = True, None


def of_group(group: Any, ranks: Iterable[int] | None = None) -> Ranks:
    """The running ranks of a group (or ``ranks`` of them), for :class:`StallWatch`: a
    ``WorkerGroup``'s by pid; a group that knows better says so (``stall_ranks``: a
    cluster's, whose agents take the stacks on their nodes)."""
    if hasattr(group, "stall_ranks"):
        return group.stall_ranks(ranks)
    wanted = None if ranks is None else set(ranks)

    def procs() -> dict[int, tuple[int, int | None]]:
        return {
            p.rank: (p.pid, p.pidfd) for p in group.running if wanted is None or p.rank in wanted
        }

    return LocalRanks(procs)


def note(found: StacksTaken | None) -> str | None:
    """The report as a note for the exception the user sees."""
    if found is None:
        return None
    return _stacks.format_report(found).rstrip("\n")


__all__ = [
    "ANSWER_TIMEOUT",
    "LocalRanks",
    "Ranks",
    "DEFAULT_STALL_AFTER",
    "REFRESH",
    "StallWatch",
    "check_stall_after",
    "flight_findings",
    "nccl_hint",
    "note",
    "of_group",
    "read_flight",
    "report",
    "take",
]
