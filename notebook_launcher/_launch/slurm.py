"""Slurm behind the scheduler interface (:class:`SlurmJob`), and Slurm's commands as the
kernel uses them: submit, look, cancel. No scheduling of ours.

Slurm allocates the nodes and starts one agent per node (an ``srun`` step, one task per
node); everything else is :mod:`.remote`'s. The functions are thin wrappers around
``sbatch``, ``srun``, ``scontrol`` and ``scancel`` that turn their failures into errors that
say what to do. Every child runs in its own session: the notebook's interrupt (SIGINT to
the kernel's process group) is the kernel's to handle, and ``srun`` would take a Ctrl-C as
an order to cancel its step. This is the one module of the package that knows Slurm's
names (its variables, its states, its commands).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ClusterError, LaunchError, at_callers_line
from .scheduler import (
    JobStatus,
    Phase,
    Reason,
    Scheduler,
    agent_argv,
    jobs_dir,
    reachable_address,
    remove,
    tail,
)

if TYPE_CHECKING:
    from .remote import AgentHub

#: States in which a job will never run (again).
ENDED = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "SPECIAL_EXIT",
        "TIMEOUT",
    }
)

#: What a state means, for the messages.
MEANING = {
    "TIMEOUT": "it reached its time limit",
    "CANCELLED": "it was cancelled (scancel)",
    "NODE_FAIL": "one of its nodes failed",
    "PREEMPTED": "it was preempted by a job of higher priority",
    "OUT_OF_MEMORY": "it ran out of memory",
    "BOOT_FAIL": "its nodes failed to boot",
    "DEADLINE": "it reached its deadline",
    "FAILED": "its batch script failed",
    "COMPLETED": "its batch script ended",
}


#: Pending reasons no wait resolves: the job asks what its partition, account or QOS never
#: grants (``squeue -o %r``), with what to change.
NEVER = {
    "PartitionTimeLimit": "ask for less time (time=...), or another partition",
    "BadConstraints": "constraint=... matches no node's features (`sinfo -o '%N %f'` lists them)",
    "InvalidAccount": "account=... must name an account you may use (`sacctmgr show assoc "
    "user=$USER`)",
    "InvalidQOS": "qos=... must name a QOS you may use (`sacctmgr show assoc user=$USER`)",
    "DependencyNeverSatisfied": "a dependency in sbatch_options can never be satisfied",
    "QOSMaxNodePerJobLimit": "your QOS allows fewer nodes per job: ask for fewer nodes",
    "QOSMaxCpuPerJobLimit": "your QOS allows fewer CPUs per job: ask for fewer",
    "QOSMaxGRESPerJob": "your QOS allows fewer GPUs per job: ask for fewer",
    "QOSMaxWallDurationPerJobLimit": "your QOS allows less time per job: ask for less time",
    "AssocMaxNodesPerJobLimit": "your account allows fewer nodes per job: ask for fewer nodes",
    "AssocMaxCpuPerJobLimit": "your account allows fewer CPUs per job: ask for fewer",
    "AssocMaxWallDurationPerJobLimit": "your account allows less time per job: ask for less",
}
#: Pending reasons that mean "never" when the job asks more nodes than its partition has
#: (else: some of its nodes are down or drained, and may come back).
PARTITION_LIMITS = frozenset({"PartitionConfig", "PartitionNodeLimit"})


class SlurmError(LaunchError):
    """A Slurm command failed, or Slurm is not there."""


@dataclass(frozen=True)
class JobState:
    """What ``scontrol show job`` says of a job (``state`` is ``"GONE"`` once Slurm forgot
    it)."""

    job_id: str
    state: str
    reason: str = ""
    nodes: str = ""
    time_limit: str = ""
    exit_code: str = ""
    partition: str = ""
    num_nodes: str = ""  # "5-5": the nodes the job asks for

    @property
    def ended(self) -> bool:
        return self.state in ENDED or self.state == "GONE"

    def brief(self) -> str:
        """``PENDING (Resources)``: the state, and its reason when Slurm gives one."""
        if self.reason and self.reason not in ("None", "(null)"):
            return f"{self.state} ({self.reason})"
        return self.state

    def describe(self) -> str:
        """``Slurm job 12: PENDING (Resources)``; an ended job with what that means."""
        text = f"Slurm job {self.job_id}: {self.brief()}"
        meaning = MEANING.get(self.state)
        if meaning:
            text += f": {meaning}"
            if self.state == "TIMEOUT" and self.time_limit:
                text += f" ({self.time_limit})"
        return text


def command(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SlurmError(
            f"`{name}` is not on PATH: this kernel cannot talk to Slurm. Run it on a machine "
            "of the cluster (a login node, or inside an allocation), or set PATH/SLURM_CONF."
        )
    return path


def run(
    args: Sequence[str],
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    stdin: str | None = None,
) -> str:
    """Run a Slurm command (``stdin``: what it reads there); its stdout, or
    :class:`SlurmError` with what it said."""
    argv = [command(args[0]), *args[1:]]
    try:
        done = subprocess.run(
            argv,
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            **({"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}),
        )
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{shlex.join(args)}` did not answer within {timeout:g} s") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()
        raise SlurmError(f"`{shlex.join(args)}` failed (exit {done.returncode}): {said}")
    return done.stdout


def submit(script: str) -> str:
    """``sbatch`` the script at ``script``; the job id."""
    out = run(["sbatch", "--parsable", script]).strip()
    return out.split(";", 1)[0]


def submit_text(text: str) -> str:
    """``sbatch`` the script ``text``, given on its stdin (not read from a file); the job
    id."""
    out = run(["sbatch", "--parsable"], stdin=text).strip()
    return out.split(";", 1)[0]


def state(job_id: str) -> JobState:
    try:
        out = run(["scontrol", "show", "job", "--oneliner", job_id], timeout=30.0)
    except SlurmError as exc:
        if "Invalid job id" in str(exc):
            return JobState(job_id, "GONE")
        raise
    fields = dict(
        item.split("=", 1) for item in shlex.split(out.strip().splitlines()[0]) if "=" in item
    )
    return JobState(
        job_id,
        fields.get("JobState", "UNKNOWN"),
        fields.get("Reason", ""),
        fields.get("NodeList", ""),
        fields.get("TimeLimit", ""),
        fields.get("ExitCode", ""),
        fields.get("Partition", ""),
        fields.get("NumNodes", ""),
    )


def never_starts(job: JobState) -> str | None:
    """Why a pending ``job`` can never start, and what to ask for instead; None when it
    may start yet (waiting for resources, priority, nodes that are down...)."""
    if job.state != "PENDING":
        return None
    if job.reason in NEVER:
        return NEVER[job.reason]
    if job.reason not in PARTITION_LIMITS or not job.partition:
        return None
    try:
        asked = int(job.num_nodes.split("-")[0])
        out = run(["scontrol", "show", "partition", "--oneliner", job.partition], timeout=30.0)
    except (ValueError, SlurmError):
        return None
    fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
    limits = []
    for key in ("TotalNodes", "MaxNodes"):
        value = fields.get(key, "")
        if value.isdigit():
            limits.append((int(value), key))
    if not limits:
        return None
    most, key = min(limits)
    if asked <= most:
        return None
    has = f"has {most} node(s)" if key == "TotalNodes" else f"allows {most} node(s) per job"
    return (
        f"it asks for {asked} nodes, and partition {job.partition} {has}: ask for at most "
        f"{most} (nodes={most}), or another partition (partition=...; `sinfo -s` lists them)"
    )


def unhealthy(nodelist: str) -> str:
    """The nodes of ``nodelist`` that Slurm holds for down, failing or not responding, with
    why: ``"n2 (Not responding)"``; "" when all are well (or Slurm cannot say)."""
    if not nodelist:
        return ""
    try:
        out = run(
            [
                "sinfo",
                "-h",
                "-N",
                "-n",
                nodelist,
                "-t",
                "down,drain,fail,no_respond",
                "-o",
                "%N|%E",
            ],
            timeout=30.0,
        )
    except SlurmError:
        return ""
    found = []
    for line in sorted(set(out.splitlines())):
        name, _, why = line.partition("|")
        if name.strip():
            found.append(
                f"{name.strip()} ({why.strip()})"
                if why.strip() not in ("", "none")
                else name.strip()
            )
    return ", ".join(found)


def cancel(job_id: str) -> None:
    try:
        run(["scancel", job_id], timeout=30.0)
    except SlurmError:
        pass  # gone already, or Slurm unreachable: nothing more we can do here


def allocation() -> tuple[str, int] | None:
    """``(job id, node count)`` of the allocation this kernel runs in (started by
    ``salloc``/``sbatch``), or None."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or "1"
    try:
        return job, int(nodes)
    except ValueError:
        return job, 1


