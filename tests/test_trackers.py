"""Accelerate's training API pieces added for parity, in one process: trackers (TensorBoard's
own reader loads what ``log_with="tensorboard"`` wrote), ``prepare`` twice, ``set_epoch`` into
custom batch samplers, ``torch.compile`` through ``dynamo_backend``, ``profile()``,
``find_executable_batch_size``, and the one error for Accelerate-only names.

Their distributed behaviour is covered by Accelerate's own tests
(``test_parity_accelerate_unit.py``); these pin what this package adds or decides itself.
"""

from __future__ import annotations

import importlib
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from notebook_launcher import Accelerator
from notebook_launcher._accelerate_only import AccelerateOnlyError
from notebook_launcher.trackers import GeneralTracker

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _inductor_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """torch sets TORCHINDUCTOR_CACHE_DIR when the process builds its first optimizer or
    compiles; pinning it here keeps the environment check of conftest.py about our code."""
    monkeypatch.setenv(
        "TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    )


class ListTracker(GeneralTracker):
    name = "list"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Any]] = []

    @property
    def tracker(self) -> Any:
        return self.calls

    def start(self) -> None:
        self.calls.append(("start", None))

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.calls.append(("config", dict(values)))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.calls.append(("log", (dict(values), step, kwargs)))

    def finish(self) -> None:
        self.calls.append(("finish", None))


def test_custom_tracker_gets_the_whole_lifecycle() -> None:
    tracker = ListTracker()
    accelerator = Accelerator(log_with=tracker)
    accelerator.init_trackers("run", config={"lr": 0.1})
    accelerator.log({"loss": 0.5}, step=2, log_kwargs={"list": {"commit": True}})
    assert accelerator.get_tracker("list") is tracker
    assert accelerator.get_tracker("list", unwrap=True) is tracker.calls
    accelerator.end_training()
    assert tracker.calls == [
        ("start", None),
        ("config", {"lr": 0.1}),
        ("log", ({"loss": 0.5}, 2, {"commit": True})),
        ("finish", None),
    ]
    with pytest.raises(ValueError, match="nope is not an available tracker"):
        accelerator.trackers.append(tracker)
        accelerator.get_tracker("nope")


def test_tensorboard_writes_an_event_file_tensorboard_reads(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accelerator = Accelerator(log_with="tensorboard", project_dir=str(tmp_path))
    accelerator.init_trackers("run", config={"lr": 0.01, "layers": 2})
    for step, loss in enumerate([1.0, 0.5, 0.25]):
        accelerator.log({"loss": torch.tensor(loss), "note": f"step {step}"}, step=step)
    accelerator.end_training()

    events = [p for p in (tmp_path / "run").iterdir() if p.name.startswith("events.out")]
    assert len(events) == 1
    reader = EventAccumulator(str(events[0]))
    reader.Reload()
    scalars = reader.Scalars("loss")
    assert [(s.step, s.value) for s in scalars] == [(0, 1.0), (1, 0.5), (2, 0.25)]
    assert "note/text_summary" in reader.Tags()["tensors"]
    assert (tmp_path / "run" / "hparams.yml").read_text().count("layers") == 1


def test_a_tracker_that_is_not_installed_fails_at_once() -> None:
    if importlib.util.find_spec("aim") is not None:
        pytest.skip("aim is installed here")
    with pytest.raises(
        ImportError, match=r"log_with='aim' needs the `aim` package.*pip install aim"
    ):
        Accelerator(log_with="aim")


def test_tracker_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="Unsupported logging capability: nonsense"):
        Accelerator(log_with="nonsense")
    if importlib.util.find_spec("tensorboard") is not None:
        with pytest.raises(ValueError, match="requires a `logging_dir`"):
            Accelerator(log_with="tensorboard")


def test_preparing_twice_wraps_and_registers_once(tmp_path: Path) -> None:
    accelerator = Accelerator()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(list(range(4)), batch_size=2)
    first = accelerator.prepare(model, optimizer, loader)
    second = accelerator.prepare(*first)
    assert all(a is b for a, b in zip(first, second, strict=True))
    assert (len(accelerator._models), len(accelerator._optimizers)) == (1, 1)
    assert len(accelerator._dataloaders) == 1
    accelerator.save_state(str(tmp_path / "ckpt"))
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert "model.safetensors" in saved
    assert "model_1.safetensors" not in saved


class EpochBatchSampler(BatchSampler):
    """A custom batch sampler that reshuffles per epoch (as bucketing samplers do)."""

    def __init__(self, n: int) -> None:
        super().__init__(SequentialSampler(range(n)), batch_size=2, drop_last=False)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


