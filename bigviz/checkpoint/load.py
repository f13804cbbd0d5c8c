"""Load a checkpoint into a model: checked first, then tensor by tensor, never half loaded.

`load_checkpoint_in_model` opens the checkpoint's headers, matches every key to a model
tensor (prefixes, ties, non-persistent buffers) and checks shapes and devices, all before
reading a byte of tensor data; one error lists every problem and the model is left as it
was. Then each tensor goes straight to its device: safetensors on the CPU with no dtype
change become zero-copy views of the memory-mapped files (no read, no anonymous memory);
tensors mapped to ``"disk"`` are not materialised at all (they stay on meta and come back
as `LazyWeights` over the original files). Should anything fail midway, every tensor is put
back as it was.

Example:
    >>> import tempfile, torch, pathlib
    >>> from bigviz.checkpoint.save import save_sharded
    >>> folder = save_sharded(torch.nn.Linear(3, 2), pathlib.Path(tempfile.mkdtemp()) / "c",
    ...                       progress=False)
    >>> with torch.device("meta"):
    ...     model = torch.nn.Linear(3, 2)
    >>> result = load_checkpoint_in_model(model, folder, progress=False)
    >>> result.loaded, model.weight.device.type
    (['weight', 'bias'], 'cpu')
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch

from bigviz.checkpoint.index import CheckpointIndex
from bigviz.checkpoint.lazy import LazyWeights
from bigviz.checkpoint.match import LoadOptions, LoadPlan, TensorLoad, check_plan, match_checkpoint
from bigviz.checkpoint.model_tensors import describe_model, tie_model
from bigviz.checkpoint.offload import offload_problems, write_offload
from bigviz.core.devicemap import check_keys

__all__ = ["LoadResult", "load_checkpoint_in_model", "load_sharded_checkpoint"]


@dataclass
class LoadResult:
    """What `load_checkpoint_in_model` did.

    Attributes:
        loaded: model tensor names materialised from the checkpoint.
        ignored: ``(checkpoint key, why)`` for keys deliberately not loaded.
        missing: model tensor names the checkpoint lacks (left as they were).
        unexpected: checkpoint keys the model has no tensor for.
        renamed_prefix: a base-model prefix (``"transformer."``) added to or stripped from
            checkpoint keys to match the model, else None; `prefix_action` says which.
        prefix_action: ``"added"``, ``"stripped"`` or None.
        filled_by_tie: ``(name, source)``: tied names absent from the checkpoint, filled by
            the tensor they are tied to.
        disk: model tensor name -> lazily read tensor, for everything mapped to ``"disk"``
            (those model tensors stay on meta); None when nothing is.
        offload_folder: where non-safetensors weights mapped to disk were written, else None.
        bytes_loaded: bytes of the materialised tensors.
    """

    loaded: list[str] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    renamed_prefix: str | None = None
    prefix_action: str | None = None
    filled_by_tie: list[tuple[str, str]] = field(default_factory=list)
    disk: LazyWeights | None = None
    offload_folder: Path | None = None
    bytes_loaded: int = 0

    def summary(self) -> str:
        """A few human-readable lines: counts, and everything ignored, renamed or tied."""
        lines = [f"loaded {len(self.loaded)} tensors ({self.bytes_loaded / 2**20:.1f} MiB)"
                 + (f", {len(self.disk)} left on disk" if self.disk else "")]
        if self.renamed_prefix:
            lines.append(f"prefix {self.renamed_prefix!r} {self.prefix_action} to match the model")
        lines += [f"ignored {k}: {why}" for k, why in self.ignored]
        lines += [f"{name} filled by its tie to {src}" for name, src in self.filled_by_tie]
        lines += [f"missing: {k}" for k in self.missing] + [f"unexpected: {k}" for k in self.unexpected]
        return "\n".join(lines)


class IncompatibleKeys(NamedTuple):
    """``(missing_keys, unexpected_keys)``, like ``torch.nn.Module.load_state_dict`` returns."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load_checkpoint_in_model(
    model: torch.nn.Module,
    checkpoint: str | Path | CheckpointIndex,
    device_map: Mapping[str, int | str | torch.device] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    offload_folder: str | Path | None = None,
    strict: bool = True,
    keep_in_fp32_modules: Sequence[str] | None = None,
    progress: bool = True,
) -> LoadResult:
    """Load ``checkpoint`` into ``model`` (usually built on meta), tensor by tensor.

    Args:
        model: any ``nn.Module`` (plain, bigviz or transformers), on meta or materialised.
        checkpoint: a weights file, an index file, a folder, or an open `CheckpointIndex`.
        device_map: module name -> device (GPU int, ``"cuda:1"``, ``"cpu"``, ``"mps"``,
            ``"disk"``); a tensor goes where its longest owning key says. None: the CPU
            (or the tensor's current device when it is not on meta). A `DevicePlan` works too.
        dtype: convert floating tensors to this dtype (default: the model's dtype).
        offload_folder: where to write disk-mapped weights when the checkpoint is not
            safetensors (safetensors are read in place and need none).
        strict: raise when keys are missing or unexpected (shape mismatches always raise).
        keep_in_fp32_modules: module names (prefixes or name components) kept in float32.
        progress: show a tqdm progress bar over bytes.

    Returns:
        A `LoadResult` saying what was loaded, ignored, renamed, tied and left on disk.

    Raises:
        CheckpointError: listing every missing key, unexpected key, shape mismatch, bad device
            or corrupt file, before anything is loaded (the model is left untouched).

    Example:
        >>> import tempfile, torch, pathlib
        >>> from bigviz.checkpoint.save import save_sharded
        >>> folder = save_sharded({"net.weight": torch.ones(2, 2)},
        ...                       pathlib.Path(tempfile.mkdtemp()) / "c", progress=False)
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(2, 2, bias=False)
        >>> result = load_checkpoint_in_model(model, folder, dtype=torch.float16, progress=False)
        >>> result.renamed_prefix, result.prefix_action, model.weight.dtype
        ('net.', 'stripped', torch.float16)
    """
    index = CheckpointIndex.open(checkpoint)
    dtype = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if keep_in_fp32_modules is None and dtype in (torch.float16, torch.bfloat16):
        keep_in_fp32_modules = getattr(model, "_keep_in_fp32_modules", None)
    options = LoadOptions(
        device_map=_as_device_map(device_map), dtype=dtype,
        keep_in_fp32_modules=tuple(keep_in_fp32_modules or ()), strict=strict,
        offload_folder=str(offload_folder) if offload_folder is not None else None,
        can_map_disk=index.format == "safetensors",
        ignore_unexpected=tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()),
        ignore_missing=tuple(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()),
    )
    return _load(model, index, options, progress=progress, inplace=False)


