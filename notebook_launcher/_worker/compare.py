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
group's digest is over its entries' bytes, sorted: neither depends on the order the entries
come in); the kernel then asks for the entries of the groups that differ, by name. A
million entries cost about half a second (issue 33: it was 16): a leaf of a plain type (a
number, a string...) is neither described nor digested on its own but goes into its
group's digest as it is, the items of a dict or a list are walked by loops in C, and an
entry's group is a CRC-32 of its path (a group only spreads the entries). Digests do not
depend on the interpreter either: a set's (or a dict's) items are digested in a canonical
order, not in the order of this rank's hash seed. An entry that cannot be read or digested
says why, in its row, and the others are compared still.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import marshal
import pickle
import reprlib
import zlib
from collections.abc import Iterable, Iterator
from operator import itemgetter
from typing import Any, cast

from . import session as rank_session

#: Entries of one value sent one by one at most (more: as :data:`GROUPS` group digests).
MAX_ENTRIES = 10_000
#: How many groups the entries of a larger value are digested in.
GROUPS = 256
#: The path of a group's row: ``GROUP + "17"`` (description: ``"3906 entries"``).
GROUP = "\0group "
#: The path of a large value's one row in the first round (description: ``"1000000
#: entries"``): its entries in their order, digested; where ranks differ, its groups are
#: asked for (issue 33: a million identical entries are then ~0.2 s, not ~0.5 s).
WHOLE = "\0whole"
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
#: Leaves of these exact types are plain values: their bytes are their pickle (one entry's
#: digest) or their marshal (in a group's digest), the same in every interpreter.
_SCALARS = frozenset({int, float, complex, bool, str, bytes, type(None)})


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


#: Entries in runs: their paths and their leaves, side by side.
Run = tuple[list[str], list[Any]]


def entries(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, leaf)`` for every entry of ``value`` (see the module docstring)."""
    for paths, leaves in _runs(value, prefix):
        yield from zip(paths, leaves, strict=True)


def _runs(value: Any, prefix: str = "") -> Iterator[Run]:
    """:func:`entries` in runs: the items of a dict or a sequence that are scalars come
    as one run, named by loops in C (``map``) rather than a Python step each -- what makes
    a million-entry dict cheap to walk."""
    import torch

    if isinstance(value, _RngState):
        for path, leaf in value.entries():
            yield [path], [leaf]
        return
    if isinstance(value, torch.nn.Module):
        module = _unwrap_module(value)
        for named in (module.named_parameters(), module.named_buffers()):
            names, leaves = _unzip(named)
            yield [f"{prefix}{name}" for name in names], leaves
        return
    inner = getattr(value, "optimizer", None)
    if isinstance(value, torch.optim.Optimizer) or isinstance(inner, torch.optim.Optimizer):
        optimizer: Any = value if isinstance(value, torch.optim.Optimizer) else inner
        state = optimizer.state_dict()
        for index, slots in sorted(state["state"].items()):
            for key, slot in slots.items():
                yield [f"{prefix}state.{index}.{key}"], [slot]
        for i, group in enumerate(state["param_groups"]):
            for key, setting in group.items():
                if key != "params":
                    yield [f"{prefix}param_groups.{i}.{key}"], [setting]
        return
    if isinstance(value, torch.Tensor):
        yield [prefix.rstrip(".") or "(tensor)"], [value]
        return
    if isinstance(value, dict):
        yield from _items(list(map(format, value)), list(value.values()), prefix)
        return
    if isinstance(value, (list, tuple)) and not _is_leafy(value):
        yield from _items(list(map(str, range(len(value)))), list(value), prefix)
        return
    if isinstance(value, _Random):
        yield [prefix.rstrip(".") or "(value)"], [value]
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _runs(getattr(value, f.name), f"{prefix}{f.name}.")
        return
    yield [prefix.rstrip(".") or "(value)"], [value]


def _unzip(pairs: Iterable[tuple[str, Any]]) -> tuple[list[str], list[Any]]:
    both = list(pairs)
    return [name for name, _ in both], [leaf for _, leaf in both]


def _items(names: list[str], items: list[Any], prefix: str) -> Iterator[Run]:
    """The entries of a container's items (``names``: the keys as ``f"{key}"`` writes
    them): a run of scalars as one run, named as :func:`_runs` would name each; any other
    item through :func:`_runs`."""
    scalar = list(map(_SCALARS.__contains__, map(type, items)))
    if all(scalar):
        yield _scalar_run(names, items, prefix)
        return
    for is_scalar, group in itertools.groupby(
        zip(names, items, scalar, strict=True), itemgetter(2)
    ):
        if is_scalar:
            names_of, items_of, _ = map(list, zip(*group, strict=True))
            yield _scalar_run(names_of, items_of, prefix)
        else:
            for name, item, _ in group:
                yield from _runs(item, f"{prefix}{name}.")


def _scalar_run(names: list[str], leaves: list[Any], prefix: str) -> Run:
    """Scalars named as ``_runs(leaf, f"{prefix}{name}.")`` names each one."""
    paths = list(map(prefix.__add__, names)) if prefix else names
    if "" in paths or any(map(str.endswith, paths, itertools.repeat("."))):
        paths = [path.rstrip(".") or "(value)" for path in paths]
    return paths, leaves


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
    if type(leaf) in _SCALARS:
        return pickle.dumps(leaf, protocol=4)  # (what _canonical ends in for these)
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
    return _groups([path])[0]


def _groups(paths: list[str]) -> list[int]:
    """:func:`group_of` each path (CRC-32: a group only spreads entries, and a digest of
    its entries says whether they are the same)."""
    encoded = map(str.encode, paths, itertools.repeat("utf-8"), itertools.repeat("surrogatepass"))
    return list(map(GROUPS.__rmod__, map(zlib.crc32, encoded)))


class _Walk:
    """A value's entries, walked once for the rounds of one comparison (:data:`_walks`):
    its runs, and what the rounds after the first make of them (their groups, their leaves
    as digests take them), each made once."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.runs = list(_runs(value))
        self.count = sum(len(paths) for paths, _ in self.runs)
        self._groups: list[list[int]] | None = None
        self._digested: list[tuple[list[Any], bool]] | None = None

    def groups(self) -> list[list[int]]:
        if self._groups is None:
            self._groups = [_groups(paths) for paths, _ in self.runs]
        return self._groups

    def digested(self) -> list[tuple[list[Any], bool]]:
        if self._digested is None:
            self._digested = [_digested(leaves) for _, leaves in self.runs]
        return self._digested


