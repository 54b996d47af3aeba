"""The Jupyter kernelspec the project ships: ipykernel plus our IPython extension.

The template lives in the package (``notebook_launcher/_kernel_template/kernel.json``, a copy
of the repository's ``kernels/notebook-launcher/kernel.json``) so that it is found after an
editable *and* a regular install. Installing renders the template for one interpreter
(``argv[0]`` becomes that interpreter's path), adds ipykernel's logos when they are there,
and hands the folder to ``jupyter_client``, which puts it where ``jupyter kernelspec list``
looks: the user's data dir, the environment (``sys.prefix``) or any prefix.

Example::

    from notebook_launcher._kernelspec import install
    path = install(prefix="/tmp/env")   # -> /tmp/env/share/jupyter/kernels/notebook-launcher
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Name of the kernel (``--nbval-kernel-name``, the notebooks' ``metadata.kernelspec.name``).
KERNEL_NAME = "notebook-launcher"
#: What Jupyter shows in its kernel picker.
DISPLAY_NAME = "Python 3 (notebook_launcher)"
#: The IPython extension every kernel started from the spec loads: the package itself, the
#: one name ``%load_ext notebook_launcher`` uses too (loading it again is then a no-op).
EXTENSION = "notebook_launcher"

_TEMPLATE_DIR = Path(__file__).with_name("_kernel_template")
_PYTHON_PLACEHOLDERS = {"python", "python3"}


def template_path() -> Path:
    """Path of the packaged ``kernel.json`` template."""
    path = _TEMPLATE_DIR / "kernel.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: notebook_launcher was installed without its package data "
            "(pyproject.toml must list '_kernel_template/*.json' under "
            "[tool.setuptools.package-data]); reinstall it from a fixed build"
        )
    return path


def kernel_json(executable: str | None = None) -> dict[str, Any]:
    """The kernelspec for ``executable`` (default: this interpreter) as a dict.

    >>> kernel_json("/opt/venv/bin/python")["argv"][:3]
    ['/opt/venv/bin/python', '-m', 'ipykernel_launcher']
    """
    spec: dict[str, Any] = json.loads(template_path().read_text(encoding="utf-8"))
    argv = list(spec["argv"])
    if argv and argv[0] in _PYTHON_PLACEHOLDERS:
        argv[0] = executable or sys.executable
    spec["argv"] = argv
    return spec


def _ipykernel_logos() -> list[Path]:
    try:
        import ipykernel
    except ImportError:  # the spec still works; Jupyter shows a default icon
        return []
    resources = Path(ipykernel.__file__).with_name("resources")
    return sorted(p for p in resources.glob("logo-*") if p.is_file())


def install(
    *,
    user: bool = False,
    prefix: str | None = None,
    executable: str | None = None,
    kernel_name: str = KERNEL_NAME,
) -> str:
    """Install the kernelspec and return the folder it was written to.

    ``user=True`` installs for the current user, ``prefix=P`` into ``P/share/jupyter/kernels``
    (``prefix=sys.prefix`` is "this environment"); with neither, Jupyter's system-wide folder.
    An existing spec of the same name is replaced.

    Example::

        install(prefix=sys.prefix)   # what `python -m notebook_launcher install-kernel --sys-prefix` does
    """
    if user and prefix is not None:
        raise ValueError("choose one of user=True or prefix=..., not both")
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory(prefix="notebook-launcher-kernelspec-") as tmp:
        source = Path(tmp) / kernel_name
        source.mkdir()
        spec_text = json.dumps(kernel_json(executable), indent=1) + "\n"
        (source / "kernel.json").write_text(spec_text, encoding="utf-8")
        for logo in _ipykernel_logos():
            shutil.copy(logo, source / logo.name)
        return KernelSpecManager().install_kernel_spec(
            str(source), kernel_name=kernel_name, user=user, prefix=prefix
        )


__all__ = ["DISPLAY_NAME", "EXTENSION", "KERNEL_NAME", "install", "kernel_json", "template_path"]
