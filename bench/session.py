"""What a session costs, against its peers measured in the same run (issue 11).

    python bench/session.py [--reps 200] [--idle 10] [--skip-peers]
    python bench/session.py --compare-only [--compare-reps 5] [--before 57bffc6]

Prints, for 2 CPU ranks and a trivial function (warm, median of ``--reps`` calls,
interleaved with the peers so that load falls on all alike):

* ``session.run(noop)``: one round trip to persistent ranks (target <= 5 ms);
* a fresh ``notebook_launcher`` launch (fork, no view) of the same function;
* Accelerate's ``notebook_launcher``, when installed (a fresh launch too);
* loky's reusable executor (2 workers) and ipyparallel (2 engines, ``view.apply_sync``),
  when installed (``pip install loky ipyparallel``: not dependencies of ours; a peer that
  is missing is skipped with a message);

with the ratio of each to ``session.run``. Then, in one real ipykernel (jupyter_client):

* a trivial ``%%distributed`` cell (``1``), timed inside the kernel around
  ``run_cell`` (IPython's own cell machinery, the magic, the session's round trip and
  the display of the value; target <= 10 ms), split into the session round trip and the
  rest, and as the client sees it (execute_request to reply, over zmq);
* the kernel's CPU time over ``--idle`` seconds of an idle session (target ~0), next to
  the same kernel idle with no session, and the ranks' own CPU over those seconds.

And ``session.compare`` of a 1,000,000-entry dict (issue 33, item 9: 16 s at 57bffc6; target
<= 2 s), identical on both ranks and with one entry that differs (three rounds: digests,
the differing group's entries, the differing entry's values), next to the peers a user
could write by hand in the same session: each rank hashes its pickle and the kernel
compares the hashes (says only "same or not", and depends on the dict's order), and
pulling both dicts into the kernel to compare them with ``==``. ``--before REF``: the
ranks' side of ``compare`` as it was at git revision REF as well, interleaved with ours
(before/after in one run). The machine's load average is printed with the figures.

Timing varies with machine load: compare figures from one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import notebook_launcher
from notebook_launcher import notebook_launcher as launch
from notebook_launcher._launch import forkserver
from notebook_launcher.ui import NullView

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def noop() -> int:
    return 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timeit(contenders: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds per call of each, interleaved (alternating order)."""
    for fn in contenders.values():
        fn()  # warm
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for rep in range(reps):
        for name in names if rep % 2 else reversed(names):
            t = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(t) for name, t in times.items()}


# --- peers -----------------------------------------------------------------------------------


def accelerate_launch() -> Callable[[], object] | str:
    try:
        from accelerate import notebook_launcher as acc_launcher  # type: ignore[import-not-found]
    except ImportError:
        return "accelerate is not installed"

    def run() -> None:
        # Accelerate leaves its SIGINT/SIGTERM handlers in place: restore ours.
        saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            acc_launcher(noop, (), num_processes=2, use_port=str(_free_port()))
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)

    return run


def loky_executor() -> tuple[Callable[[], object], Callable[[], None]] | str:
    try:
        from loky import get_reusable_executor  # type: ignore[import-not-found]
    except ImportError:
        return "loky is not installed (pip install loky)"
    executor = get_reusable_executor(max_workers=2, timeout=600)

    def run() -> list[int]:  # two calls on the 2-worker pool
        return [f.result() for f in [executor.submit(noop) for _ in range(2)]]

    return run, lambda: executor.shutdown(wait=True, kill_workers=True)


def ipyparallel_engines() -> tuple[Callable[[], object], Callable[[], None]] | str:
    try:
        import ipyparallel as ipp  # type: ignore[import-not-found]
    except ImportError:
        return "ipyparallel is not installed (pip install ipyparallel)"
    try:
        cluster = ipp.Cluster(n=2, log_level=40)
        client = cluster.start_and_connect_sync(activate=False)
        client.wait_for_engines(2, timeout=60)
    except Exception as exc:  # noqa: BLE001 - a peer that cannot start is skipped
        return f"ipyparallel could not start 2 engines: {exc!r}"
    view = client[:]

    def run() -> list[int]:
        return view.apply_sync(noop)

    def stop() -> None:
        client.close()
        cluster.stop_cluster_sync()

    return run, stop


# --- compare ---------------------------------------------------------------------------------

HUGE = """
huge = {i: i for i in range(1_000_000)}
one_differs = dict(huge)
if rank == 1:
    one_differs[123_456] = -1
import hashlib as _hashlib, pickle as _pickle
"""


