"""Sharding of PyTorch DataLoaders across ranks, the way Accelerate does it.

``prepare_data_loader`` turns one DataLoader (the same on every rank) into a
:class:`DataLoaderShard` that yields, on each rank, a distinct part of every global step:

* ``split_batches=False`` (default): the loader's batch size is per rank; global step ``k``
  is made of the sampler's batches ``k*n .. k*n+n-1`` and rank ``r`` gets batch ``k*n+r``.
* ``split_batches=True``: the loader's batch size is global; rank ``r`` gets the ``r``-th
  slice of every batch.

With ``even_batches=True`` the last, incomplete global step is completed by wrapping around
to the first samples of the epoch, so every rank yields the same number of equally sized
batches; ``remainder`` records how many samples of that last global step are real, and
``Accelerator.gather_for_metrics`` drops the rest.

While a :class:`DataLoaderShard` is iterated it registers itself with ``GradientState`` (so
``accelerator.gradient_state.active_dataloader`` / ``end_of_dataloader`` work, nested loaders
included); it looks one batch ahead to know when the current batch is the last.

Shuffling: every rank must draw the same permutation. A ``RandomSampler`` keeps (or gets) a
generator whose state rank 0 broadcasts at the start of every epoch and which checkpoints
record; ``use_seedable_sampler=True`` instead uses :class:`SeedableRandomSampler`, whose
order depends only on ``(seed, epoch)``. The global RNG is drawn from exactly where
Accelerate draws: each epoch's iterator draws torch's worker base seed, and a sampler without
a generator is seeded from it at prepare time (several processes) or at each epoch start
(one process, where ``RandomSampler`` would draw), so a seeded run gives the same batches and
models with either package. A ``skip_first_batches`` copy, which resumes an epoch begun
before a checkpoint, draws nothing, so the resumed run continues the same random stream.

Example::

    loader = DataLoader(dataset, batch_size=8, shuffle=True)
    loader = prepare_data_loader(loader, device=torch.device("cpu"))
    for batch in loader:  # this rank's share
        ...
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

#: DataLoader attributes carried over to the prepared loader (name, default).
_LOADER_ATTRS: tuple[tuple[str, Any], ...] = (
    ("num_workers", 0),
    ("collate_fn", None),
    ("pin_memory", False),
    ("timeout", 0),
    ("worker_init_fn", None),
    ("multiprocessing_context", None),
    ("generator", None),
    ("prefetch_factor", None),
    ("persistent_workers", False),
    ("pin_memory_device", ""),
    ("in_order", True),
)


def _loader_kwargs(dataloader: DataLoader) -> dict[str, Any]:
    import inspect

    accepted = inspect.signature(DataLoader.__init__).parameters
    kwargs: dict[str, Any] = {}
    for name, default in _LOADER_ATTRS:
        if name in accepted:
            kwargs[name] = getattr(dataloader, name, default)
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    return kwargs


def _state() -> Any:
    from .state import PartialState

    return PartialState()


def _check_split(batch_size: int, num_processes: int) -> None:
    """``split_batches`` cuts each batch into one equal piece per process."""
    if batch_size % num_processes != 0:
        raise ValueError(
            f"split_batches=True needs the batch size ({batch_size}) to be a round multiple of "
            f"the number of processes ({num_processes}); use a batch size of "
            f"{num_processes * math.ceil(batch_size / num_processes)}"
        )


class SeedableRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order depends only on ``(initial_seed, epoch)``.

    Every rank computes the same permutation without communicating, and a resumed run
    reproduces it after ``set_epoch(epoch)``. As in Accelerate, the seed is ``data_seed`` or
    else ``torch.random.initial_seed()`` (what ``set_seed``/``torch.manual_seed`` set; nothing
    is drawn from the global RNG), and each full pass advances the epoch by one.

    Example::

        sampler = SeedableRandomSampler(dataset, data_seed=42)
        sampler.set_epoch(3)
        order = list(sampler)   # epoch 3's order; the sampler is now at epoch 4
    """

    def __init__(
        self,
        data_source: Sized,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        data_seed: int | None = None,
    ) -> None:
        if generator is None:
            generator = torch.Generator()
        super().__init__(data_source, replacement, num_samples, generator)
        self.initial_seed = int(data_seed if data_seed is not None else torch.random.initial_seed())
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        assert self.generator is not None
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)


