"""The launch itself: results, env, start methods, ports, output, preflight errors."""

from __future__ import annotations

import os
import runpy
import socket
import threading
import time
from pathlib import Path

import pytest

from notebook_launcher import PreflightError, SerializationError, WorkerDied, notebook_launcher
from notebook_launcher._events import (
    LaunchFinished,
    LaunchStarted,
    Output,
    WorkerExited,
    WorkerFinished,
    WorkerStarted,
)
from notebook_launcher._launch import preflight

from .helpers import Recorder

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(60)]


def report_env(tag: str) -> dict:
    import torch.distributed as dist

    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    t = __import__("torch").tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return {
        "tag": tag,
        "env": {k: os.environ[k] for k in keys},
        "mp": os.environ["ACCELERATE_MIXED_PRECISION"],
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "backend": dist.get_backend(),
        "sum": t.item(),
    }


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_results_env_and_process_group(method: str) -> None:
    rec = Recorder()
    out = notebook_launcher(
        report_env,
        args=("x",),
        num_processes=3,
        mixed_precision="bf16",
        use_port="auto",
        start_method=method,
        dashboard=rec,
    )
    assert [r["rank"] for r in out] == [0, 1, 2]
    port = out[0]["env"]["MASTER_PORT"]
    for rank, r in enumerate(out):
        assert r["tag"] == "x" and r["world"] == 3 and r["backend"] == "gloo"
        assert r["sum"] == 6.0
        assert r["mp"] == "bf16"
        assert r["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
    started = rec.of(LaunchStarted)[0]
    assert started.start_method == method and started.master_port == int(port)
    assert not [e for e in rec.of(Output) if e.stream == "stderr"]  # no warnings from us
    assert sorted(e.rank for e in rec.of(WorkerStarted)) == [0, 1, 2]
    assert sorted(e.rank for e in rec.of(WorkerFinished)) == [0, 1, 2]
    assert rec.of(LaunchFinished)[0].ok and rec.closed
    assert isinstance(rec.events[0], LaunchStarted) and isinstance(rec.events[-1], LaunchFinished)


def test_busy_port_is_replaced_and_said() -> None:
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    busy = blocker.getsockname()[1]
    try:
        rec = Recorder()
        out = notebook_launcher(report_env, ("p",), 2, use_port=str(busy), dashboard=rec)
    finally:
        blocker.close()
    started = rec.of(LaunchStarted)[0]
    assert started.master_port != busy
    assert f"port {busy} is busy" in started.start_reason
    assert out[0]["env"]["MASTER_PORT"] == str(started.master_port)


def test_free_port_is_honoured() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    out = notebook_launcher(report_env, ("p",), 2, use_port=port, dashboard=Recorder())
    assert out[0]["env"]["MASTER_PORT"] == str(port)


def chatty(lines: int) -> str:
    import sys

    rank = os.environ["RANK"]
    for i in range(lines):
        print(f"r{rank} line {i} " + "x" * 40)
    sys.stdout.write("no newline at the end")
    os.write(2, f"raw fd write from rank {rank}\n".encode())
    return "done"


def test_output_comes_back_labelled_by_rank_and_line() -> None:
    rec = Recorder()
    assert notebook_launcher(chatty, (2000,), 2, dashboard=rec) == ["done", "done"]
    for rank in (0, 1):
        lines = rec.lines(rank)
        assert lines[:2000] == [f"r{rank} line {i} " + "x" * 40 + "\n" for i in range(2000)]
        assert lines[-1] == "no newline at the end"
        assert rec.lines(rank, "stderr") == [f"raw fd write from rank {rank}\n"]


def flood_and_big_result(megabytes: int) -> object:
    import torch

    line = "y" * 1023 + "\n"
    for _ in range(megabytes * 1024):
        print(line, end="")
    return torch.arange(25_000_000, dtype=torch.int32)  # 100 MB


def test_output_flood_and_100mb_result_do_not_deadlock() -> None:
    rec = Recorder()
    out = notebook_launcher(flood_and_big_result, (2,), 2, dashboard=rec)
    for rank in (0, 1):
        assert len(rec.lines(rank)) == 2 * 1024
        assert out[rank].numel() == 25_000_000 and int(out[rank][-1]) == 24_999_999


def add_kwargs(a: int, *, b: int) -> int:
    return a + b + int(os.environ["RANK"])


def test_kwargs_extension() -> None:
    assert notebook_launcher(add_kwargs, (1,), 2, kwargs={"b": 10}, dashboard=Recorder()) == [
        11,
        12,
    ]


def test_text_view_is_default_outside_a_notebook(capfd: pytest.CaptureFixture[str]) -> None:
    notebook_launcher(chatty, (1,), 2, dashboard=False)
    out = capfd.readouterr().out
    assert "[rank0] r0 line 0" in out and "[rank1] r1 line 0" in out


def test_cell_redefinition_ships_new_code_on_spawn() -> None:
    """A function defined in __main__ (a notebook cell) travels by value, freshly each time."""
    ns: dict = {"__name__": "__main__"}
    exec("def f():\n    return 'first'\n", ns)
    first = notebook_launcher(ns["f"], (), 2, start_method="forkserver", dashboard=Recorder())
    exec("def f():\n    return 'second'\n", ns)
    second = notebook_launcher(ns["f"], (), 2, start_method="forkserver", dashboard=Recorder())
    assert first == ["first", "first"] and second == ["second", "second"]


def which_are_imported(*names: str) -> list[bool]:
    import sys

    return [name in sys.modules for name in names]


def test_a_forkserver_rank_starts_with_what_the_kernel_imported_of_warm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The modules of ``forkserver.WARM`` the kernel has (torch._dynamo: every optimizer's
    first construction imports it, 1.5-2.5 s) the server imports, once, before it forks:
    its ranks start with them, as ranks forked by the kernel do; one the kernel lacks it does
    not import. Stand-ins here: two small modules nothing else imports."""
    import sys
    import zipapp  # noqa: F401 - the kernel has it

    from notebook_launcher._launch import forkserver

    assert "pyclbr" not in sys.modules
    monkeypatch.setattr(forkserver, "WARM", ("zipapp", "pyclbr"))
    sent: list = []
    send = forkserver.send
    monkeypatch.setattr(
        forkserver, "send", lambda sock, m, fds=None: (sent.append(m), send(sock, m, fds))
    )
    for _ in range(2):
        out = notebook_launcher(
            which_are_imported, ("zipapp", "pyclbr"), 2, start_method="forkserver",
            dashboard=Recorder(),
        )  # fmt: skip
        assert out == [[True, False], [True, False]]
    assert [m.preload for m in sent] == [("zipapp",), (), (), ()]  # the first time only


def test_the_forkserver_imports_no_warm_module_that_touches_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The forkserver (and a node's agent) must never touch CUDA (its ranks could not use
    it): a module of ``WARM`` is imported in a probe child first, and in the server only if
    that left CUDA untouched (neither torch's CUDA state nor the driver library loaded)."""
    import sys

    from notebook_launcher import _posix

    assert not _posix.cuda_touched()  # this process: no CUDA
    monkeypatch.setattr(_posix, "_touch_cuda", set())  # (what this test refuses: its own)
    monkeypatch.setattr(sys.modules["torch"].cuda, "is_initialized", lambda: True)
    assert _posix.cuda_touched()
    for name, touches in (("pyclbr", True), ("tabnanny", False)):
        assert name not in sys.modules
        # (the probe child sees the patch: it runs this process's code after the fork)
        monkeypatch.setattr(_posix, "cuda_touched", lambda touches=touches: touches)
        _posix.import_without_cuda((name,))
        assert (name in sys.modules) is not touches, name
    # one found touching CUDA is not probed again (an agent is asked at every launch, and
    # each probe costs the import: 1.5-2.5 s for torch._dynamo)
    probes: list[int] = []
    fork = _posix.quiet_fork
    monkeypatch.setattr(_posix, "quiet_fork", lambda: probes.append(1) or fork())
    _posix.import_without_cuda(("pyclbr", "tabnanny"))
    assert probes == [] and "pyclbr" not in sys.modules


_RUN_PATH_SCRIPT = """
import os
from notebook_launcher import notebook_launcher
from tests.helpers import Recorder

class Box:
    def __init__(self, value):
        self.value = value

def helper(k):
    return Box(k + int(os.environ["RANK"]))

def train(k):
    return helper(k)

results = notebook_launcher(train, (10,), 2, start_method="forkserver", dashboard=Recorder())
"""


def test_a_script_run_by_runpy_ships_its_functions_by_value(tmp_path: Path) -> None:
    """``runpy.run_path`` (as ``%run`` and script runners do) runs a script as the module
    ``<run_path>``, which no rank can import: its functions and classes travel by value, and
    what the ranks return is an instance of the script's own class."""
    script = tmp_path / "train.py"
    script.write_text(_RUN_PATH_SCRIPT)
    namespace = runpy.run_path(str(script))
    results = namespace["results"]
    assert [r.value for r in results] == [10, 11]
    assert all(type(r) is namespace["Box"] for r in results)


# --- preflight: nothing starts ---------------------------------------------------------


def noop() -> None:
    return None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"function": 3}, "needs a function"),
        ({"num_processes": 0}, "at least 1"),
        ({"num_processes": -2}, "at least 1"),
        ({"num_processes": "2"}, "whole number"),
        ({"num_processes": 2.0}, "whole number"),
        ({"num_processes": True}, "whole number"),
        ({"num_processes": None}, "no GPU"),
        ({"args": 5}, "args=(value,)"),
        ({"mixed_precision": "fp32"}, "Unknown mixed_precision"),
        ({"mixed_precision": "fp8"}, "'fp8' is not supported"),
        ({"mixed_precision": None}, "mixed_precision=None is not a mixed precision: leave it"),
        ({"mixed_precision": ""}, "Unknown mixed_precision ''"),
        ({"start_method": "thread"}, "start_method='thread'"),
        ({"use_port": "http"}, "use_port must be"),
        ({"max_restarts": -1}, "max_restarts must be a whole number >= 0"),
        ({"max_restarts": 1.5}, "max_restarts must be a whole number >= 0"),
        ({"rdzv_backend": "etcd"}, "rdzv_backend='etcd' is not supported"),
        ({"rdzv_conf": ["join_timeout"]}, "rdzv_conf must be a dict"),
        ({"rdzv_id": ""}, "rdzv_id must be a non-empty string"),
        ({"join_timeout": 0}, "join_timeout must be > 0"),
        ({"restart_on_exception": "yes"}, "restart_on_exception must be True, False"),
        ({"raise_child_failed": "yes"}, "raise_child_failed must be True, False"),
        ({"log_line_prefix_template": 3}, "log_line_prefix_template must be a string"),
        ({"num_nodes": 2, "use_port": "auto"}, "every node needs the same rendezvous port"),
        ({"rdzv_endpoint": "host:http", "rdzv_backend": "c10d"}, "port must be a number"),
        ({"node_rank": 2}, "node_rank must be in"),
        ({"grace_period": None}, "grace_period must be a number"),
        ({"grace_period": "1"}, "grace_period must be a number"),
        ({"grace_period": -1.0}, "grace_period must be >= 0"),
        ({"grace_period": float("nan")}, "grace_period must be >= 0"),
        ({"dashboard": "fancy"}, "dashboard must be True, False"),
        ({"dashboard": object()}, "is not a view"),
        ({"master_addr": None}, "master_addr must be"),
        ({"kwargs": [1]}, "kwargs must be a dict"),
    ],
)
def test_preflight_errors(kwargs: dict, message: str) -> None:
    """Every argument is checked before anything starts: a wrong one is the launcher's
    clear error, never a TypeError from inside it that hides the rank's real one."""
    call = {"function": noop, "num_processes": 2, "dashboard": Recorder(), **kwargs}
    with pytest.raises(PreflightError, match=message.replace("(", r"\(").replace(")", r"\)")):
        notebook_launcher(**call)


