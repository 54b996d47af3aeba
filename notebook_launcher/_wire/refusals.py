"""Connections turned away, counted and logged without flooding the cell.

The hub (the agents' channel) and the store's proxy both refuse whoever cannot prove the
job's secret. A port scan or a flood must not print a warning per connection into the
notebook: the first few are logged one by one, then one line at most every ``every``
seconds says how many more were refused since (and :meth:`Refusals.flush` says the rest,
when the listener closes). Plain bookkeeping: no socket, no thread."""

from __future__ import annotations

import logging
import time


class Refusals:
    """``first``: the log line of one refusal (``peer``, ``why``); ``more``: the summary of
    a flood (how many more, how many in all, the last ``peer: why``)."""

    def __init__(
        self,
        log: logging.Logger,
        first: str,
        more: str,
        one_by_one: int,
        kept: int = 1,
        every: float = 10.0,
    ) -> None:
        self._log, self._first, self._more = log, first, more
        self._one_by_one, self._kept, self._every = one_by_one, kept, every
        #: connections refused in all
        self.count = 0
        #: the last ``kept`` refusals, ``peer: why``
        self.last: list[str] = []
        self._unlogged = 0
        self._summary_at = 0.0

    def note(self, peer: str, why: str) -> None:
        self.count += 1
        self.last.append(f"{peer}: {why}")
        del self.last[: -self._kept]
        if self.count <= self._one_by_one:
            self._log.warning(self._first, peer, why)
            self._summary_at = time.monotonic() + self._every
            return
        self._unlogged += 1
        if time.monotonic() >= self._summary_at:
            self.flush()

    @property
    def due(self) -> float | None:
        """When the summary of the refusals not logged yet is due (None: nothing waits)."""
        return self._summary_at if self._unlogged else None

    def tick(self, now: float) -> None:
        if self._unlogged and now >= self._summary_at:
            self.flush()

    def flush(self) -> None:
        """Log the refusals not logged yet, in one line."""
        if self._unlogged:
            self._log.warning(self._more, self._unlogged, self.count, self.last[-1])
        self._unlogged = 0
        self._summary_at = time.monotonic() + self._every


__all__ = ["Refusals"]
