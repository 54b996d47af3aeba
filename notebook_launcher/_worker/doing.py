"""What a rank does in its first seconds, when nothing else says it (rank side).

A rank that runs the user's function reads "running" until it prints, draws a bar or
waits at a barrier, and a function's first seconds are often spent importing
(``from transformers import Trainer``: seconds, ~15 s on a loaded machine). While the
task's first :data:`WINDOW` seconds last, a thread looks at the main thread's stack every
:data:`LOOK` seconds (``sys._current_frames``: no signal, nothing the rank notices) and
says when it is inside an import, and when that import is over, as a
:class:`~notebook_launcher._events.WorkerPhase` whose phase is the words the dashboard
shows (``importing transformers``; ``""`` once done)::

    watch = first_seconds(rank)      # before fn(*args, **kwargs)
    ...                               # the function runs; its row: "importing transformers"
    watch.stop()                      # the function returned or raised

An import shorter than a look is never said; one that takes seconds is, within a look.
"""

from __future__ import annotations

import _thread
import os
import sys
import threading
import time
from types import FrameType

from .._events import IMPORTING, WorkerPhase
from . import runtime

#: Seconds of a task during which the rank's imports are said.
WINDOW = 60.0
#: Seconds between two looks at the main thread.
LOOK = 0.25


def importing(frame: FrameType | None) -> str:
    """The top-level package whose import ``frame``'s stack runs (the outermost import
    in it: ``transformers`` for ``from transformers import Trainer``, whatever it imports
    on the way); ``""`` when the stack is in no import."""
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    seen_importlib = False
    for f in reversed(stack):  # outermost first
        if f.f_code.co_filename.startswith("<frozen importlib"):
            seen_importlib = True
        elif seen_importlib and f.f_code.co_name == "<module>":
            name = f.f_globals.get("__name__")
            if isinstance(name, str) and name:
                return name.split(".")[0]
    return ""


class Watch:
    """The thread that says the rank's imports (see the module docstring)."""

    def __init__(self, rank: int, window: float = WINDOW, look: float = LOOK) -> None:
        self.rank, self.look = rank, look
        self.main = threading.get_ident()  # (the thread that runs the task)
        self.until = time.monotonic() + window
        self.said = ""
        self.done = threading.Event()
        self._lock = threading.Lock()  # a word said, and the end, one at a time
        # Not threading.Thread.start(), which waits until the new thread has run, nor a
        # join at stop(): each was a wake-up the rank waited for before and after the
        # user's function (~4% of a 2-rank launch on a loaded machine, bench/launch.py
        # --busy). The thread ends by itself at its next look once stopped.
        _thread.start_new_thread(self._run, ())

    def _run(self) -> None:
        while not self.done.wait(self.look) and time.monotonic() < self.until:
            frame = sys._current_frames().get(self.main)
            now = importing(frame)
            del frame
            with self._lock:
                if self.done.is_set():
                    return
                if now != self.said:
                    self._say(now)
        with self._lock:
            if self.said and not self.done.is_set():
                self._say("")

    def _say(self, module: str) -> None:
        self.said = module
        words = f"{IMPORTING}{module}" if module else ""
        runtime.emit(WorkerPhase(self.rank, os.getpid(), words, time.time()))

    def stop(self) -> None:
        """The task ended: no more looks; an import said is over."""
        with self._lock:
            self.done.set()
            if self.said:
                self._say("")


def first_seconds(rank: int) -> Watch:
    """Start saying what the rank imports for the task's first seconds."""
    return Watch(rank)


__all__ = ["LOOK", "WINDOW", "Watch", "first_seconds", "importing"]
