"""The text view: rank-prefixed lines, periodic progress, final lines, the summary."""

from __future__ import annotations

import io

import pytest

from notebook_launcher._events import (
    BarrierEnter,
    BarrierExit,
    Event,
    LaunchFinished,
    MetricsLogged,
    Output,
    WorkerFinished,
    WorkerStarted,
)
from notebook_launcher.ui.text import TextView

from .test_ui_model import T0, bar, script, started

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def render(events: list[Event], **kw: object) -> str:
    buf = io.StringIO()
    clock = Clock()
    view = TextView(buf, clock=clock, **kw)  # type: ignore[arg-type]
    for e in events:
        clock.t = max(clock.t, e.time)
        view.handle(e)
        view.tick()
    view.close()
    return buf.getvalue()


def test_successful_run() -> None:
    out = render(script(2), interval=2.0)
    assert out.splitlines() == [
        "notebook_launcher: 2 ranks, fork (cpu only), gloo on 127.0.0.1:29500",
        "[rank0] hello from 0",
        # the fake clock jumps to each event's time: rank 0's events cross the interval
        "[rank0] running 2.9s | epoch 2/3 [66%] 1.0it/s eta 1.0s | step 10/30 [33%] ?it/s",
        "[rank0] epoch: 3/3 [100%] 1.0it/s in 3.0s",
        "[rank1] hello from 1",
        "[rank1] epoch: 3/3 [100%] 1.0it/s in 3.0s",
        # rank 0 entered at +5, rank 1 at +6, both left at +8: only rank 1 waited >= 2 s
        # between two events
        "[rank1] waiting at train.py:12 for 2.0s (barrier #0: all arrived)",
        "notebook_launcher: 2 ranks, 10.0s: ok",
    ]
    assert "\r" not in out and "\x1b" not in out


def test_failed_run_names_the_rank_and_the_barrier_it_left() -> None:
    lines = render(script(2, fail_rank=1), interval=100.0).splitlines()
    assert lines[-4:] == [
        "[rank1] raised ValueError: boom",
        "[rank0] stopped: rank 1 failed",
        # shown once it held alert_delay (1 s), or at the end as here
        "notebook_launcher: rank 1 raised ValueError while rank(s) 0 waited at barrier #0 (train.py:12)",
        "notebook_launcher: 2 ranks, 10.0s: failed: rank 1 raised ValueError: boom",
    ]


def test_progress_lines_are_periodic_per_rank() -> None:
    ev: list[Event] = [started(2)]
    for i in range(1, 101):  # 10 s of updates on both ranks, 10 per second
        for r in (0, 1):
            ev.append(
                bar(r, 0, i, 100, i / 10, desc="train", elapsed=i / 10, rate=10.0, closed=i == 100)
            )
    out = render(ev, interval=3.0)
    per_rank = {r: [ln for ln in out.splitlines() if ln.startswith(f"[rank{r}]")] for r in (0, 1)}
    assert per_rank[0] == [  # first bar event at 0.1 s, then every 3 s
        "[rank0] running | train 31/100 [31%] 10.0it/s eta 6.9s",
        "[rank0] running | train 61/100 [61%] 10.0it/s eta 3.9s",
        "[rank0] running | train 91/100 [91%] 10.0it/s eta 0.9s",
        "[rank0] train: 100/100 [100%] 10.0it/s in 10.0s",
    ]
    assert [ln.split(" | ")[1] for ln in per_rank[1][:3]] == [
        "train 31/100 [31%] 10.0it/s eta 6.9s",
        "train 61/100 [61%] 10.0it/s eta 3.9s",
        "train 91/100 [91%] 10.0it/s eta 0.9s",
    ]


