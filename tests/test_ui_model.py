"""The dashboard model: event sequences in, per-rank state out (no Jupyter, no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from notebook_launcher._events import (
    BarrierEnter,
    BarrierExit,
    Event,
    LaunchFinished,
    LaunchStarted,
    Output,
    ProgressUpdate,
    WorkerExited,
    WorkerFailed,
    WorkerFinished,
    WorkerPhase,
    WorkerStarted,
    WorkerStopped,
)
from notebook_launcher.ui import html as H
from notebook_launcher.ui.model import (
    DIED,
    DONE,
    FAILED,
    MAX_BARRIERS,
    RUNNING,
    STARTING,
    STOPPED,
    WAITING,
    LaunchModel,
    clean_line,
    fmt_duration,
    fmt_rate,
    notebook_cell_traceback,
)

pytestmark = pytest.mark.unit

T0 = 1000.0


def started(
    n: int = 2, *, num_nodes: int = 1, node_rank: int = 0, ranks: tuple[int, ...] = ()
) -> LaunchStarted:
    return LaunchStarted(
        world_size=n * num_nodes,
        local_world_size=n,
        node_rank=node_rank,
        num_nodes=num_nodes,
        start_method="fork",
        start_reason="cpu only",
        master_addr="127.0.0.1",
        master_port=29500,
        backend="gloo",
        ranks=ranks or tuple(range(n)),
        time=T0,
    )


def bar(
    rank: int, bar_id: int, n: float, total: float | None, t: float, **kw: object
) -> ProgressUpdate:
    kw.setdefault("desc", "")
    return ProgressUpdate(rank=rank, bar_id=bar_id, n=n, total=total, time=T0 + t, **kw)  # type: ignore[arg-type]


def script(n: int = 2, *, fail_rank: int | None = None) -> list[Event]:
    """A whole launch: start, output, two bars per rank, one barrier, then the end."""
    ev: list[Event] = [started(n)]
    ev += [
        WorkerStarted(rank=r, local_rank=r, pid=100 + r, device="cpu", time=T0 + 0.1)
        for r in range(n)
    ]
    for r in range(n):
        ev.append(Output(rank=r, stream="stdout", text=f"hello from {r}\n", time=T0 + 0.2))
        for k in range(4):
            ev.append(
                bar(r, 0, k, 3, 1 + k, desc="epoch", elapsed=float(k), rate=1.0, closed=k == 3)
            )
            ev.append(bar(r, 1, 10 * k, 30, 1 + k, desc="step", level=1, closed=k == 3))
    ev += [
        BarrierEnter(
            rank=r, index=0, location="train.py:12", kind="wait_for_everyone", time=T0 + 5 + r
        )
        for r in range(n)
        if r != fail_rank
    ]
    if fail_rank is None:
        ev += [
            BarrierExit(rank=r, index=0, location="train.py:12", time=T0 + 6 + n) for r in range(n)
        ]
        ev += [WorkerFinished(rank=r, time=T0 + 7 + n) for r in range(n)]
        ev.append(
            LaunchFinished(
                ok=True, summary="ok", root_cause_rank=None, wall_time=8.0 + n, time=T0 + 8 + n
            )
        )
    else:
        ev.append(
            WorkerFailed(
                rank=fail_rank,
                exc_type="ValueError",
                message="boom",
                traceback="Traceback:\nValueError: boom\n",
                collateral=False,
                time=T0 + 9,
            )
        )
        ev += [
            WorkerStopped(rank=r, reason=f"rank {fail_rank} failed", time=T0 + 9.5)
            for r in range(n)
            if r != fail_rank
        ]
        ev.append(
            LaunchFinished(
                ok=False,
                summary=f"rank {fail_rank} failed",
                root_cause_rank=fail_rank,
                wall_time=10.0,
                time=T0 + 10,
                failed_ranks=(fail_rank,),
            )
        )
    return ev


def fold(events: list[Event], model: LaunchModel | None = None) -> LaunchModel:
    m = model or LaunchModel()
    for e in events:
        m.apply(e)
    return m


def test_whole_successful_run() -> None:
    m = fold(script(3))
    assert m.rank_ids == [0, 1, 2]
    for r in range(3):
        s = m.ranks[r]
        assert (s.pid, s.device, s.status, s.local_rank) == (100 + r, "cpu", DONE, r)
        assert s.elapsed(now=T0 + 999) == pytest.approx(7 + 3 - 0.1)  # ended, so the clock stops
        assert [(b.desc, b.n, b.total, b.closed, b.style) for b in s.bars.values()] == [
            ("epoch", 3, 3, True, "success"),
            ("step", 30, 30, True, "success"),
        ]
        assert [line for _, _, line in s.output.lines] == [f"hello from {r}"]
    (rec,) = m.barriers.values()
    assert rec.completed == T0 + 6 + 3 and rec.location == "train.py:12" and not rec.left
    assert sorted(rec.arrived) == [0, 1, 2] and rec.missing(m.rank_ids) == []
    assert m.summary_line() == "3 ranks, 11.0s: ok"
    assert m.root_cause() is None and m.alerts() == []


def test_status_through_a_barrier_and_waiting_time() -> None:
    m = fold(script(2)[:3])
    assert m.ranks[0].status == RUNNING
    changes = m.apply(
        BarrierEnter(rank=0, index=0, location="nb.py:4", kind="wait_for_everyone", time=T0 + 2)
    )
    assert changes == {("rank", 0), ("barriers",)}
    s = m.ranks[0]
    assert s.status == WAITING and s.status_text(now=T0 + 5.5) == "waiting at nb.py:4 for 3.5s"
    rec = m.barriers[0]
    assert rec.waiting() == [0] and rec.missing(m.rank_ids) == [1]
    assert [b.index for b in m.open_barriers()] == [0]
    m.apply(
        BarrierEnter(rank=1, index=0, location="nb.py:9", kind="main_process_first", time=T0 + 3)
    )
    assert rec.mismatched and rec.location == "nb.py:4 / nb.py:9"
    m.apply(BarrierExit(rank=0, index=0, location="nb.py:4", time=T0 + 3.1))
    assert m.ranks[0].status == RUNNING and m.ranks[0].barrier is None
    assert m.ranks[1].status == WAITING


def test_rank_that_leaves_while_others_wait_is_an_alert() -> None:
    m = fold(script(3, fail_rank=2))
    rec = m.barriers[0]
    assert rec.left == {2: "raised ValueError"}
    assert m.alerts() == [
        "rank 2 raised ValueError while rank(s) 0, 1 waited at barrier #0 (train.py:12)"
    ]
    assert m.ranks[2].status == FAILED and m.ranks[0].status == STOPPED
    assert m.ranks[0].outcome() == "stopped: rank 2 failed"
    assert m.root_cause() is m.ranks[2]
    assert m.summary_line() == "3 ranks, 10.0s: failed: rank 2 raised ValueError: boom"
    # the failed rank's bars were complete: success; others keep success too (complete)
    assert {b.style for s in m.ranks.values() for b in s.bars.values()} == {"success"}


def test_returning_early_and_dying_are_named() -> None:
    m = fold(
        [
            started(3),
            *[
                WorkerStarted(rank=r, local_rank=r, pid=10 + r, device="cpu", time=T0)
                for r in range(3)
            ],
        ]
    )
    m.apply(BarrierEnter(rank=0, index=0, location="a.py:1", kind="wait_for_everyone", time=T0 + 1))
    m.apply(WorkerFinished(rank=1, time=T0 + 2))
    m.apply(WorkerExited(rank=2, pid=12, exitcode=-9, signal_name="SIGKILL", time=T0 + 3))
    assert m.barriers[0].left == {1: "returned", 2: "died (SIGKILL)"}
    assert m.ranks[2].outcome() == "died: killed by SIGKILL(-9)"
    assert m.ranks[1].status == DONE and m.ranks[2].status == DIED
    m.apply(LaunchFinished(ok=False, summary="", root_cause_rank=None, wall_time=3.5, time=T0 + 4))
    assert m.root_cause() is m.ranks[2]
    assert m.summary_line() == "3 ranks, 3.5s: failed: rank 2 died: killed by SIGKILL(-9)"
    assert m.ranks[0].status == STOPPED  # never ended on its own


def test_a_rank_that_never_started_says_why_with_no_pid_or_signal() -> None:
    """A cluster's node refused to start its ranks: no process, so no "killed by SIGKILL"."""
    m = fold([started(2)])
    why = "never started: node 1 (gpu-3) refused to start it: at most 1 rank"
    m.apply(WorkerExited(rank=1, pid=0, exitcode=None, signal_name=None, time=T0 + 1, note=why))
    assert m.ranks[1].status == DIED and m.ranks[1].outcome() == why
    m.apply(LaunchFinished(ok=False, summary="", root_cause_rank=1, wall_time=1.0, time=T0 + 2))
    assert "SIGKILL" not in m.summary_line() and why in m.summary_line()


