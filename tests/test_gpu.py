"""The GPU tier: NCCL, placement, fork safety, mixed precision and cleanup on real GPUs.

These skip with a reason on machines without one (CI is CPU-only; ``tests/gpus.py`` says how
the other tiers run CPU ranks on a GPU machine). Run them with ``pytest -m gpu`` or
``python bench/gpu.py`` (the one-call check). Whatever initialises CUDA in a kernel runs in
a fresh interpreter (:func:`_in_fresh_kernel`): the test process itself never touches the
CUDA runtime, as a kernel must not.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from notebook_launcher import PreflightError, notebook_launcher
from notebook_launcher._events import Event, LaunchStarted
from notebook_launcher.ui import NullView

from . import gpus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpus.count(), reason=gpus.REASON),
    pytest.mark.timeout(180),
]
ROOT = Path(__file__).resolve().parents[1]
two_gpus = pytest.mark.skipif(gpus.count() < 2, reason="needs 2 GPUs (one rank per GPU)")


class Keep:
    """A view that keeps every event."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def handle(self, event: Event) -> None:
        self.events.append(event)

    def tick(self) -> None:
        pass

    def close(self) -> None:
        pass

    def started(self) -> LaunchStarted:
        return next(e for e in self.events if isinstance(e, LaunchStarted))


def placement() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from notebook_launcher import PartialState
    from notebook_launcher.utils import gather, pad_across_processes

    state = PartialState()
    t = torch.ones(4, device=state.device) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    ours = gather(torch.full((2,), float(state.process_index), device=state.device))
    padded = pad_across_processes(torch.ones(state.process_index + 1, device=state.device))
    return {
        "gathered": [ours.device.type, ours.tolist()],
        "padded": list(padded.shape),
        "backend": dist.get_backend(),
        "device": str(state.device),
        "current": torch.cuda.current_device() if state.device.type == "cuda" else None,
        "sum": t[0].item(),
        "mp": state.mixed_precision,
        "type": str(state.distributed_type),
        "visible": torch.cuda.device_count(),
    }


@two_gpus
def test_nccl_and_one_gpu_per_rank() -> None:
    n = gpus.count()
    out = notebook_launcher(placement, (), n, mixed_precision="fp16", dashboard=NullView())
    assert [o["current"] for o in out] == list(range(n))
    assert all(o["backend"] == "nccl" and o["type"] == "MULTI_GPU" for o in out)
    assert [o["device"] for o in out] == [f"cuda:{i}" for i in range(n)]
    assert all(o["sum"] == n * (n + 1) / 2 and o["mp"] == "fp16" for o in out)


def test_one_rank_on_one_gpu_is_not_a_distributed_job() -> None:
    seen = Keep()
    (out,) = notebook_launcher(placement, (), 1, mixed_precision="bf16", dashboard=seen)
    assert out["device"] == "cuda:0" and out["current"] == 0
    assert out["type"] == "NO"  # as Accelerate's state says for one process
    assert out["backend"] == "gloo"  # a group of one, no NCCL communicator to set up
    assert out["sum"] == 1 and out["mp"] == "bf16"
    assert "not a distributed job" in seen.started().placement


def test_num_processes_none_means_one_per_gpu() -> None:
    out = notebook_launcher(placement, (), None, dashboard=NullView())
    assert len(out) == gpus.count()


