"""The Ray cases of ``test_ray.py``, run by it inside a network namespace of their own.

``python tests/_ray_cases.py OUT`` (inside ``unshare -n``, loopback up): a real two-node
Ray cluster on 127.0.0.1 (``ray.cluster_utils.Cluster``: a head and a second raylet, no
dashboard, no usage stats), then the cases, one after the other on that one cluster (its
start is most of the cost), each one's findings written to ``OUT`` as JSON for the test
module to assert on. An exception in a case is recorded as that case's ``error``; the Ray
cluster is shut down whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: the lesson that runs on Ray (notebooks/_build.py builds it on ``local_ray``, too)
LESSON = ROOT / "notebooks" / "09_on_a_ray_cluster.ipynb"
#: one Ray node: one CPU, on loopback, no dashboard
NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False}


@contextlib.contextmanager
def local_ray() -> Iterator[Any]:
    """A two-node Ray cluster on 127.0.0.1 (``ray.cluster_utils.Cluster``: a head and a
    second raylet), for a process inside a network namespace of its own; shut down at the
    end. Yields the cluster (``.address``; ``.worker_nodes``: the second node's handle)."""
    from ray.cluster_utils import Cluster as LocalRay

    if [iface for _, iface in socket.if_nameindex()] != ["lo"]:
        raise RuntimeError("local_ray() runs inside a network namespace of its own only")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # (never a report home)
    local = LocalRay(initialize_head=True, head_node_args=dict(NODE))
    try:
        local.add_node(**NODE)
        local.wait_for_nodes()
        yield local
    finally:
        local.shutdown()


def returns_where_it_ran() -> tuple[int, str]:
    from notebook_launcher import PartialState

    return PartialState().process_index, os.environ.get("NOTEBOOK_LAUNCHER_RAY_NODE", "")


def sleeps(seconds: float) -> None:
    time.sleep(seconds)


def rank_one_fails() -> None:
    from notebook_launcher import PartialState

    if PartialState().process_index == 1:
        raise ValueError("rank one says no")
    time.sleep(60)  # (stopped when rank 1 fails)


def agents_alive(job: str) -> list[str]:
    """The command lines of this job's agent processes still alive on this machine (Ray's
    agents only: other tests' Slurm agents may run meanwhile)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "notebook_launcher agent" in argv and job in argv and "Ray ended the actor" in argv:
            found.append(f"{pid}: {argv[:200]}")
    return found


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return parents


def ranks_alive(job: str) -> list[str]:
    """This job's ranks still alive: the processes below its agents (forked from an agent,
    a rank's command line is its agent's), but the ``sh`` that guards a rank's group."""
    parents = _parents()
    found = {int(line.split(":")[0]): line for line in agents_alive(job)}
    below = {pid for pid in found if parents.get(pid) in found}
    changed = True
    while changed:
        changed = False
        for pid, parent in parents.items():
            if (parent in below or parent in found) and pid not in below and pid not in found:
                below.add(pid)
                changed = True
    ranks = []
    for pid in sorted(below):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if not argv.startswith("/bin/sh"):
            ranks.append(f"{pid}: {argv[:120]}")
    return ranks


def leftovers(ray: Any, job: str) -> dict[str, list[str]]:
    from ray.util.placement_group import placement_group_table

    groups = [
        f"{g.get('name')}: {g.get('state')}"
        for g in placement_group_table().values()
        if job in str(g.get("name")) and g.get("state") != "REMOVED"
    ]
    actors = [
        f"{a.get('Name') or a.get('ActorID')}: {a.get('State')}"
        for a in ray._private.state.actors().values()
        if job in str(a.get("Name")) and a.get("State") != "DEAD"
    ]
    return {"placement_groups": groups, "actors": actors, "processes": agents_alive(job)}


