"""Where every rank runs: the one owner of device placement.

Three questions, answered here and nowhere else:

* **What does this machine (or node) have?** :func:`inventory` lists the GPUs this process
  may use *without reaching the CUDA runtime*: NVML (``libnvidia-ml``), asked in a throwaway
  forked child (a broken driver library crashes that child, not the kernel), when it can
  answer; a throwaway child interpreter when it cannot (MIG instances, a ROCm build, an NVML
  that failed); nothing at all when there is no NVIDIA driver or torch was built without
  CUDA. ``cudaGetDeviceCount`` (what ``torch.cuda.is_available()`` calls without NVML)
  initialises the driver and registers torch's CUDA fork handler, and a process that forks
  after that hands its children a CUDA they cannot use ("Cannot re-initialize CUDA in
  forked subprocess"), while ``torch.cuda.is_initialized()`` still says False.
  ``CUDA_VISIBLE_DEVICES`` is read as CUDA reads it (:func:`visible_devices`).
* **Is the driver already initialised here?** :func:`driver_initialized` asks the driver
  itself when ``libcuda`` is loaded (``cuDeviceGetCount`` answers ``NOT_INITIALIZED``
  before ``cuInit``; it initialises nothing), so a user's cell, bitsandbytes or any library
  that called ``cuInit`` is seen, not only torch's own flag. (Whether a *forked child*
  could use CUDA -- torch's fork handler registered, which nothing in the process shows --
  is :func:`notebook_launcher._posix.cuda_unusable_in_fork`'s question: a canary child.)
* **Where does each rank go?** :func:`place` turns an inventory, a rank count and the
  user's ``devices=`` into a :class:`Placement`: each local rank's device, the backend,
  what the ranks may see, whether there is a process group at all, and one line saying why.

Nothing here calls into CUDA's runtime in this process: the architectures torch was built
for (``torch._C._cuda_getArchFlags``, which registers the fork handler) are asked in a
throwaway forked child, once per torch build (:func:`arch_flags`).

Importing the package calls :func:`make_cuda_checks_fork_safe`, as Lightning does on
import: ``torch.cuda.is_available()`` then counts devices through NVML, so the user's own
``is_available()``, ``autocast("cuda")`` and ``GradScaler("cuda")`` in the kernel no longer
poison the next launch. (``torch.cuda.get_arch_list()``, a bf16 autocast, a CUDA tensor
still do: the launcher sees it and starts the ranks from its forkserver.)

Bottom layer: imports nothing of ours but :mod:`.errors` and :mod:`._posix`, and torch only
inside functions.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._posix import fork_answer
from .errors import PreflightError

#: torch counts devices through NVML when this is "1" (no driver initialisation).
NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
#: The device a launched rank uses ("cpu", "cuda:1"): read by the rank's state objects.
DEVICE_ENV = "NOTEBOOK_LAUNCHER_DEVICE"
#: The values ``devices=`` takes besides a list of GPU indices.
DEVICE_CHOICES = ("auto", "cpu", "gpu")


def make_cuda_checks_fork_safe() -> None:
    """Let ``torch.cuda.is_available()`` ask NVML instead of initialising the driver (the
    user's own value, if any, is kept)."""
    os.environ.setdefault(NVML_CHECK_ENV, "1")


# ---- the inventory --------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    """One GPU this process may use, as CUDA will number it (``cuda:index``)."""

    index: int
    name: str = ""
    uuid: str = ""
    memory_bytes: int = 0
    #: compute capability, e.g. (9, 0) for an H100; None when it could not be asked
    capability: tuple[int, int] | None = None


@dataclass(frozen=True)
class Inventory:
    """The GPUs of a machine (or of a cluster's node), and how we know."""

    gpus: tuple[Gpu, ...] = ()
    #: how it was found: "no CUDA build", "CUDA_VISIBLE_DEVICES", "no NVIDIA driver",
    #: "nvml", "probe" (a child interpreter), "agent" (a node said so), "given"
    source: str = "nvml"
    #: why the probe was needed, or what went wrong asking (shown by %nl_info)
    note: str = ""

    @property
    def count(self) -> int:
        return len(self.gpus)

    def describe(self) -> str:
        if not self.gpus:
            return "no GPU" + (f" ({self.source})" if self.source not in ("nvml", "given") else "")
        names = sorted({g.name for g in self.gpus if g.name})
        kind = f" ({', '.join(names)})" if names else ""
        return f"{self.count} GPU(s){kind}"

    def to_json(self) -> dict[str, Any]:
        return {
            "gpus": [
                {
                    "index": g.index,
                    "name": g.name,
                    "uuid": g.uuid,
                    "memory_bytes": g.memory_bytes,
                    "capability": list(g.capability) if g.capability else None,
                }
                for g in self.gpus
            ],
            "source": self.source,
            "note": self.note,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str | None = None) -> Inventory:
        gpus = tuple(
            Gpu(
                int(g["index"]),
                str(g.get("name", "")),
                str(g.get("uuid", "")),
                int(g.get("memory_bytes", 0)),
                (int(g["capability"][0]), int(g["capability"][1])) if g.get("capability") else None,
            )
            for g in data.get("gpus", [])
        )
        return cls(gpus, source or str(data.get("source", "given")), str(data.get("note", "")))

    @classmethod
    def of_count(cls, count: int, source: str = "given") -> Inventory:
        """An inventory known only by its count (an older agent's hello)."""
        return cls(tuple(Gpu(i) for i in range(max(0, count))), source)


_CACHE: dict[tuple[str | None, str | None], Inventory] = {}


def inventory(environ: Mapping[str, str] | None = None, *, fresh: bool = False) -> Inventory:
    """This process's GPUs, found without touching the CUDA runtime (cached per
    ``CUDA_VISIBLE_DEVICES``: the GPUs of a machine do not change while a kernel lives)."""
    env = os.environ if environ is None else environ
    key = (env.get("CUDA_VISIBLE_DEVICES"), env.get("CUDA_DEVICE_ORDER"))
    if not fresh and key in _CACHE:
        return _CACHE[key]
    found = _take_inventory(env)
    _CACHE[key] = found
    return found


def _take_inventory(env: Mapping[str, str]) -> Inventory:
    visible = visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    if visible == []:
        return Inventory((), "CUDA_VISIBLE_DEVICES")
    if not _cuda_build():
        return Inventory((), "no CUDA build")
    if _hip_build():  # ROCm: no NVML, its own driver; a child asks
        return _probe(env, "a ROCm build")
    answer = _nvml_in_a_child()
    if answer.get("absent"):
        return Inventory((), "no NVIDIA driver")
    if "error" in answer:
        return _probe(env, f"NVML could not answer ({answer['error']})")
    devices = [(Inventory.from_json({"gpus": [d]}).gpus[0], bool(d["mig"])) for d in answer["gpus"]]
    if any(mig for _, mig in devices):
        return _probe(env, "MIG is enabled on a GPU")
    gpus = [gpu for gpu, _ in devices]
    if visible is None:
        return Inventory(tuple(gpus), "nvml")
    picked = _apply_visible(gpus, visible)
    if picked is None:
        shown = env.get("CUDA_VISIBLE_DEVICES")
        return _probe(env, f"CUDA_VISIBLE_DEVICES={shown!r} names devices NVML cannot map")
    return Inventory(tuple(picked), "nvml")


def _cuda_build() -> bool:
    """Whether torch was built with CUDA (or ROCm): asked without initialising anything."""
    import torch

    return bool(getattr(torch.version, "cuda", None) or getattr(torch.version, "hip", None))


def _hip_build() -> bool:
    import torch

    return bool(getattr(torch.version, "hip", None))


def visible_devices(value: str | None) -> list[int] | list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it (torch's ``_parse_visible_devices`` follows
    the same rules): None when unset (every device); else the ordinals or UUID prefixes it
    selects, in order.

    Ordinals are read like ``strtoul``: each entry's leading digits (``"1gpu2"`` is 1,
    ``"0,1x"`` is 0 and 1); an entry without digits or a negative one ends the list; a
    repeated ordinal selects *no* device. A value that starts with ``GPU-`` (or ``MIG-``)
    is a list of UUID prefixes, ending at the first entry without that prefix; a repeat
    again selects none.

    >>> visible_devices("1,0"), visible_devices("0,0"), visible_devices("1gpu2,x,3")
    ([1, 0], [], [1])
    >>> visible_devices("GPU-8f2,GPU-1a"), visible_devices(None) is None
    (['GPU-8f2', 'GPU-1a'], True)
    """
    if value is None:
        return None
    for prefix in ("GPU-", "MIG-"):
        if value.startswith(prefix):
            uuids: list[str] = []
            for entry in value.split(","):
                if entry in uuids:
                    return []
                if not entry.startswith(prefix):
                    break
                uuids.append(entry)
            return uuids
    ordinals: list[int] = []
    for entry in value.split(","):
        number = _leading_integer(entry.strip())
        if number in ordinals:
            return []
        if number is None or number < 0:
            break
        ordinals.append(number)
    return ordinals


def _leading_integer(text: str) -> int | None:
    """``strtoul``'s reading: an optional sign and the digits that follow, else None."""
    end = 1 if text[:1] in ("+", "-") else 0
    while end < len(text) and text[end].isdigit():
        end += 1
    digits = text[:end]
    return int(digits) if digits.lstrip("+-") else None


