"""The kernel's hub and real agent processes on this machine (no Slurm): who gets in.

Every attack the issue lists is made for real against a hub whose job then runs: a raw
connect that says nothing, garbage bytes, a wrong secret, a replayed handshake, an agent
of another job, a second agent claiming a taken node. Each is refused and logged, and the
two real agents then run a 4-rank launch across their "nodes". An agent also refuses a
kernel that cannot prove the secret, and a kernel that goes away takes its agents and their
ranks with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
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

from notebook_launcher._launch import forkserver
from notebook_launcher._launch.record import RunRecord
from notebook_launcher._launch.remote import AgentHub, RemoteGroup
from notebook_launcher._serialization import dumps
from notebook_launcher._spec import WorkerSpec
from notebook_launcher._wire import agent as wire
from notebook_launcher._wire.store import MAX_UNAUTHENTICATED

from .helpers import agent_processes, kernel_env, wait_until

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def agent_argv(
    hub: AgentHub, secret_file: str, node: int | None, job: str | None = None
) -> list[str]:
    argv = [sys.executable, "-m", "notebook_launcher", "agent", "--connect", hub.address]
    argv += ["--job", job or hub.job, "--secret-file", secret_file]
    return argv + (["--node", str(node)] if node is not None else [])


_started: list[subprocess.Popen[str]] = []


def start_agent(
    argv: list[str], env: dict[str, str] | None = None, **more: str
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        argv,
        env={**kernel_env(), **(env or {}), **more},
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
    while _proxies:
        _proxies.pop().close()
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


class ProxiedStore:
    """The ranks' store as a cluster holds it: a TCPStore on 127.0.0.1, which the agents'
    forwarders reach through the hub's proxy (``port``: the proxy's)."""

    def __init__(self, hub: AgentHub) -> None:
        from notebook_launcher.cluster import _store_server

        self.server = _store_server()
        self.proxy = hub.store_proxy(int(self.server.port))
        _proxies.append(self.proxy)

    @property
    def port(self) -> int:
        return self.proxy.port


_proxies: list[Any] = []


def which_are_imported(*names: str) -> list[bool]:
    return [name in sys.modules for name in names]


def where(x: int) -> tuple[int, int, str]:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank(), int(t.item()) * x, os.environ["LOCAL_RANK"]


def run_group(hub: AgentHub, nodes: list[Any], fn: Any, *args: Any, attempt: int = 0) -> RunRecord:
    server = ProxiedStore(hub)
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
    record = run_group(hub, joined, where, 10)
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


def environs(secret: str) -> dict[str, bool]:
    """Whether ``secret`` is in this rank's environment, as /proc shows it, and in its
    agent's (its parent)."""
    seen = {}
    for who, pid in (("rank", os.getpid()), ("agent", os.getppid())):
        with open(f"/proc/{pid}/environ", "rb") as f:
            seen[who] = secret.encode() in f.read()
    seen["os.environ"] = any(secret in value for value in os.environ.values())
    return seen


def test_a_secret_from_the_environment_reaches_no_rank(hub: AgentHub) -> None:
    """As an srun step starts it: the secret in the agent's environment, no file. The agent
    takes it and starts again without it: no rank (nor the agent) shows it in
    /proc/PID/environ, where a forked rank would keep a copy of the agent's first one."""
    secret = hub.secret_env()
    argv = [sys.executable, "-m", "notebook_launcher", "agent", "--connect", hub.address]
    agent = start_agent([*argv, "--job", hub.job, "--node", "0"], secret)
    nodes = hub.wait_for(1, 60)
    server = ProxiedStore(hub)
    record = RunRecord([0, 1])
    task = dumps((environs, (secret[wire.SECRET_ENV],), {}))
    group = RemoteGroup(nodes, specs_for(server, 0, nodes=1), task, record.on_event, record.on_exit)
    group.start()
    while not group.finished:
        group.pump(0.5)
    group.close()
    assert record.verdict().ok, record.verdict()
    clean = {"rank": False, "agent": False, "os.environ": False}
    assert list(record.results.values()) == [clean, clean]
    hub.close()
    out, _ = agent.communicate(timeout=30)
    assert agent.returncode == 0, out
    assert secret[wire.SECRET_ENV] not in out


def sleeper() -> None:
    time.sleep(600)


