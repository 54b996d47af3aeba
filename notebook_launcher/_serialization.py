"""cloudpickle in and out, and exceptions turned into data and back.

Functions and classes defined in a notebook cell live in ``__main__``, which a spawned
worker cannot import: cloudpickle ships them *by value*, so re-running a cell ships
the new definition. So does every module that only this process has (a script that
``runpy.run_path`` runs as ``<run_path>``: :func:`only_here`). Return values and exceptions come back with cloudpickle too.

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

**Exceptions.** :func:`dump_exception` turns a rank's exception into a
:class:`ShippedException`: the pickled exception (or, when its ``__init__`` cannot be
called again, its class, ``args`` and ``__dict__``), why it cannot travel when it
cannot, the frames it passed and its ``__cause__`` / ``__context__`` chain.
:func:`rebuild_exception` makes it an exception again in the kernel, whose
``__traceback__`` holds stand-in frames with the rank's file names, lines and function
names: IPython, ``traceback`` and pytest render them like local ones.
"""

from __future__ import annotations

import functools
import inspect
import io
import pickle
import sys
import threading
import traceback
import types
from collections import ChainMap, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import cloudpickle

from .errors import RankFailure, SerializationError, library_module, shorten

#: Warn when the shipped function (with everything it captures) is larger than this.
LARGE_PAYLOAD_BYTES = 100 * 1024 * 1024


def dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """Unpickle what :func:`dumps` made; classes this process already has stay as they are."""
    return _Unpickler(io.BytesIO(data)).load()


# --- code objects keep their names --------------------------------------------------------

_cp = cloudpickle.cloudpickle


def _rebuild_code(make: Callable[..., types.CodeType], args: tuple[Any, ...], filename: str) -> Any:
    """The code object cloudpickle rebuilds, under its own file name again."""
    code = make(*args)
    return code if code.co_filename == filename else code.replace(co_filename=filename)


def _reduce_code(code: types.CodeType) -> tuple[Any, ...]:
    """cloudpickle's reduction of a code object, with its ``co_filename`` kept.

    cloudpickle 3.1.3 names every code object it rebuilds ``<dynamic-code>`` (for
    deterministic payloads). The file name is what tracebacks, ``linecache`` and call
    sites use to say ``Cell In[2], line 7`` and show the line, so a function shipped to a
    rank (forkserver, spawn, sessions) must keep it. Nested code objects (inner functions,
    comprehensions) are reduced here too, each keeping its own name.
    """
    make, args = _CLOUDPICKLE_REDUCE_CODE(code)
    return _rebuild_code, (make, args, code.co_filename)


_CLOUDPICKLE_REDUCE_CODE = cloudpickle.Pickler.dispatch_table[types.CodeType]


class _Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, with code objects that keep their file names, and functions and
    classes of modules only this process has (:func:`only_here`) shipped by value."""

    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)

    def __init__(self, file: io.BytesIO, protocol: int) -> None:
        super().__init__(file, protocol=protocol)
        self._only_here: dict[str, bool] = {}

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (types.FunctionType, type)):
            name = getattr(obj, "__module__", None)
            here: bool | None = False
            if isinstance(name, str):
                here = self._only_here.get(name)
                if here is None:
                    here = self._only_here[name] = only_here(name)
            if here:
                # what cloudpickle does for __main__ (its private reducers, as in 3.0 to 3.1);
                # not register_pickle_by_value: that is process-wide, and other threads pickle
                if isinstance(obj, type):
                    return _cp._dynamic_class_reduce(obj)
                return self._dynamic_function_reduce(obj)
        return super().reducer_override(obj)


def only_here(module_name: str) -> bool:
    """Whether the module named ``module_name`` exists only in this process, made by running
    code rather than imported: a rank (spawn, forkserver, a session, another node) cannot import
    it, so what it defines must travel by value, as ``__main__``'s does (cloudpickle ships by
    reference whatever sits in a module of ``sys.modules``).

    ``runpy.run_path`` (``%run``-style script runners) runs a script as the module
    ``<run_path>`` (or the ``run_name`` given); ``exec`` into a hand-made module does the same.
    Such a module has no import spec, code ran in it (it has ``__builtins__``), and the import
    system cannot find its top-level package. (Extension submodules without a spec, like
    ``torch._C._nn``, come with their package in the rank: by reference, as before.)

    >>> import sys, types
    >>> sys.modules["made_here"] = made = types.ModuleType("made_here")
    >>> exec("def f(): pass", vars(made))
    >>> only_here("made_here"), only_here("json")
    (True, False)
    >>> del sys.modules["made_here"]
    """
    module = sys.modules.get(module_name)
    if module is None or module_name == "__main__" or getattr(module, "__spec__", None):
        return False  # unknown or __main__: cloudpickle ships by value already
    if "__builtins__" not in vars(module):
        return False  # no code ran in it: an extension's namespace
    top = module_name.partition(".")[0]
    if top in sys.builtin_module_names:
        return False
    return not _findable(top)


def _findable(top: str) -> bool:
    """Whether the import system finds the top-level module ``top`` (not from sys.modules)."""
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            if find_spec(top, None) is not None:
                return True
        except Exception:  # noqa: BLE001 - a finder that cannot answer: ask the next one
            continue
    return False


# --- class identity ------------------------------------------------------------------------

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
    if isinstance(obj.__module__, str) and only_here(obj.__module__):
        return True  # _Pickler ships it by value
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
            dumps(child)
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

#: How much of a message a rank's record keeps (the exception itself keeps all of it).
RECORD_CHARS = 4000
#: How many frames of one exception are rebuilt as stand-ins (the first and last halves).
MAX_FRAMES = 100
#: How deep a chain of ``__cause__`` / ``__context__`` is shipped.
MAX_CHAIN = 8


def safe_str(exc: BaseException) -> str:
    """``str(exc)``, or what Python's traceback module prints when ``__str__`` raises."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ is the user's exception's business
        return f"<exception str() failed: {type(exc).__name__} has a __str__ that raises>"


