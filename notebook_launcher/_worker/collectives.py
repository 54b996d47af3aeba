"""Raw ``torch.distributed`` collectives, made visible like ``wait_for_everyone``, checked,
and refused where they cannot complete.

:func:`install` wraps the blocking collectives of ``torch.distributed`` on the default
group (a session's ranks always; a launch's in debug mode). Each wrapped call:

* **fails at once in a cell that runs on some ranks only** (:func:`task_scope`): a
  collective of the whole group there waits for ranks that will never come, so it raises
  :class:`~notebook_launcher.errors.ProcessGroupMismatch` naming the call site before
  anything is sent (the group stays sound). The package's own collectives (``gather``,
  ``reduce``, ``broadcast``, ``pad_across_processes``, ``Accelerator.gather``...) call
  :func:`refuse` for the same. What runs in C++ -- DDP's gradient all-reduce in
  ``loss.backward()``, its parameter broadcast when a model is wrapped -- cannot be seen
  from Python: there the default group's timeout is :data:`PARTIAL_TIMEOUT` seconds for
  the time of the cell (gloo), the call fails that soon, and the rank reports where it
  waited (a ``BarrierEnter`` that never exits): the kernel raises ``ProcessGroupMismatch``
  naming the line and re-forms the group (the collective left data in flight).
* **is checked** (``checked=True``, gloo only): before the real collective every rank
  exchanges a 256-byte packet with the digest of its call (which collective; shapes and
  dtypes; root; reduce op) -- the format of ``utils.operations``' own check, so a raw
  call and a package call that meet are told apart too. Different digests raise
  :class:`~notebook_launcher.errors.DistributedOperationException` on every rank, naming
  each rank's call and call site, instead of hanging, aborting in gloo's C++ ("Received
  data size doesn't match") or silently mixing data. Costs one small extra collective per
  call: on in sessions (interactive, where a wrong cell is the common case), in a launch
  only in debug mode (``NOTEBOOK_LAUNCHER_DEBUG=1``); ``NOTEBOOK_LAUNCHER_CHECK_COLLECTIVES
  =0`` turns it off, ``=1`` on for launches too. torch's own ``TORCH_DISTRIBUTED_DEBUG=
  DETAIL`` does such checks for every collective, DDP's included, but measured on torch
  2.13/gloo it made a small ``all_reduce`` 3-6x slower and crashed (SIGSEGV) while
  wrapping a model in DDP; it is left to the user.
* **is reported** when it lasts longer than its quiet period (50 ms) with the user's call
  site (:func:`notebook_launcher._worker.barriers.barrier`): the dashboard shows who waits
  where.

A call costs the wrapper about a microsecond (unchecked); asynchronous calls
(``async_op=True``) and calls on a subgroup are passed straight through.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .._events import BarrierEnter
from .._stacks import COLLECTIVES
from ..errors import DistributedOperationException, ProcessGroupMismatch
from . import barriers, runtime

#: Seconds the default group waits for a peer while a cell runs on some ranks only (see
#: the module docstring): what needs an idle rank (DDP's all-reduce) fails this soon.
PARTIAL_TIMEOUT = 1.0
CHECK_ENV = "NOTEBOOK_LAUNCHER_CHECK_COLLECTIVES"
#: Bytes of the check's packet, and where its digest ends (``utils.operations``' format).
PACKET = 256
HEADER = 16

_OURS = "notebook_launcher."
_originals: dict[str, Callable[..., Any]] = {}
#: The ranks of the default group that do not run the current task (empty: all run it).
outside: tuple[int, ...] = ()
#: The ranks that run it (for the message).
_task_ranks: tuple[int, ...] = ()
_checked = False


def _position(function: Callable[..., Any], name: str) -> int:
    try:
        return list(inspect.signature(function).parameters).index(name)
    except (ValueError, TypeError):
        return -1


def _wrap(name: str, original: Callable[..., Any], rank: int, quiet: float) -> Callable[..., Any]:
    params: list[str] = []
    try:
        params = list(inspect.signature(original).parameters)
    except (ValueError, TypeError):
        pass
    at_group, at_async = _position(original, "group"), _position(original, "async_op")

    def argument(args: tuple[Any, ...], kwargs: dict[str, Any], key: str, at: int) -> Any:
        if key in kwargs:
            return kwargs[key]
        return args[at] if 0 <= at < len(args) else None

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        group = argument(args, kwargs, "group", at_group)
        if argument(args, kwargs, "async_op", at_async) or (
            group is not None and group is not _world()
        ):
            return original(*args, **kwargs)
        if outside:
            refuse(name)
        # The package's own calls (utils.operations after its own check, the state's
        # barriers) are not checked again: one check per call the user made.
        if not _checked or sys._getframe(1).f_globals.get("__name__", "").startswith(_OURS):
            return barriers.barrier(lambda: original(*args, **kwargs), rank, name, quiet)
        location = barriers.caller_location()

        def checked() -> Any:
            check(name, fingerprint(name, params, args, kwargs), location)
            return original(*args, **kwargs)

        return barriers.barrier(checked, rank, name, quiet)

    collective.__notebook_launcher_wrapped__ = original  # type: ignore[attr-defined]
    # Its frames carry the collective's name: a rank's stack says what it waits in even
    # while the check (not torch's own function) waits.
    function: Any = collective
    code = function.__code__.replace(co_name=name)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=name)
    function.__code__ = code
    return collective


def _world() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD


def install(rank: int, quiet: float = barriers.DEFAULT_QUIET, checked: bool = False) -> None:
    """Wrap the collectives of ``torch.distributed`` (idempotent); ``checked``: compare
    every call across ranks first (gloo; see the module docstring)."""
    global _checked
    import torch.distributed as dist

    env = os.environ.get(CHECK_ENV, "").strip()
    if env in ("0", "1"):
        checked = env == "1"
    _checked = checked and dist.get_backend() == "gloo" if dist.is_initialized() else checked
    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None or name in _originals:
            continue
        _originals[name] = original
        setattr(dist, name, _wrap(name, original, rank, quiet))


def install_for_launch(rank: int) -> None:
    """A launch's ranks: checked collectives in debug mode (or when asked by env)."""
    from .._accelerate_env import _DEBUG_FLAGS, _flag

    debug = any(_flag(os.environ, key) for key in _DEBUG_FLAGS)
    if debug or os.environ.get(CHECK_ENV, "").strip() == "1":
        install(rank, barriers.quiet_from_env(), checked=True)