def load_sharded_checkpoint(model: torch.nn.Module, folder: str | Path, strict: bool = True,
                            prefer_safe: bool = True) -> IncompatibleKeys:
    """transformers' ``load_sharded_checkpoint``: load a sharded folder into a real model.

    Values are copied into the model's existing tensors (their devices and dtypes are kept),
    one tensor at a time; meta tensors are filled on the CPU. Every key and shape is checked
    first, so a mismatching checkpoint raises before anything is copied. Should the load stop
    midway (Ctrl-C, a read error), every value is put back: a CPU copy of each overwritten
    tensor is kept until the load ends (peak memory: up to the model's size again).

    Args:
        model: the model to fill.
        folder: a checkpoint folder (sharded or not), index file or weights file.
        strict: raise when keys are missing or unexpected.
        prefer_safe: in a folder with both, read safetensors rather than ``.bin`` files.

    Returns:
        ``(missing_keys, unexpected_keys)``, a NamedTuple like ``load_state_dict``'s.

    Example:
        >>> import tempfile, torch, pathlib
        >>> from bigviz.checkpoint.save import save_sharded
        >>> src = torch.nn.Linear(2, 2)
        >>> folder = save_sharded(src, pathlib.Path(tempfile.mkdtemp()) / "c", progress=False)
        >>> dst = torch.nn.Linear(2, 2)
        >>> load_sharded_checkpoint(dst, folder), torch.equal(dst.weight, src.weight)
        (IncompatibleKeys(missing_keys=[], unexpected_keys=[]), True)
    """
    index = CheckpointIndex.open(folder, prefer_safe=prefer_safe)
    options = LoadOptions(strict=strict, can_map_disk=index.format == "safetensors")
    result = _load(model, index, options, progress=False, inplace=True)
    return IncompatibleKeys(result.missing, result.unexpected)


def _as_device_map(device_map: object) -> Mapping[str, int | str | torch.device] | None:
    if device_map is None:
        return None
    if isinstance(device_map, Mapping):
        check_keys(device_map)  # {0: "cpu"}: a ValueError quoting 0, not a TypeError midway
        return device_map
    inner = getattr(device_map, "device_map", None)  # a DevicePlan
    if isinstance(inner, Mapping):
        return inner
    raise TypeError(f"device_map must be a dict (module -> device) or a DevicePlan, not "
                    f"{device_map!r}; for 'auto' use bigviz.infer_auto_device_map first")


