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

from bigviz.core.names import join, owner
from bigviz.engine.devices import DeviceLike, check_devices_exist, torch_device
from bigviz.engine.dispatch import dispatch_model
from bigviz.engine.hooks import add_hook_to_module
from bigviz.engine.offload import CpuOffload, UserCpuOffloadHook
from bigviz.modeling.budgets import default_execution_device

__all__ = ["load_checkpoint_and_dispatch", "cpu_offload", "cpu_offload_with_hook", "disk_offload"]

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


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
    from bigviz.checkpoint.load import load_checkpoint_in_model
    from bigviz.checkpoint.model_names import device_map_in_model_names
    from bigviz.planning import check_device_map

    resolved = _resolve_map(model, device_map, max_memory, no_split_module_classes, dtype)
    if resolved is not None:
        resolved = device_map_in_model_names(model, checkpoint, resolved)  # a map planned from headers
        check_devices_exist(resolved)  # before anything is read
        # every tensor covered (tied duplicates join their leader): problems listed, nothing loaded
        resolved = check_device_map(model, resolved)
    result = load_checkpoint_in_model(
        model, checkpoint, resolved, dtype=dtype, offload_folder=offload_folder, strict=strict, progress=False
    )
    if resolved is not None:
        dispatch_model(
            model,
            resolved,
            offload_folder=offload_folder,
            offload_buffers=offload_buffers,
            prefetch=prefetch,
            skip_keys=skip_keys,
            preload_module_classes=preload_module_classes,
            no_split_module_classes=no_split_module_classes,
            weights=result.disk,
            force_hooks=force_hooks,
        )
        state = getattr(model, "_bigviz_dispatch", None)
        if state is not None and result.disk is not None:
            state.owned.append(result.disk)  # closed by remove_hooks
    return model.eval()


def _resolve_map(
    model: nn.Module,
    device_map: str | Mapping[str, Any] | Any | None,
    max_memory: Mapping[Any, Any] | None,
    no_split: Sequence[str] | None,
    dtype: torch.dtype | str | None,
) -> dict[str, Any] | None:
    if device_map is None:
        return None
    if isinstance(device_map, str):
        if device_map not in STRATEGIES:
            raise ValueError(
                f"device_map={device_map!r}: use one of {', '.join(STRATEGIES)}, a dict or a DevicePlan"
            )
        from bigviz.planning import plan

        return dict(plan(model, max_memory, strategy=device_map, no_split_module_classes=no_split, dtype=dtype).device_map)
    if hasattr(device_map, "device_map"):  # a DevicePlan
        return dict(device_map.device_map)
    return dict(device_map)


def _offload_map(model: nn.Module, storage: str, preload_module_classes: Sequence[str] | None) -> dict[str, str]:
    """One entry per block-sized unit: instances of the model's no-split classes (its
    transformer blocks) whole, and every other module that owns tensors directly."""
    keep_whole = set(getattr(model, "_no_split_modules", None) or ()) | set(preload_module_classes or ())
    device_map: dict[str, str] = {}
    covered: set[str] = set()
    for name, module in model.named_modules():
        if owner(name, covered) is not None:
            continue  # inside a block already mapped whole
        if type(module).__name__ in keep_whole and name:
            device_map[name] = storage
            covered.add(name)
        else:
            for table in (module._parameters, module._buffers):
                device_map.update({join(name, attr): storage for attr, t in table.items() if t is not None})
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
    device = _execution_device(model, execution_device)
    return dispatch_model(
        model,
        _offload_map(model, "cpu", preload_module_classes),
        main_device=device,
        offload_buffers=offload_buffers,
        state_dict=state_dict,
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
    weights = None
    if any(t.device.type == "meta" for t in model.state_dict().values()):
        from bigviz.engine.weights import open_offload_folder

        weights = open_offload_folder(offload_dir)  # weights written by an earlier disk_offload
    dispatch_model(
        model,
        _offload_map(model, "disk", preload_module_classes),
        main_device=_execution_device(model, execution_device),
        offload_folder=offload_dir,
        offload_buffers=offload_buffers,
        preload_module_classes=preload_module_classes,
        weights=weights,
        force_hooks=True,
    )
    if weights is not None:
        model._bigviz_dispatch.owned.append(weights)
    return model


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
