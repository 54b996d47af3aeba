"""Detached runs and sessions under attack (issue 32), each provoked for real.

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
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from notebook_launcher import attach, notebook_launcher, runs
from notebook_launcher._launch import detach as record
from notebook_launcher._posix import quiet_fork
from notebook_launcher.errors import LaunchError

from .helpers import wait_until

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