class ShardError(Exception):
    pass


def _odd_rank_fails() -> None:
    import time

    if int(os.environ["RANK"]) == 1:
        raise ShardError("bad shard on rank 1")
    time.sleep(30)  # stopped as collateral: not a failure of its own


def test_raise_child_failed_is_elastics_error_with_the_ranks_own_as_cause() -> None:
    """For code written against Accelerate's launcher that catches ChildFailedError."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with pytest.raises(ChildFailedError, match="bad shard on rank 1") as info:
        notebook_launcher(
            _odd_rank_fails, num_processes=2, dashboard=Recorder(), raise_child_failed=True
        )
    assert list(info.value.failures) == [1]  # rank 0 was stopped, it did not fail
    rank, failure = info.value.get_first_failure()
    assert (rank, failure.exitcode, failure.local_rank) == (1, 1, 1)
    assert type(info.value.__cause__) is ShardError  # the rank's own, the notebook's class
    assert info.value.name == "_odd_rank_fails"
    with pytest.raises(ShardError):  # and by default: the rank's own exception
        notebook_launcher(_odd_rank_fails, num_processes=2, dashboard=Recorder())


def test_fork_with_cuda_initialised_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Logic test on CPU; tests/test_gpu.py proves the real detection on a GPU machine."""
    monkeypatch.setattr(preflight, "cuda_initialized", lambda: True)
    with pytest.raises(PreflightError, match="restart the kernel"):
        notebook_launcher(noop, (), 2, start_method="fork", dashboard=Recorder())
    assert preflight.resolve_start_method(None, True)[0] == "forkserver"