def main(out: str) -> None:
    import ray

    from notebook_launcher import RayCluster, notebook_launcher, start
    from notebook_launcher.errors import ClusterError

    found: dict[str, Any] = {}

    only = os.environ.get("NL_RAY_CASES")  # (a few cases only, while working on them)

    def case(name: str, run: Any) -> None:
        if only and name not in only.split(","):
            return
        started = time.monotonic()
        try:
            found[name] = run()
        except BaseException as exc:  # noqa: BLE001 - the test module says which case failed
            found[name] = {"error": "".join(traceback.format_exception(exc))[-3000:]}
        found[name]["seconds"] = round(time.monotonic() - started, 1)
        with open(out, "w") as f:
            json.dump(found, f, indent=1)

    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        local = stack.enter_context(local_ray())
        ray.init(address=local.address, log_to_driver=False)
        stack.callback(ray.shutdown)
        found["ray"] = {"nodes": len(ray.nodes()), "seconds": round(time.monotonic() - started, 1)}
        cluster = RayCluster(nodes=2, cpus_per_node=1)

        def launch() -> dict[str, Any]:
            values = notebook_launcher(returns_where_it_ran, num_processes=2, cluster=cluster)
            return {"values": [list(v) for v in values]}

        def failure() -> dict[str, Any]:
            try:
                notebook_launcher(rank_one_fails, num_processes=2, cluster=cluster)
            except Exception as exc:  # noqa: BLE001 - what the user catches
                report = exc.launch_failure  # type: ignore[attr-defined]
                return {
                    "types": [t.__name__ for t in type(exc).__mro__],
                    "message": str(exc),
                    "root_rank": report.root_cause.rank,
                    "others": sorted((f.rank, f.kind) for f in report.failures if f.rank != 1),
                }
            return {"raised": None}

        def session() -> dict[str, Any]:
            with start(num_processes=2, cluster=cluster, dashboard=False) as running:
                ranks = running.run_cell(
                    "import os\nrank, os.environ['NOTEBOOK_LAUNCHER_RAY_NODE']"
                )
            return {"ranks": ranks}

        def close() -> dict[str, Any]:
            job = cluster.scheduler._job  # type: ignore[attr-defined]
            during = leftovers(ray, job)
            cluster.close()
            deadline = time.monotonic() + 20
            after = leftovers(ray, job)
            while any(after.values()) and time.monotonic() < deadline:
                time.sleep(0.2)
                after = leftovers(ray, job)
            return {"job": job, "during": during, "after": after}

        def impossible() -> dict[str, Any]:
            said = {}
            for name, kwargs in (
                ("nodes", {"nodes": 3}),
                ("gpus", {"gpus_per_node": 1}),
                ("cpus", {"cpus_per_node": 4}),
            ):
                groups = len(ray.util.placement_group_table())
                too_big = RayCluster(**kwargs)  # type: ignore[arg-type]
                try:
                    ranks = too_big.num_nodes * max(1, too_big.gpus_per_node)
                    notebook_launcher(returns_where_it_ran, num_processes=ranks, cluster=too_big)
                    said[name] = {"raised": None}
                except ClusterError as exc:
                    said[name] = {
                        "message": str(exc),
                        "new_groups": len(ray.util.placement_group_table()) - groups,
                    }
                finally:
                    too_big.close()
                said[name]["left"] = leftovers(ray, "")
            return said

        case("launch", launch)
        case("failure", failure)

        def detached() -> dict[str, Any]:
            """A kernel (a process of its own, connected by ``ray.init(address)``) detaches a
            launch on the Ray cluster and is SIGKILLed mid-run; the run goes on, and this
            process attaches to it and gets its values."""
            from notebook_launcher import attach

            code = textwrap.dedent(
                f"""
                import time, ray
                ray.init(address={local.address!r}, log_to_driver=False)
                from notebook_launcher import RayCluster, notebook_launcher
                def train(n):
                    import os, time
                    import torch.distributed as dist
                    for i in range(n):
                        time.sleep(0.1)
                    return dist.get_rank() + 100, os.environ["NOTEBOOK_LAUNCHER_RAY_NODE"]
                handle = notebook_launcher(train, args=(30,), num_processes=2,
                                           cluster=RayCluster(nodes=2), detach=True)
                print("ID", handle.id, flush=True)
                time.sleep(600)
                """
            )
            kernel = subprocess.Popen(
                [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True
            )
            try:
                assert kernel.stdout is not None
                run_id = next(
                    (line.split()[1] for line in kernel.stdout if line.startswith("ID ")), ""
                )
            finally:
                kernel.send_signal(signal.SIGKILL)
                kernel.wait()
            values = attach(run_id, dashboard=False).result(timeout=120)
            deadline = time.monotonic() + 20
            after = leftovers(ray, "")
            while any(after.values()) and time.monotonic() < deadline:
                time.sleep(0.2)
                after = leftovers(ray, "")
            return {"values": [list(v) for v in values], "after": after}

        def cancel() -> dict[str, Any]:
            """A non-blocking launch cancelled while its ranks run: they stop, the handle
            ends cancelled, the cluster stays for the next launch."""
            job = cluster.scheduler._job  # type: ignore[attr-defined]
            handle = notebook_launcher(
                sleeps, args=(600,), num_processes=2, cluster=cluster, block=False
            )
            deadline = time.monotonic() + 60
            while len(ranks_alive(job)) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            running = ranks_alive(job)
            cancelled = handle.cancel()
            return {
                "running": running,
                "cancelled": cancelled,
                "state": repr(handle),
                "ranks_after": ranks_alive(job),
                "processes_after": len(agents_alive(job)),  # (a rank's argv is its agent's)
                "then": notebook_launcher(returns_where_it_ran, num_processes=2, cluster=cluster),
            }

        def lesson() -> dict[str, Any]:
            """Lesson 09 under nbval, its kernel on this Ray cluster (``RAY_ADDRESS``)."""
            from notebook_launcher._kernelspec import KERNEL_NAME, install

            with tempfile.TemporaryDirectory() as prefix:
                install(prefix=prefix)
                env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
                env["JUPYTER_PATH"] = os.path.join(prefix, "share", "jupyter")
                env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
                env["RAY_ADDRESS"] = local.address
                done = subprocess.run(
                    [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                     "--nbval", "--nbval-kernel-name", KERNEL_NAME, "--nbval-sanitize-with",
                     str(ROOT / "notebooks" / "sanitize.cfg"), "--rootdir", str(ROOT),
                     str(LESSON)],
                    cwd=prefix, env=env, capture_output=True, text=True, timeout=150,
                )  # fmt: skip
            report = done.stdout + done.stderr
            outcomes = [
                line.split(" ", 1)[0]
                for line in report.splitlines()
                if f"{LESSON.name}::Cell " in line
                and line.startswith(("PASSED ", "FAILED ", "ERROR "))
            ]
            return {"outcomes": outcomes, "report": report[-4000:], "left": leftovers(ray, "")}

        def node_lost() -> dict[str, Any]:
            """The second Ray node lost (its raylet and workers killed) while the ranks
            run: the launch raises, naming the node; what is left of the cluster on Ray
            goes as that launch ends; the next launch says why it cannot run there."""
            lost = RayCluster(nodes=2, cpus_per_node=1)
            handle = notebook_launcher(
                sleeps, args=(600,), num_processes=2, cluster=lost, block=False
            )
            job = lost.scheduler._job  # type: ignore[attr-defined]
            deadline = time.monotonic() + 60
            while len(ranks_alive(job)) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            killed = time.monotonic()
            local.remove_node(local.worker_nodes.copy().pop(), allow_graceful=False)
            said: dict[str, Any] = {}
            try:
                handle.result(timeout=120)
            except Exception as exc:  # noqa: BLE001 - what the user catches
                said["raised"] = [type(exc).__name__, str(exc)]
            said["seconds_to_raise"] = round(time.monotonic() - killed, 1)
            said["left"] = leftovers(ray, job)  # (freed as the launch ended, before the next)
            try:
                notebook_launcher(returns_where_it_ran, num_processes=2, cluster=lost)
            except ClusterError as exc:
                said["next"] = str(exc)
            deadline = time.monotonic() + 20
            after = leftovers(ray, job)
            while any(after.values()) and time.monotonic() < deadline:
                time.sleep(0.2)
                after = leftovers(ray, job)
            said["after"] = after
            lost.close()
            return said

        case("cancel", cancel)
        case("session", session)
        case("close", close)
        case("impossible", impossible)
        case("detached", detached)
        case("lesson", lesson)
        case("node_lost", node_lost)  # (last: the Ray cluster has one node left)


if __name__ == "__main__":
    main(sys.argv[1])
