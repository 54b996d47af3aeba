"""Accelerate's ``is_*_available`` checks and version helpers (``accelerate.utils`` names).

Training scripts and Accelerate's own test helpers branch on these (``if is_bf16_available():``,
``@require_cuda``...), so they answer what this machine really has. Importing this module
imports neither torch nor any package it asks about: a package check is a lookup of its
installed metadata, and the device checks load torch only when called.

Example::

    from notebook_launcher.utils import is_bf16_available, is_torch_version
    if is_bf16_available() and is_torch_version(">=", "2.2"):
        ...
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import operator
import re
from collections.abc import Callable
from typing import Any

_OPERATIONS: dict[str, Callable[[Any, Any], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
    "<=": operator.le,
    "<": operator.lt,
}


def _installed(module: str, *distributions: str) -> bool:
    """Whether ``module`` can be imported (and, when named, one of its distributions is installed)."""
    try:
        if importlib.util.find_spec(module) is None:
            return False
    except (ImportError, ValueError):
        return False
    for name in distributions:
        try:
            importlib.metadata.version(name)
            return True
        except importlib.metadata.PackageNotFoundError:
            continue
    return not distributions


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"2.13.0+cpu"`` -> ``(2, 13, 0)``."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(version))
    if match is None:
        raise ValueError(f"not a version number: {version!r}")
    parts = tuple(int(p) for p in match.group(1).split("."))
    while len(parts) > 1 and parts[-1] == 0:
        parts = parts[:-1]
    return parts


def compare_versions(library_or_version: str, operation: str, requirement_version: str) -> bool:
    """Compare an installed library's version (or a version string) with a requirement.

    Release numbers are compared (``2.13.0+cpu`` counts as ``2.13``); pre-release and local
    tags are ignored.

    Example::

        compare_versions("torch", ">=", "2.2")   # True with torch 2.13
    """
    if operation not in _OPERATIONS:
        raise ValueError(f"operation must be one of {list(_OPERATIONS)}, got {operation!r}")
    version = str(library_or_version)
    if not re.match(r"\s*v?\d", version):
        version = importlib.metadata.version(version)
    return _OPERATIONS[operation](_release(version), _release(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """``compare_versions("torch", operation, version)``; False without torch."""
    try:
        return compare_versions("torch", operation, version)
    except importlib.metadata.PackageNotFoundError:
        return False


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """``"yes"/"true"/"on"/"1"/...`` -> 1, ``"no"/"false"/"off"/"0"/...`` -> 0 (bools with
    ``to_bool``); anything else raises ``ValueError``."""
    lowered = value.lower()
    if lowered in ("y", "yes", "t", "true", "on", "1"):
        return True if to_bool else 1
    if lowered in ("n", "no", "f", "false", "off", "0"):
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value}")


# ------------------------------------------------------------------------------ devices


def _torch() -> Any:
    import torch

    return torch


def is_cuda_available() -> bool:
    """A CUDA (or ROCm) GPU is visible to torch."""
    return bool(_torch().cuda.is_available())


def is_rocm_available() -> bool:
    """The GPU torch sees is an AMD one (torch built for ROCm)."""
    torch = _torch()
    return torch.version.hip is not None and bool(torch.cuda.is_available())


def is_mps_available(min_version: str = "1.12") -> bool:
    """Apple's Metal backend is usable (and torch is at least ``min_version``)."""
    torch = _torch()
    mps = getattr(torch.backends, "mps", None)
    return is_torch_version(">=", min_version) and bool(mps is not None and mps.is_available())


def is_xpu_available(check_device: bool = False) -> bool:
    """An Intel GPU is visible to torch."""
    xpu = getattr(_torch(), "xpu", None)
    return bool(xpu is not None and xpu.is_available())


def _vendor_device(module: str, attribute: str) -> bool:
    """Devices that need a vendor's torch extension (NPU, MLU, SDAA, MUSA, HPU, Neuron)."""
    if not _installed(module):
        return False
    importlib.import_module(module)
    device = getattr(_torch(), attribute, None)
    return bool(device is not None and device.is_available())


def is_npu_available(check_device: bool = False) -> bool:
    """An Ascend NPU is usable (``torch_npu`` installed)."""
    return _vendor_device("torch_npu", "npu")


def is_mlu_available(check_device: bool = False) -> bool:
    """A Cambricon MLU is usable (``torch_mlu`` installed)."""
    return _vendor_device("torch_mlu", "mlu")


def is_sdaa_available(check_device: bool = False) -> bool:
    """A Tecorigin SDAA is usable (``torch_sdaa`` installed)."""
    return _vendor_device("torch_sdaa", "sdaa")


def is_musa_available(check_device: bool = False) -> bool:
    """A Moore Threads MUSA GPU is usable (``torch_musa`` installed)."""
    return _vendor_device("torch_musa", "musa")


