"""Saving and loading: model weights (safetensors, sharded) and full training state.

Nothing here talks to other ranks: the :class:`~notebook_launcher.accelerator.Accelerator`
decides who writes and puts the barriers around these functions.

Crash safety, the one rule: *a checkpoint that loads is complete*.

* Files are written under a temporary name in the target directory and renamed into place
  (``os.replace`` is atomic on POSIX).
* ``save_model_files`` writes the new files into ``.model.safetensors.incomplete/`` inside
  the directory, the entry point (``model.safetensors`` or ``model.safetensors.index.json``)
  last; then removes the old entry point, moves the shards in, and the entry point last. A
  save interrupted while writing leaves the old model untouched; one interrupted while moving
  leaves the new model complete across the staging directory and the target: the loader
  reads it from there (with a warning), the next save finishes the move.
* ``save_state`` writes a whole checkpoint into ``<dir>.incomplete`` (every rank writes its
  RNG file there), adds a ``checkpoint.json`` manifest last, then renames ``<dir>`` to
  ``<dir>.old`` and ``<dir>.incomplete`` to ``<dir>``. ``load_state`` refuses a directory
  without a manifest, or one missing a listed file; where an interrupted commit left no
  ``<dir>``, :func:`find_checkpoint` names the complete copy (``.incomplete``, else ``.old``)
  and :func:`recover_checkpoint` (before the next save) puts it back.

Shared tensors (tied weights): safetensors refuses tensors that share memory. Exact aliases
(same storage, offset, shape and strides) are saved once under the first name, like
Accelerate does; the dropped names are recorded in the file's metadata
(``notebook_launcher.aliases``) so :func:`load_model_state_dict` restores them. Tensors that
only partly overlap are cloned, so no data is lost.

Example::

    save_model_files(model.state_dict(), "out", max_shard_size="200MB")
    state_dict = load_model_state_dict("out")   # every key, aliases included
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

# Accelerate's logger name, so that logging set up for Accelerate applies (README).
logger = logging.getLogger("accelerate.checkpointing")

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
OPTIMIZER_NAME = "optimizer"
SCHEDULER_NAME = "scheduler"
SCALER_NAME = "scaler.pt"
RNG_STATE_NAME = "random_states"
CUSTOM_NAME = "custom_checkpoint"
MANIFEST_NAME = "checkpoint.json"
STAGING_SUFFIX = ".incomplete"
PREVIOUS_SUFFIX = ".old"
ALIASES_KEY = "notebook_launcher.aliases"

_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """``"10GB"`` -> ``10_000_000_000``; ``"5MiB"`` -> ``5 * 2**20``; ints pass through.

    Example::

        parse_size("200MB")   # 200_000_000
    """
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}")
        return size
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]I?B|B)?\s*", str(size).upper())
    if match is None:
        raise ValueError(
            f"max_shard_size={size!r} is not a size; write it like '10GB', '500MB' or '2GiB'"
        )
    value = float(match.group(1)) * _SIZE_UNITS[match.group(2) or "B"]
    if value < 1:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return int(value)


# ------------------------------------------------------------------------------------ files


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` for a temporary file next to ``path``, then rename it to ``path``.

    A crash leaves ``path`` either absent, or as it was before, never half written.

    Example::

        atomic_write("meta.json", lambda tmp: Path(tmp).write_text(json.dumps(meta)))
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save(obj: Any, f: Any, safe_serialization: bool = False) -> None:
    """``torch.save`` (or safetensors for a dict of tensors) written atomically to a path.

    ``f`` may also be a file object (then written directly).

    Example::

        save({"epoch": 3}, "meta.pt")
    """
    if safe_serialization:
        from safetensors.torch import save_file

        tensors, aliases = dedupe_shared_tensors(obj)
        metadata = _metadata(aliases)
        if not isinstance(f, (str, os.PathLike)):
            raise TypeError("safe_serialization=True needs a path, not a file object")
        atomic_write(os.fspath(f), lambda tmp: save_file(tensors, tmp, metadata=metadata))
        return
    if isinstance(f, (str, os.PathLike)):
        atomic_write(os.fspath(f), lambda tmp: torch.save(obj, tmp))
    else:
        torch.save(obj, f)


# -------------------------------------------------------------------------- shared tensors


def _storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if storage.nbytes() == 0:
        return None
    return (t.device, storage.data_ptr())


def dedupe_shared_tensors(
    state_dict: Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Make ``state_dict`` savable by safetensors; return ``(tensors, aliases)``.

    Exact aliases of one tensor are kept once, under the first name in ``state_dict`` order;
    ``aliases`` maps each dropped name to the kept one. Tensors sharing memory without being
    the same view are cloned. Every tensor comes back contiguous and on the CPU.

    Example::

        tensors, aliases = dedupe_shared_tensors(tied_model.state_dict())
        aliases   # {"head.weight": "embed.weight"}
    """
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"safetensors can only store tensors; {name!r} is a {type(value).__name__}. "
                "Use safe_serialization=False for other objects."
            )
        key = _storage_key(value)
        if key is not None:
            groups.setdefault(key, []).append(name)
    aliases: dict[str, str] = {}
    clone: set[str] = set()
    for names in groups.values():
        if len(names) < 2:
            continue
        views: dict[tuple[Any, ...], str] = {}
        layouts = set()
        for name in names:
            t = state_dict[name]
            layout = (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            layouts.add(layout)
            if layout in views:
                aliases[name] = views[layout]
            else:
                views[layout] = name
        if len(layouts) > 1:
            clone.update(views.values())
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if name in aliases:
            continue
        t = t.detach()
        if name in clone:
            t = t.clone()
        tensors[name] = t.to("cpu").contiguous()
    if aliases:
        logger.warning(
            "Removed shared tensor %s while saving (each is stored once, under %s). "
            "notebook_launcher's loaders (load_state, load_checkpoint_in_model) restore them; "
            "a plain safetensors load_file returns the kept names only.",
            sorted(aliases),
            sorted(set(aliases.values())),
        )
    return tensors, aliases


def _metadata(aliases: Mapping[str, str]) -> dict[str, str]:
    meta = {"format": "pt"}
    if aliases:
        meta[ALIASES_KEY] = json.dumps(dict(aliases), sort_keys=True)
    return meta


# ------------------------------------------------------------------------------ sharding


def shard_state_dict(
    state_dict: Mapping[str, torch.Tensor], max_shard_size: int | str
) -> list[dict[str, torch.Tensor]]:
    """Split ``state_dict`` (in order) into shards of at most ``max_shard_size`` bytes.

    A tensor bigger than the limit gets a shard of its own.

    Example::

        shards = shard_state_dict(model.state_dict(), "500MB")
    """
    limit = parse_size(max_shard_size)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state_dict.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _names(safe: bool) -> tuple[str, str, re.Pattern[str]]:
    weights, index = (
        (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME) if safe else (WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
    )
    stem, ext = weights.rsplit(".", 1)
    ours = re.compile(
        rf"^(?:{re.escape(stem)}(?:-\d{{5}}-of-\d{{5}})?\.{ext}|{re.escape(index)}"
        rf"|\.{re.escape(stem)}.*\.tmp)$"
    )
    return weights, index, ours


def _model_staging(save_directory: str, weights_name: str) -> str:
    """Where :func:`save_model_files` writes a new model before it moves it into place."""
    return os.path.join(save_directory, f".{weights_name}{STAGING_SUFFIX}")


def _staged_entry(staging: str, weights_name: str, index_name: str) -> str | None:
    """The entry point of a completely written staged model (None: none, or not complete:
    the entry point is written last, so its presence means every shard is there)."""
    for entry in (index_name, weights_name):
        if os.path.isfile(os.path.join(staging, entry)):
            return entry
    return None


def _listed(folder: str, entry: str) -> list[str]:
    """The weight files an entry point names (itself for a single file)."""
    if not entry.endswith(".index.json"):
        return [entry]
    with open(os.path.join(folder, entry)) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def _finish_model_commit(save_directory: str, safe_serialization: bool) -> None:
    """Finish moving a completely written staged model into ``save_directory`` (a save that
    was interrupted while it did so), or drop a staged model whose writing was interrupted
    (the directory still holds the previous model, untouched). Idempotent: every step is a
    rename or a removal that the next call repeats or skips."""
    weights_name, index_name, ours = _names(safe_serialization)
    staging = _model_staging(save_directory, weights_name)
    if not os.path.isdir(staging):
        return
    entry = _staged_entry(staging, weights_name, index_name)
    if entry is None:
        shutil.rmtree(staging)
        return
    new = _listed(staging, entry)
    # 1. the old entry points go first, so that the directory never has an index (or file)
    #    that names a mix of old and new shards; a single file over a single file is
    #    replaced atomically instead
    for stale in (index_name, weights_name):
        if stale == entry == weights_name:
            continue
        if os.path.exists(os.path.join(save_directory, stale)):
            os.remove(os.path.join(save_directory, stale))
    # 2. the shards still staged (the others were moved by the interrupted commit), then
    #    the entry point, last
    for name in new:
        if name != entry and os.path.exists(os.path.join(staging, name)):
            os.replace(os.path.join(staging, name), os.path.join(save_directory, name))
    os.replace(os.path.join(staging, entry), os.path.join(save_directory, entry))
    # 3. what earlier saves left (old shards, temp files of a crashed save)
    keep = {*new, entry}
    for name in os.listdir(save_directory):
        path = os.path.join(save_directory, name)
        if name not in keep and ours.match(name) and os.path.isfile(path):
            os.remove(path)
    shutil.rmtree(staging)


def save_model_files(
    state_dict: Mapping[str, torch.Tensor],
    save_directory: str,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> list[str]:
    """Write ``state_dict`` to ``save_directory`` as one file or shards plus an index.

    Layout (``safe_serialization=True``): ``model.safetensors``, or
    ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``
    (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``) when the weights are
    bigger than ``max_shard_size``. With ``safe_serialization=False`` the same with
    ``pytorch_model*.bin``. Files of an earlier save that are not part of this one are removed;
    other files in the directory are left alone. Returns the file names written.

    Crash safety: the new files are written into ``.model.safetensors.incomplete/`` inside
    the directory, the entry point last; only then are they moved into place (the old entry
    point removed first, the new one moved last). A save interrupted while writing leaves the
    previous model as it was; one interrupted while moving is finished by the next save, and
    :func:`load_model_state_dict` loads the new model meanwhile (with a warning).

    Example::

        save_model_files(model.state_dict(), "out", max_shard_size="1GB")
    """
    os.makedirs(save_directory, exist_ok=True)
    weights_name, index_name, _ = _names(safe_serialization)
    _finish_model_commit(save_directory, safe_serialization)  # an earlier save's, if cut short
    if safe_serialization:
        tensors, aliases = dedupe_shared_tensors(state_dict)
    else:
        tensors = {k: v.detach().to("cpu") for k, v in state_dict.items()}
        aliases = {}
    shards = shard_state_dict(tensors, max_shard_size)
    stem, ext = weights_name.rsplit(".", 1)
    if len(shards) == 1:
        files = [weights_name]
    else:
        total = len(shards)
        files = [f"{stem}-{i + 1:05d}-of-{total:05d}.{ext}" for i in range(total)]
    metadata = _metadata(aliases)

    def writer(shard: dict[str, torch.Tensor]) -> Callable[[str], None]:
        if safe_serialization:
            from safetensors.torch import save_file

            return lambda tmp: save_file(shard, tmp, metadata=metadata)
        return lambda tmp: torch.save(shard, tmp)

    staging = _model_staging(save_directory, weights_name)
    os.makedirs(staging)
    try:
        # every new file, each complete under its name only once written (atomic_write):
        # the entry point (the single file, or the index) last
        for name, shard in zip(files, shards, strict=True):
            atomic_write(os.path.join(staging, name), writer(shard))
        if len(shards) > 1:
            meta: dict[str, Any] = {
                "total_size": sum(t.numel() * t.element_size() for t in tensors.values())
            }
            if aliases:
                meta[ALIASES_KEY] = json.dumps(aliases, sort_keys=True)
            index = {
                "metadata": meta,
                "weight_map": {k: files[i] for i, shard in enumerate(shards) for k in shard},
            }

            def write_index(tmp: str) -> None:
                with open(tmp, "w") as f:
                    json.dump(index, f, indent=2, sort_keys=True)

            atomic_write(os.path.join(staging, index_name), write_index)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _finish_model_commit(save_directory, safe_serialization)
    return files + ([index_name] if len(shards) > 1 else [])


def _load_file(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if path.endswith(".safetensors"):
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        aliases = json.loads(meta.get(ALIASES_KEY, "{}"))
        return load_file(path), aliases
    return torch.load(path, map_location="cpu", weights_only=True), {}


def _load_index(index_path: str, folders: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The shards an index names, each from the first of ``folders`` that has it."""
    with open(index_path) as f:
        index = json.load(f)
    merged: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        where = next(
            (os.path.join(d, shard) for d in folders if os.path.exists(os.path.join(d, shard))),
            os.path.join(folders[-1], shard),
        )
        part, _ = _load_file(where)
        merged.update(part)
    aliases = json.loads(index.get("metadata", {}).get(ALIASES_KEY, "{}"))
    return _restore_aliases(merged, aliases)


def _recover_model(path: str) -> dict[str, torch.Tensor] | None:
    """The model of a save that was interrupted while moving its complete files into
    ``path`` (split between its staging directory and ``path``); None when there is none."""
    for safe in (True, False):
        weights_name, index_name, _ = _names(safe)
        staging = _model_staging(path, weights_name)
        entry = _staged_entry(staging, weights_name, index_name) if os.path.isdir(staging) else None
        if entry is None:
            continue
        logger.warning(
            "the model in %s was being replaced when a save was interrupted: loading the "
            "new model, complete in %s (and the shards already moved into %s). The next "
            "save_model to this directory finishes moving it.",
            path,
            staging,
            path,
        )
        if entry == index_name:
            return _load_index(os.path.join(staging, entry), (staging, path))
        state, aliases = _load_file(os.path.join(staging, entry))
        return _restore_aliases(state, aliases)
    return None


def load_model_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Load what :func:`save_model_files` (or ``save_state``) wrote: a file or a directory.

    Shards are merged; names dropped as aliases of shared tensors are restored (pointing at
    the same tensor, as in the original state dict). A directory whose save was interrupted
    while it moved the new files into place gives the new model, with a warning.

    Example::

        model.load_state_dict(load_model_state_dict("out"))
    """
    entry_points = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
    if os.path.basename(path) in entry_points and not os.path.exists(path):
        recovered = _recover_model(os.path.dirname(path) or ".")
        if recovered is not None:  # named by its entry point, in the middle of a save
            return recovered
    if path.endswith(".index.json") and os.path.isfile(path):
        # the index of a sharded checkpoint (as Accelerate and Transformers accept it)
        return _load_index(path, (os.path.dirname(path),))
    if os.path.isdir(path):
        for index_name, weights_name in (
            (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME),
            (WEIGHTS_INDEX_NAME, WEIGHTS_NAME),
        ):
            index_path = os.path.join(path, index_name)
            if os.path.exists(index_path):
                return _load_index(index_path, (path,))
            if os.path.exists(os.path.join(path, weights_name)):
                path = os.path.join(path, weights_name)
                break
        else:
            recovered = _recover_model(path)
            if recovered is not None:
                return recovered
            raise FileNotFoundError(f"no model weights (model.safetensors or index) in {path}")
    state, aliases = _load_file(path)
    return _restore_aliases(state, aliases)


def _restore_aliases(
    state: dict[str, torch.Tensor], aliases: Mapping[str, str]
) -> dict[str, torch.Tensor]:
    for alias, kept in aliases.items():
        if alias not in state and kept in state:
            state[alias] = state[kept]
    return state


def load_checkpoint_in_model(
    model: torch.nn.Module,
    checkpoint: str | os.PathLike[str],
    device_map: Mapping[str, Any] | None = None,
    offload_folder: str | None = None,
    dtype: str | torch.dtype | None = None,
    strict: bool = True,
    **kwargs: Any,
) -> Any:
    """Load weights saved by ``save_model`` into ``model``: a weights file, a directory
    (sharded or not) or the ``*.index.json`` of a sharded checkpoint. Tied weights are
    restored. Returns ``load_state_dict``'s result (missing and unexpected keys).

    ``device_map`` (module name -> device, ``""`` for the whole model) places each module's
    weights on its device; ``dtype`` casts floating-point weights. Offloading (``"disk"``,
    ``offload_folder`` and Accelerate's other offload options) is big-model inference, which
    is Accelerate's own: they raise ``AccelerateOnlyError``. ``strict`` defaults to True here
    (Accelerate: False): a checkpoint that does not fit the model is an error, not a warning.

    Example::

        load_checkpoint_in_model(model, "out/model.safetensors.index.json", device_map={"": "cpu"})
    """
    from ._accelerate_only import error_for

    offloading = [k for k, v in kwargs.items() if k.startswith("offload") and v]
    if (
        offload_folder is not None
        or offloading
        or any(str(d) == "disk" for d in (device_map or {}).values())
    ):
        raise error_for("load_offloaded_weights")
    state = load_model_state_dict(os.fspath(checkpoint))
    if dtype is not None:
        target = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        state = {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}
    if device_map:
        prefixes = sorted(device_map, key=len, reverse=True)
        placed = {}
        for name, tensor in state.items():
            module = next(
                (p for p in prefixes if p == "" or name == p or name.startswith(p + ".")), None
            )
            placed[name] = tensor if module is None else tensor.to(device_map[module])
        state = placed
        for prefix in prefixes:  # the module's own tensors go where its weights go
            target_module = model.get_submodule(prefix) if prefix else model
            target_module.to(device_map[prefix])
    return model.load_state_dict(state, strict=strict)


# ------------------------------------------------------------------------- training state


def rng_state() -> dict[str, Any]:
    """The RNG states of this process: Python, NumPy (if installed), torch CPU and CUDA.

    Example::

        saved = rng_state()
        ...
        set_rng_state(saved)   # the same random numbers again
    """
    states: dict[str, Any] = {
        "random_state": random.getstate(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    try:
        import numpy as np

        states["numpy_random_seed"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_initialized():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_state(states: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(states["random_state"])
    torch.set_rng_state(states["torch_manual_seed"])
    if "numpy_random_seed" in states:
        import numpy as np

        np.random.set_state(states["numpy_random_seed"])
    if "torch_cuda_manual_seed" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])


def indexed_name(stem: str, i: int, ext: str) -> str:
    """``model.safetensors`` for the first object, ``model_1.safetensors`` for the next..."""
    return f"{stem}.{ext}" if i == 0 else f"{stem}_{i}.{ext}"


def staging_dir(output_dir: str) -> str:
    return os.path.abspath(output_dir).rstrip(os.sep) + STAGING_SUFFIX


def previous_dir(output_dir: str) -> str:
    """Where :func:`commit_staging` keeps the checkpoint it replaces until the new one is
    in place."""
    return os.path.abspath(output_dir).rstrip(os.sep) + PREVIOUS_SUFFIX


def start_staging(output_dir: str) -> str:
    """Create an empty staging directory for ``output_dir`` (its writer only).

    Call :func:`recover_checkpoint` first: a staging directory left by an interrupted
    commit can be the only complete copy of the checkpoint."""
    staging = staging_dir(output_dir)
    if os.path.exists(staging):
        shutil.rmtree(staging)
    parent = os.path.dirname(staging)
    os.makedirs(parent, exist_ok=True)
    os.makedirs(staging)
    return staging


def save_main_state(
    staging: str,
    models: Iterable[Mapping[str, torch.Tensor]],
    optimizers: Iterable[Mapping[str, Any]],
    schedulers: Iterable[Mapping[str, Any]],
    scaler: Mapping[str, Any] | None,
    custom_objects: Iterable[Any],
    safe_serialization: bool = True,
) -> None:
    """Write the main process's part of a checkpoint into ``staging``."""
    for i, sd in enumerate(models):
        if safe_serialization:
            from safetensors.torch import save_file

            tensors, aliases = dedupe_shared_tensors(sd)
            save_file(
                tensors,
                os.path.join(staging, indexed_name("model", i, "safetensors")),
                metadata=_metadata(aliases),
            )
        else:
            torch.save(dict(sd), os.path.join(staging, indexed_name("pytorch_model", i, "bin")))
    for i, sd in enumerate(optimizers):
        torch.save(sd, os.path.join(staging, indexed_name(OPTIMIZER_NAME, i, "bin")))
    for i, sd in enumerate(schedulers):
        torch.save(sd, os.path.join(staging, indexed_name(SCHEDULER_NAME, i, "bin")))
    if scaler is not None:
        torch.save(scaler, os.path.join(staging, SCALER_NAME))
    for i, obj in enumerate(custom_objects):
        with open(os.path.join(staging, f"{CUSTOM_NAME}_{i}.pkl"), "wb") as f:
            pickle.dump(obj.state_dict(), f)


def save_rank_state(staging: str, process_index: int, states: Mapping[str, Any]) -> None:
    """Write one rank's RNG (and step, dataloader) states into ``staging``."""
    with open(os.path.join(staging, f"{RNG_STATE_NAME}_{process_index}.pkl"), "wb") as f:
        pickle.dump(dict(states), f)


def commit_staging(output_dir: str, num_processes: int, extra: Mapping[str, Any]) -> None:
    """Add the manifest and move the staging directory to ``output_dir`` (its writer only).

    From the moment the manifest is there, some complete copy survives any crash:
    ``<output_dir>.incomplete`` (the new one, complete), then ``<output_dir>.old`` (the
    replaced one, while the new one is renamed into place), then ``output_dir``.
    :func:`find_checkpoint` and :func:`recover_checkpoint` find it.
    """
    staging = staging_dir(output_dir)
    files = sorted(os.listdir(staging))
    manifest = {
        "format": "notebook_launcher.checkpoint",
        "version": 1,
        "num_processes": num_processes,
        "files": files,
        **extra,
    }

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())

    atomic_write(os.path.join(staging, MANIFEST_NAME), write)
    target = os.path.abspath(output_dir).rstrip(os.sep)
    old = previous_dir(target)
    if os.path.exists(target):
        if os.path.exists(old):  # a stale copy: the target is the complete one (recovered)
            shutil.rmtree(old)
        os.replace(target, old)
    os.replace(staging, target)
    if os.path.exists(old):
        shutil.rmtree(old)


def read_manifest(input_dir: str) -> dict[str, Any]:
    """The manifest of a complete checkpoint; ``ValueError`` for anything else."""
    path = os.path.join(input_dir, MANIFEST_NAME)
    if not os.path.isdir(input_dir):
        raise FileNotFoundError(f"no checkpoint directory {input_dir!r}")
    if not os.path.exists(path):
        raise ValueError(
            f"{input_dir!r} is not a complete checkpoint (no {MANIFEST_NAME}): it was not "
            "written by save_state, or the save was interrupted."
        )
    try:
        with open(path) as f:
            manifest: dict[str, Any] = json.load(f)
    except ValueError as exc:
        raise ValueError(f"{input_dir!r} has a damaged {MANIFEST_NAME}: {exc}") from None
    missing = [
        name
        for name in manifest.get("files", [])
        if not os.path.exists(os.path.join(input_dir, name))
    ]
    if missing:
        raise ValueError(f"checkpoint {input_dir!r} is incomplete: missing {missing}")
    return manifest


def _complete(directory: str) -> bool:
    try:
        read_manifest(directory)
    except (OSError, ValueError):
        return False
    return True


def find_checkpoint(input_dir: str) -> tuple[str, str]:
    """``(the directory that holds checkpoint input_dir complete, how)``; ``how`` is ""
    for ``input_dir`` itself, else says which copy it is: ``<input_dir>.incomplete`` (a
    save interrupted while committing it, complete: the newer), else ``<input_dir>.old``
    (the copy a save was replacing). Reads only: :func:`recover_checkpoint` moves it.
    With no complete copy, ``input_dir`` (then :func:`read_manifest` says what is wrong)."""
    target = os.path.abspath(input_dir).rstrip(os.sep)
    if os.path.exists(target):
        return input_dir, ""
    staged, old = staging_dir(target), previous_dir(target)
    if _complete(staged):
        return staged, (
            f"checkpoint {target} was being committed when its save was interrupted; its "
            f"complete copy {staged} is used (the save had written everything)"
        )
    if _complete(old):
        return old, (
            f"checkpoint {target} was being replaced when a save was interrupted; the "
            f"previous checkpoint, complete in {old}, is used"
        )
    return input_dir, ""


def recover_checkpoint(output_dir: str) -> str:
    """Before writing checkpoint ``output_dir`` (its writer only): move the complete copy
    an interrupted commit left (see :func:`find_checkpoint`) back to ``output_dir``, and
    drop a stale ``<output_dir>.old``, so that the next save never removes the only complete
    copy. Returns what was recovered, in words ("" for nothing)."""
    target = os.path.abspath(output_dir).rstrip(os.sep)
    found, how = find_checkpoint(target)
    if how:
        os.replace(found, target)
        logger.warning("%s; it is back in place.", how)
    old = previous_dir(target)
    if os.path.exists(old) and _complete(target):
        shutil.rmtree(old)
    return how


def load_rank_state(input_dir: str, process_index: int) -> dict[str, Any] | None:
    path = os.path.join(input_dir, f"{RNG_STATE_NAME}_{process_index}.pkl")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        states: dict[str, Any] = pickle.load(f)
    return states


def load_torch(path: str, trusted: bool = False) -> Any:
    """``torch.load`` on the CPU; ``trusted`` allows arbitrary pickles (our own scheduler files)."""
    return torch.load(path, map_location="cpu", weights_only=not trusted)


# --- the Accelerator's checkpoints: where, and what goes back where -----------------------


def checkpoint_dir(config: Any, output_dir: str | os.PathLike[str] | None, loading: bool) -> str:
    """The directory to save to (or load from): ``output_dir``, else with
    ``ProjectConfiguration(automatic_checkpoint_naming=True)`` the next (or the latest
    complete) ``<project_dir>/checkpoints/checkpoint_<i>``, by number."""
    if output_dir is not None:
        return os.fspath(output_dir)
    if config.automatic_checkpoint_naming and config.project_dir is not None:
        base = os.path.join(config.project_dir, "checkpoints")
        if not loading:
            return os.path.join(base, f"checkpoint_{config.iteration}")
        complete = [n for n in numbered_checkpoints(base) if _complete(_numbered_copy(base, n))]
        if not complete:
            raise FileNotFoundError(f"no complete checkpoint in {base}")
        return os.path.join(base, f"checkpoint_{complete[-1]}")
    raise ValueError(
        "pass a directory, or use ProjectConfiguration(project_dir=..., "
        "automatic_checkpoint_naming=True)"
    )


_NUMBERED = re.compile(
    rf"checkpoint_(\d+)(?:{re.escape(STAGING_SUFFIX)}|{re.escape(PREVIOUS_SUFFIX)})?"
)


def _numbered_copy(base: str, n: int) -> str:
    return find_checkpoint(os.path.join(base, f"checkpoint_{n}"))[0]


def numbered_checkpoints(base: str) -> list[int]:
    """The numbers ``i`` of the checkpoints ``<base>/checkpoint_<i>``, ascending: those that
    exist, and those an interrupted commit left complete under another name (see
    :func:`find_checkpoint`). Debris of an interrupted write is not a checkpoint."""
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    numbers = set()
    for name in names:
        match = _NUMBERED.fullmatch(name)
        if match is None:
            continue
        n = int(match.group(1))
        if name == f"checkpoint_{n}" or _complete(os.path.join(base, name)):
            numbers.add(n)
    return sorted(numbers)


def recover_numbered(base: str) -> None:
    """:func:`recover_checkpoint` for every ``<base>/checkpoint_<i>`` (its writer only):
    a checkpoint an interrupted commit left under another name is put back before the
    numbering is checked and the old ones pruned."""
    for n in numbered_checkpoints(base):
        recover_checkpoint(os.path.join(base, f"checkpoint_{n}"))


def check_numbered_save(output_dir: str, iteration: int) -> None:
    """Refuse to write ``checkpoint_<iteration>`` where it, or a newer one, exists (a second
    run in the same ``project_dir``): Accelerate refuses the first ("Checkpoint directory
    ... already exists"); the second would make ``load_state()`` resume from the other
    run's checkpoint, and ``total_limit`` prune this one."""
    base = os.path.dirname(os.path.abspath(output_dir))
    newer = [n for n in numbered_checkpoints(base) if n >= iteration]
    if not newer:
        return
    fix = (
        f"A second run in the same project_dir? Resume the first one with "
        f"accelerator.load_state() (the numbering continues after its latest checkpoint), "
        f"start after it with accelerator.project_configuration.iteration = {newer[-1] + 1}, "
        f"or use a new project_dir."
    )
    if newer[0] == iteration:
        raise ValueError(
            f"Checkpoint directory {os.path.join(base, f'checkpoint_{iteration}')} "
            f"({iteration}) already exists. {fix}"
        )
    raise ValueError(
        f"Checkpoint directory {os.path.join(base, f'checkpoint_{newer[-1]}')} already exists, "
        f"newer than checkpoint_{iteration} that this save_state would write: load_state() "
        f"would resume from it, not from this save. {fix}"
    )


def prune_checkpoints(base: str, total_limit: int) -> list[str]:
    """After a checkpoint was committed: keep the ``total_limit`` newest ``checkpoint_<i>``
    (by number) and delete the older ones, with what interrupted saves left of them (and
    of any older number). Returns the names deleted."""
    keep = max(total_limit, 1)  # the one just saved stays, as with Accelerate's 0
    numbers = numbered_checkpoints(base)
    if len(numbers) <= keep:
        return []
    oldest_kept = numbers[-keep]
    deleted = []
    for name in sorted(os.listdir(base)):
        match = _NUMBERED.fullmatch(name)
        if match is not None and int(match.group(1)) < oldest_kept:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            deleted.append(name)
    if deleted:
        logger.info("total_limit=%s: deleted %s in %s", total_limit, deleted, base)
    return deleted


def load_accelerator_state(
    input_dir: str,
    models: list[torch.nn.Module],
    optimizers: list[Any],
    schedulers: list[Any],
    scaler: Any,
    custom_objects: list[Any],
    pre_hooks: list[Callable[[str], None]],
    strict: bool = True,
) -> dict[str, Any]:
    """Load what ``Accelerator.save_state`` wrote into the (unwrapped) models, optimizers,
    schedulers, scaler and registered objects; returns the checkpoint's manifest. Raises
    ``ValueError`` for a directory that is not a complete checkpoint."""
    manifest = read_manifest(input_dir)
    for i, model in enumerate(models):
        for stem, ext in (("model", "safetensors"), ("pytorch_model", "bin")):
            path = os.path.join(input_dir, indexed_name(stem, i, ext))
            if os.path.exists(path):
                break
        else:
            raise ValueError(
                f"checkpoint {input_dir!r} has no weights for model {i}"
                + (
                    ""
                    if manifest.get("ranks") is None
                    else f" (it holds the states of ranks {manifest['ranks']} only: save_state "
                    "was given a different directory on each rank, and only the main "
                    "process's holds the models; load from that one, or save to one directory)"
                )
            )
        for hook in pre_hooks:
            hook(input_dir)
        model.load_state_dict(load_model_state_dict(path), strict=strict)
    for i, opt in enumerate(optimizers):
        opt.load_state_dict(
            load_torch(os.path.join(input_dir, indexed_name("optimizer", i, "bin")))
        )
    for i, sched in enumerate(schedulers):
        path = os.path.join(input_dir, indexed_name("scheduler", i, "bin"))
        sched.load_state_dict(load_torch(path, trusted=True))
    if scaler is not None:
        scaler.load_state_dict(load_torch(os.path.join(input_dir, SCALER_NAME)))
    for i, obj in enumerate(custom_objects):
        with open(os.path.join(input_dir, f"{CUSTOM_NAME}_{i}.pkl"), "rb") as f:
            obj.load_state_dict(pickle.load(f))
    return manifest


def restore_rank_state(
    input_dir: str, process_index: int, dataloaders: list[Any], manifest: Mapping[str, Any]
) -> int | None:
    """This rank's RNG states and loaders' positions; its saved step (None: the checkpoint
    has no state for this rank, e.g. it was saved by fewer processes)."""
    states = load_rank_state(input_dir, process_index)
    if states is None:
        logger.warning(
            "checkpoint %s was saved by %s processes and has no RNG state for rank %s; "
            "RNG states not restored",
            input_dir,
            manifest.get("num_processes"),
            process_index,
        )
        return None
    set_rng_state(states)
    orders = states.get("dataloader_orders", [])
    for i, (loader, loader_state) in enumerate(
        zip(dataloaders, states.get("dataloaders", []), strict=False)
    ):
        loader.load_state_dict(loader_state)
        if i < len(orders) and getattr(loader, "use_stateful_dataloader", False):
            loader.load_order_state(orders[i])
    return int(states.get("step", 0))


__all__ = [
    "checkpoint_dir",
    "check_numbered_save",
    "find_checkpoint",
    "load_accelerator_state",
    "numbered_checkpoints",
    "prune_checkpoints",
    "recover_checkpoint",
    "recover_numbered",
    "restore_rank_state",
    "ALIASES_KEY",
    "MANIFEST_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "atomic_write",
    "dedupe_shared_tensors",
    "load_checkpoint_in_model",
    "load_model_state_dict",
    "parse_size",
    "rng_state",
    "save",
    "save_model_files",
    "set_rng_state",
    "shard_state_dict",
]
