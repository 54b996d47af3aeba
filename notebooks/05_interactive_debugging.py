# %% [markdown]
# # 5 · Interactive debugging: ranks that stay
#
# In notebooks 1–4 every launch started fresh ranks and ended them: to look at a rank's data
# after a failure, or to try a fix, you launched again and lost the model, the data and
# every variable. A **session** keeps the ranks alive between cells, and makes this notebook
# their console:
#
# * `%dist start -n 2` starts two ranks that stay, with `torch.distributed` set up;
# * a `%%distributed` cell runs on every rank, in a namespace that persists from cell to
#   cell (`rank`, `world_size`, `torch`, `dist`, `device`, `state` are at hand), and shows
#   each rank's value of its last expression;
# * `%%rank 1` (or `%%distributed --ranks 1`) runs a cell on some ranks only;
# * when a rank fails, the cell raises that rank's exception, **and the session lives
#   on**: nothing is lost, and you can look inside the failing frame afterwards.
#
# The story: a small classifier trains on two ranks, each on its own shard of the data.
# One rank's shard holds a bad batch. We find it, look at it, fix it, and go on training,
# in the same session, with no relaunch.

# %% [markdown]
# ## Start the ranks
#
# The kernel of these notebooks loads the magics; in another kernel,
# `%load_ext notebook_launcher` does. The status line names the processes, which stay the
# same for the whole notebook.

# %% tags=["nbval-ignore-output"]
# %dist start -n 2

# %% [markdown]
# ## Data, model and a training step, on every rank
#
# This cell runs on both ranks. Each builds its own shard (8 batches of 16 samples, three
# classes), and the same model from the same seed. `train_step` does by hand what
# `DistributedDataParallel` does: after the backward pass, `all_reduce` averages the
# gradients of both ranks, so both models take the same step and stay identical.
#
# We plant the bug ourselves, as a corrupt file would: one label of rank 1's sixth batch
# is `7`, and there are only three classes.
#
# (This first cell takes a moment, importing on both ranks: a cell that runs longer than
# half a second shows the dashboard; a quick one shows just its output and values.)

# %% tags=["nbval-ignore-output"]
# %%distributed
import torch
import torch.distributed as dist
import torch.nn.functional as F

N_CLASSES, N_FEATURES, BATCHES, BATCH_SIZE = 3, 4, 8, 16


def make_shard(rank):
    """This rank's part of the data: BATCHES batches of (features, labels)."""
    g = torch.Generator().manual_seed(100 + rank)
    centers = 3 * torch.eye(N_CLASSES, N_FEATURES)  # class c lies around centers[c]
    shard = []
    for _ in range(BATCHES):
        y = torch.randint(0, N_CLASSES, (BATCH_SIZE,), generator=g)
        x = centers[y] + torch.randn(BATCH_SIZE, N_FEATURES, generator=g)
        shard.append((x, y))
    if rank == 1:
        shard[5][1][3] = 7  # the bad label
    return shard


def train_step(x, y):
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():  # average the gradients over the ranks, as DDP does
        dist.all_reduce(p.grad)
        p.grad /= world_size
    optimizer.step()
    return loss.item()


def train(epochs):
    global steps_done
    for _ in range(epochs):
        for x, y in shard:
            losses.append(train_step(x, y))
            steps_done += 1
    return steps_done


shard = make_shard(rank)
torch.manual_seed(0)  # the same initial weights on both ranks
model = torch.nn.Linear(N_FEATURES, N_CLASSES)
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
steps_done, losses = 0, []
len(shard), sum(len(y) for _, y in shard)

# %% [markdown]
# ## Train, and meet the bug
#
# One epoch. Rank 1 reaches its sixth batch and `cross_entropy` raises. Rank 0 goes on
# until it waits for rank 1 in `all_reduce` (never stopped half way through a step): the
# session interrupts it there, re-forms the process group to free it, and the cell raises
# **rank 1's own exception**. Read the end of the
# error: which rank raised, the variables of the frame that failed (summarised: tensors by
# shape and dtype), and that the session lives on.

# %% tags=["nbval-ignore-output", "raises-exception"]
# %%distributed
train(epochs=1)

# %% [markdown]
# The error of the last failing cell is `sys.last_value`, like any other: an `IndexError`,
# raised on rank 1, in `train_step`, with `x` and `y` at hand.

# %%
import sys

import torch

error = sys.last_value
frame = next(note for note in error.__notes__ if note.startswith("Variables"))
print(type(error).__name__, "-", error)
print("raised on rank", error.launch_failure.root_cause.rank)
print(frame)

assert isinstance(error, IndexError) and error.launch_failure.root_cause.rank == 1
assert "y: Tensor 16 int64 on cpu" in frame

# %% [markdown]
# ## Nothing was lost
#
# Both ranks stopped after five steps; their models, data and counters are all still
# there. (The same process group was re-formed under them: objects built on the old one,
# such as a model wrapped for DDP, would have to be wrapped again. Ours are plain tensors.)

# %%
# %%distributed
steps_done, len(losses), round(model.weight.sum().item(), 4)

# %% [markdown]
# ## Find the bad batch, on rank 1 only
#
# `%%rank 1` runs the cell on rank 1 alone. Which of its batches has a label that is not a
# class?

