"""The one-call check of a GPU machine: the gpu tier, the lessons, the step and start-up
against hand-written code and Accelerate, side by side, into one JSON and a table.

Run on the GPU machine (about 6-8 minutes on one H100)::

    python bench/gpu.py --out "$OUT"            # everything, in priority order
    python bench/gpu.py --only step,startup     # some sections
    python bench/gpu.py --cpu-smoke --out /tmp/g  # the same code paths, tiny, on a CPU

Sections (each in fresh processes, each bounded in time; what did not fit says so):

* ``env``: torch, CUDA, NCCL, the GPUs as the launcher's inventory sees them (NVML).
* ``gpu_tier``: ``pytest -m gpu`` (tests/test_gpu.py, tests/test_stall_gpu.py).
* ``startup``: launch to return of a trivial function: ours on 1 rank (a gloo group of one,
  no NCCL), ours one rank per GPU on NCCL, and a hand-written fork + ``set_device`` +
  ``init_process_group("nccl", device_id=...)`` + barrier doing the same; each in a fresh
  process that never touched CUDA, cold (first) and warm (median of the next ones).
* ``step``: an MLP of ~142M parameters, batch 512 from a pinned DataLoader, AdamW, in bf16
  and fp16: the hand-written loop (autocast, ``non_blocking`` copies, GradScaler for fp16),
  Accelerate's ``Accelerator`` in one process, and ours launched on 1 rank; ms per step over
  the timed steps (after a warm-up), the ratio to the hand-written loop, and whether our
  losses equal Accelerate's bit for bit.
* ``profile``: torch.profiler over 10 steps of ours and of the hand-written loop (bf16): the
  top operators by self CUDA and CPU time, in ``profile_<variant>.txt``.
* ``lessons``: notebooks 01-06 executed in a real kernel (nbclient), unchanged.
* ``suite``: ``python -m pytest -m "not browser"`` on 8 xdist workers, in what time is left.

Writes ``results.json`` and ``table.md`` under ``--out``, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
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


# ---- the driver ----------------------------------------------------------------------------


def _sub(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``gpu.py`` with ``argv`` in a fresh interpreter; its RESULT line, or the error."""
    full = {**os.environ, **(env or {})}
    full["PYTHONPATH"] = str(ROOT) + os.pathsep + full.get("PYTHONPATH", "")
    try:
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full,
            cwd=ROOT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    return {"error": (done.stdout + done.stderr)[-3000:]}


