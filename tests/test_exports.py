"""The public surface is small and pinned; the UI never imports torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

import notebook_launcher

pytestmark = pytest.mark.unit

EXPECTED = {
    "Accelerator",
    "AcceleratorState",
    "AgentCluster",
    "AutocastKwargs",
    "ClusterError",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedOperationException",
    "DistributedType",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "GradientState",
    "InitProcessGroupKwargs",
    "LaunchError",
    "PartialState",
    "PreflightError",
    "ProcessGroupMismatch",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RankFailedError",
    "RendezvousError",
    "SerializationError",
    "Session",
    "SessionBroken",
    "RayCluster",
    "SlurmCluster",
    "TorchDynamoPlugin",
    "WorkerDied",
    "__version__",
    "attach",
    "debug_launcher",
    "find_executable_batch_size",
    "load_checkpoint_in_model",
    "log",
    "notebook_launcher",
    "runs",
    "skip_first_batches",
    "start",
    "synchronize_rng_states",
}


def test_all_is_pinned_and_resolvable() -> None:
    assert set(notebook_launcher.__all__) == EXPECTED
    for name in EXPECTED:
        assert getattr(notebook_launcher, name) is not None


def _modules_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_ui_and_package_import_do_not_import_torch() -> None:
    assert "torch" not in _modules_after("import notebook_launcher.ui")
    assert "torch" not in _modules_after("import notebook_launcher")
    assert "torch" not in _modules_after("import notebook_launcher.ipython_extension")
    # the kernel side reads the shared settings before anything loads torch
    assert "torch" not in _modules_after("import notebook_launcher._launch.preflight")
    assert "torch" not in _modules_after("from notebook_launcher.utils import PrecisionType")
    assert "torch" not in _modules_after("from notebook_launcher import DDPCommunicationHookType")


def test_the_function_carries_the_packages_verbs() -> None:
    """One spelling for every verb (issue 33, item 2): after ``from notebook_launcher import
    notebook_launcher`` the name is the function, after ``import notebook_launcher`` the
    package; ``notebook_launcher.runs()`` (``attach``, ``start``, ``log``) must work on
    either, and be the same thing."""
    from notebook_launcher import notebook_launcher as function

    for verb in ("start", "runs", "attach", "log"):
        assert getattr(function, verb) is getattr(notebook_launcher, verb), verb
