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

from bigviz.checkpoint import hf
from bigviz.checkpoint.convert import CheckpointView, Conversion, ConvertedWeights, checkpoint_view
from bigviz.checkpoint.index import CheckpointIndex
from bigviz.checkpoint.lazy import LazyWeights, WeightStores
from bigviz.checkpoint.match import (LoadOptions, LoadPlan, TensorLoad, check_plan, load_device, match_checkpoint,
                                     resolve_view)
from bigviz.checkpoint.model_tensors import ModelTensor, describe_model, tie_model
from bigviz.checkpoint.offload import offload_problems, write_offload_folder
from bigviz.core.devicemap import check_keys
from bigviz.core.devices import execution_device, torch_name

__all__ = ["LoadResult", "load_checkpoint_in_model", "load_sharded_checkpoint", "check_checkpoint",
           "checkpoint_dtypes", "device_map_in_model_names"]


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
            (those model tensors stay on meta, in the dtype they load in); None when nothing is.
        offload_folder: where weights mapped to disk were written (non-safetensors
            checkpoints, fused tensors), else None.
        bytes_loaded: bytes of the materialised tensors.
        conversions: checkpoint keys the model reads under other names (``"rename"``: read in
            place) or fuses (e.g. experts stored one by one), from transformers' own rules.
        computed: model tensors no checkpoint holds, computed by the model as
            ``from_pretrained`` does (sinusoidal positions, rotary frequencies on meta).
    """

    loaded: list[str] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    renamed_prefix: str | None = None
    prefix_action: str | None = None
    filled_by_tie: list[tuple[str, str]] = field(default_factory=list)
    disk: Mapping[str, torch.Tensor] | None = None
    offload_folder: Path | None = None
    bytes_loaded: int = 0
    conversions: list[Conversion] = field(default_factory=list)
    computed: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """A few human-readable lines: counts, and everything ignored, renamed or tied."""
        lines = [f"loaded {len(self.loaded)} tensors ({self.bytes_loaded / 2**20:.1f} MiB)"
                 + (f", {len(self.disk)} left on disk" if self.disk else "")]
        if self.renamed_prefix:
            lines.append(f"prefix {self.renamed_prefix!r} {self.prefix_action} to match the model")
        renamed = [c for c in self.conversions if c.is_rename]
        fused = [c for c in self.conversions if not c.is_rename]
        if renamed:
            lines.append(f"renamed {len(renamed)} checkpoint keys (read in place), e.g. {renamed[0].describe()}")
        lines += [f"converted {c.describe()}" for c in fused]
        lines += [f"computed by the model (not in the checkpoint): {name}" for name in self.computed]
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
    key_mapping: Mapping[str, str] | None = None,
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
            Default: the model's own rule, as ``from_pretrained`` applies it: its
            ``_keep_in_fp32_modules`` under float16 only, ``_keep_in_fp32_modules_strict``
            under float16 and bfloat16.
        key_mapping: extra checkpoint key renamings (regex -> replacement), as
            ``from_pretrained(key_mapping=...)`` takes them (transformers models).
        progress: show a tqdm progress bar over bytes.

    A transformers model's checkpoint keys are converted with transformers' own rules
    (renamed modules, experts stored one by one but fused in the model): see
    `LoadResult.conversions`. Tensors no checkpoint holds but the model computes
    (non-persistent buffers on meta, keys the class ignores when missing) are computed by the
    model's ``_init_weights``, as ``from_pretrained`` does.

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
    options = _options(model, index, device_map=device_map, dtype=dtype, strict=strict,
                       offload_folder=offload_folder, keep_in_fp32_modules=keep_in_fp32_modules)
    return _load(model, index, options, progress=progress, inplace=False, key_mapping=key_mapping)


def check_checkpoint(model: torch.nn.Module, checkpoint: str | Path | CheckpointIndex, *,
                     strict: bool = True) -> LoadPlan:
    """Match ``checkpoint`` to ``model`` and check it, from headers alone: nothing is loaded.

    What `load_checkpoint_in_model` checks first (keys, prefixes, ties, shapes), as a plan
    saying which checkpoint key fills which model tensor.

    Raises:
        CheckpointError: listing every missing key, unexpected key and shape mismatch.

    Example:
        >>> import tempfile, torch, pathlib
        >>> from bigviz.checkpoint.save import save_sharded
        >>> folder = save_sharded(torch.nn.Linear(2, 2), pathlib.Path(tempfile.mkdtemp()) / "c",
        ...                       progress=False)
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(2, 3)
        >>> check_checkpoint(model, folder)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        bigviz.checkpoint.errors.CheckpointError: cannot load ... (2 problems):
          - shape mismatch: weight: checkpoint 'weight' has shape [2, 2], the model [3, 2]
        ...
    """
    index = CheckpointIndex.open(checkpoint)
    tie_model(model)
    tensors = describe_model(model)
    view = _view(model, index, tensors, None)
    plan = resolve_view(match_checkpoint(tensors, view.entries, _options(model, index, strict=strict)), view)
    check_plan(plan, strict=strict, where=f"'{index.path}' into {type(model).__name__}")
    return plan


def _options(model: torch.nn.Module, index: CheckpointIndex, *, device_map: object = None,
             dtype: torch.dtype | str | None = None, strict: bool = True,
             offload_folder: str | Path | None = None,
             keep_in_fp32_modules: Sequence[str] | None = None) -> LoadOptions:
    """The load's options, with the keys the model class declares ignorable."""
    dtype = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    keep, patterns = _fp32_rule(model, dtype, keep_in_fp32_modules)
    return LoadOptions(
        device_map=_as_device_map(device_map), dtype=dtype,
        keep_in_fp32_modules=keep, fp32_patterns=patterns, strict=strict,
        offload_folder=str(offload_folder) if offload_folder is not None else None,
        can_map_disk=index.format == "safetensors",
        ignore_unexpected=tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()),
        ignore_missing=hf.ignorable_missing(model),
    )