def test_a_killed_agent_is_its_ranks_death_naming_the_node(hub: AgentHub, tmp_path: Path) -> None:
    secret_file = hub.write_secret(str(tmp_path / "secret"))
    agents = [start_agent(agent_argv(hub, secret_file, i)) for i in range(2)]
    nodes = hub.wait_for(2, 60)
    server = ProxiedStore(hub)
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
from tests.test_agent_hub import specs_for, ProxiedStore, sleeper, agent_argv, start_agent

hub = AgentHub("127.0.0.1")
secret = hub.write_secret({secret!r})
agents = [start_agent(agent_argv(hub, secret, i)) for i in range(2)]
nodes = hub.wait_for(2, 60)
server = ProxiedStore(hub)
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


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize(("host", "elsewhere"), [("127.0.0.1", "127.0.0.2"), ("::1", "127.0.0.1")])
def test_the_ranks_store_listens_on_loopback_and_its_proxy_on_the_hubs_interface_only(
    host: str, elsewhere: str
) -> None:
    """torch's own TCPStore server binds every interface (IPv4 and IPv6): the cluster's
    listens on 127.0.0.1 only, and the proxy the nodes reach it through listens where the
    hub does, and nowhere else."""
    from notebook_launcher._wire.store import StoreProxy
    from notebook_launcher.cluster import _store_server

    server = _store_server()
    proxy = StoreProxy(host, server.port, os.urandom(32))
    try:
        assert _reachable("127.0.0.1", server.port)
        assert not _reachable("127.0.0.2", server.port) and not _reachable("::1", server.port)
        assert _reachable(host, proxy.port) and not _reachable(elsewhere, proxy.port)
    finally:
        proxy.close()
        del server


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


POISON = """
import sys
from datetime import timedelta
import torch.distributed as dist

host, port, job, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=wait))
for launch in range(1, 3):  # gloo's addresses of the next launches' ranks, as keyed by job
    for rank in range(4):
        store.set(f"{job}/l{launch}/a0/pg/0//cpu//0/{rank}", b"\\xff" * 64)
"""


def poison_the_store(
    address: tuple[str, int], job: str, wait: float = 10.0
) -> subprocess.CompletedProcess[str]:
    """Another process that reaches the ranks' store (torch's TCPStore authenticates no one)
    writes garbage where the ranks of the next launches would read their peers' addresses,
    were their keys named after the job (whose id is on every agent's command line)."""
    argv = [sys.executable, "-c", POISON, address[0], str(address[1]), job, str(wait)]
    return subprocess.run(
        argv, env=kernel_env(), capture_output=True, text=True, timeout=60, check=False
    )


def test_an_agent_cluster_runs_on_agents_started_by_hand(tmp_path: Path) -> None:
    """Without Slurm: the agents are started by whatever starts processes on the nodes (here,
    this test, with the command the cluster gives), and launches and sessions run on them
    -- even after another process wrote garbage into the ranks' store under the keys the job
    id on the agents' command lines would name: their keys begin with a secret of the
    cluster."""
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
        # the nodes reach the store through the kernel's proxy, which lets through only
        # who proves the secret: a process that does not (here, torch's own client, writing
        # under the job's id) is turned away, and idle connections held open there (a
        # flood: 200 turned a 1 s launch into 20 s when they reached the store) do not
        # keep the job's ranks from meeting
        proxy = cluster._proxy
        assert proxy is not None and cluster.store_address == ("127.0.0.1", proxy.port)
        idle = [socket.create_connection(cluster.store_address) for _ in range(200)]
        try:
            poisoned = poison_the_store(cluster.store_address, cluster.job_key, wait=1.0)
            assert poisoned.returncode != 0 and "DistNetworkError" in poisoned.stderr
            out = notebook_launcher(where, (2,), num_processes=4, cluster=cluster, dashboard=False)
            assert sorted(out) == [(0, 8, "0"), (1, 8, "1"), (2, 8, "0"), (3, 8, "1")]
        finally:
            for sock in idle:
                sock.close()
        assert proxy.refused_count >= 200 - MAX_UNAUTHENTICATED
        # the store itself listens on 127.0.0.1 only: a program of this machine that knew
        # the cluster's secret key could still poison it there; that is named
        store = ("127.0.0.1", int(cluster._store.port))
        assert not _reachable("127.0.0.2", store[1]) and not _reachable("::1", store[1])
        poisoned = poison_the_store(store, cluster._store_key)
        assert poisoned.returncode == 0, poisoned.stdout
        with pytest.raises(Exception, match="basic_string") as info:
            notebook_launcher(where, (2,), num_processes=4, cluster=cluster, dashboard=False)
        summary = info.value.launch_failure.summary()  # type: ignore[attr-defined]
        assert "does not decode" in summary and "possible tampering" in summary, summary
        with start(num_processes=2, cluster=cluster, dashboard=False) as session:
            assert session.run_cell("rank") == ["0", "1"]
        # what the kernel has of the forkserver's WARM (torch._dynamo: 1.5-2.5 s in each
        # rank otherwise) the agents import before they fork (stand-ins: small modules)
        import zipapp  # noqa: F401 - this kernel has it, not pyclbr

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(forkserver, "WARM", ("zipapp", "pyclbr"))
            out = notebook_launcher(
                which_are_imported, ("zipapp", "pyclbr"), num_processes=2, cluster=cluster,
                dashboard=False,
            )  # fmt: skip
        assert out == [[True, False], [True, False]]
        job = cluster.job_key
    finally:
        cluster.close()
    for proc in _started:
        proc.communicate(timeout=30)
        assert proc.returncode == 0
    assert agent_processes(job) == []


