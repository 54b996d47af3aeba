"""Run Accelerate's example scripts on 2 CPU ranks of notebook_launcher (test_accelerate_examples).

Accelerate's ``examples/nlp_example.py``, ``cv_example.py``, ``complete_*_example.py`` and
``examples/by_feature/*.py`` ship in no release artifact (the sdist and the wheel have no
``examples/``), so they are read from a checkout of Accelerate's repository whose path the
caller gives; nothing of theirs is copied into this repository.

A script runs **unchanged**: each rank executes the file as ``__main__`` with its own
command line (``runpy``), in a working directory of the run. Two things are set up around it
first, from outside:

* ``mode="ours"``: the import shim of ``tests/_parity_shim.py``, so ``import accelerate``
  means notebook_launcher; ``mode="real"``: nothing, the real Accelerate runs (inside our
  ranks, as the launcher sets what ``accelerate launch`` would), for a reference run.
* the Hub stand-ins below (:func:`install_hub_stand_ins`): the scripts download
  ``bert-base-cased`` / ``HuggingFaceTB/SmolLM-360M`` (tokenizer and weights), GLUE MRPC
  and wikitext, the GLUE metric and timm's ``resnet50d`` weights. Here the same calls give
  a tiny tokenizer over a fixed vocabulary, a tiny randomly initialised model built from a
  config of the same family (BERT, Llama, timm's ``test_resnet``), synthetic data of the
  same schema (deterministic, drawn from a private random stream so that the scripts'
  seeded streams are untouched) and a local metric with the GLUE MRPC metric's interface.
  A Hub name with no stand-in raises, so a new example that needs one says so.

Each rank writes what it prints to ``OUT/rank<N>.log`` and what the metric saw to
``OUT/metric-rank<N>.jsonl``; the kernel side (``python -m tests._examples_runner``, a
child process standing in for the notebook kernel) launches the ranks and exits non-zero
with the rank's traceback on stderr when the launch raised.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import runpy
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

#: What every rank's environment gets: nothing may reach the network, and the trackers
#: that can run offline do (as Accelerate's own test_examples sets them).
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "DVCLIVE_TEST": "true",
    "SWANLAB_MODE": "disabled",
    "MLFLOW_ALLOW_FILE_STORE": "true",
}

# ------------------------------------------------------------------------------ stand-ins

#: The synthetic data's sizes. MRPC's train split gives 3 batches of 16 (2 per rank with
#: even batches, as their checkpointing test needs: ``step_2`` ends epoch 0); validation
#: is not a multiple of 2 x 32, so ``gather_for_metrics`` has duplicates to drop.
MRPC_SIZES = {"train": 40, "validation": 41, "test": 24}
WIKITEXT_SIZES = {"train": 520, "validation": 60, "test": 60}

_WORDS = [
    "the",
    "a",
    "an",
    "this",
    "that",
    "company",
    "shares",
    "stock",
    "price",
    "market",
    "year",
    "quarter",
    "said",
    "reported",
    "rose",
    "fell",
    "percent",
    "million",
    "billion",
    "investors",
    "analysts",
    "week",
    "on",
    "in",
    "at",
    "of",
    "to",
    "by",
    "for",
    "with",
    "from",
    "new",
    "old",
    "high",
    "low",
    "strong",
    "weak",
    "growth",
    "sales",
    "profit",
    "loss",
    "bank",
    "court",
    "judge",
    "government",
    "officials",
    "police",
    "city",
    "state",
    "report",
    "deal",
    "plan",
    "talks",
    "agreed",
    "expected",
    "yesterday",
    "today",
    "tuesday",
    "monday",
    "friday",
    ".",
    ",",
    "'s",
]
_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_EOS = "<|endoftext|>"


def _sentence(rng: random.Random, low: int = 5, high: int = 12) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high)))


def _paraphrase(rng: random.Random, sentence: str) -> str:
    words = sentence.split()
    i = rng.randrange(len(words))
    words[i] = rng.choice(_WORDS)
    return " ".join(words)


def synthetic_mrpc() -> Any:
    """GLUE MRPC's schema (sentence1, sentence2, label, idx), small and deterministic."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    features = Features(
        {
            "sentence1": Value("string"),
            "sentence2": Value("string"),
            "label": ClassLabel(names=["not_equivalent", "equivalent"]),
            "idx": Value("int32"),
        }
    )
    rng = random.Random(20)  # private: the scripts' seeded global streams stay untouched
    splits = {}
    for split, size in MRPC_SIZES.items():
        rows: dict[str, list[Any]] = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
        for i in range(size):
            first = _sentence(rng)
            label = int(rng.random() < 0.65)  # MRPC is about two thirds "equivalent"
            rows["sentence1"].append(first)
            rows["sentence2"].append(_paraphrase(rng, first) if label else _sentence(rng))
            rows["label"].append(label)
            rows["idx"].append(i)
        splits[split] = Dataset.from_dict(rows, features=features)
    return DatasetDict(splits)


