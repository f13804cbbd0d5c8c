"""Checkpoints stored quantized, and weights quantized while loading: both planned as
conversions of checkpoint keys into model weights, before any data is read.

**A checkpoint stored quantized** says so in its ``config.json`` (``quantization_config``,
written by transformers). Its weights are not one key each: torchao stores
``q_proj._weight_qdata``, ``_weight_scale`` and ``_weight_zero_point`` (and the tensor
subclass in the header's metadata); bitsandbytes 8-bit the int8 ``weight`` with its row scales
``SCB``; 4-bit the packed ``weight`` with ``weight.absmax``, ``weight.quant_map`` and its quant
state; FP8 (DeepSeek-V3's layout) the ``float8_e4m3fn`` ``weight`` with ``weight_scale_inv``
per block. :func:`packed_view` groups each weight's keys into one conversion (each format's
layout and builder: :mod:`bigviz.checkpoint.stored_formats`), so the load plan matches the
model's ``weight`` and sizes it in its stored bytes:

* torchao and bitsandbytes weights are built packed (torchao's tensor subclass,
  bitsandbytes' ``Int8Params``/``Params4bit``) from views of the mapped files and run packed;
  on ``"disk"`` they stay in the checkpoint's own files and are built at each fetch;
* FP8 weights are dequantized to the compute dtype (transformers' own ``Fp8Dequantize``, as
  ``from_pretrained`` does on a machine without an FP8 GPU): once when they live in RAM, at
  each fetch when they stream from disk (the disk then reads the FP8 bytes);
* MXFP4 experts as gpt-oss ships them (``gate_up_proj_blocks`` and ``gate_up_proj_scales``:
  two 4-bit values a byte, one power-of-two scale per 32) are dequantized the same way, with
  transformers' own ``convert_moe_packed_tensors`` (what ``from_pretrained`` does on a CPU
  without its Triton kernels);
* compressed-tensors weights (``weight_packed`` or ``weight``, ``weight_scale``,
  ``weight_zero_point``, ``weight_shape``: int4 pack-quantized, int8 int-quantized, ...) are
  decompressed by the compressed-tensors package, scheme and compressor chosen as transformers
  chooses them (weight-only schemes: a scheme that quantizes activations is refused).

A ``quant_method`` bigviz cannot run here (GPTQ, AWQ, optimum-quanto, HQQ, or a missing
library) is refused before anything is read, naming it and
what to do (:func:`support_problems`).

**Quantized while loading** (``quantization="int8"`` / ``"int4"``): :func:`quantize_loads`
turns each targeted weight's load into a conversion that reads the float tensor, casts it to
the compute dtype and packs it (:func:`bigviz.modeling.quant.quantize_weight`), one tensor at
a time; a weight mapped to ``"disk"`` is written once, packed, to the offload folder.

Example:
    >>> support_problems({"quant_method": "gptq", "bits": 4}, "ckpt")[0][:73]
    "ckpt is stored quantized (config.json quantization_config: quant_method '"
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Collection, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bigviz.checkpoint.convert import CheckpointView, Conversion
from bigviz.checkpoint.index import CheckpointIndex, TensorInfo
from bigviz.checkpoint.load_plan import LoadPlan
from bigviz.checkpoint.packed_weights import PackedWeights, Recipe
from bigviz.checkpoint.stored_bnb import bnb_bits
from bigviz.checkpoint.stored_formats import (
    TORCHAO_CPU_TYPES,
    ct_problems,
    format_groups,
    format_layout,
    torchao_types,
)
from bigviz.checkpoint.stored_parts import Builder, PackedRule
from bigviz.core.quant import QuantConfig, packed_nbytes, prequantized_format
from bigviz.core.serialize import parse_json
from bigviz.osio.pages import release_free_heap

__all__ = [
    "quantization_config",
    "support_problems",
    "check_supported",
    "packed_view",
    "quantize_loads",
    "packed_store",
    "is_packed_load",
    "prepare_for_checkpoint",
    "packed_on_disk",
]


# ---- the checkpoint's quantization_config ---------------------------------------------
def _folder(checkpoint: CheckpointIndex | str | os.PathLike[str]) -> Path | None:
    if isinstance(checkpoint, CheckpointIndex):
        return checkpoint.files[0].parent if checkpoint.files else None
    path = Path(checkpoint)
    return path if path.is_dir() else path.parent


@functools.lru_cache(maxsize=32)
def _read(config: Path, stamp: tuple[int, int]) -> dict[str, Any] | None:
    try:
        doc = parse_json(config.read_bytes(), config, "config.json")
    except (OSError, ValueError):
        return None  # an unreadable config is reported where configs are read, not here
    found = doc.get("quantization_config") if isinstance(doc, dict) else None
    if found is None:
        return None
    return dict(found) if isinstance(found, dict) else {"quant_method": repr(found)}


def quantization_config(checkpoint: CheckpointIndex | str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``quantization_config`` of the ``config.json`` beside a checkpoint, or None.

    Example:
        >>> quantization_config("no/such/folder") is None
        True
    """
    folder = _folder(checkpoint)
    config = folder / "config.json" if folder is not None else None
    if config is None or not config.is_file():
        return None
    st = config.stat()
    return _read(config, (st.st_mtime_ns, st.st_size))


