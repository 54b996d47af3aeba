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
import dataclasses
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
        "_sessions",  # what every session is (local or detached): below both faces
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


# --- no import circle, counting the imports inside functions (issue 34, "Done when") ------


def _face_names() -> dict[str, str]:
    """What the package's face hands on: name -> the module (under the package) that
    defines it, read from ``__init__``'s imports and its lazy table (``_LAZY``)."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            for alias in node.names:
                found[alias.asname or alias.name] = node.module
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Dict):
            for key, target in zip(value.keys, value.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(target, ast.Constant):
                    found[str(key.value)] = str(_ours(str(target.value)))
    return found


def _module_of(name: str) -> str | None:
    """The module of ours that ``name`` (a dotted path under the package) is, or lies in."""
    parts = name.split(".")
    while parts:
        if _is_module(".".join(parts)):
            return ".".join(parts)
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports (module granularity; relative imports
    resolved; at module level or inside a function alike; not under ``TYPE_CHECKING``).
    ``from notebook_launcher import X`` counts as an import of the module that defines
    ``X``: the package's face re-exports everything, and is left out itself."""
    face = _face_names()
    graph: dict[str, set[str]] = {}
    for module, path in modules():
        if not module:
            continue  # the face: re-exports only, lazily
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", -1) in skip:
                continue
            if isinstance(node, ast.Import):
                names = [_ours(a.name) for a in node.names]
                targets |= {t for t in names if t}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    ours = _ours(node.module or "")
                    if ours is None:
                        continue
                    name = ours
                for alias in node.names:
                    sub = f"{name}.{alias.name}" if name else alias.name
                    if _is_module(sub):
                        targets.add(sub)
                    elif name:
                        targets.add(name)
                    elif alias.name in face:  # the package's face: where it comes from
                        targets.add(face[alias.name])
        resolved = {m for t in targets if (m := _module_of(t)) is not None}
        graph[module] = resolved - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of ``graph`` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_counting_imports_inside_functions() -> None:
    """``launcher`` -> ``detached`` -> ``detached_session`` -> ``session`` -> ... ran in a
    circle (issue 34): shared pieces live below the faces, which sit on top."""
    assert circles(import_graph()) == []


def test_the_circle_reader_catches_what_it_should() -> None:
    """A self-check: a made-up circle is found, a chain is not, and the face's names and
    the imports inside functions are read (so a broken reader cannot pass)."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert _face_names()["start"] == "session" and _face_names()["attach"] == "detached"
    graph = import_graph()
    assert "detached_session" in graph["session"]  # start(detach=True): inside a function
    assert "_wire.supervisor" in graph["detached_session"]
    assert "" not in graph and all("" not in targets for targets in graph.values())


# --- one typed protocol for what outlives the kernel (issue 34, item 2) -----------------


def _match_classes(function: ast.AST) -> set[str]:
    """The class names the ``match`` statements in ``function`` match on."""
    return {
        node.cls.id if isinstance(node.cls, ast.Name) else ast.unparse(node.cls)
        for node in ast.walk(function)
        if isinstance(node, ast.MatchClass)
    }


def test_the_session_server_dispatches_on_the_protocols_types_not_strings() -> None:
    """The supervisor of a detached session serves the requests of ``_wire.supervisor``
    by their type (``match``), and nothing in ``detached_session`` compares a string
    constant (``method == "run"`` was its dispatch)."""
    from notebook_launcher._wire import supervisor as wire

    tree = ast.parse((PACKAGE / "detached_session.py").read_text())
    server = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_Server")
    methods = {n.name: n for n in server.body if isinstance(n, ast.FunctionDef)}
    requests = {cls.__name__ for cls in wire.REQUESTS}
    matched = _match_classes(methods["serve_connection"])
    assert matched == requests, matched ^ requests  # every request, by its class
    assert _match_classes(methods["dispatch"]) <= requests
    compared = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        and any(
            isinstance(side, ast.Constant) and isinstance(side.value, str)
            for side in (node.left, *node.comparators)
        )
    ]
    assert compared == []
    for cls in (*wire.REQUESTS, *wire.ANSWERS, wire.HandedOver, wire.Held, wire.Taken):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]


def test_no_engine_is_named_outside_its_own_module() -> None:
    """Slurm and Ray sit behind the scheduler interface (``_launch/scheduler.py``): the
    wire, the agents, the supervisor, the detached modules and the rest of ``_launch``
    never name them (node hellos carry labels, outcomes typed reasons). Only each engine's
    own module -- and the faces that let a user pick one (``cluster.py``) -- may."""
    own = {"slurm": PACKAGE / "_launch" / "slurm.py", "ray": PACKAGE / "_launch" / "ray.py"}
    places = [
        *(PACKAGE / "_launch").glob("*.py"),
        *(PACKAGE / "_wire").glob("*.py"),
        *(PACKAGE / "_agent").glob("*.py"),
        PACKAGE / "_supervise.py",
        PACKAGE / "detached.py",
        PACKAGE / "detached_session.py",
    ]
    named = [
        f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}"
        for engine, home in own.items()
        for path in places
        if path != home
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if (engine == "slurm" and "slurm" in line.lower())
        or (engine == "ray" and ("import ray" in line or "RayCluster" in line))
    ]
    assert named == [], "\n".join(named)
