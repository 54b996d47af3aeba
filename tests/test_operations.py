"""Collective operations (``notebook_launcher.utils``) in one process and across 2 and 3 ranks.

The same check function (``tests/_torchrun_target.py``) runs three ways: under
``notebook_launcher``, under ``torchrun --nproc-per-node 2`` and as a plain single process,
and must give the same observations as the table of expected values each time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch

from notebook_launcher import notebook_launcher
from notebook_launcher.errors import DistributedOperationException
from notebook_launcher.state import PartialState
from notebook_launcher.utils import (
    broadcast,
    broadcast_object_list,
    concatenate,
    find_batch_size,
    gather,
    gather_object,
    honor_type,
    listify,
    pad_across_processes,
    recursively_apply,
    reduce,
    send_to_device,
    set_seed,
)

from .helpers import free_port, kernel_env

pytestmark = pytest.mark.multiprocess

try:  # tests/ as a package (tests/__init__.py) or as a plain directory on sys.path
    from tests._torchrun_target import check_everything, expected
except ImportError:  # pragma: no cover - depends on how pytest imported this file
    from _torchrun_target import check_everything, expected  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parent.parent
Pair = namedtuple("Pair", ["a", "b"])


def _normal(data: Any) -> Any:
    """JSON round trip: tuples become lists, as in the torchrun run's files."""
    return json.loads(json.dumps(data))


# --------------------------------------------------------------------------------------------
# The same function, three ways
# --------------------------------------------------------------------------------------------


def test_check_function_in_a_plain_process() -> None:
    assert _normal(check_everything()) == _normal(expected(0, 1))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_processes", [2, 3])
def test_check_function_under_notebook_launcher(num_processes: int) -> None:
    results = notebook_launcher(check_everything, num_processes=num_processes, dashboard=False)
    assert [_normal(r) for r in results] == [
        _normal(expected(r, num_processes)) for r in range(num_processes)
    ]


@pytest.mark.timeout(90)
def test_check_function_under_torchrun(tmp_path: Path) -> None:
    env = kernel_env()
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(REPO / "tests" / "_torchrun_target.py"),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results == [_normal(expected(r, 2)) for r in range(2)]


# --------------------------------------------------------------------------------------------
# Single process
# --------------------------------------------------------------------------------------------


def test_operations_in_a_single_process() -> None:
    t = torch.arange(6.0).reshape(2, 3).t()  # non-contiguous
    nested = {"t": t, "l": [torch.ones(2)], "p": Pair(torch.zeros(1), torch.tensor(3))}
    g = gather(nested)
    assert g["t"] is t and isinstance(g["p"], Pair)
    assert gather_object([1, "a"]) == [1, "a"]
    assert gather_object({"x": 1}) == [{"x": 1}]
    assert broadcast(nested) is nested
    objs = [1, 2]
    assert broadcast_object_list(objs) is objs
    r = reduce(nested["t"], "sum", scale=2.0)
    assert r.tolist() == (t * 2).tolist() and r.is_contiguous() and r is not t
    assert reduce(torch.tensor([1, 2]), "max").tolist() == [1, 2]
    assert reduce(torch.ones(2, requires_grad=True), "mean").requires_grad is False
    assert pad_across_processes(t, dim=1).tolist() == t.tolist()
    assert pad_across_processes(torch.tensor(1.0)).tolist() == 1.0
    with pytest.raises(TypeError, match="floating-point tensors, got one of dtype torch.int64"):
        reduce({"a": torch.ones(1), "b": torch.tensor([1, 2])}, "mean")
    with pytest.raises(ValueError, match="reduction must be one of"):
        reduce(torch.ones(1), "avg")
    with pytest.raises(TypeError, match=r"Unsupported types \(<class 'str'>\)"):
        gather({"a": "text"})
    with pytest.raises(ValueError, match="from_process"):
        broadcast(torch.ones(1), from_process=1)


