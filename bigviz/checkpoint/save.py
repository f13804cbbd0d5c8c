"""`save_sharded`: write a model or state dict as a sharded checkpoint, atomically.

The output is exactly what transformers writes (and reads back with ``from_pretrained``):
``model-00001-of-00003.safetensors`` ... plus ``model.safetensors.index.json`` =
``{"metadata": {"total_parameters": N, "total_size": BYTES}, "weight_map": {name: file}}``
with sorted keys; a single shard is a plain ``model.safetensors`` with no index; with
``safe_serialization=False``, ``pytorch_model-0000k-of-0000N.bin`` and
``pytorch_model.bin.index.json``.

Everything is written into a temporary sibling folder that is renamed into place at the
end, so an interrupted save never leaves a half-written checkpoint where a loader looks.

Example:
    >>> import tempfile, torch, pathlib
    >>> folder = save_sharded(torch.nn.Linear(4, 4), pathlib.Path(tempfile.mkdtemp()) / "ckpt",
    ...                       max_shard_size=64, progress=False)
    >>> sorted(p.name for p in folder.iterdir())
    ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors.index.json']
"""
from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from bigviz.checkpoint.safetensors_io import write_safetensors
from bigviz.checkpoint.sharding import parse_size, plan_shards, unique_tensors

__all__ = ["save_sharded", "write_checkpoint_files"]


