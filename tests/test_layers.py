"""The package's layers, held by reading every import (../shared/STYLE.md, habits 17 and 10).

Module paths say where code runs:

* bottom -- ``errors``, ``_events``, ``_spec``, ``_posix``, ``_serialization``,
  ``_placement``, ``_wire/``:
  plain data and codecs both sides share; they import only each other;
* ``_launch/`` -- the kernel side (preflight, worker group, forkserver client, diagnosis);
* ``_agent/`` -- the node side: a node's agent, run for a kernel on another machine, starts
  its ranks with the kernel side's machinery (``_launch``), which never imports it back;
* ``_worker/`` -- the rank side (entry, runtime event sink, tqdm patch, barrier telemetry);
* the worker-side API -- ``state``, ``accelerator``, ``optimizer``, ``scheduler``,
  ``data_loader``, ``checkpointing``, ``utils/`` -- runs in ranks: never the kernel side
  or the UI;
* ``tracking`` -- ``log()`` for the live metric plots, called in ranks (``Accelerator.log``):
  only ``_events`` and the worker runtime (the experiment trackers are ``trackers``, worker
  API, reached from ``tracking`` by name on first use);
* ``ui/`` -- views over plain events: only ``_events`` and ``errors``, never torch;
* orchestrators -- ``launcher`` and the kernel's entry points -- where they meet.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import notebook_launcher

pytestmark = pytest.mark.unit

PACKAGE = Path(notebook_launcher.__file__).resolve().parent
PKG = "notebook_launcher"

BOTTOM = (
    "errors",
    "_events",
    "_spec",
    "_posix",
    "_serialization",
    "_settings",
    "_accelerate_env",
    # where every rank runs (inventory without the CUDA runtime, placement): both sides
    "_placement",
    "_wire",
    # Accelerate's names left to Accelerate, and the modules that only raise their error
    "_accelerate_only",
    "big_modeling",
    "hooks",
    "_stacks",
)
WORKER_API = (
    "state",
    "accelerator",
    "optimizer",
    "scheduler",
    "data_loader",
    "checkpointing",
    "utils",
    "tracking",
    "trackers",
    "logging",
    "local_sgd",
)
#: layer -> the layers (top-level names under the package) it may import
ALLOWED: dict[str, tuple[str, ...]] = {
    "bottom": BOTTOM,
    # _stacks: a rank's stacks put into words, the same for the text view and the cell
    "ui": ("errors", "_events", "_stacks", "ui"),
    "tracking": ("_events", "_worker.runtime"),
    "_worker": (*BOTTOM, "_worker"),
    # _worker.collectives: the package's collectives refuse to run in a cell on some ranks
    "worker_api": (
        *BOTTOM,
        *WORKER_API,
        "_worker.runtime",
        "_worker.barriers",
        "_worker.progress",
        "_worker.collectives",
    ),
    # fork runs the rank entry in the child: the kernel side's one crossing
    "_launch": (*BOTTOM, "_launch", "_worker.entry"),
    "_agent": (*BOTTOM, "_agent", "_launch"),
}
#: module -> what it may import beyond its layer, and why
EXCEPTIONS: dict[str, tuple[str, ...]] = {
    # a session's namespace offers `state` (a PartialState), as the issue asks
    "_worker.session": ("state",),
    # the allowed mixed-precision values, defined once for both sides (torch-free)
    "_launch.preflight": ("utils.constants",),
    # the forkserver forks detached runs' supervisors too (warm: torch imported)
    "_worker.forkserver": ("_supervise",),
}
#: third-party modules a layer must not import anywhere (module level or in a function)
FORBIDDEN_ANYWHERE = {"ui": ("torch", "cloudpickle")}
#: ... nor at module level (kernel-side modules stay cheap to import)
FORBIDDEN_AT_TOP = {"bottom": ("torch",), "_launch": ("torch",), "_agent": ("torch",)}


def layer_of(module: str) -> str | None:
    """The layer of ``notebook_launcher.<module>``, None for the orchestrators."""
    first = module.split(".")[0]
    if first in BOTTOM:
        return "bottom"
    if first in ("ui", "_worker", "_launch", "_agent"):
        return first
    if first == "tracking":
        return "tracking"
    if first in WORKER_API:
        return "worker_api"
    return None


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append((".".join(parts), path))
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:`` (never executed)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                for sub in ast.walk(inner):
                    lines.add(getattr(sub, "lineno", -1))
    return lines


def imports_of(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """(absolute module imported, line, at module level) for every executed import."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    top = {id(n) for n in tree.body}
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if node.lineno in skip if hasattr(node, "lineno") else False:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = [PKG, *package[: len(package) - node.level + 1]]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # ``from pkg import sub``: the submodule is what is used (a package's
            # ``__init__`` here holds only its docstring); ``from mod import name``: the module
            subs = [f"{name}.{a.name}" for a in node.names]
            ours = [t for t in subs if (_ours(t) or "") and _is_module(_ours(t) or "")]
            targets = ours or [name]
            found += [(t, node.lineno, id(node) in top) for t in targets]
    return found


