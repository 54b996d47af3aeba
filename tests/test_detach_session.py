"""Detached sessions (issue 27, item 3): ranks and their variables that outlive the kernel.

Real processes: a detached session started by ``%dist start --detach`` in an ipykernel,
a model defined on its ranks, the kernel SIGKILLed, the session attached here with
``%dist attach`` and the model read back with ``%%distributed``, then ``%dist stop``
(nothing left: not the ranks, not the supervisor, which is not our child, not the record);
the refusals (a wrong secret, another uid); Ctrl-C interrupting a cell while the session
lives on; a supervisor killed, its ranks gone with it and the next attach saying so.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import socket
import stat
import struct
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from notebook_launcher import attach, runs, start
from notebook_launcher._events import Output
from notebook_launcher._launch import detach as record
from notebook_launcher._posix import quiet_fork
from notebook_launcher._wire.supervisor import Ask, Question, Refused
from notebook_launcher._wire.supervisor import recv as _recv
from notebook_launcher._wire.supervisor import send as _send
from notebook_launcher._wire.supervisor import send_secret as _send_secret
from notebook_launcher.detached_session import SECRET, SOCKET, DetachedSession, SessionRefused
from notebook_launcher.errors import LaunchError
from notebook_launcher.ipython_extension import DistMagics

from .helpers import ROOT, Recorder, kernel_env, run_cell, shell_reply, wait_until
from .test_detach import runs_dir  # noqa: F401 - the fixture: records under a test's dir

pytestmark = pytest.mark.kernel


def _gone(pid: int, timeout: float, what: str) -> None:
    wait_until(lambda: not record.running(pid), timeout, what)


@pytest.mark.timeout(120)
def test_a_model_on_a_detached_sessions_ranks_outlives_a_killed_kernel(
    runs_dir: Path,  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    import jupyter_client
    import torch

    env = {**kernel_env(), "PYTHONPATH": str(ROOT), record.ROOT_ENV: str(runs_dir)}
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3", env=env, cwd=str(ROOT))
    try:
        out, reply, _ = run_cell(
            kc, "%load_ext notebook_launcher\n%dist start -n 2 --detach --dashboard off"
        )
        assert reply["status"] == "ok", out
        run_id = re.search(r"session (\w+) detached \(2 ranks\)", out).group(1)  # type: ignore[union-attr]
        out, reply, _ = run_cell(
            kc,
            """
            %%distributed
            import torch
            torch.manual_seed(0)
            model = torch.nn.Linear(2, 1)
            print("loaded", tuple(model.weight.shape))
            """,
        )
        assert reply["status"] == "ok", out
        assert "[rank0] loaded (1, 2)" in out and "[rank1] loaded (1, 2)" in out  # live
        kc.execute(  # a cell the kernel dies in
            "%%distributed\nimport time\nfor i in range(15):\n"
            "    print(f'step {i}', flush=True)\n    time.sleep(0.1)\nsteps = i + 1\n"
        )
        _printed(run_id, "step 2")
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
        km.provisioner.process.wait()
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    meta = record.read_meta(record.find(run_id))
    assert meta.pid is not None and record.supervisor_alive(meta)
    assert [(r.id, r.kind, r.state) for r in runs()] == [(run_id, "session", "running")]
    view = Recorder()
    attach(run_id, dashboard=view)  # the cell the kernel died in: shown whole, to its end
    for rank in (0, 1):
        assert view.lines(rank) == [f"step {i}\n" for i in range(15)]
    said = capsys.readouterr().out
    assert f"run_cell, whose kernel went away, ran on in session {run_id}: it returned" in said
    magics = DistMagics(SimpleNamespace(input_transformers_cleanup=[], user_ns={}))
    assert magics.dist(f"attach {run_id} --dashboard off") is None
    assert isinstance(magics.session, DetachedSession) and magics.session.id == run_id
    torch.manual_seed(0)
    expected = repr(torch.nn.Linear(2, 1).weight.detach().sum().item())
    values = magics.distributed("", "model.weight.detach().sum().item()")
    assert list(values) == [expected, expected]  # the model the dead kernel's cell made
    assert list(magics.distributed("", "steps")) == ["15", "15"]
    magics.dist("detach")  # let go here: it goes on
    assert magics.session is None and record.supervisor_alive(meta)
    magics.dist(f"attach {run_id} --dashboard off")
    pids = magics.dist("status").pids
    assert len(pids) == 2
    magics.dist("stop")
    for pid in (*pids, meta.pid):
        _gone(pid, 10, f"process {pid} of the stopped session to end")
    assert runs() == [] and not (runs_dir / run_id).exists()


def _printed(run_id: str, text: str) -> None:
    """Wait until every rank of the session printed ``text`` (read from its log)."""
    reader = record.EventReader(record.find(run_id))
    seen: set[int] = set()

    def both() -> bool:
        seen.update(e.rank for e in reader.read() if isinstance(e, Output) and text in e.text)
        return seen == {0, 1}

    try:
        wait_until(both, 30, f"both ranks to print {text!r}")
    finally:
        reader.close()


def _as_nobody(run_dir: Path, secret: bytes) -> str:
    """What a process of uid ``nobody`` gets from the session's socket, offering the
    right secret: the error of its connect, or the supervisor's answer."""
    r, w = os.pipe()
    pid = quiet_fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgid(65534)
            os.setuid(65534)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(str(run_dir / SOCKET))
                try:
                    _send_secret(sock, secret)
                    _send(sock, Ask(Question.STATUS))
                except (BrokenPipeError, ConnectionResetError):
                    pass  # refused at once, before our words: its answer is there to read
                said = repr(_recv(sock))
            except OSError as exc:
                said = type(exc).__name__
            os.write(w, said.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    return said


@pytest.mark.timeout(90)
def test_only_the_owner_with_the_secret_gets_in_and_ctrl_c_interrupts_only_the_cell(
    runs_dir: Path,  # noqa: F811
) -> None:
    session = start(num_processes=2, detach=True, dashboard=False)
    assert isinstance(session, DetachedSession)
    session.push(x=41)
    path = Path(session.path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for name in (SOCKET, SECRET):
        assert stat.S_IMODE((path / name).stat().st_mode) == 0o600, name
    intruder = DetachedSession(session.id, session.path)
    intruder._secret = b"0" * 32
    with pytest.raises(SessionRefused, match=f"refused .*not session {session.id}'s"):
        intruder.pull("x")
    # a refused client that sends its call only after the refusal went out still reads
    # why: the server used to close at once, and that call's send then failed (the kernel
    # said "does not answer" instead; a red clean-clone run)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(str(path / SOCKET))
        raw.sendall(struct.pack("<Q", 32) + b"0" * 32)
        time.sleep(0.3)  # the server read the secret and refused
        raw.sendall(struct.pack("<Q", 4) + b"call")
        assert isinstance(_recv(raw), Refused)
    if os.getuid() == 0:  # another user: the directory keeps it out, and were it let in...
        secret = (path / SECRET).read_bytes()
        assert _as_nobody(path, secret) == "PermissionError"
        for loosened in (runs_dir, path):
            loosened.chmod(0o711)
        (path / SOCKET).chmod(0o666)
        try:  # ... its uid is refused, even with the secret
            said = _as_nobody(path, secret)
            assert said.startswith("Refused(") and "uid 65534 may not use" in said, said
        finally:
            for loosened in (runs_dir, path):
                loosened.chmod(0o700)
            (path / SOCKET).chmod(0o600)
    assert session.pull("x") == [41, 41]  # the refusals left it intact
    with pytest.raises(ZeroDivisionError, match="division by zero") as raised:
        session.run_cell("def f(x):\n    return 1 / x\nf(0)")  # the rank's own error
    assert raised.value.launch_failure.root_cause.rank in (0, 1)  # type: ignore[attr-defined]
    main = threading.get_ident()
    threading.Timer(0.5, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt, match="interrupted"):
        session.run_cell("import time\nwhile True:\n    time.sleep(0.05)")
    assert session.pull("x") == [41, 41]  # the session lives on, its variables too
    handle = session.submit(time.sleep, 60)
    assert handle.cancel() and handle.cancelled()  # at once: even before it reached the ranks
    assert session.run(int, 7) == [7, 7]
    pids = session.status().pids
    meta = record.read_meta(session.path)
    assert meta.pid is not None
    with pytest.MonkeyPatch.context() as patch:  # a kernel on another host, a shared home
        patch.setattr(record, "this_host", lambda: "login2")
        assert [r.state for r in runs()] == ["running"]  # by its heartbeat
        with pytest.raises(LaunchError, match=f"runs on host {meta.host}, not on this one"):
            attach(session.id)
    session.detach()
    os.kill(meta.pid, signal.SIGKILL)
    for pid in pids:
        _gone(pid, 2, f"rank pid {pid} to die with its supervisor")
    assert [r.state for r in runs()] == [record.DIED]
    assert f"attach({session.id!r}) says why, and clears it" in str(runs())
    with pytest.raises(LaunchError, match=rf"the supervisor \(pid {meta.pid}\) .* died") as e:
        attach(session.id)
    assert "The last lines of its own log:\n    supervisor: " in str(e.value)  # not a path
    assert session.path not in str(e.value)
    # said once, its record goes: nothing of a dead session can be had again, and runs()
    # listed it for 7 days (issue 33, item 7)
    assert "Its record is cleared" in str(e.value)
    assert runs() == []


@pytest.mark.timeout(90)
def test_a_detached_sessions_ranks_take_on_the_kernel_as_it_is_at_start(
    runs_dir: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A session's supervisor is warm: forked by the kernel's forkserver, which started with
    the kernel's environment of then. Its ranks see the kernel's environment, directory
    and path as they are when the session starts (they saw the forkserver's)."""
    from notebook_launcher._launch import forkserver

    forkserver.get()  # started before the kernel's changes below, as in a kernel that
    # launched before
    monkeypatch.setenv("NL_SESSION_PROBE", "set after the forkserver started")
    (tmp_path / "session_probe_mod.py").write_text("VALUE = 9\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    session = start(num_processes=2, detach=True, dashboard=False)
    try:
        session.run_cell(
            "import os, session_probe_mod\n"
            "seen = (os.environ.get('NL_SESSION_PROBE'), os.getcwd(), session_probe_mod.VALUE)"
        )
        assert session.pull("seen") == [("set after the forkserver started", str(tmp_path), 9)] * 2
    finally:
        session.stop()
        forkserver.shutdown()


def test_frames_are_read_whole_whatever_the_chunks() -> None:
    """The client's reader (``_Frames``): a frame cut anywhere waits for its rest; a wait
    without a frame says None; the end of the stream is an error, never a half frame; a
    secret longer than a secret is read as none (nothing of it unpickled)."""
    from notebook_launcher._wire.supervisor import Frames as _Frames
    from notebook_launcher._wire.supervisor import recv_secret as _recv_secret

    a, b = socket.socketpair()
    with a, b:
        frames = _Frames(b)
        assert frames.next(0.01) is None
        data = pickle.dumps(("event", "x" * 1000))
        framed = len(data).to_bytes(8, "little") + data
        a.sendall(framed[:5])
        assert frames.next(0.01) is None
        a.sendall(framed[5:500])
        assert frames.next(0.01) is None
        a.sendall(framed[500:] + framed)
        assert frames.next(0.01) == frames.next(0.01) == ("event", "x" * 1000)
        _send_secret(a, b"s" * 100)
        assert _recv_secret(b) == b""
        a.close()
        with pytest.raises(ConnectionResetError):
            frames.next(0.01)


_LOOP_CELL = (
    "%%distributed\nimport time\nfor i in range(40):\n"
    "    print(f'step {i}', flush=True)\n    time.sleep(0.1)\nsteps = i + 1\n"
)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("end", ["shutdown", "restart"])
def test_a_detached_sessions_cell_outlives_a_polite_end_of_its_kernel(
    runs_dir: Path,  # noqa: F811
    end: str,
) -> None:
    """JupyterLab's Kernel -> Restart and Shut Down (jupyter_client's ``restart_kernel()``
    and ``shutdown_kernel(now=False)``) interrupt the kernel first (SIGINT to its process
    group), then ask it to shut down: the session's cell ran on as it does when the kernel
    is SIGKILLed, and the next kernel's ``%dist attach`` shows it whole, to its end (issue
    33, item 1: the interrupt reached the ranks and the cell stopped at step 5 or so)."""
    import jupyter_client

    env = {**kernel_env(), "PYTHONPATH": str(ROOT), record.ROOT_ENV: str(runs_dir)}
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3", env=env, cwd=str(ROOT))
    run_id = ""
    try:
        out, reply, _ = run_cell(
            kc, "%load_ext notebook_launcher\n%dist start -n 2 --detach --dashboard off"
        )
        assert reply["status"] == "ok", out
        run_id = re.search(r"session (\w+) detached \(2 ranks\)", out).group(1)  # type: ignore[union-attr]
        if end == "shutdown":  # the notebook's interrupt alone (no shutdown after it) still
            # interrupts the cell, and the session lives on
            msg_id = kc.execute(_LOOP_CELL.replace("step", "tick").replace("40", "4000"))
            _printed(run_id, "tick 2")
            km.interrupt_kernel()
            reply = shell_reply(kc, msg_id, timeout=60)["content"]
            assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
            out, reply, _ = run_cell(kc, "%%distributed\nprint('stopped at', i)")
            stopped = [int(n) for n in re.findall(r"stopped at (\d+)", out)]
            assert reply["status"] == "ok" and len(stopped) == 2, out
            assert max(stopped) < 3999, out
        kc.execute(_LOOP_CELL)
        _printed(run_id, "step 2")
        kc.stop_channels()
        if end == "shutdown":
            km.shutdown_kernel(now=False)
            km, kc = jupyter_client.manager.start_new_kernel(
                kernel_name="python3", env=env, cwd=str(ROOT)
            )
        else:
            km.restart_kernel()
            kc = km.client()
            kc.start_channels()
            kc.wait_for_ready(timeout=60)
        out, reply, _ = run_cell(
            kc, f"%load_ext notebook_launcher\n%dist attach {run_id} --dashboard off\n%dist stop"
        )
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert reply["status"] == "ok", out
    for rank in (0, 1):
        assert f"[rank{rank}] step 39" in out, out
    assert f"whose kernel went away, ran on in session {run_id}: it returned" in out, out
    assert f"session {run_id} stopped: 2 ranks and its supervisor ended" in out, out
    assert runs() == []
