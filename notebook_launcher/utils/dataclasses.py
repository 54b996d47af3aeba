"""Plugin and configuration dataclasses, named and defaulted as Accelerate documents them.

Plain data with validation in ``__post_init__``; no torch import here, so the kernel side and
the state module can both import this file without cycles.

Example::

    from notebook_launcher.utils.dataclasses import GradientAccumulationPlugin
    plugin = GradientAccumulationPlugin(num_steps=4, sync_each_batch=False)
    accelerator = Accelerator(gradient_accumulation_plugin=plugin)
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field, fields
from typing import Any

from .constants import PrecisionType


class DistributedType(str, enum.Enum):
    """The kind of distributed setup the current process is part of.

    This package produces ``NO``, ``MULTI_CPU`` and ``MULTI_GPU``; the other members are
    Accelerate's, so that code comparing against them keeps working.

    Example::

        if PartialState().distributed_type == DistributedType.MULTI_GPU:
            ...
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"

    def __str__(self) -> str:
        return self.value


class RNGType(str, enum.Enum):
    """The random number generators :func:`~notebook_launcher.utils.synchronize_rng_states`
    knows; this package's devices use ``TORCH``, ``CUDA`` and ``GENERATOR``.

    Example::

        synchronize_rng_states(["torch", RNGType.GENERATOR], generator=g)
    """

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"

    def __str__(self) -> str:
        return self.value


class DDPCommunicationHookType(str, enum.Enum):
    """How DDP communicates gradients (``DistributedDataParallelKwargs.comm_hook``).

    ``FP16``/``BF16`` compress gradients to half precision for the all-reduce; ``POWER_SGD``
    and ``BATCHED_POWER_SGD`` send low-rank approximations (``comm_state_option`` configures
    ``PowerSGDState``).

    Example::

        DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BF16)
    """

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"

    def __str__(self) -> str:
        return self.value


class KwargsHandler:
    """Base of the ``*Kwargs`` handlers: ``to_kwargs()`` returns the fields changed from default.

    Example::

        DistributedDataParallelKwargs(find_unused_parameters=True).to_kwargs()
        # {"find_unused_parameters": True}
    """

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    def to_kwargs(self) -> dict[str, Any]:
        from .environment import clear_environment

        with clear_environment():  # defaults as documented, not as the environment sets them
            default = self.__class__().to_dict()
        return {k: v for k, v in self.to_dict().items() if default[k] != v}


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """How gradient accumulation behaves.

    Args:
        num_steps: number of batches whose gradients are accumulated before a sync and an
            optimizer step.
        adjust_scheduler: the scheduler was written for optimizer steps, not batches. A
            prepared scheduler steps only on sync steps (``num_processes`` times when batches
            are not split, as in Accelerate); with this flag the skipped batches still count
            in its ``_step_count``, so torch does not warn about the order of the calls.
        sync_with_dataloader: force a sync step at the end of the active dataloader, even if
            ``num_steps`` batches have not been seen yet.
        sync_each_batch: sync gradients on every batch (no ``no_sync``) while still only
            stepping the optimizer every ``num_steps``; trades speed for memory.

    Example::

        GradientAccumulationPlugin(num_steps=2)
    """

    num_steps: int | None = field(default=None)
    adjust_scheduler: bool = field(default=True)
    sync_with_dataloader: bool = field(default=True)
    sync_each_batch: bool = field(default=False)

    def to_kwargs(self) -> dict[str, Any]:
        """Every field (not only the changed ones): ``GradientState`` reads its settings here,
        so a default like ``adjust_scheduler=True`` must not vanish."""
        return self.to_dict()

    def __post_init__(self) -> None:
        if self.num_steps is not None and (
            not isinstance(self.num_steps, int) or isinstance(self.num_steps, bool)
        ):
            raise TypeError(f"num_steps must be an int, got {type(self.num_steps).__name__}")
        if self.num_steps is not None and self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")


