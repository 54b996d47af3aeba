"""The GPU machine's one-call check (``bench/gpu.sh`` -> ``bench/gpu.py``) survives its first
run: a section that fails or outlives its limit says so, prints its last 40 lines and leaves
nothing running (a daemon it started in a session of its own included), the others still run,
the outer limit's SIGTERM ends it all, and the JSON and the table are written whatever happens.
(The whole rehearsal on CPU, every section with CUDA emulated, takes minutes:
``bash bench/gpu.sh --rehearse``; the README's Development section.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _check(out: Path, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--out", str(out), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_failing_and_a_cut_section_leave_nothing_and_the_rest_runs(tmp_path: Path) -> None:
    proc = _check(tmp_path, "--only", "selftest_fail,selftest_cut,diagnostics", "--budget", "90")
    output, _ = proc.communicate(timeout=100)
    assert proc.returncode == 0, output
    results = json.loads((tmp_path / "results.json").read_text())["sections"]
    table = (tmp_path / "table.md").read_text()
    assert results["selftest_fail"]["status"] == "failed (exit 1)"
    assert "line 49" in table and "line 9\n" not in table  # its last 40 lines, no more
    assert "RuntimeError: this section fails on purpose" in table
    assert results["selftest_cut"]["status"] == "cut by its timeout (4 s)"
    daemon = int(next(x for x in table.splitlines() if x.startswith("daemon ")).split()[1])
    assert not _alive(daemon)  # it had left the section's process group: still ended
    assert results["diagnostics"]["status"] == "ok"  # and the next section ran


def test_the_outer_limit_ends_everything_and_the_results_are_written(tmp_path: Path) -> None:
    proc = _check(
        tmp_path, "--only", "selftest_cut", "--budget", "90", "--limit", "selftest_cut=60"
    )
    log, table = tmp_path / "selftest_cut.log", tmp_path / "table.md"
    deadline = time.monotonic() + 60
    while "TABLE daemon " not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # what gpu.sh's `timeout` sends at the outer limit
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 124, output
    text = table.read_text()
    daemon = int(next(x for x in text.splitlines() if x.startswith("daemon ")).split()[1])
    assert "stopped by signal 15 (the outer time limit)" in text
    assert not _alive(daemon)
    assert json.loads((tmp_path / "results.json").read_text())["sections"]["selftest_cut"]
