"""Model helpers with Accelerate's names (``accelerate.utils.other``): taking a model out of
its DDP / DataParallel / ``torch.compile`` wrappers, and small inspections.

Example::

    from notebook_launcher.utils import extract_model_from_parallel

    module = extract_model_from_parallel(prepared_model)   # the user's nn.Module again
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch


def _optimized_module_type() -> type | None:
    # Not imported: nothing was compiled (and importing it costs ~1 s and sets
    # TORCHINDUCTOR_CACHE_DIR in the environment).
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` is the result of ``torch.compile(module)``."""
    optimized = _optimized_module_type()
    return optimized is not None and isinstance(module, optimized)


def has_compiled_regions(module: Any) -> bool:
    """Whether some submodule of ``module`` was compiled with ``torch.compile``."""
    optimized = _optimized_module_type()
    if optimized is None or not isinstance(module, torch.nn.Module) or not module._modules:
        return False
    return any(isinstance(m, optimized) for m in module.modules())


def _parallel_wrappers() -> tuple[type, ...]:
    wrappers: tuple[type, ...] = (
        torch.nn.parallel.DistributedDataParallel,
        torch.nn.DataParallel,
    )
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrappers += (FullyShardedDataParallel,)
    except ImportError:  # a torch built without distributed
        pass
    return wrappers


def _remove_fp32_wrapper(model: Any) -> None:
    """Take the mixed-precision forward off (the ``_original_forward`` an Accelerator kept)."""
    original = model.__dict__.pop("_original_forward", None)
    if original is None:
        return
    forward = model.__dict__.pop("forward", None)
    while forward is not None and forward is not original:
        forward = getattr(forward, "__wrapped__", None)
    target = original if forward is None else forward
    if getattr(target, "__func__", None) is getattr(type(model), "forward", None):
        return  # the class's own forward: nothing to put back in the instance
    function = getattr(target, "__func__", target)
    model.forward = types.MethodType(function, model)


def extract_model_from_parallel(
    model: Any,
    keep_fp32_wrapper: bool = True,
    keep_torch_compile: bool = True,
    recursive: bool = False,
) -> Any:
    """The model inside its DDP / DataParallel / FSDP and ``torch.compile`` wrappers.

    ``keep_torch_compile``: a compiled model stays compiled (around the unwrapped module);
    otherwise the plain module comes back. ``keep_fp32_wrapper=False`` also takes off the
    mixed-precision forward that ``Accelerator.prepare`` added. ``recursive`` unwraps every
    ``.module`` wrapper among the submodules too.

    >>> model = torch.nn.Linear(2, 2)
    >>> extract_model_from_parallel(torch.nn.DataParallel(model)) is model
    True
    """
    compiled = None
    if is_compiled_module(model):
        compiled, model = model, model._orig_mod
    elif has_compiled_regions(model) and "_orig_mod" in model.__dict__:
        compiled, model = model, model.__dict__["_orig_mod"]

    wrappers = _parallel_wrappers()
    while isinstance(model, wrappers):
        model = model.module  # type: ignore[attr-defined]
    if is_compiled_module(model):  # DDP(compile(module)): compiled inside the wrapper
        compiled, model = model, model._orig_mod
        while isinstance(model, wrappers):
            model = model.module  # type: ignore[attr-defined]

    if recursive:

        def unwrap(module: Any) -> Any:
            inner = unwrap(module.module) if hasattr(module, "module") else module
            for name, child in list(inner.named_children()):
                setattr(inner, name, unwrap(child))
            return inner

        model = unwrap(model)

    if not keep_fp32_wrapper:
        _remove_fp32_wrapper(model)

    if keep_torch_compile and compiled is not None:
        if is_compiled_module(compiled):
            compiled._orig_mod = model
        else:
            compiled.__dict__["_orig_mod"] = model
        return compiled
    return model


def get_model_tp_size(model: Any) -> int | None:
    """The tensor-parallel degree a Transformers model was sharded with, or ``None``
    (``model.tp_size`` before Transformers 5, ``model.config.distributed_config`` since)."""
    size = getattr(model, "tp_size", None)
    if size is not None:
        return int(size)
    config = getattr(getattr(model, "config", None), "distributed_config", None)
    if isinstance(config, dict):
        return config.get("tp_size")
    return getattr(config, "tp_size", None)


__all__ = [
    "extract_model_from_parallel",
    "get_model_tp_size",
    "has_compiled_regions",
    "is_compiled_module",
]
