"""``AcceleratedOptimizer``: an optimizer that steps only when gradients are synced.

Lives here, as in Accelerate (``accelerate.optimizer``); ``notebook_launcher.accelerator`` re-exports
it for code that imported it from there.

Example::

    from notebook_launcher.optimizer import AcceleratedOptimizer
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(optimizer, AcceleratedOptimizer)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .state import GradientState


class AcceleratedOptimizer(torch.optim.Optimizer):
    """An optimizer that steps (and zeroes gradients) only when gradients are synced.

    Under fp16 it steps through the ``GradScaler`` and records in ``step_was_skipped`` whether
    the scaler skipped the step (inf/NaN gradients). Everything else is the wrapped optimizer's:
    ``param_groups``, ``state``, ``defaults``, ``state_dict``...

    Example::

        optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        optimizer.step()   # a no-op on the non-sync steps of gradient accumulation
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        device_placement: bool = True,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        # Deliberately no super().__init__: this object is a view of ``optimizer``.
        self.optimizer = optimizer
        self.scaler = scaler
        self.gradient_state = GradientState()
        self.device_placement = device_placement
        #: bool, or (scale after, scale before) of the last step, compared when asked
        self._is_overflow: bool | tuple[torch.Tensor, torch.Tensor] = False
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks
        if device_placement and optimizer.state:
            # state made before the model moved (e.g. loaded on the CPU): load_state_dict
            # casts every state tensor to its parameter's device
            optimizer.load_state_dict(optimizer.state_dict())

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        if not self.gradient_state.sync_gradients:
            return None
        if self.scaler is None:
            self._is_overflow = False
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        # The scale before and after, kept as tensors: reading them (get_scale) waits for
        # the GPU, twice a step; whether the step was skipped is asked when someone asks.
        before = self._scale_tensor()
        result = (
            self.scaler.step(self.optimizer, closure)
            if closure
            else self.scaler.step(self.optimizer)
        )
        self.scaler.update()
        after = self._scale_tensor()
        if before is None or after is None:
            self._is_overflow = False
        else:
            self._is_overflow = (after, before)
        return result

    def _scale_tensor(self) -> Any:
        scale = getattr(self.scaler, "_scale", None)
        if not isinstance(scale, torch.Tensor):  # before its first step, or another scaler
            value = self.scaler.get_scale() if self.scaler is not None else None
            return None if value is None else torch.tensor(float(value))
        return scale.detach().clone()

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step`` was skipped by the GradScaler (inf/NaN gradients)."""
        return self.is_overflow

    @property
    def is_overflow(self) -> bool:
        pending = self._is_overflow
        if isinstance(pending, tuple):  # compared now, once
            after, before = pending
            self._is_overflow = bool((after.cpu() < before.cpu()).item())
        return bool(self._is_overflow)

    def train(self) -> None:
        if hasattr(self.optimizer, "train"):
            self.optimizer.train()

    def eval(self) -> None:
        if hasattr(self.optimizer, "eval"):
            self.optimizer.eval()

    def __getattr__(self, name: str) -> Any:
        # Only for names not found on the wrapper: the wrapped optimizer's own extras
        # (custom attributes, torch's hook registries...).
        if name.startswith("__") or name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "gradient_state"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.gradient_state = GradientState()

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


__all__ = ["AcceleratedOptimizer"]
