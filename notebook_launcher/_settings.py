"""The kernel's global RNG and torch settings, carried to ranks that were not forked from it.

A forked rank inherits everything the notebook set: ``torch.manual_seed`` and the RNG
state, ``random.seed``, NumPy's global seed, ``torch.use_deterministic_algorithms``,
``torch.backends.cudnn.benchmark``, ``torch.set_default_dtype``, TF32 switches. A rank
started by the forkserver or by spawn is a fresh interpreter and would see torch's
defaults instead: the start method the launcher picks would change what the user's code
computes. :func:`capture` reads these settings in the kernel (plain, picklable data; only
what was imported there) and :func:`apply` sets them in the rank before the function runs.

Python's ``random`` is the one thing fork does not carry: CPython reseeds it in every
forked child. It is applied under fork too, so that ``random.seed(0)`` in the notebook is
honoured in every start method, as the torch and NumPy seeds are.

Bottom layer: imports nothing of ours, and never imports torch or NumPy itself (it reads
them from ``sys.modules``).
"""

from __future__ import annotations

import sys
from typing import Any


def capture() -> dict[str, Any]:
    """The settings of this process that a forked child would inherit."""
    settings: dict[str, Any] = {}
    random = sys.modules.get("random")
    if random is not None:
        settings["random"] = random.getstate()
    np = sys.modules.get("numpy")
    if np is not None and hasattr(np, "random"):
        settings["numpy"] = np.random.get_state()
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "get_rng_state"):
        return settings
    settings["torch"] = {
        "rng": torch.get_rng_state().numpy().tobytes(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
        "float32_matmul_precision": _matmul_precision(torch),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "cuda_rng": [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
        if torch.cuda.is_initialized()  # (is_available() would initialise the driver)
        else None,
    }
    return settings


def _matmul_precision(torch: Any) -> str | None:
    """TF32 for float32 matmuls ("highest", "high", "medium"); None when torch refuses to
    say (the notebook mixed its legacy and new switches)."""
    try:
        return str(torch.get_float32_matmul_precision())
    except RuntimeError:
        return None


def apply(settings: dict[str, Any], cuda_device: int | None = None) -> None:
    """Make this process's settings those :func:`capture` read (in a fresh rank)."""
    if "random" in settings:
        import random

        random.setstate(settings["random"])
    if "numpy" in settings:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            np.random.set_state(settings["numpy"])
    t = settings.get("torch")
    if t is None:
        return
    import torch

    torch.set_rng_state(torch.frombuffer(bytearray(t["rng"]), dtype=torch.uint8))
    # Only what differs from torch's state here: some switches are not free (turning
    # deterministic algorithms on or off imports parts of the compiler, ~2 s).
    deterministic = (t["deterministic"], t["deterministic_warn_only"])
    if deterministic != (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    ):
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
    dtype = getattr(torch, t["default_dtype"])
    if dtype != torch.get_default_dtype():
        torch.set_default_dtype(dtype)
    # Only what differs, through one switch each: torch refuses to report a precision set
    # through both its legacy (allow_tf32) and its new API.
    precision = t["float32_matmul_precision"]
    if precision is not None and precision != _matmul_precision(torch):
        torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.benchmark = t["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = t["cudnn_deterministic"]
    if bool(torch.backends.cudnn.allow_tf32) != t["cudnn_allow_tf32"]:
        torch.backends.cudnn.allow_tf32 = t["cudnn_allow_tf32"]
    states = t.get("cuda_rng")
    if states and cuda_device is not None and cuda_device < len(states):
        state = torch.frombuffer(bytearray(states[cuda_device]), dtype=torch.uint8)
        torch.cuda.set_rng_state(state, device=cuda_device)


__all__ = ["apply", "capture"]