def controller_host() -> str | None:
    """The address of ``slurmctld`` (the first ``SlurmctldHost``), from ``scontrol``."""
    try:
        out = run(["scontrol", "show", "config"], timeout=30.0)
    except SlurmError:
        return None
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip().startswith("SlurmctldHost"):
            value = value.strip()  # "host(addr)" or "host"
            if "(" in value:
                return value[value.index("(") + 1 : value.index(")")]
            return value or None
    return None


def check_option(what: str, value: str) -> str:
    """``value`` of the option ``what``, refused (``ValueError``) when it holds a control
    character: a newline would end its ``#SBATCH`` line, and the rest of it would run as
    shell on the node."""
    bad = next((c for c in value if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise at_callers_line(
            ValueError(
                f"{what}={value!r} holds a control character ({bad!r}): a Slurm option is "
                "one line of the batch script, and a newline there would run the rest as "
                "shell on the node. Pass the value on one line, without control characters "
                "(set-up commands go in setup=[...])."
            )
        )
    return value


def sbatch_quote(option: str) -> str:
    """``option`` as one argument of an ``#SBATCH`` line: sbatch splits those lines at
    whitespace, and reads double quotes (and backslash escapes within them) as a shell
    would; a value with a space (``--job-name=my job``) is quoted."""
    if option and not any(c.isspace() or c in "\\\"'" for c in option):
        return option
    return '"' + option.replace("\\", "\\\\").replace('"', '\\"') + '"'


def batch_script(
    options: Sequence[str],
    setup: Sequence[str],
    agent: Sequence[str],
    output: str,
    supervisor: Sequence[str] = (),
) -> str:
    """The batch script: the ``#SBATCH`` options (quoted; see :func:`sbatch_quote`), the
    user's set-up lines, then one agent per node as one ``srun`` step -- or, with
    ``supervisor``, that command (a detached run's supervisor, which starts the agents as
    a step of this job itself)."""
    for option in (*options, output):
        check_option("an sbatch option", option)
    lines = ["#!/bin/bash", *(f"#SBATCH {sbatch_quote(o)}" for o in options)]
    lines.append(f"#SBATCH {sbatch_quote(f'--output={output}')}")
    if supervisor:
        what, command = "a detached run's supervisor; it runs the agents", shlex.join(supervisor)
    else:
        what = "one agent per node; the kernel drives the ranks"
        command = "srun --ntasks-per-node=1 --kill-on-bad-exit=0 " + shlex.join(agent)
    lines += [f"# notebook_launcher: {what}", *setup, f"exec {command}"]
    return "\n".join(lines) + "\n"


# --- the scheduler --------------------------------------------------------------------------

#: Seconds between two looks at the job while the kernel waits for it.
POLL = 1.0
#: Seconds an ending job (COMPLETING) is given to say how it ended (CANCELLED, TIMEOUT...).
COMPLETING_WAIT = 8.0
#: What an agent that gets SIGTERM in a Slurm job says (its ``--on-sigterm``): the job is
#: ending, every step of it signalled at about the same time
ENDING = "Slurm is ending the job (the time limit, a scancel, or a node failure)"
#: Slurm's ended states -> the reason the code decides on
REASONS = {
    "TIMEOUT": Reason.TIME_LIMIT,
    "DEADLINE": Reason.TIME_LIMIT,
    "CANCELLED": Reason.CANCELLED,
    "NODE_FAIL": Reason.NODE_LOST,
    "BOOT_FAIL": Reason.NODE_LOST,
    "PREEMPTED": Reason.PREEMPTED,
    "OUT_OF_MEMORY": Reason.OUT_OF_MEMORY,
    "FAILED": Reason.FAILED,
    "SPECIAL_EXIT": Reason.FAILED,
    "REVOKED": Reason.CANCELLED,
    "COMPLETED": Reason.COMPLETED,
    "GONE": Reason.COMPLETED,
}


class SlurmJob(Scheduler):
    """A Slurm job whose ``srun`` step runs one agent per node (``SlurmCluster``'s
    scheduler). ``options``: the ``sbatch`` options, ``--job-name=...`` first; ``setup``:
    shell lines before the agents start; ``python``: the interpreter on the nodes. Inside an
    allocation (``allocation``: None decides by ``SLURM_JOB_ID``, True requires it, False
    always submits) the agents are an ``srun`` step of it and nothing is submitted."""

    environment = "SLURM_"
    FRESH: ClassVar[dict[str, Any]] = {
        "job_id": None, "_step": None, "_dir": None, "_output": None, "_state": None,
        "_next_look": 0.0,
    }  # fmt: skip

    def __init__(
        self,
        nodes: int = 1,
        gpus_per_node: int = 0,
        options: Sequence[str] = (),
        setup: Sequence[str] = (),
        python: str | None = None,
        allocation: bool | None = None,
        job_dir: str | None = None,
    ) -> None:
        import sys

        super().__init__(nodes, gpus_per_node)
        self.options = list(options)
        self.setup = list(setup)
        self.python = python or sys.executable
        self.allocation = allocation
        self.job_dir = job_dir
        self.job_id: str | None = None
        self._step: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self._output: str | None = None
        self._state: JobState | None = None
        self._next_look = 0.0

    # -- the agents ------------------------------------------------------------------------------

    def uses_allocation(self) -> tuple[str, int] | None:
        """``(job, nodes)`` of the allocation this kernel runs in when the agents are to be a
        step of it; None when a job is to be submitted."""
        held = allocation()
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
        if count < self.nodes:
            if self.allocation:
                raise ClusterError(
                    f"this kernel's allocation (Slurm job {job}) has {count} node(s), "
                    f"fewer than nodes={self.nodes}"
                )
            return None  # too small to use: submit a job of its own
        return held

    def submit(self, hub: AgentHub) -> None:
        self._dir = jobs_dir(self.job_dir, hub.job)
        self._output = os.path.join(self._dir, "agents.out")
        # each agent reads what Slurm set on its node (not a shell: the agent expands them)
        agent = agent_argv(
            hub,
            ("--node", "$SLURM_NODEID", "--label", "node=$SLURMD_NODENAME",
             "--label", "job=$SLURM_JOB_ID", "--on-sigterm", ENDING),
            self.python,
        )  # fmt: skip
        held = self.uses_allocation()
        if held is not None:
            self.job_id = held[0]
            argv = [
                command("srun"), "--overlap", f"--nodes={self.nodes}", f"--ntasks={self.nodes}",
                "--ntasks-per-node=1", "--kill-on-bad-exit=0",
                f"--job-name={self.options[0].split('=', 1)[1]}", *agent,
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
            return
        secret = hub.write_secret(os.path.join(self._dir, "secret"))
        script = os.path.join(self._dir, "job.sh")
        text = batch_script(
            self.options,
            self.setup,
            [*agent, "--secret-file", secret],
            os.path.join(self._dir, "slurm-%j.out"),
        )
        with open(script, "w") as f:
            f.write(text)
        self.job_id = submit(script)
        self._output = os.path.join(self._dir, f"slurm-{self.job_id}.out")

    def address(self) -> str:
        return reachable_address(controller_host())

    def joined(self) -> None:
        if self._dir is not None:
            remove(os.path.join(self._dir, "secret"))

    # -- where it stands ---------------------------------------------------------------------------

    def status(self, settled: bool = False) -> JobStatus:
        if self._step is not None and settled:
            return JobStatus(Phase.RUNNING)  # (a step: the allocation is not ours to explain)
        if self._step is not None:
            code = self._step.poll()
            if code is not None:
                return self._ended(f"the srun step ended (exit {code})", Reason.FAILED)
            return JobStatus(Phase.RUNNING, brief="srun step started", log=self._output or "")
        if self.job_id is None:
            return JobStatus(Phase.PENDING, Reason.WAITING, brief="submitted")
        if settled:
            return self._settled()
        now = time.monotonic()
        if self._state is None or now >= self._next_look:
            self._next_look = now + POLL
            self._state = state(self.job_id)
        job = self._state
        if job.ended:
            return self._ended(job.describe(), REASONS.get(job.state, Reason.FAILED))
        never = never_starts(job)
        if never is not None:  # waiting would be forever: say why
            return JobStatus(
                Phase.PENDING, Reason.IMPOSSIBLE, job.describe(), job.brief(), fix=never
            )
        if job.state == "RUNNING":
            return JobStatus(
                Phase.RUNNING, text=job.describe(), brief=job.brief(), log=self._output or ""
            )
        if job.state == "COMPLETING":
            return JobStatus(Phase.ENDING, text=job.describe(), brief=job.brief())
        return JobStatus(Phase.PENDING, Reason.WAITING, job.describe(), job.brief())

    def _ended(self, what: str, reason: Reason) -> JobStatus:
        return JobStatus(Phase.ENDED, reason, what, log=self._output or "")

    def _settled(self) -> JobStatus:
        """``Slurm job 12: CANCELLED: it was cancelled (scancel)``. A job that is ending
        (COMPLETING) is given a few seconds to say how it ended; a node failure names the
        nodes Slurm holds down."""
        assert self.job_id is not None
        deadline = time.monotonic() + COMPLETING_WAIT
        try:
            job = state(self.job_id)
            while job.state == "COMPLETING" and time.monotonic() < deadline:
                time.sleep(0.2)
                job = state(self.job_id)
        except SlurmError:
            return JobStatus(Phase.RUNNING, log=self._output or "")
        text = job.describe()
        if job.state == "NODE_FAIL" or job.reason in ("NodeDown", "NodeFail"):
            bad = unhealthy(job.nodes)
            if bad:
                text += f"; Slurm holds these nodes down: {bad}"
        log = self._output or ""
        if job.ended:
            return JobStatus(Phase.ENDED, REASONS.get(job.state, Reason.FAILED), text, log=log)
        phase = Phase.PENDING if job.state == "PENDING" else Phase.RUNNING
        return JobStatus(phase, text=text, brief=job.brief(), log=log)

    def describe(self) -> str:
        where = f"Slurm job {self.job_id}" if self.job_id else "a Slurm job"
        if self._step is not None:
            where = f"an srun step of Slurm job {self.job_id}"
        return f"{where}, {self.nodes} node(s)"

    # -- the end -----------------------------------------------------------------------------------

    def cancel(self, now: bool = False) -> None:
        """The agents were told to leave: the step (or the job) ends by itself; make sure."""
        step, self._step = self._step, None
        if step is not None:
            if now:
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
        elif self.job_id is not None and now:
            cancel(self.job_id)
        elif self.job_id is not None:
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:
                try:
                    if state(self.job_id).ended:
                        break
                except SlurmError:
                    break
                time.sleep(0.2)
            else:
                cancel(self.job_id)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # -- a detached run's supervisor in the job ---------------------------------------------------

    def can_host_supervisor(self) -> bool:
        return self.uses_allocation() is None

    def submit_supervisor(self, argv: Sequence[str], folder: str, env: Mapping[str, str]) -> bool:
        """A job whose batch script is the supervisor; the script as submitted goes to
        sbatch on its stdin, ``env`` (the run's key) in it: never in a file."""
        self._output = os.path.join(folder, "slurm-%j.out")
        text = batch_script(self.options, self.setup, (), self._output, supervisor=argv)
        fd = os.open(
            os.path.join(folder, "job.sh"), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
            0o600,
        )  # fmt: skip
        with os.fdopen(fd, "w") as f:
            f.write(text)
        head, run = text.rsplit("\nexec ", 1)
        exports = "".join(f"\nexport {k}={shlex.quote(v)}" for k, v in env.items())
        self.job_id = submit_text(f"{head}{exports}\nexec {run}")
        self._output = self._output.replace("%j", self.job_id)
        return True

    @classmethod
    def here(cls) -> SlurmJob | None:
        held = allocation()
        if held is None:
            return None
        job = cls(held[1])
        job.job_id = held[0]
        return job

    def terminated(self) -> str:
        return (
            f"Slurm ended job {self.job_id} (scancel, or its time limit: SIGTERM to the run's "
            "supervisor)"
        )

    def dump(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "job_id": self.job_id, "output": self._output}

    @classmethod
    def load(cls, data: Mapping[str, Any]) -> SlurmJob:
        job = cls(int(data.get("nodes", 1)))
        job.job_id = data.get("job_id")
        job._output = data.get("output")
        return job


__all__ = [
    "ENDED",
    "NEVER",
    "JobState",
    "SlurmError",
    "SlurmJob",
    "allocation",
    "batch_script",
    "cancel",
    "check_option",
    "controller_host",
    "never_starts",
    "unhealthy",
    "run",
    "sbatch_quote",
    "state",
    "submit",
    "submit_text",
    "tail",
]
