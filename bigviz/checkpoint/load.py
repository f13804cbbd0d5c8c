"""Load a checkpoint into a model: planned and checked first, then executed, never half loaded.

`load_checkpoint_in_model` opens the checkpoint's headers and makes a `LoadPlan` (see
:mod:`bigviz.checkpoint.load_plan`): every key matched to a model tensor (prefixes, ties,
non-persistent buffers, transformers' renames and fused experts), every tensor's file, bytes,
dtype and device, all before reading a byte of tensor data; one error lists every problem and
the model is left as it was. :mod:`bigviz.checkpoint.loader` then executes the plan: each
tensor goes straight to its device; safetensors on the CPU with no dtype change become
zero-copy views of the memory-mapped files (no read, no anonymous memory); tensors mapped to
``"disk"`` are not materialised at all (they stay on meta and come back as `LazyWeights` over
the original files). Should anything fail midway, every tensor is put back as it was.

Every function here takes a model or its `~bigviz.modeling.inventory.ModelInventory`, so a
call that has one (``load_checkpoint_and_dispatch``) walks the model once.

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

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch

from bigviz.checkpoint import hf
from bigviz.checkpoint.convert import CheckpointView, Conversion, checkpoint_view
from bigviz.checkpoint.index import CheckpointIndex
from bigviz.checkpoint.load_plan import (
    LoadOptions,
    LoadPlan,
    TensorLoad,
    check_plan,
    load_device,
    locate,
    match_checkpoint,
    resolve_view,
)
from bigviz.checkpoint.loader import execute_load
from bigviz.checkpoint.offload_folder import offload_problems
from bigviz.checkpoint.quantized import (
    check_supported,
    is_packed_load,
    packed_view,
    prepare_for_checkpoint,
    quantize_loads,
    quantization_config,
)
from bigviz.core.devicemap import check_keys
from bigviz.core.devices import execution_device, torch_name
from bigviz.core.quant import QuantConfig
from bigviz.core.sizes import format_count
from bigviz.core.dtypes import load_dtype
from bigviz.modeling.inventory import ModelInventory, tie_model
from bigviz.core.errors import ArgumentTypeError
from bigviz.modeling.twin import computed_buffer_dtypes, is_transformers_model

__all__ = [
    "LoadResult",
    "load_checkpoint_in_model",
    "load_sharded_checkpoint",
    "check_checkpoint",
    "plan_load",
    "execute_load_plan",
    "inventory_of",
    "checkpoint_view_of",
]

ModelOrInventory = torch.nn.Module | ModelInventory


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
        lines = [
            f"loaded {format_count(len(self.loaded), 'tensor')} ({self.bytes_loaded / 2**20:.1f} MiB)"
            + (f", {len(self.disk)} left on disk" if self.disk else "")
        ]
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
    model: ModelOrInventory,
    checkpoint: str | Path | CheckpointIndex,
    device_map: Mapping[str, int | str | torch.device] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    offload_folder: str | Path | None = None,
    strict: bool = True,
    keep_in_fp32_modules: Sequence[str] | None = None,
    key_mapping: Mapping[str, str] | None = None,
    progress: bool = True,
    quantization: object = None,
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
        progress: show a progress bar over bytes once the work has run for a second.
        quantization: ``"int8"`` or ``"int4"`` (or a `~bigviz.core.quant.QuantConfig`, or
            transformers' ``TorchAoConfig`` / ``BitsAndBytesConfig``): quantize the linear
            layers' weights while they load, one at a time (see :mod:`bigviz.modeling.quant`).
            A checkpoint stored quantized needs none: it loads as stored.

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
    from bigviz.modeling.quant import as_quant_config, torch_dtype

    config = as_quant_config(quantization)
    checkpoint = CheckpointIndex.open(checkpoint)
    if not isinstance(model, ModelInventory):  # (an inventory: its caller prepared the model)
        prepare_for_checkpoint(model, checkpoint, config, dtype=torch_dtype(dtype))
    index, plan = plan_load(
        model,
        checkpoint,
        device_map,
        dtype=dtype,
        offload_folder=offload_folder,
        strict=strict,
        keep_in_fp32_modules=keep_in_fp32_modules,
        key_mapping=key_mapping,
        quantization=config,
    )
    return execute_load_plan(inventory_of(model), index, plan, progress=progress, inplace=False)


def plan_load(
    model: ModelOrInventory,
    checkpoint: str | Path | CheckpointIndex,
    device_map: object = None,
    *,
    dtype: torch.dtype | str | None = None,
    offload_folder: str | Path | None = None,
    strict: bool = True,
    keep_in_fp32_modules: Sequence[str] | None = None,
    key_mapping: Mapping[str, str] | None = None,
    check: bool = True,
    quantization: QuantConfig | None = None,
) -> tuple[CheckpointIndex, LoadPlan]:
    """The checkpoint's index and the `LoadPlan` of loading it into ``model`` (headers only:
    nothing is read); checked unless ``check=False``. Arguments as for
    `load_checkpoint_in_model`.

    Raises:
        CheckpointError: (with ``check``) listing every problem that forbids the load.

    Example:
        >>> import tempfile, torch, pathlib
        >>> from bigviz.checkpoint.save import save_sharded
        >>> folder = save_sharded(torch.nn.Linear(2, 2).half(), pathlib.Path(tempfile.mkdtemp()) / "c",
        ...                       progress=False)
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(2, 2)
        >>> _, plan = plan_load(model, folder, {"": "disk"})
        >>> [(t.name, t.device, t.source_dtype, t.in_place) for t in plan.loads]
        [('weight', 'disk', 'float16', True), ('bias', 'disk', 'float16', True)]
    """
    index = CheckpointIndex.open(checkpoint)
    check_supported(index)  # stored in a quantization bigviz cannot run here: refused, named
    inventory = inventory_of(model)
    options = _options(
        inventory.model,
        index,
        device_map=device_map,
        dtype=dtype,
        strict=strict,
        offload_folder=offload_folder,
        keep_in_fp32_modules=keep_in_fp32_modules,
    )
    plan = _plan(inventory, index, options, key_mapping, quantization)
    if check:
        check_plan(plan, strict=strict, where=f"'{index.path}' into {type(inventory.model).__name__}")
    return index, plan


def inventory_of(model: ModelOrInventory) -> ModelInventory:
    """The model's inventory, made after letting it make the ties it declares (a
    transformers model on meta ties ``lm_head.weight`` in ``tie_weights()``); an inventory
    is returned as it is (whoever made it tied the model first)."""
    if isinstance(model, ModelInventory):
        return model
    tie_model(model)
    return ModelInventory.of(model)


def _plan(
    inventory: ModelInventory,
    index: CheckpointIndex,
    options: LoadOptions,
    key_mapping: Mapping[str, str] | None,
    quantization: QuantConfig | None = None,
) -> LoadPlan:
    view = checkpoint_view_of(inventory, index, key_mapping)
    plan = resolve_view(match_checkpoint(inventory.tensors, view.entries, options), view)
    plan = locate(plan, index.entries, format=index.format)
    if quantization is not None:
        plan = _quantized(plan, inventory, index, quantization)
    disk = [load for load in plan.loads if load.device == "disk"]
    problems = tuple(view.problems) + tuple(_disk_problems(index, disk, options))
    return replace(
        plan,
        mismatched=_not_explained(plan.mismatched, view.problems),
        device_problems=plan.device_problems + problems,
        checkpoint=str(index.path),
        computed=tuple(_computed(inventory, plan, options)),
        offload_folder=options.offload_folder,
    )


def _not_explained(mismatched: Sequence[str], problems: Sequence[str]) -> tuple[str, ...]:
    """The shape mismatches no problem of the checkpoint's layout explains: a quantized weight
    whose part is missing (a 4-bit weight without its quant state) cannot be read as quantized,
    so its packed shape also disagrees with the model's; the missing part is what to say.

    Example:
        >>> _not_explained(["w: checkpoint 'w' has shape [8, 1], the model [4, 4]", "v: ..."],
        ...                ["w (in model.safetensors) is stored as bitsandbytes 4-bit but ..."])
        ('v: ...',)
    """
    named = {p.split(" (in ", 1)[0] for p in problems}
    return tuple(m for m in mismatched if m.split(": ", 1)[0] not in named)


def _quantized(plan: LoadPlan, inventory: ModelInventory, index: CheckpointIndex, config: QuantConfig) -> LoadPlan:
    """``plan`` with the weights ``config`` targets quantized while they load (one at a time);
    a checkpoint already stored quantized is refused (it loads as it is stored)."""
    from bigviz.checkpoint.errors import CheckpointError
    from bigviz.modeling.quant import quant_targets

    stored = quantization_config(index)
    if stored is not None:
        raise CheckpointError(
            f"quantization={config.method!r}: {str(index.path)!r} is already stored quantized (quant_method "
            f"{stored.get('quant_method')!r}); leave quantization= out to load it as it is stored"
        )
    targets = quant_targets(inventory, config)
    shapes = {t: tuple(inventory.tensor(t).shape) for t in targets}
    placeholders = {t: inventory.tensor(t) for t in targets}
    return quantize_loads(plan, config, targets, shapes=shapes, placeholders=placeholders)


def execute_load_plan(
    inventory: ModelInventory, index: CheckpointIndex, plan: LoadPlan, *, progress: bool = True, inplace: bool = False
) -> LoadResult:
    """Execute a checked `LoadPlan` (see :func:`bigviz.checkpoint.loader.execute_load`) and
    say what it did."""
    done = execute_load(inventory, index, plan, progress=progress, inplace=inplace)
    return LoadResult(
        loaded=[load.name for load in plan.loads if load.device != "disk"],
        ignored=list(plan.ignored),
        missing=list(plan.missing),
        unexpected=list(plan.unexpected),
        renamed_prefix=plan.prefix,
        prefix_action=plan.prefix_action,
        filled_by_tie=list(plan.filled_by_tie),
        disk=done.disk(),
        offload_folder=done.folder,
        bytes_loaded=done.nbytes,
        conversions=list(plan.conversions),
        computed=[c.name for c in plan.computed],
    )


def check_checkpoint(
    model: ModelOrInventory, checkpoint: str | Path | CheckpointIndex, *, strict: bool = True
) -> LoadPlan:
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
    return plan_load(model, checkpoint, strict=strict)[1]


def _options(
    model: torch.nn.Module,
    index: CheckpointIndex,
    *,
    device_map: object = None,
    dtype: torch.dtype | str | None = None,
    strict: bool = True,
    offload_folder: str | Path | None = None,
    keep_in_fp32_modules: Sequence[str] | None = None,
) -> LoadOptions:
    """The load's options, with the keys the model class declares ignorable."""
    dtype = torch_load_dtype(dtype)
    keep, patterns = _fp32_rule(model, dtype, keep_in_fp32_modules)
    return LoadOptions(
        device_map=_as_device_map(device_map),
        dtype=dtype,
        keep_in_fp32_modules=keep,
        fp32_patterns=patterns,
        strict=strict,
        offload_folder=str(offload_folder) if offload_folder is not None else None,
        can_map_disk=index.format == "safetensors",
        ignore_unexpected=hf.ignorable_unexpected(model),
        ignore_missing=hf.ignorable_missing(model),
    )


