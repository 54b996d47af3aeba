"""The control channel between the kernel and one rank.

Each rank has a private ``AF_UNIX`` socketpair with the kernel (inherited, never a
listener). Frames are ``multiprocessing.connection`` messages holding one standard pickle
of one message object below (payloads that need cloudpickle -- the user's function, its
results, its exceptions -- travel inside as ``bytes``, pickled by ``_serialization``)::

    kernel                                        rank
      ---- Setup(spec) --------------------------->   only when the rank did not inherit it
      ---- Task(data) ---------------------------->   (fork: the child inherits the task)
      <--- any _events event ----------------------   progress, barriers, started/finished
      <--- Returned(data) | Raised(failure, exc) ---   how the function ended

A session's rank (``spec.session``) stays after its first task and serves more::

      ---- Run(task, data) ----------------------->   one call: (fn, args, kwargs)
      <--- Returned(data, task) | Raised(.., task) -
      ---- Reform(generation) -------------------->   replace a broken process group
      <--- Reformed(generation) -------------------
      ---- Shutdown() ----------------------------->   leave cleanly
      ~~~~ SIGINT (a signal, not a message) ~~~~~~~>   interrupt the task that runs

Events travel bare (they are the hot path: progress bars and barriers); everything else is
one of the classes here, so the kernel dispatches on type, never on strings.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .._spec import WorkerSpec
from ..errors import RankFailure

# --- kernel -> rank ------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """Who the rank is (sent first when it did not inherit its spec)."""

    spec: WorkerSpec


@dataclass(frozen=True)
class Task:
    """The function to run with its arguments: cloudpickled ``(fn, args, kwargs)``."""

    data: bytes


@dataclass(frozen=True)
class Run:
    """A session's task: call cloudpickled ``(fn, args, kwargs)``; ``fn`` may take the
    rank's namespace (see ``_worker.session``). ``ranks``: the ranks that run it (empty:
    every rank); a collective of the whole group on fewer ranks fails at once."""

    task: int
    data: bytes
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Reform:
    """Destroy this rank's process group and join generation ``generation`` of a new one.

    Sent after a task failed or was interrupted while ranks may wait in a collective: an
    idle rank closing its connections makes a peer's pending collective fail at once."""

    generation: int


@dataclass(frozen=True)
class Shutdown:
    """Leave the serve loop and exit 0."""


# --- rank -> kernel ------------------------------------------------------------------------


@dataclass(frozen=True)
class Returned:
    """The function returned; ``data`` is its cloudpickled value."""

    data: bytes
    task: int = 0


@dataclass(frozen=True)
class Raised:
    """The function raised: the record, and the pickled exception when it can travel.

    ``local_vars``: the failing frame's variables, summarised (``name: type [shape]``)."""

    failure: RankFailure
    exc_data: bytes | None
    task: int = 0
    local_vars: tuple[str, ...] = ()


@dataclass(frozen=True)
class Reformed:
    """This rank joined process-group generation ``generation``."""

    generation: int


def encode(message: Any) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    return pickle.loads(data)


class Channel:
    """One end of a control channel: ``send(message)`` and ``recv() -> message``."""

    def __init__(self, conn: Connection) -> None:
        self.conn: Connection | _Closed = conn

    def send(self, message: Any) -> None:
        self.conn.send_bytes(encode(message))

    def recv(self) -> Any:
        return decode(self.conn.recv_bytes())

    def poll(self, timeout: float = 0.0) -> bool:
        return self.conn.poll(timeout)

    def fileno(self) -> int:
        return self.conn.fileno()

    def close(self) -> None:
        """Close it and let the Connection go here: its ``__del__`` (Python code, where a
        Ctrl-C can land and be printed as "Exception ignored") runs now, inside the caller's
        ``deferred_interrupts`` block, not wherever the last reference would have died."""
        conn, self.conn = self.conn, _CLOSED
        conn.close()
        del conn


class _Closed:
    """What a closed Channel holds: every use fails as a closed Connection's does."""

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise OSError("handle is closed")


_CLOSED = _Closed()


__all__ = [
    "Channel",
    "Raised",
    "Reform",
    "Reformed",
    "Returned",
    "Run",
    "Setup",
    "Shutdown",
    "Task",
    "decode",
    "encode",
]
