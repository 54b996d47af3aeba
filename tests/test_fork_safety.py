"""CUDA's fork rules, on a CPU machine: the kernel never poisons, and a poisoned kernel is seen.

A GPU machine's first launches failed twice the same way: something in the kernel called
into CUDA's runtime (``torch.cuda.is_available()`` the first time, the architecture check's
``torch._C._cuda_getArchFlags()`` the second), torch registered its CUDA fork handler, and
every rank forked afterwards raised "Cannot re-initialize CUDA in forked subprocess". CI has
no GPU and the CPU build of torch has no CUDA entry points, so nothing here failed.

Here a fresh interpreter -- the pretend kernel -- runs with torch behaving as a CUDA build
does for fork on a machine with two H100s (``tests/_cuda_site/cuda_emulation.py``: each rule
taken from torch's source, which it names; NVML and the driver are stand-in C libraries, so
torch's own code and ours ask them as they ask the real ones). Every interpreter of that
process tree (the forkserver, a detached run's supervisor, a node's agent, spawned ranks)
is emulated too. A rank on a pretend GPU makes its device current first thing: in a bad
fork that raises torch's own message, exactly as on the GPU machine.

* ``test_every_path_of_a_clean_kernel_forks_ranks_that_can_use_cuda``: launches (fork, one
  rank, ranks sharing a GPU, forkserver, spawn, ``block=False`` with its stacks, a failing
  rank), a session, a detached run and a detached session, the plans, ``%nl_info``, and a
  node's agent on its own: all on the pretend GPUs, the kernel's launches by fork, and at the
  end the kernel has registered no fork handler and initialised nothing. On 57bffc6 the first
  fork launch failed (preflight's ``_cuda_getArchFlags``).
* ``test_a_kernel_that_touched_cuda_launches_from_the_forkserver_and_says_why``: a user's
  cell calls into CUDA first -- ``get_arch_list()``, a bf16 autocast, a pinned DataLoader, a
  raw ``_cuda_getDeviceCount()``, ``is_available()`` without NVML, a library's ``cuInit`` --
  and the next launch starts its ranks from the forkserver, saying why; a ``GradScaler`` does
  not touch CUDA and the launch forks. On 57bffc6 ``get_arch_list()`` (and the others that
  only register the handler) still chose fork, and the ranks failed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "_cuda_site"))
import cuda_emulation

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parents[1]


def _in_emulated_kernel(code: str, tmp_path: Path, timeout: float = 200, **options: object) -> dict:
    """Run ``code`` in a fresh interpreter whose torch behaves as a CUDA build on a machine
    with two H100s; its ``RESULT`` (JSON). On failure, the emulation's log says which
    process poisoned fork or initialised CUDA, and from where."""
    log = tmp_path / "cuda.log"
    env = cuda_emulation.environment(log=log, **options)  # type: ignore[arg-type]
    env.pop("PYTEST_CURRENT_TEST", None)
    env["NOTEBOOK_LAUNCHER_RUNS_DIR"] = str(tmp_path / "runs")
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
        check=False,
    )
    out = done.stdout + done.stderr
    calls = log.read_text() if log.exists() else ""
    assert done.returncode == 0, f"{out[-6000:]}\n--- CUDA calls:\n{_calls(calls)}"
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result = dict(json.loads(line[len("RESULT ") :]))
    result["_calls"] = [json.loads(x) for x in calls.splitlines()]
    result["_out"] = out
    return result


def _calls(text: str) -> str:
    shown = []
    for line in text.splitlines()[:12]:
        call = json.loads(line)
        shown.append(f"{call['what']} in pid {call['pid']} ({call['argv']}):\n{call['stack']}")
    return "\n".join(shown)


PRELUDE = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    import cuda_emulation as emulated
    from notebook_launcher import notebook_launcher as launch, start
    from notebook_launcher._events import LaunchStarted
    from notebook_launcher.ui import NullView

    KERNEL = os.getpid()

    class Keep:
        def __init__(self):
            self.seen = []
        def handle(self, event):
            self.seen.append(event)
        def tick(self):
            pass
        def close(self):
            pass
        def method(self):
            started = [e for e in self.seen if isinstance(e, LaunchStarted)][-1]
            return [started.start_method, started.start_reason]

    def where():
        import torch
        from notebook_launcher import PartialState
        s = PartialState()
        on_gpu = s.device.type == "cuda"
        return [
            s.process_index, str(s.device), torch.cuda.current_device() if on_gpu else None,
            torch.cuda.is_initialized(), emulated.in_bad_fork(),
        ]

    def launched(**options):
        view = Keep()
        out = launch(where, (), options.pop("n", 2), dashboard=view, **options)
        return {"ranks": out, "method": view.method()}
    """
)

