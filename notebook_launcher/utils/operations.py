"""Collective operations on nested data, with Accelerate's names and semantics.

Every function takes a tensor or a nested ``list``/``tuple``/``dict`` of tensors (namedtuples
and dict subclasses keep their type) and works the same in a single process (where it is
a no-op or a local copy) and across ranks. Non-contiguous tensors are accepted.

Shape safety (why a mismatch never hangs the notebook): with gloo, an ``all_gather`` or
``all_reduce`` whose ranks disagree on shapes aborts a process from C++ (``SIGABRT``: gloo's
"Received data size doesn't match expected size" is thrown on its I/O thread, where nothing can
catch it, so it cannot be turned into an exception after the fact); a mismatched ``broadcast``
silently corrupts the receivers. So on gloo, :func:`gather`, :func:`reduce`,
:func:`broadcast`, :func:`broadcast_object_list` and :func:`pad_across_processes` start with
one fixed-size exchange (a 256-byte *packet* per rank, which can never trip gloo's size check)
carrying a 64-bit digest of the call (operation, structure, shapes, dtypes) and, when they
fit, the data itself: a small gather or reduce is then a single collective, the check
included. Larger inputs follow in their own collective once the digests agreed. Different
digests make every rank exchange the full descriptions and raise
:class:`~notebook_launcher.errors.DistributedOperationException` naming each rank's shapes.

On NCCL, like Accelerate, shapes are checked in debug mode only (comparing digests would
synchronise the host with the GPU on every call); ``pad_across_processes`` exchanges the
sizes it needs anyway. Set ``NOTEBOOK_LAUNCHER_CHECK_COLLECTIVES=0`` (read when the state is
built) to skip the check on gloo too.

Debug mode (``PartialState().debug``: env ``NOTEBOOK_LAUNCHER_DEBUG`` or
``ACCELERATE_DEBUG_MODE`` set to ``1``/``true``) exchanges the full description before
*every* collective here, ``gather_object`` included, on every backend.

Example::

    from notebook_launcher.utils import gather, reduce

    preds = gather(model(x).argmax(-1))          # every rank's predictions, concatenated
    loss = reduce(loss.detach(), reduction="mean")
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import pickle
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import state as _state
from .._worker import barriers, collectives
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
            f"Unsupported types ({type(data)}) passed to `{getattr(func, '__name__', func)}`. "
            "Only nested list/tuple/dicts of objects that are valid for `is_torch_tensor` "
            "should be passed."
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


def _signature(data: Any) -> str:
    """Structure, shapes and dtypes of ``data`` in a short string: what the digest covers."""
    if isinstance(data, torch.Tensor):
        return f"{data.dtype}{tuple(data.shape)}"
    if isinstance(data, (list, tuple)):
        return f"{type(data).__name__}[{','.join(_signature(d) for d in data)}]"
    if isinstance(data, Mapping):
        return "{" + ",".join(f"{k!r}:{_signature(v)}" for k, v in data.items()) + "}"
    return type(data).__name__


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
        inputs = collectives.per_rank([_format_description(d[1]) for d in descriptions])
        headline = (
            f"Cannot apply {op} because the ranks disagree on its inputs: {inputs}. All "
            f"{what} across processes must match (pad_across_processes() evens out tensor "
            "lengths)."
        )
    else:
        headline = "The ranks called different collective operations at the same point: " + (
            ", ".join(f"process {i}: {o}" for i, o in enumerate(ops))
        )
    lines = [headline, "", f"Operation: `notebook_launcher.utils.operations.{op}`"]
    lines.append("Input shapes:" if what == "shapes" else f"Inputs ({what}):")
    lines += [f"  - Process {i}: {_format_description(d[1])}" for i, d in enumerate(descriptions)]
    if any(len(d) > 2 for d in descriptions):  # each rank's call site (named cells in the kernel)
        lines.append("Called at:")
        lines += [
            f"  - Process {i}: {d[2] if len(d) > 2 else '?'}" for i, d in enumerate(descriptions)
        ]
    raise DistributedOperationException("\n".join(lines))


def _verify_debug(op: str, description: Any, key: Any = None, what: str = "shapes") -> None:
    """Debug mode: every rank's full description, compared before the collective runs."""
    ps = _state.PartialState()
    mine_key = (op, description if key is None else key)
    mine = (op, description, barriers.caller_location())
    everything = _all_gather_objects((mine_key, mine), ps.num_processes)
    if any(k != mine_key for k, _ in everything):
        _raise_mismatch(op, [item for _, item in everything], what)