def test_nested_helpers() -> None:
    data = {"a": [torch.ones(2, 3), (torch.zeros(2),)], "p": Pair(torch.ones(1), 5)}
    doubled = recursively_apply(lambda x: x * 2, data)
    assert isinstance(doubled["p"], Pair) and doubled["p"].b == 5
    assert doubled["a"][0].tolist() == [[2.0] * 3] * 2
    assert find_batch_size(data) == 2
    assert listify(data["a"]) == [[[1.0] * 3] * 2, ([0.0, 0.0],)]
    assert honor_type(Pair(1, 2), iter([3, 4])) == Pair(3, 4)
    moved = send_to_device(data, "cpu", skip_keys="p")
    assert moved["p"] is data["p"] and moved["a"][0].device.type == "cpu"
    cat = concatenate(
        [(torch.ones(1), {"x": torch.zeros(1, 2)}), (torch.zeros(2), {"x": torch.ones(1, 2)})]
    )
    assert cat[0].tolist() == [1.0, 0.0, 0.0] and cat[1]["x"].tolist() == [[0.0, 0.0], [1.0, 1.0]]
    with pytest.raises(TypeError, match="Can only concatenate tensors but got <class 'int'>"):
        concatenate([1, 2])
    assert concatenate(["a"]) == "a"  # one element comes back as it is, as in Accelerate


def test_set_seed_seeds_every_generator() -> None:
    import random

    import numpy as np

    torch_state, py_state, np_state = (
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state(),
    )
    try:
        set_seed(3)
        first = (torch.rand(2).tolist(), random.random(), np.random.rand())
        set_seed(3, device_specific=True)  # process index 0: the same seed
        assert (torch.rand(2).tolist(), random.random(), np.random.rand()) == first
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(py_state)
        np.random.set_state(np_state)
    assert PartialState().process_index == 0


# --------------------------------------------------------------------------------------------
# Mismatches across ranks: an exception on every rank, never a hang or an abort
# --------------------------------------------------------------------------------------------


def _catch(fn: Any) -> str:
    try:
        fn()
    except (DistributedOperationException, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _mismatch_worker() -> dict[str, str]:
    r = PartialState().process_index
    out = {
        "gather": _catch(lambda: gather(torch.ones(2 + r, 3))),
        "gather_nested": _catch(lambda: gather({"a": torch.ones(1)} if r else [torch.ones(1)])),
        "reduce": _catch(lambda: reduce(torch.ones(1 + r), "sum")),
        "reduce_dtype": _catch(
            lambda: reduce(torch.ones(2, dtype=torch.float64 if r else torch.float32))
        ),
        "broadcast": _catch(lambda: broadcast(torch.ones(3 - r))),
        "objects": _catch(lambda: broadcast_object_list([None] * (r + 1))),
        "pad_ndim": _catch(lambda: pad_across_processes(torch.ones([2] * (r + 1)))),
        "reduce_int_mean": _catch(lambda: reduce(torch.tensor([r]), "mean")),
        "different_ops": _catch(lambda: gather(torch.ones(1)) if r == 0 else reduce(torch.ones(1))),
    }
    # After all that, the group still works: nothing was left half-done.
    out["after"] = str(gather(torch.tensor([r])).tolist())
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("debug_env", [None, "ACCELERATE_DEBUG_MODE", "NOTEBOOK_LAUNCHER_DEBUG"])
def test_mismatches_raise_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, debug_env: str | None
) -> None:
    if debug_env is not None:
        monkeypatch.setenv(debug_env, "true" if debug_env.startswith("ACC") else "1")
    results = notebook_launcher(_mismatch_worker, num_processes=2, dashboard=False)
    for r, out in enumerate(results):
        for key in ("gather", "reduce", "broadcast"):
            assert out[key].startswith("DistributedOperationException: Cannot apply"), (key, out)
            assert "Process 0: " in out[key] and "Process 1: " in out[key]
        assert "Process 0: [2, 3] float32\n  - Process 1: [3, 3] float32" in out["gather"]
        assert "Process 0: [[1] float32]\n  - Process 1: {a: [1] float32}" in out["gather_nested"]
        assert "Process 0: ([1] float32, sum)\n  - Process 1: ([2] float32, sum)" in out["reduce"]
        assert "float64" in out["reduce_dtype"]
        assert "Process 0: ([3] float32, 0)\n  - Process 1: ([2] float32, 0)" in out["broadcast"]
        assert "list lengths" in out["objects"] and "Process 1: (2, 0)" in out["objects"]
        assert "Process 0: [2]" in out["pad_ndim"] and "Process 1: [2, 2]" in out["pad_ndim"]
        assert out["reduce_int_mean"].startswith("TypeError: reduce(..., reduction='mean')")
        assert "called different collective operations" in out["different_ops"]
        assert "process 0: gather, process 1: reduce" in out["different_ops"]
        assert out["after"] == "[0, 1]", r


