"""The ``Accelerator``: Accelerate's training API on top of this package's state.

Data flow of one training step on each rank (inside a launched worker)::

    for batch in loader:                  # DataLoaderShard: this rank's share, on the device;
                                          #   tells GradientState when the last batch comes
        with accelerator.accumulate(model):   # sync_gradients = step % N == 0 or last batch;
                                              #   DDP.no_sync() on the other steps
            loss = model(batch)               # model: DDP(module), forward under autocast
            accelerator.backward(loss)        # loss / N, GradScaler under fp16
            optimizer.step()                  # AcceleratedOptimizer: only when sync_gradients
            scheduler.step()                  # AcceleratedScheduler: only after a real step
            optimizer.zero_grad()             # only when sync_gradients

Process control (``wait_for_everyone``, ``main_process_first``, ``print``...) is delegated to
:class:`~notebook_launcher.state.PartialState`, so barriers show on the dashboard. With no
launcher and no process group, everything works as a single process.

Differences from Accelerate (names and defaults kept):

* ``save_state`` writes into ``<dir>.incomplete`` and renames it when complete, with a
  ``checkpoint.json`` manifest; ``load_state`` refuses a directory without one (so it does not
  read checkpoints written by Accelerate itself), and finds the complete copy a save cut short
  while committing left. ``total_limit`` prunes after the new checkpoint is complete, and an
  automatically named checkpoint older than an existing one is refused too. Dataloader generator states and the epoch
  are saved too, so a resumed run (mid-epoch with ``skip_first_batches``) is bit-identical.
* Prepared loaders draw from the global RNG exactly where Accelerate's do (same seed, same
  batches and models), and keep their shuffling generator, so a checkpoint records the
  epoch's order; a ``skip_first_batches`` copy (resuming mid-epoch) draws nothing.
* Tied weights are saved once, as Accelerate does, but the dropped names are recorded and
  restored by ``load_state`` / ``checkpointing.load_model_state_dict``.
* ``rng_types`` is accepted and ignored (each rank's generators are seeded by ``set_seed``
  and the loaders' own generators); DeepSpeed, FSDP and Megatron plugins are refused.
* ``end_training`` finishes the trackers but leaves the process group to the launcher.

Example::

    from notebook_launcher.accelerator import Accelerator

    def train():
        accelerator = Accelerator(gradient_accumulation_steps=2)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        accelerator.save_model(model, "out")
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from . import checkpointing
from ._worker import runtime
from .data_loader import DataLoaderShard, prepare_data_loader
from .data_loader import skip_first_batches as _skip_first_batches
from .optimizer import AcceleratedOptimizer
from .scheduler import AcceleratedScheduler
from .state import AcceleratorState, DistributedType, GradientState, PartialState, ProcessControl
from .trackers import GeneralTracker, filter_trackers
from .utils.dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DynamoBackend,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
    ProjectConfiguration,
    TorchDynamoPlugin,
)
from .utils.other import extract_model_from_parallel, is_compiled_module

# Accelerate's logger name, so that logging set up for Accelerate applies (README).
logger = logging.getLogger("accelerate.accelerator")

# ------------------------------------------------------------------- autocast wrapper


def _convert_to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    if isinstance(value, dict):
        return type(value)({k: _convert_to_fp32(v) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_convert_to_fp32(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_convert_to_fp32(v) for v in value)
    return value


def _autocast_forward(forward: Callable[..., Any], autocast: Callable[[], Any]) -> Any:
    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with autocast():
            out = forward(*args, **kwargs)
        return _convert_to_fp32(out)

    wrapped._notebook_launcher_autocast = True  # type: ignore[attr-defined]
    return wrapped


# ---------------------------------------------------------------------------- Accelerator


class Accelerator(ProcessControl):
    """Accelerate's ``Accelerator``, for DDP on CPU (gloo) and GPU (nccl).

    Args:
        device_placement: move prepared models and batches to ``accelerator.device``.
        split_batches: shorthand for ``DataLoaderConfiguration(split_batches=...)``.
        mixed_precision: ``"no"``, ``"bf16"`` (CPU and GPU) or ``"fp16"`` (GPU; on a CPU it
            is accepted with a warning and trains in fp32, as in Accelerate); ``None`` reads
            ``ACCELERATE_MIXED_PRECISION`` (set by ``notebook_launcher(mixed_precision=...)``).
        gradient_accumulation_steps: batches per optimizer step (or pass
            ``gradient_accumulation_plugin``, not both).
        cpu: run on the CPU even if CUDA is available.
        dataloader_config: how ``prepare`` shards DataLoaders.
        project_dir / project_config: default directory of ``save_state``.
        step_scheduler_with_optimizer: step prepared schedulers only with real optimizer steps.
        kwargs_handlers: ``DistributedDataParallelKwargs``, ``GradScalerKwargs``,
            ``AutocastKwargs``.

    Example::

        accelerator = Accelerator(mixed_precision="bf16")
        model, optimizer = accelerator.prepare(model, optimizer)
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: list[str] | None = None,
        log_with: Any = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[KwargsHandler] | None = None,
        dynamo_backend: Any = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        even_batches: bool | None = None,
        dispatch_batches: bool | None = None,
        use_seedable_sampler: bool | None = None,
    ) -> None:
        if project_config is not None:
            self.project_configuration = project_config
        else:
            self.project_configuration = ProjectConfiguration(
                project_dir=os.fspath(project_dir) if project_dir is not None else None
            )
        if project_dir is not None and self.project_configuration.project_dir is None:
            self.project_configuration.set_directories(os.fspath(project_dir))

        self.ddp_handler: DistributedDataParallelKwargs | None = None
        self.scaler_handler: GradScalerKwargs | None = None
        self.autocast_handler: AutocastKwargs | None = None
        self.init_handler: InitProcessGroupKwargs | None = None
        self.profile_handler: ProfileKwargs | None = None
        for handler in kwargs_handlers or []:
            if not isinstance(handler, KwargsHandler):
                raise TypeError(f"unsupported kwargs handler: {handler!r}")
            for attr, cls in (
                ("ddp_handler", DistributedDataParallelKwargs),
                ("scaler_handler", GradScalerKwargs),
                ("autocast_handler", AutocastKwargs),
                ("init_handler", InitProcessGroupKwargs),
                ("profile_handler", ProfileKwargs),
            ):
                if isinstance(handler, cls):
                    if getattr(self, attr) is not None:
                        raise ValueError(f"you can only pass one {cls.__name__} in kwargs_handlers")
                    setattr(self, attr, handler)
                    break
            else:
                raise TypeError(f"unsupported kwargs handler: {type(handler).__name__}")

        if dynamo_plugin is not None and dynamo_backend is not None:
            raise ValueError(
                "You cannot pass in both `dynamo_plugin` and `dynamo_backend`, please only pass in one."
            )
        if dynamo_plugin is None:
            dynamo_plugin = TorchDynamoPlugin(backend=dynamo_backend)
        init_kwargs: dict[str, Any] = {}
        if self.init_handler is not None and self.init_handler.timeout is not None:
            init_kwargs["timeout"] = self.init_handler.timeout
        self.state = AcceleratorState(
            mixed_precision=mixed_precision,
            cpu=cpu,
            dynamo_plugin=dynamo_plugin,
            deepspeed_plugin=deepspeed_plugin,
            fsdp_plugin=fsdp_plugin,
            megatron_lm_plugin=megatron_lm_plugin,
            _from_accelerator=True,
            **init_kwargs,
        )

        if gradient_accumulation_plugin is not None:
            if gradient_accumulation_steps != 1:
                raise ValueError(
                    "You can only pass one of `gradient_accumulation_steps` and "
                    "`gradient_accumulation_plugin`. Put the number of steps in the plugin: "
                    "GradientAccumulationPlugin(num_steps=...)."
                )
        else:
            gradient_accumulation_plugin = GradientAccumulationPlugin(
                num_steps=gradient_accumulation_steps
            )
        self.gradient_state = GradientState(
            gradient_accumulation_plugin=gradient_accumulation_plugin
        )

        legacy = {
            "split_batches": split_batches,
            "even_batches": even_batches,
            "dispatch_batches": dispatch_batches,
            "use_seedable_sampler": use_seedable_sampler,
        }
        given = {k: v for k, v in legacy.items() if v is not None}
        if dataloader_config is not None and given:
            raise ValueError(
                f"pass {sorted(given)} inside dataloader_config=DataLoaderConfiguration(...), "
                "not both as arguments and a dataloader_config"
            )
        if dataloader_config is None:
            dataloader_config = DataLoaderConfiguration(**given)
        self.dataloader_config = dataloader_config

        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = rng_types
        self.log_with = filter_trackers(log_with, self.logging_dir)
        self.trackers: list[GeneralTracker] = []
        self.step = 0
        self.flag_tensor: torch.Tensor | None = None

        self.scaler: torch.amp.GradScaler | None = None
        # fp16 on a CPU is accepted (the state warned) and trains in fp32, as in Accelerate.
        mp = self.state.mixed_precision
        self.native_amp = mp == "bf16" or (mp == "fp16" and self.device.type == "cuda")
        if mp == "fp16" and self.native_amp:
            scaler_kwargs: dict[str, Any] = (
                self.scaler_handler.to_kwargs() if self.scaler_handler else {}
            )
            self.scaler = torch.amp.GradScaler("cuda", **scaler_kwargs)

        self._models: list[torch.nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[DataLoader] = []
        self._custom_objects: list[Any] = []
        self._save_model_state_pre_hooks: list[Callable[..., Any]] = []
        self._load_model_state_pre_hooks: list[Callable[..., Any]] = []

    # ------------------------------------------------------------------ properties
    # device, num_processes, process_index, the is_*_process flags, wait_for_everyone,
    # main_process_first, on_*_process, split_between_processes and print come from
    # ProcessControl (state.py), which delegates them to PartialState.

    def _view(self, name: str) -> PartialState:
        return self.state._view(name)

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def mixed_precision(self) -> str:
        return self.state.mixed_precision

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def dispatch_batches(self) -> bool | None:
        return self.dataloader_config.dispatch_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.dataloader_config.even_batches = value

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        self.gradient_state.plugin_kwargs.update({"num_steps": int(value)})

    @property
    def sync_gradients(self) -> bool:
        """Whether this step syncs gradients (and steps the optimizer)."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state._set_sync_gradients(value)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped by the fp16 GradScaler."""
        return any(opt.step_was_skipped for opt in self._optimizers)

    # -------------------------------------------------------------- triggers
    def set_trigger(self) -> None:
        """Raise this rank's flag; the next :meth:`check_trigger` is True on every rank.

        Example::

            if loss.isnan():
                accelerator.set_trigger()
            if accelerator.check_trigger():
                break
        """
        self.flag_tensor = torch.tensor(1, device=self.device)
        super().set_trigger()

    def check_trigger(self) -> bool:
        """True on every rank if any rank called :meth:`set_trigger` since the last check.

        A collective: call it on every rank.

        Example::

            if accelerator.check_trigger():
                break   # every rank leaves the loop at the same step
        """
        fired = super().check_trigger()
        self.flag_tensor = torch.tensor(0, device=self.device)
        return fired

    # ------------------------------------------------------------------- prepare
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare models, optimizers, schedulers and DataLoaders; returned in the given order.

        Models go to the device (and into DDP when distributed), optimizers and schedulers are
        wrapped to step only with synced gradients, DataLoaders are sharded across ranks.
        Other objects pass through unchanged. Schedulers are prepared after optimizers, so
        they can be given in any order.

        Example::

            model, optimizer, loader, scheduler = accelerator.prepare(
                model, optimizer, loader, scheduler)
        """
        if device_placement is None:
            device_placement = [self.device_placement] * len(args)
        elif len(device_placement) != len(args):
            raise ValueError(
                f"device_placement has {len(device_placement)} entries for {len(args)} objects"
            )
        # Module.to() moves parameters in place (same Parameter objects), so optimizers built
        # before prepare keep pointing at the model's parameters.
        result: list[Any] = list(args)
        for i, obj in enumerate(args):
            if isinstance(obj, torch.nn.Module):
                result[i] = self.prepare_model(obj, device_placement=device_placement[i])
            elif isinstance(obj, torch.optim.Optimizer):
                result[i] = self.prepare_optimizer(obj, device_placement=device_placement[i])
            elif isinstance(obj, DataLoader):
                result[i] = self.prepare_data_loader(obj, device_placement=device_placement[i])
        for i, obj in enumerate(args):
            if _is_scheduler(obj):
                result[i] = self.prepare_scheduler(obj)
        return result[0] if len(result) == 1 else tuple(result)

    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> torch.nn.Module:
        """Move ``model`` to the device, add autocast for mixed precision, wrap it in DDP.

        With ``evaluation_mode=True`` the model is not wrapped in DDP (inference only).
        """
        if device_placement is None:
            device_placement = self.device_placement
        if _registered_again(model, self._models):
            return model
        self._models.append(model)
        if device_placement:
            model = model.to(self.device)
        if self.native_amp and "_original_forward" not in model.__dict__:
            # Like Accelerate: forward runs under autocast and returns fp32 outputs, also
            # outside ``accelerator.autocast()``. ``unwrap_model(keep_fp32_wrapper=False)``
            # takes it off again.
            original = model.forward
            model.__dict__["_original_forward"] = original
            model.__dict__["forward"] = _autocast_forward(original, self.autocast)
        if (
            not evaluation_mode
            and self.use_distributed
            and any(p.requires_grad for p in model.parameters())
        ):
            kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler else {}
            if self.device.type == "cuda":
                kwargs.setdefault("device_ids", [self.device.index or 0])
                kwargs.setdefault("output_device", self.device.index or 0)
            with runtime.phase(self.process_index, "wrapping"):  # seconds: torch's own cost
                model = DistributedDataParallel(model, **kwargs)
            if self.ddp_handler is not None:
                self.ddp_handler.register_comm_hook(model)
        dynamo = self.state.dynamo_plugin
        if (
            dynamo is not None
            and dynamo.backend != DynamoBackend.NO
            and not is_compiled_module(model)
        ):
            # Last, as in Accelerate: compile(DDP(module)); unwrap_model sees through both.
            model = torch.compile(model, **dynamo.to_kwargs())  # type: ignore[assignment]
        self._models[-1] = model
        model.__dict__["_is_accelerate_prepared"] = True
        return model

    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> AcceleratedOptimizer:
        """Wrap ``optimizer`` so it steps only when gradients are synced.

        Example::

            optimizer = accelerator.prepare_optimizer(torch.optim.AdamW(model.parameters()))
        """
        if _registered_again(optimizer, self._optimizers):
            return optimizer  # type: ignore[return-value]
        if device_placement is None:
            device_placement = self.device_placement
        wrapped = AcceleratedOptimizer(
            optimizer, device_placement=device_placement, scaler=self.scaler
        )
        wrapped._is_accelerate_prepared = True  # type: ignore[attr-defined]
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler:
        """Wrap a learning-rate scheduler so it steps only after real optimizer steps.

        Example::

            scheduler = accelerator.prepare_scheduler(StepLR(optimizer, step_size=10))
        """
        if _registered_again(scheduler, self._schedulers):
            return scheduler
        optimizer = getattr(scheduler, "optimizer", None)
        optimizers = [
            opt for opt in self._optimizers if optimizer is opt or optimizer is opt.optimizer
        ] or list(self._optimizers)
        wrapped = AcceleratedScheduler(
            scheduler,
            optimizers,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
        )
        wrapped._is_accelerate_prepared = True  # type: ignore[attr-defined]
        self._schedulers.append(wrapped)
        return wrapped

    def prepare_data_loader(
        self, data_loader: DataLoader, device_placement: bool | None = None
    ) -> DataLoaderShard:
        """Shard ``data_loader`` across ranks (see :mod:`notebook_launcher.data_loader`).

        Example::

            loader = accelerator.prepare_data_loader(DataLoader(dataset, batch_size=16))
        """
        if _registered_again(data_loader, self._dataloaders):
            return data_loader  # type: ignore[return-value]
        if device_placement is None:
            device_placement = self.device_placement
        config = self.dataloader_config
        prepared = prepare_data_loader(
            data_loader,
            device=self.device,
            num_processes=self.num_processes,
            process_index=self.process_index,
            split_batches=config.split_batches,
            put_on_device=device_placement,
            dispatch_batches=config.dispatch_batches,
            even_batches=config.even_batches,
            use_seedable_sampler=config.use_seedable_sampler,
            data_seed=config.data_seed,
            non_blocking=config.non_blocking,
            use_stateful_dataloader=config.use_stateful_dataloader,
        )
        prepared._is_accelerate_prepared = True
        self._dataloaders.append(prepared)
        return prepared

    @contextlib.contextmanager
    def join_uneven_inputs(
        self, joinables: list[Any], even_batches: bool | None = None
    ) -> Iterator[None]:
        """Train on inputs of different lengths per rank (``torch.distributed.algorithms.Join``).

        With ``even_batches=False`` the prepared DataLoaders stop padding inside the block,
        so ranks may see different numbers of batches; DDP models in ``joinables`` shadow the
        collectives of the ranks that ran out. No-op in a single process.

        Example::

            with accelerator.join_uneven_inputs([model], even_batches=False):
                for batch in loader:
                    ...
        """
        if not self.use_distributed or self.distributed_type == DistributedType.NO:
            yield
            return
        if self.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
            warnings.warn(
                "Joining uneven inputs is only supported for multi-GPU (and multi-CPU) DDP "
                f"training, not {self.distributed_type}: `join_uneven_inputs` has no effect.",
                UserWarning,
                stacklevel=3,
            )
            yield
            return
        from torch.distributed.algorithms import Join

        from .data_loader import BatchSamplerShard, DataLoaderDispatcher

        saved: list[tuple[Any, bool]] = []
        if even_batches is not None:
            for dl in self._dataloaders:
                if isinstance(dl, DataLoaderDispatcher):
                    saved.append((dl, dl.even_batches))
                    dl.even_batches = even_batches
                elif isinstance(dl.batch_sampler, BatchSamplerShard):
                    saved.append((dl.batch_sampler, dl.batch_sampler.even_batches))
                    dl.batch_sampler.even_batches = even_batches
                else:
                    continue
                if not even_batches and isinstance(dl, DataLoaderShard):
                    dl._saved_remainder = dl.remainder
                    dl.remainder = 0  # nothing padded: nothing for gather_for_metrics to drop
        else:
            even_batches = self.even_batches
        try:
            with Join(joinables, enable=not even_batches, throw_on_early_termination=False):
                yield
        finally:
            for obj, value in saved:
                obj.even_batches = value
            for dl in self._dataloaders:
                if hasattr(dl, "_saved_remainder"):
                    dl.remainder = dl.__dict__.pop("_saved_remainder")

    def skip_first_batches(self, dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
        """The loader without its first ``num_batches`` batches (to resume mid-epoch).

        Example::

            accelerator.load_state("ckpt")
            for batch in accelerator.skip_first_batches(loader, done_batches):
                ...
        """
        return _skip_first_batches(dataloader, num_batches)

    # ------------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, divided by the accumulation steps, scaled under fp16.

        Example::

            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
        """
        steps = self.gradient_accumulation_steps
        if steps > 1:
            loss = loss / steps
        if self.scaler is not None:
            self.scaler.scale(loss).backward(**kwargs)
        else:
            loss.backward(**kwargs)

    def _do_sync(self) -> None:
        gs = self.gradient_state
        if gs.sync_with_dataloader and gs.end_of_dataloader:
            self.step = 0
            gs._set_sync_gradients(True)
        else:
            self.step += 1
            gs._set_sync_gradients((self.step % gs.num_steps) == 0)

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        """Skip the gradient all-reduce in the block (DDP's ``no_sync``; no-op otherwise).

        Example::

            with accelerator.no_sync(model):
                accelerator.backward(loss)   # local gradients only
        """
        context: Callable[[], Any] = contextlib.nullcontext
        if self.use_distributed:
            context = getattr(model, "no_sync", context)
        with context():
            yield

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        """One batch of gradient accumulation: sync only every N-th batch or at the end.

        Example::

            with accelerator.accumulate(model):
                accelerator.backward(loss)
                optimizer.step()      # real step only when accelerator.sync_gradients
        """
        self._do_sync()
        allow_sync = self.sync_gradients or (
            self.use_distributed and self.gradient_state.sync_each_batch
        )
        with contextlib.ExitStack() as stack:
            if not allow_sync:
                for model in models:
                    stack.enter_context(self.no_sync(model))
            yield

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: torch.nn.Module) -> Iterator[None]:
        """Make the next backward of ``model`` all-reduce even inside ``no_sync``."""
        if not self.use_distributed or not isinstance(model, DistributedDataParallel):
            yield
            return
        old = model.require_backward_grad_sync
        model.require_backward_grad_sync = True
        model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync = old

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Any:
        """Context manager: autocast to the mixed-precision dtype (no-op for ``"no"``).

        Example::

            with accelerator.autocast():
                out = model(x)
        """
        handler = autocast_handler or self.autocast_handler or AutocastKwargs()
        if not self.native_amp or not handler.enabled:
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.mixed_precision == "bf16" else torch.float16
        kwargs: dict[str, Any] = {}
        if handler.cache_enabled is not None:
            kwargs["cache_enabled"] = handler.cache_enabled
        return torch.autocast(device_type=self.device.type, dtype=dtype, **kwargs)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale the gradients of fp16 training (before clipping); no-op otherwise."""
        if self.scaler is None:
            return
        if optimizer is None:
            optimizers: list[Any] = list(self._optimizers)
        elif isinstance(optimizer, (list, tuple)):
            optimizers = list(optimizer)
        else:
            optimizers = [optimizer]
        for opt in optimizers:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            self.scaler.unscale_(opt)

    def clip_grad_norm_(
        self, parameters: Any, max_norm: float, norm_type: float = 2
    ) -> torch.Tensor:
        """Unscale (fp16) then ``torch.nn.utils.clip_grad_norm_``; returns the total norm.

        Example::

            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
        """
        self.unscale_gradients()
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Unscale (fp16) then ``torch.nn.utils.clip_grad_value_``."""
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # ----------------------------------------------------------------- collectives
    def gather(self, tensor: Any) -> Any:
        """Concatenate ``tensor`` (or a nest of tensors) from every rank along dim 0.

        Example::

            all_losses = accelerator.gather(loss.detach()[None])   # one row per rank
        """
        from .utils.operations import gather

        return gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """:meth:`gather`, minus the samples duplicated to even out the last batch.

        Example::

            for x, y in eval_loader:
                preds = accelerator.gather_for_metrics(model(x).argmax(-1))
            # concatenated over the loop: exactly len(eval_dataset) predictions
        """
        from .utils.operations import gather_object

        if not use_gather_object and not _all_tensors(input_data):
            use_gather_object = True
        data = gather_object(input_data) if use_gather_object else self.gather(input_data)
        gs = self.gradient_state
        if not gs.end_of_dataloader:
            return data
        remainder = gs.remainder
        if remainder == -1:
            logger.info(
                "The dataset has no length: returning every gathered sample; drop the "
                "duplicates of the last batch yourself."
            )
            return data
        if remainder > 0:
            if use_gather_object:
                return data[:remainder]
            return _map_tensors(lambda t: t[:remainder], data)
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce ``tensor`` across ranks (``"sum"``, ``"mean"`` or ``"none"``).

        Example::

            mean_loss = accelerator.reduce(loss.detach(), reduction="mean")
        """
        from .utils.operations import reduce

        return reduce(tensor, reduction=reduction, scale=scale)

    def pad_across_processes(
        self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
    ) -> Any:
        """Pad ``tensor`` along ``dim`` to the largest size on any rank (before a gather).

        Example::

            tokens = accelerator.pad_across_processes(tokens, dim=1, pad_index=tokenizer.pad_token_id)
            all_tokens = accelerator.gather(tokens)
        """
        from .utils.operations import pad_across_processes

        return pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    # ------------------------------------------------------------------- models
    def unwrap_model(
        self,
        model: torch.nn.Module,
        keep_fp32_wrapper: bool = True,
        keep_torch_compile: bool = True,
    ) -> torch.nn.Module:
        """The user's module: without DDP and ``torch.compile`` (in either order; with
        ``keep_torch_compile`` the compiled module around it stays), and without the
        mixed-precision forward if ``keep_fp32_wrapper=False``.

        Example::

            torch.save(accelerator.unwrap_model(model).state_dict(), "weights.pt")
        """
        return extract_model_from_parallel(
            model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile
        )

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """The state dict of the (unwrapped) model."""
        if unwrap:
            model = self.unwrap_model(model)
        return model.state_dict()

    # ------------------------------------------------------------------- saving
    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """Save ``obj`` to ``f`` once (on the main process), atomically.

        Example::

            accelerator.save({"epoch": epoch}, "meta.pt")
        """
        if self.is_main_process:
            checkpointing.save(obj, f, safe_serialization=safe_serialization)

    def save_model(
        self,
        model: torch.nn.Module,
        save_directory: str | os.PathLike[str],
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Save the unwrapped weights to ``save_directory``, once, after a barrier.

        One ``model.safetensors``, or ``model-0000k-of-0000N.safetensors`` shards plus
        ``model.safetensors.index.json`` above ``max_shard_size``; loadable with
        ``safetensors.torch.load_file``. Tied weights are stored once (see
        :mod:`notebook_launcher.checkpointing`). Every rank returns once the files exist.

        Example::

            accelerator.save_model(model, "out", max_shard_size="1GB")
        """
        directory = os.fspath(save_directory)
        if os.path.isfile(directory):
            raise ValueError(f"save_directory {directory!r} should be a directory, not a file")
        state_dict = self.get_state_dict(model)
        self.wait_for_everyone()
        if self.is_main_process:
            checkpointing.save_model_files(
                state_dict,
                directory,
                max_shard_size=max_shard_size,
                safe_serialization=safe_serialization,
            )
        self.wait_for_everyone()

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Also save/load these objects (anything with ``state_dict``/``load_state_dict``).

        Example::

            accelerator.register_for_checkpointing(ema)
            accelerator.save_state("ckpt")   # includes custom_checkpoint_0.pkl
        """
        bad = [
            o for o in objects if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))
        ]
        if bad:
            err = (
                "All `objects` must include a `state_dict` and `load_state_dict` function to be "
                "stored. The following inputs are invalid:"
            )
            for index, obj in enumerate(bad):
                err += f"\n\t- Item at index {index}, `{type(obj).__name__}`"
            raise ValueError(err)
        self._custom_objects.extend(objects)

    def save_state(
        self,
        output_dir: str | os.PathLike[str] | None = None,
        safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> str:
        """Save models, optimizers, schedulers, scaler, custom objects and per-rank RNG states.

        All ranks must call it. Everything is written to ``<output_dir>.incomplete`` and
        renamed to ``output_dir`` when complete, so an interrupted save never looks complete
        (and the previous checkpoint stays until the new one is in place). With
        ``ProjectConfiguration(automatic_checkpoint_naming=True)`` it writes
        ``checkpoint_<iteration>``, refuses one that exists (or a newer one: another run's),
        and with ``total_limit`` deletes the oldest only after the new one is complete.
        Returns the directory.

        Each rank may pass its own directory (as Accelerate allows): each writes its RNG and
        data-loader states there, the main process also the models, optimizers and the rest;
        a warning says so, as only the main process's directory then holds a whole
        checkpoint.

        Example::

            accelerator.save_state("ckpt")
            ...
            accelerator.load_state("ckpt")   # continues bit-identically
        """
        config = self.project_configuration
        numbered = output_dir is None and config.automatic_checkpoint_naming
        output_dir = checkpointing.checkpoint_dir(config, output_dir, loading=False)
        dirs = self._rank_directories(output_dir)
        mine = dirs[self.process_index]
        writer = dirs.index(mine) == self.process_index  # the first rank naming it
        if len(set(dirs)) > 1 and self.is_main_process:
            logger.warning(
                "save_state got a different directory on each rank (%s): each rank writes "
                "its own RNG and data-loader states into its directory, and only the main "
                "process writes the models, optimizers, schedulers and registered objects, "
                "into %s. load_state on a rank whose directory lacks them fails: to save a "
                "checkpoint any rank can load, pass the same directory on every rank.",
                _listed_by_rank(dirs),
                mine,
            )
        refusal = ""
        if writer:
            if numbered:
                checkpointing.recover_numbered(os.path.dirname(mine))
            checkpointing.recover_checkpoint(mine)
            try:
                if numbered:
                    checkpointing.check_numbered_save(mine, config.iteration)
            except ValueError as exc:
                refusal = str(exc)
            if not refusal:
                checkpointing.start_staging(mine)
        self._refuse_together(refusal)  # also the barrier: every staging directory is there
        staging = checkpointing.staging_dir(mine)
        if self.is_main_process:
            models = [self.get_state_dict(m) for m in self._models]
            for hook in self._save_model_state_pre_hooks:
                hook(self._models, models, staging)
            checkpointing.save_main_state(
                staging,
                models=models,
                optimizers=[o.state_dict() for o in self._optimizers],
                schedulers=[s.state_dict() for s in self._schedulers],
                scaler=self.scaler.state_dict() if self.scaler is not None else None,
                custom_objects=self._custom_objects,
                safe_serialization=safe_serialization,
            )
        rank_states = checkpointing.rng_state()
        rank_states["step"] = self.step
        shards = [dl for dl in self._dataloaders if isinstance(dl, DataLoaderShard)]
        rank_states["dataloaders"] = [dl.state_dict() for dl in shards]
        # a stateful loader's state counts batches; its order (epoch, generator states)
        # says which permutation they come from
        rank_states["dataloader_orders"] = [dl.order_state() for dl in shards]
        checkpointing.save_rank_state(staging, self.process_index, rank_states)
        self.wait_for_everyone()
        if writer:
            extra: dict[str, Any] = {"step": self.step, "iteration": config.iteration}
            if len(set(dirs)) > 1:
                extra["ranks"] = [r for r, d in enumerate(dirs) if d == mine]
            checkpointing.commit_staging(mine, self.num_processes, extra)
            if numbered and config.total_limit is not None:
                # only now: until the new checkpoint is complete, the old ones are the ones
                checkpointing.prune_checkpoints(os.path.dirname(mine), config.total_limit)
        self.wait_for_everyone()
        if config.automatic_checkpoint_naming:
            config.iteration += 1
        return output_dir

    def load_state(
        self, input_dir: str | os.PathLike[str] | None = None, **load_model_func_kwargs: Any
    ) -> None:
        """Restore what :meth:`save_state` saved (call it on every rank, after ``prepare``).

        Raises ``ValueError`` for a directory that is not a complete checkpoint. A checkpoint
        whose save was interrupted while it was being committed is loaded from the complete
        copy that save left, with a warning naming it.

        Example::

            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            accelerator.load_state("ckpt")
        """
        config = self.project_configuration
        input_dir = checkpointing.checkpoint_dir(config, input_dir, loading=True)
        dirs = self._rank_directories(input_dir)
        found, how = checkpointing.find_checkpoint(input_dir)
        if how and dirs.index(dirs[self.process_index]) == self.process_index:
            logger.warning("%s.", how)
        manifest = checkpointing.load_accelerator_state(
            found,
            models=[self.unwrap_model(m) for m in self._models],
            optimizers=self._optimizers,
            schedulers=self._schedulers,
            scaler=self.scaler,
            custom_objects=self._custom_objects,
            pre_hooks=[
                functools.partial(h, self._models) for h in self._load_model_state_pre_hooks
            ],
            strict=load_model_func_kwargs.get("strict", True),
        )
        shards = [dl for dl in self._dataloaders if isinstance(dl, DataLoaderShard)]
        step = checkpointing.restore_rank_state(found, self.process_index, shards, manifest)
        if step is not None:
            self.step = step
        if config.automatic_checkpoint_naming:
            config.iteration = int(manifest.get("iteration", 0)) + 1

    def _rank_directories(self, directory: str) -> list[str]:
        """Every rank's absolute ``directory`` (index = rank); one collective, which is
        also the barrier before saving."""
        path = os.path.abspath(directory)
        if not self.use_distributed:
            return [path]
        from .utils.operations import gather_object

        return [str(p) for p in gather_object([path])]

    def _refuse_together(self, refusal: str) -> None:
        """Raise ``ValueError(refusal)`` on every rank when any rank has one (so that no
        rank waits for the others at the next barrier); else just a barrier."""
        if not self.use_distributed:
            if refusal:
                raise ValueError(refusal)
            return
        from .utils.operations import gather_object

        said = [str(r) for r in gather_object([refusal])]
        first = next((r for r in said if r), "")
        if first:
            raise ValueError(first)

    def register_save_state_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """``hook(models, state_dicts, output_dir)`` runs before models are saved."""
        self._save_model_state_pre_hooks.append(hook)
        return _Handle(self._save_model_state_pre_hooks, hook)

    def register_load_state_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """``hook(models, input_dir)`` runs before models are loaded."""
        self._load_model_state_pre_hooks.append(hook)
        return _Handle(self._load_model_state_pre_hooks, hook)

    # ------------------------------------------------------------------- cleanup
    def free_memory(self, *objects: Any) -> list[Any]:
        """Drop the Accelerator's references to prepared objects, collect garbage.

        Returns a list of ``None`` as long as ``objects``, to rebind your names to::

            model, optimizer = accelerator.free_memory(model, optimizer)
        """
        self._models = []
        self._optimizers = []
        self._schedulers = []
        self._dataloaders = []
        self._custom_objects = []
        self.step = 0
        released: list[Any] = [None] * len(objects)
        del objects
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return released

    def clear(self, *objects: Any) -> list[Any]:
        """Alias of :meth:`free_memory`."""
        return self.free_memory(*objects)

    def end_training(self) -> None:
        """Finish every tracker (on the ranks that run it), then wait for every rank.

        Unlike Accelerate's, it does not destroy the process group: the launcher owns it
        (and a session keeps it for the next cell).
        """
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.wait_for_everyone()

    def init_trackers(
        self,
        project_name: str,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Start a run named ``project_name`` in every tracker of ``log_with`` (on the main
        process), recording ``config`` as its hyperparameters; ``init_kwargs`` maps a tracker
        name to keyword arguments for its constructor.

        Example::

            accelerator = Accelerator(log_with="tensorboard", project_dir="runs")
            accelerator.init_trackers("run1", config={"lr": 1e-3},
                                      init_kwargs={"tensorboard": {"flush_secs": 5}})
        """
        if not self.is_main_process:
            return
        from .trackers import LOGGER_TYPE_TO_CLASS

        init_kwargs = init_kwargs or {}
        for tracker in self.log_with:
            if isinstance(tracker, GeneralTracker):
                self.trackers.append(tracker)
                continue
            cls = LOGGER_TYPE_TO_CLASS[str(tracker)]
            kwargs = init_kwargs.get(str(tracker), {})
            if cls.requires_logging_directory:
                self.trackers.append(cls(project_name, self.logging_dir, **kwargs))  # type: ignore[call-arg,arg-type]
            else:
                self.trackers.append(cls(project_name, **kwargs))  # type: ignore[arg-type]
        for started in self.trackers:
            started.start()
        if config is not None:
            for started in self.trackers:
                started.store_init_configuration(config)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (its underlying run object with ``unwrap=True``).

        On a rank that runs no tracker (not the main process) it returns a tracker that does
        nothing, so the same code runs on every rank. Raises ``ValueError`` for a name that
        is not among the started trackers.

        Example::

            writer = accelerator.get_tracker("tensorboard", unwrap=True)   # a SummaryWriter
        """
        if self.trackers:
            for tracker in self.trackers:
                if tracker.name == name:
                    return tracker.tracker if unwrap else tracker  # type: ignore[attr-defined]
            raise ValueError(f"{name} is not an available tracker stored inside the `Accelerator`.")
        return GeneralTracker(_blank=True)

    def log(
        self,
        values: dict[str, Any],
        step: int | None = None,
        log_kwargs: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        """Log ``values`` at ``step``: to the trackers (main process; ``log_kwargs`` maps a
        tracker name to extra keyword arguments for its ``log``), and every rank's numbers to
        the dashboard's live plot.

        Example::

            accelerator.log({"loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=step)
        """
        from .tracking import log

        log(values, step=step)
        if not self.is_main_process:
            return
        log_kwargs = log_kwargs or {}
        for tracker in self.trackers:
            tracker.log(values, step=step, **log_kwargs.get(tracker.name, {}))

    @contextlib.contextmanager
    def profile(self, profile_handler: ProfileKwargs | None = None) -> Iterator[Any]:
        """Profile the block with ``torch.profiler`` (settings: ``profile_handler``, else the
        ``ProfileKwargs`` of ``kwargs_handlers``); yields the profiler. With
        ``output_trace_dir`` each rank also writes its Chrome trace there, as
        ``trace_rank{process_index}.json``.

        Example::

            with accelerator.profile() as prof:
                train_step()
            accelerator.print(prof.key_averages().table(row_limit=10))
        """
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir is None:
            return
        os.makedirs(handler.output_trace_dir, exist_ok=True)
        profiler.export_chrome_trace(
            os.path.join(handler.output_trace_dir, f"trace_rank{self.process_index}.json")
        )
        self.wait_for_everyone()

    def __repr__(self) -> str:
        return (
            f"Accelerator(device={self.device}, num_processes={self.num_processes}, "
            f"mixed_precision={self.mixed_precision!r}, "
            f"gradient_accumulation_steps={self.gradient_accumulation_steps})"
        )


# ---------------------------------------------------------------------------- helpers


def _listed_by_rank(values: list[str]) -> str:
    return ", ".join(f"rank {i}: {v}" for i, v in enumerate(values))


class _Handle:
    def __init__(self, hooks: list[Callable[..., Any]], hook: Callable[..., Any]) -> None:
        self._hooks = hooks
        self._hook = hook

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


def _is_scheduler(obj: Any) -> bool:
    lr_scheduler = torch.optim.lr_scheduler
    classes: tuple[type, ...] = (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau)
    return isinstance(obj, classes)


def _all_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, dict):
        return all(_all_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return all(_all_tensors(v) for v in data)
    return False


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return type(data)({k: _map_tensors(fn, v) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_map_tensors(fn, v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(_map_tensors(fn, v) for v in data)
    return data


def _registered_again(obj: Any, registry: list[Any]) -> bool:
    """``obj`` was prepared already (a second prepare, find_executable_batch_size's retry):
    True, and it is registered once -- not wrapped again (save_state would write it twice)."""
    if not getattr(obj, "_is_accelerate_prepared", False):
        return False
    if not any(item is obj for item in registry):
        registry.append(obj)
    return True


__all__ = ["AcceleratedOptimizer", "AcceleratedScheduler", "Accelerator"]
