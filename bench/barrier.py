"""Cost of ``wait_for_everyone`` (with its dashboard events) over a bare ``dist.barrier()``.

Runs a launched 2-rank CPU job (gloo). Inside it, rounds of ``N`` barriers alternate
between ``PartialState().wait_for_everyone()`` (which sends ``BarrierEnter`` and
``BarrierExit`` to the parent) and a bare ``torch.distributed.barrier()``; the median
round of each is compared. Also measures the shape-digest check in front of ``gather``
against a bare ``all_gather`` of the same tensor (a separate figure, not part of the
barrier budget).

Usage::

    python bench/barrier.py [--barriers 2000] [--rounds 7] [--processes 2]

Prints per-call microseconds and the ratios; the budget for the barrier is a ratio
<= 1.10. Timing varies with machine load: compare figures from the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from notebook_launcher import notebook_launcher
from notebook_launcher.state import PartialState
from notebook_launcher.ui import NullView
from notebook_launcher.utils import gather


def _time(fn: object, n: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        fn()  # type: ignore[operator]
    return (time.perf_counter() - start) / n


def _bench(barriers: int, rounds: int) -> dict[str, float]:
    state = PartialState()
    # Warm-up: first calls pay for connection setup and imports.
    for _ in range(200):
        state.wait_for_everyone()
        dist.barrier()
    ours: list[float] = []
    bare: list[float] = []
    for i in range(rounds):
        pair = [(ours, state.wait_for_everyone), (bare, dist.barrier)]
        for out, fn in pair if i % 2 == 0 else reversed(pair):
            out.append(_time(fn, barriers))

    tensor = torch.ones(16)
    buffer = torch.empty(16 * state.num_processes)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    checked: list[float] = []
    plain: list[float] = []
    for i in range(rounds):
        pair = [
            (checked, lambda: gather(tensor)),
            (plain, lambda: all_gather(buffer, tensor)),
        ]
        for out, fn in pair if i % 2 == 0 else reversed(pair):
            out.append(_time(fn, max(barriers // 4, 50)))
    return {
        "wait_for_everyone": statistics.median(ours),
        "barrier": statistics.median(bare),
        "gather": statistics.median(checked),
        "all_gather": statistics.median(plain),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--barriers", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    results = notebook_launcher(
        _bench,
        args=(args.barriers, args.rounds),
        num_processes=args.processes,
        dashboard=NullView(),
    )
    r = results[0]
    ratio = r["wait_for_everyone"] / r["barrier"]
    print(f"{args.processes} ranks, {args.rounds} rounds x {args.barriers} barriers (median round)")
    print(f"  bare dist.barrier():        {r['barrier'] * 1e6:8.1f} us/call")
    print(f"  wait_for_everyone()+events: {r['wait_for_everyone'] * 1e6:8.1f} us/call")
    print(f"  ratio: {ratio:.3f}  (budget <= 1.10: {'ok' if ratio <= 1.10 else 'OVER'})")
    print(f"  bare all_gather(16 floats): {r['all_gather'] * 1e6:8.1f} us/call")
    print(f"  gather() with shape digest: {r['gather'] * 1e6:8.1f} us/call")
    print(f"  ratio: {r['gather'] / r['all_gather']:.3f}  (informational)")


if __name__ == "__main__":
    main()
