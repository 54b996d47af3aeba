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
      reserve       room kept from the start (:data:`RESERVE_BYTES`), given up at   0600
                    the end if the disk filled up meanwhile, so that the end is
                    written; a result that still does not fit is held in memory by
                    the supervisor and handed to the first kernel that asks, over
      result.sock   (a Unix socket, 0600) -- a full disk never loses the result
      supervisor.log  the supervisor's own stderr (why it could not start, if so)   0600
      heartbeat     touched by the supervisor every second while the run runs: how  0600
                    a kernel on another host (the record on a shared home) knows it
                    was heard from lately -- never that it died: only its own host
                    can tell that (its pid gone there), and says so in meta.json
      stop          written by a kernel on another host to stop the run (it cannot  0600
                    signal the supervisor): the supervisor stops it within a second
      digest.log    every 10 s: what a view that shows each rank's latest lines      0600
                    needs of events.log up to an offset (every event but the
                    output and progress ones; of each progress bar its first and
                    latest update; of each rank's output its latest 2,000 lines,
                    the older ones counted), so that attach reads that and the
                    log after it, not hours of log
      job           the job's id, when its supervisor runs in a job of its own      0600
      job.json      that job as its scheduler dumped it (``Scheduler.dump``: any
                    kernel loads it to say its state, or cancel it), its script
                    and output beside it: until the supervisor starts, the run
                    is "queued" while the job is

    kernel                                    supervisor (its own session, parent: init)
    ------                                    ------------------------------------------
    new_run() + task.pkl, sealed (seal)
    its forkserver forks _supervise -------> setsid, fork; meta: running, pid
    (or Popen: a cold python, if need be)
                         <------- pid ------  waits for its go (nothing run before)
    the go: the run's key (a pipe) --------> task.pkl checked with the key, loaded;
                                              _Launch.run_to_end() with a view that
    attach: replay events.log, then tail it   appends to events.log
            meta.json says how it ended  <--  result.pkl, then meta.json: ok|failed|stopped
                                              (a full disk: the result from memory,
                                              result.sock)
    stop(): SIGINT to the supervisor  ------> every rank stopped, as Ctrl-C does
      (from another host: the stop file)

