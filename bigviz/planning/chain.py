"""The chain of plans for a model: ``DevicePlan`` -> ``LoadPlan`` -> ``DispatchPlan``, each
printable before anything moves, made by one function and validated once.

* :func:`plan_chain`: the three at once: the device plan (planned now for a strategy, or
  given), the load plan of the checkpoint (which key fills which tensor, from which file and
  bytes, converted how, to which device), and the dispatch plan made from the device plan with
  its unit rule (the offload units, what stays resident, and how each unit lives at run time:
  its stream plan, for this machine's facts). One validation pass: every problem of the map
  and of the checkpoint in one error, before anything is read. ``load_checkpoint_and_dispatch``,
  ``dispatch_model`` and :func:`dispatch_plan` all go through it, and the engine executes
  what it returns;
* :func:`load_plan`, :func:`dispatch_plan`: one link each, for printing;
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
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from bigviz.checkpoint.index import CheckpointIndex
from bigviz.checkpoint.load import inventory_of, plan_load, torch_load_dtype
from bigviz.checkpoint.load_plan import LoadPlan, check_plan, plan_problems
from bigviz.checkpoint.model_names import device_map_in_model_names
from bigviz.core.devicemap import complete_computed, complete_tied, device_map_problems, key_problems
from bigviz.core.devices import MISSING_DEVICE_FIX, Device, execution_device, normalize_device
from bigviz.core.dispatch_plan import DispatchPlan, make_dispatch_plan
from bigviz.core.errors import DeviceMapError
from bigviz.core.offload_units import UnitRule
from bigviz.core.plan import STRATEGIES, DevicePlan
from bigviz.core.quant import QuantConfig, quantized_tree, with_stored
from bigviz.core.stream_plan import MachineFacts, StreamOptions, check_stream_options
from bigviz.core.tree import SizeTree
from bigviz.modeling.budgets import absent_device_problems, available_devices, machine_facts
from bigviz.modeling.inventory import ModelInventory
from bigviz.modeling.quant import as_quant_config, quant_targets
from bigviz.planning.inputs import no_split_names, unit_rule_of

__all__ = ["PlanChain", "plan_chain", "load_plan", "dispatch_plan", "map_problems", "check_map"]

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


class PlanChain(NamedTuple):
    """The chain of plans of one call: ``(device, load, dispatch)``.

    Attributes:
        device: The device plan (``None`` when a dict was given as the map).
        load: The load plan of the checkpoint (``None`` without one).
        dispatch: The dispatch plan, its stream plan included (``None`` without a map: a
            load onto the CPU, nothing dispatched).
    """

    device: DevicePlan | None
    load: LoadPlan | None
    dispatch: DispatchPlan | None


def plan_chain(
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
    strict: bool = True,
    offload_folder: str | Path | None = None,
    resident: str = "auto",
    stream: str = "ring",
    readers: int = 4,
    machine: MachineFacts | None = None,
    check_machine: bool = True,
    quantization: object = None,
) -> PlanChain:
    """The whole chain for ``model``: ``(DevicePlan, LoadPlan, DispatchPlan)``, validated once.

    Args:
        model: the model (on meta is fine) or its inventory.
        checkpoint: the checkpoint it loads, if any (a weights file, index, folder, or an
            opened `CheckpointIndex`): a map planned from its headers is translated into the
            model's names, and each tensor is sized in the dtype it loads in.
        device_map: a strategy (``"auto"``, ... planned now with ``max_memory``), a
            `DevicePlan` (its execution device and unit rule are used), a dict, or None (load
            on the CPU, no dispatch).
        main_device, no_split_module_classes, preload_module_classes, offload_buffers,
        prefetch: as for `bigviz.dispatch_model` (given ones override a plan's).
        dtype, strict, offload_folder: as for `bigviz.load_checkpoint_and_dispatch`.
        resident, stream, readers: what is asked of the stream plan
            (:class:`~bigviz.core.stream_plan.StreamOptions`).
        machine: the machine's facts the stream plan is made for (default: this machine's
            available RAM now).
        check_machine: refuse devices this machine lacks (``False``: plan for another one).
        quantization: ``"int8"`` / ``"int4"`` (or a config): the linear layers' weights are
            quantized while they load; every plan sizes them packed.

    Raises:
        DeviceMapError: every problem of the map (names, devices, coverage), at once.
        CheckpointError: every problem of the map and of the checkpoint, at once.
        PlanError: a strategy that does not fit, a streaming knob out of range, or a resident
            copy that cannot fit in RAM.
    """
    options = StreamOptions(resident, stream, readers, prefetch)
    check_stream_options(options)  # before anything is read
    inventory = inventory_of(model) if checkpoint is not None else ModelInventory.of(model)
    config = as_quant_config(quantization)
    if checkpoint is not None:
        dtype = torch_load_dtype(dtype)  # what it loads in: floating only, before planning with it
    device, mapping = _device_plan(
        inventory,
        device_map,
        max_memory,
        dtype,
        no_split_module_classes,
        preload_module_classes,
        offload_buffers,
        quantization=config,
        machine=machine,
    )
    index = CheckpointIndex.open(checkpoint) if checkpoint is not None else None  # headers read once
    if index is not None and mapping is not None:
        mapping = device_map_in_model_names(inventory, index, mapping)  # a map planned from headers
    if mapping is None:
        loads = _checked_load(inventory, index, None, [], dtype, strict, offload_folder, config) if index else None
        return PlanChain(device, loads, None)
    tree = inventory.tree()
    if config is not None:  # quantized while loading: held and streamed packed
        tree = quantized_tree(tree, config, quant_targets(inventory, config))
    canonical, problems = map_problems(tree, mapping, main_device=main_device, machine=check_machine)
    loads = None
    if index is not None:
        loads = _checked_load(
            inventory, index, mapping if problems else canonical, problems, dtype, strict, offload_folder, config
        )
        tree = tree.with_dtype(None, {a: str(x.dtype).removeprefix("torch.") for x in loads.loads for a in x.aliases})
        tree = with_stored(tree, {a: (x.nbytes, x.operation) for x in loads.loads if _packs(x) for a in x.aliases})
    else:
        _raise_map_problems(problems)
    rule = _rule(
        inventory,
        tree,
        device,
        canonical,
        main_device,
        no_split_module_classes,
        preload_module_classes,
        offload_buffers,
    )
    facts = machine if machine is not None else machine_facts()
    dispatch = make_dispatch_plan(tree, canonical, rule, prefetch=prefetch, machine=facts, stream=options).check()
    return PlanChain(device, loads, dispatch)


def _device_plan(
    inventory: ModelInventory,
    device_map: Any,
    max_memory: Any,
    dtype: Any,
    no_split: Collection[str] | None,
    preload: Collection[str] | None,
    offload_buffers: bool,
    *,
    quantization: QuantConfig | None = None,
    machine: MachineFacts | None = None,
) -> tuple[DevicePlan | None, dict[str, Any] | None]:
    """``(plan, map)`` from what a user passes as ``device_map``: a strategy name (planned
    now, with the weights sized as ``quantization`` packs them), a `DevicePlan`, a dict, or None."""
    if device_map is None:
        return None, None
    if isinstance(device_map, str):
        if device_map not in STRATEGIES:
            raise DeviceMapError(
                f"device_map={device_map!r}: use one of {', '.join(STRATEGIES)}, a dict or a DevicePlan"
            )
        from bigviz.planning.device_plan import plan

        made = plan(
            inventory,
            max_memory,
            strategy=device_map,
            no_split_module_classes=no_split,
            dtype=dtype,
            preload_module_classes=preload,
            offload_buffers=offload_buffers,
            quantization=quantization,
            machine=machine,  # the default "cpu" budget for the machine the stream plan is made for
        )
        return made, dict(made.device_map)
    if isinstance(device_map, DevicePlan):
        return device_map, dict(device_map.device_map)
    return None, dict(device_map)


def _rule(
    inventory: ModelInventory,
    tree: SizeTree,
    device: DevicePlan | None,
    canonical: Mapping[str, Device],
    main_device: object,
    no_split: Collection[str] | None,
    preload: Collection[str] | None,
    offload_buffers: bool,
) -> UnitRule:
    """The unit rule of the dispatch: the device plan's (the units it reserved room for),
    with the knobs given here on top; for a dict, the model's own."""
    if main_device is not None:
        main: Device = normalize_device(main_device)
    elif device is not None:
        main = device.main_device
    else:
        main = execution_device(canonical.values())
    if device is not None and device.rule is not None:
        rule = replace(device.rule, main_device=main)
        if no_split is not None:
            rule = replace(rule, blocks=frozenset([no_split] if isinstance(no_split, str) else no_split))
        if preload is not None:
            rule = replace(rule, preload=frozenset(preload))
        return replace(rule, offload_buffers=rule.offload_buffers or offload_buffers)
    blocks = no_split_names(inventory, tree, no_split) if no_split is not None else inventory.no_split
    return unit_rule_of(inventory, tree, blocks, preload=preload, offload_buffers=offload_buffers, main_device=main)


