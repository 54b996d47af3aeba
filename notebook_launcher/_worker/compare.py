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

Nothing is left out. A value of more than :data:`MAX_ENTRIES` entries is sent as
:data:`GROUPS` group digests over all its entries (an entry's group follows its path, and a
group's digest is a sum: neither depends on the order the entries come in); the kernel then
asks for the entries of the groups that differ, by name. Digests do not depend on the
interpreter either: a set's (or a dict's) items are digested in a canonical order, not in
the order of this rank's hash seed. An entry that cannot be read or digested says why, in
its row, and the others are compared still.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import reprlib
from collections.abc import Iterator
from typing import Any

from . import session as rank_session

#: Entries of one value sent one by one at most (more: as :data:`GROUPS` group digests).
MAX_ENTRIES = 10_000
#: How many groups the entries of a larger value are digested in.
GROUPS = 256
#: The path of a group's row: ``GROUP + "17"`` (description: ``"3906 entries"``).
GROUP = "\0group "
#: The path of the row that says how many entries of the asked groups were not listed.
MORE = "\0more"
#: The digest of an entry that could not be read (its description says why).
UNREADABLE = ""
#: A leaf sent for details as its ``repr`` only (``(SHOWN, text)``): not plain data.
SHOWN = "\0repr"
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
    text = _short_repr.repr(leaf)
    return text if len(text) <= 60 else f"{type(leaf).__name__} ({len(text)} chars)"


_short_repr = reprlib.Repr()
_short_repr.maxstring = _short_repr.maxother = 200
_short_repr.maxlist = _short_repr.maxtuple = _short_repr.maxset = _short_repr.maxdict = 64


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
    if callable(to_bytes) and getattr(getattr(leaf, "dtype", None), "kind", "O") != "O":
        return bytes(to_bytes()) + repr(getattr(leaf, "shape", "")).encode()
    if callable(getattr(leaf, "tolist", None)) and hasattr(leaf, "dtype"):  # object arrays
        leaf = (repr(getattr(leaf, "shape", "")), leaf.tolist())
    return _canonical(leaf)


def _framed(parts: list[bytes]) -> bytes:
    return b"".join(len(p).to_bytes(8, "big") + p for p in parts)


def _canonical(value: Any, depth: int = 0) -> bytes:
    """``value``'s bytes, the same in every interpreter: a set's or a dict's items in the
    order of their own bytes (pickle follows the hash seed, which differs between
    interpreters), a plain object by its attributes; anything else pickled (a value that
    cannot be pickled raises: its ``repr`` would name its address, which differs)."""
    kind = type(value)
    if depth < 64:
        if kind in (set, frozenset):
            items = sorted(_canonical(v, depth + 1) for v in value)
            return kind.__name__.encode() + _framed(items)
        if kind is dict:
            pairs = sorted(
                _framed([_canonical(k, depth + 1), _canonical(v, depth + 1)])
                for k, v in value.items()
            )
            return b"dict" + _framed(pairs)
        if kind in (list, tuple):
            return kind.__name__.encode() + _framed([_canonical(v, depth + 1) for v in value])
        if _plain_object(value):
            name = f"{kind.__module__}.{kind.__qualname__}".encode()
            return b"object " + name + _canonical(dict(vars(value)), depth + 1)
    return pickle.dumps(value, protocol=4)


def _plain_object(value: Any) -> bool:
    """An instance whose state is its ``__dict__`` (pickled by the default reduction)."""
    kind = type(value)
    return (
        isinstance(getattr(value, "__dict__", None), dict)
        and not isinstance(value, type)
        and kind.__reduce_ex__ is object.__reduce_ex__
        and kind.__reduce__ is object.__reduce__
        and getattr(kind, "__getstate__", None) is getattr(object, "__getstate__", None)
        and not getattr(kind, "__slots__", ())
    )


def digest(leaf: Any) -> str:
    return hashlib.blake2b(_bytes(leaf), digest_size=8).hexdigest()


def _row(path: str, leaf: Any) -> tuple[str, str, str]:
    """``(path, description, digest)``; an entry that cannot be read says why instead."""
    try:
        return path, describe(leaf), digest(leaf)
    except Exception as exc:  # noqa: BLE001 - said in the row, the others still compared
        return path, f"{type(exc).__name__}: {_clip(str(exc))}", UNREADABLE


def _clip(text: str, most: int = 200) -> str:
    return text if len(text) <= most else text[: most - 3] + "..."


