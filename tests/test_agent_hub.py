"""The kernel's hub and real agent processes on this machine (no Slurm): who gets in.

Every attack the issue lists is made for real against a hub whose job then runs: a raw
connect that says nothing, garbage bytes, a wrong secret, a replayed handshake, an agent
of another job, a second agent claiming a taken node. Each is refused and logged, and the
two real agents then run a 4-rank launch across their "nodes". An agent also refuses a
kernel that cannot prove the secret, and a kernel that goes away takes its agents and their
ranks with it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from notebook_launcher._launch.record import RunRecord
from notebook_launcher._launch.remote import AgentHub, RemoteGroup
from notebook_launcher._serialization import dumps
from notebook_launcher._spec import WorkerSpec
from notebook_launcher._wire import agent as wire

from .helpers import agent_processes, kernel_env, wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def agent_argv(
    hub: AgentHub, secret_file: str, node: int | None, job: str | None = None
) -> list[str]:
    argv = [sys.executable, "-m", "notebook_launcher", "agent", "--connect", hub.address]
    argv += ["--job", job or hub.job, "--secret-file", secret_file]
    return argv + (["--node", str(node)] if node is not None else [])


_started: list[subprocess.Popen[str]] = []


def start_agent(argv: list[str], **env: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        argv,
        env={**kernel_env(), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _started.append(proc)
    return proc


@pytest.fixture(autouse=True)
def _agents_reaped() -> Iterator[None]:
    """Whatever a test did, the agents it started are gone after it (killed if need be)."""
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[AgentHub]:
    hub = AgentHub("127.0.0.1", handshake_timeout=1.0)
    yield hub
    hub.close()


def specs_for(hub_store: Any, attempt: int, per_node: int = 2, nodes: int = 2) -> list[WorkerSpec]:
    world = per_node * nodes
    return [
        WorkerSpec(
            rank=r, local_rank=r % per_node, world_size=world, local_world_size=per_node,
            node_rank=r // per_node, master_addr="127.0.0.1", master_port=hub_store.port,
            backend="gloo", store_prefix=f"t/a{attempt}/pg", num_nodes=nodes,
        )
        for r in range(world)
    ]  # fmt: skip


def store() -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )


def where(x: int) -> tuple[int, int, str]:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank(), int(t.item()) * x, os.environ["LOCAL_RANK"]


def run_group(nodes: list[Any], fn: Any, *args: Any, attempt: int = 0) -> RunRecord:
    server = store()
    record = RunRecord([0, 1, 2, 3])
    group = RemoteGroup(
        nodes, specs_for(server, attempt), dumps((fn, args, {})), record.on_event, record.on_exit
    )
    group.start()
    deadline = time.monotonic() + 60
    while not group.finished and time.monotonic() < deadline:
        group.pump(0.5)
    group.close()
    return record


def _legit_answer(hub: AgentHub, secret: bytes) -> bytes:
    """A real agent's handshake answer, recorded (then its connection is dropped)."""
    with socket.create_connection(("127.0.0.1", hub.port)) as sock:
        reader = wire.PlainReader()
        hello = None
        while hello is None:
            hello = reader.feed(sock.recv(4096))
        reply, _, _ = wire.answer(secret, hello, {"job": hub.job, "node": 1})
        return reply