def type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}".removeprefix("builtins.")


def looks_collateral(exc: BaseException) -> bool:
    """True for errors that a rank gets when *another* rank went away mid-collective."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    text = shorten(safe_str(exc), RECORD_CHARS)  # (the markers open torch's messages)
    if "DistBackendError" in names or "DistNetworkError" in names:
        return True
    return any(m in text for m in _COLLATERAL_MARKERS) and (
        "gloo" in text.lower() or "nccl" in text.lower() or "DistError" in names
    )


def _user_frames(tb: types.TracebackType | None, skip_file: str | None) -> Any:
    """``tb`` without its leading frames from ``skip_file`` (the rank's entry)."""
    while tb is not None and skip_file and tb.tb_frame.f_code.co_filename == skip_file:
        tb = tb.tb_next
    return tb


def format_failure(exc: BaseException, tb: types.TracebackType | None) -> str:
    """The standard traceback text, every line cut to :data:`RECORD_CHARS` (a 20 MB
    message is in the exception, not repeated in its record)."""
    try:
        report = traceback.TracebackException(type(exc), exc, tb, compact=True)
        _shorten_messages(report)
        chunks = list(report.format())
    except Exception as err:  # noqa: BLE001 - e.g. a __cause__ whose __str__ raises oddly
        chunks = [f"{type_name(type(exc))}: <traceback could not be formatted: {err!r}>\n"]
    return "".join(c if len(c) <= RECORD_CHARS else shorten(c, RECORD_CHARS) + "\n" for c in chunks)


def _shorten_messages(report: traceback.TracebackException, depth: int = 0) -> None:
    """Cut each message of the chain before it is formatted (formatting a 20 MB line and
    cutting it afterwards costs tens of ms). ``_str`` is the message the module formats,
    in every Python this package supports; without it, the lines are cut afterwards."""
    text = getattr(report, "_str", None)
    if isinstance(text, str) and len(text) > RECORD_CHARS:
        report._str = shorten(text, RECORD_CHARS)  # type: ignore[attr-defined]
    for link in (report.__cause__, report.__context__):
        if link is not None and depth < MAX_CHAIN:
            _shorten_messages(link, depth + 1)


def exception_to_failure(
    exc: BaseException, rank: int, pid: int, now: float, skip_file: str | None = None
) -> RankFailure:
    """``skip_file``: leading frames from this file (the worker's own) are left out."""
    return RankFailure(
        rank=rank,
        kind="raised",
        pid=pid,
        exc_type=type_name(type(exc)),
        message=shorten(safe_str(exc), RECORD_CHARS),
        traceback=format_failure(exc, _user_frames(exc.__traceback__, skip_file)),
        collateral=looks_collateral(exc),
        time=now,
    )


@dataclass(frozen=True)
class Frame:
    """One frame a rank's exception passed through: plain data."""

    filename: str
    lineno: int
    name: str
    #: the standard library, an installed package or this launcher: folded away on display
    library: bool
    #: the first line of its code (a function's ``def``; 1 for a module or a cell): what
    #: renderers count from to find the frame's source
    firstlineno: int = 1
    #: its code is a module's, a cell's, or a class body (not a function's)
    module: bool = False


@dataclass(frozen=True)
class ShippedException:
    """A rank's exception on its way to the kernel (standard pickle: plain data and bytes)."""

    exc_type: str
    #: cloudpickled exception (or its class, args and ``__dict__``); None: it cannot travel
    data: bytes | None
    #: why ``data`` is None
    reason: str
    #: ``str(exc)`` in full, when ``data`` is None (else the exception holds it)
    message: str
    frames: tuple[Frame, ...]
    cause: ShippedException | None = None
    context: ShippedException | None = None
    suppress_context: bool = False


class _ExceptionState:
    """An exception as its class, ``args`` and ``__dict__`` (for an ``__init__`` with
    required arguments that ``args`` does not hold: ``cls(*args)`` would fail)."""

    def __init__(self, exc: BaseException) -> None:
        self.cls = type(exc)
        self.args = exc.args
        self.state = dict(getattr(exc, "__dict__", {}))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_exception_from_state, (self.cls, self.args, self.state))


