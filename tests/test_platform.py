"""Where it runs (issue 26): a launch needs Linux (pidfds, ``/proc``, the parent-death
signal, ``fork``). Elsewhere the package imports, and a launch or a session says in one
sentence what the platform lacks, before anything starts. Tested by taking those facilities
away on Linux: in this process, and in a fresh interpreter dressed as macOS."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import notebook_launcher
from notebook_launcher import PreflightError
from notebook_launcher._launch import preflight

from .helpers import ROOT, kernel_env

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(60)]


def _one_sentence(message: str) -> bool:
    return message.endswith(".") and ". " not in message


def test_linux_has_what_a_launch_needs() -> None:
    assert preflight.platform_lacks() == []
    preflight.check_platform()


def test_a_launch_without_pidfds_is_refused_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(os, "pidfd_open")  # a kernel before 5.3, or not Linux
    with pytest.raises(PreflightError) as caught:
        notebook_launcher.notebook_launcher(print, num_processes=2, dashboard=False)
    message = str(caught.value)
    assert message.startswith("notebook_launcher starts ranks on Linux only and this is linux")
    assert "lacks pidfds (os.pidfd_open, Linux 5.3 or later)" in message
    assert "importing it works here" in message and _one_sentence(message), message
    # (no rank was started: the autouse no_leftovers fixture finds no child)


#: A fresh interpreter without what Linux alone has: macOS's os, signal and sys.platform.
MACOS = """
import os, signal, sys
for module, names in ((os, ("pidfd_open", "P_PIDFD", "sched_getaffinity", "memfd_create")),
                      (signal, ("SIGRTMIN", "SIGRTMAX", "pidfd_send_signal"))):
    for name in names:
        if hasattr(module, name):
            delattr(module, name)
import torch  # (its own import reads sys.platform)
sys.platform = "darwin"
import importlib, pkgutil
import notebook_launcher
from notebook_launcher import PreflightError
failed = []
for module in pkgutil.walk_packages(notebook_launcher.__path__, "notebook_launcher."):
    leaf = module.name.rsplit(".", 1)[1]
    if leaf in ("__main__", "big_modeling", "hooks"):  # (the last two refuse: Accelerate's)
        continue
    try:
        importlib.import_module(module.name)
    except Exception as e:
        failed.append(f"{module.name}: {e!r}")
print("IMPORT FAILED", failed)
for start in (lambda: notebook_launcher.notebook_launcher(print, num_processes=2),
              lambda: notebook_launcher.start(num_processes=2)):
    try:
        start()
    except PreflightError as e:
        print("REFUSED", e)
with open(f"/proc/self/task/{os.getpid()}/children") as f:
    print("CHILDREN", f.read().split())
"""


def test_on_macos_importing_works_and_a_launch_says_what_it_lacks() -> None:
    done = subprocess.run(
        [sys.executable, "-c", MACOS],
        env={**kernel_env(), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "IMPORT FAILED []" in lines, done.stdout
    refused = [line.removeprefix("REFUSED ") for line in lines if line.startswith("REFUSED ")]
    assert len(refused) == 2, done.stdout  # a launch and a session
    for message in refused:
        assert message.startswith(
            "notebook_launcher starts ranks on Linux only and this is darwin, which lacks "
            "pidfds (os.pidfd_open, Linux 5.3 or later): importing it works here, but run "
            "launches and sessions on a Linux machine"
        ), message
        assert _one_sentence(message), message
    assert lines[-1] == "CHILDREN []", done.stdout  # nothing was started