def _checked(ps: _state.PartialState, leaves: list[torch.Tensor]) -> bool:
    """Whether a collective on ``leaves`` runs the default (non-debug) shape check.

    On gloo a shape mismatch aborts a rank from C++ (``SIGABRT``: gloo's "Received data size
    doesn't match expected size" is thrown on its I/O thread, where nothing can catch it), so
    CPU collectives are checked; the check rides along with the data (:func:`_packet`). On
    NCCL, like Accelerate, only debug mode checks: comparing digests there would synchronise
    the host with the GPU on every call.
    """
    return (
        ps._shared_state.get("_check_collectives", True)
        and ps.device.type == "cpu"
        and all(t.device.type == "cpu" for t in leaves)
    )


#: Bytes every rank sends in the first exchange of a checked collective, whatever its inputs:
#: a fixed size can never trip gloo's size check. Inputs up to 240 bytes (60 float32) travel
#: inside it, so a small gather, reduce or broadcast is one collective. On loopback gloo a
#: 256-byte all_gather costs about what a 64-byte one does, a 1 KiB one clearly more.
_PACKET = 256
#: The packet's header: the int64 digest of the call, padded so payloads stay 16-byte aligned.
_HEADER = 16


class _Packets:
    """Send and receive buffers of the packet exchange for one process group, with numpy
    views of their header fields: reused call after call, because allocating them (or any
    tensor op around a collective) shows in its latency (see :func:`_gather_small`)."""

    def __init__(self, world: int, generation: int) -> None:
        self.generation = generation
        self.world = world
        self.send = torch.zeros(_PACKET, dtype=torch.uint8)
        self.recv = torch.zeros(world * _PACKET, dtype=torch.uint8)
        self.send_np = self.send.numpy()
        self.rows = self.recv.numpy().reshape(world, _PACKET)
        self.header = self.send_np[:8].view(np.int64)
        self.digests = self.rows[:, :8].view(np.int64)[:, 0]
        self.send_payload = self.send.data_ptr() + _HEADER
        self.recv_payloads = [self.recv.data_ptr() + r * _PACKET + _HEADER for r in range(world)]

    def start(self, digest: int) -> Any:
        """Send the packet whose payload is in place; returns the work to ``wait()`` on.

        Calls the process group's own ``_allgather_base`` when it has one: the checks of
        ``dist.all_gather_single`` cost ~3 us, which gloo's latency amplifies. The group is
        looked up each time (0.1 us): holding it would keep it alive past
        ``destroy_process_group``.
        """
        self.header[0] = digest
        base = getattr(dist.group.WORLD, "_allgather_base", None)
        if base is not None:
            return base(self.recv, self.send)
        return _all_gather_single(self.recv, self.send, async_op=True)

    def agreed(self, digest: int) -> bool:
        """After the exchange: whether every rank sent ``digest``."""
        return self.digests.tolist().count(digest) == self.world

    def exchange(self, digest: int) -> bool:
        self.start(digest).wait()
        return self.agreed(digest)


class _Buffers(threading.local):
    """:class:`_Packets` of the current process group, per thread (threads never share one)."""

    def __init__(self) -> None:
        self.packets: _Packets | None = None

    def get(self, world: int, generation: int) -> _Packets:
        found = self.packets
        if found is None or found.generation != generation or found.world != world:
            found = self.packets = _Packets(world, generation)
        return found


_buffers = _Buffers()
#: (op, dtype, shape) -> digest of a single-tensor call (hashing a description costs more).
_digests: dict[tuple[Any, ...], int] = {}
#: (shape, world) -> shape of the gathered tensor.
_gathered_shapes: dict[tuple[torch.Size, int], tuple[int, ...]] = {}
#: Tensor dtypes numpy can view bytes as (the small-tensor fast paths below need one).
_NUMPY_DTYPES: dict[torch.dtype, Any] = {
    torch.float64: np.float64,
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}


def _small_digest(op: str, extra: Any, t: torch.Tensor) -> int:
    """The digest :func:`_packet` would compute for ``(op, (signature, extra))``, cached."""
    key = (op, extra, t.dtype, t.shape)
    digest = _digests.get(key)
    if digest is None:
        signature = _signature(t) if extra is None else (_signature(t), extra)
        digest = _digests[key] = _digest((op, signature))
    return digest


