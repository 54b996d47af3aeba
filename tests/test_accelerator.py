"""The Accelerator: single-process behaviour here, equivalence and resume on real CPU ranks."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F  # TORCHINDUCTOR_CACHE_DIR: do it before the env guard looks
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from notebook_launcher import notebook_launcher
from notebook_launcher._events import BarrierEnter, Output, WorkerPhase
from notebook_launcher.accelerator import (
    AcceleratedOptimizer,
    AcceleratedScheduler,
    Accelerator,
)
from notebook_launcher.data_loader import DataLoaderShard
from notebook_launcher.state import DistributedType, GradientState
from notebook_launcher.utils.dataclasses import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
)

from .helpers import Recorder

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("one_torch_thread")]


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def data(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))


# ----------------------------------------------------------------------- single process


def test_prepare_single_process_keeps_order_and_types() -> None:
    acc = Accelerator()
    assert acc.distributed_type == DistributedType.NO and acc.num_processes == 1
    assert acc.is_main_process and acc.is_local_main_process and acc.is_last_process
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    loader = DataLoader(data(), batch_size=4)
    other = {"not": "prepared"}
    out = acc.prepare(sched, loader, other, model, opt)
    assert isinstance(out[0], AcceleratedScheduler) and out[0].scheduler is sched
    assert isinstance(out[1], DataLoaderShard)
    assert out[2] is other
    assert out[3] is model  # no DDP in a single process
    assert isinstance(out[4], AcceleratedOptimizer) and out[4].optimizer is opt
    assert isinstance(out[4], torch.optim.Optimizer)
    assert out[0].optimizers == [out[4]]
    assert acc.prepare(model) is model
    assert acc.unwrap_model(model) is model


def test_gradient_accumulation_arguments() -> None:
    with pytest.raises(ValueError, match="only pass one of"):
        Accelerator(
            gradient_accumulation_steps=2,
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2),
        )
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    assert acc.gradient_accumulation_steps == 3
    gs = acc.gradient_state
    assert (gs.adjust_scheduler, gs.sync_with_dataloader, gs.sync_each_batch) == (True, True, False)
    with pytest.raises(ValueError, match="num_steps"):
        GradientAccumulationPlugin(num_steps=0)


def test_dataloader_arguments() -> None:
    with pytest.raises(ValueError, match="dataloader_config"):
        Accelerator(split_batches=True, dataloader_config=DataLoaderConfiguration())
    acc = Accelerator(split_batches=True)
    assert acc.split_batches and acc.even_batches and not acc.use_seedable_sampler
    assert DataLoaderConfiguration() == DataLoaderConfiguration(
        split_batches=False, dispatch_batches=None, even_batches=True, use_seedable_sampler=False
    )


def test_accumulate_syncs_every_n_and_at_end_of_dataloader() -> None:
    acc = Accelerator(gradient_accumulation_steps=3)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    loader = DataLoader(data(14), batch_size=2)  # 7 batches
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    pattern, weights_changed, lrs = [], [], []
    for x, y in loader:
        before = [p.detach().clone() for p in model.parameters()]
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
        pattern.append(acc.sync_gradients)
        weights_changed.append(
            any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        )
        lrs.append(sched.get_last_lr()[0])
    assert pattern == [False, False, True, False, False, True, True]
    assert weights_changed == pattern
    # the scheduler stepped once per optimizer step (one process): 1/2, 1/3, 1/4
    assert lrs == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.05, 0.1 / 3, 0.025])


def test_backward_divides_by_accumulation_steps() -> None:
    acc = Accelerator(gradient_accumulation_steps=4)
    w = torch.nn.Parameter(torch.tensor(1.0))
    acc.backward(w * 8)
    assert w.grad is not None and w.grad.item() == 2.0


def test_bf16_autocast_on_cpu() -> None:
    acc = Accelerator(mixed_precision="bf16", cpu=True)
    assert acc.mixed_precision == "bf16" and acc.device.type == "cpu"
    with acc.autocast():
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16
    model = acc.prepare(torch.nn.Linear(4, 4))
    x = torch.randn(3, 4)
    out = model(x)  # forward runs under autocast, outputs come back as fp32
    assert out.dtype == torch.float32
    expected = F.linear(x.bfloat16(), model.weight.bfloat16(), model.bias.bfloat16()).float()
    assert torch.equal(out, expected)
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert "forward" not in plain.__dict__
    assert torch.allclose(plain(x), x @ plain.weight.t() + plain.bias)


def test_fp16_on_cpu_trains_in_fp32_with_a_warning() -> None:
    # Accelerate's behaviour: accepted, no autocast and no GradScaler on a CPU.
    with pytest.warns(UserWarning, match="fp16' on CPU"):
        acc = Accelerator(mixed_precision="fp16")
    model = acc.prepare(torch.nn.Linear(4, 2))
    assert acc.mixed_precision == "fp16" and acc.scaler is None and not acc.native_amp
    with acc.autocast():
        assert model(torch.randn(3, 4)).dtype == torch.float32
    assert "forward" not in model.__dict__  # no autocast wrapper on the model either


def test_clip_grad() -> None:
    acc = Accelerator()
    w = torch.nn.Parameter(torch.zeros(4))
    w.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert acc.clip_grad_norm_([w], 1.0).item() == pytest.approx(5.0)
    assert torch.allclose(w.grad, torch.tensor([0.6, 0.8, 0.0, 0.0]))
    w.grad = torch.tensor([3.0, -4.0, 0.5, 0.0])
    acc.clip_grad_value_([w], 1.0)
    assert w.grad.tolist() == [1.0, -1.0, 0.5, 0.0]


def test_single_process_collectives_and_trigger() -> None:
    acc = Accelerator()
    t = torch.arange(3.0)
    assert torch.equal(acc.gather(t), t)
    assert torch.equal(acc.reduce(t), t)
    assert torch.equal(acc.pad_across_processes(t), t)
    assert acc.check_trigger() is False
    acc.set_trigger()
    assert acc.check_trigger() is True
    assert acc.check_trigger() is False
    acc.wait_for_everyone()


class Tied(torch.nn.Module):
    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=bias)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_save_model_tied_weights_single_process(tmp_path: Path) -> None:
    acc = Accelerator()
    model = acc.prepare(Tied())
    acc.save_model(model, tmp_path / "out")
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert list(saved) == ["embed.weight"]
    fresh = Tied()
    missing = fresh.load_state_dict(saved, strict=False)  # the alias is the same tensor
    assert missing.missing_keys == ["head.weight"]
    assert torch.equal(fresh.head.weight, model.embed.weight)
    with pytest.raises(ValueError, match="not a file"):
        (tmp_path / "f").write_text("")
        acc.save_model(model, tmp_path / "f")


class Counter:
    """A custom object to checkpoint (anything with state_dict / load_state_dict)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def test_save_state_automatic_naming_and_limit(tmp_path: Path) -> None:
    config = ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2
    )
    acc = Accelerator(project_config=config)
    model = acc.prepare(mlp())
    counter = Counter()
    acc.register_for_checkpointing(counter)
    with pytest.raises(ValueError, match="state_dict"):
        acc.register_for_checkpointing(object())
    dirs = []
    for i in range(3):
        counter.n = i + 10
        dirs.append(acc.save_state())
    assert [os.path.basename(d) for d in dirs] == [f"checkpoint_{i}" for i in range(3)]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_1", "checkpoint_2"]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    counter.n = 0
    acc.load_state()  # the latest
    assert torch.equal(model[0].weight, mlp()[0].weight)
    assert counter.n == 12
    assert acc.save_iteration == 3
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        os.makedirs(tmp_path / "empty")
        acc.load_state(tmp_path / "empty")


