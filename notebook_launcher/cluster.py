"""Nodes of other machines, driven from this kernel: :class:`SlurmCluster`, :class:`AgentCluster`.

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
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from ._events import Event, NodesWaiting
from ._launch import slurm
from ._launch.remote import AgentHub, ClusterPlan, RemoteNode, cluster_ranks, plan_cluster
from ._wire.store import StoreProxy
from .errors import ClusterError, PreflightError, at_callers_line

#: Seconds the agents have to join once the scheduler started them.
DEFAULT_JOIN_TIMEOUT = 120.0
#: Seconds between two looks at the job while the kernel waits for it.
POLL = 1.0
#: Seconds an ending job (COMPLETING) is given to say how it ended (CANCELLED, TIMEOUT...).
COMPLETING_WAIT = 8.0

_live: weakref.WeakSet[Cluster] = weakref.WeakSet()


class Cluster:
    """Nodes whose agents this kernel drives (see the module docstring). Subclasses say how
    the agents are started: :class:`SlurmCluster` (Slurm does it), :class:`AgentCluster`
    (you, or any other scheduler, do it with :meth:`AgentCluster.agent_command`)."""

    kind = "agents"

    def __init__(
        self,
        nodes: int,
        gpus_per_node: int = 0,
        *,
        host: str | None = None,
        port: int = 0,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT,
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
        self._hub: AgentHub | None = None
        self._nodes: list[RemoteNode] = []
        self._store: Any = None
        self._proxy: StoreProxy | None = None
        self._store_key = ""
        #: why the cluster ended without close() (its job ended, an agent went away)
        self.ended: str | None = None
        self._cancel_now = False
        self.launches = 0

    # -- what subclasses provide ---------------------------------------------------------------

    def _start_agents(self, hub: AgentHub, report: Callable[[Event], None]) -> None:
        """Have one agent per node started (they connect to ``hub``)."""

    def _check(self) -> None:
        """While waiting for the agents: raise if they can no longer come."""

    def _waiting(self, joined: int) -> NodesWaiting:
        return NodesWaiting(
            self.describe(), "waiting for the agents", joined, self.num_nodes, time.time()
        )

    def _stop_agents(self) -> None:
        """After the agents were told to leave (or could not be): end what started them."""

    def describe(self) -> str:
        return f"{self.num_nodes} node(s)"

    def job_state(self) -> str:
        """What the scheduler says of the job, in a few words ("" when there is nothing to say)."""
        return ""

    # -- life ----------------------------------------------------------------------------------

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
        hub = AgentHub(self.host or self._default_host(), self.port)
        self._hub, self.ended = hub, None
        try:
            self._start_agents(hub, tell)
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
            nodes = hub.wait_for(self.num_nodes, self._join_budget(), self._check, waited)
            self._check_nodes(nodes)
            self._nodes = nodes
            self._store = _store_server()
            self._proxy = hub.store_proxy(int(self._store.port))
            self._store_key = secrets.token_hex(16)  # never in an argv: see plan_cluster
        except BaseException:
            self._abort()
            raise
        self._forget_secret()
        if not _live:
            atexit.register(_close_all)
        _live.add(self)

    def _join_budget(self) -> float:
        return self.join_timeout

    def _default_host(self) -> str:
        return "127.0.0.1"

    def _forget_secret(self) -> None:
        """Every agent joined: the secret's file is of no more use."""

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
        self._stop_agents()
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
            "ended": None, "_cancel_now": False, "launches": 0,
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
        return plan_cluster(
            self.nodes_for_launch(report, renew=renew, tick=tick),
            self.store_address,
            self._store_key,
            self.launches,
            num_processes,
            self.gpus_per_node,
            explain=self.job_state,
            **options,
        )

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
        self.start(report, tick)
        for node in self._nodes:
            _notice_gone(node)
        gone = [n for n in self._nodes if n.gone is not None]
        if gone:
            why = "; ".join(f"{n.label}: {n.ending or n.gone}" for n in gone)
            state = self.job_state()
            ended = why if not state or state in why else f"{why} ({state})"
            self.close()  # what is left of the job ends too
            self.ended = ended
            if not renew:
                raise ClusterError(
                    f"the cluster lost {len(gone)} node(s): {ended}. The next launch (or "
                    "cluster.start()) starts the cluster again, on fresh nodes."
                )
            print(
                f"notebook_launcher: the cluster lost {len(gone)} node(s) ({ended}); "
                "starting it again on fresh nodes",
                file=sys.stderr,
            )
            self.start(report, tick)
        self.launches += 1
        return list(self._nodes)

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
        super().__init__(nodes, gpus_per_node, host=host, port=port, join_timeout=join_timeout)
        self._secret_file = secret_file
        self._written: str | None = None
        self._dir: str | None = None

    def _fresh_state(self) -> dict[str, Any]:
        return {**super()._fresh_state(), "_written": None, "_dir": None}

    def _default_host(self) -> str:
        return slurm.reachable_address(None)

    def _start_agents(self, hub: AgentHub, report: Callable[[Event], None]) -> None:
        if self._secret_file is None:  # a directory of the job's own (swept if we die)
            self._dir = _jobs_dir(None, hub.job)
            path = os.path.join(self._dir, "secret")
        else:
            path = self._secret_file
            _remove(path)  # the last start's secret: this start has a new one
        self._written = hub.write_secret(path)

    def agent_command(self, node: int | None = None) -> str:
        """The command that starts node ``node``'s agent (None: whichever node is free)."""
        if self._hub is None or self._written is None:
            raise ClusterError("start the cluster first (cluster.start() waits for the agents)")
        argv = [
            sys.executable, "-m", "notebook_launcher", "agent", "--connect", self._hub.address,
            "--job", self._hub.job, "--secret-file", self._written,
        ]  # fmt: skip
        if node is not None:
            argv += ["--node", str(node)]
        return shlex.join(argv)

    def _waiting(self, joined: int) -> NodesWaiting:
        return NodesWaiting(
            self.describe(),
            f"start an agent on each node: {self.agent_command()}",
            joined,
            self.num_nodes,
            time.time(),
        )

    def _forget_secret(self) -> None:
        if self._written is not None and self._secret_file is None:
            _remove(self._written)
            self._written = None

    def _stop_agents(self) -> None:
        self._forget_secret()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


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
        super().__init__(nodes, gpus_per_node, host=host, port=port, join_timeout=join_timeout)
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
        self.sbatch_options = options + extra
        self.setup = list(setup)
        self.python = python or sys.executable
        self.allocation = allocation
        self.start_timeout = start_timeout
        self.job_dir = job_dir
        self.job_id: str | None = None
        self._step: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self._output: str | None = None
        self._state: slurm.JobState | None = None
        self._next_look = 0.0
        self._started_at = 0.0
        self._running_at: float | None = None

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

    def describe(self) -> str:
        where = f"Slurm job {self.job_id}" if self.job_id else "a Slurm job"
        if self._step is not None:
            where = f"an srun step of Slurm job {self.job_id}"
        return f"{where}, {self.num_nodes} node(s)"

    def _fresh_state(self) -> dict[str, Any]:
        return {
            **super()._fresh_state(), "job_id": None, "_step": None, "_dir": None,
            "_output": None, "_state": None, "_next_look": 0.0, "_started_at": 0.0,
            "_running_at": None,
        }  # fmt: skip

    def _default_host(self) -> str:
        return slurm.reachable_address(slurm.controller_host())

    def _uses_allocation(self) -> tuple[str, int] | None:
        held = slurm.allocation()
        if self.allocation is False:
            return None
        if held is None:
            if self.allocation:
                raise ClusterError(
                    "allocation=True, but this kernel runs in no Slurm allocation "
                    "(SLURM_JOB_ID is not set): start Jupyter inside salloc/sbatch, or let "
                    "the cluster submit a job (allocation=None)"
                )
            return None
        job, count = held
        if count < self.num_nodes:
            if self.allocation:
                raise ClusterError(
                    f"this kernel's allocation (Slurm job {job}) has {count} node(s), "
                    f"fewer than nodes={self.num_nodes}"
                )
            return None  # too small to use: submit a job of its own
        return held

    def _start_agents(self, hub: AgentHub, report: Callable[[Event], None]) -> None:
        self._dir = _jobs_dir(self.job_dir, hub.job)
        self._output = os.path.join(self._dir, "agents.out")
        self._started_at = time.monotonic()
        self._running_at = None
        agent = [
            self.python,
            "-m",
            "notebook_launcher",
            "agent",
            "--connect",
            hub.address,
            "--job",
            hub.job,
        ]
        held = self._uses_allocation()
        if held is not None:
            self.job_id = held[0]
            argv = [
                slurm.command("srun"), "--overlap", f"--nodes={self.num_nodes}",
                f"--ntasks={self.num_nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
                f"--job-name={self.sbatch_options[0].split('=', 1)[1]}", *agent,
            ]  # fmt: skip
            with open(self._output, "wb") as out:
                self._step = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **hub.secret_env()},  # never argv, never a file
                    start_new_session=True,  # the notebook's Ctrl-C is the kernel's
                )
            self._running_at = time.monotonic()
            return
        secret = hub.write_secret(os.path.join(self._dir, "secret"))
        script = os.path.join(self._dir, "job.sh")
        text = slurm.batch_script(
            self.sbatch_options,
            self.setup,
            [*agent, "--secret-file", secret],
            os.path.join(self._dir, "slurm-%j.out"),
        )
        with open(script, "w") as f:
            f.write(text)
        self.job_id = slurm.submit(script)
        self._output = os.path.join(self._dir, f"slurm-{self.job_id}.out")

    def _join_budget(self) -> float:
        return float("inf")  # _check bounds the wait: pending, then join_timeout once running

    def _check(self) -> None:
        now = time.monotonic()
        if self._step is not None:
            code = self._step.poll()
            if code is not None:
                raise ClusterError(self._ended_early(f"the srun step ended (exit {code})"))
        elif self.job_id is not None and now >= self._next_look:
            self._next_look = now + POLL
            self._state = state = slurm.state(self.job_id)
            if state.ended:
                raise ClusterError(self._ended_early(state.describe()))
            never = slurm.never_starts(state)
            if never is not None:  # waiting would be forever: say why, and cancel it
                raise ClusterError(
                    f"{state.describe()}: it can never start ({never}). It was cancelled."
                )
            if state.state == "RUNNING" and self._running_at is None:
                self._running_at = now
        if self._running_at is None:
            if self.start_timeout is not None and now - self._started_at > self.start_timeout:
                state_text = self._state.describe() if self._state else "not running"
                raise ClusterError(
                    f"{state_text} after {self.start_timeout:g} s (start_timeout): it was "
                    "cancelled. Ask for fewer or other nodes, or wait longer."
                )
        elif now - self._running_at > self.join_timeout:
            raise ClusterError(
                self._ended_early(
                    f"its agents did not all join within {self.join_timeout:g} s of it running"
                )
            )

    def _ended_early(self, what: str) -> str:
        joined = len(self._hub.nodes) if self._hub is not None else 0
        text = f"{what}, before its agents joined ({joined} of {self.num_nodes})."
        tail = slurm.tail(self._output) if self._output else ""
        if tail:
            text += f" Its output ({self._output}) ends with:\n{tail}\n"
        if "No module named" in tail or "not found" in tail:
            text += (
                f"\nInstall notebook_launcher in the same environment on every node: the agents "
                f"run {self.python} (python=... names another interpreter)."
            )
        elif "cannot join the kernel" in tail:
            address = self._hub.address if self._hub is not None else "?"
            text += (
                f"\nThe nodes cannot reach this kernel at {address}: pass host= an address of "
                "this machine on the cluster's network, and port= a port the nodes may reach."
            )
        return text

    def _waiting(self, joined: int) -> NodesWaiting:
        if self._step is not None:
            what = "srun step started"
        elif self._state is not None:
            what = self._state.brief()
        else:
            what = "submitted"
        return NodesWaiting(self.describe(), what, joined, self.num_nodes, time.time())

    def job_state(self) -> str:
        """``Slurm job 12: CANCELLED: it was cancelled (scancel)``. A job that is ending
        (COMPLETING) is given a few seconds to say how it ended."""
        if self.job_id is None or self._step is not None:
            return ""
        deadline = time.monotonic() + COMPLETING_WAIT
        try:
            state = slurm.state(self.job_id)
            while state.state == "COMPLETING" and time.monotonic() < deadline:
                time.sleep(0.2)
                state = slurm.state(self.job_id)
        except slurm.SlurmError:
            return ""
        text = state.describe()
        if state.state == "NODE_FAIL" or state.reason in ("NodeDown", "NodeFail"):
            bad = slurm.unhealthy(state.nodes)
            if bad:
                text += f"; Slurm holds these nodes down: {bad}"
        return text

    def _forget_secret(self) -> None:
        if self._dir is not None:
            _remove(os.path.join(self._dir, "secret"))

    def _stop_agents(self) -> None:
        """The agents were told to leave: the step (or the job) ends by itself; make sure."""
        step, self._step = self._step, None
        if step is not None:
            if self._cancel_now:
                step.terminate()
            try:
                step.wait(10.0)
            except subprocess.TimeoutExpired:
                step.terminate()
                try:
                    step.wait(10.0)
                except subprocess.TimeoutExpired:
                    step.kill()
                    step.wait()
        elif self.job_id is not None and self._cancel_now:
            slurm.cancel(self.job_id)
        elif self.job_id is not None:
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:
                try:
                    if slurm.state(self.job_id).ended:
                        break
                except slurm.SlurmError:
                    break
                time.sleep(0.2)
            else:
                slurm.cancel(self.job_id)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


