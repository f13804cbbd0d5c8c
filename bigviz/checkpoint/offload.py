"""Write disk-mapped weights of a non-safetensors checkpoint once, as safetensors.

Torch pickles cannot be read tensor by tensor at known byte offsets, so weights a device map
sends to ``"disk"`` are converted once into ``offload_folder`` (safetensors shards + index)
and read from there lazily. Safetensors checkpoints never come here: they are read in place.

Example:
    >>> offload_problems(None)[0][:38]
    'disk offload of a non-safetensors chec'
"""
from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bigviz.checkpoint.lazy import LazyWeights
from bigviz.checkpoint.save import write_checkpoint_files

if TYPE_CHECKING:
    import torch

    from bigviz.checkpoint.index import CheckpointIndex
    from bigviz.checkpoint.match import TensorLoad

__all__ = ["offload_problems", "write_offload", "write_offload_tensors"]

# files a previous offload wrote; anything else in the folder is the user's and is kept
_OURS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
_SHARD = 2 * 10**9


def offload_problems(folder: str | Path | None) -> list[str]:
    """Why ``folder`` cannot receive offloaded weights (an empty list when it can)."""
    if folder is None:
        return ["disk offload of a non-safetensors checkpoint needs offload_folder= (its weights "
                "are written there once, as safetensors)"]
    path = Path(folder)
    if path.exists() and not path.is_dir():
        return [f"offload_folder {path} is a file: pass a folder"]
    foreign = [p.name for p in path.iterdir() if not _OURS.fullmatch(p.name)] if path.is_dir() else []
    if foreign:
        return [f"offload_folder {path} holds other files ({foreign[:3]}): use an empty folder"]
    return []


def write_offload(index: CheckpointIndex, loads: Sequence[TensorLoad], folder: Path) -> Path:
    """Write the checkpoint tensors of ``loads`` into ``folder``, under their model names.

    Tensors keep the checkpoint's dtype (a `LazyWeights` over the result converts on access,
    exactly as for a safetensors checkpoint read in place). Each tensor streams from the mapped
    pickle to its shard, so no copy of the weights is made in memory. Files of an earlier
    offload in ``folder`` are replaced; other files are never touched.
    """
    with LazyWeights(index, {load.name: load.key for load in loads}) as source:
        return write_offload_tensors(source, folder)


def write_offload_tensors(source: Mapping[str, torch.Tensor], folder: Path) -> Path:
    """Write every tensor of ``source`` (read one at a time) into ``folder`` as safetensors,
    with the same ownership rules as `write_offload`."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        written = write_checkpoint_files(source, tmp, max_shard_size=_SHARD)
        for old in folder.iterdir():
            if _OURS.fullmatch(old.name):
                old.unlink()
        for path in written:
            os.replace(path, folder / path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
