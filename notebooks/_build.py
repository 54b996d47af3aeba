"""Execute the teaching notebooks: ``python notebooks/_build.py [--check] [--no-execute] [NAME ...]``.

Each notebook's source is ``notebooks/NN_name.py`` in jupytext's percent format: plain Python
that editors, linters and formatters read (``# %%`` starts a code cell, ``# %% [markdown]`` a
markdown cell, ``# %% tags=[...]`` carries the cell's tags; magics are commented out,
``# %nl_info``). The ``.py`` is the source of truth, and nothing pairs it with its
``.ipynb``: saving a notebook in Jupyter (jupytext installed or not) writes the ``.ipynb``
alone, so a reader who runs and saves a lesson changes no source, and a new notebook in
this folder gets no ``.py`` twin. This script reads a source, runs it on the shipped
"Python 3 (notebook_launcher)" kernel (installed into a temporary prefix), replaces this
machine's paths in the outputs and the widget state with placeholders (``<repo>``,
``<venv>``, ``<tmp>``, ``<cell>``, ``~``), and writes ``NN_name.ipynb`` with them. nbval
compares against those outputs after ``sanitize.cfg``.

``--check`` executes nothing: it says whether every ``.ipynb`` holds the cells of its
``.py`` (types, sources, tags) and was executed, and exits 1 if one does not.

``--from-ipynb NAME`` is the way back for a lesson edited in Jupyter: it rewrites
``NAME.py`` from the cells of ``NAME.ipynb`` (sources and tags; outputs are not part of a
source), in the same form as the sources (no header), on request only.

Cell tags understood by nbval: ``nbval-ignore-output`` (output varies: a dashboard, a
timing), ``raises-exception`` (the cell is meant to fail). Everything else is compared
after ``sanitize.cfg``. Editing in Jupyter instead: see README.md (``--from-ipynb``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import jupytext
import nbformat

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FORMAT = "py:percent"
#: How a source is written: no notebook metadata (no header), each cell's tags only.
SOURCE_FILTERS = {"notebook_metadata_filter": "-all", "cell_metadata_filter": "tags,-all"}
#: ipykernel's file for a cell's code (what tracebacks and barrier locations name); the
#: same pattern as sanitize.cfg's, with the same placeholder.
CELL_FILE = re.compile(r"/\S*?/ipykernel_\d+/\d+\.py")
#: Widgets whose ``value`` is HTML.
HTML_WIDGETS = {"HTMLModel", "HTMLMathModel"}


def _kernelspec() -> ModuleType:
    """``notebook_launcher._kernelspec`` of this checkout (also when run as a script)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from notebook_launcher import _kernelspec

    return _kernelspec


def sources() -> list[str]:
    """Names (``NN_name``) of the notebooks, from their ``.py`` sources."""
    return sorted(p.stem for p in HERE.glob("[0-9][0-9]_*.py"))


def source_path(name: str) -> Path:
    return HERE / f"{Path(name).stem}.py"


def notebook_path(name: str) -> Path:
    return HERE / f"{Path(name).stem}.ipynb"


def build(name: str) -> Any:
    """The notebook ``name`` (``01_quickstart``, with or without a suffix), without outputs.

    Cells keep the metadata jupytext reads: their tags, and ``lines_to_next_cell`` where the
    source has ruff's two blank lines before a ``def``, so that ``--from-ipynb`` from the
    ``.ipynb`` writes a ``.py`` that ``ruff format`` leaves alone.
    """
    nb = jupytext.read(source_path(name), fmt=FORMAT)
    spec = _kernelspec()
    nb.metadata = {
        "kernelspec": {
            "name": spec.KERNEL_NAME,
            "display_name": spec.DISPLAY_NAME,
            "language": "python",
        },
        "language_info": {"name": "python"},
    }
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{Path(name).stem[:2]}-{i:02d}"
    return nb


def source_text(nb: Any) -> str:
    """``nb``'s cells as a source ``.py`` (percent format, tags kept, no header): what
    ``--from-ipynb`` writes. ``source_text(build(name))`` is the source itself."""
    nb = copy.deepcopy(nb)
    nb.metadata = {"jupytext": dict(SOURCE_FILTERS)}
    return str(jupytext.writes(nb, fmt=FORMAT))


