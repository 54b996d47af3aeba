"""GPU-only launcher paths: NCCL, CUDA placement, fp16, CUDA initialised in the kernel.

These skip with a reason on machines without CUDA (CI is CPU-only); run them on a GPU
machine with ``pytest tests/test_gpu.py``. The CUDA-initialised-in-parent tests run in a
subprocess so that the test process itself never initialises CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from notebook_launcher import PreflightError, notebook_launcher
from notebook_launcher.ui import NullView

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(180),
]
ROOT = Path(__file__).resolve().parents[1]


def placement() -> dict:
    import torch.distributed as dist

    from notebook_launcher import PartialState

    state = PartialState()
    t = torch.ones(4, device=state.device) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return {
        "backend": dist.get_backend(),
        "device": str(state.device),
        "current": torch.cuda.current_device(),
        "sum": t[0].item(),
        "mp": state.mixed_precision,
    }


def test_nccl_and_one_gpu_per_rank() -> None:
    n = torch.cuda.device_count()
    out = notebook_launcher(placement, (), n, mixed_precision="fp16", dashboard=NullView())
    assert [o["current"] for o in out] == list(range(n))
    assert all(o["backend"] == "nccl" for o in out)
    assert [o["device"] for o in out] == [f"cuda:{i}" for i in range(n)]
    assert all(o["sum"] == n * (n + 1) / 2 and o["mp"] == "fp16" for o in out)


def test_num_processes_none_means_one_per_gpu() -> None:
    out = notebook_launcher(placement, (), None, dashboard=NullView())
    assert len(out) == torch.cuda.device_count()


def test_too_many_processes_for_the_gpus() -> None:
    with pytest.raises(PreflightError, match="GPU"):
        notebook_launcher(placement, (), torch.cuda.device_count() + 1, dashboard=NullView())


def _in_fresh_kernel(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_CURRENT_TEST", None)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=170,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_cuda_initialised_in_parent_uses_forkserver_and_refuses_fork() -> None:
    out = _in_fresh_kernel(
        """
        import torch
        from notebook_launcher import notebook_launcher, PreflightError
        from notebook_launcher._events import LaunchStarted
        torch.zeros(1, device="cuda")          # CUDA is now initialised in the "kernel"
        seen = []
        class Keep:
            def handle(self, e): seen.append(e)
            def tick(self): pass
            def close(self): pass
        def f():
            import torch
            return torch.ones(1, device="cuda").item()
        print("RESULT", notebook_launcher(f, (), 1, dashboard=Keep()))
        started = [e for e in seen if isinstance(e, LaunchStarted)][0]
        print("METHOD", started.start_method, "|", started.start_reason)
        try:
            notebook_launcher(f, (), 1, start_method="fork", dashboard=Keep())
        except PreflightError as e:
            print("REFUSED", "restart the kernel" in str(e))
        """
    )
    assert "RESULT [1.0]" in out
    assert "METHOD forkserver | CUDA is initialised" in out
    assert "REFUSED True" in out