def _debug_only_worker() -> list[str]:
    state = PartialState()
    r = state.process_index
    assert state.debug
    # gather_object tolerates anything, but calling it against a different op on another
    # rank is caught in debug mode before any data moves.
    return [
        _catch(lambda: gather_object([r]) if r != 1 else gather(torch.ones(1))),
        str(gather_object([r])),
    ]


@pytest.mark.timeout(60)
def test_debug_mode_checks_every_collective_on_three_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ACCELERATE_DEBUG_MODE", "1")
    results = notebook_launcher(_debug_only_worker, num_processes=3, dashboard=False)
    for message, after in results:
        assert "process 0: gather_object, process 1: gather, process 2: gather_object" in message
        assert after == "[0, 1, 2]"


def _uncaught_mismatch() -> None:
    gather(torch.ones(1 + PartialState().process_index))


@pytest.mark.timeout(60)
def test_uncaught_mismatch_reaches_the_caller_as_distributed_operation_exception() -> None:
    with pytest.raises(DistributedOperationException, match="Process 1: \\[2\\] float32"):
        notebook_launcher(_uncaught_mismatch, num_processes=2, dashboard=False)


# --------------------------------------------------------------------------------------------
# Packets: small inputs travel with their shape check (one collective), large ones after it
# --------------------------------------------------------------------------------------------


def _packet_worker(mixed: bool) -> dict[str, Any]:
    import torch.distributed as dist

    r, n = PartialState().process_index, PartialState().num_processes
    big = torch.arange(2000, dtype=torch.float32) + r  # 8000 bytes: over the packet
    out: dict[str, Any] = {}
    for name, t in {
        "f32": torch.tensor([[1.5 + r, 2.0]]),
        "bool": torch.tensor([r == 0, True]),
        "bf16": torch.tensor([0.5 + r], dtype=torch.bfloat16),
        "i64_scalar": torch.tensor(7 + r),
        "grad": torch.ones(3, requires_grad=True) * (r + 1),
        "strided": torch.arange(6.0).reshape(2, 3).t() + r,
        "big": big,
    }.items():
        expected = [torch.empty_like(t.detach().reshape(-1)) for _ in range(n)]
        dist.all_gather(expected, t.detach().contiguous().reshape(-1))
        got = gather(t)
        out[f"gather_{name}"] = (got.dtype == t.dtype, got.reshape(-1).tolist())
        out[f"expected_{name}"] = torch.cat(expected).tolist()
    value = torch.tensor([r + 1.0, -2.0 * r])
    out["reduce"] = {
        how: reduce(value, how, scale=2.0).tolist() for how in ("sum", "mean", "max", "min")
    }
    out["reduce_bool"] = reduce(torch.tensor([r == 1, False]), "sum").tolist()
    out["reduce_big"] = reduce(big, "sum")[:2].tolist()
    out["broadcast_small"] = broadcast(torch.full((2,), float(r)), from_process=1).tolist()
    out["broadcast_big"] = broadcast(big.clone(), from_process=1)[:2].tolist()
    if mixed:  # rank 0 takes the small path, rank 1 the large one: a clean error on both
        out["mixed"] = _catch(lambda: gather(torch.ones(1) if r == 0 else big))
    out["after"] = gather(torch.tensor([r])).tolist()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("checks", ["1", "0"])
def test_packet_paths_match_the_bare_collectives(
    monkeypatch: pytest.MonkeyPatch, checks: str
) -> None:
    monkeypatch.setenv("NOTEBOOK_LAUNCHER_CHECK_COLLECTIVES", checks)
    # without the check a mismatch would abort a rank (gloo): that case needs it on
    results = notebook_launcher(_packet_worker, (checks == "1",), 2, dashboard=False)
    for out in results:
        for key, (same_dtype, values) in (
            (k, v) for k, v in out.items() if k.startswith("gather_")
        ):
            assert same_dtype, key
            assert values == out["expected_" + key[len("gather_") :]], key
        assert out["reduce"] == {
            "sum": [6.0, -4.0],
            "mean": [3.0, -2.0],
            "max": [4.0, 0.0],
            "min": [2.0, -4.0],
        }
        assert out["reduce_bool"] == [True, False]
        assert out["reduce_big"] == [1.0, 3.0]
        assert out["broadcast_small"] == [1.0, 1.0]
        assert out["broadcast_big"] == [1.0, 2.0]
        if checks == "1":
            assert out["mixed"].startswith("DistributedOperationException: Cannot apply gather")
            assert "Process 0: [1] float32" in out["mixed"]
            assert "Process 1: [2000] float32" in out["mixed"]
        assert out["after"] == [0, 1]


