"""The launch contract at its edges (issue 10), provoked for real.

Interrupts are the kernel's, not a rank's; nothing a rank started outlives the launch;
Ctrl-C at any moment leaks nothing; a rank killed while it receives its task is a death
with a name; the forkserver outlives the thread that started it; fork never hangs on a
lock another thread of the kernel holds; output costs linear time and shows ``\\r``
progress live; a busy port is replaced; a launch inside a rank says what it is; and the
start method never changes the RNG and torch settings the user's code sees.
Signal scenarios run in a stand-in kernel process (``_edge_script.py``).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from notebook_launcher import PreflightError, WorkerDied, notebook_launcher
from notebook_launcher._events import LaunchFinished, LaunchStarted, Output, WorkerFinished
from notebook_launcher._launch import forkserver, preflight

from .helpers import Recorder

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]

SCRIPT = Path(__file__).with_name("_edge_script.py")
ROOT = Path(__file__).resolve().parents[1]
METHODS = ["fork", "forkserver", "spawn"]


def run_script(mode: str, method: str, n: int, kernel_env: dict[str, str]) -> list[dict]:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), mode, method, str(n)],
        capture_output=True,
        text=True,
        timeout=80,
        start_new_session=True,  # its own process group, like a kernel
        env={**kernel_env, "PYTHONPATH": str(ROOT)},
    )
    results = [json.loads(x[7:]) for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr  # e.g. a half-started forkserver's
    return results


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pids: list[int], timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


# --- interrupts belong to the kernel --------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_a_notebook_interrupt_is_interrupted_not_a_rank_failure(
    method: str, kernel_env: dict[str, str]
) -> None:
    """Jupyter's button signals the kernel's whole process group: 10 of 10 launches end
    "interrupted" (it was 3 of 10 when ranks shared the kernel's group)."""
    n = 2 if method == "spawn" else 10  # spawn: a fresh interpreter per rank, slow
    runs = run_script("interrupt-group", method, n, kernel_env)
    assert len(runs) == n
    for run in runs:
        assert run["caught"] == "KeyboardInterrupt", run
        assert run["summary"] == "interrupted: all 2 ranks stopped", run


def raises_keyboard_interrupt() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyboardInterrupt("my own")
    dist.barrier()


def test_a_keyboard_interrupt_raised_by_a_rank_is_that_ranks() -> None:
    rec = Recorder()
    with pytest.raises(KeyboardInterrupt) as info:
        notebook_launcher(raises_keyboard_interrupt, (), 2, dashboard=rec)
    assert info.value.launch_failure.root_cause.rank == 1  # type: ignore[attr-defined]
    (end,) = rec.of(LaunchFinished)
    assert end.summary.startswith("rank 1 raised KeyboardInterrupt") and end.root_cause_rank == 1


# --- nothing a rank started survives ---------------------------------------------------------


def starts_grandchildren(tmp: str, outcome: str) -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    one = subprocess.Popen(["sleep", "300"])
    two = subprocess.Popen(["sh", "-c", "sleep 301 | cat"])
    time.sleep(0.2)
    kids = [one.pid, two.pid]
    with open(f"/proc/{two.pid}/task/{two.pid}/children") as f:
        kids += [int(p) for p in f.read().split()]
    Path(tmp, f"rank{rank}").write_text(" ".join(map(str, kids)))
    dist.barrier()
    if outcome == "fails" and rank == 1:
        raise ValueError("rank 1 fails; rank 0 is stopped as collateral")
    if outcome == "fails":
        time.sleep(60)


@pytest.mark.parametrize("outcome", ["succeeds", "fails"])
@pytest.mark.parametrize("method", METHODS)
def test_processes_a_rank_started_die_with_the_launch(
    method: str, outcome: str, tmp_path: Path
) -> None:
    """A Popen and a shell pipeline in every rank: none outlives the launch, whether it
    returned, raised, or was stopped because another rank failed."""
    call = (starts_grandchildren, (str(tmp_path), outcome), 2)
    if outcome == "fails":
        with pytest.raises(ValueError):
            notebook_launcher(*call, start_method=method, dashboard=Recorder())
    else:
        notebook_launcher(*call, start_method=method, dashboard=Recorder())
    pids = [int(p) for r in (0, 1) for p in Path(tmp_path, f"rank{r}").read_text().split()]
    assert len(pids) >= 6
    assert wait_dead(pids, timeout=1.0) == []  # killed with the rank's group, at once


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGKILL"])
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_processes_a_rank_started_die_with_the_kernel(
    method: str, how: str, kernel_env: dict[str, str]
) -> None:
    """The kernel alone is interrupted, terminated or killed: ranks and everything they
    started are gone (the last two with nobody left to clean up but the rank's guard)."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "grandchildren", method],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**kernel_env, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    pids: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "grandchildren " in line:
            pids += [int(p) for p in line.split("grandchildren ", 1)[1].split()]
        if len(pids) >= 8:
            break
    try:
        assert len(pids) >= 8, pids
        os.kill(proc.pid, getattr(signal, how))
        assert wait_dead(pids) == []
        if how == "SIGINT":  # the kernel lives on and says so
            line = proc.stdout.readline()
            while line and not line.startswith("RESULT"):
                line = proc.stdout.readline()
            assert json.loads(line[7:]) == {"caught": "KeyboardInterrupt", "children": []}
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


# --- Ctrl-C at any moment leaks nothing ------------------------------------------------------


def test_ctrl_c_while_the_forkserver_starts_leaks_nothing(kernel_env: dict[str, str]) -> None:
    runs = run_script("startup-interrupt", "forkserver", 3, kernel_env)
    *interrupted, end = runs
    assert [r["caught"] for r in interrupted] == ["KeyboardInterrupt"] * 3
    assert end["fds_after"] == end["fds_before"], end
    assert end["children"] == [] and end["again"] == [7, 7]


@pytest.mark.parametrize("method", METHODS)
def test_bursts_of_ctrl_c_leak_nothing(method: str, kernel_env: dict[str, str]) -> None:
    *runs, end = run_script("burst", method, 1 if method == "spawn" else 3, kernel_env)
    assert all(r["caught"] == "KeyboardInterrupt" and r["children"] == [] for r in runs), runs
    assert len({r["fds"] for r in runs}) == 1, runs  # flat from one burst to the next
    assert end["fds_after"] <= end["fds_before"], end


# --- a rank killed while it receives its task -------------------------------------------------


def _children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def kill_new_ranks(parent: int, old: set[int], stop: threading.Event, killed: list[int]) -> None:
    """Kill the second rank that appears under ``parent`` (rank 1) as soon as it does."""
    seen: list[int] = []
    while not stop.is_set():
        try:
            kids = _children_of(parent)
        except FileNotFoundError:
            return
        seen += [k for k in kids if k not in seen and k not in old]
        if len(seen) >= 2 and not killed:
            os.kill(seen[1], signal.SIGKILL)
            killed.append(seen[1])
        time.sleep(0.001)


@pytest.mark.filterwarnings("ignore::notebook_launcher.errors.LargePayloadWarning")
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_rank_killed_while_it_receives_a_large_task_is_a_death(method: str) -> None:
    payload = b"x" * (300 << 20)  # the closure of a function that captured a big array
    if method == "forkserver":
        forkserver.get()
    parent = forkserver.pid() if method == "forkserver" else os.getpid()
    assert parent is not None
    stop, killed = threading.Event(), []
    old = set(_children_of(parent))
    watcher = threading.Thread(target=kill_new_ranks, args=(parent, old, stop, killed))
    watcher.start()
    before = len(os.listdir("/proc/self/fd"))
    try:
        with pytest.raises(WorkerDied) as info:
            notebook_launcher(len, (payload,), 2, start_method=method, dashboard=Recorder())
    finally:
        stop.set()
        watcher.join()
    message = str(info.value)
    assert "rank 1 of 2 died" in message and "SIGKILL" in message, message
    assert "while receiving its task" in message and "out of memory" in message, message
    assert len(os.listdir("/proc/self/fd")) <= before


# --- the forkserver outlives the thread that started it ---------------------------------------


def test_the_forkserver_outlives_the_thread_that_started_it() -> None:
    forkserver.shutdown()
    got: list[Any] = []
    first = threading.Thread(
        target=lambda: got.append(
            notebook_launcher(os.getpid, (), 2, start_method="forkserver", dashboard=Recorder())
        )
    )
    first.start()
    first.join()
    server = forkserver.pid()
    assert server is not None and len(got) == 1
    time.sleep(0.3)  # a parent-death signal would have fired by now
    assert forkserver.pid() == server
    assert (
        len(notebook_launcher(os.getpid, (), 2, start_method="forkserver", dashboard=Recorder()))
        == 2
    )
    assert forkserver.pid() == server


# --- fork never hangs on another thread's lock --------------------------------------------------


def _logging_thread(stop: threading.Event) -> None:
    log = logging.getLogger("busy-thread-test")
    log.addHandler(logging.StreamHandler(open(os.devnull, "w")))  # noqa: SIM115
    while not stop.is_set():
        log.warning("tick")


def _rng_thread(stop: threading.Event) -> None:
    import torch

    while not stop.is_set():
        torch.randn(64)


def logs_and_draws() -> int:
    import torch

    logging.getLogger("busy-thread-test").warning("from a rank")
    return int(torch.randint(0, 10, (1,)).item())


@pytest.mark.parametrize("work", [_logging_thread, _rng_thread])
def test_a_busy_kernel_thread_makes_the_launcher_avoid_fork(work: Any) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=work, args=(stop,), name="busy-worker")
    thread.start()
    try:
        for _ in range(3):
            rec = Recorder()
            assert len(notebook_launcher(logs_and_draws, (), 2, dashboard=rec)) == 2
            (started,) = rec.of(LaunchStarted)
            assert started.start_method == "forkserver"
            assert "'busy-worker'" in started.start_reason
    finally:
        stop.set()
        thread.join()
    rec = Recorder()  # the thread is gone: it no longer decides (OpenMP still may)
    notebook_launcher(logs_and_draws, (), 2, dashboard=rec)
    assert "busy-worker" not in rec.of(LaunchStarted)[0].start_reason


def test_jupyter_machinery_threads_do_not_count_as_busy() -> None:
    class Fake(threading.Thread):
        pass

    Fake.__module__ = "ipykernel.iostream"
    stop = threading.Event()
    fake = Fake(target=stop.wait, daemon=True)
    fake.start()
    try:
        assert fake.name not in preflight.busy_threads()
    finally:
        stop.set()
        fake.join()


# --- output: linear, bounded, live ---------------------------------------------------------------


def prints_progress_then_a_long_line() -> None:
    for i in range(3):
        print(f"step {i}/3", end="\r", flush=True)
        time.sleep(0.3)
    print()
    sys.stdout.write("y" * 200_000)
    sys.stdout.flush()


def test_carriage_return_lines_arrive_live_and_endless_lines_in_pieces() -> None:
    rec = Recorder()
    notebook_launcher(prints_progress_then_a_long_line, (), 1, dashboard=rec)
    out = [e for e in rec.of(Output) if e.stream == "stdout"]
    transient = [e for e in out if e.text.endswith("\r")]
    assert [e.text for e in transient] == ["step 0/3\r", "step 1/3\r", "step 2/3\r"]
    assert transient[1].time - transient[0].time > 0.2  # each as it was drawn, not at the end
    pieces = [e.text for e in out if e.text.startswith("y")]
    assert "".join(pieces) == "y" * 200_000
    assert max(map(len, pieces)) <= 1 << 16
    (finished,) = rec.of(WorkerFinished)
    assert transient[0].time < finished.time - 0.5


# --- ports, nested launches -----------------------------------------------------------------------


def test_a_port_taken_between_bind_and_listen_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two launches bind the default port at once (SO_REUSEADDR lets both): whoever
    listens second gets EADDRINUSE from listen(), and must move like a failed bind."""
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    other.bind(("127.0.0.1", 0))
    port = other.getsockname()[1]

    class Racing(socket.socket):
        def bind(self, address: Any) -> None:
            super().bind(address)
            if address[1] == port:
                other.listen(1)  # the other launch listens first

    monkeypatch.setattr(preflight.socket, "socket", Racing)
    try:
        sock, got, note = preflight.bind_rendezvous("127.0.0.1", port, 0)
        assert sock is not None
        sock.close()
    finally:
        other.close()
    assert got != port and note == f"port {port} is busy"


def launches_again() -> None:
    notebook_launcher(len, ((),), 2)


def test_a_launch_inside_a_rank_says_what_it_is() -> None:
    with pytest.raises(PreflightError, match=r"inside rank \d of a running launch"):
        notebook_launcher(launches_again, (), 2, dashboard=Recorder())


# --- the start method does not change what the user's code sees -----------------------------------


def draws() -> dict[str, Any]:
    import numpy as np
    import torch

    return {
        "torch": torch.rand(3).tolist(),
        "random": random.random(),
        "numpy": float(np.random.rand()),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "dtype": str(torch.get_default_dtype()),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "precision": torch.get_float32_matmul_precision(),
    }


@pytest.mark.parametrize("method", METHODS)
def test_the_kernels_seed_and_torch_settings_reach_every_start_method(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np
    import torch

    # torch.use_deterministic_algorithms sets this in our environment; put it back after
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")

    saved = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.get_default_dtype(),
        torch.backends.cudnn.benchmark,
        torch.get_float32_matmul_precision(),
    )
    try:
        torch.manual_seed(1234)
        random.seed(99)
        np.random.seed(7)
        torch.use_deterministic_algorithms(True)
        torch.set_default_dtype(torch.float64)
        torch.backends.cudnn.benchmark = True
        torch.set_float32_matmul_precision("medium")
        before = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        expected = draws()  # what a forked rank would compute
        torch.set_rng_state(before[0])
        random.setstate(before[1])
        np.random.set_state(before[2])
        got = notebook_launcher(draws, (), 2, start_method=method, dashboard=Recorder())
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        np.random.set_state(saved[2])
        torch.use_deterministic_algorithms(flags[0])
        torch.set_default_dtype(flags[1])
        torch.backends.cudnn.benchmark = flags[2]
        torch.set_float32_matmul_precision(flags[3])
    assert got == [expected, expected]