def _apply_visible(gpus: list[Gpu], visible: list[int] | list[str]) -> list[Gpu] | None:
    """The GPUs ``visible`` selects, renumbered from 0 as CUDA does; None when an entry is
    one NVML cannot map (a MIG instance). CUDA stops at the first entry it cannot find (an
    ordinal past the last GPU, a UUID prefix that matches none or several); a UUID that
    selects one GPU twice selects none."""
    picked: list[Gpu] = []
    for entry in visible:
        if isinstance(entry, int):
            match = [g for g in gpus if g.index == entry]
        elif entry.startswith("MIG-"):
            return None
        else:
            match = [g for g in gpus if g.uuid and g.uuid.startswith(entry)]
        if len(match) != 1:
            break
        if any(g.index == match[0].index for g in picked):
            return []
        picked.append(match[0])
    return [Gpu(i, g.name, g.uuid, g.memory_bytes, g.capability) for i, g in enumerate(picked)]


class _NvmlMemory(ctypes.Structure):
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


#: More GPUs than any machine has: an NVML that says so is broken (a count of 100,000,000
#: would loop for minutes), and the probe is asked instead.
MAX_GPUS = 1024
#: NVML's "the driver is not loaded" (nvmlInit on a machine whose library outlived its driver)
_NVML_ERROR_DRIVER_NOT_LOADED = 9
#: Seconds NVML may take (in its child) before the child is killed and the probe asked.
NVML_TIMEOUT = 20.0
#: The management library's name (loaded in a child only: :func:`_nvml_in_a_child`).
NVML_LIBRARY = "libnvidia-ml.so.1"


