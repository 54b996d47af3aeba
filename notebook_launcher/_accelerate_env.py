"""The environment real Accelerate (and Transformers' ``Trainer``) reads in each rank.

Many notebooks call our launcher on a function that uses the real ``accelerate`` package
unchanged. Accelerate learns how it was launched from environment variables that
``accelerate launch`` sets; without them, on a CPU machine each rank would see
``DistributedType.NO`` and train alone. :func:`accelerate_env` computes those variables for
one launch; the launcher adds them to every rank's environment (our own state reads the same
ones, so both agree).

Pure: no torch, no I/O, no global state; the caller passes the kernel's environment.

Example::

    accelerate_env("bf16", "gloo", threads_per_rank=4, environ={})
    # {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_CPU": "true",
    #  "FORK_LAUNCHED": "1", "OMP_NUM_THREADS": "4"}
"""

from __future__ import annotations

from collections.abc import Mapping

_TRUE = ("1", "true", "yes", "on", "y", "t")
_DEBUG_FLAGS = ("NOTEBOOK_LAUNCHER_DEBUG", "ACCELERATE_DEBUG_MODE")


def _flag(environ: Mapping[str, str], key: str) -> bool:
    return environ.get(key, "").strip().lower() in _TRUE


def accelerate_env(
    mixed_precision: str,
    backend: str,
    threads_per_rank: int | None,
    environ: Mapping[str, str],
    on_gpu: bool | None = None,
) -> dict[str, str]:
    """Variables to set in every rank so that real Accelerate sees the launch we made.

    Args:
        mixed_precision: the launch's checked value (``"no"``, ``"fp16"``, ``"bf16"``).
        backend: ``"gloo"`` (CPU ranks) or ``"nccl"`` (one GPU per rank).
        threads_per_rank: CPU threads the launcher gives each rank, or ``None`` when the user
            chose them (``OMP_NUM_THREADS`` is then left as it is).
        environ: the kernel's environment (read for the debug flags).
        on_gpu: whether the ranks use GPUs (None: they do on nccl); ranks that share a GPU,
            or a lone GPU rank, are on gloo yet not on the CPU.

    What is set, and why (``accelerate launch`` sets the same):

    * ``ACCELERATE_MIXED_PRECISION``: read by ``AcceleratorState`` (ours and theirs).
    * ``ACCELERATE_USE_CPU``: ``true`` on gloo. Accelerate forms a ``MULTI_CPU`` group only
      when told to use the CPU; otherwise each rank is a lone ``NO`` process. ``false`` on
      nccl, so a flag left in the kernel's environment cannot hide the GPUs.
    * ``ACCELERATE_DEBUG_MODE``: ``true`` when the kernel asked for debug mode
      (``NOTEBOOK_LAUNCHER_DEBUG`` or ``ACCELERATE_DEBUG_MODE``): shape checks before every
      collective, in both packages.
    * ``OMP_NUM_THREADS``: the launcher's share of the cores; without it Accelerate sizes the
      thread pool itself from ``psutil`` (all physical cores per rank) and warns.
    * ``FORK_LAUNCHED``: the process group belongs to the launcher, so Accelerate's
      ``destroy_process_group()`` in the function leaves it alone, as in its own
      ``notebook_launcher``.

    Left out on purpose: ``KMP_AFFINITY``/``KMP_BLOCKTIME`` (Intel OpenMP pinning: ``compact``
    from every rank of one machine would pin all ranks to the same cores), the dynamo, FSDP,
    DeepSpeed and Megatron variables (not supported here), and ``NCCL_P2P_DISABLE`` /
    ``NCCL_IB_DISABLE`` (only needed on RTX 4000-series cards with old drivers).
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    env = {
        "ACCELERATE_MIXED_PRECISION": mixed_precision,
        "ACCELERATE_USE_CPU": "false"
        if (backend == "nccl" if on_gpu is None else on_gpu)
        else "true",
        "FORK_LAUNCHED": "1",
    }
    if any(_flag(environ, key) for key in _DEBUG_FLAGS):
        env["ACCELERATE_DEBUG_MODE"] = "true"
    if threads_per_rank is not None:
        env["OMP_NUM_THREADS"] = str(threads_per_rank)
    return env


__all__ = ["accelerate_env"]
