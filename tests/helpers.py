"""Shared test helpers: a recording view, a free port, a clean environment for kernels
and subprocesses, a real ipykernel and a cell run in it."""

from __future__ import annotations

import os
import re
import socket
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from notebook_launcher._events import Event, Output

ROOT = Path(__file__).resolve().parents[1]

#: Kernels and workers started by tests must not inherit pytest's marker: ipykernel stops
#: capturing fd-level output when it sees it (../shared/TESTING.md, pitfall 1).
KERNEL_ENV_DROP = ("PYTEST_CURRENT_TEST",)


def kernel_env() -> dict[str, str]:
    """This process's environment, less what a kernel or a rank must not inherit."""
    return {k: v for k, v in os.environ.items() if k not in KERNEL_ENV_DROP}


def free_port() -> int:
    """A loopback TCP port free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def started_kernel(**env: str) -> Iterator[Any]:
    """A real ipykernel running this checkout (``jupyter_client``); yields its client."""
    import jupyter_client

    km, kc = jupyter_client.manager.start_new_kernel(
        kernel_name="python3",
        env={**kernel_env(), "PYTHONPATH": str(ROOT), **env},
        cwd=str(ROOT),
    )
    try:
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def wait_until(condition: Any, timeout: float, what: str) -> None:
    """Poll ``condition()`` every 50 ms until it is true; fail naming ``what`` after
    ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting until {what}")
        time.sleep(0.05)


def agent_processes(job: str | None = None) -> list[int]:
    """Pids of live agent processes (of ``job``), and of the ranks they forked (a forked
    rank keeps its agent's command line)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        ours = b"notebook_launcher" in argv and b"agent" in argv
        if ours and (job is None or job.encode() in argv):
            found.append(int(entry))
    return found


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run_cell(kc: Any, code: str, timeout: float = 120) -> tuple[str, dict, list[str]]:
    """Execute ``code`` (dedented) in a kernel: (its stream text, the execute_reply
    content, the error's traceback lines without colours)."""
    msg_id = kc.execute(textwrap.dedent(code))
    text, error = [], []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            error = ANSI.sub("", "\n".join(msg["content"]["traceback"])).splitlines()
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    reply = kc.get_shell_msg(timeout=timeout)
    return "".join(text), reply["content"], error


class Recorder:
    """A launcher view that keeps every event (the output path is pluggable: any object
    with the ``notebook_launcher.ui.View`` methods can be passed as ``dashboard=``)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.ticks = 0
        self.closed = 0

    def handle(self, event: Event) -> None:
        self.events.append(event)

    def tick(self) -> None:
        self.ticks += 1

    def close(self) -> None:
        self.closed += 1

    def of(self, cls: type) -> list:
        return [e for e in self.events if isinstance(e, cls)]

    def lines(self, rank: int, stream: str = "stdout") -> list[str]:
        return [e.text for e in self.of(Output) if e.rank == rank and e.stream == stream]
