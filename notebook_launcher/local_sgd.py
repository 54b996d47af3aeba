"""Local SGD (Accelerate's ``accelerate.local_sgd.LocalSGD``): ranks train on their own and
average their parameters every ``local_sgd_steps`` optimizer steps, instead of averaging
gradients at every step.

Inside the ``with`` block the DDP model does not all-reduce gradients (``no_sync``); each
``local_sgd.step()`` counts an optimizer step and every ``local_sgd_steps``-th one averages
the parameters across ranks; leaving the block averages once more. One process: a no-op.

Example (in the launched function)::

    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            local_sgd.step()
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

import torch

from .state import DistributedType

_SUPPORTED = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class LocalSGD:
    """Average the parameters of ``model`` every ``local_sgd_steps`` steps (see the module
    docstring). ``enabled=False`` (or a single process) makes it a no-op."""

    def __init__(
        self,
        accelerator: Any,
        model: torch.nn.Module,
        local_sgd_steps: int,
        enabled: bool = True,
    ) -> None:
        if accelerator.distributed_type not in _SUPPORTED:
            raise NotImplementedError(
                "LocalSGD is supported only for CPUs and GPUs (no DeepSpeed or MegatronLM); "
                f"this run is {accelerator.distributed_type}"
            )
        if int(local_sgd_steps) < 1:
            raise ValueError(f"local_sgd_steps must be at least 1, got {local_sgd_steps}")
        self.enabled = bool(enabled) and accelerator.use_distributed
        self.num_steps = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = int(local_sgd_steps)
        self._no_sync: contextlib.AbstractContextManager[Any] | None = None

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            no_sync = getattr(self.model, "no_sync", None)
            if no_sync is None:
                raise TypeError(
                    "LocalSGD needs the model returned by accelerator.prepare (a DDP model with "
                    f"no_sync()); got a {type(self.model).__name__}"
                )
            self._no_sync = no_sync()
            self._no_sync.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.enabled:
            return
        try:
            if exc_type is None:  # a rank that failed must not wait for the others here
                self._sync_and_avg_model_params()
        finally:
            assert self._no_sync is not None
            self._no_sync.__exit__(exc_type, exc, tb)

    def step(self) -> None:
        """Count one optimizer step; average the parameters every ``local_sgd_steps``."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_avg_model_params()

    @torch.no_grad()
    def _sync_and_avg_model_params(self) -> None:
        """Replace every parameter by its mean over the ranks: one collective per dtype."""
        from .utils.operations import reduce

        self.accelerator.wait_for_everyone()
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for param in self.model.parameters():
            groups.setdefault((param.dtype, param.device), []).append(param.data)
        for tensors in groups.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            mean = reduce(flat, reduction="mean")
            offset = 0
            for t in tensors:
                t.copy_(mean[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


__all__ = ["LocalSGD"]