def test_process_group_in_parent_is_refused() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(PreflightError, match="destroy_process_group"):
            notebook_launcher(noop, (), 2, dashboard=Recorder())
    finally:
        dist.destroy_process_group()


def test_state_in_parent_is_refused() -> None:
    from notebook_launcher.state import PartialState

    PartialState()
    with pytest.raises(PreflightError, match="PartialState"):
        notebook_launcher(noop, (), 2, dashboard=Recorder())


def test_unpicklable_args_named_before_start() -> None:
    lock = threading.Lock()
    with pytest.raises(SerializationError, match=r"args.*\[1\]\[0\]|lock"):
        notebook_launcher(noop_args, (lock,), 2, start_method="spawn", dashboard=Recorder())


def noop_args(*_: object) -> None:
    return None


def test_unpicklable_closure_named_before_start() -> None:
    lock = threading.Lock()

    def uses_lock() -> bool:
        return lock.locked()

    with pytest.raises(SerializationError, match="closure lock"):
        notebook_launcher(uses_lock, (), 2, start_method="forkserver", dashboard=Recorder())


def test_closure_works_with_fork_without_pickling() -> None:
    lock = threading.Lock()

    def uses_lock() -> bool:
        return lock.locked()

    out = notebook_launcher(uses_lock, (), 2, start_method="fork", dashboard=Recorder())
    assert out == [False, False]


