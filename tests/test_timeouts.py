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

from .helpers import Kept, kept_for

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


class _Resource:
    """A context manager that counts how often it was entered and left."""

    made = 0
    closed = 0

    def __enter__(self) -> int:
        type(self).made += 1
        return type(self).made

    def __exit__(self, *exc: object) -> None:
        type(self).closed += 1


class _Request:
    def __init__(self, failed: bool | None) -> None:
        report = None if failed is None else type("Report", (), {"failed": failed})()
        self.node = type("Node", (), {"rep_call": report})()


def test_a_shared_kernel_is_replaced_after_a_test_that_failed_with_it() -> None:
    """A test that timed out leaves its module's kernel busy: the next test gets a new one
    instead of timing out behind it (the cascade seen on a loaded machine)."""
    _Resource.made = _Resource.closed = 0
    kept = Kept(_Resource)

    def one_test(failed: bool | None) -> int:
        fixture = kept_for(kept, _Request(failed))
        value = next(fixture)
        for _ in fixture:  # the teardown
            pass
        return value

    assert [one_test(False), one_test(False)] == [1, 1]  # passing tests share it
    assert one_test(True) == 1 and _Resource.closed == 1  # a failure throws it away
    assert one_test(None) == 2 and _Resource.closed == 2  # no call report: setup failed
    assert one_test(False) == 3
    kept.drop()
    kept.drop()  # idempotent
    assert (_Resource.made, _Resource.closed) == (3, 3)
