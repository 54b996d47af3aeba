# %% [markdown]
# # 1 · Quickstart: one function, two ranks
#
# In this notebook you will
#
# 1. write an ordinary Python function in a cell,
# 2. run it in **two processes at once** (two *ranks*) with `notebook_launcher`,
# 3. watch both ranks on the live dashboard,
# 4. get every rank's return value back as a Python list.
#
# No GPU is needed. On a CPU-only machine each rank is a CPU process and the ranks
# talk to each other over PyTorch's `gloo` backend; on a GPU machine each rank gets
# its own GPU, and the same code runs unchanged.

# %% [markdown]
# ## What does this machine offer?
#
# This notebook runs on the **Python 3 (notebook_launcher)** kernel. It loads a small
# IPython extension whose `%nl_info` magic shows what the launcher will work with:
# versions, devices, and how the workers will be started.

# %% tags=["nbval-ignore-output"]
# %nl_info

# %% [markdown]
# ## 1. Write the function
#
# The function you launch runs **inside every rank**. When it starts,
# `torch.distributed` is already set up: each rank knows its own number
# (`dist.get_rank()`) and how many ranks there are (`dist.get_world_size()`), and the
# ranks can exchange tensors.
#
# Below, every rank contributes `rank + 1`. `all_reduce` adds up the contributions of
# all ranks and gives the sum to every rank: with two ranks, 1 + 2 = 3.

# %%
import os

import torch
import torch.distributed as dist

from notebook_launcher import notebook_launcher


def hello(scale):
    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # this rank's GPU, or the CPU
    total = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(total)  # sum over all ranks; every rank receives it
    print(f"rank {rank} of {world_size}: the sum is {total.item()}")
    return {"rank": rank, "pid": os.getpid(), "total": total.item() * scale}


# %% [markdown]
# ## 2. Launch it on two ranks
#
# `notebook_launcher(fn, args=..., num_processes=N)` starts `N` worker processes,
# calls `fn(*args)` in each of them, and waits until all have finished. Meanwhile the
# dashboard under the cell shows one row per rank: whether it is running, finished or
# failed, what it printed, and its progress bars.

# %% tags=["nbval-ignore-output"]
results = notebook_launcher(hello, args=(10,), num_processes=2)

# %% [markdown]
# ## 3. Read the results
#
# The launcher returns a list with **one entry per rank, indexed by rank**:
# `results[0]` came from rank 0, `results[1]` from rank 1. Each rank ran in its own
# process (two different pids, neither of them this notebook's), and every rank saw
# the same sum.

# %%
for r in results:
    print(f"rank {r['rank']}: total = {r['total']}")

assert [r["rank"] for r in results] == [0, 1]  # index = rank
assert [r["total"] for r in results] == [30.0, 30.0]  # (1 + 2) * 10 on every rank
assert len({r["pid"] for r in results} | {os.getpid()}) == 3  # 2 workers + this kernel

# %% [markdown]
# ## 4. Progress bars go to the dashboard
#
# A `tqdm` bar inside a rank is drawn on the dashboard, one bar per rank, so a slow
# rank stands out. Here rank 1 sleeps twice as long per step as rank 0.

# %% tags=["nbval-ignore-output"]
import time

from tqdm.auto import tqdm


def count(steps):
    rank = dist.get_rank()
    done = 0
    for _ in tqdm(range(steps), desc="counting"):
        time.sleep(0.01 * (rank + 1))
        done += 1
    return done


counts = notebook_launcher(count, args=(40,), num_processes=2)

# %%
print(counts)
assert counts == [40, 40]

# %% [markdown]
# ## What you learned
#
# * `notebook_launcher(fn, args, num_processes)` runs `fn` on every rank and returns
#   the list of their results, index = rank.
# * Inside `fn`, `torch.distributed` is ready: `get_rank()`, `get_world_size()`,
#   collectives such as `all_reduce`.
# * The dashboard shows each rank's state, output and progress while it runs.
#
# Next: **02_execution_process** — running code on one rank only, waiting for each
# other, and splitting work between ranks.
