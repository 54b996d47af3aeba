"""The one-call check of a GPU machine: every section in its own process and time, in the
order of what matters most, into one JSON and a table that are written whatever fails.

On the GPU machine (``bash bench/gpu.sh``: installs the carried wheels, then this under an
outer limit of 8 minutes)::

    python bench/gpu.py --out "$OUT"              # everything, in this order
    python bench/gpu.py --only launch,step        # some sections
    python bench/gpu.py --rehearse --out /tmp/g   # the CPU rehearsal (below)

Sections, each a fresh process with its own timeout (what did not fit says so; one that
fails or is cut prints its last 40 lines, and nothing it started is left running):

* ``diagnostics`` (~5 s): torch, CUDA, NCCL, Python, the platform (kernel, pidfds, /proc);
  the GPUs as the launcher's inventory sees them (NVML, in a child); the fork canary in a
  clean kernel, and again after ``torch.cuda.get_arch_list()`` (which must be seen).
* ``launch``: one rank on one GPU, launch to return, in a fresh kernel (fork); then in a
  kernel poisoned by ``get_arch_list()`` and one where CUDA was initialised
  (``torch.cuda.init()``): each must work and say why it used the forkserver.
* ``step``: an MLP of ~142M parameters, batch 512 from a pinned DataLoader, AdamW, bf16 and
  fp16: the hand-written loop, Accelerate's ``Accelerator`` and ours on 1 rank; ms per step,
  the ratios, and whether our losses equal Accelerate's bit for bit.
* ``startup``: launch to return of a trivial function: ours on 1 rank, ours one rank per GPU
  on NCCL, a hand-written fork + NCCL doing the same; cold and warm.
* ``gpu_tier``: ``pytest -m gpu`` (tests/test_gpu.py, tests/test_stall_gpu.py).
* ``lessons``: notebooks 01-06 and 08 in a real kernel (nbclient), unchanged (07 needs a
  Slurm cluster, which the GPU machine cannot install).
* ``suite``: ``pytest -m "not browser"`` on 8 workers, in the time left.

``--rehearse`` runs the same sections on a CPU machine with torch behaving as a CUDA build
on a machine with one GPU (``tests/_cuda_site``: CUDA's fork rules, a stand-in NVML and
driver) for ``diagnostics``, ``launch`` and ``startup``; ``step`` on CPU ranks, tiny; the rest
on CPU as CI runs them (the ``gpu`` tier skips). It proves the harness: every section
starts, finishes or is cut by its own timeout, and the JSON and table are written.

Writes ``results.json``, ``table.md`` and a log per section under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BATCH = 512
DIMS = (1024, 8192, 8192, 10)  # 142.7M parameters
SMOKE_DIMS = (32, 64, 64, 10)
LESSONS = (
    "01_quickstart",
    "02_execution_process",
    "03_training",
    "04_debugging",
    "05_interactive_debugging",
    "06_transformers_trainer",
    "08_runs_that_outlive_the_kernel",
)


# ---- one step variant, in the process that runs it ---------------------------------------


def _model_and_data(smoke: bool, steps: int, warmup: int) -> tuple[Any, Any, Any]:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    d0, d1, d2, d3 = SMOKE_DIMS if smoke else DIMS
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(d0, d1),
        torch.nn.ReLU(),
        torch.nn.Linear(d1, d2),
        torch.nn.ReLU(),
        torch.nn.Linear(d2, d3),
    )
    batch = 8 if smoke else BATCH
    g = torch.Generator().manual_seed(1)
    n = batch * (warmup + steps)
    x = torch.randn(n, d0, generator=g)
    y = torch.randint(0, d3, (n,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, pin_memory=not smoke, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt, loader


def run_step(
    variant: str, precision: str, smoke: bool, steps: int, warmup: int, profile: str = ""
) -> dict[str, Any]:
    """Train ``warmup + steps`` steps; ms per timed step and every loss."""
    import torch
    import torch.nn.functional as F

    model, opt, loader = _model_and_data(smoke, steps, warmup)
    cuda = torch.cuda.is_available() and not smoke
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    losses: list[Any] = []
    if variant == "hand":
        device = torch.device("cuda" if cuda else "cpu")
        model.to(device)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        scaler = torch.amp.GradScaler("cuda") if precision == "fp16" and cuda else None

        def step(x: Any, y: Any) -> Any:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None and cuda):
                loss = F.cross_entropy(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    else:
        if variant == "accelerate":
            from accelerate import Accelerator
        else:
            from notebook_launcher import Accelerator  # type: ignore[assignment]
        acc = Accelerator(mixed_precision=precision if cuda else "no")
        model, opt, loader = acc.prepare(model, opt, loader)

        def step(x: Any, y: Any) -> Any:
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

    t0 = 0.0
    prof = None
    for i, (x, y) in enumerate(loader):
        if i == warmup:
            sync()
            t0 = time.perf_counter()
            if profile:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if cuda:
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                prof = torch.profiler.profile(activities=activities)
                prof.__enter__()
        losses.append(step(x, y).detach())
        if prof is not None and i == warmup + 9:
            sync()
            prof.__exit__(None, None, None)
            Path(profile).write_text(_profile_table(prof, cuda))
            prof = None
    sync()
    took = time.perf_counter() - t0
    timed = len(losses) - warmup
    return {
        "ms_per_step": 1000 * took / max(timed, 1) if not profile else None,
        "losses": [float(v) for v in torch.stack(losses).float().cpu().tolist()],
        "steps": timed,
    }


def _profile_table(prof: Any, cuda: bool) -> str:
    averages = prof.key_averages()
    parts = []
    for key in (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
        parts.append(f"sorted by {key}\n" + averages.table(sort_by=key, row_limit=25))
    return "\n\n".join(parts)


def _step_in_rank(
    variant: str, precision: str, smoke: bool, steps: int, warmup: int, profile: str
) -> Any:
    return run_step(variant, precision, smoke, steps, warmup, profile)


def step_main(args: list[str]) -> None:
    """``gpu.py _step VARIANT PRECISION SMOKE STEPS WARMUP PROFILE``: one fresh process."""
    variant, precision, smoke, steps, warmup, profile = args
    smoke_b, n, w = smoke == "1", int(steps), int(warmup)
    if variant == "ours":
        from notebook_launcher import notebook_launcher

        (out,) = notebook_launcher(
            _step_in_rank,
            (variant, precision, smoke_b, n, w, profile),
            num_processes=1,
            mixed_precision=precision if not smoke_b else "no",
            dashboard=False,
        )
    else:
        out = run_step(variant, precision, smoke_b, n, w, profile)
    print("RESULT " + json.dumps(out))


# ---- start-up, in the process that measures it ---------------------------------------------


def _trivial() -> int:
    return 0


def _hand_rank(i: int, n: int, port: int, cuda: bool) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if cuda:
        torch.cuda.set_device(i)
        kwargs["device_id"] = torch.device("cuda", i)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=i,
        world_size=n,
        timeout=datetime.timedelta(seconds=60),
        **kwargs,
    )
    if cuda:
        dist.barrier(device_ids=[i])
    else:
        dist.barrier()
    dist.destroy_process_group()


def startup_main(args: list[str]) -> None:
    """``gpu.py _startup KIND N REPEATS SMOKE``: launch-to-return, cold then warm."""
    kind, n, repeats, smoke = args[0], int(args[1]), int(args[2]), args[3] == "1"
    times = []
    if kind == "hand":
        import multiprocessing as mp
        import socket

        import torch

        ctx = mp.get_context("fork")
        for _ in range(repeats):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            t0 = time.perf_counter()
            procs = [ctx.Process(target=_hand_rank, args=(i, n, port, not smoke)) for i in range(n)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            times.append(time.perf_counter() - t0)
            assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    else:
        import torch  # noqa: F401

        from notebook_launcher import notebook_launcher

        devices = "gpu" if kind == "ours_nccl" else ("cpu" if smoke else "auto")
        for _ in range(repeats):
            t0 = time.perf_counter()
            notebook_launcher(_trivial, (), n, devices=devices, dashboard=False)
            times.append(time.perf_counter() - t0)
    print("RESULT " + json.dumps({"cold": times[0], "warm": statistics.median(times[1:] or times)}))


# ---- the launch section's cases, each in a fresh kernel --------------------------------------


#: what a user's cell did in the kernel before the launch: nothing; registered CUDA's fork
#: handler only (torch._C._cuda_getArchFlags); initialised CUDA
LAUNCH_CASES = {
    "clean": lambda torch: None,
    "get_arch_list": lambda torch: torch.cuda.get_arch_list(),
    "cuda_initialised": lambda torch: torch.cuda.init(),
}


def launch_case_main(args: list[str]) -> None:
    """``gpu.py _launch CASE``: in a fresh kernel, do what CASE says, then launch one rank on
    one GPU; the result, the start method and its reason, launch to return."""
    import torch

    from notebook_launcher import notebook_launcher
    from notebook_launcher._events import LaunchStarted

    LAUNCH_CASES[args[0]](torch)
    seen: list[Any] = []

    class Keep:
        def handle(self, event: Any) -> None:
            seen.append(event)

        def tick(self) -> None:
            pass

        def close(self) -> None:
            pass

    t0 = time.perf_counter()
    out = notebook_launcher(_on_gpu, (), 1, devices="gpu", dashboard=Keep())
    took = time.perf_counter() - t0
    started = [e for e in seen if isinstance(e, LaunchStarted)][-1]
    print("RESULT " + json.dumps({
        "result": out, "method": started.start_method, "reason": started.start_reason,
        "seconds": took, "kernel_initialized": torch.cuda.is_initialized(),
    }))  # fmt: skip


def _on_gpu() -> list[Any]:
    """The rank's device, and a sum computed there (None under the CPU rehearsal's
    emulation, which has no CUDA kernels to run)."""
    import torch

    device = torch.cuda.current_device()
    if os.environ.get("NL_EMULATE_CUDA") == "1":
        return [device, None]
    return [device, float(torch.ones(4, device="cuda").sum())]


# ---- the sections, each run in a process of its own ----------------------------------------


class Section:
    """What one section found: its JSON and its lines of the table."""

    def __init__(self, out: Path, rehearse: bool, seconds: float) -> None:
        self.out = out
        self.rehearse = rehearse
        self.deadline = time.monotonic() + seconds
        self.results: dict[str, Any] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, text: str) -> None:
        for line in text.split("\n"):
            print("TABLE " + line, flush=True)

    # -- the sections -------------------------------------------------------------------

    def diagnostics(self) -> None:
        import platform

        import torch  # (importing it registers nothing)

        from notebook_launcher import _placement, _posix
        from notebook_launcher._launch import preflight

        t0 = time.perf_counter()
        clean = _posix.fork_handler_registered()  # before anything here touches CUDA
        canary_ms = 1000 * (time.perf_counter() - t0)
        found = _placement.inventory()
        flags = _placement.arch_flags()
        unsupported = _placement.unsupported_gpus(found, flags)
        torch.cuda.get_arch_list()  # registers CUDA's fork handler here: the canary must see it
        poisoned = _posix.fork_handler_registered()
        nccl = None
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
        except Exception:  # noqa: BLE001 - a build without NCCL
            pass
        task = os.listdir("/proc/self/task")[0]
        self.results = {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": nccl,
            "kernel": platform.release(),
            "platform_lacks": preflight.platform_lacks(),
            "proc_children": os.path.exists(f"/proc/self/task/{task}/children"),
            "inventory": found.to_json(),
            "arch_flags": flags,
            "unsupported": unsupported,
            "canary_clean_kernel": clean,
            "canary_ms": round(canary_ms, 2),
            "canary_after_get_arch_list": poisoned,
        }
        self.say(f"# GPU check: {found.describe()}{' (CPU rehearsal)' if self.rehearse else ''}")
        self.say(
            f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, Python "
            f"{self.results['python']}, kernel {platform.release()}"
            + (
                f"; lacks {self.results['platform_lacks']}"
                if self.results["platform_lacks"]
                else ""
            )
        )
        self.say(
            f"canary: a clean kernel's fork is {'BAD' if clean else 'clean'} ({canary_ms:.1f} "
            f"ms); after get_arch_list() {'seen poisoned' if poisoned else 'NOT SEEN'}"
            + (f"; unsupported GPUs: {unsupported}" if unsupported else "")
        )

    def launch(self) -> None:
        self.say("\n## One rank on one GPU, from a fresh kernel\n")
        self.say("| kernel | result | start method, why | launch to return |\n|---|---|---|---|")
        for case in LAUNCH_CASES:
            r = _sub(["_launch", case], min(self.left(), 60))
            self.results[case] = r
            if "error" in r:
                self.say(f"| {case} | error | {r['error'][-300:]!r} | |")
            else:
                self.say(
                    f"| {case} | {r['result']} | {r['method']}: {r['reason']} | "
                    f"{r['seconds']:.3f} s |"
                )

    def step(self) -> None:
        steps, warmup = (5, 2) if self.rehearse else (200, 20)
        smoke = "1" if self.rehearse else "0"
        self.say("\n## Training step, one GPU (ms/step; ratio to the hand-written loop)\n")
        self.say(
            "| precision | hand-written | Accelerate | ours | ours / hand | losses = Accelerate's |"
        )
        self.say("|---|---|---|---|---|---|")
        for precision in ("bf16", "fp16"):
            row = {}
            for variant in ("hand", "accelerate", "ours"):
                argv = ["_step", variant, precision, smoke, str(steps), str(warmup), ""]
                row[variant] = _sub(argv, min(self.left(), 120), cpu=self.rehearse)
            self.results[precision] = row
            ms = {v: r.get("ms_per_step") for v, r in row.items()}
            if None in ms.values():
                errors = {v: r.get("error", "")[-300:] for v, r in row.items() if "error" in r}
                self.say(f"| {precision} | error: {errors} | | | | |")
                continue
            same = row["ours"].get("losses") == row["accelerate"].get("losses")
            ratio = ms["ours"] / ms["hand"]
            row.update(ratio_ours_hand=ratio, losses_equal_accelerate=same)
            row["ratio_accelerate_hand"] = ms["accelerate"] / ms["hand"]
            self.say(
                f"| {precision} | {ms['hand']:.2f} | {ms['accelerate']:.2f} "
                f"({ms['accelerate'] / ms['hand']:.2f}x) | {ms['ours']:.2f} | {ratio:.3f}x | {same} |"
            )

    def startup(self) -> None:
        from notebook_launcher import _placement

        gpus = max(_placement.inventory().count, 1)
        rows = {
            "ours, 1 rank (no NCCL)": ["ours", "1"],
            f"ours, {gpus} rank(s) on NCCL": ["ours_nccl", str(gpus)],
            f"hand-written fork + NCCL, {gpus} rank(s)": ["hand", str(gpus)],
        }
        self.say("\n## Start-up: launch to return of a trivial function (s)\n")
        self.say("| launch | cold | warm |\n|---|---|---|")
        for name, (kind, n) in rows.items():
            r = _sub(["_startup", kind, n, "4", "0"], min(self.left(), 60))
            self.results[name] = r
            if "error" in r:
                self.say(f"| {name} | error | {r['error'][-200:]!r} |")
            else:
                self.say(f"| {name} | {r['cold']:.3f} | {r['warm']:.3f} |")

    def gpu_tier(self) -> None:
        cmd = [sys.executable, "-m", "pytest", "-p", "no:benchmark", "-q", "-m", "gpu"]
        cmd += ["tests/test_gpu.py", "tests/test_stall_gpu.py", "--timeout", "150"]
        self.results = _pytest(cmd, self.left() - 5, self.out / "gpu_tier.out")
        self.say(f"\ngpu tier: {self.results['summary']}")

    def lessons(self) -> None:
        import nbformat
        from nbclient import NotebookClient

        self.say("\n## Lessons in a real kernel (nbclient)\n")
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        env["PYTHONPATH"] = str(ROOT)
        for name in LESSONS:
            if self.left() < 20:
                self.results[name] = "not run: out of time"
                self.say(f"- {name}: not run (out of time)")
                continue
            path = ROOT / "notebooks" / f"{name}.ipynb"
            t0 = time.perf_counter()
            try:
                client = NotebookClient(
                    nbformat.read(path, as_version=4),
                    timeout=int(min(self.left() - 5, 90)),
                    kernel_name="python3",
                    extra_arguments=["--ext=notebook_launcher"],  # as the shipped kernelspec
                    resources={"metadata": {"path": str(path.parent)}},
                )
                client.execute(env=env)
                self.results[name] = f"ok in {time.perf_counter() - t0:.1f} s"
            except Exception as exc:  # noqa: BLE001 - reported; the next one runs
                self.results[name] = f"FAILED: {type(exc).__name__}: {str(exc)[-600:]}"
            self.say(f"- {name}: {self.results[name][:300]}")

    def suite(self) -> None:
        cmd = [sys.executable, "-m", "pytest", "-p", "no:benchmark", "-q", "-n", "8"]
        cmd += ["--dist", "loadfile", "-m", "not browser", "--timeout", "150"]
        self.results = _pytest(cmd, self.left() - 5, self.out / "suite.out")
        self.say(f"\nsuite (-m 'not browser'): {self.results['summary']}")

    # -- two sections that exist to test this harness (tests/test_gpu_check.py) ----------

    def selftest_cut(self) -> None:
        """Starts a daemon (its own session: out of the section's process group) and outlives
        the section's limit: the driver must cut it and end the daemon too."""
        daemon = subprocess.Popen(["sleep", "600"], start_new_session=True)
        self.say(f"daemon {daemon.pid}")
        time.sleep(600)

    def selftest_fail(self) -> None:
        for i in range(50):
            print(f"line {i}")
        raise RuntimeError("this section fails on purpose")


def _pytest(cmd: list[str], timeout: float, log: Path) -> dict[str, Any]:
    """Run a pytest command (output to ``log``); its last line, as a summary."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env["PYTHONPATH"] = str(ROOT)
    with open(log, "w") as out:
        try:
            done = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, timeout=max(timeout, 1), cwd=ROOT,
                env=env, check=False,
            )  # fmt: skip
            code = done.returncode
        except subprocess.TimeoutExpired:
            code = 124
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    summary = (lines[-1:] or [""])[0].strip("= ")
    if code == 124:
        summary = f"cut at {timeout:.0f} s: {summary}"
    return {"returncode": code, "summary": summary}


def _sub(argv: list[str], timeout: float, cpu: bool = False) -> dict[str, Any]:
    """Run ``gpu.py`` with ``argv`` in a fresh interpreter; its RESULT line, or the error.
    ``cpu``: with the GPUs hidden and without the CUDA emulation (a rehearsal's step)."""
    env = {**os.environ}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.pop("NL_EMULATE_CUDA", None)
    try:
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), *argv],
            capture_output=True, text=True, timeout=max(timeout, 1), env=env, cwd=ROOT,
            check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    return {"error": (done.stdout + done.stderr)[-3000:]}


