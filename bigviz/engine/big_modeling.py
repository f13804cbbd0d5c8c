"""accelerate's big-model entry points: load-and-dispatch, and whole-model cpu/disk offload.

Same names and arguments as ``accelerate`` (so its examples run with ``bigviz`` in its
place), with bigviz's engine behind them: block-sized offload units, safetensors read in
place, prefetch of the next unit, a planner that explains itself.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> model, hook = cpu_offload_with_hook(model, "cpu")
    >>> _ = model(torch.ones(1, 2))
    >>> hook.offload()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from bigviz.checkpoint.index import CheckpointIndex
from bigviz.checkpoint.load import execute_load_plan, inventory_of, load_checkpoint_in_model, plan_load
from bigviz.checkpoint.load_plan import LoadPlan, check_plan, plan_problems
from bigviz.checkpoint.model_names import device_map_in_model_names
from bigviz.checkpoint.quantized import packed_on_disk, prepare_for_checkpoint
from bigviz.core.devices import MISSING_DEVICE_FIX
from bigviz.core.errors import DeviceMapError
from bigviz.core.names import owner, parent
from bigviz.core.quant import QuantConfig, with_stored
from bigviz.engine.devices import DeviceLike, torch_device
from bigviz.engine.dispatch import dispatch_inventory, execute_dispatch
from bigviz.engine.hooks import add_hook_to_module
from bigviz.engine.offload_hooks import CpuOffload, UserCpuOffloadHook
from bigviz.engine.weights import open_offload_folder
from bigviz.modeling.budgets import default_execution_device
from bigviz.modeling.inventory import ModelInventory
from bigviz.modeling.quant import as_quant_config, torch_dtype
from bigviz.planning.chain import INVALID_MAP, dispatch_plan_for, map_problems, resolve_device_map

__all__ = ["load_checkpoint_and_dispatch", "cpu_offload", "cpu_offload_with_hook", "disk_offload"]


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | Path,
    device_map: str | Mapping[str, Any] | Any | None = "auto",
    *,
    max_memory: Mapping[Any, Any] | None = None,
    no_split_module_classes: Sequence[str] | None = None,
    offload_folder: str | Path | None = None,
    dtype: torch.dtype | str | None = None,
    offload_buffers: bool = False,
    prefetch: bool = True,
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    force_hooks: bool = False,
    strict: bool = True,
    resident: str = "auto",
    quantization: object = None,
) -> nn.Module:
    """Plan (if asked), load ``checkpoint`` into ``model`` and dispatch it; returns it in eval mode.

    Safetensors weights mapped to ``"disk"`` are never copied or rewritten: they stay on
    ``meta`` in the model and are read from the checkpoint's own files at forward time.
    Other formats are written once to ``offload_folder`` as safetensors.

    Args:
        model: The model, usually built under ``init_empty_weights()``.
        checkpoint: A weights file, index file or folder.
        device_map: A strategy (``"auto"``, ``"balanced"``, ``"balanced_low_0"``,
            ``"sequential"``), a ``{module: device}`` dict, a ``DevicePlan``, or None (load
            on the CPU, no dispatch).
        max_memory: Budgets for planning (``{0: "10GiB", "cpu": "30GiB"}``).
        no_split_module_classes: Classes kept whole by the planner (default: the model's
            ``_no_split_modules``).
        offload_folder: Where non-safetensors weights mapped to disk are written.
        dtype: Load floating weights in this dtype.
        offload_buffers: Stream buffers of offloaded modules too.
        prefetch: Fetch the next offloaded module while the current one computes.
        skip_keys: Forward kwargs never moved between devices.
        preload_module_classes: See :func:`~bigviz.engine.dispatch.dispatch_model`.
        force_hooks: Hook the model even when it all fits on one device.
        strict: Refuse checkpoints with missing or unexpected keys.
        resident: ``"auto"``: a model that does not fit in RAM has its "cpu" weights read once
            into process memory and its disk units streamed through reused buffers; one that
            fits keeps zero-copy memory maps. ``"copy"`` / ``"map"`` force either
            (:func:`~bigviz.engine.resident.settle_residency`).
        quantization: ``"int8"`` (torchao, one scale per row) or ``"int4"`` (bitsandbytes 4-bit),
            or a `~bigviz.core.quant.QuantConfig` or transformers' ``TorchAoConfig`` /
            ``BitsAndBytesConfig``: the linear layers' weights are quantized while they load,
            one at a time (the float model is never in memory), planned in their packed bytes,
            and offloaded and streamed packed (disk units are written once, packed, to
            ``offload_folder``). A checkpoint stored quantized (its ``config.json`` says how)
            needs none: it loads as stored. Needs ``pip install 'bigviz[quant]'``.

    Raises:
        ValueError: a GPU named by the map is absent, or the map does not fit the model
            (before anything is loaded).

    Example:
        >>> import torch, tempfile
        >>> from bigviz.checkpoint.save import save_sharded
        >>> folder = tempfile.mkdtemp() + "/ckpt"
        >>> _ = save_sharded(torch.nn.Linear(2, 2).state_dict(), folder, progress=False)
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(2, 2)
        >>> model = load_checkpoint_and_dispatch(model, folder, {"": "disk"})
        >>> model(torch.ones(1, 2)).shape, model.weight.device.type
        (torch.Size([1, 2]), 'meta')
    """
    from bigviz.engine.resident import check_mode, settle_residency  # larger than RAM

    check_mode(resident)  # before anything is read
    config = as_quant_config(quantization)
    checkpoint = CheckpointIndex.open(checkpoint)  # headers read once for this call
    prepare_for_checkpoint(model, checkpoint, config, dtype=torch_dtype(dtype))  # quantized layers, on meta
    inventory = inventory_of(model)  # ties made, then the model's one walk for this call
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
        load_checkpoint_in_model(
            inventory,
            checkpoint,
            None,
            dtype=dtype,
            offload_folder=offload_folder,
            strict=strict,
            progress=False,
            quantization=config,
        )
        return model.eval()
    mapping = device_map_in_model_names(inventory, checkpoint, mapping)  # a map planned from headers
    index, loads, canonical = _checked_plans(
        inventory, checkpoint, mapping, dtype=dtype, strict=strict, offload_folder=offload_folder, quantization=config
    )
    result = execute_load_plan(inventory, index, loads, progress=False)
    inventory = inventory.refreshed()  # same structure, the tensors the load put in
    blocks = no_split_module_classes
    if blocks is None and made is not None and made.rule is not None:
        blocks = made.rule.blocks  # the planner's blocks (globs too): the units it reserved room for
    plan = dispatch_plan_for(
        inventory,
        canonical,
        main_device=made.main_device if made is not None else None,
        no_split_module_classes=blocks,
        preload_module_classes=preload_module_classes,
        offload_buffers=offload_buffers,
        prefetch=prefetch,
        tree=with_stored(inventory.tree(), packed_on_disk(loads)),  # streamed packed: sized packed
    )
    stores = [result.disk] if result.disk is not None else []
    execute_dispatch(
        inventory,
        plan,
        stores,
        skip_keys=skip_keys,
        force_hooks=force_hooks,
        offload_folder=offload_folder,
        owned=stores,
    )
    settle_residency(model, resident=resident)
    return model.eval()


def _checked_plans(
    inventory: ModelInventory,
    checkpoint: str | Path,
    mapping: Mapping[str, Any],
    *,
    dtype: Any,
    strict: bool,
    offload_folder: str | Path | None,
    quantization: QuantConfig | None = None,
) -> tuple[CheckpointIndex, LoadPlan, dict[str, Any]]:
    """The one validation pass of a load-and-dispatch: the device map (names, devices this
    machine has, coverage) and the checkpoint (keys, shapes, files), every problem in one
    error, before anything is read."""
    canonical, problems = map_problems(inventory.tree(), mapping)
    index, loads = plan_load(
        inventory,
        checkpoint,
        canonical if not problems else mapping,
        dtype=dtype,
        offload_folder=offload_folder,
        strict=strict,
        check=False,
        quantization=quantization,
    )
    if problems and not plan_problems(loads, strict=strict, map_checked=True)[0]:
        DeviceMapError.check(problems, INVALID_MAP, fix=MISSING_DEVICE_FIX)
    check_plan(
        loads,
        strict=strict,
        where=f"'{index.path}' into {type(inventory.model).__name__}",
        more=problems,
        map_checked=True,
    )
    return index, loads, canonical


def _offload_map(
    inventory: ModelInventory, storage: str, preload_module_classes: Sequence[str] | None
) -> dict[str, str]:
    """One entry per block-sized unit: instances of the model's no-split classes (its
    transformer blocks) whole, and every other module's own tensors."""
    keep_whole = set(inventory.no_split) | set(preload_module_classes or ())
    own: dict[str, list[str]] = {}
    for name in inventory.slots:
        own.setdefault(parent(name), []).append(name)
    device_map: dict[str, str] = {}
    covered: set[str] = set()
    for name in inventory.modules:
        if inventory.same_module.get(name) is not None or owner(name, covered) is not None:
            continue  # a second name of a shared module, or inside a block already mapped whole
        if name and inventory.classes[name] in keep_whole:
            device_map[name] = storage
            covered.add(name)
        else:
            device_map.update(dict.fromkeys(own.get(name, ()), storage))
    return device_map or {"": storage}