def test_interrupted_save_state_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from notebook_launcher import checkpointing

    acc = Accelerator()
    model = acc.prepare(mlp())
    ckpt = tmp_path / "ckpt"
    acc.save_state(ckpt)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    real = checkpointing.save_rank_state

    def crash(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt("kernel interrupted mid-save")

    monkeypatch.setattr(checkpointing, "save_rank_state", crash)
    with pytest.raises(KeyboardInterrupt):
        acc.save_state(ckpt)
    monkeypatch.setattr(checkpointing, "save_rank_state", real)
    # the half-written state never replaced the checkpoint, and is not loadable itself
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        acc.load_state(str(ckpt) + ".incomplete")
    acc.load_state(ckpt)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    acc.save_state(ckpt)  # the next save clears the debris
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_second_run_in_the_same_project_dir_is_refused_and_pruning_goes_by_number(
    tmp_path: Path,
) -> None:
    """Issue 25 item 7: a second run silently replaced checkpoint_0, then load_state()
    resumed from the first run's newer checkpoint. Accelerate refuses ("already exists")."""
    first = Accelerator(
        project_config=ProjectConfiguration(
            project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2, iteration=9
        )
    )
    first.prepare(mlp())
    for _ in range(3):
        first.save_state()
    # by number: checkpoint_9 is older than checkpoint_10, whatever the names' order
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_10", "checkpoint_11"]

    config = ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2
    )
    second = Accelerator(project_config=config)
    second.prepare(mlp())
    with pytest.raises(ValueError, match=r"checkpoint_11 already exists, newer than checkpoint_0"):
        second.save_state()
    config.iteration = 11
    with pytest.raises(ValueError, match=r"Checkpoint directory .*checkpoint_11 \(11\) already"):
        second.save_state()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_10", "checkpoint_11"]
    second.load_state()  # what the message says: resume, and the numbering continues
    assert config.iteration == 12
    assert os.path.basename(second.save_state()) == "checkpoint_12"
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_11", "checkpoint_12"]