class TamperingProxy:
    """A man in the middle between one agent and the hub, forwarding whole frames (plain or
    sealed: both are a length, then the bytes). Once :meth:`arm`-ed, the agent's next frame
    goes up with a forged one right behind it, in one write (so the hub reads both at once):
    that frame again (``"replay"``), or the kernel's last frame sent back to it
    (``"reflect"``); or the kernel's next frame reaches the agent twice (``"replay to the
    agent"``)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.target = target
        self.mode: str | None = None
        self.forged = threading.Event()
        self._last_down = b""
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def arm(self, mode: str) -> None:
        self.mode = mode

    def _serve(self) -> None:
        try:
            agent, _ = self.server.accept()
        except OSError:
            return
        kernel = socket.create_connection(self.target)
        self._socks += [agent, kernel]
        down = threading.Thread(target=self._pipe, args=(kernel, agent, False), daemon=True)
        down.start()
        self._pipe(agent, kernel, True)
        down.join()

    def _pipe(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        buf = b""
        try:
            while chunk := src.recv(1 << 16):
                buf += chunk
                while len(buf) >= 4 and len(buf) >= 4 + int.from_bytes(buf[:4], "big"):
                    size = 4 + int.from_bytes(buf[:4], "big")
                    frame, buf = buf[:size], buf[size:]
                    if not up and self.mode == "replay to the agent":
                        self.mode = None
                        frame += frame
                        self.forged.set()
                    elif not up:
                        self._last_down = frame
                    elif self.mode in ("replay", "reflect"):
                        mode, self.mode = self.mode, None
                        frame += frame if mode == "replay" else self._last_down
                        self.forged.set()
                    dst.sendall(frame)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.server.close()
        for sock in self._socks:
            sock.close()
        self._thread.join(10)


def prints_then_sleeps() -> None:
    print("started", flush=True)
    time.sleep(600)


@pytest.mark.parametrize("forgery", ["replay", "reflect"])
def test_a_tampered_frame_ends_that_nodes_connection_and_names_it(
    tmp_path: Path, forgery: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A frame replayed by someone on the path, or one of the kernel's own reflected back:
    the launch fails naming the node and the tampering (a public error, the frames verified
    before it in the same read were handled), the connection ends, and the next launch
    does not run over it."""
    from notebook_launcher import AgentCluster, ClusterError, WorkerDied, notebook_launcher

    cluster = AgentCluster(nodes=1, host="127.0.0.1", secret_file=str(tmp_path / "job.secret"))
    proxies: list[TamperingProxy] = []

    def report(event: Any) -> None:
        if not proxies and cluster.hub is not None:
            proxies.append(TamperingProxy((cluster.hub.host, cluster.hub.port)))
            argv = shlex.split(cluster.agent_command(0))
            argv[argv.index("--connect") + 1] = proxies[0].address
            start_agent(argv)

    try:
        cluster.start(report=report)
        job = cluster.job_key
        proxies[0].arm(forgery)  # the agent's next frame: its ranks started (their pids)
        with pytest.raises(WorkerDied) as info:
            notebook_launcher(prints_then_sleeps, num_processes=2, cluster=cluster, dashboard=False)
        assert proxies[0].forged.is_set()
        text = str(info.value)
        assert "Node 0 (" in text and "its connection was tampered with" in text, text
        assert "failed its check" in text, text
        # the frame verified before the forged one was handled: the ranks' pids are known
        failures = info.value.launch_failure.failures if info.value.launch_failure else []
        assert failures and all(f.pid for f in failures), failures
        with pytest.raises(ClusterError, match="lost 1 node.*tampered with"):
            notebook_launcher(prints_then_sleeps, num_processes=2, cluster=cluster)
        assert not cluster.running
        assert any("tampered with" in r.getMessage() for r in caplog.records)
    finally:
        cluster.close()
        for proxy in proxies:
            proxy.close()
    (agent,) = _started
    out, _ = agent.communicate(timeout=30)
    assert agent.returncode == 0, out  # the kernel closed it: it ended its ranks and left
    assert agent_processes(job) == []