def cpu_offload(
    model: nn.Module,
    execution_device: DeviceLike | None = None,
    offload_buffers: bool = False,
    state_dict: Mapping[str, Tensor] | None = None,
    preload_module_classes: Sequence[str] | None = None,
) -> nn.Module:
    """Keep every weight in (pinned) CPU memory; stream each block to ``execution_device`` for its forward.

    Offload units are the model's blocks (its ``_no_split_modules`` classes) and every other
    module's own tensors; the next unit is copied while the current one computes. With the
    CPU as the execution device nothing needs streaming: the model just runs.

    Args:
        model: The model (materialised, or on meta with ``state_dict``).
        execution_device: Where the forward runs (default: the model's first parameter's
            device, else the default device).
        offload_buffers: Stream buffers too (else they live on ``execution_device``).
        state_dict: CPU tensors for what is on ``meta`` in the model.
        preload_module_classes: Classes whose instances are fetched whole.

    Example:
        >>> import torch
        >>> model = cpu_offload(torch.nn.Sequential(torch.nn.Linear(2, 2)), "cpu")
        >>> model(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """
    inventory = ModelInventory.of(model)
    return dispatch_inventory(
        inventory,
        _offload_map(inventory, "cpu", preload_module_classes),
        main_device=_execution_device(model, execution_device),
        offload_buffers=offload_buffers,
        stores=[state_dict] if state_dict is not None else [],
        preload_module_classes=preload_module_classes,
        force_hooks=True,
    )


