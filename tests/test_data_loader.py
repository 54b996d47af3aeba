"""Sharding of DataLoaders across ranks: pure sampler logic here, real ranks at the end."""

from __future__ import annotations

import itertools
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

from notebook_launcher import notebook_launcher
from notebook_launcher.data_loader import (
    BatchSamplerShard,
    DataLoaderShard,
    IterableDatasetShard,
    SeedableRandomSampler,
    prepare_data_loader,
    skip_first_batches,
)
from notebook_launcher.state import GradientState

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("one_torch_thread")]


def shards(n: int, bs: int, world: int, **kw: Any) -> list[list[list[int]]]:
    drop_last = kw.pop("drop_last", False)
    base = BatchSampler(SequentialSampler(range(n)), bs, drop_last)
    return [list(BatchSamplerShard(base, world, r, **kw)) for r in range(world)]


def test_batch_sampler_shard_examples() -> None:
    # 10 samples, batch 2, 2 ranks: rank 1's third batch wraps around to the start
    assert shards(10, 2, 2) == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
    # short last batch is completed from the first samples
    assert shards(7, 2, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 0]]]
    assert shards(7, 2, 2, even_batches=False) == [[[0, 1], [4, 5]], [[2, 3], [6]]]
    assert shards(7, 2, 2, drop_last=True) == [[[0, 1]], [[2, 3]]]
    # split_batches: each rank a slice of every batch
    assert shards(7, 4, 2, split_batches=True) == [[[0, 1], [4, 5]], [[2, 3], [6, 0]]]
    assert shards(6, 4, 2, split_batches=True, even_batches=False) == [
        [[0, 1], [4, 5]],
        [[2, 3]],
    ]
    # fewer samples than one global step: wrap around several times
    assert shards(3, 2, 3) == [[[0, 1]], [[2, 0]], [[1, 2]]]


CASES = [
    (n, bs, world, split, even)
    for n in (1, 5, 12, 13, 17)
    for bs in (2, 3, 4)
    for world in (2, 3)
    for split in (False, True)
    for even in (True, False)
    if not (split and bs % world)
]


@pytest.mark.parametrize(("n", "bs", "world", "split", "even"), CASES)
def test_batch_sampler_shard_covers_dataset(
    n: int, bs: int, world: int, split: bool, even: bool
) -> None:
    per_rank = shards(n, bs, world, split_batches=split, even_batches=even)
    base = BatchSampler(SequentialSampler(range(n)), bs, False)
    for r, batches in enumerate(per_rank):
        shard = BatchSamplerShard(base, world, r, split_batches=split, even_batches=even)
        assert len(shard) == len(batches)
    if even:
        # same number of equally sized batches on every rank
        assert len({len(b) for b in per_rank}) == 1
        local = bs // world if split else bs
        assert all(len(batch) == local for b in per_rank for batch in b)
        # what gather_for_metrics sees: per step, ranks' batches concatenated in rank order;
        # dropping everything after `remainder` in the last step gives the dataset exactly
        total = bs if split else bs * world
        remainder = n % total
        steps = [sum((b[i] for b in per_rank), []) for i in range(len(per_rank[0]))]
        if remainder:
            steps[-1] = steps[-1][:remainder]
        assert sum(steps, []) == list(range(n))
    else:
        assert sorted(i for b in per_rank for batch in b for i in batch) == list(range(n))


@pytest.mark.parametrize(
    ("n", "bs", "world", "even", "drop_last"),
    [
        (n, bs, w, e, d)
        for n in (1, 7, 12, 13)
        for bs in (2, 3)
        for w in (2, 3)
        for e in (True, False)
        for d in (False, True)
    ],
)
def test_fast_path_matches_generic_path(
    n: int, bs: int, world: int, even: bool, drop_last: bool
) -> None:
    # a plain BatchSampler takes the fast path; the same batches in a custom batch sampler
    # (not a BatchSampler) take the generic one
    base = BatchSampler(SequentialSampler(range(n)), bs, drop_last)
    custom = Batches(list(base), bs, drop_last)
    for r in range(world):
        fast = BatchSamplerShard(base, world, r, even_batches=even)
        generic = BatchSamplerShard(custom, world, r, even_batches=even)
        assert list(fast) == list(generic)
        assert len(fast) == len(list(fast))


