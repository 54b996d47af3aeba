"""What the dashboard costs the kernel, next to tqdm.notebook measured in the same kernel.

Starts one real ipykernel (``jupyter_client``) and runs in it, one after the other:

* ``dashboard``:  ``notebook_launcher(work, num_processes=8)`` with the widget dashboard
  (what a notebook gets): each rank runs a ``tqdm`` loop and prints a line per step, at
  ``--rate`` steps a second (default 100) for ``--seconds`` (default 10);
* ``no view``:    the same launch with a view that draws nothing (``NullView``): what the
  launcher itself costs the kernel to read 8 ranks' pipes, for comparison;
* ``text``:       the same launch with ``dashboard="text"`` (rank lines printed to the cell);
* ``quiet``:      2 ranks, a ``tqdm`` bar each and no printing, with the dashboard;
* ``tqdm.notebook``: the peer, no launcher: one such loop run in the kernel itself with
  ``tqdm.notebook.tqdm`` (a widget bar, the lines printed to the cell);
* ``tqdm.notebook bar``: the same loop without printing (the bar alone).

For each it prints the kernel process's CPU time over the run (its ranks are child
processes and are not counted: what is measured is what the kernel, which pumps the
ranks' pipes and draws the dashboard, spends) as a share of one core, and the messages
a front end receives on iopub per second: widget messages (``comm_*``) and the others
(``stream``, ``display_data``...). "steady" leaves out the first ``--warmup`` seconds
(starting 8 ranks) and the last half second; "cell" is the whole cell.

Usage::

    python bench/dashboard.py [--seconds 10] [--rate 100] [--ranks 8] [--only dashboard,text]
                              [--busy N]

Targets (issue 13): the dashboard at most ~20 widget messages a second and at most 3% of a
core for 8 ranks printing 100 lines/s under a tqdm bar -- whatever the load (issue 33):
``--busy N`` runs N spinning processes throughout, the same for every scenario. The load
average is printed with the figures, and the dashboard's steady cost over its peer's
(one ``tqdm.notebook`` loop in the kernel, printing: what a notebook without the launcher
pays for one such loop). Timing varies with machine load: compare figures from one run.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
from jupyter_client.manager import start_new_kernel

WORK = r"""
import time
from tqdm.auto import tqdm
from notebook_launcher import log

def work(seconds, rate, chatty=True, plot=False):
    n = int(seconds * rate)
    t0 = time.perf_counter()
    for i in tqdm(range(n), desc="step"):
        if chatty:
            print(f"step {i} loss {1.0 / (i + 1):.4f}", flush=True)
        if plot:
            log({"loss": 1.0 / (i + 1), "lr": 1e-3}, step=i)
        delay = t0 + (i + 1) / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    return n