def _nvml_in_a_child() -> dict[str, Any]:
    """Ask NVML in a throwaway forked child: a driver library that crashes (SIGSEGV), hangs
    or answers nonsense takes the child with it, never the kernel. ``{"gpus": [...]}``,
    ``{"absent": True}`` (no library, or no driver behind it) or ``{"error": "why"}``."""
    answer = fork_answer(_nvml_answer, timeout=NVML_TIMEOUT)
    if answer is None:
        return {"error": "it crashed or hung in a child process"}
    try:
        return dict(json.loads(answer))
    except ValueError:
        return {"error": "its answer could not be read"}


def _nvml_answer() -> bytes:
    """What :func:`_nvml_in_a_child`'s child sends back (JSON)."""
    try:
        gpus = [{**gpu.__dict__, "mig": mig} for gpu, mig in _nvml_devices()]
        reply: dict[str, Any] = {"gpus": gpus}
    except _NvmlAbsent:
        reply = {"absent": True}
    except OSError as exc:
        reply = {"error": str(exc)}
    return json.dumps(reply).encode()


class _NvmlAbsent(OSError):
    """No NVIDIA driver here: NVML's library is missing, or has no driver behind it."""


def _nvml_devices() -> list[tuple[Gpu, bool]]:
    """Every GPU NVML sees (index, name, uuid, memory, capability) and whether MIG is on.
    NVML is the management library: it never initialises CUDA. Raises :class:`_NvmlAbsent`
    without a driver, OSError when it answers with an error, lacks a function (drivers
    before R450 have no ``nvmlDeviceGetMigMode``) or reports an impossible count."""
    try:
        lib = ctypes.CDLL(NVML_LIBRARY)
    except OSError as exc:
        raise _NvmlAbsent(str(exc)) from None

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(f"{what} returned NVML error {result}")

    try:
        init, get_count = lib.nvmlInit_v2, lib.nvmlDeviceGetCount_v2
        get_handle, get_name, get_uuid = (
            lib.nvmlDeviceGetHandleByIndex_v2,
            lib.nvmlDeviceGetName,
            lib.nvmlDeviceGetUUID,
        )
        get_memory, get_capability = (
            lib.nvmlDeviceGetMemoryInfo,
            lib.nvmlDeviceGetCudaComputeCapability,
        )
        get_mig = lib.nvmlDeviceGetMigMode
    except AttributeError as exc:  # an old driver's NVML
        raise OSError(f"NVML lacks a function ({exc})") from None
    result = init()
    if result == _NVML_ERROR_DRIVER_NOT_LOADED:
        raise _NvmlAbsent("NVML: the NVIDIA driver is not loaded")
    check(result, "nvmlInit")
    try:
        count = ctypes.c_uint()
        check(get_count(ctypes.byref(count)), "nvmlDeviceGetCount")
        if count.value > MAX_GPUS:
            raise OSError(f"nvmlDeviceGetCount said {count.value} GPUs")
        out = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            check(get_handle(i, ctypes.byref(handle)), "GetHandle")
            name = ctypes.create_string_buffer(96)
            uuid = ctypes.create_string_buffer(96)
            get_name(handle, name, 96)
            get_uuid(handle, uuid, 96)
            memory = _NvmlMemory()
            get_memory(handle, ctypes.byref(memory))
            major, minor = ctypes.c_int(), ctypes.c_int()
            cap: tuple[int, int] | None = None
            if get_capability(handle, ctypes.byref(major), ctypes.byref(minor)) == 0:
                cap = (major.value, minor.value)
            current, pending = ctypes.c_uint(), ctypes.c_uint()
            mig = get_mig(handle, ctypes.byref(current), ctypes.byref(pending)) == 0 and (
                current.value == 1
            )
            text = (name.value.decode(errors="replace"), uuid.value.decode(errors="replace"))
            out.append((Gpu(i, text[0], text[1], memory.total, cap), mig))
        return out
    finally:
        lib.nvmlShutdown()


