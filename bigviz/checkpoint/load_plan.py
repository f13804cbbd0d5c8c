"""The load plan: which checkpoint key fills which model tensor, from which file and bytes,
converted how, to which device and dtype; decided before any data is read.

The second link of the chain of plans (``DevicePlan`` -> ``LoadPlan`` -> ``DispatchPlan``).
`match_checkpoint` is pure (the model's tensors and the checkpoint's headers in, a frozen
`LoadPlan` out): it finds a base-model prefix to add or strip (``bert.``, ``model.``,
``transformer.``), follows tie groups (a tied duplicate absent from the checkpoint is filled
by its partner), skips non-persistent buffers the model computes itself, and decides every
tensor's device and dtype. `check_plan` then turns missing keys, unexpected keys, shape
mismatches and bad devices into one error listing all of them. The plan prints
(:meth:`LoadPlan.summary`, :meth:`LoadPlan.to_frame`) before anything moves;
:mod:`bigviz.checkpoint.loader` executes it.

Example:
    >>> import torch
    >>> from bigviz.modeling.inventory import ModelInventory
    >>> from bigviz.checkpoint.index import TensorInfo
    >>> with torch.device("meta"):
    ...     model = torch.nn.Linear(2, 3)
    >>> entries = {k: TensorInfo(k, "float32", s, 4, None) for k, s in
    ...            [("lin.weight", (3, 2)), ("lin.bias", (3,))]}
    >>> plan = match_checkpoint(ModelInventory.of(model).tensors, entries, LoadOptions())
    >>> plan.prefix, [(t.name, t.key, t.device) for t in plan.loads]
    ('lin.', [('weight', 'lin.weight', 'cpu'), ('bias', 'lin.bias', 'cpu')])
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import pandas as pd

from bigviz.checkpoint.convert import CheckpointView, Conversion
from bigviz.checkpoint.errors import raise_problems
from bigviz.checkpoint.index import TensorInfo
from bigviz.core.devicemap import device_of
from bigviz.core.devices import device_label, normalize_device, tie_home, torch_name
from bigviz.core.dtypes import is_floating
from bigviz.core.names import is_prefix, owner
from bigviz.core.quant import quantization_role_keys
from bigviz.core.sizes import format_count, format_size
from bigviz.modeling.budgets import absent_device_problems
from bigviz.modeling.inventory import ModelTensor

__all__ = [
    "LoadOptions",
    "TensorLoad",
    "LoadPlan",
    "match_checkpoint",
    "check_plan",
    "module_matches",
    "resolve_view",
    "locate",
    "load_device",
    "device_problems",
    "plan_problems",
]


@dataclass(frozen=True)
class LoadOptions:
    """The knobs of a load (see `bigviz.checkpoint.load.load_checkpoint_in_model`)."""

    device_map: Mapping[str, int | str | torch.device] | None = None
    dtype: torch.dtype | None = None
    keep_in_fp32_modules: Sequence[str] = ()  # module names (dotted prefixes or name components)
    fp32_patterns: Sequence[str] = ()  # regexes searched in tensor names (transformers' dtype plan)
    strict: bool = True
    offload_folder: str | None = None
    can_map_disk: bool = True  # False: disk tensors must be rewritten (needs offload_folder)
    ignore_unexpected: Sequence[str] = ()  # regexes (transformers' _keys_to_ignore_on_load_*)
    ignore_missing: Sequence[str] = ()


@dataclass(frozen=True)
class TensorLoad:
    """Load checkpoint ``key`` into model tensor ``name`` (and its tied ``aliases``).

    Attributes:
        name: the model tensor (its first name).
        aliases: every model name of that tensor (a tie: one object under each).
        key: the checkpoint key read (a fused tensor's first source; ``""``: computed by
            the model, read from no file).
        device: ``"cpu"``, ``"cuda:0"``, ``"mps"`` or ``"disk"`` (left in a file, read at
            forward time).
        dtype: the dtype the tensor loads in.
        nbytes: bytes as stored in the checkpoint.
        conversion: how the checkpoint key(s) become this tensor (a rename, or an operation
            over several keys), else None.
        source_dtype: the dtype the checkpoint stores (``"float16"``).
        file: the file holding ``key`` (``""`` when computed or fused from several files).
        offsets: ``(begin, end)`` bytes of ``key`` in ``file`` (safetensors), else None.
        in_place: a disk tensor read from the checkpoint's own file at forward time (True), or
            written once to the offload folder (False).
    """

    name: str
    aliases: tuple[str, ...]
    key: str
    device: str
    dtype: torch.dtype
    nbytes: int
    conversion: Conversion | None = None
    source_dtype: str = ""
    file: str = ""
    offsets: tuple[int, int] | None = None
    in_place: bool = False

    @property
    def fused(self) -> bool:
        """True when several checkpoint keys are combined into this tensor."""
        return self.conversion is not None and not self.conversion.is_rename

    @property
    def keys(self) -> tuple[str, ...]:
        """Every checkpoint key read for this tensor."""
        if self.fused:
            assert self.conversion is not None
            return self.conversion.sources
        return (self.key,) if self.key else ()

    @property
    def operation(self) -> str:
        """``"read"``, ``"rename"``, the fusing operation, or ``"computed"``."""
        if not self.key:
            return "computed"
        return self.conversion.operation if self.conversion is not None else "read"


@dataclass(frozen=True)
class LoadPlan:
    """What a load will do and what it found, decided before any data is read.

    Attributes:
        loads: one `TensorLoad` per model tensor the checkpoint fills.
        missing, unexpected, mismatched: model names the checkpoint lacks, checkpoint keys
            the model has no tensor for, and shape mismatches (sentences).
        ignored: ``(checkpoint key, why)`` for keys deliberately not loaded.
        filled_by_tie: ``(name, source)``: tied names filled by their partner.
        prefix, prefix_action: a base-model prefix ``"added"`` or ``"stripped"`` to match.
        device_problems: devices the map names that cannot be used here (sentences).
        conversions: renamed or fused keys this load uses.
        computed: tensors no checkpoint holds that the model computes (``from_pretrained``'s
            rule: non-persistent buffers on meta, keys the class may miss).
        checkpoint: the checkpoint's index or weights file.
        format: ``"safetensors"`` or ``"torch"``.
        offload_folder: where tensors that cannot be read in place are written once.
    """

    loads: tuple[TensorLoad, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    mismatched: tuple[str, ...]
    ignored: tuple[tuple[str, str], ...]
    filled_by_tie: tuple[tuple[str, str], ...]
    prefix: str | None = None
    prefix_action: str | None = None  # "added" | "stripped"
    device_problems: tuple[str, ...] = field(default=())
    conversions: tuple[Conversion, ...] = field(default=())
    computed: tuple[TensorLoad, ...] = field(default=())
    checkpoint: str = ""
    format: str = ""
    offload_folder: str | None = None

    def bytes_by_device(self) -> dict[str, int]:
        """Checkpoint bytes each device receives (``"disk"``: left in files)."""
        out: dict[str, int] = {}
        for load in self.loads:
            out[load.device] = out.get(load.device, 0) + load.nbytes
        return out

    def summary(self) -> str:
        """A few lines a person reads: what goes where, converted how, and what was found.

        Example:
            >>> print(LoadPlan((TensorLoad("w", ("w",), "w", "cpu", torch.float16, 8, source_dtype="float32"),),
            ...                (), (), (), (), ()).summary())
            LoadPlan: 1 tensor (8 B) from the checkpoint
              CPU: 1 tensor, 8 B
              1 cast (float32 -> float16)
        """
        where = f" from {self.checkpoint!r}" if self.checkpoint else " from the checkpoint"
        total = sum(load.nbytes for load in self.loads)
        lines = [
            f"LoadPlan: {format_count(len(self.loads), 'tensor')} ({format_size(total)}){where}"
            + (f" ({self.format})" if self.format else "")
        ]
        by_device: dict[str, list[TensorLoad]] = {}
        for load in self.loads:
            by_device.setdefault(load.device, []).append(load)
        for device, loads in by_device.items():
            how = ""
            if device == "disk":
                kept = sum(load.in_place for load in loads)
                how = f" (read in place: {kept}; written once to the offload folder: {len(loads) - kept})"
            lines.append(
                f"  {_label(device)}: {format_count(len(loads), 'tensor')}, "
                f"{format_size(sum(load.nbytes for load in loads))}{how}"
            )
        lines += self._notes()
        return "\n".join(lines)

    def _notes(self) -> list[str]:
        cast = [
            load
            for load in self.loads
            if load.source_dtype
            and load.source_dtype != str(load.dtype).removeprefix("torch.")
            and getattr(getattr(load.conversion, "rule", None), "run_packed", None) is None  # quantized: below
        ]
        casts = sorted({(load.source_dtype, str(load.dtype).removeprefix("torch.")) for load in cast})
        lines = []
        if casts:
            n = sum(
                1
                for load in self.loads
                if load.source_dtype and load.source_dtype != str(load.dtype).removeprefix("torch.")
            )
            lines.append(f"  {format_count(n, 'cast')} ({', '.join(f'{a} -> {b}' for a, b in casts)})")
        if self.prefix:
            lines.append(f"  prefix {self.prefix!r} {self.prefix_action} to match the model")
        renamed = [c for c in self.conversions if c.is_rename]
        lines += [f"  renamed {format_count(len(renamed), 'checkpoint key')} (read in place)"] if renamed else []
        packed: dict[str, int] = {}
        for c in self.conversions:
            if getattr(c.rule, "run_packed", None) is not None:  # quantized weights: one line per format
                packed[c.operation] = packed.get(c.operation, 0) + 1
            elif not c.is_rename:
                lines.append(f"  converted {c.describe()}")
        lines += [f"  {format_count(n, 'weight')}: {op}" for op, n in packed.items()]
        lines += [f"  computed by the model: {load.name}" for load in self.computed]
        lines += [f"  {name} filled by its tie to {src}" for name, src in self.filled_by_tie]
        lines += [f"  ignored {k}: {why}" for k, why in self.ignored]
        lines += [f"  missing: {k}" for k in self.missing] + [f"  unexpected: {k}" for k in self.unexpected]
        lines += [f"  shape mismatch: {m}" for m in self.mismatched]
        lines += [f"  problem: {p}" for p in self.device_problems]
        return lines

    def __str__(self) -> str:
        return self.summary()

    def to_frame(self) -> pd.DataFrame:
        """One row per tensor: tensor, key(s), file, offsets, dtypes, operation, device, bytes."""
        import pandas as pd

        columns = ["tensor", "keys", "file", "offsets", "from_dtype", "dtype", "operation", "device", "bytes"]
        rows: list[dict[str, Any]] = [
            {
                "tensor": load.name,
                "keys": ", ".join(load.keys),
                "file": Path(load.file).name if load.file else "",
                "offsets": load.offsets,
                "from_dtype": load.source_dtype,
                "dtype": str(load.dtype).removeprefix("torch."),
                "operation": load.operation,
                "device": load.device,
                "bytes": load.nbytes,
            }
            for load in (*self.loads, *self.computed)
        ]
        return pd.DataFrame(rows, columns=columns)


def _label(device: str) -> str:
    return device_label(normalize_device(device))


def locate(plan: LoadPlan, entries: Mapping[str, TensorInfo], *, format: str) -> LoadPlan:
    """``plan`` with each load's file, byte offsets and stored dtype from the checkpoint's
    ``entries`` (keys in checkpoint terms), and whether a disk tensor is read in place
    (safetensors, not fused) or written once to the offload folder.

    Example:
        >>> e = {"w": TensorInfo("w", "float16", (2,), 4, Path("a.safetensors"), (0, 4))}
        >>> p = LoadPlan((TensorLoad("w", ("w",), "w", "disk", torch.float32, 4),), (), (), (), (), ())
        >>> load = locate(p, e, format="safetensors").loads[0]
        >>> load.file, load.offsets, load.source_dtype, load.in_place
        ('a.safetensors', (0, 4), 'float16', True)
    """

    def placed(load: TensorLoad) -> TensorLoad:
        info = entries.get(load.keys[0]) if load.keys else None
        if info is None:
            return load
        in_place = load.device == "disk" and not load.fused and format == "safetensors"
        return replace(
            load,
            source_dtype=info.dtype,
            file="" if load.fused else str(info.file),
            offsets=None if load.fused else info.data_offsets,
            in_place=in_place,
        )

    return replace(plan, loads=tuple(placed(load) for load in plan.loads), format=format)


def module_matches(name: str, modules: Collection[str]) -> bool:
    """True if tensor ``name`` lies under one of ``modules``: a dotted prefix, or (for a
    dotless entry such as ``"wo"``) any name component, as accelerate and transformers match.

    Example:
        >>> module_matches("block.0.wo.weight", ["wo"]), module_matches("h.10.w", ["h.1"])
        (True, False)
    """
    if not modules:
        return False
    parts = set(name.split("."))
    return owner(name, set(modules)) is not None or any("." not in m and m in parts for m in modules)


def match_checkpoint(
    tensors: Sequence[ModelTensor], entries: Mapping[str, TensorInfo], options: LoadOptions
) -> LoadPlan:
    """Match a model's tensors to checkpoint entries and decide device and dtype of each."""
    names = [a for t in tensors for a in t.aliases]
    prefix, action, key_of = _resolve_prefix(names, entries.keys())
    loads, missing, mismatched, ignored, tied = [], [], [], [], []
    used: set[str] = set()
    for t in tensors:
        found = [(alias, key) for alias in t.aliases if (key := key_of(alias)) is not None]
        used.update(key for _, key in found)
        if not found:
            missing += [a for a in t.aliases if t.persistent and not _any_match(a, options.ignore_missing)]
            continue
        (source, key), rest = found[0], found[1:]
        ignored += [(k, f"tied duplicate of {key!r} (same tensor in the model)") for _, k in rest]
        if t.kind == "buffer" and not t.persistent and not t.is_meta:
            ignored.append((key, "non-persistent buffer: the model computes it itself"))
            continue
        tied += [(a, source) for a in t.aliases if a not in dict(found)]
        info = entries[key]
        if info.shape != t.shape:
            mismatched.append(f"{t.name}: checkpoint {key!r} has shape {list(info.shape)}, the model {list(t.shape)}")
        here = "cpu" if t.is_meta else t.device  # where it goes when there is no device_map
        loads.append(TensorLoad(t.name, t.aliases, key, here, _target_dtype(t, info, options), info.nbytes))
    unexpected = [k for k in entries if k not in used]
    ignored += [
        (k, "listed by the model class as safe to ignore")
        for k in unexpected
        if _any_match(k, options.ignore_unexpected)
    ]
    unexpected = [k for k in unexpected if not _any_match(k, options.ignore_unexpected)]
    placed, device_problems = _place(loads, options)
    return LoadPlan(
        tuple(placed),
        tuple(missing),
        tuple(unexpected),
        tuple(mismatched),
        tuple(ignored),
        tuple(tied),
        prefix,
        action,
        tuple(device_problems),
    )


