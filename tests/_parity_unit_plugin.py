"""pytest plugin for the nested run of Accelerate's unit tests (used by test_parity_accelerate_unit).

Loaded with ``-p tests._parity_unit_plugin`` by a pytest run in a child process, never by this
suite's own pytest. With ``NOTEBOOK_LAUNCHER_PARITY=ours`` it installs the accelerate shim
(``tests/_parity_shim.py``) before their test modules are imported, so ``import accelerate``
means notebook_launcher; with ``NOTEBOOK_LAUNCHER_PARITY=real`` it installs nothing, and their
tests run against the real Accelerate (how the "passes with real Accelerate here" column is
measured). Either way it writes one JSON line per test to ``NOTEBOOK_LAUNCHER_PARITY_OUT``:
the test's node id, its outcome (passed / failed / skipped) and the failure's text or the
skip's reason, as soon as the test is done. A file that fails to import is one line, ``error``.

Once their files are collected, every object then alive (the modules of all twelve files and
of what they import) is frozen (``gc.freeze``): one process runs all their files, and without
it each ``gc.collect()`` of their tests would walk every other file's imports too (their
``test_memory_utils`` collects about 60 times, 0.2-0.4 s each here). What their tests create
afterwards is collected as before.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

import pytest

_MODE = os.environ.get("NOTEBOOK_LAUNCHER_PARITY", "ours")
_OUT = os.environ.get("NOTEBOOK_LAUNCHER_PARITY_OUT", "")

if _MODE == "ours":
    from . import _parity_shim

    _parity_shim.install(
        Path(os.environ["NOTEBOOK_LAUNCHER_PARITY_SOURCES"]), stand_in_accelerate_only=True
    )

_results: dict[str, dict[str, Any]] = {}


def _write(record: dict[str, Any]) -> None:
    if _OUT:
        with open(_OUT, "a") as out:
            out.write(json.dumps(record) + "\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    record = _results.setdefault(
        report.nodeid, {"case": report.nodeid, "status": "passed", "detail": "", "seconds": 0.0}
    )
    record["seconds"] = round(record["seconds"] + report.duration, 3)
    if report.failed and record["status"] != "failed":
        record["status"] = "failed"
        record["detail"] = f"[{report.when}] {report.longreprtext}"
    elif report.skipped and record["status"] == "passed":
        record["status"] = "skipped"
        longrepr = report.longrepr
        record["detail"] = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    if report.when == "teardown":
        _write(record)


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _write(
            {"case": report.nodeid, "status": "error", "detail": report.longreprtext, "seconds": 0}
        )