"""

WARMUP = """
from notebook_launcher import notebook_launcher
notebook_launcher(work, args=(0.2, 20, False), num_processes=2, dashboard=False)
"""

SCENARIOS = {
    "no view": (
        "from notebook_launcher.ui import NullView\n"
        "notebook_launcher(work, args=({s}, {r}), num_processes={n}, dashboard=NullView())"
    ),
    "dashboard": "notebook_launcher(work, args=({s}, {r}), num_processes={n})",
    "text": "notebook_launcher(work, args=({s}, {r}), num_processes={n}, dashboard='text')",
    "plot": "notebook_launcher(work, args=({s}, {r}, True, True), num_processes={n})",
    "quiet": "notebook_launcher(work, args=({s}, {r}, False), num_processes=2)",
    "tqdm.notebook": (
        "import tqdm.notebook as _tn\n"
        "globals()['tqdm'] = _tn.tqdm\n"
        "work({s}, {r})\n"
        "from tqdm.auto import tqdm"
    ),
    "tqdm.notebook bar": (
        "import tqdm.notebook as _tn\nglobals()['tqdm'] = _tn.tqdm\nwork({s}, {r}, False)\n"
        "from tqdm.auto import tqdm"
    ),
}
WIDGET = ("comm_open", "comm_msg", "comm_close")
#: The scenarios that start ranks (their first ``--warmup`` seconds are left out of "steady").
WARMED = ("no view", "dashboard", "text", "quiet", "plot")
SKIP = ("status", "execute_input", "execute_result", "error")


@dataclass
class Run:
    name: str
    t0: float = 0.0
    t1: float = 0.0
    cpu: list[tuple[float, float]] = field(default_factory=list)  # (time, cpu seconds)
    msgs: list[tuple[float, str]] = field(default_factory=list)  # (time, msg_type)
    #: (time, comm id, state) of every widget message: what the plot-lag figures read
    comms: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)
    error: str = ""

    def cpu_between(self, a: float, b: float) -> float:
        inside = [(t, c) for t, c in self.cpu if a <= t <= b]
        if len(inside) < 2:
            return float("nan")
        (ta, ca), (tb, cb) = inside[0], inside[-1]
        return (cb - ca) / (tb - ta)

    def rate(self, a: float, b: float, types: tuple[str, ...], widget: bool) -> float:
        n = sum(
            1
            for t, k in self.msgs
            if a <= t <= b and ((k in types) if widget else (k not in types))
        )
        return n / (b - a)


def _sampler(proc: psutil.Process, run: Run, stop: threading.Event) -> None:
    while not stop.is_set():
        times = proc.cpu_times()
        run.cpu.append((time.monotonic(), times.user + times.system))
        stop.wait(0.1)


def _execute(kc: Any, code: str, run: Run | None = None, timeout: float = 300) -> str:
    msg_id = kc.execute(code)
    deadline = time.monotonic() + timeout
    error = ""
    while time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind = msg["msg_type"]
        if run is not None and kind not in SKIP:
            run.msgs.append((time.monotonic(), kind))
            if kind in ("comm_open", "comm_msg"):
                data = msg["content"].get("data", {})
                state = dict(data.get("state", {}))
                for path in data.get("buffer_paths", ()):
                    state[path[0]] = b""  # a binary value (the PNG), not read here
                run.comms.append((time.monotonic(), msg["content"]["comm_id"], state))
        if kind == "error":
            error = "\n".join(msg["content"]["traceback"][-3:])
        if kind == "status" and msg["content"]["execution_state"] == "idle":
            return error
    raise TimeoutError(code)


COUNTS = re.compile(r"(\d+)/\d+ \[\d+%\]")
PLOT_STEP = re.compile(r"data-step='(\d+)'")


def plot_lag(run: Run, a: float, b: float, rate: float) -> dict[str, float]:
    """How far the live plot is behind the bars, in seconds of training.

    Sampled every 0.1 s between ``a`` and ``b``: the step the rank table shows (rank 0's
    bar) minus the step the plot shows, divided by the steps per second. The plot's step
    is the ``data-step`` the live SVG carries; a PNG carries none, so it is taken as the
    bars' step when that PNG was sent (what it was drawn from). ``end``: how far behind
    the plot's last live update was when the bars' last one went out.
    """
    classes: dict[str, set[str]] = {}
    for _, cid, state in run.comms:
        classes.setdefault(cid, set()).update(state.get("_dom_classes", ()))
    bars = [
        (t, int(m.group(1)))
        for t, cid, state in run.comms
        if "nl-ranks" in classes[cid] and isinstance(state.get("value"), str)
        for m in [COUNTS.search(state["value"])]
        if m
    ]
    if not bars:
        return {}

    def bar_step(t: float) -> int:
        return max((s for u, s in bars if u <= t), default=0)

    plots = []
    for t, cid, state in run.comms:
        if "nl-plot" in classes[cid] and "value" in state:
            value = state["value"]
            m = PLOT_STEP.findall(value) if isinstance(value, str) else []
            plots.append((t, max(map(int, m)) if m else bar_step(t)))
    if not plots:
        return {}

    def plot_step(t: float) -> int:
        return max((s for u, s in plots if u <= t), default=0)

    grid = [a + 0.1 * i for i in range(int((b - a) / 0.1))]
    lags = [(bar_step(t) - plot_step(t)) / rate for t in grid]
    end = bars[-1][0]
    return {
        "median": statistics.median(lags) if lags else float("nan"),
        "max": max(lags, default=float("nan")),
        "end": (bar_step(end) - plot_step(end)) / rate,
        "updates/s": sum(1 for u, _ in plots if a <= u <= b) / (b - a),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=100.0, help="steps (lines) per second")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--warmup", type=float, default=2.5)
    parser.add_argument("--only", default=",".join(SCENARIOS))
    parser.add_argument("--busy", type=int, default=0, help="spinning processes (a load)")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)
    ]
    try:
        measured = _measure(args, env)
    finally:
        load_after = os.getloadavg()[0]
        for p in spinners:
            p.kill()
            p.wait()
    runs, load = measured
    _report(args, runs, load, load_after)


def _measure(args: argparse.Namespace, env: dict[str, str]) -> tuple[list[Run], float]:
    km, kc = start_new_kernel(kernel_name="python3", env=env)
    runs: list[Run] = []
    load = os.getloadavg()[0]
    try:
        pid = km.provisioner.process.pid  # type: ignore[union-attr]
        proc = psutil.Process(pid)
        for code in (WORK, WARMUP):
            if error := _execute(kc, code):
                raise RuntimeError(error)
        for name in args.only.split(","):
            code = SCENARIOS[name].format(s=args.seconds, r=args.rate, n=args.ranks)
            run = Run(name)
            stop = threading.Event()
            sampler = threading.Thread(target=_sampler, args=(proc, run, stop), daemon=True)
            sampler.start()
            run.t0 = time.monotonic()
            run.error = _execute(kc, code, run)
            run.t1 = time.monotonic()
            stop.set()
            sampler.join()
            runs.append(run)
            time.sleep(0.5)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return runs, load


def _report(args: argparse.Namespace, runs: list[Run], load: float, load_after: float) -> None:
    print(
        f"{args.ranks} ranks x {args.rate:g} lines/s under a tqdm bar, {args.seconds:g} s "
        f"(quiet: 2 ranks, bar only); kernel pid CPU, one core = 100%; {args.busy} spinning "
        f"processes, load average {load:.1f} -> {load_after:.1f} on {os.cpu_count()} cores"
    )
    head = f"{'':18} {'kernel CPU':>21} {'widget msgs/s':>21} {'other msgs/s':>13}"
    print(head)
    print(f"{'':18} {'steady':>10} {'cell':>10} {'steady':>10} {'cell':>10} {'steady':>13}")
    for run in runs:
        a, b = (
            run.t0 + (args.warmup if run.name in WARMED else 0.5),
            run.t1 - 0.5,
        )
        cells = (
            100 * run.cpu_between(a, b),
            100 * run.cpu_between(run.t0, run.t1),
            run.rate(a, b, WIDGET, True),
            run.rate(run.t0, run.t1, WIDGET, True),
            run.rate(a, b, WIDGET, False),
        )
        line = f"{run.name:18} {cells[0]:9.1f}% {cells[1]:9.1f}% {cells[2]:10.1f} {cells[3]:10.1f} {cells[4]:13.1f}"
        print(line + (f"   ERROR {run.error[-200:]}" if run.error else ""))
    steady = {
        run.name: 100
        * run.cpu_between(run.t0 + (args.warmup if run.name in WARMED else 0.5), run.t1 - 0.5)
        for run in runs
    }
    if "dashboard" in steady and "tqdm.notebook" in steady:
        ours, peer = steady["dashboard"], steady["tqdm.notebook"]
        print(
            f"dashboard ({args.ranks} ranks) {ours:.1f}% | tqdm.notebook (one loop) {peer:.1f}% | "
            f"ratio {ours / peer:.2f}x; target <= 3% whatever the load"
        )
    for run in runs:
        if run.name == "plot":
            a, b = run.t0 + args.warmup, run.t1 - 0.5
            lag = plot_lag(run, a, b, args.rate)
            print(
                "plot lag behind the bars (s of training): "
                + ", ".join(f"{k} {v:.2f}" for k, v in lag.items())
            )


if __name__ == "__main__":
    main()
