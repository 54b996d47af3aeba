"""Slurm's commands, as the kernel uses them: submit, look, cancel. No scheduling of ours.

Slurm allocates the nodes and starts one agent per node (an ``srun`` step, one task per
node); everything else is :mod:`.remote`'s. These are thin wrappers around ``sbatch``,
``srun``, ``scontrol`` and ``scancel`` that turn their failures into errors that say what
to do. Every child runs in its own session: the notebook's interrupt (SIGINT to the
kernel's process group) is the kernel's to handle, and ``srun`` would take a Ctrl-C as an
order to cancel its step.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import LaunchError, at_callers_line

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


def reachable_address(towards: str | None) -> str:
    """This machine's address on the network that reaches ``towards`` (the controller:
    the nodes are on its network); the host name's address without it."""
    if towards:
        try:
            family = socket.AF_INET6 if ":" in towards else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((towards, 6817))  # no packet is sent: routing only
                address: str = probe.getsockname()[0]
                return address
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


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


def tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return ""


__all__ = [
    "ENDED",
    "NEVER",
    "JobState",
    "SlurmError",
    "allocation",
    "batch_script",
    "cancel",
    "check_option",
    "controller_host",
    "never_starts",
    "unhealthy",
    "reachable_address",
    "run",
    "sbatch_quote",
    "state",
    "submit",
    "submit_text",
    "tail",
]
