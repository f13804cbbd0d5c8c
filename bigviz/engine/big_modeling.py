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
from bigviz.checkpoint.load import execute_load_plan, inventory_of, torch_load_dtype
from bigviz.checkpoint.quantized import prepare_for_checkpoint
from bigviz.core.names import owner, parent
from bigviz.core.sizes import format_count
from bigviz.core.stream_plan import MachineFacts
from bigviz.engine.devices import DeviceLike, torch_device
from bigviz.engine.dispatch import dispatch_inventory, execute_dispatch, refuse_dispatched
from bigviz.engine.hooks import add_hook_to_module
from bigviz.engine.offload_hooks import CpuOffload, UserCpuOffloadHook
from bigviz.engine.weights import open_offload_folder
from bigviz.modeling.budgets import default_execution_device
from bigviz.modeling.inventory import ModelInventory
from bigviz.modeling.quant import as_quant_config
from bigviz.planning.chain import plan_chain

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
    stream: str = "ring",
    machine: MachineFacts | None = None,
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
            fits keeps zero-copy memory maps. ``"copy"`` / ``"map"`` force either.
        stream: How the CPU streams disk units once the resident part is copied: ``"ring"``
            (``O_DIRECT`` into one reused ring) or ``"cache"`` (through the page cache,
            dropped after use).
        machine: The machine's facts the stream plan is made for (default: this machine's
            available RAM now). ``bigviz.dispatch_plan(...)`` with the same arguments prints
            the plan this carries out, before anything moves; ``bigviz.residency(model)`` says
            what was done.
        quantization: ``"int8"`` (torchao, one scale per row) or ``"int4"`` (bitsandbytes 4-bit),
            or a `~bigviz.core.quant.QuantConfig` or transformers' ``TorchAoConfig`` /
            ``BitsAndBytesConfig``: the linear layers' weights are quantized while they load,
            one at a time (the float model is never in memory), planned in their packed bytes,
            and offloaded and streamed packed (disk units are written once, packed, to
            ``offload_folder``). A checkpoint stored quantized (its ``config.json`` says how)
            needs none: it loads as stored. Needs ``pip install 'bigviz[quant]'``.

    Raises:
        ValueError: a GPU named by the map is absent, the map does not fit the model, or a
            resident copy would not fit in RAM (before anything is loaded).

    Example:
        >>> import torch, tempfile
        >>> from bigviz.checkpoint.save import save_sharded
        >>> folder = tempfile.mkdtemp() + "/ckpt"
        >>> _ = save_sharded(torch.nn.Linear(2, 2).state_dict(), folder, progress=False)
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(2, 2)
        >>> model = load_checkpoint_and_dispatch(model, folder, {"": "disk"})
        >>> model(torch.ones(1, 2)).shape, model.weight.is_meta  # read at forward time
        (torch.Size([1, 2]), True)
    """
    refuse_dispatched(model, "load_checkpoint_and_dispatch")  # before anything is read
    dtype = torch_load_dtype(dtype)  # floating only, before planning with it
    config = as_quant_config(quantization)
    index = CheckpointIndex.open(checkpoint)  # headers read once for this call
    before = ModelState(model)
    try:
        return _load_and_dispatch(
            model,
            index,
            device_map,
            max_memory=max_memory,
            no_split_module_classes=no_split_module_classes,
            offload_folder=offload_folder,
            dtype=dtype,
            offload_buffers=offload_buffers,
            prefetch=prefetch,
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
            force_hooks=force_hooks,
            strict=strict,
            resident=resident,
            stream=stream,
            machine=machine,
            config=config,
        )
    except BaseException:
        before.restore()  # a load that failed (here or in the dispatch) leaves the model as it was
        raise


class ModelState:
    """A model's module tree as it is now (the objects, not their values): each module's
    children, parameters, buffers and class, to put back when a load that replaced them fails
    part way. ``load_checkpoint_and_dispatch`` makes quantized layers, fills the tensors, then
    dispatches: a failure in the dispatch (after the load) must not leave a model half loaded
    and half on meta. The tensors it loaded are dropped with the objects that held them."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._saved = [
            (m, type(m), dict(m._modules), dict(m._parameters), dict(m._buffers), m.__dict__.get("hf_device_map"))
            for m in model.modules()
        ]

    def restore(self) -> None:
        from bigviz.engine.hooks import remove_hooks

        remove_hooks(self._model)  # hooks a failed dispatch attached, and the files they hold
        for module, cls, children, params, buffers, device_map in self._saved:
            if type(module) is not cls:
                module.__class__ = cls
            for store, saved in ((module._modules, children), (module._parameters, params), (module._buffers, buffers)):
                store.clear()
                store.update(saved)
            if device_map is None:
                module.__dict__.pop("hf_device_map", None)
            else:
                module.__dict__["hf_device_map"] = device_map


