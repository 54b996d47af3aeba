"""Nodes of other machines, driven from this kernel: :class:`SlurmCluster`, :class:`RayCluster`,
:class:`AgentCluster`.

One kernel drives every node (a single controller, as PyTorch Monarch's ``SlurmJob`` or
ipyparallel's engines): a long-lived agent per node, started by Slurm (or by hand, or by
any scheduler), connects back to the kernel over an authenticated channel and runs that
node's ranks with the same machinery a local launch uses. The function and the cell do not
change between a laptop and a cluster::

    from notebook_launcher import notebook_launcher, SlurmCluster

    cluster = SlurmCluster(nodes=2, gpus_per_node=4, partition="gpu", time="01:00:00")
    notebook_launcher(train, args=(cfg,), num_processes=8, cluster=cluster)  # 2 nodes x 4
    session = notebook_launcher.start(num_processes=8, cluster=cluster)       # across nodes
    cluster.close()                                                           # the job ends

The cluster starts with the first launch (or :meth:`Cluster.start`) and lives until
:meth:`Cluster.close`, the kernel's end, or the job's: launches and sessions reuse its
nodes. Inside an allocation the kernel already holds (a Jupyter server started by
``salloc``/``sbatch``: ``SLURM_JOB_ID`` set), :class:`SlurmCluster` uses that allocation's
nodes with an ``srun`` step and submits nothing. A launch that must outlive the kernel
passes a cluster not started here with ``detach=True``: a supervisor of its own then starts
it and owns the job (``notebook_launcher.detached``).

What a user needs on the cluster: this package installed in the same environment (the same
Python minor version, torch and notebook_launcher) on every node -- ``python=`` names the
interpreter when it is not this kernel's path -- and a port on this machine that the nodes
can reach (``host=`` the address on the cluster's network, ``port=`` a port the firewall
lets through; both are found when not given).
"""

from __future__ import annotations

import atexit
import secrets
import shlex
import socket
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from ._events import Event, NodesWaiting
from ._launch import slurm
from ._launch.remote import AgentHub, ClusterPlan, RemoteNode, cluster_ranks, plan_cluster
from ._launch.scheduler import HandStarted, JobStatus, Phase, Reason, Scheduler, tail
from ._wire.agent import Ending
from ._wire.store import StoreProxy
from .errors import ClusterError, PreflightError, at_callers_line

#: Seconds the agents have to join once the scheduler started them.
DEFAULT_JOIN_TIMEOUT = 120.0
_live: weakref.WeakSet[Cluster] = weakref.WeakSet()


