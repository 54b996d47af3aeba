"""Ray, the second engine (issue 34, item 4), on a real two-node Ray cluster.

Ray must never listen beyond loopback nor look for a route to the internet here: the
cases run in a child process inside a network namespace of its own (``unshare -n``,
loopback up, ``RAY_USAGE_STATS_ENABLED=0``, Ray's nodes on 127.0.0.1, no dashboard),
``tests/_ray_cases.py``. That child starts ONE Ray cluster (a head and a second raylet:
two Ray nodes) and runs every case on it -- Ray's start is most of the cost -- writing what
it found; each test below asserts on one case's findings. Lesson 09 is one of those cases
(nbval on it, its kernel in the namespace, on that Ray cluster); losing a Ray node is the
last (one node is left after it). Where ``unshare -n`` is not
permitted or Ray is not installed, they skip and say why; under ``CI=1`` a missing Ray
fails (the test extra installs it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(480)]

CASES = Path(__file__).with_name("_ray_cases.py")
ROOT = Path(__file__).resolve().parents[1]
#: seconds the child has for Ray's start, the cases, lesson 09 and Ray's end (~2 min loaded)
CHILD_TIMEOUT = 420


def _why_not() -> str | None:
    """Why the Ray cases cannot run here (None: they can)."""
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install 'notebook_launcher[ray]', or the test extra)"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare and ip (util-linux, iproute2) for a network namespace of its own"
    probe = subprocess.run(
        ["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return (
            "`unshare -n` is not permitted here (a network namespace of the test's own keeps "
            f"Ray on loopback): {probe.stderr.strip()[:200]}"
        )
    return None


@pytest.fixture(scope="module")
def ray_cases() -> Iterator[dict[str, Any]]:
    why = _why_not()
    if why is not None:
        if os.environ.get("CI") == "1" and importlib.util.find_spec("ray") is None:
            pytest.fail(f"CI=1 and {why}")
        pytest.skip(why)
    folder = Path(tempfile.mkdtemp(prefix="nl-ray-"))  # short: Ray's socket paths fit
    out = folder / "found.json"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_TMPDIR": str(folder)}
    env["NOTEBOOK_LAUNCHER_RUNS_DIR"] = str(folder / "runs")  # (the detached run's record)
    env.pop("RAY_ADDRESS", None)
    child = subprocess.Popen(
        ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"']
        + [sys.executable, str(CASES), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        said, _ = child.communicate(timeout=CHILD_TIMEOUT)
    finally:
        try:  # whatever Ray left in the child's session (its raylets, its GCS) ends with it
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait()
    found: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    found["_said"] = said[-6000:]
    found["_code"] = child.returncode
    yield found
    shutil.rmtree(folder, ignore_errors=True)


def case(found: dict[str, Any], name: str) -> dict[str, Any]:
    if name not in found:
        pytest.fail(f"case {name!r} did not run (exit {found['_code']}):\n{found['_said']}")
    assert "error" not in found[name], found[name]["error"]
    result: dict[str, Any] = found[name]
    return result


def test_a_launch_on_two_ray_nodes_returns_every_ranks_value(ray_cases: dict[str, Any]) -> None:
    assert case(ray_cases, "ray")["nodes"] == 2
    values = case(ray_cases, "launch")["values"]
    assert [rank for rank, _ in values] == [0, 1]
    assert len({node for _, node in values}) == 2, values  # one rank on each Ray node


def test_a_ranks_exception_is_raised_as_itself_and_names_its_rank(
    ray_cases: dict[str, Any],
) -> None:
    failed = case(ray_cases, "failure")
    assert failed.get("raised", "") is not None, "the launch did not raise"
    assert failed["types"][0] == "ValueError" and failed["message"] == "rank one says no"
    assert failed["root_rank"] == 1
    assert failed["others"] == [[0, "stopped"]]


def test_a_session_runs_its_cells_on_the_ray_nodes(ray_cases: dict[str, Any]) -> None:
    ranks = case(ray_cases, "session")["ranks"]
    assert len(ranks) == 2 and ranks[0].startswith("(0, ") and ranks[1].startswith("(1, "), ranks
    assert ranks[0].split()[1] != ranks[1].split()[1], ranks  # one rank on each Ray node


def test_close_leaves_no_actor_placement_group_or_agent(ray_cases: dict[str, Any]) -> None:
    closed = case(ray_cases, "close")
    during = closed["during"]  # what there was to end: it is found while it runs
    assert len(during["placement_groups"]) == 1 and len(during["actors"]) == 2, during
    assert len(during["processes"]) == 2, during
    assert closed["after"] == {"placement_groups": [], "actors": [], "processes": []}


def test_a_detached_run_outlives_its_kernel_on_ray_and_leaves_nothing(
    ray_cases: dict[str, Any],
) -> None:
    """The kernel was connected by ``ray.init(address)`` and SIGKILLed mid-run: its
    supervisor joined the same Ray cluster (the address the kernel was connected to travels
    with the pickled cluster), ran the launch to its end and ended the cluster."""
    detached = case(ray_cases, "detached")
    values = detached["values"]
    assert [rank for rank, _ in values] == [100, 101]
    assert len({node for _, node in values}) == 2, values
    assert detached["after"] == {"placement_groups": [], "actors": [], "processes": []}


def test_a_cancelled_launch_stops_its_ranks_and_the_cluster_serves_the_next(
    ray_cases: dict[str, Any],
) -> None:
    """``handle.cancel()`` of a non-blocking launch whose ranks run on both Ray nodes."""
    cancel = case(ray_cases, "cancel")
    assert len(cancel["running"]) == 2, cancel  # (the ranks, under their agents)
    assert cancel["cancelled"] is True and cancel["state"] == "<TaskHandle sleeps: cancelled>"
    assert cancel["ranks_after"] == [], cancel  # no rank left running
    assert cancel["processes_after"] == 2  # the cluster's two agents stay, for the next launch
    assert [rank for rank, _ in cancel["then"]] == [0, 1]


def test_a_lost_ray_node_is_named_and_nothing_is_left(ray_cases: dict[str, Any]) -> None:
    """The second Ray node is lost (``cluster_utils.Cluster.remove_node``: its raylet and
    workers killed) while a launch's ranks run on it: the launch raises, naming the node and
    its Ray node and what to do; the next launch says the cluster lost it; nothing is left
    on Ray or on the machine (actors, placement group, agents)."""
    lost = case(ray_cases, "node_lost")
    kind, message = lost["raised"]
    assert kind == "WorkerDied", message
    assert re.search(r"Ray node [0-9a-f]{8} \(127\.0\.0\.1\), which held node \d, is lost", message)
    assert (
        "What is left of the cluster on Ray is freed as this run ends (a session: when it "
        "is closed); launch again: it starts anew on the Ray nodes alive" in message
    )
    # freed as the failed launch ended: no placement group holds the nodes alive meanwhile
    assert lost["left"] == {"placement_groups": [], "actors": [], "processes": []}
    assert "the cluster lost 1 node(s)" in lost["next"], lost["next"]
    assert lost["after"] == {"placement_groups": [], "actors": [], "processes": []}


def test_lesson_09_runs_under_nbval_on_the_ray_cluster(ray_cases: dict[str, Any]) -> None:
    """notebooks/09_on_a_ray_cluster.ipynb (a launch, a failure, a session on Ray), its
    kernel inside this module's network namespace, on its Ray cluster (``RAY_ADDRESS``):
    every code cell ran and matched its stored output; nothing was left on Ray."""
    import nbformat

    lesson = case(ray_cases, "lesson")
    cells = nbformat.read(ROOT / "notebooks" / "09_on_a_ray_cluster.ipynb", as_version=4).cells
    code_cells = sum(c.cell_type == "code" for c in cells)
    assert lesson["outcomes"] == ["PASSED"] * code_cells, lesson["report"]
    assert lesson["left"] == {"placement_groups": [], "actors": [], "processes": []}


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("nodes", r"asks for 3 bundle\(s\) of \{CPU: 1\} \(one per node\), and the Ray "),
        ("gpus", r"asks for 1 bundle\(s\) of \{CPU: 1, GPU: 1\}"),
        (
            "cpus",
            r"asks for 1 bundle\(s\) of \{CPU: 4\} \(one per node\), and the Ray cluster's 2 ",
        ),
    ],
)
def test_an_impossible_request_is_refused_at_once_with_what_to_change(
    ray_cases: dict[str, Any], what: str, message: str
) -> None:
    said = case(ray_cases, "impossible")[what]
    assert said.get("raised", "") is not None, "it did not raise"
    assert re.search(message, said["message"]), said["message"]
    assert "it can never start. Ask for fewer nodes, GPUs or CPUs" in said["message"]
    assert said["new_groups"] == 0  # refused before Ray was asked: nothing to wait on
    assert said["left"] == {"placement_groups": [], "actors": [], "processes": []}


def test_ray_is_imported_only_when_a_ray_cluster_starts() -> None:
    """``import notebook_launcher`` and making a ``RayCluster`` import no Ray (its module
    is loaded for a Ray cluster; ``ray`` itself at the first start)."""
    code = (
        "import sys, notebook_launcher as nl\n"
        "import notebook_launcher.cluster, notebook_launcher.detached\n"
        "assert 'ray' not in sys.modules, 'import notebook_launcher imported ray'\n"
        "assert 'notebook_launcher._launch.ray' not in sys.modules\n"
        "c = nl.RayCluster(nodes=2)\n"
        "assert 'ray' not in sys.modules, 'RayCluster() imported ray'\n"
        "print(c.describe())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "a Ray placement group of 2 node(s)"