class BatchSamplerShard(BatchSampler):
    """This rank's share of the batches of ``batch_sampler`` (see the module docstring).

    Example (10 samples, batch size 2, 2 ranks, ``even_batches``: rank 1's last batch wraps)::

        >>> shard = BatchSamplerShard(BatchSampler(range(10), 2, False), 2, 1)
        >>> list(shard)
        [[2, 3], [6, 7], [0, 1]]
    """

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        # BatchSampler.__init__ validates a sampler we do not have: set the fields ourselves.
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.sampler: Any = getattr(batch_sampler, "sampler", None)
        self.batch_size: int | None = getattr(batch_sampler, "batch_size", None)  # type: ignore[assignment]
        self.drop_last: bool = bool(getattr(batch_sampler, "drop_last", False))
        if split_batches:
            if self.batch_size is None:
                raise ValueError("split_batches=True needs a batch sampler with a batch_size")
            _check_split(self.batch_size, num_processes)

    @property
    def total_batch_size(self) -> int | None:
        """Samples in one global step (all ranks together)."""
        if self.batch_size is None:
            return None
        return self.batch_size if self.split_batches else self.batch_size * self.num_processes

    def _num_samples(self) -> int | None:
        try:
            return len(self.sampler)
        except TypeError:
            return None

    def __len__(self) -> int:
        n_batches = len(self.batch_sampler)  # type: ignore[arg-type]
        n, r = self.num_processes, self.process_index
        if self.split_batches:
            if self.even_batches or self.drop_last:
                return n_batches
            samples = self._num_samples()
            assert self.batch_size is not None
            last = 0 if samples is None else samples % self.batch_size
            if last == 0:
                return n_batches
            return n_batches - 1 + (1 if last > r * (self.batch_size // n) else 0)
        full, left = divmod(n_batches, n)
        if self.drop_last:
            return full
        if self.even_batches:
            return full + (1 if left else 0)
        return full + (1 if r < left else 0)

    def __iter__(self) -> Iterator[list[int]]:
        if self.split_batches:
            return self._iter_split()
        return self._iter_grouped()

    def _pad(self, flat: list[int], head: list[int], size: int) -> list[int]:
        if not head:
            head = list(flat)
        filler = itertools.islice(itertools.cycle(head), size - len(flat))
        return flat + list(filler)

    def _iter_grouped(self) -> Iterator[list[int]]:
        if type(self.batch_sampler) is BatchSampler:
            return self._iter_grouped_fast()
        return self._iter_grouped_generic()

    def _iter_grouped_fast(self) -> Iterator[list[int]]:
        """Same batches as the generic path for a plain ``BatchSampler``, read from its
        sampler one global step (``n * batch_size`` indices) at a time."""
        n, r = self.num_processes, self.process_index
        bs = self.batch_size
        assert bs is not None
        size = n * bs
        indices = iter(self.sampler)
        head: list[int] = []
        while True:
            chunk = list(itertools.islice(indices, size))
            if len(chunk) == size:
                if not head:
                    head = chunk
                yield chunk[r * bs : (r + 1) * bs]
                continue
            if not chunk or self.drop_last:
                return
            if self.even_batches:
                yield self._pad(chunk, head, size)[r * bs : (r + 1) * bs]
            elif r * bs < len(chunk):
                yield chunk[r * bs : (r + 1) * bs]
            return

    def _iter_grouped_generic(self) -> Iterator[list[int]]:
        n, r, bs = self.num_processes, self.process_index, self.batch_size
        group: list[list[int]] = []
        head: list[int] = []
        first_batches: list[list[int]] = []  # batches of varying size: pad with whole ones
        keep_head = self.even_batches and not self.drop_last
        for batch in self.batch_sampler:
            batch = list(batch)
            if keep_head and bs is not None and len(head) < n * bs:
                head.extend(batch[: n * bs - len(head)])
            if keep_head and bs is None and len(first_batches) < n:
                first_batches.append(batch)
            group.append(batch)
            if len(group) == n and (bs is None or len(batch) == bs):
                yield group[r]
                group = []
        if not group or self.drop_last:
            return
        if not self.even_batches:
            if r < len(group):
                yield group[r]
            return
        if bs is None:  # the missing batches of the last step: the epoch's first ones
            yield (
                group[r] if r < len(group) else first_batches[(r - len(group)) % len(first_batches)]
            )
            return
        flat = self._pad([i for b in group for i in b], head, n * bs)
        yield flat[r * bs : (r + 1) * bs]

    def _iter_split(self) -> Iterator[list[int]]:
        assert self.batch_size is not None
        bs, r = self.batch_size, self.process_index
        local = bs // self.num_processes
        head: list[int] = []
        for batch in self.batch_sampler:
            batch = list(batch)
            if not head:
                head = batch
            if len(batch) == bs:
                yield batch[r * local : (r + 1) * local]
            elif not self.drop_last:
                if self.even_batches:
                    batch = self._pad(batch, head, bs)
                part = batch[r * local : (r + 1) * local]
                if part:
                    yield part


class IterableDatasetShard(IterableDataset):
    """This rank's share of an iterable dataset: global steps of ``total_batch_size`` samples.

    Every rank iterates the whole underlying dataset and keeps its slice of each group of
    ``batch_size * num_processes`` samples (``batch_size`` when ``split_batches``); with
    ``even_batches`` (and not ``drop_last``) the last group is completed from its first samples.

    Example::

        shard = IterableDatasetShard(stream, batch_size=4, num_processes=2, process_index=1)
        loader = DataLoader(shard, batch_size=4)   # samples 4-7, 12-15, ... of the stream
    """

    def __init__(
        self,
        dataset: Iterable[Any],
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        if split_batches:
            _check_split(batch_size, num_processes)
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.epoch = 0

    @property
    def total_batch_size(self) -> int:
        return self.batch_size if self.split_batches else self.batch_size * self.num_processes

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        total = len(self.dataset)  # type: ignore[arg-type]
        step = self.total_batch_size
        local = step // self.num_processes
        if self.drop_last:
            return (total // step) * local
        if self.even_batches:
            return math.ceil(total / step) * local
        full, last = divmod(total, step)
        return full * local + min(local, max(0, last - self.process_index * local))

    def __iter__(self) -> Iterator[Any]:
        step = self.total_batch_size
        local = step // self.num_processes
        lo, hi = self.process_index * local, (self.process_index + 1) * local
        buffer: list[Any] = []
        head: list[Any] = []
        for item in self.dataset:
            buffer.append(item)
            if len(buffer) == step:
                yield from buffer[lo:hi]
                if not head:
                    head = buffer
                buffer = []
        if buffer and not self.drop_last:
            if self.even_batches:
                source = head or list(buffer)
                buffer += list(itertools.islice(itertools.cycle(source), step - len(buffer)))
            yield from buffer[lo:hi]


class SkipBatchSampler(BatchSampler):
    """Yields the batches of ``batch_sampler`` after skipping the first ``skip_batches``."""

    def __init__(self, batch_sampler: Iterable[list[int]], skip_batches: int = 0) -> None:
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches
        self.sampler: Any = getattr(batch_sampler, "sampler", None)
        self.batch_size: int | None = getattr(batch_sampler, "batch_size", None)  # type: ignore[assignment]
        self.drop_last: bool = bool(getattr(batch_sampler, "drop_last", False))

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.skip_batches, None)

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip_batches)  # type: ignore[arg-type]


class DataLoaderStateMixin:
    """What a prepared loader tells ``GradientState`` while it is iterated (Accelerate's
    mixin): ``end_of_dataloader`` (the last batch is being processed), ``remainder`` (real
    samples in the last global step, ``-1`` when unknown) and ``begin()`` / ``end()`` around
    an epoch. ``gradient_state`` is the shared :class:`~notebook_launcher.state.GradientState`.
    """

    end_of_dataloader: bool = False
    remainder: int = -1

    @property
    def gradient_state(self) -> Any:
        from .state import GradientState

        return GradientState()

    def reset(self) -> None:
        self.end_of_dataloader = False

    def begin(self) -> None:
        self.reset()
        self.gradient_state._add_dataloader(self)

    def end(self) -> None:
        self.gradient_state._remove_dataloader(self)


_STATEFUL_CLASSES: dict[type, type] = {}


def _stateful_class(cls: type) -> type:
    """``cls`` combined with torchdata's ``StatefulDataLoader`` (for
    ``use_stateful_dataloader=True``): an instance of both, named in this module so that it
    pickles."""
    found = _STATEFUL_CLASSES.get(cls)
    if found is None:
        from .utils.imports import is_torchdata_stateful_dataloader_available

        if not is_torchdata_stateful_dataloader_available():
            raise ImportError(
                "StatefulDataLoader is not available. Please install torchdata version 0.8.0 "
                "or higher to use it."
            )
        from torchdata.stateful_dataloader import StatefulDataLoader

        name = f"_Stateful{cls.__name__}"
        namespace = {"__module__": __name__, "__qualname__": name, "_stateful": True}
        found = type(name, (cls, StatefulDataLoader), namespace)
        _STATEFUL_CLASSES[cls] = found
        globals()[name] = found
    return found


class DataLoaderShard(DataLoaderStateMixin, DataLoader):
    """A DataLoader over this rank's share, that tells ``GradientState`` where it stands.

    Attributes:
        end_of_dataloader: True while the last batch of the epoch is being processed.
        remainder: real samples in the last global step (``-1`` when unknown, ``0`` when the
            last step is complete or was not padded).
        iteration: the epoch counter, passed to ``set_epoch`` of the sampler at each epoch.
        device: where batches are moved (``None``: left where the collate function put them).
        use_stateful_dataloader: the loader is also a torchdata ``StatefulDataLoader``:
            ``state_dict()`` mid-epoch records the position (the batch being processed is
            the last one counted), and ``load_state_dict`` resumes after it.

    Iterating a shuffled loader starts with a broadcast of rank 0's generator state: iterate
    prepared training loaders on every rank.

    Example::

        loader = prepare_data_loader(DataLoader(ds, batch_size=8), device=device,
                                     put_on_device=True)
        for batch in loader:
            ...   # GradientState().end_of_dataloader is True for the last batch
    """

    def __new__(cls, *args: Any, use_stateful_dataloader: bool = False, **kwargs: Any) -> Any:
        target = cls
        if use_stateful_dataloader and not getattr(cls, "_stateful", False):
            target = _stateful_class(cls)
        return super().__new__(target)

    def __init__(
        self,
        dataset: Any,
        device: torch.device | None = None,
        synchronized_generator: torch.Generator | None = None,
        skip_batches: int = 0,
        non_blocking: bool = False,
        remainder: int = -1,
        total_batch_size: int | None = None,
        use_stateful_dataloader: bool = False,
        reseed_generator: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, **kwargs)
        # seed synchronized_generator from the global RNG at each epoch start (see
        # prepare_data_loader); a skip_first_batches copy continues an epoch and does not
        self._reseed_generator = reseed_generator
        self.use_stateful_dataloader = self._is_stateful()
        self._stateful_snapshot: dict[str, Any] | None = None
        # the order state that goes with the snapshot (epoch, sampler generator states)
        self._snapshot_order: dict[str, Any] | None = None
        # set by load_state_dict of a stateful loader saved mid-epoch: the next iteration
        # continues that epoch (its seeds were drawn before the checkpoint)
        self._continues_epoch = False
        self.device = device
        self.synchronized_generator = synchronized_generator
        self.skip_batches = skip_batches
        self.non_blocking = non_blocking
        self.remainder = remainder
        self._total_batch_size = total_batch_size
        self.iteration = 0
        self.end_of_dataloader = False
        self.in_progress = False
        # generator states at the start of the current epoch (what a checkpoint saves mid-epoch)
        self._epoch_start_states: dict[str, torch.Tensor] = {}
        self._base_kwargs = {**kwargs, "use_stateful_dataloader": self.use_stateful_dataloader}
        # the loader a skip_first_batches copy stands in for: it takes over the epoch count
        self._parent: DataLoaderShard | None = None

    def _is_stateful(self) -> bool:
        return bool(getattr(type(self), "_stateful", False))

    def __getattr__(self, name: str) -> Any:
        if name == "base_dataloader":  # Accelerate's adapter attribute: the loader itself
            return self
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _snapshot(self, finished: bool = False) -> None:
        """Record the stateful position now: only the batches handed out are counted.

        With it, the order it belongs to: mid-epoch, the epoch and the sampler generators'
        states at the epoch's start (the resumed epoch draws the same permutation); at the
        epoch's end (``finished``), the next epoch and the generators as they are now.
        """
        if self.use_stateful_dataloader:
            if getattr(self, "_iterator", None) is None:  # a dispatcher's rank > 0 reads none
                if self._stateful_snapshot is None:
                    self._stateful_snapshot = self._fresh_stateful_state()
            else:
                self._stateful_snapshot = super().state_dict()  # type: ignore[misc]
            if finished:
                generators = {k: g.get_state() for k, g in self._generators().items()}
                self._snapshot_order = {"iteration": self.iteration + 1, "generators": generators}
            else:
                self._snapshot_order = {
                    "iteration": self.iteration,
                    "generators": dict(self._epoch_start_states),
                }

    def _base_iter(self) -> Iterator[Any]:
        return super().__iter__()

    def _reseeded_base_iter(self) -> Iterator[Any]:
        """The epoch's base iterator, the sampler's generator seeded from the global RNG
        where a ``RandomSampler`` without a generator draws its seed: right after the
        iterator's worker base seed, before the first index. A pool of workers draws its
        first indices while the iterator is created, so the seed is worked out first (the
        same two draws, peeked) and set before; the global RNG then advances past both."""
        gen = self.synchronized_generator
        assert gen is not None
        with _global_rng_untouched():
            if self.generator is None:
                _seed_from_global_rng()  # the base seed, drawn again by the iterator
            seed = _seed_from_global_rng()
        gen.manual_seed(seed)
        self._epoch_start_states = {k: g.get_state() for k, g in self._generators().items()}
        base = self._base_iter()  # draws the base seed
        _seed_from_global_rng()  # and the sampler's seed, as RandomSampler would
        return base

    # ----------------------------------------------------------------- state tracking
    @property
    def total_batch_size(self) -> int | None:
        return self._total_batch_size

    @property
    def total_dataset_length(self) -> int:
        dataset: Any = self.dataset
        if isinstance(dataset, IterableDatasetShard):
            dataset = dataset.dataset
        return len(dataset)

    def begin(self) -> None:
        self.in_progress = True
        super().begin()

    def end(self) -> None:
        self.in_progress = False
        super().end()

    def set_epoch(self, epoch: int) -> None:
        """Pass ``epoch`` to everything that reshuffles per epoch: the batch sampler (a custom
        one too), the batch samplers it wraps (sharding, skipping), their samplers, and the
        dataset -- each once."""
        self.iteration = epoch
        seen: set[int] = set()
        pending: list[Any] = [
            self.batch_sampler if self.batch_sampler is not None else self.sampler
        ]
        while pending:
            obj = pending.pop(0)
            if obj is None or id(obj) in seen:
                continue
            seen.add(id(obj))
            if hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
            pending.append(getattr(obj, "batch_sampler", None))
            pending.append(getattr(obj, "sampler", None))
        if id(self.dataset) not in seen and hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def _generators(self) -> dict[str, torch.Generator]:
        gens: dict[str, torch.Generator] = {}
        if self.synchronized_generator is not None:
            gens["sampler"] = self.synchronized_generator
        if self.generator is not None and self.generator is not self.synchronized_generator:
            gens["loader"] = self.generator
        return gens

    def _sync_generator(self) -> None:
        gen = self.synchronized_generator
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if gen is not None and distributed:
            device = _state().device if dist.get_backend() == "nccl" else torch.device("cpu")
            state = gen.get_state().to(device)
            dist.broadcast(state, src=0)
            gen.set_state(state.cpu())
        self._epoch_start_states = {k: g.get_state() for k, g in self._generators().items()}

    def _to_device(self, batch: Any) -> Any:
        if self.device is None or _on_device(batch, self.device):
            # the common case on CPU: nothing to move, and no per-leaf .to() calls (they
            # cost tens of microseconds per batch once the model's step has cooled the cache)
            return batch
        from .utils.operations import send_to_device

        # A pinned batch goes to the GPU without blocking, as a hand-written loop copies it:
        # a blocking copy waits for every kernel queued before it, so the CPU cannot queue
        # the next step while the GPU runs this one. Stream order keeps it correct, and
        # torch's pinned allocator keeps the buffer until the copy is done.
        fast = self.pin_memory and self.device.type == "cuda"
        return send_to_device(batch, self.device, non_blocking=self.non_blocking or fast)

    # ----------------------------------------------------------------- iteration
    def _start_epoch(self, read: bool = True) -> Iterator[Any] | None:
        """Sync the sampler's generator, set the epoch and (``read``) open the base loader.

        A stateful loader restored mid-epoch continues that epoch: torchdata fast-forwards
        the sampler, whose generators hold the epoch's start states again, and nothing is
        drawn from the global RNG (the epoch drew its worker base seed and sampler seed
        before the checkpoint; drawing again would shift the resumed run's random stream).
        Otherwise a single process's sampler generator is reseeded for the epoch
        (:meth:`_reseeded_base_iter`).
        """
        self._sync_generator()
        self.set_epoch(self.iteration)
        continues, self._continues_epoch = self._continues_epoch, False
        if not read:
            return None
        if continues:
            with _global_rng_untouched():
                return self._base_iter()
        if self._reseed_generator and self.synchronized_generator is not None:
            return self._reseeded_base_iter()
        return self._base_iter()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        base = self._start_epoch()
        assert base is not None
        self.begin()
        try:
            try:
                current = next(base)
            except StopIteration:
                return
            index = 0
            while True:
                current = self._to_device(current)
                self._snapshot()
                try:
                    upcoming = next(base)
                except StopIteration:
                    self.end_of_dataloader = True
                    # the epoch's end: a checkpoint taken from here on resumes at the next
                    # epoch (torchdata's state says its iterator finished), not after the
                    # last batch of this one, where nothing is left
                    self._snapshot(finished=True)
                    if index >= self.skip_batches:
                        yield current
                    break
                if index >= self.skip_batches:
                    yield current
                index += 1
                current = upcoming
            self.iteration += 1
            if self._parent is not None:
                self._parent.iteration = self.iteration
        finally:
            self.end()

    # ----------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to replay this loader's order: epoch and generator states.

        Saved mid-epoch, the generators' states are those of the start of the epoch, so that a
        resumed run replays the same order and ``skip_first_batches`` skips what was done.
        A stateful loader (``use_stateful_dataloader``) returns torchdata's state instead
        (the same dict as a ``StatefulDataLoader``'s), at the batch being processed;
        ``save_state`` saves its :meth:`order_state` beside it.
        """
        if not self.use_stateful_dataloader:
            return self.order_state()
        if self._stateful_snapshot is not None:  # also after a loop left with break
            return dict(self._stateful_snapshot)
        return self._fresh_stateful_state()

    def order_state(self) -> dict[str, Any]:
        """The epoch and the sampler generators' states that replay this loader's order
        from where :meth:`state_dict` stands (for a stateful loader: torchdata's state
        counts the batches, this says which permutation they come from)."""
        if self._stateful_snapshot is not None and self._snapshot_order is not None:
            return dict(self._snapshot_order)
        if self.in_progress:
            generators = dict(self._epoch_start_states)
        else:
            generators = {k: g.get_state() for k, g in self._generators().items()}
        return {"iteration": self.iteration, "generators": generators}

    def load_order_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`order_state` returned."""
        self.iteration = int(state["iteration"])
        for name, gen in self._generators().items():
            if name in state.get("generators", {}):
                gen.set_state(state["generators"][name])

    def _fresh_stateful_state(self) -> dict[str, Any]:
        """torchdata's state of a loader not iterated yet. To read it, torchdata creates the
        epoch's iterator, which draws its seed from the global RNG, and keeps it for the
        next ``__iter__``: saving a checkpoint would then move that draw (and every random
        number after it) to the moment of the save. The RNG is put back, and the iterator
        dropped, so that the epoch draws when it starts, as without a checkpoint."""
        with _global_rng_untouched():
            state: dict[str, Any] = super().state_dict()  # type: ignore[misc]
        self._iterator = None
        self._initial_iter_for_state_dict = False
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.use_stateful_dataloader:
            super().load_state_dict(state)  # type: ignore[misc]
            self._stateful_snapshot = None
            self._snapshot_order = None
            finished = bool(state.get("_iterator_finished", False))
            self._continues_epoch = _batches_yielded(state) > 0 and not finished
            if finished:
                # torchdata would build the finished iterator at the next __iter__, see that
                # it is finished and build a fresh one: two seed draws where the run that
                # never stopped made one. Build the finished one now, drawing nothing.
                with _global_rng_untouched():
                    try:
                        self._iterator = self._get_iterator()
                    except StopIteration:
                        # a dataset without a state of its own is fast-forwarded by
                        # torchdata, which can run past its end (counts kept across a
                        # resume): the epoch was over, so the next one simply starts
                        self._iterator = None
                        self.next_iter_state = None
            return
        self.load_order_state(state)


class SkipDataLoader(DataLoaderShard):
    """A DataLoader that skips the first ``skip_batches`` batches of each epoch (Accelerate's
    name; :func:`skip_first_batches` builds one from a prepared loader).

    >>> [b.tolist() for b in SkipDataLoader(list(range(8)), batch_size=2, skip_batches=3)]
    [[6, 7]]
    """

    def __init__(
        self,
        dataset: Any,
        skip_batches: int = 0,
        use_stateful_dataloader: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, skip_batches=skip_batches, **kwargs)

    def __len__(self) -> int:
        return max(0, super().__len__() - self.skip_batches)


# ------------------------------------------------------------------------------ dispatching


def _is_leaf_list(value: Any) -> bool:
    """A list or tuple of plain objects (strings, numbers...): a batch dimension, not a
    structure (``default_collate`` turns a column of strings into one)."""
    return (
        isinstance(value, (list, tuple))
        and not hasattr(value, "_fields")
        and not any(isinstance(v, (torch.Tensor, list, tuple, dict)) for v in value)
    )


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    if _is_leaf_list(batch):
        return len(batch)
    if isinstance(batch, dict):
        return _batch_len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0])
    raise TypeError(f"cannot find the batch size of a {type(batch).__name__}")


def _cat(parts: list[Any]) -> Any:
    first = parts[0]
    if len(parts) == 1:
        return first  # as Accelerate's concatenate: one batch is returned as it is
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=0)
    if _is_leaf_list(first):
        return type(first)(x for p in parts for x in p)
    if isinstance(first, dict):
        return type(first)({k: _cat([p[k] for p in parts]) for k in first})
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(_cat([p[i] for p in parts]) for i in range(len(first))))
    if isinstance(first, (list, tuple)):
        return type(first)(_cat([p[i] for p in parts]) for i in range(len(first)))
    if all(p == first for p in parts[1:]):
        return first  # a per-batch constant (a name, a flag) that every batch shares
    raise TypeError(
        f"dispatch_batches cannot join batches whose {type(first).__name__} values differ "
        f"({parts[0]!r}, {parts[1]!r}...): collate them into tensors or lists"
    )


