"""Ctrl-C and kernel death, with the launching process as a real subprocess.

Jupyter's "interrupt the kernel" sends SIGINT to the kernel's whole process group;
some front ends and ``kill -INT`` reach the kernel process alone. Both must end with
KeyboardInterrupt in the caller, every worker gone and the handlers as they were.
A kernel that dies (restart, crash) takes its workers with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.kernel

SCRIPT = Path(__file__).with_name("_launch_script.py")
ROOT = Path(__file__).resolve().parents[1]


def _start(mode: str, method: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), mode, method],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, like a kernel
        env={**env, "PYTHONPATH": str(ROOT)},
    )


def _read_until(proc: subprocess.Popen[str], needle: str, count: int = 1) -> list[str]:
    seen: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if sum(needle in s for s in seen) >= count:
            return seen
    raise AssertionError(f"never saw {needle!r}; output so far:\n{''.join(seen)}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _worker_pids(lines: list[str]) -> list[int]:
    return [int(s.split("ready ")[1]) for s in lines if "ready " in s]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("target", ["process-group", "kernel-only"])
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_interrupt(kernel_env: dict[str, str], target: str, method: str) -> None:
    proc = _start("interrupt", method, kernel_env)
    try:
        lines = _read_until(proc, "ready ", count=2)
        time.sleep(0.3)  # rank 1 is inside the barrier now
        if target == "process-group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    assert "KeyboardInterrupt after" in out and "interrupted: all 2 ranks stopped" in out
    # The traceback is the caller's line, then "interrupted": not where the launch waited.
    assert "frames: ['main', 'notebook_launcher']" in out, out
    assert "summary: interrupted: all 2 ranks stopped failed: []" in out
    assert "deaths: []" in out
    assert "leftover children: []" in out
    assert "handlers restored: True" in out
    assert "again: [1, 1]" in out
    for pid in _worker_pids(lines):
        assert not _alive(pid), f"worker {pid} survived the interrupt"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_workers_die_with_the_kernel(kernel_env: dict[str, str], method: str) -> None:
    proc = _start("orphan", method, kernel_env)
    try:
        lines = _read_until(proc, "ready ", count=2)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the kernel alone dies, as in a crash
        proc.communicate(timeout=10)
    pids = _worker_pids(lines)
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "workers outlived their kernel"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("after", [0.3, 1.0])
def test_interrupt_during_the_first_forkserver_launch(
    kernel_env: dict[str, str], after: float
) -> None:
    """Ctrl-C while the forkserver itself starts (about 1 s of imports) or forks the
    ranks: the launch says it was interrupted -- no rank "died: killed by SIGKILL"."""
    proc = _start("first-start", "forkserver", kernel_env)
    try:
        _read_until(proc, "starting")
        time.sleep(after)
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    assert "KeyboardInterrupt after" in out, out
    assert "deaths: []" in out and "SIGKILL" not in out, out
    assert "summary: interrupted" in out and "failed: []" in out, out
    assert "leftover children: []" in out
    assert "again: [1, 1]" in out
