"""Soak: many launches in one process, some failing; resources must stay flat.

Runs ``--launches`` launches of 2 ranks (default 1000) in this process; every 10th one
has a rank that raises (10% of launches fail, the other rank is stopped as collateral).
Every ``--every`` launches it samples the kernel-side resources a leak would grow: RSS,
open fds, threads, child processes. Then it runs the same loop, shorter (``--peer``
launches), with a hand-written ``torch.multiprocessing`` fork + gloo launcher as the peer,
and prints both: the growth per 100 launches, and the time per launch as a ratio.

Usage::

    python bench/soak.py [--launches 1000] [--peer 200] [--every 100]

Target (issue 10): flat RSS, fds and threads (no growth beyond allocator noise), no
child left behind.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from notebook_launcher import notebook_launcher
from notebook_launcher.ui import NullView


def work(fail: bool) -> int:
    import torch.distributed as dist

    rank = dist.get_rank()
    if fail and rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()
    return rank


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def children() -> int:
    total = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            total += len(f.read().split())
    return total


def sample() -> dict[str, int]:
    return {
        "rss_kib": rss_kib(),
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "children": children(),
    }


def ours(fail: bool) -> None:
    try:
        notebook_launcher(work, (fail,), 2, dashboard=NullView())
    except ValueError:
        assert fail


def _peer_rank(rank: int, port: int, fail: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        work(fail)
    finally:
        dist.destroy_process_group()


def peer(fail: bool) -> None:
    """The usual hand-written launch: torch.multiprocessing, fork, gloo on a free port."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(_peer_rank, args=(port, fail), nprocs=2, start_method="fork")
    except mp.ProcessRaisedException:
        assert fail
    except mp.ProcessExitedException:
        assert fail


def soak(launch: Callable[[bool], None], n: int, every: int) -> tuple[list[dict[str, Any]], float]:
    launch(False)  # warm up: imports, the first pool of everything
    samples = [{"after": 0, **sample()}]
    times = []
    for i in range(1, n + 1):
        t = time.perf_counter()
        launch(i % 10 == 0)
        times.append(time.perf_counter() - t)
        if i % every == 0:
            samples.append({"after": i, **sample()})
    return samples, statistics.median(times)


def growth(samples: list[dict[str, Any]], key: str) -> float:
    """Growth per 100 launches between the second sample and the last (the first
    interval includes allocator warm-up)."""
    first, last = samples[1] if len(samples) > 2 else samples[0], samples[-1]
    span = last["after"] - first["after"]
    return 100 * (last[key] - first[key]) / span if span else 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launches", type=int, default=1000)
    parser.add_argument("--peer", type=int, default=200)
    parser.add_argument("--every", type=int, default=100)
    args = parser.parse_args()
    print(f"{args.launches} launches of 2 ranks, every 10th with a failing rank")
    ours_samples, ours_time = soak(ours, args.launches, args.every)
    print(f"{'after':>6} {'RSS MiB':>8} {'fds':>5} {'threads':>8} {'children':>9}")
    for s in ours_samples:
        print(
            f"{s['after']:>6} {s['rss_kib'] / 1024:>8.1f} {s['fds']:>5} {s['threads']:>8} "
            f"{s['children']:>9}"
        )
    peer_samples, peer_time = soak(peer, args.peer, max(1, args.peer // 2))
    print("\ngrowth per 100 launches (after the first interval):")
    for label, samples in (("notebook_launcher", ours_samples), ("hand-written mp", peer_samples)):
        print(
            f"  {label:<18} RSS {growth(samples, 'rss_kib'):+7.1f} KiB   fds "
            f"{growth(samples, 'fds'):+.2f}   threads {growth(samples, 'threads'):+.2f}   "
            f"children left {samples[-1]['children']}"
        )
    print(
        f"\nmedian time per launch: notebook_launcher {ours_time * 1000:.1f} ms, hand-written "
        f"{peer_time * 1000:.1f} ms (ratio {ours_time / peer_time:.2f})"
    )


if __name__ == "__main__":
    main()
