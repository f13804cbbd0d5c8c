"""Checkpoint names in the model's terms: the dtype each model tensor is stored in, and a
device map planned from checkpoint headers rewritten in the model's names.

Example:
    >>> import tempfile, torch, pathlib
    >>> from bigviz.checkpoint.save import save_sharded
    >>> folder = save_sharded({"net.weight": torch.ones(2, 2)}, pathlib.Path(tempfile.mkdtemp()) / "c",
    ...                       progress=False)
    >>> with torch.device("meta"):
    ...     model = torch.nn.Linear(2, 2, bias=False)
    >>> device_map_in_model_names(model, folder, {"net": "cpu"}), checkpoint_dtypes(model, folder)
    ({'weight': 'cpu'}, {'weight': 'float32'})
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from pathlib import Path

import torch

from bigviz.checkpoint.index import CheckpointIndex
from bigviz.checkpoint.load import checkpoint_view_of, inventory_of
from bigviz.checkpoint.load_plan import LoadOptions, match_checkpoint, resolve_view
from bigviz.core.names import owner, parent
from bigviz.core.quant import quantization_role_keys
from bigviz.modeling.inventory import ModelInventory

__all__ = ["checkpoint_dtypes", "checkpoint_packed", "device_map_in_model_names"]


def checkpoint_dtypes(
    model: torch.nn.Module | ModelInventory, checkpoint: str | Path | CheckpointIndex
) -> dict[str, str]:
    """Model tensor name -> the dtype the checkpoint stores it in (after conversions), for
    every name the checkpoint fills, tied names included; headers only, nothing is loaded.

    Example:
        >>> import tempfile, torch, pathlib
        >>> from bigviz.checkpoint.save import save_sharded
        >>> folder = save_sharded(torch.nn.Linear(2, 2).half(), pathlib.Path(tempfile.mkdtemp()) / "c",
        ...                       progress=False)
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(2, 2)
        >>> checkpoint_dtypes(model, CheckpointIndex.open(folder))
        {'weight': 'float16', 'bias': 'float16'}
    """
    inventory = inventory_of(model)
    view = checkpoint_view_of(inventory, CheckpointIndex.open(checkpoint), None)
    plan = match_checkpoint(inventory.tensors, view.entries, LoadOptions(strict=False))
    return {alias: view.entries[load.key].dtype for load in plan.loads for alias in load.aliases}


def checkpoint_packed(
    model: torch.nn.Module | ModelInventory, checkpoint: str | Path | CheckpointIndex
) -> dict[str, tuple[int, str]]:
    """Model tensor name -> (bytes as stored, format) for each weight a checkpoint stores
    quantized and that stays packed in memory once loaded (torchao, bitsandbytes; an FP8 weight
    is dequantized, so it takes its dtype's bytes); headers only.

    Example:
        >>> import tempfile, torch, pathlib
        >>> from bigviz.checkpoint.save import save_sharded
        >>> folder = save_sharded(torch.nn.Linear(2, 2), pathlib.Path(tempfile.mkdtemp()) / "c", progress=False)
        >>> checkpoint_packed(torch.nn.Linear(2, 2), folder)
        {}
    """
    inventory = inventory_of(model)
    view = checkpoint_view_of(inventory, CheckpointIndex.open(checkpoint), None)
    plan = match_checkpoint(inventory.tensors, view.entries, LoadOptions(strict=False))
    out: dict[str, tuple[int, str]] = {}
    for load in plan.loads:
        conversion = view.source_of.get(load.key)
        rule = getattr(conversion, "rule", None)
        if getattr(rule, "stores_packed", False):
            out.update(dict.fromkeys(load.aliases, (view.entries[load.key].nbytes, str(rule.kind))))  # type: ignore[union-attr]
    return out | _in_other_formats(plan.missing, plan.unexpected, view, plan.prefix, plan.prefix_action)


def _in_other_formats(
    missing: Sequence[str], unexpected: Sequence[str], view: Any, prefix: str | None, action: str | None
) -> dict[str, tuple[int, str]]:
    """Model weights a checkpoint stores in a format bigviz does not load (GPTQ's ``qweight``,
    ``qzeros``, ``scales``...): each missing ``weight`` sized by the quantization keys under its
    module, so a plan from headers counts the bytes as stored."""
    by_module: dict[str, int] = {}
    for key in quantization_role_keys(unexpected):
        module = key.rsplit(".", 1)[0].removesuffix(".weight")
        if prefix and action == "stripped":
            module = module.removeprefix(prefix)
        elif prefix and action == "added":
            module = prefix + module
        info = view.entries.get(key)
        by_module[module] = by_module.get(module, 0) + (info.nbytes if info is not None else 0)
    found = {name: parent(name) for name in missing if name.endswith(".weight")}
    return {name: (by_module[m], "stored quantized") for name, m in found.items() if m in by_module}


def device_map_in_model_names(
    model: torch.nn.Module | ModelInventory, checkpoint: str | Path | CheckpointIndex, device_map: Mapping[str, object]
) -> dict[str, object]:
    """``device_map`` with keys that name checkpoint modules the model does not have (a map
    planned from headers alone: ``embed_out`` where the model has ``lm_head``, a base-model
    prefix) replaced by the model tensors those checkpoint keys load into.

    Keys naming a module or tensor of the model are kept as they are; a key naming neither
    the model nor the checkpoint is kept too (the map check reports it).

    Example:
        >>> import tempfile, torch, pathlib
        >>> from bigviz.checkpoint.save import save_sharded
        >>> folder = save_sharded({"net.weight": torch.ones(2, 2)}, pathlib.Path(tempfile.mkdtemp()) / "c",
        ...                       progress=False)
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(2, 2, bias=False)
        >>> device_map_in_model_names(model, folder, {"net": "cpu"})
        {'weight': 'cpu'}
    """
    inventory = inventory_of(model)
    foreign = {k for k in device_map if k not in inventory.modules and k not in inventory.slots}
    if not foreign:
        return dict(device_map)
    index = CheckpointIndex.open(checkpoint)
    view = checkpoint_view_of(inventory, index, None)
    plan = resolve_view(match_checkpoint(inventory.tensors, view.entries, LoadOptions(strict=False)), view)
    hits: dict[str, dict[str, None]] = {}  # foreign key -> the model names its checkpoint keys fill
    for load in plan.loads:
        for key in load.keys:
            entry = owner(key, foreign)  # the longest foreign key over it wins, as in any map
            if entry is not None:
                hits.setdefault(entry, {}).update(dict.fromkeys(load.aliases))
    out: dict[str, object] = {}
    for key, device in device_map.items():
        if key in hits:
            out.update(dict.fromkeys(hits[key], device))
        else:
            out[key] = device
    return out
