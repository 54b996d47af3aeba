"""Accelerate's own example scripts, unchanged, on 2 CPU ranks of notebook_launcher.

``examples/nlp_example.py``, ``cv_example.py``, ``complete_nlp_example.py``,
``complete_cv_example.py`` and ``examples/by_feature/*.py`` of Accelerate's repository, each
run as ``python script.py ARGS`` would run it, on 2 ranks started by our launcher, with
``import accelerate`` answered by this package (the shim of ``tests/_parity_shim.py``) and
the Hub's models, data sets and metric replaced from outside by tiny local stand-ins
(``tests/_examples_runner.py``). Each case is one invocation; the arguments and the checks
are those of Accelerate's own ``tests/test_examples.py`` (checkpoints written, a resumed
run skips the epochs it resumed past), and, beyond those:

* every metric computation sees exactly the evaluation set (``gather_for_metrics`` drops
  the samples that even batches repeated);
* a run resumed from a checkpoint (an epoch's, or a step's in the middle of an epoch) ends
  with weights bit-identical to the run that never stopped;
* the trackers of ``log_with="all"`` write their files; the profiler writes its traces;
* ``test_same_results_as_accelerate``: the real Accelerate 1.15 (the test extra), run the
  same way in the same ranks (``--mode real``), prints the same epoch reports, hands its
  metric the same predictions and saves the same weights.

**Not in the default suite.** The examples ship in no release artifact (Accelerate's sdist
and wheel have no ``examples/``), so this test needs a checkout of Accelerate's repository:

    NOTEBOOK_LAUNCHER_ACCELERATE_EXAMPLES=/path/to/accelerate python -m pytest tests/test_accelerate_examples.py

and the examples' own dependencies (``pip install -e '.[test,examples]'``; ``cv_example``
and ``complete_cv_example`` also need ``timm`` and ``torchvision``, left out of the extra:
PyPI's torchvision wheel is built for CUDA torch, and installed over the CPU build it breaks
the image utilities that ``transformers`` imports, for everything else in the environment;
the runner works around that for its own ranks). Without the variable every case skips,
saying why; with it, 53 launches of 2 ranks run (about 10 minutes on 2 cores).

One example by hand (``--mode real`` for Accelerate itself)::

    python -m tests._examples_runner --checkout /path/to/accelerate --out /tmp/o \\
        --workdir /tmp/w by_feature/checkpointing.py --checkpointing_steps epoch

Outcomes: passes; or fails at a deliberate difference of this package (the README's
"Differences from Accelerate"), asserted by its error (``raises``); or skips naming a
missing package.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .helpers import kernel_env

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parent.parent
ENV = "NOTEBOOK_LAUNCHER_ACCELERATE_EXAMPLES"
WHY_A_CHECKOUT = (
    f"Accelerate's example scripts ship in no release artifact (its sdist and wheel have no "
    f"examples/): set {ENV}=/path/to/accelerate, a checkout of Accelerate's repository "
    f"with examples/ under it, to run them"
)

#: What every MRPC example needs beyond the test extra.
NLP = ("datasets", "evaluate", "transformers")
#: The validation split of the synthetic MRPC (tests/_examples_runner.py).
MRPC_VALIDATION = 41
EPOCHS = (0, 1, 2)


@dataclass(frozen=True)
class Example:
    """One invocation of one of their scripts and what must hold afterwards.

    ``args`` may name ``{run}`` (this case's directory), ``{shared}`` (a directory the
    cases of one chain share: a checkpoint written by one, resumed by the next) and
    ``{pets}`` (the synthetic image folder). ``after``: the cases whose runs this one
    reads (run first if they have not run).
    """

    id: str
    script: str
    args: tuple[str, ...] = ()
    needs: tuple[str, ...] = NLP
    epochs: tuple[int, ...] | None = EPOCHS  # "epoch N:" lines rank 0 must print
    absent: tuple[str, ...] = ()  # what rank 0 must not print
    expect: tuple[str, ...] = ()  # regular expressions rank 0's output must match
    metric_n: int | None = MRPC_VALIDATION  # what every metric computation must see
    files: tuple[str, ...] = ()  # globs under {run}/{shared} that must match
    same_weights: tuple[str, str] | None = None  # two safetensors files, bit-identical
    after: tuple[str, ...] = ()
    differs: str | None = None
    raises: str | None = None
    # real Accelerate gives the same results (see test_same_results_as_accelerate), or why not
    reference: str | None = ""
    timeout: int = 300


_ONLY = "AccelerateOnlyError: `{}` is part of Accelerate's"
#: The causal-LM scripts' data and model, as their README runs them, made small.
CLM_ARGS = (
    "--dataset_name",
    "Salesforce/wikitext",
    "--dataset_config_name",
    "wikitext-2-v1",
    "--model_name_or_path",
    "HuggingFaceTB/SmolLM-360M",
    "--block_size",
    "16",
    "--per_device_train_batch_size",
    "2",
    "--per_device_eval_batch_size",
    "2",
    "--num_train_epochs",
    "2",
    "--seed",
    "42",
)

EXAMPLES = [
    Example("nlp_example", "nlp_example.py"),
    Example(
        "cv_example",
        "cv_example.py",
        ("--data_dir", "{pets}"),
        needs=("timm", "torchvision"),
        metric_n=None,  # counts its own accuracy
    ),
    # complete_nlp_example: checkpoints by epoch, by step with a stateful loader, resumes
    Example(
        "complete_nlp_example[checkpointing_steps=epoch]",
        "complete_nlp_example.py",
        ("--checkpointing_steps", "epoch", "--output_dir", "{shared}/nlp"),
        files=("{shared}/nlp/epoch_0", "{shared}/nlp/epoch_2/model.safetensors"),
    ),
    Example(
        "complete_nlp_example[resume_from=epoch_0]",
        "complete_nlp_example.py",
        (
            "--resume_from_checkpoint",
            "{shared}/nlp/epoch_0",
            "--checkpointing_steps",
            "epoch",
            "--output_dir",
            "{run}",
        ),
        epochs=(1, 2),
        absent=("epoch 0:",),
        same_weights=("{shared}/nlp/epoch_2/model.safetensors", "{run}/epoch_2/model.safetensors"),
        after=("complete_nlp_example[checkpointing_steps=epoch]",),
    ),
    Example(
        "complete_nlp_example[stateful,checkpointing_steps=1]",
        "complete_nlp_example.py",
        (
            "--use_stateful_dataloader",
            "--checkpointing_steps",
            "1",
            "--output_dir",
            "{shared}/nlp-s",
        ),
        needs=(*NLP, "torchdata"),
        files=("{shared}/nlp-s/step_3", "{shared}/nlp-s/step_6"),
        reference="Accelerate's stateful checkpoints change its training: see the README",
    ),
    Example(
        # step 3 is the first step of epoch 1: resumed in the middle of the epoch's loader
        "complete_nlp_example[stateful,resume_from=step_3]",
        "complete_nlp_example.py",
        (
            "--use_stateful_dataloader",
            "--resume_from_checkpoint",
            "{shared}/nlp-s/step_3",
            "--checkpointing_steps",
            "epoch",
            "--output_dir",
            "{run}",
        ),
        needs=(*NLP, "torchdata"),
        reference="Accelerate resumes a stateful loader from another permutation: see the README",
        epochs=(1, 2),
        absent=("epoch 0:",),
        same_weights=("{shared}/nlp/epoch_2/model.safetensors", "{run}/epoch_2/model.safetensors"),
        after=(
            "complete_nlp_example[checkpointing_steps=epoch]",
            "complete_nlp_example[stateful,checkpointing_steps=1]",
        ),
    ),
    Example(
        "complete_nlp_example[with_tracking]",
        "complete_nlp_example.py",
        ("--with_tracking", "--project_dir", "{run}/logs"),
        files=("{run}/logs/complete_nlp_example/events.out.tfevents.*",),
    ),
    Example(
        "complete_cv_example[checkpointing_steps=epoch]",
        "complete_cv_example.py",
        ("--data_dir", "{pets}", "--checkpointing_steps", "epoch", "--output_dir", "{run}"),
        needs=("timm", "torchvision"),
        metric_n=None,
        files=("{run}/epoch_2/model.safetensors",),
    ),
    # by_feature/checkpointing.py: Accelerate's test_examples, case for case
    Example(
        "checkpointing[by_epoch]",
        "by_feature/checkpointing.py",
        ("--checkpointing_steps", "epoch", "--output_dir", "{shared}/ckpt"),
        files=("{shared}/ckpt/epoch_0",),
    ),
    Example(
        "checkpointing[by_steps]",
        "by_feature/checkpointing.py",
        ("--checkpointing_steps", "1", "--output_dir", "{shared}/ckpt"),
        files=("{shared}/ckpt/step_2",),
    ),
    Example(
        "checkpointing[load_states_by_epoch]",
        "by_feature/checkpointing.py",
        ("--resume_from_checkpoint", "{shared}/ckpt/epoch_0"),
        epochs=(1, 2),
        absent=("epoch 0:",),
        after=("checkpointing[by_epoch]",),
    ),
    Example(
        # 2 processes: step_2 ends epoch 0, so the resumed run starts at epoch 1
        "checkpointing[load_states_by_steps]",
        "by_feature/checkpointing.py",
        ("--resume_from_checkpoint", "{shared}/ckpt/step_2"),
        epochs=(1, 2),
        absent=("epoch 0:",),
        after=("checkpointing[by_steps]",),
    ),
    Example(
        "cross_validation[num_folds=2]",
        "by_feature/cross_validation.py",
        ("--num_folds", "2"),
        needs=(*NLP, "sklearn"),
        epochs=(0, 1, 2, 0, 1, 2),  # each fold's, then all folds' test predictions averaged
        expect=(r"Average test metrics from all folds: \{'accuracy'",),
        metric_n=None,  # the folds' validation sets, then the test set
    ),
    Example("ddp_comm_hook", "by_feature/ddp_comm_hook.py"),
    Example("ddp_comm_hook[fp16]", "by_feature/ddp_comm_hook.py", ("--ddp_comm_hook", "fp16")),
    Example("early_stopping", "by_feature/early_stopping.py"),
    Example("gradient_accumulation", "by_feature/gradient_accumulation.py"),
    Example(
        "gradient_accumulation[steps=2]",
        "by_feature/gradient_accumulation.py",
        ("--gradient_accumulation_steps", "2"),
    ),
    Example(
        "gradient_accumulation_for_autoregressive_models[steps=2]",
        "by_feature/gradient_accumulation_for_autoregressive_models.py",
        ("--gradient_accumulation_steps", "2"),
        needs=("datasets", "transformers"),
        expect=(r"(?m)^epoch 2:: eval perplexity: [\d.]+ ",),
        metric_n=None,
    ),
    Example("local_sgd", "by_feature/local_sgd.py"),
    Example("memory", "by_feature/memory.py"),
    Example("automatic_gradient_accumulation", "by_feature/automatic_gradient_accumulation.py"),
    Example("multi_process_metrics", "by_feature/multi_process_metrics.py"),
    Example(
        "profiler",
        "by_feature/profiler.py",
        ("--record_shapes", "--output_trace_dir", "{run}/traces"),
        files=("{run}/traces/*.json",),
    ),
    Example("schedule_free", "by_feature/schedule_free.py", needs=(*NLP, "schedulefree")),
    Example(
        "tracking",
        "by_feature/tracking.py",
        ("--with_tracking", "--project_dir", "{run}/logs"),
        files=("{run}/logs/tracking/events.out.tfevents.*",),
    ),
    # Hugging Face's run_clm_no_trainer, as these two examples adapt it: without DeepSpeed or
    # Megatron-LM configured they would train with DDP, but each imports its integration's
    # names first (in Accelerate 1.15 DummyOptim needs deepspeed installed, too)
    Example(
        "deepspeed_with_config_support",
        "by_feature/deepspeed_with_config_support.py",
        (*CLM_ARGS, "--output_dir", "{run}/model"),
        needs=("datasets", "transformers"),
        differs="the DeepSpeed integration is Accelerate's own: DummyOptim",
        raises=re.escape(_ONLY.format("DummyOptim")),
    ),
    Example(
        "megatron_lm_gpt_pretraining",
        "by_feature/megatron_lm_gpt_pretraining.py",
        (*CLM_ARGS, "--output_dir", "{run}/model"),
        # it imports transformers.utils.send_example_telemetry, gone in Transformers 5
        needs=("datasets", "transformers.utils:send_example_telemetry"),
        differs="big-model inference is Accelerate's own: init_empty_weights",
        raises=re.escape(_ONLY.format("init_empty_weights")),
    ),
    Example(
        "fsdp_with_peak_mem_tracking",
        "by_feature/fsdp_with_peak_mem_tracking.py",
        ("--model_name_or_path", "bert-base-cased"),
        needs=(*NLP, "psutil"),
        differs="the FSDP integration is Accelerate's own: FullyShardedDataParallelPlugin",
        raises=re.escape(_ONLY.format("FullyShardedDataParallelPlugin")),
    ),
]
BY_ID = {e.id: e for e in EXAMPLES}


# ------------------------------------------------------------------------------ running


def checkout() -> Path:
    root = os.environ.get(ENV)
    if not root:
        pytest.skip(WHY_A_CHECKOUT)
    path = Path(root).expanduser().resolve()
    if not (path / "examples" / "nlp_example.py").is_file():
        pytest.fail(f"{ENV}={root}: no examples/nlp_example.py under it", pytrace=False)
    return path


def _missing(example: Example) -> list[str]:
    """What of ``needs`` is not importable: ``module`` or ``module:attribute``."""
    missing = []
    for need in example.needs:
        module, _, attribute = need.partition(":")
        if importlib.util.find_spec(module.split(".")[0]) is None:
            missing.append(module)
        elif attribute and not hasattr(importlib.import_module(module), attribute):
            missing.append(f"{module}.{attribute}")
    return missing


@functools.cache
def workspace() -> Path:
    """One directory for this pytest process: the chains' shared checkpoints, each case's
    run directory, the synthetic images."""
    return Path(tempfile.mkdtemp(prefix="accelerate-examples-"))


@dataclass
class Run:
    returncode: int
    stderr: str
    rank0: str
    metrics: dict[int, list[dict]]
    paths: dict[str, str]


@pytest.fixture(scope="module", autouse=True)
def _remove_workspace() -> Iterator[None]:
    yield
    if workspace.cache_info().currsize:
        shutil.rmtree(workspace(), ignore_errors=True)
    workspace.cache_clear()
    run.cache_clear()


@functools.cache
def run(case_id: str, mode: str = "ours") -> Run:
    """Run one case (once per pytest process and mode: ``ours``, or ``real`` Accelerate
    for a reference), after the cases it reads."""
    example = BY_ID[case_id]
    for earlier in example.after:
        done = run(earlier, mode)
        assert done.returncode == 0, f"{earlier}, which {case_id} resumes from, failed"
    root = workspace() / mode
    slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", case_id)
    paths = {
        "run": str(root / "runs" / slug),
        "shared": str(root / "shared"),
        "pets": str(workspace() / "pets"),
    }
    if "{pets}" in " ".join(example.args) and not Path(paths["pets"]).is_dir():
        from ._examples_runner import synthetic_pets

        synthetic_pets(Path(paths["pets"]))
    out = root / "out" / slug
    env = kernel_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    command = [
        sys.executable,
        "-m",
        "tests._examples_runner",
        "--mode",
        mode,
        "--checkout",
        str(checkout()),
        "--out",
        str(out),
        "--workdir",
        paths["run"],
        example.script,
        *(a.format(**paths) for a in example.args),
    ]
    done = subprocess.run(
        command,
        env=env,
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=example.timeout,
    )
    log = out / "rank0.log"
    metrics = {}
    for rank in (0, 1):
        record = out / f"metric-rank{rank}.jsonl"
        if record.exists():
            metrics[rank] = [json.loads(line) for line in record.read_text().splitlines()]
    return Run(
        done.returncode,
        done.stdout[-6000:] + done.stderr[-6000:],
        log.read_text() if log.exists() else "",
        metrics,
        paths,
    )


# ------------------------------------------------------------------------------ checks


def _epoch_lines(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"^epoch (\d+):", text, flags=re.M)]


def check(example: Example) -> Run:
    checkout()  # skips first without one: the reason that matters
    missing = _missing(example)
    if missing:
        pytest.skip(f"{example.script} needs {', '.join(missing)} (not importable here)")
    done = run(example.id)
    if example.differs is not None:
        assert done.returncode != 0, (
            f"{example.id} now runs: the documented difference ({example.differs}) is gone; "
            "update this case and the README's differences from Accelerate"
        )
        assert example.raises is not None and re.search(example.raises, done.stderr), (
            f"{example.id} was expected to fail only because {example.differs}; it failed "
            f"with:\n{done.stderr}"
        )
        return done
    assert done.returncode == 0, f"{example.id} failed:\n{done.stderr}"
    if example.epochs is not None:
        assert _epoch_lines(done.rank0) == list(example.epochs), done.rank0[-3000:]
    for text in example.absent:
        assert text not in done.rank0, f"{text!r} printed:\n{done.rank0[-3000:]}"
    for pattern in example.expect:
        assert re.search(pattern, done.rank0), f"no {pattern!r} in:\n{done.rank0[-3000:]}"
    if example.metric_n is not None:
        assert set(done.metrics) == {0, 1}, "the metric was not computed on both ranks"
        for rank, records in done.metrics.items():
            seen = [r["n"] for r in records]
            assert seen and all(n == example.metric_n for n in seen), (
                f"rank {rank}'s metric saw {seen} predictions, not the {example.metric_n} "
                "of the evaluation set"
            )
        assert done.metrics[0] == done.metrics[1], "the ranks computed different metrics"
    for pattern in example.files:
        found = list(Path("/").glob(pattern.format(**done.paths).lstrip("/")))
        assert found, f"nothing matches {pattern.format(**done.paths)}"
    if example.same_weights is not None:
        first, second = (Path(p.format(**done.paths)) for p in example.same_weights)
        assert first.read_bytes() == second.read_bytes(), (
            f"the resumed run's weights ({second}) differ from the uninterrupted run's ({first})"
        )
    return done


@pytest.mark.timeout(900)
@pytest.mark.parametrize("example", [pytest.param(e, id=e.id) for e in EXAMPLES])
def test_example(example: Example) -> None:
    check(example)


def _reported(text: str) -> list[str]:
    """What a run reports per epoch: each line's text from its "epoch N" on (log prefixes,
    timings and tables left out)."""
    lines = []
    for line in text.splitlines():
        found = re.search(r"\bepoch \d+\S*\s.*", line)
        if found:
            lines.append(found.group(0))
    return lines


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "example",
    [pytest.param(e, id=e.id) for e in EXAMPLES if e.differs is None and e.reference == ""],
)
def test_same_results_as_accelerate(example: Example) -> None:
    """Same script, seed and stand-ins, run by the real Accelerate 1.15 in the same ranks:
    the same epoch reports, the same predictions handed to the metric, the same weights
    saved. ("Code written for Accelerate runs after changing the import" -- and computes
    the same thing.)"""
    ours = check(example)
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("needs accelerate (the test extra) for the reference run")
    theirs = run(example.id, "real")
    assert theirs.returncode == 0, f"real Accelerate failed:\n{theirs.stderr}"
    assert _reported(ours.rank0) == _reported(theirs.rank0)
    assert ours.metrics == theirs.metrics, "the metric saw other predictions"
    for pattern in example.files:
        if pattern.endswith(".safetensors"):
            mine, real = (Path(pattern.format(**r.paths)) for r in (ours, theirs))
            assert mine.read_bytes() == real.read_bytes(), f"{mine.name} differs"


def test_skips_without_a_checkout_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the variable the cases skip with the reason, rather than fail or pass."""
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="ship in no release artifact"):
        checkout()