def group_of(path: str) -> int:
    """The group of an entry: from its path only (the same on every rank)."""
    raw = hashlib.blake2b(path.encode("utf-8", "surrogatepass"), digest_size=4).digest()
    return int.from_bytes(raw, "big") % GROUPS


def _rows(value: Any, groups: set[int] | None) -> list[tuple[str, str, str]]:
    """Every entry's row, or the group rows of a value of more than :data:`MAX_ENTRIES`
    entries; ``groups``: only the entries of these groups (:data:`MAX_ENTRIES` at most,
    then a :data:`MORE` row says how many more there were)."""
    rows: list[tuple[str, str, str]] | None = []
    if groups is not None:
        assert rows is not None
        more = 0
        for path, leaf in entries(value):
            if group_of(path) in groups:
                if len(rows) < MAX_ENTRIES:
                    rows.append(_row(path, leaf))
                else:
                    more += 1
        if more:
            rows.append((MORE, str(more), UNREADABLE))
        return rows
    sums = [0] * GROUPS
    counts = [0] * GROUPS
    unreadable = [0] * GROUPS
    for path, leaf in entries(value):
        row = _row(path, leaf)
        g = group_of(path)
        counts[g] += 1
        if row[2] == UNREADABLE:
            unreadable[g] += 1
        term = hashlib.blake2b(f"{path}\0{row[2]}".encode("utf-8", "surrogatepass"), digest_size=8)
        sums[g] = (sums[g] + int.from_bytes(term.digest(), "big")) % (1 << 64)
        if rows is not None:
            rows.append(row)
            if len(rows) > MAX_ENTRIES:
                rows = None  # (the groups hold every entry)
    if rows is not None:
        return rows
    return [
        (
            f"{GROUP}{g}",
            f"{counts[g]} entries",
            UNREADABLE if unreadable[g] else f"{sums[g]:016x}",
        )
        for g in range(GROUPS)
        if counts[g]
    ]


def digests(names: list[str], groups: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """name -> ``[(path, description, digest), ...]`` (or ``{"error": why}``); with
    ``groups`` (name -> group numbers), the rows of those groups' entries only."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            only = None if groups is None else set(groups.get(name, ()))
            out[name] = _rows(_resolve(name), only)
        except Exception as exc:  # noqa: BLE001 - said per name, the others still compared
            out[name] = {"error": f"{type(exc).__name__}: {_clip(str(exc))}"}
    return out


def values(wanted: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """The leaves ``wanted`` (name -> paths) as plain data the kernel can compare
    (tensors as NumPy arrays of at most :data:`MAX_DETAIL_ELEMENTS` elements)."""
    import torch

    out: dict[str, dict[str, Any]] = {}
    for name, paths in wanted.items():
        want = set(paths)
        found: dict[str, Any] = {}
        try:
            for path, leaf in entries(_resolve(name)):
                if path not in want:
                    continue
                try:
                    found[path] = _plain(leaf, torch)
                except Exception as exc:  # noqa: BLE001 - that entry says why, not the rest
                    found[path] = (SHOWN, f"(cannot be read: {type(exc).__name__}: {exc})")
        except Exception as exc:  # noqa: BLE001 - said per name, the others still compared
            found = {"\0error": f"{type(exc).__name__}: {_clip(str(exc))}"}
        out[name] = found
    return out


_PLAIN = (int, float, complex, bool, str, bytes, type(None))


def _plain(leaf: Any, torch: Any) -> Any:
    """What the kernel gets of a leaf: a tensor as a NumPy array, a plain value as it is,
    anything else as ``(SHOWN, its repr)`` -- never an object the kernel may not be able
    to unpickle, nor one that cannot be pickled."""
    if isinstance(leaf, torch.Tensor):
        t = leaf.detach()
        if t.numel() > MAX_DETAIL_ELEMENTS:
            return ("too large", t.numel(), float(t.float().norm()))
        if t.dtype == torch.bfloat16 or t.dtype == torch.float16:
            t = t.float()
        return t.cpu().numpy()
    if isinstance(leaf, _PLAIN) or (
        isinstance(leaf, tuple) and all(isinstance(v, _PLAIN) for v in leaf)
    ):
        return leaf
    if type(leaf).__module__ == "numpy" and getattr(leaf.dtype, "kind", "O") in "biufc":
        return leaf
    return (SHOWN, _short_repr.repr(leaf))


__all__ = [
    "GROUP",
    "GROUPS",
    "MAX_ENTRIES",
    "RNG",
    "describe",
    "digest",
    "digests",
    "entries",
    "group_of",
    "values",
]
