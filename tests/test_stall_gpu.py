"""The stall view on GPUs: NCCL's flight recorder in the report (issue 19, item 5).

On NCCL ranks the flight recorder is on by default (``TORCH_FR_BUFFER_SIZE=2000`` unless
the user set it): a stall report carries each rank's last collectives with their sequence
numbers, and names the rank behind. These skip with a reason on machines without CUDA;
the same path on gloo (where the recorder must be asked for) runs everywhere, in
``tests/test_stall.py::test_the_flight_recorder_names_the_rank_behind``.
"""

from __future__ import annotations

import time

import pytest
import torch

from notebook_launcher import notebook_launcher
from notebook_launcher._events import StacksTaken

from . import gpus

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not gpus.count(),
        reason=gpus.REASON + ": NCCL's flight recorder (the gloo path runs in test_stall.py)",
    ),
    pytest.mark.timeout(180),
]


class Reports:
    def __init__(self) -> None:
        self.found: list[StacksTaken] = []

    def handle(self, event: object) -> None:
        if isinstance(event, StacksTaken):
            self.found.append(event)

    def tick(self) -> None:
        pass

    def close(self) -> None:
        pass

    def wait(self, showing: str, timeout: float = 60.0) -> StacksTaken:
        deadline = time.monotonic() + timeout
        while True:
            for report in self.found:
                if showing in "\n".join(report.findings):
                    return report
            assert time.monotonic() < deadline, [r.findings for r in self.found]
            time.sleep(0.05)


def reduce_then_wait() -> int:
    import torch.distributed as dist

    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    if dist.get_rank() == dist.get_world_size() - 1:
        time.sleep(60)  # the last rank falls behind
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return dist.get_rank()


def test_the_stall_view_carries_nccls_flight_recorder() -> None:
    n = min(torch.cuda.device_count(), 2)
    seen = Reports()
    handle = notebook_launcher(  # devices="gpu": NCCL even for one rank on one GPU
        reduce_then_wait,
        num_processes=n,
        dashboard=seen,
        stall_after=2.0,
        block=False,
        devices="gpu",
    )
    try:
        report = seen.wait("time.sleep(60)")
        lines = dict(report.flight)
        assert set(lines) == set(range(n)), report.flight
        assert all("all_reduce [4]" in line for line in lines.values()), lines
        if n > 1:  # the rank behind is named by the collectives themselves
            assert "behind: the others are at #" in lines[n - 1], lines
            assert "behind" not in lines[0] and report.odd == (n - 1,), lines
    finally:
        assert handle.cancel() is True
