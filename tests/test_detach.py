"""Detached runs (issue 27): a run that outlives the kernel that started it.

Real processes: a detached 2-rank CPU run started in an ipykernel that is then SIGKILLed,
attached from this process (every output line and the result); a run stopped from its
handle (nothing left); a supervisor SIGKILLed (its ranks gone within 2 s, the cause said on
attach); a supervisor forked warm by the forkserver that holds none of its fds, and one
started cold where the forkserver cannot be had; the refusals (an unknown id, a record
others could read). The record's own codec
is tested without processes. Each detached run's supervisor is not this process's child:
each test waits for it to be gone (the autouse fixtures see only our children).
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from notebook_launcher import attach, notebook_launcher, runs
from notebook_launcher._events import LaunchFinished, LaunchStarted, Output, WorkerStarted
from notebook_launcher._launch import detach as record
from notebook_launcher._launch import forkserver
from notebook_launcher._posix import quiet_fork
from notebook_launcher.detached import RunHandle
from notebook_launcher.errors import LaunchError, PreflightError
from notebook_launcher.ipython_extension import DistMagics
from notebook_launcher.ui.text import HISTORY_LINES as TEXT_HISTORY_LINES
from notebook_launcher.ui.text import TextView

from .helpers import ROOT, Recorder, kernel_env, run_cell, wait_until

pytestmark = pytest.mark.kernel


@pytest.fixture
def runs_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Run records under a directory of this test's (the kernels it starts get it too),
    in one that any user may pass through: the records' own modes are what keeps others
    out (``_as_nobody``)."""
    base = Path(tempfile.mkdtemp(prefix="nl-runs-"))
    base.chmod(0o711)
    root = base / "runs"
    monkeypatch.setenv(record.ROOT_ENV, str(root))
    try:
        yield root
    finally:
        for path in record.records():  # a failed test: its supervisors must not outlive it
            with contextlib.suppress(OSError, ValueError):  # (a record made not ours)
                meta = record.read_meta(path)
                if meta.pid is not None and record.supervisor_alive(meta):
                    os.kill(meta.pid, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


def _gone(pid: int, timeout: float, what: str) -> None:
    wait_until(lambda: not record.running(pid), timeout, what)


def _forkserver_up() -> int:
    """The kernel's forkserver's pid: running, or started behind its first detached run
    (which goes to a fresh interpreter's supervisor rather than wait for the server)."""
    wait_until(lambda: forkserver.pid() is not None, 30, "the forkserver to start")
    server = forkserver.pid()
    assert server is not None
    return server


def _meta(run_id: str) -> record.Meta:
    return record.read_meta(record.find(run_id))


def _ranks_running(run_id: str, timeout: float = 60) -> dict[int, int]:
    """rank -> pid, once both ranks of the run have started and printed (read from its
    log)."""
    reader = record.EventReader(record.find(run_id))
    pids: dict[int, int] = {}
    printed: set[int] = set()

    def started() -> bool:
        for e in reader.read():
            if isinstance(e, WorkerStarted):
                pids[e.rank] = e.pid
            elif isinstance(e, Output):
                printed.add(e.rank)
        return len(pids) == len(printed) == 2

    try:
        wait_until(started, timeout, "both ranks of the detached run to start and print")
    finally:
        reader.close()
    return pids


def _as_nobody(run_dir: Path, supervisor: int) -> int:
    """What a process of another user (``nobody``) could do to a run: bit 0, read its
    output; bit 1, read its meta file; bit 2, signal its supervisor."""
    pid = quiet_fork()
    if pid == 0:
        could = 0
        try:
            os.setgid(65534)
            os.setuid(65534)
            for bit, name in ((0b001, record.EVENTS), (0b010, record.META)):
                try:
                    with open(run_dir / name, "rb") as f:
                        f.read(1)
                    could |= bit
                except PermissionError:
                    pass
            try:
                os.kill(supervisor, 0)
                could |= 0b100
            except PermissionError:
                pass
        finally:
            os._exit(could)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _steps(n: int, pause: float) -> Any:
    def steps() -> int:
        import time

        import torch.distributed as dist

        for i in range(n):
            print(f"step {i}", flush=True)
            time.sleep(pause)
        return dist.get_rank() * 10

    return steps


@pytest.mark.timeout(120)
def test_a_run_outlives_a_killed_kernel_and_attach_gets_every_line(
    runs_dir: Path, tmp_path: Path
) -> None:
    import jupyter_client

    gate = tmp_path / "kernel-killed"

    env = {**kernel_env(), "PYTHONPATH": str(ROOT), record.ROOT_ENV: str(runs_dir)}
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3", env=env, cwd=str(ROOT))
    try:
        out, reply, _ = run_cell(
            kc,
            """
            from notebook_launcher import notebook_launcher

            def train(n, gate):
                import os, time
                import torch.distributed as dist
                for i in range(n):
                    print(f"step {i} of rank {dist.get_rank()}", flush=True)
                    while i == 5 and not os.path.exists(gate):  # until the kernel is dead
                        time.sleep(0.05)
                    time.sleep(0.1)
                return dist.get_rank() + 100

            handle = notebook_launcher(train, args=(20, GATE), num_processes=2, detach=True,
                                       dashboard=False)
            print("ID", handle.id)
            """.replace("GATE", repr(str(gate))),
        )
        assert reply["status"] == "ok", out
        run_id = out.split("ID ")[1].split()[0]
        assert f"run {run_id} detached" in out and f"attach({run_id!r})" in out
        out, reply, _ = run_cell(
            kc, "%load_ext notebook_launcher\nprint(get_ipython().run_line_magic('dist', 'runs'))"
        )
        assert f"{run_id}  " in out and "running" in out and "train" in out, out
        _ranks_running(run_id)
        os.kill(km.provisioner.process.pid, signal.SIGKILL)  # mid-run
        km.provisioner.process.wait()
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        gate.touch()  # the run goes on from step 5
    supervisor = _meta(run_id).pid
    assert supervisor is not None and record.running(supervisor)  # the run goes on
    view = Recorder()
    handle = attach(run_id, dashboard=view, keep=True)
    assert handle.result(timeout=60) == [100, 101]
    for rank in (0, 1):  # nothing lost while no kernel was attached
        assert view.lines(rank) == [f"step {i} of rank {rank}\n" for i in range(20)]
    assert view.of(LaunchFinished)[-1].ok and view.closed == 1
    assert [e.detached for e in view.of(LaunchStarted)] == [run_id]  # the header names it
    _gone(supervisor, 10, "the supervisor to exit")
    assert [(r.id, r.state) for r in runs()] == [(run_id, record.OK)]  # kept, as asked
    # its supervisor's last digest covers the whole log: the next attach reads only that
    offset, _, _ = record.read_digest(handle.path)
    assert offset == (Path(handle.path) / record.EVENTS).stat().st_size > 0
    again = Recorder()
    handle = attach(run_id, dashboard=again)  # an ended run: its whole story at once
    assert handle.done() and again.events == view.events and again.closed == 1
    assert handle.result() == [100, 101]
    assert not os.path.exists(handle.path)  # its result was taken: its record went


@pytest.mark.timeout(90)
def test_ctrl_c_detaches_and_stop_leaves_nothing(runs_dir: Path) -> None:
    forkserver.get()  # a kernel whose forkserver runs: its supervisor is forked warm
    handle = notebook_launcher(_steps(600, 0.05), num_processes=2, detach=True, dashboard=False)
    pids = _ranks_running(handle.id)
    meta = _meta(handle.id)
    # Only its user: the record's directories 0700, its files 0600 (README, Security).
    for path in (runs_dir, Path(handle.path)):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for name in (record.META, record.EVENTS, record.LOG):
        assert stat.S_IMODE((Path(handle.path) / name).stat().st_mode) == 0o600, name
    assert not (Path(handle.path) / record.TASK).exists()  # read, then removed
    if os.getuid() == 0:  # another user, where the test may become one: locked out
        assert _as_nobody(Path(handle.path), meta.pid) == 0b000
    with open(f"/proc/{meta.pid}/stat") as f:  # not our child, in a session of its own
        ppid, _, session = (int(x) for x in f.read().rsplit(") ", 1)[1].split()[1:4])
    assert ppid != os.getpid() and session != os.getsid(0)
    # forked warm by this process's forkserver, yet neither its child nor holding any of
    # their pipes or sockets (the forkserver's channel, the kernel's)
    server = forkserver.pid()
    assert server is not None and ppid != server
    assert (
        "forked by the kernel's forkserver (warm)" in (Path(handle.path) / record.LOG).read_text()
    )
    assert not _pipes_and_sockets(meta.pid) & (
        _pipes_and_sockets(os.getpid()) | _pipes_and_sockets(server)
    )
    assert [(r.id, r.state, r.ranks) for r in runs()] == [(handle.id, "running", 2)]
    wait_until(lambda: len(handle.pids) == 2, 5, "the handle to see both ranks start")
    assert "in `time.sleep(pause)`" in str(handle.stacks())
    # Ctrl-C while waiting for the result: this process stops following, the run goes on.
    main = threading.get_ident()
    threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt, match=f"detached from run {handle.id}: it goes on"):
        handle.result(timeout=30)
    assert meta.pid is not None and record.supervisor_alive(meta)
    again = DistMagics(None).dist(f"attach {handle.id} --dashboard off")  # %dist attach
    assert isinstance(again, RunHandle) and again.id == handle.id
    assert again.stop() and again.cancelled()
    for pid in (*pids.values(), meta.pid):
        _gone(pid, 10, f"process {pid} of the stopped run to end")
    assert not os.path.exists(handle.path) and runs() == []