def test_first_real_ending_wins_and_collateral_is_not_the_root_cause() -> None:
    m = fold([started(2)])
    m.apply(
        WorkerFailed(
            rank=0,
            exc_type="RuntimeError",
            message="Connection closed by peer",
            traceback="",
            collateral=True,
            time=T0 + 1,
        )
    )
    m.apply(WorkerExited(rank=1, pid=5, exitcode=1, signal_name=None, time=T0 + 2))
    m.apply(WorkerExited(rank=0, pid=4, exitcode=1, signal_name=None, time=T0 + 3))
    assert m.ranks[0].status == FAILED
    assert m.ranks[0].outcome() == "stopped: collateral RuntimeError"
    assert m.ranks[0].shown_status == STOPPED
    assert m.root_cause() is m.ranks[1]
    assert m.ranks[1].outcome() == "died: exit code 1"


def test_bars_nested_slots_styles_and_bounds() -> None:
    m = fold([started(1)])
    assert m.ranks[0].status == STARTING
    m.apply(bar(0, 0, 0, 2, 0, desc="epoch"))
    assert m.ranks[0].status == RUNNING  # a bar means it runs even before WorkerStarted
    for epoch, first_id in enumerate((1, 2)):
        m.apply(bar(0, first_id, 0, 5, epoch, desc="step", level=1))
        m.apply(bar(0, first_id, 5, 5, epoch + 0.5, desc="step", level=1, closed=True))
    # the second step bar took the closed first one's slot: one epoch row, one step row
    assert [(b.bar_id, b.desc) for b in m.ranks[0].bars.values()] == [(0, "epoch"), (2, "step")]
    m.apply(bar(0, 3, 1, 4, 3, desc="eval", closed=True))  # closed short of its total
    assert m.ranks[0].bars[3].style == "danger"
    m.apply(bar(0, 9, 0, 1, 3, desc="hidden", disabled=True))
    assert 9 not in m.ranks[0].bars
    for i in range(20):  # level-0 bars pile up but stay bounded (closed ones drop first)
        m.apply(bar(0, 100 + i, 1, 1, 4, desc=f"b{i}", closed=True))
    s = m.ranks[0]
    assert len(s.bars) == 12 and s.dropped_bars == 11 and 0 in s.bars  # the open epoch bar stays
    m.apply(LaunchFinished(ok=False, summary="x", root_cause_rank=0, wall_time=1, time=T0 + 5))
    # at the end, a rank that did not finish: complete bars success, the rest danger
    assert s.bars[0].style == "danger" and s.bars[119].style == "success"


