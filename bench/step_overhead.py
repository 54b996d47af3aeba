"""The Accelerator's own cost per step, on one rank: what a GPU step pays on the CPU.

A GPU step is as fast as the CPU can queue its kernels; every microsecond of Python around
``model(x)``, ``backward`` and ``step`` is then time the GPU may wait. This measures that
cost where it can be measured without a GPU: a tiny MLP on one CPU thread, whose step is
mostly Python, trained three ways in the same launched rank -- a hand-written loop,
Accelerate's ``Accelerator`` (when installed) and ours -- one step of each in turn so that
machine noise hits all three alike. Prints the median time per step (batch fetch included)
and each one's overhead over the hand-written loop.

Run::

    python bench/step_overhead.py                 # in a launched rank (what users run)
    python bench/step_overhead.py --in-process    # in this process, no launch
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure(steps: int) -> dict[str, float]:
    import gpu  # bench/gpu.py: the same model and data as the GPU check, tiny
    import torch
    import torch.nn.functional as F

    import notebook_launcher

    torch.set_num_threads(1)
    makers: dict[str, Any] = {"hand": None, "ours": notebook_launcher.Accelerator}
    try:
        import accelerate

        makers["accelerate"] = accelerate.Accelerator
    except ImportError:
        pass
    variants = {}
    for name, make in makers.items():
        model, opt, loader = gpu._model_and_data(True, steps, 0)
        acc = make(mixed_precision="no") if make is not None else None
        if acc is not None:
            model, opt, loader = acc.prepare(model, opt, loader)

        def step(x: Any, y: Any, model: Any = model, opt: Any = opt, acc: Any = acc) -> None:
            loss = F.cross_entropy(model(x), y)
            if acc is None:
                loss.backward()
            else:
                acc.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)

        variants[name] = (step, iter(loader))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(steps):
        for name, (step, batches) in variants.items():
            t0 = time.perf_counter()
            step(*next(batches))
            times[name].append(time.perf_counter() - t0)
    skip = steps // 10
    return {name: statistics.median(t[skip:]) * 1e6 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--in-process", action="store_true")
    args = parser.parse_args()
    if args.in_process:
        us = measure(args.steps)
    else:
        from notebook_launcher import notebook_launcher

        (us,) = notebook_launcher(measure, (args.steps,), 1, dashboard=False)
    hand = us["hand"]
    where = "in this process" if args.in_process else "in a launched rank"
    print(f"median us per step {where} (tiny MLP, 1 thread, {args.steps} interleaved steps):")
    for name, value in us.items():
        extra = "" if name == "hand" else f"  overhead {value - hand:+.0f} us ({value / hand:.2f}x)"
        print(f"  {name:<11} {value:8.0f}{extra}")


if __name__ == "__main__":
    main()