def test_a_tampered_frame_from_the_kernel_ends_the_agent_and_its_ranks(tmp_path: Path) -> None:
    """The kernel's Start reaches the agent twice: the agent starts the ranks the genuine one
    asked for, then stops them and leaves, saying why; the launch names the node as gone."""
    from notebook_launcher import AgentCluster, WorkerDied, notebook_launcher

    cluster = AgentCluster(nodes=1, host="127.0.0.1", secret_file=str(tmp_path / "job.secret"))
    proxies: list[TamperingProxy] = []

    def report(event: Any) -> None:
        if not proxies and cluster.hub is not None:
            proxies.append(TamperingProxy((cluster.hub.host, cluster.hub.port)))
            argv = shlex.split(cluster.agent_command(0))
            argv[argv.index("--connect") + 1] = proxies[0].address
            start_agent(argv)

    try:
        cluster.start(report=report)
        job = cluster.job_key
        proxies[0].arm("replay to the agent")
        with pytest.raises(WorkerDied) as info:
            notebook_launcher(prints_then_sleeps, num_processes=2, cluster=cluster, dashboard=False)
        text = str(info.value)
        assert "Node 0 (" in text and "the connection from the kernel was tampered" in text, text
    finally:
        cluster.close()
        for proxy in proxies:
            proxy.close()
    (agent,) = _started
    out, _ = agent.communicate(timeout=30)
    assert agent.returncode == 3, out
    assert "the kernel's connection was tampered with (frame 1 failed its check" in out, out
    assert agent_processes(job) == []