def resolve_view(plan: LoadPlan, view: CheckpointView) -> LoadPlan:
    """Turn a plan made on a converted `CheckpointView` back into checkpoint terms: a renamed
    tensor reads its checkpoint key in place, a fused one keeps its `Conversion`, and keys
    reported unexpected or ignored are the checkpoint's own.

    Example:
        >>> from bigviz.checkpoint.convert import CheckpointView, Conversion
        >>> c = Conversion(("old.w",), ("new.w",), "rename")
        >>> plan = LoadPlan((TensorLoad("new.w", ("new.w",), "new.w", "cpu", torch.float32, 4),),
        ...                 (), (), (), (), ())
        >>> resolve_view(plan, CheckpointView({}, (c,), {"new.w": c})).loads[0].key
        'old.w'
    """
    if not view.source_of:
        return plan
    loads = []
    for load in plan.loads:
        conversion = view.source_of.get(load.key)
        key = conversion.sources[0] if conversion is not None and conversion.is_rename else load.key
        loads.append(replace(load, key=key, conversion=conversion))
    used = {id(c): c for load in loads if (c := load.conversion) is not None}
    unexpected = tuple(k for name in plan.unexpected for k in view.checkpoint_keys(name))
    ignored = tuple((k, why) for name, why in plan.ignored for k in view.checkpoint_keys(name))
    return replace(plan, loads=tuple(loads), unexpected=unexpected, ignored=ignored, conversions=tuple(used.values()))


