"""notebook_launcher: launch a PyTorch function on N ranks from a live Jupyter kernel."""

from __future__ import annotations

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

__version__ = "0.1.0"

__all__ = [
    "DistributedOperationException",
    "LaunchError",
    "PreflightError",
    "ProcessGroupMismatch",
    "RankFailedError",
    "SerializationError",
    "WorkerDied",
    "__version__",
    "notebook_launcher",
]
