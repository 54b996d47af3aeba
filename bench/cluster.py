"""One kernel driving a Slurm job's nodes, against the peers, on a real Slurm cluster.

    python bench/cluster.py [--runs 5] [--nodes 2] [--ranks 2] [--print-seconds 10]

Uses the cluster ``SLURM_CONF`` names, or starts a three-node one on this machine
(``tests/slurm/start-cluster.sh``, as root) and stops it at the end. 2 nodes x 2 ranks by
default; every rank does a barrier and returns its rank. Measured in the same run:

  * **ours**: ``notebook_launcher(work, num_processes=4, cluster=c)`` on a started cluster:
    the call to every rank running (its process group formed), and to the results back; the
    first call (submitting the job, the agents joining) is printed on its own;
  * **srun torchrun**: the same function as a script, ``srun -N2 torchrun --nnodes 2
    --nproc-per-node 2 --rdzv-backend c10d``: the usual way, from the call to its exit;
  * **two notebooks**: today's one-notebook-per-node path: two warm kernels (torch and the
    package imported) call ``notebook_launcher(..., num_nodes=2, node_rank=i)`` at once; the
    cell is done when both have their results;
  * **Ctrl-C**: from the interrupt to every rank of every node stopped;
  * a **session** round trip across the nodes (``session.run`` of a trivial function);
    target <= 2 ms on loopback (a local session: ~0.5 ms, measured here too);
  * the **kernel's CPU** while 2 nodes x 4 ranks print 100 lines/s each for
    ``--print-seconds``, against a local launch of 8 ranks doing the same; target <= 3 % of
    a core.

Prints medians and ratios against ours.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)


def work() -> int:
    import torch.distributed as dist

    dist.barrier()
    return dist.get_rank()


def chatty(seconds: float) -> None:
    """Print 100 lines a second for ``seconds``."""
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        print(f"line {i} of a chatty rank, with some words to make it a real line", flush=True)
        i += 1
        time.sleep(0.01)


class Timing:
    """A view that notes when the last rank started."""

    def __init__(self) -> None:
        self.started: list[float] = []

    def handle(self, event: Any) -> None:
        if type(event).__name__ == "WorkerStarted":
            self.started.append(time.perf_counter())

    def tick(self) -> None:
        pass

    def close(self) -> None:
        pass


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --- a Slurm cluster ------------------------------------------------------------------------


def slurm_up() -> bool:
    if not shutil.which("sinfo"):
        return False
    done = subprocess.run(["sinfo", "-h"], capture_output=True, timeout=30, check=False)
    return done.returncode == 0 and bool(done.stdout.strip())


def start_slurm(directory: str) -> None:
    script = os.path.join(ROOT, "tests", "slurm", "start-cluster.sh")
    env = {**os.environ, "SLURMCTLD_PORT": "16917", "SLURMD_PORT_BASE": "16950"}
    subprocess.run(["bash", script, directory, "3", "2"], check=True, env=env, timeout=300)
    os.environ["SLURM_CONF"] = os.path.join(directory, "slurm.conf")


def stop_slurm(directory: str) -> None:
    script = os.path.join(ROOT, "tests", "slurm", "stop-cluster.sh")
    subprocess.run(["bash", script, directory], check=False, timeout=60)


# --- the peers ----------------------------------------------------------------------------------


def ours(cluster: Any, total: int, runs: int) -> tuple[list[float], list[float]]:
    from notebook_launcher import notebook_launcher

    running, done = [], []
    for _ in range(runs):
        view = Timing()
        t0 = time.perf_counter()
        out = notebook_launcher(work, num_processes=total, cluster=cluster, dashboard=view)
        done.append(time.perf_counter() - t0)
        running.append(max(view.started) - t0)
        assert out == list(range(total)), out
    return running, done


TORCHRUN_SCRIPT = """
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def torchrun(nodes: int, ranks: int, runs: int, directory: str) -> list[float]:
    script = os.path.join(directory, "work.py")
    with open(script, "w") as f:
        f.write(TORCHRUN_SCRIPT)
    times = []
    for i in range(runs):
        port = free_port()
        argv = [
            "srun", f"-N{nodes}", "--ntasks-per-node=1", sys.executable, "-m",
            "torch.distributed.run", f"--nnodes={nodes}", f"--nproc-per-node={ranks}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=bench{i}",
            script,
        ]  # fmt: skip
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, timeout=300)
        times.append(time.perf_counter() - t0)
    return times


KERNEL = """
import sys, time
sys.path.insert(0, {root!r})
import torch, torch.distributed
from notebook_launcher import notebook_launcher
from bench.cluster import work
for line in sys.stdin:
    node, port = (int(x) for x in line.split())
    t0 = time.perf_counter()
    notebook_launcher(work, num_processes={ranks}, num_nodes={nodes}, node_rank=node,
                      master_addr="127.0.0.1", use_port=port, dashboard=False)
    print(time.perf_counter() - t0, flush=True)
"""