def _exception_from_state(
    cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]
) -> BaseException:
    exc = cls.__new__(cls, *args)
    exc.args = args
    if state:
        exc.__dict__.update(state)
    return exc


def _default_reduction(cls: type) -> bool:
    """The class pickles as ``BaseException`` does (no ``__reduce__``/``__setstate__`` of
    its own): rebuilding it from ``args`` and ``__dict__`` is what pickle meant to do."""
    return (
        getattr(cls.__reduce__, "__qualname__", "") == "BaseException.__reduce__"
        and getattr(cls.__reduce_ex__, "__qualname__", "") == "object.__reduce_ex__"
        and getattr(getattr(cls, "__setstate__", None), "__qualname__", "")
        == "BaseException.__setstate__"
    )


def _why(err: BaseException) -> str:
    return f"{type(err).__name__}: {shorten(safe_str(err), 300)}"


def _unpicklable_attribute(exc: BaseException) -> str | None:
    for name, value in getattr(exc, "__dict__", {}).items():
        try:
            dumps(value)
        except Exception:  # noqa: BLE001 - looking for the culprit
            return f"its attribute {name!r} holds a {type_name(type(value))}"
    return None


def _pickle_exception(exc: BaseException) -> tuple[bytes | None, str]:
    """(data, "") or (None, why not). ``data`` is checked to load here too: many
    exceptions pickle but cannot be rebuilt (an ``__init__`` with required arguments);
    those are shipped as class, ``args`` and ``__dict__`` when the class pickles as
    ``BaseException`` does."""
    try:
        data = dumps(exc)
    except Exception as err:  # noqa: BLE001
        culprit = _unpicklable_attribute(exc)
        if culprit:
            return None, f"{culprit}, which cannot be pickled ({_why(err)})"
        first = f"it cannot be pickled ({_why(err)})"
    else:
        if type(exc).__module__ == "builtins":
            return data, ""  # Python's own exceptions rebuild from their pickle
        try:
            loads(data)
            return data, ""
        except Exception as err:  # noqa: BLE001
            first = f"it cannot be rebuilt from its pickle ({_why(err)})"
    if not _default_reduction(type(exc)):
        return None, f"{first}; its class defines its own pickling (__reduce__ or __setstate__)"
    try:
        data = dumps(_ExceptionState(exc))
        loads(data)
        return data, ""
    except Exception as err:  # noqa: BLE001
        again = _why(err)
        return None, f"{first}, nor from its args and __dict__" + (
            f" ({again})" if again not in first else ""
        )


def _frames(tb: types.TracebackType | None) -> tuple[Frame, ...]:
    frames = []
    while tb is not None:
        code = tb.tb_frame.f_code
        name = getattr(code, "co_qualname", code.co_name)
        lineno = tb.tb_lineno if tb.tb_lineno is not None else code.co_firstlineno
        library = bool(library_module(code.co_filename))
        module = code.co_name == "<module>" or not (code.co_flags & inspect.CO_NEWLOCALS)
        frames.append(Frame(code.co_filename, lineno, name, library, code.co_firstlineno, module))
        tb = tb.tb_next
    return tuple(frames)