@pytest.mark.parametrize("num_processes", [1, 2])
def test_set_epoch_reaches_a_custom_batch_sampler(num_processes: int) -> None:
    from notebook_launcher.data_loader import prepare_data_loader

    sampler = EpochBatchSampler(8)
    loader = prepare_data_loader(
        DataLoader(list(range(8)), batch_sampler=sampler),
        num_processes=num_processes,
        process_index=0,
    )
    loader.set_epoch(3)
    assert sampler.epochs == [3]
    list(loader)  # each epoch starts with set_epoch(iteration)
    list(loader)
    assert sampler.epochs == [3, 3, 4]


def test_dynamo_backend_compiles_and_unwrap_sees_through() -> None:
    accelerator = Accelerator(dynamo_backend="eager")
    module = torch.nn.Linear(3, 1)
    model = accelerator.prepare(module)
    assert type(model).__name__ == "OptimizedModule"
    assert accelerator.unwrap_model(model, keep_torch_compile=False) is module
    assert accelerator.unwrap_model(model)._orig_mod is module
    assert model(torch.ones(2, 3)).shape == (2, 1)
    with pytest.raises(ValueError, match="unknown dynamo backend 'nonsense'"):
        Accelerator(dynamo_backend="nonsense")


def test_profile_writes_a_chrome_trace(tmp_path: Path) -> None:
    from notebook_launcher import ProfileKwargs

    handler = ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path))
    accelerator = Accelerator(kwargs_handlers=[handler])
    with accelerator.profile() as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    assert any("mm" in e.key for e in prof.key_averages())
    assert (tmp_path / "trace_rank0.json").stat().st_size > 0


def test_find_executable_batch_size_halves_down_to_what_fits() -> None:
    from notebook_launcher import find_executable_batch_size

    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=64, reduce_batch_size_fn=lambda: tried[-1] // 2)
    def train(batch_size: int, name: str) -> str:
        tried.append(batch_size)
        if batch_size > 8:
            raise RuntimeError("CUDA out of memory.")
        return f"{name}@{batch_size}"

    assert train("run") == "run@8"
    assert tried == [64, 32, 16, 8]

    @find_executable_batch_size(starting_batch_size=4)
    def broken(batch_size: int) -> None:
        raise KeyError("not a memory problem")

    with pytest.raises(KeyError):
        broken()


@pytest.mark.parametrize(
    "statement",
    [
        "from notebook_launcher import init_empty_weights",
        "from notebook_launcher.utils import merge_fsdp_weights",
        "from notebook_launcher.utils.modeling import get_state_dict_from_offload",
        # what Transformers imports from accelerate when it sees it installed
        "from notebook_launcher.utils.modeling import clean_device_map, get_max_layer_size",
        "from notebook_launcher.utils import DeepSpeedSchedulerWrapper",
        # what Accelerate's by_feature/megatron_lm_gpt_pretraining.py imports
        "from notebook_launcher.utils import MegatronLMDummyScheduler",
        "import notebook_launcher.hooks",
        "import notebook_launcher.big_modeling",
        "from notebook_launcher import FP8RecipeKwargs",
    ],
)
def test_accelerate_only_names_raise_one_clear_error(statement: str) -> None:
    with pytest.raises(AccelerateOnlyError) as info:
        exec(statement, {})
    message = str(info.value)
    assert "which notebook_launcher does not provide" in message
    assert "pip install accelerate" in message
    assert isinstance(info.value, ImportError)


@pytest.mark.parametrize(
    ("package", "name"),
    [
        ("notebook_launcher", "dispatch_model"),
        ("notebook_launcher", "hooks"),
        ("notebook_launcher.utils", "merge_fsdp_weights"),
        ("notebook_launcher.utils.modeling", "infer_auto_device_map"),
    ],
)
def test_feature_probes_of_accelerate_only_names_answer_not_here(package: str, name: str) -> None:
    """How libraries detect a feature (Transformers: ``dispatch_model``): ``hasattr`` and
    ``getattr`` with a default answer "absent", ``try: from ... import / except ImportError``
    takes the except branch; each error still carries the message."""
    module = importlib.import_module(package)
    assert not hasattr(module, name)
    assert getattr(module, name, None) is None
    with pytest.raises(AttributeError, match="which notebook_launcher does not provide"):
        getattr(module, name)
    namespace: dict[str, Any] = {}
    exec(  # the probe as libraries write it
        f"try:\n    from {package} import {name}\nexcept ImportError as e:\n    caught = e\n",
        namespace,
    )
    assert isinstance(namespace["caught"], AccelerateOnlyError)
    assert "pip install accelerate" in str(namespace["caught"])