def check_plan(
    plan: LoadPlan, *, strict: bool, where: str, more: Sequence[str] = (), map_checked: bool = False
) -> None:
    """Raise one `CheckpointError` for every problem that forbids loading ``plan`` (and the
    ``more`` found by the caller's own checks, e.g. of its device map, which then reported the
    plan's missing devices and uncovered tensors already: ``map_checked``)."""
    problems, fix = plan_problems(plan, strict=strict, map_checked=map_checked)
    raise_problems([*more, *problems], f"cannot load {where}; nothing was loaded", fix=fix)


def plan_problems(plan: LoadPlan, *, strict: bool, map_checked: bool = False) -> tuple[list[str], str]:
    """Every problem that forbids loading ``plan``, and the fix line for them.

    Example:
        >>> p = LoadPlan((), ("w",), ("x",), (), (), ())
        >>> plan_problems(p, strict=True)[0]
        ['missing in the checkpoint: w', 'unexpected in the checkpoint (the model has no such tensor): x']
    """
    devices = [p for p in plan.device_problems if not (map_checked and p.startswith((MISSING_DEVICE, NO_DEVICE)))]
    problems = [f"shape mismatch: {m}" for m in plan.mismatched] + devices
    quantized = quantization_role_keys(plan.unexpected)  # never dropped, even with strict=False
    if quantized:
        problems.append(_quantized_keys_problem(quantized))
    if strict:
        problems += [f"missing in the checkpoint: {k}" for k in plan.missing]
        problems += [
            f"unexpected in the checkpoint (the model has no such tensor): {k}"
            for k in plan.unexpected
            if k not in set(quantized)
        ]
    fixes = []
    if plan.mismatched or (strict and plan.missing and plan.unexpected):
        fixes.append("is this the right checkpoint for this model (same config and size)?")
    if strict and (plan.missing or plan.unexpected):
        fixes.append("pass strict=False to load what matches and report the rest")
    return problems, ("Fix: " + "; ".join(fixes) if fixes else "")