def _method(qc: Mapping[str, Any]) -> str:
    return str(qc.get("quant_method", "")).lower().replace("_", "-") or "unknown"


def support_problems(qc: Mapping[str, Any] | None, where: object, index: CheckpointIndex | None = None) -> list[str]:
    """Why bigviz cannot load a checkpoint stored with ``qc`` here (empty: it can), each
    problem naming the ``quant_method`` and what to do.

    Example:
        >>> support_problems({"quant_method": "fp8", "weight_block_size": [128, 128]}, "ckpt")
        []
    """
    if qc is None:
        return []
    method = _method(qc)
    head = f"{where} is stored quantized (config.json quantization_config: quant_method {method!r})"
    known = prequantized_format(method)
    if not known.runs:
        return [f"{head}: {known.how}"]
    if known.library and importlib.util.find_spec(known.library.replace("-", "_")) is None:
        return [
            f"{head}: loading it needs the {known.library} package, which is not installed: "
            f"pip install 'bigviz[quant]' (or pip install {known.library})"
        ]
    if method == "bitsandbytes" and bnb_bits(qc) not in (4, 8):
        return [f"{head}: neither load_in_8bit nor load_in_4bit is set; re-save it with transformers"]
    if method == "compressed-tensors":
        return [f"{head}: {problem}" for problem in ct_problems(qc)]
    if method == "torchao" and index is not None:
        types = sorted({t for t in torchao_types(index) if t not in TORCHAO_CPU_TYPES})
        if types:
            return [
                f"{head}: torchao's {', '.join(types)} has no CPU kernel here (bigviz runs "
                f"{', '.join(sorted(TORCHAO_CPU_TYPES))}); quantize a float checkpoint with quantization='int8' "
                "or 'int4' instead"
            ]
    return []


def check_supported(index: CheckpointIndex) -> None:
    """Raise one `CheckpointError` when ``index`` is stored in a quantization bigviz cannot
    run here (before anything is read)."""
    from bigviz.checkpoint.errors import raise_problems

    problems = support_problems(quantization_config(index), f"checkpoint {str(_folder(index))!r}", index)
    raise_problems(problems, f"cannot load {str(_folder(index))!r}; nothing was loaded")


# ---- the conversions of a stored-quantized checkpoint ----------------------------------
def is_packed_load(load: Any) -> bool:
    """True when a `TensorLoad` builds a packed (or dequantized) weight from stored parts."""
    conversion = getattr(load, "conversion", None)
    return conversion is not None and isinstance(conversion.rule, PackedRule)


def packed_view(view: CheckpointView, index: CheckpointIndex) -> CheckpointView:
    """``view`` with each stored-quantized weight's keys grouped into one conversion to the
    weight (a checkpoint without a ``quantization_config`` is returned as it is), and in its
    ``problems`` every part that is missing or of a shape or dtype its weight does not have
    (naming the key, its file, what was expected and found), and a config that claims a
    format no tensor is stored in: the load refuses them all together, before reading any.

    Example:
        >>> packed_view(CheckpointView({}), CheckpointIndex.__new__(CheckpointIndex)).entries
        {}
    """
    qc = quantization_config(index) if getattr(index, "files", None) else None
    if qc is None or support_problems(qc, "", index):
        return view
    groups, problems = format_layout(_method(qc), qc, view, index)
    problems += _unscaled(qc, view, groups) or _not_stored(qc, groups, index)
    if not groups and not problems:
        return view
    entries = dict(view.entries)
    source_of = dict(view.source_of)
    conversions = list(view.conversions)
    for name, (keys, rule, shape, dtype) in groups.items():
        infos = [view.entries[k] for k in keys.values()]
        for key in keys.values():
            entries.pop(key, None)
        nbytes = sum(
            i.nbytes for role, i in zip(keys, infos) if role not in _NOT_HELD and "quant_state." not in role
        )  # what memory holds
        entries[name] = TensorInfo(name, dtype, shape, nbytes, infos[0].file)
        conversion = Conversion(tuple(keys.values()), (name,), rule.kind, (shape,), dtype, rule.roles, rule)
        source_of[name] = conversion
        conversions.append(conversion)
    return CheckpointView(entries, tuple(conversions), source_of, (*view.problems, *problems))