_PROBE = """
import json, torch
n = torch.cuda.device_count()
gpus = []
for i in range(n):
    p = torch.cuda.get_device_properties(i)
    gpus.append({"index": i, "name": p.name, "uuid": str(getattr(p, "uuid", "")),
                 "memory_bytes": int(p.total_memory), "capability": [p.major, p.minor]})
print(json.dumps({"gpus": gpus}))
"""


def _probe(env: Mapping[str, str], why: str) -> Inventory:
    """Ask a throwaway child interpreter (its CUDA dies with it; ours stays untouched)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE],
            check=False,
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return Inventory((), "probe", f"{why}; the probe failed: {exc}")
    lines = done.stdout.strip().splitlines()
    try:
        data = json.loads(lines[-1])
    except (ValueError, IndexError):
        if done.returncode < 0:
            failed = f"it was killed by {_signal_name(-done.returncode)}"
        else:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            failed = f"it exited with {done.returncode}: {last}"
        return Inventory((), "probe", f"{why}; the probe failed ({failed}): no GPU counted")
    return dataclasses.replace(Inventory.from_json(data, "probe"), note=why)


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def set_inventory_for_tests(found: Inventory | None) -> None:
    """Pin (or with None forget) the inventory every later call returns."""
    _CACHE.clear()
    if found is not None:
        _CACHE[(os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER"))] = (
            found
        )


# ---- is the driver initialised here? -----------------------------------------------------

_CUDA_ERROR_NOT_INITIALIZED = 3


def driver_initialized() -> bool:
    """Whether the CUDA driver is initialised in this process, by torch or by anything
    else (a user's ``cuInit``, bitsandbytes, CuPy, numba): then a forked child cannot use
    CUDA. Asks nothing that initialises it."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    try:  # RTLD_NOLOAD: only a libcuda that is loaded already (loading it is not cuInit)
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return False
    count = ctypes.c_int()
    return bool(lib.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED)


# ---- where each rank goes ---------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Each local rank's device, the backend, and why."""

    #: one per local rank: "cpu" or "cuda:N"
    devices: tuple[str, ...]
    #: "nccl" (one GPU per rank), or "gloo" (CPU ranks, ranks sharing a GPU, and a lone
    #: rank: one rank is not a distributed job, so it gets no NCCL communicator to set up)
    backend: str
    #: each rank's share of its GPU's memory when ranks share one; None: all of it
    memory_fraction: float | None
    #: one line for the dashboard: what was decided and why
    reason: str
    #: what the user should read before the ranks start (sharing a GPU), or None
    banner: str | None = None
    #: variables the ranks get on top of the kernel's (GPUs hidden from CPU ranks)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def on_gpu(self) -> bool:
        return any(d.startswith("cuda") for d in self.devices)

    def rank_env(self, local_rank: int) -> dict[str, str]:
        """What one rank adds to its environment: its device (read by its state objects)."""
        return {**self.env, DEVICE_ENV: self.devices[local_rank]}


def check_devices(devices: Any) -> str | tuple[int, ...]:
    """``devices=`` as given: "auto", "cpu", "gpu", or GPU indices; else a PreflightError."""
    if devices is None:
        return "auto"
    if isinstance(devices, str):
        value = devices.strip().lower()
        if value in ("cuda", "gpus"):
            value = "gpu"
        if value in DEVICE_CHOICES:
            return value
    elif isinstance(devices, Sequence) and not isinstance(devices, (bytes, bytearray)):
        items = list(devices)
        if (
            items
            and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items)
            and len(set(items)) == len(items)
        ):
            return tuple(items)
    raise PreflightError(
        f"devices={devices!r} is not a placement: use 'auto' (one rank per GPU, ranks share "
        "the GPUs when there are more ranks than GPUs, CPU ranks without GPUs), 'gpu' (one "
        "rank per GPU, refused when there are too few), 'cpu' (CPU ranks on gloo, GPUs "
        "hidden from them), or a list of distinct GPU indices such as [0, 2]."
    )


