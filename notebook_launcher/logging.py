"""``get_logger``: a logger that knows about ranks (Accelerate's ``accelerate.logging``).

Each message is prefixed with ``[RANK n]``; by default only the main process logs it
(``main_process_only=False`` logs on every rank, ``in_order=True`` on every rank one after the
other). Records keep the caller's file, line and function, as a plain logger's do, and a
``stacklevel`` you pass is honoured. It needs the state: create an ``Accelerator`` or
``PartialState`` before the first message.

Example (in the launched function)::

    from notebook_launcher.logging import get_logger

    logger = get_logger(__name__)
    accelerator = Accelerator()
    logger.info("starting")                          # once, from rank 0
    logger.info("my shard is ready", main_process_only=False)
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import MutableMapping
from typing import Any

from .state import PartialState


class MultiProcessAdapter(logging.LoggerAdapter):
    """A ``LoggerAdapter`` whose calls take ``main_process_only`` (default True) and
    ``in_order`` (default False) keyword arguments."""

    @staticmethod
    def _should_log(main_process_only: bool) -> bool:
        return not main_process_only or PartialState().is_main_process

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        msg, kwargs = super().process(msg, kwargs)
        kwargs.setdefault("stacklevel", 2)  # the caller's frame, not this module's
        return f"[RANK {PartialState().process_index}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        if not PartialState._shared_state:
            raise RuntimeError(
                "You must initialize the accelerate state by calling either `PartialState()` or "
                "`Accelerator()` before using the logging utility."
            )
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        msg, kwargs = self.process(msg, kwargs)
        if in_order:
            state = PartialState()
            for index in range(state.num_processes):
                if index == state.process_index:
                    self.logger.log(level, msg, *args, **kwargs)
                state.wait_for_everyone()
        elif self._should_log(main_process_only):
            self.logger.log(level, msg, *args, **kwargs)

    @functools.lru_cache(None)  # noqa: B019 - the adapters live as long as their loggers
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """``warning()``, once per distinct arguments."""
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """A rank-aware logger for ``name`` (see the module docstring). ``log_level`` (or env
    ``ACCELERATE_LOG_LEVEL``) sets the level of this logger and of the root logger.

    Example: ``logger = get_logger(__name__, log_level="INFO")``.
    """
    if log_level is None:
        log_level = os.environ.get("ACCELERATE_LOG_LEVEL")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logging.getLogger().setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})


__all__ = ["MultiProcessAdapter", "get_logger"]
