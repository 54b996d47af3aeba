"""Device placement as a table (``_placement``): what each machine and ``devices=`` give,
how CUDA_VISIBLE_DEVICES is read, which GPUs torch was not built for, and the plans the
launcher makes from a machine's inventory. No process is started: the GPU machines are
inventories, which is all the kernel ever asks of a GPU."""

from __future__ import annotations

import re

import pytest

from notebook_launcher import PreflightError
from notebook_launcher import _placement as P
from notebook_launcher._launch import plan as plan_mod
from notebook_launcher._launch import preflight

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def gpus(n: int, cap: tuple[int, int] = (9, 0), name: str = "NVIDIA H100") -> P.Inventory:
    return P.Inventory(
        tuple(P.Gpu(i, name, f"GPU-{i:04d}aaaa", 80 * 2**30, cap) for i in range(n)), "nvml"
    )


# (inventory, num_processes, devices) -> (devices, backend, memory fraction, banner?)
CASES = [
    (gpus(0), 2, "auto", ("cpu", "cpu"), "gloo", None, False),
    (gpus(0), 1, "auto", ("cpu",), "gloo", None, False),
    (gpus(2), 2, "auto", ("cuda:0", "cuda:1"), "nccl", None, False),
    (gpus(4), 2, "auto", ("cuda:0", "cuda:1"), "nccl", None, False),
    # one rank is not a distributed job: a gloo group of one, no NCCL communicator
    (gpus(1), 1, "auto", ("cuda:0",), "gloo", None, False),
    # Colab's one GPU and a lesson written for two ranks: they share it, said in a banner
    (gpus(1), 2, "auto", ("cuda:0", "cuda:0"), "gloo", 0.475, True),
    (gpus(2), 3, "auto", ("cuda:0", "cuda:1", "cuda:0"), "gloo", 0.475, True),
    (gpus(1), 4, "auto", ("cuda:0",) * 4, "gloo", 0.237, True),
    (gpus(2), 2, "gpu", ("cuda:0", "cuda:1"), "nccl", None, False),
    (gpus(2), 2, "cpu", ("cpu", "cpu"), "gloo", None, False),
    (gpus(4), 2, (3, 1), ("cuda:3", "cuda:1"), "nccl", None, False),
    (gpus(4), 1, (2,), ("cuda:2",), "gloo", None, False),
    # NCCL asked for by name: a group of one (to try NCCL code on one GPU)
    (gpus(1), 1, "gpu", ("cuda:0",), "nccl", None, False),
]


@pytest.mark.parametrize(("found", "n", "devices", "placed", "backend", "share", "banner"), CASES)
def test_placement_table(
    found: P.Inventory,
    n: int,
    devices: str | tuple[int, ...],
    placed: tuple[str, ...],
    backend: str,
    share: float | None,
    banner: bool,
) -> None:
    p = P.place(found, n, devices)
    assert p.devices == placed
    assert p.backend == backend
    assert p.memory_fraction == share
    assert bool(p.banner) == banner
    assert p.reason
    for local, device in enumerate(placed):
        assert p.rank_env(local)[P.DEVICE_ENV] == device
    # CPU ranks on a GPU machine do not see the GPUs; nobody else is told anything
    hidden = devices == "cpu" and found.count > 0
    assert (p.rank_env(0).get("CUDA_VISIBLE_DEVICES") == "") is hidden


def test_the_banner_names_the_one_argument_that_changes_it() -> None:
    p = P.place(gpus(1), 2)
    assert p.banner is not None
    assert "2 ranks share 1 GPU over gloo" in p.banner
    assert "num_processes=1" in p.banner and "devices='cpu'" in p.banner
    assert "48%" in p.banner


REFUSALS = [
    (gpus(1), 2, "gpu", "only 1 GPU(s) are visible"),
    (gpus(0), 2, "gpu", "devices='gpu' asks for one rank per GPU"),
    (gpus(2), 1, (2,), "names GPU(s) [2]"),
    (gpus(4), 3, (0, 1), "one rank per listed GPU"),
]


