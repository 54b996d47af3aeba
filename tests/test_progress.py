"""Worker-side tqdm integration: bars become ProgressUpdate events, and draw nothing."""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import tqdm
import tqdm.auto
import tqdm.notebook
import tqdm.std
from tqdm.auto import tqdm as auto_tqdm_imported_early  # a reference taken before install

from notebook_launcher import notebook_launcher
from notebook_launcher._events import ProgressUpdate
from notebook_launcher._worker import progress as _progress
from notebook_launcher._worker import runtime as _runtime
from notebook_launcher.ui.model import DONE, FAILED, STOPPED, LaunchModel
from notebook_launcher.ui.text import TextView

from .helpers import Recorder

pytestmark = pytest.mark.multiprocess


@pytest.fixture
def events() -> Iterator[list[Any]]:
    got: list[Any] = []
    _runtime.install(got.append)
    _progress.install(rank=3)
    try:
        yield got
    finally:
        _progress.uninstall()
        _runtime.install(None)


def bars(events: list[Any]) -> dict[int, list[ProgressUpdate]]:
    """The updates of each bar, in the order the bars appeared (bar ids are only unique)."""
    out: dict[int, list[ProgressUpdate]] = {}
    for e in events:
        if isinstance(e, ProgressUpdate):
            out.setdefault(e.bar_id, []).append(e)
    return out


def nth(events: list[Any], i: int) -> list[ProgressUpdate]:
    return list(bars(events).values())[i]


