"""Collective operations on nested data, with Accelerate's names and semantics.

Every function takes a tensor or a nested ``list``/``tuple``/``dict`` of tensors (namedtuples
and dict subclasses keep their type) and works the same in a single process (where it is
a no-op or a local copy) and across ranks. Non-contiguous tensors are accepted.

Shape safety (why a mismatch never hangs the notebook): with gloo, an ``all_gather`` or
``all_reduce`` whose ranks disagree on shapes aborts the receiving process from C++
(``SIGABRT``, "Received data size doesn't match expected size") while the other rank goes
on with garbage; a mismatched ``broadcast`` silently corrupts the receivers; with nccl a
mismatch can hang. So before :func:`gather`, :func:`reduce`, :func:`broadcast` and
:func:`broadcast_object_list` the ranks exchange one fixed-size 64-bit digest of the call
(operation name, structure, shapes, dtypes). Equal digests cost one tiny collective; a
difference makes every rank exchange the full descriptions and raise
:class:`~notebook_launcher.errors.DistributedOperationException` naming each rank's shapes.
:func:`pad_across_processes` checks the number of dimensions inside the size exchange it
needs anyway. Set ``NOTEBOOK_LAUNCHER_CHECK_COLLECTIVES=0`` to skip the digest (on CUDA
the digest comparison also synchronises the host with the device, like ``.item()``).

Debug mode (``PartialState().debug``: env ``NOTEBOOK_LAUNCHER_DEBUG`` or
``ACCELERATE_DEBUG_MODE`` set to ``1``/``true``) exchanges the full description before
*every* collective here, ``gather_object`` included, even when the digest is switched off.

Example::

    from notebook_launcher.utils import gather, reduce

    preds = gather(model(x).argmax(-1))          # every rank's predictions, concatenated
    loss = reduce(loss.detach(), reduction="mean")
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import state as _state
from ..errors import DistributedOperationException

# torch >= 2.10 renamed all_gather_into_tensor (which now warns) to all_gather_single.
_all_gather_single: Callable[..., Any] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)

#: Longest shape :func:`pad_across_processes` exchanges (torch allows at most 64 dims).
_MAX_DIMS = 64


# --------------------------------------------------------------------------------------------
# Nested-structure helpers
# --------------------------------------------------------------------------------------------


def is_torch_tensor(tensor: Any) -> bool:
    """``isinstance(tensor, torch.Tensor)``."""
    return isinstance(tensor, torch.Tensor)


def is_namedtuple(data: Any) -> bool:
    """True for instances of ``collections.namedtuple`` / ``typing.NamedTuple`` classes."""
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj: Any, generator: Any) -> Any:
    """Build an object of ``type(obj)`` (list, tuple, namedtuple...) from ``generator``."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def _rebuild_mapping(data: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    if type(data) is dict:
        return items
    try:
        return type(data)(items)  # type: ignore[call-arg]
    except Exception:  # noqa: BLE001 - a mapping type we cannot rebuild becomes a dict
        return items


def recursively_apply(
    func: Callable[..., Any],
    data: Any,
    *args: Any,
    test_type: Callable[[Any], bool] = is_torch_tensor,
    error_on_other_type: bool = False,
    **kwargs: Any,
) -> Any:
    """Apply ``func(leaf, *args, **kwargs)`` to every leaf passing ``test_type`` in ``data``.

    Lists, tuples (namedtuples too) and mappings are rebuilt with their own type; other
    leaves are returned unchanged, or raise ``TypeError`` with ``error_on_other_type``.

    Example::

        recursively_apply(lambda t: t * 2, {"a": torch.ones(2), "b": [torch.zeros(1)]})
    """
    if isinstance(data, (tuple, list)):
        return honor_type(
            data,
            (
                recursively_apply(
                    func,
                    o,
                    *args,
                    test_type=test_type,
                    error_on_other_type=error_on_other_type,
                    **kwargs,
                )
                for o in data
            ),
        )
    if isinstance(data, Mapping):
        return _rebuild_mapping(
            data,
            {
                k: recursively_apply(
                    func,
                    v,
                    *args,
                    test_type=test_type,
                    error_on_other_type=error_on_other_type,
                    **kwargs,
                )
                for k, v in data.items()
            },
        )
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        raise TypeError(
            f"Unsupported type {type(data).__name__!r} passed to {getattr(func, '__name__', func)}:"
            " only tensors in nested lists/tuples/dicts are accepted."
        )
    return data