ON_TWO_GPUS = [[0, "cuda:0", 0, True, False], [1, "cuda:1", 1, True, False]]


def test_every_path_of_a_clean_kernel_forks_ranks_that_can_use_cuda(tmp_path: Path) -> None:
    r = _in_emulated_kernel(
        """
        import shlex, subprocess
        from notebook_launcher import _placement, AgentCluster
        from notebook_launcher._launch.plan import plan_launch
        from notebook_launcher.ipython_extension import info_lines

        results = {}
        found = _placement.inventory()
        results["inventory"] = [found.source, found.count, found.describe()]
        results["fork"] = launched()
        results["one"] = launched(n=1)
        results["shared"] = launched(n=3)
        results["forkserver"] = launched(start_method="forkserver")
        results["spawn"] = launched(start_method="spawn")

        def boom():
            import torch.distributed as dist
            torch.cuda.set_device(dist.get_rank())
            if dist.get_rank() == 1:
                raise ValueError("rank one fails")
            dist.barrier()
        try:
            launch(boom, (), 2, dashboard=NullView())
        except ValueError as exc:
            results["raised"] = str(exc)

        def nap():
            where()
            time.sleep(30)
        handle = launch(nap, (), 2, block=False, dashboard=NullView())
        time.sleep(2.0)
        results["stacks"] = "nap" in str(handle.stacks())
        handle.cancel()
        try:
            handle.result(30)
        except BaseException as exc:
            results["cancelled"] = type(exc).__name__

        with start(2, dashboard=NullView()) as session:
            results["session"] = session.run(where)
        results["detached"] = launch(where, (), 2, dashboard=NullView(), detach=True).result(90)
        with start(2, dashboard=NullView(), detach=True) as session:
            results["detached_session"] = session.run(where)

        for n in (1, 2, 3):
            plan = plan_launch(where, n, mixed_precision="bf16")
            plan.close()
            results[f"plan{n}"] = [[s.device, s.backend] for s in plan.specs] + [plan.start_method]
        results["info"] = [x for x in info_lines() if x.startswith(("devices", "start method"))]

        # a node's agent (started as the cluster says, as a scheduler would), on its node's
        # two GPUs: it forks their ranks itself
        cluster = AgentCluster(nodes=1, gpus_per_node=2, host="127.0.0.1")
        agents = []
        def report(event):
            if not agents and getattr(event, "state", "").startswith("start an agent"):
                agents.append(subprocess.Popen(shlex.split(cluster.agent_command(0))))
        try:
            cluster.start(report=report)
            results["agent"] = launch(where, (), 2, cluster=cluster, dashboard=NullView())
        finally:
            cluster.close()
            for agent in agents:
                agent.wait(30)

        # what the forkserver and an agent import ahead for their ranks: a module that calls
        # into CUDA's runtime at import is left to the ranks (a probe child and its canary say)
        from notebook_launcher import _posix
        here = os.environ["NOTEBOOK_LAUNCHER_RUNS_DIR"] + "-modules"
        os.makedirs(here)
        with open(f"{here}/nl_touchy.py", "w") as f:
            f.write("import torch; torch.cuda.get_arch_list()")
        with open(f"{here}/nl_clean.py", "w") as f:
            f.write("import torch; torch.cuda.is_available()")
        sys.path.insert(0, here)
        _posix.import_without_cuda(("nl_touchy",))
        _posix.import_without_cuda(("nl_clean",))
        results["imported"] = sorted(n for n in ("nl_touchy", "nl_clean") if n in sys.modules)

        results["kernel"] = [emulated.poisoned_here(), torch.cuda.is_initialized(),
                             _placement.driver_initialized()]
        print("RESULT " + json.dumps(results))
        """,
        tmp_path,
    )
    assert r["inventory"] == ["nvml", 2, "2 GPU(s) (NVIDIA H100 80GB HBM3)"]
    assert r["fork"]["ranks"] == ON_TWO_GPUS and r["fork"]["method"][0] == "fork"
    assert r["fork"]["method"][1].startswith("fast, nothing to pickle")  # (a busy port is said)
    assert r["one"]["ranks"] == [ON_TWO_GPUS[0]] and r["one"]["method"][0] == "fork"
    assert [x[1] for x in r["shared"]["ranks"]] == ["cuda:0", "cuda:1", "cuda:0"]
    assert r["shared"]["method"][0] == "fork"
    assert r["forkserver"]["ranks"] == r["spawn"]["ranks"] == ON_TWO_GPUS
    assert r["raised"] == "rank one fails"
    assert r["stacks"] is True and r["cancelled"] == "CancelledError"
    assert r["session"] == r["detached"] == r["detached_session"] == ON_TWO_GPUS
    assert r["plan1"] == [["cuda:0", "gloo"], "fork"]
    assert r["plan2"] == [["cuda:0", "nccl"], ["cuda:1", "nccl"], "fork"]
    assert r["plan3"] == [["cuda:0", "gloo"], ["cuda:1", "gloo"], ["cuda:0", "gloo"], "fork"]
    assert "2 CUDA device(s): NVIDIA H100" in r["info"][0]
    assert r["info"][1].split()[2:4] == ["fork", "(fast,"]
    assert r["agent"] == ON_TWO_GPUS
    assert r["imported"] == ["nl_clean"]
    # the kernel registered no fork handler and initialised nothing, in all of that
    assert r["kernel"] == [False, False, False]
    kernel_side = [c for c in r["_calls"] if c["rank"] is None and "-c" in c["argv"]]
    assert not [c for c in kernel_side if c["what"] != "torch._C._cuda_getArchFlags"], _calls(
        "\n".join(json.dumps(c) for c in kernel_side)
    )