def from_ipynb(name: str) -> bool:
    """Rewrite ``name``'s ``.py`` from its ``.ipynb`` (edited in Jupyter); True if it changed."""
    text = source_text(nbformat.read(notebook_path(name), as_version=4))
    path = source_path(name)
    if path.read_text() == text:
        return False
    path.write_text(text)
    return True


def cells(nb: Any) -> list[tuple[str, str, list[str]]]:
    """What must agree between a ``.py`` and its ``.ipynb``: type, source and tags per cell."""
    return [(c.cell_type, c.source, list(c.metadata.get("tags", []))) for c in nb.cells]


def check(name: str) -> str | None:
    """Why ``name``'s ``.ipynb`` is out of step with its ``.py`` (None: it is in step)."""
    path = notebook_path(name)
    if not path.exists():
        return f"{path.name} is missing"
    stored = nbformat.read(path, as_version=4)
    built, have = cells(build(name)), cells(stored)
    for i, (want, got) in enumerate(zip(built, have, strict=False)):
        if want != got:
            return f"cell {i} differs from {source_path(name).name}"
    if len(built) != len(have):
        return f"{len(have)} cells, {source_path(name).name} has {len(built)}"
    if any(c.cell_type == "code" and c.execution_count is None for c in stored.cells):
        return "not executed"
    return None


def _machine_paths() -> list[tuple[str, str]]:
    """(path, placeholder) for the folders of this machine that outputs may name."""
    venv = "<venv>" if sys.prefix != sys.base_prefix else "<python>"
    roots = [
        (sys.prefix, venv),
        (sys.base_prefix, "<python>"),
        (str(ROOT), "<repo>"),
        (tempfile.gettempdir(), "<tmp>"),
        (str(Path.home()), "~"),
    ]
    pairs: dict[str, str] = {}
    for path, placeholder in roots:
        for variant in (path, os.path.realpath(path)):
            if variant.rstrip("/"):  # never "/" itself
                pairs.setdefault(variant.rstrip("/"), placeholder)
    return sorted(pairs.items(), key=lambda pair: -len(pair[0]))  # innermost first


def without_machine_paths(text: str, *, html: bool = False) -> str:
    """``text`` with this machine's paths replaced by placeholders (escaped in ``html``)."""
    escape = (lambda s: s.replace("<", "&lt;").replace(">", "&gt;")) if html else str
    text = CELL_FILE.sub(escape("<cell>"), text)
    for path, placeholder in _machine_paths():
        text = re.sub(re.escape(path) + r"(?![\w.-])", escape(placeholder), text)
    return text


def _map_strings(value: Any, *, html: bool = False) -> Any:
    """``value`` (JSON) with machine paths replaced in every string.

    Strings under a ``text/html`` key, and the ``value`` in an HTML widget's state, are HTML:
    a bare ``<repo>`` there would be read as a tag and vanish.
    """
    if isinstance(value, str):
        return without_machine_paths(value, html=html)
    if isinstance(value, list):
        return [_map_strings(v, html=html) for v in value]
    if not isinstance(value, dict):
        return value
    mapped = {k: _map_strings(v, html=html or k == "text/html") for k, v in value.items()}
    state = value.get("state")
    if value.get("model_name") in HTML_WIDGETS and isinstance(state, dict) and "value" in state:
        mapped["state"]["value"] = _map_strings(state["value"], html=True)
    return mapped


def strip_machine_paths(nb: Any) -> None:
    """Replace this machine's paths in ``nb``'s outputs and widget state (issue 13).

    The stored notebooks travel: a reader should not see the author's folders, and nbval's
    comparisons do not depend on them (``sanitize.cfg`` maps a fresh run's cell files to the
    same ``<cell>``).
    """
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = nbformat.from_dict(_map_strings(cell.outputs))
    if "widgets" in nb.metadata:
        nb.metadata.widgets = nbformat.from_dict(_map_strings(nb.metadata.widgets))


#: Lessons that need a Slurm cluster: built against the one ``SLURM_CONF`` names, or a
#: loopback cluster of three nodes started for the build (tests/slurm/, as root)
NEEDS_SLURM = ("07_from_laptop_to_cluster",)