def num_processes_for(devices: str | tuple[int, ...], found: Inventory) -> int | None:
    """The rank count ``num_processes=None`` means: one per GPU in use (None: no GPU)."""
    if isinstance(devices, tuple):
        return len(devices)
    if devices == "cpu" or not found.count:
        return None
    return found.count


def place(
    found: Inventory,
    num_processes: int,
    devices: str | tuple[int, ...] = "auto",
    *,
    world_size: int | None = None,
    hint_num_processes: str = "num_processes",
    given: Any = None,
) -> Placement:
    """Decide every local rank's device for ``num_processes`` ranks on this machine (or on
    one node of a job of ``world_size`` ranks).

    >>> place(Inventory.of_count(0), 2).devices
    ('cpu', 'cpu')
    >>> p = place(Inventory.of_count(2), 2)
    >>> p.devices, p.backend
    (('cuda:0', 'cuda:1'), 'nccl')
    >>> p = place(Inventory.of_count(1), 2)
    >>> p.devices, p.backend, p.memory_fraction
    (('cuda:0', 'cuda:0'), 'gloo', 0.475)
    >>> place(Inventory.of_count(1), 1).backend
    'gloo'

    ``given``: ``devices`` as the user wrote it (``'cuda'`` for ``'gpu'``), for the errors.
    """
    shown = (
        given if given is not None else (list(devices) if isinstance(devices, tuple) else devices)
    )
    said = f"devices={shown!r}"
    world = num_processes if world_size is None else world_size
    # One rank on its own is not a distributed job (Accelerate: distributed_type NO): it
    # gets a gloo group of one (milliseconds; torch.distributed calls still work), not an
    # NCCL communicator (half a second to set up, and nothing to talk to).
    lone = world == 1
    hide = {"CUDA_VISIBLE_DEVICES": ""}
    if devices == "cpu" or (devices == "auto" and not found.count):
        why = "CPU ranks" if devices == "cpu" or found.source != "nvml" else "no GPU"
        return Placement(
            ("cpu",) * num_processes,
            "gloo",
            None,
            f"{num_processes} CPU rank(s) on gloo ({why})",
            env=hide if found.count else {},
        )
    if isinstance(devices, tuple):
        missing = [i for i in devices if i >= found.count]
        if missing:
            raise PreflightError(
                f"{said} names GPU(s) {missing}, but {_gpus_here(found)}. Pass indices that "
                "exist, or devices='cpu' for CPU ranks."
            )
        if num_processes != len(devices):
            raise PreflightError(
                f"{said} is one rank per listed GPU, but {hint_num_processes}="
                f"{num_processes}. Leave {hint_num_processes} out, or list "
                f"{num_processes} GPU(s)."
            )
        chosen = [f"cuda:{i}" for i in devices]
    elif not found.count:  # devices == "gpu"
        raise PreflightError(
            f"{said} asks for one rank per GPU, and {_gpus_here(found)}. Use devices='cpu' (or "
            "leave devices out) to run CPU ranks."
        )
    elif num_processes <= found.count:
        chosen = [f"cuda:{i}" for i in range(num_processes)]
    elif devices == "gpu":
        raise PreflightError(
            f"{hint_num_processes}={num_processes} but only {found.count} GPU(s) are visible, "
            f"and {said} asks for one rank per GPU. Use {hint_num_processes}<="
            f"{found.count}; or devices='auto' to let {num_processes} ranks share the "
            "GPU(s) over gloo; or devices='cpu' for CPU ranks."
        )
    else:
        return _shared(found, num_processes, hint_num_processes)
    if lone and devices != "gpu":  # ("gpu": NCCL asked for, a group of one)
        return Placement(
            tuple(chosen),
            "gloo",
            None,
            f"1 rank on {chosen[0]} (one rank is not a distributed job: no NCCL communicator)",
        )
    return Placement(
        tuple(chosen),
        "nccl",
        None,
        f"{num_processes} rank(s), one per GPU ({', '.join(chosen)}), on NCCL",
    )