What protects a run is the file system: the directories are 0700 and the files 0600, so
only their user (and root) can read the outputs, the task or the result, and only that user
can signal the supervisor. A record that is not private (another owner, group or other
permissions) is refused, not read -- and not only by ``attach``: every file of a record is
opened through a descriptor of its directory, checked (this user's, 0700, not a symlink)
once it is open, then the file itself checked the same way (this user's, 0600, a plain
file), so that a path swapped between a check and its use (a records root in a folder
others can write to) is never followed. The root of the records must be this user's too
(made 0700 if it is not): one that another user made first is refused, saying whose it is.
A run's task is bound to its run: the kernel seals it with a key of the run's own
(:func:`seal`), which the supervisor gets over the hand-over, never from the record, and a
task that does not carry it is refused before anything of it is unpickled.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import os
import pickle
import pwd
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
from .._wire import supervisor as wire
from ..errors import LaunchError
from .scheduler import Scheduler, dump, load

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
RESERVE, HELD = "reserve", "result.sock"
#: Bytes a supervisor keeps free from its start for its run's end (the result, the meta).
RESERVE_BYTES = 256 * 1024
#: Seconds between two digests of a run's log (:class:`EventWriter`).
DIGEST_INTERVAL = 10.0
#: The latest output lines of each rank a digest keeps: at least what any view shows of a
#: history (the dashboard 1,000 of all ranks together, the text view 1,000 of each).
DIGEST_LINES = 2000
#: Seconds between two touches of a running supervisor's heartbeat file.
HEARTBEAT_INTERVAL = 1.0
#: A supervisor on another host whose heartbeat is older than this is "not heard from"
#: (a stalled or swapping machine, a slow file server, or clocks that differ): said, and
#: never taken for dead -- only its own host can tell that.
HEARTBEAT_STALE = 15.0

#: The states a run's meta file says; "supervisor died" is found, by the supervisor's own
#: host (its pid gone there), which then writes it for the other hosts to read.
RUNNING, OK, FAILED, STOPPED, DIED = "running", "ok", "failed", "stopped", "supervisor died"
STARTING = "starting"
#: a run whose supervisor starts inside a job of its own, while that job waits in the queue
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


class RecordFull(LaunchError, OSError):
    """The file system that holds the records is full (or the user's quota is spent)."""


class RecordDamaged(LaunchError, ValueError):
    """A record file that does not read as notebook_launcher writes it."""


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
    #: a cluster run's job, once its supervisor started it (``Scheduler.describe``)
    cluster: str = ""
    #: what befell the record itself ("disk full: ..."), said to whoever attaches
    note: str = ""
    #: its result is held in memory by its supervisor (a full disk): taken over HELD
    held: bool = False


def root() -> str:
    return os.environ.get(ROOT_ENV) or os.path.join(
        os.path.expanduser("~"), ".notebook_launcher", "runs"
    )


def retention() -> float:
    """Seconds an ended run's record is kept when its result is not taken."""
    raw = os.environ.get(RETENTION_ENV, "")
    try:
        seconds = float(raw) if raw else DEFAULT_RETENTION
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:  # (a negative one, or nan, would remove results nobody took)
        raise LaunchError(
            f"{RETENTION_ENV}={raw!r} is not a number of seconds of 0 or more: set it to, "
            "say, 86400 (a day), or unset it for the default of 7 days"
        )
    return seconds


#: how a directory of the records is opened: never through a symlink
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FULL = (errno.ENOSPC, errno.EDQUOT)


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _not_private(path: str, st: os.stat_result) -> RecordNotPrivate:
    mode = stat.S_IMODE(st.st_mode)
    link = ", a symlink" if stat.S_ISLNK(st.st_mode) else ""
    return RecordNotPrivate(
        f"the run record {path} is not private (owner uid {st.st_uid}, mode "
        f"{mode:04o}{link}): refused. Records are yours alone (directories 0700, files "
        "0600); one that is not was not made by notebook_launcher for you. Remove it, or "
        "chmod it back if you loosened it yourself."
    )


def _foreign_root(base: str, why: os.stat_result | OSError) -> RecordNotPrivate:
    """The records' root cannot be this user's: whose it is, and what to do."""
    fix = (
        f"Choose a folder of your own: unset {ROOT_ENV} for ~/.notebook_launcher/runs, or "
        "set it to a new folder under your home (on a shared file system, one that only "
        "you can write to)."
    )
    if isinstance(why, OSError):
        return RecordNotPrivate(
            f"the records folder {base} cannot be used ({why.strerror or why}): refused. {fix}"
        )
    if stat.S_ISLNK(why.st_mode):
        what = "is a symlink"
    else:
        what = f"belongs to {_user(why.st_uid)}, not to you ({_user(os.getuid())})"
    return RecordNotPrivate(
        f"the records folder {base} {what}: refused -- its owner could read a run's task "
        f"and result there, or swap them for its own, and a run's supervisor would run "
        f"that. {fix}"
    )


def _open_root(create: bool) -> int | None:
    """A descriptor of the records' root, checked: this user's, 0700 (``create``: made if
    need be, tightened to 0700 if it is this user's and looser; else a looser one is
    refused). None when it does not exist (and ``create`` is false)."""
    base = root()
    if create:
        try:
            os.makedirs(base, 0o700, exist_ok=True)
        except OSError as exc:
            if exc.errno in _FULL:
                raise RecordFull(_full(base, exc)) from None
            if not os.path.lexists(base):
                raise _foreign_root(base, exc) from None
    try:
        fd = os.open(base, _DIR)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as exc:
        why: os.stat_result | OSError = exc
        with contextlib.suppress(OSError):
            why = os.lstat(base)
        raise _foreign_root(base, why) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise _foreign_root(base, st)
        if stat.S_IMODE(st.st_mode) & 0o077:
            if not create:
                raise _not_private(base, st)
            os.fchmod(fd, 0o700)  # ours, looser: whatever the umask, or an older mode
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_dir(path: str, dir_fd: int | None = None) -> int:
    """A descriptor of the record directory ``path``, checked once open: a directory, not
    a symlink, this user's, 0700. What is inside it can only be this user's doing."""
    try:
        fd = os.open(path, _DIR, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EACCES):
            raise
        raise _not_private(path, os.lstat(path, dir_fd=dir_fd)) from None
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        os.close(fd)
        raise _not_private(path, st)
    return fd


@contextlib.contextmanager
def _in(run_dir: str) -> Iterator[int]:
    fd = _open_dir(run_dir)
    try:
        yield fd
    finally:
        os.close(fd)


def open_private(run_dir: str, name: str, flags: int = os.O_RDONLY) -> int:
    """A descriptor of file ``name`` of the record ``run_dir``, opened through a checked
    descriptor of the directory and checked itself once open (a plain file, this user's,
    nothing for group or others); created 0600 with ``os.O_CREAT``."""
    with _in(run_dir) as d:
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=d)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise _not_private(os.path.join(run_dir, name), os.lstat(name, dir_fd=d)) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        os.close(fd)
        raise _not_private(os.path.join(run_dir, name), st)
    return fd


