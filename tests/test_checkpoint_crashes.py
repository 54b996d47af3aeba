"""Checkpoints killed at every step of a save, in a real child process, then loaded and saved
again: what loads is always a whole checkpoint (the old one or the new one), never a mix and
never nothing, and the next save never removes the only complete copy.

The child is forked from the test (it inherits the Accelerator, the model, the directory) and
dies with ``os._exit`` at its N-th filesystem step -- a rename, a removal (each file and
directory ``rmtree`` removes counts), or a weights file written only halfway -- for N = 1, 2,
... until a save gets through without reaching N. That is a kill at every point of the save.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from notebook_launcher import checkpointing
from notebook_launcher.accelerator import Accelerator
from notebook_launcher.checkpointing import load_model_state_dict, save_model_files
from notebook_launcher.utils.dataclasses import ProjectConfiguration

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("one_torch_thread")]

KILLED = 113  # the child's exit code when it died at the chosen step
MAX_STEPS = 200  # a save of these tiny checkpoints takes far fewer


def _arm(step: int) -> None:
    """In the child: die at the ``step``-th filesystem step from now."""
    import safetensors.torch

    count = [0]

    def tick(half_written: str | None = None) -> None:
        count[0] += 1
        if count[0] == step:
            if half_written is not None and os.path.exists(half_written):
                os.truncate(half_written, os.path.getsize(half_written) // 2)
            os._exit(KILLED)

    def before(real: Callable[..., Any]) -> Callable[..., Any]:
        def step_then(*args: Any, **kwargs: Any) -> Any:
            tick()
            return real(*args, **kwargs)

        return step_then

    def written(real: Callable[..., Any], path_arg: int) -> Callable[..., Any]:
        def write_then(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            path = args[path_arg] if len(args) > path_arg else None
            tick(os.fspath(path) if isinstance(path, (str, os.PathLike)) else None)
            return out

        return write_then

    for name in ("replace", "rename", "remove", "unlink", "rmdir"):
        setattr(os, name, before(getattr(os, name)))
    safetensors.torch.save_file = written(safetensors.torch.save_file, 1)
    torch.save = written(torch.save, 1)


def killed_at(step: int, save: Callable[[], Any]) -> bool:
    """Run ``save()`` in a forked child that dies at its ``step``-th filesystem step: True
    when it died there, False when the save finished first."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            logging.disable(logging.CRITICAL)
            _arm(step)
            save()
        except BaseException:  # noqa: BLE001
            code = 2
        finally:
            os._exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    assert code in (0, KILLED), f"the save in the child failed by itself (exit code {code})"
    return code == KILLED


def weights(n: int, value: float) -> dict[str, torch.Tensor]:
    return {f"layer{i}.weight": torch.full((10,), value + i) for i in range(n)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("old_shards", "new_shards"),
    [(2, 3), (1, 2), (2, 1)],
    ids=["sharded-over-sharded", "sharded-over-single", "single-over-sharded"],
)
@pytest.mark.timeout(120)
def test_model_files_killed_at_every_step_load_whole_and_next_save_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, old_shards: int, new_shards: int
) -> None:
    old, new, third = weights(6, 0.0), weights(6, 100.0), weights(2, 7.0)
    shard_size = {1: "1GB", 2: 120, 3: 80}  # six 40-byte tensors: 1 file, 2 or 3 shards

    seen = set()
    for step in range(1, MAX_STEPS):
        d = tmp_path / f"kill{step}"
        d.mkdir()
        (d / "config.json").write_text("{}")
        save_model_files(old, str(d), max_shard_size=shard_size[old_shards])
        if not killed_at(
            step, lambda d=d: save_model_files(new, str(d), max_shard_size=shard_size[new_shards])
        ):
            break
        caplog.clear()
        loaded = load_model_state_dict(str(d))  # never "no model weights", never a mix
        entry = any((d / n).exists() for n in ("model.safetensors", "model.safetensors.index.json"))
        if same(loaded, new):
            seen.add("new")
            if not entry:  # loaded from the copy the interrupted save left, and says so
                assert ".model.safetensors.incomplete" in caplog.text, caplog.text
                seen.add("recovered")
                name = "model.safetensors" + (".index.json" if new_shards > 1 else "")
                assert same(load_model_state_dict(str(d / name)), new)  # named by its entry
        else:
            assert same(loaded, old), f"killed at step {step}: neither the old nor the new model"
            seen.add("old")
        save_model_files(third, str(d))  # the next save finishes or drops what was cut short
        assert same(load_model_state_dict(str(d)), third)
        assert sorted(os.listdir(d)) == ["config.json", "model.safetensors"], step
        shutil.rmtree(d)
    else:
        pytest.fail(f"the save never finished within {MAX_STEPS} steps")
    assert seen == {"old", "new", "recovered"}, seen