def disk_offload(
    model: nn.Module,
    offload_dir: str | Path,
    execution_device: DeviceLike | None = None,
    offload_buffers: bool = False,
    preload_module_classes: Sequence[str] | None = None,
) -> nn.Module:
    """Write the weights once to ``offload_dir`` as safetensors; read each block from there for its forward.

    Works on a materialised model (accelerate's needs one too); a model on ``meta`` reads the
    weights already in ``offload_dir``. With the CPU executing, forwards compute straight
    on the memory-mapped files: weights occupy page cache, not process memory.

    Args:
        model: The model.
        offload_dir: Folder for the safetensors files (created; its content is replaced).
        execution_device: Where the forward runs (default: the model's device, else CPU).
        offload_buffers: Stream buffers too.
        preload_module_classes: Classes whose instances are fetched whole.

    Example:
        >>> import torch, tempfile
        >>> model = disk_offload(torch.nn.Sequential(torch.nn.Linear(2, 2)), tempfile.mkdtemp())
        >>> model(torch.ones(1, 2)).shape, model[0].weight.device.type
        (torch.Size([1, 2]), 'meta')
    """
    inventory = ModelInventory.of(model)
    weights = open_offload_folder(offload_dir) if inventory.has_meta() else None  # an earlier disk_offload's
    stores = [weights] if weights is not None else []
    return dispatch_inventory(
        inventory,
        _offload_map(inventory, "disk", preload_module_classes),
        main_device=_execution_device(model, execution_device),
        offload_folder=offload_dir,
        offload_buffers=offload_buffers,
        preload_module_classes=preload_module_classes,
        stores=stores,
        owned=stores,
        force_hooks=True,
    )


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: DeviceLike | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Keep ``model`` on the CPU until called; then move it whole to ``execution_device``.

    It stays there after the forward (fast in loops) until ``hook.offload()`` is called or
    the next model of a pipeline (given this hook as ``prev_module_hook``) runs.

    Example:
        >>> import torch
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> a, hook_a = cpu_offload_with_hook(a, "cpu")
        >>> b, hook_b = cpu_offload_with_hook(b, "cpu", prev_module_hook=hook_a)
        >>> _ = b(a(torch.ones(1, 2)))
        >>> hook_a.hook.on_device, hook_b.hook.on_device  # running b offloaded a
        (False, True)
        >>> hook_b.offload()
    """
    hook = CpuOffload(execution_device=execution_device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def _execution_device(model: nn.Module, execution_device: DeviceLike | None) -> torch.device:
    """accelerate's default: the device of the model's first parameter (when that is ``meta``,
    this machine's execution device: the first GPU, else mps, else the CPU)."""
    if execution_device is not None:
        return torch_device(execution_device)
    first = next(iter(model.parameters()), None)
    if first is not None and first.device.type != "meta":
        return first.device
    return torch_device(default_execution_device())
