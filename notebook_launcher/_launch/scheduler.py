"""What starts a cluster's node agents: one small interface, one class per scheduler.

The questions this module alone answers: how the agents of a cluster come to run (a batch
scheduler's job, Ray's actors, your own hands), where that stands, why it ended, and how
to end it --
so that everything after an agent joined (the hub, the store, the ranks, sessions,
detached runs) is the same on every engine. Its size is Monarch's ``JobTrait``'s
(``_src/job/job.py``: a handful of methods, ``job_load`` to reattach); each scheduler is a
small subclass, as ipyparallel's launchers are::

    kernel (cluster.Cluster)                 Scheduler                      node i
    ------------------------                 ---------                      ------
    hub = AgentHub(scheduler.address())
    scheduler.submit(hub) -----------------> reserve every node or none,
                                             start one agent on each -----> agent joins the hub
    while they join: scheduler.status() <--- JobStatus(Phase, Reason, words)
    all joined: scheduler.joined()           (a secret's file can go)
    ... launches, sessions: the hub's business, not the scheduler's ...
    an agent gone: status(settled=True) <--- why: NODE_LOST, TIME_LIMIT, CANCELLED ...
    close(): hub.close() (agents leave), scheduler.cancel(now=False); an abort: now=True

To implement (abstract):

* :meth:`Scheduler.submit` -- reserve the nodes and start one agent per node, each told to
  join ``hub`` (its address, its job, its secret: the scheduler picks how the secret
  travels -- a file only the user reads, a child's environment, never an argv);
* :meth:`Scheduler.status` -- a :class:`JobStatus`: a :class:`Phase` and a :class:`Reason`
  the code decides on, and words for people that nothing decides on;
* :meth:`Scheduler.cancel` -- end what :meth:`~Scheduler.submit` started, nothing left
  behind;
* :meth:`Scheduler.describe` -- the allocation in a few words ("job 12, 2 node(s)");
* :meth:`Scheduler.dump` -- what another process needs to look at the job or cancel it
  (JSON); :func:`load` reads it back in any kernel (a detached run's record holds it).

With defaults (a scheduler says yes where it can):

* :meth:`Scheduler.address` -- where the agents reach this kernel;
* :meth:`Scheduler.joined` -- every agent joined;
* :meth:`Scheduler.submit_supervisor` -- run a detached run's supervisor inside a job of
  its own, where :meth:`Scheduler.can_host_supervisor` (else the supervisor runs on the
  kernel's host and starts the agents as a kernel would); :meth:`Scheduler.here` and
  :meth:`Scheduler.terminated` are that supervisor's view of the job it runs in.

Typed, not prose: an outcome is decided on a :class:`Reason`, never by finding a phrase in
an exception's text; an agent's hello carries labels (a dict), not one scheduler's fields.
"""

from __future__ import annotations

import enum
import importlib
import os
import shutil
import socket
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ClusterError

if TYPE_CHECKING:
    from .remote import AgentHub


class Phase(enum.Enum):
    """Where a submission stands."""

    #: submitted, waiting for its resources (a queue, a placement group not yet placed)
    PENDING = "pending"
    #: its resources are held and its agents start (or run)
    RUNNING = "running"
    #: the scheduler is ending it (its agents were told: SIGTERM)
    ENDING = "ending"
    #: it will never run (again)
    ENDED = "ended"


class Reason(enum.Enum):
    """Why it stands there: what the code decides on (the words are :class:`JobStatus`'s)."""

    NONE = "none"
    #: waiting for resources others hold, or for its priority
    WAITING = "waiting"
    #: it asks what the cluster never grants (more GPUs than any node has, a bad account):
    #: waiting would be forever
    IMPOSSIBLE = "impossible"
    #: cancelled (by the scheduler, ``ray.kill``, a placement group removed, ``close()``)
    CANCELLED = "cancelled"
    TIME_LIMIT = "time limit"
    #: a node of it failed or was lost
    NODE_LOST = "node lost"
    PREEMPTED = "preempted"
    OUT_OF_MEMORY = "out of memory"
    #: what started the agents failed (a batch script, an agent that could not start)
    FAILED = "failed"
    #: what started the agents ended by itself
    COMPLETED = "completed"


