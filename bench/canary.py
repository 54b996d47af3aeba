"""What the fork canary costs a launch onto GPUs, on CPU with the CUDA emulation.

    python bench/canary.py [--runs 15] [--rss-mb 512]

Before forking ranks that will use a GPU, the launcher forks a throwaway child that reads
torch's bad-fork flag (``_posix.fork_handler_registered``): that costs one fork of the kernel,
and a fork costs more the more memory the kernel holds. Measured here in a pretend kernel
whose torch behaves as a CUDA build on a machine with two GPUs
(``tests/_cuda_site/cuda_emulation.py``; the script re-runs itself under it), holding
``--rss-mb`` of tensors as a notebook would:

* the canary alone (fork, answer, reap), against a bare ``os.fork()`` + ``waitpid`` of the
  same process (the price of any fork of it: each forked rank pays it too);
* launch to return of one rank on a pretend GPU, with the canary and without it (the
  canary switched off in the same process), interleaved; and a hand-written fork +
  ``set_device`` + one-rank process group, the peer;
* a CPU launch (``devices='cpu'``), which never asks the canary.

Medians of ``--runs``; the ratio "with / without" is what the canary adds to a GPU launch.
On a GPU machine run it without the emulation: ``python bench/canary.py --real``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _trivial() -> int:
    import torch

    return int(torch.cuda.is_available())


def _hand_fork() -> float:
    """A hand-written launch of one GPU rank: fork, set_device, a gloo group of one."""
    import socket

    t0 = time.perf_counter()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import torch
            import torch.distributed as dist

            torch.cuda.set_device(0)
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
            )
            dist.destroy_process_group()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return time.perf_counter() - t0


def measure(runs: int, rss_mb: int) -> None:
    from notebook_launcher import _posix, notebook_launcher
    from notebook_launcher._launch import preflight
    from notebook_launcher.ui import NullView

    # a notebook's data, resident (not a torch op: that would start torch's OpenMP pool,
    # and the launcher would rightly use its forkserver instead of forking)
    ballast = b"\x01" * (rss_mb * 2**20)  # noqa: F841 - held
    real = preflight.fork_handler_registered
    canary, bare = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        assert _posix.fork_answer(_posix._bad_fork_here, 5.0) == b"ok"
        canary.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        bare.append(time.perf_counter() - t0)
    rows: dict[str, list[float]] = {"with canary": [], "without": [], "hand": [], "cpu": []}
    for _ in range(runs):
        for name in ("with canary", "without", "hand", "cpu"):
            if name == "hand":
                rows[name].append(_hand_fork())
                continue
            preflight.fork_handler_registered = real if name == "with canary" else lambda: False
            devices = "cpu" if name == "cpu" else "auto"
            t0 = time.perf_counter()
            notebook_launcher(_trivial, (), 1, devices=devices, dashboard=NullView())
            rows[name].append(time.perf_counter() - t0)
    preflight.fork_handler_registered = real

    def ms(values: list[float]) -> str:
        return f"{1000 * statistics.median(values):.1f} ms"

    with_, without = statistics.median(rows["with canary"]), statistics.median(rows["without"])
    print(f"kernel: torch + {rss_mb} MiB of tensors; medians of {runs}\n")
    print("| what | time |\n|---|---|")
    print(f"| canary (fork, answer, reap) | {ms(canary)} |")
    print(f"| bare fork + waitpid of the same process | {ms(bare)} |")
    print(f"| 1 GPU rank, launch to return, with the canary | {ms(rows['with canary'])} |")
    print(f"| 1 GPU rank, launch to return, canary off | {ms(rows['without'])} |")
    print(f"| hand-written fork + set_device + gloo group of one | {ms(rows['hand'])} |")
    print(f"| 1 CPU rank (devices='cpu': no canary) | {ms(rows['cpu'])} |")
    print(f"\nwith / without the canary: {with_ / without:.3f}x")
    print(f"ours (with the canary) / hand-written: {with_ / statistics.median(rows['hand']):.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--rss-mb", type=int, default=512)
    parser.add_argument("--real", action="store_true", help="a real GPU machine: no emulation")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.real or args.inside:
        measure(args.runs, args.rss_mb)
        return
    sys.path.insert(0, str(ROOT / "tests" / "_cuda_site"))
    import cuda_emulation

    env = cuda_emulation.environment()
    argv = [sys.executable, __file__, "--inside", "--runs", str(args.runs)]
    argv += ["--rss-mb", str(args.rss_mb)]
    raise SystemExit(subprocess.run(argv, env=env, check=False).returncode)


if __name__ == "__main__":
    main()