def save_sharded(
    model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    folder: str | Path,
    *,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
    overwrite: bool = False,
    metadata: Mapping[str, str] | None = None,
    progress: bool = True,
    config: Any = None,
) -> Path:
    """Save a model's state dict (or a state dict) as a sharded checkpoint in ``folder``.

    Tensors are assigned to shards greedily in key order; a tensor larger than
    ``max_shard_size`` gets a shard of its own. Tensors that are the same storage view (tied
    weights such as ``lm_head.weight`` / ``wte.weight``) are saved once, under the first name.

    Args:
        model_or_state_dict: an ``nn.Module`` (its ``state_dict()``) or ``{name: tensor}``.
        folder: the output folder; created, or replaced when ``overwrite=True``.
        max_shard_size: the largest shard, in bytes or as a string (``"10GB"`` = 10e9,
            ``"500MiB"`` = 500 * 2**20).
        safe_serialization: write safetensors (default) or torch ``.bin`` pickles.
        overwrite: replace an existing non-empty ``folder``.
        metadata: extra string pairs for every safetensors shard header (next to
            ``{"format": "pt"}``).
        progress: show a tqdm progress bar over bytes.
        config: written as ``config.json`` beside the shards, so the model can be rebuilt
            from the folder alone (``python -m bigviz.distributed``, transformers'
            ``AutoConfig``): a bigviz config (``model.config``), a transformers config, or a dict.

    Returns:
        The folder, as a ``Path``.

    Raises:
        FileExistsError: ``folder`` exists and is not empty, and ``overwrite`` is False.
        ValueError: some tensors are on the meta device (they have no data to save).

    Example:
        >>> import tempfile, torch, pathlib
        >>> out = save_sharded({"w": torch.zeros(3)}, pathlib.Path(tempfile.mkdtemp()) / "m",
        ...                    progress=False)
        >>> [p.name for p in out.iterdir()]
        ['model.safetensors']
    """
    folder = Path(folder)
    _check_target(folder, overwrite)
    state = _state_dict(model_or_state_dict)
    tensors, _dropped = unique_tensors(state)
    limit = parse_size(max_shard_size)
    tmp = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        write_checkpoint_files(tensors, tmp, max_shard_size=limit, safe_serialization=safe_serialization,
                               metadata=metadata, progress=progress)
        if config is not None:  # inside the temporary folder: weights and config appear together
            (tmp / "config.json").write_text(json.dumps(_config_data(config), indent=2, sort_keys=True) + "\n")
        _move_into_place(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def write_checkpoint_files(
    tensors: Mapping[str, torch.Tensor],
    folder: Path,
    *,
    max_shard_size: int,
    safe_serialization: bool = True,
    metadata: Mapping[str, str] | None = None,
    progress: bool = False,
    align: int = 64,
) -> list[Path]:
    """Write shards (and an index when there are several) into an existing ``folder``.

    The building block of `save_sharded` (which adds the atomic folder swap); also used to
    write disk-offloaded weights once. Tensors start 64-byte aligned where their sizes allow
    (see `write_safetensors`): a memory-mapped tensor then computes exactly as one in fresh
    memory, even in kernels that take another path on unaligned data. Returns the files
    written, index last.
    """
    from tqdm.auto import tqdm

    shards = plan_shards(tensors, max_shard_size)
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    names = _shard_names(stem, ext, len(shards))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    written: list[Path] = []
    with tqdm(total=total, unit="B", unit_scale=True, desc="saving", disable=not progress) as bar:
        for name, shard in zip(names, shards):
            part = {k: tensors[k] for k in shard}
            if safe_serialization:
                header = {"format": "pt", **(metadata or {})}
                write_safetensors(folder / name, part, metadata=header, on_bytes=bar.update, align=align)
            else:
                torch.save({k: _own_storage(t) for k, t in part.items()}, folder / name)
                bar.update(sum(t.numel() * t.element_size() for t in part.values()))
            written.append(folder / name)
    if len(shards) > 1:
        written.append(_write_index(folder, f"{stem}.{ext}.index.json", tensors, shards, names))
    return written


def _config_data(config: Any) -> dict[str, Any]:
    """A config as JSON data: a mapping, or anything with ``to_dict()`` (bigviz and
    transformers configs)."""
    data = dict(config) if isinstance(config, Mapping) else getattr(config, "to_dict", lambda: None)()
    if not isinstance(data, dict):
        raise TypeError(f"config must be a dict or have to_dict() (a bigviz or transformers config), "
                        f"not {type(config).__name__}")
    return data


def _shard_names(stem: str, ext: str, count: int) -> list[str]:
    if count <= 1:
        return [f"{stem}.{ext}"]
    return [f"{stem}-{i:05d}-of-{count:05d}.{ext}" for i in range(1, count + 1)]


def _write_index(folder: Path, name: str, tensors: Mapping[str, torch.Tensor],
                 shards: list[list[str]], files: list[str]) -> Path:
    weight_map = {key: file for file, shard in zip(files, shards) for key in shard}
    doc = {
        "metadata": {
            "total_parameters": sum(t.numel() for t in tensors.values()),
            "total_size": sum(t.numel() * t.element_size() for t in tensors.values()),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    path = folder / name
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return path


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, cloned when it is a view into a larger storage (torch.save would
    otherwise write the whole storage)."""
    t = t.detach().to("cpu")
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        t = t.contiguous().clone()
    return t


def _state_dict(obj: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = obj.state_dict() if isinstance(obj, torch.nn.Module) else dict(obj)
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"not tensors, cannot save: {bad[:10]}")
    meta = [k for k, v in state.items() if v.is_meta]
    if meta:
        raise ValueError(
            f"{len(meta)} tensors are on the meta device and have no data to save "
            f"(first: {meta[:5]}); load weights into the model first (bigviz.load_checkpoint_in_model) "
            "or materialise it with model.to_empty(device='cpu') and initialise it"
        )
    return state


def _check_target(folder: Path, overwrite: bool) -> None:
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder} exists and is a file; choose a folder path")
    if folder.is_dir() and any(folder.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{folder} exists and is not empty; pass overwrite=True to replace it, or choose another folder"
        )


def _move_into_place(tmp: Path, folder: Path) -> None:
    """Rename ``tmp`` to ``folder``; an old ``folder`` is moved aside first, then deleted.

    Replacing by rename (never truncating files) also keeps memory-mapped tensors of the old
    checkpoint valid: their inodes live on until unmapped.
    """
    old = None
    if folder.exists():
        old = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex[:8]}"
        folder.rename(old)
    try:
        tmp.rename(folder)
    except BaseException:
        if old is not None:
            old.rename(folder)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