def test_accelerate_only_error_pickles() -> None:
    import pickle

    from notebook_launcher._accelerate_only import (
        AccelerateOnlyAttributeError,
        error_for,
        lookup_error,
    )

    error = pickle.loads(pickle.dumps(error_for("dispatch_model")))
    assert isinstance(error, AccelerateOnlyError)
    assert error.name == "dispatch_model"
    assert "dispatch_model" in str(error)
    looked_up = pickle.loads(pickle.dumps(lookup_error("hooks", None)))
    assert isinstance(looked_up, AccelerateOnlyAttributeError)
    assert looked_up.name == "hooks"
    assert "hooks" in str(looked_up)


def test_convert_dict_to_env_variables_warns_on_accelerates_logger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Accelerate's ``test_convert_dict_to_env_variables``: the entry it leaves out is named on
    the logger Accelerate names, ``accelerate.utils.environment``."""
    from notebook_launcher.utils import convert_dict_to_env_variables

    env = {"ACCELERATE_DEBUG_MODE": "1", "BAD_ENV_NAME": "<mything", "OTHER_ENV": "2", "E": ""}
    with caplog.at_level("WARNING", logger="accelerate.utils.environment"):
        lines = convert_dict_to_env_variables(env)
    assert lines == ["ACCELERATE_DEBUG_MODE=1\n", "OTHER_ENV=2\n"]
    skipped = [r.getMessage() for r in caplog.records if r.name == "accelerate.utils.environment"]
    assert len(skipped) == 2
    assert "BAD_ENV_NAME=<mything" in skipped[0]


def test_patch_environment_restores_after_an_error() -> None:
    from notebook_launcher.utils import patch_environment

    os.environ.pop("NL_PATCH_TEST", None)
    with pytest.raises(RuntimeError), patch_environment(nl_patch_test=5):
        assert os.environ["NL_PATCH_TEST"] == "5"
        raise RuntimeError("boom")
    assert "NL_PATCH_TEST" not in os.environ


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("num_processes", [1, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_loaders_draw_from_the_global_rng_as_accelerate_does(
    shuffle: bool, num_processes: int, num_workers: int
) -> None:
    """Same seed, same stream: after preparing a loader and running two epochs, the global
    RNG is where real Accelerate leaves it, and the batches are the same (its
    by_feature/cross_validation.py ended fold 2 differently before). With workers too: a
    pool draws its first indices while the epoch's iterator is created, which on one
    process came before the sampler's generator was seeded for the epoch."""
    accelerate_data_loader = pytest.importorskip("accelerate.data_loader")
    from notebook_launcher.data_loader import prepare_data_loader

    def run(prepare: Any) -> tuple[list[list[int]], float]:
        torch.manual_seed(1234)
        loader = DataLoader(list(range(10)), batch_size=2, shuffle=shuffle, num_workers=num_workers)
        prepared = prepare(loader, num_processes=num_processes, process_index=0)
        batches = [b.tolist() for _ in range(2) for b in prepared]
        return batches, torch.rand(1).item()

    handler = signal.getsignal(signal.SIGCHLD)  # torch installs its own for worker processes
    try:
        ours = run(prepare_data_loader)
        theirs = run(accelerate_data_loader.prepare_data_loader)
    finally:
        signal.signal(signal.SIGCHLD, handler)
    assert ours == theirs


def test_load_checkpoint_in_model_takes_an_index_and_a_device_map(tmp_path: Path) -> None:
    from notebook_launcher import load_checkpoint_in_model
    from notebook_launcher.checkpointing import save_model_files

    source = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    save_model_files(source.state_dict(), str(tmp_path), max_shard_size=10_000)
    (index,) = tmp_path.glob("*.index.json")
    target = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    load_checkpoint_in_model(target, str(index), device_map={"": "cpu"}, dtype=torch.float64)
    assert torch.equal(target[0].weight, source[0].weight.double())
    with pytest.raises(AccelerateOnlyError, match="load_offloaded_weights"):
        load_checkpoint_in_model(target, str(tmp_path), device_map={"0": "disk", "1": "cpu"})


def test_a_streaming_dataset_with_a_shard_per_rank_is_sharded_natively() -> None:
    datasets = pytest.importorskip("datasets")
    from notebook_launcher.data_loader import IterableDatasetShard, prepare_data_loader

    stream = datasets.Dataset.from_dict({"x": list(range(10))}).to_iterable_dataset(num_shards=2)
    loaders = [
        prepare_data_loader(DataLoader(stream, batch_size=4), num_processes=2, process_index=r)
        for r in range(2)
    ]
    assert not any(isinstance(dl.dataset, IterableDatasetShard) for dl in loaders)
    seen = sorted(x for dl in loaders for batch in dl for x in batch["x"].tolist())
    assert seen == list(range(10))