class Cluster:
    """Nodes whose agents this kernel drives (see the module docstring), started by a
    scheduler (``_launch.scheduler``: Slurm's job for :class:`SlurmCluster`, Ray's actors
    for :class:`RayCluster`, your hands for :class:`AgentCluster`). The cluster holds what
    is the same on every engine: the hub the agents join, the ranks' store, the wait for
    the agents (the scheduler's status shown and bounded), the checks of the nodes."""

    kind = "agents"

    def __init__(
        self,
        nodes: int,
        gpus_per_node: int = 0,
        *,
        host: str | None = None,
        port: int = 0,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT,
        start_timeout: float | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
            raise at_callers_line(ValueError(f"nodes must be a positive int, got {nodes!r}"))
        if not isinstance(gpus_per_node, int) or gpus_per_node < 0:
            raise at_callers_line(
                ValueError(f"gpus_per_node must be an int >= 0, got {gpus_per_node!r}")
            )
        self.num_nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.host = host
        self.port = port
        self.join_timeout = join_timeout
        self.start_timeout = start_timeout
        #: what starts the agents (a subclass sets its own)
        self.scheduler: Scheduler = scheduler or HandStarted(nodes, gpus_per_node)
        self._hub: AgentHub | None = None
        self._nodes: list[RemoteNode] = []
        self._store: Any = None
        self._proxy: StoreProxy | None = None
        self._store_key = ""
        #: why the cluster ended without close() (its job ended, an agent went away)
        self.ended: str | None = None
        #: nodes lost (how many, and why), said at the next launch: the cluster was ended
        #: when the run that saw the loss ended (see :meth:`_after_run`)
        self._lost: tuple[int, str] | None = None
        self._cancel_now = False
        self.launches = 0
        self._started_at = 0.0
        self._running_at: float | None = None

    # -- the wait for the agents, through the scheduler -----------------------------------------

    def _check(self) -> None:
        """While waiting for the agents: raise if they can no longer come (the job ended,
        it can never start, it waited longer than ``start_timeout``, or ran longer than
        ``join_timeout`` without them all)."""
        now = time.monotonic()
        status = self.scheduler.status()
        if status.phase is Phase.ENDED:
            raise ClusterError(self._ended_early(status))
        if status.reason is Reason.IMPOSSIBLE:  # waiting would be forever: say why
            raise ClusterError(
                f"{status.line}: it can never start ({status.fix}). It was cancelled."
            )
        if status.phase is Phase.RUNNING and self._running_at is None:
            self._running_at = now
        if self._running_at is None:
            if self.start_timeout is not None and now - self._started_at > self.start_timeout:
                raise ClusterError(
                    f"{status.text or 'not running'} after {self.start_timeout:g} s "
                    "(start_timeout): it was cancelled. Ask for fewer or other nodes, or wait "
                    "longer."
                )
        elif self.scheduler.queued and now - self._running_at > self.join_timeout:
            raise ClusterError(
                self._ended_early(
                    status,
                    f"its agents did not all join within {self.join_timeout:g} s of it running",
                )
            )

    def _ended_early(self, status: JobStatus, what: str | None = None) -> str:
        joined = len(self._hub.nodes) if self._hub is not None else 0
        text = f"{what or status.line}, before its agents joined ({joined} of {self.num_nodes})."
        said = status.output or (tail(status.log) if status.log else "")
        if said:
            where = f" ({status.log})" if status.log else ""
            text += f" Its output{where} ends with:\n{said}\n"
        if status.fix:
            text += f"\n{status.fix}"
        elif "No module named" in said or "not found" in said:
            python = self.scheduler.python or "the nodes' Python"
            text += (
                f"\nInstall notebook_launcher in the same environment on every node: the "
                f"agents run {python} (python=... names another interpreter)."
            )
        elif "cannot join the kernel" in said:
            address = self._hub.address if self._hub is not None else "?"
            text += (
                f"\nThe nodes cannot reach this kernel at {address}: pass host= an address of "
                "this machine on the cluster's network, and port= a port the nodes may reach."
            )
        return text

    def _waiting(self, joined: int) -> NodesWaiting:
        status = self.scheduler.status()
        what = status.brief or (
            "waiting for the agents" if status.phase is Phase.RUNNING else "submitted"
        )
        return NodesWaiting(self.describe(), what, joined, self.num_nodes, time.time())

    def describe(self) -> str:
        return self.scheduler.describe()

    def job_state(self) -> str:
        """What the scheduler says of the job, in a few words ("" when there is nothing to
        say): asked when an agent ends or goes, it may take a few seconds to settle."""
        return self.scheduler.status(settled=True).text

    def told_to_end(self) -> bool:
        """Some node's agent said whoever started it is ending it (its SIGTERM: Slurm's
        time limit or scancel, Ray's actor killed): typed (``_wire.agent.Ending``), never a
        phrase found in an error's text."""
        return any(node.end_reason is Ending.TERMINATED for node in self._nodes)

    @property
    def running(self) -> bool:
        return self._hub is not None

    def start(
        self,
        report: Callable[[Event], None] | None = None,
        tick: Callable[[], None] | None = None,
    ) -> None:
        """Start the agents and wait until every node's agent joined (idempotent). Ctrl-C
        while waiting cancels what was started (a queued Slurm job is cancelled).
        ``report`` is told of the wait whenever it changes; ``tick`` is called every half
        second of it (a view's clock: nothing else moves while the job waits)."""
        if self.running:
            return
        tell = report or (lambda event: None)
        hub = AgentHub(self.host or self.scheduler.address(), self.port)
        self._hub, self.ended = hub, None
        self._started_at, self._running_at = time.monotonic(), None
        try:
            self.scheduler.submit(hub)
            last: list[Any] = [None]

            def waited() -> None:
                event = self._waiting(len(hub.nodes))
                key = (event.state, event.joined)
                if key != last[0]:
                    last[0] = key
                    tell(event)
                if tick is not None:
                    tick()

            waited()
            # a queue bounds the wait by its own rules (_check); else join_timeout does
            budget = float("inf") if self.scheduler.queued else self.join_timeout
            nodes = hub.wait_for(self.num_nodes, budget, self._check, waited)
            self._check_nodes(nodes)
            self._nodes = nodes
            self._store = _store_server()
            self._proxy = hub.store_proxy(int(self._store.port))
            self._store_key = secrets.token_hex(16)  # never in an argv: see plan_cluster
        except BaseException:
            self._abort()
            raise
        self.scheduler.joined()
        if not _live:
            atexit.register(_close_all)
        _live.add(self)

    def _check_nodes(self, nodes: list[RemoteNode]) -> None:
        """Every node must run what this kernel runs, and have the GPUs asked for."""
        from . import __version__

        mine = {
            "Python": ".".join(sys.version.split()[0].split(".")[:2]),
            "notebook_launcher": __version__,
            "torch": _torch_version(),
        }
        for node in nodes:
            h = node.hello
            theirs = {
                "Python": ".".join(h.python.split(".")[:2]),
                "notebook_launcher": h.package,
                "torch": h.torch,
            }
            for what, version in mine.items():
                if theirs[what] != version:
                    raise ClusterError(
                        f"{node.label} runs {what} {theirs[what]}, this kernel {version}. "
                        "The function travels as Python bytecode and the ranks must agree: "
                        "install the same environment on every node (python=... names the "
                        "interpreter there)."
                    )
            if self.gpus_per_node and h.gpus < self.gpus_per_node:
                raise ClusterError(
                    f"{node.label} has {h.gpus} GPU(s) visible, but gpus_per_node="
                    f"{self.gpus_per_node}: ask the scheduler for them (gpus_per_node sets "
                    "--gpus-per-node) or lower gpus_per_node"
                )

    def close(self) -> None:
        """Let the agents go and end the job. Idempotent; the kernel's exit does it too."""
        hub, self._hub = self._hub, None
        self._nodes = []
        proxy, self._proxy = self._proxy, None
        if proxy is not None:
            proxy.close()
        self._store = None
        if hub is not None:
            hub.close()
            self.scheduler.cancel(now=self._cancel_now)
        _live.discard(self)

    def _abort(self) -> None:
        """The agents did not all join (an error, Ctrl-C): end at once what was started
        (a queued or starting job is cancelled)."""
        self._cancel_now = True
        try:
            self.close()
        finally:
            self._cancel_now = False

    def __getstate__(self) -> dict[str, Any]:
        """A cluster's configuration, as a cluster not started (what a detached run's
        supervisor gets, to start a job of its own). A running cluster's job, hub and store
        belong to the process that started it: refused."""
        if self.running:
            raise ClusterError(
                f"{self!r} was started in this process: its job, hub and store belong to "
                "it and cannot be copied. Pass a new cluster object, not started (e.g. "
                "SlurmCluster(nodes=2, ...)), or close() this one first."
            )
        return {**self.__dict__, **self._fresh_state()}

    def _fresh_state(self) -> dict[str, Any]:
        """What a cluster that never started holds besides its configuration."""
        return {
            "_hub": None, "_nodes": [], "_store": None, "_proxy": None, "_store_key": "",
            "ended": None, "_cancel_now": False, "launches": 0, "_started_at": 0.0,
            "_running_at": None,
        }  # fmt: skip

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what launches use ------------------------------------------------------------------------

    def plan(
        self,
        report: Callable[[Event], None],
        num_processes: int | None,
        *,
        renew: bool = False,
        tick: Callable[[], None] | None = None,
        **options: Any,
    ) -> ClusterPlan:
        """The plan of a launch or a session (``options``: ``plan_cluster``'s) on this
        cluster's nodes, started if need be (``report`` is told of the wait). What can be
        checked without the nodes is checked first: no job is submitted for a launch that
        could not run. ``renew``: a cluster that lost nodes starts again on fresh ones,
        saying so (what a session's ``restart()`` asks for), instead of raising. ``tick``:
        called all along the wait for the nodes (see :meth:`start`)."""
        __tracebackhide__ = True
        cluster_ranks(
            num_processes,
            self.num_nodes,
            self.gpus_per_node,
            devices=options.get("devices", "auto"),
        )
        plan = plan_cluster(
            self.nodes_for_launch(report, renew=renew, tick=tick),
            self.store_address,
            self._store_key,
            self.launches,
            num_processes,
            self.gpus_per_node,
            explain=self.job_state,
            **options,
        )
        plan.on_finished = self._after_run
        return plan

    def nodes_for_launch(
        self,
        report: Callable[[Event], None] | None = None,
        *,
        renew: bool = False,
        tick: Callable[[], None] | None = None,
    ) -> list[RemoteNode]:
        """The nodes, started if needed; :class:`ClusterError` when one is gone (saying why,
        with what the scheduler says of the job) -- or, with ``renew``, the nodes of the
        cluster started again."""
        lost, self._lost = self._lost, None  # (ended when its run ended: said now)
        if lost is None:
            self.start(report, tick)
            lost = self._end_if_lost()
        if lost is not None:
            count, ended = lost
            if not renew:
                raise ClusterError(
                    f"the cluster lost {count} node(s): {ended}. The next launch (or "
                    "cluster.start()) starts the cluster again, on fresh nodes."
                )
            print(
                f"notebook_launcher: the cluster lost {count} node(s) ({ended}); "
                "starting it again on fresh nodes",
                file=sys.stderr,
            )
            self.start(report, tick)
        self.launches += 1
        return list(self._nodes)

    def _end_if_lost(self) -> tuple[int, str] | None:
        """A cluster that lost nodes is ended (what is left of its job too): how many
        were lost and why (with what the scheduler says of the job); None when none was."""
        for node in self._nodes:
            _notice_gone(node)
        gone = [n for n in self._nodes if n.gone is not None]
        if not gone:
            return None
        why = "; ".join(f"{n.label}: {n.ending or n.gone}" for n in gone)
        state = self.job_state()
        ended = why if not state or state in why else f"{why} ({state})"
        self.close()
        self.ended = ended
        return len(gone), ended

    def _after_run(self) -> None:
        """A run on this cluster ended (a launch, a session closed). A scheduler that keeps
        holding resources for a job that lost a node (Ray's placement group) has them freed
        now, not at the next launch, which then says what was lost."""
        if self.running and self.scheduler.holds_when_lost():
            self._lost = self._end_if_lost()

    @property
    def store_address(self) -> tuple[str, int]:
        """Where the nodes reach the ranks' store: the proxy in front of the TCPStore this
        kernel holds on 127.0.0.1 (each node's agent forwards its ranks' clients there,
        proving the job's secret: see ``_wire.store``)."""
        if self._proxy is None or self._hub is None:
            raise ClusterError("the cluster is not started")
        return self._hub.host, self._proxy.port

    @property
    def job_key(self) -> str:
        """The job's id: it names the job's directory and is on the agents' command lines
        (not secret: the store is reached only through forwarders that prove the job's
        secret, and the ranks' keys there begin with a secret of their own)."""
        assert self._hub is not None
        return self._hub.job

    @property
    def hub(self) -> AgentHub | None:
        return self._hub

    def __repr__(self) -> str:
        state = (
            "running" if self.running else f"ended: {self.ended}" if self.ended else "not started"
        )
        return f"<{type(self).__name__} {self.describe()}, {state}>"


def check_cluster(cluster: Any) -> None:
    """``cluster=`` is a cluster object (:class:`SlurmCluster`, :class:`RayCluster`,
    :class:`AgentCluster`), not its name or its class."""
    if isinstance(cluster, type):
        name = cluster.__name__
        raise PreflightError(
            f"cluster={name} is the class, not a cluster: make one and pass it, e.g. "
            f"cluster={name}(nodes=2) (it starts with the first launch and stays for the next)."
        )
    if not callable(getattr(cluster, "plan", None)) or not hasattr(cluster, "nodes_for_launch"):
        raise PreflightError(
            f"cluster={cluster!r} ({type(cluster).__name__}) is not a cluster: pass a "
            "SlurmCluster or AgentCluster object (or a RayCluster), e.g. "
            "`from notebook_launcher import SlurmCluster; cluster = SlurmCluster(nodes=2, "
            "partition='gpu')`, then cluster=cluster (or leave cluster=None to run here)."
        )


def _notice_gone(node: RemoteNode) -> None:
    """Read what the agent said while nothing listened: its end, or that it is ending."""
    if not node.drain():
        node.gone = node.lost()
        node.link.close()


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _store_server(host: str = "127.0.0.1") -> Any:
    """The ranks' store, listening on 127.0.0.1 only -- never on every interface of this
    machine (what a TCPStore torch binds itself does): we bind the socket and hand it over.
    The nodes reach it through the kernel's authenticating proxy (``_wire.store``)."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listen = socket.socket(family, socket.SOCK_STREAM)
    try:
        listen.bind((host, 0))
        listen.listen(128)
        store = dist.TCPStore(
            host,
            listen.getsockname()[1],
            is_master=True,
            master_listen_fd=listen.fileno(),
            wait_for_workers=False,
            timeout=timedelta(minutes=30),
        )
    except BaseException:
        listen.close()
        raise
    listen.detach()  # the store closes it when it goes
    return store


class AgentCluster(Cluster):
    """Nodes whose agents you start yourself, by hand or with any scheduler (Kubernetes,
    TorchX, PBS...): ``cluster.agent_command(i)`` is the command to run on node ``i``.

    The job's secret is written to ``secret_file`` (default: a directory of the job's own
    under ``~/.notebook_launcher/jobs/``, removed when the cluster closes, or at the next
    start on this machine if the kernel was killed), readable by you only: the agents read
    it there, so it must be on a file system the nodes share (or copy it, keeping its mode
    0600)::

        cluster = AgentCluster(nodes=2, host="10.0.0.5", port=29400)
        cluster.start()   # prints the command, waits for both agents
    """

    def __init__(
        self,
        nodes: int,
        gpus_per_node: int = 0,
        *,
        host: str | None = None,
        port: int = 0,
        secret_file: str | None = None,
        join_timeout: float = 600.0,
    ) -> None:
        super().__init__(
            nodes,
            gpus_per_node,
            host=host,
            port=port,
            join_timeout=join_timeout,
            scheduler=HandStarted(nodes, gpus_per_node, secret_file),
        )

    def agent_command(self, node: int | None = None) -> str:
        """The command that starts node ``node``'s agent (None: whichever node is free)."""
        scheduler = self.scheduler
        assert isinstance(scheduler, HandStarted)
        if self._hub is None:
            raise ClusterError("start the cluster first (cluster.start() waits for the agents)")
        return shlex.join(scheduler.command(node))