class Run:
    def __init__(self, out: Path, smoke: bool, budget: float) -> None:
        self.out = out
        self.smoke = smoke
        self.deadline = time.monotonic() + budget
        self.results: dict[str, Any] = {"smoke": smoke}
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

    # -- sections ------------------------------------------------------------------------

    def env(self) -> None:
        import torch

        from notebook_launcher import _placement

        found = _placement.inventory()
        nccl = None
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
        except Exception:  # noqa: BLE001
            pass
        self.results["env"] = {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": nccl,
            "python": sys.version.split()[0],
            "inventory": found.to_json(),
            "kernel_cuda_initialized": _placement.driver_initialized(),
        }
        self.say(f"# GPU check ({'CPU smoke' if self.smoke else found.describe()})")
        self.say(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}")

    def gpu_tier(self) -> None:
        xml = self.out / "gpu_tier.xml"
        cmd = [sys.executable, "-m", "pytest", "-p", "no:benchmark", "-q", "-m", "gpu"]
        cmd += ["tests/test_gpu.py", "tests/test_stall_gpu.py", f"--junitxml={xml}"]
        self.results["gpu_tier"] = self._pytest(cmd, min(self.left(), 240), "gpu_tier.log")
        self.say(f"gpu tier: {self.results['gpu_tier']['summary']}")

    def startup(self) -> None:
        from notebook_launcher import _placement

        gpus = 1 if self.smoke else max(_placement.inventory().count, 1)
        smoke = "1" if self.smoke else "0"
        rows = {
            "ours, 1 rank (no NCCL)": ["ours", "1"],
            f"ours, {gpus} rank(s) on NCCL": ["ours_nccl", str(gpus)],
            f"hand-written fork + NCCL, {gpus} rank(s)": ["hand", str(gpus)],
        }
        if self.smoke:
            rows = {"ours, 1 rank": ["ours", "1"], "hand-written fork + gloo": ["hand", "1"]}
        out = {}
        self.say("\n## Start-up: launch to return of a trivial function (s)\n")
        self.say("| launch | cold | warm |\n|---|---|---|")
        for name, (kind, n) in rows.items():
            r = _sub(["_startup", kind, n, "4", smoke], min(self.left(), 120))
            out[name] = r
            if "error" in r:
                self.say(f"| {name} | error | {r['error'][-200:]!r} |")
            else:
                self.say(f"| {name} | {r['cold']:.3f} | {r['warm']:.3f} |")
        self.results["startup"] = out

    def step(self) -> None:
        steps, warmup = (5, 2) if self.smoke else (200, 20)
        smoke = "1" if self.smoke else "0"
        out: dict[str, Any] = {}
        self.say("\n## Training step, one GPU (ms/step; ratio to the hand-written loop)\n")
        self.say(
            "| precision | hand-written | Accelerate | ours | ours / hand | losses = Accelerate's |"
        )
        self.say("|---|---|---|---|---|---|")
        for precision in ("bf16", "fp16"):
            row = {}
            for variant in ("hand", "accelerate", "ours"):
                argv = ["_step", variant, precision, smoke, str(steps), str(warmup), ""]
                row[variant] = _sub(argv, min(self.left(), 180))
            out[precision] = row
            ms = {v: r.get("ms_per_step") for v, r in row.items()}
            same = row["ours"].get("losses") == row["accelerate"].get("losses")
            if None in ms.values():
                errors = {v: r.get("error", "")[-300:] for v, r in row.items() if "error" in r}
                self.say(f"| {precision} | error: {errors} | | | | |")
                continue
            ratio = ms["ours"] / ms["hand"]
            row["ratio_ours_hand"] = ratio
            row["ratio_accelerate_hand"] = ms["accelerate"] / ms["hand"]
            row["losses_equal_accelerate"] = same
            self.say(
                f"| {precision} | {ms['hand']:.2f} | {ms['accelerate']:.2f} "
                f"({ms['accelerate'] / ms['hand']:.2f}x) | {ms['ours']:.2f} | {ratio:.3f}x | {same} |"
            )
        self.results["step"] = out

    def profile(self) -> None:
        smoke = "1" if self.smoke else "0"
        out = {}
        for variant in ("ours", "hand"):
            path = self.out / f"profile_{variant}.txt"
            r = _sub(["_step", variant, "bf16", smoke, "12", "5", str(path)], min(self.left(), 120))
            out[variant] = {"file": path.name, "error": r.get("error")}
        self.results["profile"] = out
        self.say(f"\nprofiles: {', '.join(v['file'] for v in out.values())}")

    def lessons(self) -> None:
        import nbformat
        from nbclient import NotebookClient

        out = {}
        self.say("\n## Lessons in a real kernel (nbclient)\n")
        for name in LESSONS:
            if self.left() < 30:
                out[name] = "not run: out of time"
                continue
            path = ROOT / "notebooks" / f"{name}.ipynb"
            nb = nbformat.read(path, as_version=4)
            env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
            env["PYTHONPATH"] = str(ROOT)
            t0 = time.perf_counter()
            try:
                client = NotebookClient(
                    nb,
                    timeout=int(min(self.left(), 180)),
                    kernel_name="python3",
                    # what the shipped kernelspec (kernels/notebook-launcher) adds
                    extra_arguments=["--ext=notebook_launcher"],
                    resources={"metadata": {"path": str(path.parent)}},
                )
                client.execute(env=env)
                out[name] = f"ok in {time.perf_counter() - t0:.1f} s"
            except Exception as exc:  # noqa: BLE001 - reported, and the next one runs
                out[name] = f"FAILED: {type(exc).__name__}: {str(exc)[-800:]}"
            self.say(f"- {name}: {out[name][:300]}")
        self.results["lessons"] = out

    def suite(self) -> None:
        left = self.left()
        if left < 60:
            self.results["suite"] = {"summary": "not run: out of time"}
            self.say("suite: not run (out of time)")
            return
        cmd = [sys.executable, "-m", "pytest", "-p", "no:benchmark", "-q", "-n", "8"]
        cmd += ["--dist", "loadfile", "-m", "not browser", "-x", "--timeout", "150"]
        cmd += [f"--junitxml={self.out / 'suite.xml'}"]
        self.results["suite"] = self._pytest(cmd, left - 10, "suite.log")
        self.say(f"suite (-m 'not browser'): {self.results['suite']['summary']}")

    def _pytest(self, cmd: list[str], timeout: float, log: str) -> dict[str, Any]:
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        env["PYTHONPATH"] = str(ROOT)
        try:
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd=ROOT,
                env=env,
                check=False,
            )
            text, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as exc:
            text = str(exc.stdout or "") + f"\ntimed out after {timeout:.0f} s"
            code = 124
        (self.out / log).write_text(text)
        tail = [x for x in text.splitlines() if x.strip()][-1:] or [""]
        return {"returncode": code, "summary": tail[0].strip("= ")}


SECTIONS = ("env", "gpu_tier", "startup", "step", "profile", "lessons", "suite")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_step":
        step_main(sys.argv[2:])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "_startup":
        startup_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "gpu-out")))
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny, on CPU ranks")
    parser.add_argument("--budget", type=float, default=460.0, help="seconds for everything")
    parser.add_argument("--only", default=",".join(SECTIONS))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.cpu_smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    run = Run(out, args.cpu_smoke, args.budget)
    wanted = [s for s in args.only.split(",") if s]
    for name in SECTIONS:
        if name in wanted or name == "env":
            try:
                getattr(run, name)()
            except Exception as exc:  # noqa: BLE001 - one section's failure is reported
                run.results[name] = {"error": f"{type(exc).__name__}: {exc}"}
                run.say(f"{name}: error {type(exc).__name__}: {exc}")
    run.save()
    print(f"\nwritten: {out / 'results.json'}, {out / 'table.md'}")


if __name__ == "__main__":
    main()
