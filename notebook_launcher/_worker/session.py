"""A session's rank: after its set-up it stays, and serves one task after another.

The rank keeps its process group, its state (``PartialState``), and a namespace that
``%%distributed`` cells run in (``rank``, ``local_rank``, ``world_size``, ``device``,
``state``, ``torch``, ``dist`` at hand). Each :class:`~notebook_launcher._wire.control.Run`
is one call; its outcome goes back as ``Returned``/``Raised`` tagged with the task id.

* **Interrupts**: SIGINT (sent to the main thread) raises ``KeyboardInterrupt`` in the
  task that runs; one that comes while the task is being unpickled starts it interrupted;
  between tasks it is ignored (an interrupt that arrives late must not kill the rank).
* **Failures**: the rank keeps the exception of its last failed task, so that code can run
  in the failing frame afterwards (:func:`post_mortem`), and sends a summary of that
  frame's variables with the failure.
* **Re-forming the process group** (:class:`~notebook_launcher._wire.control.Reform`):
  after a failed or interrupted task some rank may wait in a collective for a peer that
  moved on. Gloo cannot abort a collective in flight, but a peer whose connections end
  makes it fail at once: every rank shuts down its group's sockets (destroying the group
  does not close them while torch holds it), destroys it and joins a new one on the same
  store. Namespaces survive.

The functions the kernel ships by reference (:func:`run_cell`, :func:`push`, :func:`pull`,
:func:`post_mortem`) work on :func:`current`'s namespace.
"""

from __future__ import annotations

import ast
import builtins
import linecache
import os
import signal
import socket
import time
import types
from datetime import timedelta
from typing import Any

from .._events import WorkerFinished, WorkerStarted
from .._posix import socket_inodes
from .._serialization import dump_exception, dumps, exception_to_failure, load_task, safe_str
from .._spec import WorkerSpec
from .._wire.control import Channel, Raised, Reform, Reformed, Returned, Run, Shutdown
from . import collectives, runtime

_current: RankSession | None = None

#: Variables summarised per failure, and the longest summary of one.
MAX_LOCALS = 40
MAX_LOCAL_CHARS = 160
#: The longest ``repr`` a cell's last expression sends back.
MAX_REPR_CHARS = 10_000


def current() -> RankSession:
    if _current is None:
        raise RuntimeError("this is not a rank of a notebook_launcher session")
    return _current


