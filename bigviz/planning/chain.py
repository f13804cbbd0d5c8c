"""The chain of plans for a model: ``DevicePlan`` -> ``LoadPlan`` -> ``DispatchPlan``, each
printable before anything moves, and the one validation pass each entry point runs.

* :func:`load_plan`: which checkpoint key fills which tensor, from which file and bytes,
  converted how, to which device (:mod:`bigviz.checkpoint.load_plan`);
* :func:`dispatch_plan`: the offload units a dispatch fetches, where each is stored, what it
  fetches, in which order, and what stays resident (:mod:`bigviz.core.dispatch_plan`), made
  with the unit rule the planner reserves room with;
* :func:`map_problems`: every problem of a device map for a model, at once: keys that are not
  names, names the model lacks, values that are no device, devices this machine lacks,
  modules left uncovered.

Example:
    >>> import torch.nn as nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> plan = dispatch_plan(model, device_map={"0": "cpu", "2": "disk"})
    >>> [(u.name, u.storage, u.nbytes) for u in plan.units]
    [('2', 'disk', 40)]
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigviz.checkpoint.index import CheckpointIndex
from bigviz.checkpoint.load import inventory_of, plan_load
from bigviz.checkpoint.load_plan import LoadPlan
from bigviz.checkpoint.model_names import device_map_in_model_names
from bigviz.core.devicemap import complete_computed, complete_tied, device_map_problems, key_problems
from bigviz.core.devices import MISSING_DEVICE_FIX, Device, execution_device, normalize_device
from bigviz.core.dispatch_plan import DispatchPlan, make_dispatch_plan
from bigviz.core.errors import DeviceMapError
from bigviz.core.offload_units import UnitRule
from bigviz.core.plan import STRATEGIES, DevicePlan
from bigviz.core.quant import quantized_tree, with_stored
from bigviz.core.tree import SizeTree
from bigviz.modeling.budgets import absent_device_problems, available_devices
from bigviz.modeling.inventory import ModelInventory
from bigviz.modeling.quant import as_quant_config, quant_targets

__all__ = ["load_plan", "dispatch_plan", "dispatch_plan_for", "map_problems", "resolve_device_map"]

INVALID_MAP = "invalid device_map"


def map_problems(
    tree: SizeTree, device_map: Mapping[Any, object], *, main_device: object = None, machine: bool = True
) -> tuple[dict[str, Device], list[str]]:
    """The map completed and canonical, and every problem with it for this model (and, with
    ``machine``, for this machine: devices it lacks).

    Tied tensors the map leaves out join their leader; non-persistent buffers it leaves out go
    to the execution device (see :func:`bigviz.core.devicemap.validate_device_map`).

    Example:
        >>> from bigviz.core.tree import TensorSpec
        >>> tree = SizeTree.build([TensorSpec("a.w", 1, "float32"), TensorSpec("b.w", 1, "float32")])
        >>> _, problems = map_problems(tree, {"a": 7})
        >>> [p[:40] for p in problems]
        ['device map names GPU 7 (a), which this m', 'not covered by any key (add them, or a p']
    """
    problems = key_problems(device_map)
    named = {k: v for k, v in device_map.items() if isinstance(k, str)}
    completed = complete_computed(tree, complete_tied(tree, named))
    problems += device_map_problems(tree, completed, available_devices() if machine else None)
    if main_device is not None:
        try:
            main = normalize_device(main_device)
        except ValueError as err:
            problems.append(f"main_device: {err}")
        else:
            mapped = {_canonical_or_none(v) for v in completed.values()}
            if machine and main not in mapped:  # a GPU the map names is reported once, above
                problems += absent_device_problems({}, main_device=main_device)
    canonical: dict[str, Device] = {}
    for key, value in completed.items():
        try:
            canonical[key] = normalize_device(value)
        except ValueError:
            continue  # reported above
    return canonical, problems


def _canonical_or_none(value: object) -> Device | None:
    try:
        return normalize_device(value)
    except ValueError:
        return None


def check_map(
    tree: SizeTree,
    device_map: Mapping[Any, object],
    *,
    main_device: object = None,
    more: Collection[str] = (),
    machine: bool = True,
) -> dict[str, Device]:
    """The completed canonical map, or one `DeviceMapError` with every problem (and ``more``)."""
    canonical, problems = map_problems(tree, device_map, main_device=main_device, machine=machine)
    problems += list(more)
    missing = any("which this machine does not have" in p for p in problems)
    DeviceMapError.check(problems, INVALID_MAP, fix=MISSING_DEVICE_FIX if missing else "")
    return canonical


def dispatch_plan_for(
    inventory: ModelInventory,
    device_map: Mapping[Any, object],
    *,
    main_device: object = None,
    no_split_module_classes: Collection[str] | None = None,
    preload_module_classes: Collection[str] | None = None,
    offload_buffers: bool = False,
    prefetch: bool = True,
    tree: SizeTree | None = None,
    machine: bool = True,
) -> DispatchPlan:
    """The checked dispatch plan of ``device_map`` on a model's inventory.

    ``machine=False`` plans for hardware this machine lacks (no check that its devices exist).

    Raises:
        DeviceMapError: (a ``ValueError``) with every problem of the map, at once.
    """
    tree = tree if tree is not None else inventory.tree()
    canonical = check_map(tree, device_map, main_device=main_device, machine=machine)
    main = normalize_device(main_device) if main_device is not None else execution_device(canonical.values())
    blocks = no_split_module_classes if no_split_module_classes is not None else inventory.no_split
    rule = UnitRule(
        main,
        frozenset(blocks),
        frozenset(preload_module_classes or ()),
        {m: r for m, r in inventory.reads.items() if m in tree.nodes},
        offload_buffers,
        {k: v for k, v in inventory.same_module.items() if k in tree.nodes},
    )
    return make_dispatch_plan(tree, canonical, rule, prefetch=prefetch).check()


def resolve_device_map(
    model: nn.Module | ModelInventory,
    device_map: Any,
    *,
    max_memory: Any = None,
    no_split_module_classes: Collection[str] | None = None,
    dtype: Any = None,
    preload_module_classes: Collection[str] | None = None,
    offload_buffers: bool = False,
    quantization: object = None,
) -> tuple[dict[str, Any] | None, DevicePlan | None]:
    """``(map, plan)`` from what a user passes as ``device_map``: a strategy name (planned
    now, with the weights sized as ``quantization`` packs them), a `DevicePlan`, a dict, or None."""
    if device_map is None:
        return None, None
    if isinstance(device_map, str):
        if device_map not in STRATEGIES:
            raise ValueError(f"device_map={device_map!r}: use one of {', '.join(STRATEGIES)}, a dict or a DevicePlan")
        from bigviz.planning.device_plan import plan

        made = plan(
            model,
            max_memory,
            strategy=device_map,
            no_split_module_classes=no_split_module_classes,
            dtype=dtype,
            preload_module_classes=preload_module_classes,
            offload_buffers=offload_buffers,
            quantization=quantization,
        )
        return dict(made.device_map), made
    if isinstance(device_map, DevicePlan):
        return dict(device_map.device_map), device_map
    return dict(device_map), None


def load_plan(
    model: nn.Module | ModelInventory,
    checkpoint: str | Path | CheckpointIndex,
    device_map: Any = None,
    *,
    dtype: torch.dtype | str | None = None,
    offload_folder: str | Path | None = None,
    strict: bool = True,
    keep_in_fp32_modules: Sequence[str] | None = None,
    key_mapping: Mapping[str, str] | None = None,
    quantization: object = None,
) -> LoadPlan:
    """The load plan of ``checkpoint`` into ``model``: for each model tensor, the checkpoint
    key(s), file, byte offsets, stored and loaded dtype, conversion and target device; made
    from headers alone (nothing is read), checked, and printable (``.summary()``,
    ``.to_frame()``).

    Args:
        model: the model (on meta is fine) or its inventory.
        checkpoint: a weights file, an index file or a folder.
        device_map: a dict, a `DevicePlan`, or None (everything to the CPU). A map planned
            from checkpoint headers is translated into the model's names.
        dtype, offload_folder, strict, keep_in_fp32_modules, key_mapping, quantization: as for
            `bigviz.load_checkpoint_in_model` (``quantization="int8"``: each targeted weight's
            load reads the float tensor and packs it; its bytes are the packed ones).

    Raises:
        CheckpointError: listing every missing key, unexpected key, shape mismatch, bad
            device and file that cannot be used.

    Example:
        >>> import tempfile, torch, pathlib, bigviz
        >>> folder = bigviz.save_sharded(torch.nn.Linear(2, 2), pathlib.Path(tempfile.mkdtemp()) / "c",
        ...                              progress=False)
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(2, 2)
        >>> plan = load_plan(model, folder, {"": "disk"}, dtype=torch.float16)
        >>> [(t.name, t.device, t.source_dtype, str(t.dtype), t.in_place) for t in plan.loads]
        [('weight', 'disk', 'float32', 'torch.float16', True), ('bias', 'disk', 'float32', 'torch.float16', True)]
    """
    inventory = inventory_of(model)
    mapping, _ = resolve_device_map(inventory, device_map)
    if mapping is not None:
        mapping = device_map_in_model_names(inventory, checkpoint, mapping)
    return plan_load(
        inventory,
        checkpoint,
        mapping,
        dtype=dtype,
        offload_folder=offload_folder,
        strict=strict,
        keep_in_fp32_modules=keep_in_fp32_modules,
        key_mapping=key_mapping,
        quantization=as_quant_config(quantization),
    )[1]


def dispatch_plan(
    model: nn.Module | ModelInventory,
    checkpoint: str | Path | CheckpointIndex | None = None,
    device_map: Any = "auto",
    *,
    max_memory: Any = None,
    main_device: object = None,
    no_split_module_classes: Collection[str] | None = None,
    preload_module_classes: Collection[str] | None = None,
    offload_buffers: bool = False,
    prefetch: bool = True,
    dtype: torch.dtype | str | None = None,
    quantization: object = None,
) -> DispatchPlan:
    """The dispatch plan of ``device_map`` on ``model``: the offload units a dispatch fetches
    (the module each hook sits on, where its weights are stored, the tensors and buffers it
    fetches, their bytes), in fetch order, and the tensors that stay resident; printable
    (``.summary()``, ``.to_frame()``) before anything moves. Made with the unit rule the
    planner reserves room with, so what a plan promises is what the dispatch fetches.

    Args:
        model: the model (on meta is fine) or its inventory.
        checkpoint: the checkpoint it will load, if any: a map planned from its headers is
            translated into the model's names, and each tensor is sized in the dtype it loads in.
        device_map: a strategy (``"auto"``, planned now with ``max_memory``), a `DevicePlan`
            (its execution device and unit rule are used) or a dict.
        main_device, no_split_module_classes, preload_module_classes, offload_buffers,
        prefetch: as for `bigviz.dispatch_model`.
        dtype: the dtype the checkpoint loads in (with ``checkpoint``).
        quantization: ``"int8"``/``"int4"`` (or a config): the units' weights sized packed.

    Nothing is read but checkpoint headers, and the devices need not exist here: a plan for
    a machine you do not have is fine (executing it checks them).

    Raises:
        DeviceMapError: every problem of the map at once (names, device spellings, coverage).

    Example:
        >>> import torch.nn as nn
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> print(dispatch_plan(model, device_map={"": "disk"}).summary())
        DispatchPlan: execution on CPU, 1 offload unit, 160 B streamed per forward
          from disk: 1 unit, 160 B (<model>)
    """
    inventory = inventory_of(model) if checkpoint is not None else ModelInventory.of(model)
    config = as_quant_config(quantization)
    mapping, made = resolve_device_map(
        inventory,
        device_map,
        max_memory=max_memory,
        dtype=dtype,
        no_split_module_classes=no_split_module_classes,
        preload_module_classes=preload_module_classes,
        offload_buffers=offload_buffers,
        quantization=config,
    )
    if mapping is None:
        raise ValueError("dispatch_plan: give a device_map (a strategy such as 'auto', a dict or a DevicePlan)")
    tree = inventory.tree()
    if config is not None:
        tree = quantized_tree(tree, config, quant_targets(inventory, config))
    if checkpoint is not None:
        checkpoint = CheckpointIndex.open(checkpoint)  # headers read once for this call
        mapping = device_map_in_model_names(inventory, checkpoint, mapping)
        loads = plan_load(inventory, checkpoint, mapping, dtype=dtype, check=False, quantization=config)[1]
        tree = tree.with_dtype(None, {a: str(x.dtype).removeprefix("torch.") for x in loads.loads for a in x.aliases})
        packed = {a: (x.nbytes, x.operation) for x in loads.loads if _packs(x) for a in x.aliases}
        tree = with_stored(tree, packed)
    if made is not None and made.rule is not None:
        main_device = made.main_device if main_device is None else main_device
        no_split_module_classes = made.rule.blocks if no_split_module_classes is None else no_split_module_classes
    return dispatch_plan_for(
        inventory,
        mapping,
        main_device=main_device,
        tree=tree,
        no_split_module_classes=no_split_module_classes,
        preload_module_classes=preload_module_classes,
        offload_buffers=offload_buffers,
        prefetch=prefetch,
        machine=False,
    )


def _packs(load: Any) -> bool:
    """A load that puts a packed weight in memory (its bytes are the packed ones)."""
    return bool(getattr(getattr(load.conversion, "rule", None), "stores_packed", False))
