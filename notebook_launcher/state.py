"""Shared distributed state: :class:`PartialState`, :class:`AcceleratorState`, :class:`GradientState`.

Same names, attributes and semantics as Hugging Face Accelerate's state classes, so code
written for ``accelerate`` runs after changing the import. Each class is a *shared-state
singleton* (Alex Martelli's "Borg"): every instance reads and writes one class-level dict,
so ``PartialState()`` anywhere in a process returns a view of the same state.

Where the process group comes from (decided once, on the first ``PartialState()``):

* inside a worker of :func:`notebook_launcher.notebook_launcher`, or any process where the
  default group already exists: the group is adopted (rank and world size come from
  ``torch.distributed``), giving ``MULTI_CPU`` on gloo and ``MULTI_GPU`` on nccl;
* under ``torchrun`` (``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` set, no group yet) or
  a Slurm job step (``srun``: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; see
  :func:`launch_env`): the group is created here (gloo on CPU, nccl with CUDA) and destroyed
  by :meth:`PartialState.destroy_process_group` or :func:`_reset_state`;
* otherwise a plain single process: ``DistributedType.NO``, ``num_processes == 1``.

Differences from Accelerate (defects fixed, names kept):

* CPU workers of a launch form a real ``MULTI_CPU`` group without ``cpu=True``.
* ``on_main_process`` and friends decide *when the function is called*, not when it is
  decorated, so a function decorated before the state exists works.
* ``split_between_processes`` never mutates the caller's dict; a rank with nothing to do
  gets an empty slice (not a copy of the last element) unless ``apply_padding=True``;
  padding works for tuples and tensors.
* Re-initialising ``PartialState``/``AcceleratorState`` with a device, backend or mixed
  precision that conflicts with the existing one raises ``ValueError`` naming both values.
  Gradient-accumulation settings follow Accelerate: the latest ``Accelerator`` sets them.

Barriers and the dashboard: inside a launched worker, every process-control barrier
(``wait_for_everyone``, ``main_process_first``, ...) that keeps a rank waiting longer than
a quiet period (50 ms; env ``NOTEBOOK_LAUNCHER_BARRIER_QUIET_MS``, ``0`` = report all)
sends ``BarrierEnter`` (call site, kind, time it entered) and ``BarrierExit`` to the
parent. Shorter barriers cost nothing extra (``bench/barrier.py``).

Example::

    from notebook_launcher import PartialState

    state = PartialState()
    with state.main_process_first():
        download_dataset()          # rank 0 first, the others after it finished
    state.wait_for_everyone()
    with state.split_between_processes(["a", "b", "c"]) as prompts:
        ...                         # rank 0: ["a", "b"], rank 1: ["c"]
"""

from __future__ import annotations

import builtins
import functools
import itertools
import math
import os
import re
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from ._placement import DEVICE_ENV
from ._worker import barriers, runtime
from .utils.constants import FP16_ON_CPU_WARNING, parse_mixed_precision
from .utils.dataclasses import DistributedType

if TYPE_CHECKING:
    from .utils.dataclasses import GradientAccumulationPlugin

F = TypeVar("F", bound=Callable[..., Any])

_TRUE = ("1", "true", "yes", "on", "y", "t")
_INIT_KWARGS = ("backend", "timeout", "init_method", "pg_options")
_GENERATIONS = itertools.count()


_DISTRIBUTED_TYPES = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """``True`` when env var ``key`` is ``"1"``/``"true"``/``"yes"``/``"on"`` (any case)."""
    value = os.environ.get(key)
    if value is None:
        return default
    return value.strip().lower() in _TRUE


def _debug_from_env() -> bool:
    return parse_flag_from_env("NOTEBOOK_LAUNCHER_DEBUG") or parse_flag_from_env(
        "ACCELERATE_DEBUG_MODE"
    )


def _check_mixed_precision(value: str | None, cuda: bool, source: str) -> str:
    """Normalise a mixed-precision setting; raise ``ValueError`` saying how to fix a bad one.

    ``fp16`` without CUDA is accepted with a warning and trains in fp32, as in Accelerate.
    """
    mp = parse_mixed_precision(value, source)
    if mp == "fp16" and not cuda:
        warnings.warn(FP16_ON_CPU_WARNING, UserWarning, stacklevel=4)
    return mp


def _env_int(*keys: str, default: int) -> int:
    for key in keys:
        value = os.environ.get(key)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return default


def _env_wants_group() -> bool:
    """True under ``torchrun``, Slurm and similar: the env describes a group that does not
    exist yet."""
    return launch_env() is not None