def test_bar_text() -> None:
    b = (
        fold(
            [
                started(1),
                bar(0, 0, 40, 100, 0, desc="step", rate=12.34, elapsed=3.2, postfix="loss=0.1"),
            ]
        )
        .ranks[0]
        .bars[0]
    )
    assert b.stats() == "40/100 [40%] 12.3it/s eta 4.9s loss=0.1"
    b.closed = True
    assert b.stats() == "40/100 [40%] 12.3it/s in 3.2s loss=0.1"
    u = fold([started(1), bar(0, 0, 7, None, 0, unit="batch", elapsed=2.0)]).ranks[0].bars[0]
    assert (u.fraction, u.eta, u.counts(), u.label()) == (None, None, "7batch", "progress")
    assert u.stats() == "7batch 3.5batch/s"
    assert (
        fmt_rate(0.5, "it") == "2.00s/it"
        and fmt_rate(None, "it") == "?it/s"
        and fmt_rate(250.0, "it") == "250it/s"
    )
    rates = [fmt_rate(x, "B") for x in (12_345.0, 6_462_718.0, 2.5e9)]
    assert rates == ["12.3kB/s", "6.46MB/s", "2.5GB/s"]
    assert [fmt_duration(x) for x in (0.04, 59.9, 65, 3723, None, -1)] == [
        "0.0s",
        "59.9s",
        "1:05",
        "1:02:03",
        "?",
        "?",
    ]


def test_output_lines_tails_and_ring_buffer() -> None:
    m = LaunchModel(max_lines_per_rank=3, max_lines_combined=4)
    m.apply(started(2))
    m.apply(Output(rank=0, stream="stdout", text="par", time=T0))
    assert list(m.ranks[0].output.lines) == [] and m.pending_tail(0, "stdout") == "par"
    m.apply(Output(rank=0, stream="stdout", text="tial\n", time=T0))
    m.apply(Output(rank=0, stream="stderr", text="\x1b[31mred\x1b[0m 10%\r50%\r100%\n", time=T0))
    assert list(m.ranks[0].output.lines) == [(0, "stdout", "partial"), (0, "stderr", "100%")]
    for i in range(5):
        m.apply(Output(rank=1, stream="stdout", text=f"line {i}\n", time=T0))
    s1 = m.ranks[1].output
    assert [t for _, _, t in s1.lines] == ["line 2", "line 3", "line 4"]
    assert (s1.dropped, s1.total, s1.dropped_note()) == (2, 5, "[2 earlier line(s) dropped]")
    assert [(r, t) for r, _, t in m.combined.lines] == [
        (1, "line 1"),
        (1, "line 2"),
        (1, "line 3"),
        (1, "line 4"),
    ]
    assert m.combined.dropped == 3
    m.apply(Output(rank=1, stream="stdout", text="no newline at the end", time=T0))
    m.apply(LaunchFinished(ok=True, summary="", root_cause_rank=None, wall_time=1, time=T0 + 1))
    assert list(s1.lines)[-1] == (1, "stdout", "no newline at the end")
    assert clean_line("a\rb\r\n") == "b" and clean_line("\x1b]0;title\x07x\n") == "x"
    m.apply(Output(rank=0, stream="stdout", text="two\nlines\n", time=T0))  # defensively split
    assert [t for _, _, t in m.ranks[0].output.lines][-2:] == ["two", "lines"]
    for i in range(10_000):  # a \r progress display that never ends its line stays small
        m.apply(Output(rank=0, stream="stderr", text=f"\r{i}%", time=T0))
    assert m.pending_tail(0, "stderr") == "9999%" and len(m._tails[(0, "stderr")]) == 5
    m.apply(Output(rank=0, stream="stderr", text="x" * 50_000, time=T0))
    assert len(m.pending_tail(0, "stderr")) == 10_000


