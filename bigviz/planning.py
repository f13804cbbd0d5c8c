"""The planning entry points users call: ``plan``, ``infer_auto_device_map`` and
``check_device_map``, for an ``nn.Module``, a :class:`SizeTree` or a checkpoint path.

This layer sits above ``modeling`` (trees from modules) and ``checkpoint`` (trees from
headers) so that one call takes either; ``engine`` and ``ui`` build on it.

Example:
    >>> import torch.nn as nn
    >>> model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(4)])  # 40,400 bytes each
    >>> infer_auto_device_map(model, {0: "150KB", "cpu": "1GB"})  # accelerate's default: in order
    {'0': 0, '1': 'cpu', '2': 'cpu', '3': 'cpu'}
"""
from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Union

import torch
import torch.nn as nn

from bigviz.checkpoint.hf import meta_model_from_folder
from bigviz.checkpoint.tree import detect_no_split, tree_from_checkpoint
from bigviz.core.devicemap import device_of, validate_device_map
from bigviz.core.names import is_prefix
from bigviz.core.plan import DevicePlan, PlanOptions
from bigviz.core.strategies import is_no_split, make_plan
from bigviz.core.tree import SizeTree
from bigviz.core.units import Device, device_label
from bigviz.modeling.budgets import get_max_memory
from bigviz.modeling.reads import direct_reads
from bigviz.modeling.sizes import module_tree

__all__ = ["plan", "infer_auto_device_map", "check_device_map", "as_tree", "default_no_split"]

ModelLike = Union[nn.Module, SizeTree, str, "os.PathLike[str]"]


def as_tree(model: ModelLike, dtype: torch.dtype | str | None = None,
            special_dtypes: Mapping[str, torch.dtype | str] | None = None) -> SizeTree:
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
    if isinstance(model, nn.Module):
        return module_tree(model, dtype, special_dtypes)
    if isinstance(model, (str, os.PathLike)):
        meta = meta_model_from_folder(model)
        return as_tree(tree_from_checkpoint(model, model=meta), dtype, special_dtypes)
    raise TypeError(f"expected an nn.Module, a SizeTree or a checkpoint path, got {type(model).__name__}")


def default_no_split(model: ModelLike, tree: SizeTree) -> list[str]:
    """The model's own no-split classes (``_no_split_modules``), or, for a checkpoint, those
    of the transformers model its ``config.json`` names, else the repeated numbered blocks
    found in its tensor names."""
    declared = getattr(model, "_no_split_modules", None)
    if declared:
        return list(declared)
    if isinstance(model, (str, os.PathLike)):
        meta = meta_model_from_folder(model)
        declared = getattr(meta, "_no_split_modules", None)
        return list(declared) if declared else list(detect_no_split(list(tree.tensors)))
    return []


def plan(model: ModelLike, max_memory: Mapping[object, object] | None = None, *,
         strategy: str = "auto", no_split_module_classes: Collection[str] | None = None,
         dtype: torch.dtype | str | None = None, reserve: Mapping[object, object] | None = None,
         overrides: Mapping[str, object] | None = None,
         special_dtypes: Mapping[str, torch.dtype | str] | None = None,
         offload_reserve: bool = True, prefetch: bool = True) -> DevicePlan:
    """Plan where every module goes, with bytes and a reason for each placement.

    Args:
        model: an ``nn.Module`` (on meta is fine), a :class:`SizeTree`, or a checkpoint path.
        max_memory: ``{0: "10GiB", "cpu": "30GiB", "disk": ...}``; default: this machine's
            free memory. GPUs the machine does not have can be planned for.
        strategy: ``"auto"``, ``"balanced"``, ``"balanced_low_0"`` or ``"sequential"``.
        no_split_module_classes: classes (or name globs like ``"transformer.h.*"``) kept whole;
            default: the model's ``_no_split_modules``.
        dtype: plan for this dtype (floating tensors only), e.g. ``torch.float16``.
        reserve: bytes per device kept free for activations and KV cache.
        overrides: ``{module: device}`` to honour; the rest is planned around them.

    Example:
        >>> import torch.nn as nn
        >>> p = plan(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10)), {"cpu": "1KB"})
        >>> p.device_map, p.placements[0].reason
        ({'': 'cpu'}, 'fits: 880 B of 1000 B left on CPU')
    """
    tree = as_tree(model, dtype, special_dtypes)
    no_split = no_split_module_classes if no_split_module_classes is not None else default_no_split(model, tree)
    options = PlanOptions(strategy=strategy, no_split=frozenset(no_split), reserve=dict(reserve or {}),
                          overrides=dict(overrides or {}), offload_reserve=offload_reserve, prefetch=prefetch)
    budgets = get_max_memory(max_memory)
    result = make_plan(tree, budgets, options)
    return _keep_direct_reads_resident(result, _module_of(model), tree, budgets, options)