FORK_AFTER_OPENMP = """
import torch
from notebook_launcher import notebook_launcher
from notebook_launcher._events import LaunchStarted

class Keep:
    def __init__(self): self.events = []
    def handle(self, e): self.events.append(e)
    def tick(self): pass
    def close(self): pass

def work():
    x = torch.ones(256, 256)
    return (x @ x).sum().item(), torch.get_num_threads()

def launch(**kw):
    keep = Keep()
    out = notebook_launcher(work, (), 2, dashboard=keep, **kw)
    started = [e for e in keep.events if isinstance(e, LaunchStarted)][0]
    print(started.start_method, "|", started.start_reason, "|", out)

launch()                                     # nothing parallel ran here yet: fork
x = torch.ones(512, 512); x @ x               # now this kernel's OpenMP pool runs
import time; from notebook_launcher._launch import preflight
t = time.monotonic(); safe = preflight.fork_is_safe()  # its probe child is stuck at once
print("probe", safe, time.monotonic() - t)
launch()                                     # fork would hang: the forkserver takes over
launch(start_method="fork")                  # asked for: ranks get one thread, no hang
from notebook_launcher._launch import forkserver; forkserver.shutdown()
"""


@pytest.mark.timeout(90)
def test_fork_after_the_kernel_used_openmp_does_not_hang(kernel_env: dict) -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", FORK_AFTER_OPENMP],
        capture_output=True,
        text=True,
        timeout=80,
        env={**kernel_env, "PYTHONPATH": root, "OMP_NUM_THREADS": ""},
    )
    assert out.returncode == 0, out.stderr
    probe = [line.split() for line in out.stdout.splitlines() if line.startswith("probe")]
    # told once the child is seen stuck, not at the probe's 2 s timeout
    assert probe[0][1] == "False" and float(probe[0][2]) < 0.8 * preflight.FORK_PROBE_TIMEOUT
    lines = [line for line in out.stdout.splitlines() if "|" in line]
    assert lines[0].startswith("fork | fast")
    assert lines[1].startswith("forkserver | this kernel already ran a multi-threaded torch op")
    assert lines[2].startswith("fork | asked for; ranks use 1 CPU thread")
    assert lines[2].endswith("[(16777216.0, 1), (16777216.0, 1)]")


