"""Accelerate's ``accelerate.launchers``: :func:`notebook_launcher` and :func:`debug_launcher`.

``debug_launcher`` is a launch on CPU ranks in debug mode (every collective checks that the
ranks agree on shapes first), for trying distributed code on a machine without GPUs.

Example::

    from notebook_launcher.launchers import debug_launcher

    debug_launcher(train, num_processes=2)   # 2 CPU ranks over gloo, checked collectives
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .launcher import notebook_launcher
from .utils.environment import patch_environment


def debug_launcher(
    function: Callable[..., Any], args: tuple[Any, ...] = (), num_processes: int = 2
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` CPU ranks in debug mode; returns every
    rank's result (index = rank), or raises what the failing rank raised, as
    :func:`notebook_launcher` does. CUDA is hidden from the ranks (``CUDA_VISIBLE_DEVICES=""``)
    unless the kernel has initialised it already, in which case the ranks use it. A state the
    caller created (``PartialState``, ``Accelerator``) is set aside during the launch and
    restored after it; a process group in the caller is refused, as by
    :func:`notebook_launcher`.
    """
    from .state import AcceleratorState, GradientState, PartialState

    # A debugging tool, CPU only: a single-process state the caller made (a test's
    # Accelerator()) is set aside for the launch (notebook_launcher refuses to copy one into
    # the ranks) and given back afterwards.
    saved = [
        (cls, dict(cls._shared_state)) for cls in (PartialState, AcceleratorState, GradientState)
    ]
    for cls, _ in saved:
        cls._shared_state.clear()
    try:
        with patch_environment(
            accelerate_use_cpu="yes", accelerate_debug_mode="yes", cuda_visible_devices=""
        ):
            return notebook_launcher(
                function, args=args, num_processes=num_processes, use_port="auto"
            )
    finally:
        for cls, state in saved:
            cls._shared_state.clear()
            cls._shared_state.update(state)


__all__ = ["debug_launcher", "notebook_launcher"]