def _small_send(op: str, extra: Any, t: torch.Tensor) -> tuple[_Packets, Any, int] | None:
    """Start exchanging one small contiguous CPU tensor in a packet; ``None`` if no fast path.

    The lean twin of :func:`_packet` for the common case: same bytes on the wire, same
    digests, ``memmove`` for the copies and no tensor op before the collective. Returns
    ``(packets, work, digest)``: the caller prepares its result while the data travels, then
    calls :func:`_small_finish`.
    """
    shared = _state.PartialState._shared_state
    if not shared or shared["debug"] or not shared["_small_world"]:
        return None
    nbytes = t.nbytes
    if nbytes > _PACKET - _HEADER or not t.is_cpu or not t.is_contiguous():
        return None
    digest = _small_digest(op, extra, t)
    packets = _buffers.get(shared["_small_world"], shared["_generation"])
    ctypes.memmove(packets.send_payload, t.data_ptr(), nbytes)
    return packets, packets.start(digest), digest


def _small_finish(op: str, extra: Any, t: torch.Tensor, sent: tuple[_Packets, Any, int]) -> None:
    """Wait for :func:`_small_send`'s exchange; raise on every rank if the digests differ."""
    packets, work, digest = sent
    work.wait()
    if not packets.agreed(digest):

        def describe() -> Any:
            return _describe(t) if extra is None else (_describe(t), extra)

        mine = (op, describe(), barriers.caller_location())
        _raise_mismatch(op, _all_gather_objects(mine, packets.world))


def _offsets(leaves: list[torch.Tensor]) -> tuple[list[int], int]:
    """Where each leaf's bytes start in the packet (16-byte aligned), and where they end."""
    offsets, end = [], _HEADER
    for t in leaves:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // 16) * 16
    return offsets, end


def _packet(
    op: str,
    key: Any,
    describe: Callable[[], Any],
    payload: list[torch.Tensor],
    device: torch.device,
    what: str = "shapes",
    send: bool = True,
) -> np.ndarray | None:
    """The checked collective's first exchange: an ``all_gather`` of ``_PACKET`` bytes per rank.

    Each rank sends the digest of ``(op, key)`` and, when they fit, the bytes of ``payload``
    (not with ``send=False``: a broadcast's receivers). Equal digests mean equal shapes and
    dtypes everywhere, so every rank also agrees on whether the payload fitted. Returns the
    ``(world, _PACKET)`` byte rows when it did (the data has already arrived: unpack it with
    :func:`_unpacked` before the next collective reuses the buffer), ``None`` when the caller
    must now run its own collective. Different digests raise
    :class:`DistributedOperationException` on every rank, with each rank's ``describe()``
    (exchanged only then).
    """
    ps = _state.PartialState()
    world = ps.num_processes
    offsets, end = _offsets(payload)
    fits = end <= _PACKET
    digest = _digest((op, key))
    packets = _buffers.get(world, ps._shared_state["_generation"])
    if fits and send:
        for t, start in zip(payload, offsets, strict=True):
            raw = t.detach().reshape(-1).view(torch.uint8)
            packets.send_np[start : start + raw.numel()] = raw.cpu().numpy()
    if device.type == "cpu" or not _on_nccl():  # (gloo: its packets live on the CPU)
        agreed = packets.exchange(digest)
    else:  # pad_across_processes on NCCL: the exchange it needs anyway, on the device
        packets.header[0] = digest
        on_device = torch.empty(world * _PACKET, dtype=torch.uint8, device=device)
        _all_gather_single(on_device, packets.send.to(device))
        packets.recv.copy_(on_device)
        agreed = all(d == digest for d in packets.digests.tolist())
    if not agreed:
        mine = (op, describe(), barriers.caller_location())
        _raise_mismatch(op, _all_gather_objects(mine, world), what)
    return packets.rows if fits else None


