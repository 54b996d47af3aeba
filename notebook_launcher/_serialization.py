"""cloudpickle in and out, and exceptions turned into data and back.

Functions and classes defined in a notebook cell live in ``__main__``, which a spawned
worker cannot import: cloudpickle ships them *by value*, so re-running a cell ships
the new definition. Return values and exceptions come back with cloudpickle too.

**Class identity.** A class shipped by value is rebuilt as a new class object unless
cloudpickle's class tracker knows it: each such class gets a tracker id when it is first
pickled, and unpickling an id that is already known returns the known class. So a
``MyError`` defined in the notebook and raised by a rank is the notebook's own ``MyError``
in the kernel (``except MyError`` catches it) when the kernel gave it its id before the
rank pickled it back:

* forkserver / spawn: the kernel pickles the task, which gives every notebook class it
  reaches an id; the rank rebuilds them under the same ids;
* fork: nothing is pickled on the way in, so :func:`share_class_identities` gives the
  kernel's notebook classes their ids just before the fork; the child inherits them.

On the way back :func:`loads` returns a class the kernel already has *as it is*:
cloudpickle would also overwrite its methods with the rank's copies (whose globals are a
snapshot, so the notebook's later changes to a global would no longer reach them).
"""

from __future__ import annotations

import functools
import io
import pickle
import sys
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import cloudpickle

from .errors import RankFailure, RemoteTraceback, SerializationError

#: Warn when the shipped function (with everything it captures) is larger than this.
LARGE_PAYLOAD_BYTES = 100 * 1024 * 1024


def dumps(obj: Any) -> bytes:
    return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    """Unpickle what :func:`dumps` made; classes this process already has stay as they are."""
    return _Unpickler(io.BytesIO(data)).load()


# --- class identity ------------------------------------------------------------------------

_cp = cloudpickle.cloudpickle
#: cloudpickle's private class tracker (present since cloudpickle 1.1; checked, not assumed)
_TRACKER_BY_ID: Any = getattr(_cp, "_DYNAMIC_CLASS_TRACKER_BY_ID", None)
_tracker_id: Callable[[type], str] | None = getattr(_cp, "_get_or_create_tracker_id", None)
#: cloudpickle reconstructor -> position of the class tracker id in its arguments
_SKELETONS = {"_make_skeleton_class": 4, "_make_skeleton_enum": 5}


class _Unpickler(pickle.Unpickler):
    """Returns a tracked class that exists here unchanged (no ``_class_setstate``)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self._known: list[type] = []

    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] == "cloudpickle" and _TRACKER_BY_ID is not None:
            if name in _SKELETONS:
                return functools.partial(self._class, getattr(_cp, name), _SKELETONS[name])
            if name == "_class_setstate":
                return self._class_setstate
        return super().find_class(module, name)

    def _class(self, make: Callable[..., type], at: int, *args: Any) -> type:
        tracker_id = args[at] if len(args) > at else None
        known = _TRACKER_BY_ID.get(tracker_id) if tracker_id is not None else None
        if known is not None:
            self._known.append(known)
            return known
        return make(*args)

    def _class_setstate(self, obj: type, state: Any) -> type:
        if any(obj is k for k in self._known):
            return obj
        return _cp._class_setstate(obj, state)


def _is_dynamic_class(obj: Any) -> bool:
    if not isinstance(obj, type):
        return False
    try:
        return not _cp._should_pickle_by_reference(obj)
    except Exception:  # noqa: BLE001 - cloudpickle's private helper changed: be safe
        return obj.__module__ == "__main__"


def share_class_identities(*roots: Any) -> int:
    """Give the kernel's notebook classes (those cloudpickle ships by value) their tracker
    ids, so that a forked rank pickles them back as the kernel's own classes.

    Looks at ``__main__``, the namespaces and closures of the callables in ``roots``,
    and classes nested in those classes. A class made *inside* the launched function is
    new in every rank and comes back as a new class, as with any start method. Returns
    how many classes were tracked (cheap: a notebook's globals, not every class).
    """
    if _tracker_id is None:
        return 0
    spaces: dict[int, Iterable[Any]] = {}
    main = sys.modules.get("__main__")
    if main is not None:
        spaces[id(vars(main))] = list(vars(main).values())
    values: list[Any] = list(roots)
    for root in roots:
        globs = getattr(root, "__globals__", None)
        if isinstance(globs, dict) and id(globs) not in spaces:
            spaces[id(globs)] = list(globs.values())
        for cell in getattr(root, "__closure__", None) or ():
            try:
                values.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    for space in spaces.values():
        values.extend(space)
    seen: set[int] = set()
    stack = [v for v in values if isinstance(v, type)]
    tracked = 0
    while stack:
        cls = stack.pop()
        if id(cls) in seen:
            continue
        seen.add(id(cls))
        if not _is_dynamic_class(cls):
            continue
        _tracker_id(cls)
        tracked += 1
        stack.extend(v for v in vars(cls).values() if isinstance(v, type))
    return tracked


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
        loads(data)  # must also rebuild: many exceptions pickle but cannot be rebuilt
        return data
    except Exception:  # noqa: BLE001
        return None


def rebuild_exception(data: bytes | None, failure: RankFailure) -> BaseException | None:
    """The rank's own exception object with its traceback attached as ``__cause__``."""
    if data is None:
        return None
    try:
        exc = loads(data)
    except Exception:  # noqa: BLE001 - e.g. the class is not importable in the kernel
        return None
    if not isinstance(exc, BaseException):
        return None
    exc.__cause__ = RemoteTraceback(failure.rank, failure.traceback)
    return exc