def _unscaled(qc: Mapping[str, Any], view: CheckpointView, groups: Mapping[str, Any]) -> list[str]:
    """Weights a stored-quantized checkpoint holds in a quantized dtype without the scales that
    say how to read them: cast as they are, they would be garbage, so they are named."""
    method = _method(qc)
    if method not in ("fp8", "mxfp4"):
        return []
    grouped = {k for keys, *_ in groups.values() for k in keys.values()}
    if method == "fp8":
        bare = [k for k, info in view.entries.items() if info.dtype.startswith("float8") and k not in grouped]
        what = "stored in float8 without their weight_scale_inv"
    else:
        bare = [k for k in view.entries if k.endswith(("_blocks", "_scales")) and k not in grouped]
        what = "MXFP4 blocks or scales without their other half (or of a shape gpt-oss does not store)"
    if not bare:
        return []
    shown = ", ".join(bare[:4]) + (f", ... ({len(bare)} in all)" if len(bare) > 4 else "")
    return [
        f"{what}: {shown}; the checkpoint is incomplete (copy its missing shards again), they cannot be "
        "read without their scales"
    ]


_STORED_AS = {
    "torchao": "torchao tensor subclasses (_weight_qdata, _weight_scale and their metadata)",
    "bitsandbytes": "bitsandbytes parts (SCB, or weight.absmax and weight.quant_state.*)",
}


def _not_stored(qc: Mapping[str, Any], groups: Mapping[str, Any], index: CheckpointIndex) -> list[str]:
    """A ``quantization_config`` over a checkpoint that stores no weight in its format (float
    weights under a config copied from a quantized model): transformers refuses it for torchao and
    bitsandbytes, and so does bigviz rather than guess which of the two is wrong (FP8 and the
    dequantized formats load a float weight as it is, as transformers does)."""
    method = _method(qc)
    if groups or method not in _STORED_AS:
        return []
    bits = f", {bnb_bits(qc)}-bit" if method == "bitsandbytes" else ""
    return [
        f"config.json says the checkpoint is stored quantized (quant_method {method!r}{bits}), but none of its "
        f"tensors is: no {_STORED_AS[method]} in {', '.join(f.name for f in index.files)}. If its weights are "
        "meant to be plain floats, remove quantization_config from config.json (then quantization='int8' or "
        "'int4' quantizes them while loading); else the quantized files are missing: copy them again"
    ]


_NOT_HELD = frozenset({"weight_format", "activation_scale", "input_scale"})
"""Parts read but not kept (bitsandbytes' layout flag, static activation scales a CPU does not
use); a 4-bit quant state's JSON (``quant_state.bitsandbytes__nf4``) becomes attributes too."""


# ---- quantized while loading -------------------------------------------------------------
def _quantize_builder(config: QuantConfig, placeholder: Tensor | None) -> Builder:
    def build(parts: Mapping[str, Tensor], dtype: torch.dtype | None) -> Tensor:
        from bigviz.modeling.quant import quantize_weight

        weight = parts["weight"]
        weight = weight.to(dtype) if dtype is not None and weight.dtype != dtype else weight
        packed = quantize_weight(weight, config, placeholder=placeholder)
        release_free_heap()  # the float temporaries: not left as holes between the packed weights
        return packed

    return build


def quantize_loads(
    plan: LoadPlan,
    config: QuantConfig,
    targets: Collection[str],
    *,
    shapes: Mapping[str, tuple[int, ...]],
    placeholders: Mapping[str, Tensor] | None = None,
) -> LoadPlan:
    """``plan`` with each load of a ``targets`` weight turned into a conversion that casts
    the checkpoint's float tensor to the compute dtype and packs it with ``config``: its
    ``nbytes`` are the packed bytes its device receives.

    Example:
        >>> from bigviz.checkpoint.load_plan import TensorLoad
        >>> p = LoadPlan((TensorLoad("fc.weight", ("fc.weight",), "fc.weight", "cpu", torch.float32, 256),),
        ...              (), (), (), (), ())
        >>> q = quantize_loads(p, QuantConfig("int8"), ["fc.weight"], shapes={"fc.weight": (8, 8)})
        >>> q.loads[0].nbytes, q.loads[0].operation
        (104, 'int8 (torchao weight-only, one scale per output row in the compute dtype)')
    """
    wanted = set(targets)
    loads = []
    made = []
    for load in plan.loads:
        hit = next((a for a in load.aliases if a in wanted), None)
        if hit is None or (load.conversion is not None and not load.conversion.is_rename) or not load.key:
            loads.append(load)
            continue
        shape = tuple(shapes[hit])
        placeholder = (placeholders or {}).get(hit)
        rule = PackedRule(("weight",), _quantize_builder(config, placeholder), config.describe(), in_place=False)
        conversion = Conversion(
            (load.key,), (load.name,), rule.kind, (shape,), load.source_dtype or "float32", ("weight",), rule
        )
        made.append(conversion)
        loads.append(
            replace(
                load, conversion=conversion, nbytes=packed_nbytes(config, shape), file="", offsets=None, in_place=False
            )
        )
    return replace(plan, loads=tuple(loads), conversions=(*plan.conversions, *made))


