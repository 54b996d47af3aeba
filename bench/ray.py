"""Ours on a Ray cluster against Ray Train's TorchTrainer, side by side on one local Ray cluster.

    python bench/ray.py [--runs 3] [--steps 200] [--print-seconds 5]

Needs ``pip install 'ray[train]'`` (tested: 2.60.0). It re-runs itself inside a network
namespace of its own (``unshare -n``, loopback up: Ray never listens beyond loopback nor
looks for a route out; as root), starts a two-node Ray cluster there
(``ray.cluster_utils.Cluster``, 6 logical CPUs a node, no dashboard, no usage stats) and
measures, 2 nodes x 2 ranks (gloo), in the same run:

  * **ours, to running**: ``notebook_launcher(fn, num_processes=4, cluster=RayCluster(nodes=2,
    cpus_per_node=2))`` on a started cluster: from the call to every rank past its first
    barrier (the latest rank's clock), and to the results back; the first call (the placement
    group, the actors, the agents joining) on its own;
  * **TorchTrainer.fit(), to the first step**: ``TorchTrainer(loop, scaling_config=
    ScalingConfig(num_workers=4))``: from ``fit()`` to every worker past its first barrier;
    the first fit and the next ones (warm: Ray's workers are reused where it can);
  * **a step, ours against plain torch in Ray actors**: ``--steps`` DDP steps of a small MLP
    (gloo, 4 ranks) timed inside the ranks: under ours, and in 4 Ray actors that form the
    group themselves (``init_process_group`` on a TCP store) -- the median of each rank's
    mean step, and the ratio (goal <= 1.02x).

  * **the kernel's CPU** while the 2x2 ranks print 100 lines/s each for ``--print-seconds``
    (the launcher's own cost: a view that draws nothing), against a local launch of 4 ranks,
    as ``bench/cluster.py`` measures it on Slurm.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
# this file is bench/ray.py: its folder on the path would make `import ray` import it
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]
INSIDE = "NOTEBOOK_LAUNCHER_BENCH_RAY_INSIDE"


def first_barrier() -> float:
    """In a rank: the clock once its group met (what "running" means in both columns)."""
    import torch.distributed as dist

    dist.barrier()
    return time.time()


def steps(n: int) -> float:
    """In a rank whose group is formed: the mean seconds of ``n`` DDP steps of a small MLP."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    for _ in range(10):  # warm-up
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(n):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return (time.perf_counter() - started) / n


def ours_steps(n: int) -> float:
    import torch

    torch.set_num_threads(1)
    first_barrier()
    return steps(n)


def trainer_loop(config: dict[str, Any]) -> None:
    """Ray Train's worker: writes its clock past the first barrier to a file of its rank."""
    import ray.train

    at = first_barrier()
    rank = ray.train.get_context().get_world_rank()
    with open(os.path.join(config["folder"], f"rank{rank}"), "w") as f:
        f.write(repr(at))


class PlainRank:
    """Plain torch in a Ray actor: forms the group itself, runs the same steps."""

    def run(self, rank: int, world: int, port: int, n: int) -> float:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        try:
            return steps(n)
        finally:
            dist.destroy_process_group()


def chatty(seconds: float) -> None:
    """Print 100 lines a second for ``seconds`` (as ``bench/cluster.py``'s ranks do)."""
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        print(f"line {i} of a chatty rank, with some words to make it a real line", flush=True)
        i += 1
        time.sleep(0.01)


