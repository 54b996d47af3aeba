"""Cost of a tqdm bar reported to the dashboard, over the same loop with no bar at all.

Runs a launched CPU job (default 2 ranks, gloo). Inside each rank, rounds alternate
between versions of a tight loop of ``N`` steps (default 100k); each step is a small
torch op (``--work``: a ``k x k`` matmul on one thread, default k=64, ~7 us here):

* ``bare``:        ``for i in range(N): step()``
* ``iter``:        ``for i in tqdm(range(N)): step()``         (``from tqdm.auto import tqdm``)
* ``update``:      ``bar = tqdm(total=N)`` ... ``step(); bar.update(1)``
* ``plain-iter``, ``plain-update``: the same with our integration uninstalled (stock tqdm
  drawing into /dev/null), to separate tqdm's own per-step cost from ours.

Our bars are the worker-side ones (``notebook_launcher._worker.progress``): they draw nothing
and send coalesced ``ProgressUpdate`` events through the real pipe to the parent, whose
view counts them. Each round is timed in CPU time of the rank's process
(``time.process_time``: a shared, busy machine's preemptions do not count, the bars'
own work, including pickling events into the pipe, does), and the fastest round of each
version is compared with ``bare``. The per-step overhead is printed in nanoseconds (it
does not depend on the step's cost).

Usage::

    python bench/progress.py [--steps 100000] [--rounds 3] [--processes 2] [--work 64]

Budget: ratio <= 1.05 for ``iter`` and ``update``. What a bar costs per step is tqdm's
own counting (~150-250 ns here, the same with and without our integration: compare the
``plain-`` rows); events cost nothing per step, as tqdm calls ``display`` ~10 times a
second. So the ratio depends on the step: at ``--work 32`` (~2 us a step) the same
overhead is 7-12%. Timing varies with machine load: compare figures from the same machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from notebook_launcher import notebook_launcher
from notebook_launcher._events import Event, ProgressUpdate
from notebook_launcher._worker import progress as _progress

VERSIONS = ("bare", "iter", "update", "plain-iter", "plain-update")


def _bench(steps: int, rounds: int, work: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    a = torch.randn(work, work)
    b = torch.randn(work, work)
    rank = int(os.environ["RANK"])
    sink = open(os.devnull, "w")  # noqa: SIM115 - closed below

    def bare() -> None:
        for _ in range(steps):
            torch.mm(a, b)

    def with_iter() -> None:
        for _ in tqdm(range(steps), desc="iter", file=sink):
            torch.mm(a, b)

    def with_update() -> None:
        bar = tqdm(total=steps, desc="update", file=sink)
        for _ in range(steps):
            torch.mm(a, b)
            bar.update(1)
        bar.close()

    def plain(fn: Any) -> Any:
        def run() -> None:
            _progress.uninstall()
            try:
                fn()
            finally:
                _progress.install(rank)

        return run

    versions = {
        "bare": bare,
        "iter": with_iter,
        "update": with_update,
        "plain-iter": plain(with_iter),
        "plain-update": plain(with_update),
    }
    bare()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in versions}
    for i in range(rounds):
        order = list(versions) if i % 2 == 0 else list(reversed(versions))
        for name in order:
            start = time.process_time()
            versions[name]()
            times[name].append(time.process_time() - start)
    sink.close()
    return {k: min(v) / steps for k, v in times.items()}


class _Counter:
    """A view that counts the progress events the parent received, per (rank, bar)."""

    def __init__(self) -> None:
        self.per_bar: dict[tuple[int, int], int] = {}

    def handle(self, event: Event) -> None:
        if isinstance(event, ProgressUpdate):
            key = (event.rank, event.bar_id)
            self.per_bar[key] = self.per_bar.get(key, 0) + 1

    def tick(self) -> None:
        pass

    def close(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--work", type=int, default=64, help="k of the k x k matmul per step")
    args = parser.parse_args()

    print(
        f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
        f"on {os.cpu_count()} cores"
    )
    counter = _Counter()
    t0 = time.perf_counter()
    results = notebook_launcher(
        _bench,
        args=(args.steps, args.rounds, args.work),
        num_processes=args.processes,
        dashboard=counter,
    )
    wall = time.perf_counter() - t0
    print(
        f"{args.processes} ranks x {args.rounds} rounds x {args.steps} steps of a "
        f"{args.work}x{args.work} matmul (fastest round, CPU time; launch took {wall:.1f}s)"
    )
    print(f"{'rank':>4} {'version':>13} {'us/step':>9} {'ratio':>7} {'+ns/step':>9}")
    worst = 0.0
    for rank, r in enumerate(results):
        for name in VERSIONS:
            ratio = r[name] / r["bare"]
            extra = (r[name] - r["bare"]) * 1e9
            if name in ("iter", "update"):
                worst = max(worst, ratio)
            print(f"{rank:>4} {name:>13} {r[name] * 1e6:>9.3f} {ratio:>7.3f} {extra:>9.0f}")
    per_bar = sorted(counter.per_bar.values())
    seconds = min(r["iter"] for r in results) * args.steps
    print(
        f"events received by the parent: {sum(per_bar)} for {len(per_bar)} bars "
        f"(min {per_bar[0]}, median {statistics.median(per_bar):.0f}, max {per_bar[-1]} per bar;"
        f" one bar runs about {seconds:.2f}s)"
    )
    verdict = "within" if worst <= 1.05 else "OVER"
    print(f"worst ratio of our bars: {worst:.3f}: {verdict} the 1.05 budget")


if __name__ == "__main__":
    main()