def synthetic_wikitext() -> Any:
    """wikitext-2's schema (one ``text`` column; empty lines and headings included)."""
    from datasets import Dataset, DatasetDict

    rng = random.Random(103)
    splits = {}
    for split, size in WIKITEXT_SIZES.items():
        lines = []
        for _ in range(size):
            roll = rng.random()
            if roll < 0.75:
                lines.append("")  # wikitext is mostly blank lines: the script filters them
            elif roll < 0.8:
                lines.append(f" = {_sentence(rng, 1, 3)} = \n")
            else:
                lines.append(f" {_sentence(rng, 6, 20)} \n")
        splits[split] = Dataset.from_dict({"text": lines})
    return DatasetDict(splits)


def tiny_bert_tokenizer() -> Any:
    from transformers import BertTokenizer

    vocab = {token: i for i, token in enumerate([*_SPECIAL, *_WORDS])}
    return BertTokenizer(vocab=vocab, do_lower_case=False, model_max_length=128)


def tiny_causal_tokenizer() -> Any:
    """A word-level tokenizer with an end-of-text token and no pad token (as SmolLM's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["[UNK]", _EOS, *_WORDS, "="])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        eos_token=_EOS,
        bos_token=_EOS,
        model_max_length=128,
    )


def tiny_bert_config(**kwargs: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=len(_SPECIAL) + len(_WORDS),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        # wide enough an initialisation that predictions differ from sample to sample, so
        # that the metric's records tell two runs apart
        initializer_range=0.5,
        **kwargs,
    )


def tiny_llama_config(**kwargs: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(_WORDS) + 3,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,  # as SmolLM
        bos_token_id=1,
        eos_token_id=1,
        **kwargs,
    )


class LocalGlueMetric:
    """``evaluate.load("glue", "mrpc")``'s interface: ``add_batch``, ``compute`` (accuracy
    and F1 of class 1, then forgets the batches, as evaluate does). Each ``compute``
    also records the predictions it saw in ``OUT/metric-rank<N>.jsonl``: the
    examples' ``gather_for_metrics`` must hand it exactly the evaluation set."""

    def __init__(self, record: str | None) -> None:
        self._record = record
        self._predictions: list[int] = []
        self._references: list[int] = []

    @staticmethod
    def _ints(values: Any) -> list[int]:
        if hasattr(values, "tolist"):
            values = values.tolist()
        return [int(v) for v in values]

    def add_batch(self, *, predictions: Any = None, references: Any = None) -> None:
        self._predictions += self._ints(predictions)
        self._references += self._ints(references)

    def add(self, *, prediction: Any = None, reference: Any = None) -> None:
        self.add_batch(predictions=[prediction], references=[reference])

    def compute(self, *, predictions: Any = None, references: Any = None) -> dict[str, float]:
        if predictions is not None:
            self.add_batch(predictions=predictions, references=references)
        preds, refs = self._predictions, self._references
        self._predictions, self._references = [], []
        if len(preds) != len(refs):
            raise ValueError(f"{len(preds)} predictions for {len(refs)} references")
        correct = sum(p == r for p, r in zip(preds, refs, strict=True))
        tp = sum(p == r == 1 for p, r in zip(preds, refs, strict=True))
        fp = sum(p == 1 and r == 0 for p, r in zip(preds, refs, strict=True))
        fn = sum(p == 0 and r == 1 for p, r in zip(preds, refs, strict=True))
        f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
        if self._record is not None:
            with open(self._record, "a") as out:
                out.write(json.dumps({"n": len(refs), "predictions": preds}) + "\n")
        return {"accuracy": correct / len(refs) if refs else 0.0, "f1": f1}