def two_notebooks(nodes: int, ranks: int, runs: int) -> list[float]:
    code = textwrap.dedent(KERNEL.format(root=ROOT, ranks=ranks, nodes=nodes))
    kernels = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(nodes)
    ]
    times = []
    try:
        for _ in range(runs):
            port = free_port()
            for node, kernel in enumerate(kernels):
                assert kernel.stdin is not None
                kernel.stdin.write(f"{node} {port}\n")
                kernel.stdin.flush()
            times.append(max(_seconds(k) for k in kernels))
    finally:
        for kernel in kernels:
            if kernel.stdin is not None:
                kernel.stdin.close()
            kernel.wait(60)
    return times


def _seconds(kernel: subprocess.Popen[str]) -> float:
    """The next number a kernel prints (it may say other things first)."""
    assert kernel.stdout is not None
    while True:
        line = kernel.stdout.readline()
        if not line:
            raise RuntimeError("a kernel of the two-notebook path ended")
        try:
            return float(line)
        except ValueError:
            continue


def sleeps() -> None:
    time.sleep(600)


def ctrl_c(cluster: Any, total: int, runs: int) -> list[float]:
    """From SIGINT to the cell's KeyboardInterrupt, every rank of every node stopped."""
    import signal
    import threading

    from notebook_launcher import notebook_launcher

    times = []
    for _ in range(runs):
        view = Timing()
        pressed: list[float] = []

        def press(view: Timing = view, pressed: list[float] = pressed) -> None:
            while len(view.started) < total:
                time.sleep(0.01)
            time.sleep(0.3)
            pressed.append(time.perf_counter())
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=press, daemon=True).start()
        try:
            notebook_launcher(sleeps, num_processes=total, cluster=cluster, dashboard=view)
        except KeyboardInterrupt:
            times.append(time.perf_counter() - pressed[0])
    return times


def round_trips(session: Any, count: int = 300) -> float:
    session.run(int)  # warm
    t0 = time.perf_counter()
    for _ in range(count):
        session.run(int)
    return (time.perf_counter() - t0) / count


def kernel_cpu(launch: Any, seconds: float) -> float:
    """The share of one core this process used while ``launch()`` ran."""
    c0, t0 = cpu(), time.perf_counter()
    launch()
    return (cpu() - c0) / (time.perf_counter() - t0)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2, help="ranks per node")
    parser.add_argument("--print-seconds", type=float, default=10.0)
    args = parser.parse_args()
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

    from notebook_launcher import SlurmCluster, notebook_launcher
    from notebook_launcher import start as start_session

    directory = tempfile.mkdtemp(prefix="nl-bench-cluster-")
    started_slurm = False
    if not slurm_up():
        start_slurm(os.path.join(directory, "slurm"))
        started_slurm = True
    nodes, ranks, total = args.nodes, args.ranks, args.nodes * args.ranks
    cluster = SlurmCluster(nodes=nodes)
    try:
        t0 = time.perf_counter()
        first = notebook_launcher(work, num_processes=total, cluster=cluster, dashboard=Timing())
        first_call = time.perf_counter() - t0
        assert first == list(range(total))
        running, done = ours(cluster, total, args.runs)
        peers = {
            "srun torchrun": torchrun(nodes, ranks, args.runs, directory),
            "two notebooks": two_notebooks(nodes, ranks, args.runs),
        }
        print(f"{nodes} nodes x {ranks} ranks, {args.runs} runs, medians")
        print(f"  ours, first call (submit, agents join, launch): {first_call * 1000:8.1f} ms")
        print(f"  ours, call -> every rank running:               {median(running) * 1000:8.1f} ms")
        print(f"  ours, call -> results back:                     {median(done) * 1000:8.1f} ms")
        for name, times in peers.items():
            ratio = median(times) / median(done)
            print(f"  {name + ':':<48}{median(times) * 1000:8.1f} ms  ({ratio:.1f}x ours)")

        stopped = ctrl_c(cluster, total, args.runs)
        print(f"  Ctrl-C -> every rank of every node stopped:    {median(stopped) * 1000:8.1f} ms")

        remote_trip = local_trip = float("nan")
        with start_session(num_processes=total, cluster=cluster, dashboard=False) as session:
            remote_trip = round_trips(session)
        with start_session(num_processes=total, dashboard=False) as session:
            local_trip = round_trips(session)
        print(
            f"  session round trip: across nodes {remote_trip * 1000:.2f} ms, local "
            f"{local_trip * 1000:.2f} ms ({remote_trip / local_trip:.1f}x; target <= 2 ms)"
        )

        seconds = args.print_seconds
        from notebook_launcher.ui import NullView

        many = {"num_processes": nodes * 4, "dashboard": NullView()}  # the launcher's own cost
        remote_cpu = kernel_cpu(
            lambda: notebook_launcher(chatty, (seconds,), cluster=cluster, **many), seconds
        )
        local_cpu = kernel_cpu(lambda: notebook_launcher(chatty, (seconds,), **many), seconds)
        print(
            f"  kernel CPU, {nodes} nodes x 4 ranks printing 100 lines/s: {remote_cpu * 100:.1f} % "
            f"of a core (a local launch of {nodes * 4} ranks: {local_cpu * 100:.1f} %; target <= 3 %)"
        )
    finally:
        cluster.close()
        if started_slurm:
            stop_slurm(os.path.join(directory, "slurm"))
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
