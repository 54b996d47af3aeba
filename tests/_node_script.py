"""The other node of a two-node job, for ``tests/test_multinode.py``.

The test process is one node; ``python -m tests._node_script OUT.json OPTIONS.json`` is the
other: it launches :func:`work` with the options given and writes what it saw to ``OUT``:
its results or its error, the events of its view, and whatever it left behind (child
processes, listening ports, threads: all must be none).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

#: set in the other node's environment (its ranks inherit it): where a rank runs
NODE_ENV = "NL_TEST_NODE"


def work(mode: str) -> dict[str, Any]:
    """Both nodes' function. ``mode``: ``"gather"``; ``"kill"`` (the other node's local
    rank 1 is killed in the first attempt); ``"raise"`` (it raises ValueError); ``"sleep"``
    (every rank sleeps a minute once the group works); ``"linger"`` (after one gather, this
    node's ranks return and the other node's sleep a minute); ``"loop"`` (every rank
    all-reduces in a loop, as training does, until a peer goes away)."""
    from notebook_launcher import PartialState
    from notebook_launcher.utils import gather_object

    state = PartialState()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    here = os.environ.get(NODE_ENV, "test")
    culprit = here == "other" and state.local_process_index == 1
    if mode == "kill" and culprit and attempt == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "raise" and culprit:
        raise ValueError(f"boom on rank {state.process_index}")
    if mode == "sleep":
        state.wait_for_everyone()
        time.sleep(60)
    if mode == "loop":
        import torch
        import torch.distributed as dist

        step = torch.ones(1)
        while True:
            dist.all_reduce(step)
            time.sleep(0.01)
    if mode == "linger" and here == "other":  # after the gather below: nobody waits on it
        gather_object([state.process_index])
        time.sleep(60)
    if mode == "linger":  # here: return at once, with no further collective
        return {"rank": state.process_index, "seen": gather_object([state.process_index])}
    return {
        "rank": state.process_index,
        "local": state.local_process_index,
        "world": state.num_processes,
        "local_main": state.is_local_main_process,
        "attempt": attempt,
        "seen": gather_object([[state.process_index, here]]),
    }


def leftovers() -> dict[str, Any]:
    from tests.conftest import _wait_for_no_children, listening_ports

    return {
        "children": sorted(_wait_for_no_children(set())),
        "ports": sorted(listening_ports()),
        "threads": [t.name for t in threading.enumerate() if t is not threading.main_thread()],
    }


def main(out: str, options: dict[str, Any]) -> None:
    from notebook_launcher import notebook_launcher
    from tests.helpers import Recorder

    view = Recorder()
    mode = options.pop("mode")
    record: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        record["results"] = notebook_launcher(
            work, (mode,), num_processes=2, dashboard=view, **options
        )
    except BaseException as exc:  # noqa: BLE001 - what the test checks (Ctrl-C included)
        failure = getattr(exc, "launch_failure", None)
        record["error"] = {
            "type": type(exc).__name__,
            "message": str(exc),
            "root_rank": failure.root_cause.rank if failure else None,
            "summary": failure.summary() if failure else "",
        }
    record["seconds"] = time.monotonic() - t0
    record["events"] = [type(e).__name__ for e in view.events]
    started = [e for e in view.events if type(e).__name__ == "LaunchStarted"]
    if started:
        s = started[0]
        record["started"] = {"world_size": s.world_size, "ranks": list(s.ranks)}
    record["leftovers"] = leftovers()
    with open(out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