def read_private(run_dir: str, name: str) -> bytes:
    """The whole of file ``name`` of the record (:func:`open_private`)."""
    fd = open_private(run_dir, name)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


def _full(path: str, exc: OSError) -> str:
    return (
        f"disk full: {path} could not be written ({exc.strerror}). Free space on that file "
        f"system (or raise your quota there), or move the records elsewhere with {ROOT_ENV}."
    )


def new_run(function: str) -> tuple[str, str]:
    """A new run's id and its (empty, private) directory: made in the checked root, and
    checked again once made."""
    base_fd = _open_root(create=True)
    assert base_fd is not None
    base = root()
    try:
        for _ in range(100):
            run_id = secrets.token_hex(3)
            try:
                os.mkdir(run_id, 0o700, dir_fd=base_fd)
            except FileExistsError:
                continue
            except OSError as exc:
                if exc.errno in _FULL:
                    raise RecordFull(_full(os.path.join(base, run_id), exc)) from None
                raise
            fd = os.open(run_id, _DIR, dir_fd=base_fd)
            try:
                st = os.fstat(fd)
                if st.st_uid != os.getuid():  # (it cannot be, in a root that is ours)
                    raise _not_private(os.path.join(base, run_id), st)
                os.fchmod(fd, 0o700)  # whatever the umask
            finally:
                os.close(fd)
            return run_id, os.path.join(base, run_id)
    finally:
        os.close(base_fd)
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
        raise _not_private(path, st)