def test_nodes_group_ranks() -> None:
    one = fold([started(2)])
    assert one.nodes() == {0: [0, 1]}
    two = fold([started(2, num_nodes=2, node_rank=1, ranks=(2, 3))])
    assert two.world_size == 4 and two.nodes() == {1: [2, 3]}
    two.apply(WorkerStarted(rank=0, local_rank=0, pid=1, device="cpu", time=T0))  # a stray rank
    assert two.nodes() == {0: [0], 1: [2, 3]}


def test_restart_starts_every_row_afresh_and_keeps_the_log() -> None:
    from notebook_launcher._events import LaunchRestarting

    m = fold(
        [
            started(2),
            *(WorkerStarted(r, r, 100 + r, "cpu", T0) for r in range(2)),
            Output(0, "stdout", "attempt 0\n", T0),
            BarrierEnter(0, 0, "train.py:3", "wait_for_everyone", T0 + 0.5),
            bar(0, 1, 5, 10, 0.6),
            WorkerExited(1, 101, -9, "SIGKILL", T0 + 1),
            WorkerStopped(0, "another rank failed", T0 + 1),
        ]
    )
    assert m.alerts()  # rank 1 left rank 0 waiting in barrier #0 of this attempt
    m.apply(LaunchRestarting(1, 3, "rank 1 (pid 101) died: killed by SIGKILL(-9)", T0 + 1.1))
    assert [m.ranks[r].status for r in (0, 1)] == [STARTING, STARTING]
    assert not m.ranks[0].bars and not m.barriers and not m.alerts()
    assert [t for _, _, t in m.ranks[0].output.lines] == ["attempt 0"]
    assert m.restart_text() == "restart 1 of 3 (rank 1 (pid 101) died: killed by SIGKILL(-9))"
    for r in range(2):
        m.apply(WorkerStarted(r, r, 200 + r, "cpu", T0 + 1.2))
        m.apply(WorkerFinished(r, T0 + 2))
    m.apply(LaunchFinished(True, "all 2 ranks finished", None, 2.0, T0 + 2, restarts=1))
    assert m.summary_line() == "2 ranks, 2.0s, 1 restart: ok"


def test_nodes_meeting_then_the_job() -> None:
    from notebook_launcher._events import RendezvousStarted
    from notebook_launcher.ui.html import header_parts

    m = fold([RendezvousStarted("c10d", "10.0.0.1:29500", "job", 2, 0, 300.0, T0)])
    assert "waiting up to 5:00 for 2 nodes: c10d rendezvous 'job' at 10.0.0.1:29500" in (
        header_parts(m, T0 + 1)
    )
    job = started(2, num_nodes=2, node_rank=1, ranks=(2, 3))
    m.apply(LaunchStarted(**{**job.__dict__, "rendezvous": "c10d rendezvous 'job' at h:1"}))
    parts = header_parts(m, T0 + 1)
    assert "node 1 of 2, world size 4" in parts and "gloo, c10d rendezvous 'job' at h:1" in parts
    never = fold([RendezvousStarted("static", "h:1", "none", 2, 0, 1.0, T0)])
    never.apply(LaunchFinished(False, "RendezvousError: node 1 did not join", None, 1.0, T0 + 1))
    assert never.summary_line() == "2 nodes, 1.0s: failed: RendezvousError: node 1 did not join"


def test_a_followed_detached_run_is_named_in_the_header() -> None:
    """A kernel that follows a detached run shows whose ranks these are (a supervisor's)."""
    from notebook_launcher.ui.html import header_parts
    from notebook_launcher.ui.text import TextView

    detached = LaunchStarted(**{**started(2).__dict__, "detached": "3fa9c1"})
    assert header_parts(fold([detached]), T0 + 1)[1:3] == ["detached run 3fa9c1", "2 ranks"]
    assert TextView._header(detached).startswith("detached run 3fa9c1: 2 ranks, ")
    assert "detached" not in " ".join(header_parts(fold([started(2)]), T0 + 1))


def test_line_label_follows_the_template() -> None:
    m = fold([started(2, ranks=(4, 5))])
    assert m.line_label(5) == "[rank5]"
    m.started = LaunchStarted(
        **{
            **m.started.__dict__,
            "log_line_prefix_template": "${role_name}[${rank}/${local_rank}]: ",
        }
    )  # type: ignore[union-attr]
    assert m.line_label(5) == "default[5/1]:" and m.line_label(9) == "default[9/]:"


def test_unknown_events_change_nothing() -> None:
    m = LaunchModel()
    assert m.apply(object()) == frozenset()  # type: ignore[arg-type]
    assert m.summary_line() == "0 ranks: running" and m.elapsed(now=5.0) is None


# Import the ui subpackage without running notebook_launcher/__init__.py (which imports the
# launcher): a bare package module with the right __path__ stands in for it.
_ISOLATED = (
    "import sys, types, importlib.util;"
    "spec = importlib.util.find_spec('notebook_launcher');"
    "pkg = types.ModuleType('notebook_launcher');"
    "pkg.__path__ = list(spec.submodule_search_locations);"
    "sys.modules['notebook_launcher'] = pkg;"
)


