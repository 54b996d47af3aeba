"""The GPUs of the machine the suite runs on, and which tiers see them.

Only the ``gpu`` tier uses them. Every other tier runs CPU ranks on gloo (what CI has, and
what those tests assert: ``cpu`` devices, fp16 refused without CUDA), so the suite hides
the GPUs from them by setting ``CUDA_VISIBLE_DEVICES=""`` for the test process and all it
starts (:func:`hide`, called by ``conftest.py`` at import), and gives them back to a ``gpu``
test for its duration (the ``conftest.gpu_tier_sees_the_gpus`` fixture). Both ask NVML
(``_placement.inventory``), never the CUDA runtime: the test process launches by fork, and
must stay as a kernel would be.
"""

from __future__ import annotations

import os

from notebook_launcher import _placement

#: CUDA_VISIBLE_DEVICES as the suite found it (None: unset)
MACHINE_VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES")


def machine_env() -> dict[str, str]:
    """The environment with the machine's own CUDA_VISIBLE_DEVICES."""
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if MACHINE_VISIBLE is not None:
        env["CUDA_VISIBLE_DEVICES"] = MACHINE_VISIBLE
    return env


def count() -> int:
    """How many GPUs the ``gpu`` tier has (0 on CI)."""
    return _placement.inventory(machine_env()).count


def hide() -> None:
    """Every tier but ``gpu`` runs CPU ranks (nothing changes on a machine without GPUs)."""
    if count():
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


#: the skip of every ``gpu`` test on a machine without one
REASON = "needs a CUDA GPU (NVML sees none here; the suite's CPU tiers cover the rest)"
