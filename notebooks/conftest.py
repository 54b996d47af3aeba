"""nbval glue for the teaching notebooks (used when pytest collects ``notebooks/*.ipynb``).

ipykernel stops capturing file-descriptor output (``os.write(1, ...)``, C++ code, child
processes) when ``PYTEST_CURRENT_TEST`` is in its environment, and a kernel started by nbval
inherits it from pytest (shared/TESTING.md, pitfall 1). nbval has no option for the kernel's
environment, so its kernel start is wrapped to pass one without that variable.

Run directly (after ``python -m notebook_launcher install-kernel``)::

    pytest --nbval --nbval-sanitize-with notebooks/sanitize.cfg notebooks/

``tests/test_notebooks.py`` does this with the kernelspec installed into a temporary prefix.
"""

from __future__ import annotations

import os
from typing import Any

import nbval.kernel

_DROP = ("PYTEST_CURRENT_TEST",)
_original_start_new_kernel = nbval.kernel.start_new_kernel


def kernel_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _DROP}


def _start_new_kernel(*args: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("env", kernel_env())  # passed on to KernelManager.start_kernel
    return _original_start_new_kernel(*args, **kwargs)


nbval.kernel.start_new_kernel = _start_new_kernel  # RunningKernel looks it up when called
