"""Launch overhead and failure latency, against peers measured in the same run.

    python bench/launch.py [--reps 20] [--busy N] [--launch-only]

Prints, for 2 CPU workers running a trivial function with one barrier (warm):
  * notebook_launcher (fork)         vs hand-written torch.multiprocessing (fork) + gloo
  * notebook_launcher (forkserver)   vs hand-written torch.multiprocessing (spawn) + gloo
  * Accelerate's notebook_launcher, when it is installed
  * the fork pair again on a loaded machine: ``--busy N`` processes that spin (default:
    twice the cores), started by this bench for that row only, the same for both sides
    (issue 33: ours lost more to contention than the hand-written launch did; target
    <= 1.0x under load), with the CPU time each launch costs (kernel and ranks together,
    from ``getrusage``) -- what a loaded machine makes a launch wait for
the time from a rank raising to the exception reaching the caller, and from Ctrl-C
(SIGINT to the kernel alone, one rank stuck in a C++ barrier) to KeyboardInterrupt with
every rank gone; and the failure latency of each hard-to-carry failure and each pickling
stage of the crash table (``--failures-only`` measures just these). Targets (issue 2):
fork launch <= 1.2x the hand-written fork baseline; failure <= 0.3 s; interrupt <= 1 s.
The machine's load average is printed with the figures: compare figures from one run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch.distributed as dist
import torch.multiprocessing as tmp

from notebook_launcher import notebook_launcher
from notebook_launcher._launch import forkserver
from notebook_launcher.ui import NullView


def trivial() -> int:
    dist.barrier()
    return dist.get_rank()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _handwritten_worker(rank: int, world: int, port: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    dist.barrier()
    dist.destroy_process_group()


def handwritten(method: str) -> None:
    tmp.start_processes(
        _handwritten_worker, args=(2, _free_port()), nprocs=2, start_method=method, join=True
    )


def ours(method: str) -> None:
    notebook_launcher(trivial, (), 2, start_method=method, use_port="auto", dashboard=NullView())


def trivial_accelerate() -> int:
    # Accelerate's workers only get a process group once its state is created.
    from accelerate import PartialState  # type: ignore[import-not-found]

    state = PartialState()
    state.wait_for_everyone()
    return int(state.num_processes)


def accelerate_launch() -> None:
    import signal

    from accelerate import notebook_launcher as acc_launcher  # type: ignore[import-not-found]

    # Accelerate (torch elastic underneath) replaces the kernel's SIGINT/SIGTERM handlers
    # and leaves them replaced: Ctrl-C then raises SignalException, not KeyboardInterrupt.
    # Put them back so the rest of this benchmark measures what a user would see.
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        acc_launcher(trivial_accelerate, (), num_processes=2, use_port=str(_free_port()))
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


Contender = tuple[Callable[..., None], tuple[object, ...]]


def timeit(contenders: list[Contender], reps: int) -> list[float]:
    """Median seconds per call of each contender, interleaved so that load on a shared
    machine falls on all of them alike."""
    for fn, args in contenders:
        fn(*args)  # warm: imports, forkserver start, page cache
    times: list[list[float]] = [[] for _ in contenders]
    for rep in range(reps):
        order = list(range(len(contenders)))
        if rep % 2:
            order.reverse()
        for i in order:
            fn, args = contenders[i]
            t = time.perf_counter()
            fn(*args)
            times[i].append(time.perf_counter() - t)
    return [statistics.median(t) for t in times]


@contextlib.contextmanager
def busy(n: int) -> Iterator[None]:
    """``n`` processes that spin (a loaded machine) while the block runs."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)  # (they are running)
        yield
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()


def cpu_per_call(fn: Callable[..., None], args: tuple[object, ...], reps: int) -> float:
    """CPU seconds one call costs this process and the children it waited for."""

    def used() -> float:
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    before = used()
    for _ in range(reps):
        fn(*args)
    return (used() - before) / reps


def raise_at(path: str) -> None:
    if dist.get_rank() == 1:
        time.sleep(0.05)
        with open(path, "w") as f:
            f.write(repr(time.time()))
        raise ValueError("measured failure")
    dist.barrier()


