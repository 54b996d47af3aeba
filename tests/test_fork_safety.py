"""The kernel never reaches the CUDA runtime: a spy, on a CPU machine.

A GPU machine's first failure was this: ``torch.cuda.is_available()`` in the kernel
(preflight, the agent's hello) calls ``cudaGetDeviceCount``, which initialises the driver,
and every rank forked after it fails with "Cannot re-initialize CUDA in forked subprocess".
The CPU build of torch has no CUDA runtime to reach, so a fresh interpreter is made to look
like a CUDA build whose runtime entry points are spies (``_cuda_getDeviceCount``,
``_cuda_init``, ``torch.cuda._lazy_init``): each records a call made in the kernel process
(the forked ranks may use CUDA, and the spy answers them "no GPU"). Then every path of the
kernel runs -- launches (fork, forkserver, detached, one rank, a failing rank,
``block=False`` with its stacks), a session, preflight and plans on a pretend GPU machine,
the NVML-less probe, the dashboard, ``%nl_info``, and a node agent's hello -- and the spy
must have seen nothing.
A control first proves the spy catches what the old preflight did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time, traceback
    import torch

    KERNEL = os.getpid()
    calls = []

    def spy(name, answer):
        def runtime_call(*args, **kwargs):
            if os.getpid() == KERNEL:
                calls.append([name, "".join(traceback.format_stack(limit=12)[:-1])])
            return answer
        return runtime_call

    torch.version.cuda = "13.0"  # a CUDA build, as far as anyone asks
    torch._C._cuda_getDeviceCount = spy("cudaGetDeviceCount", 0)
    torch._C._cuda_init = spy("cuda_init", None)
    torch.cuda._lazy_init = spy("torch.cuda._lazy_init", None)

    # the control: what preflight did on 10004d7
    torch.cuda.is_available()
    assert [c[0] for c in calls] == ["cudaGetDeviceCount"], calls
    calls.clear()

    import notebook_launcher
    from notebook_launcher import notebook_launcher as launch, start, _placement
    from notebook_launcher.ui import NullView
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"

    def where():
        from notebook_launcher import PartialState
        s = PartialState()
        return [s.process_index, str(s.device), str(s.distributed_type)]

    def boom():
        import torch.distributed as dist
        if dist.get_rank() == 1:
            raise ValueError("rank one fails")
        dist.barrier()

    def nap():
        time.sleep(30)

    results = {}
    # no NVIDIA driver here: the inventory says so without asking the runtime
    results["inventory"] = _placement.inventory().source
    results["fork"] = launch(where, (), 2, dashboard=True)
    results["one"] = launch(where, (), 1, dashboard=NullView())
    results["forkserver"] = launch(where, (), 2, start_method="forkserver", dashboard=NullView())
    # a detached run: its supervisor forked by that forkserver, asked from here
    import tempfile
    with tempfile.TemporaryDirectory() as runs:
        os.environ["NOTEBOOK_LAUNCHER_RUNS_DIR"] = runs
        results["detached"] = launch(where, (), 2, dashboard=NullView(), detach=True).result(60)
    try:
        launch(boom, (), 2, dashboard=True)
    except ValueError as exc:
        results["raised"] = str(exc)
    handle = launch(nap, (), 2, block=False, dashboard=NullView())
    time.sleep(1.0)
    results["stacks"] = "nap" in str(handle.stacks())
    handle.cancel()
    try:
        handle.result(30)
    except BaseException as exc:
        results["cancelled"] = type(exc).__name__
    with start(2, dashboard=NullView()) as session:
        results["session"] = session.run(where)
        results["session_stacks"] = bool(str(session.stacks()))

    from notebook_launcher.ipython_extension import info_lines
    results["info"] = [line for line in info_lines() if line.startswith("devices")]

    from notebook_launcher._agent import serve
    results["hello_gpus"] = serve.hello(serve.claim("job", 0)).gpus
    serve.preload()  # what an agent imports before it forks its node's ranks

    # NVML cannot answer (MIG, no library): a throwaway child asks instead
    _placement._nvidia_driver_present = lambda: True
    def no_nvml():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")
    _placement._nvml_devices = no_nvml
    found = _placement.inventory(fresh=True)
    results["probe"] = [found.source, found.count]

    # a pretend machine with two H100s: preflight and the plans, as on the GPU machine
    fake = [(_placement.Gpu(i, "NVIDIA H100", f"GPU-{i}", 80 << 30, (9, 0)), False)
            for i in range(2)]
    _placement._nvml_devices = lambda: fake
    _placement.set_inventory_for_tests(None)
    from notebook_launcher._launch.plan import plan_launch
    for n in (2, 3, 1):
        plan = plan_launch(where, n, mixed_precision="bf16")
        plan.close()
        results[f"plan{n}"] = [[s.device, s.backend] for s in plan.specs]
    results["info_gpus"] = [line for line in info_lines() if line.startswith("devices")]
    results["hello_gpus_fake"] = serve.hello(serve.claim("job", 0)).gpus
    results["driver_initialized"] = _placement.driver_initialized()

    print("RESULT " + json.dumps({"results": results, "calls": calls}))
    """
)


def test_the_kernel_never_reaches_the_cuda_runtime() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_CURRENT_TEST", None)
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)  # what importing the package sets
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=220,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    data = json.loads(line[len("RESULT ") :])
    calls, results = data["calls"], data["results"]
    assert calls == [], "the kernel reached the CUDA runtime:\n" + "\n".join(
        f"{name} from\n{stack}" for name, stack in calls
    )
    assert results["inventory"] == "no NVIDIA driver"
    assert results["fork"] == [[0, "cpu", "MULTI_CPU"], [1, "cpu", "MULTI_CPU"]]
    assert results["one"] == [[0, "cpu", "NO"]]  # one rank is not a distributed job
    assert results["forkserver"] == results["fork"]
    assert results["detached"] == results["fork"]
    assert results["raised"] == "rank one fails"
    assert results["stacks"] is True
    assert results["cancelled"] == "CancelledError"
    assert results["session"] == results["fork"]
    assert results["info"] and "CPU only" in results["info"][0]
    assert results["hello_gpus"] == 0
    assert results["probe"] == ["probe", 0]
    assert results["plan2"] == [["cuda:0", "nccl"], ["cuda:1", "nccl"]]
    assert results["plan3"] == [["cuda:0", "gloo"], ["cuda:1", "gloo"], ["cuda:0", "gloo"]]
    assert results["plan1"] == [["cuda:0", "gloo"]]
    assert "2 CUDA device(s): NVIDIA H100, NVIDIA H100" in results["info_gpus"][0]
    assert results["hello_gpus_fake"] == 2
    assert results["driver_initialized"] is False
    # the dashboard (text view here) showed the launch
    assert "notebook_launcher: 2 ranks, fork" in out
