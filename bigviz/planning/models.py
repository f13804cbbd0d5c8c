"""What a planning call takes: an ``nn.Module``, its inventory, a size tree, a checkpoint path
or a ``config.json``, and how each becomes a size tree.

Example:
    >>> import torch.nn as nn
    >>> as_tree(nn.Linear(4, 2)).total(""), default_no_split(nn.Linear(4, 2), as_tree(nn.Linear(4, 2)))
    (40, [])
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Union

import torch
import torch.nn as nn

from bigviz.checkpoint.hf import meta_model_from_folder
from bigviz.modeling.twin import is_transformers_model
from bigviz.checkpoint.tree import detect_no_split, tree_from_checkpoint
from bigviz.core.names import execution_order
from bigviz.core.tree import SizeTree
from bigviz.modeling.inventory import ModelInventory
from bigviz.modeling.sizes import module_tree
from bigviz.modeling.configs import is_config_source, model_from_config, reference_model_from_folder
from bigviz.core.errors import ArgumentTypeError

__all__ = ["ModelLike", "resolve_model", "as_tree", "in_execution_order", "default_no_split", "inventory_or_none"]

ModelLike = Union[nn.Module, ModelInventory, SizeTree, str, "os.PathLike[str]"]


def resolve_model(model: ModelLike) -> ModelLike:
    """A ``config.json`` path, or a folder holding only one, becomes its model built on
    ``meta``; anything else is returned as it is."""
    return model_from_config(model) if is_config_source(model) else model


def as_tree(
    model: ModelLike,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
) -> SizeTree:
    """A size tree from a model, a tree, or a checkpoint path (headers only, no weights).

    A checkpoint folder with a transformers ``config.json`` is described in the model's names
    (built on meta from the config; checkpoint keys converted as the loader converts them,
    tied duplicates and computed buffers included), so a map planned on it names what the
    model has and runs in ``from_pretrained(device_map=...)`` as in bigviz. Without one, the
    tree has the checkpoint's own names.
    """
    if isinstance(model, SizeTree):
        special = {k: str(v) for k, v in (special_dtypes or {}).items()}
        return model.with_dtype(str(dtype) if dtype is not None else None, special)
    if isinstance(model, (nn.Module, ModelInventory)):
        return module_tree(model, dtype, computed_dtypes(model, dtype, special_dtypes))
    if isinstance(model, (str, os.PathLike)):
        if is_config_source(model):
            return as_tree(model_from_config(model), dtype, special_dtypes)
        meta = meta_model_from_folder(os.fspath(model))
        meta = meta if meta is not None else reference_model_from_folder(os.fspath(model))
        tree = tree_from_checkpoint(os.fspath(model), model=meta)
        if meta is None:
            return as_tree(in_execution_order(tree, os.fspath(model)), dtype, special_dtypes)
        return as_tree(tree, dtype, computed_dtypes(meta, dtype, special_dtypes))
    raise ArgumentTypeError(f"expected an nn.Module, a SizeTree or a checkpoint path, got {type(model).__name__}")


def computed_dtypes(
    model: nn.Module | ModelInventory,
    dtype: torch.dtype | str | None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
) -> Mapping[str, torch.dtype | str] | None:
    """``special_dtypes`` plus the dtype the loader gives each floating buffer the model
    computes itself (non-persistent: never in a checkpoint) when it loads in ``dtype``: for a
    transformers model, the dtype ``from_pretrained(dtype=)`` builds it in (rotary ``inv_freq``
    stays float32 in a bfloat16 Llama: transformers computes it in float32 on purpose); for any
    other model, the dtype it was built with (the loader materialises it, it does not cast it).
    A name ``special_dtypes`` covers keeps what it says. So a plan's bytes are the loaded model's.

    Example:
        >>> import transformers
        >>> config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...                                   num_attention_heads=2, vocab_size=10)
        >>> computed_dtypes(transformers.LlamaForCausalLM(config), "bfloat16")
        {'model.rotary_emb.inv_freq': torch.float32, 'model.rotary_emb.original_inv_freq': torch.float32}
    """
    if dtype is None:
        return special_dtypes
    from bigviz.core.dtypes import canonical_dtype
    from bigviz.core.names import owner
    from bigviz.modeling.twin import computed_buffer_dtypes

    inventory = ModelInventory.of(model)
    wanted = getattr(torch, canonical_dtype(dtype))
    if is_transformers_model(inventory.model):
        built = computed_buffer_dtypes(inventory.model, wanted)
    else:
        built = {t.name: t.dtype for t in inventory.tensors if not t.persistent}
    given = dict(special_dtypes or {})
    extra: dict[str, torch.dtype | str] = {
        name: d
        for name, d in built.items()
        if d.is_floating_point and d != wanted and not (given and owner(name, given) is not None)
    }
    return {**extra, **given} if extra else special_dtypes


def in_execution_order(tree: SizeTree, where: object = "the checkpoint") -> SizeTree:
    """A tree read from checkpoint keys alone, its modules put in the order transformers models
    run them (:func:`~bigviz.core.names.execution_order`): embeddings, the blocks by number,
    then the final norm and head. The keys hold no definition order, and planning them in key
    order puts ``lm_head`` first (on GPU 0, in a pipeline's first stage) and GPT-2's ``wte``
    last. With more than one list of blocks (an encoder and a decoder) no name rule says which
    runs first: the keys' order is kept, with a warning naming the fix.

    Example:
        >>> from bigviz.core.tree import TensorSpec
        >>> keys = ["lm_head.w", "model.embed.w", "model.layers.0.w", "model.layers.1.w", "model.norm.w"]
        >>> list(in_execution_order(SizeTree.build([TensorSpec(k, 1, "float32") for k in keys])).tensors)
        ['model.embed.w', 'model.layers.0.w', 'model.layers.1.w', 'model.norm.w', 'lm_head.w']
    """
    names = list(tree.tensors)
    lists = detect_no_split(names)
    if len(lists) > 1:
        warnings.warn(
            f"{where}: no config.json, and its keys hold {len(lists)} lists of blocks ({', '.join(lists)}) "
            "whose execution order their names do not say; modules are planned in the keys' order. "
            "Put the model's config.json beside the checkpoint to plan in execution order",
            stacklevel=3,
        )
        return tree
    order = execution_order(names, lists[0].removesuffix("*").rstrip(".")) if lists else names
    if order == names:
        return tree
    return SizeTree.build([tree.tensors[n] for n in order], ties=tree.ties, containers=tree.containers)


def default_no_split(model: ModelLike, tree: SizeTree) -> list[str]:
    """The model's own no-split classes (``_no_split_modules``), or, for a checkpoint, those
    of the transformers model its ``config.json`` names, else the repeated numbered blocks
    found in its tensor names."""
    declared = getattr(model.model if isinstance(model, ModelInventory) else model, "_no_split_modules", None)
    if declared:
        return list(declared)
    if isinstance(model, (str, os.PathLike)):
        meta = meta_model_from_folder(os.fspath(model))
        declared = getattr(meta, "_no_split_modules", None)
        return list(declared) if declared else list(detect_no_split(list(tree.tensors)))
    return []


def inventory_or_none(model: ModelLike) -> ModelInventory | None:
    """The inventory of a model (a checkpoint: of the model its config.json builds on meta),
    or None for a bare size tree or a checkpoint without a known model."""
    if isinstance(model, (nn.Module, ModelInventory)):
        return ModelInventory.of(model)
    if isinstance(model, (str, os.PathLike)):
        meta = meta_model_from_folder(os.fspath(model))
        return None if meta is None else ModelInventory.of(meta)
    return None