@dataclass(frozen=True)
class JobStatus:
    """What a scheduler says of its job. ``phase`` and ``reason`` are decided on; the
    rest is for people.

    >>> JobStatus(Phase.PENDING, Reason.WAITING, "job 12: PENDING (Resources)").line
    'job 12: PENDING (Resources)'
    >>> JobStatus(Phase.PENDING, Reason.WAITING, brief="submitted").line
    'submitted'
    """

    phase: Phase
    reason: Reason = Reason.NONE
    #: the scheduler's words: ``job 12: PENDING (Resources)`` ("" when nothing to say)
    text: str = ""
    #: the short form a waiting line shows: ``PENDING (Resources)``
    brief: str = ""
    #: what to change (reason IMPOSSIBLE), or to look at (an agent that could not start)
    fix: str = ""
    #: where the agents' output goes, and its last lines once it ended before they joined
    log: str = ""
    output: str = ""

    @property
    def line(self) -> str:
        return self.text or self.brief or self.phase.value

    @property
    def ended(self) -> bool:
        return self.phase is Phase.ENDED


class Scheduler(ABC):
    """Starts a cluster's agents, says where they stand, ends them (the module docstring
    says why each method is there). An instance is a configuration until :meth:`submit`,
    then the handle of that submission; pickled, it is the configuration only (the
    attributes of :attr:`FRESH` go back to their values there: a detached run's
    supervisor gets a scheduler that never submitted)."""

    #: whether its jobs may wait in a queue: the wait for the agents is then bounded by
    #: ``start_timeout`` while pending and ``join_timeout`` once running; otherwise by
    #: ``join_timeout`` from the start
    queued: ClassVar[bool] = True
    #: the prefix of the variables it sets in its jobs: a supervisor inside one keeps its
    #: own (its allocation) over those of the kernel it takes on
    environment: ClassVar[str] = ""
    #: runtime attributes -> their value before any submission (see the class docstring)
    FRESH: ClassVar[Mapping[str, Any]] = {}
    #: the interpreter the agents run, when one is named for every node (said in the hint
    #: to an agent that could not import this package)
    python: str | None = None

    def __init__(self, nodes: int, gpus_per_node: int = 0) -> None:
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.__dict__.update(self.FRESH)

    # -- to implement --------------------------------------------------------------------------

    @abstractmethod
    def submit(self, hub: AgentHub) -> None:
        """Reserve the nodes and start one agent per node, told to join ``hub``. Raise
        :class:`~notebook_launcher.errors.ClusterError` at once when the request can never
        be granted (the cluster is closed then)."""

    @abstractmethod
    def status(self, settled: bool = False) -> JobStatus:
        """Where the submission stands (cheap: called twice a second while the kernel waits;
        a scheduler asks its server at most every second or so). ``settled``: asked after an
        agent went away -- take a few seconds if the scheduler needs them to say why."""

    @abstractmethod
    def cancel(self, now: bool = False) -> None:
        """End what :meth:`submit` started, nothing left behind. The agents were told to
        leave already (``now``: they could not be, or the start was aborted -- end at once).
        Idempotent."""

    @abstractmethod
    def describe(self) -> str:
        """The allocation in a few words: ``job 12, 2 node(s)``."""

    @abstractmethod
    def dump(self) -> dict[str, Any]:
        """What :meth:`load` needs, in another process, to look at this job or cancel it:
        JSON types (the module's :func:`dump` adds which class loads it)."""

    # -- with defaults -------------------------------------------------------------------------

    def address(self) -> str:
        """This machine's address where the agents can reach it (the hub listens there)."""
        return reachable_address(None)

    def joined(self) -> None:  # noqa: B027 - a hook: most schedulers have nothing to do
        """Every agent joined (what only their start needed can go)."""

    def can_host_supervisor(self) -> bool:
        """Whether :meth:`submit_supervisor` can run a detached run's supervisor in a job."""
        return False

    def holds_when_lost(self) -> bool:
        """Whether the job keeps holding its resources after one of its nodes is lost (a
        Ray placement group stays reserved until it is removed): the cluster is then ended
        as soon as the run that saw the loss ends, not at the next launch. A batch job
        whose node died is ended by its scheduler anyway."""
        return False

    def submit_supervisor(self, argv: Sequence[str], folder: str, env: Mapping[str, str]) -> bool:
        """Run a detached run's supervisor (``argv``, with ``env`` added to its environment:
        never written to a file) inside a job of its own, its output in ``folder``: True
        when it was submitted (this object is then that job's handle), False when this
        scheduler cannot (the supervisor runs on the kernel's host instead)."""
        return False

    @classmethod
    def here(cls) -> Scheduler | None:
        """The job of this scheduler that this process runs in (a supervisor inside its
        job), or None."""
        return None

    def terminated(self) -> str:
        """What a SIGTERM to a process of this job means, said by its supervisor inside it."""
        return f"{self.describe()} was ended (SIGTERM to the run's supervisor)"

    @classmethod
    def load(cls, data: Mapping[str, Any]) -> Scheduler:
        """The job of a :meth:`dump` (the module's :func:`load` picks the class)."""
        raise NotImplementedError(f"{cls.__name__} cannot be loaded from a dump")

    # -- plumbing ------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, **self.FRESH}