def failure_latency(method: str, reps: int) -> float:
    path = f"/tmp/nl_bench_raise_{os.getpid()}"
    lat = []
    for _ in range(reps):
        try:
            notebook_launcher(raise_at, (path,), 2, start_method=method, dashboard=NullView())
        except ValueError:
            caught = time.time()
        with open(path) as f:
            lat.append(caught - float(f.read()))
    os.unlink(path)
    return statistics.median(lat)


# --- the crash table's hard cases and pickling stages (issue 10, items 1, 11, 15) ---------


def _mark(path: str) -> None:
    with open(path, "w") as f:
        f.write(repr(time.time()))


class BenchError(Exception):
    """Defined in the script's __main__, like a class defined in a notebook cell."""


class NeedsTwo(Exception):
    def __init__(self, a: int, b: str) -> None:
        super().__init__(f"{a} and {b}")


class BadStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


class HoldsLock(Exception):
    def __init__(self) -> None:
        super().__init__("carries a lock")
        import threading

        self.lock = threading.Lock()


def _only_in_ranks() -> object:
    if "RANK" not in os.environ:
        raise RuntimeError("loads only in the ranks")
    return OnlyInRanks()


class OnlyInRanks:
    def __reduce__(self) -> tuple[object, ...]:
        return (_only_in_ranks, ())


class CarriesRankOnly(Exception):
    def __init__(self) -> None:
        super().__init__("cannot come back")
        self.payload = OnlyInRanks()


def _fails_in_rank_1(path: str) -> object:
    if os.environ.get("RANK") == "1":
        _mark(path)
        raise RuntimeError("loads only in the kernel")
    return None


class FailsInRank1:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:
        return (_fails_in_rank_1, (self.path,))


def hard_failure(kind: str, path: str, payload: object = None) -> object:
    if dist.get_rank() != 1:
        if kind == "result unpickles only in ranks":
            return 0
        dist.barrier()
        return 0
    time.sleep(0.05)
    if kind == "result unpickles only in ranks":
        _mark(path)
        return OnlyInRanks()
    exc: BaseException = {
        "ValueError (reference)": lambda: ValueError("plain"),
        "notebook class": lambda: BenchError("own class"),
        "__init__ needs 2 args": lambda: NeedsTwo(1, "b"),
        "20 MB message": lambda: ValueError("x" * (20 * 2**20)),
        "str() raises": BadStr,
        "cannot be pickled": HoldsLock,
        "exception unpickles only in ranks": CarriesRankOnly,
    }[kind]()
    _mark(path)
    raise exc


HARD_KINDS = (
    "ValueError (reference)",
    "notebook class",
    "__init__ needs 2 args",
    "20 MB message",
    "str() raises",
    "cannot be pickled",
    "exception unpickles only in ranks",
    "result unpickles only in ranks",
    "task unpickle fails in rank 1",
)


def hard_failure_latency(kind: str, method: str, reps: int) -> float:
    path = f"/tmp/nl_bench_hard_{os.getpid()}"
    lat = []
    for _ in range(reps):
        task = "task" in kind
        args = (kind, path, FailsInRank1(path) if task else None)
        try:
            notebook_launcher(hard_failure, args, 2, start_method=method, dashboard=NullView())
        except Exception:  # noqa: BLE001 - every kind has its own type
            caught = time.time()
        with open(path) as f:
            lat.append(caught - float(f.read()))
    os.unlink(path)
    return statistics.median(lat)


def blocked_in_barrier() -> None:
    if dist.get_rank() == 0:
        time.sleep(60)  # Python code: SIGINT raises here...
    dist.barrier()  # ...but not in rank 1, inside a C++ collective: the launcher escalates