def _ship(
    exc: BaseException, skip_file: str | None, seen: set[int], depth: int
) -> ShippedException:
    seen.add(id(exc))
    data, reason = _pickle_exception(exc)

    def link(other: BaseException | None) -> ShippedException | None:
        if other is None or id(other) in seen or depth >= MAX_CHAIN:
            return None
        return _ship(other, skip_file, seen, depth + 1)

    cause = link(exc.__cause__)
    context = None if exc.__suppress_context__ else link(exc.__context__)
    return ShippedException(
        exc_type=type_name(type(exc)),
        data=data,
        reason=reason,
        message="" if data is not None else safe_str(exc),
        frames=_frames(_user_frames(exc.__traceback__, skip_file)),
        cause=cause,
        context=context,
        suppress_context=exc.__suppress_context__,
    )


def dump_exception(exc: BaseException, skip_file: str | None = None) -> bytes | None:
    """The rank's exception as a pickled :class:`ShippedException`; ``skip_file`` as for
    :func:`exception_to_failure`. None only if even that fails (it holds plain data)."""
    try:
        return pickle.dumps(_ship(exc, skip_file, set(), 0), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - the record still tells the story
        return None


# --- back in the kernel --------------------------------------------------------------------


class _RaiseHere(Exception):
    pass


def _stand_in_frame(
    filename: str, lineno: int, name: str, hidden: bool, firstlineno: int = 1, module: bool = True
) -> tuple[types.FrameType, int]:
    """A finished frame (and its last instruction) whose code has ``filename`` and
    ``name``, starts at ``firstlineno`` and stopped at ``lineno``: traceback renderers read
    the file (the notebook's cells are in ``linecache``) and show that line, counting from
    the code's first line as for the rank's own frame (IPython reads a function's source
    from its ``def`` on). ``hidden``: ``__tracebackhide__`` (IPython and pytest fold the
    frame away; such a library frame stands in as module code, where the flag is a local).

    The ``raise`` spans two lines from column 0, so that ``traceback`` draws no carets
    under characters of the real line that this code does not have."""
    lineno = max(lineno, 1)
    first = min(max(firstlineno, 1), lineno)
    raise_here = "raise \\\n__raise_here__\n"
    namespace: dict[str, Any] = {"__name__": "__rank__", "__raise_here__": _RaiseHere()}
    if hidden:  # in a module frame's locals (its globals): library frames are folded
        namespace["__tracebackhide__"] = True
        module = True
    if module:  # a module's (a cell's) code: it starts at line 1
        code = compile("\n" * (lineno - 1) + raise_here, filename, "exec")
        run: Callable[[], Any] = functools.partial(exec, code, namespace)
    else:  # a function whose ``def`` is at ``first``, raising at ``lineno``
        gap = "\n" + "\n" * (lineno - first - 1) + " " if lineno > first else " "
        source = "\n" * (first - 1) + "def __stand_in__():" + gap + raise_here
        exec(compile(source, filename, "exec"), namespace)
        code = namespace.pop("__stand_in__").__code__
    code = code.replace(co_name=name.rpartition(".")[2] or name)
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=name)
    if not module:
        run = types.FunctionType(code, namespace)
    else:
        run = functools.partial(exec, code, namespace)
    try:
        run()  # a constant raise, for its frame
    except _RaiseHere as err:
        tb = err.__traceback__
        while tb is not None and tb.tb_frame.f_code is not code:
            tb = tb.tb_next
        assert tb is not None
        found = tb.tb_frame, tb.tb_lasti
        err.__traceback__ = None
    del namespace["__raise_here__"]
    return found


