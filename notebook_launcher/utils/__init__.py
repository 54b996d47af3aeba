"""Helpers with Accelerate's ``accelerate.utils`` names: collective operations, seeding, the
``is_*_available`` checks, nested-structure helpers and the plugin dataclasses.

The torch-free parts (dataclasses, constants, availability checks) are imported with the
package; the rest (operations, seeding, ``parse_flag_from_env``) loads on first use, so the
kernel side can read the constants without importing torch.

Example::

    from notebook_launcher.utils import gather, set_seed, DistributedType
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from .constants import PrecisionType
from .dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    DynamoBackend,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    LoggerType,
    ProfileKwargs,
    ProjectConfiguration,
    RNGType,
    TorchDynamoPlugin,
)
from .imports import (
    check_cuda_fp8_capability,
    compare_versions,
    is_aim_available,
    is_bf16_available,
    is_bnb_available,
    is_clearml_available,
    is_comet_ml_available,
    is_cuda_available,
    is_datasets_available,
    is_deepspeed_available,
    is_dvclive_available,
    is_fp8_available,
    is_fp16_available,
    is_habana_gaudi1,
    is_hpu_available,
    is_import_timer_available,
    is_matplotlib_available,
    is_mlflow_available,
    is_mlu_available,
    is_mps_available,
    is_msamp_available,
    is_musa_available,
    is_neuron_available,
    is_npu_available,
    is_pandas_available,
    is_peft_available,
    is_pippy_available,
    is_pytest_available,
    is_rich_available,
    is_rocm_available,
    is_schedulefree_available,
    is_sdaa_available,
    is_swanlab_available,
    is_tensorboard_available,
    is_timm_available,
    is_torch_version,
    is_torch_xla_available,
    is_torchao_available,
    is_torchdata_stateful_dataloader_available,
    is_torchvision_available,
    is_trackio_available,
    is_transformer_engine_available,
    is_transformer_engine_mxfp8_available,
    is_transformers_available,
    is_triton_available,
    is_wandb_available,
    is_xpu_available,
    str_to_bool,
)

if TYPE_CHECKING:
    from ..checkpointing import load_checkpoint_in_model, save
    from ..errors import DistributedOperationException
    from ..state import parse_flag_from_env
    from .environment import (
        check_os_kernel,
        clear_environment,
        convert_dict_to_env_variables,
        get_int_from_env,
        patch_environment,
        purge_accelerate_environment,
    )
    from .memory import (
        clear_device_cache,
        find_executable_batch_size,
        release_memory,
        should_reduce_batch_size,
    )
    from .operations import (
        CannotPadNestedTensorWarning,
        broadcast,
        broadcast_object_list,
        concatenate,
        convert_outputs_to_fp32,
        convert_to_fp32,
        copy_tensor_to_devices,
        find_batch_size,
        find_device,
        gather,
        gather_object,
        honor_type,
        is_namedtuple,
        is_torch_tensor,
        listify,
        pad_across_processes,
        pad_input_tensors,
        recursively_apply,
        reduce,
        send_to_device,
        slice_tensors,
        wait_for_everyone,
    )
    from .other import (
        extract_model_from_parallel,
        get_model_tp_size,
        has_compiled_regions,
        is_compiled_module,
    )
    from .random import set_seed, synchronize_rng_state, synchronize_rng_states

_OPERATIONS = (
    "CannotPadNestedTensorWarning",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "copy_tensor_to_devices",
    "find_batch_size",
    "find_device",
    "gather",
    "gather_object",
    "honor_type",
    "is_namedtuple",
    "is_torch_tensor",
    "listify",
    "pad_across_processes",
    "pad_input_tensors",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "slice_tensors",
    "wait_for_everyone",
)
_LAZY: dict[str, str] = {
    **dict.fromkeys(_OPERATIONS, "notebook_launcher.utils.operations"),
    **dict.fromkeys(
        (
            "check_os_kernel",
            "clear_environment",
            "convert_dict_to_env_variables",
            "get_int_from_env",
            "patch_environment",
            "purge_accelerate_environment",
        ),
        "notebook_launcher.utils.environment",
    ),
    **dict.fromkeys(
        (
            "extract_model_from_parallel",
            "get_model_tp_size",
            "has_compiled_regions",
            "is_compiled_module",
        ),
        "notebook_launcher.utils.other",
    ),
    **dict.fromkeys(
        (
            "clear_device_cache",
            "find_executable_batch_size",
            "release_memory",
            "should_reduce_batch_size",
        ),
        "notebook_launcher.utils.memory",
    ),
    "load_checkpoint_in_model": "notebook_launcher.checkpointing",
    "save": "notebook_launcher.checkpointing",
    "set_seed": "notebook_launcher.utils.random",
    "synchronize_rng_state": "notebook_launcher.utils.random",
    "synchronize_rng_states": "notebook_launcher.utils.random",
    "parse_flag_from_env": "notebook_launcher.state",
    "DistributedOperationException": "notebook_launcher.errors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        from .._accelerate_only import ACCELERATE_ONLY, lookup_error

        if name in ACCELERATE_ONLY:
            raise lookup_error(name, sys._getframe(1))
        raise AttributeError(f"module 'notebook_launcher.utils' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "AutocastKwargs",
    "CannotPadNestedTensorWarning",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedOperationException",
    "DistributedType",
    "DynamoBackend",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "TorchDynamoPlugin",
    "broadcast",
    "broadcast_object_list",
    "check_cuda_fp8_capability",
    "check_os_kernel",
    "clear_device_cache",
    "clear_environment",
    "compare_versions",
    "concatenate",
    "convert_dict_to_env_variables",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
    "copy_tensor_to_devices",
    "extract_model_from_parallel",
    "find_batch_size",
    "find_device",
    "find_executable_batch_size",
    "gather",
    "gather_object",
    "get_int_from_env",
    "get_model_tp_size",
    "has_compiled_regions",
    "honor_type",
    "is_aim_available",
    "is_bf16_available",
    "is_bnb_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_compiled_module",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_dvclive_available",
    "is_fp16_available",
    "is_fp8_available",
    "is_habana_gaudi1",
    "is_hpu_available",
    "is_import_timer_available",
    "is_matplotlib_available",
    "is_mlflow_available",
    "is_mlu_available",
    "is_mps_available",
    "is_msamp_available",
    "is_musa_available",
    "is_namedtuple",
    "is_neuron_available",
    "is_npu_available",
    "is_pandas_available",
    "is_peft_available",
    "is_pippy_available",
    "is_pytest_available",
    "is_rich_available",
    "is_rocm_available",
    "is_schedulefree_available",
    "is_sdaa_available",
    "is_swanlab_available",
    "is_tensorboard_available",
    "is_timm_available",
    "is_torch_tensor",
    "is_torch_version",
    "is_torch_xla_available",
    "is_torchao_available",
    "is_torchdata_stateful_dataloader_available",
    "is_torchvision_available",
    "is_trackio_available",
    "is_transformer_engine_available",
    "is_transformer_engine_mxfp8_available",
    "is_transformers_available",
    "is_triton_available",
    "is_wandb_available",
    "is_xpu_available",
    "listify",
    "load_checkpoint_in_model",
    "pad_across_processes",
    "pad_input_tensors",
    "parse_flag_from_env",
    "patch_environment",
    "purge_accelerate_environment",
    "recursively_apply",
    "reduce",
    "release_memory",
    "save",
    "send_to_device",
    "set_seed",
    "should_reduce_batch_size",
    "slice_tensors",
    "str_to_bool",
    "synchronize_rng_state",
    "synchronize_rng_states",
    "wait_for_everyone",
]