def _leaves(data: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    recursively_apply(found.append, data)
    return found


def listify(data: Any) -> Any:
    """Turn every tensor of a nested structure into (nested) Python lists / numbers."""
    return recursively_apply(lambda t: t.tolist(), data)


def find_batch_size(data: Any) -> int | None:
    """The size of the first dimension of the first tensor found in ``data`` (or ``None``)."""
    if isinstance(data, (tuple, list)):
        for d in data:
            size = find_batch_size(d)
            if size is not None:
                return size
        return None
    if isinstance(data, Mapping):
        for v in data.values():
            size = find_batch_size(v)
            if size is not None:
                return size
        return None
    if isinstance(data, torch.Tensor):
        return int(data.shape[0]) if data.ndim > 0 else None
    return None


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor found in ``data`` (or ``None``)."""
    leaves = _leaves(data)
    return leaves[0].device if leaves else None


def slice_tensors(data: Any, tensor_slice: slice | int, process_index: Any = None) -> Any:
    """``t[tensor_slice]`` for every tensor of a nested structure."""
    return recursively_apply(lambda t: t[tensor_slice], data)


def send_to_device(
    tensor: Any,
    device: torch.device | str | int,
    non_blocking: bool = False,
    skip_keys: str | Sequence[str] | None = None,
) -> Any:
    """Move every tensor (and every object with a ``.to`` method) of ``tensor`` to ``device``.

    Args:
        skip_keys: keys of dicts whose values stay where they are.

    Example::

        batch = send_to_device(batch, PartialState().device)
    """
    if isinstance(skip_keys, str):
        skip_keys = [skip_keys]
    skip = set(skip_keys or ())
    if isinstance(tensor, (tuple, list)):
        return honor_type(
            tensor, (send_to_device(t, device, non_blocking, skip_keys) for t in tensor)
        )
    if isinstance(tensor, Mapping):
        return _rebuild_mapping(
            tensor,
            {
                k: v if k in skip else send_to_device(v, device, non_blocking, skip_keys)
                for k, v in tensor.items()
            },
        )
    if isinstance(tensor, torch.Tensor):
        if isinstance(device, str) and device == "npu":
            device = "npu:0"
        return tensor.to(device, non_blocking=non_blocking)
    to = getattr(tensor, "to", None)
    if callable(to) and not isinstance(tensor, type):
        try:
            return to(device, non_blocking=non_blocking)
        except TypeError:
            return to(device)
    return tensor


# --------------------------------------------------------------------------------------------
# Cross-rank agreement checks
# --------------------------------------------------------------------------------------------


def _describe(data: Any) -> Any:
    """A picklable, printable description of ``data``'s structure: shapes and dtypes."""

    def leaf(t: torch.Tensor) -> str:
        return f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"

    return recursively_apply(leaf, data)


def _format_description(desc: Any) -> str:
    if isinstance(desc, str):
        return desc
    return repr(desc).replace("'", "")


def _checks_enabled() -> bool:
    value = os.environ.get("NOTEBOOK_LAUNCHER_CHECK_COLLECTIVES", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def _digest(item: Any) -> int:
    raw = hashlib.blake2b(repr(item).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def _all_gather_objects(obj: Any, num: int) -> list[Any]:
    out: list[Any] = [None] * num
    dist.all_gather_object(out, obj)
    return out


def _raise_mismatch(op: str, descriptions: list[Any], what: str = "shapes") -> None:
    ops = [d[0] for d in descriptions]
    if len(set(ops)) == 1:
        headline = (
            f"Cannot apply {op} because the ranks disagree on its inputs: all {what} across "
            "processes must match (pad_across_processes() evens out tensor lengths)."
        )
    else:
        headline = "The ranks called different collective operations at the same point: " + (
            ", ".join(f"process {i}: {o}" for i, o in enumerate(ops))
        )
    lines = [headline, "", f"Operation: `notebook_launcher.utils.operations.{op}`"]
    lines.append("Input shapes:" if what == "shapes" else f"Inputs ({what}):")
    lines += [f"  - Process {i}: {_format_description(d[1])}" for i, d in enumerate(descriptions)]
    raise DistributedOperationException("\n".join(lines))


def _verify(
    op: str, description: Any, *, key: Any = None, always: bool = True, what: str = "shapes"
) -> None:
    """Make sure every rank calls ``op`` with matching inputs before the collective runs.

    Ranks must agree on ``key`` (default: ``description``); a mismatch raises
    :class:`DistributedOperationException` on every rank, listing each rank's
    ``description``. ``always``: run the cheap digest check outside debug mode too (for
    ops where a mismatch would abort, corrupt or hang); debug mode exchanges the full
    descriptions every time.
    """
    ps = _state.PartialState()
    if not ps.use_distributed:
        return
    item = (op, description)
    mine_key = (op, description if key is None else key)
    if ps.debug:
        everything = _all_gather_objects((mine_key, item), ps.num_processes)
        if any(k != mine_key for k, _ in everything):
            _raise_mismatch(op, [i for _, i in everything], what)
        return
    if not (always and _checks_enabled()):
        return
    mine = torch.tensor([_digest(mine_key)], dtype=torch.int64, device=ps.device)
    everyone = torch.empty(ps.num_processes, dtype=torch.int64, device=ps.device)
    _all_gather_single(everyone, mine)
    if bool((everyone == mine).all()):
        return
    _raise_mismatch(op, _all_gather_objects(item, ps.num_processes), what)


# --------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------


def _for_wire(t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
    """A contiguous, detached tensor the backend can send; bools travel as uint8."""
    t = t.detach()
    if t.dtype == torch.bool:
        return t.to(torch.uint8).contiguous(), torch.bool
    return t.contiguous(), None


def _gather_one(tensor: torch.Tensor, num: int) -> torch.Tensor:
    if tensor.ndim == 0:
        tensor = tensor.reshape(1)
    wire, orig = _for_wire(tensor)
    out = torch.empty((num * wire.shape[0], *wire.shape[1:]), dtype=wire.dtype, device=wire.device)
    _all_gather_single(out, wire)
    return out.to(orig) if orig is not None else out


def gather(tensor: Any) -> Any:
    """Concatenate (along dim 0) each tensor of ``tensor`` from every process.

    All ranks must pass the same structure and shapes (else
    :class:`DistributedOperationException` on every rank); 0-dim tensors become one row per
    process. In a single process the input is returned unchanged.

    Example::

        gather(torch.tensor([state.process_index]))   # 2 ranks: tensor([0, 1])
    """
    ps = _state.PartialState()
    if not ps.use_distributed:
        return recursively_apply(lambda t: t, tensor, error_on_other_type=True)
    recursively_apply(lambda t: t, tensor, error_on_other_type=True)
    _verify("gather", _describe(tensor))
    return recursively_apply(_gather_one, tensor, ps.num_processes)


def gather_object(object: Any) -> list[Any]:
    """Gather picklable objects from every process.

    A list or tuple from each rank gives one flat list (rank 0's items first); any other
    object gives ``[object_of_rank_0, object_of_rank_1, ...]``. In a single process:
    ``list(object)`` for a list/tuple, else ``[object]``.

    Example::

        gather_object([f"rank {state.process_index}"])   # ["rank 0", "rank 1"]
    """
    ps = _state.PartialState()
    flatten = isinstance(object, (list, tuple))
    if not ps.use_distributed:
        return list(object) if flatten else [object]
    _verify("gather_object", "list" if flatten else "object", always=False, what="kinds")
    gathered = _all_gather_objects(object, ps.num_processes)
    if flatten:
        return [x for part in gathered for x in part]
    return gathered


def _broadcast_one(tensor: torch.Tensor, src: int) -> torch.Tensor:
    wire, orig = _for_wire(tensor)
    if wire.data_ptr() == tensor.data_ptr() and orig is None and tensor.is_contiguous():
        dist.broadcast(tensor.detach(), src=src)
        return tensor
    dist.broadcast(wire, src=src)
    with torch.no_grad():
        tensor.copy_(wire.to(orig) if orig is not None else wire)
    return tensor


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Copy every tensor of ``tensor`` from process ``from_process`` into the others, in place.

    Receivers must hold tensors of the same shapes and dtypes. Returns ``tensor``.

    Example::

        weights = broadcast(weights)    # everybody now has rank 0's values
    """
    ps = _state.PartialState()
    _check_src(from_process, ps.num_processes)
    recursively_apply(lambda t: t, tensor, error_on_other_type=True)
    if not ps.use_distributed:
        return tensor
    _verify("broadcast", (_describe(tensor), from_process))
    return recursively_apply(_broadcast_one, tensor, from_process)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace the items of ``object_list`` (in place) by those of process ``from_process``.

    Every rank must pass a list of the same length. Returns ``object_list``.

    Example::

        cfg = [config if state.is_main_process else None]
        broadcast_object_list(cfg)      # cfg[0] is rank 0's config everywhere
    """
    ps = _state.PartialState()
    _check_src(from_process, ps.num_processes)
    if not ps.use_distributed:
        return object_list
    _verify("broadcast_object_list", (len(object_list), from_process), what="list lengths")
    device = ps.device if ps.device.type == "cuda" else None
    dist.broadcast_object_list(object_list, src=from_process, device=device)
    return object_list


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Send the tensor that one process holds to every process; the others pass ``None``.

    Unlike :func:`broadcast`, the receivers need not know its shape or dtype. Any one process
    may hold it (not only the main one); none or several holding a tensor raises
    ``ValueError`` on every rank (Accelerate sums them silently). Returns a tensor on
    ``PartialState().device`` everywhere.

    Example::

        weights = torch.randn(3) if state.is_main_process else None
        weights = copy_tensor_to_devices(weights)   # rank 0's values on every rank
    """
    ps = _state.PartialState()
    if tensor is not None and not isinstance(tensor, torch.Tensor):
        raise TypeError(f"copy_tensor_to_devices sends a tensor or None, got {type(tensor)}")
    if not ps.use_distributed:
        if tensor is None:
            raise ValueError("copy_tensor_to_devices: no process holds a tensor (got None)")
        return tensor.to(ps.device)
    mine = None if tensor is None else (tuple(tensor.shape), tensor.dtype)
    everyone = _all_gather_objects(mine, ps.num_processes)
    holders = [i for i, info in enumerate(everyone) if info is not None]
    if len(holders) != 1:
        raise ValueError(
            "copy_tensor_to_devices needs exactly one process holding a tensor and None on "
            f"the others; processes {holders or 'none'} hold one"
        )
    shape, dtype = everyone[holders[0]]
    if tensor is None:
        out = torch.empty(shape, dtype=dtype, device=ps.device)
    else:
        out = tensor.detach().to(ps.device).clone()
    return _broadcast_one(out, holders[0])


def _check_src(src: int, num: int) -> None:
    if not isinstance(src, int) or not 0 <= src < num:
        raise ValueError(f"from_process must be a process index in [0, {num}), got {src!r}")


_REDUCTIONS = ("mean", "sum", "max", "min", "none")


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Reduce each tensor of ``tensor`` across processes: ``"mean"``, ``"sum"``, ``"max"``,
    ``"min"`` or ``"none"`` (a local copy). Returns new tensors, multiplied by ``scale``.

    ``"mean"`` of an integer or bool tensor raises ``TypeError`` (the mean is fractional).

    Example::

        reduce(torch.tensor([state.process_index + 1.0]), "sum")   # 2 ranks: tensor([3.])
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    leaves = _leaves(recursively_apply(lambda t: t, tensor, error_on_other_type=True))
    if reduction == "mean":
        for t in leaves:
            if not (t.is_floating_point() or t.is_complex()):
                raise TypeError(
                    f"reduce(..., reduction='mean') needs floating-point tensors, got one of "
                    f"dtype {t.dtype}: the mean of integers is fractional. Use "
                    "reduction='sum' and divide, or pass tensor.float()."
                )
    ps = _state.PartialState()
    distributed = ps.use_distributed and reduction != "none"
    if distributed:
        _verify("reduce", (_describe(tensor), reduction))
    op = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}.get(reduction, dist.ReduceOp.SUM)

    def one(t: torch.Tensor) -> torch.Tensor:
        out, orig = _for_wire(t)
        out = out.clone(memory_format=torch.contiguous_format)
        if distributed:
            dist.all_reduce(out, op=op)
            if reduction == "mean":
                out /= ps.num_processes
        if orig is not None:
            out = out.to(orig)
        if scale != 1.0:
            out = out * scale
        return out

    return recursively_apply(one, tensor)


def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False
) -> Any:
    """Pad each tensor along ``dim`` to the largest size any process has, with ``pad_index``.

    Use it before :func:`gather` on tensors of different lengths. ``pad_first`` pads at the
    start instead of the end. Tensors with fewer than ``dim + 1`` dimensions are returned
    unchanged. All ranks must pass tensors of the same number of dimensions.

    Example::

        padded = pad_across_processes(torch.ones(1 + state.process_index), pad_index=-1)
        gather(padded)   # 2 ranks: tensor([ 1., -1.,  1.,  1.])
    """
    ps = _state.PartialState()

    def one(t: torch.Tensor) -> torch.Tensor:
        if ps.use_distributed:
            if t.ndim > _MAX_DIMS:
                raise ValueError(f"pad_across_processes supports up to {_MAX_DIMS} dims")
            if ps.debug:
                _verify("pad_across_processes", _describe(t), key=(t.ndim, t.dtype))
            info = torch.full((_MAX_DIMS + 1,), -1, dtype=torch.int64, device=ps.device)
            info[0] = t.ndim
            if t.ndim:
                info[1 : t.ndim + 1] = torch.tensor(t.shape, dtype=torch.int64)
            every = torch.empty((ps.num_processes, _MAX_DIMS + 1), dtype=torch.int64)
            every = every.to(ps.device)
            _all_gather_single(every, info[None])
            every = every.cpu()
            ndims = every[:, 0].tolist()
            if len(set(ndims)) > 1:
                shapes = [row[1 : row[0] + 1].tolist() for row in every]
                _raise_mismatch(
                    "pad_across_processes",
                    [("pad_across_processes", s) for s in shapes],
                    "numbers of dimensions",
                )
        d = dim + t.ndim if dim < 0 else dim
        if t.ndim == 0 or not 0 <= d < t.ndim:
            return t
        if not ps.use_distributed:
            return t
        max_size = int(every[:, d + 1].max())
        if max_size == t.shape[d]:
            return t
        new_shape = list(t.shape)
        new_shape[d] = max_size
        out = t.new_full(new_shape, pad_index)
        index = [slice(None)] * t.ndim
        index[d] = slice(max_size - t.shape[d], max_size) if pad_first else slice(0, t.shape[d])
        out[tuple(index)] = t
        return out

    return recursively_apply(one, tensor, error_on_other_type=True)


def concatenate(data: Sequence[Any], dim: int = 0) -> Any:
    """Concatenate a list of same-structured nested tensors, leaf by leaf, along ``dim``.

    Example::

        concatenate([{"x": torch.ones(1)}, {"x": torch.zeros(2)}])   # {"x": tensor([1., 0., 0.])}
    """
    if len(data) == 0:
        raise ValueError("concatenate needs at least one element")
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(
            first, (concatenate([d[i] for d in data], dim) for i in range(len(first)))
        )
    if isinstance(first, Mapping):
        return _rebuild_mapping(first, {k: concatenate([d[k] for d in data], dim) for k in first})
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"concatenate joins tensors, got {type(first).__name__}")
    return torch.cat(list(data), dim=dim)


def wait_for_everyone() -> None:
    """``PartialState().wait_for_everyone()``: block until every process gets here."""
    _state.PartialState().wait_for_everyone()


__all__ = [
    "DistributedOperationException",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "copy_tensor_to_devices",
    "find_batch_size",
    "find_device",
    "gather",
    "gather_object",
    "honor_type",
    "is_namedtuple",
    "is_torch_tensor",
    "listify",
    "pad_across_processes",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "slice_tensors",
    "wait_for_everyone",
]