@pytest.mark.parametrize(("found", "n", "devices", "message"), REFUSALS)
def test_placement_refusals_name_the_fix(
    found: P.Inventory, n: int, devices: str | tuple[int, ...], message: str
) -> None:
    with pytest.raises(PreflightError, match=re.escape(message)):
        P.place(found, n, devices)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, "auto"),
        ("auto", "auto"),
        ("CPU", "cpu"),
        ("cuda", "gpu"),
        ("gpu", "gpu"),
        ([0, 2], (0, 2)),
        ((1,), (1,)),
    ],
)
def test_devices_values(given: object, expected: object) -> None:
    assert P.check_devices(given) == expected


@pytest.mark.parametrize("given", ["tpu", 3, [0, 0], [-1], [True], [], "0,1", b"cpu"])
def test_devices_refused(given: object) -> None:
    with pytest.raises(PreflightError, match="is not a placement"):
        P.check_devices(given)


# CUDA_VISIBLE_DEVICES as CUDA reads it
NVML = [P.Gpu(i, "GPU", f"GPU-{i}{i}{i}-uuid", 1, (8, 0)) for i in range(4)]

#: (value, what CUDA selects of the four GPUs above). The parsing follows CUDA's rules as torch
#: writes them down (torch/cuda/__init__.py: _parse_visible_devices, which test_visible_devices_
#: parse_as_torch_does checks against), the mapping onto devices torch's _device_count_nvml and
#: _transform_uuid_to_ordinals.
VISIBLE = [
    ("", []),
    ("-1", []),
    ("2", [2]),
    ("3,1", [3, 1]),
    (" 1, 2", [1, 2]),
    ("0,7,1", [0]),  # CUDA stops at the first device it cannot find
    ("1,-1,2", [1]),  # ... and at a negative entry
    ("1,,2", [1]),  # ... and at an empty one
    ("0,x,1", [0]),  # ... and at one without digits
    ("1,1", []),  # a repeated ordinal selects no device at all
    ("0,0", []),
    ("1gpu2", [1]),  # strtoul: an entry's leading digits
    ("0,1x", [0, 1]),
    ("+1", [1]),
    ("GPU-222", [2]),  # a UUID prefix
    ("GPU-333-uuid,0", [3]),  # a UUID list ends at the first entry that is not one
    ("GPU-1,GPU-1", []),  # a repeated UUID selects none
    ("GPU-111,GPU-111-uuid", []),  # ... as do two prefixes of one GPU
    ("GPU-111,GPU-9", [1]),  # a prefix that matches no GPU ends the list
    ("GPU-", []),  # ... and so does one that matches several
]


@pytest.mark.parametrize(("visible", "indices"), VISIBLE)
def test_visible_devices_as_cuda_reads_them(visible: str, indices: list[int]) -> None:
    picked = P._apply_visible(NVML, P.visible_devices(visible) or [])
    assert picked is not None
    assert [g.uuid for g in picked] == [NVML[i].uuid for i in indices]
    assert [g.index for g in picked] == list(range(len(indices)))  # renumbered from 0