@contextlib.contextmanager
def _slurm_for(name: str) -> Iterator[None]:
    if name not in NEEDS_SLURM or _slurm_answers():
        yield
        return
    scripts = ROOT / "tests" / "slurm"
    with tempfile.TemporaryDirectory() as where:
        subprocess.run(["bash", str(scripts / "start-cluster.sh"), where, "3", "2"], check=True)
        old = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = os.path.join(where, "slurm.conf")
        try:
            yield
        finally:
            subprocess.run(["bash", str(scripts / "stop-cluster.sh"), where], check=False)
            if old is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = old


def _slurm_answers() -> bool:
    try:
        done = subprocess.run(["sinfo", "-h"], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and bool(done.stdout.strip())


#: Lessons that need a Ray cluster: built against the one ``RAY_ADDRESS`` names, or a local
#: two-node one started for the build inside a network namespace of its own (Ray must not
#: listen beyond loopback: tests/_ray_cases.py, docs/development.md)
NEEDS_RAY = ("09_on_a_ray_cluster",)


@contextlib.contextmanager
def _ray_for(name: str) -> Iterator[None]:
    if name not in NEEDS_RAY or os.environ.get("RAY_ADDRESS"):
        yield
        return
    if [iface for _, iface in socket.if_nameindex()] != ["lo"]:
        raise SystemExit(
            f"{name} needs a Ray cluster: set RAY_ADDRESS, or build it inside a network "
            "namespace of its own, where this script starts a local one on loopback:\n"
            "  RAY_USAGE_STATS_ENABLED=0 unshare -n sh -c 'ip link set lo up && "
            f"python notebooks/_build.py {name}'"
        )
    sys.path.insert(0, str(ROOT / "tests"))
    from _ray_cases import local_ray

    with local_ray() as local:
        os.environ["RAY_ADDRESS"] = local.address
        try:
            yield
        finally:
            del os.environ["RAY_ADDRESS"]


def execute(nb: Any, name: str) -> None:
    """Run ``nb`` on the shipped kernelspec (installed into a temporary prefix)."""
    with _slurm_for(name), _ray_for(name):
        _execute(nb, name)


def _execute(nb: Any, name: str) -> None:
    from nbclient import NotebookClient

    spec = _kernelspec()
    with tempfile.TemporaryDirectory() as prefix:
        spec.install(prefix=prefix)
        # pytest's marker would stop ipykernel capturing fd output (TESTING.md, pitfall 1)
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        env["JUPYTER_PATH"] = os.path.join(prefix, "share", "jupyter")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        old = dict(os.environ)
        os.environ.update(env)  # the kernelspec manager reads JUPYTER_PATH from here
        try:
            client = NotebookClient(
                nb,
                kernel_name=spec.KERNEL_NAME,
                timeout=120,
                resources={"metadata": {"path": str(HERE)}},
                store_widget_state=True,
            )
            client.execute(env=env)
        finally:
            os.environ.clear()
            os.environ.update(old)
    strip_machine_paths(nb)
    print(f"executed {name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--check",
        action="store_true",
        help="execute nothing; exit 1 if an .ipynb is out of step with its .py",
    )
    group.add_argument(
        "--no-execute", action="store_true", help="write the cells only, without outputs"
    )
    group.add_argument(
        "--from-ipynb",
        action="store_true",
        help="rewrite each NAME.py from its NAME.ipynb (a lesson edited in Jupyter)",
    )
    parser.add_argument("names", nargs="*", help="notebooks, e.g. 01_quickstart (default: all)")
    args = parser.parse_args(argv)
    names = [Path(n).stem for n in args.names] or sources()
    unknown = [n for n in names if not source_path(n).exists()]
    if unknown:
        parser.error(f"no source notebooks/<name>.py for {unknown}; have {sources()}")
    if args.from_ipynb:
        if not args.names:
            parser.error("--from-ipynb needs the NAME of the notebook you edited")
        for name in names:
            changed = from_ipynb(name)
            print(f"{source_path(name).name}: {'rewritten' if changed else 'unchanged'}")
        print("then `ruff format notebooks` and `python notebooks/_build.py NAME` (executes it)")
        return 0
    if args.check:
        failed = 0
        for name in names:
            problem = check(name)
            failed += problem is not None
            print(f"{name}: {problem or 'in step'}")
        if failed:
            print("run `python notebooks/_build.py NAME` (re-executes it), or see README.md")
        return 1 if failed else 0
    for name in names:
        nb = build(name)
        if not args.no_execute:
            execute(nb, name)
        nbformat.write(nb, notebook_path(name))
        print(f"wrote {notebook_path(name).name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
