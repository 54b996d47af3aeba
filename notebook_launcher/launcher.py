"""``notebook_launcher()``: validate -> preflight -> start workers -> pump events -> return or raise.

This is the one module where the process side (``_process``) meets the UI (``ui``).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

from . import _preflight as preflight
from ._accelerate_env import accelerate_env
from ._events import (
    BarrierEnter,
    BarrierExit,
    Event,
    LaunchFinished,
    LaunchStarted,
    Output,
    WorkerDied,
    WorkerFailed,
    WorkerFinished,
    WorkerStopped,
)
from ._process import WorkerGroup, WorkerProcess
from ._serialization import (
    dumps_checked,
    loads,
    payload_size_warning,
    rebuild_exception,
)
from ._worker import WorkerSpec
from .errors import (
    LargePayloadWarning,
    LaunchError,
    LaunchFailure,
    ProcessGroupMismatch,
    RankFailedError,
    RankFailure,
    RemoteTraceback,
    SerializationError,
    signal_name,
)
from .errors import WorkerDied as WorkerDiedError
from .ui import View, create_view

_STDERR_TAIL_LINES = 400
_DIED_REPORT_LINES = 25


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str | int | None = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    *,
    kwargs: dict[str, Any] | None = None,
    start_method: str | None = None,
    dashboard: bool | str | View = "auto",
    grace_period: float = 1.0,
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` ranks and return their results.

    Accelerate's signature and meaning, so existing notebooks keep working. Each rank
    runs in its own process with ``torch.distributed`` initialised (NCCL, one GPU per
    rank, when GPUs are visible; gloo on CPU otherwise) and the usual env
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...).

    Returns the list of per-rank return values (index = rank on this node). If a rank
    fails, the caller gets that rank's own exception (with its traceback), or
    :class:`~notebook_launcher.WorkerDied` / :class:`~notebook_launcher.ProcessGroupMismatch`;
    the other ranks are stopped and the kernel stays usable.

    Extras beyond Accelerate: ``kwargs`` for the function, ``start_method``
    (``None`` chooses: fork unless CUDA is initialised here, then a forkserver),
    ``dashboard`` (``"auto"``, ``True``, ``False``, or any object with the
    ``notebook_launcher.ui.View`` methods, which then receives every event), ``grace_period`` (seconds between
    SIGTERM and SIGKILL when stopping ranks).

    Example::

        def train(lr):
            from notebook_launcher import PartialState
            state = PartialState()
            return state.process_index * lr

        notebook_launcher(train, args=(0.1,), num_processes=2)   # -> [0.0, 0.1]
    """
    preflight.check_function(function)
    preflight.check_args(args, kwargs)
    preflight.check_nodes(num_nodes, node_rank)
    preflight.check_unsupported(
        rdzv_backend=(rdzv_backend, "static"),
        rdzv_endpoint=(rdzv_endpoint, ""),
        rdzv_conf=(rdzv_conf, None),
        rdzv_id=(rdzv_id, "none"),
        max_restarts=(max_restarts, 0),
        log_line_prefix_template=(log_line_prefix_template, None),
    )
    del monitor_interval  # we wait on sentinels instead of polling
    gpus = preflight.cuda_device_count()
    nprocs = preflight.resolve_num_processes(num_processes, gpus)
    precision = preflight.check_mixed_precision(mixed_precision, gpus)
    preflight.check_no_process_group_in_parent()
    state = sys.modules.get("notebook_launcher.state")
    preflight.check_no_state_in_parent(getattr(state, "state_in_use", None))
    cuda_init = preflight.cuda_initialized()
    wants_fork = start_method in (None, "auto", "fork") and not cuda_init
    fork_safe = preflight.fork_is_safe() if wants_fork else True  # may fork a probe
    method, reason = preflight.resolve_start_method(start_method, cuda_init, fork_safe)

    task = _task(function, tuple(args), dict(kwargs or {}), method)
    listen, port, port_note = preflight.bind_rendezvous(master_addr, use_port, node_rank)
    if port_note:
        reason += f"; {port_note}, using {port}"
    threads = 1 if (method == "fork" and not fork_safe) else _threads_per_rank(nprocs)
    specs = _specs(
        nprocs, num_nodes, node_rank, master_addr, port, gpus, precision, method, threads
    )
    view = dashboard if hasattr(dashboard, "handle") else create_view(dashboard)
    run = _Run(specs, view)  # type: ignore[arg-type]
    group = WorkerGroup(specs, method, task, listen, run.on_event, run.on_exit, grace=grace_period)
    run.on_event(
        LaunchStarted(
            world_size=specs[0].world_size,
            local_world_size=nprocs,
            node_rank=node_rank,
            num_nodes=num_nodes,
            start_method=method,
            start_reason=reason,
            master_addr=master_addr,
            master_port=port,
            backend=specs[0].backend,
            ranks=tuple(s.rank for s in specs),
            time=time.time(),
        )
    )
    try:
        group.start()
        while not group.finished:
            group.pump(0.5)
            run.view.tick()
            if run.failed and not run.stopping:
                run.stopping = True
                group.terminate()
    except KeyboardInterrupt:
        run.stopping = True
        run.interrupted = True
        group.stop()
        raise
    finally:
        group.close()
        run.finish()
    return run.outcome()