def _unpacked(rows: np.ndarray, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's copy of each leaf, from the packet rows: ``(world, *leaf.shape)`` each."""
    out = []
    offsets, _ = _offsets(leaves)
    for t, start in zip(leaves, offsets, strict=True):
        size = t.numel() * t.element_size()
        chunk = torch.from_numpy(np.ascontiguousarray(rows[:, start : start + size]))
        out.append(chunk.view(t.dtype).reshape(rows.shape[0], *t.shape))
    return out


def _rebuild(data: Any, values: list[torch.Tensor]) -> Any:
    """``data`` with its tensor leaves replaced, in order, by ``values``."""
    it = iter(values)
    return recursively_apply(lambda _: next(it), data)


# --------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------


def _for_wire(t: torch.Tensor) -> tuple[torch.Tensor, torch.dtype | None]:
    """A contiguous, detached tensor the backend can send; bools travel as uint8."""
    t = t.detach()
    if t.dtype == torch.bool:
        return t.to(torch.uint8).contiguous(), torch.bool
    return t.contiguous(), None


def _on_nccl() -> bool:
    """Whether the group is NCCL's. Ranks that share a GPU run gloo with CUDA tensors:
    gloo's all_reduce and broadcast take them, its gather into one tensor goes by the CPU."""
    return "nccl" in str(dist.get_backend())


def _gather_one(tensor: torch.Tensor, num: int) -> torch.Tensor:
    if tensor.ndim == 0:
        tensor = tensor.reshape(1)
    wire, orig = _for_wire(tensor)
    home = wire.device
    if home.type == "cuda" and not _on_nccl():
        wire = wire.cpu()
    out = torch.empty((num * wire.shape[0], *wire.shape[1:]), dtype=wire.dtype, device=wire.device)
    _all_gather_single(out, wire)
    out = out.to(home)
    return out.to(orig) if orig is not None else out


def _gather_small(t: torch.Tensor) -> torch.Tensor | None:
    """:func:`gather` of one small CPU tensor: one packet carries the data and the check.

    Kept lean on purpose. On gloo a rank that spends more than ~5 us between two collectives
    lets its threads go to sleep, and waking them costs ~100 us, so every microsecond of
    Python around the collective shows ten times over (``bench/barrier.py``): the state is
    read from its dict (building ``PartialState()`` costs a microsecond), the copies are
    ``memmove``s, and the result is allocated (through numpy, twice as fast as
    ``torch.empty``) while the packets travel.
    """
    sent = _small_send("gather", None, t)
    if sent is None:
        return None
    packets = sent[0]
    shape = _gathered_shapes.get((t.shape, packets.world))
    if shape is None:
        shape = (packets.world * t.shape[0], *t.shape[1:]) if t.ndim else (packets.world,)
        _gathered_shapes[(t.shape, packets.world)] = shape
    dtype = _NUMPY_DTYPES.get(t.dtype)
    if dtype is not None:
        out = torch.from_numpy(np.empty(shape, dtype=dtype))
    else:
        out = torch.empty(shape, dtype=t.dtype)
    _small_finish("gather", None, t, sent)
    nbytes, base = t.nbytes, out.data_ptr()
    for rank, source in enumerate(packets.recv_payloads):
        ctypes.memmove(base + rank * nbytes, source, nbytes)
    return out


def gather(tensor: Any) -> Any:
    """Concatenate (along dim 0) each tensor of ``tensor`` from every process.

    All ranks must pass the same structure and shapes (else
    :class:`DistributedOperationException` on every rank); 0-dim tensors become one row per
    process. In a single process the input is returned unchanged.

    Example::

        gather(torch.tensor([state.process_index]))   # 2 ranks: tensor([0, 1])
    """
    if collectives.outside:  # a cell on some ranks only: it would wait for ever
        collectives.refuse("gather")
    if type(tensor) is torch.Tensor:
        small = _gather_small(tensor)
        if small is not None:
            return small
    ps = _state.PartialState()
    if not ps.use_distributed:
        return recursively_apply(lambda t: t, tensor, error_on_other_type=True)
    leaves = _leaves(recursively_apply(lambda t: t, tensor, error_on_other_type=True))
    if ps.debug:
        _verify_debug("gather", _describe(tensor))
    elif _checked(ps, leaves):
        rows = _packet("gather", _signature(tensor), lambda: _describe(tensor), leaves, ps.device)
        if rows is not None:  # small: the data came with the check
            every = _unpacked(rows, leaves)
            return _rebuild(tensor, [e.reshape(-1, *e.shape[2:]) for e in every])
    return recursively_apply(_gather_one, tensor, ps.num_processes)


def gather_object(object: Any) -> list[Any]:
    """Gather picklable objects from every process.

    A list or tuple from each rank gives one flat list (rank 0's items first); any other
    object gives ``[object_of_rank_0, object_of_rank_1, ...]``. In a single process:
    ``list(object)`` for a list/tuple, else ``[object]``.

    Example::

        gather_object([f"rank {state.process_index}"])   # ["rank 0", "rank 1"]
    """
    if collectives.outside:  # a cell on some ranks only: it would wait for ever
        collectives.refuse("gather_object")
    ps = _state.PartialState()
    flatten = isinstance(object, (list, tuple))
    if not ps.use_distributed:
        return list(object) if flatten else [object]
    if ps.debug:
        _verify_debug("gather_object", "list" if flatten else "object", what="kinds")
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
    if collectives.outside:  # a cell on some ranks only: it would wait for ever
        collectives.refuse("broadcast")
    ps = _state.PartialState()
    _check_src(from_process, ps.num_processes)
    leaves = _leaves(recursively_apply(lambda t: t, tensor, error_on_other_type=True))
    if not ps.use_distributed:
        return tensor
    if ps.debug:
        _verify_debug("broadcast", (_describe(tensor), from_process))
    elif _checked(ps, leaves):
        key = (_signature(tensor), from_process)

        def describe() -> Any:
            return (_describe(tensor), from_process)

        sending = ps.process_index == from_process
        rows = _packet("broadcast", key, describe, leaves, ps.device, send=sending)
        if rows is not None:  # small: the source's data came with the check
            if ps.process_index != from_process:
                with torch.no_grad():
                    for t, every in zip(leaves, _unpacked(rows, leaves), strict=True):
                        t.copy_(every[from_process])
            return tensor
    return recursively_apply(_broadcast_one, tensor, from_process)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Replace the items of ``object_list`` (in place) by those of process ``from_process``.

    Every rank must pass a list of the same length. Returns ``object_list``.

    Example::

        cfg = [config if state.is_main_process else None]
        broadcast_object_list(cfg)      # cfg[0] is rank 0's config everywhere
    """
    if collectives.outside:  # a cell on some ranks only: it would wait for ever
        collectives.refuse("broadcast_object_list")
    ps = _state.PartialState()
    _check_src(from_process, ps.num_processes)
    if not ps.use_distributed:
        return object_list
    key = (len(object_list), from_process)
    if ps.debug:
        _verify_debug("broadcast_object_list", key, what="list lengths")
    elif _checked(ps, []):
        _packet("broadcast_object_list", key, lambda: key, [], ps.device, what="list lengths")
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
    if collectives.outside:  # a cell on some ranks only: it would wait for ever
        collectives.refuse("reduce")
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
    if type(tensor) is torch.Tensor and reduction != "none":
        small = _reduce_small(tensor, reduction, scale)
        if small is not None:
            return small
    ps = _state.PartialState()
    distributed = ps.use_distributed and reduction != "none"
    if distributed and ps.debug:
        _verify_debug("reduce", (_describe(tensor), reduction))
    elif distributed and _checked(ps, leaves):
        wires = [_for_wire(t) for t in leaves]

        def describe() -> Any:
            return (_describe(tensor), reduction)

        key = (_signature(tensor), reduction)
        rows = _packet("reduce", key, describe, [w for w, _ in wires], ps.device)
        if rows is not None:  # small: every rank has every rank's values; reduce them here
            every = _unpacked(rows, [w for w, _ in wires])
            done = []
            for (_, orig), values in zip(wires, every, strict=True):
                out = _local_reduction(values, reduction)
                if orig is not None:
                    out = out.to(orig)
                done.append(out * scale if scale != 1.0 else out)
            return _rebuild(tensor, done)
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


def _reduce_small(t: torch.Tensor, reduction: str, scale: float) -> torch.Tensor | None:
    """:func:`reduce` of one small CPU tensor: one packet, then each rank reduces the rows
    (in rank order: every rank computes the same result)."""
    dtype = _NUMPY_DTYPES.get(t.dtype)
    sent = _small_send("reduce", reduction, t) if dtype is not None else None
    if sent is None:
        return None
    _small_finish("reduce", reduction, t, sent)
    packets = sent[0]
    values = packets.rows[:, _HEADER : _HEADER + t.nbytes].view(dtype)
    if reduction == "max":
        out = values.max(axis=0)
    elif reduction == "min":
        out = values.min(axis=0)
    else:
        out = values.sum(axis=0, dtype=values.dtype)
        if reduction == "mean":
            out = out / packets.world
    result = torch.from_numpy(np.array(out.reshape(t.shape)))
    return result * scale if scale != 1.0 else result


def _local_reduction(values: torch.Tensor, reduction: str) -> torch.Tensor:
    """``values`` stacks every rank's tensor (rank order): the same result on every rank."""
    if reduction == "max":
        return values.amax(dim=0)
    if reduction == "min":
        return values.amin(dim=0)
    total = values.sum(dim=0, dtype=values.dtype)
    return total / values.shape[0] if reduction == "mean" else total


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
    if collectives.outside:  # a cell on some ranks only: it would wait for ever
        collectives.refuse("pad_across_processes")
    ps = _state.PartialState()

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.is_nested:
            warnings.warn(
                "pad_across_processes cannot pad a nested tensor: it is returned as is.",
                CannotPadNestedTensorWarning,
                stacklevel=4,
            )
            return t
        if ps.use_distributed:
            if t.ndim > _MAX_DIMS:
                raise ValueError(f"pad_across_processes supports up to {_MAX_DIMS} dims")
            if ps.debug:
                _verify_debug("pad_across_processes", _describe(t), key=(t.ndim, t.dtype))
            shape = torch.tensor(t.shape, dtype=torch.int64)
            rows = _packet(
                "pad_across_processes",
                t.ndim,
                lambda: _describe(t),
                [shape],
                ps.device,
                what="numbers of dimensions",
            )
            if rows is not None:
                every = _unpacked(rows, [shape])[0]  # (world, ndim): every rank's shape
            else:  # many dims: the ranks agreed on ndim, so this exchange sizes match
                every = torch.empty(ps.num_processes * t.ndim, dtype=torch.int64, device=ps.device)
                _all_gather_single(every, shape.to(ps.device))
                every = every.cpu().view(ps.num_processes, t.ndim)
        d = dim + t.ndim if dim < 0 else dim
        if t.ndim == 0 or not 0 <= d < t.ndim:
            return t
        if not ps.use_distributed:
            return t
        max_size = int(every[:, d].max())
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

    A list of one element is returned as that element, whatever it is (as in Accelerate);
    several non-tensor leaves raise ``TypeError``.

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
    if isinstance(first, torch.Tensor):
        return torch.cat(list(data), dim=dim)
    if len(data) == 1:
        return first
    raise TypeError(f"Can only concatenate tensors but got {type(first)}")


class CannotPadNestedTensorWarning(UserWarning):
    """:func:`pad_across_processes` was given a nested tensor, which it returns unpadded."""


def pad_input_tensors(tensor: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Pad each tensor along ``dim`` with zeros to a multiple of ``num_processes`` rows (at
    least ``num_processes``), so that every process gets a share of a batch of ``batch_size``.

    >>> pad_input_tensors(torch.ones(3, 2), batch_size=3, num_processes=2).shape
    torch.Size([4, 2])
    """

    def one(t: torch.Tensor) -> torch.Tensor:
        target = max(num_processes, -(-batch_size // num_processes) * num_processes)
        d = dim + t.ndim if dim < 0 else dim
        if target <= t.shape[d]:
            return t
        shape = list(t.shape)
        shape[d] = target
        out = t.new_zeros(shape)
        index = [slice(None)] * t.ndim
        index[d] = slice(0, t.shape[d])
        out[tuple(index)] = t
        return out

    return recursively_apply(one, tensor, error_on_other_type=True)


def _to_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float()


def _is_half(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16)


def convert_to_fp32(tensor: Any) -> Any:
    """Every fp16/bf16 tensor of a nest converted to fp32; everything else unchanged.

    >>> convert_to_fp32({"x": torch.ones(1, dtype=torch.bfloat16), "n": 3})["x"].dtype
    torch.float32
    """
    return recursively_apply(_to_fp32, tensor, test_type=_is_half)


class ConvertOutputsToFp32:
    """Wraps a forward so that its half-precision outputs come back in fp32. A class, not a
    closure, so that a model carrying it still pickles."""

    def __init__(self, model_forward: Callable[..., Any]) -> None:
        self.model_forward = model_forward
        functools.update_wrapper(self, model_forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(self.model_forward(*args, **kwargs))

    def __getstate__(self) -> Any:
        raise pickle.PicklingError(
            "Cannot pickle a prepared model with automatic mixed precision, please unwrap the "
            "model with `Accelerator.unwrap_model(model)` before pickling it."
        )


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """``model_forward`` whose half-precision outputs are converted to fp32."""
    return ConvertOutputsToFp32(model_forward)


def wait_for_everyone() -> None:
    """``PartialState().wait_for_everyone()``: block until every process gets here."""
    _state.PartialState().wait_for_everyone()


__all__ = [
    "CannotPadNestedTensorWarning",
    "ConvertOutputsToFp32",
    "DistributedOperationException",
    "broadcast",
    "broadcast_object_list",
    "concatenate",
    "convert_outputs_to_fp32",
    "convert_to_fp32",
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
    "pad_input_tensors",
    "recursively_apply",
    "reduce",
    "send_to_device",
    "slice_tensors",
    "wait_for_everyone",
]