def test_a_store_proxy_that_cannot_prove_the_secret_is_named_as_tampering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What answers at the ranks' store's address lets the node in without proving it holds
    the secret (an impostor, or a network that changes what passes): the node's agent stops
    its ranks and leaves, and the launch names the node and the tampering."""
    from notebook_launcher import AgentCluster, WorkerDied, notebook_launcher
    from notebook_launcher._wire import store as store_wire

    cluster = AgentCluster(nodes=1, host="127.0.0.1", secret_file=str(tmp_path / "job.secret"))

    def report(event: Any) -> None:
        if not _started:
            start_agent(shlex.split(cluster.agent_command(0)))

    try:
        cluster.start(report=report)
        job = cluster.job_key
        monkeypatch.setattr(
            store_wire, "check_answer", lambda *args: store_wire._frame(b"OK" + bytes(32))
        )
        with pytest.raises(WorkerDied) as info:
            notebook_launcher(where, (1,), num_processes=2, cluster=cluster, dashboard=False)
        text = str(info.value)
        assert "Node 0 (" in text, text
        assert "the connection to the ranks' store failed its authentication" in text, text
        assert "did not prove it holds the cluster's secret" in text and "tampering" in text
    finally:
        cluster.close()
    (agent,) = _started
    out, _ = agent.communicate(timeout=30)
    assert agent.returncode == 3, out
    assert agent_processes(job) == []


def big_on_rank_3() -> bytes:
    import torch.distributed as dist

    dist.barrier()
    return b"x" * (2 << 20) if dist.get_rank() == 3 else b"ok"


def test_a_result_larger_than_a_frame_is_the_ranks_failure(hub: AgentHub, tmp_path: Path) -> None:
    """Issue 25 item 9: a result the agent could not frame ended as ok, None for that rank.
    The agents here carry frames of 1 MiB (4 GiB in real life), the result is 2 MiB."""
    secret_file = hub.write_secret(str(tmp_path / "secret"))
    small_frames = (
        "import sys; from notebook_launcher._wire import agent; agent.MAX_FRAME = 1 << 20; "
        "from notebook_launcher.__main__ import main; sys.exit(main(sys.argv[1:]))"
    )
    for i in range(2):
        start_agent([sys.executable, "-c", small_frames, *agent_argv(hub, secret_file, i)[3:]])
    record = run_group(hub, hub.wait_for(2, 60), big_on_rank_3)
    assert record.results == {0: b"ok", 1: b"ok", 2: b"ok"}
    verdict = record.verdict()
    assert verdict.kind == "raised" and verdict.cause is not None
    cause = verdict.cause
    assert (cause.rank, cause.exc_type) == (3, "notebook_launcher.errors.SerializationError")
    assert "the result of rank 3 is 2,097,1" in cause.message
    assert "more than the connection from its node's agent to the kernel carries" in cause.message
    assert cause.host  # named with its node


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
        # issue 25: the refused ranks read "killed by SIGKILL (pid 0)": no process of them
        # ever was; they never started, and that says why
        assert said.startswith("rank 0 of 2 never started: node 0 ("), said
        assert "refused to start it" in said and "SIGKILL" not in said and "pid" not in said
        failures = caught.value.launch_failure.failures  # type: ignore[attr-defined]
        assert {(f.rank, f.pid, f.started) for f in failures} == {
            (0, None, False),
            (1, None, False),
        }
        job_dir = Path.home() / ".notebook_launcher" / "jobs" / cluster.job_key
        assert (job_dir / "kernel").exists()  # the secret's directory, swept if we die
        assert (
            "2 ranks are more than this node can hold: at most 1 "
            "(NOTEBOOK_LAUNCHER_MAX_PROCESSES=1)" in said
        ), said
        job = cluster.job_key
    finally:
        cluster.close()
    assert not job_dir.exists()  # removed with the cluster
    for proc in _started:
        proc.communicate(timeout=30)
    assert agent_processes(job) == []


def test_a_rank_that_never_started_says_whether_its_node_refused_it_or_was_gone() -> None:
    from notebook_launcher._launch.remote import RemoteNode, _refused_or_gone

    hello = wire.NodeHello("gpu-3", 1, 0, "3.11", "2", "0", "/")
    node = RemoteNode(1, None, hello, gone="its connection ended")  # type: ignore[arg-type]
    assert (
        _refused_or_gone(node) == "node 1 (gpu-3) was gone before it started: its connection ended"
    )
    # what the agent sent: its words, and why, typed (what the kernel decides on)
    node.ending = "its ranks could not start: OSError: no memory"
    node.end_reason = wire.Ending.COULD_NOT_START
    assert _refused_or_gone(node) == "node 1 (gpu-3) refused to start it: OSError: no memory"


def test_a_forked_rank_holds_none_of_the_store_forwarders_sockets() -> None:
    """The agent forks its ranks while its forwarder splices their store connections: a
    rank must hold none of those sockets (a connection would outlive its end in the agent,
    and one rank could read another's bytes)."""
    import warnings
    from datetime import timedelta

    import torch.distributed as dist

    from notebook_launcher._wire.store import StoreForwarder, StoreProxy
    from notebook_launcher.cluster import _store_server

    secret = os.urandom(32)
    server = _store_server()
    proxy = StoreProxy("127.0.0.1", server.port, secret)
    forwarder = StoreForwarder(("127.0.0.1", proxy.port), secret)
    try:
        client = dist.TCPStore(*forwarder.address, is_master=False, timeout=timedelta(seconds=10))
        client.set("k", "v")  # a spliced connection through both
        fds = set(forwarder._fds) | set(proxy._fds)
        assert len(forwarder._socks) >= 3 and len(proxy._socks) >= 3, (forwarder, proxy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
            pid = os.fork()
        if pid == 0:
            still = 0
            for fd in fds:
                try:
                    os.fstat(fd)
                    still += 1
                except OSError:
                    pass
            os._exit(min(still, 100))
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "descriptors left open in the child"
        assert client.get("k") == b"v"  # and the parent's go on
        del client
    finally:
        forwarder.close()
        proxy.close()
        del server


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
