"""What the stall view costs while nothing stalls, and how soon it shows when something does.

1. **Cost while nothing stalls.** The same DDP training loop (2 CPU ranks on gloo, a small
   MLP, a line printed every few steps so the watch is fed events) is launched again and
   again with the stall watch on (``stall_after=30``, the default) and off
   (``stall_after=None``), alternating, in one run of this script. Reported: each variant's
   median per-step time (the slowest rank's), the ratio on / off (the median of the
   per-pair ratios), and a control: the ratio of two "off" runs (the machine's noise floor).
   Also the kernel's own CPU time per launch. Target: on / off <= 1.01.

   Where the cost could come from: the ranks register a fault handler for a signal that
   never comes (nothing runs), and the kernel's pump notes the time of every event and
   wakes once more per ``stall_after``. Collectives are not checked in a launch (only in
   debug mode and in sessions).

2. **From ``stall_after`` passing to every rank's stack shown**, with 8 ranks: rank 7 sleeps
   while ranks 0-6 wait in ``all_reduce``; a view notes the time of the last event and of
   the stall report's arrival (what the text view prints and the dashboard draws at once).
   Reported: the latency ``report - (last event + stall_after)``, median and worst of
   several launches, and how long reading the 8 ranks' stacks took. Target <= 0.5 s.

3. **What checking collectives costs** (``_worker.collectives``: on in sessions, and in a
   launch in debug mode): a 2-rank session runs a loop of small raw ``all_reduce`` calls and
   of DDP steps, with the check off (``NOTEBOOK_LAUNCHER_CHECK_COLLECTIVES=0``), with it on
   (the default), and -- the alternative the issue names -- with torch's own
   ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` instead (ranks started with ``spawn``, which reads it
   when torch is imported). Reported: microseconds per ``all_reduce`` and milliseconds per
   DDP step, and the ratios to "off".

Run::

    python bench/stall.py                 # defaults: 6 pairs of launches, 5 stalls
    python bench/stall.py --pairs 10 --steps 300
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import Any

from notebook_launcher import notebook_launcher
from notebook_launcher._events import StacksTaken


def ddp_loop(steps: int, hidden: int) -> list[float]:
    """Every rank: seconds per step of a DDP MLP (printing a line every 20 steps)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(
            torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)
        )
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    times = []
    for step in range(steps + 10):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if step >= 10:
            times.append(time.perf_counter() - t0)
        if step % 20 == 0:
            print(f"step {step}", flush=True)
    return times


class Quiet:
    """A view that shows nothing (the text view's printing is not what is measured)."""

    def handle(self, event: Any) -> None:
        pass

    def tick(self) -> None:
        pass

    def close(self) -> None:
        pass


