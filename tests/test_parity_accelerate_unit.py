"""Accelerate 1.15.0's own unit tests, run against notebook_launcher.

The README promises that code written for Accelerate runs after changing the import. The
companion of ``test_parity_accelerate.py`` (their distributed scripts): here their *unit test
files* (``tests/test_accelerator.py``, ``test_data_loader.py``... of the released source
distribution, fetched at test time by ``tests/_parity_shim.py``, never vendored) run in one
child pytest with the shim installed, so ``import accelerate`` means this package; each of
their test functions is one case here. Their tests that launch ranks (``debug_launcher`` in
``test_cpu`` and ``test_grad_sync``) start 2 CPU ranks with our launcher from that child.

``parity_accelerate_unit.json`` is the baseline: each of their tests and what it did with the
real Accelerate 1.15.0 on this CPU machine (``python -m tests.test_parity_accelerate_unit real
OUT.jsonl`` measures it again; the JSON is that run, test ids and outcomes only). Per case:

* passed with real Accelerate: passes with ours, or, where this package deliberately differs
  (``DIFFERS``, the README's "Differences from Accelerate"), fails exactly at that point, the
  failure matching the case's pattern; if it ever passes, the case says the difference is gone;
* skipped with real Accelerate (a GPU, a package not installed here): skips with ours too;
* a test of theirs missing from the baseline fails: measure the new version first.

Their files import Accelerate-only names (``init_empty_weights``, ``accelerate.hooks``...) at
the top next to the training API. ``from notebook_launcher import init_empty_weights`` raises
our ``AccelerateOnlyError``; in the child the shim binds stand-ins that raise that same error
when *used*, so the rest of their file runs and the tests that use them fail at it (asserted).
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from . import _parity_shim as shim
from .helpers import kernel_env

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parent.parent

#: Their files, in the order they run. ``test_memory_utils`` first: its tests call
#: ``gc.collect()`` about 60 times (``find_executable_batch_size`` collects after each
#: out-of-memory), and a collection walks every object alive in the child save those frozen
#: after collection (``tests/_parity_unit_plugin.py``), which the other files' tests add by
#: the hundred thousand (torch._dynamo, MLflow...): 20-25 s of the run when it ran after
#: them, a few milliseconds first.
FILES = (
    "test_memory_utils",
    "test_accelerator",
    "test_data_loader",
    "test_state_checkpointing",
    "test_utils",
    "test_tracking",
    "test_scheduler",
    "test_cpu",
    "test_grad_sync",
    "test_logging",
    "test_kwargs_handlers",
    "test_launch",
)


def their_env(mode: str, out_file: str, sources: Path) -> dict[str, str]:
    """The environment of the child pytest running their tests, and of every process it starts.

    "ours": ``tests/_parity_site/sitecustomize.py`` installs the shim in every interpreter of
    the run, so that the forkserver and spawned ranks of their ``debug_launcher`` calls answer
    ``import accelerate`` as the child pytest does (a forked rank inherits the shim anyway).
    """
    env = kernel_env()
    site = [str(REPO / "tests" / "_parity_site")] if mode == "ours" else []
    env.update(
        PYTHONPATH=os.pathsep.join([*site, str(REPO), env.get("PYTHONPATH", "")]),
        NOTEBOOK_LAUNCHER_PARITY=mode,
        NOTEBOOK_LAUNCHER_PARITY_OUT=out_file,
        NOTEBOOK_LAUNCHER_PARITY_SOURCES=str(sources),
        # MLflow >= 3.17 refuses the file store their MLflow tests use unless asked
        MLFLOW_ALLOW_FILE_STORE="true",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
    )
    return env


def run_their_tests(
    mode: str, out_file: str, files: tuple[str, ...] = FILES, cases: tuple[str, ...] = ()
) -> None:
    """Their ``tests/<file>.py`` (or only ``cases``, test ids) in a child pytest (``mode``:
    "ours" through the shim, or "real" Accelerate), one JSON line per test in ``out_file``."""
    sources = shim.accelerate_sources()
    env = their_env(mode, out_file, sources)
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
                *(
                    (str(sources / "tests" / c) for c in cases)
                    if cases
                    else (str(sources / "tests" / f"{f}.py") for f in files)
                ),
            ],
            env=env,
            cwd=workdir,
            timeout=RUN_TIMEOUT,
            capture_output=True,
        )


#: Seconds the child pytest may take (their tests take 1-3 min here, more on a loaded machine).
RUN_TIMEOUT = 840
#: At most this many failures are run again (more is not noise).
MAX_RERUNS = 5

BASELINE_FILE = Path(__file__).with_name("parity_accelerate_unit.json")
BASELINE: dict[str, str] = json.loads(BASELINE_FILE.read_text())

_ONLY = "AccelerateOnlyError: `{}` is part of Accelerate's"

#: Their tests that fail with ours on purpose: test id -> (the difference, the failure's pattern).
DIFFERS: dict[str, tuple[str, str]] = {
    "test_accelerator.py::AcceleratorTester::test_save_model_offload_use_pytorch": (
        "big-model inference (load_checkpoint_and_dispatch) is Accelerate's own",
        re.escape(_ONLY.format("load_checkpoint_and_dispatch")),
    ),
    "test_accelerator.py::AcceleratorTester::test_save_model_offload_use_safetensors": (
        "big-model inference (load_checkpoint_and_dispatch) is Accelerate's own",
        re.escape(_ONLY.format("load_checkpoint_and_dispatch")),
    ),
    "test_accelerator.py::AcceleratorTester::"
    "test_prepare_model_8bit_cpu_offload_raises_valueerror_not_typeerror": (
        "bitsandbytes 8-/4-bit models (quantisation, offload) are Accelerate's own: their test "
        "patches a bitsandbytes check in accelerate.accelerator that this module does not have",
        r"does not have the attribute 'is_bitsandbytes_multi_backend_available'",
    ),
    "test_utils.py::UtilsTester::test_has_offloaded_params": (
        "offloading hooks are Accelerate's own",
        re.escape(_ONLY.format("has_offloaded_params")),
    ),
    "test_launch.py::TestPrepareMultiGpuEnv::test_auto_port_selection": (
        "the `accelerate launch` command line and its helpers are Accelerate's own",
        re.escape(_ONLY.format("prepare_multi_gpu_env")),
    ),
}

#: Not deliberate: failures still open, each with what it shows (see the README). A case here
#: that starts passing fails, so that it is moved out.
OPEN: dict[str, tuple[str, str]] = {}


def _records(out: str) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    if os.path.exists(out):
        with open(out) as f:
            for line in f:
                record = json.loads(line)
                found[record["case"].removeprefix("tests/")] = record
    return found


def should_pass(case: str) -> bool:
    return BASELINE.get(case) == "passed" and case not in DIFFERS and case not in OPEN


@functools.cache
def outcomes() -> dict[str, dict[str, Any]]:
    """Their test id -> its record with ours (one child pytest for every file, run once).

    A case that should pass and failed runs once more, alone: some of their tests measure
    the whole machine (``test_free_memory_dereferences_prepared_components`` compares the
    machine's free RAM before and after, which any other process moves), and fail with the
    real Accelerate too on a busy machine. A case that fails twice fails; one that passed
    the second time says so in its record (``reran``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ours.jsonl")
        run_their_tests("ours", out)
        found = _records(out)
        again = tuple(c for c, r in found.items() if r["status"] == "failed" and should_pass(c))
        if again and len(again) <= MAX_RERUNS:
            out = os.path.join(tmp, "again.jsonl")
            run_their_tests("ours", out, cases=again)
            for case, record in _records(out).items():
                if record["status"] == "passed":
                    found[case] = {**record, "reran": found[case]["detail"]}
    return found


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", sorted(BASELINE))
def test_accelerate_unit(case: str) -> None:
    real = BASELINE[case]
    record = outcomes().get(case)
    if record is None:
        broken = {k: r for k, r in outcomes().items() if r["status"] == "error"}
        file_error = broken.get(case.split("::")[0])
        detail = file_error["detail"][-3000:] if file_error else "(no record)"
        pytest.fail(f"{case} did not run with notebook_launcher:\n{detail}", pytrace=False)
    status, detail = record["status"], record["detail"]
    if real.startswith("skipped"):
        assert status in ("skipped", "passed"), f"skipped with real Accelerate; ours:\n{detail}"
        if status == "skipped":
            pytest.skip(f"as with real Accelerate: {detail}")
        return
    assert real == "passed", f"baseline outcome {real!r} is not one this test knows"
    expected = DIFFERS.get(case) or OPEN.get(case)
    if expected is not None:
        why, pattern = expected
        assert status == "failed", (
            f"{case} now {status}: the {'difference' if case in DIFFERS else 'open failure'} "
            f"({why}) is gone; update DIFFERS/OPEN and the README's differences from Accelerate"
        )
        assert re.search(pattern, detail), (
            f"{case} was expected to fail only because {why} ({pattern!r}); it failed with:\n"
            f"{detail[-3000:]}"
        )
        return
    if status != "passed":
        pytest.fail(f"{case} {status} with notebook_launcher:\n{detail[-4000:]}", pytrace=False)


@pytest.mark.timeout(60)
def test_a_fresh_interpreter_of_their_run_imports_ours_as_accelerate() -> None:
    """What a forkserver or spawned rank of their run imports as ``accelerate``: ours, as in
    the child pytest (it was the real Accelerate, and ``test_gradient_sync_cpu_noop`` measured
    it whenever the launcher picked the forkserver)."""
    env = their_env("ours", os.devnull, shim.accelerate_sources())
    probe = "import accelerate, accelerate.test_utils as t; print(accelerate.__name__, t.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stderr
    name, helpers = out.stdout.split()
    assert name == "notebook_launcher"
    assert helpers.startswith(str(shim.accelerate_sources()))


@pytest.mark.timeout(900)
def test_every_test_of_theirs_is_in_the_baseline() -> None:
    """A test id we never measured (a new Accelerate, a renamed test) is not silently ignored."""
    ran = {c for c, r in outcomes().items() if r["status"] != "error"}
    assert not ran - set(BASELINE), f"not in {BASELINE_FILE.name}: {sorted(ran - set(BASELINE))}"
    assert not (set(DIFFERS) | set(OPEN)) - set(BASELINE)


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