# %%
# %%rank 1
[i for i, (x, y) in enumerate(shard) if (y >= N_CLASSES).any()]

# %% [markdown]
# ## Look inside the failing frame
#
# `--post-mortem` runs the cell **in the frame where rank 1 failed** (`train_step`), with its
# variables, the way pdb's `interact` does, without running anything again.

# %%
# %%distributed --ranks 1 --post-mortem
y.tolist(), int(y.max())

# %% [markdown]
# ## Fix it, and go on
#
# The label `7` is garbage: drop that sample from rank 1's batch (the other rank's data is
# fine, so this runs on rank 1 only). Then train on, with the same model, optimizer and
# counters: three more epochs.

# %%
# %%rank 1
x, y = shard[5]
keep = y < N_CLASSES
shard[5] = (x[keep], y[keep])
len(shard[5][1])

# %%
# %%distributed
train(epochs=3)

# %% [markdown]
# Five steps before the bug, twenty-four after it. The models stayed identical on both
# ranks (the gradients were averaged at every step), and the loss went down.

# %%
# %%distributed
weights = model.weight.detach().clone()
first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
steps_done, round(first, 3), round(last, 3)

# %% [markdown]
# `%dist pull NAME` brings each rank's value into this notebook, as a list (index = rank).

# %%
# %dist pull weights
# %dist pull losses
# %dist pull steps_done
print("steps on each rank:", steps_done)
print("same weights on both ranks:", torch.equal(weights[0], weights[1]))

assert steps_done == [29, 29]
assert torch.equal(weights[0], weights[1])
assert all(sum(r[-8:]) / 8 < sum(r[:5]) / 5 for r in losses)  # it learned

# %% [markdown]
# ## A hang: find it with the stall view, and fix it
#
# The worst distributed bug makes no error at all: one rank waits for something another
# rank only does later, and nothing moves. Here rank 0 saves a file for everyone, but only
# *after* a barrier, while rank 1 waits for the file *before* the barrier.
#
# In your own notebook you would just run the cell: once no rank made progress for
# `stall_after` seconds (30 by default) the cell's dashboard shows every rank's Python stack,
# side by side, and names the odd rank out; the interrupt button then stops the cell, says
# where each rank was, and keeps the session. Here the task runs in the background
# (`session.submit`) so that the next cells can look at it, on a session of its own that
# calls a stall after 2 seconds.

# %% tags=["nbval-ignore-output"]
import os
import tempfile

import notebook_launcher

session = notebook_launcher.start(num_processes=2, stall_after=2)
shared_dir = tempfile.mkdtemp()


def save_then_load(path):
    """Rank 0 saves a tensor for everyone; every rank loads it."""
    import os
    import time

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.barrier()  # wait until everyone is ready...
        torch.save(torch.ones(3), path)  # ...then save
    else:
        while not os.path.exists(path):  # BUG: waits for the file before the barrier
            time.sleep(0.1)
        dist.barrier()
    return torch.load(path).sum().item()


handle = session.submit(save_then_load, os.path.join(shared_dir, "ones.pt"))

# %% [markdown]
# Two seconds later the dashboard above shows the stall view. `session.stacks()` (or
# `%dist stacks` for the `%dist` session, or `handle.stacks()`) says the same on demand:
# where each rank is, the odd one first.

# %%
import time

time.sleep(3)
stacks = session.stacks()
print("\n".join(stacks.findings))
print("the odd rank out:", stacks.odd)

# %% tags=["nbval-ignore-output"]
display(stacks)  # every thread of every rank, the library frames folded

# %% [markdown]
# Rank 1 waits for the file in its loop (line 23); rank 0 waits in the barrier (line 19)
# for rank 1, which will never come. Stop the task (the session lives on), move the save
# before the barrier, and run it again.

# %%
handle.cancel()


def save_then_load(path):
    """Rank 0 saves a tensor for everyone; every rank loads it once it is there."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        torch.save(torch.ones(3), path)
    dist.barrier()  # past this line the file exists, for every rank
    return torch.load(path).sum().item()


session.run(save_then_load, os.path.join(shared_dir, "ones.pt"))

# %%
session.close()

# %% [markdown]
# ## Stop the ranks
#
# `%dist stop` ends them (closing the kernel does too). The same from Python:
# `session = notebook_launcher.start(num_processes=2)`, then `session.run(fn)`,
# `session.run_cell(source, ranks=[1])`, `session.post_mortem(1, source)`,
# `session.push(lr=...)`, `session.pull("losses")`, `session.close()`.

# %%
# %dist stop

# %% [markdown]
# ## What you learned
#
# * A session's ranks stay between cells; so do their variables.
# * A failing cell raises the failing rank's exception, with its frame's variables, and the
#   session survives it, even while another rank waits in a collective.
# * `%%rank N` looks at one rank; `--post-mortem` looks inside the frame that failed.
# * Fix the data or the code in place, and continue: no relaunch, nothing recomputed.
# * A hang shows itself: after `stall_after` seconds without progress the dashboard shows
#   where every rank is and names the odd one out; `stacks()` says it on demand.