#: The file in a job's directory that names the kernel that made it (host, pid, start).
OWNER = "kernel"


def _jobs_dir(base: str | None = None, job: str | None = None) -> str:
    """The jobs' root (``~/.notebook_launcher/jobs``), or the directory of ``job`` in it,
    made with an :data:`OWNER` file; the directories of ended kernels of this host go
    (a killed kernel could not remove its own)."""
    root = base or os.path.join(os.path.expanduser("~"), ".notebook_launcher", "jobs")
    if not job:
        os.makedirs(root, mode=0o700, exist_ok=True)
        return root
    _sweep(root)
    path = os.path.join(root, job)
    os.makedirs(path, mode=0o700, exist_ok=True)
    with open(os.path.join(path, OWNER), "w") as f:
        f.write(_kernel_id(os.getpid()))
    return path


def _kernel_id(pid: int) -> str:
    """``host pid start``: a process, told apart from a later one that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        start = "?"
    return f"{socket.gethostname()} {pid} {start}"


def _sweep(root: str) -> None:
    """Remove the job directories under ``root`` whose kernel, on this host, has ended."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    host = socket.gethostname()
    for name in names:
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, OWNER)) as f:
                owner = f.read().strip()
            owner_host, pid = owner.split()[:2]
            if owner_host != host or int(pid) == os.getpid():
                continue  # another login node's kernel (it may well be alive), or this one
        except (OSError, ValueError):
            continue  # not one of ours, or being made
        if _kernel_id(int(pid)) != owner:  # that kernel ended (its pid is gone or reused)
            shutil.rmtree(path, ignore_errors=True)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _close_all() -> None:
    for cluster in list(_live):
        try:
            cluster.close()
        except Exception:  # noqa: BLE001 - at exit: do what can be done
            pass


__all__ = ["AgentCluster", "Cluster", "ClusterError", "SlurmCluster"]
