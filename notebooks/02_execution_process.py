# %% [markdown]
# # 2 · The execution process: who runs what, and when
#
# With several ranks running the same function, you constantly need to say *"only
# one rank does this"* (print, save, download) or *"nobody goes on until everybody
# is here"*. This notebook demonstrates, live, every tool of Accelerate's
# ["Execution process"](https://huggingface.co/docs/accelerate/basic_tutorials/execution)
# and ["Deferring executions"](https://huggingface.co/docs/accelerate/concept_guides/deferring_execution)
# pages, with the same names.
#
# They live on `PartialState`, which needs no model or optimizer; an `Accelerator`
# has all of them too (`accelerator.is_main_process`, `accelerator.wait_for_everyone()`,
# ...). Code written for Accelerate runs after changing the import.
#
# Every launch returns what the ranks observed, and a cell after it **checks** that
# observation: if a feature broke, this notebook fails.

# %%
import contextlib
import io
import shutil
import tempfile
import time
from pathlib import Path

from notebook_launcher import PartialState, notebook_launcher

workdir = Path(tempfile.mkdtemp(prefix="execution-process-"))


# %% [markdown]
# ## 1. Who am I? `is_main_process` and `is_local_main_process`
#
# Every rank has a global index, `process_index` (0 ... `num_processes - 1`), and an
# index on its own machine, `local_process_index`. The **main process** is global
# rank 0; each machine also has a **local main process** (its local rank 0). On a
# single machine they are the same rank. With two machines of two GPUs, global
# rank 2 would be the local main process of the second machine, but not the main
# process.


# %% tags=["nbval-ignore-output"]
def who_am_i():
    state = PartialState()
    return {
        "process_index": state.process_index,
        "local_process_index": state.local_process_index,
        "num_processes": state.num_processes,
        "is_main_process": state.is_main_process,
        "is_local_main_process": state.is_local_main_process,
        "is_last_process": state.is_last_process,
    }


identities = notebook_launcher(who_am_i, num_processes=2)

# %%
for identity in identities:
    print(identity)

assert [i["process_index"] for i in identities] == [0, 1]
assert [i["is_main_process"] for i in identities] == [True, False]
assert [i["is_local_main_process"] for i in identities] == [True, False]
assert [i["is_last_process"] for i in identities] == [False, True]

# %% [markdown]
# ## 2. Printing once: `state.print`, and one progress bar
#
# A plain `print` runs on every rank, so a log line appears once per rank.
# `state.print(...)` prints once per machine, on the local main process. The same
# idea gives a single progress bar instead of one per rank:
# `tqdm(..., disable=not state.is_local_main_process)`.
#
# To prove it, each rank captures what it printed and reports whether its bar was
# shown.

# %% tags=["nbval-ignore-output"]
from tqdm.auto import tqdm


def print_once():
    state = PartialState()
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        print(f"plain print from rank {state.process_index}")
        state.print("state.print: epoch 1 finished")
    bar = tqdm(range(20), desc="epoch 1", disable=not state.is_local_main_process)
    bar_shown = not bar.disable
    for _ in bar:
        time.sleep(0.01)
    return {"printed": captured.getvalue(), "bar_shown": bar_shown}


printed = notebook_launcher(print_once, num_processes=2)

# %%
for rank, seen in enumerate(printed):
    print(f"--- rank {rank} printed:\n{seen['printed']}", end="")
    print(f"    and showed a progress bar: {seen['bar_shown']}")

assert printed[0]["printed"].count("state.print") == 1
assert "state.print" not in printed[1]["printed"]
assert [p["bar_shown"] for p in printed] == [True, False]