def is_hpu_available(init_hccl: bool = False) -> bool:
    """A Habana Gaudi is usable (``habana_frameworks`` installed)."""
    return _vendor_device("habana_frameworks.torch", "hpu")


def is_habana_gaudi1() -> bool:
    """The Habana device is a first-generation Gaudi (no fp16/fp8)."""
    if not is_hpu_available():
        return False
    import habana_frameworks.torch.utils.experimental as htexp

    return bool(htexp._get_device_type() == htexp.synDeviceType.synDeviceGaudi)


def is_neuron_available(check_device: bool = False) -> bool:
    """An AWS Neuron core is usable (``torch_neuronx`` installed)."""
    return _vendor_device("torch_neuronx", "neuron")


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """``torch_xla`` is installed (TPUs and XLA GPUs; never used by this package)."""
    return _installed("torch_xla")


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """bf16 works here: always on CPU, on GPUs that support it (Ampere and later)."""
    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    if is_cuda_available():
        return bool(_torch().cuda.is_bf16_supported())
    return True


def is_fp16_available() -> bool:
    """fp16 is accepted here (on CPU it trains in fp32, as in Accelerate)."""
    return not is_habana_gaudi1()


def check_cuda_fp8_capability() -> bool:
    """The first GPU has compute capability 8.9 or more (Ada, Hopper): fp8 tensor cores."""
    torch = _torch()
    return bool(torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9))


# ------------------------------------------------------------------------------ packages


def is_transformer_engine_available() -> bool:
    return _installed("transformer_engine", "transformer-engine", "transformer_engine")


def is_transformer_engine_mxfp8_available() -> bool:
    return False if not is_transformer_engine_available() else check_cuda_fp8_capability()


def is_torchao_available() -> bool:
    return _installed("torchao")


def is_msamp_available() -> bool:
    return _installed("msamp", "ms-amp")


def is_fp8_available() -> bool:
    """An fp8 library is installed (notebook_launcher itself refuses ``"fp8"``)."""
    return is_msamp_available() or is_transformer_engine_available() or is_torchao_available()


def is_torchdata_stateful_dataloader_available() -> bool:
    """``torchdata`` >= 0.8 (its ``StatefulDataLoader``) is installed."""
    return _installed("torchdata", "torchdata") and compare_versions("torchdata", ">=", "0.8.0")


def is_bnb_available() -> bool:
    return _installed("bitsandbytes")


def is_datasets_available() -> bool:
    return _installed("datasets")


def is_deepspeed_available() -> bool:
    return _installed("deepspeed", "deepspeed")


def is_peft_available() -> bool:
    return _installed("peft")


def is_pippy_available() -> bool:
    return is_torch_version(">=", "2.4.0")


def is_pytest_available() -> bool:
    return _installed("pytest")


def is_rich_available() -> bool:
    return _installed("rich")


def is_schedulefree_available() -> bool:
    return _installed("schedulefree")


def is_timm_available() -> bool:
    return _installed("timm")


def is_torchvision_available() -> bool:
    return _installed("torchvision")


def is_transformers_available() -> bool:
    return _installed("transformers")


def is_triton_available() -> bool:
    return _installed("triton")


def is_import_timer_available() -> bool:
    return _installed("import_timer")


def is_matplotlib_available() -> bool:
    return _installed("matplotlib")


def is_pandas_available() -> bool:
    return _installed("pandas")


# Experiment trackers (``log_with``): none is wired into this package's Accelerator, but
# code that picks one by availability still asks.


def is_aim_available() -> bool:
    return _installed("aim")


def is_clearml_available() -> bool:
    return _installed("clearml")


def is_comet_ml_available() -> bool:
    return _installed("comet_ml")


def is_dvclive_available() -> bool:
    return _installed("dvclive")


def is_mlflow_available() -> bool:
    return _installed("mlflow")


def is_swanlab_available() -> bool:
    return _installed("swanlab")


def is_tensorboard_available() -> bool:
    return _installed("tensorboard") or _installed("tensorboardX")


def is_trackio_available() -> bool:
    return _installed("trackio")


def is_wandb_available() -> bool:
    return _installed("wandb")


__all__ = [
    "check_cuda_fp8_capability",
    "compare_versions",
    "is_aim_available",
    "is_bf16_available",
    "is_bnb_available",
    "is_clearml_available",
    "is_comet_ml_available",
    "is_cuda_available",
    "is_datasets_available",
    "is_deepspeed_available",
    "is_dvclive_available",
    "is_fp8_available",
    "is_fp16_available",
    "is_habana_gaudi1",
    "is_hpu_available",
    "is_import_timer_available",
    "is_matplotlib_available",
    "is_mlflow_available",
    "is_mlu_available",
    "is_mps_available",
    "is_msamp_available",
    "is_musa_available",
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
    "str_to_bool",
]