def test_attacks_are_refused_and_logged_and_the_job_runs(
    hub: AgentHub, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="notebook_launcher.cluster")
    secret_file = hub.write_secret(str(tmp_path / "secret"))
    assert oct(os.stat(secret_file).st_mode & 0o777) == "0o600"
    secret = bytes.fromhex(Path(secret_file).read_text())
    wrong = tmp_path / "wrong"
    wrong.write_text(os.urandom(32).hex())
    joined: list[Any] = []
    serving = threading.Thread(target=lambda: joined.extend(hub.wait_for(2, 90)))
    serving.start()  # the hub serves everything below, as it does while a launch waits
    try:
        silent = socket.create_connection(("127.0.0.1", hub.port))  # says nothing
        garbage = socket.create_connection(("127.0.0.1", hub.port))
        garbage.sendall(b"GET / HTTP/1.1\r\nHost: kernel\r\n\r\n")
        recorded = _legit_answer(hub, secret)  # a real answer, for another connection
        replayed = socket.create_connection(("127.0.0.1", hub.port))
        replayed.recv(4096)
        replayed.sendall(recorded)
        intruders = [
            start_agent(agent_argv(hub, str(wrong), 0)),  # the wrong secret
            start_agent(agent_argv(hub, secret_file, 1, job="another-job")),
        ]
        for proc in intruders:
            proc.wait(60)
        first = start_agent(agent_argv(hub, secret_file, 0))
        wait_until(lambda: 0 in hub.nodes, 60, "node 0 joins")
        usurper = start_agent(agent_argv(hub, secret_file, 0))  # node 0 is taken
        usurper.wait(60)
        second = start_agent(agent_argv(hub, secret_file, 1))
    finally:
        serving.join(90)
    assert len(joined) == 2
    for proc in (*intruders, usurper):
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 2, out
        assert "cannot join the kernel" in out and "refused this agent" in out, out
    refused = "\n".join(hub.refused)
    for why in (
        "no handshake within 1 s",  # the silent one
        "garbage",
        "wrong secret (or a replayed handshake)",
        "an agent of another job",
        "a second agent claiming node 0",
    ):
        assert why in refused, (why, refused)
    assert refused.count("wrong secret") >= 2  # the wrong secret's agent, and the replay
    assert len(caplog.records) == len(hub.refused)
    for sock in (silent, garbage, replayed):
        with sock:
            assert b"NO" in _until_closed(sock)  # told why, then closed
    record = run_group(joined, where, 10)
    assert record.verdict().ok
    assert sorted(record.results.values()) == [
        (0, 40, "0"),
        (1, 40, "1"),
        (2, 40, "0"),
        (3, 40, "1"),
    ]
    hub.close()
    for proc in (first, second):
        proc.communicate(timeout=30)
        assert proc.returncode == 0
    assert agent_processes(hub.job) == []