def kernel_cpu(launch: Any) -> float:
    """The share of one core this process (the kernel's stand-in) used while ``launch()`` ran."""

    def used() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    c0, t0 = used(), time.perf_counter()
    launch()
    return (used() - c0) / (time.perf_counter() - t0)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(args: argparse.Namespace) -> None:
    import ray
    from ray.cluster_utils import Cluster as LocalRay

    from notebook_launcher import RayCluster, notebook_launcher

    node = {"num_cpus": 6, "node_ip_address": "127.0.0.1", "include_dashboard": False}
    local = LocalRay(initialize_head=True, head_node_args=node)
    rows: list[tuple[str, str]] = []
    try:
        local.add_node(**node)
        ray.init(address=local.address, log_to_driver=False)
        local.wait_for_nodes()
        cluster = RayCluster(nodes=2, cpus_per_node=2)

        def ours() -> tuple[float, float]:
            called = time.time()
            times = notebook_launcher(first_barrier, num_processes=4, cluster=cluster)
            return max(times) - called, time.time() - called

        first = ours()
        rows.append(
            ("ours: first call (placement group, agents joining) -> running", f"{first[0]:.2f} s")
        )
        warm = [ours() for _ in range(args.runs)]
        ours_running = statistics.median(w[0] for w in warm)
        rows.append(("ours: call -> 2x2 ranks running (warm, median)", f"{ours_running:.3f} s"))
        rows.append(
            (
                "ours: call -> results back (warm, median)",
                f"{statistics.median(w[1] for w in warm):.3f} s",
            )
        )
        ours_step = statistics.median(
            notebook_launcher(ours_steps, (args.steps,), num_processes=4, cluster=cluster)
        )
        from notebook_launcher.ui import NullView

        talk = (args.print_seconds,)
        quiet = {"num_processes": 4, "dashboard": NullView()}  # the launcher's own cost
        on_ray = kernel_cpu(lambda: notebook_launcher(chatty, talk, cluster=cluster, **quiet))
        here = kernel_cpu(lambda: notebook_launcher(chatty, talk, **quiet))
        rows.append(
            (
                "kernel CPU, 2x2 ranks printing 100 lines/s each (goal <= 3 %)",
                f"{on_ray * 100:.1f} % of a core (4 local ranks: {here * 100:.1f} %)",
            )
        )
        cluster.close()

        from ray.train import ScalingConfig
        from ray.train.torch import TorchTrainer

        def fit() -> float:
            folder = tempfile.mkdtemp(prefix="nl-bench-ray-")
            trainer = TorchTrainer(
                trainer_loop,
                train_loop_config={"folder": folder},
                scaling_config=ScalingConfig(num_workers=4, resources_per_worker={"CPU": 1}),
            )
            called = time.time()
            trainer.fit()
            times = []
            for name in os.listdir(folder):
                with open(os.path.join(folder, name)) as f:
                    times.append(float(f.read()))
            return max(times) - called

        fits = [fit() for _ in range(1 + args.runs)]
        trainer_warm = statistics.median(fits[1:])
        rows.append(("TorchTrainer.fit() -> first step (first fit)", f"{fits[0]:.2f} s"))
        rows.append(
            ("TorchTrainer.fit() -> first step (next fits, median)", f"{trainer_warm:.2f} s")
        )
        rows.append(
            ("ours / TorchTrainer, warm (goal <= 0.1)", f"{ours_running / trainer_warm:.3f}")
        )

        plain = ray.remote(num_cpus=1)(PlainRank)
        actors = [plain.remote() for _ in range(4)]
        port = free_port()
        plain_step = statistics.median(
            ray.get([a.run.remote(i, 4, port, args.steps) for i, a in enumerate(actors)])
        )
        for a in actors:
            ray.kill(a)
        rows.append(
            (f"a DDP step, ours ({args.steps} steps, median rank)", f"{ours_step * 1e3:.3f} ms")
        )
        rows.append(("a DDP step, plain torch in 4 Ray actors", f"{plain_step * 1e3:.3f} ms"))
        rows.append(("ours / plain (goal <= 1.02)", f"{ours_step / plain_step:.3f}"))
    finally:
        ray.shutdown()
        local.shutdown()
    load = os.getloadavg()[0]
    print(
        f"\n2 Ray nodes x 2 ranks, gloo, load average {load:.1f} (os.cpu_count()={os.cpu_count()})"
    )
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--print-seconds", type=float, default=5.0)
    parsed = parser.parse_args()
    if os.environ.get(INSIDE) != "1":
        env = {**os.environ, INSIDE: "1", "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
        shell = 'ip link set lo up && exec "$0" "$@"'
        sys.exit(subprocess.call(["unshare", "-n", "sh", "-c", shell, *argv], env=env))
    main(parsed)
