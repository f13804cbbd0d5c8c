"""The module tree of a checkpoint, from tensor names and header sizes alone (no model code).

`tree_from_checkpoint` turns a checkpoint's `CheckpointIndex` into the same `SizeTree` the
planner builds from an ``nn.Module``, so a device map can be planned for a model whose code
you do not have. `detect_no_split` finds the repeated numbered blocks (``transformer.h.0``,
``transformer.h.1``, ...) that a plan should keep whole.

Module order: a checkpoint does not record definition order, so modules come in the order the
files list them, with numbered siblings in numeric order (``h.2`` before ``h.10``, even in
alphabetically sorted headers).

Example:
    >>> names = [f"transformer.h.{i}.{p}" for i in range(3) for p in ("attn.w", "mlp.w")]
    >>> detect_no_split(names + ["transformer.wte.weight"])
    ['transformer.h.*']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from bigviz.checkpoint.index import CheckpointIndex, TensorInfo
from bigviz.checkpoint.sharding import unique_tensors
from bigviz.core.names import join, natural_order
from bigviz.core.dtypes import canonical_dtype
from bigviz.core.tree import SizeTree, TensorSpec

if TYPE_CHECKING:
    import torch

__all__ = ["tree_from_checkpoint", "detect_no_split"]


def tree_from_checkpoint(
    path_or_index: str | Path | CheckpointIndex, *, dtype: object | None = None, model: torch.nn.Module | None = None
) -> SizeTree:
    """Build the `SizeTree` of a checkpoint from its headers (no tensor data is read).

    Args:
        path_or_index: anything `CheckpointIndex.open` takes.
        dtype: size floating tensors as if converted to this dtype (e.g. ``"float16"``).
        model: the model the checkpoint is for (on meta). The tree then has the model's
            names (checkpoint keys converted as the loader converts them: renamed modules,
            fused experts), classes and ties, and what the checkpoint does not hold (tied
            duplicates, computed buffers) sized from the model; each tensor the checkpoint
            holds is sized by its header. A map planned on it names what the model has.

    Example:
        >>> import tempfile, torch, pathlib
        >>> from bigviz.checkpoint.save import save_sharded
        >>> folder = save_sharded(torch.nn.Sequential(torch.nn.Linear(4, 4)),
        ...                       pathlib.Path(tempfile.mkdtemp()) / "c", progress=False)
        >>> tree = tree_from_checkpoint(folder)
        >>> tree.total(""), tree.total("0"), tree_from_checkpoint(folder, dtype="float16").total("")
        (80, 80, 40)
    """
    index = CheckpointIndex.open(path_or_index)
    if model is not None:
        tree = _model_tree(index, model)
    else:
        entries, packed = _entries(index)
        names = natural_order(entries)
        specs = [
            TensorSpec(info.name, info.numel, canonical_dtype(info.dtype), info.shape, stored=packed.get(info.name))
            for info in (entries[n] for n in names)
        ]
        tree = SizeTree.build(specs, ties=_pickled_ties(index))
    return tree.with_dtype(canonical_dtype(dtype)) if dtype is not None else tree


def _entries(index: CheckpointIndex) -> tuple[Mapping[str, TensorInfo], dict[str, int]]:
    """The checkpoint's tensors as a model sees them: a weight stored quantized is one tensor
    in its logical shape (its parts grouped), sized as it lives in memory (packed, or for
    FP8, dequantized); and the packed ones' bytes."""
    from bigviz.checkpoint.quantized import quantization_config

    if quantization_config(index) is None:
        return index.entries, {}
    from bigviz.checkpoint.convert import CheckpointView
    from bigviz.checkpoint.quantized import packed_view

    view = packed_view(CheckpointView(dict(index.entries)), index)
    packed = {
        name: info.nbytes
        for name, info in view.entries.items()
        if getattr(getattr(view.source_of.get(name), "rule", None), "stores_packed", False)
    }
    return view.entries, packed


def _model_tree(index: CheckpointIndex, model: torch.nn.Module) -> SizeTree:
    """The model's tree, each tensor the checkpoint holds in the checkpoint's dtype."""
    from bigviz.checkpoint.model_names import checkpoint_dtypes, checkpoint_packed
    from bigviz.checkpoint.quantized import quantization_config
    from bigviz.modeling.inventory import ModelInventory

    inventory = ModelInventory.of(model)
    tree = inventory.tree()
    stored = checkpoint_dtypes(inventory, index)
    packed = checkpoint_packed(inventory, index) if quantization_config(index) is not None else {}
    specs = [
        replace(spec, dtype=canonical_dtype(stored[name])) if name in stored else spec
        for name, spec in tree.tensors.items()
    ]
    specs = [replace(s, stored=packed[s.name][0], quant=packed[s.name][1]) if s.name in packed else s for s in specs]
    classes = {name: node.class_name for name, node in tree.nodes.items()}
    return SizeTree.build(specs, classes, tree.ties, containers=tree.containers)


def _pickled_ties(index: CheckpointIndex) -> list[list[str]]:
    """Names a torch pickle stores as one tensor (``torch.save`` keeps ties); safetensors
    cannot share tensors, so it has none."""
    if index.format != "torch":
        return []
    groups: dict[str, list[str]] = {}
    for file in index.files:
        state = {k: v for k, v in index.torch_state(file).items() if k in index.entries}
        for dropped, kept in unique_tensors(state)[1]:
            groups.setdefault(kept, [kept]).append(dropped)
    return list(groups.values())


def detect_no_split(names: Sequence[str]) -> list[str]:
    """Glob patterns for repeated numbered blocks: a module whose children are exactly
    ``0 .. N-1`` (N >= 2), each holding the same relative tensor names.

    Only the outermost repeats are returned (a block's own repeated children are inside it).
    A model whose top-level children are numbered gets ``"[0-9]*"`` (``"*"`` would also
    match the whole model, ``""``).

    Example:
        >>> detect_no_split(["layers.0.w", "layers.1.w", "layers.1.b", "norm.w"])
        []
        >>> detect_no_split(["0.weight", "1.weight"])
        ['[0-9]*']
    """
    blocks: dict[str, dict[str, set[str]]] = {}
    mixed: set[str] = set()  # modules with named (not numbered) children too: not a ModuleList
    for name in natural_order(names):
        parts = name.split(".")
        for i, part in enumerate(parts[:-1]):
            parent = ".".join(parts[:i])
            if part.isdigit():
                blocks.setdefault(parent, {}).setdefault(part, set()).add(".".join(parts[i + 1 :]))
            else:
                mixed.add(parent)
    found: list[str] = []
    for parent, children in blocks.items():  # outer parents first: they appear first
        if parent in mixed or any(parent.startswith(f + ".") for f in found):
            continue
        if _is_repeat(children):
            found.append(parent)
    return [join(p, "*") if p else "[0-9]*" for p in found]


def _is_repeat(children: dict[str, set[str]]) -> bool:
    count = len(children)
    if count < 2 or set(children) != {str(i) for i in range(count)}:
        return False
    first = children["0"]
    return all(rel == first for rel in children.values())
