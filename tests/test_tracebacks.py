"""What a notebook user meets when a rank fails, in a real ipykernel.

* Types defined in a cell (an exception class, a dataclass, an Enum, a nested class)
  come back as the notebook's own classes under fork, forkserver and spawn: ``except``
  catches them, ``isinstance``, ``==`` and ``is`` hold, and their methods stay the
  notebook's.
* An uncaught failure reads like IPython's own traceback of a local error: the cell
  that called the launcher, then the rank's frames named ``Cell In[n], line k`` with
  their source lines, library frames folded, none of the launcher's frames, no
  "remote traceback" header pair; the final error line right after the frame that raised.
* Every rank's traceback is reachable from the exception (``print_traceback``).

The assertions read the ``error`` message's ``traceback`` field: what the front end shows.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(240)]

jupyter_client = pytest.importorskip("jupyter_client")

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def kernel() -> Iterator[object]:
    import os

    from .conftest import KERNEL_ENV_DROP

    env = {k: v for k, v in os.environ.items() if k not in KERNEL_ENV_DROP}
    km, kc = jupyter_client.manager.start_new_kernel(
        kernel_name="python3", env={**env, "PYTHONPATH": str(ROOT)}, cwd=str(ROOT)
    )
    try:
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def run_cell(kc: object, code: str, timeout: float = 120) -> tuple[str, dict, list[str]]:
    """Execute ``code``: (stream text, execute_reply content, the error's traceback lines
    without colours)."""
    msg_id = kc.execute(textwrap.dedent(code))  # type: ignore[attr-defined]
    text, error = [], []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)  # type: ignore[attr-defined]
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            error = ANSI.sub("", "\n".join(msg["content"]["traceback"])).splitlines()
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    reply = kc.get_shell_msg(timeout=timeout)  # type: ignore[attr-defined]
    return "".join(text), reply["content"], error


DEFINITIONS = """
    import os
    from dataclasses import dataclass
    from enum import Enum

    from notebook_launcher import notebook_launcher

    class MyError(Exception):
        def hint(self):
            return "mine"

    class Color(Enum):
        RED = 1
        BLUE = 2

    @dataclass
    class Result:
        rank: int
        color: Color

    class Outer:
        class Inner(Exception):
            pass

    HINT = MyError.hint

    def raise_mine():
        if os.environ["RANK"] == "1":
            raise MyError("from a cell")

    def return_results():
        return Result(int(os.environ["RANK"]), Color.BLUE)

    def raise_inner():
        raise Outer.Inner("nested")
"""

IDENTITY = """
    def identity(method):
        try:
            notebook_launcher(raise_mine, num_processes=2, start_method=method, dashboard=False)
        except MyError as exc:
            assert type(exc) is MyError and exc.hint() == "mine", exc
        results = notebook_launcher(
            return_results, num_processes=2, start_method=method, dashboard=False
        )
        assert all(isinstance(r, Result) for r in results), results
        assert results == [Result(0, Color.BLUE), Result(1, Color.BLUE)], results
        assert results[1].color is Color.BLUE
        if method != "spawn":  # (a third spawn launch adds time, not coverage)
            try:
                notebook_launcher(raise_inner, num_processes=2, start_method=method, dashboard=False)
            except Outer.Inner:
                pass
        assert MyError.hint is HINT  # the notebook's own method, not a copy from a rank
        print("IDENTITY", method, "OK")

    for method in ("fork", "forkserver", "spawn"):
        identity(method)
"""


def test_notebook_types_keep_their_identity_in_every_start_method(kernel: object) -> None:
    out, reply, error = run_cell(kernel, DEFINITIONS)
    assert reply["status"] == "ok", error
    out, reply, error = run_cell(kernel, IDENTITY)
    assert reply["status"] == "ok", "\n".join(error)
    for method in ("fork", "forkserver", "spawn"):
        assert f"IDENTITY {method} OK" in out, out
    # Re-running the cell makes new classes: the next launch gives back the new ones.
    out, reply, error = run_cell(kernel, DEFINITIONS)
    out, reply, error = run_cell(kernel, 'identity("fork")\nidentity("forkserver")')
    assert reply["status"] == "ok", "\n".join(error)
    assert "IDENTITY fork OK" in out and "IDENTITY forkserver OK" in out, out