def uninstall() -> None:
    global _checked
    import torch.distributed as dist

    for name, original in _originals.items():
        setattr(dist, name, original)
    _originals.clear()
    _checked = False


# --- a cell on some ranks only ----------------------------------------------------------------


def refuse(name: str) -> None:
    """Raise :class:`ProcessGroupMismatch`: collective ``name`` of the whole group was
    called in a task that runs on some ranks only (it would wait for ever)."""
    __tracebackhide__ = True
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else -1
    where = barriers.caller_location()
    raise ProcessGroupMismatch(
        f"rank {rank} calls {name} at {where}, which needs every rank, but this cell runs "
        f"on ranks {list(_task_ranks)} only (ranks {list(outside)} do not run it). Run it "
        "on every rank, or make the collective use a subgroup (dist.new_group(ranks=...))."
    )


@contextlib.contextmanager
def task_scope(ranks: Sequence[int], world: int, backend: str, timeout_s: float) -> Iterator[None]:
    """For the time of a session's task that runs on ``ranks`` (empty: every rank): a
    collective of the whole group fails at once (see the module docstring); ``timeout_s``
    is the group's own timeout, restored at the end."""
    global outside, _task_ranks
    missing = tuple(r for r in range(world) if ranks and r not in ranks)
    if not missing:
        yield
        return
    outside, _task_ranks = missing, tuple(sorted(ranks))
    restore = _shorten_timeout(timeout_s) if backend == "gloo" else None
    try:
        yield
    except BaseException as exc:
        if restore is not None and _timed_out(exc):
            _report_stranded(exc)
        raise
    finally:
        outside, _task_ranks = (), ()
        if restore is not None:
            restore()


def _shorten_timeout(timeout_s: float) -> Callable[[], None] | None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized() or not hasattr(c10d, "_set_pg_timeout"):
        return None
    group = dist.group.WORLD
    before = timedelta(seconds=timeout_s)
    try:
        c10d._set_pg_timeout(timedelta(seconds=PARTIAL_TIMEOUT), group)
    except Exception:  # noqa: BLE001 - without it DDP's calls wait (the stall view shows them)
        return None

    def restore() -> None:
        try:
            c10d._set_pg_timeout(before, group)
        except Exception:  # noqa: BLE001 - a group re-formed meanwhile has its own timeout
            pass

    return restore


