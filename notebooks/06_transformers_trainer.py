# %% [markdown]
# # 06 · Transformers' `Trainer` on 2 CPU ranks
#
# Nothing here imports notebook_launcher's Accelerate API: `transformers` and `accelerate` are
# the real packages, unchanged. `notebook_launcher` starts the ranks and sets the environment
# `accelerate launch` would (`ACCELERATE_USE_CPU`, mixed precision, debug mode, threads), so the
# `Trainer` in each rank joins **one** 2-rank group: each rank trains on half of every step's
# data and DDP averages the gradients. The `Trainer`'s progress bar (drawn by rank 0 only, as
# `Trainer` does) and its logs appear in the rank panes of the dashboard.
#
# The model is built from a config, so nothing is downloaded. It needs `transformers` and
# `accelerate`, which `pip install -e '.[jupyter]'` installs (the README's Jupyter setup);
# elsewhere: `pip install 'transformers>=5.23,<6' 'accelerate>=1.15'`.

# %%
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything below is made here: no downloads

from notebook_launcher import notebook_launcher


# %%
def train(output_dir: str, steps: int = 8) -> dict:
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)  # same weights and data on both ranks: Trainer shards the batches
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    # A toy task: is the first token even?
    tokens = torch.randint(1, 64, (128, 8))
    data = [{"input_ids": ids, "labels": int(ids[0]) % 2} for ids in tokens]
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=8,
        max_steps=steps,
        learning_rate=1e-3,
        logging_steps=2,
        save_strategy="no",
        report_to="none",
        dataloader_pin_memory=False,  # no GPU to pin for
        ddp_find_unused_parameters=False,  # every parameter is used: skip DDP's extra pass
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    weights = trainer.accelerator.unwrap_model(trainer.model).classifier.weight.detach()
    return {
        "world_size": args.world_size,
        "distributed_type": trainer.accelerator.distributed_type.value,
        "loss": result.training_loss,
        "steps": trainer.state.global_step,
        "classifier_sum": float(weights.sum()),
    }


# %% [markdown]
# Launch it: the dashboard shows both ranks; rank 0's pane has the `Trainer`'s bar and its
# `{'loss': ...}` lines.

# %% tags=["nbval-ignore-output"]
with tempfile.TemporaryDirectory() as output_dir:
    results = notebook_launcher(train, args=(output_dir,), num_processes=2)
print(results)

# %% [markdown]
# One group of two: both ranks saw a world of 2, took the same 8 optimizer steps, and ended
# with the same weights (DDP keeps the replicas identical).

# %%
assert [r["world_size"] for r in results] == [2, 2]
assert [r["distributed_type"] for r in results] == ["MULTI_CPU", "MULTI_CPU"]
assert [r["steps"] for r in results] == [8, 8]
assert results[0]["classifier_sum"] == results[1]["classifier_sum"]
