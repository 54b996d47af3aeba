"""The worker's side of a launch: what runs in each rank's process.

A worker is handed four things by whoever started it (the kernel itself with
``fork``, our forkserver, or a fresh interpreter with ``spawn``):

* a :class:`WorkerSpec` (plain data: rank, world size, rendezvous, environment);
* the child end of its control socket (events, result and failure go up; with spawn
  and forkserver the pickled function comes down first);
* the write ends of two pipes that become its fd 1 and fd 2, so everything the rank
  prints -- Python, C++, subprocesses -- reaches the kernel labelled with its rank;
* for rank 0 only, the listening socket of the rendezvous store, bound by the parent
  to loopback (no port race, nothing listens beyond this machine).

Messages up the control socket (standard pickle of tuples):
``("event", Event)``, ``("result", bytes)``, ``("failed", RankFailure, bytes | None)``.
"""

from __future__ import annotations

import ctypes
import faulthandler
import importlib
import io
import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from . import _runtime
from ._events import WorkerFinished, WorkerStarted
from ._serialization import dump_exception, dumps, exception_to_failure

_PR_SET_PDEATHSIG = 1


@dataclass
class WorkerSpec:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    backend: str
    env: dict[str, str]
    cwd: str
    sys_path: list[str]
    replace_environ: bool = False
    pg_timeout_s: float = 1800.0
    num_threads: int | None = None


def die_with_parent(expected_parent: int) -> None:
    """Ask the kernel to SIGKILL us when our parent goes (kernel restart, crash)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the control socket's EOF still stops us
        pass
    if os.getppid() != expected_parent:  # the parent died before prctl took effect
        os._exit(1)


def _reset_signals() -> None:
    """Forget the kernel's handlers: Ctrl-C raises KeyboardInterrupt, SIGTERM terminates."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.set_wakeup_fd(-1)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _redirect_output(out_fd: int, err_fd: int) -> None:
    for src, dst in ((out_fd, 1), (err_fd, 2)):
        if src != dst:
            os.dup2(src, dst)
            os.close(src)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)

    def stream(fd: int) -> io.TextIOWrapper:
        return io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=True,
            write_through=True,
        )

    sys.stdout = stream(1)
    sys.stderr = stream(2)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the process
    # Code that writes to the "original" streams (faulthandler users, some C bridges).
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr  # type: ignore[misc]
    faulthandler.enable(file=sys.stderr)  # a segfault prints the Python stack of the rank