#: The walks of the comparison under way: its token (the kernel's, for all its rounds)
#: and name -> :class:`_Walk`. The rounds after the first take a value's entries from here
#: rather than walking it again (a million entries: ~0.15 s a walk, issue 33); a new
#: comparison, or :func:`forget`, lets them go.
_walks: dict[str, Any] = {"token": None, "by_name": {}}


def _walk(name: str, token: str | None) -> _Walk:
    value = _resolve(name)
    if token is None:
        return _Walk(value)
    if _walks["token"] != token:
        _walks.update(token=token, by_name={})
    walk = _walks["by_name"].get(name)
    if walk is None or walk.value is not value:  # (another object under that name now)
        walk = _walks["by_name"][name] = _Walk(value)
    return cast(_Walk, walk)


def forget(token: str) -> None:
    """The comparison ``token`` is over: let its walks go."""
    if _walks["token"] == token:
        _walks.update(token=None, by_name={})


def _rows(value: Any, groups: set[int] | None, whole: bool = False) -> list[tuple[str, str, str]]:
    """Every entry's row, or the group rows of a value of more than :data:`MAX_ENTRIES`
    entries (``whole``: its one :data:`WHOLE` row instead); ``groups``: only the entries of
    these groups (:data:`MAX_ENTRIES` at most, then a :data:`MORE` row says how many more
    there were)."""
    return _rows_of(_Walk(value), groups, whole)


def _rows_of(walk: _Walk, groups: set[int] | None, whole: bool) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    if groups is not None:
        more = 0
        for (paths, leaves), of_run in zip(walk.runs, walk.groups(), strict=True):
            picked = map(groups.__contains__, of_run)
            for path, leaf in itertools.compress(zip(paths, leaves, strict=True), picked):
                if len(rows) < MAX_ENTRIES:
                    rows.append(_row(path, leaf))
                else:
                    more += 1
        if more:
            rows.append((MORE, str(more), UNREADABLE))
        return rows
    if walk.count > MAX_ENTRIES:
        return [_whole_row(walk)] if whole else _group_rows(walk)
    return [
        _row(path, leaf)
        for paths, leaves in walk.runs
        for path, leaf in zip(paths, leaves, strict=True)
    ]


