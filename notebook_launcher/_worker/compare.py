"""A rank's values, broken into entries and digested, for comparing them across ranks
(rank side of ``session.compare`` / ``%rankdiff``).

:func:`digests` turns each named value of the rank's namespace into entries -- a module's
parameters and buffers (``weight``, ``0.bias``: a DDP or compiled wrapper is looked
through, so replicas line up), an optimizer's state and hyper-parameters
(``state.3.exp_avg``, ``param_groups.0.lr``), a tensor, the leaves of a dict, list or
dataclass, a plain value -- and each entry into a short description and a 64-bit digest
of its bytes. The name ``rng`` (unless the namespace has a variable of that name) is the
rank's random state: torch's (CPU and CUDA), Python's ``random`` and NumPy's.

Cheap first: only digests travel. :func:`values` then sends the entries whose digests
differ, so that the kernel can say which elements differ and by how much.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from collections.abc import Iterator
from typing import Any

from . import session as rank_session

#: Entries of one value at most (a huge nested structure is cut, and says so).
MAX_ENTRIES = 10_000
#: Elements of one tensor sent for details at most (more: only its digest and norm).
MAX_DETAIL_ELEMENTS = 4_000_000
RNG = "rng"
#: The description of a random generator's state (the kernel shows no details for it).
RANDOM = "random state"


def _resolve(name: str) -> Any:
    namespace = rank_session.current().namespace
    if name == RNG and RNG not in namespace:
        return _RngState()
    head, *rest = name.split(".")
    if head not in namespace:
        rank = namespace.get("rank")
        raise NameError(f"name {head!r} is not defined on rank {rank}")
    value = namespace[head]
    for attr in rest:
        value = getattr(value, attr)
    return value


class _RngState:
    """The rank's random number generators, as entries."""

    def entries(self) -> Iterator[tuple[str, Any]]:
        import random

        import torch

        yield "torch", _Random(torch.get_rng_state())
        if torch.cuda.is_initialized():
            for i, state in enumerate(torch.cuda.get_rng_state_all()):
                yield f"cuda:{i}", _Random(state)
        yield "random", _Random(random.getstate())
        try:
            import numpy as np

            yield "numpy", _Random(np.random.get_state())
        except ImportError:
            pass


@dataclasses.dataclass(frozen=True)
class _Random:
    """A generator's state: compared by digest only (its bytes mean nothing to a user)."""

    state: Any


def _unwrap_module(module: Any) -> Any:
    seen = set()
    while id(module) not in seen:
        seen.add(id(module))
        inner = getattr(module, "module", None) or getattr(module, "_orig_mod", None)
        import torch

        if isinstance(inner, torch.nn.Module):
            module = inner
        else:
            break
    return module


def entries(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` for every entry of ``value`` (see the module docstring)."""
    import torch

    if isinstance(value, _RngState):
        yield from value.entries()
        return
    if isinstance(value, torch.nn.Module):
        module = _unwrap_module(value)
        for name, p in module.named_parameters():
            yield f"{prefix}{name}", p
        for name, b in module.named_buffers():
            yield f"{prefix}{name}", b
        return
    inner = getattr(value, "optimizer", None)
    if isinstance(value, torch.optim.Optimizer) or isinstance(inner, torch.optim.Optimizer):
        optimizer: Any = value if isinstance(value, torch.optim.Optimizer) else inner
        state = optimizer.state_dict()
        for index, slots in sorted(state["state"].items()):
            for key, slot in slots.items():
                yield f"{prefix}state.{index}.{key}", slot
        for i, group in enumerate(state["param_groups"]):
            for key, setting in group.items():
                if key != "params":
                    yield f"{prefix}param_groups.{i}.{key}", setting
        return
    if isinstance(value, torch.Tensor):
        yield prefix.rstrip(".") or "(tensor)", value
        return
    if isinstance(value, dict):
        for key, item in value.items():
            yield from entries(item, f"{prefix}{key}.")
        return
    if isinstance(value, (list, tuple)) and not _is_leafy(value):
        for i, item in enumerate(value):
            yield from entries(item, f"{prefix}{i}.")
        return
    if isinstance(value, _Random):
        yield prefix.rstrip(".") or "(value)", value
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from entries(getattr(value, f.name), f"{prefix}{f.name}.")
        return
    yield prefix.rstrip(".") or "(value)", value


def _is_leafy(value: Any) -> bool:
    """A short sequence of plain values is one entry (a shape, a tuple of settings)."""
    return len(value) <= 16 and all(
        isinstance(v, (int, float, str, bool, type(None))) for v in value
    )


def describe(leaf: Any) -> str:
    if isinstance(leaf, _Random):
        return RANDOM
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{str(dtype).replace('torch.', '')} {list(shape)}"
    text = repr(leaf)
    return text if len(text) <= 60 else f"{type(leaf).__name__} ({len(text)} chars)"


def _bytes(leaf: Any) -> bytes:
    import torch

    if isinstance(leaf, _Random):
        leaf = leaf.state
    if isinstance(leaf, torch.Tensor):
        t = leaf.detach()
        if t.is_sparse:
            t = t.to_dense()
        shape = str((tuple(t.shape), t.dtype)).encode()
        t = t.cpu().contiguous().reshape(-1)
        try:
            return t.view(torch.uint8).numpy().tobytes() + shape
        except (RuntimeError, TypeError):
            return pickle.dumps(t.tolist())
    to_bytes = getattr(leaf, "tobytes", None)  # numpy arrays
    if callable(to_bytes):
        return bytes(to_bytes()) + repr(getattr(leaf, "shape", "")).encode()
    try:
        return pickle.dumps(leaf, protocol=4)
    except Exception:  # noqa: BLE001 - compare what it shows
        return repr(leaf).encode()


def digest(leaf: Any) -> str:
    return hashlib.blake2b(_bytes(leaf), digest_size=8).hexdigest()


def digests(names: list[str]) -> dict[str, Any]:
    """name -> ``[(path, description, digest), ...]`` (or ``{"error": why}``)."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            rows: list[tuple[str, str, str]] = []
            for path, leaf in entries(_resolve(name)):
                if len(rows) == MAX_ENTRIES:
                    rows.append(("...", f"more than {MAX_ENTRIES} entries, not compared", ""))
                    break
                rows.append((path, describe(leaf), digest(leaf)))
            out[name] = rows
        except Exception as exc:  # noqa: BLE001 - said per name, the others still compared
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def values(wanted: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """The leaves ``wanted`` (name -> paths) as plain data the kernel can compare
    (tensors as NumPy arrays of at most :data:`MAX_DETAIL_ELEMENTS` elements)."""
    import torch

    out: dict[str, dict[str, Any]] = {}
    for name, paths in wanted.items():
        want = set(paths)
        found: dict[str, Any] = {}
        for path, leaf in entries(_resolve(name)):
            if path not in want:
                continue
            if isinstance(leaf, torch.Tensor):
                t = leaf.detach()
                if t.numel() > MAX_DETAIL_ELEMENTS:
                    found[path] = ("too large", t.numel(), float(t.float().norm()))
                    continue
                if t.dtype == torch.bfloat16 or t.dtype == torch.float16:
                    t = t.float()
                found[path] = t.cpu().numpy()
            else:
                found[path] = leaf
        out[name] = found
    return out


__all__ = ["RNG", "describe", "digest", "digests", "entries", "values"]