def _ours(target: str) -> str | None:
    if target == PKG:
        return ""
    return target[len(PKG) + 1 :] if target.startswith(PKG + ".") else None


def _is_module(name: str) -> bool:
    path = PACKAGE.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _allowed(target: str, allowed: tuple[str, ...]) -> bool:
    return any(target == a or target.startswith(a + ".") for a in allowed)


def violations() -> list[str]:
    found = []
    for module, path in modules():
        layer = layer_of(module)
        for target, line, at_top in imports_of(module, path):
            where = f"{path.relative_to(PACKAGE.parent)}:{line}"
            ours = _ours(target)
            if ours is None:
                root = target.split(".")[0]
                if layer in FORBIDDEN_ANYWHERE and root in FORBIDDEN_ANYWHERE[layer]:
                    found.append(f"{where}: the {layer} layer imports {target}")
                if at_top and layer in FORBIDDEN_AT_TOP and root in FORBIDDEN_AT_TOP[layer]:
                    found.append(f"{where}: the {layer} layer imports {target} at module level")
                continue
            if layer is None or not ours or not _is_module(ours):
                continue  # orchestrators may import anything; names of a module are fine
            if not _allowed(ours, ALLOWED[layer] + EXCEPTIONS.get(module, ())):
                found.append(f"{where}: {module} ({layer}) must not import {ours}")
    return found


def test_every_import_follows_the_layers() -> None:
    assert violations() == []


def test_the_rule_catches_what_it_should() -> None:
    """A self-check of the reader on made-up modules (so a broken reader cannot pass)."""
    assert layer_of("ui.widgets") == "ui" and layer_of("_wire.control") == "bottom"
    assert layer_of("state") == "worker_api" and layer_of("launcher") is None
    assert not _allowed("_launch.group", ALLOWED["worker_api"])
    assert not _allowed("_worker.entry", ALLOWED["ui"])
    assert _allowed("_worker.entry", ALLOWED["_launch"])
    assert not _allowed("_worker.progress", ALLOWED["_launch"])
    assert not _allowed("_agent.serve", ALLOWED["_launch"]) and layer_of("_agent") == "_agent"
    assert layer_of("tracking") == "tracking" and _allowed("tracking", ALLOWED["worker_api"])
    assert not _allowed("state", ALLOWED["tracking"]) and not _allowed("tracking", ALLOWED["ui"])


def test_every_module_has_a_layer_or_is_an_orchestrator() -> None:
    orchestrators = {
        "",
        "launcher",
        "session",
        "cluster",
        "ipython_extension",
        "__main__",
        "_demo",
        "_kernelspec",
        "launchers",  # Accelerate's module: notebook_launcher and debug_launcher
        "detached",  # attach() and runs(): the kernel's side of a detached run
        "_supervise",  # a detached run's supervisor: a launch, recorded
        "detached_session",  # a detached session: the kernel's client, the supervisor's server
    }
    extra = {m for m, _ in modules() if layer_of(m) is None} - orchestrators
    assert not extra, f"modules without a layer (add them to tests/test_layers.py): {extra}"


@pytest.mark.parametrize(
    ("statement", "absent"),
    [
        ("import notebook_launcher.ui", ("torch", "cloudpickle", "notebook_launcher._launch")),
        ("import notebook_launcher.ui.widgets", ("torch", "notebook_launcher._worker")),
        ("import notebook_launcher", ("torch", "cloudpickle", "notebook_launcher.launcher")),
        ("import notebook_launcher.ipython_extension", ("torch",)),
        ("from notebook_launcher import log", ("torch", "notebook_launcher.state")),
        ("from notebook_launcher import notebook_launcher", ("torch",)),
    ],
)
def test_light_imports_stay_light(statement: str, absent: tuple[str, ...]) -> None:
    code = f"import sys; {statement}; print([m for m in {absent!r} if m in sys.modules])"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", (statement, out.stdout, out.stderr)
