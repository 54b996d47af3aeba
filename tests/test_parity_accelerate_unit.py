"""Accelerate 1.15.0's own unit tests, run against notebook_launcher.

(Draft runner; the expectations table follows.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from . import _parity_shim as shim
from .helpers import kernel_env

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parent.parent

FILES = (
    "test_accelerator",
    "test_data_loader",
    "test_state_checkpointing",
    "test_utils",
    "test_tracking",
    "test_scheduler",
    "test_cpu",
    "test_grad_sync",
    "test_memory_utils",
    "test_logging",
    "test_kwargs_handlers",
    "test_launch",
)


def run_their_tests(mode: str, out_file: str, files: tuple[str, ...] = FILES) -> None:
    """Their ``tests/<file>.py`` in a child pytest (``mode``: "ours" through the shim, or
    "real" Accelerate), one JSON line per test in ``out_file``."""
    sources = shim.accelerate_sources()
    env = kernel_env()
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
        NOTEBOOK_LAUNCHER_PARITY=mode,
        NOTEBOOK_LAUNCHER_PARITY_OUT=out_file,
        NOTEBOOK_LAUNCHER_PARITY_SOURCES=str(sources),
    )
    with tempfile.TemporaryDirectory() as workdir:
        ini = Path(workdir) / "pytest.ini"
        ini.write_text("[pytest]\n")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-c",
                str(ini),
                "--rootdir",
                str(sources),
                "-p",
                "tests._parity_unit_plugin",
                "-p",
                "no:cacheprovider",
                "-q",
                "--timeout=120",
                "--continue-on-collection-errors",
                *(str(sources / "tests" / f"{f}.py") for f in files),
            ],
            env=env,
            cwd=workdir,
            timeout=600,
            capture_output=True,
        )


if __name__ == "__main__":
    # python -m tests.test_parity_accelerate_unit {ours|real} OUT.jsonl [FILE...]
    run_their_tests(sys.argv[1], os.path.abspath(sys.argv[2]), tuple(sys.argv[3:]) or FILES)
    with open(sys.argv[2]) as f:
        records = [json.loads(line) for line in f]
    table: dict[str, dict[str, int]] = {}
    for r in records:
        name = r["case"].split("::")[0].rsplit("/", 1)[-1]
        table.setdefault(name, {}).setdefault(r["status"], 0)
        table[name][r["status"]] += 1
    for name, counts in table.items():
        print(name, counts)