class NoStandIn(LookupError):
    """What an example asked the Hub for has no local stand-in here."""


def _lookup(table: dict[str, Callable[..., Any]], what: str, name: Any) -> Callable[..., Any]:
    try:
        return table[str(name)]
    except KeyError:
        raise NoStandIn(
            f"the example asks the Hub for {what} {name!r}, which has no local stand-in in "
            f"tests/_examples_runner.py (known: {', '.join(sorted(table))}); add one there"
        ) from None


def install_hub_stand_ins(metric_record: str | None) -> None:
    """Answer the examples' Hub calls with the local stand-ins (see the module docstring).

    Patched on the classes and modules themselves before the script runs, so both
    ``AutoTokenizer.from_pretrained(...)`` and ``from datasets import load_dataset`` (bound
    when the script imports it) reach them.
    """
    os.environ.update(OFFLINE_ENV)
    _import_torchvision()  # first: transformers and timm import it
    import datasets
    import evaluate
    import transformers

    tokenizers = {
        "bert-base-cased": tiny_bert_tokenizer,
        "HuggingFaceTB/SmolLM-360M": tiny_causal_tokenizer,
    }
    models = {
        "bert-base-cased": (transformers.AutoModelForSequenceClassification, tiny_bert_config),
        "HuggingFaceTB/SmolLM-360M": (transformers.AutoModelForCausalLM, tiny_llama_config),
    }
    data = {
        "nyu-mll/glue/mrpc": synthetic_mrpc,
        "glue/mrpc": synthetic_mrpc,
        "Salesforce/wikitext/wikitext-2-v1": synthetic_wikitext,
    }

    def config_from_pretrained(cls: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        _auto, config_for = models.get(str(name), (None, None))
        if config_for is None:
            raise NoStandIn(f"the example asks the Hub for the config of {name!r}")
        return config_for()

    def tokenizer_from_pretrained(cls: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        return _lookup(tokenizers, "the tokenizer", name)()

    def model_from_pretrained(cls: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        auto, config_for = models.get(str(name), (None, None))
        if auto is not cls or config_for is None:
            raise NoStandIn(
                f"the example asks the Hub for {cls.__name__} weights {name!r}, which have no "
                "local stand-in in tests/_examples_runner.py; add one there"
            )
        config = kwargs.get("config")  # the HF *_no_trainer scripts pass the one they loaded
        if config is None:
            config_keys = {"return_dict", "num_labels", "output_hidden_states", "use_cache"}
            config = config_for(**{k: v for k, v in kwargs.items() if k in config_keys})
        return cls.from_config(config)

    def load_dataset(path: Any, name: Any = None, *args: Any, **kwargs: Any) -> Any:
        return _lookup(data, "the data set", f"{path}/{name}" if name else path)()

    def load_metric(path: Any, config_name: Any = None, *args: Any, **kwargs: Any) -> Any:
        if (path, config_name) != ("glue", "mrpc"):
            raise NoStandIn(f"the example asks the Hub for the metric {path!r}/{config_name!r}")
        return LocalGlueMetric(metric_record)

    transformers.AutoConfig.from_pretrained = classmethod(config_from_pretrained)  # type: ignore[method-assign,assignment]
    transformers.AutoTokenizer.from_pretrained = classmethod(tokenizer_from_pretrained)  # type: ignore[method-assign,assignment]
    for auto in {auto for auto, _ in models.values()}:
        auto.from_pretrained = classmethod(model_from_pretrained)
    datasets.load_dataset = load_dataset
    evaluate.load = load_metric
    _install_timm_stand_in()


def _import_torchvision() -> None:
    """torchvision's PyPI wheel is built against CUDA torch: with the CPU build its C ops do
    not load, and its import then fails registering fakes for two of them (``nms``,
    ``qnms``). Declaring their schemas lets the pure-Python parts (transforms) import."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
        import torch

        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        lib = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _KEEP.append(lib)  # a dropped Library object takes its definitions with it
        import torchvision  # noqa: F401


_KEEP: list[Any] = []


def _install_timm_stand_in() -> None:
    try:
        import timm
    except ImportError:
        return  # cv_example fails at its own import, naming the package
    real_create_model = timm.create_model
    tiny = {"resnet50d": "test_resnet"}

    def create_model(name: str, pretrained: bool = False, **kwargs: Any) -> Any:
        # timm's own tiny test model of the same family, randomly initialised
        return real_create_model(_lookup_name(tiny, name), pretrained=False, **kwargs)

    def _lookup_name(table: dict[str, str], name: str) -> str:
        if name not in table:
            raise NoStandIn(f"the example asks the Hub for timm weights {name!r}")
        return table[name]

    timm.create_model = create_model


def synthetic_pets(directory: Path, per_breed: int = 12) -> Path:
    """The Oxford-IIIT Pet layout cv_example reads: ``<breed>_<n>.jpg``, small images."""
    from PIL import Image

    rng = random.Random(37)
    directory.mkdir(parents=True, exist_ok=True)
    for b, breed in enumerate(("Abyssinian", "beagle", "great_pyrenees")):
        for n in range(1, per_breed + 1):
            size = (rng.randint(48, 80), rng.randint(48, 80))
            base = [(40 + 80 * b + rng.randint(-20, 20)) % 256 for _ in range(3)]
            Image.new("RGB", size, tuple(base)).save(directory / f"{breed}_{n}.jpg")
    return directory


# ------------------------------------------------------------------------------ rank side


class _Tee:
    def __init__(self, *streams: Any) -> None:
        self._streams = streams

    def write(self, text: str) -> int:
        for s in self._streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self._streams:
            s.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._streams[0], name)


@contextlib.contextmanager
def _captured(path: str) -> Iterator[None]:
    with open(path, "a", buffering=1) as log:
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = out, err


def run_on_rank(
    mode: str, checkout: str, script: str, argv: list[str], workdir: str, out: str
) -> None:
    """Rank side: the shim (ours) or nothing (real), the stand-ins, then the script."""
    import warnings

    rank = int(os.environ.get("RANK", "0"))
    warnings.resetwarnings()  # as a fresh `python script.py`
    # log_with="all" includes MLflow where it is installed: its default store is an SQLite
    # database that mlflow-skinny cannot open; a file store in the run's directory instead
    os.environ.setdefault("MLFLOW_TRACKING_URI", Path(workdir, "mlruns").as_uri())
    with _captured(os.path.join(out, f"rank{rank}.log")):
        if mode == "ours":
            from tests import _parity_shim

            # Transformers itself imports Accelerate's big-model names (dispatch_model...)
            # from `accelerate` when it sees it installed: stand-ins that raise when used.
            # The script's own imports get none: they raise at once, as in a user's code.
            _parity_shim.install(
                Path(checkout) / "src", stand_in_accelerate_only=True, strict_importers=["__main__"]
            )
        install_hub_stand_ins(os.path.join(out, f"metric-rank{rank}.jsonl"))
        path = str(Path(checkout) / "examples" / script)
        os.chdir(workdir)
        sys.argv = [path, *argv]
        try:
            runpy.run_path(path, run_name="__main__")
        finally:
            sys.stdout.flush()


# ------------------------------------------------------------------------------ kernel side


def main() -> int:
    parser = argparse.ArgumentParser(
        description="Run one of Accelerate's example scripts on CPU ranks of notebook_launcher."
    )
    parser.add_argument("--checkout", required=True, help="Accelerate's repository (has examples/)")
    parser.add_argument("--mode", choices=("ours", "real"), default="ours")
    parser.add_argument("--out", required=True, help="where the ranks write their logs")
    parser.add_argument("--workdir", required=True, help="the script's working directory")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("script", help="path under examples/, e.g. by_feature/checkpointing.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    ns = parser.parse_args()
    from notebook_launcher import notebook_launcher

    os.makedirs(ns.out, exist_ok=True)
    os.makedirs(ns.workdir, exist_ok=True)
    try:
        notebook_launcher(
            run_on_rank,
            args=(ns.mode, ns.checkout, ns.script, list(ns.args), ns.workdir, ns.out),
            num_processes=ns.processes,
            dashboard=False,
        )
    except Exception:  # noqa: BLE001 - the launch's failure is the run's outcome: printed
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
