"""A stand-in kernel for the edges of the launch contract that involve signals.

Usage: python _edge_script.py MODE METHOD [N]; prints ``RESULT <json>`` lines.

* ``interrupt-group``: N launches, each interrupted the way Jupyter's button does it
  (SIGINT to this process's whole process group) once both ranks run; reports what the
  caller saw and what the launch summary said.
* ``startup-interrupt``: N launches interrupted while the forkserver starts (it imports
  torch for about a second); reports fds and children before and after.
* ``burst``: N launches, each hit by three SIGINTs a few ms apart; fds and children.
* ``grandchildren``: ranks start ``sleep`` processes (a Popen and a shell pipeline),
  print their pids and block; the test then signals or kills this process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any


def blocked() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(120)
    dist.barrier()  # rank 1 waits inside C++


def with_grandchildren() -> None:
    import torch.distributed as dist

    one = subprocess.Popen(["sleep", "300"])
    two = subprocess.Popen(["sh", "-c", "sleep 301 | cat"])
    time.sleep(0.3)  # the pipeline's children exist by now
    kids = [one.pid, two.pid]
    for pid in (two.pid,):
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids += [int(p) for p in f.read().split()]
    print("grandchildren " + " ".join(map(str, kids)), flush=True)
    dist.barrier()
    time.sleep(120)


class WhenRunning:
    """A view that calls ``action`` once every rank has started, and keeps the summary."""

    def __init__(self, action: Any, ranks: int = 2) -> None:
        self.action, self.ranks, self.started = action, ranks, 0
        self.summary = ""

    def handle(self, event: Any) -> None:
        name = type(event).__name__
        if name == "WorkerStarted":
            self.started += 1
            if self.started == self.ranks:
                threading.Timer(0.2, self.action).start()
        elif name == "LaunchFinished":
            self.summary = event.summary

    def tick(self) -> None:
        pass

    def close(self) -> None:
        pass


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def children() -> list[int]:
    kids: list[int] = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            kids += [int(p) for p in f.read().split()]
    from notebook_launcher._launch import forkserver

    return sorted(set(kids) - {forkserver.pid()})


def settle() -> None:
    """Swallow SIGINTs still on their way (a burst may outlive the launch)."""
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        try:
            time.sleep(0.05)
        except KeyboardInterrupt:
            pass


def result(**data: Any) -> None:
    print("RESULT " + json.dumps(data), flush=True)


def main() -> None:
    mode, method = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    from notebook_launcher import notebook_launcher
    from notebook_launcher._launch import forkserver

    notebook_launcher(lambda: None, (), 2, start_method=method, dashboard=False)  # warm up
    if mode == "interrupt-group":
        for _ in range(n):
            view = WhenRunning(lambda: os.killpg(os.getpgrp(), signal.SIGINT))
            try:
                notebook_launcher(blocked, (), 2, start_method=method, dashboard=view)
                caught = "nothing"
            except KeyboardInterrupt:
                caught = "KeyboardInterrupt"
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                caught = f"{type(exc).__name__}: {exc}"
            result(caught=caught, summary=view.summary)
    elif mode == "startup-interrupt":
        forkserver.shutdown()
        before, kids = fds(), children()
        for _ in range(n):
            forkserver.shutdown()
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
            try:
                notebook_launcher(blocked, (), 2, start_method=method, dashboard=False)
                caught = "nothing"
            except KeyboardInterrupt:
                caught = "KeyboardInterrupt"
            settle()
            result(caught=caught)
        again = notebook_launcher(lambda: 7, (), 2, start_method=method, dashboard=False)
        forkserver.shutdown()
        result(fds_before=before, fds_after=fds(), children=children(), again=again, kids=kids)
    elif mode == "burst":
        before = fds()

        def burst() -> None:
            for _ in range(3):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.002)

        for _ in range(n):
            try:
                notebook_launcher(blocked, (), 2, start_method=method, dashboard=WhenRunning(burst))
                caught = "nothing"
            except KeyboardInterrupt:
                caught = "KeyboardInterrupt"
            settle()
            result(caught=caught, fds=fds(), children=children())
        forkserver.shutdown()
        result(fds_before=before, fds_after=fds())
    elif mode == "grandchildren":
        try:
            notebook_launcher(with_grandchildren, (), 2, start_method=method, dashboard=False)
        except KeyboardInterrupt:
            result(caught="KeyboardInterrupt", children=children())
            time.sleep(60)  # the test looks at the grandchildren, then kills us


if __name__ == "__main__":
    main()