class SlurmCluster(Cluster):
    """``nodes`` nodes of a Slurm job, each running one agent (``srun``, one task per node).

    The usual ``sbatch`` options have their names here (``partition``, ``time``,
    ``account``, ``qos``, ``cpus_per_node`` (``--cpus-per-task`` of the one task per
    node), ``mem``, ``constraint``, ``job_name``); ``gpus_per_node`` sets
    ``--gpus-per-node``; anything else goes in ``sbatch_options`` as on the command line
    (``["--exclusive", "--reservation=x"]``); a control character in any of them (a
    newline would end its ``#SBATCH`` line) is refused, and values with spaces are quoted.
    ``setup`` lines (shell, by design) run before the agents start
    (``module load ...``, ``source venv/bin/activate``); ``python`` is the interpreter on
    the nodes (default: this kernel's).

    Inside an allocation (``SLURM_JOB_ID`` set; ``allocation=None`` decides so, True
    requires it, False always submits), the agents are an ``srun`` step of it: nothing is
    submitted and closing ends the step, not the allocation.

    Waiting: a queued job may pend for long; the launch shows its state and waits
    (``start_timeout`` seconds at most, None: as long as it takes; Ctrl-C cancels the
    job). Once it runs, its agents have ``join_timeout`` seconds to connect.
    """

    kind = "slurm"

    def __init__(
        self,
        nodes: int = 1,
        gpus_per_node: int = 0,
        *,
        partition: str | None = None,
        time: str | int | None = None,
        account: str | None = None,
        qos: str | None = None,
        cpus_per_node: int | None = None,
        mem: str | None = None,
        constraint: str | None = None,
        job_name: str = "notebook-launcher",
        sbatch_options: Sequence[str] | str = (),
        setup: Sequence[str] = (),
        python: str | None = None,
        host: str | None = None,
        port: int = 0,
        allocation: bool | None = None,
        start_timeout: float | None = None,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT,
        job_dir: str | None = None,
    ) -> None:
        super().__init__(
            nodes,
            gpus_per_node,
            host=host,
            port=port,
            join_timeout=join_timeout,
            start_timeout=start_timeout,
        )
        extra = (
            shlex.split(sbatch_options) if isinstance(sbatch_options, str) else list(sbatch_options)
        )
        for what, value in (
            ("partition", partition),
            ("time", time),
            ("account", account),
            ("qos", qos),
            ("mem", mem),
            ("constraint", constraint),
            ("job_name", job_name),
            ("job_dir", job_dir),
            *(("sbatch_options", option) for option in extra),
        ):
            if value is not None:  # before anything is written or submitted
                slurm.check_option(what, str(value))
        # --no-requeue: a job Slurm requeued (after a node failure) would start agents for a
        # kernel that has moved on; the launch says what happened instead
        options = [
            f"--job-name={job_name}",
            f"--nodes={nodes}",
            "--ntasks-per-node=1",
            "--no-requeue",
        ]
        for flag, value in (
            ("--partition", partition),
            ("--time", time),
            ("--account", account),
            ("--qos", qos),
            ("--cpus-per-task", cpus_per_node),
            ("--mem", mem),
            ("--constraint", constraint),
            ("--gpus-per-node", gpus_per_node or None),
        ):
            if value is not None:
                options.append(f"{flag}={value}")
        self.scheduler = slurm.SlurmJob(
            nodes, gpus_per_node, options + extra, setup, python, allocation, job_dir
        )

    @property
    def job_id(self) -> str | None:
        """The Slurm job's id, once submitted (or the allocation's, for a step of it)."""
        return self.scheduler.job_id  # type: ignore[attr-defined]

    @property
    def sbatch_options(self) -> list[str]:
        return self.scheduler.options  # type: ignore[attr-defined]

    @classmethod
    def from_sbatch(cls, options: str | Sequence[str], **kwargs: Any) -> SlurmCluster:
        """A cluster from ``sbatch``-style options (what ``%dist start --slurm "..."``
        takes): ``--nodes 2 --partition debug --time 10 --gpus-per-node 4``; the others
        pass through to ``sbatch``."""
        example = "e.g. '--nodes 2 --partition gpu --time 60 --gpus-per-node 4'"
        try:
            args = shlex.split(options) if isinstance(options, str) else list(options)
        except ValueError as exc:  # an unclosed quote
            raise PreflightError(
                f"SlurmCluster.from_sbatch({options!r}): {exc}; {example}"
            ) from None
        named = {
            "-N": "nodes", "--nodes": "nodes", "-p": "partition", "--partition": "partition",
            "-t": "time", "--time": "time", "-A": "account", "--account": "account",
            "-q": "qos", "--qos": "qos", "-c": "cpus_per_node", "--cpus-per-task": "cpus_per_node",
            "--mem": "mem", "-C": "constraint", "--constraint": "constraint",
            "-J": "job_name", "--job-name": "job_name", "--gpus-per-node": "gpus_per_node",
        }  # fmt: skip
        rest: list[str] = []
        i = 0
        while i < len(args):
            flag, sep, value = args[i].partition("=")
            if flag in named:
                if not sep:
                    if i + 1 >= len(args):
                        raise PreflightError(
                            f"SlurmCluster.from_sbatch: {flag} needs a value ({flag} 2); {example}"
                        )
                    i += 1
                    value = args[i]
                key = named[flag]
                if key in ("nodes", "gpus_per_node", "cpus_per_node"):
                    try:
                        kwargs[key] = int(value)
                    except ValueError:
                        raise PreflightError(
                            f"SlurmCluster.from_sbatch: {flag} {value!r} is not a whole number "
                            f"(a count of {key.replace('_', ' ')}); {example}"
                        ) from None
                else:
                    kwargs[key] = value
            else:
                rest.append(args[i])
            i += 1
        return cls(sbatch_options=rest, **kwargs)


