"""Classes the kernel already has come back as themselves: no process.

The launch-level proof, under fork, forkserver and spawn in a real kernel, is
``test_tracebacks.py``.
"""

from __future__ import annotations

import enum
import os
from typing import Any

import cloudpickle
import pytest

from notebook_launcher._serialization import dumps, loads, share_class_identities

pytestmark = pytest.mark.unit  # the tier: see tests/conftest.py


SCALE = 1


def make_classes() -> tuple[type, type]:
    class Local:
        def scaled(self) -> int:
            return SCALE * 2

    class Color(enum.Enum):
        RED = 1

    return Local, Color


def test_a_known_class_comes_back_itself_with_its_own_methods() -> None:
    global SCALE
    local, color = make_classes()
    method = local.scaled
    obj, red = loads(dumps((local(), color.RED)))  # cloudpickle ships both by value
    assert type(obj) is local and red is color.RED
    # cloudpickle would have replaced the method by a copy bound to a globals snapshot
    assert local.scaled is method
    SCALE = 5
    try:
        assert obj.scaled() == 10
    finally:
        SCALE = 1


def test_share_class_identities_tracks_the_notebook_classes_a_function_reaches() -> None:
    local, color = make_classes()

    class Outer:
        class Inner(Exception):
            pass

    def train() -> tuple[Any, ...]:
        return local, color, Outer

    tracked = cloudpickle.cloudpickle._DYNAMIC_CLASS_TRACKER_BY_CLASS
    assert share_class_identities(train) >= 4
    for cls in (local, color, Outer, Outer.Inner):
        assert cls in tracked, cls
    assert ValueError not in tracked and os.PathLike not in tracked  # importable: by reference
