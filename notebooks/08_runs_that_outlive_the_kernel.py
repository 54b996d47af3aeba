# %% [markdown]
# # 8 · Runs that outlive the kernel
#
# A launch's ranks are the kernel's children: when the kernel dies -- a restart, a crash,
# a laptop that closes, a JupyterHub that culls idle kernels -- the run ends with it. For a
# long training run that is a bad bet. In this notebook you will
#
# 1. start a training run **detached** from the kernel (`detach=True`),
# 2. let go of it (here you may restart the kernel: *Kernel → Restart*),
# 3. find it again with `runs()` (or `%dist runs`) and **attach** to it: the dashboard
#    comes back with the whole history, then follows the run live,
# 4. take its result and load the checkpoint it wrote;
# 5. do the same with a **session** (lesson 5): a model loaded on its ranks is still
#    there after the kernel restarts.

# %% [markdown]
# ## 1. A training function that saves a checkpoint
#
# Nothing here is special to detached runs: the same function runs attached. Rank 0 writes
# the trained weights to `path` at the end, and every rank returns where they are: after a
# kernel restart, the result is how this notebook finds them again.

# %%
import os
import tempfile
import time

import torch

from notebook_launcher import Accelerator, notebook_launcher


def train(steps, path):
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x = torch.randn(64, 4)
    y = x.sum(dim=1, keepdim=True)  # the weights to learn: all ones
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0:
            accelerator.print(f"step {step}: loss {loss.item():.4f}")
        time.sleep(0.02)  # a longer run, in miniature
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), path)
    return {"loss": loss.item(), "checkpoint": path}


checkpoint = os.path.join(tempfile.mkdtemp(), "model.pt")

# %% [markdown]
# ## 2. Start it detached
#
# `detach=True` returns at once with a handle and prints the run's id. The ranks run
# under a small **supervisor** process of their own, not under this kernel: killing or
# restarting the kernel leaves them running, and the supervisor records everything the
# dashboard shows (output, progress, failures) in `~/.notebook_launcher/runs/<id>/`,
# readable by you alone.

# %% tags=["nbval-ignore-output"]
handle = notebook_launcher(train, args=(60, checkpoint), num_processes=2, detach=True)

# %% [markdown]
# ## 3. Let go of it
#
# Restart the kernel now if you like (*Kernel → Restart*): the run goes on. `handle` and
# every variable of this notebook are then gone, but the run is not: `runs()` lists the
# runs of yours on this machine, with their state. The cells below work either way.

# %%
from notebook_launcher import attach, runs

latest = runs()[-1]  # the run started last
print(latest.function, latest.ranks, "ranks:", latest.state in ("running", "ok"))

# %% [markdown]
# ## 4. Attach to it
#
# `attach(id)` (or `%dist attach ID`) shows the run's dashboard with everything it did so far, then follows it
# live. `result()` waits for its end and returns every rank's value (or raises the root
# cause, as an attached launch does). Ctrl-C while waiting only lets go again: the run goes
# on; `handle.stop()` would stop it. Once the result is taken, the run's record is removed.

# %% tags=["nbval-ignore-output"]
handle = attach(latest.id)

# %%
results = handle.result()
print("final loss, every rank:", [round(r["loss"], 3) for r in results])
assert results[0]["loss"] == results[1]["loss"] < 0.01  # DDP kept the ranks' models equal
assert latest.id not in [run.id for run in runs()]  # its record is gone

# %% [markdown]
# ## 5. Load the checkpoint
#
# The run wrote its weights before it ended; load them here as any checkpoint.

# %%
import torch  # noqa: F811 - again: after a kernel restart, the first import is gone

model = torch.nn.Linear(4, 1)
model.load_state_dict(torch.load(results[0]["checkpoint"]))
print("learned weights:", [round(w, 2) for w in model.weight.flatten().tolist()])
assert torch.allclose(model.weight, torch.ones(1, 4), atol=0.05)  # all ones, as taught

# %% [markdown]
# ## 6. A session that outlives the kernel
#
# A session (lesson 5) keeps its ranks and their variables from one cell to the next, but
# its ranks are the kernel's children too. `%dist start --detach` (in code:
# `start(num_processes=2, detach=True)`) puts them under a supervisor of their own: a model
# that took ten minutes to load stays loaded through a kernel restart. The session's id is
# printed; `%%distributed`, `%dist pull` and the rest work on it as on any session.

# %% tags=["nbval-ignore-output"]
# %dist start -n 2 --detach

# %%
# %%distributed
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)  # stands for a model that takes minutes to load
tuple(model.weight.shape)

# %% [markdown]
# Restart the kernel here if you like: the ranks, and `model` on them, stay. In the new
# kernel, `runs()` lists the session (its `kind` is "session") and `%dist attach ID` makes
# it this notebook's session again; a cell that was running when the kernel went away is
# shown from its first line to its end.

# %%
from notebook_launcher import runs  # again: after a kernel restart, the first import is gone

session_id = [run.id for run in runs() if run.kind == "session"][-1]

# %% tags=["nbval-ignore-output"]
# %dist attach {session_id}

# %%
# %%distributed
round(model.weight.sum().item(), 4)  # the same model, on both ranks

# %% [markdown]
# `%dist stop` (or `session.stop()`) ends the ranks and the supervisor, and removes the
# session's record; `%dist detach` would only let go of it here.

# %%
# %dist stop
assert session_id not in [run.id for run in runs()]
