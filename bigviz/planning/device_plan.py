"""The planning entry points users call: ``plan``, ``infer_auto_device_map`` and
``check_device_map``, for an ``nn.Module``, a :class:`SizeTree` or a checkpoint path, and
``plan_pipeline`` (stages across ranks, run by ``torch.distributed``; see ``bigviz.distributed``).

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
from typing import Any, TypedDict
from dataclasses import replace

import torch
import torch.nn as nn

from bigviz.core.devicemap import device_of, validate_device_map
from bigviz.core.devices import Device, device_label, streamed_devices
from bigviz.core.names import is_prefix
from bigviz.core.errors import PlanError
from bigviz.core.plan import DevicePlan, PlanOptions
from bigviz.core.planner import check_no_split, is_no_split, make_plan
from bigviz.core.quant import QuantConfig, default_targets, quantized_tree
from bigviz.core.tree import SizeTree
from bigviz.core.workload import Workload
from bigviz.modeling.budgets import get_max_memory
from bigviz.checkpoint.quantized import quantization_config
from bigviz.modeling.inventory import ModelInventory
from bigviz.modeling.quant import as_quant_config, quant_targets
from bigviz.planning.models import ModelLike, as_tree, default_no_split, inventory_or_none, resolve_model
from bigviz.planning.workload import device_type, workload_bytes

__all__ = ["plan", "infer_auto_device_map", "check_device_map", "keep_direct_reads_resident", "unit_knobs"]


def plan(
    model: ModelLike,
    max_memory: Mapping[Any, object] | None = None,
    *,
    strategy: str = "auto",
    no_split_module_classes: Collection[str] | None = None,
    dtype: torch.dtype | str | None = None,
    reserve: Mapping[Any, object] | None = None,
    overrides: Mapping[str, object] | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    offload_reserve: bool = True,
    prefetch: bool = True,
    batch_size: int = 1,
    context_length: int | None = None,
    kv_dtype: torch.dtype | str | None = None,
    kv_cache: Mapping[str, int] | None = None,
    activations: Mapping[str, int] | None = None,
    preload_module_classes: Collection[str] | None = None,
    offload_buffers: bool = False,
    quantization: object = None,
) -> DevicePlan:
    """Plan where every module goes, with bytes and a reason for each placement.

    Args:
        model: an ``nn.Module`` (on meta is fine), a :class:`SizeTree`, a checkpoint path, or
            a ``config.json`` (or a folder holding only one: the model is built on meta).
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
        batch_size: sequences run together (with ``context_length``).
        context_length: plan the run too: each layer's KV cache (or recurrent state) for this
            many tokens on the device the layer runs on (its own; the execution device when it
            is streamed in from cpu or disk), and on every device that runs a layer, room for
            the activations of the largest step, the prefill of ``context_length`` tokens.
        kv_dtype: the cache's dtype (default: the compute dtype).
        kv_cache, activations: ``{module: bytes}`` given by hand, for a model whose layout
            bigviz does not know (they replace what bigviz would read from the model).
        preload_module_classes, offload_buffers: as the dispatch will use them: the room kept
            for streamed weights is computed from the offload units the engine will fetch
            (:mod:`bigviz.core.offload_units`).
        quantization: ``"int8"`` or ``"int4"`` (or a `~bigviz.core.quant.QuantConfig`, or
            transformers' ``TorchAoConfig`` / ``BitsAndBytesConfig``): the linear layers'
            weights sized as the quantizer stores them (values, scales, zero points; the
            modules it keeps in high precision as they are), exactly what
            ``load_checkpoint_and_dispatch(..., quantization=...)`` puts in memory. A checkpoint
            stored quantized is sized as stored without it.

    Example:
        >>> import torch.nn as nn
        >>> p = plan(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10)), {"cpu": "1KB"})
        >>> p.device_map, p.placements[0].reason
        ({'': 'cpu'}, 'fits: 880 B of 1000 B left on CPU')
    """
    model = resolve_model(model)
    model = ModelInventory.of(model) if isinstance(model, nn.Module) else model  # one walk for the call
    tree = as_tree(model, dtype, special_dtypes)
    tree = _quantized(model, tree, as_quant_config(quantization))
    if no_split_module_classes is not None:  # yours: a typo would split every block silently
        no_split_module_classes = _as_names(no_split_module_classes)
        check_no_split(tree, no_split_module_classes)
    no_split = no_split_module_classes if no_split_module_classes is not None else default_no_split(model, tree)
    budgets = get_max_memory(max_memory)
    if max_memory is None and "cpu" in budgets:  # a model larger than RAM leaves room to stream
        from bigviz.core.streaming import default_cpu_budget

        budgets["cpu"] = default_cpu_budget(tree, budgets["cpu"], frozenset(no_split))
    workload = Workload(batch_size, context_length or 0, None if kv_dtype is None else str(kv_dtype))
    kv, act = workload_bytes(
        model, tree, workload, dtype=dtype, device_type=device_type(budgets), kv_cache=kv_cache, activations=activations
    )
    inventory = inventory_or_none(model)
    options = PlanOptions(
        strategy=strategy,
        no_split=frozenset(no_split),
        reserve=dict(reserve or {}),
        overrides=dict(overrides or {}),
        offload_reserve=offload_reserve,
        prefetch=prefetch,
        kv_cache=kv,
        activations=act,
        workload=workload if (kv or act) else None,
        **unit_knobs(inventory, tree, preload_module_classes, offload_buffers),
    )
    result = make_plan(tree, budgets, options)
    result = keep_direct_reads_resident(result, inventory, tree, budgets, options)
    note = _quant_note(model, tree, as_quant_config(quantization))
    return replace(result, notes=(*result.notes, note)) if note else result


def _quantized(model: ModelLike, tree: SizeTree, config: QuantConfig | None) -> SizeTree:
    """``tree`` with the weights ``config`` packs in their packed bytes (the model's rule when
    there is a model, else the one for names and shapes alone)."""
    if config is None:
        return tree
    if isinstance(model, (str, os.PathLike)) and quantization_config(os.fspath(model)) is not None:
        raise PlanError(
            f"quantization={config.method!r}: {os.fspath(model)!r} is already stored quantized; plan it "
            "without quantization= (it is sized as stored)"
        )
    inventory = inventory_or_none(model)
    targets = quant_targets(inventory, config) if inventory is not None else default_targets(tree, config)
    return quantized_tree(tree, config, [t for t in targets if t in tree.tensors])


def _quant_note(model: ModelLike, tree: SizeTree, config: QuantConfig | None) -> str:
    """One line naming the quantization a plan sized, its packed bytes and the dtype the model
    computes in ("" when none): a plan's bytes are only read right knowing the format."""
    from bigviz.core.quant import prequantized_format
    from bigviz.core.sizes import format_size

    packed = [s for s in tree.tensors.values() if s.quant]
    computed = sorted({s.dtype for s in packed}) or _dominant_dtype(tree)
    in_dtype = f"computed in {', '.join(computed)}"
    if config is not None:
        size = format_size(sum(s.nbytes for s in packed))
        return f"quantized: {len(packed)} weights as {config.describe()}, {size}; {in_dtype}"
    qc = quantization_config(os.fspath(model)) if isinstance(model, (str, os.PathLike)) else None
    if qc is None:
        return ""
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    held = f"{len(packed)} weights held packed ({format_size(sum(s.nbytes for s in packed))})" if packed else ""
    return f"stored quantized ({method}): {held or prequantized_format(method).how}; {in_dtype}"


