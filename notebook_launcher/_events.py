"""Plain events: what the workers (and the launcher) report about a launch.

Every event is a small frozen dataclass of builtins: it pickles with the standard
library, knows nothing of torch or widgets, and is the *only* thing the dashboard
sees. Workers create most of them (a rank's first are :class:`WorkerPhase`, while it
starts); the parent adds :class:`RendezvousStarted` (a launch
across nodes waits for the others), :class:`LaunchStarted`, :class:`Output` (it reads the
workers' stdout/stderr pipes itself), :class:`WorkerExited`, :class:`WorkerStopped`,
:class:`LaunchRestarting` (``max_restarts``: every rank starts again),
:class:`StacksTaken` / :class:`StallOver` (no rank made progress for a while: where each
rank is; ``_launch.stall``) and :class:`LaunchFinished`.

``time`` is always ``time.time()`` where the event was made (wall clock, so the
parent can order events coming from different processes on one node).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RendezvousStarted:
    """This node waits (up to ``timeout`` seconds) for the other nodes of the job to join
    the rendezvous at ``endpoint``; :class:`LaunchStarted` follows once they all have."""

    backend: str
    endpoint: str
    run_id: str
    num_nodes: int
    node_rank: int
    timeout: float
    time: float


@dataclass(frozen=True)
class NodesWaiting:
    """The kernel waits for the nodes of a cluster (``where``: "Slurm job 12, 2 node(s)"):
    ``state`` is what the scheduler says of the job ("PENDING (Resources)", "RUNNING"), or
    what the user must do; ``joined`` of ``nodes`` agents have joined so far. Sent again
    whenever either changes."""

    where: str
    state: str
    joined: int
    nodes: int
    time: float


@dataclass(frozen=True)
class LaunchStarted:
    """The launcher is about to start ``world_size`` ranks (this node's share of them).

    ``node_rank`` is this node's rank in the job (with the c10d rendezvous, the one torch
    assigned); ``rendezvous`` says how the nodes met (empty for one node without one);
    A launch on a cluster's nodes (one kernel drives them all) has ``node_rank`` -1 and
    ``hosts``. ``log_line_prefix_template`` (torch elastic's ``${rank}``, ``${local_rank}``,
    ``${role_name}``) replaces the views' ``[rankN]`` label of output lines; ``task``: set
    when a session's ranks run one of its tasks (``"task 3: run_cell"``), empty for a launch;
    ``session``: the ranks of a session start (they stay, ready for its tasks)."""

    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    start_method: str
    start_reason: str
    master_addr: str
    master_port: int
    backend: str
    ranks: tuple[int, ...]
    time: float
    max_restarts: int = 0
    rendezvous: str = ""
    log_line_prefix_template: str | None = None
    task: str = ""
    #: a cluster's launch: the host of each of ``ranks`` (the views name it in the row)
    hosts: tuple[str, ...] = ()
    #: where the ranks run, on GPUs ("2 rank(s), one per GPU (cuda:0, cuda:1), on NCCL");
    #: empty for CPU ranks on a machine without GPUs
    placement: str = ""
    #: what the user should read before the ranks start (ranks sharing a GPU), or empty
    banner: str = ""
    session: bool = False
    #: the id of the detached run these ranks belong to, as a kernel that follows it shows
    #: it (the ranks are a supervisor's, not this kernel's); empty otherwise
    detached: str = ""


@dataclass(frozen=True)
class LaunchRestarting:
    """A rank failed in a way that restarts (see ``max_restarts``): every rank of the job
    was stopped and restart number ``attempt`` (1, 2, ... up to ``max_restarts``) starts
    the ranks again now. ``cause``: how the previous attempt ended, in one line."""

    attempt: int
    max_restarts: int
    cause: str
    time: float


#: :class:`WorkerPhase` phases, in the order a rank goes through them, and how views say them.
PHASES = {
    "importing": "importing torch",
    "loading": "loading the function",
    "joining": "joining the process group",
}
#: What a running rank does for a while in this package's code rather than the user's
#: (said as the start-up phases are): a :class:`WorkerPhase` with one of these keys after
#: :class:`WorkerStarted`; one with ``""`` says it is done.
RUNNING_PHASES = {
    "wrapping": "wrapping the model in DDP",
}
#: A running rank's phase that starts with this is said as it is: ``importing transformers``
#: (``_worker.doing``: the imports of a task's first seconds).
IMPORTING = "importing "


@dataclass(frozen=True)
class WorkerPhase:
    """What a rank does while it starts, before :class:`WorkerStarted` (so a slow start is
    not taken for a hang): ``phase`` is a key of :data:`PHASES`. ``"importing"``: torch, in
    a fresh interpreter (spawn); ``"loading"``: receiving and unpickling the function, which
    imports the modules it refers to (spawn, forkserver); ``"joining"``: the rendezvous and
    the process group, where a rank waits until every rank has come."""

    rank: int
    pid: int
    phase: str
    time: float


@dataclass(frozen=True)
class WorkerStarted:
    """A worker process is up and its process group is initialised."""

    rank: int
    local_rank: int
    pid: int
    device: str
    time: float


@dataclass(frozen=True)
class Output:
    """One line (ending in a newline) or the unterminated tail of a rank's stdout/stderr."""

    rank: int
    stream: str  # "stdout" | "stderr"
    text: str
    time: float