def torch_load_dtype(dtype: object) -> torch.dtype | None:
    """A loader's ``dtype=`` as a torch dtype, checked (:func:`~bigviz.core.dtypes.load_dtype`:
    floating only, bad values quoted).

    Example:
        >>> torch_load_dtype("bf16")
        torch.bfloat16
    """
    name = load_dtype(dtype)
    return None if name is None else getattr(torch, name)


def _fp32_rule(
    model: torch.nn.Module, dtype: torch.dtype | None, given: Sequence[str] | None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(module names, regex patterns) kept in float32: the caller's list, else the model's rule.

    transformers' rule (and the same attributes on other modules): ``_keep_in_fp32_modules``
    under float16 only, ``_keep_in_fp32_modules_strict`` under float16 and bfloat16.
    """
    if given is not None:
        return tuple(given), ()
    if is_transformers_model(model):
        return (), hf.fp32_patterns(model, dtype)
    keep: list[str] = []
    if dtype == torch.float16:
        keep += getattr(model, "_keep_in_fp32_modules", None) or []
    if dtype in (torch.float16, torch.bfloat16):
        keep += getattr(model, "_keep_in_fp32_modules_strict", None) or []
    return tuple(keep), ()


def load_sharded_checkpoint(
    model: torch.nn.Module, folder: str | Path, strict: bool = True, prefer_safe: bool = True
) -> IncompatibleKeys:
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
    check_supported(index)
    inventory = inventory_of(model)
    options = LoadOptions(strict=strict, can_map_disk=index.format == "safetensors")
    plan = _plan(inventory, index, options, None)
    check_plan(plan, strict=strict, where=f"'{index.path}' into {type(model).__name__}")
    result = execute_load_plan(inventory, index, plan, progress=False, inplace=True)
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
    raise ArgumentTypeError(
        f"device_map must be a dict (module -> device) or a DevicePlan, not "
        f"{device_map!r}; for 'auto' use bigviz.infer_auto_device_map first"
    )


def checkpoint_view_of(
    inventory: ModelInventory, index: CheckpointIndex, key_mapping: Mapping[str, str] | None
) -> CheckpointView:
    """The checkpoint as the model sees it, after transformers' conversions (if any apply)."""
    model = inventory.model
    rules = hf.conversion_rules(model, key_mapping)
    names = list(inventory.slots)
    prefix = getattr(model, "base_model_prefix", "") or ""
    view = checkpoint_view(index.entries, rules, model_names=names, base_model_prefix=prefix, model=model)
    return packed_view(view, index)  # a checkpoint stored quantized: each weight's parts as one


def _disk_problems(index: CheckpointIndex, disk: list[TensorLoad], options: LoadOptions) -> list[str]:
    """Disk tensors that cannot be read in place need an offload folder to be written to once."""
    stored = [load for load in disk if is_packed_load(load) and load.conversion.rule.in_place]  # type: ignore[union-attr]
    if stored and index.format != "safetensors":
        return [
            f"disk offload of weights stored quantized in {index.format} files ({stored[0].name}, ...): "
            "map them to 'cpu', or save the checkpoint as safetensors"
        ]
    disk = [load for load in disk if load not in stored]  # read in place, built at each fetch
    fused = [load.name for load in disk if load.fused]
    if not fused and (not disk or index.format == "safetensors"):
        return []
    problems = offload_problems(options.offload_folder)
    quantized = [load.name for load in disk if is_packed_load(load)]
    if quantized and options.offload_folder is None:
        return [
            f"weights quantized while loading and mapped to 'disk' ({', '.join(quantized[:3])}"
            f"{', ...' if len(quantized) > 3 else ''}) are written once, packed, to an offload folder: "
            "pass offload_folder="
        ]
    if fused and options.offload_folder is None:
        problems = [
            f"disk offload of tensors fused from several checkpoint keys ({', '.join(fused[:3])}"
            f"{', ...' if len(fused) > 3 else ''}) needs offload_folder= (they are converted "
            "once and written there as safetensors)"
        ]
    return problems


def _computed(inventory: ModelInventory, plan: LoadPlan, options: LoadOptions) -> list[TensorLoad]:
    """Tensors on meta that no checkpoint key fills but the model computes itself, as
    ``from_pretrained`` does: non-persistent buffers, keys the class ignores when missing, and
    (with ``strict=False``) missing keys (initialised as transformers initialises them). With
    ``dtype=``, computed float buffers take the dtype ``from_pretrained(dtype=...)`` gives
    them (a buffer already materialised is cast: Falcon-H1's ``mup_vector`` becomes bfloat16,
    a rotary ``inv_freq`` stays float32)."""
    if not is_transformers_model(inventory.model):
        return []
    loaded = {a for load in plan.loads for a in load.aliases}
    missing = set(plan.missing) if not options.strict else set()
    buffers: dict[str, torch.dtype] | None = None
    out = []
    for t in inventory.tensors:
        if any(a in loaded for a in t.aliases):
            continue
        ignorable = any(_search(a, options.ignore_missing) for a in t.aliases)
        computed = not t.persistent or ignorable or any(a in missing for a in t.aliases)
        float_buffer = t.kind == "buffer" and t.dtype.is_floating_point and options.dtype is not None
        if not computed or not (t.is_meta or (float_buffer and not t.persistent)):
            continue
        dtype = t.dtype
        if t.kind == "param" and t.dtype.is_floating_point and options.dtype is not None:
            dtype = options.dtype
        elif float_buffer:  # as from_pretrained builds the model under the dtype
            if buffers is None:
                buffers = computed_buffer_dtypes(inventory.model, options.dtype)  # type: ignore[arg-type]
            dtype = next((buffers[a] for a in t.aliases if a in buffers), dtype)
        if not t.is_meta and dtype == t.dtype:
            continue  # materialised already, in the dtype it keeps
        # what no key covers runs where offloaded modules run (one rule: bigviz.core.devices)
        device = load_device(t.name, options.device_map) or torch_name(
            execution_device((options.device_map or {}).values())
        )
        out.append(TensorLoad(t.name, t.aliases, "", device, dtype, 0))
    return out


def _search(name: str, patterns: Sequence[str]) -> bool:
    return any(re.search(p, name) for p in patterns)
