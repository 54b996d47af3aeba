"""Cost of ``wait_for_everyone`` (with its dashboard reporting) over a bare ``dist.barrier()``.

Runs a launched CPU job (gloo, 2 ranks by default). Inside it, many short rounds of
``N`` barriers alternate between ``PartialState().wait_for_everyone()`` and a bare
``torch.distributed.barrier()``; each ``wait_for_everyone`` round is compared with the bare
round next to it, and the median of those paired ratios is reported (pairing cancels the
slow drift of a shared machine's load). An A/A comparison (bare against bare, same
procedure) shows how much of a ratio is noise.

Also measures ``gather()`` and ``reduce()`` of 16 floats against a bare ``all_gather`` /
``all_reduce`` of the same tensor, with the same paired procedure and its own A/A line. On gloo
both check that the ranks agree on the shapes (a mismatch raises instead of aborting a rank);
the check travels in the same packet as the data, so a small gather is one collective. The
budget for ``gather()`` is a ratio <= 1.20.

Usage::

    python bench/barrier.py [--barriers 200] [--rounds 41] [--processes 2]

The budget for the barrier is a ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from notebook_launcher import notebook_launcher
from notebook_launcher.state import PartialState
from notebook_launcher.ui import NullView
from notebook_launcher.utils import gather, operations, reduce


def _time(fn: Callable[[], Any], n: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def _paired(a: Callable[[], Any], b: Callable[[], Any], n: int, rounds: int) -> dict[str, float]:
    """Median per-call time of ``a`` and ``b`` and the median of paired ratios a/b."""
    ta: list[float] = []
    tb: list[float] = []
    for i in range(rounds):
        if i % 2 == 0:
            ta.append(_time(a, n))
            tb.append(_time(b, n))
        else:
            tb.append(_time(b, n))
            ta.append(_time(a, n))
    return {
        "a": statistics.median(ta),
        "b": statistics.median(tb),
        "ratio": statistics.median(x / y for x, y in zip(ta, tb, strict=True)),
    }


def _bench(barriers: int, rounds: int) -> dict[str, dict[str, float]]:
    state = PartialState()
    for _ in range(300):  # warm-up: connections, imports, the reporting thread
        state.wait_for_everyone()
        dist.barrier()
    out = {
        "barrier": _paired(state.wait_for_everyone, dist.barrier, barriers, rounds),
        "a/a": _paired(dist.barrier, dist.barrier, barriers, rounds),
    }
    # The reporting's own cost, free of network noise: the same call with the barrier
    # itself replaced by a no-op, against calling that no-op directly.
    real_barrier = dist.barrier

    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    dist.barrier = noop
    try:
        out["own"] = _paired(state.wait_for_everyone, noop, barriers * 10, rounds)
    finally:
        dist.barrier = real_barrier
    tensor = torch.ones(16)
    buffer = torch.empty(16 * state.num_processes)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def bare_gather() -> None:
        all_gather(buffer, tensor)

    def bare_reduce() -> None:
        dist.all_reduce(tensor.clone())

    out["gather"] = _paired(lambda: gather(tensor), bare_gather, barriers, rounds)
    out["gather a/a"] = _paired(bare_gather, bare_gather, barriers, rounds)
    out["reduce"] = _paired(lambda: reduce(tensor, "sum"), bare_reduce, barriers, rounds)
    # gather()'s own cost, free of network noise: its packet exchange replaced by a no-op
    # that leaves every rank's digest in place, against calling that no-op directly.
    real_start = operations._Packets.start

    class _Done:
        def wait(self) -> None:
            return None

    def start_noop(packets: Any, digest: int) -> _Done:
        packets.digests[:] = digest
        return _Done()

    operations._Packets.start = start_noop  # type: ignore[method-assign]
    try:
        out["gather own"] = _paired(lambda: gather(tensor), noop, barriers * 10, rounds)
    finally:
        operations._Packets.start = real_start  # type: ignore[method-assign]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--barriers", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    results = notebook_launcher(
        _bench,
        args=(args.barriers, args.rounds),
        num_processes=args.processes,
        dashboard=NullView(),
    )
    r = results[0]
    b, aa, g, gaa, red, own, gown = (
        r[k] for k in ("barrier", "a/a", "gather", "gather a/a", "reduce", "own", "gather own")
    )
    own_us = (own["a"] - own["b"]) * 1e6
    print(f"{args.processes} ranks, {args.rounds} paired rounds x {args.barriers} barriers")
    print(f"  bare dist.barrier():        {b['b'] * 1e6:8.1f} us/call (median round)")
    print(f"  wait_for_everyone():        {b['a'] * 1e6:8.1f} us/call (median round)")
    verdict = "ok" if b["ratio"] <= 1.10 else "OVER"
    print(f"  ratio (median of pairs):    {b['ratio']:8.3f}   budget <= 1.10: {verdict}")
    print(f"  A/A noise, bare vs bare:    {aa['ratio']:8.3f}")
    print(
        f"  own cost (barrier no-op'd): {own_us:8.2f} us/call = "
        f"{own_us / (b['b'] * 1e6) * 100:.1f}% of a bare barrier"
    )
    print(f"  bare all_reduce(16 floats): {red['b'] * 1e6:8.1f} us/call")
    print(f"  reduce() with shape check:  {red['a'] * 1e6:8.1f} us/call")
    print(f"  ratio (informational):      {red['ratio']:8.3f}")
    print(f"  A/A noise, bare all_gather: {gaa['ratio']:8.3f}")
    print(f"  bare all_gather(16 floats): {g['b'] * 1e6:8.1f} us/call")
    print(f"  gather() with shape check:  {g['a'] * 1e6:8.1f} us/call")
    print(f"  gather's own cost (no-op'd): {(gown['a'] - gown['b']) * 1e6:7.2f} us/call")
    verdict = "ok" if g["ratio"] <= 1.20 else "OVER"
    print(f"  gather ratio (median pairs): {g['ratio']:7.3f}   budget <= 1.20: {verdict}")


if __name__ == "__main__":
    main()
