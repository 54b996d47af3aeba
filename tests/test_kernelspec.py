"""The shipped kernelspec: its template, the install command, and a kernel started from it.

A kernel started from the installed spec must run this interpreter, have the project's
IPython extension loaded (``%nl_info`` works), and not have imported torch at start-up.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import notebook_launcher
from notebook_launcher import _kernelspec
from notebook_launcher._kernelspec import DISPLAY_NAME, EXTENSION, KERNEL_NAME

pytestmark = pytest.mark.kernel

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_PARENT = str(Path(notebook_launcher.__file__).resolve().parents[1])
EXPECTED_TAIL = ["-m", "ipykernel_launcher", "-f", "{connection_file}", f"--ext={EXTENSION}"]


def _env_with_package(env: dict[str, str], **extra: str) -> dict[str, str]:
    """``env`` plus the notebook_launcher under test on the path (installed or not)."""
    paths = [PACKAGE_PARENT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(paths), **extra}


def test_repository_kernelspec_is_the_packaged_template() -> None:
    shipped = json.loads((ROOT / "kernels" / KERNEL_NAME / "kernel.json").read_text())
    packaged = json.loads(_kernelspec.template_path().read_text())
    assert shipped == packaged
    assert shipped["display_name"] == DISPLAY_NAME == "Python 3 (notebook_launcher)"
    assert shipped["language"] == "python"
    assert shipped["argv"] == ["python", *EXPECTED_TAIL]


def test_kernel_json_names_the_interpreter() -> None:
    assert _kernelspec.kernel_json()["argv"] == [sys.executable, *EXPECTED_TAIL]
    assert _kernelspec.kernel_json("/opt/env/bin/python3")["argv"][0] == "/opt/env/bin/python3"
    with pytest.raises(ValueError, match="not both"):
        _kernelspec.install(user=True, prefix="/nonexistent")


def test_missing_template_names_the_packaging_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_kernelspec, "_TEMPLATE_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"_kernel_template/\*\.json"):
        _kernelspec.kernel_json()


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "notebook_launcher", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(90)
def test_install_kernel_command_is_listed_by_jupyter(
    tmp_path: Path, kernel_env: dict[str, str]
) -> None:
    env = _env_with_package(kernel_env)

    done = _cli("install-kernel", "--prefix", str(tmp_path / "env"), env=env)
    assert done.returncode == 0, done.stderr
    spec_dir = tmp_path / "env" / "share" / "jupyter" / "kernels" / KERNEL_NAME
    assert str(spec_dir) in done.stdout
    spec = json.loads((spec_dir / "kernel.json").read_text())
    assert spec["argv"] == [sys.executable, *EXPECTED_TAIL]
    assert spec["display_name"] == DISPLAY_NAME
    assert {"logo-32x32.png", "logo-64x64.png"} <= {p.name for p in spec_dir.iterdir()}

    listed = subprocess.run(
        [sys.executable, "-m", "jupyter", "kernelspec", "list", "--json"],
        env={**env, "JUPYTER_PATH": str(tmp_path / "env" / "share" / "jupyter")},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    found = json.loads(listed.stdout)["kernelspecs"][KERNEL_NAME]
    assert Path(found["resource_dir"]) == spec_dir
    assert found["spec"]["display_name"] == DISPLAY_NAME

    # --user goes to Jupyter's data dir (redirected here), and re-installing replaces.
    user_data = tmp_path / "user-data"
    for _ in range(2):
        done = _cli("install-kernel", "--user", env={**env, "JUPYTER_DATA_DIR": str(user_data)})
        assert done.returncode == 0, done.stderr
    assert json.loads((user_data / "kernels" / KERNEL_NAME / "kernel.json").read_text()) == spec

    clash = _cli("install-kernel", "--user", "--prefix", str(tmp_path), env=env)
    assert clash.returncode == 2
    assert "not allowed with argument" in clash.stderr


@pytest.mark.timeout(90)
def test_install_kernel_into_an_environment_names_its_interpreter(
    tmp_path: Path, kernel_env: dict[str, str]
) -> None:
    """In a virtual environment, ``--sys-prefix`` (also the default there) installs into it,
    for its own interpreter."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site_packages = next((venv / "lib").glob("python*/site-packages"))
    ours = [p for p in sys.path if p.endswith("site-packages")] + [PACKAGE_PARENT]
    (site_packages / "outer.pth").write_text("\n".join(ours) + "\n")
    python = venv / "bin" / "python"
    spec_file = venv / "share" / "jupyter" / "kernels" / KERNEL_NAME / "kernel.json"
    env = {k: v for k, v in kernel_env.items() if not k.startswith(("JUPYTER", "PYTHON"))}
    for flags in (["--sys-prefix"], []):
        spec_file.unlink(missing_ok=True)
        done = subprocess.run(
            [str(python), "-m", "notebook_launcher", "install-kernel", *flags],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(spec_file.read_text())["argv"] == [str(python), *EXPECTED_TAIL]


@pytest.fixture
def kernel_from_spec(tmp_path: Path, kernel_env: dict[str, str]) -> Iterator[Any]:
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    installed = _kernelspec.install(prefix=str(tmp_path / "env"))
    ksm = KernelSpecManager(kernel_dirs=[str(Path(installed).parent)])
    km = KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm)
    km.start_kernel(env=_env_with_package(kernel_env), cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def _run(kc: Any, code: str) -> str:
    """Execute ``code`` in the kernel; return its stdout, fail on an error."""
    chunks: list[str] = []

    def on_output(msg: dict[str, Any]) -> None:
        content = msg["content"]
        if msg["msg_type"] == "stream" and content["name"] == "stdout":
            chunks.append(content["text"])
        elif msg["msg_type"] == "error":
            pytest.fail("kernel error: " + "\n".join(content["traceback"]))

    reply = kc.execute_interactive(code, output_hook=on_output, timeout=60)
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(chunks)


@pytest.mark.timeout(120)
def test_kernel_started_from_installed_spec_has_the_extension(
    kernel_from_spec: Any, tmp_path: Path
) -> None:
    kc = kernel_from_spec
    facts = json.loads(
        _run(
            kc,
            "import json, sys\n"
            "ip = get_ipython()\n"
            "print(json.dumps({'exe': sys.executable,\n"
            "  'loaded': sorted(e for e in ip.extension_manager.loaded if 'launcher' in e),\n"
            "  'magics': sorted(k for d in ip.magics_manager.magics.values() for k in d\n"
            "                   if k in ('nl_info', 'dist', 'distributed', 'rank')),\n"
            "  'torch_imported': 'torch' in sys.modules,\n"
            "  'user_ns': sorted(k for k in ip.user_ns if 'launcher' in k)}))",
        )
    )
    assert facts == {
        "exe": sys.executable,
        "loaded": ["notebook_launcher"],  # the one spelling the README gives
        "magics": ["dist", "distributed", "nl_info", "rank"],
        "torch_imported": False,
        "user_ns": [],
    }

    info = _run(kc, "%nl_info")
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in info.splitlines())
    assert rows["notebook_launcher"].startswith(notebook_launcher.__version__ + "  (")
    assert rows["python"].endswith(f"({sys.executable})")
    import torch

    assert rows["torch"] == torch.__version__
    assert "gloo" in rows["backends"]
    assert rows["in a worker"] == "no"
    assert ("CUDA device" if torch.cuda.is_available() else "CPU only") in rows["devices"]
    assert rows["start method"] == "fork (fast, nothing to pickle)"
    assert rows["ready to launch"] == "yes"

    # A process group created in the kernel itself would break the next launch: %nl_info says so.
    _run(
        kc,
        "import torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)",
    )
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in _run(kc, "%nl_info").splitlines())
    assert rows["ready to launch"].startswith("no: torch.distributed is already initialised")
    _run(kc, "dist.destroy_process_group()")

    # `%load_ext notebook_launcher` (what the README says for other kernels) is then a no-op,
    # and the extension unloads and reloads like any other.
    assert "already loaded" in _run(kc, "%load_ext notebook_launcher")
    _run(kc, "%unload_ext notebook_launcher")
    magics = "get_ipython().magics_manager.magics"
    assert _run(kc, f"print('nl_info' in {magics}['line'], 'distributed' in {magics}['cell'])") == (
        "False False\n"
    )
    _run(kc, "%load_ext notebook_launcher")
    assert _run(kc, "%nl_info").splitlines()[0].startswith("notebook_launcher")
    assert _run(kc, "print(sorted(k for k in get_ipython().magics_manager.magics['cell']))").count(
        "'distributed'"
    )
