"""Every rank's entry, whatever started it: environment, process group, run, report.

A rank is handed four things by whoever started it (the kernel itself with ``fork``, the
forkserver, or a fresh interpreter with ``spawn``):

* a :class:`~notebook_launcher._spec.WorkerSpec` (rank, world size, rendezvous, env);
* its end of the control channel (:mod:`notebook_launcher._wire.control`): events and
  how the function ended go up; with spawn and forkserver the spec and the task come
  down first;
* the write ends of two pipes that become its fd 1 and fd 2, so everything the rank
  prints -- Python, C++, subprocesses -- reaches the kernel labelled with its rank;
* for rank 0 only, the listening socket of the rendezvous store, bound by the kernel
  (no port race) -- unless the launch spans nodes or restarts: then a node's kernel holds
  the store and every rank joins as a client, under a key prefix of its attempt.
"""

from __future__ import annotations

import faulthandler
import io
import os
import signal
import sys
import time
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from .. import _settings
from .._events import WorkerFinished, WorkerPhase, WorkerStarted
from .._posix import (
    become_subreaper,
    die_with_parent,
    guard_process_group,
    kill_descendants,
    lead_own_process_group,
)
from .._serialization import dump_exception, dumps, exception_to_failure, load_task
from .._spec import WorkerSpec
from .._wire.control import Channel, Raised, Returned, Setup, Task
from . import collectives, doing, progress, runtime, stacks

