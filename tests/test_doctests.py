"""The examples in the package's docstrings run (``>>>`` ones), so they cannot go stale."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import notebook_launcher

pytestmark = pytest.mark.unit

PACKAGE = Path(notebook_launcher.__file__).resolve().parent


def _modules_with_examples() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>> " in path.read_text(encoding="utf-8"):
            rel = path.relative_to(PACKAGE.parent).with_suffix("")
            names.append(".".join(rel.parts).removesuffix(".__init__"))
    return names


MODULES = _modules_with_examples()


def test_examples_are_found() -> None:
    assert "notebook_launcher.ui.model" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0, f"{result.failed} example(s) of {name} failed (see above)"
