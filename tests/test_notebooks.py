"""The teaching notebooks run top to bottom under nbval, on the shipped kernelspec.

One ``pytest --nbval`` subprocess runs every notebook (a fresh kernel each), with the
"notebook-launcher" kernelspec installed into a temporary prefix (found through
``JUPYTER_PATH``), so the suite's one command (``pytest``) checks them without installing
anything anywhere; each notebook's test then reads its cells' outcomes from that run's
report. They run in strict mode: every cell's output is compared with the stored one after
``notebooks/sanitize.cfg``, except cells tagged ``nbval-ignore-output`` (dashboards,
``%nl_info``); every notebook also asserts what it teaches.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import nbformat
import pytest

import notebook_launcher
from notebook_launcher._kernelspec import DISPLAY_NAME, KERNEL_NAME, install

from .helpers import SlurmTestCluster, kernel_env

pytestmark = pytest.mark.notebook

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(p.name for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
#: Lessons whose kernel must be on a Ray cluster: tests/test_ray.py runs them under nbval,
#: inside its network namespace, on its Ray cluster (Ray must not listen beyond loopback)
ON_RAY = ("09_on_a_ray_cluster.ipynb",)
#: Extras a lesson needs beyond ``[jupyter]``
EXTRAS = {"09_on_a_ray_cluster.py": ("ray",)}
PACKAGE_PARENT = str(Path(notebook_launcher.__file__).resolve().parents[1])


def test_notebooks_are_the_nine_of_the_course() -> None:
    assert NOTEBOOKS == [
        "01_quickstart.ipynb",
        "02_execution_process.ipynb",
        "03_training.ipynb",
        "04_debugging.ipynb",
        "05_interactive_debugging.ipynb",
        "06_transformers_trainer.ipynb",
        "07_from_laptop_to_cluster.ipynb",
        "08_runs_that_outlive_the_kernel.ipynb",
        "09_on_a_ray_cluster.ipynb",
    ]


def _imported_modules(source: str) -> set[str]:
    """Top-level names of every module a notebook source imports, in any cell, function or
    ``%%distributed`` cell (magics are comments in the jupytext source: the rest is Python)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed_by(extras: tuple[str, ...]) -> set[str]:
    """Distributions ``pip install -e '.[extras]'`` installs: pyproject.toml's dependencies
    and those extras, with what they require in turn (read from the installed metadata)."""
    from packaging.requirements import Requirement

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: what was installed from it
        ours = importlib.metadata.requires("notebook_launcher") or []
        wanted = [
            r
            for r in ours
            if Requirement(r).marker is None
            or any(
                Requirement(r).marker.evaluate({"extra": e})
                for e in extras  # type: ignore[union-attr]
            )
        ]
    else:
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        wanted = list(project["dependencies"])
        for extra in extras:
            wanted += project["optional-dependencies"][extra]
    seen: set[str] = set()
    while wanted:
        req = Requirement(wanted.pop())
        name = _normalized(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            wanted += importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            pass  # not installed here: its own requirements are not known
    return seen


def test_the_jupyter_extra_installs_every_import_of_the_shipped_notebooks() -> None:
    """The README's "Use it in Jupyter" install (``.[jupyter]``) runs every lesson: each module
    a notebook imports is the standard library's, ours, or comes with that extra."""
    where = importlib.metadata.packages_distributions()
    missing = {}
    for source in sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.py")):
        installed = _installed_by(("jupyter", *EXTRAS.get(source.name, ())))
        for module in sorted(_imported_modules(source.read_text())):
            if module in sys.stdlib_module_names or module == "notebook_launcher":
                continue
            dists = {_normalized(d) for d in where.get(module, [module])}
            if not dists & installed:
                missing.setdefault(source.name, []).append(module)
    assert not missing, (
        f"not installed by pip install -e '.[jupyter]' (and the lesson's EXTRAS): {missing}; "
        "add them to the [jupyter] extra in pyproject.toml"
    )
    # the check has teeth: notebook 06's Trainer comes with the extra, not with the package
    assert "transformers" in _imported_modules(
        (NOTEBOOK_DIR / "06_transformers_trainer.py").read_text()
    )
    assert "transformers" not in _installed_by(())
    assert "ray" not in _installed_by(("jupyter",))  # lesson 09 needs the [ray] extra too


def _build_module() -> Any:
    """notebooks/_build.py, which reads the notebooks' jupytext sources."""
    sys.path.insert(0, str(NOTEBOOK_DIR))
    try:
        import _build
    finally:
        sys.path.remove(str(NOTEBOOK_DIR))
    return _build


def test_every_notebook_has_its_jupytext_source() -> None:
    sources = sorted(p.stem for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.py"))
    assert sources == [Path(name).stem for name in NOTEBOOKS]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_in_step_with_its_source(name: str) -> None:
    """The .ipynb holds the cells of its notebooks/NN_name.py, the shipped kernel, and outputs."""
    source = NOTEBOOK_DIR / f"{Path(name).stem}.py"
    stored = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    built = _build_module().build(name)  # jupytext.read(source, fmt="py:percent")

    def cells(nb: Any) -> list[tuple[str, str, list[str]]]:
        return [(c["cell_type"], c["source"], c["metadata"].get("tags", [])) for c in nb["cells"]]

    assert len(built.cells) > 1, f"{source} was read as one cell: is it in percent format?"
    assert cells(stored) == cells(built), (
        f"{name} differs from {source.name}: run `python notebooks/_build.py {Path(name).stem}`"
        " (or `--from-ipynb NAME` after editing the .ipynb, see notebooks/README.md)"
    )
    assert stored["metadata"]["kernelspec"] == {
        "name": KERNEL_NAME,
        "display_name": DISPLAY_NAME,
        "language": "python",
    }
    code_cells = [c for c in stored["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code_cells), f"{name} was not executed"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_the_source_is_what_its_notebook_writes_back(name: str) -> None:
    """``_build.py --from-ipynb`` (the way back from an edit in Jupyter) writes the source
    as it is: same cells and tags, no header; so the ``.py`` and ``.ipynb`` agree exactly."""
    build = _build_module()
    source = (NOTEBOOK_DIR / f"{Path(name).stem}.py").read_text()
    assert build.source_text(build.build(name)) == source
    assert build.source_text(nbformat.read(NOTEBOOK_DIR / name, as_version=4)) == source


def test_nothing_pairs_a_notebook_with_its_source() -> None:
    """Saving a lesson in JupyterLab (with jupytext's contents manager, which the test extras
    install) must write the ``.ipynb`` alone: no jupytext configuration in the repository
    pairs the folder, and no notebook carries pairing metadata."""
    from jupytext.config import find_jupytext_configuration_file

    found = find_jupytext_configuration_file(str(NOTEBOOK_DIR))
    assert found is None or ROOT not in Path(found).resolve().parents, found
    for name in NOTEBOOKS:
        assert "jupytext" not in nbformat.read(NOTEBOOK_DIR / name, as_version=4).metadata


def test_from_ipynb_rewrites_the_source_of_an_edited_notebook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build = _build_module()
    for suffix in (".py", ".ipynb"):
        path = NOTEBOOK_DIR / f"01_quickstart{suffix}"
        (tmp_path / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(build, "HERE", tmp_path)
    assert build.main(["--from-ipynb", "01_quickstart"]) == 0
    assert (tmp_path / "01_quickstart.py").read_bytes() == (
        NOTEBOOK_DIR / "01_quickstart.py"
    ).read_bytes()  # nothing edited: nothing changes
    nb = nbformat.read(tmp_path / "01_quickstart.ipynb", as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("print('added in Jupyter')"))
    nb.cells[-1].metadata["tags"] = ["nbval-ignore-output"]
    nbformat.write(nb, tmp_path / "01_quickstart.ipynb")
    assert build.from_ipynb("01_quickstart")
    text = (tmp_path / "01_quickstart.py").read_text()
    assert text.endswith("# %% tags=[\"nbval-ignore-output\"]\nprint('added in Jupyter')\n"), text
    # the .ipynb holds the cells of the new .py (the new cell was not run yet)
    assert build.check("01_quickstart") == "not executed"


def _this_machines_paths() -> list[str]:
    """Folders of this machine that a notebook executed here could name."""
    folders = {
        str(ROOT),
        PACKAGE_PARENT,
        sys.prefix,
        sys.base_prefix,
        str(Path(sys.executable).parent),
        str(Path.home()),
        tempfile.gettempdir(),
    }
    folders |= {os.path.realpath(f) for f in folders}
    return sorted(f.rstrip("/") for f in folders if f.rstrip("/"))


#: An absolute path under a folder that only a machine has, wherever the notebook was run.
_ABSOLUTE_PATH = re.compile(
    r"(?<![\w.:/<~])/(?:tmp|work|root|home|Users|private|var|opt|usr|mnt|srv|scratch)/[^\s\"'<>]*"
)


def _stored_strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for v in value for s in _stored_strings(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _stored_strings(v)]
    return []


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_stored_notebook_names_no_machine_paths(name: str) -> None:
    """Outputs, cell metadata and notebook metadata (widget state) name no machine's folders.

    The build replaces them with placeholders (``<repo>``, ``<venv>``, ``<tmp>``, ``<cell>``,
    ``~``); the cell sources are ours and are not scanned.
    """
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    stored = [dict(nb["metadata"])]
    stored += [{k: v for k, v in cell.items() if k != "source"} for cell in nb["cells"]]
    patterns: list[str | re.Pattern[str]] = [
        re.escape(folder) + r"(?![\w.-])" for folder in _this_machines_paths()
    ]
    patterns.append(_ABSOLUTE_PATH)
    found = [
        f"{m.group()!r} in ...{text[max(0, m.start() - 80) : m.end() + 80]!r}..."
        for text in _stored_strings(stored)
        for pattern in patterns
        for m in re.finditer(pattern, text)
    ]
    assert not found, (
        f"{name} stores machine paths (re-run `python notebooks/_build.py {Path(name).stem}`):\n"
        + "\n".join(found)
    )


@pytest.fixture(scope="module")
def jupyter_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    prefix = tmp_path_factory.mktemp("kernel-prefix")
    install(prefix=str(prefix))
    return str(prefix / "share" / "jupyter")


def _nbval(
    paths: list[Path], rootdir: Path, jupyter_path: str, cwd: Path
) -> subprocess.CompletedProcess[str]:
    """``pytest --nbval paths`` in a subprocess, on the kernelspec found in ``jupyter_path``.

    The subprocess gets an environment without ``PYTEST_CURRENT_TEST``; its own pytest sets
    the variable again, and notebooks/conftest.py keeps it away from nbval's kernels.
    """
    env = kernel_env()
    pythonpath = [PACKAGE_PARENT, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["JUPYTER_PATH"] = jupyter_path  # finds the kernelspec installed for this test run
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)  # the kernel imports the code under test
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
            "--nbval",
            "--nbval-kernel-name",
            KERNEL_NAME,
            "--nbval-sanitize-with",
            str(NOTEBOOK_DIR / "sanitize.cfg"),
            "--rootdir",
            str(rootdir),
            *map(str, paths),
        ],
        cwd=str(cwd),
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )


@pytest.mark.timeout(60)
def test_nbval_kernel_captures_fd_output_without_the_pytest_marker(
    jupyter_path: str, tmp_path: Path
) -> None:
    """notebooks/conftest.py starts nbval's kernel without PYTEST_CURRENT_TEST (pitfall 1)."""
    cell = nbformat.v4.new_code_cell(
        "import os, time\n"
        "print(os.environ.get('PYTEST_CURRENT_TEST'))\n"
        "_ = os.write(1, b'written to fd 1\\n')\n"
        "time.sleep(0.2)",
        execution_count=1,
        outputs=[nbformat.v4.new_output("stream", name="stdout", text="None\nwritten to fd 1\n")],
    )
    nb = nbformat.v4.new_notebook(cells=[cell])
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": DISPLAY_NAME}
    folder = tmp_path / "nb"
    folder.mkdir()
    nbformat.write(nb, folder / "fd_check.ipynb")
    (folder / "conftest.py").write_text((NOTEBOOK_DIR / "conftest.py").read_text())
    done = _nbval([folder / "fd_check.ipynb"], folder, jupyter_path, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


@pytest.fixture(scope="module")
def nbval_report(
    jupyter_path: str, tmp_path_factory: pytest.TempPathFactory, slurm: SlurmTestCluster
) -> str:
    """One nbval run over every notebook (one kernel each); its ``-rA`` report. Lesson 7
    drives the test Slurm cluster (its kernel finds it through ``SLURM_CONF``)."""
    done = _nbval(
        [NOTEBOOK_DIR / name for name in NOTEBOOKS if name not in ON_RAY],
        ROOT,
        jupyter_path,
        tmp_path_factory.mktemp("nbval"),
    )
    return done.stdout + done.stderr


# The first case pays for the module's fixtures: the test Slurm cluster's start (up to 300 s
# on a loaded machine) and the nbval run (its own limit: 280 s), each with its own timeout.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [name for name in NOTEBOOKS if name not in ON_RAY])
def test_notebook_runs_under_nbval(name: str, nbval_report: str) -> None:
    """Every code cell of the notebook ran and matched its stored output (or raised as tagged).
    The lessons ``ON_RAY`` run so in tests/test_ray.py, on its Ray cluster."""
    outcomes = [
        line.split(" ", 1)[0]
        for line in nbval_report.splitlines()
        if f"{name}::Cell " in line and line.startswith(("PASSED ", "FAILED ", "ERROR "))
    ]
    code_cells = sum(c.cell_type == "code" for c in nbformat.read(NOTEBOOK_DIR / name, 4).cells)
    assert outcomes == ["PASSED"] * code_cells, f"nbval on {name}:\n{nbval_report}"