def test_waiting_rank_reports_who_is_missing() -> None:
    buf = io.StringIO()
    clock = Clock()
    view = TextView(buf, clock=clock, interval=5.0)
    for e in [
        started(3),
        *[WorkerStarted(rank=r, local_rank=r, pid=r, device="cpu", time=T0) for r in range(3)],
    ]:
        view.handle(e)
    view.handle(
        BarrierEnter(rank=0, index=4, location="nb.py:7", kind="wait_for_everyone", time=T0)
    )
    clock.t = T0 + 1
    view.handle(
        BarrierEnter(rank=2, index=4, location="nb.py:7", kind="wait_for_everyone", time=T0 + 1)
    )
    for t in range(2, 12):
        clock.t = T0 + t
        view.tick()
    assert buf.getvalue().splitlines()[1:] == [
        "[rank0] waiting at nb.py:7 for 5.0s (barrier #4: missing rank 1)",
        "[rank2] waiting at nb.py:7 for 5.0s (barrier #4: missing rank 1)",
        "[rank0] waiting at nb.py:7 for 10.0s (barrier #4: missing rank 1)",
        "[rank2] waiting at nb.py:7 for 10.0s (barrier #4: missing rank 1)",
    ]


def test_dashboard_false_prints_only_output_and_summary() -> None:
    out = render(script(2, fail_rank=0), progress=False)
    assert out.splitlines() == [
        "[rank0] hello from 0",
        "[rank1] hello from 1",
        "notebook_launcher: 2 ranks, 10.0s: failed: rank 0 raised ValueError: boom",
    ]


def test_stderr_lines_go_to_stderr_and_tails_are_kept(capsys: pytest.CaptureFixture[str]) -> None:
    view = TextView(progress=False)
    view.handle(started(2))
    view.handle(Output(rank=0, stream="stdout", text="out \x1b[1mbold\x1b[0m\n", time=T0))
    view.handle(Output(rank=1, stream="stderr", text="err 1%\r100%\n", time=T0))
    view.handle(Output(rank=0, stream="stdout", text="a\nb\n", time=T0))
    view.handle(Output(rank=1, stream="stdout", text="no newline", time=T0))
    view.handle(Output(rank=1, stream="stderr", text="half", time=T0))
    view.close()
    view.close()  # idempotent
    captured = capsys.readouterr()
    assert captured.out == "[rank0] out bold\n[rank0] a\n[rank0] b\n[rank1] no newline\n"
    assert captured.err == "[rank1] 100%\n[rank1] half\n"


def test_alert_waits_out_a_race_and_then_shows() -> None:
    buf = io.StringIO()
    clock = Clock()
    view = TextView(buf, clock=clock, alert_delay=1.0)
    for e in [
        started(2),
        *[WorkerStarted(rank=r, local_rank=r, pid=r, device="cpu", time=T0) for r in (0, 1)],
    ]:
        view.handle(e)
    view.handle(BarrierEnter(rank=0, index=0, location="a.py:1", kind="wait_for_everyone", time=T0))
    view.handle(WorkerFinished(rank=1, time=T0 + 0.1))  # raced ahead of rank 0's exit
    clock.t = T0 + 0.5
    view.tick()
    view.handle(BarrierExit(rank=0, index=0, location="a.py:1", time=T0 + 0.05))
    clock.t = T0 + 3
    view.tick()
    assert "left" not in buf.getvalue() and "returned while" not in buf.getvalue()
    view.handle(
        BarrierEnter(rank=0, index=1, location="a.py:2", kind="wait_for_everyone", time=T0 + 3)
    )
    clock.t = T0 + 3.5
    view.tick()
    assert "returned while" not in buf.getvalue()
    clock.t = T0 + 4.1
    view.tick()
    assert buf.getvalue().splitlines()[-1] == (
        "notebook_launcher: rank 1 returned while rank(s) 0 waited at barrier #1 (a.py:2)"
    )


def test_transient_lines_are_written_once_committed_and_metrics_at_the_end() -> None:
    buf = io.StringIO()
    view = TextView(buf, clock=lambda: T0)
    view.handle(started(2))
    for text in ("\r", " 10%|#  |\r", " 90%|## |\r", "100%|###|\n"):
        view.handle(Output(rank=0, stream="stdout", text=text, time=T0))
    for step in range(3):
        for r in (0, 1):
            view.handle(MetricsLogged(r, step, (("loss", 1.0 / (1 + step + r)),), T0))
    view.handle(
        LaunchFinished(ok=True, summary="ok", root_cause_rank=None, wall_time=1.0, time=T0 + 1)
    )
    view.close()
    assert buf.getvalue().splitlines()[1:] == [
        "[rank0] 100%|###|",
        "notebook_launcher: loss (step 2): rank 0 0.333, rank 1 0.25",
        "notebook_launcher: 2 ranks, 1.0s: ok",
    ]


