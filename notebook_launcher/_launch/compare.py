"""Values compared across ranks: which ranks differ, in which entries, by how much
(kernel side of ``session.compare`` / ``%rankdiff``; the ranks' side is
``_worker.compare``).

Two rounds. Every rank sends a digest per entry (a module's parameters and buffers, an
optimizer's state, a tensor, the leaves of a structure, the random state): entries with
one digest on every rank are identical, and said so in one line. Only the entries whose
digests differ are sent whole (:func:`details`), and for each rank that differs from the
reference -- the digest most ranks have, rank order breaking ties -- the report says how
many elements differ, the largest difference and where::

    model: ranks differ in 2 of 4 entries (2 identical)
      0.weight (float32 [2, 4]): rank 1 differs from ranks 0, 2, 3 in 8 of 8 elements;
        largest |difference| 0.0312 at [1, 3] (0.5 vs 0.4688)
    optimizer: identical on ranks 0-3 (6 entries)

A value of more than 10,000 entries comes as one digest of all its entries in their
order (``_worker.compare.WHOLE``): the same on every rank, it is identical. Where not, it
is asked for as group digests over all its entries (``_worker.compare.GROUPS``, which do
not depend on the order: :func:`wholes_wanted`, :func:`expand`), and the groups that differ
entry by entry (:func:`groups_wanted`, :func:`expand`), so "identical" is said only of what
was compared whole. An entry a rank could not read is named, with why, and the others are
compared.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._stacks import rank_list

Rows = list[tuple[str, str, str]]  # (path, description, digest)

#: The ranks' markers (``_worker.compare``): a group's row, the row of entries not listed,
#: the digest of an entry that could not be read, a value sent as its repr.
GROUP = "\0group "
WHOLE = "\0whole"
MORE = "\0more"
UNREADABLE = ""
SHOWN = "\0repr"
ERROR = "\0error"


@dataclass
class EntryDiff:
    """One entry whose ranks do not agree: the ranks per digest, and the details."""

    name: str
    path: str
    description: dict[int, str]
    groups: list[list[int]]  # ranks with the same digest, the reference group first
    details: dict[int, str] = field(default_factory=dict)  # rank -> how it differs

    @property
    def reference(self) -> list[int]:
        return self.groups[0]


@dataclass
class ValueDiff:
    """One compared name: its entries, identical or not."""

    name: str
    ranks: list[int]
    entries: int = 0
    differing: list[EntryDiff] = field(default_factory=list)
    error: dict[int, str] = field(default_factory=dict)  # rank -> why it could not be read
    only_on: dict[str, list[int]] = field(default_factory=dict)  # path -> ranks that have it
    unreadable: dict[str, dict[int, str]] = field(default_factory=dict)  # path -> rank -> why
    unlisted: int = 0  # entries of differing groups that were not listed one by one

    @property
    def identical(self) -> bool:
        return not (self.differing or self.error or self.only_on or self.unreadable) and not (
            self.unlisted
        )

    def lines(self) -> list[str]:
        who = rank_list(self.ranks)
        if self.error:
            same: dict[str, list[int]] = {}
            for r, why in sorted(self.error.items()):
                same.setdefault(why.replace(f" on rank {r}", ""), []).append(r)
            return [
                f"{self.name}: could not be read on "
                + "; ".join(f"{rank_list(rs)} ({why})" for why, rs in same.items())
            ]
        n = self.entries
        if self.identical:
            return [f"{self.name}: identical on {who} ({n:,} entr{'y' if n == 1 else 'ies'})"]
        groups = [d for d in self.differing if _gathers(d.path)]
        named = [d for d in self.differing if not _gathers(d.path)]
        bad = len(named) + len(self.only_on)
        unread = len(self.unreadable)
        if self.unlisted or groups:
            out = [
                f"{self.name}: ranks differ in {bad + unread:,} of {n:,} entries listed below and "
                f"in {self.unlisted:,} more not listed one by one (compare a part of it to see them)"
            ]
        else:
            head = f"ranks differ in {bad:,} of {n:,} entries" if bad else ""
            if unread:
                told = f"{unread:,} of {n:,} entries could not be compared"
                head = f"{head}, {told.split(' of ')[0]} could not be compared" if bad else told
            out = [f"{self.name}: {head} ({n - bad - unread:,} identical)"]
        for path, by_rank in sorted(self.unreadable.items()):
            said: dict[str, list[int]] = {}
            for r, text in sorted(by_rank.items()):
                said.setdefault(text, []).append(r)
            out.append(
                f"  {path}: could not be compared on "
                + "; ".join(f"{rank_list(rs)} ({text})" for text, rs in said.items())
            )
        for path, have in sorted(self.only_on.items()):
            out.append(f"  {path}: only on {rank_list(have)}")
        for d in named:
            desc = d.description.get(d.reference[0], "")
            path = "the value" if d.path in ("(value)", "(tensor)") else d.path
            head = f"  {path} ({desc})" if desc and desc != RANDOM else f"  {path}"
            for group in d.groups[1:]:
                rank = group[0]
                how = d.details.get(rank, "")
                out.append(
                    f"{head}: {rank_list(group)} differ{'s' if len(group) == 1 else ''} "
                    f"from {rank_list(d.reference)}" + (f" {how}" if how else "")
                )
        return out


@dataclass
class Comparison:
    """What ``session.compare(...)`` returns: printed, one block per name."""

    values: list[ValueDiff]

    @property
    def identical(self) -> bool:
        return all(v.identical for v in self.values)

    def __str__(self) -> str:
        return "\n".join(line for v in self.values for line in v.lines())

    def __repr__(self) -> str:
        return str(self)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


def compare(per_rank: Mapping[int, Mapping[str, Any]], names: Sequence[str]) -> Comparison:
    """The first round: ``per_rank[rank][name]`` is that rank's rows (or an error)."""
    ranks = sorted(per_rank)
    out = []
    for name in names:
        value = ValueDiff(name, ranks)
        rows_of: dict[int, Rows] = {}
        for rank in ranks:
            got = per_rank[rank].get(name)
            if isinstance(got, dict):
                value.error[rank] = got.get("error", "?")
            else:
                rows_of[rank] = list(got or [])
        if value.error:
            out.append(value)
            continue
        value.entries = max(
            (
                sum(int(d.split()[0]) if _gathers(p) else 1 for p, d, _ in rows)
                for rows in rows_of.values()
            ),
            default=0,
        )
        _fold(value, rows_of)
        out.append(value)
    return Comparison(out)