def section_main(args: list[str]) -> None:
    """``gpu.py _section NAME OUT SECONDS REHEARSE``: one section, in this process."""
    name, out, seconds, rehearse = args[0], Path(args[1]), float(args[2]), args[3] == "1"
    section = Section(out, rehearse, seconds)
    getattr(section, name)()
    print("RESULT " + json.dumps(section.results), flush=True)


# ---- the driver -------------------------------------------------------------------------------

SECTIONS = ("diagnostics", "launch", "step", "startup", "gpu_tier", "lessons", "suite")
#: each section's own limit (s); the suite takes what is left
LIMITS = {
    "diagnostics": 30,
    "launch": 75,
    "step": 120,
    "startup": 60,
    "gpu_tier": 90,
    "lessons": 110,
    "selftest_cut": 4,
}
#: sections run only when named in --only
SELFTESTS = ("selftest_cut", "selftest_fail")


class Driver:
    def __init__(self, out: Path, rehearse: bool, budget: float) -> None:
        self.out = out
        self.rehearse = rehearse
        self.deadline = time.monotonic() + budget
        self.results: dict[str, Any] = {"rehearsal": rehearse, "sections": {}}
        self.lines: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2))
        (self.out / "table.md").write_text("\n".join(self.lines) + "\n")

    def say(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)
        self.save()

    def env_for(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        if self.rehearse and name in ("diagnostics", "launch", "startup"):
            sys.path.insert(0, str(ROOT / "tests" / "_cuda_site"))
            import cuda_emulation

            env = cuda_emulation.environment(env, gpus=1)
        elif self.rehearse:
            env["CUDA_VISIBLE_DEVICES"] = ""  # as CI runs them
        return env

    def run(self, name: str) -> None:
        """Run section ``name`` in a process of its own, within its limit and the time left;
        whatever it started is gone afterwards."""
        own = LIMITS.get(name, 10**6)
        limit = min(own, self.left() - 10)
        record: dict[str, Any] = {"limit_s": round(limit)}
        self.results["sections"][name] = record
        if limit < min(own, 15):
            record["status"] = "not run: out of time"
            self.say(f"\n{name}: not run (out of time)")
            return
        log = self.out / f"{name}.log"
        argv = [sys.executable, str(Path(__file__).resolve()), "_section", name, str(self.out)]
        argv += [str(limit - 3), "1" if self.rehearse else "0"]
        t0 = time.monotonic()
        status = "stopped by the outer time limit"
        with open(log, "w") as f:
            proc = subprocess.Popen(
                argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env_for(name),
                start_new_session=True,
            )  # fmt: skip
            try:
                proc.wait(timeout=limit)
                status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
            except subprocess.TimeoutExpired:
                status = f"cut by its timeout ({limit:.0f} s)"
            finally:
                end_everything(proc)
                record["seconds"] = round(time.monotonic() - t0, 1)
                self._fold(name, record, log.read_text(errors="replace"), status)

    def _fold(self, name: str, record: dict[str, Any], text: str, status: str) -> None:
        """A section's table lines and result into the whole; its last 40 lines unless ok."""
        for line in text.splitlines():
            if line.startswith("TABLE "):
                self.say(line[len("TABLE ") :])
            elif line.startswith("RESULT "):
                record["result"] = json.loads(line[len("RESULT ") :])
        if status == "ok" and "result" not in record:
            status = "failed (no result)"
        record["status"] = status
        if status != "ok":
            tail = "\n".join(text.splitlines()[-40:])
            self.say(f"\n{name}: {status}; its last 40 lines:\n```\n{tail}\n```")
        else:
            self.say(f"({name}: {record['seconds']} s)")


def _pids_under(root: int) -> list[int]:
    """Every live descendant of ``root``, from ``/proc/*/stat`` (the ``children`` files are
    not everywhere: gVisor)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for kid in parents.get(todo.pop(), []):
            found.append(kid)
            todo.append(kid)
    return found


def end_everything(proc: subprocess.Popen[bytes] | None = None) -> None:
    """SIGKILL what a section left: its process group, then every descendant of this
    driver (a daemon that left the group is still ours: this process is their subreaper),
    and reap them."""
    if proc is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for _ in range(3):
        pids = _pids_under(os.getpid())
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not pids:
            return
        time.sleep(0.2)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("_step", "_startup", "_launch", "_section"):
        entry = {"_step": step_main, "_startup": startup_main, "_launch": launch_case_main}
        entry["_section"] = section_main
        entry[sys.argv[1]](sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "gpu-out")))
    parser.add_argument("--rehearse", action="store_true", help="on a CPU, CUDA emulated")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for everything")
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument(
        "--limit", action="append", default=[], metavar="SECTION=SECONDS",
        help="a section's own limit (default: LIMITS)",
    )  # fmt: skip
    args = parser.parse_args()
    for item in args.limit:
        name, _, seconds = item.partition("=")
        LIMITS[name] = int(seconds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:  # orphans of a section (daemons) come to this process, which ends them
        import ctypes

        ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass
    driver = Driver(out, args.rehearse, args.budget)

    def outer_limit(signum: int, frame: Any) -> None:  # gpu.sh's timeout: end, but say so
        end_everything()
        driver.say(f"\nstopped by signal {signum} (the outer time limit)")
        raise SystemExit(124)

    signal.signal(signal.SIGTERM, outer_limit)
    wanted = [s for s in args.only.split(",") if s]
    for name in SECTIONS + SELFTESTS:
        if name in wanted:
            driver.run(name)
    driver.save()
    print(f"\nwritten: {out / 'results.json'}, {out / 'table.md'}")


if __name__ == "__main__":
    main()
