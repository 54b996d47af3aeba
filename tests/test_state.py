"""PartialState / AcceleratorState / GradientState and process control.

Single-process behaviour runs in the test process itself; multi-process behaviour runs
one launch per world size (2 and 3 CPU ranks) that records everything it sees and
returns it, so the assertions live here in the parent.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from notebook_launcher import notebook_launcher
from notebook_launcher._events import BarrierEnter, BarrierExit, Output
from notebook_launcher.state import (
    AcceleratorState,
    DistributedType,
    GradientState,
    PartialState,
    _reset_state,
    split_inputs,
    state_in_use,
)
from notebook_launcher.utils.dataclasses import GradientAccumulationPlugin

from .helpers import Recorder, free_port

pytestmark = pytest.mark.multiprocess

# --------------------------------------------------------------------------------------------
# Single process
# --------------------------------------------------------------------------------------------


def test_plain_process_is_distributed_type_no() -> None:
    state = PartialState()
    assert state.distributed_type is DistributedType.NO
    assert (state.num_processes, state.process_index, state.local_process_index) == (1, 0, 0)
    assert state.device == torch.device("cpu")
    assert state.backend is None
    assert state.mixed_precision == "no"
    assert state.debug is False
    assert state.use_distributed is False
    assert state.is_main_process and state.is_local_main_process and state.is_last_process
    assert state.initialized
    text = repr(state)
    assert "Distributed environment: NO" in text
    assert "Num processes: 1" in text
    assert "Device: cpu" in text


def test_shared_state_singleton_and_reset() -> None:
    assert state_in_use() is None
    a = PartialState()
    b = PartialState()
    assert a.__dict__ is b.__dict__
    assert state_in_use() == "PartialState"
    AcceleratorState()
    assert state_in_use() == "AcceleratorState"
    AcceleratorState(_from_accelerator=True)
    assert state_in_use() == "Accelerator"
    _reset_state()
    assert state_in_use() is None
    assert not a.initialized
    assert not AcceleratorState._shared_state and not GradientState._shared_state


@pytest.mark.parametrize(
    ("env", "value", "expected"),
    [
        ("NOTEBOOK_LAUNCHER_DEBUG", "1", True),
        ("NOTEBOOK_LAUNCHER_DEBUG", "true", True),
        ("ACCELERATE_DEBUG_MODE", "TRUE", True),
        ("ACCELERATE_DEBUG_MODE", "1", True),
        ("ACCELERATE_DEBUG_MODE", "0", False),
        ("NOTEBOOK_LAUNCHER_DEBUG", "false", False),
    ],
)
def test_debug_mode_from_env(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, expected: bool
) -> None:
    monkeypatch.setenv(env, value)
    assert PartialState().debug is expected


def test_mixed_precision_from_env_and_constructor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert PartialState().mixed_precision == "bf16"
    assert AcceleratorState().mixed_precision == "bf16"
    _reset_state()
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    acc = AcceleratorState(mixed_precision="BF16")
    assert acc.mixed_precision == "bf16"
    assert PartialState().mixed_precision == "bf16"  # the AcceleratorState's value wins
    assert AcceleratorState(mixed_precision="bf16").mixed_precision == "bf16"  # same: fine


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: PartialState(nonsense=1), TypeError, "nonsense"),
        (lambda: AcceleratorState(mixed_precision="fp8"), ValueError, "fp8.*not supported"),
        (lambda: AcceleratorState(mixed_precision="fp64"), ValueError, "Unknown mixed_precision"),
        (lambda: AcceleratorState(mixed_precision=""), ValueError, "Unknown mixed_precision ''"),
        (lambda: AcceleratorState(fsdp_plugin=object()), NotImplementedError, "fsdp_plugin"),
    ],
)
def test_bad_settings_raise_clear_errors(make: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()
    assert AcceleratorState._shared_state == {}


@pytest.mark.parametrize("source", ["env", "argument"])
def test_fp16_without_cuda_warns_and_is_kept(monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    # Accelerate accepts fp16 on a CPU (and trains in fp32): so do we, saying so.
    if source == "env":
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.warns(UserWarning, match="fp16' on CPU.*trains in fp32"):
        state = AcceleratorState(mixed_precision=None if source == "env" else "fp16")
    assert state.mixed_precision == "fp16"


def test_reinitialising_with_conflicting_settings_raises() -> None:
    AcceleratorState(mixed_precision="no")
    with pytest.raises(ValueError, match="mixed_precision='no' and cannot be changed to 'bf16'"):
        AcceleratorState(mixed_precision="bf16")


def test_latest_gradient_accumulation_settings_win() -> None:
    # Accelerate's rule (its tests build one Accelerator per case, each with its settings).
    GradientState(GradientAccumulationPlugin(num_steps=2))
    GradientState()  # no settings: nothing changes
    assert GradientState().num_steps == 2
    GradientState(GradientAccumulationPlugin(num_steps=4, sync_each_batch=True))
    assert (GradientState().num_steps, GradientState().sync_each_batch) == (4, True)


def test_accelerator_state_delegates_to_partial_state() -> None:
    acc = AcceleratorState()
    partial = PartialState()
    for name in (
        "device",
        "distributed_type",
        "num_processes",
        "process_index",
        "local_process_index",
        "backend",
        "debug",
        "use_distributed",
        "is_main_process",
        "is_local_main_process",
        "is_last_process",
        "fork_launched",
    ):
        assert getattr(acc, name) == getattr(partial, name), name
    assert "Distributed environment: NO" in repr(acc)
    with pytest.raises(AttributeError, match="no_such_thing"):
        _ = acc.no_such_thing


@dataclass
class _FakeLoader:
    end_of_dataloader: bool
    remainder: int


def test_gradient_state_bookkeeping() -> None:
    gs = GradientState()
    assert gs.sync_gradients is True
    assert (gs.num_steps, gs.adjust_scheduler, gs.sync_with_dataloader) == (1, False, True)
    assert gs.active_dataloader is None and gs.dataloader_references == [None]
    assert gs.end_of_dataloader is False and gs.remainder == -1 and not gs.in_dataloader
    gs = GradientState(GradientAccumulationPlugin(num_steps=3, adjust_scheduler=True))
    assert (gs.num_steps, gs.adjust_scheduler) == (3, True)
    outer, inner = _FakeLoader(False, -1), _FakeLoader(True, 5)
    gs._add_dataloader(outer)
    gs._add_dataloader(inner)
    assert GradientState().active_dataloader is inner
    assert (gs.end_of_dataloader, gs.remainder) == (True, 5)
    gs._remove_dataloader(inner)
    assert (gs.active_dataloader, gs.end_of_dataloader) == (outer, False)
    gs._remove_dataloader(outer)
    assert gs.active_dataloader is None and gs.dataloader_references == [None]
    gs._set_sync_gradients(False)
    assert GradientState().sync_gradients is False
    assert "Sync Gradients: False" in repr(gs)


def test_process_control_in_a_single_process(capsys: pytest.CaptureFixture[str]) -> None:
    state = PartialState()
    calls: list[str] = []

    @state.on_main_process
    def main(x: int) -> int:
        calls.append("main")
        return x + 1

    @state.on_local_main_process()
    def local_main() -> str:
        calls.append("local")
        return "local"

    @state.on_last_process
    def last() -> None:
        calls.append("last")

    @state.on_process(process_index=3)  # not distributed: every decorated function runs
    def third() -> None:
        calls.append("third")

    @state.on_local_process(local_process_index=1)
    def local_one() -> None:
        calls.append("local_one")

    assert main(1) == 2 and main.__name__ == "main"
    assert local_main() == "local"
    last(), third(), local_one()
    assert calls == ["main", "local", "last", "third", "local_one"]

    state.wait_for_everyone()
    with state.main_process_first():
        calls.append("first")
    with state.local_main_process_first():
        calls.append("local_first")
    assert calls[-2:] == ["first", "local_first"]

    data = {"a": [1, 2, 3]}
    with state.split_between_processes(data, apply_padding=True) as part:
        assert part is data
    state.print("printed", 1)
    assert capsys.readouterr().out == "printed 1\n"
    assert state.check_trigger() is False
    state.set_trigger()
    assert state.check_trigger() is True
    assert state.check_trigger() is False
    with pytest.raises(ValueError, match="process_index"):
        state.on_process(lambda: None)


def test_decorators_decide_at_call_time() -> None:
    state = PartialState()
    wrapped = state.on_main_process(lambda: "ran")
    _reset_state()  # the state is rebuilt when the function is called
    assert wrapped() == "ran"
    assert state_in_use() == "PartialState"


@pytest.mark.parametrize(
    ("inputs", "num", "padding", "expected"),
    [
        ([1, 2, 3, 4, 5], 2, False, [[1, 2, 3], [4, 5]]),
        ([1, 2, 3, 4, 5], 2, True, [[1, 2, 3], [4, 5, 5]]),
        ([1, 2, 3, 4], 3, False, [[1, 2], [3], [4]]),
        ([1, 2, 3, 4], 3, True, [[1, 2], [3, 3], [4, 4]]),
        ([1], 3, False, [[1], [], []]),
        ([1], 3, True, [[1], [1], [1]]),
        ([], 2, True, [[], []]),
        ((1, 2, 3), 2, True, [(1, 2), (3, 3)]),
        ("abcde", 3, False, ["ab", "cd", "e"]),
        (
            {"x": [1, 2, 3], "y": ("a", "b", "c")},
            2,
            True,
            [{"x": [1, 2], "y": ("a", "b")}, {"x": [3, 3], "y": ("c", "c")}],
        ),
    ],
)
def test_split_inputs(inputs: Any, num: int, padding: bool, expected: list[Any]) -> None:
    before = repr(inputs)
    assert [split_inputs(inputs, i, num, padding) for i in range(num)] == expected
    assert repr(inputs) == before  # the caller's data is never changed


def test_split_inputs_hf_dataset_by_rows() -> None:
    """A Hugging Face Dataset is split by rows (slicing one gives a dict of columns: each
    rank got one "item" per column before; Accelerate's test_split_between_processes_dataset)."""
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_list([{"k": v} for v in range(5)])
    parts = [split_inputs(data, i, 2) for i in range(2)]
    assert [p["k"] for p in parts] == [[0, 1, 2], [3, 4]]
    assert all(isinstance(p, datasets.Dataset) for p in parts)
    padded = [split_inputs(data, i, 2, True)["k"] for i in range(2)]
    assert padded == [[0, 1, 2], [3, 4, 4]]
    few = datasets.Dataset.from_list([{"k": 0}])
    assert [split_inputs(few, i, 2, True)["k"] for i in range(2)] == [[0], [0]]


def test_split_inputs_tensors_and_errors() -> None:
    t = torch.arange(10).reshape(5, 2).t().t()  # a non-contiguous-looking view of 5 rows
    parts = [split_inputs(t, i, 3, True) for i in range(3)]
    assert [p.tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [8, 9]]]
    with pytest.raises(ValueError, match="same length"):
        split_inputs({"a": [1, 2], "b": [1]}, 0, 2)
    with pytest.raises(TypeError, match="list, tuple, dict or tensor"):
        split_inputs(42, 0, 2)


