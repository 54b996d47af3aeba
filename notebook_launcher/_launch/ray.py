"""Ray behind the scheduler interface (:class:`RayJob`): Ray reserves, our agents run.

A placement group holds every node's resources at once (all of them or none: a gang, as
a batch scheduler's job is), one bundle per node; one small actor per bundle hosts that
node's agent -- a process of its own, the same ``python -m notebook_launcher agent`` any
scheduler's job runs. From there on nothing is Ray's: the agents join the kernel's hub and run
the ranks, the store, the sessions and the views as on any cluster::

    kernel (RayCluster)                        Ray                          node i
    -------------------                        ---                          ------
    submit(hub): what the live nodes can hold,
      checked now (an impossible request is an
      error at once, not a wait)
      placement_group([bundle] * n) ---------> reserved when all fit
      AgentHost(argv, env) per bundle -------> an actor on node i ------> Popen: the agent,
                                                                          its own session,
                                                                          SIGTERM when the
                                                                          actor dies; joins
    status(): the group's state (PENDING,                                 the hub
      INFEASIBLE, RESCHEDULING) and each
      actor's poll() of its agent
    cancel(): each actor's stop() (SIGTERM, grace, SIGKILL), ray.kill, the group removed

Why a process and not the agent inside the actor: the agent forks the ranks, and a Ray
worker holds gRPC's threads (a fork of it inherits their locks); the agent is a clean
interpreter, as under ``srun``. Its parent-death signal (SIGTERM) ends it with its actor --
``ray.kill``, the group removed, the node lost -- and it says so to the kernel
(``--on-sigterm``), stopping its ranks.

``ray`` is imported inside functions only: this module is loaded for a Ray cluster (or a
record of a Ray job), never by ``import notebook_launcher``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ClusterError
from .scheduler import JobStatus, Phase, Reason, Scheduler, agent_argv, reachable_address, tail

if TYPE_CHECKING:
    from .remote import AgentHub

#: Seconds between two looks at the placement group and the actors while the kernel waits.
POLL = 1.0
#: Seconds an agent has to stop its ranks and leave once its actor is told to stop it.
STOP_GRACE = 5.0
#: Seconds the kernel gives Ray to tell a lost node from a slow one (``status(settled)``).
SETTLE_WAIT = 8.0
#: Seconds an actor Ray cannot reach must stay so to count as on a lost node (Ray itself
#: calls a node dead after its health checks fail: 15 s or more by default).
UNREACHABLE_WAIT = 2.0
#: What an agent says when its actor dies (its parent-death signal): the kernel hears it.
ENDING = (
    "Ray ended the actor that hosts it (the cluster closed, the actor killed, or its node lost)"
)
#: The variable that names, in the agent and its ranks, the Ray node they run on.
NODE_ENV = "NOTEBOOK_LAUNCHER_RAY_NODE"
#: Placement strategies (Ray's names); STRICT_SPREAD: one bundle per node, as nodes are.
STRATEGIES = ("STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK")


def fits(totals: Sequence[Mapping[str, float]], bundle: Mapping[str, float], strategy: str) -> int:
    """How many ``bundle`` s the nodes whose resources are ``totals`` can hold at most,
    placed by ``strategy`` (Ray's: STRICT_SPREAD one per node, STRICT_PACK all on one).

    >>> nodes = [{"CPU": 8, "GPU": 4}, {"CPU": 8, "GPU": 0}, {"CPU": 2, "GPU": 8}]
    >>> fits(nodes, {"CPU": 1, "GPU": 4}, "STRICT_SPREAD"), fits(nodes, {"CPU": 1, "GPU": 4}, "PACK")
    (2, 3)
    >>> fits(nodes, {"CPU": 4}, "STRICT_PACK"), fits(nodes, {"CPU": 4, "GPU": 1}, "SPREAD")
    (2, 2)
    """
    wanted = {k: v for k, v in bundle.items() if v > 0}
    each = [
        min((int(node.get(k, 0) // v) for k, v in wanted.items()), default=1) for node in totals
    ]
    if strategy == "STRICT_SPREAD":
        return sum(1 for n in each if n >= 1)
    if strategy == "STRICT_PACK":
        return max(each, default=0)
    return sum(each)


class RayJob(Scheduler):
    """A placement group of ``nodes`` bundles (``cpus_per_node`` CPUs, ``gpus_per_node``
    GPUs each; ``strategy``: Ray's, STRICT_SPREAD by default: one per Ray node) and one
    actor per bundle hosting its agent, on the Ray cluster ``address`` names (None: the one
    this process is connected to, else the one ``ray.init()`` joins). ``autoscaling``: the
    cluster grows on demand (KubeRay's autoscaler), so a request larger than its nodes
    waits for new ones instead of being refused."""

    FRESH: ClassVar[Mapping[str, Any]] = {
        "_pg": None, "_actors": [], "_job": "", "_state": None, "_next_look": 0.0,
        "_started": False, "_placed": {}, "_lost_status": None,
    }  # fmt: skip

    def __init__(
        self,
        nodes: int = 1,
        gpus_per_node: int = 0,
        cpus_per_node: float = 1,
        address: str | None = None,
        strategy: str = "STRICT_SPREAD",
        autoscaling: bool = False,
        init: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(nodes, gpus_per_node)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        if not isinstance(cpus_per_node, (int, float)) or cpus_per_node < 0:
            raise ValueError(f"cpus_per_node must be a number >= 0, got {cpus_per_node!r}")
        self.cpus_per_node = cpus_per_node
        self.ray_address = address
        self.strategy = strategy
        self.autoscaling = autoscaling
        self.init = dict(init or {})
        self._pg: Any = None
        self._actors: list[Any] = []
        self._job = ""
        self._state: JobStatus | None = None
        self._next_look = 0.0
        self._started = False
        #: bundle (our node) -> (its Ray node's id, its address), once every agent joined
        self._placed: dict[int, tuple[str, str]] = {}
        #: what was said of a node lost, once (the same words each time it is asked)
        self._lost_status: JobStatus | None = None

    # -- Ray, joined when first needed ---------------------------------------------------------

    def connect(self) -> Any:
        """``ray``, connected to the cluster: the one this process is connected to, else
        ``ray_address`` (None: what ``ray.init()`` joins -- ``RAY_ADDRESS``, or a cluster
        started on this machine)."""
        try:
            import ray
        except ImportError:
            raise ClusterError(
                "RayCluster needs Ray: pip install 'notebook_launcher[ray]' (or ray) in this "
                "environment, the same version as the cluster's"
            ) from None
        if not ray.is_initialized():
            ray.init(address=self.ray_address, **self.init)
        return ray

    @property
    def bundle(self) -> dict[str, float]:
        """One node's resources, as Ray names them."""
        bundle = {"CPU": float(self.cpus_per_node)}
        if self.gpus_per_node:
            bundle["GPU"] = float(self.gpus_per_node)
        return {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.001}

    def address(self) -> str:
        """This machine's address as the Ray nodes reach it: the address Ray registered for
        this process's node (a kernel on the cluster: the head, a workspace, a KubeRay
        pod); through a Ray client (``ray://``), this machine's address toward the head."""
        ray = self.connect()
        if _client_mode(ray):
            head = str(self.ray_address or os.environ.get("RAY_ADDRESS", ""))
            host = head.removeprefix("ray://").rsplit(":", 1)[0].strip("[]")
            return reachable_address(host or None)
        node = ray.get_runtime_context().get_node_id()
        for info in ray.nodes():
            if info.get("NodeID") == node:
                return str(info.get("NodeManagerAddress"))
        return reachable_address(None)

    # -- the interface -------------------------------------------------------------------------

    def submit(self, hub: AgentHub) -> None:
        ray = self.connect()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._check_fits(ray)
        self._job = hub.job
        self._started = True
        self._placed, self._lost_status = {}, None
        self._pg = placement_group(
            [self.bundle] * self.nodes, strategy=self.strategy, name=f"notebook-launcher-{hub.job}"
        )
        host = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(AgentHost)
        cwd = os.getcwd()
        for i in range(self.nodes):
            argv = agent_argv(hub, ("--node", str(i), "--on-sigterm", ENDING), python="")[1:]
            self._actors.append(
                host.options(
                    num_cpus=self.bundle.get("CPU", 0),
                    num_gpus=self.gpus_per_node,
                    name=f"notebook-launcher-{hub.job}-{i}",
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self._pg, placement_group_bundle_index=i
                    ),
                ).remote(argv, hub.secret_env(), cwd)
            )

    def joined(self) -> None:
        """Remember the Ray node each bundle went to: once a node is lost, Ray's table no
        longer says which one it was."""
        ray = self.connect()
        from ray.util.placement_group import placement_group_table

        try:
            placed = placement_group_table(self._pg).get("bundles_to_node_id", {})
            where = {n.get("NodeID"): str(n.get("NodeManagerAddress", "?")) for n in ray.nodes()}
        except Exception:  # noqa: BLE001 - (only the words of a later loss need it)
            return
        self._placed = {int(i): (str(node), where.get(node, "?")) for i, node in placed.items()}

    def _check_fits(self, ray: Any) -> None:
        """Refuse at once what the cluster's live nodes can never hold (a placement group
        Ray cannot place waits forever, silently)."""
        if self.autoscaling:
            return
        alive = [n for n in ray.nodes() if n.get("Alive")]
        totals = [n.get("Resources", {}) for n in alive]
        can = fits(totals, self.bundle, self.strategy)
        if can >= self.nodes:
            return
        each = "; ".join(
            f"{n.get('NodeManagerAddress')}: "
            + ", ".join(
                f"{k} {v:g}"
                for k, v in sorted(n.get("Resources", {}).items())
                if k in ("CPU", "GPU")
            )  # fmt: skip
            for n in alive
        )
        spread = " (one per node)" if self.strategy == "STRICT_SPREAD" else ""
        raise ClusterError(
            f"RayCluster(nodes={self.nodes}, gpus_per_node={self.gpus_per_node}, "
            f"cpus_per_node={self.cpus_per_node:g}) asks for {self.nodes} bundle(s) of "
            f"{_words(self.bundle)}{spread}, and the Ray cluster's {len(alive)} live node(s) "
            f"can hold {can} ({each or 'none'}): it can never start. Ask for fewer nodes, "
            "GPUs or CPUs, or add nodes to the cluster (autoscaling=True waits for a "
            "cluster that grows on demand)."
        )

    def status(self, settled: bool = False) -> JobStatus:
        if self._pg is None:
            return JobStatus(Phase.PENDING, Reason.WAITING, brief="submitted")
        if settled:
            return self._settled()
        now = time.monotonic()
        if self._state is None or now >= self._next_look:
            self._next_look = now + POLL
            self._state = self._look()
        return self._state

    def _look(self) -> JobStatus:
        ray = self.connect()
        from ray.util.placement_group import placement_group_table

        table = placement_group_table(self._pg)
        state = table.get("state", "")
        placing = table.get("stats", {}).get("scheduling_state", "")
        where = self.describe()
        if state == "REMOVED":
            return JobStatus(
                Phase.ENDED, Reason.CANCELLED, f"{where}: its placement group was removed"
            )
        if state == "PENDING":
            if placing == "INFEASIBLE" and not self.autoscaling:
                return JobStatus(
                    Phase.PENDING, Reason.IMPOSSIBLE, f"{where}: placement group INFEASIBLE",
                    "INFEASIBLE", fix=f"no live node can hold a bundle of {_words(self.bundle)}",
                )  # fmt: skip
            brief = f"placement group pending ({placing or 'waiting for resources'})"
            return JobStatus(Phase.PENDING, Reason.WAITING, f"{where}: {brief}", brief)
        if state == "RESCHEDULING":
            return JobStatus(
                Phase.ENDING, Reason.NODE_LOST, f"{where}: a node of its placement group was lost"
            )
        for i, actor in enumerate(self._actors):
            try:
                code, said = ray.get(actor.poll.remote(), timeout=30)
            except Exception as exc:  # noqa: BLE001 - an actor that died says it so
                return JobStatus(
                    Phase.ENDED,
                    Reason.FAILED,
                    f"{where}: the actor of node {i} died ({_first(exc)})",
                )
            if code is not None:
                return JobStatus(
                    Phase.ENDED, Reason.FAILED,
                    f"{where}: the agent of node {i} exited (exit {code})",
                    log=f"its actor's log on node {i}", output=said,
                )  # fmt: skip
        return JobStatus(Phase.RUNNING, text=where, brief="placement group ready: agents starting")

    def _settled(self) -> JobStatus:
        """Why an agent went: a node of the group lost (Ray is given a few seconds to tell
        a lost node from a slow one; an actor Ray cannot reach for ``UNREACHABLE_WAIT``
        seconds is on a lost node too: Ray calls a node dead later), the group removed, its
        actor killed; "" when Ray says nothing is wrong."""
        if self._lost_status is not None:
            return self._lost_status
        ray = self.connect()
        from ray.exceptions import ActorUnavailableError
        from ray.util.placement_group import placement_group_table

        first = time.monotonic()
        deadline = first + SETTLE_WAIT
        while True:
            table = placement_group_table(self._pg)
            if table.get("state") == "REMOVED":
                return JobStatus(
                    Phase.ENDED, Reason.CANCELLED,
                    f"{self.describe()}: its placement group was removed",
                )  # fmt: skip
            alive = {n.get("NodeID") for n in ray.nodes() if n.get("Alive")}
            placed = self._placed or {
                int(i): (str(node), "?") for i, node in table.get("bundles_to_node_id", {}).items()
            }
            lost = [i for i, (node, _) in sorted(placed.items()) if node not in alive]
            if lost or table.get("state") == "RESCHEDULING":
                return self._lost(lost, "")
            dead, unreachable = [], []
            for i, actor in enumerate(self._actors):
                try:
                    ray.get(actor.poll.remote(), timeout=5)
                except ActorUnavailableError:  # its node (or worker) gone, not yet known dead
                    unreachable.append(i)
                except Exception as exc:  # noqa: BLE001 - its death, in Ray's words
                    dead.append(f"the actor of node {i} died ({_first(exc)})")
            if not dead and not unreachable:
                return JobStatus(Phase.RUNNING)
            now = time.monotonic()
            if unreachable and (now >= first + UNREACHABLE_WAIT or now >= deadline):
                return self._lost(
                    unreachable,
                    " (its actor is unreachable; Ray has not marked the node dead yet)",
                )
            if now >= deadline:
                return JobStatus(
                    Phase.ENDED, Reason.CANCELLED, f"{self.describe()}: {'; '.join(dead)}"
                )
            time.sleep(0.5)  # (a dead actor first: its node's loss may be on its way)

    def _lost(self, nodes: Sequence[int], how: str) -> JobStatus:
        """A node of the group lost: which, on which Ray node, and what to do (said once:
        later looks say the same)."""
        said = (
            "; ".join(
                f"Ray node {self._placed[i][0][:8]} ({self._placed[i][1]}), which held node {i}, "
                f"is lost{how}"
                if i in self._placed
                else f"the Ray node that held node {i} is lost{how}"
                for i in nodes
            )
            or "a Ray node of its placement group is lost"
        )
        self._lost_status = JobStatus(
            Phase.ENDING,
            Reason.NODE_LOST,
            f"{self.describe()}: {said}; the ranks there went with it. What is left of the "
            "cluster on Ray is freed as this run ends (a session: when it is closed); launch "
            "again: it starts anew on the Ray nodes alive",
        )
        return self._lost_status

    def holds_when_lost(self) -> bool:
        return True  # (the placement group stays reserved on the nodes alive)

    def describe(self) -> str:
        if not self._job:
            return f"a Ray placement group of {self.nodes} node(s)"
        return f"Ray placement group notebook-launcher-{self._job}, {self.nodes} node(s)"

    def cancel(self, now: bool = False) -> None:
        if not self._started:
            return
        self._started = False
        ray = self.connect()
        from ray.util.placement_group import remove_placement_group

        actors, self._actors = self._actors, []
        grace = 1.0 if now else STOP_GRACE
        stops = []
        for actor in actors:
            try:
                stops.append(actor.stop.remote(grace))
            except Exception:  # noqa: BLE001 - (a dead actor: nothing to stop)
                continue
        deadline = time.monotonic() + grace + 10.0
        for ref in stops:
            try:
                ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - lost, killed: ray.kill below
                continue
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                continue
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - removed already (the cluster's end)
                pass

    def dump(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "job": self._job, "address": self.ray_address}

    @classmethod
    def load(cls, data: Mapping[str, Any]) -> RayJob:
        job = cls(int(data.get("nodes", 1)), address=data.get("address"))
        job._job = str(data.get("job", ""))
        return job

    def __getstate__(self) -> dict[str, Any]:
        """The configuration, with the cluster this process is connected to named (a
        detached run's supervisor joins the same one)."""
        state = super().__getstate__()
        if state.get("ray_address") is None:
            state["ray_address"] = _connected_address()
        return state


class AgentHost:
    """One node's agent, hosted by a Ray actor that holds its bundle's resources (and,
    with GPUs, Ray's ``CUDA_VISIBLE_DEVICES``, which the agent and its ranks inherit). The
    agent is a process of its own (see the module docstring), in a session of its own; it
    gets SIGTERM when the actor's process dies."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], cwd: str) -> None:
        import ray

        node = ray.get_runtime_context().get_node_id()
        address = ray.util.get_node_ip_address()
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives with the actor
            prefix="notebook-launcher-agent-", suffix=".log", delete=False
        )
        labels = ("--label", f"node={address}", "--label", f"ray_node={node}")
        self.proc = subprocess.Popen(
            [sys.executable, *argv, *labels],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env, NODE_ENV: node},
            cwd=cwd if os.path.isdir(cwd) else None,
            start_new_session=True,  # (Ray's signals to its worker are not the agent's)
            # (libc's prctl found here, before the fork: the child only calls it)
            preexec_fn=_term_with_parent(),  # noqa: PLW1509 - one prctl call, no lock taken
        )

    def poll(self) -> tuple[int | None, str]:
        """The agent's exit status (None: it runs) and, once it ended, its output's end."""
        code = self.proc.poll()
        return code, (tail(self.log.name) if code is not None else "")

    def stop(self, grace: float) -> tuple[int, str]:
        """SIGTERM to the agent, SIGKILL after ``grace`` seconds: its exit and output."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        said = tail(self.log.name)
        try:
            os.unlink(self.log.name)
        except OSError:
            pass
        return int(self.proc.returncode), said


def _term_with_parent() -> Callable[[], None]:
    """What the agent runs before it starts: SIGTERM when its parent (the actor's process)
    dies (``PR_SET_PDEATHSIG``)."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def term_with_parent() -> None:
        prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG

    return term_with_parent


def _client_mode(ray: Any) -> bool:
    """This process reaches Ray through a Ray client (``ray://``)."""
    try:
        from ray.util.client import ray as client

        return bool(client.is_connected())
    except ImportError:
        return False


def _connected_address() -> str | None:
    """The address of the Ray cluster this process is connected to (None: none)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized() or _client_mode(ray):
        return None
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # noqa: BLE001 - (an older Ray): ray.init() finds it again
        return None


def _words(bundle: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


def _first(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


__all__ = ["ENDING", "NODE_ENV", "AgentHost", "RayJob", "fits"]