def stand_in_traceback(frames: tuple[Frame, ...]) -> types.TracebackType | None:
    """A traceback of stand-in frames for a rank's ``frames``: library frames are marked
    hidden (the frame where the error was raised always shows); a very deep one keeps its
    first and last :data:`MAX_FRAMES` // 2."""
    if len(frames) > MAX_FRAMES:
        frames = frames[: MAX_FRAMES // 2] + frames[-(MAX_FRAMES // 2) :]
    made = _stand_in_frames(frames)
    tb: types.TracebackType | None = None
    for f, found in zip(reversed(frames), reversed(made), strict=True):
        if found is not None:
            frame, lasti = found
            tb = types.TracebackType(tb, frame, lasti, f.lineno)
    return tb


#: Stand-in frames made so far (they are reused: a frame is never changed once made).
_STAND_INS: OrderedDict[tuple[Any, ...], tuple[types.FrameType, int]] = OrderedDict()
_STAND_INS_MAX = 2048
_stand_ins_lock = threading.Lock()


def _stand_in_frames(frames: tuple[Frame, ...]) -> list[tuple[types.FrameType, int] | None]:
    """The stand-ins for ``frames`` (None for one that cannot be made), made on a thread of
    their own.

    A frame that outlives its run keeps the frame that called it (``f_back``), and that
    one its caller, each with its variables: made here, the stand-ins would keep the
    kernel's whole stack alive with them -- the rank's pickled exception among it (three
    copies of a 200 MB exception). Made on a short-lived thread, they keep only it."""
    keys = [(f.filename, f.lineno, f.name, f.library, f.firstlineno, f.module) for f in frames]
    with _stand_ins_lock:
        missing = [k for k in dict.fromkeys(keys) if k not in _STAND_INS]
    if missing:
        made: dict[tuple[Any, ...], tuple[types.FrameType, int]] = {}

        def make() -> None:
            for key in missing:
                try:
                    made[key] = _stand_in_frame(*key)
                except Exception:  # noqa: BLE001 - e.g. a file name compile() refuses
                    continue

        maker = threading.Thread(target=make, name="notebook-launcher-frames", daemon=True)
        maker.start()
        maker.join()
        with _stand_ins_lock:
            _STAND_INS.update(made)
            while len(_STAND_INS) > _STAND_INS_MAX:
                _STAND_INS.popitem(last=False)
    with _stand_ins_lock:
        return [_STAND_INS.get(k) for k in keys]


@dataclass
class Rebuilt:
    """A rank's exception back in the kernel, or why it could not be rebuilt."""

    exc: BaseException | None
    #: why ``exc`` is None
    reason: str = ""
    #: the rank's frames as stand-ins (already ``exc.__traceback__`` when it was rebuilt)
    traceback: types.TracebackType | None = None
    #: the full message when ``exc`` is None
    message: str = ""


def _rebuild(shipped: ShippedException) -> Rebuilt:
    tb = stand_in_traceback(shipped.frames)
    if shipped.data is None:
        return Rebuilt(None, shipped.reason, tb, shipped.message)
    try:
        exc = loads(shipped.data)
    except Exception as err:  # noqa: BLE001 - whatever the class's own unpickling raises
        return Rebuilt(None, f"it could not be unpickled in the kernel ({_why(err)})", tb)
    if not isinstance(exc, BaseException):
        return Rebuilt(None, f"it unpickled as a {type(exc).__qualname__}", tb)
    exc = exc.with_traceback(tb)
    if shipped.cause is not None:
        exc.__cause__ = _link(shipped.cause)
    if shipped.context is not None:
        exc.__context__ = _link(shipped.context)
    exc.__suppress_context__ = shipped.suppress_context
    return Rebuilt(exc, traceback=tb)


def _link(shipped: ShippedException) -> BaseException:
    """A link of the chain; one that cannot be rebuilt is told as a RankFailedError."""
    from .errors import RankFailedError

    rebuilt = _rebuild(shipped)
    if rebuilt.exc is not None:
        return rebuilt.exc
    stand_in = RankFailedError(
        f"{shipped.exc_type}: {shorten(rebuilt.message)} (not rebuilt: {rebuilt.reason})"
    )
    return stand_in.with_traceback(rebuilt.traceback)


def rebuild_exception(data: bytes | None) -> Rebuilt:
    """The rank's own exception (from :func:`dump_exception`), its ``__traceback__`` the
    rank's frames as stand-ins, its chain rebuilt; or why it cannot be."""
    if data is None:
        return Rebuilt(None, "the rank could not describe it")
    try:
        shipped = pickle.loads(data)
    except Exception as err:  # noqa: BLE001 - a record from another version, say
        return Rebuilt(None, f"its record could not be read ({_why(err)})")
    if not isinstance(shipped, ShippedException):
        return Rebuilt(None, "its record could not be read")
    return _rebuild(shipped)


def load_task(data: bytes, rank: int) -> Any:
    """The ``(fn, args, kwargs)`` a rank received; :class:`SerializationError` naming the
    rank and the stage when it cannot be unpickled there (its cause: what failed)."""
    try:
        return loads(data)
    except Exception as exc:
        raise SerializationError(
            f"rank {rank} could not unpickle the launched function and its arguments "
            f"({_why(exc)}). They were pickled in the kernel; whatever they reach must "
            "also import and unpickle in a rank (a module on the rank's path, an object "
            "whose __setstate__ or __reduce__ works outside the kernel)."
        ) from exc
