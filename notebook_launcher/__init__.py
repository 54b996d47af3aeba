"""notebook_launcher: launch a PyTorch function on N ranks from a live Jupyter kernel.

Accelerate's names, so code written for it runs after changing the import::

    from notebook_launcher import notebook_launcher, Accelerator, PartialState

Importing the package imports nothing but its errors: every other name loads on first
use (PEP 562), so the kernel extension and the dashboard (``notebook_launcher.ui``) start
fast and never pull in torch or the process machinery.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from typing import TYPE_CHECKING, Any

from .errors import (
    ClusterError,
    DistributedOperationException,
    LaunchError,
    PreflightError,
    ProcessGroupMismatch,
    RankFailedError,
    RendezvousError,
    SerializationError,
    WorkerDied,
)

if TYPE_CHECKING:
    from .accelerator import Accelerator
    from .checkpointing import load_checkpoint_in_model
    from .cluster import AgentCluster, RayCluster, SlurmCluster
    from .data_loader import skip_first_batches
    from .detached import attach, runs
    from .errors import SessionBroken
    from .launcher import notebook_launcher
    from .launchers import debug_launcher
    from .session import Session, start
    from .state import AcceleratorState, DistributedType, GradientState, PartialState
    from .tracking import log
    from .utils.dataclasses import (
        AutocastKwargs,
        DataLoaderConfiguration,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        GradientAccumulationPlugin,
        GradScalerKwargs,
        InitProcessGroupKwargs,
        ProfileKwargs,
        ProjectConfiguration,
        TorchDynamoPlugin,
    )
    from .utils.memory import find_executable_batch_size
    from .utils.random import synchronize_rng_states

__version__ = "0.1.0"

# The one side effect of importing, as Lightning does on import: torch.cuda.is_available()
# (and autocast("cuda"), GradScaler("cuda"), a pinned DataLoader, which ask it) then counts
# GPUs through NVML instead of initialising the CUDA driver in the kernel, which would make
# every later fork unable to use CUDA. The user's own value is kept. (_placement.NVML_CHECK_ENV)
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

_LAZY = {
    "Accelerator": "notebook_launcher.accelerator",
    "AgentCluster": "notebook_launcher.cluster",
    "SlurmCluster": "notebook_launcher.cluster",
    "RayCluster": "notebook_launcher.cluster",
    "AcceleratorState": "notebook_launcher.state",
    "attach": "notebook_launcher.detached",
    "runs": "notebook_launcher.detached",
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
    "debug_launcher": "notebook_launcher.launchers",
    "find_executable_batch_size": "notebook_launcher.utils.memory",
    "load_checkpoint_in_model": "notebook_launcher.checkpointing",
    "InitProcessGroupKwargs": "notebook_launcher.utils.dataclasses",
    "ProfileKwargs": "notebook_launcher.utils.dataclasses",
    "ProjectConfiguration": "notebook_launcher.utils.dataclasses",
    "TorchDynamoPlugin": "notebook_launcher.utils.dataclasses",
    "notebook_launcher": "notebook_launcher.launcher",
    "start": "notebook_launcher.session",
    "Session": "notebook_launcher.session",
    "SessionBroken": "notebook_launcher.errors",
    "synchronize_rng_states": "notebook_launcher.utils.random",
    "log": "notebook_launcher.tracking",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        from ._accelerate_only import ACCELERATE_ONLY, lookup_error

        if name in ACCELERATE_ONLY:
            raise lookup_error(name, sys._getframe(1))
        raise AttributeError(f"module 'notebook_launcher' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # after importing: the submodule import rebinds nothing here
    return value


class _Package(types.ModuleType):
    """The package, callable as its function.

    ``from notebook_launcher import notebook_launcher`` names the function; a later
    ``import notebook_launcher`` (for ``notebook_launcher.runs()``, say) rebinds that name
    to the package, and the next ``notebook_launcher(train, num_processes=2)`` would raise
    "'module' object is not callable". Either name does what the other does: the package
    calls the function, and the function carries the package's verbs (``start``,
    ``runs``, ``attach``, ``log``: ``launcher.py``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # the caller's line, then the ranks', as the function's
        return self.notebook_launcher(*args, **kwargs)


# (the documented way to give a module behaviour of a class: the data model's
# "Customizing module attribute access"; nothing else of the module changes)
sys.modules[__name__].__class__ = _Package


def load_ipython_extension(ip: Any) -> None:
    """``%load_ext notebook_launcher``: the ``%nl_info``, ``%dist``, ``%%distributed`` and
    ``%%rank`` magics (the shipped kernelspec loads them already)."""
    from .ipython_extension import load_ipython_extension as load

    load(ip)


def unload_ipython_extension(ip: Any) -> None:
    """``%unload_ext notebook_launcher``: the magics go (and the ``%dist`` session with them)."""
    from .ipython_extension import unload_ipython_extension as unload

    unload(ip)


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "Accelerator",
    "AcceleratorState",
    "AgentCluster",
    "AutocastKwargs",
    "ClusterError",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedOperationException",
    "DistributedType",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "GradientState",
    "InitProcessGroupKwargs",
    "LaunchError",
    "PartialState",
    "PreflightError",
    "ProcessGroupMismatch",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RankFailedError",
    "RendezvousError",
    "SerializationError",
    "Session",
    "SessionBroken",
    "RayCluster",
    "SlurmCluster",
    "TorchDynamoPlugin",
    "WorkerDied",
    "__version__",
    "attach",
    "debug_launcher",
    "find_executable_batch_size",
    "load_checkpoint_in_model",
    "log",
    "notebook_launcher",
    "runs",
    "skip_first_batches",
    "start",
    "synchronize_rng_states",
]
