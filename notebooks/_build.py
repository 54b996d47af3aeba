"""Source of the teaching notebooks: ``python notebooks/_build.py [--no-execute] [NAME ...]``.

The notebooks are written here, as plain Python, so that a change to one of them reviews as
a diff of prose and code rather than of JSON. Running this script rewrites the ``.ipynb``
files, runs them on the shipped "Python 3 (notebook_launcher)"
kernel (installed into a temporary prefix) and stores their outputs, which nbval compares
against (``tests/test_notebooks.py`` checks that the files are in step with this script).

Cell tags understood by nbval: ``nbval-ignore-output`` (output varies: a dashboard, a
timing), ``raises-exception`` (the cell is meant to fail). Everything else is compared
after ``sanitize.cfg``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
KERNEL_NAME = "notebook-launcher"
DISPLAY_NAME = "Python 3 (notebook_launcher)"
IGNORE = "nbval-ignore-output"
RAISES = "raises-exception"


def md(text: str) -> Any:
    return new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str, *tags: str) -> Any:
    cell = new_code_cell(textwrap.dedent(text).strip())
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


# ----------------------------------------------------------------------------------------------
# 01 quickstart
# ----------------------------------------------------------------------------------------------


def quickstart() -> list[Any]:
    return [
        md(
            """
            # 1 · Quickstart: one function, two ranks

            In this notebook you will

            1. write an ordinary Python function in a cell,
            2. run it in **two processes at once** (two *ranks*) with `notebook_launcher`,
            3. watch both ranks on the live dashboard,
            4. get every rank's return value back as a Python list.

            No GPU is needed. On a CPU-only machine each rank is a CPU process and the ranks
            talk to each other over PyTorch's `gloo` backend; on a GPU machine each rank gets
            its own GPU, and the same code runs unchanged.
            """
        ),
        md(
            """
            ## What does this machine offer?

            This notebook runs on the **Python 3 (notebook_launcher)** kernel. It loads a small
            IPython extension whose `%nl_info` magic shows what the launcher will work with:
            versions, devices, and how the workers will be started.
            """
        ),
        code("%nl_info", IGNORE),
        md(
            """
            ## 1. Write the function

            The function you launch runs **inside every rank**. When it starts,
            `torch.distributed` is already set up: each rank knows its own number
            (`dist.get_rank()`) and how many ranks there are (`dist.get_world_size()`), and the
            ranks can exchange tensors.

            Below, every rank contributes `rank + 1`. `all_reduce` adds up the contributions of
            all ranks and gives the sum to every rank: with two ranks, 1 + 2 = 3.
            """
        ),
        code(
            """
            import os

            import torch
            import torch.distributed as dist

            from notebook_launcher import notebook_launcher


            def hello(scale):
                rank = dist.get_rank()
                world_size = dist.get_world_size()
                device = "cuda" if torch.cuda.is_available() else "cpu"  # this rank's GPU, or the CPU
                total = torch.tensor([rank + 1.0], device=device)
                dist.all_reduce(total)  # sum over all ranks; every rank receives it
                print(f"rank {rank} of {world_size}: the sum is {total.item()}")
                return {"rank": rank, "pid": os.getpid(), "total": total.item() * scale}
            """
        ),
        md(
            """
            ## 2. Launch it on two ranks

            `notebook_launcher(fn, args=..., num_processes=N)` starts `N` worker processes,
            calls `fn(*args)` in each of them, and waits until all have finished. Meanwhile the
            dashboard under the cell shows one row per rank: whether it is running, finished or
            failed, what it printed, and its progress bars.
            """
        ),
        code("results = notebook_launcher(hello, args=(10,), num_processes=2)", IGNORE),
        md(
            """
            ## 3. Read the results

            The launcher returns a list with **one entry per rank, indexed by rank**:
            `results[0]` came from rank 0, `results[1]` from rank 1. Each rank ran in its own
            process (two different pids, neither of them this notebook's), and every rank saw
            the same sum.
            """
        ),
        code(
            """
            for r in results:
                print(f"rank {r['rank']}: total = {r['total']}")

            assert [r["rank"] for r in results] == [0, 1]  # index = rank
            assert [r["total"] for r in results] == [30.0, 30.0]  # (1 + 2) * 10 on every rank
            assert len({r["pid"] for r in results} | {os.getpid()}) == 3  # 2 workers + this kernel
            """
        ),
        md(
            """
            ## 4. Progress bars go to the dashboard

            A `tqdm` bar inside a rank is drawn on the dashboard, one bar per rank, so a slow
            rank stands out. Here rank 1 sleeps twice as long per step as rank 0.
            """
        ),
        code(
            """
            import time

            from tqdm.auto import tqdm


            def count(steps):
                rank = dist.get_rank()
                done = 0
                for _ in tqdm(range(steps), desc="counting"):
                    time.sleep(0.01 * (rank + 1))
                    done += 1
                return done


            counts = notebook_launcher(count, args=(40,), num_processes=2)
            """,
            IGNORE,
        ),
        code(
            """
            print(counts)
            assert counts == [40, 40]
            """
        ),
        md(
            """
            ## What you learned

            * `notebook_launcher(fn, args, num_processes)` runs `fn` on every rank and returns
              the list of their results, index = rank.
            * Inside `fn`, `torch.distributed` is ready: `get_rank()`, `get_world_size()`,
              collectives such as `all_reduce`.
            * The dashboard shows each rank's state, output and progress while it runs.

            Next: **02_execution_process** — running code on one rank only, waiting for each
            other, and splitting work between ranks.
            """
        ),
    ]


# ----------------------------------------------------------------------------------------------
# 02 execution process
# ----------------------------------------------------------------------------------------------


def execution_process() -> list[Any]:
    return [
        md(
            """
            # 2 · The execution process: who runs what, and when

            With several ranks running the same function, you constantly need to say *"only
            one rank does this"* (print, save, download) or *"nobody goes on until everybody
            is here"*. This notebook demonstrates, live, every tool of Accelerate's
            ["Execution process"](https://huggingface.co/docs/accelerate/basic_tutorials/execution)
            and ["Deferring executions"](https://huggingface.co/docs/accelerate/concept_guides/deferring_execution)
            pages, with the same names.

            They live on `PartialState`, which needs no model or optimizer; an `Accelerator`
            has all of them too (`accelerator.is_main_process`, `accelerator.wait_for_everyone()`,
            ...). Code written for Accelerate runs after changing the import.

            Every launch returns what the ranks observed, and a cell after it **checks** that
            observation: if a feature broke, this notebook fails.
            """
        ),
        code(
            """
            import contextlib
            import io
            import shutil
            import tempfile
            import time
            from pathlib import Path

            from notebook_launcher import PartialState, notebook_launcher

            workdir = Path(tempfile.mkdtemp(prefix="execution-process-"))
            """
        ),
        md(
            """
            ## 1. Who am I? `is_main_process` and `is_local_main_process`

            Every rank has a global index, `process_index` (0 ... `num_processes - 1`), and an
            index on its own machine, `local_process_index`. The **main process** is global
            rank 0; each machine also has a **local main process** (its local rank 0). On a
            single machine they are the same rank. With two machines of two GPUs, global
            rank 2 would be the local main process of the second machine, but not the main
            process.
            """
        ),
        code(
            """
            def who_am_i():
                state = PartialState()
                return {
                    "process_index": state.process_index,
                    "local_process_index": state.local_process_index,
                    "num_processes": state.num_processes,
                    "is_main_process": state.is_main_process,
                    "is_local_main_process": state.is_local_main_process,
                    "is_last_process": state.is_last_process,
                }


            identities = notebook_launcher(who_am_i, num_processes=2)
            """,
            IGNORE,
        ),
        code(
            """
            for identity in identities:
                print(identity)

            assert [i["process_index"] for i in identities] == [0, 1]
            assert [i["is_main_process"] for i in identities] == [True, False]
            assert [i["is_local_main_process"] for i in identities] == [True, False]
            assert [i["is_last_process"] for i in identities] == [False, True]
            """
        ),
        md(
            """
            ## 2. Printing once: `state.print`, and one progress bar

            A plain `print` runs on every rank, so a log line appears once per rank.
            `state.print(...)` prints once per machine, on the local main process. The same
            idea gives a single progress bar instead of one per rank:
            `tqdm(..., disable=not state.is_local_main_process)`.

            To prove it, each rank captures what it printed and reports whether its bar was
            shown.
            """
        ),
        code(
            """
            from tqdm.auto import tqdm


            def print_once():
                state = PartialState()
                captured = io.StringIO()
                with contextlib.redirect_stdout(captured):
                    print(f"plain print from rank {state.process_index}")
                    state.print("state.print: epoch 1 finished")
                bar = tqdm(range(20), desc="epoch 1", disable=not state.is_local_main_process)
                bar_shown = not bar.disable
                for _ in bar:
                    time.sleep(0.01)
                return {"printed": captured.getvalue(), "bar_shown": bar_shown}


            printed = notebook_launcher(print_once, num_processes=2)
            """,
            IGNORE,
        ),
        code(
            """
            for rank, seen in enumerate(printed):
                print(f"--- rank {rank} printed:\\n{seen['printed']}", end="")
                print(f"    and showed a progress bar: {seen['bar_shown']}")

            assert printed[0]["printed"].count("state.print") == 1
            assert "state.print" not in printed[1]["printed"]
            assert [p["bar_shown"] for p in printed] == [True, False]
            """
        ),
        md(
            """
            ## 3. Functions that run on one process only

            Decorators make a function run on a chosen process and do nothing elsewhere:

            | decorator | runs on |
            |---|---|
            | `@state.on_main_process` | global rank 0 (logging to a tracker, saving) |
            | `@state.on_local_main_process` | local rank 0 of every machine (unzipping to local disk) |
            | `@state.on_process(process_index=i)` | global rank `i` |
            | `@state.on_local_process(local_process_index=i)` | local rank `i` of every machine |
            | `@state.on_last_process` | the last rank |

            Each decorated function below records its name when it actually runs.
            """
        ),
        code(
            """
            def decorated():
                state = PartialState()
                ran = []

                @state.on_main_process
                def log_to_tracker():
                    ran.append("on_main_process")

                @state.on_local_main_process
                def unzip_to_local_disk():
                    ran.append("on_local_main_process")

                @state.on_process(process_index=1)
                def only_rank_1():
                    ran.append("on_process(process_index=1)")

                @state.on_local_process(local_process_index=1)
                def only_local_rank_1():
                    ran.append("on_local_process(local_process_index=1)")

                @state.on_last_process
                def only_the_last():
                    ran.append("on_last_process")

                for f in (log_to_tracker, unzip_to_local_disk, only_rank_1, only_local_rank_1, only_the_last):
                    f()
                return ran


            ran = notebook_launcher(decorated, num_processes=2)
            """,
            IGNORE,
        ),
        code(
            """
            for rank, names in enumerate(ran):
                print(f"rank {rank} ran: {names}")

            assert ran[0] == ["on_main_process", "on_local_main_process"]
            assert ran[1] == [
                "on_process(process_index=1)",
                "on_local_process(local_process_index=1)",
                "on_last_process",
            ]
            """
        ),
        md(
            """
            ## 4. Waiting for everyone: `wait_for_everyone`

            Ranks run at their own pace. `state.wait_for_everyone()` is a **barrier**: no rank
            goes past it until every rank has reached it.

            Here rank 1 is slow and writes a file; rank 0 reads that file right after the
            barrier. Without the barrier rank 0 would look too early and crash with
            `FileNotFoundError`. While rank 0 waits, the dashboard shows the barrier it waits
            in and the line of code it came from.
            """
        ),
        code(
            """
            def barrier_demo(folder):
                state = PartialState()
                message = Path(folder) / "message-from-rank-1.txt"
                if state.process_index == 1:
                    time.sleep(0.5)  # rank 1 is slow ...
                    message.write_text("rank 1 was here")
                state.wait_for_everyone()  # ... and nobody passes this line before it arrives
                return message.read_text()


            messages = notebook_launcher(barrier_demo, args=(str(workdir),), num_processes=2)
            """,
            IGNORE,
        ),
        code(
            """
            print(messages)
            assert messages == ["rank 1 was here", "rank 1 was here"]
            """
        ),
        md(
            """
            ## 5. One download, read by everyone: `main_process_first`

            Downloading a dataset on every rank at once wastes bandwidth and can corrupt the
            cache. In `with state.main_process_first():` the main process runs the block
            **first**; the other ranks wait at the start of the block and run it once the main
            process has finished it, finding the data already there.

            Each rank writes what it did to a shared log, so we can check the order.
            """
        ),
        code(
            """
            def load_dataset(folder):
                state = PartialState()
                data_file = Path(folder) / "dataset.csv"
                log = Path(folder) / "log.txt"

                def note(message):
                    with open(log, "a") as f:
                        f.write(f"rank {state.process_index}: {message}\\n")

                with state.main_process_first():
                    if data_file.exists():
                        note("dataset already there, reading it")
                    else:
                        note("downloading the dataset")
                        time.sleep(0.5)  # a slow download
                        data_file.write_text(",".join(str(i) for i in range(10)))
                    numbers = [int(x) for x in data_file.read_text().split(",")]
                return sum(numbers)


            sums = notebook_launcher(load_dataset, args=(str(workdir),), num_processes=2)
            """,
            IGNORE,
        ),
        code(
            """
            log = (workdir / "log.txt").read_text()
            print(log, end="")
            print("sums:", sums)

            assert log.splitlines() == [
                "rank 0: downloading the dataset",
                "rank 1: dataset already there, reading it",
            ]
            assert sums == [45, 45]
            """
        ),
        md(
            """
            ## 6. Sharing out work: `split_between_processes`

            For inference over a list of inputs, `with state.split_between_processes(inputs) as
            mine:` gives each rank its own slice. With 5 prompts and 2 ranks, rank 0 gets 3 and
            rank 1 gets 2.

            Collectives such as `gather` need the same number of items on every rank. With
            `apply_padding=True` a shorter slice is padded by repeating its last item, so every
            rank has 3; after gathering, keep the first `len(inputs)` results to drop the
            padding.
            """
        ),
        code(
            """
            import torch.distributed as dist


            def split_demo():
                state = PartialState()
                prompts = ["a cat", "a dog", "a bird", "a fish", "a frog"]
                with state.split_between_processes(prompts) as mine:
                    plain = list(mine)
                with state.split_between_processes(prompts, apply_padding=True) as mine:
                    padded = list(mine)
                    answers = [p.upper() for p in padded]  # the "model"
                gathered = [None] * state.num_processes
                dist.all_gather_object(gathered, answers)  # needs equal lengths: padding
                every_answer = [a for part in gathered for a in part]
                return {"plain": plain, "padded": padded, "results": every_answer[: len(prompts)]}


            shares = notebook_launcher(split_demo, num_processes=2)
            """,
            IGNORE,
        ),
        code(
            """
            for rank, share in enumerate(shares):
                print(f"rank {rank}: plain={share['plain']}  padded={share['padded']}")
            print("results:", shares[0]["results"])

            assert [s["plain"] for s in shares] == [["a cat", "a dog", "a bird"], ["a fish", "a frog"]]
            assert shares[1]["padded"] == ["a fish", "a frog", "a frog"]  # its last item, repeated
            assert shares[0]["results"] == ["A CAT", "A DOG", "A BIRD", "A FISH", "A FROG"]
            """
        ),
        md(
            """
            ## 7. Stopping everyone early: `set_trigger` and `check_trigger`

            Early stopping is a trap in distributed training: if one rank decides to stop and
            `break`s out of the loop, the others wait forever for it in the next collective.
            Instead, the rank that wants to stop calls `state.set_trigger()`, and **every** rank
            calls `state.check_trigger()` at the same place in the loop; it returns `True` on
            all ranks as soon as any rank set the trigger, so they all stop at the same step.

            Below, only rank 1's validation loss drops under the threshold (at step 3).
            """
        ),
        code(
            """
            def train_with_early_stopping():
                state = PartialState()
                losses = {
                    0: [0.9, 0.7, 0.5, 0.4, 0.3, 0.2],
                    1: [0.8, 0.6, 0.4, 0.05, 0.3, 0.2],
                }[state.process_index]
                for step, loss in enumerate(losses):
                    if loss < 0.1:
                        state.set_trigger()  # only this rank wants to stop ...
                    if state.check_trigger():  # ... and every rank learns about it here
                        return {"stopped_at_step": step, "loss": loss}
                return {"stopped_at_step": None, "loss": losses[-1]}


            stops = notebook_launcher(train_with_early_stopping, num_processes=2)
            """,
            IGNORE,
        ),
        code(
            """
            for rank, stop in enumerate(stops):
                print(f"rank {rank}: {stop}")

            assert [s["stopped_at_step"] for s in stops] == [3, 3]  # both ranks stop together
            shutil.rmtree(workdir)
            """
        ),
        md(
            """
            ## What you learned

            * `is_main_process` / `is_local_main_process` / `is_last_process` and `process_index`
              tell a rank who it is.
            * `state.print` prints once; `on_main_process`, `on_local_main_process`,
              `on_process`, `on_local_process` and `on_last_process` run a function on chosen
              ranks only.
            * `wait_for_everyone` is a barrier; `main_process_first` lets rank 0 prepare what
              the others then read.
            * `split_between_processes` shares inputs out, with padding when results are
              gathered.
            * `set_trigger` / `check_trigger` stop every rank at the same step.

            Next: **03_training** — a model trained with `Accelerator.prepare`.
            """
        ),
    ]


# ----------------------------------------------------------------------------------------------
# 03 training
# ----------------------------------------------------------------------------------------------


def training() -> list[Any]:
    return [
        md(
            """
            # 3 · Training with the `Accelerator`

            A small regression model, trained on two ranks the way Accelerate does it:

            1. `accelerator.prepare(...)` wraps the model for distributed training and gives
               each rank its own part of the data;
            2. **gradient accumulation** (`GradientAccumulationPlugin`) adds up the gradients
               of several batches before each optimizer step;
            3. `accelerator.gather_for_metrics` collects the predictions of all ranks for
               evaluation, without the duplicates that make the last batch even;
            4. `accelerator.save_model` writes the weights as **safetensors** shards;
            5. back in this notebook, we load those shards into a fresh model and check it.
            """
        ),
        md(
            """
            ## The data and the model

            The data is synthetic so the notebook runs anywhere in seconds: `y = x · w + b` plus
            a little noise, with 8 input features. Everything the ranks need is created
            inside the training function from fixed seeds, so every rank starts from the same
            model.
            """
        ),
        code(
            """
            import json
            import shutil
            import tempfile
            from pathlib import Path

            import torch
            from torch.utils.data import DataLoader, TensorDataset

            from notebook_launcher import Accelerator, notebook_launcher
            from notebook_launcher.utils import GradientAccumulationPlugin

            N_FEATURES = 8


            def make_data(n_samples, seed):
                g = torch.Generator().manual_seed(seed)
                true_w = torch.arange(1.0, N_FEATURES + 1) / N_FEATURES
                x = torch.randn(n_samples, N_FEATURES, generator=g)
                y = x @ true_w + 0.5 + 0.01 * torch.randn(n_samples, generator=g)
                return TensorDataset(x, y.unsqueeze(1))


            def make_model():
                torch.manual_seed(0)
                return torch.nn.Sequential(
                    torch.nn.Linear(N_FEATURES, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
                )
            """
        ),
        md(
            """
            ## The training function

            Read it top to bottom; the Accelerate-specific lines are commented. Note the
            evaluation set has **50** samples: with 2 ranks and batches of 8, the last batch
            is padded with repeated samples so that both ranks have the same number of
            batches. `gather_for_metrics` drops those repeats, so we evaluate on exactly 50
            predictions.
            """
        ),
        code(
            """
            def train(out_dir, epochs=4, accumulation_steps=2):
                accelerator = Accelerator(
                    gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=accumulation_steps)
                )
                model = make_model()
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                train_loader = DataLoader(make_data(512, seed=1), batch_size=16, shuffle=True)
                eval_loader = DataLoader(make_data(50, seed=2), batch_size=8)

                # One call wraps everything for distributed training.
                model, optimizer, train_loader, eval_loader = accelerator.prepare(
                    model, optimizer, train_loader, eval_loader
                )

                optimizer_steps = 0
                for _epoch in range(epochs):
                    model.train()
                    for x, y in train_loader:
                        # Inside accumulate(), gradients are only synchronised and applied
                        # every `accumulation_steps` batches.
                        with accelerator.accumulate(model):
                            loss = torch.nn.functional.mse_loss(model(x), y)
                            accelerator.backward(loss)
                            optimizer.step()
                            optimizer.zero_grad()
                        if accelerator.sync_gradients:
                            optimizer_steps += 1

                model.eval()
                predictions, targets = [], []
                with torch.no_grad():
                    for x, y in eval_loader:
                        # Collect every rank's predictions, minus the padding repeats.
                        p, t = accelerator.gather_for_metrics((model(x), y))
                        predictions.append(p)
                        targets.append(t)
                predictions, targets = torch.cat(predictions), torch.cat(targets)
                eval_mse = torch.nn.functional.mse_loss(predictions, targets).item()

                accelerator.wait_for_everyone()
                # Writes safetensors shards (small shards here, to see several files).
                accelerator.save_model(model, out_dir, max_shard_size="1KB")
                return {
                    "rank": accelerator.process_index,
                    "train_batches_seen": len(train_loader) * epochs,
                    "optimizer_steps": optimizer_steps,
                    "eval_samples": len(predictions),
                    "eval_mse": eval_mse,
                }
            """
        ),
        md("## Launch it on two ranks"),
        code(
            """
            out_dir = Path(tempfile.mkdtemp(prefix="training-")) / "model"
            results = notebook_launcher(train, args=(str(out_dir),), num_processes=2)
            """,
            IGNORE,
        ),
        md(
            """
            ## What each rank saw

            The 512 training samples are split between the ranks: 256 each per epoch, that
            is 16 batches of 16. Over 4 epochs each rank saw 64 batches and, accumulating
            over 2 batches, stepped its optimizer 32 times. Both ranks evaluated the same 50
            gathered predictions.
            """
        ),
        code(
            """
            for r in results:
                print(
                    f"rank {r['rank']}: {r['train_batches_seen']} batches, "
                    f"{r['optimizer_steps']} optimizer steps, {r['eval_samples']} eval samples"
                )

            assert [r["train_batches_seen"] for r in results] == [64, 64]
            assert [r["optimizer_steps"] for r in results] == [32, 32]
            assert [r["eval_samples"] for r in results] == [50, 50]
            assert results[0]["eval_mse"] == results[1]["eval_mse"] < 0.3  # variance of y: ~3.4
            """
        ),
        md(
            """
            The model learned the function: its error on the evaluation set is a tiny
            fraction of the variance of `y` (the error of always predicting the mean).
            """
        ),
        code(
            """
            y_eval = make_data(50, seed=2).tensors[1]
            print(f"eval MSE {results[0]['eval_mse']:.4f}, variance of y {y_eval.var().item():.2f}")
            """,
            IGNORE,
        ),
        md(
            """
            ## The saved files

            `save_model` wrote the weights in shards of about `max_shard_size` each (a tensor
            is never split), plus an index that says which tensor lives in which shard. Only
            the main process writes; every rank waits until the files exist.
            """
        ),
        code(
            """
            for f in sorted(out_dir.iterdir()):
                print(f.name)

            index = json.loads((out_dir / "model.safetensors.index.json").read_text())
            shards = sorted(set(index["weight_map"].values()))
            assert len(shards) > 1 and all(s.endswith(".safetensors") for s in shards)
            assert sorted(index["weight_map"]) == sorted(make_model().state_dict())
            """
        ),
        md(
            """
            ## Reload the model here, in the notebook

            The shards are plain safetensors files: load each, merge them, and load the result
            into a fresh model. Evaluated here, on one process, it gives the same error the
            ranks measured together.
            """
        ),
        code(
            """
            from safetensors.torch import load_file

            state_dict = {}
            for shard in shards:
                state_dict.update(load_file(out_dir / shard))

            model = make_model()
            model.load_state_dict(state_dict)
            model.eval()

            x, y = make_data(50, seed=2).tensors
            with torch.no_grad():
                mse = torch.nn.functional.mse_loss(model(x), y).item()
            print(f"reloaded model: eval MSE matches the ranks' = {abs(mse - results[0]['eval_mse']) < 1e-5}")
            assert abs(mse - results[0]["eval_mse"]) < 1e-5
            shutil.rmtree(out_dir.parent)
            """
        ),
        md(
            """
            ## What you learned

            * `accelerator.prepare` shards the data loaders and wraps the model and optimizer.
            * `with accelerator.accumulate(model):` plus `GradientAccumulationPlugin(num_steps=k)`
              steps the optimizer every `k` batches (`accelerator.sync_gradients` tells you when).
            * `gather_for_metrics` returns every rank's outputs without the padding repeats.
            * `save_model(..., max_shard_size=...)` writes safetensors shards and an index that
              any process can load.

            Next: **04_debugging** — what it looks like when a rank goes wrong.
            """
        ),
    ]


# ----------------------------------------------------------------------------------------------
# 04 debugging
# ----------------------------------------------------------------------------------------------


def debugging() -> list[Any]:
    return [
        md(
            """
            # 4 · Debugging: when a rank goes wrong

            Distributed bugs are confusing because one rank's mistake shows up as trouble on
            all of them: the others hang, time out or lose their connection. The launcher
            sorts this out for you. For each failure it tells you **which rank** went wrong
            first (the *root cause*) and marks what happened to the others as *collateral*.

            Three classic failures, each shown twice: first as you would meet it (the cell
            fails, with the dashboard and the error), then caught in `try`/`except` to read
            the error's details.
            """
        ),
        code(
            """
            import os
            import signal
            import time

            import torch.distributed as dist

            from notebook_launcher import PartialState, ProcessGroupMismatch, WorkerDied, notebook_launcher
            from notebook_launcher.ui.widgets import WidgetView
            """
        ),
        md(
            """
            ## 1. A rank raises an exception

            Rank 1 finds a bad batch and raises `ValueError`, while rank 0 waits for it in a
            barrier. The cell fails with **rank 1's own exception type**, and the traceback
            below it is the one from rank 1, pointing at the line in this notebook that raised.
            """
        ),
        code(
            """
            def bad_batch_on_rank_1():
                rank = dist.get_rank()
                if rank == 1:
                    raise ValueError("batch 7 has 3 labels for 4 samples")
                dist.barrier()  # rank 0 waits here for rank 1, which never comes
                return rank


            notebook_launcher(bad_batch_on_rank_1, num_processes=2)
            """,
            IGNORE,
            RAISES,
        ),
        md(
            """
            Because it is the worker's own exception type, you can catch it as usual (this
            time without the dashboard: `dashboard=False`). It also carries `launch_failure`,
            every rank's record. Its `root_cause` is the rank to look at. Rank 0 did nothing
            wrong: depending on timing it was either stopped by the launcher or failed with
            gloo's "Connection closed by peer", which the summary lists as *collateral*, a
            consequence of rank 1 going away. The worker's traceback is attached as the
            exception's `__cause__`.
            """
        ),
        code(
            """
            try:
                notebook_launcher(bad_batch_on_rank_1, num_processes=2, dashboard=False)
            except ValueError as exc:
                error = exc

            root = error.launch_failure.root_cause
            print(type(error).__name__, "-", error.args[0].splitlines()[0])
            print("root cause:", root.describe())

            assert (root.rank, root.kind, root.exc_type) == (1, "raised", "ValueError")
            assert "in bad_batch_on_rank_1" in error.__cause__.tb  # rank 1's own traceback
            """
        ),
        md(
            """
            ## 2. A rank dies

            A process can also vanish without raising anything: killed by the kernel's
            out-of-memory killer, a segfault in native code, `os._exit`. Rank 1 kills itself
            with `SIGKILL` here. The launcher reports `WorkerDied`, with the signal.
            """
        ),
        code(
            """
            def rank_1_is_killed():
                if dist.get_rank() == 1:
                    os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer does
                dist.barrier()


            notebook_launcher(rank_1_is_killed, num_processes=2)
            """,
            IGNORE,
            RAISES,
        ),
        code(
            """
            try:
                notebook_launcher(rank_1_is_killed, num_processes=2, dashboard=False)
            except WorkerDied as exc:
                error = exc

            root = error.launch_failure.root_cause
            print("root cause:", root.describe())

            assert (root.rank, root.kind, root.signal_name) == (1, "died", "SIGKILL")
            """
        ),
        md(
            """
            ## 3. A rank skips a barrier

            Every rank must reach every barrier (and every collective) in the same order. Here
            only rank 0 calls `wait_for_everyone()`; rank 1 does something else and returns.
            Rank 0 would wait forever. Instead, the launcher sees that rank 1 returned while
            rank 0 still waited for it, ends the launch and raises `ProcessGroupMismatch`,
            naming rank 1. The dashboard's barrier table shows the barrier rank 0 was stuck
            in, the line of the cell it was called from, and which rank never arrived.

            This time we create the dashboard ourselves and pass it in (`dashboard=`), so we
            can read what it showed afterwards.
            """
        ),
        code(
            """
            def rank_1_skips_the_barrier():
                state = PartialState()
                if state.is_main_process:
                    state.wait_for_everyone()  # rank 0 waits here ...
                else:
                    time.sleep(0.5)  # ... while rank 1 does something else ...
                return state.process_index  # ... and returns without ever calling it


            dashboard = WidgetView()
            notebook_launcher(rank_1_skips_the_barrier, num_processes=2, dashboard=dashboard)
            """,
            IGNORE,
            RAISES,
        ),
        md(
            """
            What the dashboard recorded: the first barrier (`#0`), who arrived and from which
            line (`In[n]:4` is line 4 of the cell above), who is missing, and the root cause.
            """
        ),
        code(
            """
            barrier = dashboard.model.barriers[0]
            missing = barrier.missing(dashboard.model.rank_ids)
            line = barrier.locations[0].rsplit(":", 1)[1]
            print(f"barrier #0: {barrier.kind}, rank 0 arrived from line {line}, missing: {missing}")
            print("root cause on the dashboard: rank", dashboard.model.root_cause().rank)

            assert barrier.kind == "wait_for_everyone"
            assert (list(barrier.locations), line, missing) == ([0], "4", [1])
            assert dashboard.model.root_cause().rank == 1
            """
        ),
        code(
            """
            try:
                notebook_launcher(rank_1_skips_the_barrier, num_processes=2, dashboard=False)
            except ProcessGroupMismatch as exc:
                error = exc

            root = error.launch_failure.root_cause
            print("root cause:", root.describe())

            assert (root.rank, root.kind) == (1, "left")
            assert "rank 0 still waited for it at" in root.describe()  # and where
            """
        ),
        md(
            """
            ## Reading a failure, in short

            1. Look at the **root cause** rank first; the other ranks' errors are usually
               collateral (a peer closed the connection, a barrier never completed).
            2. "Raised" is a Python exception: its traceback comes from that rank. "Died" is a
               process that ended without raising: look at the signal (`SIGKILL` is often
               memory) or the exit code.
            3. A hang or a `ProcessGroupMismatch` means the ranks did not take the same path
               through the collectives: look at the barrier lines the dashboard shows for each
               rank.
            """
        ),
    ]


NOTEBOOKS: dict[str, Callable[[], list[Any]]] = {
    "01_quickstart.ipynb": quickstart,
    "02_execution_process.ipynb": execution_process,
    "03_training.ipynb": training,
    "04_debugging.ipynb": debugging,
}


def build(name: str) -> Any:
    """The notebook ``name`` without outputs."""
    nb = new_notebook(cells=NOTEBOOKS[name]())
    nb.metadata["kernelspec"] = {
        "name": KERNEL_NAME,
        "display_name": DISPLAY_NAME,
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{Path(name).stem[:2]}-{i:02d}"
    return nb


def execute(nb: Any, name: str) -> None:
    """Run ``nb`` on the shipped kernelspec (installed into a temporary prefix)."""
    from nbclient import NotebookClient

    sys.path.insert(0, str(HERE.parent))
    from notebook_launcher._kernelspec import install

    with tempfile.TemporaryDirectory() as prefix:
        install(prefix=prefix)
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        env["JUPYTER_PATH"] = os.path.join(prefix, "share", "jupyter")
        env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
        old = dict(os.environ)
        os.environ.update(env)  # the kernelspec manager reads JUPYTER_PATH from here
        try:
            client = NotebookClient(
                nb,
                kernel_name=KERNEL_NAME,
                timeout=120,
                resources={"metadata": {"path": str(HERE)}},
                store_widget_state=True,
            )
            client.execute(env=env)
        finally:
            os.environ.clear()
            os.environ.update(old)
    print(f"executed {name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--no-execute", action="store_true", help="write the cells only, without outputs"
    )
    parser.add_argument("names", nargs="*", help="notebooks to build (default: all)")
    args = parser.parse_args(argv)
    for name in args.names or list(NOTEBOOKS):
        nb = build(name)
        if not args.no_execute:
            execute(nb, name)
        nbformat.write(nb, HERE / name)
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