def _pipes_and_sockets(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(("pipe:", "socket:")):
                found.add(target)
    return found


_FIRST_DETACH = """
import os, sys, threading, time
from notebook_launcher import notebook_launcher
from notebook_launcher._launch import forkserver

released = threading.Event()
start = forkserver.ForkServer.__init__
def slow_start(self, *args, **kwargs):  # a forkserver whose imports take as long as we like
    released.wait(120)
    start(self, *args, **kwargs)
forkserver.ForkServer.__init__ = slow_start

def steps():
    import torch.distributed as dist
    return dist.get_rank() * 10

handle = notebook_launcher(steps, num_processes=2, detach=True, dashboard=False)
print("RETURNED", forkserver.running() is None, flush=True)  # the server was not waited for
print("RESULT", handle.result(timeout=60), flush=True)
released.set()
deadline = time.monotonic() + 60
while forkserver.running() is None and time.monotonic() < deadline:
    time.sleep(0.05)
print("SERVER", forkserver.running() is not None, flush=True)  # up behind, for the next runs
second = notebook_launcher(steps, num_processes=2, detach=True, dashboard=False)
print("SECOND", second.result(timeout=60), flush=True)
forkserver.shutdown()
"""


@pytest.mark.timeout(120)
def test_a_kernels_first_detached_run_does_not_wait_for_its_forkserver(runs_dir: Path) -> None:
    """The first detach=True of a kernel returned only once the kernel's forkserver had
    started (its imports: 1.3-2.8 s) to fork the supervisor warm. Now it starts a fresh
    interpreter's supervisor (which imports behind the hand-over) and returns; the server
    starts behind it, with a spare supervisor ahead, for the next runs. Here the server's
    start is held back until the run has ended: the call returns, the run runs."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", _FIRST_DETACH],
        capture_output=True, text=True, timeout=110, env=kernel_env(), check=False,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "RETURNED True" in out and "RESULT [0, 10]" in out, out
    assert "SERVER True" in out and "SECOND [0, 10]" in out, out
    logs = [p / record.LOG for p in runs_dir.iterdir()] if runs_dir.exists() else []
    assert not logs  # both records taken (result() removes them)


@pytest.mark.timeout(60)
def test_without_the_forkserver_the_supervisor_starts_cold(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(forkserver, "running", lambda: None)  # as where it cannot start
    monkeypatch.setattr(forkserver, "start_behind", lambda *args, **kwargs: None)
    handle = notebook_launcher(_steps(2, 0.0), num_processes=2, detach=True, dashboard=False)
    meta = _meta(handle.id)
    assert handle.result(timeout=50) == [0, 10]
    assert meta.pid is not None
    _gone(meta.pid, 10, "the supervisor to exit")
    assert not os.path.exists(handle.path)


@pytest.mark.timeout(90)
def test_a_killed_supervisor_takes_its_ranks_and_attach_says_so(runs_dir: Path) -> None:
    handle = notebook_launcher(_steps(600, 0.05), num_processes=2, detach=True, dashboard=False)
    pids = _ranks_running(handle.id)
    handle.detach()
    meta = _meta(handle.id)
    assert meta.pid is not None
    with open(os.path.join(handle.path, record.LOG), "a") as log:  # as its stderr would
        log.write("Traceback (most recent call last):\nMemoryError: the supervisor's last word\n")
    os.kill(meta.pid, signal.SIGKILL)
    killed = time.monotonic()
    for pid in pids.values():
        _gone(pid, 2, f"rank pid {pid} to die with its supervisor")
    assert time.monotonic() - killed <= 2
    assert [r.state for r in runs()] == [record.DIED]
    # a kernel on another host (the record on a home both share) cannot look for the
    # pid: the supervisor's own host found it gone (runs() above) and wrote it down
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(record, "this_host", lambda: "login2")
        patch.setattr(record, "HEARTBEAT_STALE", 0.5)
        died = [record.DIED]
        wait_until(lambda: [r.state for r in runs()] == died, 5, "the heartbeat to go stale")
        with pytest.raises(
            LaunchError, match=rf"on host {meta.host}\) .* \(its host {meta.host} found it gone"
        ):
            attach(handle.id, dashboard=False, keep=True).result(timeout=10)
    view = Recorder()
    with pytest.raises(LaunchError, match=rf"the supervisor \(pid {meta.pid}\) .* died") as e:
        attach(handle.id, dashboard=view).result(timeout=10)
    assert view.lines(0)  # its history up to the end
    assert not view.of(LaunchFinished)[-1].ok
    # result() removed the record: the error quotes the log rather than name a file that
    # is gone by the time it is read (issue 33, item 3)
    assert not os.path.exists(handle.path)
    assert "MemoryError: the supervisor's last word" in str(e.value)
    assert handle.path not in str(e.value), str(e.value)


@pytest.mark.timeout(60)
def test_a_kernel_on_another_host_follows_and_stops_the_run_through_its_record(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record on a home both hosts share (a login node's supervisor, a kernel on a
    compute node): the run is alive by its heartbeat, followed from its log, and stopped
    by the stop file (no signal reaches another host); stacks() says where to call it."""
    handle = notebook_launcher(_steps(600, 0.05), num_processes=2, detach=True, dashboard=False)
    pids = _ranks_running(handle.id)
    handle.detach()
    meta = _meta(handle.id)
    monkeypatch.setattr(record, "this_host", lambda: "login2")  # this kernel: elsewhere now
    time.sleep(2 * record.HEARTBEAT_INTERVAL)  # beats, not its start, keep it alive
    [info] = runs()
    assert info.state == "running" and f"[supervisor on {meta.host}]" in str(info), info
    view = Recorder()
    there = attach(handle.id, dashboard=view, keep=True)
    assert view.lines(0) and view.lines(1)  # the history
    with pytest.raises(LaunchError, match=f"run on host {meta.host}, not this one"):
        there.stacks()
    assert there.stop() and there.cancelled()
    assert "a stop was asked for from another host" in (Path(there.path) / record.LOG).read_text()
    assert [(r.id, r.state) for r in runs()] == [(handle.id, record.STOPPED)]
    assert meta.pid is not None
    for pid in (*pids.values(), meta.pid):
        _gone(pid, 10, f"process {pid} of the stopped run to end")
    record.remove(there.path)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"detach": "yes"}, "detach must be True or False"),
        ({"detach": True, "cluster": object()}, "is not a cluster: pass a SlurmCluster"),
    ],
)
def test_what_cannot_be_detached_is_refused_before_anything_starts(
    runs_dir: Path, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(PreflightError, match=message):
        notebook_launcher(print, num_processes=2, **options)
    assert not runs_dir.exists()


def test_a_detached_session_on_a_cluster_is_checked_before_anything_starts(
    runs_dir: Path,
) -> None:
    """What can be checked without the nodes is checked in the kernel: no record, no
    supervisor, no job (the session on a real cluster: ``test_detach_cluster.py``)."""
    from notebook_launcher import SlurmCluster, start

    with pytest.raises(PreflightError, match="num_processes=3 does not split evenly"):
        start(3, cluster=SlurmCluster(nodes=2), detach=True, dashboard=False)
    with pytest.raises(PreflightError, match="is not a cluster"):
        start(2, cluster="slurm", detach=True, dashboard=False)  # type: ignore[arg-type]
    assert not runs_dir.exists()


def test_an_unknown_run_or_a_record_others_can_read_is_refused(runs_dir: Path) -> None:
    with pytest.raises(record.RunNotFound, match=r"no run 'nope' .*runs\(\) lists the runs"):
        attach("nope")
    with pytest.raises(record.RunNotFound):
        attach("../elsewhere")
    run_id, path = record.new_run("train")
    record.write_meta(path, record.Meta(run_id, "train", time.time(), 2, pid=None))
    os.chmod(path, 0o755)
    with pytest.raises(record.RecordNotPrivate, match=r"not private .*mode 0755.*chmod"):
        attach(run_id)
    assert runs() == []  # not listed either
    os.chmod(path, 0o700)
    os.chmod(os.path.join(path, record.META), 0o644)
    with pytest.raises(record.RecordNotPrivate, match="mode 0644"):
        attach(run_id)
    if os.getuid() == 0:  # a record another user made, where the test may make one
        os.chmod(os.path.join(path, record.META), 0o600)
        os.chown(path, 65534, 65534)
        with pytest.raises(record.RecordNotPrivate, match="owner uid 65534"):
            attach(run_id)


def test_the_event_log_is_read_whole_frames_at_a_time(tmp_path: Path) -> None:
    writer = record.EventWriter(str(tmp_path))
    reader = record.EventReader(str(tmp_path))
    assert reader.read() == []
    first = Output(0, "stdout", "hello\n", 1.0)
    writer.write(first)
    with open(tmp_path / record.EVENTS, "ab") as f:  # a frame half written
        f.write(b"\xff\x00")
    assert reader.read() == [first]
    assert reader.read() == []
    writer.close()
    reader.close()


def test_every_event_reads_back_as_written(tmp_path: Path) -> None:
    """Output lines have a compact frame of their own, every other event is pickled."""
    events = [
        WorkerStarted(0, 0, 4242, "cpu", 1.0),
        Output(0, "stdout", "", 2.0),
        Output(70000, "stderr", "héllo \x1b[1mbold\x1b[0m\r50%\r\udcff\n", 3.25),
        Output(1, "stdout", "no newline yet", -1.0),
        LaunchFinished(True, "ok", None, 1.0, 4.0),
    ]
    writer = record.EventWriter(str(tmp_path))
    for event in events:
        writer.write(event)
    writer.close()
    reader = record.EventReader(str(tmp_path))
    assert reader.read() == events
    reader.close()


def test_a_long_history_replays_into_the_text_view_as_event_by_event(
    runs_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """100,000 lines (two ranks, both streams, a progress line redrawn with \\r, a
    line in pieces): attach shows each rank's latest ``HISTORY_LINES`` as one block per
    stream, exactly as handling each event in turn shows them, after one line per rank
    that counts the older ones; ``handle.output()`` has them all."""
    run_id, path = record.new_run("train")
    meta = record.Meta(run_id, "train", 0.0, 2, state=record.OK, ended=1.0)
    events: list[Any] = [
        LaunchStarted(
            world_size=2,
            local_world_size=2,
            node_rank=0,
            num_nodes=1,
            start_method="fork",
            start_reason="test",
            master_addr="127.0.0.1",
            master_port=1,
            backend="gloo",
            ranks=(0, 1),
            time=0.0,
        ),  # fmt: skip
        *(WorkerStarted(r, r, 100 + r, "cpu", 0.0) for r in (0, 1)),
    ]
    for i in range(100_000):
        stream = "stderr" if i % 1000 == 999 else "stdout"
        events.append(Output(i % 2, stream, f"step {i}\n", 0.5))
    events += [
        Output(0, "stdout", "10%\r50%\r", 0.6),
        Output(0, "stdout", "100%\n", 0.7),
        Output(1, "stdout", "a line in ", 0.8),
        Output(1, "stdout", "pieces\n", 0.8),
        Output(1, "stderr", "an unterminated tail", 0.9),
        LaunchFinished(True, "2 ranks returned", None, 1.0, 1.0),
    ]
    writer = record.EventWriter(path)
    for event in events:
        writer.write(event)
    writer.close()
    record.write_result(path, [0, 10])
    record.write_meta(path, meta)
    one_by_one = TextView(clock=lambda: 1.0)
    for event in events:  # (attach names the run in the header)
        if isinstance(event, LaunchStarted):
            event = LaunchStarted(**{**event.__dict__, "detached": run_id})
        one_by_one.handle(event)
    one_by_one.close()
    expected = capsys.readouterr()
    assert expected.out.count("\n") > 99_000 and "[rank1] an unterminated tail" in expected.err
    writes = {"stdout": 0, "stderr": 0}

    class Counted:
        def __init__(self, name: str, inner: Any) -> None:
            self.name, self.inner = name, inner

        def write(self, text: str) -> int:
            writes[self.name] += 1
            return int(self.inner.write(text))

        def flush(self) -> None:
            self.inner.flush()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stdout", Counted("stdout", sys.stdout))
        patch.setattr(sys, "stderr", Counted("stderr", sys.stderr))
        handle = attach(run_id, dashboard=TextView(clock=lambda: 1.0))
        everything = handle.output()
        assert handle.output(1) == "".join(
            e.text for e in events if isinstance(e, Output) and e.rank == 1
        )
        assert handle.result() == [0, 10]
    shown = capsys.readouterr()

    def rank_lines(text: str, rank: int) -> list[str]:
        return [line for line in text.splitlines() if line.startswith(f"[rank{rank}] ")]

    said = [line for line in shown.out.splitlines() if "earlier line(s) not shown" in line]
    assert [line.split()[0] for line in said] == ["[rank0]", "[rank1]"], said
    for rank, notice in enumerate(said):
        assert f"handle.output({rank})" in notice
        older = int(notice.split()[2].replace(",", ""))
        kept = 0
        for got, want in ((shown.out, expected.out), (shown.err, expected.err)):
            lines = [line for line in rank_lines(got, rank) if line != notice]
            kept += len(lines)
            assert lines == rank_lines(want, rank)[len(rank_lines(want, rank)) - len(lines) :]
        assert rank_lines(shown.out, rank)[0] == notice  # before the rank's first line
        whole = len(rank_lines(expected.out, rank) + rank_lines(expected.err, rank))
        assert kept <= TEXT_HISTORY_LINES + 2 and older + kept == whole
    assert shown.out.splitlines()[-1] == expected.out.splitlines()[-1]  # the same end
    assert everything.count("\n") == 100_000 + 3 and "[rank1] a line in pieces\n" in everything
    # one block per run of lines to one stream (a stderr line every 1000), not a write
    # per line
    assert writes["stdout"] + writes["stderr"] < 500


def test_records_of_ended_runs_go_after_the_retention_time(
    runs_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(record.RETENTION_ENV, "60")
    ended = {}
    for age in (10, 100):
        run_id, path = record.new_run("train")
        meta = record.Meta(run_id, "train", 0.0, 2, state=record.OK, ended=time.time() - age)
        record.write_meta(path, meta)
        ended[age] = run_id
    dead = record.Meta("x", "train", 0.0, 2, state=record.RUNNING, pid=os.getpid(), pid_start="0")
    assert record.state_of(dead) == record.DIED  # its pid now names another process
    assert [r.id for r in runs()] == [ended[10]]
    monkeypatch.setenv(record.RETENTION_ENV, "a week")
    with pytest.raises(LaunchError, match="not a number of seconds"):
        record.retention()


@pytest.mark.timeout(30)
def test_a_detached_runs_start_method_is_its_supervisors_not_this_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The supervisor is a clean process: a kernel with CUDA initialised or busy threads
    (forkserver for its own launches) still has its detached ranks forked, and the header
    says from where, not "fast, nothing to pickle"."""
    from notebook_launcher._launch import preflight
    from notebook_launcher._launch.plan import plan_launch

    monkeypatch.setattr(preflight, "cuda_initialized", lambda: True)
    monkeypatch.setattr(preflight, "busy_threads", lambda: ["Thread-7"])
    attached = plan_launch(lambda: None, 2, use_port=0)
    detached_plan = plan_launch(lambda: None, 2, use_port=0, supervised=True)
    asked = plan_launch(lambda: None, 2, use_port=0, supervised=True, start_method="spawn")
    try:
        assert (attached.start_method, detached_plan.start_method) == ("forkserver", "fork")
        assert "CUDA is initialised" in attached.reason
        assert detached_plan.reason.startswith("from its supervisor, a clean process")
        assert (asked.start_method, asked.reason) == ("spawn", "asked for")
    finally:
        for plan in (attached, detached_plan, asked):
            plan.close()


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(") ", 1)[1].split()[1])


def _spares(server: int) -> list[int]:
    """Spare supervisors of ``server``: forks of it (the same command line), out of its
    session and no longer its children, waiting for a detached run (not the ranks they
    forked ahead: ``_blanks``)."""
    with open(f"/proc/{server}/cmdline", "rb") as f:
        command = f.read()
    found: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == server:
            continue
        pid = int(name)
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            ppid = _parent(pid)
            if f.read() == command and os.getsid(pid) != os.getsid(server) and ppid != server:
                found[pid] = ppid
    return [pid for pid, ppid in found.items() if ppid not in found]


def _blanks(spare: int) -> list[int]:
    """The ranks ``spare`` forked ahead (its children), waiting for its run."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                if _parent(int(name)) == spare:
                    out.append(int(name))
    return sorted(out)


@pytest.mark.timeout(60)
def test_a_spare_supervisor_waits_for_the_next_run_and_ends_with_the_forkserver(
    runs_dir: Path,
) -> None:
    """After a detached run the forkserver forks the next run's supervisor ahead of need
    (so that its ranks wait for no fork); that spare runs the next run, and a spare that
    no run came for ends with the server (the kernel's end): nothing is left."""
    forkserver.shutdown()  # (one started behind an earlier test's session: its spare forks none)
    first = notebook_launcher(_steps(1, 0.0), num_processes=2, detach=True, dashboard=False)
    ran_first = _meta(first.id).pid
    assert first.result(timeout=50) == [0, 10] and ran_first is not None
    _gone(ran_first, 10, "the first run's supervisor to exit")  # (a fork of the server too)
    server = _forkserver_up()
    wait_until(lambda: len(_spares(server)) == 1, 30, "a spare supervisor")
    [spare] = _spares(server)
    second = notebook_launcher(_steps(1, 0.0), num_processes=2, detach=True, dashboard=False)
    assert _meta(second.id).pid == spare  # the spare took the run
    assert second.result(timeout=50) == [0, 10]
    _gone(spare, 10, "the second run's supervisor to exit")
    wait_until(lambda: len(_spares(server)) == 1, 10, "the next spare")
    [waiting] = _spares(server)
    wait_until(lambda: len(_blanks(waiting)) == 2, 10, "the ranks it forks ahead")
    blanks = _blanks(waiting)
    forkserver.shutdown()  # as when the kernel ends
    _gone(waiting, 5, "the spare to end with its forkserver")
    for pid in blanks:
        _gone(pid, 5, "its ranks forked ahead to end with it")


def _next_spare(server: int, ranks: int) -> tuple[int, list[int]]:
    """The spare waiting for the next run, once it has forked ``ranks`` ranks ahead."""
    found: list[tuple[int, list[int]]] = []

    def ready() -> bool:
        spares = _spares(server)  # (once: the last run's supervisor may be leaving)
        found[:] = [(spares[0], _blanks(spares[0]))] if len(spares) == 1 else []
        return bool(found) and len(found[0][1]) == ranks

    # (30 s: the server may still be starting, behind the kernel's first detached run)
    wait_until(ready, 30, f"a spare with {ranks} ranks forked ahead")
    return found[0]


@pytest.mark.timeout(120)
def test_a_detached_runs_ranks_are_forked_ahead_and_take_on_the_kernel_as_it_is_at_launch(
    runs_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spare supervisor forks as many ranks as the kernel's last detached run had,
    while it waits (so that the next run's start waits for no fork). Those ranks were
    forked before the run: they take on the kernel's environment, directory and path as
    they are at the launch. A run with more ranks than were forked ahead, or with a large
    task (unpickled once in the supervisor, inherited), forks its own, and the blanks it
    did not take end; a restart forks its attempt's ranks; a run that spawns its ranks ends
    the blanks as it starts. Nothing is left."""
    forkserver.shutdown()  # (one started behind an earlier test's session: its spare forks none)
    first = notebook_launcher(_steps(1, 0.0), num_processes=2, detach=True, dashboard=False)
    assert first.result(timeout=50) == [0, 10]
    server = _forkserver_up()
    spare, blanks = _next_spare(server, 2)

    monkeypatch.setenv("NL_POOL_PROBE", "set after the spare forked")
    (tmp_path / "pool_probe_mod.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)

    def probe(payload: bytes = b"") -> tuple[int, str | None, str, int]:
        import os

        import pool_probe_mod  # type: ignore[import-not-found]

        return os.getpid(), os.environ.get("NL_POOL_PROBE"), os.getcwd(), pool_probe_mod.VALUE

    run = notebook_launcher(probe, num_processes=2, detach=True, dashboard=False)
    out = run.result(timeout=50)
    assert sorted(pid for pid, *_ in out) == blanks  # the ranks forked ahead ran it
    assert {tuple(rest) for _, *rest in out} == {("set after the spare forked", str(tmp_path), 7)}
    _gone(spare, 10, "the run's supervisor to exit")

    spare, blanks = _next_spare(server, 2)
    more = notebook_launcher(probe, num_processes=3, detach=True, dashboard=False)
    out = more.result(timeout=50)
    assert len(out) == 3 and not {pid for pid, *_ in out} & set(blanks)  # forked for it
    for pid in blanks:
        _gone(pid, 10, "the ranks it did not take to end")

    spare, blanks = _next_spare(server, 3)
    large = notebook_launcher(
        probe, args=(b"x" * (2 << 20),), num_processes=3, detach=True, dashboard=False
    )
    out = large.result(timeout=50)
    assert len(out) == 3 and not {pid for pid, *_ in out} & set(blanks)  # inherited
    for pid in blanks:
        _gone(pid, 10, "the ranks a large task did not take to end")

    spare, blanks = _next_spare(server, 3)
    marker = tmp_path / "failed-once"

    def fails_once() -> tuple[int, list[str]]:
        import os

        import torch.distributed as dist

        if dist.get_rank() == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(3)  # a death: the attempt is restarted
        kinds = []  # what its fds are: pipes, sockets, epolls...
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                kinds.append(os.readlink(f"/proc/self/fd/{fd}").split(":")[0])
        return os.getpid(), sorted(k for k in kinds if not k.startswith("/"))

    again = notebook_launcher(
        fails_once, num_processes=3, max_restarts=1, detach=True, dashboard=False
    )
    out = again.result(timeout=60)
    pids = {pid for pid, _ in out}
    assert len(out) == 3 and marker.exists() and not pids & set(blanks)  # new ranks
    # forked while the group ran, each left the group's fds behind (its siblings' pipes and
    # pidfds): every rank holds as many as rank 0 (sockets are not compared: the restart's
    # store, in the supervisor, may have accepted a rank's connection before the next fork)
    counts = [collections.Counter(k for k in kinds if k != "socket") for _, kinds in out]
    assert counts[1] == counts[0] and counts[2] == counts[0], counts
    _gone(spare, 10, "the run's supervisor to exit")
    for pid in blanks:
        _gone(pid, 10, "the first attempt's ranks to end")

    spare, blanks = _next_spare(server, 3)
    go = tmp_path / "go"

    def waits() -> int:
        import os
        import time

        while not os.path.exists(go):
            time.sleep(0.05)
        return os.getpid()

    spawned = notebook_launcher(
        waits, num_processes=3, start_method="spawn", detach=True, dashboard=False
    )
    for pid in blanks:  # spawned ranks: the forked ones go at once, not with the run
        _gone(pid, 30, "the ranks a spawn run does not use to end while it runs")
    assert not spawned.done()
    go.touch()
    assert len(spawned.result(timeout=60)) == 3
    _gone(spare, 10, "the spawn run's supervisor to exit")
    forkserver.shutdown()