def _dominant_dtype(tree: SizeTree) -> list[str]:
    by_dtype: dict[str, int] = {}
    for spec in tree.tensors.values():
        by_dtype[spec.dtype] = by_dtype.get(spec.dtype, 0) + spec.nbytes
    return [max(by_dtype, key=by_dtype.__getitem__)] if by_dtype else []


class UnitKnobs(TypedDict):
    """The `PlanOptions` fields of the unit rule (see `bigviz.core.offload_units.UnitRule`)."""

    reads: dict[str, str]
    same_module: dict[str, str]
    preload: frozenset[str]
    offload_buffers: bool


def unit_knobs(
    inventory: ModelInventory | None,
    tree: SizeTree,
    preload: Collection[str] | None = None,
    offload_buffers: bool = False,
) -> UnitKnobs:
    """The unit rule's knobs a model gives (`PlanOptions` fields): its direct reads and its
    modules shared under two names, with the preload classes and buffer rule of the dispatch.

    Example:
        >>> import torch.nn as nn
        >>> mha = nn.Sequential(nn.MultiheadAttention(4, 2))
        >>> unit_knobs(ModelInventory.of(mha), as_tree(mha))["reads"]
        {'0.out_proj': '0'}
    """
    reads = {m: r for m, r in (inventory.reads if inventory is not None else {}).items() if m in tree.nodes}
    same = inventory.same_module if inventory is not None else {}
    return {
        "reads": reads,
        "same_module": {k: v for k, v in same.items() if k in tree.nodes},
        "preload": frozenset(preload or ()),
        "offload_buffers": offload_buffers,
    }


def keep_direct_reads_resident(
    result: DevicePlan,
    model: ModelInventory | None,
    tree: SizeTree,
    budgets: Mapping[Device, int],
    options: PlanOptions,
) -> DevicePlan:
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
    modules = model.modules
    reads = {
        m: r
        for m, r in model.reads.items()
        if m in tree.nodes
        and (not any(is_prefix(b, m) for b in blocks) or type(modules[r]).__module__.startswith("torch.nn."))
    }
    streamed = streamed_devices(result.main_device)
    moved = [m for m in reads if m not in options.overrides and device_of(m, result.unit_map) in streamed]
    if not moved:
        return result
    overrides = {**options.overrides, **dict.fromkeys(moved, result.main_device)}
    again = make_plan(tree, budgets, replace(options, overrides=overrides))
    why = {
        m: f"read directly by {reads[m] or 'the model'}'s code (not called): kept on "
        f"{device_label(result.main_device)}, where every loader can use it"
        for m in moved
    }
    placements = tuple(replace(p, reason=why[p.name], override=False) if p.name in why else p for p in again.placements)
    return replace(again, placements=placements, _cache={})


def _as_names(names: Collection[str] | str) -> list[str]:
    """``"Block"`` alone means ``["Block"]`` (not the letters B, l, o, c, k)."""
    return [names] if isinstance(names, str) else list(names)


def infer_auto_device_map(
    model: ModelLike,
    max_memory: Mapping[Any, object] | None = None,
    no_split_module_classes: Collection[str] | None = None,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    *,
    strategy: str = "sequential",
    reserve: Mapping[Any, object] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> dict[str, Device]:
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
    result = plan(
        model,
        max_memory,
        strategy=strategy,
        no_split_module_classes=no_split_module_classes,
        dtype=dtype,
        special_dtypes=special_dtypes,
        reserve=reserve,
        overrides=overrides,
    )
    if verbose:
        print(result.summary())
        for p in result.placements:
            print(f"  {p.name or '<model>'}: {p.device} ({p.reason})")
    return result.device_map if clean_result else dict(result.unit_map)


def check_device_map(
    model: ModelLike, device_map: Mapping[str, object], *, devices: Collection[Device] | None = None
) -> dict[str, Device]:
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
