"""The suite's own timeouts (issue 26): a passing test prints no stack dump.

pytest-timeout ends a test that outlives its timeout, with every thread's stack. A
``faulthandler_timeout`` below a test's timeout dumped the stacks of a test that went on to
pass ("Timeout (0:01:50)!", 50 lines that read like a hang), as the tests that take minutes
(the Accelerate examples, the notebooks) do on a loaded machine.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

TESTS = Path(__file__).resolve().parent
MARKED = re.compile(r"mark\.timeout\((\d+(?:\.\d*)?)\)")


def test_timeouts_are_read_from_the_markers() -> None:
    assert MARKED.findall("@pytest.mark.timeout(900)\npytest.mark.timeout(2.5)") == ["900", "2.5"]


def test_no_stack_dump_fires_before_a_tests_own_timeout(pytestconfig: pytest.Config) -> None:
    marked = [float(t) for f in TESTS.glob("*.py") for t in MARKED.findall(f.read_text())]
    longest = max([float(pytestconfig.getini("timeout")), *marked])
    dump_after = float(pytestconfig.getini("faulthandler_timeout") or 0)
    assert dump_after == 0 or dump_after > longest, (
        f"faulthandler_timeout = {dump_after:g} s dumps the stacks of a test that may still "
        f"pass: the longest test timeout is {longest:g} s"
    )