@dataclass(frozen=True)
class LaunchEnv:
    """A process group the environment describes: this process's place in it."""

    rank: int
    world_size: int
    local_rank: int
    #: ``tcp://host:port`` when the address is not in ``MASTER_ADDR``/``MASTER_PORT``
    #: (Slurm), else None (torch reads the env)
    init_method: str | None
    source: str  # "torchrun" | "slurm"


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The group ``environ`` (default ``os.environ``) describes, or None.

    * ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (``LOCAL_RANK``): torchrun,
      ``accelerate launch``, or set by hand;
    * a Slurm job step of several tasks (``srun``: ``SLURM_STEP_ID``, ``SLURM_PROCID``,
      ``SLURM_STEP_NUM_TASKS`` or ``SLURM_NTASKS``, ``SLURM_LOCALID``): the store is on the
      first node of the step (``MASTER_ADDR`` overrides), port ``MASTER_PORT`` or 15000 plus
      the last four digits of ``SLURM_JOB_ID``. A batch script or a notebook kernel in an
      allocation is not a step of several tasks: a plain single process.
    """
    env = os.environ if environ is None else environ

    def num(key: str, default: int | None = None) -> int | None:
        value = env.get(key, "").strip()
        return int(value) if value.lstrip("-").isdigit() else default

    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        rank = num("RANK", 0) or 0
        return LaunchEnv(
            rank, num("WORLD_SIZE", 1) or 1, num("LOCAL_RANK", rank) or 0, None, "torchrun"
        )
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    tasks = num("SLURM_STEP_NUM_TASKS", num("SLURM_NTASKS"))
    procid = num("SLURM_PROCID")
    if step is None or procid is None or tasks is None or tasks < 2:
        return None
    host = env.get("MASTER_ADDR") or first_host(
        env.get("SLURM_STEP_NODELIST")
        or env.get("SLURM_JOB_NODELIST")
        or env.get("SLURM_NODELIST", "")
    )
    job = env.get("SLURM_JOB_ID", "").strip()
    port = num("MASTER_PORT") or 15000 + (int(job[-4:]) if job[-4:].isdigit() else 0)
    if not host:
        return None
    where = f"[{host}]" if ":" in host else host
    local = num("SLURM_LOCALID", 0) or 0
    return LaunchEnv(procid, tasks, local, f"tcp://{where}:{port}", "slurm")


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: ``node[07-09,12],gpu1`` -> ``node07``."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):  # the first item: up to a comma outside brackets
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            end = i
            break
    item = nodelist[:end].strip()
    return re.sub(r"\[([^\],-]+)[^\]]*\]", r"\1", item)


# --------------------------------------------------------------------------------------------
# PartialState
# --------------------------------------------------------------------------------------------


class PartialState:
    """Where this process stands in the distributed run; works with no ``Accelerator``.

    Args:
        cpu: force the CPU even when CUDA is available (also env ``ACCELERATE_USE_CPU=1``).
        **kwargs: ``backend`` and ``timeout`` (a ``timedelta`` or seconds) are used only if
            this call creates the process group (under ``torchrun``).

    Attributes:
        device, distributed_type, num_processes, process_index, local_process_index,
        mixed_precision, backend, debug, and the properties ``is_main_process``,
        ``is_local_main_process``, ``is_last_process``, ``use_distributed``.

    Example::

        state = PartialState()
        print(f"rank {state.process_index} of {state.num_processes} on {state.device}")
    """

    _shared_state: dict[str, Any] = {}

    # Declared for type checkers; the values live in ``_shared_state``.
    device: torch.device
    distributed_type: DistributedType
    num_processes: int
    process_index: int
    local_process_index: int
    backend: str | None
    debug: bool
    fork_launched: bool
    _mixed_precision: str
    _cpu: bool
    _created_group: bool
    _trigger: bool
    _init_kwargs: dict[str, Any]
    _barrier_quiet: float

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared_state
        cpu = bool(cpu) or parse_flag_from_env("ACCELERATE_USE_CPU")
        mixed_precision = kwargs.pop("_mixed_precision", None)
        if self.initialized:
            self._check_compatible(cpu, kwargs)
            return
        unknown = sorted(set(kwargs) - set(_INIT_KWARGS))
        if unknown:
            raise TypeError(f"PartialState() got unexpected keyword arguments: {unknown}")
        self._shared_state.update(_build_partial_state(cpu, mixed_precision, kwargs))

    # ---- identity -------------------------------------------------------------------------

    @property
    def initialized(self) -> bool:
        """Whether the shared state has been built in this process."""
        return bool(self._shared_state)

    def __getattr__(self, name: str) -> Any:
        # Only for names not found normally: after _reset_state(), say so as Accelerate does.
        if name in _PARTIAL_STATE_FIELDS:
            raise AttributeError(_reset_message("PartialState", name))
        raise AttributeError(f"'PartialState' object has no attribute {name!r}")

    def __repr__(self) -> str:
        if not self.initialized:
            return "PartialState(<not initialized>)"
        backend = f"  Backend: {self.backend}" if self.backend else ""
        return (
            f"Distributed environment: {self.distributed_type}{backend}\n"
            f"Num processes: {self.num_processes}\n"
            f"Process index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\n"
            f"Device: {self.device}\n"
            f"Mixed precision: {self.mixed_precision}\n"
            f"Debug mode: {self.debug}\n"
        )

    def _check_compatible(self, cpu: bool, kwargs: dict[str, Any]) -> None:
        if cpu and self.device.type != "cpu":
            raise ValueError(
                f"PartialState is already initialized on {self.device} and cannot be switched "
                "to cpu=True. Pass cpu=True to the first PartialState()/Accelerator() of the "
                "process (in a notebook: restart the kernel, or launch with notebook_launcher)."
            )
        backend = kwargs.get("backend")
        if backend is not None and self.backend is not None and backend != self.backend:
            raise ValueError(
                f"PartialState is already initialized with backend={self.backend!r}; "
                f"it cannot be re-initialized with backend={backend!r}."
            )

    # ---- derived attributes ---------------------------------------------------------------

    @property
    def mixed_precision(self) -> str:
        """``"no"``, ``"fp16"`` or ``"bf16"``: the AcceleratorState's value once it exists."""
        acc = AcceleratorState._shared_state
        if acc:
            return str(acc["mixed_precision"])
        return self._mixed_precision

    @property
    def use_distributed(self) -> bool:
        """Whether more than one process takes part (collectives do something)."""
        return self.distributed_type != DistributedType.NO and self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        """True on the process of global index 0 (the one that should log and save)."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """True on the first process of each node."""
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        """True on the process of index ``num_processes - 1``."""
        return self.process_index == self.num_processes - 1

    @property
    def default_device(self) -> torch.device:
        """``cuda`` if available, else ``cpu`` (what a fresh single process would use)."""
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    # ---- barriers -------------------------------------------------------------------------

    def _barrier(self, kind: str) -> None:
        """``dist.barrier()``; inside a launched rank the dashboard sees it when it lasts
        (see :mod:`notebook_launcher._worker.barriers`)."""
        if self.distributed_type not in _DISTRIBUTED_TYPES:
            return
        kwargs: dict[str, Any] = {}
        if self.device.type == "cuda" and self.backend is not None and "nccl" in self.backend:
            kwargs["device_ids"] = [self.device.index or 0]
        quiet = self._shared_state.get("_barrier_quiet", barriers.DEFAULT_QUIET)
        barriers.barrier(lambda: dist.barrier(**kwargs), self.process_index, kind, quiet)

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this call (a no-op in a single process).

        Inside a launched worker the dashboard sees which ``file:line`` each rank waits at.

        Example::

            state.wait_for_everyone()   # everybody finished the previous step
        """
        self._barrier("wait_for_everyone")

    @contextmanager
    def _goes_first(self, is_main: bool, kind: str) -> Iterator[None]:
        if not is_main:
            self._barrier(kind)
        yield
        if is_main:
            self._barrier(kind)

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process first, then on all the others.

        Example::

            with state.main_process_first():
                dataset = load_dataset("...")   # rank 0 downloads, the others read the cache
        """
        with self._goes_first(self.is_main_process, "main_process_first"):
            yield

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Run the block on each node's local main process first, then on the others."""
        with self._goes_first(self.is_local_main_process, "local_main_process_first"):
            yield

    # ---- decorators -----------------------------------------------------------------------

    @staticmethod
    def _only_when(
        function: Callable[..., Any] | None,
        predicate: Callable[[PartialState], bool],
        name: str,
    ) -> Any:
        """Wrap ``function`` so it runs only where ``predicate(PartialState())`` holds.

        The decision is made at call time. Usable bare (``@state.on_main_process``) and called
        (``@state.on_main_process()``); the wrapper returns ``None`` where it does not run.
        """
        if function is None:
            return functools.partial(PartialState._only_when, predicate=predicate, name=name)
        if not callable(function):
            raise TypeError(f"{name} decorates a function, got {type(function).__name__}")

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            state = PartialState()
            if not state.use_distributed or predicate(state):
                return function(*args, **kwargs)
            return None

        return wrapper

    def on_main_process(self, function: F | None = None) -> F:
        """Decorator: run the function only on the main process (returns ``None`` elsewhere).

        Example::

            @state.on_main_process
            def log(msg): print(msg)
        """
        return self._only_when(function, lambda s: s.is_main_process, "on_main_process")

    def on_local_main_process(self, function: F | None = None) -> F:
        """Decorator: run the function only on each node's local main process."""
        return self._only_when(function, lambda s: s.is_local_main_process, "on_local_main_process")

    def on_last_process(self, function: F | None = None) -> F:
        """Decorator: run the function only on the last process."""
        return self._only_when(function, lambda s: s.is_last_process, "on_last_process")

    def on_process(self, function: F | None = None, process_index: int | None = None) -> F:
        """Decorator: run the function only on the process of index ``process_index``.

        Example::

            @state.on_process(process_index=1)
            def report(): ...
        """
        if process_index is None:
            raise ValueError("on_process needs process_index=<int>")
        index = process_index
        return self._only_when(function, lambda s: s.process_index == index, "on_process")

    def on_local_process(
        self, function: F | None = None, local_process_index: int | None = None
    ) -> F:
        """Decorator: run the function only on the local process ``local_process_index``."""
        if local_process_index is None:
            raise ValueError("on_local_process needs local_process_index=<int>")
        index = local_process_index
        return self._only_when(
            function, lambda s: s.local_process_index == index, "on_local_process"
        )

    # ---- data splitting -------------------------------------------------------------------

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Yield this process's share of ``inputs`` (list, tuple, dict of those, tensor, or
        a Hugging Face ``datasets.Dataset``: its rows).

        The first ``len % num_processes`` processes get one item more. With
        ``apply_padding=True`` every process gets the same number of items, shorter shares
        repeating their own last item (or, for an empty share, the last item of
        ``inputs``); drop the duplicates from the results afterwards. A dict is split value
        by value into a *new* dict.

        Example::

            with state.split_between_processes(["a", "b", "c"]) as part:
                ...   # 2 processes: rank 0 gets ["a", "b"], rank 1 gets ["c"]
        """
        yield split_inputs(inputs, self.process_index, self.num_processes, apply_padding)

    # ---- output and triggers --------------------------------------------------------------

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per machine: on each node's local main process (as Accelerate)."""
        if self.is_local_main_process:
            builtins.print(*args, **kwargs)

    def set_trigger(self) -> None:
        """Raise this process's flag; :meth:`check_trigger` on *every* rank then returns True.

        Example::

            if loss.isnan():
                state.set_trigger()
            if state.check_trigger():   # collective: call it on every rank
                break
        """
        self._shared_state["_trigger"] = True

    def check_trigger(self) -> bool:
        """True on every rank if any rank called :meth:`set_trigger` (then the flag is cleared).

        A collective when distributed: every rank must call it.
        """
        flag = bool(self._shared_state.get("_trigger", False))
        if self.distributed_type in _DISTRIBUTED_TYPES:
            t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = bool(t.item())
        if flag:
            self._shared_state["_trigger"] = False
        return flag

    # ---- teardown -------------------------------------------------------------------------

    def destroy_process_group(self, group: Any = None) -> None:
        """Destroy the process group (or ``group``) if this process may.

        The group of a launched worker belongs to the launcher, which destroys it when the
        function returns; for it (with ``group=None``) this is a no-op.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return
        if (
            group is None
            and self.initialized
            and not self._created_group
            and os.environ.get(runtime.LAUNCHER_ENV) == "1"
        ):
            return
        dist.destroy_process_group(group)
        if group is None and self.initialized:
            self._shared_state["_created_group"] = False

    def set_device(self) -> None:
        """Make ``self.device`` the current CUDA device (no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    @staticmethod
    def _reset_state(reset_partial_state: bool = True) -> None:
        """Forget the shared state (tests and notebooks); does not touch the process group."""
        if reset_partial_state:
            PartialState._shared_state.clear()


def _build_partial_state(
    cpu: bool, mixed_precision: str | None, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Work out (and if needed create) the distributed setup; return the state's fields."""
    created = False
    init_kwargs = dict(kwargs)
    cuda = torch.cuda.is_available() and not cpu
    described = launch_env() if dist.is_available() and not dist.is_initialized() else None
    if described is not None:
        backend = init_kwargs.pop("backend", None) or ("nccl" if cuda else "gloo")
        timeout = init_kwargs.pop("timeout", None)
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        if timeout is not None:
            init_kwargs["timeout"] = timeout
        if "nccl" in backend:
            torch.cuda.set_device(described.local_rank)
        if described.init_method is not None:
            init_kwargs.setdefault("init_method", described.init_method)
        dist.init_process_group(
            backend=backend,
            rank=described.rank,
            world_size=described.world_size,
            **init_kwargs,
        )
        created = True
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
        world = dist.get_world_size()
        env = launch_env()
        local = env.local_rank if env is not None else _env_int("LOCAL_RANK", default=rank)
        backend_name: str | None = str(dist.get_backend())
        launched = os.environ.get(runtime.LAUNCHER_ENV) == "1" and not cpu
        placed = os.environ.get(DEVICE_ENV) if launched else None
        if placed:  # a launched rank: where the launcher placed it (_placement.place)
            device = torch.device(placed)
            if device.type == "cuda":
                torch.cuda.set_device(device)
        elif cuda and backend_name is not None and "nccl" in backend_name:
            device = torch.device("cuda", local % max(torch.cuda.device_count(), 1))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        # Accelerate's rule: one process is not distributed (no DDP wrapping), even with a
        # process group of one
        if world == 1:
            dtype = DistributedType.NO
        else:
            gpu = device.type == "cuda"
            dtype = DistributedType.MULTI_GPU if gpu else DistributedType.MULTI_CPU
    else:
        rank, world, local = 0, 1, 0
        backend_name = None
        device = torch.device("cuda") if cuda else torch.device("cpu")
        dtype = DistributedType.NO
    forced = os.environ.get("ACCELERATE_TORCH_DEVICE")
    if forced:
        # Accelerate's override of the device (e.g. "cuda:1", "xpu:0"): used as given
        device = torch.device(forced)
        set_device = getattr(getattr(torch, device.type, None), "set_device", None)
        if device.index is not None and callable(set_device):
            set_device(device)
    if mixed_precision is not None:
        mp = _check_mixed_precision(mixed_precision, device.type == "cuda", "mixed_precision=")
    else:
        mp = _check_mixed_precision(
            os.environ.get("ACCELERATE_MIXED_PRECISION") or None,  # (set empty: not set)
            device.type == "cuda",
            "env ACCELERATE_MIXED_PRECISION",
        )
    checks = parse_flag_from_env("NOTEBOOK_LAUNCHER_CHECK_COLLECTIVES", True)
    return {
        "device": device,
        "distributed_type": dtype,
        "num_processes": world,
        "process_index": rank,
        "local_process_index": local,
        "backend": backend_name,
        "debug": _debug_from_env(),
        "fork_launched": os.environ.get(runtime.LAUNCHER_ENV) == "1",
        "_mixed_precision": mp,
        "_cpu": cpu,
        "_created_group": created,
        "_trigger": False,
        "_init_kwargs": init_kwargs,
        "_barrier_quiet": barriers.quiet_from_env(),
        # read once: the collectives consult them on every call (utils/operations.py)
        "_check_collectives": checks,
        "_small_world": world if world > 1 and checks and device.type == "cpu" else 0,
        "_generation": next(_GENERATIONS),  # a new state may mean a new process group
    }


# --------------------------------------------------------------------------------------------
# Splitting
# --------------------------------------------------------------------------------------------


def _shard_bounds(length: int, index: int, num: int) -> tuple[int, int]:
    per, extra = divmod(length, num)
    start = index * per + min(index, extra)
    end = start + per + (1 if index < extra else 0)
    return start, end


def _is_hf_dataset(value: Any) -> bool:
    """A Hugging Face ``datasets.Dataset``: sliced, it gives a dict of columns, not rows."""
    datasets = sys.modules.get("datasets")  # only if the caller has imported it
    return datasets is not None and isinstance(value, getattr(datasets, "Dataset", ()))


def _split_value(value: Any, index: int, num: int, pad: bool, target: int) -> Any:
    if isinstance(value, Mapping):
        return _split_mapping(value, index, num, pad)
    length = len(value)
    start, end = _shard_bounds(length, index, num)
    if _is_hf_dataset(value):  # rows by index, as Accelerate selects them
        rows = list(range(start, end))
        if pad and length and end - start < target:
            rows += [rows[-1] if rows else length - 1] * (target - (end - start))
        return value.select(rows)
    part = value[start:end]
    if not pad or length == 0 or end - start >= target:
        return part
    missing = target - (end - start)
    # Repeat the share's own last item (so a rank only redoes its own work); a rank with
    # an empty share repeats the last item of the whole input.
    last = part[-1:] if end > start else value[-1:]
    if isinstance(value, torch.Tensor):
        return torch.cat([part, last.expand(missing, *last.shape[1:])], dim=0)
    return part + last * missing


def _length(value: Any) -> int:
    if isinstance(value, Mapping):
        lengths = {_length(v) for v in value.values()}
        if len(lengths) > 1:
            raise ValueError(
                "split_between_processes: all values of a dict must have the same length, got "
                + ", ".join(f"{k!r}: {_length(v)}" for k, v in value.items())
            )
        return lengths.pop() if lengths else 0
    try:
        return len(value)
    except TypeError:
        raise TypeError(
            "split_between_processes splits a list, tuple, dict or tensor (anything with len() "
            f"and slicing), got {type(value).__name__}"
        ) from None


def _split_mapping(value: Mapping[Any, Any], index: int, num: int, pad: bool) -> Any:
    length = _length(value)
    target = math.ceil(length / num) if num else length
    out = {k: _split_value(v, index, num, pad, target) for k, v in value.items()}
    if type(value) is dict:
        return out
    try:
        return type(value)(out)  # type: ignore[call-arg]
    except Exception:  # noqa: BLE001 - unusual mapping types come back as plain dicts
        return out


def split_inputs(inputs: Any, index: int, num: int, apply_padding: bool = False) -> Any:
    """Share ``index`` of ``num`` of ``inputs`` (the logic of ``split_between_processes``)."""
    if num <= 1:
        return inputs
    if isinstance(inputs, Mapping):
        return _split_mapping(inputs, index, num, apply_padding)
    length = _length(inputs)
    return _split_value(inputs, index, num, apply_padding, math.ceil(length / num))


# --------------------------------------------------------------------------------------------
# Process control, delegated (written once for AcceleratorState and the Accelerator)
# --------------------------------------------------------------------------------------------

#: Names a built PartialState answers; after ``_reset_state()`` they raise Accelerate's error.
_PARTIAL_STATE_FIELDS = frozenset(
    {
        "device",
        "distributed_type",
        "num_processes",
        "process_index",
        "local_process_index",
        "backend",
        "debug",
        "fork_launched",
        "mixed_precision",
        "is_main_process",
        "is_local_main_process",
        "is_last_process",
        "use_distributed",
    }
)
_ACCELERATOR_STATE_FIELDS = _PARTIAL_STATE_FIELDS | {
    "dynamo_plugin",
    "deepspeed_plugin",
    "fsdp_plugin",
    "megatron_lm_plugin",
    "use_ipex",
}


def _reset_message(cls: str, name: str) -> str:
    """Accelerate's wording, so code (and tests) that match on it keep working."""
    return (
        f"`{cls}` object has no attribute `{name}`. This happens if `{cls}._reset_state()` was "
        "called and an `Accelerator` or `PartialState` was not reinitialized."
    )


class ProcessControl:
    """PartialState's process-control API, for objects that stand in front of it.

    :class:`AcceleratorState` and :class:`~notebook_launcher.accelerator.Accelerator` both expose
    ``wait_for_everyone``, ``main_process_first``, the ``on_*_process`` decorators,
    ``split_between_processes``, ``print`` and the triggers; each implements only
    :meth:`_view`, which returns the :class:`PartialState` that does the work (or raises when
    the state was reset), so barriers reach the dashboard the same way from all three.

    Example::

        accelerator.wait_for_everyone()       # == PartialState().wait_for_everyone()
    """

    def _view(self, name: str) -> PartialState:
        raise NotImplementedError

    # ---- identity ---------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._view("device").device

    @property
    def num_processes(self) -> int:
        return self._view("num_processes").num_processes

    @property
    def process_index(self) -> int:
        return self._view("process_index").process_index

    @property
    def local_process_index(self) -> int:
        return self._view("local_process_index").local_process_index

    @property
    def use_distributed(self) -> bool:
        return self._view("use_distributed").use_distributed

    @property
    def is_main_process(self) -> bool:
        return self._view("is_main_process").is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self._view("is_local_main_process").is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self._view("is_last_process").is_last_process

    # ---- barriers and decorators ------------------------------------------------------------

    def wait_for_everyone(self) -> None:
        """Barrier across ranks (reported to the dashboard); a no-op in a single process.

        Example::

            accelerator.wait_for_everyone()   # every rank finished writing its shard
        """
        self._view("wait_for_everyone").wait_for_everyone()

    @contextmanager
    def main_process_first(self) -> Iterator[None]:
        """See :meth:`PartialState.main_process_first`."""
        with self._view("main_process_first").main_process_first():
            yield

    @contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """See :meth:`PartialState.local_main_process_first`."""
        with self._view("local_main_process_first").local_main_process_first():
            yield

    def on_main_process(self, function: F | None = None) -> F:
        """See :meth:`PartialState.on_main_process`."""
        return self._view("on_main_process").on_main_process(function)

    def on_local_main_process(self, function: F | None = None) -> F:
        """See :meth:`PartialState.on_local_main_process`."""
        return self._view("on_local_main_process").on_local_main_process(function)

    def on_last_process(self, function: F | None = None) -> F:
        """See :meth:`PartialState.on_last_process`."""
        return self._view("on_last_process").on_last_process(function)

    def on_process(self, function: F | None = None, process_index: int | None = None) -> F:
        """See :meth:`PartialState.on_process`."""
        return self._view("on_process").on_process(function, process_index=process_index)

    def on_local_process(
        self, function: F | None = None, local_process_index: int | None = None
    ) -> F:
        """See :meth:`PartialState.on_local_process`."""
        return self._view("on_local_process").on_local_process(
            function, local_process_index=local_process_index
        )

    @contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """See :meth:`PartialState.split_between_processes`."""
        with self._view("split_between_processes").split_between_processes(
            inputs, apply_padding=apply_padding
        ) as part:
            yield part

    # ---- output and triggers ----------------------------------------------------------------

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per machine.

        Example::

            accelerator.print(f"epoch {epoch}: loss {loss:.3f}")
        """
        self._view("print").print(*args, **kwargs)

    def set_trigger(self) -> None:
        """See :meth:`PartialState.set_trigger`."""
        self._view("set_trigger").set_trigger()

    def check_trigger(self) -> bool:
        """See :meth:`PartialState.check_trigger` (a collective: call it on every rank)."""
        return self._view("check_trigger").check_trigger()


# --------------------------------------------------------------------------------------------
# AcceleratorState
# --------------------------------------------------------------------------------------------


class AcceleratorState(ProcessControl):
    """:class:`PartialState` plus the training settings an ``Accelerator`` needs.

    Args:
        mixed_precision: ``"no"``, ``"fp16"`` (CUDA only) or ``"bf16"``; ``None`` reads env
            ``ACCELERATE_MIXED_PRECISION`` (set by the launcher), default ``"no"``.
        cpu: force the CPU.
        dynamo_plugin, deepspeed_plugin, fsdp_plugin, megatron_lm_plugin: accepted for
            Accelerate compatibility; only ``None`` is supported for the last three.

    Every attribute and process-control method of :class:`PartialState` is available here.
    Re-creating it with a different ``mixed_precision`` raises ``ValueError``.

    Example::

        state = AcceleratorState(mixed_precision="bf16")
        state.mixed_precision   # "bf16"
    """

    _shared_state: dict[str, Any] = {}

    mixed_precision: str
    dynamo_plugin: Any
    deepspeed_plugin: Any
    fsdp_plugin: Any
    megatron_lm_plugin: Any
    use_ipex: bool
    _initialized_by: str

    def __init__(
        self,
        mixed_precision: str | None = None,
        cpu: bool = False,
        dynamo_plugin: Any = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        _from_accelerator: bool = False,
        **kwargs: Any,
    ) -> None:
        self.__dict__ = self._shared_state
        for name, plugin in (
            ("deepspeed_plugin", deepspeed_plugin),
            ("fsdp_plugin", fsdp_plugin),
            ("megatron_lm_plugin", megatron_lm_plugin),
        ):
            if plugin is not None:
                raise NotImplementedError(
                    f"{name} is not supported by notebook_launcher (DDP only); pass None."
                )
        if self.initialized:
            self._check_compatible(mixed_precision, cpu)
            if _from_accelerator:
                self._shared_state["_initialized_by"] = "Accelerator"
            return
        partial = PartialState(cpu, _mixed_precision=mixed_precision, **kwargs)
        if mixed_precision is None:
            mp = partial._mixed_precision
        else:
            mp = _check_mixed_precision(
                mixed_precision, partial.device.type == "cuda", "mixed_precision="
            )
        self._shared_state.update(
            {
                "mixed_precision": mp,
                "dynamo_plugin": dynamo_plugin,
                "deepspeed_plugin": None,
                "fsdp_plugin": None,
                "megatron_lm_plugin": None,
                "use_ipex": False,
                "_initialized_by": "Accelerator" if _from_accelerator else "AcceleratorState",
            }
        )

    @property
    def initialized(self) -> bool:
        return bool(self._shared_state)

    def _check_compatible(self, mixed_precision: str | None, cpu: bool) -> None:
        if mixed_precision is not None:
            mp = str(mixed_precision).strip().lower()
            if mp != self.mixed_precision:
                raise ValueError(
                    f"AcceleratorState is already initialized with "
                    f"mixed_precision={self.mixed_precision!r} and cannot be changed to {mp!r}. "
                    "Create a single Accelerator per process (in a notebook: restart the kernel "
                    "or pass the setting to notebook_launcher(mixed_precision=...))."
                )
        PartialState(cpu)

    def __repr__(self) -> str:
        return repr(self._view("__repr__")).replace("PartialState", "AcceleratorState")

    def _view(self, name: str) -> PartialState:
        if not self.initialized:
            raise AttributeError(_reset_message("AcceleratorState", name))
        return PartialState()

    def __getattr__(self, name: str) -> Any:
        # Only called for names not found normally: fall back to PartialState's fields.
        if name.startswith("__"):
            raise AttributeError(name)
        if not self.initialized and name in _ACCELERATOR_STATE_FIELDS:
            raise AttributeError(_reset_message("AcceleratorState", name))
        shared = PartialState._shared_state
        if name in shared:
            return shared[name]
        raise AttributeError(f"'AcceleratorState' object has no attribute {name!r}")

    @property
    def distributed_type(self) -> DistributedType:
        """PartialState's, unless set on this object (Accelerate's tests pose as FSDP that way)."""
        override = self._shared_state.get("_distributed_type")
        return override if override is not None else self._view("distributed_type").distributed_type

    @distributed_type.setter
    def distributed_type(self, value: DistributedType) -> None:
        # The process group is what it is: only this view changes, PartialState keeps the truth.
        self._view("distributed_type")
        self._shared_state["_distributed_type"] = DistributedType(value)

    @property
    def backend(self) -> str | None:
        return self._view("backend").backend

    @property
    def debug(self) -> bool:
        return self._view("debug").debug

    def destroy_process_group(self, group: Any = None) -> None:
        """See :meth:`PartialState.destroy_process_group` (works after ``_reset_state()``, as
        Accelerate's does: the process group outlives the state objects)."""
        PartialState().destroy_process_group(group)

    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None:
        """Forget the shared state; with ``reset_partial_state`` PartialState's too."""
        AcceleratorState._shared_state.clear()
        if reset_partial_state:
            PartialState._reset_state()


# --------------------------------------------------------------------------------------------
# GradientState
# --------------------------------------------------------------------------------------------


def _plugin_kwargs(plugin: Any) -> dict[str, Any]:
    if plugin is None:
        return {}
    if isinstance(plugin, Mapping):
        return dict(plugin)
    to_kwargs = getattr(plugin, "to_kwargs", None)
    if callable(to_kwargs):
        return dict(to_kwargs())
    raise TypeError(
        "gradient_accumulation_plugin must be a GradientAccumulationPlugin, got "
        f"{type(plugin).__name__}"
    )


class GradientState:
    """Shared gradient-accumulation and dataloader bookkeeping (singleton).

    Args:
        gradient_accumulation_plugin: a
            :class:`~notebook_launcher.utils.dataclasses.GradientAccumulationPlugin`; the
            latest one given sets ``num_steps``, ``adjust_scheduler``,
            ``sync_with_dataloader`` and ``sync_each_batch`` (as in Accelerate: a second
            ``Accelerator`` with other settings updates them).

    Attributes:
        sync_gradients: whether the next backward syncs gradients across ranks.
        active_dataloader: the prepared dataloader being iterated (or ``None``).
        dataloader_references: stack of dataloaders being iterated (``[None]`` at rest).
        end_of_dataloader: the active dataloader yielded its last batch.
        remainder: samples of padding in the last batch (``-1`` outside a dataloader).

    Example::

        state = GradientState(GradientAccumulationPlugin(num_steps=4))
        state.num_steps   # 4
    """

    _shared_state: dict[str, Any] = {}

    sync_gradients: bool
    plugin_kwargs: dict[str, Any]
    _dataloader_refs: list[Any]

    def __init__(self, gradient_accumulation_plugin: GradientAccumulationPlugin | None = None):
        self.__dict__ = self._shared_state
        kwargs = _plugin_kwargs(gradient_accumulation_plugin)
        if not self.initialized:
            self._shared_state.update(
                {
                    "sync_gradients": True,
                    # weak references: a loader dropped mid-epoch (an iterator abandoned
                    # in a notebook) is freed, not kept alive by this singleton
                    "_dataloader_refs": [None],
                    "plugin_kwargs": kwargs,
                    "_is_xla_gradients_synced": False,
                }
            )
            return
        if gradient_accumulation_plugin is not None and kwargs != self.plugin_kwargs:
            # Accelerate's rule: the latest plugin wins (its tests build one Accelerator per
            # case, each with its own settings).
            self._shared_state["plugin_kwargs"] = kwargs

    @property
    def initialized(self) -> bool:
        return bool(self._shared_state)

    @property
    def num_steps(self) -> int:
        """Batches per optimizer step."""
        return int(self.plugin_kwargs.get("num_steps") or 1)

    @property
    def adjust_scheduler(self) -> bool:
        return bool(self.plugin_kwargs.get("adjust_scheduler", False))

    @property
    def sync_with_dataloader(self) -> bool:
        return bool(self.plugin_kwargs.get("sync_with_dataloader", True))

    @property
    def sync_each_batch(self) -> bool:
        return bool(self.plugin_kwargs.get("sync_each_batch", False))

    @property
    def in_dataloader(self) -> bool:
        """Whether a prepared dataloader is being iterated."""
        return self.active_dataloader is not None

    @property
    def end_of_dataloader(self) -> bool:
        if not self.in_dataloader:
            return False
        return bool(getattr(self.active_dataloader, "end_of_dataloader", False))

    @property
    def remainder(self) -> int:
        if not self.in_dataloader:
            return -1
        return int(getattr(self.active_dataloader, "remainder", -1))

    def __repr__(self) -> str:
        return (
            f"Sync Gradients: {self.sync_gradients}\n"
            f"At end of current dataloader: {self.end_of_dataloader}\n"
            f"Extra samples added: {self.remainder}\n"
            f"Gradient accumulation plugin: {self.plugin_kwargs}\n"
        )

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        self._shared_state["sync_gradients"] = sync_gradients

    @property
    def dataloader_references(self) -> list[Any]:
        """The loaders being iterated, outermost first, after a leading ``None``."""
        live = [None if r is None else r() for r in self._dataloader_refs]
        return [None] + [d for d in live[1:] if d is not None]

    @property
    def active_dataloader(self) -> Any:
        """The innermost prepared loader being iterated, or ``None``."""
        return self.dataloader_references[-1]

    def _add_dataloader(self, dataloader: Any) -> None:
        self._dataloader_refs.append(weakref.ref(dataloader))

    def _remove_dataloader(self, dataloader: Any) -> None:
        refs = self._dataloader_refs
        for i in range(len(refs) - 1, 0, -1):
            if refs[i]() is dataloader:
                del refs[i]
                break
        refs[1:] = [r for r in refs[1:] if r() is not None]

    @staticmethod
    def _reset_state() -> None:
        GradientState._shared_state.clear()


# --------------------------------------------------------------------------------------------
# Module-level helpers
# --------------------------------------------------------------------------------------------


def _reset_state() -> None:
    """Forget every shared state of this process (for tests and notebooks).

    Destroys the process group only if ``PartialState`` created it itself (``torchrun``);
    a group made by the launcher, or by the user, is left alone.
    """
    ps = PartialState._shared_state
    if ps.get("_created_group") and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    GradientState._reset_state()
    AcceleratorState._reset_state(reset_partial_state=True)


# A forked rank inherits this module from the kernel: it starts with a fresh state.
runtime.on_rank_start(_reset_state)


def state_in_use() -> str | None:
    """Which state this process has already built: ``"Accelerator"``, ``"AcceleratorState"``,
    ``"PartialState"`` or ``None``. The launcher refuses to start when it is not ``None``."""
    acc = AcceleratorState._shared_state
    if acc:
        return str(acc.get("_initialized_by", "AcceleratorState"))
    if PartialState._shared_state:
        return "PartialState"
    return None


__all__ = [
    "AcceleratorState",
    "DistributedType",
    "GradientState",
    "PartialState",
    "parse_flag_from_env",
    "state_in_use",
]
