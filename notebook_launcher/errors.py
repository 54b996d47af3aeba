"""Errors the launcher raises, and the per-rank failure records behind them.

A launch that fails raises, in the caller:

* the failing rank's **own exception type** (e.g. ``ValueError``) when a rank raised
  and that exception could be rebuilt in the parent; its ``__cause__`` is a
  :class:`RemoteTraceback` holding the worker's traceback, and the exception carries
  ``exc.launch_failure`` (a :class:`LaunchFailure`) with every rank's record;
* :class:`WorkerDied` when a rank exited or was killed without raising;
* :class:`ProcessGroupMismatch` when a rank returned while others still waited for it
  in a collective;
* :class:`LaunchError` for everything else (and as the base of the above).

Every exception here that carries fields defines ``__reduce__`` so it survives pickling.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class LaunchError(RuntimeError):
    """A launch could not start, or one of its ranks failed."""


class PreflightError(LaunchError, ValueError):
    """A problem found before any worker started: nothing was launched."""


class SerializationError(LaunchError, TypeError):
    """Something could not be shipped between the kernel and a worker."""


class LargePayloadWarning(UserWarning):
    """The launched function (with what it captures) is large: every worker gets a copy."""


class DistributedOperationException(RuntimeError):
    """Ranks called a collective with incompatible inputs (shapes, dtypes, order)."""


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank: plain data, safe to pickle and to show."""

    rank: int
    kind: str  # "raised" | "died" | "left" | "stopped"
    pid: int | None = None
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    exitcode: int | None = None
    signal_name: str | None = None
    collateral: bool = False
    time: float = 0.0
    #: what the launcher knows of a death that the exit code does not say (e.g. "it died
    #: while receiving its task"; "its forkserver process died")
    context: str = ""

    def describe(self) -> str:
        if self.kind == "raised":
            return f"rank {self.rank} raised {self.exc_type}: {self.message}"
        if self.kind == "died":
            how = (
                f"killed by {self.signal_name}({self.exitcode})"
                if self.signal_name
                else f"exit code {self.exitcode}"
            )
            return f"rank {self.rank} (pid {self.pid}) died: {how}"
        if self.kind == "left":
            waiting = self.message or "other ranks still waited for it"
            return f"rank {self.rank} returned while {waiting}"
        return f"rank {self.rank} was stopped by the launcher"


@dataclass
class LaunchFailure:
    """Every rank's record of a failed launch; ``root_cause`` is the rank to look at."""

    root_cause: RankFailure
    failures: list[RankFailure] = field(default_factory=list)
    world_size: int = 0

    @property
    def collateral(self) -> list[RankFailure]:
        return [f for f in self.failures if f is not self.root_cause and f.kind != "stopped"]

    def summary(self) -> str:
        lines = [f"Root cause: {self.root_cause.describe()}"]
        others = self.collateral
        if others:
            lines.append("Collateral (a consequence of the root cause, not a separate bug):")
            lines += [f"  - {f.describe()}" for f in others]
        stopped = [f.rank for f in self.failures if f.kind == "stopped"]
        if stopped:
            lines.append(f"Stopped by the launcher: ranks {stopped}")
        return "\n".join(lines)


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, shown as the ``__cause__``."""

    def __init__(self, rank: int, tb: str) -> None:
        super().__init__(rank, tb)
        self.rank = rank
        self.tb = tb

    def __str__(self) -> str:
        return f"\n\nTraceback from rank {self.rank} (most recent call last):\n{self._body()}"

    def _body(self) -> str:
        body = self.tb
        prefix = "Traceback (most recent call last):\n"
        return body[len(prefix) :] if body.startswith(prefix) else body

    def __reduce__(self) -> tuple[type, tuple[int, str]]:
        return (RemoteTraceback, (self.rank, self.tb))

    def _render_traceback_(self) -> list[str]:
        """IPython calls this to render the exception: show the worker's own traceback."""
        return [f"Traceback from rank {self.rank} (most recent call last):", self._body()]


class RankFailedError(LaunchError):
    """A rank raised an exception that could not be rebuilt in the kernel."""

    def __init__(self, message: str, failure: LaunchFailure | None = None) -> None:
        super().__init__(message)
        self.launch_failure = failure

    def __reduce__(self) -> tuple[type, tuple[str, LaunchFailure | None]]:
        return (type(self), (str(self), self.launch_failure))


class WorkerDied(RankFailedError):
    """A rank's process ended (exit code, signal) without raising an exception."""


class ProcessGroupMismatch(RankFailedError):
    """A rank left the function while other ranks still waited for it in a collective."""


class SessionBroken(LaunchError):
    """A session's ranks can no longer run cells together (a rank died, or one did not
    stop when asked). ``session.restart()`` (``%dist restart``) brings up fresh ranks."""


def signal_name(returncode: int | None) -> str | None:
    """``-9`` -> ``"SIGKILL"``; ``None`` for normal exit codes."""
    import signal

    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


__all__ = [
    "DistributedOperationException",
    "LaunchError",
    "LaunchFailure",
    "LargePayloadWarning",
    "PreflightError",
    "ProcessGroupMismatch",
    "RankFailedError",
    "RankFailure",
    "RemoteTraceback",
    "SerializationError",
    "SessionBroken",
    "WorkerDied",
    "signal_name",
]