def _slice(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, torch.Tensor) or _is_leaf_list(batch):
        return batch[start:stop]
    if isinstance(batch, dict):
        return type(batch)({k: _slice(v, start, stop) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_slice(v, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(v, start, stop) for v in batch)
    return batch


def _pad(batch: Any, source: Any, size: int) -> Any:
    """``batch`` completed to ``size`` samples with samples of ``source``, cyclically."""
    parts = [batch]
    missing = size - _batch_len(batch)
    available = _batch_len(source)
    while missing > 0:
        take = min(missing, available)
        parts.append(_slice(source, 0, take))
        missing -= take
    return _cat(parts)


class DataLoaderDispatcher(DataLoaderShard):
    """Rank 0 reads the data and sends every rank its share (``dispatch_batches=True``).

    For datasets that cannot be read by every rank (streams, iterables without sharding):
    only rank 0 iterates the underlying loader. Each global step it takes ``num_processes``
    batches (one batch when ``split_batches``), joins them, broadcasts the global batch and
    every rank keeps its slice. With ``even_batches`` a short last step is completed with
    samples of the first one, and ``remainder`` is the number of real samples, known even
    for iterables without a length.

    Example::

        loader = prepare_data_loader(DataLoader(stream, batch_size=8), dispatch_batches=True)
    """

    def __init__(
        self,
        dataset: Any,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, **kwargs)
        batch_size = self.batch_size or getattr(self.batch_sampler, "batch_size", None)
        if batch_size is None:
            raise ValueError("dispatch_batches=True needs a DataLoader with a batch_size")
        if split_batches:
            _check_split(batch_size, num_processes)
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self._drop_last = bool(self.drop_last or getattr(self.batch_sampler, "drop_last", False))
        self.local_batch_size = batch_size // num_processes if split_batches else batch_size
        self._global_size = self.local_batch_size * num_processes
        self._total_batch_size = self._global_size

    def _sync_generator(self) -> None:
        # only rank 0 samples: nothing to agree on, just remember the epoch's start
        self._epoch_start_states = {k: g.get_state() for k, g in self._generators().items()}

    def __len__(self) -> int:
        base = super().__len__()
        if self.split_batches:
            return base
        full, left = divmod(base, self.num_processes)
        if self._drop_last:
            return full
        if self.even_batches:
            return full + (1 if left else 0)
        return full + (1 if self.process_index < left else 0)

    def _fetch(self, it: Iterator[Any] | None, first: list[Any]) -> tuple[Any, int] | None:
        from .utils.operations import broadcast_object_list

        payload: list[Any] = [None]
        if it is not None:
            wanted = 1 if self.split_batches else self.num_processes
            parts = list(itertools.islice(it, wanted))
            if parts:
                batch = _cat(parts)
                real = _batch_len(batch)
                if not first:
                    first.append(batch)
                size = self._global_size
                if real < size and self._drop_last:
                    batch = None
                elif real < size and self.even_batches:
                    batch = _pad(batch, first[0], size)
                payload = [None if batch is None else (batch, real)]
        if self.num_processes > 1:
            broadcast_object_list(payload, from_process=0)
        return payload[0]

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        it = self._start_epoch(read=self.process_index == 0)
        first: list[Any] = []
        self.begin()
        try:
            current = self._fetch(it, first)
            index = 0
            while current is not None:
                self._snapshot()
                upcoming = self._fetch(it, first)
                batch, real = current
                if upcoming is None:
                    self.end_of_dataloader = True
                    self._snapshot(finished=True)  # see DataLoaderShard.__iter__
                    self.remainder = real if real < self._global_size else 0
                    if not self.even_batches:
                        self.remainder = 0
                lo = self.process_index * self.local_batch_size
                hi = min(lo + self.local_batch_size, _batch_len(batch))
                if lo < hi and index >= self.skip_batches:
                    yield self._to_device(_slice(batch, lo, hi))
                index += 1
                current = upcoming
            self.iteration += 1
            if self._parent is not None:
                self._parent.iteration = self.iteration
        finally:
            self.end()


def _on_device(batch: Any, device: torch.device) -> bool:
    """True when every tensor of a plain batch (tensor, list/tuple/dict of tensors) is
    already on ``device``; False when unsure (then ``send_to_device`` decides)."""
    if isinstance(batch, torch.Tensor):
        return batch.device == device
    if batch is None or isinstance(batch, (str, bytes, int, float)):
        return True
    if type(batch) in (list, tuple):
        return all(_on_device(b, device) for b in batch)
    if type(batch) is dict:
        return all(_on_device(b, device) for b in batch.values())
    return False


def _seed_from_global_rng() -> int:
    return int(torch.empty((), dtype=torch.int64).random_().item())


def _batches_yielded(state: dict[str, Any]) -> int:
    """How far into its epoch torchdata's state is (single- or multi-process iterator)."""
    if "_num_yielded" in state:
        return int(state["_num_yielded"])
    snapshot = state.get("_snapshot") or {}
    return int(snapshot.get("_snapshot_step", 0)) + int(state.get("_steps_since_snapshot", 0))


class _global_rng_untouched:
    """Puts torch's global CPU generator back as it was on entry."""

    def __enter__(self) -> None:
        self._state = torch.get_rng_state()

    def __exit__(self, *exc: object) -> None:
        torch.set_rng_state(self._state)


def prepare_data_loader(
    dataloader: DataLoader,
    device: torch.device | None = None,
    num_processes: int | None = None,
    process_index: int | None = None,
    split_batches: bool = False,
    put_on_device: bool = False,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    use_seedable_sampler: bool = False,
    data_seed: int | None = None,
    non_blocking: bool = False,
    use_stateful_dataloader: bool = False,
) -> DataLoaderShard:
    """Return a :class:`DataLoaderShard` yielding this rank's share of ``dataloader``.

    Args mirror Accelerate's ``prepare_data_loader``; ``num_processes`` / ``process_index``
    default to the current ``PartialState``. ``dispatch_batches`` (default: True for an
    ``IterableDataset``, False otherwise) makes rank 0 read and send the batches
    (:class:`DataLoaderDispatcher`); otherwise every rank reads its own share.

    Example::

        loader = prepare_data_loader(DataLoader(ds, batch_size=4), put_on_device=True,
                                     device=accelerator.device)
    """
    if num_processes is None or process_index is None:
        state = _state()
        num_processes = state.num_processes if num_processes is None else num_processes
        process_index = state.process_index if process_index is None else process_index
    assert num_processes is not None and process_index is not None
    # The global RNG is drawn from exactly where Accelerate draws (so a seeded run gives the
    # same models and batches with either package): each epoch's iterator draws its worker
    # base seed (torch's DataLoader, no generator of ours); a shuffling sampler without a
    # generator gets one, seeded from the global RNG here when several processes must agree
    # on its order, or at each epoch start, where RandomSampler itself would draw, in one
    # process. Keeping the generator makes the epoch's order part of a checkpoint.
    kwargs = _loader_kwargs(dataloader)
    reseed = False
    dataset = dataloader.dataset
    synchronized: torch.Generator | None = None
    remainder = -1
    total_batch_size: int | None
    if dispatch_batches is None:
        # Accelerate's default: rank 0 reads iterables, when batches go to the device
        dispatch_batches = put_on_device and isinstance(dataset, IterableDataset)
    if use_stateful_dataloader:
        _stateful_class(DataLoaderShard)  # Accelerate's ImportError without torchdata
        kwargs["use_stateful_dataloader"] = True
    if dispatch_batches:
        return _dispatcher(
            dataloader,
            kwargs,
            device if put_on_device else None,
            num_processes,
            process_index,
            split_batches,
            even_batches,
            non_blocking,
        )

    if isinstance(dataset, IterableDataset) and num_processes == 1 and not split_batches:
        # one process: nothing to shard (the loader's own batching, batch_size=None included)
        try:
            length = len(dataset)  # type: ignore[arg-type]
            batch = dataloader.batch_size
            remainder = 0 if dataloader.drop_last or not batch else length % batch
        except TypeError:
            remainder = -1
        return DataLoaderShard(
            dataset,
            device=device if put_on_device else None,
            non_blocking=non_blocking,
            remainder=remainder,
            total_batch_size=dataloader.batch_size,
            batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last,
            **kwargs,
        )
    streaming = getattr(sys.modules.get("datasets"), "IterableDataset", None)
    if (
        streaming is not None
        and isinstance(dataset, streaming)
        and not split_batches
        and getattr(dataset, "n_shards", 0) >= num_processes
    ):
        # a Hugging Face streaming dataset with a shard (file) per rank at least: each rank
        # reads its own shards, as Accelerate does, instead of every rank reading everything.
        # Shards of different sizes give ranks different numbers of batches.
        local = dataset.shard(num_shards=num_processes, index=process_index)
        return DataLoaderShard(
            local,
            device=device if put_on_device else None,
            non_blocking=non_blocking,
            remainder=-1,
            total_batch_size=None
            if dataloader.batch_size is None
            else dataloader.batch_size * num_processes,
            batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last,
            **kwargs,
        )
    if isinstance(dataset, IterableDataset):
        # batch_size=None: the dataset yields whole batches; each is one "sample" here
        unbatched = dataloader.batch_size is None
        if unbatched and split_batches:
            raise ValueError(
                "split_batches=True needs a DataLoader with a batch_size to split; this one "
                "has batch_size=None (its dataset yields whole batches)"
            )
        batch_size = 1 if dataloader.batch_size is None else dataloader.batch_size
        shard = IterableDatasetShard(
            dataset,
            batch_size=batch_size,
            drop_last=dataloader.drop_last,
            num_processes=num_processes,
            process_index=process_index,
            split_batches=split_batches,
            even_batches=even_batches,
        )
        total_batch_size = shard.total_batch_size
        try:
            length = len(dataset)  # type: ignore[arg-type]
            remainder = 0 if dataloader.drop_last else length % total_batch_size
        except TypeError:
            remainder = -1
        new = DataLoaderShard(
            shard,
            device=device if put_on_device else None,
            non_blocking=non_blocking,
            remainder=remainder,
            total_batch_size=total_batch_size,
            batch_size=None if unbatched else total_batch_size // num_processes,
            drop_last=False if unbatched else dataloader.drop_last,
            **kwargs,
        )
        return new

    # DataLoader(sampler=BatchSampler(...), batch_size=None) hands the dataset whole lists of
    # indices: the BatchSampler plays the batch sampler's part, and stays a sampler below.
    sampler_is_batch_sampler = dataloader.batch_sampler is None
    batch_sampler = _batch_sampler_of(dataloader)
    sampler = getattr(batch_sampler, "sampler", None)
    if isinstance(sampler, RandomSampler):
        if use_seedable_sampler and not isinstance(sampler, SeedableRandomSampler):
            seeded = SeedableRandomSampler(
                sampler.data_source,
                replacement=sampler.replacement,
                num_samples=sampler._num_samples,
                generator=sampler.generator,
                data_seed=data_seed,
            )
            batch_sampler = _rebuild_batch_sampler(batch_sampler, seeded)
        elif not use_seedable_sampler:
            if sampler.generator is None:
                sampler.generator = torch.Generator()
                if num_processes > 1:
                    sampler.generator.manual_seed(_seed_from_global_rng())
                else:
                    reseed = True
            synchronized = sampler.generator

    if num_processes > 1 or split_batches:
        shard_sampler: BatchSampler = BatchSamplerShard(
            batch_sampler,
            num_processes=num_processes,
            process_index=process_index,
            split_batches=split_batches,
            even_batches=even_batches,
        )
        total_batch_size = shard_sampler.total_batch_size  # type: ignore[attr-defined]
        samples = shard_sampler._num_samples()  # type: ignore[attr-defined]
        drop_last = shard_sampler.drop_last
    else:
        shard_sampler = batch_sampler
        total_batch_size = getattr(batch_sampler, "batch_size", None)
        try:
            samples = len(getattr(batch_sampler, "sampler"))  # noqa: B009
        except (AttributeError, TypeError):
            samples = None
        drop_last = bool(getattr(batch_sampler, "drop_last", False))
    if drop_last or not even_batches:
        remainder = 0
    elif samples is not None and total_batch_size:
        remainder = samples % total_batch_size

    return DataLoaderShard(
        dataset,
        device=device if put_on_device else None,
        synchronized_generator=synchronized,
        non_blocking=non_blocking,
        remainder=remainder,
        total_batch_size=total_batch_size,
        reseed_generator=reseed,
        **_sampling(shard_sampler, sampler_is_batch_sampler),
        **kwargs,
    )


def _sampling(batches: Any, as_sampler: bool) -> dict[str, Any]:
    """DataLoader arguments that make ``batches`` yield the batches' indices."""
    return {"sampler": batches, "batch_size": None} if as_sampler else {"batch_sampler": batches}


def _batch_sampler_of(dataloader: DataLoader) -> Any:
    """What yields the loader's batches of indices: its batch sampler, or a ``BatchSampler``
    passed as its sampler (with ``batch_size=None``)."""
    if dataloader.batch_sampler is not None:
        return dataloader.batch_sampler
    if isinstance(dataloader.sampler, BatchSampler):
        return dataloader.sampler
    raise ValueError(
        "prepare_data_loader shards batches: give the DataLoader a batch_size, a "
        "batch_sampler, or a BatchSampler as its sampler (with batch_size=None); it has "
        f"batch_size=None and a {type(dataloader.sampler).__name__}"
    )


def _dispatcher(
    dataloader: DataLoader,
    kwargs: dict[str, Any],
    device: torch.device | None,
    num_processes: int,
    process_index: int,
    split_batches: bool,
    even_batches: bool,
    non_blocking: bool,
) -> DataLoaderDispatcher:
    synchronized: torch.Generator | None = None
    reseed = False
    if isinstance(dataloader.dataset, IterableDataset):
        loader_kwargs: dict[str, Any] = {
            "batch_size": dataloader.batch_size,
            "drop_last": dataloader.drop_last,
        }
    else:
        batch_sampler = dataloader.batch_sampler
        sampler = getattr(batch_sampler, "sampler", None)
        if isinstance(sampler, RandomSampler) and sampler.generator is None:
            sampler.generator = torch.Generator()  # seeded each epoch, on rank 0 (it samples)
            reseed = True
        if isinstance(sampler, RandomSampler):
            synchronized = sampler.generator
        loader_kwargs = {"batch_sampler": batch_sampler}
    return DataLoaderDispatcher(
        dataloader.dataset,
        num_processes=num_processes,
        process_index=process_index,
        split_batches=split_batches,
        even_batches=even_batches,
        device=device,
        synchronized_generator=synchronized,
        non_blocking=non_blocking,
        reseed_generator=reseed,
        **loader_kwargs,
        **kwargs,
    )


def _rebuild_batch_sampler(batch_sampler: Any, sampler: Sampler[int]) -> Any:
    if type(batch_sampler) is BatchSampler:
        return BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last)
    raise ValueError(
        "use_seedable_sampler=True needs a DataLoader built with shuffle=True (a plain "
        f"BatchSampler), got a {type(batch_sampler).__name__}"
    )


def _continuation_kwargs(dataloader: DataLoaderShard) -> dict[str, Any]:
    """Loader arguments for a copy that continues an epoch already started: it draws nothing
    from the global RNG (the original epoch drew its seeds before the checkpoint), so a run
    resumed mid-epoch sees the same global random stream as the uninterrupted one."""
    kwargs = dict(dataloader._base_kwargs)
    if kwargs.get("generator") is None:
        kwargs["generator"] = torch.Generator()  # worker base seeds, without a global draw
    return kwargs


def skip_first_batches(dataloader: DataLoader, num_batches: int = 0) -> DataLoader:
    """A loader that yields the batches of ``dataloader`` after the first ``num_batches``.

    For resuming mid-epoch: use it for the first (resumed) epoch, then the original loader.

    Example::

        accelerator.load_state("ckpt")
        for batch in skip_first_batches(train_loader, done_batches):
            ...
    """
    if isinstance(dataloader, DataLoaderDispatcher):
        disp = DataLoaderDispatcher(
            dataloader.dataset,
            num_processes=dataloader.num_processes,
            process_index=dataloader.process_index,
            split_batches=dataloader.split_batches,
            even_batches=dataloader.even_batches,
            device=dataloader.device,
            synchronized_generator=dataloader.synchronized_generator,
            skip_batches=num_batches,
            non_blocking=dataloader.non_blocking,
            **_continuation_kwargs(dataloader),
        )
        disp.iteration = dataloader.iteration
        disp._parent = dataloader
        return disp
    if isinstance(dataloader, DataLoaderShard):
        if isinstance(dataloader.dataset, IterableDataset):
            new = DataLoaderShard(
                dataloader.dataset,
                device=dataloader.device,
                synchronized_generator=dataloader.synchronized_generator,
                skip_batches=num_batches,
                non_blocking=dataloader.non_blocking,
                remainder=dataloader.remainder,
                total_batch_size=dataloader.total_batch_size,
                **_continuation_kwargs(dataloader),
            )
        else:
            kwargs = _continuation_kwargs(dataloader)
            as_sampler = dataloader.batch_sampler is None
            batches = dataloader.sampler if as_sampler else dataloader.batch_sampler
            kwargs.update(_sampling(SkipBatchSampler(batches, num_batches), as_sampler))  # type: ignore[arg-type]
            new = DataLoaderShard(
                dataloader.dataset,
                device=dataloader.device,
                synchronized_generator=dataloader.synchronized_generator,
                non_blocking=dataloader.non_blocking,
                remainder=dataloader.remainder,
                total_batch_size=dataloader.total_batch_size,
                **kwargs,
            )
        new.iteration = dataloader.iteration
        new._parent = dataloader
        return new
    kwargs = _loader_kwargs(dataloader)
    if isinstance(dataloader.dataset, IterableDataset):
        return DataLoaderShard(
            dataloader.dataset,
            skip_batches=num_batches,
            batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last,
            **kwargs,
        )
    assert dataloader.batch_sampler is not None
    return DataLoader(
        dataloader.dataset,
        batch_sampler=SkipBatchSampler(dataloader.batch_sampler, num_batches),
        **kwargs,
    )


__all__ = [
    "BatchSamplerShard",
    "DataLoaderDispatcher",
    "DataLoaderShard",
    "DataLoaderStateMixin",
    "SkipDataLoader",
    "IterableDatasetShard",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "prepare_data_loader",
    "skip_first_batches",
]