def interrupt_latency(method: str, reps: int) -> float:
    """SIGINT to the kernel alone -> KeyboardInterrupt in the caller, all ranks gone."""
    import signal
    import threading

    lat = []
    sent: list[float] = []

    def interrupt() -> None:
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)

    for _ in range(reps):
        timer = threading.Timer(0.5, interrupt)
        timer.start()
        try:
            notebook_launcher(blocked_in_barrier, (), 2, start_method=method, dashboard=NullView())
        except KeyboardInterrupt:
            lat.append(time.perf_counter() - sent[-1])
        timer.join()
    return statistics.median(lat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--failures-only", action="store_true")
    parser.add_argument(
        "--busy", type=int, default=2 * (os.cpu_count() or 1), help="spinners for the loaded row"
    )
    parser.add_argument("--launch-only", action="store_true", help="the launch rows only")
    options = parser.parse_args()
    reps = options.reps
    if options.failures_only:
        hard_failures(reps)
        forkserver.shutdown()
        return
    rows = []
    contenders: list[Contender] = [(ours, ("fork",)), (handwritten, ("fork",))]
    try:
        import accelerate  # type: ignore[import-not-found]  # noqa: F401

        contenders.append((accelerate_launch, ()))
    except ImportError:
        print("(Accelerate not installed: no comparison with it)")
    load = os.getloadavg()[0]
    fork_times = timeit(contenders, reps)
    our_fork = fork_times[0]
    rows.append(("fork: notebook_launcher", our_fork, "hand-written mp fork", fork_times[1]))
    if len(fork_times) > 2:
        rows.append(
            ("fork: notebook_launcher", our_fork, "Accelerate notebook_launcher", fork_times[2])
        )
    our_fs, base_spawn = timeit(
        [(ours, ("forkserver",)), (handwritten, ("spawn",))], max(3, reps // 4)
    )
    rows.append(
        ("CUDA-safe: notebook_launcher forkserver", our_fs, "hand-written spawn", base_spawn)
    )
    print(
        f"launch-to-return, 2 CPU ranks, one barrier, median of {reps} warm runs "
        f"(load average {load:.1f} -> {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores)"
    )
    for name, ours_t, peer, peer_t in rows:
        print(
            f"  {name:42s} {ours_t * 1e3:8.1f} ms | {peer:30s} {peer_t * 1e3:8.1f} ms"
            f" | ratio {ours_t / peer_t:5.2f}x"
        )
    pair: list[Contender] = [(ours, ("fork",)), (handwritten, ("fork",))]
    cpu = [cpu_per_call(fn, args, max(5, reps // 2)) for fn, args in pair]
    print(
        f"  CPU per launch (kernel and ranks): ours {cpu[0] * 1e3:.1f} ms | hand-written "
        f"{cpu[1] * 1e3:.1f} ms | ratio {cpu[0] / cpu[1]:5.2f}x"
    )
    if options.busy:
        with busy(options.busy):
            load = os.getloadavg()[0]
            loaded = timeit(pair, reps)
            load_after = os.getloadavg()[0]
        print(
            f"the same under load: {options.busy} spinning processes on {os.cpu_count()} cores "
            f"(load average {load:.1f} -> {load_after:.1f}), median of {reps}"
        )
        print(
            f"  {'fork: notebook_launcher':42s} {loaded[0] * 1e3:8.1f} ms | "
            f"{'hand-written mp fork':30s} {loaded[1] * 1e3:8.1f} ms | "
            f"ratio {loaded[0] / loaded[1]:5.2f}x (target <= 1.0x)"
        )
    if options.launch_only:
        forkserver.shutdown()
        return
    for method in ("fork", "forkserver"):
        lat = failure_latency(method, max(5, reps // 2))
        print(f"rank raises -> exception in caller ({method}): median {lat * 1e3:.1f} ms")
        lat = interrupt_latency(method, max(3, reps // 4))
        print(f"Ctrl-C -> KeyboardInterrupt, ranks stopped ({method}): median {lat * 1e3:.1f} ms")
    hard_failures(reps)
    forkserver.shutdown()


def hard_failures(reps: int) -> None:
    n = max(5, reps // 2)
    print(f"failure -> exception in caller, median of {n} (spawn: 3), ms")
    methods = ("fork", "forkserver", "spawn")
    print(f"  {'':36s}" + "".join(f"{m:>12s}" for m in methods))
    for kind in HARD_KINDS:
        cells = []
        for method in methods:
            if method == "fork" and "task" in kind:
                cells.append(f"{'n/a':>12s}")  # fork inherits the task: nothing to unpickle
                continue
            lat = hard_failure_latency(kind, method, 3 if method == "spawn" else n)
            cells.append(f"{lat * 1e3:12.1f}")
        print(f"  {kind:36s}" + "".join(cells))


if __name__ == "__main__":
    main()