def dump(job: Scheduler) -> dict[str, Any]:
    """``job.dump()``, with the class that loads it back (:func:`kind_of`)."""
    return {**job.dump(), "kind": kind_of(type(job))}


def load(data: Mapping[str, Any]) -> Scheduler:
    """A scheduler's job from its :func:`dump` (Monarch's ``job_load``): its class is
    found by ``data["kind"]``, its module imported only now (Ray's, only for a Ray job)."""
    return kind(str(data.get("kind"))).load(data)


def kind_of(cls: type[Scheduler]) -> str:
    """A scheduler's class by name: ``notebook_launcher._launch.<module>:<class>``."""
    return f"{cls.__module__}:{cls.__qualname__}"


def kind(name: str) -> type[Scheduler]:
    """The scheduler class :func:`kind_of` named, its module imported now (one of this
    package's: a record names nothing else)."""
    module, _, attribute = name.partition(":")
    if not module.startswith(f"{__package__}.") or not attribute.isidentifier():
        raise ClusterError(f"a job of an unknown scheduler ({name!r})")
    try:
        found = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as exc:
        raise ClusterError(
            f"a job of a scheduler that cannot be loaded ({name!r}: {exc})"
        ) from None
    if not (isinstance(found, type) and issubclass(found, Scheduler)):
        raise ClusterError(f"a job of an unknown scheduler ({name!r})")
    return found