def test_an_agent_refuses_a_kernel_that_cannot_prove_the_secret(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text(os.urandom(32).hex())
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        argv = [
            sys.executable,
            "-m",
            "notebook_launcher",
            "agent",
            "--connect",
            f"127.0.0.1:{port}",
        ]
        agent = start_agent(argv + ["--job", "j", "--secret-file", str(secret_file)])
        conn, _ = server.accept()
        with conn:
            hello, _ = wire.challenge()
            conn.sendall(hello)
            conn.recv(4096)  # the agent's answer: this impostor cannot check it
            conn.sendall(wire.frame(b"OK" + os.urandom(32)))  # and cannot prove itself
            out, _ = agent.communicate(timeout=60)
    assert agent.returncode == 2
    assert "the kernel did not prove it holds the secret" in out, out


def sleeper() -> None:
    time.sleep(600)


def test_a_killed_agent_is_its_ranks_death_naming_the_node(hub: AgentHub, tmp_path: Path) -> None:
    secret_file = hub.write_secret(str(tmp_path / "secret"))
    agents = [start_agent(agent_argv(hub, secret_file, i)) for i in range(2)]
    nodes = hub.wait_for(2, 60)
    server = store()
    record = RunRecord([0, 1, 2, 3])
    group = RemoteGroup(
        nodes, specs_for(server, 0), dumps((sleeper, (), {})), record.on_event, record.on_exit
    )
    group.start()
    wait_until(
        lambda: (group.pump(0.2), all(p.stage == "running" for p in group.procs))[1],
        60,
        "ranks run",
    )
    rank_pids = [p.pid for p in group.procs if p.node.index == 1]
    agents[1].kill()
    wait_until(lambda: (group.pump(0.2), record.failed)[1], 30, "the death is noticed")
    group.terminate()
    while not group.finished:
        group.pump(0.2)
    group.close()
    verdict = record.verdict()
    assert verdict.kind == "died" and verdict.cause is not None
    assert verdict.cause.rank in (2, 3)
    assert "node 1 (" in verdict.cause.context and "agent is gone" in verdict.cause.context
    for pid in rank_pids:
        wait_until(lambda pid=pid: not _alive(pid), 10, f"rank pid {pid} of the killed agent ends")
    hub.close()
    agents[0].communicate(timeout=30)
    agents[1].communicate(timeout=30)
    assert agent_processes(hub.job) == []


KERNEL = """
import sys, time
from notebook_launcher._launch.remote import AgentHub, RemoteGroup
from notebook_launcher._serialization import dumps
sys.path.insert(0, {tests!r})
from tests.test_agent_hub import specs_for, store, sleeper, agent_argv, start_agent

hub = AgentHub("127.0.0.1")
secret = hub.write_secret({secret!r})
agents = [start_agent(agent_argv(hub, secret, i)) for i in range(2)]
nodes = hub.wait_for(2, 60)
server = store()
group = RemoteGroup(nodes, specs_for(server, 0), dumps((sleeper, (), {{}})), lambda e: None, lambda p: None)
group.start()
while not all(p.stage == "running" for p in group.procs):
    group.pump(0.2)
print("JOB", hub.job, flush=True)
time.sleep(600)
"""


def test_a_killed_kernel_takes_its_agents_and_ranks_along(tmp_path: Path) -> None:
    code = KERNEL.format(tests=str(Path(__file__).parents[1]), secret=str(tmp_path / "secret"))
    kernel = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=kernel_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = kernel.stdout.readline() if kernel.stdout else ""
        assert line.startswith("JOB "), line
        job = line.split()[1]
        assert len(agent_processes(job)) == 2 + 4  # two agents, four ranks (forked from them)
        kernel.send_signal(signal.SIGKILL)
        kernel.wait(10)
        t0 = time.monotonic()
        wait_until(lambda: agent_processes(job) == [], 15, "the agents and ranks end")
        assert time.monotonic() - t0 < 10
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait()
        if kernel.stdout:
            kernel.stdout.close()


def _until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_an_agent_cluster_runs_on_agents_started_by_hand(tmp_path: Path) -> None:
    """Without Slurm: the agents are started by whatever starts processes on the nodes (here,
    this test, with the command the cluster gives), and launches and sessions run on them."""
    import shlex

    from notebook_launcher import AgentCluster, notebook_launcher, start
    from notebook_launcher._events import NodesWaiting

    cluster = AgentCluster(nodes=2, host="127.0.0.1", secret_file=str(tmp_path / "job.secret"))
    said: list[str] = []

    def report(event: Any) -> None:
        if isinstance(event, NodesWaiting) and not said:
            said.append(event.state)
            for node in range(2):
                start_agent(shlex.split(cluster.agent_command(node)))

    try:
        cluster.start(report=report)
        assert said and "start an agent on each node: " in said[0]
        assert "--secret-file" in said[0] and cluster.hub is not None
        secret = cluster.hub.secret_env()["NOTEBOOK_LAUNCHER_AGENT_SECRET"]
        assert (
            secret not in said[0]
            and oct(os.stat(tmp_path / "job.secret").st_mode & 0o777) == "0o600"
        )
        out = notebook_launcher(where, (2,), num_processes=4, cluster=cluster, dashboard=False)
        assert sorted(out) == [(0, 8, "0"), (1, 8, "1"), (2, 8, "0"), (3, 8, "1")]
        with start(num_processes=2, cluster=cluster, dashboard=False) as session:
            assert session.run_cell("rank") == ["0", "1"]
        job = cluster.job_key
    finally:
        cluster.close()
    for proc in _started:
        proc.communicate(timeout=30)
        assert proc.returncode == 0
    assert agent_processes(job) == []


class AgentStarter:
    """A view that starts the agents whenever the cluster waits for them (what a user does
    with ``cluster.agent_command()``), as often as the cluster starts."""

    def __init__(self, cluster: Any, **env: str) -> None:
        self.cluster = cluster
        self.env = env
        self.hubs: list[str] = []
        self.agents: list[subprocess.Popen[str]] = []

    def handle(self, event: Any) -> None:
        from notebook_launcher._events import NodesWaiting

        hub = self.cluster.hub
        if isinstance(event, NodesWaiting) and hub is not None and hub.job not in self.hubs:
            import shlex

            self.hubs.append(hub.job)
            for node in range(self.cluster.num_nodes):
                argv = shlex.split(self.cluster.agent_command(node))
                self.agents.append(start_agent(argv, **self.env))

    def tick(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_an_agent_cluster_starts_again_and_a_session_restarts_on_fresh_agents(
    tmp_path: Path,
) -> None:
    """Issue 25, item 15: ``AgentCluster(secret_file=F)`` starts a second time (F is
    rewritten, not FileExistsError); a session whose agent was killed restarts at the first
    ``restart()``, on fresh agents, saying so."""
    from notebook_launcher import AgentCluster, start

    secret = tmp_path / "job.secret"
    cluster = AgentCluster(nodes=1, host="127.0.0.1", secret_file=str(secret))
    starter = AgentStarter(cluster)
    try:
        with start(num_processes=2, cluster=cluster, dashboard=starter) as session:
            assert session.run_cell("rank") == ["0", "1"]
            starter.agents[-1].kill()  # the node's agent dies, its ranks with it
            starter.agents[-1].wait()
            session.restart()  # at once (no 'lost 1 node(s)' first), with the same file
            assert len(starter.hubs) == 2 and oct(secret.stat().st_mode & 0o777) == "0o600"
            assert session.run_cell("rank") == ["0", "1"]
        job = cluster.job_key
    finally:
        cluster.close()
    for proc in _started:
        proc.communicate(timeout=30)
    assert agent_processes(job) == []


def test_a_flood_of_refused_connections_is_summed_up_not_logged_line_by_line(
    hub: AgentHub, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 25, item 15: 1,476 refused connections were 1,476 warnings printed into the
    cell; now the first ten are logged one by one, the rest summed up in one line."""
    caplog.set_level(logging.WARNING, logger="notebook_launcher.cluster")
    for _ in range(40):
        socket.create_connection(("127.0.0.1", hub.port)).close()  # connects, says nothing
        hub.serve(0.0, 1)
    deadline = time.monotonic() + 30
    while hub.refused_count < 40 and time.monotonic() < deadline:
        hub.serve(0.1, 1)
    assert hub.refused_count == 40
    hub.stop_listening()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 11, lines
    assert all("closed the connection during the handshake" in x for x in lines[:10])
    assert lines[10].startswith("refused 30 more connection(s) (40 in all; the last: 127.0.0.1:")


def test_a_node_that_cannot_hold_the_ranks_says_so_and_starts_none() -> None:
    """Issue 25, item 11, on a cluster: the kernel cannot know a node's cores and memory,
    its agent does; it refuses what it cannot hold, naming the limit, and the launch ends
    naming the node."""
    from notebook_launcher import AgentCluster, LaunchError, notebook_launcher

    cluster = AgentCluster(nodes=1, host="127.0.0.1")
    starter = AgentStarter(cluster, NOTEBOOK_LAUNCHER_MAX_PROCESSES="1")
    try:
        cluster.start(report=starter.handle)
        with pytest.raises(LaunchError) as caught:
            notebook_launcher(where, (1,), num_processes=2, cluster=cluster, dashboard=False)
        said = str(caught.value)
        assert "Node 0 (" in said, said
        job_dir = Path.home() / ".notebook_launcher" / "jobs" / cluster.job_key
        assert (job_dir / "kernel").exists()  # the secret's directory, swept if we die
        assert (
            "its ranks could not start: 2 ranks are more than this node can hold: at most 1 "
            "(NOTEBOOK_LAUNCHER_MAX_PROCESSES=1)" in said
        ), said
        job = cluster.job_key
    finally:
        cluster.close()
    assert not job_dir.exists()  # removed with the cluster
    for proc in _started:
        proc.communicate(timeout=30)
    assert agent_processes(job) == []


def sleeps(seconds: float) -> None:
    time.sleep(seconds)


def test_a_frozen_agent_is_named_and_a_cancel_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25, item 10: a node's agent frozen (SIGSTOP) with its connection up: the stall
    view said nothing, cancel() never returned, and the end said "all ranks stopped". Now
    the stall view names the node that does not answer, cancel() returns once the stop had
    its bound, and the end says the stop is not confirmed. The agent, woken, finds its
    kernel gone and ends its ranks."""
    from concurrent.futures import CancelledError

    from notebook_launcher import AgentCluster, notebook_launcher
    from notebook_launcher._events import LaunchFinished, StacksTaken, WorkerStopped
    from notebook_launcher._launch import stall

    from .helpers import Recorder

    monkeypatch.setattr(stall, "REFRESH", 1.0)  # the stall view looks again every second
    cluster = AgentCluster(nodes=1, host="127.0.0.1")
    starter = AgentStarter(cluster)
    seen = Recorder()
    try:
        cluster.start(report=starter.handle)
        agent = starter.agents[-1]
        assert cluster.hub is not None
        label = cluster.hub.nodes[0].label  # node 0 (its host)
        handle = notebook_launcher(
            sleeps, (120,), num_processes=2, cluster=cluster, dashboard=seen, block=False,
            stall_after=1.0, grace_period=0.2,
        )  # fmt: skip
        wait_until(lambda: seen.of(StacksTaken), 60, "the stall view")
        os.kill(agent.pid, signal.SIGSTOP)
        try:
            silent = f"{label}'s agent sent nothing (stopped or swapping"
            wait_until(
                lambda: any(silent in " ".join(r.findings) for r in seen.of(StacksTaken)),
                30,
                "the stall view names the node that does not answer",
            )
            began = time.monotonic()
            assert handle.cancel() is True
            assert time.monotonic() - began < 15
            with pytest.raises(CancelledError):
                handle.result(timeout=5)
        finally:
            os.kill(agent.pid, signal.SIGCONT)
        (end,) = seen.of(LaunchFinished)
        assert end.summary.startswith(
            f"interrupted: 0 of 2 ranks stopped; ranks 0 and 1: not confirmed ({label} did "
            "not answer within 5.2 s of being told to stop its ranks"
        ), end.summary
        assert all("its stop is not confirmed" in e.reason for e in seen.of(WorkerStopped))
        agent.communicate(timeout=30)  # woken: its kernel is gone, its ranks end with it
        job = cluster.job_key
    finally:
        cluster.close()
    assert agent_processes(job) == []
