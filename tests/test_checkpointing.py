"""Model files (safetensors, shards, tied weights) and crash safety of checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from notebook_launcher import checkpointing
from notebook_launcher.checkpointing import (
    dedupe_shared_tensors,
    load_model_state_dict,
    parse_size,
    save_model_files,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("size", "expected"),
    [("10GB", 10 * 10**9), ("5MiB", 5 * 2**20), ("100kb", 100_000), (123, 123), ("1.5KB", 1500)],
)
def test_parse_size(size: int | str, expected: int) -> None:
    assert parse_size(size) == expected


@pytest.mark.parametrize("bad", ["ten GB", "0", "", 0, "-1GB"])
def test_parse_size_rejects(bad: int | str) -> None:
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size(bad)


def state(n: int, width: int = 10) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.full((width,), float(i)) for i in range(n)}


def files(d: Path) -> list[str]:
    return sorted(os.listdir(d))


def test_single_file_then_shards_then_single_again(tmp_path: Path) -> None:
    sd = state(5)  # 5 tensors of 40 bytes
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model_card.md").write_text("keep me")
    assert save_model_files(sd, str(tmp_path)) == ["model.safetensors"]
    assert files(tmp_path) == ["config.json", "model.safetensors", "model_card.md"]
    assert torch.equal(
        load_file(str(tmp_path / "model.safetensors"))["layer3.weight"], sd["layer3.weight"]
    )

    written = save_model_files(sd, str(tmp_path), max_shard_size=100)  # 2 tensors per shard
    shard_names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert written == [*shard_names, "model.safetensors.index.json"]
    assert files(tmp_path) == sorted(["config.json", "model_card.md", *written])
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 200
    assert index["weight_map"]["layer4.weight"] == shard_names[2]
    merged: dict[str, torch.Tensor] = {}
    for name in shard_names:
        merged.update(load_file(str(tmp_path / name)))  # plain safetensors loads each shard
    assert merged.keys() == sd.keys()
    assert all(torch.equal(merged[k], v) for k, v in sd.items())

    # fewer, bigger shards: the stale third shard is removed
    save_model_files(state(3), str(tmp_path), max_shard_size=80)
    assert files(tmp_path) == sorted(
        [
            "config.json",
            "model_card.md",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
        ]
    )
    save_model_files(state(2), str(tmp_path))
    assert files(tmp_path) == ["config.json", "model.safetensors", "model_card.md"]
    assert load_model_state_dict(str(tmp_path)).keys() == state(2).keys()


def test_torch_format_and_big_tensor_gets_own_shard(tmp_path: Path) -> None:
    sd = {"a": torch.zeros(100), "b": torch.zeros(2), "c": torch.zeros(2)}
    written = save_model_files(sd, str(tmp_path), max_shard_size=50, safe_serialization=False)
    assert written == [
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json",
    ]
    first = torch.load(tmp_path / written[0], weights_only=True)
    assert list(first) == ["a"]
    assert load_model_state_dict(str(tmp_path)).keys() == sd.keys()


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(6, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_saved_once_and_restored(tmp_path: Path) -> None:
    model = Tied()
    save_model_files(model.state_dict(), str(tmp_path))
    raw = load_file(str(tmp_path / "model.safetensors"))
    assert list(raw) == ["embed.weight"]  # like Accelerate: the alias is dropped
    full = load_model_state_dict(str(tmp_path))
    assert full["head.weight"] is full["embed.weight"]
    fresh = Tied()
    fresh.load_state_dict(full)  # strict
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    assert fresh.head.weight is fresh.embed.weight
    # sharded: the aliases travel in the index
    save_model_files(model.state_dict(), str(tmp_path), max_shard_size=1)
    assert load_model_state_dict(str(tmp_path)).keys() == {"embed.weight", "head.weight"}


def test_partly_overlapping_views_are_cloned_not_dropped() -> None:
    base = torch.arange(10.0)
    tensors, aliases = dedupe_shared_tensors({"all": base, "tail": base[5:], "same": base})
    assert aliases == {"same": "all"}
    assert torch.equal(tensors["tail"], torch.arange(5.0, 10.0))
    assert (
        tensors["tail"].untyped_storage().data_ptr() != tensors["all"].untyped_storage().data_ptr()
    )
    with pytest.raises(TypeError, match="safe_serialization=False"):
        dedupe_shared_tensors({"step": 3})  # type: ignore[dict-item]


def test_interrupted_sharded_save_never_looks_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_model_files(state(4), str(tmp_path), max_shard_size=100)  # complete old save
    real_replace = os.replace
    calls = []

    def crash_on_second(src: str, dst: str) -> None:
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt("power cut")
        real_replace(src, dst)

    monkeypatch.setattr(checkpointing.os, "replace", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        save_model_files(state(6, width=20), str(tmp_path), max_shard_size=100)
    monkeypatch.setattr(checkpointing.os, "replace", real_replace)
    # cut short while writing the new files (into a staging directory, removed on the way
    # out): the old model is as it was (a kill at every step: test_checkpoint_crashes.py)
    assert files(tmp_path) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert load_model_state_dict(str(tmp_path)).keys() == state(4).keys()
    # the next save cleans up the debris (temp files, the staging directory)
    save_model_files(state(1), str(tmp_path))
    assert files(tmp_path) == ["model.safetensors"]


def test_failed_write_keeps_old_single_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_model_files(state(2), str(tmp_path))
    import safetensors.torch

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_model_files(state(3), str(tmp_path))
    assert files(tmp_path) == ["model.safetensors"]  # no temp file left, old model intact
    assert load_file(str(tmp_path / "model.safetensors")).keys() == state(2).keys()


def test_atomic_save_and_staged_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "meta.pt"
    checkpointing.save({"epoch": 3}, str(target))
    assert torch.load(target, weights_only=True) == {"epoch": 3}
    checkpointing.save(
        {"w": torch.ones(2)}, str(tmp_path / "w.safetensors"), safe_serialization=True
    )
    assert torch.equal(load_file(str(tmp_path / "w.safetensors"))["w"], torch.ones(2))

    ckpt = tmp_path / "ckpt"
    staging = checkpointing.start_staging(str(ckpt))
    checkpointing.save_rank_state(staging, 0, {"step": 1})
    # not committed yet: nothing at the target, and the staging dir is not a checkpoint
    assert not ckpt.exists()
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpointing.read_manifest(staging)
    checkpointing.commit_staging(str(ckpt), 1, {"step": 1})
    manifest = checkpointing.read_manifest(str(ckpt))
    assert manifest["files"] == ["random_states_0.pkl"] and manifest["step"] == 1
    # overwrite an existing checkpoint
    staging = checkpointing.start_staging(str(ckpt))
    checkpointing.save_rank_state(staging, 0, {"step": 2})
    checkpointing.commit_staging(str(ckpt), 1, {"step": 2})
    assert checkpointing.load_rank_state(str(ckpt), 0) == {"step": 2}
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "meta.pt", "w.safetensors"]
    # a listed file that went missing is detected
    os.remove(ckpt / "random_states_0.pkl")
    with pytest.raises(ValueError, match="incomplete"):
        checkpointing.read_manifest(str(ckpt))
    with pytest.raises(FileNotFoundError):
        checkpointing.read_manifest(str(tmp_path / "nope"))


def test_rng_state_round_trip() -> None:
    import random

    import numpy as np

    saved = checkpointing.rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpointing.set_rng_state(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