def test_large_captured_object_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    from notebook_launcher import _serialization
    from notebook_launcher.errors import LargePayloadWarning

    monkeypatch.setattr(_serialization, "LARGE_PAYLOAD_BYTES", 1 << 20)
    big = b"z" * (2 << 20)

    def uses_big() -> int:
        return len(big)

    with pytest.warns(LargePayloadWarning, match="pickle to 2 MiB"):
        out = notebook_launcher(uses_big, (), 2, start_method="forkserver", dashboard=Recorder())
    assert out == [2 << 20, 2 << 20]


def state_view() -> tuple:
    from notebook_launcher import PartialState

    s = PartialState()
    return (s.process_index, s.num_processes, str(s.distributed_type), s.mixed_precision)


def test_mixed_precision_and_world_reach_the_workers_state() -> None:
    out = notebook_launcher(state_view, (), 2, mixed_precision="bf16", dashboard=Recorder())
    assert [o[:2] for o in out] == [(0, 2), (1, 2)]
    assert all("MULTI_CPU" in o[2] and o[3] == "bf16" for o in out)


def exits_cleanly() -> None:
    import sys

    sys.exit(0 if os.environ["RANK"] == "1" else None)


def test_sys_exit_zero_is_not_a_success() -> None:
    """Exit code 0 without a value (``sys.exit(0)``, ``sys.exit()``): the README lists
    ``sys.exit`` among deaths, and a value that did not come back is never a success
    (issue 25 item 9; it was ``ok`` with None)."""
    rec = Recorder()
    with pytest.raises(WorkerDied, match=r"died without raising an exception \(exit code 0\)"):
        notebook_launcher(exits_cleanly, (), 2, dashboard=rec)
    assert not rec.of(WorkerFinished)
    assert rec.of(WorkerExited)
    (end,) = rec.of(LaunchFinished)
    assert "died: exit code 0" in end.summary


def test_leak_guard_sees_a_listening_port() -> None:
    """The autouse guard's port check is real: a socket listening here is seen."""
    from .conftest import listening_ports

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    try:
        assert sock.getsockname()[1] in listening_ports()
    finally:
        sock.close()