def _gpus_here(found: Inventory) -> str:
    """What GPUs there are, for an error: "this machine has 2 GPU(s) (...) (cuda:0..cuda:1)",
    "no GPU is visible here (CUDA_VISIBLE_DEVICES)"."""
    if not found.count:
        why = {"nvml": "", "given": ""}.get(found.source, f" ({found.source})")
        return f"no GPU is visible here{why}"
    names = "cuda:0" if found.count == 1 else f"cuda:0..cuda:{found.count - 1}"
    return f"this machine has {found.describe()} ({names})"


def _shared(found: Inventory, num_processes: int, hint: str) -> Placement:
    """More ranks than GPUs: the ranks take the GPUs in turn, on gloo (NCCL refuses two
    ranks on one device), each held to its share of the GPU's memory."""
    chosen = tuple(f"cuda:{r % found.count}" for r in range(num_processes))
    per_gpu = -(-num_processes // found.count)
    share = round(0.95 / per_gpu, 3)
    gpus = f"{found.count} GPU" + ("s" if found.count > 1 else "")
    banner = (
        f"{num_processes} ranks share {gpus} over gloo (NCCL needs one GPU per rank): each "
        f"may use {share:.0%} of its GPU's memory, and collectives go through the CPU. For "
        f"one rank per GPU on NCCL pass {hint}={found.count}; for CPU ranks pass "
        "devices='cpu'."
    )
    return Placement(
        chosen,
        "gloo",
        share,
        f"{num_processes} ranks share {gpus} on gloo, {share:.0%} of its memory each",
        banner,
    )


# ---- checks that need the inventory ------------------------------------------------------


def unsupported_gpus(found: Inventory, arch_flags: str | None) -> list[str]:
    """The GPUs the installed torch was not built for (Kaggle's P100 on CUDA 13 wheels),
    each as "cuda:0 (Tesla P100, sm_60)", given torch's architecture flags
    (:func:`arch_flags`; None or empty: nothing known, nothing refused)."""
    if not arch_flags:
        return []
    binary: list[tuple[int, int]] = []
    ptx: list[tuple[int, int]] = []
    for flag in arch_flags.split():
        kind, _, num = flag.partition("_")
        num = num.rstrip("af")  # sm_90a, sm_100f: the family-specific variants
        if not num.isdigit():
            continue
        cap = (int(num[:-1]), int(num[-1]))
        (binary if kind == "sm" else ptx).append(cap)
    bad = []
    for gpu in found.gpus:
        if gpu.capability is None:
            continue
        major, minor = gpu.capability
        ok = any(b[0] == major and b[1] <= minor for b in binary) or any(
            p <= gpu.capability for p in ptx
        )
        if not ok:
            bad.append(f"cuda:{gpu.index} ({gpu.name or 'GPU'}, sm_{major}{minor})")
    return bad


_ARCH_FLAGS: dict[tuple[str, str], str | None] = {}


def arch_flags() -> str | None:
    """The GPU architectures the installed torch was built for ("sm_80 sm_90 ...";
    ``torch.cuda.get_arch_list()``), None when it cannot tell. Asked in a throwaway forked
    child, once per torch build: ``torch._C._cuda_getArchFlags`` registers CUDA's fork
    handler in the process that calls it (``torch/csrc/cuda/Module.cpp``), and every rank
    forked after that would be unable to use CUDA."""
    import torch

    key = (str(torch.__version__), str(getattr(torch, "__file__", "")))
    if key not in _ARCH_FLAGS:
        if not hasattr(torch._C, "_cuda_getArchFlags"):
            _ARCH_FLAGS[key] = None
        else:
            answer = fork_answer(_arch_flags_here, timeout=20.0)
            _ARCH_FLAGS[key] = answer.decode(errors="replace") if answer else None
    return _ARCH_FLAGS[key]


def _arch_flags_here() -> bytes:
    """In :func:`arch_flags`'s child (where registering the fork handler harms nothing)."""
    import torch

    return str(torch._C._cuda_getArchFlags() or "").encode()


def shm_bytes(path: str = "/dev/shm") -> int | None:
    """Free bytes of /dev/shm (NCCL's shared-memory transport lives there), or None."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


__all__ = [
    "DEVICE_CHOICES",
    "DEVICE_ENV",
    "NVML_CHECK_ENV",
    "Gpu",
    "Inventory",
    "Placement",
    "arch_flags",
    "check_devices",
    "driver_initialized",
    "inventory",
    "make_cuda_checks_fork_safe",
    "num_processes_for",
    "place",
    "set_inventory_for_tests",
    "shm_bytes",
    "unsupported_gpus",
    "visible_devices",
]
