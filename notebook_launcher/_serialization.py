"""cloudpickle in and out, and exceptions turned into data and back.

Functions and classes defined in a notebook cell live in ``__main__``, which a spawned
worker cannot import: cloudpickle ships them *by value*, so re-running a cell ships
the new definition. Return values and exceptions come back with cloudpickle too.
"""

from __future__ import annotations

import io
import pickle
import traceback
from typing import Any

import cloudpickle

from .errors import RankFailure, RemoteTraceback, SerializationError

#: Warn when the shipped function (with everything it captures) is larger than this.
LARGE_PAYLOAD_BYTES = 100 * 1024 * 1024


def dumps(obj: Any) -> bytes:
    return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


def _describe(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


def _find_unpicklable(obj: Any, path: str, depth: int = 0) -> str:
    """Walk containers (and a function's globals/closure) to name the part that fails."""
    if depth > 4:
        return path
    children: list[tuple[str, Any]] = []
    if isinstance(obj, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif callable(obj) and hasattr(obj, "__code__"):
        code = obj.__code__
        globs = getattr(obj, "__globals__", {})
        children = [(f"{path}.<global {n}>", globs[n]) for n in code.co_names if n in globs]
        for name, cell in zip(code.co_freevars, obj.__closure__ or (), strict=False):
            try:
                children.append((f"{path}.<closure {name}>", cell.cell_contents))
            except ValueError:
                continue
    for child_path, child in children:
        try:
            cloudpickle.dumps(child)
        except Exception:  # noqa: BLE001 - we are looking for the culprit
            return _find_unpicklable(child, child_path, depth + 1)
    return path


def dumps_checked(obj: Any, what: str, rank: int | None = None) -> bytes:
    """Pickle ``obj`` or raise :class:`SerializationError` naming the part that fails."""
    try:
        return dumps(obj)
    except Exception as exc:
        culprit = _find_unpicklable(obj, what)
        where = f" on rank {rank}" if rank is not None else ""
        raise SerializationError(
            f"Cannot pickle {culprit}{where} ({type(exc).__name__}: {exc}). "
            "Objects that hold OS resources (open files, locks, sockets, CUDA streams, "
            "process groups) cannot be sent between processes: create them inside the "
            "function, or pass what is needed to rebuild them (a path, a config)."
        ) from exc


def payload_size_warning(nbytes: int, limit: int | None = None) -> str | None:
    if nbytes <= (LARGE_PAYLOAD_BYTES if limit is None else limit):
        return None
    return (
        f"The launched function and its arguments pickle to {nbytes / 2**20:.0f} MiB: each "
        "worker receives a copy. Load large data inside the function instead of capturing it."
    )


# --- exceptions --------------------------------------------------------------------------

_COLLATERAL_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket closed",
    "connection closed",
    "Connection refused",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL is aborted",
    "Timed out waiting",
)


def looks_collateral(exc: BaseException) -> bool:
    """True for errors that a rank gets when *another* rank went away mid-collective."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    text = str(exc)
    if "DistBackendError" in names or "DistNetworkError" in names:
        return True
    return any(m in text for m in _COLLATERAL_MARKERS) and (
        "gloo" in text.lower() or "nccl" in text.lower() or "DistError" in names
    )


def exception_to_failure(
    exc: BaseException, rank: int, pid: int, now: float, skip_file: str | None = None
) -> RankFailure:
    """``skip_file``: leading frames from this file (the worker's own) are left out."""
    frames = exc.__traceback__
    while frames is not None and skip_file and frames.tb_frame.f_code.co_filename == skip_file:
        frames = frames.tb_next
    tb = "".join(traceback.format_exception(type(exc), exc, frames))
    return RankFailure(
        rank=rank,
        kind="raised",
        pid=pid,
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        message=str(exc),
        traceback=tb,
        collateral=looks_collateral(exc),
        time=now,
    )


def dump_exception(exc: BaseException) -> bytes | None:
    """Pickle the exception itself (without traceback); None when it cannot travel."""
    try:
        data = dumps(exc)
        pickle.loads(data)  # must also rebuild: many exceptions pickle but cannot be rebuilt
        return data
    except Exception:  # noqa: BLE001
        return None


def rebuild_exception(data: bytes | None, failure: RankFailure) -> BaseException | None:
    """The rank's own exception object with its traceback attached as ``__cause__``."""
    if data is None:
        return None
    try:
        exc = pickle.load(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - e.g. the class is not importable in the kernel
        return None
    if not isinstance(exc, BaseException):
        return None
    exc.__cause__ = RemoteTraceback(failure.rank, failure.traceback)
    return exc