def test_more_ranks_than_gpus_share_them_on_gloo() -> None:
    """A lesson written for two ranks on Colab's one GPU: it runs, and says how."""
    n = gpus.count() + 1
    seen = Keep()
    out = notebook_launcher(placement, (), n, dashboard=seen)
    assert all(o["backend"] == "gloo" and o["type"] == "MULTI_GPU" for o in out)
    assert [o["device"] for o in out] == [f"cuda:{r % gpus.count()}" for r in range(n)]
    assert all(o["sum"] == n * (n + 1) / 2 for o in out)  # collectives of CUDA tensors
    assert out[0]["gathered"] == ["cuda", [float(r // 2) for r in range(2 * n)]]
    assert all(o["padded"] == [n] for o in out)
    assert "share" in seen.started().banner and "devices='cpu'" in seen.started().banner


def test_devices_gpu_refuses_more_ranks_than_gpus() -> None:
    with pytest.raises(PreflightError, match="devices='gpu' asks for one rank per GPU"):
        notebook_launcher(placement, (), gpus.count() + 1, devices="gpu", dashboard=NullView())


def test_cpu_ranks_on_a_gpu_machine_see_no_gpu() -> None:
    out = notebook_launcher(placement, (), 2, devices="cpu", dashboard=NullView())
    assert [(o["device"], o["visible"], o["backend"]) for o in out] == [("cpu", 0, "gloo")] * 2


def _in_fresh_kernel(code: str, **env_extra: str) -> str:
    env = {**gpus.machine_env(), "PYTHONPATH": str(ROOT), **env_extra}
    env.pop("PYTEST_CURRENT_TEST", None)
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)  # importing the package sets it
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=170,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


PRELUDE = """
    import torch
    from notebook_launcher import notebook_launcher, PreflightError
    from notebook_launcher._events import LaunchStarted
    seen = []
    class Keep:
        def handle(self, e): seen.append(e)
        def tick(self): pass
        def close(self): pass
    def f():
        import torch
        return torch.ones(1, device="cuda").item()
    def method():
        started = [e for e in seen if isinstance(e, LaunchStarted)][-1]
        return started.start_method + " | " + started.start_reason
"""


def test_the_users_cuda_checks_in_the_kernel_do_not_poison_fork() -> None:
    """What every launch on the H100 hit: is_available() (and what calls it) in the kernel
    initialised the driver, and the forked rank could not use CUDA."""
    out = _in_fresh_kernel(
        PRELUDE
        + """
    import notebook_launcher  # sets PYTORCH_NVML_BASED_CUDA_CHECK, as Lightning does
    assert torch.cuda.is_available()
    torch.autocast("cuda")
    torch.amp.GradScaler("cuda")
    assert not torch.cuda.is_initialized()
    print("RESULT", notebook_launcher(f, (), 1, dashboard=Keep()))
    print("METHOD", method())
    """
    )
    assert "RESULT [1.0]" in out
    assert "METHOD fork" in out


def test_a_kernel_poisoned_by_get_arch_list_is_seen_and_launches_from_the_forkserver() -> None:
    """``torch.cuda.get_arch_list()`` registers CUDA's fork handler without initialising
    anything (``torch._C._cuda_getArchFlags``): the driver cannot tell; the canary child
    can, and the ranks start from the forkserver, saying why."""
    out = _in_fresh_kernel(
        PRELUDE
        + """
    torch.cuda.get_arch_list()
    assert not torch.cuda.is_initialized()
    print("RESULT", notebook_launcher(f, (), 1, dashboard=Keep()))
    print("METHOD", method())
    """
    )
    assert "RESULT [1.0]" in out
    assert "METHOD forkserver | a rank forked from this kernel could not use CUDA" in out


def test_cuda_initialised_in_parent_uses_forkserver_and_refuses_fork() -> None:
    out = _in_fresh_kernel(
        PRELUDE
        + """
    torch.zeros(1, device="cuda")          # CUDA is now initialised in the "kernel"
    print("RESULT", notebook_launcher(f, (), 1, dashboard=Keep()))
    print("METHOD", method())
    try:
        notebook_launcher(f, (), 1, start_method="fork", dashboard=Keep())
    except PreflightError as e:
        print("REFUSED", "restart the kernel" in str(e))
    """
    )
    assert "RESULT [1.0]" in out
    assert "METHOD forkserver | CUDA is initialised" in out
    assert "REFUSED True" in out


def test_a_driver_initialised_by_another_library_is_seen() -> None:
    """cuInit by anything (bitsandbytes, CuPy, a user's ctypes): torch's flag stays False,
    the launcher still knows, and uses the forkserver."""
    out = _in_fresh_kernel(
        PRELUDE
        + """
    import ctypes
    from notebook_launcher import _placement
    assert not _placement.driver_initialized()
    assert ctypes.CDLL("libcuda.so.1").cuInit(0) == 0
    assert not torch.cuda.is_initialized() and _placement.driver_initialized()
    print("RESULT", notebook_launcher(f, (), 1, dashboard=Keep()))
    print("METHOD", method())
    """
    )
    assert "RESULT [1.0]" in out
    assert "METHOD forkserver | CUDA is initialised" in out


def _gpu_pids() -> set[int]:
    done = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    return {int(x) for x in done.stdout.split() if x.strip().isdigit()}


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def hold_memory_then_fail() -> None:
    import torch
    import torch.distributed as dist

    from notebook_launcher import PartialState

    state = PartialState()
    keep = torch.empty(256 * 2**20, dtype=torch.uint8, device=state.device)  # noqa: F841
    dist.barrier()
    if state.process_index == 0:
        raise RuntimeError("rank 0 fails holding GPU memory")
    import time

    time.sleep(60)


def test_a_failed_gpu_launch_leaves_no_process_on_the_gpu_nor_shm_files() -> None:
    before_pids, before_shm = _gpu_pids(), _shm()
    n = min(gpus.count(), 2)
    with pytest.raises(RuntimeError, match="rank 0 fails holding GPU memory"):
        notebook_launcher(hold_memory_then_fail, (), n, devices="gpu", dashboard=NullView())
    assert _gpu_pids() <= before_pids
    assert _shm() <= before_shm


def fp16_step() -> dict[str, Any]:
    import torch

    from notebook_launcher import Accelerator

    acc = Accelerator(mixed_precision="fp16")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(4, 8, device=acc.device)
    with acc.autocast():
        half = model(x).dtype
    acc.backward(model(x).float().sum())
    norm = acc.clip_grad_norm_(model.parameters(), 1e9)
    opt.step()
    return {
        "device": str(acc.device),
        "scaler": acc.scaler is not None,
        "half": str(half),
        "finite": bool(torch.isfinite(norm)),
    }


def test_fp16_trains_with_a_grad_scaler_on_the_gpu() -> None:
    (out,) = notebook_launcher(fp16_step, (), 1, dashboard=NullView())
    assert out == {"device": "cuda:0", "scaler": True, "half": "torch.float16", "finite": True}


def free_memory_on_gpu() -> list[int]:
    import torch

    from notebook_launcher import Accelerator

    acc = Accelerator()
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device=acc.device)
    held = torch.cuda.memory_allocated()
    (x,) = acc.free_memory(x)
    return [held, torch.cuda.memory_allocated(), int(x is None)]


def test_free_memory_releases_cuda_memory() -> None:
    ((held, after, gone),) = notebook_launcher(free_memory_on_gpu, (), 1, dashboard=NullView())
    assert held >= 64 * 2**20 and after < held and gone == 1


def prepared_on_gpu() -> list[str]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from notebook_launcher import Accelerator

    acc = Accelerator()
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    model, loader = acc.prepare(torch.nn.Linear(4, 1), DataLoader(data, batch_size=4))
    return [next(model.parameters()).device.type] + [x.device.type for x, _ in loader]


def test_prepare_places_model_and_batches_on_the_ranks_gpu() -> None:
    ((*devices,),) = notebook_launcher(prepared_on_gpu, (), 1, dashboard=NullView())
    assert devices == ["cuda"] * 3
