"""IPython extension loaded by the ``notebook-launcher`` kernel: the ``%nl_info`` magic.

The shipped kernelspec starts ipykernel with ``--ext=notebook_launcher.ipython_extension``;
any other IPython loads it with ``%load_ext notebook_launcher.ipython_extension``. Loading
puts nothing in the user's namespace and imports neither torch nor the launcher, so kernel
start-up stays fast; ``%nl_info`` imports them when it runs.

``%nl_info`` prints what a student needs to know before a launch: the versions in use, the
devices torch sees, how workers will be started (fork, or a forkserver once CUDA is
initialised in the kernel), and whether the next launch would pass its preflight checks (no
process group or ``PartialState`` created in the kernel itself).

Example (in a notebook)::

    %nl_info
    # notebook_launcher 0.1.0   (/path/to/notebook_launcher)
    # python            3.11.9  (/opt/venv/bin/python)
    # torch             2.13.0+cpu
    # ...
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

from ._launch import preflight
from .errors import PreflightError

#: The magic's name (``%nl_info``).
MAGIC_NAME = "nl_info"


def info_lines() -> list[str]:
    """The report ``%nl_info`` prints, one ``name  value`` line each (imports torch)."""
    import notebook_launcher

    pkg_dir = os.path.dirname(notebook_launcher.__file__ or "")
    lines = [
        ("notebook_launcher", f"{notebook_launcher.__version__}  ({pkg_dir})"),
        ("python", f"{platform.python_version()}  ({sys.executable})"),
    ]
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        lines.append(("torch", f"not importable: {exc}"))
        return _format(lines)
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backends = [
        name
        for name, ok in (
            ("gloo", dist.is_available() and dist.is_gloo_available()),
            ("nccl", dist.is_available() and dist.is_nccl_available()),
        )
        if ok
    ]
    method, reason = preflight.resolve_start_method(None, preflight.cuda_initialized())
    if cuda_devices:
        devices = f"{cuda_devices} CUDA device(s): " + ", ".join(
            torch.cuda.get_device_name(i) for i in range(cuda_devices)
        )
        workers = f"one per GPU (num_processes <= {cuda_devices}), backend nccl"
    else:
        devices = f"CPU only ({os.cpu_count()} cores)"
        workers = "CPU processes, backend gloo"
    lines += [
        ("torch", torch.__version__),
        ("devices", devices),
        ("backends", ", ".join(backends) or "none (torch.distributed unavailable)"),
        ("workers", workers),
        ("start method", f"{method} ({reason})"),
        ("ready to launch", _launch_readiness()),
        ("in a worker", "yes" if os.environ.get("NOTEBOOK_LAUNCHER_WORKER") == "1" else "no"),
    ]
    return _format(lines)


def _launch_readiness() -> str:
    """``"yes"``, or the first preflight error the next launch from this kernel would raise."""
    state = sys.modules.get("notebook_launcher.state")
    try:
        preflight.check_no_process_group_in_parent()
        preflight.check_no_state_in_parent(getattr(state, "state_in_use", None))
    except PreflightError as exc:
        return f"no: {exc}"
    return "yes"


def _format(pairs: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in pairs)
    return [f"{k:<{width}}  {v}" for k, v in pairs]


def nl_info(line: str = "") -> None:
    """``%nl_info``: print versions, devices and how workers will start."""
    print("\n".join(info_lines()))


def load_ipython_extension(ip: Any) -> None:
    """Called by IPython on ``%load_ext`` (and by the kernelspec's ``--ext``)."""
    ip.register_magic_function(nl_info, magic_kind="line", magic_name=MAGIC_NAME)


def unload_ipython_extension(ip: Any) -> None:
    """Called by IPython on ``%unload_ext``: remove the magic again."""
    ip.magics_manager.magics["line"].pop(MAGIC_NAME, None)


__all__ = ["MAGIC_NAME", "info_lines", "load_ipython_extension", "nl_info"]