def _timed_out(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("Timed out" in text or "timed out" in text)


def _report_stranded(exc: BaseException) -> None:
    """A C++ collective of the whole group timed out in a cell on some ranks: say where
    (the user's innermost frame) as a wait that never ended, so that the kernel names it
    and re-forms the group (the collective may have left data in flight)."""
    tb, frame = exc.__traceback__, None
    while tb is not None:
        if not barriers._ours(tb.tb_frame.f_globals.get("__name__", "")) and not _library(
            tb.tb_frame.f_code.co_filename
        ):
            frame = tb.tb_frame
            line = tb.tb_lineno
        tb = tb.tb_next
    if frame is None:
        return
    import linecache

    import torch.distributed as dist

    filename = frame.f_code.co_filename
    source = linecache.getline(filename, line).strip()
    what = f"a collective of the whole group run by `{source}`" if source else "a collective"
    where = f"{barriers._short(filename)}:{line}"
    rank = dist.get_rank() if dist.is_initialized() else -1
    runtime.emit(BarrierEnter(rank, runtime.next_barrier_index(), where, what, time.time()))


def _library(filename: str) -> bool:
    from ..errors import library_module

    return library_module(filename) is not None


# --- checked collectives --------------------------------------------------------------------


def _describe_tensor(value: Any) -> str | None:
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return None
    return f"{str(dtype).replace('torch.', '')} {list(shape)}"


def fingerprint(name: str, params: list[str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """What must agree across ranks for collective ``name``: the tensors' dtypes and
    shapes (a list's length; objects only by count), the root rank and the reduce op."""
    bound = dict(zip(params, args, strict=False))
    bound.update(kwargs)
    parts = []
    for key, value in bound.items():
        if key in ("group", "async_op", "device", "device_ids", "timeout", "wait_all_ranks"):
            continue
        if key in ("src", "dst", "group_src", "group_dst"):
            if value is not None:
                parts.append(f"{key}={value}")
            continue
        if key == "op":
            parts.append(f"op={getattr(value, 'name', value)}")
            continue
        described = _describe_tensor(value)
        if described is not None:
            parts.append(described)
        elif isinstance(value, (list, tuple)):
            inner = [_describe_tensor(v) for v in value]
            if all(i is not None for i in inner) and inner:
                parts.append("[" + ", ".join(str(i) for i in inner) + "]")
            else:
                parts.append(f"{len(value)} objects")
    return ", ".join(parts)


class _Buffers(threading.local):
    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.send: Any = None
        self.recv: Any = None


_buffers = _Buffers()


def _digest(name: str, description: str) -> int:
    raw = hashlib.blake2b(repr(("raw:" + name, description)).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def check(name: str, description: str, location: str) -> None:
    """Compare this call with every rank's (one 256-byte exchange); raise
    :class:`DistributedOperationException` on every rank when they differ."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    group = dist.group.WORLD
    key = (id(group), world)
    if _buffers.key != key:
        _buffers.key = key
        _buffers.send = torch.zeros(PACKET, dtype=torch.uint8)
        _buffers.recv = torch.zeros(world * PACKET, dtype=torch.uint8)
    send, recv = _buffers.send, _buffers.recv
    digest = _digest(name, description)
    send[:8].view(torch.int64)[0] = digest
    base = getattr(group, "_allgather_base", None)
    if base is not None:
        base(recv, send).wait()
    else:
        gather = _originals.get("all_gather_into_tensor") or dist.all_gather_into_tensor
        gather(recv, send)
    digests = recv.view(world, PACKET)[:, :8].contiguous().view(torch.int64)[:, 0].tolist()
    if digests.count(digest) == world:
        return
    everyone: list[Any] = [None] * world
    gather_objects = _originals.get("all_gather_object") or dist.all_gather_object
    gather_objects(everyone, (name, f"{name}({description})", location))
    raise DistributedOperationException(mismatch_message(everyone))


def mismatch_message(entries: Sequence[Any], what: str = "") -> str:
    """Every rank's call: ``entries[i]`` is rank i's ``(op, description[, location])``."""
    ops = [e[0] if isinstance(e, (tuple, list)) and e else "?" for e in entries]
    if len(set(ops)) > 1:
        head = "The ranks called different collective operations at the same point: " + (
            ", ".join(f"process {i}: {o}" for i, o in enumerate(ops))
        )
    else:
        head = (
            f"The ranks called {ops[0]} with different inputs: "
            f"{per_rank([_part(e, 1) for e in entries])}. Every rank must pass the same "
            "shapes, dtypes, root and reduce op" + (f" ({what})" if what else "")
        )
    lines = [head, "", "Inputs:"]
    lines += [f"  - Process {i}: {_part(e, 1)}" for i, e in enumerate(entries)]
    if any(_part(e, 2) for e in entries):
        lines.append("Called at:")
        lines += [f"  - Process {i}: {_part(e, 2) or '?'}" for i, e in enumerate(entries)]
    return "\n".join(lines)


def per_rank(values: Sequence[str]) -> str:
    """Each rank's value in one line, ranks that agree sharing an entry: the headline of a
    mismatch, which is what a summary, the dashboard and a log show of it.

    >>> per_rank(["float32 [4]", "float32 [5]", "float32 [4]"])
    'processes 0, 2: float32 [4], process 1: float32 [5]'
    """
    groups: dict[str, list[int]] = {}
    for i, value in enumerate(values):
        groups.setdefault(value, []).append(i)
    return ", ".join(
        f"process {ranks[0]}: {value}"
        if len(ranks) == 1
        else f"processes {', '.join(map(str, ranks))}: {value}"
        for value, ranks in groups.items()
    )


def _part(entry: Any, i: int) -> str:
    if isinstance(entry, (tuple, list)) and len(entry) > i:
        value = entry[i]
        return value if isinstance(value, str) else repr(value).replace("'", "")
    return ""


__all__ = [
    "COLLECTIVES",
    "PARTIAL_TIMEOUT",
    "check",
    "fingerprint",
    "install",
    "install_for_launch",
    "mismatch_message",
    "per_rank",
    "refuse",
    "task_scope",
    "uninstall",
]
