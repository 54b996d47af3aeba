"""notebook_launcher: launch a PyTorch function on N ranks from a live Jupyter kernel.

Accelerate's names, so code written for it runs after changing the import::

    from notebook_launcher import notebook_launcher, Accelerator, PartialState

Importing the package does not import torch: the names that need it (the state,
the Accelerator, the plugins) load on first use, so the kernel extension and the
dashboard start fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    DistributedOperationException,
    LaunchError,
    PreflightError,
    ProcessGroupMismatch,
    RankFailedError,
    SerializationError,
    WorkerDied,
)
from .launcher import notebook_launcher

if TYPE_CHECKING:
    from .accelerator import Accelerator
    from .data_loader import skip_first_batches
    from .state import AcceleratorState, DistributedType, GradientState, PartialState
    from .utils.dataclasses import (
        AutocastKwargs,
        DataLoaderConfiguration,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradientAccumulationPlugin,
        GradScalerKwargs,
    )
    from .utils.random import synchronize_rng_states

__version__ = "0.1.0"

_LAZY = {
    "Accelerator": "notebook_launcher.accelerator",
    "AcceleratorState": "notebook_launcher.state",
    "DistributedType": "notebook_launcher.state",
    "GradientState": "notebook_launcher.state",
    "PartialState": "notebook_launcher.state",
    "AutocastKwargs": "notebook_launcher.utils.dataclasses",
    "DataLoaderConfiguration": "notebook_launcher.utils.dataclasses",
    "DDPCommunicationHookType": "notebook_launcher.utils.dataclasses",
    "DistributedDataParallelKwargs": "notebook_launcher.utils.dataclasses",
    "GradientAccumulationPlugin": "notebook_launcher.utils.dataclasses",
    "GradScalerKwargs": "notebook_launcher.utils.dataclasses",
    "skip_first_batches": "notebook_launcher.data_loader",
    "synchronize_rng_states": "notebook_launcher.utils.random",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'notebook_launcher' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "Accelerator",
    "AcceleratorState",
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedOperationException",
    "DistributedType",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "GradientState",
    "LaunchError",
    "PartialState",
    "PreflightError",
    "ProcessGroupMismatch",
    "RankFailedError",
    "SerializationError",
    "WorkerDied",
    "__version__",
    "notebook_launcher",
    "skip_first_batches",
    "synchronize_rng_states",
]