#: Imported in the kernel before forking, so that every rank inherits them instead of
#: importing them itself (tqdm's patch and the state module are used by most functions).
_FORK_PRELOAD = ("notebook_launcher._progress", "tqdm.std", "notebook_launcher.state")


def _task(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any], method: str) -> Any:
    if method == "fork":
        for name in _FORK_PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
        return (function, args, kwargs)  # the child inherits it: nothing to pickle
    data = dumps_checked((function, args, kwargs), "the launched function and its args")
    note = payload_size_warning(len(data))
    if note:
        warnings.warn(note, LargePayloadWarning, stacklevel=3)
    return data


def _threads_per_rank(nprocs: int) -> int | None:
    """CPU threads for each rank's torch ops: the cores shared out, unless the user chose
    (OMP_NUM_THREADS), so that N ranks do not fight over the same cores."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // nprocs)


def _specs(
    nprocs: int,
    num_nodes: int,
    node_rank: int,
    master_addr: str,
    port: int,
    gpus: int,
    precision: str,
    method: str,
    threads: int | None,
) -> list[WorkerSpec]:
    extra = {
        **accelerate_env(precision, "nccl" if gpus else "gloo", threads, os.environ),
        "NOTEBOOK_LAUNCHER_START_METHOD": method,
    }
    env = extra if method == "fork" else {**os.environ, **extra}
    return [
        WorkerSpec(
            rank=node_rank * nprocs + local,
            local_rank=local,
            world_size=nprocs * num_nodes,
            local_world_size=nprocs,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=port,
            backend="nccl" if gpus else "gloo",
            env=env,
            cwd=os.getcwd(),
            sys_path=list(sys.path),
            replace_environ=method != "fork",
            num_threads=threads,
        )
        for local in range(nprocs)
    ]


class _Run:
    """What the parent learns during one launch, and what it makes of it at the end."""

    def __init__(self, specs: list[WorkerSpec], view: View) -> None:
        self.view = view
        self.specs = specs
        self.first_rank = specs[0].rank
        self.t0 = time.time()
        self.results: dict[int, Any] = {}
        self.failures: list[RankFailure] = []
        self.exc_data: dict[int, bytes | None] = {}
        self.finished_at: dict[int, float] = {}
        self.stderr_tail: dict[int, deque[str]] = {
            s.rank: deque(maxlen=_STDERR_TAIL_LINES) for s in specs
        }
        self.stopping = False
        self.interrupted = False
        self.failed = False
        self.cause: tuple[RankFailure, str] | None = None
        self.waiting: dict[int, BarrierEnter] = {}
        self.barriers_done: dict[int, int] = {}
        self.stranded: tuple[BarrierEnter, list[int]] | None = None
        self._view_broken = False

    def on_event(self, event: Event) -> None:
        if isinstance(event, Output) and event.stream == "stderr":
            self.stderr_tail[event.rank].append(event.text)
        elif isinstance(event, BarrierEnter):
            self.waiting[event.rank] = event
            self._check_stranded()
        elif isinstance(event, BarrierExit):
            self.waiting.pop(event.rank, None)
        elif isinstance(event, WorkerFinished) and event.barriers >= 0:
            self.barriers_done[event.rank] = event.barriers
            self._check_stranded()
        if self._view_broken:
            return
        try:
            self.view.handle(event)
        except Exception as exc:  # noqa: BLE001 - a broken view must not break a launch
            self._view_broken = True
            sys.stderr.write(f"notebook_launcher: the dashboard failed ({exc!r}); continuing\n")

    def _check_stranded(self) -> None:
        """A rank waits in barrier #i for a rank that returned after entering fewer than
        i+1 barriers: it will wait forever (NCCL does not even notice the peer is gone).
        Fail now, naming both, instead of hanging until the collective timeout."""
        if self.stranded is not None:
            return
        for waiter in self.waiting.values():
            gone = [r for r, n in self.barriers_done.items() if n <= waiter.index]
            if gone:
                self.stranded = (waiter, sorted(gone))
                self.failed = True
                return

    def on_exit(self, proc: WorkerProcess) -> None:
        now = time.time()
        code = proc.returncode
        if proc.result is not None:
            try:
                self.results[proc.rank] = loads(proc.result)
            except Exception as exc:  # noqa: BLE001
                self._fail(
                    RankFailure(
                        proc.rank,
                        "raised",
                        proc.pid,
                        "notebook_launcher.errors.SerializationError",
                        f"the result of rank {proc.rank} could not be unpickled in the "
                        f"kernel: {type(exc).__name__}: {exc}",
                        time=now,
                    ),
                    None,
                )
                return
            self.finished_at[proc.rank] = now
        elif proc.failure is not None:
            self._fail(proc.failure, proc.exc_data)
            f = proc.failure
            self.on_event(
                WorkerFailed(f.rank, f.exc_type or "", f.message, f.traceback, f.collateral, now)
            )
        elif code == 0:  # sys.exit(0): a clean end with nothing to return
            self.results[proc.rank] = None
            self.finished_at[proc.rank] = now
            self.on_event(WorkerFinished(proc.rank, now))
        elif self.stopping and code is not None and code < 0:
            self.failures.append(RankFailure(proc.rank, "stopped", proc.pid, time=now))
            reason = "interrupted" if self.interrupted else "another rank failed"
            self.on_event(WorkerStopped(proc.rank, reason, now))
        else:
            sig = signal_name(code)
            self._fail(
                RankFailure(
                    proc.rank,
                    "died",
                    proc.pid,
                    exitcode=code,
                    signal_name=sig,
                    message=_last_words(self.stderr_tail[proc.rank]),
                    time=now,
                ),
                None,
            )
            self.on_event(WorkerDied(proc.rank, proc.pid, code, sig, now))

    def _fail(self, failure: RankFailure, exc_data: bytes | None) -> None:
        self.failures.append(failure)
        self.exc_data[failure.rank] = exc_data
        self.failed = True

    # -- the end ---------------------------------------------------------------------------

    def root_cause(self) -> tuple[RankFailure, str] | None:
        """(failure, kind) where kind is "raised", "died" or "left"."""
        real = [f for f in self.failures if f.kind in ("raised", "died")]
        if self.stranded is not None and not any(
            f.kind != "stopped" and not f.collateral for f in self.failures
        ):
            waiter, gone = self.stranded
            left = RankFailure(
                gone[0],
                "left",
                message=f"rank {waiter.rank} still waited for it at {waiter.location} "
                f"({waiter.kind}, barrier #{waiter.index})",
                time=self.finished_at.get(gone[0], waiter.time),
            )
            self.failures.append(left)
            return left, "left"
        if not real:
            return None
        raised = sorted((f for f in real if f.kind == "raised" and not f.collateral), key=_t)
        if raised:
            return raised[0], "raised"
        died = sorted((f for f in real if f.kind == "died"), key=_t)
        if died:
            return died[0], "died"
        collateral = sorted(real, key=_t)
        if self.finished_at:  # waiting ranks lost a peer that had simply returned
            rank = min(self.finished_at, key=self.finished_at.__getitem__)
            left = RankFailure(rank, "left", time=self.finished_at[rank])
            self.failures.append(left)
            return left, "left"
        return collateral[0], "raised"

    def finish(self) -> None:
        wall = time.time() - self.t0
        self.cause = cause = self.root_cause()
        n = len(self.specs)
        # The views put "N ranks, wall time: ok/failed:" in front of this themselves.
        if self.interrupted:
            summary = f"interrupted: all {n} ranks stopped"
            ok, rank = False, None
        elif cause is None:
            summary = f"all {n} ranks finished"
            ok, rank = True, None
        else:
            summary = cause[0].describe()
            ok, rank = False, cause[0].rank
        failed = tuple(sorted({f.rank for f in self.failures if f.kind != "stopped"}))
        self.on_event(LaunchFinished(ok, summary, rank, wall, time.time(), failed))
        try:
            self.view.close()
        except Exception:  # noqa: BLE001
            pass

    def outcome(self) -> list[Any]:
        cause = self.cause
        if cause is None:
            missing = [s.rank for s in self.specs if s.rank not in self.results]
            if missing:  # cannot happen without a failure record; never return a short list
                raise LaunchError(f"ranks {missing} ended without a result")
            return [self.results[s.rank] for s in self.specs]
        failure, kind = cause
        report = LaunchFailure(failure, sorted(self.failures, key=_t), len(self.specs))
        raise self._exception(failure, kind, report)

    def _left_error(self, report: LaunchFailure) -> BaseException:
        """Some rank returned while others still waited for it: say who, and where."""
        left = sorted(self.finished_at, key=self.finished_at.__getitem__)
        stuck = sorted((f for f in self.failures if f.kind == "raised"), key=_t)
        if self.stranded is not None:
            waiter, gone = self.stranded
            left = gone
            waiting = (
                f"rank {waiter.rank} still waited for them at {waiter.location} "
                f"({waiter.kind}, barrier #{waiter.index})"
            )
        else:
            first = stuck[0]
            got = first.message.strip().splitlines()[0] if first.message else ""
            waiting = (
                f"rank(s) {sorted({f.rank for f in stuck})} still waited for them in a "
                f"collective or barrier (rank {first.rank} got {first.exc_type}: {got[:200]})"
            )
        err = ProcessGroupMismatch(
            f"rank(s) {left} returned from the function while {waiting}. Every rank must "
            "call the same collectives (barrier, all_reduce, wait_for_everyone, gather...) "
            "in the same order; look for one inside an `if` that only some ranks take, or a "
            "rank that returns early.\n" + report.summary(),
            report,
        )
        if stuck:
            err.__cause__ = RemoteTraceback(stuck[0].rank, stuck[0].traceback)
        return err

    def _exception(self, failure: RankFailure, kind: str, report: LaunchFailure) -> BaseException:
        n = len(self.specs)
        if kind == "left":
            return self._left_error(report)
        if kind == "died":
            tail = failure.message.strip()
            hint = (
                " It was killed from outside (out of memory is a common reason: check `dmesg`)."
                if failure.signal_name == "SIGKILL"
                else ""
            )
            return WorkerDiedError(
                f"rank {failure.rank} of {n} died without raising an exception "
                f"({failure.describe().split(': ', 1)[1]}).{hint}\n"
                + report.summary()
                + (f"\nLast lines rank {failure.rank} wrote to stderr:\n{tail}" if tail else ""),
                report,
            )
        exc = rebuild_exception(self.exc_data.get(failure.rank), failure)
        note = f"Raised on rank {failure.rank} of {n}.\n{report.summary()}"
        if exc is None:
            cls = SerializationError if "SerializationError" in (failure.exc_type or "") else None
            message = f"rank {failure.rank} raised {failure.exc_type}: {failure.message}\n" + note
            exc = cls(message) if cls else RankFailedError(message, report)
            exc.__cause__ = RemoteTraceback(failure.rank, failure.traceback)
        else:
            if hasattr(exc, "add_note"):
                exc.add_note(note)
        try:
            exc.launch_failure = report  # type: ignore[attr-defined]
        except AttributeError:
            pass
        return exc


def _last_words(lines: deque[str]) -> str:
    """What a dead rank wrote last; from its fatal-error banner (segfault) when there is one."""
    text = list(lines)
    for i in range(len(text) - 1, -1, -1):
        if text[i].startswith("Fatal Python error"):
            return "".join(text[i : i + _DIED_REPORT_LINES])
    return "".join(text[-_DIED_REPORT_LINES:])


def _t(f: RankFailure) -> float:
    return f.time