def _set_environment(spec: WorkerSpec) -> None:
    if spec.replace_environ:
        os.environ.clear()
    os.environ.update(spec.env)
    os.environ.update(
        {
            "RANK": str(spec.rank),
            "LOCAL_RANK": str(spec.local_rank),
            "WORLD_SIZE": str(spec.world_size),
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "NODE_RANK": str(spec.node_rank),
            "GROUP_RANK": str(spec.node_rank),
            "MASTER_ADDR": spec.master_addr,
            "MASTER_PORT": str(spec.master_port),
            _runtime.LAUNCHER_ENV: "1",
        }
    )
    if spec.backend == "gloo" and spec.master_addr in ("127.0.0.1", "localhost", "::1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # A kernel started under pytest marks its env; the worker is not a test.
    os.environ.pop("PYTEST_CURRENT_TEST", None)
    if spec.cwd and os.path.isdir(spec.cwd):
        os.chdir(spec.cwd)
    for entry in reversed(spec.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)


def _init_process_group(spec: WorkerSpec, listen_fd: int | None) -> str:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    device = "cpu"
    if spec.backend == "nccl":
        torch.cuda.set_device(spec.local_rank)
        device = f"cuda:{spec.local_rank}"
    timeout = timedelta(seconds=spec.pg_timeout_s)
    is_master = spec.rank == 0
    store_kwargs: dict[str, Any] = {"timeout": timeout, "wait_for_workers": False}
    if is_master and listen_fd is not None:
        store_kwargs["master_listen_fd"] = listen_fd
    store = dist.TCPStore(
        spec.master_addr, spec.master_port, spec.world_size, is_master, **store_kwargs
    )
    dist.init_process_group(
        spec.backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout
    )
    # Everyone's connections are up before anyone runs the function: otherwise a rank that
    # returns at once could close its side while a peer is still connecting, and that peer
    # would fail (and be taken for one left waiting in a collective).
    if spec.backend == "nccl":
        dist.barrier(device_ids=[spec.local_rank])
    else:
        dist.barrier()
    return device


def _install_progress(rank: int) -> None:
    try:
        progress = importlib.import_module("notebook_launcher._progress")
    except ImportError:
        return
    install = getattr(progress, "install", None)
    if install is not None:
        install(rank)


def _reset_state() -> None:
    """A forked worker inherits the kernel's modules: start the shared state afresh."""
    state = sys.modules.get("notebook_launcher.state")
    reset = getattr(state, "_reset_state", None)
    if reset is not None:
        reset()


def run(
    conn: Connection,
    out_fd: int,
    err_fd: int,
    listen_fd: int | None,
    expected_parent: int,
    spec: WorkerSpec | None = None,
    task: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None,
) -> NoReturn:
    """Entry of every worker, whatever started it. Never returns.

    With ``fork`` the spec and the task are already in memory; otherwise the parent
    sends the spec, then the cloudpickled task, down ``conn``.
    """
    code = 1
    try:
        die_with_parent(expected_parent)
        _reset_signals()
        _redirect_output(out_fd, err_fd)
        if spec is None:
            spec = pickle.loads(conn.recv_bytes())
        code = _serve(spec, conn, listen_fd, task)
    except BaseException:  # noqa: BLE001 - last resort: say something, then exit
        try:
            import traceback

            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
        os._exit(code)


def _serve(
    spec: WorkerSpec,
    conn: Connection,
    listen_fd: int | None,
    task: tuple[Any, tuple[Any, ...], dict[str, Any]] | None,
) -> int:
    def send(message: tuple[Any, ...]) -> None:
        conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    _runtime.install(lambda event: send(("event", event)))
    _set_environment(spec)
    _reset_state()
    pid = os.getpid()
    try:
        if task is None:
            task = pickle.loads(conn.recv_bytes())
        fn, args, kwargs = task
        device = _init_process_group(spec, listen_fd)
        if listen_fd is not None:
            os.close(listen_fd)
        _runtime.emit(WorkerStarted(spec.rank, spec.local_rank, pid, device, time.time()))
        _install_progress(spec.rank)
        result = fn(*args, **kwargs)
    except SystemExit as exc:  # sys.exit(n) in a rank: it ends, like a script would
        _flush()
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException as exc:  # noqa: BLE001 - everything the function raises is reported
        _report_failure(send, exc, spec.rank, pid)
        return 1
    try:
        data = dumps(result)
    except Exception as exc:  # noqa: BLE001
        from .errors import SerializationError

        err = SerializationError(
            f"rank {spec.rank} returned a {type(result).__module__}.{type(result).__qualname__}"
            ", which cannot be pickled "
            f"back to the notebook ({type(exc).__name__}: {exc}). Return plain data, tensors "
            "or numbers; save anything else to a file and return its path."
        )
        _report_failure(send, err, spec.rank, pid)
        return 1
    _flush()
    _runtime.emit(WorkerFinished(spec.rank, time.time(), _runtime.barriers_entered()))
    send(("result", data))
    _teardown()
    return 0


def _report_failure(send: Any, exc: BaseException, rank: int, pid: int) -> None:
    _flush()
    failure = exception_to_failure(exc, rank, pid, time.time(), skip_file=__file__)
    try:
        send(("failed", failure, dump_exception(exc)))
    except (OSError, EOFError):
        pass


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _teardown() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the process ends right after
            pass


def main(argv: list[str] | None = None) -> None:
    """``python -m notebook_launcher._spawn CONN OUT ERR LISTEN|- PARENT_PID`` (spawn)."""
    argv = sys.argv[1:] if argv is None else argv
    conn_fd, out_fd, err_fd = (int(a) for a in argv[:3])
    listen_fd = int(argv[3]) if len(argv) > 3 and argv[3] != "-" else None
    run(Connection(conn_fd), out_fd, err_fd, listen_fd, int(argv[4]))