def _load_and_dispatch(
    model: nn.Module,
    index: CheckpointIndex,
    device_map: Any,
    *,
    max_memory: Any,
    no_split_module_classes: Sequence[str] | None,
    offload_folder: str | Path | None,
    dtype: torch.dtype | None,
    offload_buffers: bool,
    prefetch: bool,
    skip_keys: str | Sequence[str] | None,
    preload_module_classes: Sequence[str] | None,
    force_hooks: bool,
    strict: bool,
    resident: str,
    stream: str,
    machine: MachineFacts | None,
    config: Any,
) -> nn.Module:
    """:func:`load_checkpoint_and_dispatch` once its arguments are read: quantized layers made,
    the plans, the load, the dispatch."""
    prepare_for_checkpoint(model, index, config, dtype=dtype)  # quantized layers, on meta
    inventory = inventory_of(model)  # ties made, then the model's one walk for this call
    _, loads, plan = plan_chain(
        inventory,
        index,
        device_map,
        max_memory=max_memory,
        no_split_module_classes=no_split_module_classes,
        preload_module_classes=preload_module_classes,
        offload_buffers=offload_buffers,
        prefetch=prefetch,
        dtype=dtype,
        strict=strict,
        offload_folder=offload_folder,
        resident=resident,
        stream=stream,
        machine=machine,
        quantization=config,
    )
    assert loads is not None
    result = execute_load_plan(inventory, index, loads, progress=False)
    if plan is None:  # no map: loaded on the CPU, nothing to dispatch
        _warn_not_loaded(result.missing, result.unexpected, index.path)
        return model.eval()
    stores = [result.disk] if result.disk is not None else []
    try:
        execute_dispatch(
            inventory.refreshed(),  # same structure, the tensors the load put in
            plan,
            stores,
            skip_keys=skip_keys,
            force_hooks=force_hooks,
            offload_folder=offload_folder,
            owned=stores,
            stamps=index.stamps.values(),
            progress=True,
        )
    except BaseException:
        for store in stores:  # the load's disk weights: their files are closed, as remove_hooks would
            close = getattr(store, "close", None)
            if close is not None:
                close()
        raise
    _warn_not_loaded(result.missing, result.unexpected, index.path)  # once the call has done what it could
    return model.eval()


def _warn_not_loaded(missing: Sequence[str], unexpected: Sequence[str], checkpoint: Path) -> None:
    """With ``strict=False`` the call returns only the model: say what it did not load (as
    accelerate and transformers log it), so a model left partly untrained is never silent.
    ``load_checkpoint_in_model`` returns the same in its `LoadResult`."""
    if not missing and not unexpected:
        return
    import warnings

    def shown(names: Sequence[str]) -> str:
        return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")

    parts = []
    if missing:
        parts.append(
            f"{format_count(len(missing), 'tensor')} of the model not in the checkpoint, not loaded: they hold what "
            f"the model initialised, not trained weights ({shown(missing)})"
        )
    if unexpected:
        parts.append(
            f"{format_count(len(unexpected), 'checkpoint key')} matching no tensor of the model, not used "
            f"({shown(unexpected)})"
        )
    warnings.warn(
        f"load_checkpoint_and_dispatch(strict=False) from {checkpoint}: "
        + "; ".join(parts)
        + ". Pass strict=True to refuse such a checkpoint before anything is read.",
        stacklevel=4,  # the caller of load_checkpoint_and_dispatch
    )


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
    refuse_dispatched(model, "cpu_offload")
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
        >>> model(torch.ones(1, 2)).shape, model[0].weight.is_meta
        (torch.Size([1, 2]), True)
    """
    refuse_dispatched(model, "disk_offload")  # before the folder is opened
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
