# %% [markdown]
# # 7 · From laptop to cluster: the same function on a Slurm job's nodes
#
# So far every rank ran on this machine. When one machine is not enough, the ranks go to
# the nodes of a **Slurm** cluster -- and the notebook stays the one place you work from:
#
# 1. a training function, run on **2 CPU ranks here**, as in notebook 1;
# 2. the **same function** on a Slurm job of two nodes: `SlurmCluster` asks Slurm for the
#    nodes, Slurm starts one *agent* on each, and this kernel drives every rank through
#    them (the dashboard, the rank's own exception, Ctrl-C: all as before);
# 3. a **session across the nodes**: cells that run on every rank of every node.
#
# You need a Slurm cluster whose nodes run this same Python environment, and a port on this
# machine they can reach. (This course's test machine runs a small Slurm cluster of three
# "nodes" on its own loopback; on a real cluster the cell is the same, with your
# `partition=` and `time=`.)

# %% [markdown]
# ## 1. The function, on this machine
#
# Each rank trains a tiny linear model on its own shard of synthetic data, averaging the
# gradients of all ranks (what `DistributedDataParallel` does), and returns where it ran,
# its last loss and a checksum of its weights: equal checksums mean the replicas agree.

# %%
import os
import socket

import torch
import torch.distributed as dist

from notebook_launcher import notebook_launcher


def train(steps=30, lr=0.1):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same starting weights on every rank
    model = torch.nn.Linear(4, 1)
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    x = torch.randn(64, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():  # average the gradients of all ranks
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
    checksum = round(sum(p.sum().item() for p in model.parameters()), 4)
    host = os.environ.get("SLURMD_NODENAME", socket.gethostname())
    return {"rank": rank, "host": host, "loss": round(loss.item(), 4), "checksum": checksum}


# %% tags=["nbval-ignore-output"]
here = notebook_launcher(train, num_processes=2)
here

# %%
assert len({r["checksum"] for r in here}) == 1  # both replicas agree
print("2 ranks here, loss", [r["loss"] < 1.0 for r in here])

# %% [markdown]
# ## 2. The same function on two nodes
#
# `SlurmCluster(nodes=2, ...)` takes the options you would give `sbatch` (`partition=`,
# `time=`, `gpus_per_node=`, `account=`, ... and `sbatch_options=[...]` for the rest). It
# submits nothing yet: the first launch that needs it does, shows the job's state while it
# waits (`PENDING (Resources)`, then the agents joining), and keeps the nodes for the next
# launches. `num_processes` is the job's total: 4 ranks on 2 nodes are 2 ranks per node.
#
# The channel between the agents and this kernel is authenticated with a secret made for
# this job, which never appears on a command line or in the notebook.

# %% tags=["nbval-ignore-output"]
from notebook_launcher import SlurmCluster

cluster = SlurmCluster(nodes=2, job_name="lesson-07", time="10")
there = notebook_launcher(train, num_processes=4, cluster=cluster)
there

# %% [markdown]
# Each rank says which node it ran on: ranks 0 and 1 on the job's first node, 2 and 3 on
# the second. The four replicas agree, and the function did not change.

# %%
hosts = [r["host"] for r in there]
assert hosts[0] == hosts[1] != hosts[2] == hosts[3]
assert len({r["checksum"] for r in there}) == 1
print("4 ranks on 2 nodes; the replicas agree:", len({r["checksum"] for r in there}) == 1)

# %% [markdown]
# A failure on a remote node is the cell's exception, as on this machine: the rank's own
# exception type, its line, and which host it ran on.


# %% tags=["nbval-ignore-output", "raises-exception"]
def fails_on_rank_3():
    if dist.get_rank() == 3:
        raise ValueError("rank 3 found a bad batch")
    dist.barrier()


notebook_launcher(fails_on_rank_3, num_processes=4, cluster=cluster)

# %% [markdown]
# ## 3. A session across the nodes
#
# `notebook_launcher.start(num_processes=4, cluster=cluster)` keeps the ranks of both nodes
# alive between cells (notebook 5), on the same job. In a cell of its own,
# `%dist start -n 4 --slurm "--nodes 2 --partition debug"` does the same from the magics.

# %% tags=["nbval-ignore-output"]
session = notebook_launcher.start(num_processes=4, cluster=cluster)
session.run_cell("import os\nhost = os.environ['SLURMD_NODENAME']\n(rank, host)")

# %%
values = session.run_cell("rank * 10", ranks=[3, 0])  # some ranks, in the order asked
assert values == ["30", "0"]
session.push(lr=0.05)  # into every rank's namespace, on every node
print("pushed to every rank:", session.pull("lr"))

# %% [markdown]
# ## The end: the job ends with the cluster
#
# Closing the session lets its ranks go; closing the cluster lets the agents go, and the
# Slurm job ends (`squeue` shows nothing of it). The kernel's end would do the same.
#
# A run that must outlive this kernel passes a *new* cluster with `detach=True`:
# `notebook_launcher(train, num_processes=4, cluster=SlurmCluster(nodes=2), detach=True)`.
# A supervisor of its own then submits the job and owns it, the run goes on when the kernel
# dies, `notebook_launcher.attach(id)` follows it from any kernel of yours on this machine,
# and the job ends with the run (notebook 8 shows detached runs on one machine).

# %%
import subprocess

session.close()
cluster.close()
left = subprocess.run(
    ["squeue", "-h", "-n", "lesson-07"], capture_output=True, text=True, check=True
)
print("jobs of this lesson left:", len(left.stdout.split()))
