"""The record of a detached run: what its supervisor writes and any kernel of its user reads.

A detached launch (``notebook_launcher(..., detach=True)``) runs its ranks under a small
supervisor process that is not the kernel's child, so that the run outlives the kernel. The
supervisor and every kernel that attaches share nothing but a directory, one per run::

    ~/.notebook_launcher/runs/<id>/        (NOTEBOOK_LAUNCHER_RUNS_DIR: another root)  0700
      meta.json     id, function, start, ranks, state, the supervisor's pid and     0600
                    start time (a reused pid is not taken for it)
      task.pkl      the plan and the pickled task, from the kernel; the supervisor  0600
                    reads it and removes it
      events.log    every event the launch's view got, in order: 4-byte length,     0600
                    then the pickled event (``_events``: plain dataclasses), or for
                    an output line (most of a long run's log) a compact frame that
                    reads back several times faster: tag, rank, time, UTF-8 text
      result.pkl    at the end: the per-rank values, or the exception to raise       0600
      supervisor.log  the supervisor's own stderr (why it could not start, if so)   0600
      heartbeat     touched by the supervisor every second while the run runs: how  0600
                    a kernel on another host (the record on a shared home) knows it lives
      stop          written by a kernel on another host to stop the run (it cannot  0600
                    signal the supervisor): the supervisor stops it within a second
      digest.log    every 10 s: what a view that shows each rank's latest lines      0600
                    needs of events.log up to an offset (every event but the
                    output and progress ones; of each progress bar its first and
                    latest update; of each rank's output its latest 2,000 lines,
                    the older ones counted), so that attach reads that and the
                    log after it, not hours of log
      job           a Slurm run's job id, when its supervisor runs in the job       0600
                    (``job.sh``, ``slurm-<id>.out`` beside it): until the
                    supervisor starts, the run is "queued" while the job is

    kernel                                    supervisor (its own session, parent: init)
    ------                                    ------------------------------------------
    new_run() + write_private(task.pkl)
    its forkserver forks _supervise -------> setsid, fork; meta: running, pid
    (or Popen: a cold python, if need be)
                         <------- pid ------  load task.pkl, _Launch.run_to_end() with a
    attach: replay events.log, then tail it   view that appends to events.log
            meta.json says how it ended  <--  result.pkl, then meta.json: ok|failed|stopped
    stop(): SIGINT to the supervisor  ------> every rank stopped, as Ctrl-C does
      (from another host: the stop file)

What protects a run is the file system: the directories are 0700 and the files 0600, so
only their user (and root) can read the outputs, the task or the result, and only that user
can signal the supervisor. A record that is not private (another owner, group or other
permissions) is refused, not read.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import secrets
import shutil
import stat
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from .._events import Output, ProgressUpdate
from .._posix import start_time
from ..errors import LaunchError

#: The root of the run records (default ``~/.notebook_launcher/runs``).
ROOT_ENV = "NOTEBOOK_LAUNCHER_RUNS_DIR"
#: Seconds a record of an ended run is kept when nobody took its result (default 7 days).
RETENTION_ENV = "NOTEBOOK_LAUNCHER_RUN_RETENTION"
DEFAULT_RETENTION = 7 * 24 * 3600.0

META, TASK, EVENTS, RESULT, LOG, HEARTBEAT, STOP, JOB, DIGEST = (
    "meta.json",
    "task.pkl",
    "events.log",
    "result.pkl",
    "supervisor.log",
    "heartbeat",
    "stop",
    "job",
    "digest.log",
)
#: Seconds between two digests of a run's log (:class:`EventWriter`).
DIGEST_INTERVAL = 10.0
#: The latest output lines of each rank a digest keeps: at least what any view shows of a
#: history (the dashboard 1,000 of all ranks together, the text view 1,000 of each).
DIGEST_LINES = 2000
#: Seconds between two touches of a running supervisor's heartbeat file.
HEARTBEAT_INTERVAL = 1.0
#: A supervisor on another host whose heartbeat is older than this is taken for dead.
HEARTBEAT_STALE = 15.0

#: The states a run's meta file says; "supervisor died" is never written, it is found.
RUNNING, OK, FAILED, STOPPED, DIED = "running", "ok", "failed", "stopped", "supervisor died"
STARTING = "starting"
#: a run whose supervisor starts inside its Slurm job, while that job waits in the queue
QUEUED = "queued"
ENDED = (OK, FAILED, STOPPED)

_FRAME = struct.Struct("<I")
#: An output line's frame after its length: tag (1 stdout, 2 stderr), rank, time, then the
#: text. A pickle's first byte is its PROTO opcode (0x80): the two never meet.
_OUTPUT = struct.Struct("<Bid")
_OUTPUT_TAGS = {"stdout": 1, "stderr": 2}
_OUTPUT_STREAMS = {1: "stdout", 2: "stderr"}


class RunNotFound(LaunchError, LookupError):
    """No run of this id on this machine (or it was removed once its result was taken)."""


class RecordNotPrivate(LaunchError, PermissionError):
    """A run record that others could read or write: refused."""


@dataclass
class Meta:
    """What ``meta.json`` says of a run."""

    id: str
    function: str
    started: float
    ranks: int
    state: str = STARTING
    #: the supervisor: its pid, and its start time (``/proc``), None until it runs
    pid: int | None = None
    pid_start: str | None = None
    ended: float | None = None
    #: one line: how it ended ("2 ranks returned", the root cause)
    summary: str = ""
    host: str = field(default_factory=lambda: os.uname().nodename)
    #: "launch" (``notebook_launcher(detach=True)``) or "session" (``start(detach=True)``)
    kind: str = "launch"
    #: the nodes its ranks run on (more than one: a cluster's job, the supervisor's)
    nodes: int = 1
    #: a cluster run's job, once its supervisor started it ("Slurm job 12, 2 node(s)")
    cluster: str = ""


def root() -> str:
    return os.environ.get(ROOT_ENV) or os.path.join(
        os.path.expanduser("~"), ".notebook_launcher", "runs"
    )


def retention() -> float:
    """Seconds an ended run's record is kept when its result is not taken."""
    raw = os.environ.get(RETENTION_ENV, "")
    try:
        return float(raw) if raw else DEFAULT_RETENTION
    except ValueError:
        raise LaunchError(
            f"{RETENTION_ENV}={raw!r} is not a number of seconds: set it to, say, 86400 "
            "(a day), or unset it for the default of 7 days"
        ) from None