TaskTuple = tuple[Any, tuple[Any, ...], dict[str, Any]]


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
    # where this rank reaches the store (on a cluster: its agent's forwarder)
    store_host, store_port = spec.store_via or (spec.master_addr, spec.master_port)
    os.environ.update(
        {
            "RANK": str(spec.rank),
            "LOCAL_RANK": str(spec.local_rank),
            "WORLD_SIZE": str(spec.world_size),
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "NODE_RANK": str(spec.node_rank),
            "GROUP_RANK": str(spec.node_rank),
            "GROUP_WORLD_SIZE": str(spec.num_nodes),
            # what torch elastic tells its workers: code that resumes from a checkpoint
            # on a restart reads it
            "TORCHELASTIC_RESTART_COUNT": str(spec.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "MASTER_ADDR": store_host,
            "MASTER_PORT": str(store_port),
            runtime.LAUNCHER_ENV: "1",
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


def _init_process_group(spec: WorkerSpec, listen_fd: int | None) -> tuple[str, Any]:
    """Join the process group; returns the device and the store (a session re-forms its
    group on the same store)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    device = spec.device
    index = _cuda_index(device)  # made current by _take_device, before the task was loaded
    timeout = timedelta(seconds=spec.pg_timeout_s)
    store: Any
    if spec.store_prefix is not None:  # a node's kernel holds the store: join as a client
        host, port = spec.store_via or (spec.master_addr, spec.master_port)
        client = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        store = dist.PrefixStore(spec.store_prefix, client)
    else:
        is_master = spec.rank == 0
        store_kwargs: dict[str, Any] = {"timeout": timeout, "wait_for_workers": False}
        if is_master and listen_fd is not None:
            store_kwargs["master_listen_fd"] = listen_fd
        store = dist.TCPStore(
            spec.master_addr, spec.master_port, spec.world_size, is_master, **store_kwargs
        )
    group_kwargs: dict[str, Any] = {}
    if spec.backend == "nccl" and index is not None and _takes_device_id(dist):
        # the communicator is made now, with its device known, not lazily at the barrier
        group_kwargs["device_id"] = torch.device("cuda", index)
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timeout,
        **group_kwargs,
    )
    # Everyone's connections are up before anyone runs the function: otherwise a rank that
    # returns at once could close its side while a peer is still connecting, and that peer
    # would fail (and be taken for one left waiting in a collective).
    if spec.world_size > 1:
        if spec.backend == "nccl":
            dist.barrier(device_ids=[index])
        else:
            dist.barrier()
    return device, store


def _take_device(spec: WorkerSpec) -> None:
    """Make the rank's GPU its current device first, before any other CUDA work: else a
    CUDA tensor in the task (unpickled onto ``cuda:0``) or a library's first CUDA call makes
    a stray context on GPU 0, in every rank. Ranks that share a GPU get their share of its
    memory."""
    index = _cuda_index(spec.device)
    if index is None:
        return
    import torch

    torch.cuda.set_device(index)
    if spec.memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(spec.memory_fraction, index)


def _cuda_index(device: str) -> int | None:
    """``"cuda:2"`` -> 2; None for the CPU."""
    if not device.startswith("cuda"):
        return None
    _, _, number = device.partition(":")
    return int(number) if number else 0


def _takes_device_id(dist: Any) -> bool:
    import inspect

    return "device_id" in inspect.signature(dist.init_process_group).parameters


def run(
    conn: Connection,
    out_fd: int,
    err_fd: int,
    listen_fd: int | None,
    expected_parent: int,
    spec: WorkerSpec | None = None,
    task: TaskTuple | bytes | None = None,
) -> NoReturn:
    """Entry of every rank. Never returns.

    With ``fork`` the spec and the task are already in memory; otherwise the kernel sends
    :class:`Setup` then :class:`Task` down the channel.
    """
    code = 1
    channel = Channel(conn)
    forked = spec is not None  # fork: the kernel's memory, its multiprocessing objects too
    try:
        if forked:
            _adopt_multiprocessing()
        die_with_parent(expected_parent)
        lead_own_process_group()  # the kernel's interrupts are not ours; our children are
        become_subreaper()  # daemons we start (setsid) stay in our tree, to end with us
        _reset_signals()
        _redirect_output(out_fd, err_fd)
        if spec is None:
            setup = channel.recv()
            assert isinstance(setup, Setup), setup
            spec = setup.spec
        code = _serve(spec, channel, listen_fd, task)
    except BaseException:  # noqa: BLE001 - last resort: say something, then exit
        try:
            import traceback

            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        try:
            _finish_multiprocessing()
            sys.stdout.flush()
            sys.stderr.flush()
            kill_descendants(os.getpid())  # whatever we started, in our group or not
        except BaseException:  # noqa: BLE001
            pass
        os._exit(code)


def _adopt_multiprocessing() -> None:
    """What ``multiprocessing`` does first in a child it forks: forget the kernel's
    finalizers (a kernel's Pool would otherwise be terminated from here at exit) and run its
    after-fork hooks, so that an inherited ``multiprocessing.Queue`` gets its own feeder
    thread and locks. Accelerate's notebooks pass such queues to the launched function."""
    util = sys.modules.get("multiprocessing.util")
    if util is None:
        return
    util._finalizer_registry.clear()
    util._run_after_forkers()


def _finish_multiprocessing() -> None:
    """What ``multiprocessing`` does last in its children: run this rank's finalizers, so
    that what it put in a queue is flushed before ``os._exit``."""
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        util._run_finalizers()


def _forget_accelerates_state() -> None:
    """A forked rank starts as a fresh process would, for the real Accelerate too: its
    singletons made in the kernel (a loader prepared there, an ``Accelerator``) would give
    every rank the kernel's one-process state (``distributed_type`` NO, process 0 of 1),
    silently. Accelerate's own launcher refuses to launch then; a rank simply forgets."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    for name, kwargs in (
        ("AcceleratorState", {"reset_partial_state": True}),
        ("GradientState", {}),
        ("PartialState", {}),
    ):
        reset = getattr(getattr(state, name, None), "_reset_state", None)
        if reset is not None:
            try:
                reset(**kwargs)
            except Exception:  # noqa: BLE001 - another version's signature: leave it be
                pass


def _serve(
    spec: WorkerSpec,
    channel: Channel,
    listen_fd: int | None,
    task: TaskTuple | bytes | None,
) -> int:
    """Run the task (or serve the session's)."""
    runtime.install(channel.send)
    _set_environment(spec)
    # The kernel can see where this rank is, from now on; what the rank's code starts dies
    # with it, even if the kernel is killed: the guard (a process) is started on the stack
    # helper's thread while the rank meets the others, and waited for (``guarded()``)
    # before any code of the user's runs (unpickling the task may run some).
    guarded = stacks.install(first=guard_process_group)
    stacks.install_flight(spec.backend)
    runtime.run_start_hooks()  # forget what a forked rank inherited (e.g. the state)
    _forget_accelerates_state()
    pid = os.getpid()

    def phase(name: str) -> None:  # what the dashboard shows until WorkerStarted
        runtime.emit(WorkerPhase(spec.rank, pid, name, time.time()))

    try:
        if "torch" not in sys.modules:  # a fresh interpreter: seconds, with many ranks
            phase("importing")
            import torch  # noqa: F401
        _take_device(spec)  # before anything (the task's CUDA tensors too) touches CUDA
        if task is None and not spec.session:
            phase("loading")  # unpickling imports what the function refers to
            message = channel.recv()
            assert isinstance(message, Task), message
            guarded()
            task = load_task(message.data, spec.rank)
        elif isinstance(task, bytes):  # forked by a node's agent: the task as it came
            phase("loading")
            guarded()
            task = load_task(task, spec.rank)
        phase("joining")  # waits here until every rank has come
        device, store = _init_process_group(spec, listen_fd)
        guarded()
        if listen_fd is not None:
            os.close(listen_fd)
        if spec.settings is not None:  # what a forked rank inherits (and `random`)
            _settings.apply(spec.settings, _cuda_index(device))
        runtime.emit(WorkerStarted(spec.rank, spec.local_rank, pid, device, time.time()))
        progress.install(spec.rank)
        if not spec.session:
            collectives.install_for_launch(spec.rank)  # debug mode: checked collectives
        if spec.session:  # stay, and serve the session's tasks
            from . import session

            code = session.serve(spec, channel, store, device)
            _teardown()
            return code
        assert task is not None and not isinstance(task, bytes)
        fn, args, kwargs = task
        watch = doing.first_seconds(spec.rank)  # its row says what it imports meanwhile
        try:
            result = fn(*args, **kwargs)
        finally:
            watch.stop()
    except SystemExit as exc:  # sys.exit(n) in a rank: it ends, like a script would
        runtime.flush_output()
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException as exc:  # noqa: BLE001 - everything the function raises is reported
        _report_failure(channel, exc, spec.rank, pid)
        return 1
    try:
        data = dumps(result)
    except Exception as exc:  # noqa: BLE001
        from ..errors import SerializationError

        err = SerializationError(
            f"rank {spec.rank} returned a {type(result).__module__}.{type(result).__qualname__}"
            ", which cannot be pickled "
            f"back to the notebook ({type(exc).__name__}: {exc}). Return plain data, tensors "
            "or numbers; save anything else to a file and return its path."
        )
        _report_failure(channel, err, spec.rank, pid)
        return 1
    runtime.flush_output()
    runtime.emit(WorkerFinished(spec.rank, time.time(), runtime.barriers_entered()))
    channel.send(Returned(data))
    _teardown()
    return 0


def _report_failure(channel: Channel, exc: BaseException, rank: int, pid: int) -> None:
    runtime.flush_output()
    failure = exception_to_failure(exc, rank, pid, time.time(), skip_file=__file__)
    try:
        channel.send(Raised(failure, dump_exception(exc, skip_file=__file__)))
    except (OSError, EOFError):
        pass


def _teardown() -> None:
    """Before the rank exits: NCCL's communicators are destroyed cleanly. A gloo group is
    left to the exit that follows (``os._exit`` closes its sockets, after the last
    messages were sent): destroying it costs every launch 15-20 ms."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_backend() != "nccl":
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the process ends right after
        pass


def main(argv: list[str] | None = None) -> None:
    """``python -m notebook_launcher._worker CONN OUT ERR LISTEN|- PARENT_PID`` (spawn)."""
    argv = sys.argv[1:] if argv is None else argv
    conn_fd, out_fd, err_fd = (int(a) for a in argv[:3])
    listen_fd = int(argv[3]) if len(argv) > 3 and argv[3] != "-" else None
    run(Connection(conn_fd), out_fd, err_fd, listen_fd, int(argv[4]))