def _fp32_rule(model: torch.nn.Module, dtype: torch.dtype | None,
               given: Sequence[str] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(module names, regex patterns) kept in float32: the caller's list, else the model's rule.

    transformers' rule (and the same attributes on other modules): ``_keep_in_fp32_modules``
    under float16 only, ``_keep_in_fp32_modules_strict`` under float16 and bfloat16.
    """
    if given is not None:
        return tuple(given), ()
    if hf.is_transformers_model(model):
        return (), hf.fp32_patterns(model, dtype)
    keep: list[str] = []
    if dtype == torch.float16:
        keep += getattr(model, "_keep_in_fp32_modules", None) or []
    if dtype in (torch.float16, torch.bfloat16):
        keep += getattr(model, "_keep_in_fp32_modules_strict", None) or []
    return tuple(keep), ()


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
          progress: bool, inplace: bool, key_mapping: Mapping[str, str] | None = None) -> LoadResult:
    tie_model(model)
    tensors = describe_model(model)
    view = _view(model, index, tensors, key_mapping)
    plan = resolve_view(match_checkpoint(tensors, view.entries, options), view)
    disk = [load for load in plan.loads if load.device == "disk"]
    plan = _with_problems(plan, list(view.problems) + _disk_problems(index, disk, options))
    check_plan(plan, strict=options.strict, where=f"'{index.path}' into {type(model).__name__}")
    computed = _computed(model, tensors, plan, options)
    slots = _Slots(model, [*plan.loads, *computed])
    stores: list[Mapping[str, torch.Tensor]] = []
    try:
        nbytes = _materialise(slots, index, plan, progress=progress, inplace=inplace, model=model)
        folder = _disk_weights(index, disk, options, model, stores)
        _leave_on_meta(slots, disk)
        stores += _compute(model, slots, computed)
    except BaseException:
        slots.restore()  # the model is as it was; the files opened so far are closed
        WeightStores(stores).close()
        raise
    return LoadResult(
        loaded=[load.name for load in plan.loads if load.device != "disk"],
        ignored=list(plan.ignored), missing=list(plan.missing), unexpected=list(plan.unexpected),
        renamed_prefix=plan.prefix, prefix_action=plan.prefix_action,
        filled_by_tie=list(plan.filled_by_tie), disk=_one_store(stores), offload_folder=folder,
        bytes_loaded=nbytes, conversions=list(plan.conversions), computed=[c.name for c in computed],
    )


def checkpoint_dtypes(model: torch.nn.Module, index: CheckpointIndex) -> dict[str, str]:
    """Model tensor name -> the dtype the checkpoint stores it in (after conversions), for
    every name the checkpoint fills, tied names included; headers only, nothing is loaded.

    Example:
        >>> import tempfile, torch, pathlib
        >>> from bigviz.checkpoint.save import save_sharded
        >>> folder = save_sharded(torch.nn.Linear(2, 2).half(), pathlib.Path(tempfile.mkdtemp()) / "c",
        ...                       progress=False)
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(2, 2)
        >>> checkpoint_dtypes(model, CheckpointIndex.open(folder))
        {'weight': 'float16', 'bias': 'float16'}
    """
    tie_model(model)
    tensors = describe_model(model)
    view = _view(model, index, tensors, None)
    plan = match_checkpoint(tensors, view.entries, LoadOptions(strict=False))
    return {alias: view.entries[load.key].dtype for load in plan.loads for alias in load.aliases}


def device_map_in_model_names(model: torch.nn.Module, checkpoint: str | Path | CheckpointIndex,
                              device_map: Mapping[str, object]) -> dict[str, object]:
    """``device_map`` with keys that name checkpoint modules the model does not have (a map
    planned from headers alone: ``embed_out`` where the model has ``lm_head``, a base-model
    prefix) replaced by the model tensors those checkpoint keys load into.

    Keys naming a module or tensor of the model are kept as they are; a key naming neither
    the model nor the checkpoint is kept too (the map check reports it).

    Example:
        >>> import tempfile, torch, pathlib
        >>> from bigviz.checkpoint.save import save_sharded
        >>> folder = save_sharded({"net.weight": torch.ones(2, 2)}, pathlib.Path(tempfile.mkdtemp()) / "c",
        ...                       progress=False)
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(2, 2, bias=False)
        >>> device_map_in_model_names(model, folder, {"net": "cpu"})
        {'weight': 'cpu'}
    """
    from bigviz.core.names import owner

    names = {n for n, _ in model.named_modules()} | {a for t in describe_model(model) for a in t.aliases}
    foreign = {k for k in device_map if k not in names}
    if not foreign:
        return dict(device_map)
    index = CheckpointIndex.open(checkpoint)
    tie_model(model)
    tensors = describe_model(model)
    view = _view(model, index, tensors, None)
    plan = resolve_view(match_checkpoint(tensors, view.entries, LoadOptions(strict=False)), view)
    hits: dict[str, dict[str, None]] = {}  # foreign key -> the model names its checkpoint keys fill
    for load in plan.loads:
        for key in load.conversion.sources if _is_fused(load) else (load.key,):  # type: ignore[union-attr]
            entry = owner(key, foreign)  # the longest foreign key over it wins, as in any map
            if entry is not None:
                hits.setdefault(entry, {}).update(dict.fromkeys(load.aliases))
    out: dict[str, object] = {}
    for key, device in device_map.items():
        if key in hits:
            out.update(dict.fromkeys(hits[key], device))
        else:
            out[key] = device
    return out


def _view(model: torch.nn.Module, index: CheckpointIndex, tensors: Sequence[ModelTensor],
          key_mapping: Mapping[str, str] | None) -> CheckpointView:
    """The checkpoint as the model sees it, after transformers' conversions (if any apply)."""
    rules = hf.conversion_rules(model, key_mapping)
    names = [a for t in tensors for a in t.aliases]
    prefix = getattr(model, "base_model_prefix", "") or ""
    return checkpoint_view(index.entries, rules, model_names=names, base_model_prefix=prefix, model=model)


def _with_problems(plan: LoadPlan, problems: list[str]) -> LoadPlan:
    return replace(plan, device_problems=plan.device_problems + tuple(problems))


def _disk_problems(index: CheckpointIndex, disk: list[TensorLoad], options: LoadOptions) -> list[str]:
    """Disk tensors that cannot be read in place need an offload folder to be written to once."""
    fused = [load.name for load in disk if _is_fused(load)]
    if not fused and (not disk or index.format == "safetensors"):
        return []
    problems = offload_problems(options.offload_folder)
    if fused and options.offload_folder is None:
        problems = [f"disk offload of tensors fused from several checkpoint keys ({', '.join(fused[:3])}"
                    f"{', ...' if len(fused) > 3 else ''}) needs offload_folder= (they are converted "
                    "once and written there as safetensors)"]
    return problems


def _is_fused(load: TensorLoad) -> bool:
    return load.conversion is not None and not load.conversion.is_rename


def _materialise(slots: _Slots, index: CheckpointIndex, plan: LoadPlan, *,
                 progress: bool, inplace: bool, model: torch.nn.Module) -> int:
    from tqdm.auto import tqdm

    todo = [load for load in plan.loads if load.device != "disk"]
    plain = [load for load in todo if not _is_fused(load)]
    sources = {key for load in todo if _is_fused(load) for key in load.conversion.sources}  # type: ignore[union-attr]
    names = {load.name: load.key for load in plain} | {key: key for key in sources}
    nbytes = 0
    with LazyWeights(index, names) as weights, \
            tqdm(total=sum(load.nbytes for load in todo), unit="B", unit_scale=True, desc="loading",
                 disable=not progress) as bar:
        for load in plain:
            nbytes += slots.fill(load, _convert(weights[load.name], load), inplace=inplace)
            bar.update(load.nbytes)
        fused = [load for load in todo if _is_fused(load)]
        converted = ConvertedWeights([load.conversion for load in fused], weights.__getitem__,  # type: ignore[misc]
                                     dtypes={load.name: load.dtype for load in fused}, model=model)
        for load in fused:
            nbytes += slots.fill(load, converted[load.name].to(load.device), inplace=inplace)
            bar.update(load.nbytes)
    return nbytes


def _convert(tensor: torch.Tensor, load: TensorLoad) -> torch.Tensor:
    """Move and cast, narrowing before a device copy and widening after (fewer bytes moved)."""
    if tensor.dtype == load.dtype or not tensor.is_floating_point():
        return tensor.to(load.device)
    if tensor.element_size() > load.dtype.itemsize:
        return tensor.to(load.dtype).to(load.device)
    return tensor.to(load.device).to(load.dtype)


def _disk_weights(index: CheckpointIndex, disk: list[TensorLoad], options: LoadOptions,
                  model: torch.nn.Module, stores: list[Mapping[str, torch.Tensor]]) -> Path | None:
    """Add to ``stores`` the disk tensors' sources: the safetensors files themselves (plain and
    renamed keys, read in place), and a one-time safetensors copy in ``offload_folder`` of what
    cannot be read in place (other formats, fused tensors); returns that folder, if written.
    Each tensor comes back in its load dtype."""
    in_place = [load for load in disk if not _is_fused(load) and index.format == "safetensors"]
    written = [load for load in disk if load not in in_place]
    if in_place:
        names = {alias: load.key for load in in_place for alias in load.aliases}
        dtypes = {alias: load.dtype for load in in_place for alias in load.aliases}
        stores.append(LazyWeights(index, names, dtypes=dtypes))
    if not written:
        return None
    assert options.offload_folder is not None  # checked before loading
    folder = Path(options.offload_folder)
    plain = [load for load in written if not _is_fused(load)]
    fused = [load for load in written if _is_fused(load)]
    sources = {key for load in fused for key in load.conversion.sources}  # type: ignore[union-attr]
    with LazyWeights(index, {load.name: load.key for load in plain} | {k: k for k in sources}) as weights:
        converted = ConvertedWeights([load.conversion for load in fused], weights.__getitem__,  # type: ignore[misc]
                                     dtypes={load.name: load.dtype for load in fused}, model=model)
        source = WeightStores([{load.name: weights[load.name] for load in plain}, converted])
        written_index = write_offload_folder(source, folder)
    names = {alias: load.name for load in written for alias in load.aliases}
    dtypes = {alias: load.dtype for load in written for alias in load.aliases}
    stores.append(LazyWeights(CheckpointIndex.open(written_index), names, dtypes=dtypes))
    return folder


def _leave_on_meta(slots: _Slots, disk: list[TensorLoad]) -> None:
    """Disk tensors stay on meta in the model, in the dtype they load in (so the engine casts
    what it fetches to that dtype, and the model reports it)."""
    for load in disk:
        old = slots.current(load.name)
        if not old.is_meta or old.dtype != load.dtype:
            slots.fill(load, torch.empty(old.shape, dtype=load.dtype, device="meta"), inplace=False)


def _computed(model: torch.nn.Module, tensors: Sequence[ModelTensor], plan: LoadPlan,
              options: LoadOptions) -> list[TensorLoad]:
    """Tensors on meta that no checkpoint key fills but the model computes itself, as
    ``from_pretrained`` does: non-persistent buffers, keys the class ignores when missing, and
    (with ``strict=False``) missing keys (initialised as transformers initialises them)."""
    if not hf.is_transformers_model(model):
        return []
    loaded = {a for load in plan.loads for a in load.aliases}
    missing = set(plan.missing) if not options.strict else set()
    out = []
    for t in tensors:
        if not t.is_meta or any(a in loaded for a in t.aliases):
            continue
        ignorable = any(_search(a, options.ignore_missing) for a in t.aliases)
        if not t.persistent or ignorable or any(a in missing for a in t.aliases):
            device = load_device(t.name, options.device_map) or torch_name(execution_device((options.device_map or {}).values()))
            dtype = t.dtype
            if t.kind == "param" and t.dtype.is_floating_point and options.dtype is not None:
                dtype = options.dtype
            out.append(TensorLoad(t.name, t.aliases, "", device, dtype, 0))
    return out


def _search(name: str, patterns: Sequence[str]) -> bool:
    import re

    return any(re.search(p, name) for p in patterns)


def _compute(model: torch.nn.Module, slots: _Slots, computed: list[TensorLoad]) -> list[Mapping[str, torch.Tensor]]:
    """Materialise and compute ``computed``; those mapped to disk are handed back in a store
    held in RAM (they are in no file) and left on meta in the model."""
    if not computed:
        return []
    for load in computed:
        old = slots.current(load.name)
        device = "cpu" if load.device == "disk" else load.device
        slots.fill(load, torch.empty(old.shape, dtype=load.dtype, device=device), inplace=False)
    hf.initialise_computed(model, [a for load in computed for a in load.aliases])
    on_disk = [load for load in computed if load.device == "disk"]
    store = {alias: slots.current(load.name).detach() for load in on_disk for alias in load.aliases}
    _leave_on_meta(slots, on_disk)
    return [store] if store else []


def _one_store(stores: list[Mapping[str, torch.Tensor]]) -> Mapping[str, torch.Tensor] | None:
    if not stores:
        return None
    return stores[0] if len(stores) == 1 else WeightStores(stores)


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

    def current(self, name: str) -> torch.Tensor:
        """What slot ``name`` holds now."""
        store, leaf, _ = self._slots[name]
        return store[leaf]

    def fill(self, load: TensorLoad, tensor: torch.Tensor, *, inplace: bool) -> int:
        """Put ``tensor`` under every name of ``load`` (one object: a tie survives); its bytes."""
        store, leaf, old = self._slots[load.name]
        nbytes = tensor.numel() * tensor.element_size()
        if inplace and not old.is_meta:
            with torch.no_grad():
                self._saved.append((old, old.detach().to("cpu", copy=True)))
                old.copy_(tensor)
            return nbytes
        if isinstance(old, torch.nn.Parameter):
            grad = old.requires_grad and tensor.is_floating_point()
            tensor = torch.nn.Parameter(tensor, requires_grad=grad)
        for alias in load.aliases:
            alias_store, alias_leaf, _ = self._slots[alias]
            alias_store[alias_leaf] = tensor
        return nbytes

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, value in reversed(self._saved):  # values first, then the objects
                tensor.copy_(value)
        self._saved.clear()
        for store, leaf, old in self._slots.values():
            store[leaf] = old
