"""``python -m notebook_launcher demo``: a tiny model trained on CPU ranks, in a few seconds.

Every rank builds the same linear model from a fixed seed, trains it on its own share of
a synthetic regression set (``y = x . w + b`` plus noise), and returns its final loss and a
SHA-256 of its weights. Data-parallel training averages the gradients across ranks at every
step, so every rank ends with bit-identical weights: equal checksums are the proof.

The training uses the :class:`~notebook_launcher.accelerator.Accelerator` (``prepare``,
``backward``) when it is available, and plain ``DistributedDataParallel`` otherwise.

Example::

    python -m notebook_launcher demo --num-processes 2 --steps 200
"""

from __future__ import annotations

import hashlib
import struct
import sys
import time
from typing import Any

N_FEATURES = 4
N_SAMPLES = 512
BATCH_SIZE = 16  # per rank
TRUE_WEIGHTS = (1.0, -2.0, 3.0, 0.5)
TRUE_BIAS = 0.25


def weights_checksum(model: Any) -> str:
    """First 12 hex digits of a SHA-256 over every parameter value, in order."""
    digest = hashlib.sha256()
    for p in model.parameters():
        values = p.detach().cpu().double().flatten().tolist()
        digest.update(struct.pack(f"<{len(values)}d", *values))
    return digest.hexdigest()[:12]


def train(steps: int, seed: int = 0) -> dict[str, Any]:
    """The function every rank runs: returns what that rank saw and where it ended."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)  # one core per rank: ranks are already parallel
    rank, world_size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_SAMPLES, N_FEATURES, generator=g)
    y = x @ torch.tensor(TRUE_WEIGHTS) + TRUE_BIAS + 0.01 * torch.randn(N_SAMPLES, generator=g)
    dataset = TensorDataset(x, y.unsqueeze(1))

    torch.manual_seed(seed)  # the same initial weights on every rank
    model: Any = torch.nn.Linear(N_FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    accelerator = _accelerator()
    if accelerator is not None:
        loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=False)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        backward = accelerator.backward
        engine = "Accelerator"
    else:
        shard = TensorDataset(x[rank::world_size], y.unsqueeze(1)[rank::world_size])
        loader = DataLoader(shard, batch_size=BATCH_SIZE, shuffle=False)
        model = torch.nn.parallel.DistributedDataParallel(model)

        def backward(loss: Any) -> None:
            loss.backward()

        engine = "DistributedDataParallel"

    samples = 0
    step = 0
    loss = torch.tensor(0.0)
    while step < steps:
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            backward(loss)
            optimizer.step()
            samples += len(xb)
            step += 1
            if step == steps:
                break
    inner = getattr(model, "module", model)
    return {
        "rank": rank,
        "engine": engine,
        "samples": samples,
        "loss": float(loss.item()),
        "checksum": weights_checksum(inner),
        "weights": [round(v, 3) for v in inner.weight.detach().flatten().tolist()],
    }


def _accelerator() -> Any:
    try:
        from .accelerator import Accelerator
    except ImportError:
        return None
    return Accelerator()


def format_report(results: list[dict[str, Any]], seconds: float) -> list[str]:
    """The table the demo prints, and its verdict."""
    lines = [f"{'rank':>4}  {'samples':>7}  {'final loss':>10}  weights sha256"]
    for r in results:
        lines.append(f"{r['rank']:>4}  {r['samples']:>7}  {r['loss']:>10.6f}  {r['checksum']}")
    checksums = {r["checksum"] for r in results}
    if len(checksums) == 1:
        lines.append(
            f"All {len(results)} ranks hold identical weights "
            f"(gradients averaged at every step by {results[0]['engine']})."
        )
    else:
        lines.append("The ranks' weights differ: gradients were NOT synchronised.")
    lines.append(f"Learned weights {results[0]['weights']} (true: {list(TRUE_WEIGHTS)}).")
    lines.append(f"Done in {seconds:.1f} s.")
    return lines


def run_demo(num_processes: int = 2, steps: int = 200) -> int:
    """Launch :func:`train` on ``num_processes`` ranks, print the report; 0 if ranks agree."""
    from .launcher import notebook_launcher

    print(
        f"notebook_launcher demo: a {N_FEATURES}-feature linear model, {num_processes} ranks, "
        f"{steps} steps of {BATCH_SIZE} samples per rank, synthetic data"
    )
    sys.stdout.flush()
    start = time.perf_counter()
    results = notebook_launcher(train, args=(steps,), num_processes=num_processes)
    print("\n".join(format_report(results, time.perf_counter() - start)))
    return 0 if len({r["checksum"] for r in results}) == 1 else 1


__all__ = ["format_report", "run_demo", "train", "weights_checksum"]