def _copy_and_rng_worker() -> dict[str, Any]:
    from notebook_launcher.utils import copy_tensor_to_devices, synchronize_rng_states

    r = PartialState().process_index
    out: dict[str, Any] = {}
    held = torch.tensor([[1, 2, 3]], dtype=torch.int32) if r == 1 else None
    copied = copy_tensor_to_devices(held)  # held by rank 1, not the main process
    out["copied"] = (copied.dtype, copied.tolist())
    out["none"] = _catch_value(lambda: copy_tensor_to_devices(None))
    out["two"] = _catch_value(lambda: copy_tensor_to_devices(torch.ones(1)))
    torch.manual_seed(100 + r)
    generator = torch.Generator().manual_seed(200 + r)
    synchronize_rng_states(["torch", "generator"], generator=generator)
    out["draws"] = (torch.rand(2).tolist(), torch.rand(2, generator=generator).tolist())
    out["xla"] = _catch_value(lambda: synchronize_rng_states(["xla"]))
    return out


def _catch_value(fn: Any) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_copy_tensor_to_devices_and_synchronize_rng_states() -> None:
    a, b = notebook_launcher(_copy_and_rng_worker, num_processes=2, dashboard=False)
    assert a["copied"] == b["copied"] == (torch.int32, [[1, 2, 3]])
    assert "exactly one process" in a["none"] and "none hold one" in b["none"]
    assert "processes [0, 1] hold one" in a["two"]
    assert a["draws"] == b["draws"]  # rank 0's generator states everywhere
    assert "notebook_launcher runs on CPUs and CUDA GPUs" in a["xla"]


def test_availability_checks_and_version_helpers() -> None:
    from notebook_launcher import utils

    assert utils.compare_versions("2.13.0+cpu", ">=", "2.13") is True
    assert utils.compare_versions("1.9.1", "<", "1.10") is True  # numeric, not lexicographic
    assert utils.is_torch_version(">=", "2.2") is True
    assert utils.str_to_bool("Yes") == 1 and utils.str_to_bool("off", to_bool=True) is False
    with pytest.raises(ValueError, match="invalid truth value"):
        utils.str_to_bool("maybe")
    assert utils.is_pytest_available() is True
    assert utils.is_bf16_available() is True and utils.is_fp16_available() is True
    assert utils.is_cuda_available() is torch.cuda.is_available()
    for name in utils.__all__:
        if name.startswith("is_") and name.endswith("_available"):
            assert isinstance(getattr(utils, name)(), bool), name


def _many_dims_worker() -> list[int]:
    r = PartialState().process_index
    shape = [1] * 40  # 40 dims: the sizes no longer fit the packet, a second exchange follows
    shape[-1] = 1 + r
    return list(pad_across_processes(torch.ones(shape), dim=-1).shape)


@pytest.mark.timeout(60)
def test_pad_across_processes_with_many_dims() -> None:
    for shape in notebook_launcher(_many_dims_worker, num_processes=2, dashboard=False):
        assert shape == [1] * 39 + [2]


def test_a_shape_mismatch_names_each_ranks_input_in_its_first_line() -> None:
    """The first line is what a summary, the dashboard's rank row and a log show: it names
    each rank's input (ranks that agree share an entry), as a mismatch of kinds names each
    rank's call."""
    from notebook_launcher._worker import collectives
    from notebook_launcher.utils import operations

    raw = collectives.mismatch_message(
        [
            ("all_reduce", "all_reduce(float32 [4])", "a.py:3"),
            ("all_reduce", "all_reduce(float32 [5])", "a.py:3"),
            ("all_reduce", "all_reduce(float32 [4])", "a.py:3"),
        ]
    )
    assert raw.splitlines()[0] == (
        "The ranks called all_reduce with different inputs: processes 0, 2: "
        "all_reduce(float32 [4]), process 1: all_reduce(float32 [5]). Every rank must pass "
        "the same shapes, dtypes, root and reduce op"
    )
    with pytest.raises(DistributedOperationException) as info:
        operations._raise_mismatch("gather", [("gather", "[2] float32"), ("gather", "[3] float32")])
    assert str(info.value).splitlines()[0] == (
        "Cannot apply gather because the ranks disagree on its inputs: process 0: [2] float32, "
        "process 1: [3] float32. All shapes across processes must match "
        "(pad_across_processes() evens out tensor lengths)."
    )