def _load(model: torch.nn.Module, index: CheckpointIndex, options: LoadOptions, *,
          progress: bool, inplace: bool) -> LoadResult:
    tie_model(model)
    plan = match_checkpoint(describe_model(model), index.entries, options)
    disk = [load for load in plan.loads if load.device == "disk"]
    if disk and index.format != "safetensors":
        plan = _with_problems(plan, offload_problems(options.offload_folder))
    check_plan(plan, strict=options.strict, where=f"'{index.path}' into {type(model).__name__}")
    slots = _Slots(model, plan.loads)
    try:
        nbytes = _materialise(slots, index, plan, progress=progress, inplace=inplace)
        lazy, folder = _disk_weights(index, disk, options)
    except BaseException:
        slots.restore()
        raise
    return LoadResult(
        loaded=[load.name for load in plan.loads if load.device != "disk"],
        ignored=list(plan.ignored), missing=list(plan.missing), unexpected=list(plan.unexpected),
        renamed_prefix=plan.prefix, prefix_action=plan.prefix_action,
        filled_by_tie=list(plan.filled_by_tie), disk=lazy, offload_folder=folder, bytes_loaded=nbytes,
    )


def _with_problems(plan: LoadPlan, problems: list[str]) -> LoadPlan:
    return replace(plan, device_problems=plan.device_problems + tuple(problems))


def _materialise(slots: _Slots, index: CheckpointIndex, plan: LoadPlan, *,
                 progress: bool, inplace: bool) -> int:
    from tqdm.auto import tqdm

    todo = [load for load in plan.loads if load.device != "disk"]
    total = sum(load.nbytes for load in todo)
    nbytes = 0
    with LazyWeights(index, {load.name: load.key for load in todo}) as weights, \
            tqdm(total=total, unit="B", unit_scale=True, desc="loading", disable=not progress) as bar:
        for load in todo:
            tensor = _convert(weights[load.name], load)
            slots.fill(load, tensor, inplace=inplace)
            nbytes += tensor.numel() * tensor.element_size()
            bar.update(load.nbytes)
    return nbytes


def _convert(tensor: torch.Tensor, load: TensorLoad) -> torch.Tensor:
    """Move and cast, narrowing before a device copy and widening after (fewer bytes moved)."""
    if tensor.dtype == load.dtype:
        return tensor.to(load.device)
    if tensor.element_size() > load.dtype.itemsize:
        return tensor.to(load.dtype).to(load.device)
    return tensor.to(load.device).to(load.dtype)


def _disk_weights(index: CheckpointIndex, disk: list[TensorLoad],
                  options: LoadOptions) -> tuple[LazyWeights | None, Path | None]:
    """Disk tensors as `LazyWeights`: over the safetensors files themselves, or over a
    one-time safetensors copy in ``offload_folder`` for other formats."""
    if not disk:
        return None, None
    floats = {load.dtype for load in disk if load.dtype.is_floating_point}
    dtype = floats.pop() if len(floats) == 1 else options.dtype
    keep = options.keep_in_fp32_modules
    if index.format == "safetensors":  # read in place: nothing is rewritten
        names = {alias: load.key for load in disk for alias in load.aliases}
        return LazyWeights(index, names, dtype=dtype, keep_dtype=keep), None
    assert options.offload_folder is not None  # checked before loading
    written = write_offload(index, disk, Path(options.offload_folder))
    names = {alias: load.name for load in disk for alias in load.aliases}
    return LazyWeights(CheckpointIndex.open(written), names, dtype=dtype, keep_dtype=keep), written.parent


class _Slots:
    """Where each model tensor lives (module dict + key), and what was there before.

    A load into a real tensor copies in place (optimizers and user references keep the same
    objects), so the value it overwrites is saved first, on the CPU: `restore` puts back the
    values as well as the objects. That costs up to the model's size in RAM until the load
    ends; loading into new tensors and swapping at the end would cost the same (every new
    tensor held at once) and would break the objects' identity.
    """

    def __init__(self, model: torch.nn.Module, loads: Sequence[TensorLoad]) -> None:
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor overwritten, old value)
        self._slots: dict[str, tuple[dict, str, torch.Tensor]] = {}
        for load in loads:
            for alias in load.aliases:
                module_name, _, leaf = alias.rpartition(".")
                module = model.get_submodule(module_name)
                store = module._parameters if leaf in module._parameters else module._buffers
                self._slots[alias] = (store, leaf, store[leaf])

    def fill(self, load: TensorLoad, tensor: torch.Tensor, *, inplace: bool) -> None:
        store, leaf, old = self._slots[load.name]
        if inplace and not old.is_meta:
            with torch.no_grad():
                self._saved.append((old, old.detach().to("cpu", copy=True)))
                old.copy_(tensor)
            return
        if isinstance(old, torch.nn.Parameter):
            tensor = torch.nn.Parameter(tensor, requires_grad=old.requires_grad)
        for alias in load.aliases:  # one object under every tied name: the tie survives
            alias_store, alias_leaf, _ = self._slots[alias]
            alias_store[alias_leaf] = tensor

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, value in reversed(self._saved):  # values first, then the objects
                tensor.copy_(value)
        self._saved.clear()
        for store, leaf, old in self._slots.values():
            store[leaf] = old
