"""Raw ``torch.distributed`` collectives, made visible like ``wait_for_everyone``.

In a session a cell may run on some ranks only; a collective there waits for ranks that
will never come. The kernel can tell, and stop it at once, if it hears about the wait:
:func:`install` wraps the blocking collectives of ``torch.distributed`` on the default
group with :func:`notebook_launcher._worker.barriers.barrier`, which reports a call that
lasts longer than its quiet period (50 ms) with the user's call site. A call costs the
wrapper about a microsecond; asynchronous calls (``async_op=True``) and calls on a
subgroup are passed straight through.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from . import barriers

#: The blocking collectives that need every rank of the default group.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "monitored_barrier",
)

_originals: dict[str, Callable[..., Any]] = {}


def _position(function: Callable[..., Any], name: str) -> int:
    try:
        return list(inspect.signature(function).parameters).index(name)
    except (ValueError, TypeError):
        return -1


def _wrap(name: str, original: Callable[..., Any], rank: int, quiet: float) -> Callable[..., Any]:
    at_group, at_async = _position(original, "group"), _position(original, "async_op")

    def argument(args: tuple[Any, ...], kwargs: dict[str, Any], key: str, at: int) -> Any:
        if key in kwargs:
            return kwargs[key]
        return args[at] if 0 <= at < len(args) else None

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        group = argument(args, kwargs, "group", at_group)
        if argument(args, kwargs, "async_op", at_async) or (
            group is not None and group is not _world()
        ):
            return original(*args, **kwargs)
        return barriers.barrier(lambda: original(*args, **kwargs), rank, name, quiet)

    collective.__notebook_launcher_wrapped__ = original  # type: ignore[attr-defined]
    return collective


def _world() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD


def install(rank: int, quiet: float = barriers.DEFAULT_QUIET) -> None:
    """Wrap the collectives of ``torch.distributed`` (idempotent)."""
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None or name in _originals:
            continue
        _originals[name] = original
        setattr(dist, name, _wrap(name, original, rank, quiet))


def uninstall() -> None:
    import torch.distributed as dist

    for name, original in _originals.items():
        setattr(dist, name, original)
    _originals.clear()


__all__ = ["COLLECTIVES", "install", "uninstall"]