#: (what a user's cell does in the kernel before launching, what the launch then chose, the
#: reason it gives). Each: torch 2.13's path into CUDA, cited in cuda_emulation's docstring.
TOUCHES = [
    pytest.param(
        "torch.cuda.get_arch_list()",  # Module.cpp: THCPModule_getArchFlags -> poison_fork
        "forkserver",
        "torch's CUDA fork handler is registered here",
        id="get_arch_list",
    ),
    pytest.param(
        "torch._C._cuda_getDeviceCount()",  # poison_fork, and cudaGetDeviceCount's cuInit
        "forkserver",
        "CUDA is initialised in this kernel (its driver, by something other than torch",
        id="raw_getDeviceCount",
    ),
    pytest.param(
        "with torch.autocast('cuda', dtype=torch.bfloat16): pass",  # is_bf16_supported
        "forkserver",
        "CUDA is initialised in this kernel, so fork is unsafe",
        id="bf16_autocast",
    ),
    pytest.param(
        "from torch.utils.data import DataLoader\n"
        "for batch in DataLoader(list(range(8)), batch_size=4, pin_memory=True): pass",
        "forkserver",
        "CUDA is initialised in this kernel (its driver",
        id="pinned_loader",
    ),
    pytest.param(
        "import ctypes; assert ctypes.CDLL('libcuda.so.1').cuInit(0) == 0",  # bitsandbytes...
        "forkserver",
        "CUDA is initialised in this kernel (its driver, by something other than torch",
        id="library_cuInit",
    ),
    pytest.param(
        "torch.amp.GradScaler('cuda'); torch.autocast('cuda')",  # NVML's count only
        "fork",
        "fast, nothing to pickle",
        id="grad_scaler",
    ),
]


@pytest.mark.parametrize(("cell", "method", "reason"), TOUCHES)
def test_a_kernel_that_touched_cuda_launches_from_the_forkserver_and_says_why(
    cell: str, method: str, reason: str, tmp_path: Path
) -> None:
    r = _in_emulated_kernel(
        cell
        + """
results = {"launch": launched()}
try:  # asked for by name, fork is refused with the reason
    launch(where, (), 2, start_method="fork", dashboard=NullView())
    results["fork"] = "ran"
except Exception as exc:
    results["fork"] = f"{type(exc).__name__}: {exc}"
print("RESULT " + json.dumps(results))
""",
        tmp_path,
    )
    assert r["launch"]["ranks"] == ON_TWO_GPUS  # they could use CUDA
    assert r["launch"]["method"][0] == method
    assert reason in r["launch"]["method"][1]
    if method == "forkserver":
        assert r["fork"].startswith("PreflightError: start_method='fork' was asked for, but ")
        assert "restart the kernel" in r["fork"]
    else:
        assert r["fork"] == "ran"


