"""``python -m notebook_launcher demo``: two CPU ranks train a tiny model and agree."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import notebook_launcher
from notebook_launcher._demo import format_report

pytestmark = pytest.mark.kernel

PACKAGE_PARENT = str(Path(notebook_launcher.__file__).resolve().parents[1])


@pytest.mark.timeout(90)
def test_demo_command_trains_on_two_ranks_with_identical_weights(
    kernel_env: dict[str, str],
) -> None:
    env = {**kernel_env, "PYTHONPATH": PACKAGE_PARENT}
    done = subprocess.run(
        [sys.executable, "-m", "notebook_launcher", "demo", "--steps", "60"],
        env=env,
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = re.findall(r"^\s+(\d)\s+(\d+)\s+([\d.]+)\s+([0-9a-f]{12})$", done.stdout, re.M)
    assert [r[0] for r in rows] == ["0", "1"], done.stdout
    assert [int(r[1]) for r in rows] == [60 * 16, 60 * 16]  # 60 steps of 16 samples per rank
    assert rows[0][3] == rows[1][3]  # the same weights on both ranks
    assert all(float(r[2]) < 0.5 for r in rows)  # it learned (initial loss is ~14)
    assert "All 2 ranks hold identical weights" in done.stdout


def test_report_says_when_ranks_disagree() -> None:
    base = {"engine": "DDP", "samples": 16, "loss": 0.1, "weights": [1.0]}
    lines = format_report(
        [{**base, "rank": 0, "checksum": "aaa"}, {**base, "rank": 1, "checksum": "bbb"}], 1.0
    )
    assert lines[1].split() == ["0", "16", "0.100000", "aaa"]
    assert lines[3] == "The ranks' weights differ: gradients were NOT synchronised."
