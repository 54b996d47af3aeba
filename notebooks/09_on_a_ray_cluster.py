# %% [markdown]
# # 9 · On a Ray cluster: the same function on Ray's nodes
#
# Notebook 7 sent the ranks to a Slurm job's nodes. Many notebooks live on a **Ray**
# cluster instead: a Jupyter pod of KubeRay on Kubernetes, an Anyscale workspace, the head
# node of a Ray cluster. There the same cell runs on Ray's nodes with `RayCluster`:
#
# 1. a look at the Ray cluster this kernel is on;
# 2. a training function on **2 Ray nodes x 2 ranks**: Ray reserves the nodes (all or
#    none), hosts one agent per node, and this kernel drives every rank, as on Slurm;
# 3. a **failure** on one rank: the rank's own exception, here;
# 4. a **session** across the Ray nodes, then the end: nothing left on Ray; and a request
#    larger than the cluster, refused at once instead of waiting forever.
#
# You need Ray in this environment and on the nodes (`pip install 'notebook_launcher[ray]'`).
# (This course's test machine runs a small Ray cluster of two nodes on its own loopback and
# points `RAY_ADDRESS` at it; on KubeRay or Anyscale the cells are the same.)

# %% [markdown]
# ## 1. The Ray cluster this kernel is on
#
# `RayCluster()` joins the cluster that `ray.init()` would: the one this process is
# connected to, else the one `RAY_ADDRESS` names (what KubeRay and Anyscale set in their
# pods), else one started on this machine. You need not call `ray.init()` yourself; here
# we do, to look at the cluster first.

# %% tags=["nbval-ignore-output"]
import ray

ray.init(log_to_driver=False)  # the cluster RAY_ADDRESS names

# %%
alive = [n for n in ray.nodes() if n["Alive"]]
print(len(alive), "Ray nodes, CPUs each:", [n["Resources"]["CPU"] for n in alive])

# %% [markdown]
# ## 2. The function, on two Ray nodes
#
# Each rank trains a tiny linear model on its own shard, averaging the gradients of all
# ranks (as in notebook 7), and returns where it ran: the Ray node (its id, which Ray
# gives the agent as `NOTEBOOK_LAUNCHER_RAY_NODE`), its last loss and a checksum of its
# weights: equal checksums mean the replicas agree.

# %%
import os

import torch
import torch.distributed as dist

from notebook_launcher import RayCluster, notebook_launcher


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
    node = os.environ["NOTEBOOK_LAUNCHER_RAY_NODE"][:8]
    return {"rank": rank, "ray_node": node, "loss": round(loss.item(), 4), "checksum": checksum}


# %% [markdown]
# `RayCluster(nodes=2)` asks Ray for a **placement group** of two bundles, one per Ray node
# (`cpus_per_node=1` CPU each by default; `gpus_per_node=4` would ask for 4 GPUs on each):
# Ray grants all of them or none. One small actor per bundle starts this package's agent on
# its node, and the agents join this kernel. Nothing happens until the first launch, which
# waits for the agents (a few seconds) and keeps them for the next launches.
# `num_processes` is the total: 4 ranks on 2 nodes are 2 ranks per node.

# %% tags=["nbval-ignore-output"]
cluster = RayCluster(nodes=2)
there = notebook_launcher(train, num_processes=4, cluster=cluster)
there

# %%
nodes = [r["ray_node"] for r in there]
assert nodes[0] == nodes[1] != nodes[2] == nodes[3]  # ranks 0, 1 on one node; 2, 3 on the other
assert len({r["checksum"] for r in there}) == 1
print("4 ranks on 2 Ray nodes; the replicas agree:", len({r["checksum"] for r in there}) == 1)

# %% [markdown]
# ## 3. A failure on a Ray node
#
# A rank's exception is the cell's exception, as on this machine: its own type, its line,
# its rank, and the other ranks stopped (without the `try`, the cell shows its traceback).
# `launch_failure` says which rank failed first and what became of the others. The
# cluster stays up for the next launch.


# %% tags=["nbval-ignore-output"]
def fails_on_rank_3():
    if dist.get_rank() == 3:
        raise ValueError("rank 3 found a bad batch")
    dist.barrier()


try:
    notebook_launcher(fails_on_rank_3, num_processes=4, cluster=cluster)
except ValueError as exc:
    failed = exc
    print(f"{type(exc).__name__}: {exc}")
    print(failed.launch_failure.summary())

# %%
root = failed.launch_failure.root_cause
assert (str(failed), root.rank) == ("rank 3 found a bad batch", 3)
print(f"{type(failed).__name__} raised on rank {root.rank}, on a Ray node")

# %% [markdown]
# ## 4. A session across the Ray nodes
#
# `notebook_launcher.start(num_processes=4, cluster=cluster)` keeps the ranks alive between
# cells (notebook 5), on the same agents.

# %% tags=["nbval-ignore-output"]
session = notebook_launcher.start(num_processes=4, cluster=cluster)
session.run_cell("import os\nrank, os.environ['NOTEBOOK_LAUNCHER_RAY_NODE'][:8]")

# %%
values = session.run_cell("rank * 10", ranks=[3, 0])  # some ranks, in the order asked
assert values == ["30", "0"]
session.push(lr=0.05)  # into every rank's namespace, on every Ray node
print("pushed to every rank:", session.pull("lr"))

# %% [markdown]
# ## The end: nothing left on Ray
#
# Closing the session lets its ranks go; closing the cluster stops the agents, ends their
# actors and removes the placement group, so its CPUs (and GPUs) go back to Ray. The
# kernel's end does the same. A request the Ray cluster can never hold (more nodes or GPUs
# than it has) is refused at once, saying what each node has, instead of waiting forever.

# %%
from ray.util.placement_group import placement_group_table

session.close()
cluster.close()
groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
actors = ray.util.list_named_actors(all_namespaces=True)
print("placement groups left:", len(groups), "· actors left:", len(actors))

# %% tags=["nbval-ignore-output"]
from notebook_launcher import ClusterError

try:
    notebook_launcher(train, num_processes=3, cluster=RayCluster(nodes=3))
except ClusterError as exc:
    refused = exc
    print(f"{type(exc).__name__}: {exc}")
assert "it can never start" in str(refused)
