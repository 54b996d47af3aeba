"""Detached runs and sessions under attack (issue 32), each provoked for real.

* A run seen from another host (a UTS namespace of its own, another host name; its clock
  skewed with faketime): dead only when its own host says so; from elsewhere "not heard
  from for N s", and nothing deleted that is not known to be over.
* A detached session whose record was removed ends, ranks and all.
* A records folder another user made (``NOTEBOOK_LAUNCHER_RUNS_DIR`` in a shared place): a
  root kernel refuses it, saying whose it is, instead of running that user's ``task.pkl``
  as root; a record swapped under the supervisor (the root's parent writable by others)
  is refused by the supervisor itself; a task that is not the one the run's kernel wrote
  (even one of the same user) is refused by its seal; a user who meets another's folder
  gets a clear error, not a raw ``PermissionError``. Other users are real: ``runuser -u
  nobody`` (the attacker's shell), and a fork of this process that becomes ``nobody``.

Each detached run's supervisor is not this process's child: each test waits for it to be
gone (the autouse fixtures see only our children).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import wait
from pathlib import Path
from typing import Any

import pytest

from notebook_launcher import attach, detached, notebook_launcher, runs, start
from notebook_launcher._events import LaunchFinished, Output, WorkerStarted
from notebook_launcher._launch import detach as record
from notebook_launcher._launch import handover
from notebook_launcher._posix import quiet_fork
from notebook_launcher.errors import LaunchError

from .helpers import ROOT, kernel_env, require_system, wait_until

pytestmark = pytest.mark.kernel

NOBODY = 65534
ROOT_ONLY = "needs root: the test makes folders as another user (nobody) and plays it"


def _as_nobody(script: str) -> None:
    """Run ``script`` (sh) as the user nobody: a real other user, as an attacker would be."""
    if shutil.which("runuser") is None:
        pytest.skip("runuser (util-linux) is not installed: cannot act as another user")
    subprocess.run(["runuser", "-u", "nobody", "--", "sh", "-ec", script], check=True)


class _Evil:
    """A pickle whose loading runs a command: what an attacker puts in a task.pkl."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return (os.system, (self.command,))


def _supervisors_gone() -> None:
    """Every supervisor a record names has ended (they are not our children)."""
    for path in record.records():
        with contextlib.suppress(OSError, ValueError):
            pid = record.read_meta(path).pid
            if pid is not None:
                wait_until(lambda p=pid: not record.running(p), 10, "the supervisor to end")


@pytest.fixture
def shared(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A shared place every user may write to (a project folder, /scratch...), whose
    ``runs`` the records go to."""
    if os.getuid() != 0:
        pytest.skip(ROOT_ONLY)
    base = Path(tempfile.mkdtemp(prefix="nl-shared-"))
    base.chmod(0o777)
    monkeypatch.setenv(record.ROOT_ENV, str(base / "runs"))
    try:
        yield base
    finally:
        with contextlib.suppress(OSError, ValueError, LaunchError):
            _supervisors_gone()
        shutil.rmtree(base, ignore_errors=True)


def _swap_at_task(monkeypatch: pytest.MonkeyPatch, swap: Callable[[str], None]) -> list[str]:
    """Call ``swap(run_dir)`` as soon as the kernel has written a run's task (before its
    supervisor reads it): the moment an attacker wins the race. The run dirs it saw."""
    seen: list[str] = []
    write = record.write_private

    def write_then_swap(path: str, data: bytes) -> None:
        write(path, data)
        if os.path.basename(path) == record.TASK and not seen:
            seen.append(os.path.dirname(path))
            swap(os.path.dirname(path))

    monkeypatch.setattr(record, "write_private", write_then_swap)
    return seen


def _evil_record(shared: Path, run_id: str, marker: Path) -> Path:
    """What nobody puts in a run folder of its own: a meta file and a task that writes
    who ran it to ``marker``; ready to copy (world-readable)."""
    kit = shared / "kit"
    kit.mkdir(exist_ok=True)
    meta = {"id": run_id, "function": "train", "started": 0.0, "ranks": 2}
    (kit / record.META).write_text(json.dumps(meta))
    (kit / record.TASK).write_bytes(pickle.dumps(_Evil(f"id > {marker}")))
    for path in (kit, kit / record.META, kit / record.TASK):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return kit


def _settled(run_dir: str) -> None:
    """Wait for a supervisor that wrote its pid into ``run_dir`` (the attacker's folder:
    read as it is) to end: what it would run has run by then."""
    with contextlib.suppress(OSError, ValueError):
        pid = json.loads((Path(run_dir) / record.META).read_text()).get("pid")
        if pid is not None:
            wait_until(lambda: not record.running(pid), 30, "the supervisor to end")


def _two() -> list[int]:
    return [1, 2]


@pytest.mark.timeout(90)
def test_a_records_folder_another_user_made_is_refused_and_their_task_never_runs(
    shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nobody made the records folder first; a root kernel detaches a run there. It was
    adopted (chmod 0700, still nobody's), nobody swapped in a run folder of its own, and
    the root supervisor unpickled its task.pkl (the marker said uid=0(root))."""
    runs_root = shared / "runs"
    _as_nobody(f"mkdir -m 0755 {runs_root}")
    marker = shared / "ran-as"

    def swap(run_dir: str) -> None:
        kit = _evil_record(shared, os.path.basename(run_dir), marker)
        _as_nobody(f"mv {run_dir} {run_dir}.x && mkdir {run_dir} && cp {kit}/* {run_dir}/")

    seen = _swap_at_task(monkeypatch, swap)
    with pytest.raises(record.RecordNotPrivate) as refused:
        notebook_launcher(_two, num_processes=2, detach=True, dashboard=False)
    for run_dir in seen:
        _settled(run_dir)
    assert not marker.exists(), marker.read_text()
    said = str(refused.value)
    assert f"the records folder {runs_root} belongs to nobody (uid {NOBODY})" in said, said
    assert record.ROOT_ENV in said and "a folder of your own" in said
    assert os.listdir(runs_root) == []  # nothing of the run made there
    with pytest.raises(record.RecordNotPrivate, match="belongs to nobody"):
        runs()  # listing it is refused the same way


