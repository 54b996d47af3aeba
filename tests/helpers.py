"""Shared test helpers: a recording view, a free port, a clean environment for kernels
and subprocesses, a real ipykernel and a cell run in it."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from notebook_launcher._events import Event, Output

ROOT = Path(__file__).resolve().parents[1]

#: Kernels and workers started by tests must not inherit pytest's marker: ipykernel stops
#: capturing fd-level output when it sees it (../shared/TESTING.md, pitfall 1).
KERNEL_ENV_DROP = ("PYTEST_CURRENT_TEST",)


def kernel_env() -> dict[str, str]:
    """This process's environment, less what a kernel or a rank must not inherit."""
    return {k: v for k, v in os.environ.items() if k not in KERNEL_ENV_DROP}


def free_port() -> int:
    """A loopback TCP port free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def started_kernel(**env: str) -> Iterator[Any]:
    """A real ipykernel running this checkout (``jupyter_client``); yields its client."""
    import jupyter_client

    km, kc = jupyter_client.manager.start_new_kernel(
        kernel_name="python3",
        env={**kernel_env(), "PYTHONPATH": str(ROOT), **env},
        cwd=str(ROOT),
    )
    try:
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


class PlainKernel:
    """A plain interpreter standing for a kernel: it runs ``code`` (from this checkout's
    root, with ``env``), which prints ``ID <id>`` once it has started a detached run or
    session and then sleeps. ``id`` is that id; ``kill()`` is the kernel's SIGKILL (done on
    leaving the ``with`` too)."""

    def __init__(self, code: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], env=env, cwd=str(ROOT), stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.id = ""

    def __enter__(self) -> PlainKernel:
        try:
            assert self.proc.stdout is not None
            line = ""
            while "ID " not in line:
                line = self.proc.stdout.readline()
                assert line, "the kernel ended before it printed the id"
            self.id = line.split("ID ")[1].strip()
        except BaseException:
            self.kill()
            raise
        return self

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __exit__(self, *exc: object) -> None:
        self.kill()


class Kept:
    """A costly resource (a kernel, a session) shared by a module's tests, and replaced
    after a test that failed with it: a test that timed out may leave the kernel busy or
    wedged, and every later test of the module would time out waiting on it.

    ``make`` is a context manager factory; :func:`kept_for` is the per-test fixture body."""

    #: the child processes of every resource kept now: not left behind by the test that
    #: happens to start one (the leak check of tests/conftest.py allows them)
    children: set[int] = set()

    def __init__(self, make: Any) -> None:
        self._make = make
        self._cm: Any = None
        self._pids: set[int] = set()
        self.value: Any = None

    def get(self) -> Any:
        if self._cm is None:
            from .conftest import child_pids

            before = child_pids()
            cm = self._make()
            self.value = cm.__enter__()
            self._cm = cm
            self._pids = child_pids() - before
            Kept.children |= self._pids
        return self.value

    def drop(self) -> None:
        cm, self._cm, self.value = self._cm, None, None
        Kept.children -= self._pids
        self._pids = set()
        if cm is not None:
            cm.__exit__(None, None, None)


def kept_for(kept: Kept, request: Any) -> Iterator[Any]:
    """Yield the module's resource to one test; throw it away if that test failed."""
    yield kept.get()
    report = getattr(request.node, "rep_call", None)
    if report is None or report.failed:
        kept.drop()


