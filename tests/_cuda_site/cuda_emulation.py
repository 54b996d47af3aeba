"""A CPU build of torch that behaves, for fork, as a CUDA build does on a GPU machine.

CI has no GPU, and the CPU build of torch has none of CUDA's entry points, so nothing on
CPU fails the way a GPU launch fails. This module gives a fresh interpreter's torch those
entry points with CUDA's fork rules, each taken from torch's own source (torch 2.13;
``torch/csrc/cuda/Module.cpp`` and ``torch/cuda/__init__.py``):

* **poisoning** -- ``poison_fork()`` registers a ``pthread_atfork`` child handler that sets
  ``in_bad_fork`` in every process forked afterwards (``Module.cpp``: ``forked_child``).
  It is called by ``THCPModule_getDeviceCount_wrap`` (``torch._C._cuda_getDeviceCount``),
  ``THCPModule_getArchFlags`` (``torch._C._cuda_getArchFlags``, what
  ``torch.cuda.get_arch_list()`` calls) and ``THCPModule_initExtension``
  (``torch._C._cuda_init``, what ``torch.cuda._lazy_init()`` calls). Here: the process that
  poisons is remembered by pid, and any other process that still carries that memory (a
  fork, at any depth, before an exec) is in a bad fork -- as the inherited handler makes it.
* **initialising** -- ``torch.cuda._lazy_init()`` (torch's own, unchanged) raises torch's
  own "Cannot re-initialize CUDA in forked subprocess" in a bad fork, else calls
  ``_cuda_init``; every ``_lazy_init`` path is torch's own Python and so reaches it as on a
  GPU: ``set_device``, ``current_device``, ``get_device_properties``, ``mem_get_info``,
  ``set_per_process_memory_fraction``, ``is_bf16_supported`` (bf16 autocast), a CUDA
  tensor (C++ ``device_lazy_init`` calls ``torch.cuda._lazy_init``). ``_cuda_init`` and
  ``cudaGetDeviceCount`` initialise the driver: here a stand-in ``libcuda.so.1``
  (``fake_cuda.c``) whose ``cuInit`` fails in a process forked after its parent's, as
  CUDA's does.
* **pinning** -- ``Tensor.pin_memory()`` reaches the CUDA context through ATen's CUDA
  hooks (the pinned-memory allocator initialises CUDA in C++), not through
  ``torch.cuda._lazy_init``: the driver is initialised, torch's Python flag is not, and no
  fork handler is registered.
* **counting** -- ``torch.cuda.device_count()`` and, with ``PYTORCH_NVML_BASED_CUDA_CHECK=1``,
  ``is_available()`` ask NVML (torch's own code, through ``ctypes``): a stand-in
  ``libnvidia-ml.so.1`` (``fake_nvml.c``) says what GPUs the pretend machine has. When
  NVML cannot answer, torch falls back to ``_cuda_getDeviceCount`` -- and poisons.

A CUDA tensor cannot be made (no CUDA kernels in a CPU build): after the emulated
initialisation its allocation fails with torch's "Could not run ... 'CUDA' backend". NCCL
groups are gloo groups (a CPU build has no NCCL), so ranks placed on the pretend GPUs come
up, set their device and talk. What a launch does with a GPU rank up to the user's code is
real; what the user's code computes on a GPU is not.

Turned on for a whole process tree by :func:`environment` (``sitecustomize.py`` beside this
file does the install, in every interpreter the tree starts). ``NL_EMULATE_LOG``: every
poisoning and initialisation is appended there, with its process and stack, so that a test
can say where one came from.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: the architectures the pretend torch build was compiled for (a CUDA 13 wheel's set)
ARCH_FLAGS = "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120 compute_120"
#: torch's message for CUDA used in a bad fork (torch/cuda/__init__.py, _lazy_init)
BAD_FORK_MESSAGE = "Cannot re-initialize CUDA in forked subprocess"

_poisoned_in: int | None = None  # the pid whose process registered CUDA's fork handler
_current = 0  # the current device (c10::cuda::current_device)
_fractions: dict[int, float] = {}


# ---- the pretend machine's libraries ---------------------------------------------------


def build(cache: Path | None = None) -> Path:
    """Compile ``fake_cuda.c`` and ``fake_nvml.c`` (once per source; ``cc``) into a folder
    holding ``libcuda.so.1`` and ``libnvidia-ml.so.1``, and ``r440/libnvidia-ml.so.1``
    (an NVML without ``nvmlDeviceGetMigMode``, as drivers before R450). Returns the folder."""
    sources = [HERE / "fake_cuda.c", HERE / "fake_nvml.c"]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]
    root = (cache or Path(os.environ.get("TMPDIR", "/tmp"))) / f"nl-fake-cuda-{os.getuid()}"
    out = root / digest
    if (out / "r440" / "libnvidia-ml.so.1").exists():
        return out
    (out / "r440").mkdir(parents=True, exist_ok=True)
    jobs = [
        ("fake_cuda.c", out / "libcuda.so.1", []),
        ("fake_nvml.c", out / "libnvidia-ml.so.1", []),
        ("fake_nvml.c", out / "r440" / "libnvidia-ml.so.1", ["-DNO_MIG_MODE"]),
    ]
    for source, target, flags in jobs:
        part = target.with_name(target.name + f".{os.getpid()}.tmp")
        soname = target.name
        subprocess.run(
            ["cc", "-shared", "-fPIC", "-O1", *flags, f"-Wl,-soname,{soname}", "-o", str(part)]
            + [str(HERE / source)],
            check=True,
            capture_output=True,
        )
        os.replace(part, target)  # atomic: another test process may be building too
    return out


def environment(
    base: dict[str, str] | None = None,
    *,
    gpus: int = 2,
    nvml_fault: str = "",
    nvml_check: bool = True,
    log: str | Path | None = None,
    libraries: Path | None = None,
) -> dict[str, str]:
    """The environment of a process tree whose torch behaves as a CUDA build on a machine
    with ``gpus`` GPUs (NVML's stand-in says so). ``nvml_check=False`` leaves out
    ``PYTORCH_NVML_BASED_CUDA_CHECK`` (what the package sets at import)."""
    env = dict(os.environ if base is None else base)
    libs = libraries or build()
    env["NL_EMULATE_CUDA"] = "1"
    env["NL_FAKE_GPUS"] = str(gpus)
    if nvml_fault:
        env["NL_FAKE_NVML_FAULT"] = nvml_fault
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (str(libs), env.get("LD_LIBRARY_PATH", "")) if p
    )
    root = str(HERE.parents[1])
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), root, env.get("PYTHONPATH", "")) if p
    )
    if not nvml_check:
        env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    if log is not None:
        env["NL_EMULATE_LOG"] = str(log)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


# ---- CUDA's fork rules ------------------------------------------------------------------


def _note(what: str) -> None:
    """Append one poisoning or initialisation to NL_EMULATE_LOG."""
    path = os.environ.get("NL_EMULATE_LOG")
    if not path:
        return
    entry = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "what": what,
        "rank": os.environ.get("RANK"),
        "argv": sys.argv[:3],
        "stack": "".join(traceback.format_stack(limit=14)[:-2]),
    }
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def poison_fork(what: str) -> None:
    """``Module.cpp``'s ``poison_fork()``: once per process (``call_once``)."""
    global _poisoned_in
    _note(what)
    if _poisoned_in is None:
        _poisoned_in = os.getpid()


def in_bad_fork() -> bool:
    """``torch._C._cuda_isInBadFork``: forked (at any depth, before an exec) from a process
    that had registered the handler."""
    return _poisoned_in is not None and _poisoned_in != os.getpid()


def poisoned_here() -> bool:
    """Whether this very process registered CUDA's fork handler (a child forked now would be
    a bad fork); for tests."""
    return _poisoned_in == os.getpid()


def _driver() -> Any:
    return ctypes.CDLL("libcuda.so.1", mode=os.RTLD_GLOBAL)


def _driver_init(what: str) -> None:
    """cuInit, through the stand-in driver: fails in a process forked after its parent's."""
    _note(what)
    if _driver().cuInit(0) != 0:
        raise RuntimeError(
            "CUDA driver initialization failed: initialization error (this process was "
            "forked after its parent initialised the CUDA driver)"
        )


def _visible_count() -> int:
    import torch

    count = torch.cuda._device_count_nvml()  # torch's own: CUDA_VISIBLE_DEVICES, NVML
    return max(count, 0)


# ---- torch._C's CUDA entry points (Module.cpp), emulated -----------------------------------


def _get_device_count() -> int:
    poison_fork("torch._C._cuda_getDeviceCount")
    _driver_init("cudaGetDeviceCount")  # the runtime's first call initialises the driver
    return _visible_count()


def _get_arch_flags() -> str:
    poison_fork("torch._C._cuda_getArchFlags")
    return ARCH_FLAGS


def _cuda_init() -> None:
    import torch

    assert not in_bad_fork(), "Handled at python level"  # TORCH_INTERNAL_ASSERT
    poison_fork("torch._C._cuda_init")
    _driver_init("torch._C._cuda_init")
    count = _visible_count()
    if count == 0:
        raise RuntimeError("No CUDA GPUs are available")
    torch.cuda.default_generators = tuple(torch.Generator() for _ in range(count))
    torch.cuda._get_device_properties = _device_properties


def _lazy_init_from_cpp() -> None:
    """C++'s ``torch::utils::device_lazy_init(kCUDA)``: calls ``torch.cuda._lazy_init``."""
    import torch

    torch.cuda._lazy_init()


def _set_device(device: int) -> None:
    global _current
    _lazy_init_from_cpp()
    if not 0 <= device < _visible_count():
        raise RuntimeError("CUDA error: invalid device ordinal")
    _current = device


def _get_device() -> int:
    _lazy_init_from_cpp()
    return _current


def _exchange_device(device: int) -> int:
    if device < 0:
        return -1
    previous = _get_device()
    _set_device(device)
    return previous


def _set_memory_fraction(fraction: float, device: int) -> None:
    _fractions[device] = fraction


class _Properties:
    def __init__(self, index: int) -> None:
        cap = os.environ.get("NL_FAKE_GPU_CAP", "9.0").split(".")
        self.name = os.environ.get("NL_FAKE_GPU_NAME", "NVIDIA H100 80GB HBM3")
        self.major, self.minor = int(cap[0]), int(cap[1])
        self.total_memory = 80 << 30
        self.multi_processor_count = 132
        self.uuid = f"GPU-{index:08d}-1111-2222-3333-444455556666"
        self.index = index


def _device_properties(device: int) -> _Properties:
    return _Properties(device)


class _Cudart:
    """``torch.cuda.cudart()``'s module, as far as the package and its tests reach it."""

    def cudaMemGetInfo(self, device: int) -> tuple[int, int]:  # (CUDA runtime name)
        return (79 << 30, 80 << 30)


def _pin_memory(self: Any, device: Any = None) -> Any:
    _driver_init("Tensor.pin_memory (ATen's CUDA hooks)")
    return self


# ---- installing it ------------------------------------------------------------------------


def install(torch: Any) -> None:
    """Make ``torch`` (just imported, a CPU build) answer as a CUDA build does."""
    import torch.cuda as tc
    import torch.distributed as dist

    C = torch._C
    torch.version.cuda = "13.0"
    C._cuda_getDeviceCount = _get_device_count
    C._cuda_getArchFlags = _get_arch_flags
    C._cuda_init = _cuda_init
    C._cuda_isInBadFork = in_bad_fork
    C._cuda_setDevice = _set_device
    C._cuda_getDevice = _get_device
    C._cuda_setMemoryFraction = _set_memory_fraction
    C._cuda_getCompiledVersion = lambda: 13000
    C._accelerator_getAccelerator = lambda: torch.device("cuda")  # does not poison
    tc._is_in_bad_fork = in_bad_fork  # bound from torch._C at torch.cuda's import
    tc._exchange_device = _exchange_device
    tc._maybe_exchange_device = _exchange_device
    tc._cudart = _Cudart()
    torch.Tensor.pin_memory = _pin_memory
    _gloo_for_nccl(dist)


def _gloo_for_nccl(dist: Any) -> None:
    """A CPU build has no NCCL: an NCCL group is a gloo group here (its device_id and a
    barrier's device_ids dropped), so that ranks on the pretend GPUs come up and talk."""
    from torch.distributed import distributed_c10d as c10d

    init, barrier = c10d.init_process_group, c10d.barrier

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> Any:
        if backend is not None and "nccl" in str(backend):
            backend = "gloo"
            kwargs.pop("device_id", None)
        return init(backend, *args, **kwargs)

    def barrier_(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("device_ids", None)
        return barrier(*args, **kwargs)

    for module in (c10d, dist):
        module.init_process_group = init_process_group
        module.barrier = barrier_
    dist.is_nccl_available = lambda: True
