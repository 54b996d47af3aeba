# %% [markdown]
# # 4 · Debugging: when a rank goes wrong
#
# Distributed bugs are confusing because one rank's mistake shows up as trouble on
# all of them: the others hang, time out or lose their connection. The launcher
# sorts this out for you. For each failure it tells you **which rank** went wrong
# first (the *root cause*) and marks what happened to the others as *collateral*.
#
# Three classic failures, each shown twice: first as you would meet it (the cell
# fails, with the dashboard and the error), then caught in `try`/`except` to read
# the error's details.

# %%
import os
import signal
import time

import torch.distributed as dist

from notebook_launcher import PartialState, ProcessGroupMismatch, WorkerDied, notebook_launcher
from notebook_launcher.ui.widgets import WidgetView

# %% [markdown]
# ## 1. A rank raises an exception
#
# Rank 1 finds a bad batch and raises `ValueError`, while rank 0 waits for it in a
# barrier. The cell fails with **rank 1's own exception type**, and the traceback
# below it is the one from rank 1, pointing at the line in this notebook that raised.


# %% tags=["nbval-ignore-output", "raises-exception"]
def bad_batch_on_rank_1():
    rank = dist.get_rank()
    if rank == 1:
        raise ValueError("batch 7 has 3 labels for 4 samples")
    dist.barrier()  # rank 0 waits here for rank 1, which never comes
    return rank


notebook_launcher(bad_batch_on_rank_1, num_processes=2)

# %% [markdown]
# Because it is the worker's own exception type, you can catch it as usual (this
# time without the dashboard: `dashboard=False`). It also carries `launch_failure`,
# every rank's record. Its `root_cause` is the rank to look at. Rank 0 did nothing
# wrong: depending on timing it was either stopped by the launcher or failed with
# gloo's "Connection closed by peer", which the summary lists as *collateral*, a
# consequence of rank 1 going away. The error's own traceback continues into rank 1's
# frames (above: the cell that called the launcher, then the line of
# `bad_batch_on_rank_1` that raised); `launch_failure.print_traceback(rank)` prints any
# rank's traceback, with this notebook's cells named as IPython names them.

# %%
try:
    notebook_launcher(bad_batch_on_rank_1, num_processes=2, dashboard=False)
except ValueError as exc:
    error = exc

root = error.launch_failure.root_cause
print(type(error).__name__, "-", error.args[0].splitlines()[0])
print("root cause:", root.describe())

assert (root.rank, root.kind, root.exc_type) == (1, "raised", "ValueError")
error.launch_failure.print_traceback(1)  # rank 1's own traceback
assert "in bad_batch_on_rank_1" in error.launch_failure.tracebacks[1]


# %% [markdown]
# ## 2. A rank dies
#
# A process can also vanish without raising anything: killed by the kernel's
# out-of-memory killer, a segfault in native code, `os._exit`. Rank 1 kills itself
# with `SIGKILL` here. The launcher reports `WorkerDied`, with the signal.


# %% tags=["nbval-ignore-output", "raises-exception"]
def rank_1_is_killed():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does
    dist.barrier()


notebook_launcher(rank_1_is_killed, num_processes=2)

# %%
try:
    notebook_launcher(rank_1_is_killed, num_processes=2, dashboard=False)
except WorkerDied as exc:
    error = exc

root = error.launch_failure.root_cause
print("root cause:", root.describe())

assert (root.rank, root.kind, root.signal_name) == (1, "died", "SIGKILL")


# %% [markdown]
# ## 3. A rank skips a barrier
#
# Every rank must reach every barrier (and every collective) in the same order. Here
# only rank 0 calls `wait_for_everyone()`; rank 1 does something else and returns.
# Rank 0 would wait forever. Instead, the launcher sees that rank 1 returned while
# rank 0 still waited for it, ends the launch and raises `ProcessGroupMismatch`,
# naming rank 1. The dashboard's barrier table shows the barrier rank 0 was stuck
# in, the line of the cell it was called from, and which rank never arrived.
#
# This time we create the dashboard ourselves and pass it in (`dashboard=`), so we
# can read what it showed afterwards.


# %% tags=["nbval-ignore-output", "raises-exception"]
def rank_1_skips_the_barrier():
    state = PartialState()
    if state.is_main_process:
        state.wait_for_everyone()  # rank 0 waits here ...
    else:
        time.sleep(0.5)  # ... while rank 1 does something else ...
    return state.process_index  # ... and returns without ever calling it


dashboard = WidgetView()
notebook_launcher(rank_1_skips_the_barrier, num_processes=2, dashboard=dashboard)

# %% [markdown]
# What the dashboard recorded: the first barrier (`#0`), who arrived and from which
# line (`In[n]:4` is line 4 of the cell above), who is missing, and the root cause.

# %%
barrier = dashboard.model.barriers[0]
missing = barrier.missing(dashboard.model.rank_ids)
line = barrier.locations[0].rsplit(":", 1)[1]
print(f"barrier #0: {barrier.kind}, rank 0 arrived from line {line}, missing: {missing}")
print("root cause on the dashboard: rank", dashboard.model.root_cause().rank)

assert barrier.kind == "wait_for_everyone"
assert (list(barrier.locations), line, missing) == ([0], "4", [1])
assert dashboard.model.root_cause().rank == 1

# %%
try:
    notebook_launcher(rank_1_skips_the_barrier, num_processes=2, dashboard=False)
except ProcessGroupMismatch as exc:
    error = exc

root = error.launch_failure.root_cause
print("root cause:", root.describe())

assert (root.rank, root.kind) == (1, "left")
assert "rank 0 still waited for it at" in root.describe()  # and where

# %% [markdown]
# ## Reading a failure, in short
#
# 1. Look at the **root cause** rank first; the other ranks' errors are usually
#    collateral (a peer closed the connection, a barrier never completed).
# 2. "Raised" is a Python exception: its traceback comes from that rank. "Died" is a
#    process that ended without raising: look at the signal (`SIGKILL` is often
#    memory) or the exit code.
# 3. A hang or a `ProcessGroupMismatch` means the ranks did not take the same path
#    through the collectives: look at the barrier lines the dashboard shows for each
#    rank.
