"""Step time of an Accelerator-prepared DDP MLP vs the same loop written by hand with DDP.

Both loops run in the *same* launch (2 CPU workers on gloo by default), on the same data,
interleaved step by step so that machine noise hits all of them alike:

* hand-written: ``DistributedDataParallel(model)``, a ``DataLoader`` with a
  ``DistributedSampler``, ``loss.backward()``, ``optimizer.step()``, ``zero_grad()``;
* Accelerator: ``accelerator.prepare(model, optimizer, DataLoader(..., shuffle=True))``,
  ``accelerator.backward(loss)``, the same optimizer calls; and a third variant that also
  wraps each step in ``accelerator.accumulate(model)`` (1 step: sync every batch).

Each variant has its own model, optimizer and loader; every step of a round runs one step of
each variant (fetching the batch included), in a rotating order, so all see the same machine
load. A second copy of the hand-written loop is the control: its ratio to the first shows
how far from 1.0 two identical loops land on this machine (the noise floor).

Reported: per-step time (max over ranks, since a DDP step is as slow as its slowest rank),
median and best over rounds, and the ratio Accelerator / hand-written as the median of the
per-round ratios (robust on a shared, noisy machine), of the medians and of the bests.
Target <= 1.05.

Run::

    python bench/train_step.py                    # defaults: 2 workers, 1 thread each
    python bench/train_step.py --hidden 2048 --rounds 12
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_model(width: int, hidden: int, classes: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, classes),
    )


def bench_worker(cfg: dict[str, Any]) -> dict[str, list[float]]:
    """Runs on every rank: returns this rank's seconds per step for each variant and round."""
    from notebook_launcher.accelerator import Accelerator

    torch.set_num_threads(cfg["threads"])
    g = torch.Generator().manual_seed(1)
    n = cfg["steps"] * cfg["batch_size"] * dist.get_world_size()
    dataset = TensorDataset(
        torch.randn(n, cfg["width"], generator=g),
        torch.randint(0, cfg["classes"], (n,), generator=g),
    )

    def model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = make_model(cfg["width"], cfg["hidden"], cfg["classes"])
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    # hand-written DDP, twice: the second copy is the control (its ratio to the first is the
    # noise floor of this machine)
    hand: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    samplers = []
    loaders: dict[str, Any] = {}
    for name in ("hand", "control"):
        model, opt = model_and_opt()
        hand[name] = (DistributedDataParallel(model), opt)
        samplers.append(DistributedSampler(dataset, shuffle=True, seed=0))
        loaders[name] = DataLoader(dataset, batch_size=cfg["batch_size"], sampler=samplers[-1])

    # Accelerator (two copies: plain loop, and the loop inside accumulate())
    accelerator = Accelerator()
    acc = {}
    for name in ("accelerator", "accumulate"):
        model, opt = model_and_opt()
        loader = DataLoader(dataset, batch_size=cfg["batch_size"], shuffle=True)
        acc[name] = accelerator.prepare(model, opt, loader)

    def hand_step(name: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
        model, opt = hand[name]

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()

        return step

    def accel_step(x: torch.Tensor, y: torch.Tensor) -> None:
        model, opt, _ = acc["accelerator"]
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()

    def accumulate_step(x: torch.Tensor, y: torch.Tensor) -> None:
        model, opt, _ = acc["accumulate"]
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()

    steps_of = {
        "hand": hand_step("hand"),
        "control": hand_step("control"),
        "accelerator": accel_step,
        "accumulate": accumulate_step,
    }
    loaders["accelerator"] = acc["accelerator"][2]
    loaders["accumulate"] = acc["accumulate"][2]
    names = list(steps_of)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(cfg["rounds"] + 1):  # round 0 warms up (allocator, DDP buckets)
        for sampler in samplers:
            sampler.set_epoch(r)
        iters = {name: iter(loaders[name]) for name in names}
        spent = dict.fromkeys(names, 0.0)
        dist.barrier()
        for i in range(cfg["steps"]):
            # every step runs all the loops, in a rotating order: load bursts on a shared
            # machine hit them alike
            k = (i + r) % len(names)
            for name in names[k:] + names[:k]:
                start = time.perf_counter()
                x, y = next(iters[name])
                steps_of[name](x, y)
                spent[name] += time.perf_counter() - start
        for name in names:  # the end of the epoch counts too (a prepared loader's cleanup)
            start = time.perf_counter()
            for _ in iters[name]:
                raise RuntimeError("the loaders should be exhausted after `steps` batches")
            spent[name] += time.perf_counter() - start
        if r > 0:
            for name in names:
                times[name].append(spent[name] / cfg["steps"])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument(
        "--steps", type=int, default=50, help="steps per round (one epoch) and variant"
    )
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = parser.parse_args()
    cfg = {k: v for k, v in vars(args).items() if k != "num_processes"}

    from notebook_launcher import notebook_launcher

    results = notebook_launcher(
        bench_worker, args=(cfg,), num_processes=args.num_processes, dashboard=False
    )
    per_round = {
        name: [max(r[name][i] for r in results) for i in range(args.rounds)] for name in results[0]
    }
    med = {name: statistics.median(v) for name, v in per_round.items()}
    best = {name: min(v) for name, v in per_round.items()}

    def paired(name: str) -> float:
        # each round measures both loops back to back: the ratio within a round cancels the
        # slow drift of a shared machine's load; the median drops the rounds a burst hit
        return statistics.median(
            a / h for a, h in zip(per_round[name], per_round["hand"], strict=True)
        )

    print(
        f"MLP {args.width}-{args.hidden}-{args.hidden}-{args.classes}, batch {args.batch_size}/rank, "
        f"{args.num_processes} CPU workers x {args.threads} thread(s), "
        f"{args.rounds} rounds x {args.steps} steps (slowest rank per round)"
    )
    print("                            median ms/step   best ms/step")
    for name, label in (
        ("hand", "hand-written DDP"),
        ("control", "hand-written, 2nd copy"),
        ("accelerator", "Accelerator"),
        ("accumulate", "Accelerator + accumulate"),
    ):
        print(f"  {label:<25} {med[name] * 1e3:12.3f} {best[name] * 1e3:14.3f}")
    for name, label in (
        ("control", "control (noise floor)"),
        ("accelerator", "Accelerator"),
        ("accumulate", "Accelerator+accumulate"),
    ):
        print(
            f"  ratio {label} / hand: median of per-round ratios {paired(name):.3f}, "
            f"of medians {med[name] / med['hand']:.3f}, of bests {best[name] / best['hand']:.3f}"
        )
    print("  target: <= 1.05")


if __name__ == "__main__":
    main()