def _private_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)  # whatever the umask, or an older directory's mode


def new_run(function: str) -> tuple[str, str]:
    """A new run's id and its (empty, private) directory."""
    base = root()
    _private_dir(base)
    for _ in range(100):
        run_id = secrets.token_hex(3)
        path = os.path.join(base, run_id)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        os.chmod(path, 0o700)
        return run_id, path
    raise LaunchError(f"no free run id under {base}: remove old records there")


def check_private(path: str) -> None:
    """Refuse a record (a directory or a file) that is a symlink, belongs to another user
    or that others may read or write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid() or mode & 0o077:
        raise RecordNotPrivate(
            f"the run record {path} is not private (owner uid {st.st_uid}, mode "
            f"{mode:04o}{', a symlink' if stat.S_ISLNK(st.st_mode) else ''}): refused. "
            "Records are yours alone (directories 0700, files 0600); one that is not was "
            "not made by notebook_launcher for you. Remove it, or chmod it back if you "
            "loosened it yourself."
        )


def write_private(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` as a whole (a reader sees the old file or the new one),
    mode 0600."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.replace(tmp, path)


def the_kernel() -> dict[str, Any]:
    """What a supervisor takes on from the kernel that started it (:func:`take_on`): its
    path, environment and working directory as they are now (a warm supervisor has its
    forkserver's, from when that started)."""
    return {"sys_path": list(sys.path), "environ": dict(os.environ), "cwd": os.getcwd()}


def take_on(kernel: dict[str, Any], in_job: bool = False) -> None:
    """Become the kernel of :func:`the_kernel` (ranks forked here inherit it). ``in_job``:
    inside the run's Slurm job, whose ``SLURM_*`` variables (the allocation a cluster starts
    its agents in) stand over the kernel's."""
    sys.path[:] = kernel["sys_path"]  # the function's modules import
    environ = kernel["environ"]
    if in_job:
        environ = {k: v for k, v in environ.items() if not k.startswith("SLURM_")}
        environ.update((k, v) for k, v in os.environ.items() if k.startswith("SLURM_"))
    os.environ.clear()
    os.environ.update(environ)
    if os.path.isdir(kernel["cwd"]):
        os.chdir(kernel["cwd"])


def write_meta(run_dir: str, meta: Meta) -> None:
    write_private(os.path.join(run_dir, META), json.dumps(asdict(meta)).encode())


def read_meta(run_dir: str) -> Meta:
    with open(os.path.join(run_dir, META), "rb") as f:
        fields = json.loads(f.read())
    known = set(Meta.__dataclass_fields__)
    return Meta(**{k: v for k, v in fields.items() if k in known})


def this_host() -> str:
    return os.uname().nodename


def elsewhere(meta: Meta) -> bool:
    """The run's supervisor runs on another host (its record on a home both share)."""
    return meta.host != this_host()


def supervisor_alive(meta: Meta, run_dir: str | None = None) -> bool:
    """The run's supervisor is still the process it was (not a pid reused since); of a
    supervisor on another host (``run_dir`` given), its heartbeat is recent."""
    if meta.pid is None:
        if meta.state == QUEUED and run_dir is not None:
            return not queued_job_ended(run_dir, meta)
        return meta.state in (STARTING, QUEUED) and time.time() - meta.started < 30
    if elsewhere(meta):
        if run_dir is None:
            return True  # (no way to tell: the caller's record says)
        try:
            beat = os.stat(os.path.join(run_dir, HEARTBEAT)).st_mtime
        except OSError:
            return False
        return time.time() - beat < HEARTBEAT_STALE
    return running(meta.pid) and start_time(meta.pid) == meta.pid_start


#: Seconds between two looks at a queued run's Slurm job.
QUEUED_LOOK = 2.0
#: job id -> (when asked, whether it had ended): Slurm is asked at most every 2 s per job
_JOBS_SEEN: dict[str, tuple[float, bool]] = {}


def job_of(run_dir: str) -> str | None:
    """The Slurm job a queued run's supervisor starts in (None: not submitted yet)."""
    try:
        with open(os.path.join(run_dir, JOB)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def queued_job_ended(run_dir: str, meta: Meta) -> bool:
    """A queued run's job ended before its supervisor started (cancelled, failed to run
    it...). Where Slurm cannot be asked from here, it has not."""
    from . import slurm

    job = job_of(run_dir)
    if job is None:  # (between the submission and its id written)
        return time.time() - meta.started > 60
    now = time.monotonic()
    seen = _JOBS_SEEN.get(job)
    if seen is not None and now - seen[0] < QUEUED_LOOK:
        return seen[1]
    try:
        ended = slurm.state(job).ended
    except slurm.SlurmError:
        ended = False
    _JOBS_SEEN[job] = (now, ended)
    return ended


def beat(run_dir: str) -> bool:
    """The supervisor's heartbeat (``HEARTBEAT_INTERVAL``): its file touched; True when a
    kernel on another host asked for the run to stop (the stop file)."""
    path = os.path.join(run_dir, HEARTBEAT)
    try:
        os.utime(path)
    except FileNotFoundError:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    return os.path.exists(os.path.join(run_dir, STOP))


def ask_to_stop(run_dir: str) -> None:
    """Ask the supervisor to stop the run (from a host where it cannot be signalled)."""
    write_private(os.path.join(run_dir, STOP), b"stop\n")


def running(pid: int) -> bool:
    """Process ``pid`` exists and has not ended (a zombie that nobody reaped yet has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def state_of(meta: Meta, run_dir: str | None = None) -> str:
    """Its state as written, or "supervisor died" when it says running but the supervisor
    is gone (on another host: ``run_dir``'s heartbeat stopped)."""
    if meta.state in ENDED or supervisor_alive(meta, run_dir):
        return meta.state
    return DIED


def find(run_id: str) -> str:
    """The directory of run ``run_id``, checked to be private."""
    base = root()
    path = os.path.join(base, run_id)
    if (
        not run_id
        or os.sep in run_id
        or run_id.startswith(".")
        or not os.path.exists(os.path.join(path, META))
    ):
        raise RunNotFound(
            f"no run {run_id!r} under {base}: notebook_launcher.runs() lists the runs "
            "there (a run whose result was taken is removed; runs started with another "
            f"{ROOT_ENV} live elsewhere)"
        )
    check_private(base)
    check_private(path)
    check_private(os.path.join(path, META))
    return path


def records() -> Iterator[str]:
    """Every run directory under the root."""
    base = root()
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        if os.path.exists(os.path.join(path, META)):
            yield path


def remove(run_dir: str) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)


#: The lines of a dead supervisor's own log that the error about its death quotes.
LOG_LINES = 10


def log_said(run_dir: str, lines: int = LOG_LINES) -> str:
    """What the supervisor's own log says, for the error about its death: its last lines,
    quoted, not its path (``result()`` removes the record the moment the error is raised,
    and the message outlives it), or that it says nothing."""
    try:
        with open(os.path.join(run_dir, LOG), "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 64 * 1024))
            tail = f.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        tail = []
    quoted = "\n".join(f"    {line}" for line in tail if line.strip())
    if not quoted:
        return (
            "Its own log says nothing (a process killed by SIGKILL, by the out-of-memory "
            "killer say, leaves no word there)."
        )
    return f"The last lines of its own log:\n{quoted}"


def sweep(now: float | None = None) -> None:
    """Remove records of runs that ended (or whose supervisor died) longer ago than the
    retention time."""
    now = time.time() if now is None else now
    keep = retention()
    for path in records():
        with contextlib.suppress(OSError, ValueError, TypeError):
            meta = read_meta(path)
            if state_of(meta, path) not in (*ENDED, DIED):
                continue
            ended = meta.ended or os.stat(os.path.join(path, META)).st_mtime
            if meta.ended is None:  # died: its last word is its log's last write
                with contextlib.suppress(OSError):
                    ended = max(ended, os.stat(os.path.join(path, EVENTS)).st_mtime)
            if now - ended > keep:
                remove(path)


# --- the event log -----------------------------------------------------------------------


class EventWriter:
    """Appends events to ``events.log``, one write per event (nothing is buffered: a
    supervisor killed at any moment leaves every event it had). With ``digest_every``
    (seconds), also keeps ``digest.log`` (:func:`write_digest`) that often, written
    after the events it covers."""

    def __init__(self, run_dir: str, digest_every: float | None = None) -> None:
        path = os.path.join(run_dir, EVENTS)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = os.open(path, flags, 0o600)
        os.fchmod(self.fd, 0o600)
        self.run_dir = run_dir
        self.digest_every = digest_every
        self.digested = time.monotonic()

    def write(self, event: Any) -> None:
        data = _encode(event)
        view = memoryview(_FRAME.pack(len(data)) + data)
        while view:
            view = view[os.write(self.fd, view) :]
        if self.digest_every is not None:
            now = time.monotonic()
            if now - self.digested >= self.digest_every:
                self.digested = now
                write_digest(self.run_dir)

    def close(self) -> None:
        """The log is whole: with ``digest_every``, a last digest (an attach to the ended
        run reads only that)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            if self.digest_every is not None:
                with contextlib.suppress(OSError):  # (a record removed meanwhile)
                    write_digest(self.run_dir)


#: A digest's head: the offset in events.log it covers up to, then how many ranks have
#: lines left out, then (rank, lines) for each; its frames follow, as in events.log.
_DIGEST_HEAD = struct.Struct("<QI")
_DIGEST_RANK = struct.Struct("<iQ")


def write_digest(run_dir: str, keep: int = DIGEST_LINES) -> None:
    """Fold what ``events.log`` gained since the last digest into ``digest.log``: the
    frames a history replayed to each rank's latest ``keep`` lines needs (see
    :func:`_digest`), and how many older lines of each rank it left out. Its cost is the
    last digest's size and what was written since, not the log's."""
    offset, left_out, data = read_digest(run_dir)
    fd = os.open(os.path.join(run_dir, EVENTS), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        os.lseek(fd, offset, os.SEEK_SET)
        chunks = [data]
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    frames, end = _frames(data)
    offset += end - (len(chunks[0]))  # (a frame half written: the next digest's)
    kept, more = _digest(data, frames, keep)
    for rank, lines in more.items():
        left_out[rank] = left_out.get(rank, 0) + lines
    head = _DIGEST_HEAD.pack(offset, len(left_out)) + b"".join(
        _DIGEST_RANK.pack(rank, lines) for rank, lines in sorted(left_out.items())
    )
    body = b"".join(data[frames[i] : frames[i] + 4 + _FRAME.unpack_from(data, frames[i])[0]]
                    for i in kept)  # fmt: skip
    write_private(os.path.join(run_dir, DIGEST), head + body)


def read_digest(run_dir: str) -> tuple[int, dict[int, int], bytes]:
    """``(offset in events.log it covers up to, rank -> lines left out, its frames)``;
    ``(0, {}, b"")`` when there is none."""
    try:
        with open(os.path.join(run_dir, DIGEST), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return 0, {}, b""
    offset, ranks = _DIGEST_HEAD.unpack_from(data, 0)
    at = _DIGEST_HEAD.size
    left_out = {}
    for _ in range(ranks):
        rank, lines = _DIGEST_RANK.unpack_from(data, at)
        left_out[rank] = lines
        at += _DIGEST_RANK.size
    return offset, left_out, data[at:]


def _frames(data: bytes) -> tuple[list[int], int]:
    """The offsets of the whole frames in ``data``, and where the last one ends."""
    frames, at, size = [], 0, len(data)
    while at + 4 <= size:
        (n,) = _FRAME.unpack_from(data, at)
        if at + 4 + n > size:
            break
        frames.append(at)
        at += 4 + n
    return frames, at


def _digest(data: bytes, frames: list[int], keep: int) -> tuple[list[int], dict[int, int]]:
    """Which frames (indices into ``frames``, in order) a history shown to each rank's
    latest ``keep`` lines needs: every event but output and progress; of each rank's output
    the frames :func:`_older_lines` does not leave out (counted: rank -> lines); of each
    progress bar its first update (where the bar is placed) and its latest (its state:
    an update carries the whole of it)."""
    skip, left_out = _older_lines(data, frames, keep)
    bars: dict[tuple[int, int], tuple[int, int]] = {}
    view = memoryview(data)
    for i, at in enumerate(frames):
        if i in skip or data[at + 4] in _OUTPUT_STREAMS:
            continue
        if data.find(_PROGRESS_NAME, at + 4, at + 4 + 96) >= 0:  # (a look before unpickling)
            event = pickle.loads(view[at + 4 : at + 4 + _FRAME.unpack_from(data, at)[0]])
            if type(event) is ProgressUpdate:
                first, last = bars.setdefault((event.rank, event.bar_id), (i, i))
                if last != first:  # an update between the first and this one: not needed
                    skip.add(last)
                bars[event.rank, event.bar_id] = (first, i)
    view.release()
    return [i for i in range(len(frames)) if i not in skip], left_out


_PROGRESS_NAME = ProgressUpdate.__name__.encode()


class EventReader:
    """Reads ``events.log`` from the start, then what was appended since the last read."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, EVENTS)
        self.fd = -1
        self.buffer = b""

    def read(self) -> list[Any]:
        """The events written since the last call (a frame half written waits)."""
        data = self._take()
        frames, at = _frames(data)
        view = memoryview(data)
        events = [_decode(data, view, f, _FRAME.unpack_from(data, f)[0]) for f in frames]
        view.release()
        self.buffer = data[at:]
        return events

    def read_history(self, keep_lines: int | None) -> tuple[list[Any], dict[int, int]]:
        """Like :meth:`read`; with ``keep_lines``, for a view that shows only the latest
        ``keep_lines`` output lines of each rank (and of all ranks together): each rank's
        older output lines are counted, not read -- ``(events, rank -> lines left out)``.
        What is left out ends where none of the rank's streams has a line half written, so
        the lines read fold into exactly what the whole log would leave in such a view.
        The log itself is untouched."""
        if keep_lines is None:
            return self.read(), {}
        digested: dict[int, int] = {}
        if self.fd < 0 and keep_lines <= DIGEST_LINES:  # the first read: from the digest
            offset, digested, digest = read_digest(os.path.dirname(self.path))
            if offset and self._open():
                os.lseek(self.fd, offset, os.SEEK_SET)
                self.buffer = digest
        data = self._take()
        frames, at = _frames(data)
        self.buffer = data[at:]
        skip, left_out = _older_lines(data, frames, keep_lines)
        for rank, lines in digested.items():
            left_out[rank] = left_out.get(rank, 0) + lines
        view = memoryview(data)
        events = [
            _decode(data, view, at, _FRAME.unpack_from(data, at)[0])
            for i, at in enumerate(frames)
            if i not in skip
        ]
        view.release()
        return events, left_out

    def _open(self) -> bool:
        if self.fd < 0:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                return False
        return True

    def _take(self) -> bytes:
        """What was left of the last read, and everything written since."""
        if not self._open():
            return b""
        chunks = [self.buffer]
        while chunk := os.read(self.fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _older_lines(data: bytes, frames: list[int], keep: int) -> tuple[set[int], dict[int, int]]:
    """Which output frames (indices into ``frames``) hold only lines older than each
    rank's latest ``keep``, and how many lines they hold per rank. A rank's cut falls where
    none of its streams has a line half written (a frame without its newline yet), so that
    no line is split between what is read and what is counted."""
    #: rank -> its output frames: (index, stream tag, lines ended, a line left half written)
    per_rank: dict[int, list[tuple[int, int, int, bool | None]]] = {}
    head = _OUTPUT.size
    for i, at in enumerate(frames):
        (n,) = _FRAME.unpack_from(data, at)
        if not n or data[at + 4] not in _OUTPUT_STREAMS:
            continue
        _, rank, _ = _OUTPUT.unpack_from(data, at + 4)
        start, end = at + 4 + head, at + 4 + n
        lines = data.count(b"\n", start, end)
        # after it, is a line of its stream half written? (None: an empty text, no change)
        half = (data[end - 1] != 0x0A) if lines else (True if end > start else None)
        per_rank.setdefault(rank, []).append((i, data[at + 4], lines, half))
    skip: set[int] = set()
    left_out: dict[int, int] = {}
    for rank, outputs in per_rank.items():
        count, cut = 0, 0  # outputs[:cut] are left out
        for j in range(len(outputs) - 1, -1, -1):
            count += outputs[j][2]
            if count > keep:  # outputs[j:] hold more than the latest `keep` lines
                cut = j
                break
        clean, half = [True] * (cut + 1), dict.fromkeys(_OUTPUT_STREAMS, False)
        for j in range(cut):  # clean[j]: before outputs[j], no line is half written
            if outputs[j][3] is not None:
                half[outputs[j][1]] = outputs[j][3]
            clean[j + 1] = not any(half.values())
        while cut and not clean[cut]:
            cut -= 1
        if cut:
            skip.update(o[0] for o in outputs[:cut])
            left_out[rank] = sum(o[2] for o in outputs[:cut])
    return skip, left_out


def _decode(data: bytes, view: memoryview, at: int, n: int) -> Any:
    """The event in the frame at ``at`` (its length ``n``)."""
    stream = _OUTPUT_STREAMS.get(data[at + 4]) if n else None
    if stream is None:
        return pickle.loads(view[at + 4 : at + 4 + n])
    _, rank, when = _OUTPUT.unpack_from(data, at + 4)
    text = str(view[at + 4 + _OUTPUT.size : at + 4 + n], "utf-8", "surrogatepass")
    return Output(rank, stream, text, when)


def _encode(event: Any) -> bytes:
    if type(event) is Output and event.stream in _OUTPUT_TAGS:
        head = _OUTPUT.pack(_OUTPUT_TAGS[event.stream], event.rank, event.time)
        return head + event.text.encode("utf-8", "surrogatepass")
    return pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL)


# --- the result --------------------------------------------------------------------------


def write_result(run_dir: str, outcome: Any) -> None:
    """The launch's outcome: its per-rank values, or the exception it would raise."""
    from .._serialization import dump_exception, dumps

    if isinstance(outcome, BaseException):
        record: tuple[str, Any] = ("raised", dump_exception(outcome))
    else:
        try:
            record = ("returned", dumps(outcome))
        except Exception as exc:  # noqa: BLE001 - said to whoever takes the result
            error = LaunchError(
                f"every rank returned, but the supervisor could not pickle their values "
                f"for the kernel ({type(exc).__name__}: {exc}): return plain data, or save "
                "what the ranks made to a file and return its path"
            )
            record = ("raised", dump_exception(error))
    write_private(os.path.join(run_dir, RESULT), pickle.dumps(record))


def read_result(run_dir: str) -> Any:
    """The per-rank values, or the exception to raise (rebuilt, the rank's frames as its
    traceback)."""
    from .._serialization import loads, rebuild_exception

    check_private(os.path.join(run_dir, RESULT))
    with open(os.path.join(run_dir, RESULT), "rb") as f:
        kind, data = pickle.loads(f.read())
    if kind == "returned":
        return loads(data)
    rebuilt = rebuild_exception(data)
    if rebuilt.exc is not None:
        return rebuilt.exc
    return LaunchError(f"the run failed, and its exception could not be rebuilt ({rebuilt.reason})")


__all__ = [
    "DIED",
    "ENDED",
    "EventReader",
    "EventWriter",
    "Meta",
    "RecordNotPrivate",
    "RunNotFound",
    "check_private",
    "find",
    "log_said",
    "new_run",
    "read_meta",
    "read_result",
    "records",
    "remove",
    "retention",
    "running",
    "root",
    "state_of",
    "supervisor_alive",
    "sweep",
    "write_meta",
    "write_private",
    "write_result",
]
