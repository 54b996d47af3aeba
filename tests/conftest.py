"""Test-suite guards: every test must leave the process exactly as it found it.

The autouse fixture ``no_leftovers`` fails a test that leaves behind a child process,
a changed environment variable, an initialised torch.distributed process group, a
changed signal handler, a listening port, or an extra thread. The launcher's persistent forkserver
(started on first use of the CUDA-safe path, like multiprocessing's) is the one
allowed child; it is shut down and checked at the end of the session.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from notebook_launcher._posix import socket_inodes

from . import gpus, helpers

gpus.hide()  # every tier but `gpu` runs CPU ranks, as on CI (see tests/gpus.py)

#: The test tiers (registered in pyproject.toml). Every test file declares exactly one with
#: ``pytestmark``, so ``pytest -m unit`` is the fast loop and nothing runs unclassified.
TIERS = frozenset({"unit", "multiprocess", "kernel", "notebook", "browser", "gpu"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tiers = {m.name for m in item.iter_markers()} & TIERS
        if len(tiers) != 1 and item.path.suffix == ".py":
            raise pytest.UsageError(
                f"{item.nodeid}: a test file must declare exactly one tier "
                f"(pytestmark = pytest.mark.<tier>, one of {sorted(TIERS)}); found {sorted(tiers)}"
            )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[object]:
    """Keep each phase's report on the test (``item.rep_call``): a fixture that shares a
    kernel across a module replaces it after a test that failed (helpers.Kept)."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread in this (parent) process, so its OpenMP pool never starts (a
    module asks for it with ``pytest.mark.usefixtures("one_torch_thread")``).

    Once a process has run a multi-threaded OpenMP region (a bf16 matmul, a large elementwise
    op), a child forked from it hangs in its own first parallel region: libgomp is not
    fork-safe. The launcher detects that and then starts ranks with a slower method
    (seconds per launch instead of a fraction of one); staying single-threaded keeps every
    launch of the module on the fast fork path, and its forked children free of a pool."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGPIPE]
_ENV_IGNORED = {"PYTEST_CURRENT_TEST"}


def child_pids(pid: int | None = None) -> set[int]:
    """Direct children of ``pid`` (default: this process), read from /proc."""
    pid = os.getpid() if pid is None else pid
    kids: set[int] = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.update(int(p) for p in f.read().split())
    except FileNotFoundError:
        pass
    return kids


def _allowed_children() -> set[int]:
    server = sys.modules.get("notebook_launcher._launch.forkserver")
    if server is None:
        return set()
    pid = server.pid()
    return {pid} if pid else set()


def listening_ports() -> set[int]:
    """TCP ports this process listens on (rendezvous sockets it may have leaked)."""
    inodes = socket_inodes()
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def _process_group_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _wait_for_no_children(before: set[int], timeout: float = 5.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while True:
        extra = child_pids() - before - _allowed_children()
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.02)


def _describe(pid: int) -> str:
    """``1234 (python -m x, State: S)``: what a leftover child is, for the failure."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/status") as f:
            state = next((line for line in f if line.startswith("State:")), "").strip()
    except OSError:
        return str(pid)
    return f"{pid} ({argv[:200] or '?'}, {state})"


@pytest.fixture(autouse=True)
def no_leftovers(request: pytest.FixtureRequest) -> Iterator[None]:
    env_before = {k: v for k, v in os.environ.items() if k not in _ENV_IGNORED}
    handlers_before = {s: signal.getsignal(s) for s in _SIGNALS}
    children_before = child_pids()
    threads_before = {t.ident for t in threading.enumerate()}
    ports_before = listening_ports()
    yield
    problems: list[str] = []
    leaked_ports = listening_ports() - ports_before
    if leaked_ports:
        problems.append(f"listening ports left open: {sorted(leaked_ports)}")
    extra = _wait_for_no_children(children_before | helpers.Kept.children)
    if extra:
        described = [_describe(pid) for pid in sorted(extra)]
        for pid in extra:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        problems.append(f"child processes left behind: {described}")
    env_after = {k: v for k, v in os.environ.items() if k not in _ENV_IGNORED}
    if env_after != env_before:
        changed = sorted(set(env_after.items()) ^ set(env_before.items()))
        os.environ.clear()
        os.environ.update(env_before)
        problems.append(f"environment changed: {changed}")
    handlers_after = {s: signal.getsignal(s) for s in _SIGNALS}
    if handlers_after != handlers_before:
        for s, h in handlers_before.items():
            signal.signal(s, h)
        problems.append("signal handlers changed")
    if _process_group_initialized():
        import torch.distributed as dist

        dist.destroy_process_group()
        problems.append("a torch.distributed process group was left initialised")
    deadline = time.monotonic() + 2.0
    while True:
        new_threads = [
            t
            for t in threading.enumerate()
            if t.ident not in threads_before and t.is_alive() and not t.daemon
        ]
        if not new_threads or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    if new_threads:
        problems.append(f"threads left running: {[t.name for t in new_threads]}")
    reset = getattr(sys.modules.get("notebook_launcher.state"), "_reset_state", None)
    if reset is not None:
        reset()
    if problems:
        pytest.fail(f"{request.node.nodeid} left things behind: " + "; ".join(problems))


@pytest.fixture(autouse=True)
def gpu_tier_sees_the_gpus(request: pytest.FixtureRequest, no_leftovers: None) -> Iterator[None]:
    """A ``gpu`` test gets the machine's GPUs back for its duration (see tests/gpus.py)."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    if gpus.MACHINE_VISIBLE is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus.MACHINE_VISIBLE
    try:
        yield
    finally:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        if hidden is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden


@pytest.fixture(scope="session", autouse=True)
def _forkserver_shut_down_at_end() -> Iterator[None]:
    yield
    server = sys.modules.get("notebook_launcher._launch.forkserver")
    if server is not None:
        server.shutdown()
    assert not _wait_for_no_children(set()), "worker or forkserver processes outlived the suite"


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[helpers.SlurmTestCluster]:
    """A real Slurm cluster of 3 nodes on this machine (``tests/slurm/start-cluster.sh``),
    started once for the session and stopped even when tests fail. ``SLURM_CONF`` points
    at it for the session (Slurm's commands and the kernel's ``SlurmCluster`` read it)."""
    cluster = helpers.SlurmTestCluster.start(tmp_path_factory.mktemp("slurm"), nodes=3)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def kernel_env() -> dict[str, str]:
    """Environment for kernels started by a test (see ``helpers.KERNEL_ENV_DROP``)."""
    return helpers.kernel_env()