def _module_of(model: ModelLike) -> nn.Module | None:
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, (str, os.PathLike)):
        return meta_model_from_folder(model)
    return None


def _keep_direct_reads_resident(result: DevicePlan, model: nn.Module | None, tree: SizeTree,
                                budgets: Mapping[Device, int], options: PlanOptions) -> DevicePlan:
    """Plan again with the modules read directly by a parent's code (not called: DeBERTa's
    ``rel_embeddings``, an ``nn.MultiheadAttention``'s ``out_proj``) on the execution device,
    where the plan had streamed them. bigviz's engine fetches such weights with their reader;
    accelerate's hooks, which run ``from_pretrained(device_map=...)``, fetch per called module
    and would leave them on meta. Reads inside a no-split block by the model's own code are
    left streamed with the block (they are on paths such as CUDA kernels or position
    interpolation); torch's own modules read their children's weights on every path.
    """
    if model is None:
        return result
    blocks = [n for n in tree.nodes if n and is_no_split(tree, n, options.no_split)]
    modules = dict(model.named_modules())
    reads = {m: r for m, r in direct_reads(model).items() if m in tree.nodes and (
        not any(is_prefix(b, m) for b in blocks) or type(modules[r]).__module__.startswith("torch.nn."))}
    streamed = {"disk"} if result.main_device == "cpu" else {"cpu", "disk"}
    moved = [m for m in reads if m not in options.overrides and device_of(m, result.unit_map) in streamed]
    if not moved:
        return result
    overrides = {**options.overrides, **dict.fromkeys(moved, result.main_device)}
    again = make_plan(tree, budgets, replace(options, overrides=overrides))
    why = {m: f"read directly by {reads[m] or 'the model'}'s code (not called): kept on "
              f"{device_label(result.main_device)}, where every loader can use it" for m in moved}
    placements = tuple(replace(p, reason=why[p.name], override=False) if p.name in why else p
                       for p in again.placements)
    return replace(again, placements=placements, _cache={})


def infer_auto_device_map(model: ModelLike, max_memory: Mapping[object, object] | None = None,
                          no_split_module_classes: Collection[str] | None = None,
                          dtype: torch.dtype | str | None = None,
                          special_dtypes: Mapping[str, torch.dtype | str] | None = None,
                          verbose: bool = False, clean_result: bool = True, offload_buffers: bool = False,
                          *, strategy: str = "sequential", reserve: Mapping[object, object] | None = None,
                          overrides: Mapping[str, object] | None = None) -> dict[str, Device]:
    """Accelerate's function with bigviz's planner behind it: a ``{module: device}`` dict.

    Like accelerate's, it fills the devices in order (``strategy="sequential"``): GPU 0 up to
    its budget, then GPU 1, ..., then the CPU, then disk; a balanced spread comes from a
    balanced ``max_memory`` (as accelerate's ``get_balanced_memory`` makes), or from
    ``strategy="balanced"``. ``device_map="auto"`` in loading (and :func:`plan`'s default)
    balances, as transformers does. ``verbose=True`` prints each placement and its reason
    (the plan itself is inspectable with :func:`plan`). ``offload_buffers`` is accepted for
    compatibility; bigviz counts buffers in module sizes either way.

    Example:
        >>> import torch.nn as nn
        >>> infer_auto_device_map(nn.Linear(10, 10), {"cpu": "1KB"})
        {'': 'cpu'}
    """
    result = plan(model, max_memory, strategy=strategy, no_split_module_classes=no_split_module_classes,
                  dtype=dtype, special_dtypes=special_dtypes, reserve=reserve, overrides=overrides)
    if verbose:
        print(result.summary())
        for p in result.placements:
            print(f"  {p.name or '<model>'}: {p.device} ({p.reason})")
    return result.device_map if clean_result else dict(result.unit_map)


def check_device_map(model: ModelLike, device_map: Mapping[str, object], *,
                     devices: Collection[Device] | None = None) -> dict[str, Device]:
    """Check that ``device_map`` covers every tensor of ``model`` with known devices.

    Returns the map with canonical devices (``"cuda:1"`` -> ``1``).

    Raises:
        ValueError: naming every module or tensor not covered, every unknown device and
            every key that names no module, with the fix.

    Example:
        >>> import torch.nn as nn
        >>> check_device_map(nn.Linear(2, 2), {"": "cuda:0"})
        {'': 0}
    """
    return validate_device_map(as_tree(model), device_map, devices)