@dataclass
class DataLoaderConfiguration:
    """How :meth:`Accelerator.prepare` shards DataLoaders across ranks.

    Args:
        split_batches: when True, the batch size of the given loader is the *global* batch
            size and each rank gets a ``1/num_processes`` slice of every batch (the batch size
            must divide evenly). When False (default) each rank draws its own full batches.
        dispatch_batches: when True, rank 0 iterates the loader and sends each rank its share.
            ``None`` means True for iterable datasets, False otherwise.
        even_batches: when True (default), pad the last batch by wrapping around to the
            start of the dataset so every rank sees the same number of batches of the same
            size; :meth:`Accelerator.gather_for_metrics` drops those duplicates.
        use_seedable_sampler: replace a random sampler by one whose order depends only on
            ``(seed, epoch)``, so results are reproducible across runs and resumptions.
        data_seed: the seed of that sampler (default: the global seed at prepare time).
        non_blocking: pass ``non_blocking=True`` when moving batches to the device.
        use_stateful_dataloader: prepared loaders are also ``torchdata``'s
            ``StatefulDataLoader``: ``state_dict()`` mid-epoch records the position and
            ``save_state``/``load_state`` resume there. ``prepare`` raises Accelerate's
            ``ImportError`` without ``torchdata`` >= 0.8.

    Example::

        DataLoaderConfiguration(even_batches=False)
    """

    split_batches: bool = field(default=False)
    dispatch_batches: bool | None = field(default=None)
    even_batches: bool = field(default=True)
    use_seedable_sampler: bool = field(default=False)
    data_seed: int | None = field(default=None)
    non_blocking: bool = field(default=False)
    use_stateful_dataloader: bool = field(default=False)


@dataclass
class ProjectConfiguration:
    """Where :meth:`Accelerator.save_state` writes when no directory is given.

    With ``automatic_checkpoint_naming`` checkpoints go to
    ``{project_dir}/checkpoints/checkpoint_{iteration}``, keeping at most ``total_limit``.

    Example::

        config = ProjectConfiguration("runs", automatic_checkpoint_naming=True, total_limit=3)
        accelerator = Accelerator(project_config=config)
        accelerator.save_state()   # runs/checkpoints/checkpoint_0
    """

    project_dir: str | None = field(default=None)
    logging_dir: str | None = field(default=None)
    automatic_checkpoint_naming: bool = field(default=False)
    total_limit: int | None = field(default=None)
    iteration: int = field(default=0)
    save_on_each_node: bool = field(default=False)

    def set_directories(self, project_dir: str | None = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments forwarded to ``torch.nn.parallel.DistributedDataParallel`` by ``prepare``.

    ``comm_hook`` / ``comm_wrapper`` / ``comm_state_option`` pick a DDP communication hook
    (:class:`DDPCommunicationHookType`), registered on the wrapped model by ``prepare``; they
    are not DDP constructor arguments, so :meth:`to_kwargs` leaves them out.

    Example::

        Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
        Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(comm_hook="bf16")])
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict[str, Any] = field(default_factory=dict)

    _HOOK_FIELDS = ("comm_hook", "comm_wrapper", "comm_state_option")

    def __post_init__(self) -> None:
        self.comm_hook = DDPCommunicationHookType(self.comm_hook)
        self.comm_wrapper = DDPCommunicationHookType(self.comm_wrapper)
        if self.comm_wrapper not in (
            DDPCommunicationHookType.NO,
            DDPCommunicationHookType.FP16,
            DDPCommunicationHookType.BF16,
        ):
            raise ValueError(
                f"comm_wrapper must be 'no', 'fp16' or 'bf16' (it compresses what another hook "
                f"sends), got {self.comm_wrapper.value!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """The DDP constructor's fields (the hook fields are applied by
        :meth:`register_comm_hook`)."""
        return {k: v for k, v in super().to_dict().items() if k not in self._HOOK_FIELDS}

    def register_comm_hook(self, model: Any) -> None:
        """Register the chosen communication hook on a ``DistributedDataParallel`` model."""
        if self.comm_hook == DDPCommunicationHookType.NO:
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        hooks: dict[DDPCommunicationHookType, Any] = {
            DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
            DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
            DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
            DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook,
        }
        wrappers: dict[DDPCommunicationHookType, Any] = {
            DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
            DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper,
        }
        hook = hooks[self.comm_hook]
        if self.comm_wrapper in wrappers:
            hook = wrappers[self.comm_wrapper](hook)
        state = None
        if self.comm_hook in (
            DDPCommunicationHookType.POWER_SGD,
            DDPCommunicationHookType.BATCHED_POWER_SGD,
        ):
            state = powerSGD_hook.PowerSGDState(None, **self.comm_state_option)
        model.register_comm_hook(state=state, hook=hook)


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments forwarded to ``torch.amp.GradScaler`` under ``mixed_precision="fp16"``.

    Example::

        Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024)])
    """

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments forwarded to ``torch.autocast`` by :meth:`Accelerator.autocast`.

    Example::

        with accelerator.autocast(AutocastKwargs(cache_enabled=False)):
            out = model(x)
    """

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for ``torch.distributed.init_process_group`` when the ``Accelerator`` creates
    the group (under ``torchrun``). Inside a launch the launcher created it already: then only
    ``timeout`` is applied, to the collectives of the existing group.

    Example::

        Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(minutes=5))])
    """

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: Any = None

    def __post_init__(self) -> None:
        if self.timeout is not None and not hasattr(self.timeout, "total_seconds"):
            from datetime import timedelta

            self.timeout = timedelta(seconds=float(self.timeout))