def write_private(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` (a file of a record) as a whole (a reader sees the old
    file or the new one), mode 0600, through a checked descriptor of its directory. A
    write that fails leaves no temporary file; a full disk raises :class:`RecordFull`."""
    run_dir, name = os.path.split(path)
    with _in(run_dir) as d:
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600, dir_fd=d)  # fmt: skip
            try:
                os.fchmod(fd, 0o600)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=d)
            if isinstance(exc, OSError) and exc.errno in _FULL:
                raise RecordFull(_full(path, exc)) from exc
            raise


#: The variable that carries a run's key into its supervisor inside a job of its own (in
#: the job's environment as submitted, never in a file; taken out of the environment first).
KEY_ENV = "NOTEBOOK_LAUNCHER_RUN_KEY"
#: A sealed task: this tag, then its MAC (keyed BLAKE2b of the run's key), then the pickle.
_SEALED = b"NLTASK1\n"
KEY_BYTES = 32


def seal(key: bytes, payload: bytes) -> bytes:
    """``payload`` (a run's task) with a MAC of the run's ``key``: the supervisor that got
    the key from the kernel (never from the record) runs this task and no other."""
    return _SEALED + hashlib.blake2b(payload, key=key, digest_size=32).digest() + payload


def unseal(key: bytes, sealed: bytes, where: str) -> bytes:
    """The payload of :func:`seal`, or :class:`RecordNotPrivate` for a task that its run's
    kernel did not write (nothing of it unpickled)."""
    head = len(_SEALED) + 32
    mac = hashlib.blake2b(sealed[head:], key=key, digest_size=32).digest()
    if not sealed.startswith(_SEALED) or not hmac.compare_digest(sealed[len(_SEALED) : head], mac):
        raise RecordNotPrivate(
            f"the task in {where} is not the one this run's kernel wrote (its seal does not "
            "match the run's key): refused, nothing of it was run. Something replaced the "
            "record's files; start the run again, with the records in a folder only you can "
            f"write to ({ROOT_ENV})."
        )
    return sealed[head:]


def read_task(run_dir: str, key: bytes) -> bytes:
    """The run's task, checked against its ``key``, then removed from the record (it, and
    what its arguments hold, stays no longer than needed)."""
    with _in(run_dir) as d:
        fd = os.open(TASK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise _not_private(os.path.join(run_dir, TASK), st)
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(fd)
        os.unlink(TASK, dir_fd=d)
    return unseal(key, b"".join(chunks), os.path.join(run_dir, TASK))


def the_kernel() -> dict[str, Any]:
    """What a supervisor takes on from the kernel that started it (:func:`take_on`): its
    path, environment and working directory as they are now (a warm supervisor has its
    forkserver's, from when that started)."""
    return {"sys_path": list(sys.path), "environ": dict(os.environ), "cwd": os.getcwd()}


def take_on(kernel: dict[str, Any], keep: str = "") -> None:
    """Become the kernel of :func:`the_kernel` (ranks forked here inherit it). ``keep``:
    inside the run's job, the prefix of its scheduler's variables (``Scheduler.environment``:
    the allocation a cluster starts its agents in), which stand over the kernel's."""
    sys.path[:] = kernel["sys_path"]  # the function's modules import
    environ = kernel["environ"]
    if keep:
        environ = {k: v for k, v in environ.items() if not k.startswith(keep)}
        environ.update((k, v) for k, v in os.environ.items() if k.startswith(keep))
    os.environ.clear()
    os.environ.update(environ)
    if os.path.isdir(kernel["cwd"]):
        os.chdir(kernel["cwd"])


def write_meta(run_dir: str, meta: Meta) -> None:
    write_private(os.path.join(run_dir, META), json.dumps(asdict(meta)).encode())


#: The type of each field of :class:`Meta` (what a meta file must hold to be read).
_META_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "function": (str,),
    "started": (int, float),
    "ranks": (int,),
    "state": (str,),
    "pid": (int, type(None)),
    "pid_start": (str, type(None)),
    "ended": (int, float, type(None)),
    "summary": (str,),
    "host": (str,),
    "kind": (str,),
    "nodes": (int,),
    "cluster": (str,),
    "note": (str,),
    "held": (bool,),
}


def damaged(run_dir: str, name: str, why: str) -> RecordDamaged:
    """The error for file ``name`` of a record that does not read as it was written."""
    return RecordDamaged(
        f"the record of run {os.path.basename(run_dir)} is damaged: "
        f"{os.path.join(run_dir, name)} {why}. Restore that file, or remove the record "
        f"(rm -r {run_dir}); the other runs are not affected"
    )


def read_meta(run_dir: str) -> Meta:
    """The run's meta file; :class:`RecordDamaged` (saying which) for one that does not
    read as a meta file."""
    data = read_private(run_dir, META)
    try:
        fields = json.loads(data)
        if not isinstance(fields, dict):
            raise ValueError(f"holds a JSON {type(fields).__name__}, not an object")
        meta = Meta(**{k: v for k, v in fields.items() if k in _META_TYPES})
        wrong = [k for k, types in _META_TYPES.items() if not isinstance(getattr(meta, k), types)]
        if wrong:
            raise ValueError(f"has {', '.join(wrong)} of the wrong type")
    except (ValueError, TypeError) as exc:  # (not JSON, not UTF-8, a field missing...)
        why = str(exc) if isinstance(exc, ValueError) and "holds" in str(exc) else (
            f"does not read as a run's meta file ({type(exc).__name__}: {exc})"
        )  # fmt: skip
        raise damaged(run_dir, META, why) from None
    return meta


def this_host() -> str:
    return os.uname().nodename


def elsewhere(meta: Meta) -> bool:
    """The run's supervisor runs on another host (its record on a home both share)."""
    return meta.host != this_host()


def supervisor_alive(meta: Meta, run_dir: str | None = None) -> bool:
    """The run's supervisor is still the process it was (not a pid reused since). Only its
    own host can tell: one on another host is taken to live until its host says otherwise
    in the record (a heartbeat judged from here is a guess: :func:`unheard_for`)."""
    if meta.pid is None:
        if meta.state == QUEUED and run_dir is not None:
            return not queued_job_ended(run_dir, meta)
        if elsewhere(meta):
            return meta.state in (STARTING, QUEUED)  # (its kernel's host tells)
        return meta.state in (STARTING, QUEUED) and time.time() - meta.started < 30
    if elsewhere(meta):
        return True
    return running(meta.pid) and start_time(meta.pid) == meta.pid_start


def unheard_for(meta: Meta, run_dir: str) -> float | None:
    """Seconds since the heartbeat of a run's supervisor on another host was touched, by
    this host's clock, when more than :data:`HEARTBEAT_STALE` (None: heard from lately, or
    not a running run elsewhere). Not a death: that host may be stalled, or its clock (or
    the file server's) differ from this one's."""
    if not elsewhere(meta) or meta.state not in (RUNNING, STARTING) or meta.pid is None:
        return None
    try:
        age = time.time() - os.stat(os.path.join(run_dir, HEARTBEAT)).st_mtime
    except OSError:
        return None
    return age if age > HEARTBEAT_STALE else None


#: Seconds between two looks at a queued run's job.
QUEUED_LOOK = 2.0
#: record -> (when asked, whether its job had ended): its scheduler is asked at most every
#: 2 s per job
_JOBS_SEEN: dict[str, tuple[float, bool]] = {}
#: The record's file with the dumped job (``JOB`` holds its id alone, for people).
JOB_DUMP = "job.json"


def write_job(run_dir: str, job: Scheduler) -> None:
    """Write the job a run's supervisor runs in into its record: its id, and its dump."""
    dumped = dump(job)
    write_private(os.path.join(run_dir, JOB_DUMP), json.dumps(dumped).encode())
    write_private(os.path.join(run_dir, JOB), f"{dumped.get('job_id', '')}\n".encode())


def job_of(run_dir: str) -> Scheduler | None:
    """The job a queued run's supervisor starts in, loaded from its dump (its scheduler's
    class imported now: ``scheduler.load``); None: not submitted yet."""
    try:
        return load(json.loads(read_private(run_dir, JOB_DUMP)))
    except (OSError, ValueError, LaunchError):
        return None


def queued_job_ended(run_dir: str, meta: Meta) -> bool:
    """A queued run's job ended before its supervisor started (cancelled, failed to run
    it...). Where its scheduler cannot be asked from here, it has not."""
    job = job_of(run_dir)
    if job is None:  # (between the submission and its dump written)
        return time.time() - meta.started > 60
    now = time.monotonic()
    seen = _JOBS_SEEN.get(run_dir)
    if seen is not None and now - seen[0] < QUEUED_LOOK:
        return seen[1]
    try:
        ended = job.status().ended
    except LaunchError:
        ended = False
    _JOBS_SEEN[run_dir] = (now, ended)
    return ended


def beat(run_dir: str) -> bool:
    """The supervisor's heartbeat (``HEARTBEAT_INTERVAL``): its file touched; True when a
    kernel on another host asked for the run to stop (the stop file)."""
    with _in(run_dir) as d:
        try:
            os.utime(HEARTBEAT, dir_fd=d, follow_symlinks=False)
        except FileNotFoundError:
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            os.close(os.open(HEARTBEAT, flags, 0o600, dir_fd=d))
        try:
            os.stat(STOP, dir_fd=d, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True


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
    is gone -- found on the supervisor's own host (with ``run_dir``, then written in its
    record for the other hosts), or written there by that host."""
    if meta.state in (*ENDED, DIED) or supervisor_alive(meta, run_dir):
        return meta.state
    if run_dir is not None and meta.pid is not None:
        _found_dead(run_dir)
    return DIED


def _found_dead(run_dir: str) -> None:
    """This host found the run's supervisor gone: said in its record, for the kernels of
    other hosts (which cannot look for its pid). Its end: its last word (its log's last
    write)."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        meta = read_meta(run_dir)  # again: it may have ended meanwhile
        if meta.state in (*ENDED, DIED) or meta.pid is None or supervisor_alive(meta):
            return
        last = [os.stat(os.path.join(run_dir, META)).st_mtime]
        with contextlib.suppress(OSError):
            last.append(os.stat(os.path.join(run_dir, EVENTS)).st_mtime)
        meta.state, meta.ended = DIED, max(last)
        meta.summary = meta.summary or (
            f"its supervisor (pid {meta.pid} on host {meta.host}) ended without a word "
            "(killed, or it crashed), and its ranks with it"
        )
        write_meta(run_dir, meta)


def find(run_id: str) -> str:
    """The directory of run ``run_id``, checked to be private."""
    if not isinstance(run_id, str):
        raise TypeError(
            f"a run's id is a string such as '3fa9c1' (notebook_launcher.runs() lists them), "
            f"not {type(run_id).__name__} {run_id!r}"
        )
    base = root()
    path = os.path.join(base, run_id)
    missing = RunNotFound(
        f"no run {run_id!r} under {base}: notebook_launcher.runs() lists the runs "
        "there (a run whose result was taken is removed; runs started with another "
        f"{ROOT_ENV} live elsewhere)"
    )
    if not run_id or os.sep in run_id or run_id.startswith(".") or "\0" in run_id:
        raise missing
    base_fd = _open_root(create=False)
    if base_fd is None:
        raise missing
    try:
        try:
            os.stat(os.path.join(run_id, META), dir_fd=base_fd, follow_symlinks=False)
        except OSError:
            if os.path.lexists(path):  # a directory not ours: said so
                os.close(_open_dir(run_id, dir_fd=base_fd))
            raise missing from None
        os.close(_open_dir(run_id, dir_fd=base_fd))
    finally:
        os.close(base_fd)
    os.close(open_private(path, META))
    return path


def records() -> Iterator[str]:
    """Every run directory under the root (the root checked: this user's, private)."""
    base_fd = _open_root(create=False)
    if base_fd is None:
        return
    try:
        names = sorted(os.listdir(base_fd))
        base = root()
        found = []
        for name in names:
            with contextlib.suppress(OSError):
                os.stat(os.path.join(name, META), dir_fd=base_fd, follow_symlinks=False)
                found.append(os.path.join(base, name))
    finally:
        os.close(base_fd)
    yield from found


def remove(run_dir: str) -> None:
    """Remove a record -- only a directory of this user's (never through a symlink)."""
    try:
        st = os.lstat(run_dir)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        shutil.rmtree(run_dir, ignore_errors=True)


#: The lines of a dead supervisor's own log that the error about its death quotes.
LOG_LINES = 10


def log_said(run_dir: str, lines: int = LOG_LINES) -> str:
    """What the supervisor's own log says, for the error about its death: its last lines,
    quoted, not its path (``result()`` removes the record the moment the error is raised,
    and the message outlives it), or that it says nothing."""
    try:
        fd = open_private(run_dir, LOG)  # (through the checked folder, as every record file)
        try:
            size = os.fstat(fd).st_size
            tail = os.pread(fd, 64 * 1024, max(0, size - 64 * 1024))
        finally:
            os.close(fd)
        lines_said = tail.decode(errors="replace").splitlines()[-lines:]
    except OSError:
        lines_said = []
    quoted = "\n".join(f"    {line}" for line in lines_said if line.strip())
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
        self.fd = open_private(run_dir, EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.fchmod(self.fd, 0o600)
        self.size = os.fstat(self.fd).st_size  # (one writer: where the next frame starts)
        self.run_dir = run_dir
        self.digest_every = digest_every
        self.digested = time.monotonic()

    def write(self, event: Any) -> None:
        """Append ``event``; a write that fails (a full disk: :class:`RecordFull`) leaves
        the log as it was, whole frames only."""
        data = _encode(event)
        view = memoryview(_FRAME.pack(len(data)) + data)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, self.size)  # (a frame half written: none)
            if exc.errno in _FULL:
                raise RecordFull(_full(os.path.join(self.run_dir, EVENTS), exc)) from exc
            raise
        self.size += 4 + len(data)
        if self.digest_every is not None:
            now = time.monotonic()
            if now - self.digested >= self.digest_every:
                self.digested = now
                with contextlib.suppress(RecordFull):  # (the log goes on without it)
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
    fd = open_private(run_dir, EVENTS)
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
    ``(0, {}, b"")`` when there is none -- or when it is damaged (cut short, frames cut,
    an offset past the log's end): the log is then read whole."""
    try:
        data = read_private(run_dir, DIGEST)
    except FileNotFoundError:
        return 0, {}, b""
    try:
        offset, ranks = _DIGEST_HEAD.unpack_from(data, 0)
        at = _DIGEST_HEAD.size
        left_out = {}
        for _ in range(ranks):
            rank, lines = _DIGEST_RANK.unpack_from(data, at)
            left_out[rank] = lines
            at += _DIGEST_RANK.size
        body = data[at:]
        if _frames(body)[1] != len(body):
            raise ValueError("a frame cut short")
        if offset > os.stat(os.path.join(run_dir, EVENTS)).st_size:
            raise ValueError("it covers more of the log than the log holds")
    except (struct.error, ValueError, OSError):
        return 0, {}, b""
    return offset, left_out, body


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
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, EVENTS)
        self.fd = -1
        self.buffer = b""
        #: where the log first failed to read (a frame that does not decode), said once
        #: seen; nothing after it is read (its frames cannot be told apart any more)
        self.damaged = ""
        self.read_bytes = 0  # (of the log itself: where a damage is)

    def read(self) -> list[Any]:
        """The events written since the last call (a frame half written waits)."""
        if self.damaged:
            return []
        start = self.read_bytes - len(self.buffer)
        data = self._take()
        frames, at = _frames(data)
        self.buffer = data[at:]
        return self._decode(data, frames, start)

    def _decode(self, data: bytes, frames: list[int], start: int | None) -> list[Any]:
        """The events of ``frames``, up to the first that does not decode (then
        :attr:`damaged` says where: ``start``, the offset of ``data`` in the log)."""
        events = []
        view = memoryview(data)
        try:
            for at in frames:
                try:
                    events.append(_decode(data, view, at, _FRAME.unpack_from(data, at)[0]))
                except Exception as exc:  # noqa: BLE001 - any garbage
                    where = f"at byte {start + at}" if start is not None else "after its digest"
                    self.damaged = (
                        f"the event log of run {os.path.basename(self.run_dir)} ({self.path}) "
                        f"is damaged {where}: a frame there does not read "
                        f"({type(exc).__name__}: {exc})"
                    )
                    self.buffer = b""
                    break
        finally:
            view.release()
        return events

    def pending(self) -> int:
        """Bytes read that are not a whole frame yet (of an ended run's log: a damage)."""
        return len(self.buffer)

    def read_history(self, keep_lines: int | None) -> tuple[list[Any], dict[int, int]]:
        """Like :meth:`read`; with ``keep_lines``, for a view that shows only the latest
        ``keep_lines`` output lines of each rank (and of all ranks together): each rank's
        older output lines are counted, not read -- ``(events, rank -> lines left out)``.
        What is left out ends where none of the rank's streams has a line half written, so
        the lines read fold into exactly what the whole log would leave in such a view.
        The log itself is untouched."""
        if keep_lines is None or self.damaged:
            return self.read(), {}
        digested: dict[int, int] = {}
        start: int | None = self.read_bytes - len(self.buffer)
        if self.fd < 0 and keep_lines <= DIGEST_LINES:  # the first read: from the digest
            offset, digested, digest = read_digest(self.run_dir)
            if offset and self._open():
                os.lseek(self.fd, offset, os.SEEK_SET)
                self.read_bytes, self.buffer, start = offset, digest, None
        data = self._take()
        frames, at = _frames(data)
        self.buffer = data[at:]
        skip, left_out = _older_lines(data, frames, keep_lines)
        for rank, lines in digested.items():
            left_out[rank] = left_out.get(rank, 0) + lines
        kept = [at for i, at in enumerate(frames) if i not in skip]
        return self._decode(data, kept, start), left_out

    def _open(self) -> bool:
        if self.fd < 0:
            try:
                self.fd = open_private(self.run_dir, EVENTS)
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
            self.read_bytes += len(chunk)
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
        if n < _OUTPUT.size or data[at + 4] not in _OUTPUT_STREAMS:
            continue  # (not an output frame, or a damaged one: said where it is read)
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
    if n < _OUTPUT.size:
        raise ValueError(f"an output frame of {n} bytes, shorter than its head")
    _, rank, when = _OUTPUT.unpack_from(data, at + 4)
    text = str(view[at + 4 + _OUTPUT.size : at + 4 + n], "utf-8", "surrogatepass")
    return Output(rank, stream, text, when)


def _encode(event: Any) -> bytes:
    if type(event) is Output and event.stream in _OUTPUT_TAGS:
        head = _OUTPUT.pack(_OUTPUT_TAGS[event.stream], event.rank, event.time)
        return head + event.text.encode("utf-8", "surrogatepass")
    return pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL)


# --- the result --------------------------------------------------------------------------


def reserve(run_dir: str) -> None:
    """Keep :data:`RESERVE_BYTES` of the disk for the run's end (:func:`write_end`); where
    that cannot be had (a disk full already), the run goes on without."""
    with contextlib.suppress(OSError):
        fd = open_private(run_dir, RESERVE, os.O_WRONLY | os.O_CREAT)
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        except OSError:
            with contextlib.suppress(OSError), _in(run_dir) as d:
                os.unlink(RESERVE, dir_fd=d)
        finally:
            os.close(fd)


def _give_up_reserve(run_dir: str) -> bool:
    try:
        with _in(run_dir) as d:
            os.unlink(RESERVE, dir_fd=d)
    except OSError:
        return False
    return True


def write_end(run_dir: str, meta: Meta, result: bytes) -> bool:
    """The run's end in its record: its result (:func:`encode_result`), then ``meta``
    (ended). A full disk: the reserve (:func:`reserve`) is given up and the end written
    again; False when it still does not fit -- ``meta`` then says why and that the result
    is held, and the caller holds both (:func:`hold`)."""
    full = ""
    for _ in range(2):
        try:
            write_private(os.path.join(run_dir, RESULT), result)
            break
        except RecordFull as exc:
            full = str(exc)
            if not _give_up_reserve(run_dir):
                break
    _give_up_reserve(run_dir)  # (done with it)
    if full and not os.path.exists(os.path.join(run_dir, RESULT)):
        meta.held = True
        meta.note = " ".join(
            part for part in (meta.note, f"{full} Its result is held in memory by its "
            f"supervisor (pid {meta.pid}) until a kernel of yours on host {meta.host} takes "
            "it: notebook_launcher.attach(id).result().") if part
        )  # fmt: skip
    try:
        write_meta(run_dir, meta)
    except RecordFull:
        return False
    return not meta.held


def encode_result(outcome: Any) -> bytes:
    """The launch's outcome as :func:`read_result` reads it: its per-rank values, or the
    exception it would raise."""
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
    return pickle.dumps(record)


def write_result(run_dir: str, outcome: Any) -> None:
    """The launch's outcome in the record (:func:`encode_result`)."""
    write_private(os.path.join(run_dir, RESULT), encode_result(outcome))


def read_result(run_dir: str) -> Any:
    """The per-rank values, or the exception to raise (rebuilt, the rank's frames as its
    traceback); :class:`RecordDamaged` for a result file that does not read."""
    return decode_result(read_private(run_dir, RESULT), run_dir)


def decode_result(data: bytes, run_dir: str) -> Any:
    """What :func:`encode_result` made: the values, or the exception (rebuilt)."""
    from .._serialization import loads, rebuild_exception

    try:
        kind, data = pickle.loads(data)
        if kind not in ("returned", "raised") or not isinstance(data, bytes):
            raise ValueError(f"a record of kind {kind!r}")
    except Exception as exc:  # noqa: BLE001 - any garbage: said which file
        why = f"does not read as a run's result ({type(exc).__name__}: {exc})"
        raise damaged(run_dir, RESULT, why) from None
    if kind == "returned":
        return loads(data)
    rebuilt = rebuild_exception(data)
    if rebuilt.exc is not None:
        return rebuilt.exc
    return LaunchError(f"the run failed, and its exception could not be rebuilt ({rebuilt.reason})")


# --- a result held in memory (a full disk) ------------------------------------------------
#
#     supervisor (hold)                          kernel (take_held), same uid, same host
#     binds result.sock, waits  <-------------   connects: the peer is checked (our uid)
#     Held(meta, result)  --------------------->  (``_wire.supervisor``'s framing)
#                               <-------------   Taken(): the supervisor then ends


def hold(run_dir: str, meta: Meta, result: bytes, keep: float) -> bool:
    """Hold the run's end (``meta``, its ``result``) for the first kernel of this user that
    asks (:func:`take_held`), up to ``keep`` seconds; True once one took it."""
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _in(run_dir) as d:
            old = os.umask(0o177)
            try:
                listener.bind(f"/proc/self/fd/{d}/{HELD}")
            finally:
                os.umask(old)
        listener.listen(4)
        listener.settimeout(min(max(keep, 60.0), 1e8))  # (a retention of 0, or of inf)
        frame = wire.encode(wire.Held(asdict(meta), result))
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                return False
            with conn:
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                if struct.unpack("3i", creds)[1] != os.getuid():
                    continue
                conn.settimeout(30.0)
                try:
                    conn.sendall(frame)
                    if isinstance(wire.recv(conn), wire.Taken):
                        return True
                except (OSError, EOFError, ValueError, pickle.UnpicklingError):
                    continue  # (that kernel went away first, or spoke nonsense: the next one)
    finally:
        listener.close()
        with contextlib.suppress(OSError), _in(run_dir) as d:
            os.unlink(HELD, dir_fd=d)


def take_held(run_dir: str) -> tuple[Meta, bytes] | None:
    """The end of a run whose supervisor holds it in memory (:func:`hold`), taken from it
    (then it ends); None when there is none to take here."""
    import socket

    if not os.path.exists(os.path.join(run_dir, HELD)):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _in(run_dir) as d:
            sock.settimeout(30.0)
            sock.connect(f"/proc/self/fd/{d}/{HELD}")
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        if struct.unpack("3i", creds)[1] != os.getuid():
            return None  # (not a supervisor of ours: nothing of it is read)
        held = wire.recv(sock)
        if not isinstance(held, wire.Held):
            return None
        wire.send(sock, wire.Taken())
    except (OSError, EOFError):
        return None
    finally:
        sock.close()
    return Meta(**held.meta), held.result


__all__ = [
    "DIED",
    "ENDED",
    "EventReader",
    "EventWriter",
    "Meta",
    "RecordDamaged",
    "RecordFull",
    "RecordNotPrivate",
    "RunNotFound",
    "check_private",
    "damaged",
    "decode_result",
    "encode_result",
    "find",
    "hold",
    "log_said",
    "new_run",
    "open_private",
    "read_meta",
    "read_private",
    "read_result",
    "read_task",
    "reserve",
    "records",
    "remove",
    "retention",
    "running",
    "root",
    "seal",
    "state_of",
    "supervisor_alive",
    "sweep",
    "take_held",
    "unheard_for",
    "unseal",
    "write_meta",
    "write_end",
    "write_private",
    "write_result",
]
