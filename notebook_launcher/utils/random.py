"""Seeding every random number generator a training script touches."""

from __future__ import annotations

import random

import torch

from .. import state as _state


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


__all__ = ["set_seed"]
