"""Small named checks run in the kernel before anything starts; each error says how to fix it."""

from __future__ import annotations

import ctypes
import errno
import os
import select
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from .. import _placement
from .._posix import (
    REAPER_NAME,
    deferred_interrupts,
    die_with_parent,
    fork_handler_registered,
    quiet_fork,
)
from .._spec import LAUNCHER_ENV
from ..errors import PreflightError
from ..utils.constants import FP16_ON_CPU_WARNING, MIXED_PRECISION_MODES, parse_mixed_precision
from .rendezvous import RendezvousConfig

START_METHODS = ("fork", "spawn", "forkserver")


def check_function(function: Any) -> None:
    if not callable(function):
        raise PreflightError(
            f"notebook_launcher needs a function to run on every rank, got "
            f"{type(function).__name__} {function!r}. Pass the function itself, without "
            "calling it: notebook_launcher(train, args=(...)), not notebook_launcher(train())."
        )


def check_args(args: Any, kwargs: Any) -> None:
    if not isinstance(args, (tuple, list)):
        raise PreflightError(
            f"args must be a tuple of positional arguments, got {type(args).__name__}. "
            "For a single argument write args=(value,) -- note the comma."
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise PreflightError(f"kwargs must be a dict, got {type(kwargs).__name__}.")


def cuda_initialized() -> bool:
    """Whether the CUDA driver is initialised in this kernel (by torch or by anything else):
    then a forked rank cannot use CUDA (see :func:`notebook_launcher._placement.driver_initialized`)."""
    return _placement.driver_initialized()


#: What the views say when CUDA is initialised in the kernel (tests and users match on it).
CUDA_INITIALISED = "CUDA is initialised in this kernel"


def cuda_unusable_in_fork(on_gpu: bool) -> str | None:
    """Why a rank forked from this kernel now could not use CUDA (the cause, as far as it
    can be named), or None when it could.

    The driver is asked first (0.3 ms; :func:`cuda_initialized`). For ranks that will use
    a GPU, a canary child then says whether torch's CUDA fork handler is registered here,
    which the driver does not show (:func:`notebook_launcher._posix.fork_handler_registered`:
    one fork, a few ms; once it says yes it is not asked again). CPU ranks never ask it:
    a forked CPU rank does not use CUDA."""
    import sys

    if cuda_initialized():
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return CUDA_INITIALISED
        return (
            f"{CUDA_INITIALISED} (its driver, by something other than torch: bitsandbytes, "
            "CuPy, numba, a cuInit)"
        )
    if not on_gpu:
        return None
    registered = fork_handler_registered()
    if registered:
        return (
            "a rank forked from this kernel could not use CUDA: torch's CUDA fork handler is "
            "registered here (by torch.cuda.get_arch_list(), torch.cuda.is_available() without "
            "PYTORCH_NVML_BASED_CUDA_CHECK=1, or another call into CUDA's runtime)"
        )
    if registered is None:
        return "a canary child did not say whether a forked rank could use CUDA here"
    return None


def resolve_num_processes(num_processes: Any, gpus: int, where: str = "python") -> int:
    """``num_processes`` checked; None means one per GPU (``gpus``), refused without any.
    ``where``: "magic" when it was typed as ``%dist start -n N`` (the hint says so)."""
    if num_processes is None:
        if gpus:
            return gpus
        fix = "-n 2" if where == "magic" else "num_processes=2"
        raise PreflightError(
            "num_processes=None means one process per GPU, and this machine has no GPU. "
            f"Say how many CPU workers to start, e.g. {fix}."
        )
    if isinstance(num_processes, bool) or not isinstance(num_processes, int):
        raise PreflightError(
            f"num_processes must be a whole number of processes, got {num_processes!r} "
            f"({type(num_processes).__name__})."
        )
    if num_processes <= 0:
        raise PreflightError(f"num_processes must be at least 1, got {num_processes}.")
    return num_processes


#: Below this much free /dev/shm, several NCCL ranks on one machine may fail (NCCL's
#: shared-memory transport; Docker's default is 64 MiB).
SMALL_SHM_BYTES = 512 * 1024 * 1024


def check_placement(placement: _placement.Placement, found: _placement.Inventory) -> None:
    """What the GPUs in use need, asked without touching CUDA: an architecture the
    installed torch supports (refused otherwise), and room in /dev/shm for NCCL (warned)."""
    used = {int(d.split(":")[1]) for d in placement.devices if d.startswith("cuda:")}
    if not used:
        return
    in_use = _placement.Inventory(tuple(g for g in found.gpus if g.index in used), found.source)
    flags = _placement.arch_flags()
    bad = _placement.unsupported_gpus(in_use, flags)
    if bad:
        import torch

        raise PreflightError(
            f"{', '.join(bad)}: this torch ({torch.__version__}) was not built for that GPU "
            f"architecture (it has {flags}). Install a torch build for it "
            "(e.g. wheels for an older CUDA from pytorch.org), or run CPU ranks with "
            "devices='cpu'."
        )
    if placement.backend == "nccl" and len(placement.devices) > 1:
        free = _placement.shm_bytes()
        if free is not None and free < SMALL_SHM_BYTES:
            warnings.warn(
                f"/dev/shm has only {free // 2**20} MiB free, and NCCL's shared-memory "
                f"transport between the {len(placement.devices)} GPU ranks lives there: a "
                "launch may fail or hang. In Docker start the container with --shm-size=2g "
                "(or --ipc=host); or set NCCL_SHM_DISABLE=1 before launching.",
                UserWarning,
                stacklevel=4,
            )


def check_mixed_precision(mixed_precision: Any, on_gpu: bool | int) -> str:
    """The launch's mixed precision: one of the modes (``"no"`` by default). ``None`` and
    ``""`` are refused as any unknown value is, as Accelerate's ``notebook_launcher`` refuses
    them (``PrecisionType(mixed_precision.lower())``): leave it out for ``"no"``."""
    if mixed_precision is None:
        raise PreflightError(
            "mixed_precision=None is not a mixed precision: leave it out (or pass 'no') for "
            f"full precision, or choose one of {', '.join(map(repr, MIXED_PRECISION_MODES))}."
        )
    try:
        value = parse_mixed_precision(mixed_precision, "notebook_launcher(mixed_precision=...)")
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    if value == "fp16" and not on_gpu:
        warnings.warn(FP16_ON_CPU_WARNING, UserWarning, stacklevel=3)
    return value


def check_nodes(num_nodes: Any, node_rank: Any) -> None:
    for name, value in (("num_nodes", num_nodes), ("node_rank", node_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise PreflightError(f"{name} must be an int, got {value!r}.")
    if num_nodes < 1 or not 0 <= node_rank < num_nodes:
        raise PreflightError(
            f"node_rank={node_rank} with num_nodes={num_nodes}: node_rank must be in "
            f"0..{num_nodes - 1}."
        )


def check_grace_period(grace_period: Any) -> float:
    """Seconds between SIGTERM and SIGKILL when ranks are stopped: a number >= 0."""
    if isinstance(grace_period, bool) or not isinstance(grace_period, (int, float)):
        raise PreflightError(
            f"grace_period must be a number of seconds (e.g. 1.0), got {grace_period!r} "
            f"({type(grace_period).__name__})."
        )
    if not grace_period >= 0:  # also refuses NaN
        raise PreflightError(f"grace_period must be >= 0 seconds, got {grace_period!r}.")
    return float(grace_period)


RDZV_BACKENDS = ("static", "c10d")
#: Seconds a node waits for the others by default: time to start the same cell on each.
DEFAULT_JOIN_TIMEOUT = 300.0


def check_rendezvous(
    backend: Any,
    endpoint: Any,
    conf: Any,
    run_id: Any,
    *,
    master_addr: str,
    use_port: Any,
    num_nodes: int,
    node_rank: int,
    join_timeout: Any,
    max_restarts: int,
) -> RendezvousConfig | None:
    """The rendezvous of a launch that needs one -- several nodes, the c10d backend, an
    endpoint, or restarts -- checked; None for a plain launch on one node (rank 0 then
    holds the store on the kernel's listening socket, as always)."""
    if not isinstance(backend, str) or backend.lower() not in RDZV_BACKENDS:
        raise PreflightError(
            f"rdzv_backend={backend!r} is not supported: use 'static' (node_rank says who is "
            "who) or 'c10d' (torch assigns the node ranks)."
        )
    backend = backend.lower()
    if not isinstance(endpoint, str):
        raise PreflightError(f"rdzv_endpoint must be 'host:port' or '', got {endpoint!r}.")
    if conf is not None and not (isinstance(conf, dict) and all(isinstance(k, str) for k in conf)):
        raise PreflightError(
            f"rdzv_conf must be a dict of option names to values (e.g. "
            f"{{'join_timeout': 600}}), got {conf!r}."
        )
    if not isinstance(run_id, str) or not run_id:
        raise PreflightError(f"rdzv_id must be a non-empty string, got {run_id!r}.")
    if isinstance(join_timeout, bool) or not isinstance(join_timeout, (int, float)):
        raise PreflightError(f"join_timeout must be a number of seconds, got {join_timeout!r}.")
    if not join_timeout > 0:
        raise PreflightError(f"join_timeout must be > 0 seconds, got {join_timeout!r}.")
    if num_nodes == 1 and backend == "static" and not endpoint and not max_restarts:
        return None
    conf = dict(conf or {})
    timeout = float(conf.pop("join_timeout", join_timeout))
    host, port = _parse_endpoint(endpoint, master_addr, use_port, num_nodes)
    return RendezvousConfig(backend, host, port, run_id, conf, num_nodes, node_rank, timeout)


def _parse_endpoint(
    endpoint: str, master_addr: str, use_port: Any, num_nodes: int
) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or ``host`` (then ``use_port``); empty: master_addr and
    use_port, as Accelerate does. ``use_port="auto"`` is for one node only."""
    text = endpoint.strip()
    host, port_text = master_addr, None
    if text:
        if text.startswith("["):
            host, _, rest = text[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else None
        elif text.count(":") == 1:
            host, port_text = text.split(":")
        else:
            host = text
    if port_text is None:
        if use_port is None or str(use_port).lower() == "auto":
            if num_nodes > 1:
                raise PreflightError(
                    "with several nodes, every node needs the same rendezvous port: give "
                    "use_port=29500 (or rdzv_endpoint='host:port'), not 'auto'."
                )
            return host, 0
        port_text = str(use_port)
    try:
        port = int(port_text)
    except ValueError:
        raise PreflightError(
            f"the rendezvous port must be a number, got {port_text!r} (rdzv_endpoint="
            f"{endpoint!r}, use_port={use_port!r})."
        ) from None
    if not 0 < port < 65536 or not host:
        raise PreflightError(f"rendezvous endpoint {host}:{port} is not a host and a TCP port.")
    return host, port


def check_max_restarts(max_restarts: Any) -> int:
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise PreflightError(
            f"max_restarts must be a whole number >= 0 (restarts of every rank after one "
            f"dies), got {max_restarts!r}."
        )
    return max_restarts


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


def check_raise_child_failed(value: Any) -> bool:
    """``None``: env ``NOTEBOOK_LAUNCHER_RAISE_CHILD_FAILED`` (``1``), else False."""
    if value is None:
        return _env_flag("NOTEBOOK_LAUNCHER_RAISE_CHILD_FAILED")
    if not isinstance(value, bool):
        raise PreflightError(
            f"raise_child_failed must be True, False or None (from the environment), got {value!r}."
        )
    return value


def check_restart_on_exception(value: Any) -> bool | tuple[type[BaseException], ...]:
    """``False`` (a raised exception ends the launch), ``True`` (any restarts, as torch
    elastic does), or exception classes that restart (e.g. ``(ConnectionError,)``).
    ``None``: env ``NOTEBOOK_LAUNCHER_RESTART_ON_EXCEPTION`` (``1``: any), else False."""
    if value is None:
        value = _env_flag("NOTEBOOK_LAUNCHER_RESTART_ON_EXCEPTION")
    if isinstance(value, bool):
        return value
    if isinstance(value, type) and issubclass(value, BaseException):
        return (value,)
    if (
        isinstance(value, tuple)
        and value
        and all(isinstance(t, type) and issubclass(t, BaseException) for t in value)
    ):
        return value
    raise PreflightError(
        f"restart_on_exception must be True, False, an exception class or a tuple of them, "
        f"got {value!r}."
    )


def check_log_line_prefix_template(template: Any) -> str | None:
    if template is not None and not isinstance(template, str):
        raise PreflightError(
            "log_line_prefix_template must be a string such as '[${rank}]: ' (torch "
            f"elastic's ${{rank}}, ${{local_rank}}, ${{role_name}}), got {template!r}."
        )
    return template


def _unknown_native_threads() -> frozenset[int]:
    """Threads of this process that Python did not start (OpenMP, MKL, torch pools...).

    ZeroMQ's own threads (every Jupyter kernel has them) are left out: they are not
    touched by a forked child.
    """
    known = {t.native_id for t in threading.enumerate()}
    unknown: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return frozenset()
    for tid in tids:
        if int(tid) in known:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(("ZMQbg", REAPER_NAME)):
                    continue
        except OSError:
            continue
        unknown.add(int(tid))
    return frozenset(unknown)


_fork_verdict: dict[str, Any] = {"unsafe": False, "safe_with_threads": None}
FORK_PROBE_TIMEOUT = 2.0
#: A probe child caught by the OpenMP pool waits at once, for pool threads that were not
#: forked: its only thread asleep, using no CPU. Seen that way this long, it is stuck (a
#: healthy child is running, or has started threads of its own, well within it).
FORK_PROBE_STUCK_AFTER = 0.1


def fork_is_safe() -> bool:
    """Can a forked child use torch's CPU thread pool? False once this kernel's OpenMP
    pool is running (after any parallel op here, e.g. a matmul): GNU OpenMP's workers do
    not survive fork, and a child entering a parallel region hangs forever.

    Probed for real, in a throwaway forked child, whenever the set of native threads
    (by thread id: a new pool thread is a new id) changed since the last probe; the cost
    (~10 ms when safe, ~0.1 s when not) is paid once per change.
    """
    if "torch" not in sys.modules or _fork_verdict["unsafe"]:
        return not _fork_verdict["unsafe"]
    threads = _unknown_native_threads()
    if _fork_verdict["safe_with_threads"] == threads:
        return True
    if _probe_fork():
        _fork_verdict["safe_with_threads"] = threads
        return True
    _fork_verdict["unsafe"] = True  # the pool never goes away: no need to probe again
    return False


def _asleep_alone(pid: int) -> tuple[bool, int] | None:
    """Whether process ``pid`` has one thread, asleep (state S), and the CPU ticks it has
    used; None when ``/proc`` cannot tell (it has just ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except (OSError, IndexError):
        return None
    # after the command's ")": state, ppid, ... utime and stime are the 12th and 13th
    return fields[0] == "S" and threads == 1, int(fields[11]) + int(fields[12])


def _wait_probe(pid: int, pidfd: int) -> bool:
    """Wait for the probe child to end; False once it is stuck (asleep alone, using no CPU,
    for FORK_PROBE_STUCK_AFTER) or after FORK_PROBE_TIMEOUT."""
    start = time.monotonic()
    asleep_since, ticks = None, None
    while True:
        now = time.monotonic()
        left = start + FORK_PROBE_TIMEOUT - now
        if left <= 0:
            return False
        if select.select([pidfd], [], [], min(0.02, left))[0]:
            return True
        seen = _asleep_alone(pid)
        if seen is not None and seen[0] and seen[1] == ticks:
            if asleep_since is None:
                asleep_since = now
            elif now - asleep_since >= FORK_PROBE_STUCK_AFTER:
                return False
        else:
            asleep_since = None
        ticks = seen[1] if seen is not None else None


def _probe_fork() -> bool:
    """Fork a child that runs a parallel op; True when it finished, False once it is stuck
    (see :func:`_wait_probe`). Ctrl-C at any moment leaves no child behind (not even a
    zombie): it is killed and reaped first."""
    parent = os.getpid()
    pid = pidfd = None
    done = False
    status = 0
    try:  # (entered first: the deferred Ctrl-C is raised as the block below ends)
        with deferred_interrupts():  # the child and its pidfd, or neither
            pid = quiet_fork()
            if pid == 0:
                code = 1
                try:
                    die_with_parent(parent)
                    torch = sys.modules["torch"]
                    torch.ones(1 << 17).add_(1)  # at::parallel_for: the OpenMP pool
                    torch.ones(128, 128) @ torch.ones(128, 128)
                    code = 0
                finally:
                    os._exit(code)
            pidfd = os.pidfd_open(pid)
        done = _wait_probe(pid, pidfd)
    finally:
        with deferred_interrupts():
            if pid:
                if not done:
                    os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
            if pidfd is not None:
                os.close(pidfd)
    return done and os.waitstatus_to_exitcode(status) == 0


#: Modules whose threads a forked rank never touches (the kernel's own machinery): their
#: locks cannot be inherited held by anything the rank runs.
_INFRASTRUCTURE = (
    "ipykernel.",
    "IPython.",
    "jupyter_client.",
    "zmq.",
    "tornado.",
    "tqdm.",
    "notebook_launcher.",
    # a multiprocessing.Queue's feeder: a forked rank resets the queues it inherits, as
    # multiprocessing's own fork children do (see _worker.entry), and never uses it
    "multiprocessing.queues.",
    "debugpy",
    "pydevd",
    "_pydevd",
)


def _thread_module(thread: threading.Thread) -> str:
    cls = type(thread)
    if cls.__module__ != "threading":
        return cls.__module__
    target = getattr(thread, "_target", None)
    return getattr(target, "__module__", None) or ""


def busy_threads() -> list[str]:
    """Names of the threads that run *user* code in this process besides the caller.

    A forked child inherits every lock as it was at the fork; one held by such a thread
    (a logging handler, torch's CPU RNG, a tracker's queue) is never released in the
    child, and a rank that takes it hangs forever. Jupyter's own threads are left out
    (the rank never uses their state); so are threads that exist only in C.
    """
    me = threading.current_thread()
    busy = []
    for thread in threading.enumerate():
        if thread is me or isinstance(thread, threading._DummyThread) or not thread.is_alive():
            continue
        if thread is threading.main_thread():
            busy.append(thread.name)  # a launch from another thread: the kernel runs on
            continue
        if not (_thread_module(thread) + ".").startswith(_INFRASTRUCTURE):
            busy.append(thread.name)
    return busy


def resolve_start_method(
    requested: str | None,
    cuda_unusable: str | bool | None,
    fork_safe: bool = True,
    busy: list[str] | None = None,
) -> tuple[str, str]:
    """(method, one-line reason). ``cuda_unusable``: why a forked rank could not use CUDA
    (:func:`cuda_unusable_in_fork`; True: CUDA is initialised here), or None;
    ``fork_safe=False``: this kernel's OpenMP pool runs; ``busy``: threads running user
    code (see :func:`busy_threads`)."""
    if requested not in (None, "auto", *START_METHODS):
        raise PreflightError(
            f"start_method={requested!r} is not one of 'fork', 'spawn', 'forkserver' (or None)."
        )
    why_not_cuda = CUDA_INITIALISED if cuda_unusable is True else (cuda_unusable or None)
    if requested == "fork" and why_not_cuda:
        raise PreflightError(
            f"start_method='fork' was asked for, but {why_not_cuda}, and a forked "
            "child cannot use CUDA then. Either restart the kernel and do not touch CUDA "
            "(no .cuda(), no torch.cuda calls) before launching, or use "
            "start_method='forkserver' (the default then)."
        )
    threads = ", ".join(repr(name) for name in (busy or [])[:3])
    if requested in START_METHODS:
        assert requested is not None
        if requested == "fork" and not fork_safe:
            return "fork", "asked for; ranks use 1 CPU thread: this kernel's OpenMP pool runs"
        if requested == "fork" and busy:
            return "fork", (
                f"asked for, though thread(s) {threads} run here: a lock one of them holds "
                "at the fork would hang a rank that takes it"
            )
        return requested, "asked for"
    if why_not_cuda == CUDA_INITIALISED:
        return "forkserver", f"{CUDA_INITIALISED}, so fork is unsafe"
    if why_not_cuda:
        return "forkserver", why_not_cuda
    unsafe = []
    if not fork_safe:
        unsafe.append(
            "this kernel already ran a multi-threaded torch op (its OpenMP pool would hang a "
            "forked rank)"
        )
    if busy:
        unsafe.append(
            f"thread(s) {threads} run in this kernel (a lock one of them holds at a fork "
            "would hang a forked rank)"
        )
    if unsafe:
        return "forkserver", "; and ".join(unsafe)
    if not hasattr(os, "fork"):
        return "spawn", "this platform has no fork"
    return "fork", "fast, nothing to pickle"


def platform_lacks() -> list[str]:
    """What a launch needs of the platform and this one lacks (nothing on Linux 5.3+): a
    pidfd per rank to wait on it, ``/proc`` to read it, the parent-death signal so that no
    rank outlives the kernel, ``fork`` (the forkserver forks too)."""
    lacking = []
    if not hasattr(os, "fork"):
        lacking.append("fork")
    try:
        pidfd = os.pidfd_open(os.getpid())
    except (AttributeError, OSError):  # not Linux, or a kernel before 5.3 (ENOSYS)
        lacking.append("pidfds (os.pidfd_open, Linux 5.3 or later)")
    else:
        os.close(pidfd)
    if not os.path.isdir("/proc/self/fd"):
        lacking.append("/proc")
    try:
        ctypes.CDLL(None).prctl  # noqa: B018 - the lookup is the probe
    except (OSError, TypeError, AttributeError):  # no libc to open (Windows), no prctl (macOS)
        lacking.append("the parent-death signal (prctl PR_SET_PDEATHSIG)")
    return lacking


def check_platform() -> None:
    """A launch needs Linux: elsewhere it is refused in one sentence before anything starts,
    while importing the package (the Accelerate-style API, the views) still works."""
    lacking = platform_lacks()
    if sys.platform.startswith("linux") and not lacking:
        return
    this = f"this is {sys.platform}" + (f", which lacks {', '.join(lacking)}" if lacking else "")
    raise PreflightError(
        f"notebook_launcher starts ranks on Linux only and {this}: importing it works here, "
        "but run launches and sessions on a Linux machine (on Windows: WSL 2; on macOS: a "
        "Linux VM or container)."
    )


def check_not_in_a_rank() -> None:
    """A launch from inside a launched function: refused with what it is, not as if the
    rank were a notebook kernel."""
    if os.environ.get(LAUNCHER_ENV) == "1":
        rank = os.environ.get("RANK", "?")
        raise PreflightError(
            f"notebook_launcher() was called inside rank {rank} of a running launch (the "
            "launched function, or something it calls, launches again). Ranks cannot start "
            "ranks of their own: launch once, from the notebook or a script, and let the "
            "function do its work directly (it already runs on every rank)."
        )


def check_dashboard(dashboard: Any) -> None:
    if isinstance(dashboard, (bool, str)):
        if dashboard not in (True, False, "auto", "widgets", "text", "none"):
            raise PreflightError(
                f"dashboard must be True, False, 'auto', 'widgets' or 'text' (or a view "
                f"object), got {dashboard!r}."
            )
    elif not all(callable(getattr(dashboard, m, None)) for m in ("handle", "tick", "close")):
        raise PreflightError(
            f"dashboard={dashboard!r} is not a view: a view has handle(event), tick() and "
            "close() (see notebook_launcher.ui.View)."
        )


def check_detach(detach: Any, cluster: Any, session: bool = False) -> None:
    """A detached run or session is one machine's ranks under a supervisor there (one node
    of a launch across machines too), or a cluster's job that the supervisor starts and
    owns (not a cluster this kernel already drives)."""
    if not isinstance(detach, bool):
        raise PreflightError(f"detach must be True or False, got {detach!r}.")
    if not detach:
        return
    if cluster is not None:
        if getattr(cluster, "running", False):
            describe = getattr(cluster, "describe", lambda: "its job")
            what = "session" if session else "run"
            raise PreflightError(
                f"detach=True with a cluster this kernel started ({describe()}): its job "
                "belongs to this kernel and ends with it, so it cannot outlive it. Pass a "
                f"new cluster object, not started (e.g. {type(cluster).__name__}(...)): the "
                f"detached {what}'s supervisor submits a job of its own. Or leave detach "
                "out to use this one."
            )
        return  # num_nodes and the rest: checked as for any launch on a cluster


def check_master_addr(master_addr: Any) -> None:
    if not isinstance(master_addr, str) or not master_addr:
        raise PreflightError(
            f"master_addr must be a host name or IP address, got {master_addr!r}; use "
            "'127.0.0.1' on a single machine."
        )


def check_no_process_group_in_parent() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        raise PreflightError(
            "torch.distributed is already initialised in this kernel, so its process group "
            "would be copied into every worker. Call torch.distributed.destroy_process_group() "
            "in the notebook (or restart the kernel) and launch again; workers create their own."
        )


def check_no_state_in_parent(state_in_use: Callable[[], str | None] | None) -> None:
    name = state_in_use() if state_in_use is not None else None
    if name:
        raise PreflightError(
            f"An {name} was already created in this kernel (outside the launched function). "
            "It would carry a single-process state into the workers. Create "
            f"{name}/Accelerator inside the function you launch, then restart the kernel "
            "(or call notebook_launcher.state._reset_state() if nothing was placed on a GPU)."
        )


def bind_rendezvous(
    master_addr: str, use_port: Any, node_rank: int
) -> tuple[socket.socket | None, int, str | None]:
    """Bind the store's listening socket now (no race); returns (socket, port, note).

    ``use_port`` busy (or ``None``/``"auto"``) -> a free port is chosen and a note says so.
    Nodes other than 0 bind nothing: they connect to node 0.
    """
    auto = use_port is None or str(use_port).lower() == "auto"
    if not auto:
        try:
            port = int(use_port)
        except (TypeError, ValueError):
            raise PreflightError(
                f"use_port must be a port number or 'auto', got {use_port!r}."
            ) from None
        if not 0 <= port < 65536:
            raise PreflightError(f"use_port={port} is not a valid TCP port.")
    else:
        port = 0
    if node_rank != 0:
        if auto:
            raise PreflightError("with several nodes, give every node the same use_port.")
        return None, port, None
    bound = None
    try:  # quick; Ctrl-C meanwhile is raised as it ends, and the socket is closed, not lost
        with deferred_interrupts():
            bound = _bind(master_addr, port)
    except BaseException:
        if bound is not None:
            bound[0].close()
        raise
    return bound


def _bind(master_addr: str, port: int) -> tuple[socket.socket, int, str | None]:
    family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        note = None
        try:
            sock.bind((master_addr, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise PreflightError(
                    f"cannot listen on {master_addr}:{port} ({exc.strerror}). Use "
                    "master_addr='127.0.0.1' for a single machine."
                ) from exc
            sock.bind((master_addr, 0))
            note = f"port {port} is busy"
        try:
            sock.listen(1024)
        except OSError as exc:
            # Two launches bound the same port at once (SO_REUSEADDR lets both bind): the
            # second to listen loses. Same answer as a failed bind: take another port.
            if exc.errno != errno.EADDRINUSE:
                raise
            sock.close()
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.bind((master_addr, 0))
            sock.listen(1024)
            note = f"port {port} is busy"
        sock.set_inheritable(True)
        return sock, sock.getsockname()[1], note
    except BaseException:
        sock.close()
        raise


#: CPU ranks per core at most (more only wait for a core: a mistake, not a plan).
RANKS_PER_CORE = 16
#: The kernel's file descriptors per local rank (its pipes and sentinels), and a margin.
FDS_PER_RANK = 5
FD_MARGIN = 64
#: Memory a rank needs at the least (a forked interpreter with torch, gloo's buffers).
MIN_RANK_MEMORY = 64 << 20
#: Ranks one kernel drives at most, on a cluster too (each has its records and its row).
MAX_WORLD = 16_384
#: Overrides the per-core bound (never the descriptors, memory or process limits).
MAX_PROCESSES_ENV = "NOTEBOOK_LAUNCHER_MAX_PROCESSES"


def capacity_problem(count: int, where: str = "this machine") -> str | None:
    """Why ``count`` ranks cannot run on this machine (its cores, its free memory, this
    process's descriptor limit, the user's process limit), or None. Each reason names the
    limit and the most ranks it allows."""
    import resource

    found: list[tuple[int, str]] = []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    override = os.environ.get(MAX_PROCESSES_ENV, "")
    if override.isdigit():
        found.append((int(override), f"{MAX_PROCESSES_ENV}={override}"))
    else:
        found.append(
            (
                max(RANKS_PER_CORE * cores, 32),
                f"{cores} CPU core(s), {RANKS_PER_CORE} ranks per core at most: more only "
                f"wait for a core (set {MAX_PROCESSES_ENV} to allow more)",
            )
        )
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        try:
            used = len(os.listdir("/proc/self/fd"))
        except OSError:
            used = 0
        most = max(0, (soft - used - FD_MARGIN) // FDS_PER_RANK)
        found.append(
            (
                most,
                f"this process may open {soft} files (ulimit -n; {used} open now) and each "
                f"rank takes {FDS_PER_RANK}: raise it (resource.setrlimit, or ulimit -n "
                "before starting Jupyter)",
            )
        )
    nproc, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if nproc != resource.RLIM_INFINITY and os.geteuid() != 0:
        found.append((nproc // 2, f"this user may run {nproc} processes and threads (ulimit -u)"))
    free = _available_memory()
    if free is not None:
        found.append(
            (
                free // MIN_RANK_MEMORY,
                f"{free >> 20:,} MiB of memory is free, and a rank needs "
                f"{MIN_RANK_MEMORY >> 20} MiB at the least",
            )
        )
    found.append((MAX_WORLD, f"one kernel drives {MAX_WORLD:,} ranks at most"))
    most, why = min(found, key=lambda f: f[0])
    if count <= most:
        return None
    return f"{count:,} ranks are more than {where} can hold: at most {most:,} ({why})"


def _available_memory() -> int | None:
    """Bytes of memory this process may still use: the system's available memory, or its
    cgroup's room when that is less; None when neither can be read."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read())
        if limit != "max":
            room = max(0, int(limit) - current)
            free = room if free is None else min(free, room)
    except (OSError, ValueError):
        pass
    return free


def check_capacity(count: int) -> None:
    """Refuse, before anything is built, more ranks than this machine can hold
    (:func:`capacity_problem`)."""
    why = capacity_problem(count)
    if why is not None:
        raise PreflightError(f"num_processes={count}: {why}. Ask for fewer.")