def test_restarts_and_the_line_prefix_template() -> None:
    from notebook_launcher._events import LaunchRestarting, LaunchStarted, WorkerExited

    first = started(2)
    templated = LaunchStarted(**{**first.__dict__, "log_line_prefix_template": "${rank}>"})
    out = render(
        [
            templated,
            Output(1, "stdout", "hi\n", T0),
            WorkerExited(1, 101, -9, "SIGKILL", T0 + 1),
            LaunchRestarting(1, 2, "rank 1 (pid 101) died: killed by SIGKILL(-9)", T0 + 1),
            Output(1, "stdout", "again\n", T0 + 2),
            LaunchFinished(True, "all 2 ranks finished", None, 3.0, T0 + 3, restarts=1),
        ],
        progress=False,
    )
    assert out.splitlines() == [
        "1> hi",
        "notebook_launcher: restart 1 of 2 (rank 1 (pid 101) died: killed by SIGKILL(-9))",
        "1> again",
        "notebook_launcher: 2 ranks, 3.0s, 1 restart: ok",
    ]


def test_a_session_task_is_named_by_its_task() -> None:
    import dataclasses

    task = dataclasses.replace(started(2), task="task 3: run_cell")
    out = render([task, LaunchFinished(True, "ok", None, 1.0, T0 + 1)])
    assert out.splitlines()[0] == "notebook_launcher: session task 3: run_cell, 2 of 2 ranks"


def cluster_launch() -> list[Event]:
    """What a launch on a cluster of two nodes (n1, n2) x 2 ranks sends the view."""
    from dataclasses import replace

    from notebook_launcher._events import NodesWaiting

    start = replace(
        started(2),
        world_size=4,
        local_world_size=4,
        node_rank=-1,
        num_nodes=2,
        start_method="agent",
        start_reason="2 nodes (n1, n2), 2 ranks each",
        ranks=(0, 1, 2, 3),
        hosts=("n1", "n1", "n2", "n2"),
    )
    return [
        NodesWaiting("Slurm job 12, 2 node(s)", "PENDING (Resources)", 0, 2, T0 - 5),
        NodesWaiting("Slurm job 12, 2 node(s)", "RUNNING", 1, 2, T0 - 1),
        start,
        *(WorkerStarted(r, r % 2, 100 + r, "cpu", T0 + 0.1) for r in range(4)),
        Output(3, "stdout", "hello from n2\n", T0 + 0.2),
        *(WorkerFinished(r, T0 + 1) for r in range(4)),
        LaunchFinished(True, "all 4 ranks finished", None, 6.0, T0 + 1),
    ]


def test_a_cluster_launch_names_the_job_nodes_and_hosts() -> None:
    lines = render(cluster_launch(), interval=100.0).splitlines()
    assert lines[:4] == [
        "notebook_launcher: waiting for Slurm job 12, 2 node(s): PENDING (Resources), 0/2 agents joined",
        "notebook_launcher: waiting for Slurm job 12, 2 node(s): RUNNING, 1/2 agents joined",
        "notebook_launcher: 4 ranks, agent (2 nodes (n1, n2), 2 ranks each), gloo on 127.0.0.1:29500",
        "[n2:rank3] hello from n2",  # output labelled with the node and the rank
    ]
    assert lines[-1] == "notebook_launcher: 4 ranks, 6.0s: ok"


def test_a_cluster_launchs_dashboard_groups_ranks_by_node_with_hosts() -> None:
    from notebook_launcher.ui import html
    from notebook_launcher.ui.model import LaunchModel

    model = LaunchModel()
    for event in cluster_launch()[:4]:
        model.apply(event)
    assert model.nodes() == {0: [0, 1], 1: [2, 3]}
    page = html.ranks_html(model, T0 + 1)
    assert "node 0 (n1)" in page and "node 1 (n2)" in page
    assert page.count("class='nl-host'") == 4
    head = " · ".join(html.header_parts(model, T0 + 1))
    assert "node -1" not in head and "agent: 2 nodes (n1, n2), 2 ranks each" in head, head
    waiting = LaunchModel()
    waiting.apply(cluster_launch()[0])
    assert "waiting for Slurm job 12, 2 node(s): PENDING (Resources), 0/2 agents joined" in (
        " · ".join(html.header_parts(waiting, T0))
    )