def _quantized_keys_problem(keys: Sequence[str]) -> str:
    shown = ", ".join(keys[:4]) + (f", ... ({len(keys)} in all)" if len(keys) > 4 else "")
    return (
        f"the checkpoint holds quantized data the model has no tensor for ({shown}): scales, packed values "
        "or zero points without which the weights they belong to are garbage, so they are never dropped "
        "(not even with strict=False). The checkpoint is stored quantized: keep the quantization_config "
        "transformers wrote in its config.json (bigviz then loads it as stored, or names what it lacks), "
        "or load it with transformers' from_pretrained"
    )


MISSING_DEVICE = "device map names "  # see bigviz.core.devices.missing_device_problems
NO_DEVICE = "device_map gives no device for "


def _any_match(name: str, patterns: Iterable[str]) -> bool:
    return any(re.search(p, name) for p in patterns)


def _target_dtype(t: ModelTensor, info: TensorInfo, options: LoadOptions) -> torch.dtype:
    if not is_floating(info.dtype):
        return t.dtype
    if module_matches(t.name, options.keep_in_fp32_modules) or _any_match(t.name, options.fp32_patterns):
        return torch.float32
    return options.dtype or t.dtype


def _resolve_prefix(
    names: Sequence[str], keys: Collection[str]
) -> tuple[str | None, str | None, Callable[[str], str | None]]:
    """The (prefix, "added"/"stripped", model name -> key) that matches the most names;
    no prefix unless one matches strictly more names than the names as they are."""
    keyset = set(keys)

    def exact(n: str) -> str | None:
        return n if n in keyset else None

    best: tuple[int, str | None, str | None, Callable[[str], str | None]] = (
        sum(n in keyset for n in names),
        None,
        None,
        exact,
    )
    if best[0] == len(names):
        return best[1:]
    for p in _common_heads(keyset):

        def strip(n: str, p: str = p) -> str | None:
            return exact(n) or (f"{p}.{n}" if f"{p}.{n}" in keyset else None)

        best = max(best, (sum(strip(n) is not None for n in names), p + ".", "stripped", strip), key=lambda b: b[0])
    for p in _common_heads(names):

        def add(n: str, p: str = p) -> str | None:
            tail = n[len(p) + 1 :] if is_prefix(p, n) else None
            return exact(n) or (tail if tail in keyset else None)

        best = max(best, (sum(add(n) is not None for n in names), p + ".", "added", add), key=lambda b: b[0])
    return best[1:]