class Batches(list):  # type: ignore[type-arg]
    """A custom batch sampler: a list of batches with the BatchSampler fields."""

    def __init__(self, batches: list[list[int]], batch_size: int, drop_last: bool) -> None:
        super().__init__(batches)
        self.batch_size = batch_size
        self.drop_last = drop_last


def test_batch_sampler_shard_rejects_bad_split() -> None:
    base = BatchSampler(SequentialSampler(range(10)), 3, False)
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        BatchSamplerShard(base, 2, 0, split_batches=True)


class Stream(IterableDataset):
    def __init__(self, n: int, with_len: bool = True) -> None:
        self.n = n
        self.with_len = with_len

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        if not self.with_len:
            raise TypeError("no length")
        return self.n


@pytest.mark.parametrize(
    ("n", "bs", "world", "even"),
    [(7, 2, 2, True), (7, 2, 2, False), (9, 2, 3, True), (4, 3, 2, True)],
)
def test_iterable_dataset_shard(n: int, bs: int, world: int, even: bool) -> None:
    parts = [
        list(IterableDatasetShard(Stream(n), bs, False, world, r, even_batches=even))
        for r in range(world)
    ]
    for r, part in enumerate(parts):
        assert len(IterableDatasetShard(Stream(n), bs, False, world, r, even_batches=even)) == len(
            part
        )
    if even:
        assert len({len(p) for p in parts}) == 1
        merged = [
            x
            for step in range(len(parts[0]) // bs)
            for p in parts
            for x in p[step * bs : (step + 1) * bs]
        ]
        assert merged[:n] == list(range(n))
    else:
        assert sorted(itertools.chain(*parts)) == list(range(n))


def test_seedable_sampler_depends_on_seed_and_epoch_only() -> None:
    a = SeedableRandomSampler(range(20), data_seed=7)
    b = SeedableRandomSampler(range(20), data_seed=7)
    torch.rand(5)  # global RNG use in between changes nothing
    assert list(a) == list(b)
    assert a.epoch == b.epoch == 1  # a full pass advances the epoch, as in Accelerate
    a.set_epoch(1)
    first_epoch1 = list(a)
    b.set_epoch(0)
    assert first_epoch1 != list(b) and sorted(first_epoch1) == list(range(20))
    a.set_epoch(1)
    assert list(a) == first_epoch1


def test_seedable_sampler_seeds_from_initial_seed_without_drawing() -> None:
    torch.manual_seed(123)
    state = torch.get_rng_state()
    sampler = SeedableRandomSampler(range(10))
    assert sampler.initial_seed == 123 == torch.random.initial_seed()
    assert torch.equal(torch.get_rng_state(), state)  # the global stream was not touched


def test_data_loader_shard_tracks_gradient_state_nested() -> None:
    gs = GradientState()
    outer = prepare_data_loader(
        DataLoader(list(range(6)), batch_size=2), num_processes=1, process_index=0
    )
    inner = prepare_data_loader(
        DataLoader(list(range(4)), batch_size=2), num_processes=1, process_index=0
    )
    log: list[tuple[str, bool]] = []
    for batch in outer:
        assert gs.active_dataloader is outer
        log.append(("outer", gs.end_of_dataloader))
        if batch[0] == 2:
            for _ in inner:
                assert gs.active_dataloader is inner
                log.append(("inner", gs.end_of_dataloader))
            assert gs.active_dataloader is outer  # restored when the inner one ends
    assert gs.active_dataloader is None and gs.end_of_dataloader is False
    assert log == [
        ("outer", False),
        ("outer", False),
        ("inner", False),
        ("inner", True),
        ("outer", True),
    ]
    # leaving a loop early unregisters the loader too
    for _ in outer:
        break
    assert gs.active_dataloader is None
    assert gs.dataloader_references == [None]


def test_data_loader_shard_single_process_remainder_and_skip() -> None:
    loader = prepare_data_loader(
        DataLoader(list(range(7)), batch_size=3), num_processes=1, process_index=0
    )
    assert isinstance(loader, DataLoaderShard) and loader.remainder == 1
    assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5], [6]]
    assert len(loader) == 3
    skipped = skip_first_batches(loader, 2)
    assert [b.tolist() for b in skipped] == [[6]]
    plain = skip_first_batches(DataLoader(list(range(7)), batch_size=3), 1)
    assert [b.tolist() for b in plain] == [[3, 4, 5], [6]]
    empty = prepare_data_loader(DataLoader([], batch_size=3), num_processes=1, process_index=0)
    assert list(empty) == []
    assert GradientState().active_dataloader is None