def wait_until(condition: Any, timeout: float, what: str) -> None:
    """Poll ``condition()`` every 50 ms until it is true; fail naming ``what`` after
    ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting until {what}")
        time.sleep(0.05)


def agent_processes(job: str | None = None, slurm_conf: str | None = None) -> list[int]:
    """Pids of live agent processes (of ``job``; of the Slurm cluster ``slurm_conf`` names,
    so that another test process's cluster is not counted), and of the ranks they forked (a
    forked rank keeps its agent's command line); not the ``srun`` that started them."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        command = b" ".join(argv[1:4])
        ours = b"python" in os.path.basename(argv[0]) and command == b"-m notebook_launcher agent"
        if ours and (job is None or job.encode() in argv):
            if slurm_conf is not None and not _in_environ(entry, f"SLURM_CONF={slurm_conf}"):
                continue
            found.append(int(entry))
    return found


def _in_environ(pid: str, entry: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry.encode() in f.read().split(b"\0")
    except OSError:
        return False


#: What ``tests/slurm/start-cluster.sh`` runs: Debian's slurm-wlm and munge.
SLURM_TOOLS = ("slurmctld", "slurmd", "munged")


def require_system(what: str, lacking: list[str]) -> None:
    """Skip the test, naming what ``what`` lacks, where the README's test command could not
    install the system packages it needs (no root, not Debian: ``apt-get`` failed and the
    command went on). Under ``CI`` (set to anything), where every tier must run, fail."""
    import pytest

    if not lacking:
        return
    reason = f"{what} needs {'; '.join(lacking)}"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI runs every tier", pytrace=False)
    pytest.skip(f"{reason} (not installed: the test command could not install it)")


class SlurmTestCluster:
    """A real Slurm cluster on loopback for the tests (see ``tests/slurm/``)."""

    SCRIPTS = ROOT / "tests" / "slurm"

    def __init__(self, directory: Path, nodes: int) -> None:
        self.dir = directory
        self.nodes = nodes
        self.conf = str(directory / "slurm.conf")
        self._old_conf: str | None = None

    @classmethod
    def start(cls, directory: Path, nodes: int = 3) -> SlurmTestCluster:
        import shutil
        import subprocess

        missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
        lacking = [f"{tool} (apt-get install slurm-wlm munge)" for tool in missing]
        if os.geteuid() != 0:
            lacking.insert(0, "root (slurmd runs each step as its user)")
        require_system("a test Slurm cluster", lacking)
        cluster = cls(directory, nodes)
        ctld = free_port()
        base = _free_port_run(nodes)
        env = {**kernel_env(), "SLURMCTLD_PORT": str(ctld), "SLURMD_PORT_BASE": str(base)}
        done = subprocess.run(
            ["bash", str(cls.SCRIPTS / "start-cluster.sh"), str(directory), str(nodes), "2"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if done.returncode != 0:
            cluster.stop()
            raise RuntimeError(f"the test Slurm cluster did not start:\n{done.stdout}{done.stderr}")
        cluster._old_conf = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = cluster.conf
        return cluster

    def stop(self) -> None:
        import subprocess

        subprocess.run(
            ["bash", str(self.SCRIPTS / "stop-cluster.sh"), str(self.dir)],
            capture_output=True,
            timeout=60,
            check=False,
        )
        self._kill_step_daemons()
        if self._old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = self._old_conf

    def _kill_step_daemons(self) -> None:
        """The ``slurmstepd`` of a step still running when the daemons were stopped (after
        a failed test) outlives them, waiting for its slurmd: killed too (found by its
        working directory, under this cluster's)."""
        import signal

        root = os.path.realpath(self.dir)
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/comm") as f:
                    if f.read().strip() != "slurmstepd":
                        continue
                cwd = os.readlink(f"/proc/{name}/cwd").removesuffix(" (deleted)")
                if cwd == root or cwd.startswith(root + os.sep):
                    os.kill(int(name), signal.SIGKILL)
            except OSError:
                pass

    def jobs(self) -> list[str]:
        """The ids of the jobs Slurm still holds (pending, running or completing)."""
        import subprocess

        out = subprocess.run(
            ["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        return [line.split()[0] for line in out.splitlines() if line.strip()]

    def restart_node(self, name: str) -> None:
        """Start node ``name``'s slurmd again (after a test killed it), and wait until Slurm
        takes the node back (idle)."""
        import subprocess
        import time

        subprocess.run(["slurmd", "-f", self.conf, "-N", name], check=True, timeout=60)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-n", name, "-o", "%T"],
                capture_output=True, text=True, timeout=30, check=False,
            ).stdout  # fmt: skip
            if out.strip() in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"node {name} did not come back")

    def log(self, name: str = "slurmctld") -> str:
        return (self.dir / "log" / f"{name}.log").read_text(errors="replace")


def _free_port_run(count: int) -> int:
    """A base port such that base+1 .. base+count are free now."""
    import random

    for _ in range(100):
        base = random.randrange(20000, 60000 - count)
        ok = True
        for port in range(base + 1, base + count + 1):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(f"no run of {count} free ports")


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_cell(kc: Any, code: str, timeout: float = 120) -> tuple[str, dict, list[str]]:
    """Execute ``code`` (dedented) in a kernel: (its stream text, the execute_reply
    content, the error's traceback lines without colours).

    Every message read is matched to this cell's request by its parent's msg id, on iopub
    and on shell alike: the shell channel may hold replies to other requests (a kernel slow
    to answer jupyter_client's first ``kernel_info_request`` gets a second one, whose reply
    arrives after ``wait_for_ready`` returned), and taking the next reply as this cell's
    would shift every later cell by one."""
    msg_id = kc.execute(textwrap.dedent(code))
    text, error = [], []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            error = ANSI.sub("", "\n".join(msg["content"]["traceback"])).splitlines()
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    return "".join(text), shell_reply(kc, msg_id, timeout)["content"], error


def shell_reply(kc: Any, msg_id: str, timeout: float = 120) -> dict:
    """The shell channel's reply to the request ``msg_id``; replies to other requests
    (a second ``kernel_info_reply``, a cell sent without waiting) are skipped."""
    while True:
        reply = kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply


class Recorder:
    """A launcher view that keeps every event (the output path is pluggable: any object
    with the ``notebook_launcher.ui.View`` methods can be passed as ``dashboard=``)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ticks = 0
        self.closed = 0

    def handle(self, event: Event) -> None:
        self.events.append(event)

    def tick(self) -> None:
        self.ticks += 1

    def close(self) -> None:
        self.closed += 1

    def of(self, cls: type) -> list:
        return [e for e in self.events if isinstance(e, cls)]

    def lines(self, rank: int, stream: str = "stdout") -> list[str]:
        return [e.text for e in self.of(Output) if e.rank == rank and e.stream == stream]
