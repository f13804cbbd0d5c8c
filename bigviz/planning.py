"""The planning entry points users call: ``plan``, ``infer_auto_device_map`` and
``check_device_map``, for an ``nn.Module``, a :class:`SizeTree` or a checkpoint path.

This layer sits above ``modeling`` (trees from modules) and ``checkpoint`` (trees from
headers) so that one call takes either; ``engine`` and ``ui`` build on it.

Example:
    >>> import torch.nn as nn
    >>> model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(4)])  # 40,400 bytes each
    >>> infer_auto_device_map(model, {0: "150KB", "cpu": "1GB"}, strategy="sequential")
    {'0': 0, '1': 'cpu', '2': 'cpu', '3': 'cpu'}
"""
from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Union

import torch
import torch.nn as nn

from bigviz.checkpoint.tree import detect_no_split, tree_from_checkpoint
from bigviz.core.devicemap import validate_device_map
from bigviz.core.plan import DevicePlan, PlanOptions
from bigviz.core.strategies import check_no_split, make_plan
from bigviz.core.tree import SizeTree
from bigviz.core.units import Device
from bigviz.modeling.budgets import get_max_memory
from bigviz.modeling.sizes import module_tree

__all__ = ["plan", "infer_auto_device_map", "check_device_map", "as_tree", "default_no_split"]

ModelLike = Union[nn.Module, SizeTree, str, "os.PathLike[str]"]


def as_tree(model: ModelLike, dtype: torch.dtype | str | None = None,
            special_dtypes: Mapping[str, torch.dtype | str] | None = None) -> SizeTree:
    """A size tree from a model, a tree, or a checkpoint path (headers only, no model code)."""
    if isinstance(model, SizeTree):
        special = {k: str(v) for k, v in (special_dtypes or {}).items()}
        return model.with_dtype(str(dtype) if dtype is not None else None, special)
    if isinstance(model, nn.Module):
        return module_tree(model, dtype, special_dtypes)
    if isinstance(model, (str, os.PathLike)):
        return as_tree(tree_from_checkpoint(model), dtype, special_dtypes)
    raise TypeError(f"expected an nn.Module, a SizeTree or a checkpoint path, got {type(model).__name__}")


def default_no_split(model: ModelLike, tree: SizeTree) -> list[str]:
    """The model's own no-split classes (``_no_split_modules``), or, for a checkpoint,
    the repeated numbered blocks found in its tensor names."""
    declared = getattr(model, "_no_split_modules", None)
    if declared:
        return list(declared)
    if isinstance(model, (str, os.PathLike)):
        return list(detect_no_split(list(tree.tensors)))
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
            default: the model's ``_no_split_modules``. Each entry must match a class of the
            model or, for a glob, a module name: a typo raises ``PlanError`` listing the
            model's classes.
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
    if no_split_module_classes is not None:  # yours: a typo would split every block silently
        no_split_module_classes = _as_names(no_split_module_classes)
        check_no_split(tree, no_split_module_classes)
    no_split = no_split_module_classes if no_split_module_classes is not None else default_no_split(model, tree)
    options = PlanOptions(strategy=strategy, no_split=frozenset(no_split), reserve=dict(reserve or {}),
                          overrides=dict(overrides or {}), offload_reserve=offload_reserve, prefetch=prefetch)
    return make_plan(tree, get_max_memory(max_memory), options)


def _as_names(names: Collection[str] | str) -> list[str]:
    """``"Block"`` alone means ``["Block"]`` (not the letters B, l, o, c, k)."""
    return [names] if isinstance(names, str) else list(names)


def infer_auto_device_map(model: ModelLike, max_memory: Mapping[object, object] | None = None,
                          no_split_module_classes: Collection[str] | None = None,
                          dtype: torch.dtype | str | None = None,
                          special_dtypes: Mapping[str, torch.dtype | str] | None = None,
                          verbose: bool = False, clean_result: bool = True, offload_buffers: bool = False,
                          *, strategy: str = "auto", reserve: Mapping[object, object] | None = None,
                          overrides: Mapping[str, object] | None = None) -> dict[str, Device]:
    """Accelerate's function with bigviz's planner behind it: a ``{module: device}`` dict.

    ``verbose=True`` prints each placement and its reason (the plan itself is inspectable
    with :func:`plan`). ``offload_buffers`` is accepted for compatibility; bigviz counts
    buffers in module sizes either way.

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