# %% [markdown]
# ## 3. Functions that run on one process only
#
# Decorators make a function run on a chosen process and do nothing elsewhere:
#
# | decorator | runs on |
# |---|---|
# | `@state.on_main_process` | global rank 0 (logging to a tracker, saving) |
# | `@state.on_local_main_process` | local rank 0 of every machine (unzipping to local disk) |
# | `@state.on_process(process_index=i)` | global rank `i` |
# | `@state.on_local_process(local_process_index=i)` | local rank `i` of every machine |
# | `@state.on_last_process` | the last rank |
#
# Each decorated function below records its name when it actually runs.


# %% tags=["nbval-ignore-output"]
def decorated():
    state = PartialState()
    ran = []

    @state.on_main_process
    def log_to_tracker():
        ran.append("on_main_process")

    @state.on_local_main_process
    def unzip_to_local_disk():
        ran.append("on_local_main_process")

    @state.on_process(process_index=1)
    def only_rank_1():
        ran.append("on_process(process_index=1)")

    @state.on_local_process(local_process_index=1)
    def only_local_rank_1():
        ran.append("on_local_process(local_process_index=1)")

    @state.on_last_process
    def only_the_last():
        ran.append("on_last_process")

    for f in (log_to_tracker, unzip_to_local_disk, only_rank_1, only_local_rank_1, only_the_last):
        f()
    return ran


ran = notebook_launcher(decorated, num_processes=2)

# %%
for rank, names in enumerate(ran):
    print(f"rank {rank} ran: {names}")

assert ran[0] == ["on_main_process", "on_local_main_process"]
assert ran[1] == [
    "on_process(process_index=1)",
    "on_local_process(local_process_index=1)",
    "on_last_process",
]


# %% [markdown]
# ## 4. Waiting for everyone: `wait_for_everyone`
#
# Ranks run at their own pace. `state.wait_for_everyone()` is a **barrier**: no rank
# goes past it until every rank has reached it.
#
# Here rank 1 is slow and writes a file; rank 0 reads that file right after the
# barrier. Without the barrier rank 0 would look too early and crash with
# `FileNotFoundError`. While rank 0 waits, the dashboard shows the barrier it waits
# in and the line of code it came from.


# %% tags=["nbval-ignore-output"]
def barrier_demo(folder):
    state = PartialState()
    message = Path(folder) / "message-from-rank-1.txt"
    if state.process_index == 1:
        time.sleep(0.5)  # rank 1 is slow ...
        message.write_text("rank 1 was here")
    state.wait_for_everyone()  # ... and nobody passes this line before it arrives
    return message.read_text()


messages = notebook_launcher(barrier_demo, args=(str(workdir),), num_processes=2)

# %%
print(messages)
assert messages == ["rank 1 was here", "rank 1 was here"]


# %% [markdown]
# ## 5. One download, read by everyone: `main_process_first`
#
# Downloading a dataset on every rank at once wastes bandwidth and can corrupt the
# cache. In `with state.main_process_first():` the main process runs the block
# **first**; the other ranks wait at the start of the block and run it once the main
# process has finished it, finding the data already there.
#
# Each rank writes what it did to a shared log, so we can check the order.


# %% tags=["nbval-ignore-output"]
def load_dataset(folder):
    state = PartialState()
    data_file = Path(folder) / "dataset.csv"
    log = Path(folder) / "log.txt"

    def note(message):
        with open(log, "a") as f:
            f.write(f"rank {state.process_index}: {message}\n")

    with state.main_process_first():
        if data_file.exists():
            note("dataset already there, reading it")
        else:
            note("downloading the dataset")
            time.sleep(0.5)  # a slow download
            data_file.write_text(",".join(str(i) for i in range(10)))
        numbers = [int(x) for x in data_file.read_text().split(",")]
    return sum(numbers)


sums = notebook_launcher(load_dataset, args=(str(workdir),), num_processes=2)

# %%
log = (workdir / "log.txt").read_text()
print(log, end="")
print("sums:", sums)

assert log.splitlines() == [
    "rank 0: downloading the dataset",
    "rank 1: dataset already there, reading it",
]
assert sums == [45, 45]