class Before:
    """``session.compare`` as it was at git revision ``ref``: both its sides (the ranks'
    ``_worker.compare`` and the kernel's ``_launch.compare``) loaded beside ours, before the
    ranks are forked so that they have them too, and its rounds as ``Session.compare`` ran
    them then (the whole's round is new: at 57bffc6 a large value came as its groups)."""

    def __init__(self, ref: str) -> None:
        self.ref = ref
        self.ranks = self._load(ref, "_worker", "compare")
        self.kernel = self._load(ref, "_launch", "compare")

    @staticmethod
    def _load(ref: str, package: str, module: str) -> ModuleType:
        source = subprocess.run(
            ["git", "show", f"{ref}:notebook_launcher/{package}/{module}.py"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        name = f"notebook_launcher.{package}._{module}_before"
        path = os.path.join(tempfile.mkdtemp(prefix="nl-bench-"), f"_{module}_before.py")
        with open(path, "w") as f:
            f.write(source)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[name] = loaded
        spec.loader.exec_module(loaded)
        return loaded

    def compare(self, session: notebook_launcher.Session, name: str) -> Any:
        ranks, kernel = self.ranks, self.kernel
        asked = sorted(range(session.status().world_size))
        rows = session.run(ranks.digests, [name], ranks=asked)
        found = kernel.compare(dict(zip(asked, rows, strict=True)), [name])
        groups = kernel.groups_wanted(found)
        if groups:
            rows = session.run(ranks.digests, list(groups), groups, ranks=asked)
            kernel.expand(found, dict(zip(asked, rows, strict=True)))
        want = kernel.wanted(found)
        if want:
            values = session.run(ranks.values, want, ranks=asked)
            kernel.details(found, dict(zip(asked, values, strict=True)))
        return found


def compare_figures(session: notebook_launcher.Session, reps: int, before: Before | None) -> None:
    session.run_cell(HUGE)
    expected = {
        "huge": "huge: identical on ranks 0, 1 (1,000,000 entries)",
        "one_differs": (
            "one_differs: ranks differ in 1 of 1,000,000 entries (999,999 identical)\n"
            "  123456 (123456): rank 1 differs from rank 0 (-1 vs 123456)"
        ),
    }

    def ours(name: str) -> Callable[[], object]:
        def run() -> None:
            said = str(session.compare(name))
            assert said == expected[name], said

        return run

    def theirs(name: str) -> Callable[[], object]:
        def run() -> None:
            assert before is not None
            said = str(before.compare(session, name))
            assert said == expected[name], said

        return run

    def hashed(name: str) -> Callable[[], object]:
        code = f"_hashlib.blake2b(_pickle.dumps({name})).hexdigest()"
        return lambda: len(set(session.run_cell(code))) == 1

    def pulled(name: str) -> Callable[[], object]:
        def run() -> bool:
            first, *others = session.pull(name)
            return all(first == other for other in others)

        return run

    for name, what in (("huge", "identical"), ("one_differs", "one entry differs")):
        contenders: dict[str, Callable[[], object]] = {
            f'session.compare("{name}") (ours)': ours(name)
        }
        if before is not None:
            contenders[f"the same at {before.ref}"] = theirs(name)
        contenders["each rank hashes its pickle (by hand)"] = hashed(name)
        contenders["pull both, == in the kernel (by hand)"] = pulled(name)
        load = os.getloadavg()[0]
        times = timeit(contenders, reps)
        print(
            f"compare a 1,000,000-entry dict on 2 ranks, {what}; median of {reps} "
            f"(load average {load:.1f} -> {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores):"
        )
        mine = times[f'session.compare("{name}") (ours)']
        for label, t in times.items():
            note = "(target <= 2 s)" if t is mine else f"ours is {mine / t:5.2f}x this"
            print(f"  {label:44s} {t:8.2f} s   {note}")
    session.run_cell("del huge, one_differs")  # (not kept for the figures that follow)


# --- the kernel ------------------------------------------------------------------------------

IN_KERNEL = """
import statistics, time
import notebook_launcher.ipython_extension as _ext
_ip = get_ipython()
_session = _ext._magics.session
def _noop():
    return 1
def _median(fn, reps):
    for _ in range(5):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)
_cell = _median(lambda: _ip.run_cell("%%distributed\\n1", store_history=False), {reps})
_run = _median(lambda: _session.run(_noop), {reps})
_cell_src = _median(lambda: _session.run_cell("1"), {reps})
print(f"RESULT {{_cell}} {{_run}} {{_cell_src}}")
"""


def _execute(kc, code: str, timeout: float = 120) -> str:  # type: ignore[no-untyped-def]
    msg_id = kc.execute(textwrap.dedent(code))
    out = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            raise RuntimeError("\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    while kc.get_shell_msg(timeout=timeout)["parent_header"].get("msg_id") != msg_id:
        pass
    return "".join(out)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kernel_figures(reps: int, idle: float) -> None:
    from jupyter_client.manager import start_new_kernel

    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=ROOT)
    try:
        pid = km.provisioner.process.pid
        _execute(kc, "%load_ext notebook_launcher\nimport notebook_launcher, torch")
        time.sleep(1.0)
        c0 = _cpu_seconds(pid)
        time.sleep(idle)
        no_session = _cpu_seconds(pid) - c0

        _execute(kc, "%dist start -n 2 --dashboard False")
        pids = "import notebook_launcher.ipython_extension as _e\n"
        pids += "print(*_e._magics.session.status().pids)"
        ranks = [int(p) for p in _execute(kc, pids).split()]
        client_times = []
        for i in range(reps // 4 + 5):
            t = time.perf_counter()
            _execute(kc, "%%distributed\n1")
            if i >= 5:
                client_times.append(time.perf_counter() - t)
        cell, run, run_cell = map(
            float, _execute(kc, IN_KERNEL.format(reps=reps)).split("RESULT ")[1].split()
        )
        time.sleep(1.0)
        c0, r0 = _cpu_seconds(pid), [_cpu_seconds(r) for r in ranks]
        time.sleep(idle)
        with_session = _cpu_seconds(pid) - c0
        rank_cpu = [_cpu_seconds(r) - r0[i] for i, r in enumerate(ranks)]
        _execute(kc, "%dist stop")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)

    print(f"\na trivial %%distributed cell (`1`) in a real ipykernel, median of {reps}:")
    print(
        f"  the cell, timed in the kernel around run_cell     {cell * 1e3:7.2f} ms (target <= 10)"
    )
    print(f"    of which session.run_cell's round trip          {run_cell * 1e3:7.2f} ms")
    print(f"    of which IPython, the magic, the values shown   {(cell - run_cell) * 1e3:7.2f} ms")
    print(f"  session.run(noop) in the kernel                   {run * 1e3:7.2f} ms")
    client = statistics.median(client_times)
    print(f"  as the client sees it (execute -> reply, zmq)     {client * 1e3:7.2f} ms")
    print(f"\nCPU over {idle:.0f} s idle (kernel process; its ranks separately):")
    for name, cpu in (
        ("kernel, no session", no_session),
        ("kernel, an idle 2-rank session", with_session),
        ("the 2 idle ranks", sum(rank_cpu)),
    ):
        print(f"  {name:32s} {cpu * 1e3:7.1f} ms ({cpu / idle:.2%} of a core)")


# --- main ------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200, help="calls per round-trip figure")
    parser.add_argument("--launch-reps", type=int, default=10, help="fresh launches per peer")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idle measured")
    parser.add_argument("--skip-peers", action="store_true", help="session figures only")
    parser.add_argument("--skip-kernel", action="store_true", help="no ipykernel figures")
    parser.add_argument("--compare-only", action="store_true", help="the compare figures only")
    parser.add_argument("--compare-reps", type=int, default=5, help="calls per compare figure")
    parser.add_argument("--before", metavar="REF", help="compare's ranks' side at REF as well")
    args = parser.parse_args()

    before = Before(args.before) if args.before else None
    session = notebook_launcher.start(num_processes=2, dashboard=NullView())
    stops: list[Callable[[], None]] = [session.close]
    try:
        compare_figures(session, args.compare_reps, before)
        if args.compare_only:
            return
        quick: dict[str, Callable[[], object]] = {"session.run (ours)": lambda: session.run(noop)}
        fresh: dict[str, Callable[[], object]] = {
            "session.run (ours)": lambda: session.run(noop),
            "notebook_launcher, a fresh launch (ours)": lambda: launch(
                noop, (), 2, use_port="auto", dashboard=NullView()
            ),
        }
        if not args.skip_peers:
            acc = accelerate_launch()
            if isinstance(acc, str):
                print(f"skipped: {acc}")
            else:
                fresh["Accelerate's notebook_launcher"] = acc
            for name, make in (
                ("loky reusable executor", loky_executor),
                ("ipyparallel, 2 engines", ipyparallel_engines),
            ):
                peer = make()
                if isinstance(peer, str):
                    print(f"skipped: {peer}")
                    continue
                quick[name], stop = peer
                stops.append(stop)
        print(f"2 ranks (workers), a trivial function, warm; median of {args.reps} calls:")
        base = timeit(quick, args.reps)
        ours = base["session.run (ours)"]
        for name, t in base.items():
            note = "(target <= 5 ms)" if t is ours else f"{t / ours:6.1f}x session.run"
            print(f"  {name:44s} {t * 1e3:8.2f} ms   {note}")
        print(f"fresh launches, median of {args.launch_reps} (session.run interleaved):")
        launches = timeit(fresh, args.launch_reps)
        ours = launches["session.run (ours)"]
        for name, t in launches.items():
            if t is not ours:
                print(f"  {name:44s} {t * 1e3:8.2f} ms   {t / ours:6.1f}x session.run")
    finally:
        for stop in reversed(stops):
            stop()
        forkserver.shutdown()
    if not args.skip_kernel:
        kernel_figures(args.reps, args.idle)


if __name__ == "__main__":
    main()
