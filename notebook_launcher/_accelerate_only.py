"""Accelerate's names this package deliberately does not provide, and the error they raise.

notebook_launcher matches Accelerate's *training* API. Big-model inference (empty-weight
initialisation, device maps, offloading, hooks), the DeepSpeed / FSDP / Megatron-LM
integrations and the ``accelerate`` command line are Accelerate's own: importing one of those
names from this package raises :class:`AccelerateOnlyError`, which says what the name is and
to use Accelerate itself for it -- real Accelerate runs unchanged inside notebook_launcher's
ranks (the launcher sets what ``accelerate launch`` would). Feature probes work as they do on
a package without the name: an import raises an ImportError, ``hasattr`` answers False.

>>> from notebook_launcher._accelerate_only import error_for
>>> print(error_for("init_empty_weights"))  # doctest: +ELLIPSIS
`init_empty_weights` is part of Accelerate's big-model inference ...(`pip install accelerate`...)...ranks...
"""

from __future__ import annotations

import dis
from types import FrameType

_BIG_MODEL = "big-model inference (empty weights, device maps, offloading, hooks)"
_INTEGRATIONS = "DeepSpeed / FSDP / Megatron-LM integration"
_CLI = "`accelerate` command line and its launch helpers"

#: name -> what part of Accelerate it belongs to. Names of functions and classes, and of
#: modules (``notebook_launcher.hooks``), as Accelerate spells them.
ACCELERATE_ONLY: dict[str, str] = {
    **dict.fromkeys(
        (
            "init_empty_weights",
            "init_on_device",
            "cpu_offload",
            "cpu_offload_with_hook",
            "disk_offload",
            "dispatch_model",
            "load_checkpoint_and_dispatch",
            "infer_auto_device_map",
            "get_balanced_memory",
            "get_max_memory",
            "get_max_layer_size",
            "clean_device_map",
            "compute_module_sizes",
            "get_state_dict_from_offload",
            "has_offloaded_params",
            "load_offloaded_weights",
            "offload_state_dict",
            "offload_weight",
            "OffloadedWeightsLoader",
            "align_module_device",
            "attach_align_device_hook",
            "attach_align_device_hook_on_blocks",
            "remove_hook_from_module",
            "add_hook_to_module",
            "ModelHook",
            "AlignDevicesHook",
            "big_modeling",
            "hooks",
            "inference",
            "prepare_pippy",
        ),
        _BIG_MODEL,
    ),
    **dict.fromkeys(
        (
            "DeepSpeedPlugin",
            "DummyOptim",
            "DummyScheduler",
            "DeepSpeedSchedulerWrapper",
            "HfDeepSpeedConfig",
            "FullyShardedDataParallelPlugin",
            "MegatronLMPlugin",
            "MegatronLMDummyScheduler",
            "MegatronLMDummyDataLoader",
            "TorchTensorParallelPlugin",
            "ParallelismConfig",
            "merge_fsdp_weights",
            "save_fsdp_model",
            "load_fsdp_model",
            "save_fsdp_optimizer",
            "load_fsdp_optimizer",
        ),
        _INTEGRATIONS,
    ),
    **dict.fromkeys(
        ("FP8RecipeKwargs", "TERecipeKwargs", "MSAMPRecipeKwargs", "AORecipeKwargs"),
        "FP8 training (Transformer Engine, MS-AMP, torchao)",
    ),
    **dict.fromkeys(("commands", "launch", "prepare_multi_gpu_env"), _CLI),
}


class AccelerateOnlyError(ImportError):
    """A name of Accelerate that notebook_launcher deliberately leaves to Accelerate itself,
    imported (``import ...`` or ``from ... import``): ``except ImportError`` catches it."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message, name=name)

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (str(self), self.name or "")


class AccelerateOnlyAttributeError(AttributeError):
    """:class:`AccelerateOnlyError`'s twin for an attribute lookup (``package.name``,
    ``hasattr``, ``getattr`` with a default): an :class:`AttributeError`, as those expect.
    ImportError and AttributeError cannot share a subclass (their layouts conflict)."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message, name=name)

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (str(self), self.name or "")


def _message(name: str) -> str:
    part = ACCELERATE_ONLY[name]
    return (
        f"`{name}` is part of Accelerate's {part}, which notebook_launcher does not provide. "
        f"Use Accelerate itself for it (`pip install accelerate`, then `from accelerate "
        f"import ...`): it runs unchanged inside notebook_launcher's ranks, which are set up "
        f"as `accelerate launch` would set them up."
    )


def error_for(name: str) -> AccelerateOnlyError:
    """The error importing ``name`` raises (``name`` from :data:`ACCELERATE_ONLY`)."""
    return AccelerateOnlyError(_message(name), name)


_IMPORT_FROM = dis.opmap["IMPORT_FROM"]


def lookup_error(
    name: str, caller: FrameType | None
) -> AccelerateOnlyError | AccelerateOnlyAttributeError:
    """The error a package's ``__getattr__`` raises for ``name`` (from :data:`ACCELERATE_ONLY`),
    looked up by the code running in ``caller`` (``sys._getframe(1)`` in ``__getattr__``).

    ``from package import name`` gets :class:`AccelerateOnlyError` (an ImportError: Python
    would turn an AttributeError into its own "cannot import name" and drop the message).
    Every other lookup (``package.name``, ``hasattr``, ``getattr`` with a default) gets
    :class:`AccelerateOnlyAttributeError`, which those probes expect.

    >>> import sys
    >>> type(lookup_error("dispatch_model", sys._getframe())).__name__
    'AccelerateOnlyAttributeError'
    """
    if caller is not None and caller.f_code.co_code[caller.f_lasti] == _IMPORT_FROM:
        return error_for(name)
    return AccelerateOnlyAttributeError(_message(name), name)