class HandStarted(Scheduler):
    """Agents started by you, or by any scheduler this package does not drive: the job's
    secret goes to a file only you can read, and :meth:`command` is what to run on each
    node (``AgentCluster``)."""

    queued = False
    FRESH: ClassVar[Mapping[str, Any]] = {"_written": None, "_dir": None, "_command": ()}

    def __init__(self, nodes: int, gpus_per_node: int = 0, secret_file: str | None = None):
        super().__init__(nodes, gpus_per_node)
        self.secret_file = secret_file
        self._written: str | None = None
        self._dir: str | None = None
        self._command: tuple[str, ...] = ()

    def submit(self, hub: AgentHub) -> None:
        if self.secret_file is None:  # a directory of the job's own (swept if we die)
            self._dir = jobs_dir(None, hub.job)
            path = os.path.join(self._dir, "secret")
        else:
            path = self.secret_file
            remove(path)  # the last start's secret: this start has a new one
        self._written = hub.write_secret(path)
        self._command = tuple(agent_argv(hub, ("--secret-file", self._written)))

    def command(self, node: int | None = None) -> list[str]:
        """The command that starts node ``node``'s agent (None: whichever node is free)."""
        if not self._command or self._written is None:
            raise ClusterError("start the cluster first (cluster.start() waits for the agents)")
        return [*self._command, *(("--node", str(node)) if node is not None else ())]

    def status(self, settled: bool = False) -> JobStatus:
        import shlex

        if self._written is None or not self._command:  # (joined, or not started)
            return JobStatus(Phase.RUNNING)
        return JobStatus(
            Phase.RUNNING, brief=f"start an agent on each node: {shlex.join(self.command())}"
        )

    def joined(self) -> None:
        if self._written is not None and self.secret_file is None:
            remove(self._written)
            self._written = None

    def cancel(self, now: bool = False) -> None:
        self.joined()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def describe(self) -> str:
        return f"{self.nodes} node(s)"

    def dump(self) -> dict[str, Any]:
        return {"nodes": self.nodes}

    @classmethod
    def load(cls, data: Mapping[str, Any]) -> HandStarted:
        return cls(int(data.get("nodes", 1)))


# --- what every scheduler uses ------------------------------------------------------------------


def agent_argv(hub: AgentHub, extra: Sequence[str] = (), python: str | None = None) -> list[str]:
    """The command of an agent that joins ``hub`` (``python``: the interpreter on the
    node, default this one's), ``extra`` options after it: ``--node``, ``--label``,
    ``--on-sigterm`` (see ``python -m notebook_launcher agent --help``)."""
    import sys

    return [
        python or sys.executable, "-m", "notebook_launcher", "agent",
        "--connect", hub.address, "--job", hub.job, *extra,
    ]  # fmt: skip


def reachable_address(towards: str | None, port: int = 9) -> str:
    """This machine's address on the network that reaches ``towards`` (a scheduler's
    server: the nodes are on its network); the host name's address without it. No packet
    is sent: the kernel's routing table is asked (a UDP socket's connect)."""
    if towards:
        try:
            family = socket.AF_INET6 if ":" in towards else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((towards, port))
                address: str = probe.getsockname()[0]
                return address
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


#: The file in a job's directory that names the kernel that made it (host, pid, start).
OWNER = "kernel"


def jobs_dir(base: str | None = None, job: str | None = None) -> str:
    """The jobs' root (``~/.notebook_launcher/jobs``), or the directory of ``job`` in it,
    made with an :data:`OWNER` file; the directories of ended kernels of this host go
    (a killed kernel could not remove its own)."""
    root = base or os.path.join(os.path.expanduser("~"), ".notebook_launcher", "jobs")
    if not job:
        os.makedirs(root, mode=0o700, exist_ok=True)
        return root
    sweep(root)
    path = os.path.join(root, job)
    os.makedirs(path, mode=0o700, exist_ok=True)
    with open(os.path.join(path, OWNER), "w") as f:
        f.write(kernel_id(os.getpid()))
    return path


def kernel_id(pid: int) -> str:
    """``host pid start``: a process, told apart from a later one that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        start = "?"
    return f"{socket.gethostname()} {pid} {start}"


def sweep(root: str) -> None:
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
        if kernel_id(int(pid)) != owner:  # that kernel ended (its pid is gone or reused)
            shutil.rmtree(path, ignore_errors=True)


def tail(path: str, lines: int = 15) -> str:
    """The last ``lines`` of the file at ``path`` ("" when it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return ""


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


__all__ = [
    "dump",
    "kind",
    "kind_of",
    "HandStarted",
    "JobStatus",
    "Phase",
    "Reason",
    "Scheduler",
    "agent_argv",
    "jobs_dir",
    "load",
    "reachable_address",
    "tail",
]