def _gathers(path: str) -> bool:
    """A row of many entries: a group's, or a large value's whole."""
    return path == WHOLE or path.startswith(GROUP)


def _fold(value: ValueDiff, rows_of: Mapping[int, Rows]) -> None:
    """Compare the rows of each rank (entries, or groups of them), entry by entry."""
    ranks = value.ranks
    paths: dict[str, None] = {}
    for rank in ranks:
        for path, _, _ in rows_of[rank]:
            paths.setdefault(path, None)
    table = {r: {p: (d, h) for p, d, h in rows_of[r]} for r in ranks}
    for path in paths:
        if path == MORE:
            value.unlisted += max(int(table[r].get(MORE, ("0",))[0]) for r in ranks)
            continue
        have = [r for r in ranks if path in table[r]]
        if len(have) != len(ranks):
            if _gathers(path):  # (what some ranks lack: compared in parts)
                value.differing.append(EntryDiff(value.name, path, {}, [have, []]))
            else:
                value.only_on[path] = have
            continue
        unread = {r: table[r][path][0] for r in ranks if table[r][path][1] == UNREADABLE}
        if unread and not _gathers(path):
            value.unreadable[path] = unread
            continue
        by_digest: dict[str, list[int]] = {}
        for r in ranks:
            by_digest.setdefault(table[r][path][1], []).append(r)
        if len(by_digest) == 1 and not unread:
            continue
        groups = sorted(by_digest.values(), key=lambda g: (-len(g), g[0]))
        value.differing.append(
            EntryDiff(value.name, path, {r: table[r][path][0] for r in ranks}, groups)
        )


def wholes_wanted(comparison: Comparison) -> list[str]:
    """The names of the large values whose wholes differ (or hold an entry some rank could
    not read): the round that asks for their groups."""
    return [
        value.name for value in comparison.values if any(d.path == WHOLE for d in value.differing)
    ]


def groups_wanted(comparison: Comparison) -> dict[str, list[int]]:
    """name -> the groups of entries that differ (or hold an entry some rank could not
    read): the round that asks for their entries one by one."""
    out: dict[str, list[int]] = {}
    for value in comparison.values:
        ids = [int(d.path[len(GROUP) :]) for d in value.differing if d.path.startswith(GROUP)]
        if ids:
            out[value.name] = ids
    return out