# %% [markdown]
# ## 6. Sharing out work: `split_between_processes`
#
# For inference over a list of inputs, `with state.split_between_processes(inputs) as
# mine:` gives each rank its own slice. With 5 prompts and 2 ranks, rank 0 gets 3 and
# rank 1 gets 2.
#
# Collectives such as `gather` need the same number of items on every rank. With
# `apply_padding=True` a shorter slice is padded by repeating its last item, so every
# rank has 3; after gathering, keep the first `len(inputs)` results to drop the
# padding.

# %% tags=["nbval-ignore-output"]
import torch.distributed as dist


def split_demo():
    state = PartialState()
    prompts = ["a cat", "a dog", "a bird", "a fish", "a frog"]
    with state.split_between_processes(prompts) as mine:
        plain = list(mine)
    with state.split_between_processes(prompts, apply_padding=True) as mine:
        padded = list(mine)
        answers = [p.upper() for p in padded]  # the "model"
    gathered = [None] * state.num_processes
    dist.all_gather_object(gathered, answers)  # needs equal lengths: padding
    every_answer = [a for part in gathered for a in part]
    return {"plain": plain, "padded": padded, "results": every_answer[: len(prompts)]}


shares = notebook_launcher(split_demo, num_processes=2)

# %%
for rank, share in enumerate(shares):
    print(f"rank {rank}: plain={share['plain']}  padded={share['padded']}")
print("results:", shares[0]["results"])

assert [s["plain"] for s in shares] == [["a cat", "a dog", "a bird"], ["a fish", "a frog"]]
assert shares[1]["padded"] == ["a fish", "a frog", "a frog"]  # its last item, repeated
assert shares[0]["results"] == ["A CAT", "A DOG", "A BIRD", "A FISH", "A FROG"]


# %% [markdown]
# ## 7. Stopping everyone early: `set_trigger` and `check_trigger`
#
# Early stopping is a trap in distributed training: if one rank decides to stop and
# `break`s out of the loop, the others wait forever for it in the next collective.
# Instead, the rank that wants to stop calls `state.set_trigger()`, and **every** rank
# calls `state.check_trigger()` at the same place in the loop; it returns `True` on
# all ranks as soon as any rank set the trigger, so they all stop at the same step.
#
# Below, only rank 1's validation loss drops under the threshold (at step 3).


# %% tags=["nbval-ignore-output"]
def train_with_early_stopping():
    state = PartialState()
    losses = {
        0: [0.9, 0.7, 0.5, 0.4, 0.3, 0.2],
        1: [0.8, 0.6, 0.4, 0.05, 0.3, 0.2],
    }[state.process_index]
    for step, loss in enumerate(losses):
        if loss < 0.1:
            state.set_trigger()  # only this rank wants to stop ...
        if state.check_trigger():  # ... and every rank learns about it here
            return {"stopped_at_step": step, "loss": loss}
    return {"stopped_at_step": None, "loss": losses[-1]}


stops = notebook_launcher(train_with_early_stopping, num_processes=2)

# %%
for rank, stop in enumerate(stops):
    print(f"rank {rank}: {stop}")

assert [s["stopped_at_step"] for s in stops] == [3, 3]  # both ranks stop together
shutil.rmtree(workdir)

# %% [markdown]
# ## What you learned
#
# * `is_main_process` / `is_local_main_process` / `is_last_process` and `process_index`
#   tell a rank who it is.
# * `state.print` prints once; `on_main_process`, `on_local_main_process`,
#   `on_process`, `on_local_process` and `on_last_process` run a function on chosen
#   ranks only.
# * `wait_for_everyone` is a barrier; `main_process_first` lets rank 0 prepare what
#   the others then read.
# * `split_between_processes` shares inputs out, with padding when results are
#   gathered.
# * `set_trigger` / `check_trigger` stop every rank at the same step.
#
# Next: **03_training** — a model trained with `Accelerator.prepare`.