def _trained(acc: Accelerator, model: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def _value(model: torch.nn.Module) -> float:
    return float(next(model.parameters()).detach().flatten()[0])


@pytest.mark.timeout(120)
def test_total_limit_prunes_only_after_the_new_checkpoint_is_complete(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 25 item 6: with total_limit=1 a save killed mid-write left only
    checkpoint_1.incomplete (checkpoint_0 was pruned first) and load_state() found nothing."""
    seen = set()
    config = ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=1)
    acc = Accelerator(project_config=config)
    model = acc.prepare(torch.nn.Linear(3, 2))
    for step in range(1, MAX_STEPS):
        project = tmp_path / f"kill{step}"
        config.project_dir, config.iteration = str(project), 0
        _trained(acc, model, 1.0)
        acc.save_state()  # checkpoint_0
        _trained(acc, model, 2.0)
        if not killed_at(step, acc.save_state):  # checkpoint_1, killed at `step`
            break
        _trained(acc, model, 0.0)
        caplog.clear()
        acc.load_state()  # the latest complete checkpoint: never "no checkpoint"
        value = _value(model)
        assert value in (1.0, 2.0), f"killed at step {step}: loaded {value}"
        if value == 2.0 and not (project / "checkpoints" / "checkpoint_1").exists():
            assert "checkpoint_1.incomplete is used" in caplog.text, caplog.text
            seen.add("recovered")
        seen.add(value)
        assert acc.save_iteration == (2 if value == 2.0 else 1)
        acc.save_state()  # the next save: the one checkpoint left is it, no debris
        assert os.listdir(project / "checkpoints") == [f"checkpoint_{acc.save_iteration - 1}"]
        _trained(acc, model, 0.0)
        acc.load_state()
        assert _value(model) == value
        shutil.rmtree(project)
    else:
        pytest.fail(f"the save never finished within {MAX_STEPS} steps")
    assert seen == {1.0, 2.0, "recovered"}, seen


@pytest.mark.timeout(120)
def test_save_state_killed_between_the_commits_renames_is_found_and_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 25 item 8: killed between renaming d to d.old and d.incomplete to d, load_state(d)
    said only "no checkpoint directory d", and the next save deleted both copies."""
    acc = Accelerator()
    model = acc.prepare(torch.nn.Linear(3, 2))
    d = tmp_path / "ckpt"
    outcomes = []
    for step in range(1, MAX_STEPS):
        _trained(acc, model, 1.0)
        acc.save_state(d)
        _trained(acc, model, 2.0)
        if not killed_at(step, lambda: acc.save_state(d)):
            break
        left = sorted(os.listdir(tmp_path))
        _trained(acc, model, 0.0)
        caplog.clear()
        acc.load_state(d)
        outcomes.append((left, _value(model), caplog.text))
        # the next save (killed again, right away) never removes the only complete copy
        killed_at(1, lambda: acc.save_state(d))
        _trained(acc, model, 0.0)
        acc.load_state(d)
        assert _value(model) == outcomes[-1][1], f"step {step}: {os.listdir(tmp_path)}"
        _trained(acc, model, 3.0)
        acc.save_state(d)
        assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    else:
        pytest.fail(f"the save never finished within {MAX_STEPS} steps")
    between = [o for o in outcomes if o[0] == ["ckpt.incomplete", "ckpt.old"]]
    assert between, [o[0] for o in outcomes]
    for _, value, warning in between:
        assert value == 2.0  # the new checkpoint: it was complete
        assert "ckpt.incomplete is used" in warning and "interrupted" in warning
    only_old = [o for o in outcomes if o[0] == ["ckpt.old"]]
    assert all(o[1] == 1.0 and "ckpt.old" in o[2] for o in only_old)
    assert all(value in (1.0, 2.0) for _, value, _ in outcomes)


def test_find_checkpoint_prefers_the_newer_complete_copy(tmp_path: Path) -> None:
    d = str(tmp_path / "ckpt")
    for path, step in ((d, 1), (d, 2)):
        staging = checkpointing.start_staging(path)
        checkpointing.save_rank_state(staging, 0, {"step": step})
        if step == 1:
            checkpointing.commit_staging(path, 1, {"step": step})
    # a complete staging copy (manifest written) beside the checkpoint it would replace
    os.replace(d, d + ".old")
    manifest = {"files": ["random_states_0.pkl"], "step": 2}
    Path(d + ".incomplete", checkpointing.MANIFEST_NAME).write_text(str(manifest).replace("'", '"'))
    found, how = checkpointing.find_checkpoint(d)
    assert found == d + ".incomplete" and "interrupted" in how
    assert checkpointing.recover_checkpoint(d) == how
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert checkpointing.read_manifest(d)["step"] == 2


def test_a_numbered_checkpoint_left_under_its_staging_name_is_loaded_then_put_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    acc = Accelerator(project_config=config)
    model = acc.prepare(torch.nn.Linear(3, 2))
    for value in (1.0, 2.0):
        _trained(acc, model, value)
        acc.save_state()
    base = tmp_path / "checkpoints"
    # what a kill between the manifest and the rename leaves of a first save of checkpoint_1
    os.rename(base / "checkpoint_1", base / "checkpoint_1.incomplete")
    _trained(acc, model, 0.0)
    acc.load_state()  # the latest is checkpoint_1, complete under its staging name
    assert _value(model) == 2.0 and config.iteration == 2
    assert "checkpoint_1.incomplete is used" in caplog.text
    acc.save_state()
    assert sorted(os.listdir(base)) == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
