"""A stand-in kernel for tests that signal or kill the launching process itself.

Usage: python _launch_script.py MODE METHOD
  MODE "interrupt": launch 2 ranks (rank 0 asleep in Python, rank 1 blocked in a C++
  barrier); the test sends SIGINT; print what the caller saw, then prove the process
  is clean (no children, same handlers) and can launch again.
  MODE "orphan": launch 2 ranks that sleep; the test SIGKILLs this process and checks
  that the workers die with it.
  MODE "first-start": the first forkserver launch of this process (no forkserver yet);
  the test sends SIGINT while it starts; print how the launch ended for its view.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def blocked(_: str) -> None:
    import torch.distributed as dist

    print(f"ready {os.getpid()}", flush=True)
    if dist.get_rank() == 0:
        time.sleep(120)
    dist.barrier()  # rank 1 waits here, inside C++, where SIGINT cannot reach Python


def children() -> list[int]:
    kids: list[int] = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/children") as f:
            kids += [int(p) for p in f.read().split()]
    return kids


def main() -> None:
    mode, method = sys.argv[1], sys.argv[2]
    import traceback

    import torch.distributed  # noqa: F401 - imported before the test's signal can come

    from notebook_launcher import notebook_launcher
    from notebook_launcher._events import LaunchFinished, Output, WorkerExited
    from notebook_launcher._launch import forkserver
    from tests.helpers import Recorder

    class Printing(Recorder):  # keeps every event, and prints the ranks' lines
        def handle(self, event: object) -> None:
            super().handle(event)  # type: ignore[arg-type]
            if isinstance(event, Output):
                print(f"[rank{event.rank}] {event.text}", end="", flush=True)

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)}
    view = Printing()
    t0 = time.monotonic()
    try:
        if mode == "first-start":
            print("starting", flush=True)
        notebook_launcher(blocked, (mode,), 2, start_method=method, dashboard=view)
    except KeyboardInterrupt as exc:
        print(f"KeyboardInterrupt after {time.monotonic() - t0:.2f}s: {exc}", flush=True)
        frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
        print("frames:", frames, flush=True)
    (finished,) = view.of(LaunchFinished)
    print("summary:", finished.summary, "failed:", list(finished.failed_ranks), flush=True)
    print("deaths:", [e.rank for e in view.of(WorkerExited)], flush=True)
    after = {s: signal.getsignal(s) for s in handlers}
    allowed = {forkserver.pid()}
    print("leftover children:", sorted(set(children()) - allowed), flush=True)
    print("handlers restored:", after == handlers, flush=True)
    print("again:", notebook_launcher(lambda: 1, (), 2, start_method=method, dashboard=False))
    forkserver.shutdown()


if __name__ == "__main__":
    main()
