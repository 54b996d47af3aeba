"""``AcceleratedScheduler``: a learning-rate scheduler that steps only after real optimizer steps.

Lives here, as in Accelerate (``accelerate.scheduler``); ``notebook_launcher.accelerator``
re-exports it for code that imported it from there.

Example::

    from notebook_launcher.scheduler import AcceleratedScheduler
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.StepLR(optimizer, step_size=10))
    assert isinstance(scheduler, AcceleratedScheduler)
"""

from __future__ import annotations

from typing import Any

from .state import AcceleratorState, GradientState


class AcceleratedScheduler:
    """A learning-rate scheduler that steps only after a real optimizer step.

    On non-sync steps of gradient accumulation it does not step (with ``adjust_scheduler`` it
    bumps the step counter so torch does not warn); after a step the GradScaler skipped it does
    not step either. Without ``split_batches`` it steps ``num_processes`` times per optimizer
    step, like Accelerate: a schedule written for one process over the whole dataset then
    ends at the same point when ``n`` ranks each see ``1/n`` of the batches.

    Example::

        scheduler = accelerator.prepare(OneCycleLR(optimizer, max_lr=0.1, total_steps=1000))
        scheduler.step()   # after optimizer.step(), every batch
    """

    def __init__(
        self,
        scheduler: Any,
        optimizers: Any,
        step_with_optimizer: bool = True,
        split_batches: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
        self.split_batches = split_batches
        self.step_with_optimizer = step_with_optimizer
        self.gradient_state = GradientState()

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler and hasattr(self.scheduler, "_step_count"):
                self.scheduler._step_count += 1
            return
        for opt in self.optimizers:
            if getattr(opt, "step_was_skipped", False):
                return
        if self.split_batches:
            self.scheduler.step(*args, **kwargs)
            return
        for _ in range(AcceleratorState().num_processes):
            total = getattr(self.scheduler, "total_steps", None)
            if total is not None and self.scheduler._step_count > total:
                break
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> Any:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> Any:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self) -> Any:
        return self.scheduler.get_lr()

    def print_lr(self, *args: Any, **kwargs: Any) -> Any:
        return self.scheduler.print_lr(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)


__all__ = ["AcceleratedScheduler"]