def _second_run_worker(project: str) -> str:
    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
    acc = Accelerator(project_config=config)
    acc.prepare(mlp())
    return acc.save_state()


@pytest.mark.timeout(60)
def test_a_refused_save_state_raises_on_every_rank(tmp_path: Path) -> None:
    from notebook_launcher import checkpointing

    earlier = str(tmp_path / "checkpoints" / "checkpoint_0")  # an earlier run's
    checkpointing.save_rank_state(checkpointing.start_staging(earlier), 0, {"step": 3})
    checkpointing.commit_staging(earlier, 1, {"step": 3, "iteration": 0})
    with pytest.raises(ValueError, match=r"checkpoint_0 \(0\) already exists") as info:
        notebook_launcher(
            _second_run_worker, args=(str(tmp_path),), num_processes=2, dashboard=False
        )
    failures = info.value.launch_failure.failures  # type: ignore[attr-defined]
    assert sorted((f.rank, f.kind, f.collateral) for f in failures) == [
        (0, "raised", False),
        (1, "raised", False),
    ]
    assert os.listdir(tmp_path / "checkpoints") == ["checkpoint_0"]


def _own_directory_worker(base: str) -> dict[str, Any]:
    """Accelerate's test_stateful_dataloader_save_state, shortened: each rank saves into its
    own directory and resumes from it."""
    import logging
    import sys

    # pytest's log capture, inherited by the forked rank, would keep the warning from stderr
    # (the Accelerator logs under Accelerate's logger name, as Accelerate's does)
    logging.getLogger("accelerate").addHandler(logging.StreamHandler(sys.stderr))
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    loader = acc.prepare(DataLoader(data(32), batch_size=4, shuffle=True))
    mine = os.path.join(base, f"rank{acc.process_index}")
    unseen = []
    for step, batch in enumerate(loader):
        if step == 2:
            acc.save_state(mine)
        if step > 2:
            unseen.append(batch[0])
    acc.load_state(mine)
    resumed = [batch[0] for batch in loader]
    out: dict[str, Any] = {
        "same": len(unseen) == len(resumed)
        and all(torch.equal(a, b) for a, b in zip(unseen, resumed, strict=True))
    }
    out["files"] = sorted(os.listdir(mine))
    acc.prepare(mlp())  # now with a model: only rank 0's directory holds it
    acc.save_state(mine)
    try:
        acc.load_state(mine)
        out["load"] = "ok"
    except ValueError as exc:
        out["load"] = str(exc)
    return out


@pytest.mark.timeout(60)
def test_save_state_into_each_ranks_own_directory(tmp_path: Path) -> None:
    """Issue 26: Accelerate accepts a different directory on each rank (their
    test_stateful_dataloader_save_state does it); we refused it."""
    events = Recorder()
    results = notebook_launcher(
        _own_directory_worker, args=(str(tmp_path),), num_processes=2, dashboard=events
    )
    assert [r["same"] for r in results] == [True, True]
    assert results[0]["files"] == ["checkpoint.json", "random_states_0.pkl"]
    assert results[1]["files"] == ["checkpoint.json", "random_states_1.pkl"]
    assert results[0]["load"] == "ok"
    assert "rank1' has no weights for model 0" in results[1]["load"]
    assert "only the main process's holds the models" in results[1]["load"]
    warned = "".join(events.lines(0, "stderr"))
    assert "save_state got a different directory on each rank" in warned
    assert "load_state on a rank whose directory lacks them fails" in warned