def _checked_load(
    inventory: ModelInventory,
    index: CheckpointIndex,
    mapping: Mapping[str, Any] | None,
    problems: Sequence[str],
    dtype: Any,
    strict: bool,
    offload_folder: str | Path | None,
    quantization: QuantConfig | None = None,
) -> LoadPlan:
    """The load plan, and the one validation pass: the map's ``problems`` (names, devices this
    machine has, coverage) and the checkpoint's (keys, shapes, files), in one error."""
    _, loads = plan_load(
        inventory,
        index,
        mapping,
        dtype=dtype,
        offload_folder=offload_folder,
        strict=strict,
        check=False,
        quantization=quantization,
    )
    if problems and not plan_problems(loads, strict=strict, map_checked=True)[0]:
        _raise_map_problems(problems)
    check_plan(
        loads,
        strict=strict,
        where=f"'{index.path}' into {type(inventory.model).__name__}",
        more=problems,
        map_checked=True,
    )
    return loads


def _raise_map_problems(problems: Sequence[str]) -> None:
    missing = any("which this machine does not have" in p for p in problems)
    DeviceMapError.check(problems, INVALID_MAP, fix=MISSING_DEVICE_FIX if missing else "")


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
    config = as_quant_config(quantization)
    _, mapping = _device_plan(inventory, device_map, None, dtype, None, None, False, quantization=config)
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
        quantization=config,
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
    strict: bool = True,
    resident: str = "auto",
    stream: str = "ring",
    readers: int = 4,
    machine: MachineFacts | None = None,
    quantization: object = None,
) -> DispatchPlan:
    """The dispatch plan of ``device_map`` on ``model``: the offload units a dispatch fetches
    (the module each hook sits on, where its weights are stored, the tensors and buffers it
    fetches, their bytes), in fetch order, the tensors that stay resident, and how each unit
    lives at run time (memory-mapped, resident copy or streamed; which fetcher, its ring, how
    far it reads ahead: the stream plan, for ``machine``); printable (``.summary()``,
    ``.to_frame()``) before anything moves. Made by :func:`plan_chain`, as
    ``load_checkpoint_and_dispatch`` makes it, so what it prints is what the engine does.

    Args:
        model: the model (on meta is fine) or its inventory.
        checkpoint: the checkpoint it will load, if any: a map planned from its headers is
            translated into the model's names, and each tensor is sized in the dtype it loads in.
        device_map: a strategy (``"auto"``, planned now with ``max_memory``), a `DevicePlan`
            (its execution device and unit rule are used) or a dict.
        main_device, no_split_module_classes, preload_module_classes, offload_buffers,
        prefetch: as for `bigviz.dispatch_model`.
        dtype, strict: the dtype the checkpoint loads in, and whether its keys must match.
        resident, stream, readers: as for `bigviz.load_checkpoint_and_dispatch`.
        machine: the machine's facts (default: this machine's available RAM now).
        quantization: ``"int8"``/``"int4"`` (or a config): the units' weights sized packed.

    Nothing is read but checkpoint headers, and the devices need not exist here: a plan for
    a machine you do not have is fine (executing it checks them).

    Raises:
        DeviceMapError: every problem of the map at once (names, device spellings, coverage).

    Example:
        >>> import torch.nn as nn
        >>> from bigviz.core.stream_plan import MachineFacts
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        >>> print(dispatch_plan(model, device_map={"": "disk"}, machine=MachineFacts(10**9)).summary())
        DispatchPlan: execution on CPU, 1 offload unit, 160 B streamed per forward
          from disk: 1 unit, 160 B (<model>)
          run: 1 disk unit streamed by the cpu fetcher (zero-copy views of the memory-mapped files, paged in one unit ahead, 1 unit ahead)
            streamed by the cpu fetcher: 1 unit, 160 B (<model>)
            why: the model (160 B) fits in 90% of the available RAM (858.3 MiB): zero-copy memory maps
    """
    if device_map is None:
        raise DeviceMapError("dispatch_plan: give a device_map (a strategy such as 'auto', a dict or a DevicePlan)")
    chain = plan_chain(
        model,
        checkpoint,
        device_map,
        max_memory=max_memory,
        main_device=main_device,
        no_split_module_classes=no_split_module_classes,
        preload_module_classes=preload_module_classes,
        offload_buffers=offload_buffers,
        prefetch=prefetch,
        dtype=dtype,
        strict=strict,
        resident=resident,
        stream=stream,
        readers=readers,
        machine=machine,
        check_machine=False,
        quantization=quantization,
    )
    assert chain.dispatch is not None
    return chain.dispatch


def _packs(load: Any) -> bool:
    """A load that puts a packed weight in memory (its bytes are the packed ones)."""
    return bool(getattr(getattr(load.conversion, "rule", None), "stores_packed", False))