def _digested(leaves: list[Any]) -> tuple[list[Any], bool]:
    """The leaves as a digest of a large value takes them: a scalar as it is, any other
    leaf as ``("", its digest)``; and whether one could not be read."""
    if all(map(_SCALARS.__contains__, map(type, leaves))):
        return leaves, False
    out, unreadable = list(leaves), False
    for i, leaf in enumerate(out):
        if type(leaf) not in _SCALARS:
            try:
                out[i] = ("", digest(leaf))
            except Exception:  # noqa: BLE001 - said by the entry's own row, if it is asked for
                out[i], unreadable = ("", UNREADABLE), True
    return out, unreadable


def _whole_row(walk: _Walk) -> tuple[str, str, str]:
    """The one row of a large value in the first round: a digest of its entries in the
    order they come (marshalled in runs, as :func:`_group_rows` takes them: ~0.05 s a
    million); where the ranks' differ, its groups are asked for, which do not depend on
    the order."""
    h = hashlib.blake2b(digest_size=8)
    unreadable = False
    for (paths, _), (taken, bad) in zip(walk.runs, walk.digested(), strict=True):
        unreadable |= bad
        h.update(marshal.dumps((paths, taken), 2))
    return WHOLE, f"{walk.count} entries", UNREADABLE if unreadable else h.hexdigest()


def _group_rows(walk: _Walk) -> list[tuple[str, str, str]]:
    """One row per group: how many entries it has and a digest of them all (or
    :data:`UNREADABLE` where one of them could not be read).

    A group's digest is over its entries' bytes, sorted: the same whatever order the
    entries come in. An entry's bytes are the marshal (version 2: no references, so equal
    values give equal bytes whichever objects they share) of ``(path, leaf)`` for a
    scalar -- ``1``, ``True`` and ``1.0`` told apart, as an entry's own digest does -- and
    of ``(path, ("", digest))`` for any other leaf. Made by ``map`` in C and sorted while
    they are small, in one list per group: a million entries take ~0.3 s."""
    members: list[list[bytes]] = [[] for _ in range(GROUPS)]
    unreadable = [0] * GROUPS
    for (paths, _), groups, (leaves, bad) in zip(
        walk.runs, walk.groups(), walk.digested(), strict=True
    ):
        if bad:  # the group is unreadable; its entries say why when they are asked for
            for g, leaf in zip(groups, leaves, strict=True):
                if leaf == ("", UNREADABLE):
                    unreadable[g] += 1
        blobs = map(marshal.dumps, zip(paths, leaves, strict=True), itertools.repeat(2))
        for g, blob in zip(groups, blobs, strict=True):
            members[g].append(blob)
    rows = []
    for g, got in enumerate(members):
        if got:
            got.sort()
            sums = hashlib.blake2b(b"".join(got), digest_size=8).hexdigest()
            rows.append(
                (f"{GROUP}{g}", f"{len(got)} entries", UNREADABLE if unreadable[g] else sums)
            )
    return rows


def digests(
    names: list[str],
    groups: dict[str, list[int]] | None = None,
    whole: bool = True,
    token: str | None = None,
) -> dict[str, Any]:
    """name -> ``[(path, description, digest), ...]`` (or ``{"error": why}``): a large
    value's one :data:`WHOLE` row (``whole=False``: its group rows); with ``groups`` (name
    -> group numbers), the rows of those groups' entries only. ``token``: the comparison
    this round is of (its walks are kept for its next rounds, until :func:`forget`)."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            only = None if groups is None else set(groups.get(name, ()))
            out[name] = _rows_of(_walk(name, token), only, whole)
        except Exception as exc:  # noqa: BLE001 - said per name, the others still compared
            out[name] = {"error": f"{type(exc).__name__}: {_clip(str(exc))}"}
    return out


def values(wanted: dict[str, list[str]], token: str | None = None) -> dict[str, dict[str, Any]]:
    """The leaves ``wanted`` (name -> paths) as plain data the kernel can compare
    (tensors as NumPy arrays of at most :data:`MAX_DETAIL_ELEMENTS` elements)."""
    import torch

    out: dict[str, dict[str, Any]] = {}
    for name, paths in wanted.items():
        want = set(paths)
        found: dict[str, Any] = {}
        try:
            for paths, leaves in _walk(name, token).runs:
                if want.isdisjoint(paths):
                    continue
                for path, leaf in zip(paths, leaves, strict=True):
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
    "WHOLE",
    "MAX_ENTRIES",
    "RNG",
    "describe",
    "digest",
    "digests",
    "entries",
    "forget",
    "group_of",
    "values",
]