def test_rank_share_with_worker_processes() -> None:
    # the share of rank 1 of 2, computed here without a process group, read by 2 workers
    loader = DataLoader(list(range(10)), batch_size=3, num_workers=2)
    shard = prepare_data_loader(loader, num_processes=2, process_index=1)
    handler = signal.getsignal(signal.SIGCHLD)  # torch installs its own for worker processes
    try:
        assert [b.tolist() for b in shard] == [[3, 4, 5], [9, 0, 1]]
    finally:
        signal.signal(signal.SIGCHLD, handler)
    assert len(shard) == 2 and shard.remainder == 4


def test_shuffle_gets_a_generator_seeded_from_the_global_rng() -> None:
    def order(seed: int) -> list[int]:
        torch.manual_seed(seed)
        loader = prepare_data_loader(
            DataLoader(list(range(16)), batch_size=4, shuffle=True),
            num_processes=1,
            process_index=0,
        )
        return [int(i) for b in loader for i in b]

    assert order(0) == order(0)
    assert order(0) != order(1)
    assert sorted(order(0)) == list(range(16))


# ------------------------------------------------------------------------- real ranks


def _ranks_worker(n: int) -> dict[str, Any]:
    from notebook_launcher.accelerator import Accelerator

    acc = Accelerator()
    out: dict[str, Any] = {}
    torch.manual_seed(100 + acc.process_index)  # different global RNG per rank on purpose
    loader = acc.prepare(DataLoader(torch.arange(n), batch_size=2, shuffle=True))
    for epoch in range(2):
        mine, gathered = [], []
        for batch in loader:
            mine += batch.tolist()
            gathered += acc.gather_for_metrics(batch).tolist()
        out[f"mine{epoch}"] = mine
        out[f"gathered{epoch}"] = gathered
    stream = acc.prepare(DataLoader(Stream(n), batch_size=2))
    out["stream"] = [x for b in stream for x in acc.gather_for_metrics(b).tolist()]
    uneven = acc.prepare(
        DataLoader(list(range(n)), batch_size=2, drop_last=False),
    )
    out["len"] = len(uneven)
    objs = []
    for batch in uneven:
        objs += acc.gather_for_metrics([f"s{int(i)}" for i in batch])
    out["objects"] = objs
    # dispatch_batches: rank 0 reads (a stream without length here) and sends the shares
    nolen = acc.prepare(DataLoader(Stream(n, with_len=False), batch_size=2))
    assert type(nolen).__name__ == "DataLoaderDispatcher"
    out["nolen"] = [x for b in nolen for x in acc.gather_for_metrics(b).tolist()]
    out["nolen_mine"] = [b.tolist() for b in nolen]
    words = prepare_data_loader(
        DataLoader(
            [(i, f"w{i}") for i in range(n)], batch_size=2 * acc.num_processes, shuffle=True
        ),
        dispatch_batches=True,
        split_batches=True,
    )
    out["words"] = [(b[0].tolist(), list(b[1])) for b in words]
    seeded = prepare_data_loader(
        DataLoader(list(range(n)), batch_size=2, shuffle=True),
        use_seedable_sampler=True,
        data_seed=3,
    )
    out["seeded"] = [[int(i) for b in seeded for i in b] for _ in range(2)]
    split = prepare_data_loader(
        DataLoader(list(range(n)), batch_size=2 * acc.num_processes), split_batches=True
    )
    out["split"] = [b.tolist() for b in split]
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world", "n"), [(2, 11), (3, 13)])
def test_sharding_on_real_ranks(world: int, n: int) -> None:
    results = notebook_launcher(_ranks_worker, args=(n,), num_processes=world, dashboard=False)
    for epoch in range(2):
        # each rank a distinct part; all together the dataset plus wrap-around duplicates
        parts = [r[f"mine{epoch}"] for r in results]
        assert len({len(p) for p in parts}) == 1
        seen = set().union(*map(set, parts))
        assert seen == set(range(n))
        # gather_for_metrics gives exactly the dataset, identically on every rank
        gathered = results[0][f"gathered{epoch}"]
        assert len(gathered) == n and sorted(gathered) == list(range(n))
        assert all(r[f"gathered{epoch}"] == gathered for r in results)
    # a new permutation per epoch, shared by all ranks
    assert results[0]["gathered0"] != results[0]["gathered1"]
    assert results[0]["stream"] == list(range(n))
    assert results[0]["objects"] == [f"s{i}" for i in range(n)]
    assert results[0]["len"] == -(-n // (2 * world))
    assert results[0]["nolen"] == list(range(n))  # remainder known without a length
    mine = [r["nolen_mine"] for r in results]
    assert mine[1][0] == [2, 3] and len({len(m) for m in mine}) == 1
    for r in results:  # numbers and strings travel together, each rank a slice of 2 of each batch
        for ids, words in r["words"]:
            assert words == [f"w{i}" for i in ids]
    shares = [[i for ids, _ in r["words"] for i in ids] for r in results]
    assert set().union(*map(set, shares)) == set(range(n))
    # seedable sampler: no communication, yet one permutation per epoch shared by the ranks
    for epoch in range(2):
        parts = [r["seeded"][epoch] for r in results]
        assert set().union(*map(set, parts)) == set(range(n))
        assert len({len(p) for p in parts}) == 1
    assert results[0]["seeded"][0] != results[0]["seeded"][1]
    # split_batches: rank r gets the r-th pair of every global batch of 2 * world
    assert results[1]["split"][0] == [2, 3]
    assert all(len(b) == 2 for r in results for b in r["split"])


def test_a_batch_sampler_passed_as_the_sampler_is_sharded() -> None:
    # DataLoader(sampler=BatchSampler(...), batch_size=None): the dataset gets whole lists of
    # indices (Accelerate's test_distributed_data_loop uses this form).
    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 10

        def __getitem__(self, index: list[int]) -> torch.Tensor:
            return torch.tensor(index)

    sampler = BatchSampler(SequentialSampler(range(10)), batch_size=2, drop_last=False)
    loader = DataLoader(Rows(), sampler=sampler, batch_size=None)
    shards = [prepare_data_loader(loader, num_processes=2, process_index=r) for r in range(2)]
    assert [b.tolist() for b in shards[0]] == [[0, 1], [4, 5], [8, 9]]
    assert [b.tolist() for b in shards[1]] == [[2, 3], [6, 7], [0, 1]]  # even_batches wraps
    skipped = skip_first_batches(shards[1], 1)
    assert [b.tolist() for b in skipped] == [[6, 7], [0, 1]]


@pytest.mark.parametrize(
    ("pinned", "asked", "expected"),
    [(True, False, True), (False, False, False), (False, True, True)],
)
def test_a_pinned_loader_copies_to_the_gpu_without_blocking(
    monkeypatch: pytest.MonkeyPatch, pinned: bool, asked: bool, expected: bool
) -> None:
    """What a hand-written loop does (``.to(device, non_blocking=True)`` from pinned memory),
    so the CPU queues the next step while the GPU runs this one. Asked of a CUDA device
    without reaching it: the copy itself is a spy."""
    from notebook_launcher import data_loader
    from notebook_launcher.utils import operations

    seen = []
    monkeypatch.setattr(
        operations,
        "send_to_device",
        lambda batch, device, non_blocking=False: seen.append(non_blocking),
    )
    loader = data_loader.DataLoaderShard(
        list(range(4)), device=torch.device("cuda", 0), batch_size=2, non_blocking=asked
    )
    loader.pin_memory = pinned  # (pinning itself needs a GPU; only the flag matters here)
    loader._to_device(torch.zeros(2))
    assert seen == [expected]