def test_every_tqdm_name_reports_and_draws_nothing(
    events: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from ipywidgets.widgets import widget

    widgets_before = len(widget._instances)
    classes = [
        tqdm.tqdm,
        tqdm.std.tqdm,
        tqdm.auto.tqdm,
        tqdm.notebook.tqdm,
        tqdm.notebook.tqdm_notebook,
        auto_tqdm_imported_early,
    ]
    for i, cls in enumerate(classes):
        for _ in cls(range(5), desc=f"c{i}"):
            pass
    for _ in tqdm.trange(4, desc="trange"):
        pass
    for _ in tqdm.notebook.trange(4, desc="nb-trange"):
        pass
    assert len(widget._instances) == widgets_before  # the notebook class built nothing
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
    finals = [b[-1] for b in bars(events).values()]
    assert [(f.desc, f.n, f.total, f.closed, f.rank) for f in finals] == [
        *[(f"c{i}", 5, 5, True, 3) for i in range(len(classes))],
        ("trange", 4, 4, True, 3),
        ("nb-trange", 4, 4, True, 3),
    ]
    assert all(b[0].n == 0 and not b[0].closed for b in bars(events).values())  # first draw
    assert isinstance(tqdm.auto.tqdm(total=1, disable=True), tqdm.auto.tqdm)  # same classes


def test_nested_bars_levels_postfix_and_units(events: list[Any]) -> None:
    with tqdm.tqdm(total=2, desc="epoch", unit="ep") as outer:
        for epoch in range(2):
            for _ in tqdm.tqdm(range(3), desc="step", leave=False):
                pass
            outer.set_postfix(loss=0.5 / (epoch + 1))
            outer.update()
    for _ in tqdm.tqdm(range(2048), unit="B", unit_scale=2):
        pass
    by_id = bars(events)
    epoch, step1, step2, scaled = by_id.values()
    assert [(e.level, e.unit) for e in (epoch[0], step1[0], scaled[0])] == [
        (0, "ep"),
        (1, "it"),
        (0, "B"),
    ]
    assert (epoch[-1].n, epoch[-1].total, epoch[-1].postfix) == (2, 2, "loss=0.25")
    assert step2[-1].closed and step2[-1].n == 3
    assert (scaled[-1].n, scaled[-1].total) == (4096, 4096)
    assert epoch[-1].rate is not None and epoch[-1].rate > 0 and epoch[-1].elapsed > 0


def test_disabled_bars_emit_nothing_and_disable_none_still_shows(events: list[Any]) -> None:
    is_local_main_process = False
    for _ in tqdm.auto.tqdm(range(10), disable=not is_local_main_process):
        pass
    bar = tqdm.tqdm(total=3, disable=True)
    bar.update(3)
    bar.close()
    assert events == []
    for _ in tqdm.tqdm(range(2), disable=None):  # "hide on non-TTY": the dashboard shows it
        pass
    assert [e.n for e in events] == [0, 2]


def test_coalescing_tight_loops_and_refresh_floods(events: list[Any]) -> None:
    t0 = time.perf_counter()
    for _ in tqdm.tqdm(range(200_000)):
        pass
    bar = tqdm.tqdm(total=3000)
    for i in range(3000):
        bar.set_postfix(i=i)  # refresh=True each time: capped at ~10 events/s
        bar.update()
    bar.close()
    seconds = time.perf_counter() - t0
    by_id = bars(events)
    assert len(by_id) == 2
    for updates in by_id.values():
        assert len(updates) <= 3 + 11 * seconds, (len(updates), seconds)
        assert updates[-1].closed and updates[-1].n == updates[-1].total
    assert nth(events, 1)[-1].postfix == "i=2999"


def test_final_state_always_sent(events: list[Any]) -> None:
    bar = tqdm.tqdm(total=10, delay=60)  # never drawn by tqdm itself
    bar.update(4)
    bar.close()
    bar.close()  # twice: still one final event
    with pytest.raises(KeyError), tqdm.auto.tqdm(total=5, desc="boom") as b2:
        b2.update(2)
        raise KeyError("x")
    b3 = tqdm.tqdm(total=2, desc="reset")
    b3.update(2)
    b3.reset(total=7)
    b3.update(1)
    b3.close()
    finals = [(u[-1].desc, u[-1].n, u[-1].total, u[-1].closed) for u in bars(events).values()]
    assert finals == [("", 4, 10, True), ("boom", 2, 5, True), ("reset", 1, 7, True)]
    first = nth(events, 0)[0].bar_id
    assert sum(1 for e in events if e.closed and e.bar_id == first) == 1


def test_uninstall_restores_tqdm(capsys: pytest.CaptureFixture[str]) -> None:
    original = tqdm.std.tqdm.__dict__["__new__"]
    got: list[Any] = []
    _runtime.install(got.append)
    try:
        _progress.install(rank=0)
        _progress.install(rank=1)  # idempotent
        assert _progress.installed() and tqdm.std.tqdm.__dict__["__new__"] is not original
        _progress.uninstall()
        assert not _progress.installed() and tqdm.std.tqdm.__dict__["__new__"] is original
        buf = io.StringIO()
        for _ in tqdm.tqdm(range(3), file=buf):
            pass
    finally:
        _progress.uninstall()
        _runtime.install(None)
    assert got == [] and "3/3" in buf.getvalue()  # an ordinary tqdm again
    assert type(tqdm.tqdm(disable=True)) is tqdm.tqdm


# -- real workers ---------------------------------------------------------------------------


def _train(steps: int) -> int:
    from notebook_launcher.state import PartialState

    state = PartialState()
    for _ in tqdm.auto.tqdm(range(2), desc="epoch"):
        for _ in auto_tqdm_imported_early(range(steps), desc="step", leave=False):
            pass
    for _ in tqdm.tqdm(range(3), desc="main only", disable=not state.is_local_main_process):
        pass
    # barriers are reported when they take noticeable time (> 50 ms): make them wait
    with state.main_process_first():
        if state.is_main_process:
            time.sleep(0.3)  # rank 1 waits for this
        print(f"rank {state.process_index} in main_process_first", flush=True)
    if not state.is_main_process:
        time.sleep(0.3)  # rank 0 waits for this
    state.wait_for_everyone()
    return state.process_index


@pytest.mark.timeout(60)
def test_two_ranks_report_their_bars_and_barriers() -> None:
    rec = Recorder()
    left_open = tqdm.tqdm(total=10, file=io.StringIO())  # the kernel's own, never closed
    try:
        assert notebook_launcher(_train, args=(500,), num_processes=2, dashboard=rec) == [0, 1]
    finally:
        left_open.close()
    assert rec.closed == 1
    model = LaunchModel()
    for e in rec.events:
        model.apply(e)
    for r in (0, 1):
        s = model.ranks[r]
        assert s.status == DONE and s.pid not in (None, os.getpid())
        # levels count the rank's own bars only (not the kernel's open one)
        shown = [(b.desc, b.n, b.total, b.level, b.style) for b in s.bars.values()]
        expected = [("epoch", 2, 2, 0, "success"), ("step", 500, 500, 1, "success")]
        if r == 0:
            expected.append(("main only", 3, 3, 0, "success"))
        assert shown == expected
        # tqdm drew nothing into the rank's stderr
        assert not [t for _, stream, t in s.output.lines if stream == "stderr"]
        assert [t for _, _, t in s.output.lines] == [f"rank {r} in main_process_first"]
    # main_process_first: rank 1 waited for rank 0; then rank 0 waited at wait_for_everyone
    records = [model.barriers[i] for i in sorted(model.barriers)]
    assert [(b.index, sorted(b.arrived), b.kind) for b in records] == [
        (0, [1], "main_process_first"),
        (1, [0], "wait_for_everyone"),
    ]
    for b in records:
        assert b.completed is not None and b.arrived_ranks(model.rank_ids) == [0, 1]
        assert b.location.startswith("test_progress.py:") and b.took() >= 0.25  # type: ignore[operator]
    assert model.finished is not None and model.finished.ok and model.alerts() == []
    updates = [e for e in rec.events if isinstance(e, ProgressUpdate)]
    assert len(updates) < 100  # 2 ranks x 5 bars: a handful of events each, not 2000


def _leave_early(_: int) -> None:
    from notebook_launcher.state import PartialState

    state = PartialState()
    for _ in tqdm.tqdm(range(4), desc="work"):
        pass
    if state.process_index == 2:
        time.sleep(0.2)  # the others are waiting (and have said so) by now
        raise ValueError("rank 2 gives up")
    state.wait_for_everyone()


@pytest.mark.timeout(60)
def test_three_ranks_one_leaves_while_the_others_wait() -> None:
    buf = io.StringIO()
    view = TextView(buf, interval=1.0)
    with pytest.raises(ValueError, match="rank 2 gives up"):
        notebook_launcher(_leave_early, args=(0,), num_processes=3, dashboard=view)
    m = view.model
    assert m.ranks[2].status == FAILED and m.ranks[2].exc_type.endswith("ValueError")
    assert {m.ranks[0].status, m.ranks[1].status} <= {STOPPED, FAILED}
    (barrier,) = m.barriers.values()
    assert sorted(barrier.arrived) == [0, 1] and list(barrier.left) == [2]
    assert barrier.completed is None and barrier.kind == "wait_for_everyone"
    out = buf.getvalue()
    assert "[rank2] raised " in out and "ValueError: rank 2 gives up" in out
    assert "[rank0] work: 4/4 [100%]" in out
    (alert,) = [ln for ln in out.splitlines() if "waited at barrier" in ln]
    assert (
        alert.startswith("notebook_launcher: rank 2 raised ")
        and "ValueError while rank(s) 0, 1" in alert
    )
    last = out.splitlines()[-1]
    assert last.startswith("notebook_launcher: 3 ranks, ") and "failed: rank 2 raised" in last


def _chatty(_: int) -> int:
    import sys

    for _ in tqdm.tqdm(range(3), desc="quiet bar"):
        pass
    rank = int(os.environ["RANK"])
    print(f"hello from {rank}", flush=True)
    print(f"warning from {rank}", file=sys.stderr, flush=True)
    return rank


@pytest.mark.timeout(60)
def test_dashboard_false_still_prints_rank_output_and_the_summary(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert notebook_launcher(_chatty, args=(0,), num_processes=2, dashboard=False) == [0, 1]
    captured = capsys.readouterr()
    out, err = captured.out.splitlines(), captured.err.splitlines()
    assert sorted(out[:-1]) == ["[rank0] hello from 0", "[rank1] hello from 1"]
    assert out[-1].startswith("notebook_launcher: 2 ranks, ") and out[-1].endswith(": ok")
    assert sorted(err) == ["[rank0] warning from 0", "[rank1] warning from 1"]
    assert "quiet bar" not in captured.out + captured.err  # no progress lines


def _first_bar() -> tuple[bool, bool, int]:
    made_before = hasattr(tqdm.std.TqdmDefaultWriteLock, "mp_lock")
    bar = tqdm.std.tqdm(range(3), desc="first")
    for _ in bar:
        pass
    return made_before, hasattr(tqdm.std.TqdmDefaultWriteLock, "mp_lock"), bar.n


class _HoldsTheBarsLock(threading.Thread):
    """Stands in for tqdm's monitor thread (``tqdm._monitor.TMonitor``, a Thread of that
    module: the fork check leaves it be), which takes the bars' lock while it looks at
    them: here it holds it across the fork."""

    __module__ = "tqdm._monitor"

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.holding, self.done = threading.Event(), threading.Event()

    def run(self) -> None:
        with tqdm.std.TqdmDefaultWriteLock.th_lock:
            self.holding.set()
            self.done.wait(60)


@pytest.mark.timeout(60)
def test_a_ranks_first_bar_makes_the_bars_lock_then(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 33, item 9: tqdm's write lock is made when a rank's first bar takes it, not as
    every rank starts (it makes a multiprocessing lock: an import and a semaphore, ~2 ms
    of every launch, for ranks that may never draw a bar); and it is not the thread lock
    a kernel thread held at the fork (the first bar would wait for it forever)."""
    monkeypatch.delattr(tqdm.std.TqdmDefaultWriteLock, "mp_lock", raising=False)
    holder = _HoldsTheBarsLock()
    holder.start()
    assert holder.holding.wait(10)
    rec = Recorder()
    try:
        got = notebook_launcher(_first_bar, num_processes=2, start_method="fork", dashboard=rec)
    finally:
        holder.done.set()
        holder.join()
    assert got == [(False, True, 3)] * 2
    done = [(e.rank, e.n, e.total) for e in rec.of(ProgressUpdate) if e.n == e.total]
    assert sorted(set(done)) == [(0, 3, 3), (1, 3, 3)]