class RankSession:
    def __init__(self, spec: WorkerSpec, channel: Channel, store: Any, device: str) -> None:
        self.spec = spec
        self.channel = channel
        self.store = store
        self.device = device
        self.generation = 0
        #: inodes of the sockets of the current process group (see _join)
        self.group_sockets: set[str] = set()
        self.running = False
        #: a Run was received and its outcome not yet sent; an interrupt then is for it
        self.in_task = False
        self.interrupt_pending = False
        self.last_error: BaseException | None = None
        self.namespace = self._namespace()

    def _namespace(self) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        from ..state import PartialState

        return {
            "__name__": "__main__",
            "__builtins__": builtins,
            "rank": self.spec.rank,
            "local_rank": self.spec.local_rank,
            "world_size": self.spec.world_size,
            "device": torch.device(self.device),
            "state": PartialState(),
            "torch": torch,
            "dist": dist,
        }

    # -- the loop -------------------------------------------------------------------------

    def serve(self) -> int:
        global _current
        _current = self
        signal.signal(signal.SIGINT, self._on_sigint)
        collectives.install(self.spec.rank, checked=True)
        self._join(0)  # a group whose connections this rank knows (see _reform)
        self._send(Reformed(0))  # serving, in group generation 0: the session is ready
        while True:
            try:
                message = self.channel.recv()
            except KeyboardInterrupt:  # a late interrupt, between tasks: nothing to stop
                continue
            except (EOFError, OSError):
                return 0  # the kernel went away
            if isinstance(message, Run):
                self._run(message)
            elif isinstance(message, Reform):
                self._reform(message.generation)
            elif isinstance(message, Shutdown):
                return 0

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self.running:
            raise KeyboardInterrupt
        if self.in_task:  # the task has not started yet (its data is being unpickled):
            self.interrupt_pending = True  # it starts interrupted

    def _run(self, message: Run) -> None:
        self.in_task, self.interrupt_pending = True, False
        try:
            self._run_task(message)
        finally:
            self.in_task = False

    def _run_task(self, message: Run) -> None:
        spec, pid = self.spec, os.getpid()
        runtime.reset_barrier_count()
        runtime.emit(WorkerStarted(spec.rank, spec.local_rank, pid, self.device, time.time()))
        fn: Any = None
        try:
            fn, args, kwargs = load_task(message.data, spec.rank)
            self.running = True
            try:
                if self.interrupt_pending:
                    raise KeyboardInterrupt
                # a cell on some ranks: a collective of the whole group fails at once
                with collectives.task_scope(
                    message.ranks, spec.world_size, spec.backend, spec.pg_timeout_s
                ):
                    result = fn(*args, **kwargs)
            finally:
                self.running = False
            data = _dumps_result(result, spec.rank)
        except BaseException as exc:  # noqa: BLE001 - every failure is the task's
            self.running = False
            if fn not in _INSPECTING:  # a typo while looking must not lose what we look at
                self.last_error = exc
            runtime.flush_output()
            failure = exception_to_failure(exc, spec.rank, pid, time.time(), skip_file=__file__)
            raised = Raised(failure, dump_exception(exc), message.task, summarise_locals(exc))
            self._send(raised)
            return
        runtime.flush_output()
        runtime.emit(WorkerFinished(spec.rank, time.time(), runtime.barriers_entered()))
        self._send(Returned(data, message.task))

    def _send(self, message: Any) -> None:
        """Send an answer (never interrupted: SIGINT only raises while a task runs), under
        the lock of :func:`runtime.emit`: the barrier watchdog thread may be sending an
        event at the same moment, and two frames must not interleave."""
        runtime.send(message)

    def _reform(self, generation: int) -> None:
        self._join(generation)
        self._send(Reformed(generation))

    def _join(self, generation: int) -> None:
        """Leave the current process group and join generation ``generation`` of a new one,
        on the same store.

        Leaving must free any peer stuck in a collective of the old group. Destroying the
        group is not enough: torch keeps a gloo group alive (its connections open) once
        anything holds it -- creating an optimizer is enough -- and gloo's ``abort`` does
        not close them either. So the rank shuts down the old group's sockets itself: it
        noted which sockets appeared while it joined (not the store's, never one of the
        kernel's that a forked rank inherited), and a peer waiting on one of them fails at
        once. The old group's objects keep their (dead) descriptors until they are freed.
        """
        import torch.distributed as dist

        spec = self.spec
        if dist.is_initialized():
            if spec.backend == "gloo":
                _shut_down_sockets(self.group_sockets)
            else:
                try:
                    dist.group.WORLD.abort()  # type: ignore[union-attr]  # NCCL: its communicators
                except Exception:  # noqa: BLE001 - best effort; destroying follows
                    pass
            dist.destroy_process_group()
        before = socket_inodes()
        store = dist.PrefixStore(f"notebook_launcher/reform/{generation}", self.store)
        dist.init_process_group(
            spec.backend,
            store=store,
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.pg_timeout_s),
        )
        self.group_sockets = socket_inodes() - before
        self.generation = generation


def _shut_down_sockets(inodes: set[str]) -> None:
    """``shutdown(SHUT_RDWR)`` the sockets with these inodes: their peers see the
    connection end. Descriptors stay open (their owner closes them)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}")[8:-1] not in inodes:
                continue
            sock = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            # Never a listener: gloo's accept loop would abort the process.
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected, or already down
            pass
        finally:
            sock.close()


def serve(spec: WorkerSpec, channel: Channel, store: Any, device: str) -> int:
    """Serve tasks until the kernel says :class:`Shutdown` (or goes away)."""
    return RankSession(spec, channel, store, device).serve()


def _dumps_result(result: Any, rank: int) -> bytes:
    try:
        return dumps(result)
    except Exception as exc:
        from ..errors import SerializationError

        raise SerializationError(
            f"rank {rank} returned a {type(result).__module__}.{type(result).__qualname__}, "
            f"which cannot be pickled back to the notebook ({type(exc).__name__}: {exc}). "
            "Keep it in the rank (assign it to a variable in a %%distributed cell) and pull "
            "what can travel."
        ) from exc


# --- what a failure leaves to look at --------------------------------------------------------

_LIBRARY_MARKERS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def _users_frame(exc: BaseException) -> types.FrameType | None:
    """The innermost frame of the traceback that is the user's (a cell, a script), not the
    launcher's, a library's or the standard library's; None when the failure happened
    before any code of the user's ran (its variables would be ``ast.parse``'s, or
    unpickling's)."""
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    stdlib = os.path.dirname(os.__file__)
    tb, found = exc.__traceback__, None
    while tb is not None:
        frame = tb.tb_frame
        name = frame.f_code.co_filename
        if not (
            name.startswith(ours)
            or name.startswith(stdlib)
            or any(m in name for m in _LIBRARY_MARKERS)
        ):
            found = frame
        tb = tb.tb_next
    return found


