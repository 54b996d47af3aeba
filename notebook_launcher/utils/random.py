"""Seeding every random number generator a training script touches, and bringing the
ranks' generators into the same state."""

from __future__ import annotations

import random
from collections.abc import Iterable

import torch
import torch.distributed as dist

from .. import state as _state
from .dataclasses import RNGType


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed ``random``, ``numpy`` (if installed) and ``torch`` (CPU and every CUDA device).

    Args:
        seed: the seed.
        device_specific: add the process index, so each rank draws different numbers
            (e.g. for data augmentation) while staying reproducible.
        deterministic: also ask torch for deterministic algorithms
            (``torch.use_deterministic_algorithms(True)``), slower on GPU.

    Example::

        set_seed(42)                          # same numbers on every rank
        set_seed(42, device_specific=True)    # rank r uses seed 42 + r
    """
    if device_specific:
        seed += _state.PartialState().process_index
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def synchronize_rng_state(
    rng_type: RNGType | str | None = None, generator: torch.Generator | None = None
) -> None:
    """Give every rank the main process's state of one generator.

    Args:
        rng_type: ``"torch"`` (the global CPU generator), ``"cuda"`` (this rank's GPU
            generator) or ``"generator"`` (``generator``). Other devices' generators raise
            ``ValueError``: this package runs on CPUs and CUDA GPUs only.
        generator: the generator to synchronise for ``"generator"``.

    A collective when distributed: call it on every rank.

    Example::

        synchronize_rng_state("torch")   # the next torch.rand() is the same on every rank
    """
    kind = RNGType(rng_type) if rng_type is not None else RNGType.TORCH
    if kind == RNGType.TORCH:
        rng_state = torch.get_rng_state()
    elif kind == RNGType.CUDA:
        if not torch.cuda.is_available():
            raise ValueError("synchronize_rng_state('cuda') needs a CUDA GPU")
        rng_state = torch.cuda.get_rng_state()
    elif kind == RNGType.GENERATOR:
        if generator is None:
            raise ValueError("synchronize_rng_state('generator') needs generator=<torch.Generator>")
        rng_state = generator.get_state()
    else:
        raise ValueError(
            f"cannot synchronise the {kind.value!r} generator: notebook_launcher runs on CPUs "
            "and CUDA GPUs (use 'torch', 'cuda' or 'generator')"
        )
    ps = _state.PartialState()
    if ps.use_distributed:
        on_gpu = ps.device.type == "cuda" and ps.backend is not None and "nccl" in ps.backend
        wire = rng_state.to(ps.device) if on_gpu else rng_state.clone()
        dist.broadcast(wire, src=0)
        rng_state = wire.cpu()
    if kind == RNGType.TORCH:
        torch.set_rng_state(rng_state)
    elif kind == RNGType.CUDA:
        torch.cuda.set_rng_state(rng_state)
    else:
        assert generator is not None
        generator.set_state(rng_state)


def synchronize_rng_states(
    rng_types: Iterable[RNGType | str], generator: torch.Generator | None = None
) -> None:
    """:func:`synchronize_rng_state` for each of ``rng_types``, in order.

    Example::

        synchronize_rng_states(["torch", "generator"], generator=loader_generator)
    """
    for rng_type in rng_types:
        synchronize_rng_state(RNGType(rng_type), generator=generator)


__all__ = ["set_seed", "synchronize_rng_state", "synchronize_rng_states"]