def test_ui_and_progress_never_import_torch() -> None:
    code = _ISOLATED + (
        "import notebook_launcher.ui, notebook_launcher.ui.widgets, notebook_launcher.ui.text;"
        "import notebook_launcher._worker.progress;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'));"
        "print('ok' if not bad else bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.stdout, out.stderr)


def test_notebook_cells_are_named_like_ipython_does(monkeypatch: pytest.MonkeyPatch) -> None:
    class Compiler:
        def format_code_name(self, name: str) -> tuple[str, str] | None:
            return ("Cell", "In[7]") if name == "/tmp/ipykernel_1/42.py" else None

    class Shell:
        compile = Compiler()

    class FakeIPython:
        @staticmethod
        def get_ipython() -> Shell:
            return Shell()

    monkeypatch.setitem(sys.modules, "IPython", FakeIPython)  # type: ignore[arg-type]
    m = fold([started(1)])
    m.apply(BarrierEnter(rank=0, index=0, location="/tmp/ipykernel_1/42.py:3", kind="k", time=T0))
    assert m.ranks[0].barrier is not None and m.ranks[0].barrier.location == "In[7]:3"
    assert m.barriers[0].location == "In[7]:3"
    m.apply(BarrierEnter(rank=0, index=1, location="train.py:9", kind="k", time=T0))
    assert m.barriers[1].location == "train.py:9"
    tb = (
        'Traceback (most recent call last):\n  File "/work/x.py", line 239, in _serve\n'
        '  File "/tmp/ipykernel_1/42.py", line 15, in train\nValueError: boom\n'
    )
    assert notebook_cell_traceback(tb) == (
        'Traceback (most recent call last):\n  File "/work/x.py", line 239, in _serve\n'
        "  Cell In[7], line 15, in train\nValueError: boom\n"
    )


def test_quiet_barriers_and_racing_events() -> None:
    """Workers report only barriers that take time; events of different ranks race."""
    m = fold(
        [
            started(3),
            *[WorkerStarted(rank=r, local_rank=r, pid=r, device="cpu", time=T0) for r in range(3)],
        ]
    )
    # rank 0 waited, ranks 1 and 2 came late and passed at once (they sent nothing)
    m.apply(BarrierEnter(rank=0, index=0, location="a.py:1", kind="wait_for_everyone", time=T0 + 1))
    assert m.barriers[0].missing(m.rank_ids) == [1, 2]
    # rank 1 returned and its end reached the parent before rank 0's exit did
    m.apply(WorkerFinished(rank=1, time=T0 + 2.1))
    assert m.barriers[0].left == {1: "returned"} and len(m.alerts()) == 1
    m.apply(BarrierExit(rank=0, index=0, location="a.py:1", time=T0 + 2))
    rec = m.barriers[0]
    assert rec.completed == T0 + 2 and rec.left == {} and m.alerts() == []
    assert rec.arrived_ranks(m.rank_ids) == [0, 1, 2] and rec.missing(m.rank_ids) == []
    assert rec.took() == pytest.approx(1.0)
    # rank 2 fails; ranks 0's enter of the next barrier arrives after that failure
    m.apply(
        WorkerFailed(
            rank=2, exc_type="KeyError", message="k", traceback="", collateral=False, time=T0 + 3
        )
    )
    m.apply(
        BarrierEnter(rank=0, index=1, location="a.py:2", kind="wait_for_everyone", time=T0 + 2.9)
    )
    assert m.barriers[1].left == {1: "returned", 2: "raised KeyError"}
    assert m.alerts() == [
        "rank 1 returned while rank(s) 0 waited at barrier #1 (a.py:2)",
        "rank 2 raised KeyError while rank(s) 0 waited at barrier #1 (a.py:2)",
    ]


def test_an_alert_names_a_collective_by_its_kind_and_never_blames_a_stopped_rank() -> None:
    """A rank the launcher stopped (the user's interrupt, a peer's failure) did not leave by
    itself: no alert names it; a rank that did is said to leave ranks waiting in the
    collective they were in, not at "barrier #0" (issue 26)."""
    m = fold([started(3), *[WorkerStarted(r, r, r, "cpu", T0) for r in range(3)]])
    m.apply(BarrierEnter(rank=0, index=0, location="a.py:4", kind="all_reduce", time=T0 + 1))
    m.apply(WorkerStopped(rank=1, reason="interrupted", time=T0 + 2))
    assert m.barriers[0].left == {1: "was stopped"} and m.alerts() == []
    assert m.barriers[0].label == "all_reduce #0"  # (as the text view names it too)
    m.apply(
        WorkerFailed(
            rank=2, exc_type="KeyError", message="k", traceback="", collateral=False, time=T0 + 3
        )
    )
    assert m.alerts() == ["rank 2 raised KeyError while rank(s) 0 waited in all_reduce #0 (a.py:4)"]


def test_an_interrupted_run_reads_stopped_not_failed() -> None:
    """The user's interrupt: every rank stopped, the headline says so, grey, no cross."""
    m = fold([started(2), *[WorkerStarted(r, r, r, "cpu", T0) for r in range(2)]])
    m.apply(BarrierEnter(rank=0, index=0, location="a.py:4", kind="barrier", time=T0 + 1))
    for r in range(2):
        m.apply(WorkerStopped(rank=r, reason="interrupted", time=T0 + 2))
    summary = "interrupted: ranks [0, 1] stopped their task; the session lives on"
    m.apply(LaunchFinished(False, summary, None, 2.0, T0 + 2, interrupted=True))
    assert m.summary_line() == f"2 ranks, 2.0s: {summary}" and m.alerts() == []
    assert "\u2718" not in H.summary(m) and "#757575" in H.summary(m)


def test_a_running_rank_says_while_it_wraps_the_model_in_ddp() -> None:
    """torch takes seconds to wrap a model in DDP on a loaded machine: the rank's status
    says so, as the start-up phases do, rather than only "running" (issue 26)."""
    m = fold([started(2), *[WorkerStarted(r, r, r, "cpu", T0) for r in range(2)]])
    m.apply(WorkerPhase(0, 0, "wrapping", T0 + 1))
    row = H.rank_row(m.ranks[0], T0 + 5)
    assert m.ranks[0].status_text(T0 + 5) == "wrapping the model in DDP" and row.count(
        "\u25cf wrapping the model in DDP"
    )
    assert m.ranks[1].status_text(T0 + 5) == "running"
    m.apply(WorkerPhase(0, 0, "", T0 + 6))  # done: its own code again
    assert m.ranks[0].status_text(T0 + 7) == "running"


def test_a_bar_without_desc_is_called_progress() -> None:
    """Transformers' Trainer draws its steps without a desc: not "bar 0" (issue 26)."""
    m = fold([started(1), WorkerStarted(0, 0, 0, "cpu", T0)])
    m.apply(ProgressUpdate(rank=0, bar_id=3, desc="", n=1, total=8, time=T0 + 1))
    m.apply(ProgressUpdate(rank=0, bar_id=4, desc="", n=1, total=2, level=1, time=T0 + 1))
    assert [b.label() for b in m.ranks[0].bars.values()] == ["progress", "inner progress"]


def test_outcome_is_one_short_line() -> None:
    m = fold([started(2)])
    m.apply(
        WorkerFailed(
            rank=0,
            exc_type="ValueError",
            message="x" * 300 + "\nmore",
            traceback="",
            collateral=False,
            time=T0,
        )
    )
    m.apply(
        WorkerFailed(
            rank=1, exc_type="KeyError", message="", traceback="", collateral=False, time=T0
        )
    )
    assert m.ranks[0].outcome() == "raised ValueError: " + "x" * 157 + "..."
    assert m.ranks[1].outcome() == "raised KeyError"


def test_barrier_history_is_bounded() -> None:
    m = fold([started(2)])
    for i in range(MAX_BARRIERS + 50):
        m.apply(BarrierEnter(rank=0, index=i, location="a.py:1", kind="k", time=T0 + i))
        m.apply(BarrierExit(rank=0, index=i, location="a.py:1", time=T0 + i + 0.5))
    m.apply(BarrierEnter(rank=1, index=MAX_BARRIERS + 50, location="a.py:1", kind="k", time=T0))
    assert len(m.barriers) == MAX_BARRIERS + 1 and m.dropped_barriers == 50
    assert min(m.barriers) == 50 and [b.index for b in m.open_barriers()] == [MAX_BARRIERS + 50]


def test_every_event_type_has_a_handler() -> None:
    import typing

    from notebook_launcher import _events
    from notebook_launcher.ui.model import HANDLERS

    assert set(typing.get_args(_events.Event)) == set(HANDLERS)


def out(m: LaunchModel, text: str, rank: int = 0, stream: str = "stderr") -> None:
    m.apply(Output(rank=rank, stream=stream, text=text, time=T0))


def test_a_line_ended_by_carriage_return_is_transient_until_a_newline() -> None:
    """The core's contract: ``"...\\r"`` arrives as its own piece and replaces the rank's
    current transient line; a ``"\\n"`` line commits it, as a terminal leaves it."""
    m = fold([started(2)])
    lines = m.ranks[0].output
    out(m, "\r")
    assert m.transient_lines() == [] and lines.total == 0
    out(m, " 10%|#    |\r")
    out(m, " 50%|#####|\r")
    assert m.pending_tail(0, "stderr") == " 50%|#####|" and lines.total == 0
    assert m.transient_lines() == [(0, "stderr", " 50%|#####|")]
    out(m, "\r")  # only moves the cursor: the line is still shown
    assert m.transient_lines() == [(0, "stderr", " 50%|#####|")]
    out(m, "100%|#####|\n")
    assert [t for _, _, t in lines.lines] == ["100%|#####|"] and m.transient_lines() == []
    out(m, "last state\r")
    out(m, "\n")  # a newline right after: the transient line is what stays
    assert [t for _, _, t in lines.lines][-1] == "last state"
    out(m, "epoch 1\r", rank=1, stream="stdout")
    out(m, "a long line in pieces, ", rank=0, stream="stdout")
    out(m, "still going", rank=0, stream="stdout")
    assert m.transient_lines() == [
        (0, "stdout", "a long line in pieces, still going"),
        (1, "stdout", "epoch 1"),
    ]
    m.apply(LaunchFinished(ok=True, summary="", root_cause_rank=None, wall_time=1, time=T0 + 1))
    assert m.transient_lines() == []  # the end commits them
    assert [t for r, _, t in m.combined.lines][-2:] == [
        "a long line in pieces, still going",
        "epoch 1",
    ]


def test_stopped_ranks_end_grey_with_no_eta_and_collateral_counts_as_stopped() -> None:
    m = fold([started(3)])
    for r in range(3):
        m.apply(bar(r, 0, 5, 10, 1, desc="step", rate=2.0))
    assert "eta" in m.ranks[0].bars[0].stats()
    m.apply(
        WorkerFailed(
            rank=1, exc_type="ValueError", message="x", traceback="", collateral=False, time=T0 + 2
        )
    )
    m.apply(
        WorkerFailed(
            rank=2,
            exc_type="RuntimeError",
            message="peer",
            traceback="",
            collateral=True,
            time=T0 + 2,
        )
    )
    m.apply(WorkerStopped(rank=0, reason="rank 1 failed", time=T0 + 2))
    styles = {r: m.ranks[r].bars[0].style for r in range(3)}
    assert styles == {0: "stopped", 1: "danger", 2: "stopped"}
    for r in range(3):
        stats = m.ranks[r].bars[0].stats()
        assert "eta" not in stats and stats.startswith("5/10 [50%] 2.0it/s"), stats
    assert [m.ranks[r].shown_status for r in range(3)] == [STOPPED, FAILED, STOPPED]
    assert m.ranks[2].outcome() == "stopped: collateral RuntimeError"
    m.apply(LaunchFinished(ok=False, summary="", root_cause_rank=1, wall_time=2, time=T0 + 3))
    assert {r: m.ranks[r].bars[0].style for r in range(3)} == styles


def test_progress_and_the_spread_of_many_ranks() -> None:
    m = fold([started(10)])
    m.apply(bar(0, 0, 1, 4, 0, desc="epoch"))
    m.apply(bar(0, 1, 50, 100, 0, desc="step", level=1))
    assert m.ranks[0].progress() == pytest.approx((1 + 0.5) / 4)
    for r in range(1, 10):
        m.apply(bar(r, 0, 50 + r, 100, 0, desc="step"))
    m.apply(bar(7, 0, 20, 100, 0, desc="step"))  # far behind: a straggler
    m.apply(WorkerFailed(7, "ValueError", "x", "", False, T0 + 1))
    sp = m.spread()
    assert sp.slowest == (7, 0.2) and sp.fastest == (9, 0.59)
    assert sp.median == (3, pytest.approx(0.535))  # the rank nearest the median
    assert sp.stragglers == [0] and sp.broken == [7]  # a failed rank is no straggler
    assert sp.counts == {"running": 9, "failed": 1}


def test_metrics_are_kept_per_rank_and_thinned_out() -> None:
    from notebook_launcher._events import MetricsLogged
    from notebook_launcher.ui.model import MetricSeries

    m = fold([started(2)])
    for step in range(5):
        for r in range(2):
            m.apply(MetricsLogged(r, step, (("loss", 1.0 / (step + 1 + r)), ("lr", 0.1)), T0))
    assert list(m.metrics) == ["loss", "lr"] and m.metrics_logged == 10
    assert m.metrics["loss"][1].points() == ([0, 1, 2, 3, 4], [0.5, 1 / 3, 0.25, 0.2, 1 / 6])
    s = MetricSeries()
    for i in range(10_001):
        s.add(i, float(i), max_points=100)
    steps, values = s.points()
    assert len(steps) <= 101 and steps[0] == 0 and steps[-1] == 10_000  # whole run, bounded
    assert steps == sorted(steps) and values == [float(x) for x in steps]


def _status(row: str) -> str:
    import html
    import re

    found = re.search(r"class='nl-status'[^>]*>● ([^<]*)<", row)
    assert found is not None, row
    return html.unescape(found.group(1))


def test_a_starting_rank_says_what_it_does_and_how_many_joined() -> None:
    m = fold([started(4)])
    assert [m.ranks[r].status_text(T0) for r in range(4)] == ["starting"] * 4
    m.apply(WorkerPhase(rank=0, pid=10, phase="importing", time=T0 + 1))
    m.apply(WorkerPhase(rank=1, pid=11, phase="loading", time=T0 + 1))
    m.apply(WorkerPhase(rank=2, pid=12, phase="joining", time=T0 + 2))
    changed = m.apply(WorkerPhase(rank=3, pid=13, phase="joining", time=T0 + 3))
    assert changed == {("rank", 2), ("rank", 3)}  # both waiting ranks now say 2/4
    assert [m.ranks[r].status_text(T0 + 4) for r in range(4)] == [
        "importing torch",
        "loading the function",
        "joining the process group (2/4 joined)",
        "joining the process group (2/4 joined)",
    ]
    assert m.ranks[0].pid == 10 and m.ranks[0].in_phase(T0 + 4) == 3.0
    assert m.starting_phases() == {"importing": 1, "loading": 1, "joining": 2}
    # the row: the phase, how long it has been at it, and the whole row for it (no bars yet)
    row = H.rank_row(m.ranks[2], T0 + 9)
    assert _status(row) == "joining the process group (2/4 joined)" and ">7.0s<" in row
    assert "nl-bars" not in row and "flex:1 1 24em;max-width:48em" in row
    m.apply(WorkerPhase(rank=0, pid=10, phase="joining", time=T0 + 5))
    m.apply(WorkerStarted(rank=1, local_rank=1, pid=11, device="cpu", time=T0 + 6))
    assert m.ranks[2].status_text(T0 + 6) == "joining the process group (4/4 joined)"
    assert m.ranks[1].status_text(T0 + 6) == RUNNING and m.ranks[1].in_phase(T0 + 6) is None
    # a phase that comes after its rank started (it cannot, but events race) changes nothing
    assert m.apply(WorkerPhase(rank=1, pid=11, phase="joining", time=T0 + 7)) == frozenset()
    # many ranks: the spread line counts the phases
    big = fold([started(12)])
    for r in range(12):
        if r < 7:
            big.apply(
                WorkerPhase(rank=r, pid=r, phase="importing" if r < 5 else "joining", time=T0)
            )
    spread = H.ranks_html(big, T0 + 1)
    assert "5 not heard from yet, 5 importing torch, 2 joining the process group" in spread


def test_a_failed_rank_row_keeps_its_status_short_and_its_message_whole() -> None:
    """At 1280 px the status was cut ("raised ValueError: rank 1 h…"): the message gets a
    line of its own under the row, wrapped rather than cut."""
    m = fold([started(2)])
    m.apply(bar(1, 1, 3, 10, 0.5, desc="step"))
    message = "rank 1 has a bad batch at step 3: shapes (8, 3) and (8, 4) cannot be multiplied"
    m.apply(WorkerFailed(1, "ValueError", message, "tb", False, T0 + 1))
    row = H.rank_row(m.ranks[1], T0 + 2)
    assert _status(row) == "raised ValueError"
    assert f"title='raised ValueError: {message}'" in row  # the full outcome on hover
    assert "<div class='nl-msg'" in row and f"ValueError: {message}</div>" in row
    assert "white-space:pre-wrap" in row.split("nl-msg", 1)[1].split(">", 1)[0]
    # collateral and stopped ranks have no message line
    m.apply(WorkerFailed(0, "RuntimeError", "Connection closed by peer", "", True, T0 + 1))
    assert "nl-msg" not in H.rank_row(m.ranks[0], T0 + 2)


def test_a_session_task_header_names_the_task_not_the_start_method() -> None:
    """A session's tasks said "fork: run_cell" (the task's name in the start reason)."""
    import dataclasses

    task = dataclasses.replace(started(2), task="task 3: run_cell")
    m = fold([task])
    assert H.header_parts(m, T0 + 1)[1:] == [
        "session task 3: run_cell",
        "2 of 2 ranks",
        "gloo on 127.0.0.1:29500",
        "running 1.0s",
    ]
    assert H.header_parts(fold([started(2)]), T0 + 1)[1:3] == ["2 ranks", "fork: cpu only"]


def test_a_session_started_on_a_cluster_shows_the_wait_then_its_ranks_ready() -> None:
    """The wait for the job and its agents shows at once, even in the view that holds a
    quick task's events back; the ranks that came up are ready (alive, waiting for tasks),
    not done; the clock runs on from the wait."""
    from dataclasses import replace

    from notebook_launcher._events import NodesWaiting
    from notebook_launcher.ui.lazy import LazyView
    from notebook_launcher.ui.model import READY

    shown: list[Event] = []

    class Shown:
        def handle(self, event: Event) -> None:
            shown.append(event)

        def tick(self) -> None: ...

        def close(self) -> None: ...

    wait = NodesWaiting("Slurm job 12, 2 node(s)", "PENDING (Resources)", 0, 2, T0 - 30.0)
    lazy = LazyView(Shown)
    lazy.handle(wait)
    assert shown == [wait]  # not held back until a task would have lasted

    m = LaunchModel()
    events: list[Event] = [
        wait,
        replace(started(2), session=True),
        WorkerStarted(0, 0, 10, "cpu", T0 + 1.0),
        WorkerStarted(1, 1, 11, "cpu", T0 + 1.0),
        LaunchFinished(True, "2 ranks ready", None, 2.0, T0 + 2.0),
    ]
    for event in events:
        m.apply(event)
    assert [m.ranks[r].status for r in (0, 1)] == [READY, READY]
    assert m.summary_line() == "2 ranks, 32.0s: ready"  # from the first word of the wait
    head = H.header_parts(m, T0 + 5.0)
    assert head[-1] == "ready in 32.0s"
    assert "done" not in H.snapshot(m, T0 + 5.0)