@dataclass(frozen=True)
class ProgressUpdate:
    """State of one progress bar of one rank (coalesced in the worker: ~10/s per bar).

    ``bar_id`` is unique per rank; ``closed`` marks the bar's last update.
    """

    rank: int
    bar_id: int
    desc: str
    n: float
    total: float | None
    unit: str = "it"
    rate: float | None = None
    elapsed: float = 0.0
    closed: bool = False
    disabled: bool = False
    postfix: str = ""
    level: int = 0  # nesting depth: 0 for the outermost open bar of the rank
    time: float = 0.0


@dataclass(frozen=True)
class BarrierEnter:
    """A rank entered a process-control barrier (``wait_for_everyone`` and friends).

    ``index`` counts the barriers this rank entered (0, 1, 2...): ranks with the same
    index are in the same barrier when the program is correct. ``location`` is
    ``"file:line"`` of the user's call site, ``kind`` the API that was called.
    """

    rank: int
    index: int
    location: str
    kind: str
    time: float


@dataclass(frozen=True)
class BarrierExit:
    rank: int
    index: int
    location: str
    time: float


@dataclass(frozen=True)
class WorkerFinished:
    """The rank's function returned (its result travels separately).

    ``barriers``: how many process-control barriers it entered (-1: unknown). A rank
    still waiting in barrier ``index >= barriers`` waits for a rank that will never come.
    """

    rank: int
    time: float
    barriers: int = -1


@dataclass(frozen=True)
class WorkerFailed:
    """The rank's function raised; ``collateral`` when it looks like fallout of another
    rank's failure (e.g. gloo "Connection closed by peer")."""

    rank: int
    exc_type: str
    message: str
    traceback: str
    collateral: bool
    time: float


@dataclass(frozen=True)
class WorkerExited:
    """A worker process ended without reporting a result or an exception (an exit code or
    a signal). The exception the user then catches is :class:`errors.WorkerDied`."""

    rank: int
    pid: int
    exitcode: int | None
    signal_name: str | None
    time: float
    #: what happened when there is no exit status to tell (e.g. "never started: node 1
    #: (gpu-3) refused to start them: ...")
    note: str = ""


@dataclass(frozen=True)
class WorkerStopped:
    """The launcher stopped this rank (because another rank failed, or on interrupt)."""

    rank: int
    reason: str
    time: float


@dataclass(frozen=True)
class MetricsLogged:
    """Values a rank logged at one step (``accelerator.log`` / ``notebook_launcher.log``):
    ``values`` holds ``(name, float)`` pairs, in the order they were logged."""

    rank: int
    step: int
    values: tuple[tuple[str, float], ...]
    time: float


