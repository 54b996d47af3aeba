"""Real Accelerate and Transformers inside our ranks, unchanged.

People who never change the import call ``notebook_launcher`` on functions that use the real
``accelerate`` (or Transformers' ``Trainer``, which uses it). These tests prove that such a
function trains as ONE 2-rank group on CPU through our launcher, with our failure reporting,
progress bars and rank panes; and pin the environment that makes it so
(``notebook_launcher/_accelerate_env.py``).
"""

from __future__ import annotations

import runpy
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import notebook_launcher as package
from notebook_launcher import notebook_launcher
from notebook_launcher._accelerate_env import accelerate_env
from notebook_launcher._events import Output, ProgressUpdate

from .helpers import Recorder

pytestmark = pytest.mark.multiprocess

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "06_transformers_trainer.py"


# ------------------------------------------------------------------------------ the env


@pytest.mark.parametrize(
    ("args", "environ", "expected"),
    [
        (
            ("no", "gloo", 1),
            {},
            {
                "ACCELERATE_MIXED_PRECISION": "no",
                "ACCELERATE_USE_CPU": "true",
                "FORK_LAUNCHED": "1",
                "OMP_NUM_THREADS": "1",
            },
        ),
        (
            ("bf16", "nccl", None),  # the user chose OMP_NUM_THREADS: left alone
            {"ACCELERATE_USE_CPU": "1"},  # a stale flag in the kernel cannot hide the GPUs
            {
                "ACCELERATE_MIXED_PRECISION": "bf16",
                "ACCELERATE_USE_CPU": "false",
                "FORK_LAUNCHED": "1",
            },
        ),
        (
            ("fp16", "gloo", 4),
            {"NOTEBOOK_LAUNCHER_DEBUG": "yes"},
            {
                "ACCELERATE_MIXED_PRECISION": "fp16",
                "ACCELERATE_USE_CPU": "true",
                "ACCELERATE_DEBUG_MODE": "true",
                "FORK_LAUNCHED": "1",
                "OMP_NUM_THREADS": "4",
            },
        ),
        (
            ("no", "gloo", 2),
            {"ACCELERATE_DEBUG_MODE": "0"},
            {
                "ACCELERATE_MIXED_PRECISION": "no",
                "ACCELERATE_USE_CPU": "true",
                "FORK_LAUNCHED": "1",
                "OMP_NUM_THREADS": "2",
            },
        ),
    ],
)
def test_accelerate_env(args: tuple[Any, ...], environ: dict[str, str], expected: dict) -> None:
    assert accelerate_env(*args, environ=environ) == expected


def test_accelerate_env_refuses_unknown_backends_and_imports_no_torch() -> None:
    with pytest.raises(ValueError, match="gloo"):
        accelerate_env("no", "mpi", None, {})
    code = "import sys, notebook_launcher._accelerate_env; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------ real Accelerate


@pytest.fixture
def default_warnings() -> Iterator[None]:
    """Third-party code warns freely: ranks forked from here get the default filters, not
    pytest's "error" (our own code's warnings are tested elsewhere)."""
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        yield


def _real_accelerate_worker(fail_on: int | None) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import gather_object
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator()
    if accelerator.process_index == fail_on:
        raise KeyError("rank-specific failure inside an Accelerate function")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))
    seen = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seen.append(x[:, 0].tolist())
    weights = accelerator.unwrap_model(model).weight.detach().clone()
    return {
        "module": type(accelerator).__module__,
        "distributed_type": accelerator.distributed_type.value,
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "mixed_precision": accelerator.mixed_precision,
        "all_seen": gather_object(seen),
        "weights": weights,
    }


@pytest.mark.timeout(120)
def test_real_accelerate_trains_as_one_group(default_warnings: None) -> None:
    results = notebook_launcher(
        _real_accelerate_worker, args=(None,), num_processes=2, mixed_precision="bf16"
    )
    assert [r["module"] for r in results] == ["accelerate.accelerator"] * 2  # theirs, not ours
    assert [r["distributed_type"] for r in results] == ["MULTI_CPU"] * 2
    assert [(r["num_processes"], r["process_index"]) for r in results] == [(2, 0), (2, 1)]
    assert [r["mixed_precision"] for r in results] == ["bf16"] * 2
    # each rank trained on its own half of the 16 samples, DDP kept the replicas identical
    assert len(results[0]["all_seen"]) == 4 and results[0]["all_seen"] == results[1]["all_seen"]
    assert torch.equal(results[0]["weights"], results[1]["weights"])


@pytest.mark.timeout(120)
def test_real_accelerate_failure_raises_the_ranks_own_exception(default_warnings: None) -> None:
    with pytest.raises(KeyError, match="rank-specific failure") as info:
        notebook_launcher(_real_accelerate_worker, args=(1,), num_processes=2, dashboard=False)
    assert info.value.launch_failure.root_cause.rank == 1  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_real_accelerate_used_in_the_kernel_first_still_trains_as_one_group(
    default_warnings: None,
) -> None:
    """A loader prepared with the real Accelerate in the kernel makes its one-process
    singletons here; ranks forked after must not inherit them (every rank was process 0 of
    1, distributed_type NO, and the launch trained twice on everything, silently)."""
    from accelerate.data_loader import prepare_data_loader
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from torch.utils.data import DataLoader

    prepare_data_loader(DataLoader(list(range(4)), batch_size=2))
    assert PartialState._shared_state  # the kernel's own state, as a notebook leaves it
    try:
        results = notebook_launcher(
            _real_accelerate_worker, args=(None,), num_processes=2, dashboard=False
        )
        assert [r["distributed_type"] for r in results] == ["MULTI_CPU"] * 2
        assert [(r["num_processes"], r["process_index"]) for r in results] == [(2, 0), (2, 1)]
        assert PartialState._shared_state  # the kernel's is its own business: kept
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


# ------------------------------------------------------------------------------ Trainer


@pytest.mark.timeout(240)
def test_transformers_trainer_notebook_trains_on_two_ranks(
    monkeypatch: pytest.MonkeyPatch, default_warnings: None
) -> None:
    """notebooks/06_transformers_trainer.py as it is, with a recording dashboard."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the notebook sets it too (setdefault)
    recorder = Recorder()
    launched: list[list[Any]] = []

    def recording_launcher(*args: Any, **kwargs: Any) -> list[Any]:
        results = notebook_launcher(*args, **kwargs, dashboard=recorder)
        launched.append(results)
        return results

    monkeypatch.setattr(package, "notebook_launcher", recording_launcher)
    runpy.run_path(str(NOTEBOOK))  # its own asserts: one group of 2, same weights on both

    (results,) = launched
    assert [r["steps"] for r in results] == [8, 8]
    bars = recorder.of(ProgressUpdate)
    trainer_bar = [b for b in bars if b.rank == 0 and b.total == 8]
    assert trainer_bar and trainer_bar[-1].closed and trainer_bar[-1].n == 8
    assert not [b for b in bars if b.rank == 1 and not b.disabled]  # Trainer draws on rank 0
    logs = "".join(e.text for e in recorder.of(Output) if e.rank == 0)
    assert logs.count("'loss'") == 4 and "'train_runtime'" in logs  # logging_steps=2 of 8