def expand(comparison: Comparison, per_rank: Mapping[int, Mapping[str, Any]]) -> None:
    """The round that looks closer: ``per_rank[rank][name]`` is the rows that name's
    differing whole is made of (its groups), or its differing groups (their entries); they
    replace the whole or the groups (a rank that could not send them: the name could not
    be read there)."""
    for value in comparison.values:
        if not any(_gathers(d.path) for d in value.differing):
            continue
        rows_of: dict[int, Rows] = {}
        for rank in value.ranks:
            got = per_rank.get(rank, {}).get(value.name)
            if isinstance(got, dict) or got is None:
                value.error[rank] = got.get("error", "?") if isinstance(got, dict) else "?"
            else:
                rows_of[rank] = list(got)
        if value.error:
            continue
        value.differing = [d for d in value.differing if not _gathers(d.path)]
        value.only_on, value.unreadable, value.unlisted = {}, {}, 0
        _fold(value, rows_of)


#: How the ranks describe a random generator's state (``_worker.compare.RANDOM``).
RANDOM = "random state"


def wanted(comparison: Comparison) -> dict[str, list[str]]:
    """name -> the paths whose details the second round fetches (not random states: a
    different state is all there is to say)."""
    out: dict[str, list[str]] = {}
    for value in comparison.values:
        for d in value.differing:
            if _gathers(d.path):
                continue
            if RANDOM in d.description.values():
                for group in d.groups[1:]:
                    d.details[group[0]] = "(a different random state: seed every rank alike)"
        paths = [d.path for d in value.differing if not d.details]
        if paths:
            out[value.name] = paths
    return out


def details(
    comparison: Comparison, per_rank: Mapping[int, Mapping[str, Mapping[str, Any]]]
) -> None:
    """The second round: fill in how each differing rank differs from the reference,
    from the values ``per_rank[rank][name][path]``."""
    for value in comparison.values:
        for d in value.differing:
            if d.details or _gathers(d.path):
                continue
            ref_values = per_rank.get(d.reference[0], {}).get(value.name, {})
            for group in d.groups[1:]:
                other_values = per_rank.get(group[0], {}).get(value.name, {})
                unread = [
                    f"{why} on rank {r}"
                    for r, got in ((d.reference[0], ref_values), (group[0], other_values))
                    for why in [got.get(ERROR)]
                    if why
                ]
                if unread:
                    d.details[group[0]] = f"(its values could not be read: {'; '.join(unread)})"
                    continue
                try:
                    how = describe_difference(ref_values.get(d.path), other_values.get(d.path))
                except Exception as exc:  # noqa: BLE001 - the digests differ: that stands
                    how = f"(how could not be told: {type(exc).__name__}: {exc})"
                d.details[group[0]] = how


def describe_difference(ref: Any, other: Any) -> str:
    """How ``other`` differs from ``ref``: ``in 3 of 8 elements; largest |difference| 0.5 at
    [1, 3] (1.5 vs 1.0)`` for arrays, ``(0.002 vs 0.001)`` for plain values (``other``'s
    value first)."""
    if isinstance(ref, tuple) and ref[:1] == ("too large",):
        return f"(a tensor of {ref[1]:,} elements: norms {ref[2]:.6g} vs {other[2]:.6g})"
    shape_r, shape_o = getattr(ref, "shape", None), getattr(other, "shape", None)
    if shape_r is None or shape_o is None:
        return f"({_short(other)} vs {_short(ref)})"
    if tuple(shape_r) != tuple(shape_o):
        return f"in shape: {list(shape_r)} vs {list(shape_o)}"
    import numpy as np

    a = np.asarray(ref)
    b = np.asarray(other)
    if a.dtype.kind in "fc" or b.dtype.kind in "fc":
        diff = np.abs(a.astype(np.complex128 if a.dtype.kind == "c" else np.float64) - b)
        unequal = ~((a == b) | (np.isnan(a) & np.isnan(b)))
    else:
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        unequal = a != b
    count = int(np.count_nonzero(unequal))
    if count == 0:
        return "(the same values, stored differently)"
    if a.ndim == 0:
        return f"by {float(diff):.6g} ({_short(b.item())} vs {_short(a.item())})"
    finite = np.where(np.isnan(diff), np.inf, diff)
    flat = int(np.argmax(finite))
    at = [int(i) for i in np.unravel_index(flat, a.shape)]
    return (
        f"in {count:,} of {a.size:,} elements; largest |difference| {float(finite.flat[flat]):.6g} "
        f"at {at} ({_short(b.flat[flat].item())} vs {_short(a.flat[flat].item())})"
    )


def _short(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == SHOWN:
        text = str(value[1])
        return text if len(text) <= 40 else text[:37] + "..."
    text = f"{value:.6g}" if isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


__all__ = [
    "Comparison",
    "EntryDiff",
    "ValueDiff",
    "compare",
    "describe_difference",
    "details",
    "expand",
    "groups_wanted",
    "wholes_wanted",
]