# ---- disk: read in place, built at each fetch -------------------------------------------
def packed_store(index: CheckpointIndex, loads: Collection[Any]) -> PackedWeights:
    """A store of the packed loads' weights over the checkpoint's own files: each weight built
    at lookup from zero-copy views of its parts (FP8: dequantized to its load dtype)."""
    from bigviz.checkpoint.lazy import LazyWeights

    recipes: dict[str, Recipe] = {}
    keys = {key for load in loads for key in load.conversion.sources}
    for load in loads:
        rule: PackedRule = load.conversion.rule
        parts = dict(zip(rule.roles, load.conversion.sources))
        build = functools.partial(_with_dtype, rule.build, load.dtype)
        recipe = Recipe(parts, build, rule.kind, load.nbytes)
        recipes.update(dict.fromkeys(load.aliases, recipe))
    return PackedWeights(LazyWeights(index, {k: k for k in keys}), recipes)


def _with_dtype(build: Builder, dtype: torch.dtype, parts: Mapping[str, Tensor]) -> Tensor:
    return build(parts, dtype)


# ---- the model's layers for a stored format ---------------------------------------------
def prepare_for_checkpoint(
    model: torch.nn.Module,
    checkpoint: CheckpointIndex,
    quantization: QuantConfig | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> None:
    """Make ``model`` (on meta) ready for what the load will put in it: bitsandbytes' layers
    for a checkpoint stored in bitsandbytes' formats (exactly the layers whose weights it
    stores quantized) or for ``quantization="int4"``; for torchao's int8 (stored, or
    ``quantization="int8"``) the same layers made :class:`~bigviz.modeling.int8_linear.Int8Linear`
    (its weights are tensor subclasses; the layer runs them on torch's packed CPU kernel);
    nothing for other formats (FP8 and MXFP4 are dequantized).

    Raises:
        QuantizationUnavailable: a library the format needs is missing.
        CheckpointError: the checkpoint is stored in a format bigviz cannot run here.
    """
    from bigviz.modeling.int8_linear import use_int8_kernel
    from bigviz.modeling.quant import prepare_model, replace_linear

    check_supported(checkpoint)
    if quantization is not None:
        prepare_model(model, quantization, dtype=dtype)
        return
    qc = quantization_config(checkpoint)
    if qc is None or _method(qc) not in ("bitsandbytes", "torchao"):
        return
    from bigviz.checkpoint.convert import checkpoint_view

    groups = format_groups(_method(qc), qc, checkpoint_view(checkpoint.entries, None), checkpoint)
    layers = _model_names({g.rpartition(".")[0] for g in groups}, [n for n, _ in model.named_modules()])
    if _method(qc) == "torchao":  # its weights are tensor subclasses in the same layers: the CPU kernel
        use_int8_kernel(model, sorted(layers))
        return
    settings = {k: v for k, v in qc.items() if k != "quant_method"}
    if dtype is not None:
        settings["bnb_4bit_compute_dtype"] = dtype
    replace_linear(model, layers, settings, pre_quantized=True)


def _model_names(found: Collection[str], names: Collection[str]) -> set[str]:
    """The model's module names for checkpoint module names (a base-model prefix added or
    stripped: ``model.layers.0.mlp`` is ``layers.0.mlp`` in the base model)."""
    out = set()
    for name in names:
        if name in found or any(f.endswith("." + name) or name.endswith("." + f) for f in found):
            out.add(name)
    return out


def packed_on_disk(plan: LoadPlan) -> dict[str, tuple[int, str]]:
    """Model tensor name -> (bytes as stored, format) for each weight a load leaves on
    ``"disk"`` that stays packed when fetched (it sits on meta in the model in its logical
    dtype; the dispatch streams and holds its packed bytes)."""
    out: dict[str, tuple[int, str]] = {}
    for load in plan.loads:
        if load.device == "disk" and is_packed_load(load) and load.conversion.rule.stores_packed:  # type: ignore[union-attr]
            out.update(dict.fromkeys(load.aliases, (load.nbytes, load.conversion.rule.kind)))  # type: ignore[union-attr]
    return out
