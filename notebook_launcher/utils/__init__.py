"""Helpers with Accelerate's ``accelerate.utils`` names: collective operations, seeding,
nested-structure helpers and the plugin dataclasses.

Example::

    from notebook_launcher.utils import gather, set_seed, DistributedType
"""

from __future__ import annotations

from ..state import DistributedType, parse_flag_from_env
from .dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    KwargsHandler,
    PrecisionType,
    ProjectConfiguration,
)
from .operations import (
    broadcast,
    broadcast_object_list,
    concatenate,
    find_batch_size,
    find_device,
    gather,
    gather_object,
    honor_type,
    is_namedtuple,
    is_torch_tensor,
    listify,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
    slice_tensors,
    wait_for_everyone,
)
from .random import set_seed

__all__ = [
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "KwargsHandler",
    "PrecisionType",
    "ProjectConfiguration",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "find_batch_size",
    "find_device",
    "gather",
    "gather_object",
    "honor_type",
    "is_namedtuple",
    "is_torch_tensor",
    "listify",
    "pad_across_processes",
    "parse_flag_from_env",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "set_seed",
    "slice_tensors",
    "wait_for_everyone",
]