class RayCluster(Cluster):
    """``nodes`` nodes of a Ray cluster, each running one agent: Ray reserves them all at
    once (a placement group of ``nodes`` bundles of ``cpus_per_node`` CPUs and
    ``gpus_per_node`` GPUs, one per Ray node by default: ``strategy="STRICT_SPREAD"``) and
    hosts each agent in an actor; the ranks, the store, sessions and the views then run as
    on Slurm. ``address``: the Ray cluster (None: the one this process is connected to,
    else the one ``ray.init()`` joins -- ``RAY_ADDRESS``, or one started on this machine);
    ``init``: more keyword arguments for ``ray.init``. A request the live nodes can never
    hold is refused at once (``autoscaling=True``: the cluster grows on demand, as
    KubeRay's autoscaler does, so it waits instead, ``start_timeout`` seconds at most)::

        cluster = RayCluster(nodes=2, gpus_per_node=4)
        notebook_launcher(train, num_processes=8, cluster=cluster)  # 2 Ray nodes x 4 GPUs

    Needs Ray in this environment and on the nodes (``pip install
    'notebook_launcher[ray]'``), with this package; ``ray`` is imported at the first
    start, never by ``import notebook_launcher``.
    """

    kind = "ray"

    def __init__(
        self,
        nodes: int = 1,
        gpus_per_node: int = 0,
        *,
        cpus_per_node: float = 1,
        address: str | None = None,
        strategy: str = "STRICT_SPREAD",
        autoscaling: bool = False,
        init: dict[str, Any] | None = None,
        host: str | None = None,
        port: int = 0,
        start_timeout: float | None = None,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT,
    ) -> None:
        super().__init__(
            nodes,
            gpus_per_node,
            host=host,
            port=port,
            join_timeout=join_timeout,
            start_timeout=start_timeout,
        )
        from ._launch.ray import RayJob

        try:
            self.scheduler = RayJob(
                nodes, gpus_per_node, cpus_per_node, address, strategy, autoscaling, init
            )
        except ValueError as exc:
            raise at_callers_line(exc) from None


def _close_all() -> None:
    for cluster in list(_live):
        try:
            cluster.close()
        except Exception:  # noqa: BLE001 - at exit: do what can be done
            pass


__all__ = ["AgentCluster", "Cluster", "ClusterError", "RayCluster", "SlurmCluster"]