def one_launch(stall_after: float | None, steps: int, hidden: int) -> tuple[float, float]:
    """(median of the slowest rank's step times, the kernel's CPU seconds for the launch)."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    per_rank = notebook_launcher(
        ddp_loop,
        args=(steps, hidden),
        num_processes=2,
        dashboard=Quiet(),
        stall_after=stall_after,
    )
    after = resource.getrusage(resource.RUSAGE_SELF)
    slowest = [max(ts) for ts in zip(*per_rank, strict=True)]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return statistics.median(slowest), cpu


def cost(pairs: int, steps: int, hidden: int) -> None:
    one_launch(None, 20, hidden)  # warm up (imports in the kernel, the port)
    on, off, control, cpu_on, cpu_off = [], [], [], [], []
    for i in range(pairs):
        order = [("on", 30.0), ("off", None), ("control", None)]
        if i % 2:
            order.reverse()
        for name, stall_after in order:
            step, cpu = one_launch(stall_after, steps, hidden)
            {"on": on, "off": off, "control": control}[name].append(step)
            if name == "on":
                cpu_on.append(cpu)
            elif name == "off":
                cpu_off.append(cpu)
    ratio = statistics.median(a / b for a, b in zip(on, off, strict=True))
    noise = statistics.median(a / b for a, b in zip(control, off, strict=True))
    print(f"1. watcher cost while nothing stalls: {pairs} pairs of launches, 2 ranks, "
          f"{steps} DDP steps each (hidden {hidden})")  # fmt: skip
    print(f"   stall watch on  (stall_after=30):  {statistics.median(on) * 1e3:8.3f} ms/step, "
          f"kernel CPU {statistics.median(cpu_on):.3f} s/launch")  # fmt: skip
    print(f"   stall watch off (stall_after=None): {statistics.median(off) * 1e3:7.3f} ms/step, "
          f"kernel CPU {statistics.median(cpu_off):.3f} s/launch")  # fmt: skip
    print(f"   on / off:            {ratio:.3f}   (target <= 1.01)")
    print(f"   control off / off:   {noise:.3f}   (the noise floor of this machine)")


def waits_for_rank_7() -> int:
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 7:
        print("late", flush=True)
        time.sleep(8)
    else:
        print("waiting", flush=True)
    dist.all_reduce(torch.ones(4))
    return 0


class Timer:
    """Notes when the last event of a rank came, and when the stall report came."""

    def __init__(self) -> None:
        self.last = 0.0
        self.report: tuple[float, StacksTaken] | None = None

    def handle(self, event: Any) -> None:
        now = time.monotonic()
        if isinstance(event, StacksTaken):
            if self.report is None:
                self.report = (now, event)
        elif hasattr(event, "rank") and self.report is None:
            self.last = now

    def tick(self) -> None:
        pass

    def close(self) -> None:
        pass


def latency(stalls: int, stall_after: float) -> None:
    from notebook_launcher._launch import stall

    found, reads = [], []
    for _ in range(stalls):
        timer = Timer()
        notebook_launcher(
            waits_for_rank_7, num_processes=8, dashboard=timer, stall_after=stall_after
        )
        assert timer.report is not None, "no stall report"
        at, report = timer.report
        assert report.odd == (7,) and len(report.ranks) == 8, report.findings
        found.append(at - (timer.last + stall_after))
    # reading 8 ranks' stacks on their own (the part of the latency that is ours)
    handle = notebook_launcher(
        waits_for_rank_7, num_processes=8, dashboard=Quiet(), stall_after=None, block=False
    )
    time.sleep(3)
    for _ in range(5):
        t0 = time.perf_counter()
        handle.stacks()
        reads.append(time.perf_counter() - t0)
    handle.cancel()
    print(f"2. from stall_after passing to every rank's stack shown: 8 ranks, {stalls} stalls "
          f"(stall_after={stall_after:g}s)")  # fmt: skip
    print(f"   latency: median {statistics.median(found) * 1e3:.0f} ms, worst "
          f"{max(found) * 1e3:.0f} ms   (target <= 500 ms)")  # fmt: skip
    print(f"   reading the 8 ranks' stacks: median {statistics.median(reads) * 1e3:.1f} ms, worst "
          f"{max(reads) * 1e3:.1f} ms (the ranks' answer timeout is {stall.ANSWER_TIMEOUT:g} s)")  # fmt: skip


def raw_collectives(n: int) -> float:
    """Every rank: seconds per small raw all_reduce (as a cell calls it)."""
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    for _ in range(20):
        dist.all_reduce(t)
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)
    return (time.perf_counter() - t0) / n


def ddp_steps(n: int) -> float:
    """Every rank: seconds per DDP step (or -1 if wrapping the model failed)."""
    times = ddp_loop(n, 256)
    return statistics.median(times)


def checking(calls: int, steps: int, rounds: int) -> None:
    import os

    import notebook_launcher as nl

    variants = {
        "off": ({"NOTEBOOK_LAUNCHER_CHECK_COLLECTIVES": "0"}, "fork"),
        "our check (sessions' default)": ({}, "fork"),
        "torch DETAIL (check off)": (
            {"NOTEBOOK_LAUNCHER_CHECK_COLLECTIVES": "0", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
            "spawn",
        ),
    }
    results: dict[str, tuple[list[float], list[float] | str]] = {}
    for name, (env, method) in variants.items():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            session = nl.start(num_processes=2, start_method=method, dashboard=False)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            per_call = [max(session.run(raw_collectives, calls)) for _ in range(rounds)]
            try:
                per_step: list[float] | str = [
                    max(session.run(ddp_steps, steps)) for _ in range(rounds)
                ]
            except BaseException as exc:  # noqa: BLE001 - DETAIL crashed DDP here (SIGSEGV)
                per_step = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
            results[name] = (per_call, per_step)
        finally:
            session.close()
    base_call = statistics.median(results["off"][0])
    base_step = results["off"][1]
    print(f"3. checking raw collectives in a session: 2 ranks, {calls} all_reduce([4]) and "
          f"{steps} DDP steps, best of {rounds}")  # fmt: skip
    for name, (per_call, per_step) in results.items():
        call = statistics.median(per_call)
        line = f"   {name:<30} all_reduce {call * 1e6:8.1f} us ({call / base_call:4.2f}x)"
        if isinstance(per_step, str) or isinstance(base_step, str):
            line += f", DDP step: {per_step if isinstance(per_step, str) else 'n/a'}"
        else:
            step = statistics.median(per_step)
            ratio = step / statistics.median(base_step)
            line += f", DDP step {step * 1e3:6.3f} ms ({ratio:4.2f}x)"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--stalls", type=int, default=5)
    parser.add_argument("--stall-after", type=float, default=1.0)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=["cost", "latency", "checking"], default=None)
    args = parser.parse_args()
    if args.only in (None, "cost"):
        cost(args.pairs, args.steps, args.hidden)
    if args.only in (None, "latency"):
        latency(args.stalls, args.stall_after)
    if args.only in (None, "checking"):
        checking(args.calls, args.steps, args.rounds)


if __name__ == "__main__":
    main()