@dataclass(frozen=True)
class LaunchFinished:
    ok: bool
    summary: str
    root_cause_rank: int | None
    wall_time: float
    time: float
    failed_ranks: tuple[int, ...] = field(default=())
    #: how many times the ranks were restarted (``max_restarts``) before this end
    restarts: int = 0
    #: the user stopped the run (the interrupt button, ``cancel()``): every rank stopped,
    #: none failed
    interrupted: bool = False


@dataclass(frozen=True)
class StackFrame:
    """One Python frame of a rank's thread, as its fault handler dumped it: file, line and
    function (``source`` is the line's text, read in the kernel; empty when unknown)."""

    filename: str
    lineno: int
    function: str
    source: str = ""


@dataclass(frozen=True)
class ThreadStack:
    """One thread of a rank: ``frames`` outermost first (the order of a traceback).
    ``ident`` is the thread's id as Python prints it (``0x7f...``); ``main`` marks the
    rank's main thread, where its function or cell runs."""

    ident: str
    frames: tuple[StackFrame, ...]
    main: bool = False
    #: the dump stopped at its limit (100 frames): the outermost frames are missing
    truncated: bool = False


@dataclass(frozen=True)
class RankStacks:
    """Every Python thread of one rank (and of the Python processes it started, such as
    DataLoader workers: ``children``, pid -> threads). ``error`` says why there is nothing
    to show (the rank did not answer, had ended, or was still starting)."""

    rank: int
    pid: int
    threads: tuple[ThreadStack, ...] = ()
    children: tuple[tuple[int, tuple[ThreadStack, ...]], ...] = ()
    error: str = ""
    #: a session's rank that runs no task: it waits for the next one
    idle: bool = False


@dataclass(frozen=True)
class StacksTaken:
    """Where every rank is, taken from their stacks (``_launch.stall``).

    ``reason``: ``"stall"`` (no rank made progress for ``quiet`` seconds; taken again while
    the stall lasts), ``"interrupt"`` (where each rank was when the user interrupted) or
    ``"request"`` (``stacks()``). ``findings`` are sentences that name the odd rank(s) out
    (``rank 1 is in `loss.backward()` at Cell In[3], line 9; ...``); ``odd`` their ranks;
    ``flight`` one line per rank of the last collectives its flight recorder saw."""

    reason: str
    quiet: float
    ranks: tuple[RankStacks, ...]
    findings: tuple[str, ...]
    odd: tuple[int, ...]
    time: float
    flight: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class StallOver:
    """A rank made progress again after a stall: the stall view goes away."""

    lasted: float
    time: float


@dataclass(frozen=True)
class FollowingStopped:
    """This view stopped following its run, which goes on without it (Ctrl-C in a detached
    run's ``result()``, a session task's follow): what it shows stays, and says so."""

    time: float


Event = (
    RendezvousStarted
    | NodesWaiting
    | LaunchStarted
    | LaunchRestarting
    | WorkerPhase
    | WorkerStarted
    | Output
    | ProgressUpdate
    | BarrierEnter
    | BarrierExit
    | WorkerFinished
    | WorkerFailed
    | WorkerExited
    | WorkerStopped
    | MetricsLogged
    | StacksTaken
    | StallOver
    | LaunchFinished
    | FollowingStopped
)

__all__ = [
    "BarrierEnter",
    "BarrierExit",
    "Event",
    "FollowingStopped",
    "IMPORTING",
    "LaunchFinished",
    "LaunchRestarting",
    "LaunchStarted",
    "MetricsLogged",
    "NodesWaiting",
    "Output",
    "PHASES",
    "RUNNING_PHASES",
    "ProgressUpdate",
    "RankStacks",
    "RendezvousStarted",
    "StackFrame",
    "StacksTaken",
    "StallOver",
    "ThreadStack",
    "WorkerExited",
    "WorkerFailed",
    "WorkerFinished",
    "WorkerPhase",
    "WorkerStarted",
    "WorkerStopped",
]