@pytest.mark.timeout(90)
def test_a_record_swapped_under_the_supervisor_is_refused_by_the_supervisor(
    shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The records folder is root's own (0700), but its parent is writable by others: nobody
    renames the folder away between the kernel's checks and the supervisor's reads, and
    puts its own there. The supervisor checks what it opens: refused, nothing run."""
    runs_root = shared / "runs"
    marker = shared / "ran-as"

    def swap(run_dir: str) -> None:
        kit = _evil_record(shared, os.path.basename(run_dir), marker)
        theirs = f"{runs_root}/{os.path.basename(run_dir)}"
        _as_nobody(
            f"mv {runs_root} {runs_root}.x && mkdir -m 0700 {runs_root} {theirs} "
            f"&& cp {kit}/* {theirs}/"
        )

    seen = _swap_at_task(monkeypatch, swap)
    with pytest.raises(LaunchError, match="not private") as refused:
        notebook_launcher(_two, num_processes=2, detach=True, dashboard=False)
    [run_dir] = seen
    _settled(run_dir)
    assert not marker.exists(), marker.read_text()
    assert f"owner uid {NOBODY}" in str(refused.value)
    assert sorted(os.listdir(run_dir)) == [record.META, record.TASK]  # theirs: untouched


@pytest.mark.timeout(90)
def test_a_task_the_runs_kernel_did_not_write_is_refused_by_its_seal(
    shared: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even a file of the same user (another run's task, a file put there through some
    other hole) is not run: the supervisor runs the task sealed with the key it got from
    the kernel over the hand-over, not whatever task.pkl the record holds."""
    marker = shared / "ran-as"

    def replace(run_dir: str) -> None:  # (the wrapper writes it, then does nothing more)
        record.write_private(
            os.path.join(run_dir, record.TASK), pickle.dumps(_Evil(f"id > {marker}"))
        )

    _swap_at_task(monkeypatch, replace)
    handle = notebook_launcher(_two, num_processes=2, detach=True, dashboard=False)
    with pytest.raises(BaseException) as refused:
        handle.result(timeout=60)
    _supervisors_gone()
    assert not marker.exists(), marker.read_text()
    assert isinstance(refused.value, record.RecordNotPrivate), refused.value
    assert "is not the one this run's kernel wrote" in str(refused.value)


def _in_a_fork_as_nobody(work: Callable[[], str]) -> str:
    """What ``work()`` says, run in a fork of this process that became nobody."""
    r, w = os.pipe()
    pid = quiet_fork()
    if pid == 0:
        os.close(r)
        said = "?"
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            said = work()
        except BaseException as exc:  # noqa: BLE001 - said to the parent
            said = f"{type(exc).__name__}: {exc}"
        finally:
            os.write(w, said.encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    return said


@pytest.mark.timeout(60)
def test_a_user_who_meets_another_users_records_folder_is_told_whose_it_is(
    shared: Path,
) -> None:
    """A records folder root made (0700): nobody, pointed at it, got a raw PermissionError
    (detach=True) or an empty list (runs())."""
    (shared / "runs").mkdir(mode=0o700)

    def lists() -> str:
        return repr(runs())

    def starts() -> str:
        return repr(record.new_run("train"))

    def attaches() -> str:
        return repr(attach("3fa9c1"))

    for work in (lists, starts, attaches):
        said = _in_a_fork_as_nobody(work)
        assert said.startswith("RecordNotPrivate: "), (work.__name__, said)
        assert f"the records folder {shared / 'runs'} belongs to root (uid 0)" in said, said
        assert "not to you (nobody" in said and record.ROOT_ENV in said, said


# --- a kernel on another host --------------------------------------------------------------


class _OtherHost:
    """A kernel on another host that shares the records' folder (a home on NFS): this
    machine's interpreter in a UTS namespace of its own (another host name), its clock
    skewed with faketime where asked. Runs ``code``; its lines are read as they come."""

    def __init__(self, code: str, skew: str | None = None, **env: str) -> None:
        tools = {"unshare": "util-linux", **({"faketime": "faketime"} if skew else {})}
        lacking = [f"{t} (apt-get install {p})" for t, p in tools.items() if not shutil.which(t)]
        if os.getuid() != 0:
            lacking.insert(0, "root (a UTS namespace, another host name, is made with unshare)")
        require_system("a kernel on another host", lacking)
        clock = ["faketime", "-f", skew] if skew else []
        command = [
            "unshare", "-u", "sh", "-c", 'hostname login9 && exec "$@"', "sh",
            *clock, sys.executable, "-c", textwrap.dedent(code),
        ]  # fmt: skip
        full = {**kernel_env(), "PYTHONPATH": str(ROOT), **env}
        self.proc = subprocess.Popen(
            command, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [
            threading.Thread(target=self._read, args=(s, lines), daemon=True)
            for s, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream: Any, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    def said(self, text: str, stream: str = "out") -> str:
        """The first line with ``text`` (waits for it)."""
        lines = self.out if stream == "out" else self.err

        def found() -> bool:
            if self.proc.poll() is not None:
                for reader in self.readers:
                    reader.join(5)
                if not any(text in line for line in lines):
                    raise AssertionError(f"the other host ended: {''.join(self.out + self.err)}")
            return any(text in line for line in lines)

        wait_until(found, 90, f"the other host to say {text!r}")
        return next(line for line in lines if text in line)

    def end(self) -> str:
        """Its exit (waited for) and all it said."""
        self.proc.wait(90)
        self.kill()
        said = "".join(self.out + self.err)
        assert self.proc.returncode == 0, said
        return said

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for reader in self.readers:
            reader.join(5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def _gated(gate: str) -> Callable[[], int]:
    def steps() -> int:
        import os
        import time

        import torch.distributed as dist

        i = 0
        while not os.path.exists(gate):
            print(f"step {i}", flush=True)
            i += 1
            time.sleep(0.05)
        return dist.get_rank() * 10

    return steps


@pytest.fixture
def runs_here(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Run records under a folder of this test's (the other host reads them too)."""
    base = Path(tempfile.mkdtemp(prefix="nl-runs-"))
    monkeypatch.setenv(record.ROOT_ENV, str(base / "runs"))
    try:
        yield base / "runs"
    finally:
        for path in record.records():  # a failed test: its supervisors must not outlive it
            with contextlib.suppress(OSError, ValueError):
                meta = record.read_meta(path)
                if meta.pid is not None and record.supervisor_alive(meta):
                    os.kill(meta.pid, signal.SIGCONT)
                    os.kill(meta.pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.timeout(150)
def test_a_live_run_seen_from_a_host_whose_clock_is_ahead_is_neither_dead_nor_swept(
    runs_here: Path, tmp_path: Path
) -> None:
    """The other host's clock is 2 minutes ahead and its retention 60 s: its runs() sweep
    deleted the record of a running run (its heartbeat looked 2 minutes old), and
    attach(id).result() said the ranks were ended with a supervisor that was fine. Now:
    running, "not heard from" by that host's clock, kept, and its result taken there."""
    gate = tmp_path / "gate"
    handle = notebook_launcher(_gated(str(gate)), num_processes=2, detach=True, dashboard=False)
    handle.detach()
    meta = record.read_meta(handle.path)
    there = _OtherHost(
        f"""
        from notebook_launcher import attach, runs
        [info] = runs()
        print("STATE", info.state, "|", info.summary, flush=True)
        handle = attach({handle.id!r}, dashboard=False, keep=True)
        print("ATTACHED", flush=True)
        print("RESULT", handle.result(timeout=90), flush=True)
        """,
        skew="+120s",
        **{record.RETENTION_ENV: "60"},
    )
    try:
        state = there.said("STATE")
        assert "STATE running |" in state and "not heard from for 1" in state, state
        there.said("ATTACHED")
        gate.touch()
        assert "RESULT [0, 10]" in there.said("RESULT")
        said = there.end()
    finally:
        there.kill()
    assert "died" not in said and "were ended" not in said, said
    assert [(r.id, r.state) for r in runs()] == [(handle.id, record.OK)]  # kept, as asked
    assert meta.pid is not None
    wait_until(lambda: not record.running(meta.pid), 10, "the supervisor to exit")


@pytest.mark.timeout(150)
def test_a_stalled_supervisor_seen_from_another_host_is_not_heard_from_not_dead(
    runs_here: Path, tmp_path: Path
) -> None:
    """A supervisor stopped (SIGSTOP: a swapping machine, a stalled NFS client) for longer
    than the stale threshold: the other host's attach(id).result() said "its ranks were
    ended with it" (false) and removed the record; the run then finished headless, its
    result lost. Now that host says "not heard from", keeps following, and gets the
    result once the supervisor goes on."""
    gate = tmp_path / "gate"
    handle = notebook_launcher(_gated(str(gate)), num_processes=2, detach=True, dashboard=False)
    handle.detach()
    meta = record.read_meta(handle.path)
    assert meta.pid is not None
    stale = "import notebook_launcher._launch.detach as record; record.HEARTBEAT_STALE = 1.0\n"
    there = _OtherHost(
        stale
        + f"""
from notebook_launcher import attach
handle = attach({handle.id!r}, dashboard=False, keep=True)
print("ATTACHED", flush=True)
print("RESULT", handle.result(timeout=120), flush=True)
"""
    )
    try:
        there.said("ATTACHED")
        os.kill(meta.pid, signal.SIGSTOP)
        try:
            there.said("has not been heard from", stream="err")
            lister = _OtherHost(
                stale + "from notebook_launcher import runs\n"
                "print([(r.state, r.summary) for r in runs()])\n"
            )
            listed = lister.end()
            assert "('running', \"not heard from for" in listed, listed
        finally:
            os.kill(meta.pid, signal.SIGCONT)
        there.said("heard from again", stream="err")
        gate.touch()
        assert "RESULT [0, 10]" in there.said("RESULT")
        said = there.end()
    finally:
        there.kill()
    assert "died" not in said and "were ended" not in said, said
    assert [(r.id, r.state) for r in runs()] == [(handle.id, record.OK)]
    wait_until(lambda: not record.running(meta.pid), 10, "the supervisor to exit")


# --- a full disk ------------------------------------------------------------------------


@pytest.fixture
def small_disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Run records on a tmpfs of 1 MiB (a home at its quota)."""
    lacking = [] if os.getuid() == 0 else ["root (the test mounts a small tmpfs)"]
    require_system("a full disk", lacking)
    mount = Path(tempfile.mkdtemp(prefix="nl-small-"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        mount.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    monkeypatch.setenv(record.ROOT_ENV, str(mount / "runs"))
    try:
        yield mount / "runs"
    finally:
        with contextlib.suppress(OSError, ValueError, LaunchError):
            _supervisors_gone()
        subprocess.run(["umount", "-l", str(mount)], check=False)
        mount.rmdir()


def _chatty(value_bytes: int) -> Callable[[], Any]:
    def chatty() -> Any:
        import torch.distributed as dist

        for i in range(1000):  # 2 ranks x 1,000 lines of 1 KiB: twice the disk
            print(f"{i:5d} " + "x" * 1018, flush=True)
        return [dist.get_rank()] + ([b"v" * value_bytes] if value_bytes else [])

    return chatty


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("value_bytes", "where"),
    [(0, "its reserve"), (300_000, "its supervisor's memory")],
    ids=["small-result", "large-result"],
)
def test_a_full_disk_keeps_the_result_and_says_so(
    small_disk: Path, capsys: pytest.CaptureFixture[str], value_bytes: int, where: str
) -> None:
    """Chatty ranks fill the disk of the records: recording stopped, the ranks finished,
    then writing the result failed -- the handle said the supervisor died and its ranks
    were ended (false), and .tmp files stayed. Now the result comes back (written in the
    room the supervisor kept, or, larger, handed over from its memory), the attach says
    "disk full" with the path, and no temporary file is left. Then, the disk full before a
    run: refused with the path, nothing left."""
    handle = notebook_launcher(_chatty(value_bytes), num_processes=2, detach=True, dashboard=False)
    run_dir = Path(handle.path)
    wait([handle], timeout=90)
    assert handle.done()
    assert [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")] == []
    values = handle.result()
    tail = [b"v" * value_bytes] if value_bytes else []
    assert values == [[0, *tail], [1, *tail]], where
    said = capsys.readouterr().err
    assert f"disk full: {run_dir / record.EVENTS} could not be written" in said, said
    assert "Its log stops at" in said
    assert not run_dir.exists()  # its result taken: its record went, temporaries and all
    _supervisors_gone()
    # a disk full before the run starts: refused, saying where; nothing left there
    filler = small_disk.parent / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    with contextlib.suppress(OSError):
        while os.write(fd, b"\0" * 4096):
            pass
    os.close(fd)
    with pytest.raises(record.RecordFull, match=rf"disk full: {small_disk}/\w+/"):
        notebook_launcher(_chatty(0), num_processes=2, detach=True, dashboard=False)
    assert [p.name for p in small_disk.iterdir()] == []


# --- Ctrl-C during the hand-over ------------------------------------------------------------


def _marks(marker: str) -> Callable[[], int]:
    def marked() -> int:
        import torch.distributed as dist

        open(marker, "a").close()  # the function ran
        return dist.get_rank()

    return marked


def _interrupt() -> None:
    signal.raise_signal(signal.SIGINT)  # a real Ctrl-C: what a deferred section holds back


def _interrupt_at(monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    """Press Ctrl-C at ``point`` of the hand-over: after the run's folder is made, after its
    meta or its task is written, once the forkserver is had, as the kernel waits for the
    supervisor's pid (the request sent) or once it has it, or as the handle is made."""
    if point == "folder made":
        new_run = record.new_run

        def then(name: str) -> tuple[str, str]:
            made = new_run(name)
            _interrupt()
            return made

        monkeypatch.setattr(record, "new_run", then)
    elif point in ("meta written", "task written"):
        write = record.write_private
        name = record.META if point == "meta written" else record.TASK

        def written(path: str, data: bytes) -> None:
            write(path, data)
            if os.path.basename(path) == name:
                _interrupt()

        monkeypatch.setattr(record, "write_private", written)
    elif point == "forkserver had":
        get = handover.forkserver.running

        def had() -> Any:
            server = get()
            _interrupt()
            return server

        monkeypatch.setattr(handover.forkserver, "running", had)
    elif point in ("waiting for the pid", "pid read"):
        read = handover._read_until_closed

        def reading(*args: Any) -> Any:
            if point == "waiting for the pid":
                _interrupt()
            said = read(*args)
            if point == "pid read":
                _interrupt()
            return said

        monkeypatch.setattr(handover, "_read_until_closed", reading)
    elif point == "handle made":
        attach_ = detached.attach

        def attaching(run_id: str, **options: Any) -> Any:
            _interrupt()
            return attach_(run_id, **options)

        monkeypatch.setattr(detached, "attach", attaching)


BEFORE_THE_GO = [
    "folder made",
    "meta written",
    "task written",
    "forkserver had",
    "waiting for the pid",
    "pid read",
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", [*BEFORE_THE_GO, "handle made"])
def test_ctrl_c_during_the_hand_over_leaves_no_run_or_returns_its_handle(
    runs_here: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    point: str,
) -> None:
    """Ctrl-C at each step of detach=True (a real SIGINT, at a point made to come every
    time): the call raised KeyboardInterrupt yet the run ran to ok, or an empty run folder
    stayed that runs() never shows. Now: before the supervisor's go, KeyboardInterrupt and
    nothing at all -- no folder, no supervisor, the function never run; after it, the run's
    handle (the interrupt said)."""
    from notebook_launcher._launch import forkserver

    from .test_detach import _forkserver_up, _next_spare

    forkserver.shutdown()  # (one started behind an earlier test's session: its spare forks none)
    warm = notebook_launcher(_two, num_processes=2, detach=True, dashboard=False)
    assert warm.result(timeout=60) == [[1, 2], [1, 2]]
    server = _forkserver_up()
    spare, _ = _next_spare(server, 2)  # the supervisor the next run goes to
    marker = tmp_path / "ran"
    with monkeypatch.context() as patch:
        _interrupt_at(patch, point)
        if point in BEFORE_THE_GO:
            with pytest.raises(KeyboardInterrupt):
                notebook_launcher(_marks(str(marker)), num_processes=2, detach=True,
                                  dashboard=False)  # fmt: skip
        else:
            try:
                handle = notebook_launcher(_marks(str(marker)), num_processes=2, detach=True,
                                           dashboard=False)  # fmt: skip
            except KeyboardInterrupt:
                pytest.fail("Ctrl-C as the run started raised: the run goes on, no handle")
    if point in BEFORE_THE_GO:
        assert sorted(os.listdir(runs_here)) == []  # no folder left, whole or empty
        if record.running(spare):  # it never got the run: the next one is its
            after = notebook_launcher(_two, num_processes=2, detach=True, dashboard=False)
            assert record.read_meta(after.path).pid == spare
            assert after.result(timeout=60) == [[1, 2], [1, 2]]
        assert not marker.exists()  # the function never ran
    else:
        assert handle.result(timeout=60) == [0, 1] and marker.exists()
        assert f"Ctrl-C came as run {handle.id} started: it goes on" in capsys.readouterr().err
    forkserver.shutdown()


# --- a detached session whose record was removed ---------------------------------------


def _sleeps(marker: str) -> Callable[[], None]:
    def sleeps() -> None:
        import time

        open(marker, "a").close()  # the task runs on this rank
        time.sleep(60)

    return sleeps


@pytest.mark.timeout(90)
def test_a_detached_session_whose_record_was_removed_ends_with_its_ranks(
    runs_here: Path, tmp_path: Path
) -> None:
    """Its record removed (by hand, a cleaner), a detached session lived on, unreachable:
    its supervisor and ranks alive, holding their memory, until someone killed them. Now it
    notices within a beat or two and ends, ranks and all; the task that ran is told why."""
    session = start(num_processes=2, detach=True, dashboard=False)
    meta = record.read_meta(session.path)
    assert meta.pid is not None
    supervisor = meta.pid
    try:
        pids = session.status().pids
        marker = tmp_path / "running"
        handle = session.submit(_sleeps(str(marker)))
        wait_until(marker.exists, 30, "the task to run on the ranks")
        shutil.rmtree(session.path)
        with pytest.raises(KeyboardInterrupt, match=r"its record \(.*\) was removed"):
            handle.result(timeout=30)
        for pid in (*pids, supervisor):
            wait_until(lambda p=pid: not record.running(p), 30, f"process {pid} to end")
    finally:
        if record.running(supervisor):
            os.kill(supervisor, signal.SIGKILL)


# --- a stopped process forked ahead ---------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stopped", ["a blank rank", "the spare supervisor"])
def test_a_stopped_process_forked_ahead_is_replaced_not_waited_on(
    runs_here: Path, stopped: str
) -> None:
    """A blank rank SIGSTOPped while it waited: the next detached run hung forever on it. A
    spare supervisor SIGSTOPped: the next launch waited 30 s, then failed "a loaded
    machine?" with no run. Now each is checked (a bounded answer) before it is given work,
    killed if it does not answer, and a process forked then takes its place."""
    from notebook_launcher._launch import forkserver

    from .test_detach import _forkserver_up, _next_spare

    forkserver.shutdown()  # (one started behind an earlier test's session: its spare forks none)
    try:
        first = notebook_launcher(_two, num_processes=2, detach=True, dashboard=False)
        assert first.result(timeout=60) == [[1, 2], [1, 2]]
        server = _forkserver_up()
        spare, blanks = _next_spare(server, 2)
        victim = blanks[0] if stopped == "a blank rank" else spare
        os.kill(victim, signal.SIGSTOP)
        try:
            run = notebook_launcher(_two, num_processes=2, detach=True, dashboard=False)
            assert run.result(timeout=60) == [[1, 2], [1, 2]]
            wait_until(lambda: not record.running(victim), 10, f"{stopped} to be killed")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
    finally:
        forkserver.shutdown()


# --- damaged record files ---------------------------------------------------------------


def _ended_record(lines: int = 50, digested: int = 10) -> tuple[str, Path]:
    """An ended run's record, written as its supervisor writes one: a digest taken when the
    log had ``digested`` lines, ``lines`` in all (each with a two-byte letter), its result."""
    run_id, path = record.new_run("train")
    writer = record.EventWriter(path)
    writer.write(WorkerStarted(0, 0, 4242, "cpu", 0.0))
    for i in range(lines):
        if i == digested:
            record.write_digest(path)
        writer.write(Output(0, "stdout", f"héllo {i}\n", 0.5))
    writer.write(LaunchFinished(True, "1 rank(s) returned", None, 1.0, 1.0))
    writer.close()
    record.write_result(path, [0])
    meta = record.Meta(run_id, "train", time.time() - 5, 1, state=record.OK, ended=time.time())
    record.write_meta(path, meta)
    return run_id, Path(path)


def _frame_at(path: Path, index: int) -> int:
    data = (path / record.EVENTS).read_bytes()
    frames, _ = record._frames(data)
    return frames[index]


def _digest_cut(path: Path) -> None:
    with open(path / record.DIGEST, "r+b") as f:
        f.truncate(5)


def _digest_frames_cut(path: Path) -> None:
    data = (path / record.DIGEST).read_bytes()
    (path / record.DIGEST).write_bytes(data[:-7])


def _digest_past_the_log(path: Path) -> None:
    data = (path / record.DIGEST).read_bytes()
    past = (path / record.EVENTS).stat().st_size + 1000
    (path / record.DIGEST).write_bytes(past.to_bytes(8, "little") + data[8:])


def _frame_length_wrong(path: Path) -> None:
    at = _frame_at(path, 1 + 20)  # the 21st line, after what the digest covers
    data = bytearray((path / record.EVENTS).read_bytes())
    n = int.from_bytes(data[at : at + 4], "little")
    data[at : at + 4] = (n - 8).to_bytes(4, "little")  # its text ends inside "é"
    (path / record.EVENTS).write_bytes(bytes(data))


def _meta_a_list(path: Path) -> None:
    (path / record.META).write_text("[1, 2]")


def _meta_not_json(path: Path) -> None:
    (path / record.META).write_text('{"id": "abc", "func')


def _result_cut(path: Path) -> None:
    with open(path / record.RESULT, "r+b") as f:
        f.truncate(10)


#: (damage, what it damages: the digest -- read around, the log -- shown up to the damage,
#: the meta -- the record left out of runs(), the result -- said when taken)
DAMAGES = [
    (_digest_cut, "digest"),
    (_digest_frames_cut, "digest"),
    (_digest_past_the_log, "digest"),
    (_frame_length_wrong, "log"),
    (_meta_a_list, "meta"),
    (_meta_not_json, "meta"),
    (_result_cut, "result"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("damage", "what"), DAMAGES, ids=[d.__name__[1:] for d, _ in DAMAGES])
def test_a_damaged_record_is_named_and_read_around(
    runs_here: Path, capsys: pytest.CaptureFixture[str], damage: Any, what: str
) -> None:
    """A truncated digest raised struct.error; a digest past the log's end lost the lines
    after it; a wrong frame length raised a UnicodeDecodeError; a meta file holding a list
    made runs() raise for every run; a cut result raised an UnpicklingError. Now a digest
    that does not read is ignored (the log read whole); a damaged log is shown up to the
    damage, which is said, with the run's end and result; a damaged meta or result raises
    RecordDamaged naming the file, and runs() leaves that record out, saying why."""
    from .helpers import Recorder

    healthy, _ = _ended_record()
    run_id, path = _ended_record()
    damage(path)
    listed = runs()
    shown = [healthy] if what == "meta" else [healthy, run_id]  # (runs() never raises)
    assert sorted(r.id for r in listed) == sorted(shown)
    lines = [f"héllo {i}\n" for i in range(50)]
    if what == "meta":
        assert len(listed.damaged) == 1 and str(path / record.META) in listed.damaged[0]
        assert f"left out: the record of run {run_id} is damaged" in repr(listed)
        with pytest.raises(record.RecordDamaged, match=f"{path / record.META} "):
            attach(run_id, dashboard=False, keep=True)
        return
    view = Recorder()
    view.history_lines = 1000  # type: ignore[attr-defined]  # (as the text view: digest first)
    handle = attach(run_id, dashboard=view, keep=True)
    if what == "result":
        with pytest.raises(record.RecordDamaged, match=f"{path / record.RESULT} does not read"):
            handle.result(timeout=10)
        assert view.lines(0) == lines
        return
    assert handle.result(timeout=10) == [0]
    if what == "digest":  # read around: the whole log
        assert view.lines(0) == lines and handle.output(0) == "".join(lines)
        return
    assert view.lines(0) == lines[:20]  # up to the damage
    said = capsys.readouterr().err
    assert f"the event log of run {run_id} ({path / record.EVENTS}) is damaged" in said, said
    with pytest.raises(record.RecordDamaged, match=r"is damaged at byte \d+: a frame there"):
        handle.output()


# --- the smaller ones -------------------------------------------------------------------


@pytest.mark.parametrize("retention", ["-1", "-0.5", "nan"])
def test_a_negative_retention_is_refused_before_any_record_goes(
    runs_here: Path, monkeypatch: pytest.MonkeyPatch, retention: str
) -> None:
    """NOTEBOOK_LAUNCHER_RUN_RETENTION=-1 was taken: the next runs() removed every ended
    run's record, results nobody took included."""
    run_id, path = _ended_record()
    monkeypatch.setenv(record.RETENTION_ENV, retention)
    with pytest.raises(LaunchError, match=r"is not a number of seconds of 0 or more: set it"):
        runs()
    assert path.exists()
    monkeypatch.setenv(record.RETENTION_ENV, "inf")  # (kept for ever: allowed)
    assert [r.id for r in runs()] == [run_id]


def test_attach_to_none_says_what_an_id_is(runs_here: Path) -> None:
    """attach(None) raised a bare TypeError ("argument of type 'NoneType' is not
    iterable")."""
    with pytest.raises(TypeError, match=r"a run's id is a string such as '3fa9c1' .*not NoneType"):
        attach(None)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_attach_after_a_kernel_died_mid_cell_shows_the_cell_whatever_the_timing(
    runs_here: Path,
) -> None:
    """A kernel killed mid-cell; the cell ended on the ranks; a kernel attaches just then,
    before the cell's end was found undeliverable: the attach showed 0 of the cell's lines
    (once in 2 runs of a session script). The window is held open here: the call's
    connection thread is stopped between the cell's end and its reply (the seam: the
    server's ``watch``), and the attach comes in it."""
    from notebook_launcher import detached_session as ds
    from notebook_launcher._wire import supervisor as wire

    run_id, run_dir = record.new_run("session")
    secret = b"s" * wire.SECRET_BYTES
    record.write_private(os.path.join(run_dir, ds.SECRET), secret)
    server = ds._Server(run_dir, record.Meta(run_id, "session", time.time(), 2, kind="session"))

    class Ranks:  # the session's ranks: the cell prints 30 lines
        def _run_pickled(self, data: bytes, label: str, ranks: Any) -> list[int]:
            for i in range(30):
                server.handle(Output(0, "stdout", f"line {i}\n", 0.0))
            return [1, 2]

    server.session = Ranks()  # type: ignore[assignment]
    release = threading.Event()
    watch = server.watch

    def held(job: Any, conn: Any) -> None:  # the reply waits for the test
        release.wait()
        watch(job, conn)

    server.watch = held  # type: ignore[method-assign]
    dead, theirs = socket.socketpair()
    call = threading.Thread(target=server.serve_connection, args=(theirs,), daemon=True)
    call.start()
    wire.send_secret(dead, secret)
    wire.send(dead, wire.Call(b"", "cell 7", None))
    job = server.jobs.get(timeout=10)
    dead.close()  # the kernel dies mid-cell
    server.run_job(job)  # the cell ends on the ranks, its kernel gone
    kernel, theirs = socket.socketpair()
    follow = threading.Thread(target=server.serve_connection, args=(theirs,), daemon=True)
    with kernel:
        wire.send_secret(kernel, secret)
        wire.send(kernel, wire.Follow())
        follow.start()
        follow.join(2)  # (it answered at once: nothing missed, nothing running)
        release.set()
        frame = wire.Frames(kernel).next(10)
        assert isinstance(frame, wire.Missed), frame
        assert [e.text for e in frame.events] == [f"line {i}\n" for i in range(30)]
        assert frame.summary == "returned [1, 2]"
    call.join(10)
    follow.join(10)
    server.writer.close()


@pytest.mark.timeout(90)
def test_a_session_stopped_from_another_kernel_tells_the_running_cell_who(
    runs_here: Path, tmp_path: Path
) -> None:
    """Another kernel's stop() ended the session while this kernel's cell ran on it: the
    cell said only "interrupted"."""
    session = start(num_processes=2, detach=True, dashboard=False)
    supervisor = record.read_meta(session.path).pid
    assert supervisor is not None
    try:
        marker = tmp_path / "running"
        handle = session.submit(_sleeps(str(marker)))
        wait_until(marker.exists, 30, "the task to run on the ranks")
        other = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import notebook_launcher as nl; nl.attach({session.id!r}).stop()",
            ],
            env={**kernel_env(), "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        with pytest.raises(KeyboardInterrupt) as stopped:
            handle.result(timeout=60)
        _, err = other.communicate(timeout=60)
        assert other.returncode == 0, err
        said = str(stopped.value)
        assert f"session {session.id} was stopped by another kernel (process {other.pid}" in said
        assert "its ranks left" in said, said
        wait_until(lambda: not record.running(supervisor), 20, "the supervisor to end")
    finally:
        if record.running(supervisor):
            os.kill(supervisor, signal.SIGKILL)