@pytest.mark.parametrize("visible", [v for v, _ in VISIBLE] + ["MIG-a,MIG-b", "MIG-a,0"])
def test_visible_devices_parse_as_torch_does(visible: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's own reading (the one its NVML device count uses) is the reference."""
    import torch

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert P.visible_devices(visible) == torch.cuda._parse_visible_devices()


def test_a_mig_instance_needs_the_probe() -> None:
    assert P._apply_visible(NVML, ["MIG-abc"]) is None


def test_unset_visible_devices_are_all_of_them() -> None:
    assert P.visible_devices(None) is None


@pytest.mark.parametrize(
    ("flags", "cap", "supported"),
    [
        ("sm_75 sm_80 sm_86 sm_90 sm_100 sm_120 compute_120", (6, 0), False),  # P100
        ("sm_75 sm_80 sm_86 sm_90 sm_100 sm_120 compute_120", (9, 0), True),  # H100
        ("sm_80 sm_90", (8, 9), True),  # sm_80 code runs on an sm_89 (same major)
        ("sm_80 compute_80", (9, 0), True),  # PTX is compiled for newer GPUs
        ("sm_80", (9, 0), False),
        ("sm_90a sm_100f", (9, 0), True),  # the family-specific variants
        ("", (6, 0), True),  # nothing known: nothing refused
    ],
)
def test_unsupported_architectures(flags: str, cap: tuple[int, int], supported: bool) -> None:
    found = gpus(1, cap, "Tesla P100" if cap == (6, 0) else "GPU")
    bad = P.unsupported_gpus(found, flags)
    assert (bad == []) is supported
    if not supported:
        assert bad == [f"cuda:0 ({found.gpus[0].name}, sm_{cap[0]}{cap[1]})"]


def test_inventory_without_cuda_build_or_with_gpus_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    assert P.inventory({"CUDA_VISIBLE_DEVICES": ""}, fresh=True).source == "CUDA_VISIBLE_DEVICES"
    monkeypatch.setattr(P, "_cuda_build", lambda: False)
    assert P.inventory({}, fresh=True) == P.Inventory((), "no CUDA build")


def test_inventory_reads_nvml_and_applies_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(P, "_cuda_build", lambda: True)
    # (asked in a forked child, which runs this process's code: the patch included)
    monkeypatch.setattr(P, "_nvml_devices", lambda: [(g, False) for g in NVML])
    assert P.inventory({}, fresh=True).count == 4
    found = P.inventory({"CUDA_VISIBLE_DEVICES": "2,0"}, fresh=True)
    assert [g.uuid for g in found.gpus] == [NVML[2].uuid, NVML[0].uuid]
    assert found.source == "nvml"


def test_inventory_asks_a_child_when_nvml_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    """MIG, or NVML failing: a throwaway interpreter answers (here: the CPU build, 0)."""
    monkeypatch.setattr(P, "_cuda_build", lambda: True)
    monkeypatch.setattr(P, "_nvml_devices", lambda: [(NVML[0], True)])
    found = P.inventory({"PATH": "/usr/bin:/bin"}, fresh=True)
    assert (found.source, found.count, found.note) == ("probe", 0, "MIG is enabled on a GPU")

    def broken() -> list[tuple[P.Gpu, bool]]:
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    monkeypatch.setattr(P, "_nvml_devices", broken)
    found = P.inventory({"PATH": "/usr/bin:/bin"}, fresh=True)
    assert found.source == "probe" and "NVML could not answer" in found.note


def test_the_driver_is_not_initialised_in_the_test_process() -> None:
    assert P.driver_initialized() is False


def test_num_processes_none_means_one_per_gpu_in_use() -> None:
    assert P.num_processes_for("auto", gpus(3)) == 3
    assert P.num_processes_for((0, 2), gpus(3)) == 2
    assert P.num_processes_for("cpu", gpus(3)) is None
    assert P.num_processes_for("auto", gpus(0)) is None


# ---- the plans the launcher makes from an inventory ------------------------------------


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Pretend the kernel's machine has the GPUs of a given inventory."""

    def use(found: P.Inventory) -> None:
        monkeypatch.setattr(P, "inventory", lambda *a, **k: found)
        # the installed (CPU) torch has no arch list: every GPU counts as supported

    return use


def _plan(n: int | None, **options: object) -> plan_mod.LaunchPlan:
    plan = plan_mod.plan_launch(lambda: None, n, **options)  # type: ignore[arg-type]
    plan.close()
    return plan


def test_a_plan_on_two_gpus(machine) -> None:  # type: ignore[no-untyped-def]
    machine(gpus(2))
    plan = _plan(None, mixed_precision="fp16")
    assert [s.device for s in plan.specs] == ["cuda:0", "cuda:1"]
    assert {s.backend for s in plan.specs} == {"nccl"}
    assert [s.env[P.DEVICE_ENV] for s in plan.specs] == ["cuda:0", "cuda:1"]
    assert plan.specs[0].env["ACCELERATE_USE_CPU"] == "false"
    started = plan.started_event()
    assert started.placement == "2 rank(s), one per GPU (cuda:0, cuda:1), on NCCL"
    assert started.banner == ""


def test_a_plan_for_a_lesson_on_one_gpu(machine) -> None:  # type: ignore[no-untyped-def]
    machine(gpus(1))
    plan = _plan(2)
    assert [(s.device, s.backend, s.memory_fraction) for s in plan.specs] == [
        ("cuda:0", "gloo", 0.475),
        ("cuda:0", "gloo", 0.475),
    ]
    assert plan.specs[0].env["ACCELERATE_USE_CPU"] == "false"  # gloo, yet on the GPU
    assert "share 1 GPU" in plan.started_event().banner


def test_a_plan_of_cpu_ranks_on_a_gpu_machine(machine) -> None:  # type: ignore[no-untyped-def]
    machine(gpus(2))
    with pytest.warns(UserWarning, match="fp16"):
        plan = _plan(2, devices="cpu", mixed_precision="fp16")
    assert [s.device for s in plan.specs] == ["cpu", "cpu"]
    assert all(s.env["CUDA_VISIBLE_DEVICES"] == "" for s in plan.specs)


def test_a_plan_refuses_a_gpu_torch_was_not_built_for(machine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    machine(gpus(1, (6, 0), "Tesla P100-PCIE-16GB"))
    monkeypatch.setattr(P, "arch_flags", lambda: "sm_75 sm_120 compute_120")
    with pytest.raises(
        PreflightError, match=r"cuda:0 \(Tesla P100-PCIE-16GB, sm_60\).*sm_75 sm_120.*devices='cpu'"
    ):
        _plan(1)


def test_a_plan_warns_of_a_small_dev_shm(machine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    machine(gpus(2))
    monkeypatch.setattr(P, "shm_bytes", lambda path="/dev/shm": 64 * 2**20)
    with pytest.warns(UserWarning, match=r"/dev/shm has only 64 MiB free.*--shm-size"):
        _plan(2)


def test_no_gpu_plan_says_nothing_new(machine) -> None:  # type: ignore[no-untyped-def]
    machine(gpus(0))
    plan = _plan(2)
    assert plan.started_event().placement == ""
    assert [s.device for s in plan.specs] == ["cpu", "cpu"]
    with pytest.raises(PreflightError, match="this machine has no GPU"):
        _plan(None)


# ---- a hang inside NCCL: the stall view's hint --------------------------------------------

STUCK = "last collective #7 all_reduce [4] (started)"


@pytest.mark.parametrize(
    ("flight", "hinted"),
    [
        ([(0, STUCK), (1, STUCK)], True),
        ([(0, STUCK), (1, "last collective #6 all_reduce [4] (completed), behind: ...")], False),
        ([(0, STUCK), (1, "last collective #7 broadcast [4] (started)")], False),
        ([(0, "last collective #7 all_reduce [4] (completed)")] * 2, False),
        ([(0, STUCK)], False),
        ([], False),
    ],
)
def test_a_hang_inside_nccl_names_what_to_try(flight: list[tuple[int, str]], hinted: bool) -> None:
    from notebook_launcher._launch.stall import nccl_hint

    hint = nccl_hint(flight)
    assert (hint is not None) is hinted
    if hint:
        assert "NCCL_P2P_DISABLE=1" in hint and "#7 all_reduce [4]" in hint


@pytest.mark.parametrize(
    ("argv", "devices"),
    [
        ("start -n 2", "auto"),
        ("start -n 2 --devices cpu", "cpu"),
        ("start --devices 0,2", [0, 2]),
        ("start --devices gpu", "gpu"),
    ],
)
def test_the_magic_takes_devices_in_one_argument(argv: str, devices: object) -> None:
    from notebook_launcher.ipython_extension import _dist_parser

    assert _dist_parser().parse_args(argv.split()).devices == devices


def test_a_rank_takes_its_gpu_before_anything_else(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank's first CUDA call makes its own GPU current (and caps a shared GPU's memory);
    a CPU rank makes none. Spied: this machine has no GPU."""
    import torch

    from notebook_launcher._spec import WorkerSpec
    from notebook_launcher._worker import entry

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(
        torch.cuda,
        "set_per_process_memory_fraction",
        lambda f, i: calls.append(("fraction", (f, i))),
    )

    def spec(device: str, share: float | None = None) -> WorkerSpec:
        return WorkerSpec(
            0, 0, 1, 1, 0, "127.0.0.1", 1, "gloo", device=device, memory_fraction=share
        )

    entry._take_device(spec("cpu"))
    entry._take_device(spec("cuda:3"))
    entry._take_device(spec("cuda:0", 0.475))
    assert calls == [("set_device", 3), ("set_device", 0), ("fraction", (0.475, 0))]


def test_the_fork_canary_is_asked_for_gpu_ranks_only(machine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A canary child (one fork of the kernel) says whether torch's CUDA fork handler is
    registered: asked before forking ranks that will use a GPU, never for CPU ranks."""
    asked: list[int] = []
    monkeypatch.setattr(preflight, "fork_handler_registered", lambda: asked.append(1) or False)
    machine(gpus(0))
    assert _plan(2).start_method == "fork" and asked == []
    machine(gpus(2))
    assert _plan(2, devices="cpu").start_method == "fork" and asked == []
    assert _plan(2, start_method="spawn").start_method == "spawn" and asked == []
    assert _plan(2).start_method == "fork" and asked == [1]
    monkeypatch.setattr(preflight, "fork_handler_registered", lambda: True)
    plan = _plan(2)
    assert plan.start_method == "forkserver" and "fork handler is registered" in plan.reason
    with pytest.raises(PreflightError, match="start_method='fork' was asked for, but a rank"):
        _plan(2, start_method="fork")


@pytest.mark.parametrize(
    ("found", "devices", "given", "n", "says"),
    [
        (
            P.Inventory((), "no CUDA build"),
            (0,),
            [0],
            1,
            "devices=[0] names GPU(s) [0], but no GPU is visible here (no CUDA build)",
        ),
        (
            P.Inventory((), "no NVIDIA driver"),
            (0, 1),
            None,
            2,
            "devices=[0, 1] names GPU(s) [0, 1], but no GPU is visible here (no NVIDIA driver)",
        ),
        (
            gpus(1),
            (0, 3),
            None,
            2,
            "names GPU(s) [3], but this machine has 1 GPU(s) (NVIDIA H100) (cuda:0).",
        ),
        (gpus(2), (0, 3), None, 2, "(cuda:0..cuda:1)"),
        (
            P.Inventory((), "no NVIDIA driver"),
            "gpu",
            "cuda",
            1,
            "devices='cuda' asks for one rank per GPU, and no GPU",
        ),
        (gpus(2), "gpu", "cuda", 3, "and devices='cuda' asks for one rank per GPU"),
    ],
)
def test_a_devices_refusal_says_what_the_user_wrote_and_what_is_here(
    found: P.Inventory, devices: object, given: object, n: int, says: str
) -> None:
    with pytest.raises(PreflightError) as info:
        P.place(found, n, devices, given=given)  # type: ignore[arg-type]
    assert says in str(info.value)
    assert "cuda:0..cuda:0" not in str(info.value)