def test_the_package_launches_as_the_function_does() -> None:
    """The README's detach example did ``from notebook_launcher import notebook_launcher``,
    then ``import notebook_launcher; notebook_launcher.runs()`` in the same kernel: the
    name became the package, and the next ``notebook_launcher(fn, num_processes=2)`` raised
    "TypeError: 'module' object is not callable" (issue 33, item 2). It launches."""
    import notebook_launcher as package

    rec = Recorder()
    assert package(abs, args=(-3,), num_processes=2, dashboard=rec) == [3, 3]
    assert len(rec.of(LaunchFinished)) == 1
    with pytest.raises(PreflightError, match="num_processes"):  # its errors are the function's
        package(abs, args=(-3,), num_processes=0, dashboard=False)


def test_every_argument_is_documented() -> None:
    """``kwargs=`` was in the signature and nowhere said (issue 33, item 7): every argument
    of ``notebook_launcher()`` is named in its docstring, and the README says ``kwargs=``."""
    import inspect

    doc = notebook_launcher.__doc__ or ""
    for name in inspect.signature(notebook_launcher).parameters:
        assert f"``{name}``" in doc or f"``{name}=" in doc, name
    assert doc.startswith("Run ``function(*args, **kwargs)``")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "kwargs={" in readme


def _imports_the_slow_module() -> int:
    import nl_slow_import  # noqa: F401 - its import waits for the test's flag

    return 1


def test_a_rank_says_what_it_imports_in_its_first_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lesson 06's ranks read "running" for 15 s while they imported transformers (issue 33,
    item 7): a rank inside an import says so ("importing nl_slow_import"), and that it is
    over. The import here lasts until the test saw both ranks say it."""
    from notebook_launcher._events import WorkerPhase
    from notebook_launcher.ui.model import LaunchModel

    from .helpers import wait_until

    flag = tmp_path / "go"
    (tmp_path / "nl_slow_import").mkdir()
    (tmp_path / "nl_slow_import" / "__init__.py").write_text(
        f"import os, time\nwhile not os.path.exists({str(flag)!r}):\n    time.sleep(0.02)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    rec = Recorder()
    handle = notebook_launcher(
        _imports_the_slow_module, num_processes=2, dashboard=rec, block=False, start_method="fork"
    )
    try:

        def said() -> set[int]:
            return {e.rank for e in rec.of(WorkerPhase) if e.phase == "importing nl_slow_import"}

        wait_until(lambda: said() == {0, 1}, 30, "both ranks to say what they import")
        model = LaunchModel()
        for event in list(rec.events):
            model.apply(event)
        assert [model.ranks[r].status_text(time.time()) for r in (0, 1)] == [
            "importing nl_slow_import"
        ] * 2
    finally:
        flag.write_text("")
    assert handle.result(timeout=30) == [1, 1]
    for rank in (0, 1):  # then that it is over
        phases = [e.phase for e in rec.of(WorkerPhase) if e.rank == rank]
        assert phases[-2:] == ["importing nl_slow_import", ""], phases


def _boom_on_rank_1() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom")
    return 0


def test_a_launch_is_decided_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 34: ``decide()`` runs once per end -- the view's ``LaunchFinished`` and the
    caller's value come from the same outcome (it ran twice: once for the view, once for
    the value), blocking or not, ok or failed."""
    import notebook_launcher.launcher as launcher_module

    decided: list[str] = []
    real = launcher_module.decide

    def counting(end: object) -> object:
        outcome = real(end)  # type: ignore[arg-type]
        decided.append(outcome.kind)
        return outcome

    monkeypatch.setattr(launcher_module, "decide", counting)
    assert notebook_launcher(os.getpid, num_processes=2, dashboard=False) != []
    assert decided == ["ok"]
    with pytest.raises(ValueError, match="boom"):
        notebook_launcher(_boom_on_rank_1, num_processes=2, dashboard=False)
    assert decided == ["ok", "failed"]
    handle = notebook_launcher(os.getpid, num_processes=2, dashboard=False, block=False)
    assert len(handle.result(timeout=30)) == 2
    assert decided == ["ok", "failed", "ok"]