def test_free_memory() -> None:
    acc = Accelerator()
    model, opt = acc.prepare(mlp(), torch.optim.SGD(mlp().parameters(), lr=1))
    assert acc._models and acc._optimizers
    assert acc.free_memory(model, opt) == [None, None]
    assert not acc._models and not acc._optimizers and acc.step == 0


# --------------------------------------------------------------------------- real ranks


def _equivalence_worker(sync_each_batch: bool) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=sync_each_batch)
    acc = Accelerator(gradient_accumulation_plugin=plugin)
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(data(48), batch_size=4)
    model, opt, loader = acc.prepare(model, opt, loader)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    calls = {"n": 0}

    # unannotated on purpose: DDP rejects a `bucket` annotation other than dist.GradBucket,
    # and this module's annotations are strings
    def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]
        state["n"] += 1
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    model.register_comm_hook(calls, counting_allreduce)
    steps = []
    for x, y in loader:
        with acc.accumulate(model):
            before = calls["n"]
            acc.backward(F.mse_loss(model(x), y))
            grads = torch.cat([p.grad.flatten() for p in model.parameters()])
            ranks_grads = acc.gather(grads[None])
            steps.append(
                {
                    "sync": acc.sync_gradients,
                    "allreduces": calls["n"] - before,
                    "grads_equal": bool(torch.allclose(ranks_grads[0], ranks_grads[1])),
                }
            )
            opt.step()
            opt.zero_grad()
    acc.set_trigger() if acc.process_index == 1 else None
    triggered = acc.check_trigger()
    reduced = acc.reduce(torch.tensor([acc.process_index + 1.0]), reduction="sum")
    padded = acc.pad_across_processes(torch.ones(acc.process_index + 1))
    return {
        "state": {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()},
        "steps": steps,
        "triggered": triggered,
        "reduced": reduced.item(),
        "padded": padded.tolist(),
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sync_each_batch", [False, True])
def test_accumulate_on_two_ranks_equals_full_batch_training(sync_each_batch: bool) -> None:
    results = notebook_launcher(
        _equivalence_worker, args=(sync_each_batch,), num_processes=2, dashboard=False
    )
    # single process reference: 3 optimizer steps on the full 16-sample batch
    ref = mlp(0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = data(48).tensors
    for s in range(3):
        F.mse_loss(ref(x[16 * s : 16 * (s + 1)]), y[16 * s : 16 * (s + 1)]).backward()
        opt.step()
        opt.zero_grad()
    for r in results:
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(r["state"][name], value, rtol=1e-5, atol=1e-6)
    steps = results[0]["steps"]
    assert [s["sync"] for s in steps] == [False, True] * 3
    for s in steps:
        if s["sync"] or sync_each_batch:  # sync_each_batch: all-reduce, but step every 2
            assert s["allreduces"] >= 1 and s["grads_equal"]
        else:  # no_sync really skipped the all-reduce: local gradients differ
            assert s["allreduces"] == 0 and not s["grads_equal"]
    assert [r["triggered"] for r in results] == [True, True]
    assert [r["reduced"] for r in results] == [3.0, 3.0]
    assert [r["padded"] for r in results] == [[1.0, 0.0], [1.0, 1.0]]


def _parts(acc: Accelerator, seed: int) -> tuple[Any, ...]:
    torch.manual_seed(seed * 10 + acc.process_index)  # ranks differ, as in real runs
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(12, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(7)
    ds = TensorDataset(torch.randn(36, 6, generator=g), torch.randn(36, 1, generator=g))
    loader = DataLoader(ds, batch_size=3, shuffle=True)
    return acc.prepare(model, opt, sched, loader)


def _train(acc: Accelerator, parts: tuple[Any, ...], loader: Iterable[Any], stop: int = -1) -> None:
    model, opt, sched, _ = parts
    for i, (x, y) in enumerate(loader):
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
        if i + 1 == stop:
            return


def _weights(acc: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}


def _resume_worker(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    acc = Accelerator(gradient_accumulation_steps=2)  # A: 3 epochs, uninterrupted
    parts = _parts(acc, seed=0)
    for _ in range(3):
        _train(acc, parts, parts[3])
    out["A"] = _weights(acc, parts[0])
    out["A_lr"] = parts[2].get_last_lr()

    acc = Accelerator(gradient_accumulation_steps=2)  # B: 1 epoch, save, 4 batches, save
    parts = _parts(acc, seed=0)
    _train(acc, parts, parts[3])
    acc.save_state(os.path.join(tmp, "epoch"))
    model, opt, sched, loader = parts
    for i, (x, y) in enumerate(loader):
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
        if i == 3:
            acc.save_state(os.path.join(tmp, "mid"))
            break

    acc = Accelerator(gradient_accumulation_steps=2)  # C: other init, resume at epoch 1
    parts = _parts(acc, seed=5)
    acc.load_state(os.path.join(tmp, "epoch"))
    for _ in range(2):
        _train(acc, parts, parts[3])
    out["C"] = _weights(acc, parts[0])
    out["C_lr"] = parts[2].get_last_lr()

    acc = Accelerator(gradient_accumulation_steps=2)  # D: resume mid-epoch 1
    parts = _parts(acc, seed=6)
    acc.load_state(os.path.join(tmp, "mid"))
    _train(acc, parts, acc.skip_first_batches(parts[3], 4))
    _train(acc, parts, parts[3])
    out["D"] = _weights(acc, parts[0])
    out["files"] = sorted(os.listdir(os.path.join(tmp, "mid")))
    return out


@pytest.mark.timeout(60)
def test_save_load_state_resumes_bit_identically(tmp_path: Path) -> None:
    results = notebook_launcher(
        _resume_worker, args=(str(tmp_path),), num_processes=2, dashboard=False
    )
    for r in results:
        for name, value in r["A"].items():
            assert torch.equal(r["C"][name], value), f"epoch resume differs in {name}"
            assert torch.equal(r["D"][name], value), f"mid-epoch resume differs in {name}"
        assert r["C_lr"] == r["A_lr"]
    assert results[0]["files"] == [
        "checkpoint.json",
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "scheduler.bin",
    ]
    assert sorted(os.listdir(tmp_path)) == ["epoch", "mid"]  # no staging left behind


def _stateful_parts(seed: int) -> tuple[Any, ...]:
    """A stateful training loader, and an evaluation loader first iterated at epoch end
    (as Accelerate's complete_nlp_example has them)."""
    acc = Accelerator(
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
        gradient_accumulation_steps=2,
    )
    parts = _parts(acc, seed)
    evaluation = acc.prepare(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=2))
    return acc, parts, evaluation


def _stateful_epoch(
    acc: Accelerator, parts: tuple[Any, ...], evaluation: Any, save: str | None = None
) -> list[float]:
    """One epoch (6 batches a rank) of training then evaluation; ``save``: a checkpoint
    after 4 batches (a whole number of accumulation steps: gradients being accumulated are
    not saved)."""
    model, opt, sched, loader = parts
    seen = []
    for i, (x, y) in enumerate(loader):
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
        seen.append(float(x.sum()))
        if save is not None and i == 3:
            acc.save_state(save)
    for _ in evaluation:
        pass
    return seen


def _stateful_resume_worker(tmp: str) -> dict[str, Any]:
    """A: 3 epochs, saving in the middle of epoch 0 (before evaluation ever ran) and of
    epoch 1. B: 3 epochs, no checkpoint. C: resumed from A's epoch-1 checkpoint."""
    out: dict[str, Any] = {}
    acc, parts, evaluation = _stateful_parts(seed=0)
    out["A_batches"] = [
        _stateful_epoch(acc, parts, evaluation, save=os.path.join(tmp, f"e{e}") if e < 2 else None)
        for e in range(3)
    ]
    out["A"] = _weights(acc, parts[0])
    acc, parts, evaluation = _stateful_parts(seed=0)
    for _ in range(3):
        _stateful_epoch(acc, parts, evaluation)
    out["B"] = _weights(acc, parts[0])
    acc, parts, evaluation = _stateful_parts(seed=4)
    acc.load_state(os.path.join(tmp, "e1"))
    out["C_batches"] = [_stateful_epoch(acc, parts, evaluation) for _ in range(2)]
    out["C"] = _weights(acc, parts[0])
    return out


@pytest.mark.timeout(60)
def test_stateful_loader_resumes_mid_epoch_bit_identically(tmp_path: Path) -> None:
    """With use_stateful_dataloader, a checkpoint taken mid-epoch resumes the same
    permutation where it stopped and the same random stream (Accelerate 1.15 resumes the
    right number of batches from another permutation), and taking a checkpoint does not
    change the training (reading an unused stateful loader's state drew from the global
    RNG)."""
    pytest.importorskip("torchdata.stateful_dataloader")
    results = notebook_launcher(
        _stateful_resume_worker, args=(str(tmp_path),), num_processes=2, dashboard=False
    )
    for r in results:
        assert r["C_batches"][0] == r["A_batches"][1][4:]  # the rest of epoch 1
        assert r["C_batches"][1] == r["A_batches"][2]
        for name, value in r["A"].items():
            assert torch.equal(r["B"][name], value), f"saving changed the training ({name})"
            assert torch.equal(r["C"][name], value), f"the resumed run differs in {name}"


def _uneven_worker() -> dict[str, Any]:
    acc = Accelerator()
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, DataLoader(data(6), batch_size=2))
    lengths = [len(loader)]
    with acc.join_uneven_inputs([model], even_batches=False):
        lengths.append(len(loader))
        seen = []
        for x, y in loader:
            seen.append(x.shape[0])
            acc.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    lengths.append(len(loader))
    acc.init_trackers("compat")  # no trackers: accepted and ignored
    acc.log({"loss": 1.0})
    return {"lengths": lengths, "seen": seen, "state": _weights(acc, model)}


@pytest.mark.timeout(60)
def test_join_uneven_inputs() -> None:
    results = notebook_launcher(_uneven_worker, num_processes=2, dashboard=False)
    # 3 batches: rank 0 gets two, rank 1 one, inside the block only
    assert [r["lengths"] for r in results] == [[2, 2, 2], [2, 1, 2]]
    assert [r["seen"] for r in results] == [[2, 2], [2]]
    for name, value in results[0]["state"].items():  # Join kept the replicas identical
        assert torch.equal(results[1]["state"][name], value)


def _metrics_worker(out_dir: str, n: int) -> dict[str, Any]:
    acc = Accelerator()  # mixed precision comes from the launcher
    model = acc.prepare(Tied(bias=True))
    with torch.no_grad():
        inner_dtype = model.module.head(torch.ones(1, 4)).dtype  # plain Linear under DDP
        with acc.autocast():
            autocast_dtype = model.module.head(torch.ones(1, 4)).dtype
        out_dtype = model(torch.tensor([1])).dtype
    acc.save_model(model, out_dir, max_shard_size=100)  # 160 + 40 bytes: two shards
    acc.wait_for_everyone()
    with acc.main_process_first():
        pass
    acc.print(f"printed by rank {acc.process_index}")
    loader = acc.prepare(DataLoader(torch.arange(n), batch_size=2))
    preds = []
    for batch in loader:
        preds += acc.gather_for_metrics(batch * 10).tolist()
    if acc.process_index == acc.num_processes - 1:
        acc.set_trigger()
    return {
        "preds": preds,
        "trigger": acc.check_trigger(),
        "files": sorted(os.listdir(out_dir)),
        "mp": acc.mixed_precision,
        "dtypes": (inner_dtype, autocast_dtype, out_dtype),
    }


@pytest.mark.timeout(60)
def test_three_ranks_metrics_save_model_and_barrier_events(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTEBOOK_LAUNCHER_BARRIER_QUIET_MS", "0")  # report every barrier
    view = Recorder()
    out = str(tmp_path / "model")
    results = notebook_launcher(
        _metrics_worker, args=(out, 13), num_processes=3, dashboard=view, mixed_precision="bf16"
    )
    for r in results:
        assert r["mp"] == "bf16"
        assert r["dtypes"] == (torch.float32, torch.bfloat16, torch.float32)
        assert r["preds"] == [10 * i for i in range(13)]  # 13 = not a multiple of 3 x 2
        assert r["trigger"] is True
        # every rank returns after the files exist (the main process wrote them once)
        assert r["files"] == sorted(os.listdir(out))
    assert sorted(os.listdir(out)) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    # plain safetensors loads the shards; the tied head is stored once
    merged: dict[str, torch.Tensor] = {}
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        merged.update(load_file(os.path.join(out, name)))
    assert sorted(merged) == ["embed.weight", "head.bias"]
    # the Accelerator's barriers reach the dashboard, on every rank, at the user's line
    kinds = {(e.rank, e.kind) for e in view.events if isinstance(e, BarrierEnter)}
    for rank in range(3):
        assert (rank, "wait_for_everyone") in kinds
        assert (rank, "main_process_first") in kinds
    printed = [
        (e.rank, e.text) for e in view.events if isinstance(e, Output) and "printed" in e.text
    ]
    assert printed == [(0, "printed by rank 0\n")]  # accelerator.print: once, on the main process
    locations = {e.location for e in view.events if isinstance(e, BarrierEnter)}
    assert any(loc.startswith("test_accelerator.py:") for loc in locations)
    # prepare() says while it wraps the model in DDP (torch's seconds, issue 26), then done
    phases = [(e.rank, e.phase) for e in view.events if isinstance(e, WorkerPhase)]
    for rank in range(3):
        assert [p for r, p in phases if r == rank][-2:] == ["wrapping", ""]


def test_prepare_in_parent_without_launcher_is_single_process() -> None:
    # the kernel's own process: no launcher, no process group
    acc = Accelerator()
    model, opt, loader = acc.prepare(
        mlp(), torch.optim.SGD(mlp().parameters(), lr=0.1), DataLoader(data(10), batch_size=4)
    )
    assert not torch.distributed.is_initialized()
    assert [len(x) for x, _ in loader] == [4, 4, 2]
    assert GradientState().active_dataloader is None


# ----------------------------------------------------------------- Accelerate parity details


def _comm_hook_worker(hook: str) -> dict[str, Any]:
    from notebook_launcher.utils.dataclasses import DistributedDataParallelKwargs

    handler = DistributedDataParallelKwargs(comm_hook=hook, comm_state_option={})
    acc = Accelerator(kwargs_handlers=[handler])
    torch.manual_seed(0)
    model = acc.prepare(torch.nn.Linear(4, 1))
    x = torch.full((2, 4), float(acc.process_index + 1))
    model(x).sum().backward()
    hooks = [getattr(h, "__name__", "") for h, _ in model._comm_hooks]
    return {"grad": model.module.weight.grad.clone(), "kwargs": handler.to_kwargs(), "hooks": hooks}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hook", ["fp16", "power_sgd"])  # bf16 compression needs NCCL
def test_ddp_comm_hook_is_registered(hook: str) -> None:
    results = notebook_launcher(_comm_hook_worker, args=(hook,), num_processes=2, dashboard=False)
    # ranks fed 1s and 2s: averaged to 3 per weight through the hook (PowerSGD starts with
    # plain all-reduces), like plain DDP
    for r in results:
        assert torch.equal(r["grad"], torch.full((1, 4), 3.0))
        assert r["kwargs"] == {}  # hook fields are not DDP constructor arguments
        assert r["hooks"] == [{"fp16": "fp16_compress_hook", "power_sgd": "powerSGD_hook"}[hook]]


def test_comm_wrapper_must_be_a_compression() -> None:
    from notebook_launcher.utils.dataclasses import DistributedDataParallelKwargs

    with pytest.raises(ValueError, match="comm_wrapper must be"):
        DistributedDataParallelKwargs(comm_hook="power_sgd", comm_wrapper="power_sgd")


def test_state_reset_under_an_accelerator_says_what_happened() -> None:
    from notebook_launcher.state import AcceleratorState, PartialState

    acc = Accelerator()
    AcceleratorState._reset_state()
    with pytest.raises(
        AttributeError, match=r"`AcceleratorState` object has no attribute `device`"
    ):
        acc.prepare(torch.nn.Linear(1, 1))
    state = PartialState()
    PartialState._reset_state()
    with pytest.raises(AttributeError, match=r"`PartialState._reset_state\(\)` was called"):
        _ = state.process_index


def test_distributed_type_can_be_posed_on_the_accelerator_state_only() -> None:
    acc = Accelerator()
    acc.state.distributed_type = DistributedType.FSDP
    assert acc.distributed_type == DistributedType.FSDP
    from notebook_launcher.state import PartialState

    assert PartialState().distributed_type == DistributedType.NO  # the truth is untouched
    with acc.join_uneven_inputs([torch.nn.Linear(1, 1)]):  # single process: nothing to join
        pass


def _join_warning_worker() -> list[str]:
    import warnings

    acc = Accelerator()
    acc.state.distributed_type = DistributedType.FSDP
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acc.join_uneven_inputs([torch.nn.Linear(1, 1)]):
            pass
    return [str(w.message) for w in caught]


@pytest.mark.timeout(60)
def test_join_warns_outside_ddp() -> None:
    for messages in notebook_launcher(_join_warning_worker, num_processes=2, dashboard=False):
        assert len(messages) == 1 and "only supported for multi-GPU" in messages[0]


def test_stateful_dataloader_uses_torchdata_as_in_accelerate() -> None:
    from notebook_launcher.utils.imports import is_torchdata_stateful_dataloader_available

    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    if not is_torchdata_stateful_dataloader_available():
        with pytest.raises(ImportError, match="Please install torchdata version 0.8.0"):
            acc.prepare(loader)
        return
    from torchdata.stateful_dataloader import StatefulDataLoader

    prepared = acc.prepare(loader)
    assert isinstance(prepared, StatefulDataLoader)
    seen = []
    for i, (batch,) in enumerate(prepared):
        seen.append(batch.tolist())
        if i == 1:
            state = prepared.state_dict()  # after two batches handed out
    again = acc.prepare(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2))
    again.load_state_dict(state)
    assert [b.tolist() for (b,) in again] == seen[2:]


def test_stateful_dataloader_saved_after_its_epoch_resumes_with_the_next() -> None:
    """A loader that finished its epoch (an evaluation loader, when a checkpoint is taken
    during the next training epoch) restores to a full next epoch, not to an empty one
    (Accelerate's complete_nlp_example then evaluated nothing after resuming)."""
    pytest.importorskip("torchdata.stateful_dataloader")
    acc = Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))

    def loader() -> Any:
        return acc.prepare(DataLoader(TensorDataset(torch.arange(6.0)), batch_size=2))

    done = loader()
    everything = [b.tolist() for (b,) in done]
    state = done.state_dict()
    assert state["_iterator_finished"] is True
    resumed = loader()
    resumed.load_state_dict(state)
    assert [b.tolist() for (b,) in resumed] == everything
    # left with break: resumes after the batches it handed out; after the last one, the
    # epoch is over (as in Accelerate, which marks the state finished at the last batch)
    for stop_after, expected in ((0, everything[1:]), (1, everything[2:]), (2, everything)):
        partial = loader()
        for i, _ in enumerate(partial):
            if i == stop_after:
                break
        again = loader()
        again.load_state_dict(partial.state_dict())
        assert [b.tolist() for (b,) in again] == expected


def test_a_second_accelerator_updates_gradient_accumulation() -> None:
    Accelerator(gradient_accumulation_steps=4)
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))
    assert acc.gradient_accumulation_steps == 2 == GradientState().num_steps
    assert Accelerator().gradient_accumulation_steps == 1  # Accelerate's rule: latest wins


@pytest.mark.parametrize("bad", [False, True])
def test_a_skipped_scaler_step_is_known_without_reading_the_scale_each_step(bad: bool) -> None:
    """fp16's GradScaler: the scale is compared when step_was_skipped is asked, not read
    (a wait for the GPU) twice in every step."""
    from notebook_launcher.optimizer import AcceleratedOptimizer

    w = torch.nn.Parameter(torch.ones(3))
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    opt = AcceleratedOptimizer(torch.optim.SGD([w], lr=0.1), scaler=scaler)
    scaler.scale((w * (float("inf") if bad else 1.0)).sum()).backward()
    opt.step()
    assert isinstance(opt._is_overflow, tuple)  # nothing read yet
    assert opt.step_was_skipped is bad and opt.is_overflow is bad
    assert torch.equal(w.detach(), torch.ones(3) if bad else torch.full((3,), 0.9))