def describe_value(value: Any) -> str:
    """``type`` and what matters of a value, in one short line (tensors: shape, dtype,
    device; numbers and short strings: the value; containers: their length)."""
    kind = type(value).__qualname__
    shape = getattr(value, "shape", None)
    if shape is not None and hasattr(value, "dtype"):
        device = getattr(value, "device", None)
        dims = "x".join(str(d) for d in tuple(shape)) or "scalar"
        text = f"{kind} {dims} {value.dtype}" + (f" on {device}" if device is not None else "")
        return text.replace("torch.", "")
    if isinstance(value, (bool, int, float, complex)) or value is None:
        return f"{kind} = {value!r}"
    if isinstance(value, (str, bytes)):
        short = repr(value[:60]) + ("..." if len(value) > 60 else "")
        return f"{kind} = {short}"
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return f"{kind} of {len(value)}"
    if kind == "device" and type(value).__module__ == "torch":
        return f"device = {value}"
    return kind


_DEFINITIONS = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def summarise_locals(exc: BaseException) -> tuple[str, ...]:
    """``name: description`` for the variables of the user's failing frame."""
    frame = _users_frame(exc)
    if frame is None:
        return ()
    rows: list[str] = []
    # A cell's own code runs at the namespace's top level: there its data is what matters,
    # not what it defined or imported, nor IPython's ``_``.
    top_level = frame.f_locals is frame.f_globals
    for name, value in list(frame.f_locals.items()):
        if len(rows) == MAX_LOCALS:
            break
        if name.startswith("__") or isinstance(value, types.ModuleType):
            continue
        if top_level and (name.startswith("_") or isinstance(value, _DEFINITIONS)):
            continue
        try:
            text = describe_value(value)
        except Exception:  # noqa: BLE001 - a value whose attributes raise
            text = type(value).__qualname__
        rows.append(f"{name}: {text}"[:MAX_LOCAL_CHARS])
    return tuple(rows)


# --- functions the kernel ships by reference -------------------------------------------------


def _execute(source: str, filename: str, scope: dict[str, Any]) -> Any:
    """Run ``source`` in ``scope`` as IPython runs a cell; the value of its last
    expression (None when the cell ends with a statement)."""
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)  # tracebacks show it
    tree = ast.parse(source, filename, "exec")
    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    if last is not None:
        tree.body.pop()
    exec(compile(tree, filename, "exec"), scope)
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), filename, "eval"), scope)


def _shown(value: Any) -> str | None:
    if value is None:
        return None
    text = repr(value)
    return text if len(text) <= MAX_REPR_CHARS else text[:MAX_REPR_CHARS] + " ..."


def run_cell(source: str, filename: str) -> str | None:
    """Run a ``%%distributed`` cell in the rank's namespace; the ``repr`` of its last
    expression (``None`` when there is none, or it is ``None``), as IPython shows it."""
    namespace = current().namespace
    value = _execute(source, filename, namespace)
    if value is not None:
        namespace["_"] = value
    return _shown(value)


def push(values: dict[str, Any]) -> None:
    """Bind ``values`` in the rank's namespace."""
    current().namespace.update(values)


def pull(name: str) -> Any:
    """The value of ``name`` in the rank's namespace."""
    namespace = current().namespace
    if name not in namespace:
        raise NameError(f"name {name!r} is not defined on rank {namespace['rank']}")
    return namespace[name]


def post_mortem(source: str, filename: str) -> str | None:
    """Run ``source`` in the frame where this rank's last failure happened (its globals
    and a copy of its locals, as pdb's ``interact`` does); ``repr`` of the last expression."""
    session = current()
    error = session.last_error
    if error is None:
        raise RuntimeError(f"rank {session.spec.rank} has no failure to look into")
    frame = _users_frame(error)
    if frame is None:
        raise RuntimeError(
            f"rank {session.spec.rank}'s last failure ({type(error).__name__}: "
            f"{safe_str(error)[:200]}) happened before any of your code ran: there is no "
            "frame of yours to look into"
        )
    return _shown(_execute(source, filename, {**frame.f_globals, **frame.f_locals}))


#: Tasks that look at the rank's state: their own failures keep the last one to inspect.
_INSPECTING = (post_mortem, pull)

__all__ = [
    "RankSession",
    "current",
    "describe_value",
    "post_mortem",
    "pull",
    "push",
    "run_cell",
    "serve",
    "summarise_locals",
]
