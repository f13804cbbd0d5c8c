"""The planner's inputs, prepared once for every caller: ``bigviz.plan``, ``max_context``, the
Planner widget, and the chain of plans.

Planning a model takes more than its size tree and the budgets: the default "cpu" budget of
a model that may not fit in RAM (room for the stream's ring, :func:`~bigviz.core.stream_plan.resident_room`),
the model's no-split classes, the unit rule's knobs (modules read directly by a parent's code,
modules shared under two names), and after the pass, the direct-read rule (those modules kept
on the execution device: :func:`place`). :func:`planner_inputs` gathers all of them, so a model
planned by ``bigviz.plan`` and by the widget is placed the same way.

Example:
    >>> import torch.nn as nn
    >>> inputs = planner_inputs(nn.Sequential(nn.MultiheadAttention(4, 2)), {"cpu": "1MB"})
    >>> dict(inputs.options.rule.reads), place(inputs).device_map
    ({'0.out_proj': '0'}, {'': 'cpu'})
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn

from bigviz.checkpoint.quantized import quantization_config
from bigviz.core.devicemap import device_of
from bigviz.core.devices import Device, device_label, streamed_devices
from bigviz.core.errors import PlanError
from bigviz.core.headroom import headroom
from bigviz.core.names import is_prefix
from bigviz.core.nosplit import check_no_split, is_no_split
from bigviz.core.offload_units import UnitRule, largest_unit
from bigviz.core.plan import DevicePlan, PlanOptions
from bigviz.core.planner import make_plan
from bigviz.core.quant import QuantConfig, default_targets, quantized_tree
from bigviz.core.stream_plan import MachineFacts, resident_room
from bigviz.core.tree import SizeTree
from bigviz.core.workload import Workload
from bigviz.modeling.budgets import get_max_memory, machine_facts
from bigviz.modeling.inventory import ModelInventory
from bigviz.modeling.quant import as_quant_config, quant_targets
from bigviz.planning.models import ModelLike, as_tree, default_no_split, inventory_or_none, resolve_model
from bigviz.planning.positions import check_context, position_rule
from bigviz.planning.workload import device_type, workload_bytes

__all__ = [
    "PlannerInputs",
    "planner_inputs",
    "with_workload",
    "place",
    "unit_rule_of",
    "no_split_names",
    "quantized_for_plan",
    "quant_note",
]


@dataclass(frozen=True)
class PlannerInputs:
    """What :func:`~bigviz.core.planner.make_plan` takes for one model, and what :func:`place`
    needs after it.

    Attributes:
        model: The model as resolved (a ``config.json`` built on meta; an ``nn.Module`` as its
            inventory, walked once).
        tree: Its size tree, at the planned dtype.
        budgets: Bytes per device (this machine's when none were given, the "cpu" one leaving
            room for the stream's ring when the model does not fit in RAM).
        options: The planner's knobs, the unit rule included.
        inventory: The model's inventory (``None`` for a bare size tree or a checkpoint of a
            model bigviz cannot build).
        notes: What the plan notes about its inputs (a context past the length the model was
            trained for).
        dtype: The dtype the model is planned in (``None``: as built), for its run's bytes.
        given_run: ``(kv_cache, activations)`` bytes per module given by hand, if any.
        quant_note: The line naming the quantization the tree is sized in ("" when none).
        given_reserve: ``reserve`` as the caller gave it: the headroom kept per device depends
            on whether a run is planned (:func:`bigviz.core.headroom.headroom`).
    """

    model: Any
    tree: SizeTree
    budgets: dict[Device, int]
    options: PlanOptions
    inventory: ModelInventory | None
    notes: tuple[str, ...] = ()
    dtype: torch.dtype | str | None = None
    given_run: tuple[Mapping[str, int] | None, Mapping[str, int] | None] = (None, None)
    quant_note: str = ""
    given_reserve: Mapping[Any, object] | int | str | None = None


def planner_inputs(
    model: ModelLike,
    max_memory: Mapping[Any, object] | None = None,
    *,
    strategy: str = "auto",
    no_split_module_classes: Collection[str] | str | None = None,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    reserve: Mapping[Any, object] | int | str | None = None,
    overrides: Mapping[str, object] | None = None,
    offload_reserve: bool = True,
    prefetch: bool = True,
    workload: Workload | None = None,
    kv_cache: Mapping[str, int] | None = None,
    activations: Mapping[str, int] | None = None,
    preload_module_classes: Collection[str] | None = None,
    offload_buffers: bool = False,
    quantization: object = None,
    machine: MachineFacts | None = None,
) -> PlannerInputs:
    """Everything the planner takes for ``model`` (see :func:`bigviz.plan` for the knobs;
    ``quantization``: the linear layers' weights sized as the quantizer packs them, the one
    place ``bigviz.plan``, ``max_context`` and the Planner size them; ``machine``: the facts
    of the machine planned for, whose RAM sets the default "cpu" budget without ``max_memory``).

    Raises:
        PlanError: a no-split class the model does not have (a typo would split every block
            silently), or a run the planner cannot describe.
    """
    model = resolve_model(model)
    model = ModelInventory.of(model) if isinstance(model, nn.Module) else model  # one walk for the call
    tree = as_tree(model, dtype, special_dtypes)
    config = as_quant_config(quantization)
    tree = quantized_for_plan(model, tree, config)
    no_split = no_split_names(model, tree, no_split_module_classes)
    budgets = get_max_memory(max_memory)
    if max_memory is None and "cpu" in budgets:  # a model larger than RAM leaves room to stream
        budgets["cpu"] = resident_room(
            machine if machine is not None else machine_facts(),  # the machine planned for, as the stream plan's
            model_bytes=tree.total(""),
            largest_unit=largest_unit(tree, frozenset(no_split)),
        )
    inventory = inventory_or_none(model)
    options = PlanOptions(
        strategy=strategy,
        reserve=dict(reserve) if isinstance(reserve, Mapping) else {},  # with_workload: the headroom
        overrides=dict(overrides or {}),
        offload_reserve=offload_reserve,
        prefetch=prefetch,
        rule=unit_rule_of(inventory, tree, no_split, preload=preload_module_classes, offload_buffers=offload_buffers),
    )
    inputs = PlannerInputs(
        model,
        tree,
        budgets,
        options,
        inventory,
        dtype=dtype,
        given_run=(kv_cache, activations),
        given_reserve=reserve,
        quant_note=quant_note(model, tree, config),
    )
    return with_workload(inputs, workload or Workload())


def with_workload(inputs: PlannerInputs, workload: Workload) -> PlannerInputs:
    """``inputs`` planning the run ``workload`` beside the weights (its KV cache and activations
    per module, read from the model unless given by hand): ``max_context`` prepares a model's
    inputs once and plans each context it tries with this.

    Example:
        >>> import torch
        >>> from bigviz.models import build
        >>> with torch.device("meta"):
        ...     inputs = planner_inputs(build("gpt-tiny"), {"cpu": "1GB"})
        >>> run = with_workload(inputs, Workload(1, 16)).options
        >>> run.workload.context_length, sum(run.kv_cache.values()) > 0, inputs.options.kv_cache
        (16, True, {})
    """
    kv_cache, activations = inputs.given_run
    context = workload.context_length
    note = check_context(position_rule(inputs.model), context) if context else None  # past a table: refused
    run = workload_bytes(
        inputs.model,
        inputs.tree,
        workload,
        dtype=inputs.dtype,
        device_type=device_type(inputs.budgets),
        kv_cache=kv_cache,
        activations=activations,
    )
    planned = bool(run.kv_cache or run.activations)
    room = headroom(inputs.budgets, inputs.given_reserve, defaults=planned)  # the default headroom: with a run
    options = replace(
        inputs.options,
        kv_cache=run.kv_cache,
        activations=run.activations,
        held=run.held,
        reserve=room.reserve,
        run_slack=room.run_slack,
        workload=workload if planned else None,
    )
    return replace(inputs, options=options, notes=(*((note,) if note else ()), *room.notes))


def no_split_names(model: ModelLike, tree: SizeTree, given: Collection[str] | str | None) -> list[str]:
    """The no-split classes (or module-name globs) to plan with: the ones given, checked
    against the model (``"Block"`` alone means ``["Block"]``, not its letters), else the
    model's own (``_no_split_modules``, or those found in a checkpoint).

    Example:
        >>> import torch.nn as nn
        >>> no_split_names(nn.Linear(2, 2), as_tree(nn.Linear(2, 2)), "Linear")
        ['Linear']
    """
    if given is None:
        return default_no_split(model, tree)
    names = [given] if isinstance(given, str) else list(given)
    check_no_split(tree, names)  # yours: a typo would split every block silently
    return names


def unit_rule_of(
    inventory: ModelInventory | None,
    tree: SizeTree,
    blocks: Collection[str],
    *,
    preload: Collection[str] | None = None,
    offload_buffers: bool = False,
    main_device: Device | None = None,
) -> UnitRule:
    """The unit rule of a model: its blocks, its modules read directly by a parent's code and
    its modules shared under two names (from the inventory, restricted to the tree), with the
    preload classes and buffer rule of the dispatch.

    Example:
        >>> import torch.nn as nn
        >>> mha = nn.Sequential(nn.MultiheadAttention(4, 2))
        >>> dict(unit_rule_of(ModelInventory.of(mha), as_tree(mha), ()).reads)
        {'0.out_proj': '0'}
    """
    reads = inventory.reads if inventory is not None else {}
    same = inventory.same_module if inventory is not None else {}
    return UnitRule(
        main_device,
        frozenset(blocks),
        frozenset(preload or ()),
        {m: r for m, r in reads.items() if m in tree.nodes},
        offload_buffers,
        {k: v for k, v in same.items() if k in tree.nodes},
    )


def place(inputs: PlannerInputs) -> DevicePlan:
    """Plan: :func:`~bigviz.core.planner.make_plan`, then the modules a parent's code reads
    directly (not called: DeBERTa's ``rel_embeddings``, an ``nn.MultiheadAttention``'s
    ``out_proj``) planned again onto the execution device where the pass streamed them.
    bigviz's engine fetches such weights with their reader; accelerate's hooks, which run
    ``from_pretrained(device_map=...)``, fetch per called module and would leave them on meta.
    Reads inside a no-split block by the model's own code are left streamed with the block
    (they are on paths such as CUDA kernels or position interpolation); torch's own modules
    read their children's weights on every path.

    Raises:
        PlanError: nothing fits, or the inputs are invalid.
    """
    result = _direct_reads_resident(inputs, make_plan(inputs.tree, inputs.budgets, inputs.options))
    notes = (*inputs.notes, inputs.quant_note) if inputs.quant_note else inputs.notes
    return replace(result, notes=(*result.notes, *notes), _cache={}) if notes else result


def _direct_reads_resident(inputs: PlannerInputs, result: DevicePlan) -> DevicePlan:
    inventory, options, tree = inputs.inventory, inputs.options, inputs.tree
    if inventory is None or not inventory.reads:
        return result
    blocks = [n for n in tree.nodes if n and is_no_split(tree, n, options.rule.blocks)]
    modules = inventory.modules
    reads = {
        m: r
        for m, r in inventory.reads.items()
        if m in tree.nodes
        and (not any(is_prefix(b, m) for b in blocks) or type(modules[r]).__module__.startswith("torch.nn."))
    }
    streamed = streamed_devices(result.main_device)
    moved = [m for m in reads if m not in options.overrides and device_of(m, result.unit_map) in streamed]
    if not moved:
        return result
    overrides = {**options.overrides, **dict.fromkeys(moved, result.main_device)}
    again = make_plan(tree, inputs.budgets, replace(options, overrides=overrides))
    why = {
        m: f"read directly by {reads[m] or 'the model'}'s code (not called): kept on "
        f"{device_label(result.main_device)}, where every loader can use it"
        for m in moved
    }
    placements = tuple(replace(p, reason=why[p.name], override=False) if p.name in why else p for p in again.placements)
    return replace(again, placements=placements, _cache={})


def quantized_for_plan(model: ModelLike, tree: SizeTree, config: QuantConfig | None) -> SizeTree:
    """``tree`` with the weights ``config`` packs in their packed bytes (the model's rule when
    there is a model, else the one for names and shapes alone).

    Raises:
        PlanError: ``model`` is a checkpoint already stored quantized (it is sized as stored).
    """
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


def quant_note(model: ModelLike, tree: SizeTree, config: QuantConfig | None) -> str:
    """One line naming the quantization a plan sized, its packed bytes and the dtype the model
    computes in ("" when none): a plan's bytes are only read right knowing the format."""
    from bigviz.core.quant import prequantized_format
    from bigviz.core.sizes import format_size

    packed = [s for s in tree.tensors.values() if s.quant]
    computed = sorted({s.dtype for s in packed}) or _dominant_dtype(tree)
    in_dtype = f"computed in {', '.join(computed)}"
    if config is not None:
        size = format_size(sum(s.nbytes for s in packed))
        hint = _INT8_HINT if config.method == "int8" and "float32" in computed else ""
        return f"quantized: {len(packed)} weights as {config.describe()}, {size}; {in_dtype}{hint}"
    qc = quantization_config(os.fspath(model)) if isinstance(model, (str, os.PathLike)) else None
    if qc is None:
        return ""
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    held = f"{len(packed)} weights held packed ({format_size(sum(s.nbytes for s in packed))})" if packed else ""
    hint = _INT8_HINT if method == "torchao" and "float32" in computed else ""
    return f"stored quantized ({method}): {held or prequantized_format(method).how}; {in_dtype}{hint}"


_INT8_HINT = (
    " (int8 in float32 runs torchao's path, slower than float32 on a CPU; with dtype=torch.bfloat16 "
    "it runs on torch's packed int8 kernel: docs/quantization.md)"
)


def _dominant_dtype(tree: SizeTree) -> list[str]:
    by_dtype: dict[str, int] = {}
    for spec in tree.tensors.values():
        by_dtype[spec.dtype] = by_dtype.get(spec.dtype, 0) + spec.nbytes
    return [max(by_dtype, key=by_dtype.__getitem__)] if by_dtype else []
