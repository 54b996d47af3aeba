"""The Ray cases of ``test_ray.py``, run by it inside a network namespace of their own.

``python tests/_ray_cases.py OUT`` (inside ``unshare -n``, loopback up): a real two-node
Ray cluster on 127.0.0.1 (``ray.cluster_utils.Cluster``: a head and a second raylet, no
dashboard, no usage stats), then the cases, one after the other on that one cluster (its
start is most of the cost), each one's findings written to ``OUT`` as JSON for the test
module to assert on. An exception in a case is recorded as that case's ``error``; the Ray
cluster is shut down whatever happens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from typing import Any


def returns_where_it_ran() -> tuple[int, str]:
    from notebook_launcher import PartialState

    return PartialState().process_index, os.environ.get("NOTEBOOK_LAUNCHER_RAY_NODE", "")


def rank_one_fails() -> None:
    from notebook_launcher import PartialState

    if PartialState().process_index == 1:
        raise ValueError("rank one says no")
    time.sleep(60)  # (stopped when rank 1 fails)


def agents_alive(job: str) -> list[str]:
    """The command lines of this job's agent processes still alive on this machine."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "notebook_launcher agent" in argv and job in argv:
            found.append(f"{pid}: {argv[:200]}")
    return found


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
    from ray.cluster_utils import Cluster as LocalRay

    from notebook_launcher import RayCluster, notebook_launcher, start
    from notebook_launcher.errors import ClusterError

    found: dict[str, Any] = {}

    def case(name: str, run: Any) -> None:
        started = time.monotonic()
        try:
            found[name] = run()
        except BaseException as exc:  # noqa: BLE001 - the test module says which case failed
            found[name] = {"error": "".join(traceback.format_exception(exc))[-3000:]}
        found[name]["seconds"] = round(time.monotonic() - started, 1)
        with open(out, "w") as f:
            json.dump(found, f, indent=1)

    node = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False}
    started = time.monotonic()
    local = LocalRay(initialize_head=True, head_node_args=node)
    try:
        local.add_node(**node)
        ray.init(address=local.address, log_to_driver=False)
        local.wait_for_nodes()
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
            for name, kwargs in (("nodes", {"nodes": 3}), ("gpus", {"gpus_per_node": 1})):
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

        case("session", session)
        case("close", close)
        case("impossible", impossible)
        case("detached", detached)
    finally:
        try:
            ray.shutdown()
        finally:
            local.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