def test_is_available_without_nvml_poisons_and_is_seen(tmp_path: Path) -> None:
    """Without ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (the package sets it at import; here the
    user cleared it), ``is_available()`` calls ``cudaGetDeviceCount``: the driver is
    initialised and the handler registered, and the launch says so."""
    r = _in_emulated_kernel(
        """
os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK")
assert torch.cuda.is_available()
print("RESULT " + json.dumps(launched()))
""",
        tmp_path,
    )
    assert r["ranks"] == ON_TWO_GPUS
    assert r["method"][0] == "forkserver" and "CUDA is initialised" in r["method"][1]


#: (a broken NVML, what the inventory then says). NVML runs in a throwaway forked child: a
#: driver library that crashes, loops or answers nonsense costs that child, never the kernel.
NVML_FAULTS = [
    ("", ("nvml", 2), ""),
    ("crash", ("probe", 0), "NVML could not answer (it crashed or hung in a child process)"),
    ("huge", ("probe", None), "nvmlDeviceGetCount said 100000000 GPUs"),
    ("badutf8", ("nvml", 2), ""),
    ("initfail", ("no NVIDIA driver", 0), ""),
    ("mig", ("probe", 2), "MIG is enabled on a GPU"),
    ("r440", ("probe", 2), "NVML lacks a function"),  # no nvmlDeviceGetMigMode (pre-R450)
]


@pytest.mark.parametrize(
    ("fault", "found", "note"), NVML_FAULTS, ids=[f[0] or "ok" for f in NVML_FAULTS]
)
def test_a_broken_nvml_never_takes_the_kernel_down(
    fault: str, found: tuple[str, int | None], note: str, tmp_path: Path
) -> None:
    r440 = fault == "r440"
    env = cuda_emulation.environment(nvml_fault="" if r440 else fault)
    if r440:  # its NVML found first, the driver beside it
        env["LD_LIBRARY_PATH"] = f"{cuda_emulation.build() / 'r440'}:{env['LD_LIBRARY_PATH']}"
    code = (
        "import json; from notebook_launcher import _placement as P; f = P.inventory(); "
        "print(json.dumps([f.source, f.count, f.note, [g.name for g in f.gpus][:2]]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr  # the kernel lives
    source, count, said, names = json.loads(done.stdout.strip().splitlines()[-1])
    assert source == found[0] and count == (count if found[1] is None else found[1])
    assert note in said
    if fault == "badutf8":
        assert names == ["NVIDIA \ufffd\ufffd GPU"] * 2  # decoded, not raised


def test_fork_hooks_close_only_in_the_children_of_who_registered_them() -> None:
    """A process that holds an fd its children must not (an agent's link to the kernel, the
    process-group guard's pipe) closes it in each child it forks -- and only there. A child
    reuses the freed number for its own files; a hook closing that number again in the
    child's own children took their pipe: the fork-answer child of an agent's warm-import
    probe (which asks whether the probe poisoned fork) lost its answer, the probe said
    "touched CUDA", and the agents' ranks imported torch._dynamo again each launch (the
    only-CPU CI run of 0d24631 saw it in test_agent_hub)."""
    code = """
        import os, sys
        from notebook_launcher import _posix
        held_r, held = os.pipe()
        _posix.close_in_children(held)
        pid = os.fork()
        if pid == 0:
            try:
                gone = not os.path.exists(f"/proc/self/fd/{held}")
                r, w = os.pipe()  # the freed number is the next pipe's ...
                reused = held in (r, w)
                _posix.close_quietly(r, w)
                answer = _posix.fork_answer(lambda: b"ok", timeout=10)  # ... as here
                print(gone, reused, answer, flush=True)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        print("parent holds it:", os.path.exists(f"/proc/self/fd/{held}"))
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["True True b'ok'", "parent holds it: True"], (
        done.stdout + done.stderr
    )