def _common_heads(names: Collection[str]) -> list[str]:
    """First name components shared by at least half of ``names`` (prefix candidates)."""
    heads = Counter(n.split(".", 1)[0] for n in names if "." in n)
    return [h for h, count in heads.items() if 2 * count >= len(names)]


def load_device(name: str, device_map: Mapping[str, object] | None) -> str | None:
    """torch's name of the device tensor ``name`` loads to (``"cpu"`` with no map; None when
    no key covers it).

    Example:
        >>> load_device("h.10.w", {"h.1": 0, "": "cpu"}), load_device("h.1.w", {"h.1": 0})
        ('cpu', 'cuda:0')
    """
    if device_map is None:
        return "cpu"
    device = device_of(name, device_map)  # type: ignore[arg-type]
    return None if device is None else torch_name(device)


def device_problems(
    device_map: Mapping[str, object] | None, *, can_map_disk: bool, offload_folder: object
) -> list[str]:
    """Every entry of ``device_map`` naming a device this machine lacks or cannot use here.

    Example:
        >>> device_problems({"": "gpu"}, can_map_disk=True, offload_folder=None)[0][:38]
        "device_map[''] = 'gpu' is not a device"
    """
    problems: list[str] = []
    disk_keys = []
    for key, value in (device_map or {}).items():
        try:
            device = normalize_device(value)
        except ValueError:
            problems.append(
                f"device_map[{key!r}] = {value!r} is not a device: use an int (GPU), 'cpu', 'disk' or 'mps'"
            )
            continue
        if device == "disk":
            disk_keys.append(key)
    problems += absent_device_problems(device_map or {})
    if disk_keys and not can_map_disk and offload_folder is None:
        problems.append(
            f"device_map sends {disk_keys[:5]} to disk, but this checkpoint is not "
            "safetensors (it cannot be read in place): pass offload_folder= to write "
            "those weights there once, as safetensors"
        )
    return problems


def _place(loads: list[TensorLoad], options: LoadOptions) -> tuple[list[TensorLoad], list[str]]:
    if options.device_map is None:
        return loads, []
    problems = device_problems(
        options.device_map, can_map_disk=options.can_map_disk, offload_folder=options.offload_folder
    )
    placed = []
    for load in loads:
        devices = [load_device(a, options.device_map) for a in load.aliases]
        if None in devices:
            problems.append(f"{NO_DEVICE}{load.name}: add a key for it or ''")
        else:
            placed.append(replace(load, device=torch_name(tie_home(devices))))
    return placed, problems
