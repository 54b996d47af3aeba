"""One check function, run three ways by ``tests/test_operations.py``:

* under :func:`notebook_launcher.notebook_launcher` (the group already exists: adopted),
* under ``torchrun --nproc-per-node 2`` (this file as the script: the group is created by
  ``PartialState``),
* as a plain single process (``DistributedType.NO``).

:func:`check_everything` only *observes* (plain Python values, no assertions), and
:func:`expected` says what every observation must be for a given rank and world size, so
all three runs are held to the same table.

As a script: ``python -m torch.distributed.run --nproc-per-node 2 ... _torchrun_target.py OUT``
writes ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

from notebook_launcher.state import AcceleratorState, PartialState
from notebook_launcher.utils import (
    broadcast,
    broadcast_object_list,
    concatenate,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
    set_seed,
)


def check_everything() -> dict[str, Any]:
    """Exercise state, process control and every operation; return what was seen."""
    state = PartialState()
    r, n = state.process_index, state.num_processes
    out: dict[str, Any] = {
        "type": str(state.distributed_type),
        "n": n,
        "rank": r,
        "main": state.is_main_process,
        "last": state.is_last_process,
        "use_distributed": state.use_distributed,
        "acc_rank": AcceleratorState().process_index,
    }
    order: list[str] = []
    with state.main_process_first():
        order.append(f"{r}@{time.time()!r}")
    state.wait_for_everyone()
    out["first_ran"] = len(order)

    @state.on_main_process
    def only_main() -> str:
        return "main"

    out["only_main"] = only_main()
    with state.split_between_processes(list(range(5)), apply_padding=True) as part:
        out["split"] = part

    # A non-contiguous tensor (a transposed view) inside a nested structure.
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r
    nested = {"t": base.t(), "pair": (torch.tensor(r), torch.tensor([True, r == 0]))}
    g = gather(nested)
    out["gather_t"] = g["t"].tolist()
    out["gather_scalar"] = g["pair"][0].tolist()
    out["gather_bool"] = g["pair"][1].tolist()
    out["gather_object"] = gather_object([f"r{r}", r])
    out["gather_object_dict"] = gather_object({"rank": r})
    b = broadcast(torch.full((2, 2), float(r)).t(), from_process=n - 1)
    out["broadcast"] = b.tolist()
    objs: list[Any] = [{"from": r}, r * 10]
    out["broadcast_objects"] = broadcast_object_list(objs, from_process=0)
    value = torch.tensor([r + 1.0, 2.0 * r])
    out["reduce_sum"] = reduce(value, "sum").tolist()
    out["reduce_mean"] = reduce({"v": value}, "mean")["v"].tolist()
    out["reduce_max"] = reduce([value], "max")[0].tolist()
    padded = pad_across_processes(torch.ones(r + 1, 2), dim=0, pad_index=-1)
    out["pad_gather"] = gather(padded).tolist()
    padded_first = pad_across_processes(torch.ones(2, r + 1), dim=1, pad_first=True)
    out["pad_first"] = padded_first.tolist()
    out["concatenate"] = concatenate([{"x": torch.ones(1)}, {"x": torch.zeros(2)}])["x"].tolist()
    out["send"] = str(send_to_device({"a": torch.ones(1)}, state.device)["a"].device)
    set_seed(7, device_specific=True)
    drawn = torch.rand(1).item()
    torch.manual_seed(7 + r)
    out["seeded"] = drawn == torch.rand(1).item()
    if state.is_last_process:
        state.set_trigger()
    out["trigger"] = state.check_trigger()
    return out


def expected(rank: int, n: int) -> dict[str, Any]:
    """What :func:`check_everything` must return on ``rank`` of ``n``."""
    base = [[[i + 10.0 * q, i + 3 + 10.0 * q] for i in range(3)] for q in range(n)]
    sizes = [5 // n + (1 if q < 5 % n else 0) for q in range(n)]
    starts = [sum(sizes[:q]) for q in range(n)]
    width = max(sizes)
    share = list(range(starts[rank], starts[rank] + sizes[rank]))
    share += share[-1:] * (width - len(share))
    last = float(n - 1)

    def pad_rows(q: int) -> list[list[float]]:
        return [[1.0, 1.0]] * (q + 1) + [[-1.0, -1.0]] * (n - 1 - q)

    return {
        "type": "MULTI_CPU" if n > 1 else "NO",
        "n": n,
        "rank": rank,
        "main": rank == 0,
        "last": rank == n - 1,
        "use_distributed": n > 1,
        "acc_rank": rank,
        "first_ran": 1,
        "only_main": "main" if rank == 0 else None,
        "split": share if n > 1 else list(range(5)),
        "gather_t": [row for q in range(n) for row in base[q]],
        "gather_scalar": list(range(n)) if n > 1 else 0,
        "gather_bool": [x for q in range(n) for x in (True, q == 0)],
        "gather_object": [x for q in range(n) for x in (f"r{q}", q)],
        "gather_object_dict": [{"rank": q} for q in range(n)],
        "broadcast": [[last, last], [last, last]],
        "broadcast_objects": [{"from": 0}, 0],
        "reduce_sum": [n * (n + 1) / 2, float(n * (n - 1))],
        "reduce_mean": [(n + 1) / 2, float(n - 1)],
        "reduce_max": [float(n), 2.0 * (n - 1)],
        "pad_gather": [row for q in range(n) for row in pad_rows(q)],
        "pad_first": [[0.0] * (n - 1 - rank) + [1.0] * (rank + 1)] * 2,
        "concatenate": [1.0, 0.0, 0.0],
        "send": "cpu",
        "seeded": True,
        "trigger": True,
    }


if __name__ == "__main__":
    result = check_everything()
    state = PartialState()
    with open(os.path.join(sys.argv[1], f"rank{state.process_index}.json"), "w") as f:
        json.dump(result, f)
    state.destroy_process_group()