class DynamoBackend(str, enum.Enum):
    """``torch.compile`` backends, as Accelerate names them (``NO``: do not compile)."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"

    def __str__(self) -> str:
        return self.value


def _env_flag(key: str) -> bool:
    return os.environ.get(key, "false").strip().lower() in ("1", "true", "yes", "on", "y", "t")


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """How :meth:`Accelerator.prepare` compiles models with ``torch.compile``.

    ``backend="no"`` (the default, or env ``ACCELERATE_DYNAMO_BACKEND``) compiles nothing;
    ``Accelerator(dynamo_backend="inductor")`` is a shorthand for this plugin. ``mode``,
    ``fullgraph``, ``dynamic``, ``options`` and ``disable`` go to ``torch.compile``;
    ``use_regional_compilation`` compiles each repeated block instead of the whole model.

    Example::

        Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="inductor", mode="reduce-overhead"))
    """

    backend: Any = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        prefix = "ACCELERATE_DYNAMO_"
        if self.backend is None:
            self.backend = os.environ.get(prefix + "BACKEND", "no")
        backend = self.backend.value if isinstance(self.backend, DynamoBackend) else self.backend
        try:
            self.backend = DynamoBackend(str(backend).upper())
        except ValueError:
            known = ", ".join(b.value.lower() for b in DynamoBackend)
            raise ValueError(f"unknown dynamo backend {backend!r}: use one of {known}") from None
        if self.mode is None:
            self.mode = os.environ.get(prefix + "MODE", "default")
        if self.fullgraph is None:
            self.fullgraph = _env_flag(prefix + "USE_FULLGRAPH")
        if self.use_regional_compilation is None:
            self.use_regional_compilation = _env_flag(prefix + "USE_REGIONAL_COMPILATION")
        if self.dynamic is None and os.environ.get(prefix + "USE_DYNAMIC") is not None:
            self.dynamic = _env_flag(prefix + "USE_DYNAMIC")

    def to_dict(self) -> dict[str, Any]:
        config = super().to_dict()
        config["backend"] = self.backend.value.lower()
        return config

    def to_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for ``torch.compile`` that differ from the defaults (as in
        Accelerate), the backend always included unless it is ``"no"``."""
        kwargs = super().to_kwargs()
        kwargs.pop("use_regional_compilation", None)
        if self.backend != DynamoBackend.NO:
            kwargs["backend"] = self.backend.value.lower()
        return kwargs


class ProfilerActivity(str, enum.Enum):
    CPU = "cpu"
    XPU = "xpu"
    MTIA = "mtia"
    CUDA = "cuda"
    HPU = "hpu"


@dataclass
class ProfileKwargs(KwargsHandler):
    """Settings of :meth:`Accelerator.profile` (``torch.profiler.profile``).

    ``activities`` (``["cpu", "cuda"]``; default: what the profiler picks), ``schedule_option``
    (``wait``, ``warmup``, ``active``, ``repeat``, ``skip_first``: a ``torch.profiler.schedule``),
    ``on_trace_ready``, ``record_shapes``, ``profile_memory``, ``with_stack``, ``with_flops``,
    ``with_modules``; ``output_trace_dir``: also export each rank's Chrome trace there
    (``trace_rank{n}.json``).

    Example::

        handler = ProfileKwargs(activities=["cpu"], record_shapes=True)
        accelerator = Accelerator(kwargs_handlers=[handler])
        with accelerator.profile() as prof:
            train_step()
        print(prof.key_averages().table(row_limit=5))
    """

    activities: list[Any] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Any = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self) -> Any:
        """The ``torch.profiler.profile`` these settings describe (not started)."""
        import torch.profiler

        activities = None
        if self.activities is not None:
            activities = []
            for activity in self.activities:
                name = activity.value if isinstance(activity, ProfilerActivity) else str(activity)
                try:
                    activities.append(getattr(torch.profiler.ProfilerActivity, name.upper()))
                except AttributeError:
                    raise ValueError(
                        f"unknown profiler activity {activity!r}: use cpu, cuda, xpu, mtia or hpu"
                    ) from None
        schedule = None
        if self.schedule_option is not None:
            schedule = torch.profiler.schedule(**self.schedule_option)
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


class LoggerType(str, enum.Enum):
    """The experiment trackers ``Accelerator(log_with=...)`` knows by name."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    TRACKIO = "trackio"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


__all__ = [
    "AutocastKwargs",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "DynamoBackend",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "PrecisionType",
    "ProfileKwargs",
    "ProfilerActivity",
    "ProjectConfiguration",
    "RNGType",
    "TorchDynamoPlugin",
]
