# %% [markdown]
# # 3 · Training with the `Accelerator`
#
# A small regression model, trained on two ranks the way Accelerate does it:
#
# 1. `accelerator.prepare(...)` wraps the model for distributed training and gives
#    each rank its own part of the data;
# 2. **gradient accumulation** (`GradientAccumulationPlugin`) adds up the gradients
#    of several batches before each optimizer step;
# 3. `accelerator.gather_for_metrics` collects the predictions of all ranks for
#    evaluation, without the duplicates that make the last batch even;
# 4. `accelerator.save_model` writes the weights as **safetensors** shards;
# 5. back in this notebook, we load those shards into a fresh model and check it.

# %% [markdown]
# ## The data and the model
#
# The data is synthetic so the notebook runs anywhere in seconds: `y = x · w + b` plus
# a little noise, with 8 input features. Everything the ranks need is created
# inside the training function from fixed seeds, so every rank starts from the same
# model.

# %%
import json
import shutil
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from notebook_launcher import Accelerator, notebook_launcher
from notebook_launcher.utils import GradientAccumulationPlugin

N_FEATURES = 8


def make_data(n_samples, seed):
    g = torch.Generator().manual_seed(seed)
    true_w = torch.arange(1.0, N_FEATURES + 1) / N_FEATURES
    x = torch.randn(n_samples, N_FEATURES, generator=g)
    y = x @ true_w + 0.5 + 0.01 * torch.randn(n_samples, generator=g)
    return TensorDataset(x, y.unsqueeze(1))


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    )


# %% [markdown]
# ## The training function
#
# Read it top to bottom; the Accelerate-specific lines are commented. Note the
# evaluation set has **50** samples: with 2 ranks and batches of 8, the last batch
# is padded with repeated samples so that both ranks have the same number of
# batches. `gather_for_metrics` drops those repeats, so we evaluate on exactly 50
# predictions.


# %%
def train(out_dir, epochs=4, accumulation_steps=2):
    accelerator = Accelerator(
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=accumulation_steps)
    )
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train_loader = DataLoader(make_data(512, seed=1), batch_size=16, shuffle=True)
    eval_loader = DataLoader(make_data(50, seed=2), batch_size=8)

    # One call wraps everything for distributed training.
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )

    optimizer_steps = 0
    step = 0
    for _epoch in tqdm(range(epochs), desc="epoch"):
        model.train()
        for x, y in tqdm(train_loader, desc="batch", leave=False):
            # Inside accumulate(), gradients are only synchronised and applied
            # every `accumulation_steps` batches.
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                optimizer_steps += 1
            # Each rank's loss, for the dashboard's live plot.
            accelerator.log({"loss": loss.item()}, step=step)
            step += 1

    model.eval()
    predictions, targets = [], []
    with torch.no_grad():
        for x, y in eval_loader:
            # Collect every rank's predictions, minus the padding repeats.
            p, t = accelerator.gather_for_metrics((model(x), y))
            predictions.append(p)
            targets.append(t)
    predictions, targets = torch.cat(predictions), torch.cat(targets)
    eval_mse = torch.nn.functional.mse_loss(predictions, targets).item()

    accelerator.wait_for_everyone()
    # Writes safetensors shards (small shards here, to see several files).
    accelerator.save_model(model, out_dir, max_shard_size="1KB")
    return {
        "rank": accelerator.process_index,
        "train_batches_seen": len(train_loader) * epochs,
        "optimizer_steps": optimizer_steps,
        "eval_samples": len(predictions),
        "eval_mse": eval_mse,
    }


# %% [markdown]
# ## Launch it on two ranks
#
# The dashboard shows each rank's `epoch` and `batch` bars and a live plot of each rank's
# loss from `accelerator.log`; when the run ends they are replaced by a static copy and a
# picture, so the saved notebook still shows both.

# %% tags=["nbval-ignore-output"]
out_dir = Path(tempfile.mkdtemp(prefix="training-")) / "model"
results = notebook_launcher(train, args=(str(out_dir),), num_processes=2)

# %% [markdown]
# ## What each rank saw
#
# The 512 training samples are split between the ranks: 256 each per epoch, that
# is 16 batches of 16. Over 4 epochs each rank saw 64 batches and, accumulating
# over 2 batches, stepped its optimizer 32 times. Both ranks evaluated the same 50
# gathered predictions.

# %%
for r in results:
    print(
        f"rank {r['rank']}: {r['train_batches_seen']} batches, "
        f"{r['optimizer_steps']} optimizer steps, {r['eval_samples']} eval samples"
    )

assert [r["train_batches_seen"] for r in results] == [64, 64]
assert [r["optimizer_steps"] for r in results] == [32, 32]
assert [r["eval_samples"] for r in results] == [50, 50]
assert results[0]["eval_mse"] == results[1]["eval_mse"] < 0.3  # variance of y: ~3.4

# %% [markdown]
# The model learned the function: its error on the evaluation set is a tiny
# fraction of the variance of `y` (the error of always predicting the mean).

# %% tags=["nbval-ignore-output"]
y_eval = make_data(50, seed=2).tensors[1]
print(f"eval MSE {results[0]['eval_mse']:.4f}, variance of y {y_eval.var().item():.2f}")

# %% [markdown]
# ## The saved files
#
# `save_model` wrote the weights in shards of about `max_shard_size` each (a tensor
# is never split), plus an index that says which tensor lives in which shard. Only
# the main process writes; every rank waits until the files exist.

# %%
for f in sorted(out_dir.iterdir()):
    print(f.name)

index = json.loads((out_dir / "model.safetensors.index.json").read_text())
shards = sorted(set(index["weight_map"].values()))
assert len(shards) > 1 and all(s.endswith(".safetensors") for s in shards)
assert sorted(index["weight_map"]) == sorted(make_model().state_dict())

# %% [markdown]
# ## Reload the model here, in the notebook
#
# The shards are plain safetensors files: load each, merge them, and load the result
# into a fresh model. Evaluated here, on one process, it gives the same error the
# ranks measured together.

# %%
from safetensors.torch import load_file

state_dict = {}
for shard in shards:
    state_dict.update(load_file(out_dir / shard))

model = make_model()
model.load_state_dict(state_dict)
model.eval()

x, y = make_data(50, seed=2).tensors
with torch.no_grad():
    mse = torch.nn.functional.mse_loss(model(x), y).item()
print(f"reloaded model: eval MSE matches the ranks' = {abs(mse - results[0]['eval_mse']) < 1e-5}")
assert abs(mse - results[0]["eval_mse"]) < 1e-5
shutil.rmtree(out_dir.parent)

# %% [markdown]
# ## What you learned
#
# * `accelerator.prepare` shards the data loaders and wraps the model and optimizer.
# * `with accelerator.accumulate(model):` plus `GradientAccumulationPlugin(num_steps=k)`
#   steps the optimizer every `k` batches (`accelerator.sync_gradients` tells you when).
# * `gather_for_metrics` returns every rank's outputs without the padding repeats.
# * `save_model(..., max_shard_size=...)` writes safetensors shards and an index that
#   any process can load.
#
# Next: **04_debugging** — what it looks like when a rank goes wrong.