def test_torchrun_style_env_creates_and_reset_destroys_the_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(key, value)
    state = PartialState(timeout=30)
    assert dist.is_initialized()
    # Accelerate's rule: one CPU process is not distributed, even in a group of one
    assert state.distributed_type is DistributedType.NO
    assert (state.backend, state.num_processes, state.use_distributed) == ("gloo", 1, False)
    state.wait_for_everyone()  # a real barrier on a 1-rank group
    _reset_state()
    assert not dist.is_initialized()


def test_destroy_process_group_destroys_a_group_it_created(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch.distributed as dist

    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(key, value)
    PartialState().destroy_process_group()
    assert not dist.is_initialized()
    PartialState().destroy_process_group()  # nothing left to destroy: a no-op


# --------------------------------------------------------------------------------------------
# Several processes
# --------------------------------------------------------------------------------------------


def _append(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def _process_control_worker(log_dir: str) -> dict[str, Any]:
    state = PartialState()
    acc = AcceleratorState()
    r, n = state.process_index, state.num_processes
    out: dict[str, Any] = {
        "attrs": (
            state.distributed_type,
            state.num_processes,
            state.process_index,
            state.local_process_index,
            str(state.device),
            state.backend,
            state.mixed_precision,
            state.use_distributed,
            state.is_main_process,
            state.is_local_main_process,
            state.is_last_process,
        ),
        "repr": repr(state),
        "acc_same": (acc.process_index, acc.num_processes, acc.device) == (r, n, state.device),
    }
    # main_process_first: each rank logs when it enters and leaves the block.
    first_log = os.path.join(log_dir, "first.log")
    with state.main_process_first():
        _append(first_log, f"enter {r} {time.time()!r}")
        if state.is_main_process:
            time.sleep(0.2)  # gives the others every chance to barge in if it were broken
        _append(first_log, f"leave {r} {time.time()!r}")
    local_log = os.path.join(log_dir, "local.log")
    with acc.local_main_process_first():
        _append(local_log, f"enter {r} {time.time()!r}")
        if state.is_local_main_process:
            time.sleep(0.1)
        _append(local_log, f"leave {r} {time.time()!r}")
    acc.wait_for_everyone()

    # Decorators, bare and with arguments, on both state classes.
    @state.on_main_process
    def on_main() -> str:
        return f"main {r}"

    @acc.on_local_main_process()
    def on_local_main() -> str:
        return f"local-main {r}"

    @state.on_last_process
    def on_last() -> str:
        return f"last {r}"

    @acc.on_process(process_index=1)
    def on_one() -> str:
        return f"one {r}"

    @state.on_local_process(local_process_index=n - 1)
    def on_local_last() -> str:
        return f"local-last {r}"

    out["decorated"] = [on_main(), on_local_main(), on_last(), on_one(), on_local_last()]

    # split_between_processes: uneven lists, padding, dicts (not mutated), tensors.
    data = {"ids": list(range(7)), "t": torch.arange(7)}
    with state.split_between_processes(list(range(7))) as part:
        out["split"] = part
    with acc.split_between_processes(("a", "b", "c", "d", "e"), apply_padding=True) as part:
        out["split_padded"] = part
    with state.split_between_processes(data, apply_padding=True) as part:
        out["split_dict"] = {"ids": part["ids"], "t": part["t"].tolist()}
    out["dict_untouched"] = data["ids"] == list(range(7)) and data["t"].shape == (7,)
    with state.split_between_processes(["only"]) as part:
        out["split_short"] = part

    # print once, from the main process.
    state.print(f"print-from-rank-{r}")
    acc.print(f"acc-print-from-rank-{r}")

    # Triggers: only the last rank sets it; every rank sees it once.
    out["trigger_before"] = state.check_trigger()
    if state.is_last_process:
        acc.set_trigger()
    out["trigger_after"] = acc.check_trigger()
    out["trigger_again"] = state.check_trigger()
    # The launcher's group is the launcher's: destroying it from the function is a no-op.
    acc.destroy_process_group()
    out["group_kept"] = torch.distributed.is_initialized()
    return out


def _read_log(path: Path) -> list[tuple[str, int, float]]:
    rows = []
    for line in path.read_text().splitlines():
        what, rank, when = line.split()
        rows.append((what, int(rank), float(when)))
    return rows


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_processes", [2, 3])
def test_process_control_across_ranks(
    tmp_path: Path, num_processes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTEBOOK_LAUNCHER_BARRIER_QUIET_MS", "0")  # report every barrier
    view = Recorder()
    results = notebook_launcher(
        _process_control_worker, args=(str(tmp_path),), num_processes=num_processes, dashboard=view
    )
    n = num_processes
    assert len(results) == n
    for r, res in enumerate(results):
        assert res["attrs"] == (
            DistributedType.MULTI_CPU,
            n,
            r,
            r,
            "cpu",
            "gloo",
            "no",
            True,
            r == 0,
            r == 0,
            r == n - 1,
        )
        assert "Distributed environment: MULTI_CPU  Backend: gloo" in res["repr"]
        assert f"Num processes: {n}\nProcess index: {r}\n" in res["repr"]
        assert res["acc_same"]
        assert res["decorated"] == [
            "main 0" if r == 0 else None,
            "local-main 0" if r == 0 else None,
            f"last {r}" if r == n - 1 else None,
            "one 1" if r == 1 else None,
            f"local-last {r}" if r == n - 1 else None,
        ]
        assert res["dict_untouched"]
        assert res["group_kept"]
        assert (res["trigger_before"], res["trigger_after"], res["trigger_again"]) == (
            False,
            True,
            False,
        )
    splits = [res["split"] for res in results]
    padded = [res["split_padded"] for res in results]
    dicts = [res["split_dict"] for res in results]
    short = [res["split_short"] for res in results]
    if n == 2:
        assert splits == [[0, 1, 2, 3], [4, 5, 6]]
        assert padded == [("a", "b", "c"), ("d", "e", "e")]
        assert dicts == [
            {"ids": [0, 1, 2, 3], "t": [0, 1, 2, 3]},
            {"ids": [4, 5, 6, 6], "t": [4, 5, 6, 6]},
        ]
        assert short == [["only"], []]
    else:
        assert splits == [[0, 1, 2], [3, 4], [5, 6]]
        assert padded == [("a", "b"), ("c", "d"), ("e", "e")]
        assert dicts == [
            {"ids": [0, 1, 2], "t": [0, 1, 2]},
            {"ids": [3, 4, 4], "t": [3, 4, 4]},
            {"ids": [5, 6, 6], "t": [5, 6, 6]},
        ]
        assert short == [["only"], [], []]

    # main_process_first: rank 0 left the block before any other rank entered it.
    for name in ("first.log", "local.log"):
        rows = _read_log(tmp_path / name)
        assert len(rows) == 2 * n
        assert rows[0][:2] == ("enter", 0) and rows[1][:2] == ("leave", 0), rows
        main_left = rows[1][2]
        assert all(when >= main_left for what, rank, when in rows if rank != 0), rows

    # print: once, from rank 0.
    printed = "".join(e.text for e in view.events if isinstance(e, Output))
    assert "print-from-rank-0" in printed and "acc-print-from-rank-0" in printed
    for r in range(1, n):
        assert f"print-from-rank-{r}" not in printed

    # Barrier events: every rank reports where it waits, and when it leaves.
    enters = [e for e in view.events if isinstance(e, BarrierEnter)]
    exits = [e for e in view.events if isinstance(e, BarrierExit)]
    for r in range(n):
        mine = [e for e in enters if e.rank == r]
        assert [e.index for e in mine] == list(range(len(mine)))
        kinds = [e.kind for e in mine]
        # one barrier per *_first block on every rank, then wait_for_everyone
        assert kinds[:3] == ["main_process_first", "local_main_process_first", "wait_for_everyone"]
        assert all(e.location.startswith("test_state.py:") for e in mine)
        mine_exits = {e.index: e for e in exits if e.rank == r}
        for e in mine:
            assert mine_exits[e.index].location == e.location
            assert mine_exits[e.index].time >= e.time
    waits = {e.location for e in enters if e.kind == "wait_for_everyone"}
    assert len(waits) == 1  # every rank waited at the same line


def _slow_main_worker() -> float:
    state = PartialState()
    for _ in range(3):
        state.wait_for_everyone()  # fast barriers: usually not worth a dashboard event
    if state.is_main_process:
        time.sleep(0.5)  # the others wait for rank 0 at the next line
    arrived = time.time()
    state.wait_for_everyone()
    return arrived


@pytest.mark.timeout(60)
def test_a_rank_waiting_at_a_barrier_is_reported_with_its_call_site() -> None:
    view = Recorder()
    arrived = notebook_launcher(_slow_main_worker, num_processes=3, dashboard=view)
    enters = [e for e in view.events if isinstance(e, BarrierEnter)]
    exits = {(e.rank, e.index): e for e in view.events if isinstance(e, BarrierExit)}
    line = _slow_main_worker.__code__.co_firstlineno + 7
    for rank in (1, 2):
        slow = [e for e in enters if e.rank == rank and e.index == 3]
        assert len(slow) == 1, enters
        assert (slow[0].location, slow[0].kind) == (f"test_state.py:{line}", "wait_for_everyone")
        assert slow[0].time <= arrived[0]  # it entered before rank 0 even arrived
        assert exits[(rank, 3)].time >= arrived[0] and exits[(rank, 3)].location == slow[0].location
    for e in enters:  # whatever else was reported is consistent
        assert exits[(e.rank, e.index)].time >= e.time and e.index <= 3
