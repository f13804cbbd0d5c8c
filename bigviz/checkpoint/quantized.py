"""Checkpoints stored quantized, and weights quantized while loading: both planned as
conversions of checkpoint keys into model weights, before any data is read.

**A checkpoint stored quantized** says so in its ``config.json`` (``quantization_config``,
written by transformers). Its weights are not one key each: torchao stores
``q_proj._weight_qdata``, ``_weight_scale`` and ``_weight_zero_point`` (and the tensor
subclass in the header's metadata); bitsandbytes 8-bit the int8 ``weight`` with its row scales
``SCB``; 4-bit the packed ``weight`` with ``weight.absmax``, ``weight.quant_map`` and its quant
state; FP8 (DeepSeek-V3's layout) the ``float8_e4m3fn`` ``weight`` with ``weight_scale_inv``
per block. :func:`packed_view` groups each weight's keys into one conversion, so the load
plan matches the model's ``weight`` and sizes it in its stored bytes:

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
import json
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bigviz.checkpoint.convert import CheckpointView, Conversion
from bigviz.checkpoint.index import CheckpointIndex, TensorInfo
from bigviz.checkpoint.load_plan import LoadPlan
from bigviz.checkpoint.packed_weights import PackedWeights, Recipe
from bigviz.checkpoint.safetensors_io import read_header
from bigviz.core.quant import QuantConfig, packed_nbytes, prequantized_format
from bigviz.core.serialize import parse_json
from bigviz.osio.pages import release_free_heap

__all__ = [
    "quantization_config",
    "support_problems",
    "check_supported",
    "packed_view",
    "PackedRule",
    "quantize_loads",
    "packed_store",
    "is_packed_load",
    "TORCHAO_CPU_TYPES",
    "prepare_for_checkpoint",
    "packed_on_disk",
]

TORCHAO_CPU_TYPES = frozenset({"Int8Tensor", "IntxUnpackedToInt8Tensor"})
"""torchao tensor subclasses whose linear layers run on a CPU (their kernels dequantize per
matmul); torchao's int4 subclasses need CUDA or the ``mslk`` kernels."""


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
    if method == "bitsandbytes" and _bnb_bits(qc) not in (4, 8):
        return [f"{head}: neither load_in_8bit nor load_in_4bit is set; re-save it with transformers"]
    if method == "compressed-tensors":
        return [f"{head}: {problem}" for problem in _ct_problems(qc)]
    if method == "torchao" and index is not None:
        types = sorted({t for t in _torchao_types(index) if t not in TORCHAO_CPU_TYPES})
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


def _bnb_bits(qc: Mapping[str, Any]) -> int:
    if qc.get("load_in_4bit") or qc.get("_load_in_4bit"):
        return 4
    return 8 if qc.get("load_in_8bit") or qc.get("_load_in_8bit") else 0


# ---- the conversions of a stored-quantized checkpoint ----------------------------------
Builder = Callable[[Mapping[str, Tensor], "torch.dtype | None"], Tensor]


@dataclass(frozen=True)
class PackedRule:
    """The operation of a conversion whose sources are one weight's parts (a stored format)
    or one float weight (quantized while loading); what
    :class:`~bigviz.checkpoint.convert.ConvertedWeights` runs instead of transformers' ops.

    Attributes:
        roles: the part each source key is, in the conversion's order.
        build: parts (by role) and the dtype the model computes in -> the weight.
        kind: the format, for people.
        in_place: on ``"disk"``, read from the checkpoint's files at each fetch (a stored
            format), else written once, packed, to the offload folder (quantized while loading).
        stores_packed: the weight lives packed in memory (False: dequantized, FP8).
    """

    roles: tuple[str, ...]
    build: Builder
    kind: str
    in_place: bool = True
    stores_packed: bool = True

    @property
    def source_patterns(self) -> tuple[str, ...]:
        return self.roles

    @property
    def operations(self) -> tuple[str, ...]:
        return (self.kind,)

    def run_packed(
        self, conversion: Conversion, read: Callable[[str], Tensor], dtypes: Mapping[str, torch.dtype], model: Any
    ) -> dict[str, Tensor]:
        """The conversion's one target from its sources read by ``read`` (no cast on the way:
        scales stay float32, packed bytes stay bytes)."""
        target = conversion.targets[0]
        parts = {role: read(key) for role, key in zip(self.roles, conversion.sources)}
        return {target: self.build(parts, dtypes.get(target))}


def is_packed_load(load: Any) -> bool:
    """True when a `TensorLoad` builds a packed (or dequantized) weight from stored parts."""
    conversion = getattr(load, "conversion", None)
    return conversion is not None and isinstance(conversion.rule, PackedRule)


def packed_view(view: CheckpointView, index: CheckpointIndex) -> CheckpointView:
    """``view`` with each stored-quantized weight's keys grouped into one conversion to the
    weight (a checkpoint without a ``quantization_config`` is returned as it is).

    Example:
        >>> packed_view(CheckpointView({}), CheckpointIndex.__new__(CheckpointIndex)).entries
        {}
    """
    qc = quantization_config(index) if getattr(index, "files", None) else None
    if qc is None or support_problems(qc, "", index):
        return view
    groups = _groups(_method(qc), qc, view, index)
    problems = _unscaled(qc, view, groups)
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


Group = tuple[dict[str, str], PackedRule, tuple[int, ...], str]
_NOT_HELD = frozenset({"weight_format", "activation_scale", "input_scale"})
"""Parts read but not kept (bitsandbytes' layout flag, static activation scales a CPU does not
use); a 4-bit quant state's JSON (``quant_state.bitsandbytes__nf4``) becomes attributes too."""


def _groups(method: str, qc: Mapping[str, Any], view: CheckpointView, index: CheckpointIndex) -> dict[str, Group]:
    """Weight name -> (role -> checkpoint key, rule, logical shape, logical dtype)."""
    plain = {k: info for k, info in view.entries.items() if k not in view.source_of}
    if method == "torchao":
        return _torchao_groups(plain, index)
    if method == "fp8":
        return _fp8_groups(plain, qc)
    if method == "mxfp4":
        return _mxfp4_groups(plain)
    if method == "compressed-tensors":
        return _ct_groups(plain, index, qc)
    if method == "bitsandbytes":
        return _bnb8_groups(plain) if _bnb_bits(qc) == 8 else _bnb4_groups(plain, index, qc)
    return {}


def _torchao_metadata(index: CheckpointIndex) -> dict[str, dict[str, Any]]:
    """Tensor name -> torchao's description of it (``_type``, ``_data``, ``_tensor_data_names``),
    from the safetensors headers' metadata (each shard carries it)."""
    found: dict[str, dict[str, Any]] = {}
    for file in index.files:
        if not file.name.endswith(".safetensors"):
            continue
        metadata = read_header(file).metadata
        for name in json.loads(metadata.get("tensor_names", "[]")):
            if name not in found and name in metadata:
                found[name] = json.loads(metadata[name])
    return found


def _torchao_types(index: CheckpointIndex) -> set[str]:
    return {str(d.get("_type")) for d in _torchao_metadata(index).values() if d.get("_type") != "Tensor"}


def _torchao_groups(plain: Mapping[str, TensorInfo], index: CheckpointIndex) -> dict[str, Group]:
    out: dict[str, Group] = {}
    for name, described in _torchao_metadata(index).items():
        kind = str(described.get("_type"))
        if kind not in TORCHAO_CPU_TYPES:
            continue
        module, _, param = name.rpartition(".")
        roles = [str(r) for r in described.get("_tensor_data_names", [])]
        keys = {role: f"{module}._{param}_{role}" for role in roles}
        if not roles or not all(k in plain for k in keys.values()):
            continue
        dtype = str(described.get("_data", {}).get("dtype", {}).get("_data", "float32"))
        rule = PackedRule(tuple(keys), _torchao_builder(described), f"torchao {kind}")
        out[name] = (keys, rule, plain[keys["qdata"]].shape if "qdata" in keys else (), dtype)
    return out


def _torchao_builder(described: Mapping[str, Any]) -> Builder:
    def build(parts: Mapping[str, Tensor], dtype: torch.dtype | None) -> Tensor:
        from bigviz.modeling.quant import quiet_torchao

        quiet_torchao()
        from torchao.prototype.safetensors.safetensors_utils import object_from_dict

        data = {**described["_data"], **parts}
        return object_from_dict({"_type": described["_type"], "_data": data})  # type: ignore[no-any-return]

    return build


def _weights_with(plain: Mapping[str, TensorInfo], suffix: str) -> list[tuple[str, str, str]]:
    """(module, its ``weight`` key, the key ending in ``suffix``) for each module that stores both."""
    modules = [(k.removesuffix(suffix), k) for k in plain if k.endswith(suffix)]
    return [(m, f"{m}.weight", k) for m, k in modules if f"{m}.weight" in plain]


def _fp8_groups(plain: Mapping[str, TensorInfo], qc: Mapping[str, Any]) -> dict[str, Group]:
    out: dict[str, Group] = {}
    for module, weight, key in _weights_with(plain, ".weight_scale_inv"):
        keys = {"weight": weight, "weight_scale_inv": key}
        for extra in ("activation_scale", "input_scale"):  # static activation scales: unused on a CPU
            if f"{module}.{extra}" in plain:
                keys[extra] = f"{module}.{extra}"
        rule = PackedRule(tuple(keys), _fp8_dequantize, "fp8 block-scaled, dequantized", stores_packed=False)
        out[weight] = (keys, rule, plain[weight].shape, str(qc.get("dequantized_dtype", "bfloat16")))
    return out


def _fp8_dequantize(parts: Mapping[str, Tensor], dtype: torch.dtype | None) -> Tensor:
    """transformers' own FP8 block dequantization (``Fp8Dequantize``), so the weights equal
    what ``from_pretrained`` makes on a machine without an FP8 GPU."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    weight = Fp8Dequantize(None)._dequantize_one(parts["weight"], parts["weight_scale_inv"], output_dtype=dtype)
    release_free_heap()  # its float32 temporaries, as for quantizing
    return weight  # type: ignore[no-any-return]


_MXFP4_BLOCKS = "_blocks"


def _mxfp4_groups(plain: Mapping[str, TensorInfo]) -> dict[str, Group]:
    """gpt-oss's experts: ``<proj>_blocks`` ``[experts, out, groups, 16]`` (uint8, two FP4
    values a byte) and ``<proj>_scales`` ``[experts, out, groups]`` (uint8 exponents) are the
    model's ``<proj>`` ``[experts, in, out]`` (``in = groups * 32``), dequantized to bfloat16 as
    transformers does on a CPU."""
    out: dict[str, Group] = {}
    for key, info in plain.items():
        if not key.endswith(_MXFP4_BLOCKS) or len(info.shape) != 4:
            continue
        weight = key.removesuffix(_MXFP4_BLOCKS)
        scales = f"{weight}_scales"
        if scales not in plain or tuple(plain[scales].shape) != tuple(info.shape[:-1]):
            continue
        experts, rows, groups, per = info.shape
        keys = {"blocks": key, "scales": scales}
        rule = PackedRule(tuple(keys), _mxfp4_dequantize, "mxfp4, dequantized", stores_packed=False)
        out[weight] = (keys, rule, (experts, groups * per * 2, rows), "bfloat16")
    return out


def _mxfp4_dequantize(parts: Mapping[str, Tensor], dtype: torch.dtype | None) -> Tensor:
    """transformers' own MXFP4 dequantization (``Mxfp4Dequantize``'s), so the experts equal
    what ``from_pretrained`` makes on a CPU."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weight = convert_moe_packed_tensors(parts["blocks"], parts["scales"], dtype=dtype or torch.bfloat16)
    release_free_heap()
    return weight  # type: ignore[no-any-return]


def _ct_problems(qc: Mapping[str, Any]) -> list[str]:
    """What a compressed-tensors config asks that bigviz does not run: activations quantized at
    run time (transformers runs them with the package's forward hooks), sparsity, transforms."""
    out = []
    groups = qc.get("config_groups") or {}
    acts = sorted(
        name
        for name, group in (groups.items() if isinstance(groups, dict) else ())
        if isinstance(group, dict) and (group.get("input_activations") or group.get("output_activations"))
    )
    if acts:
        out.append(
            f"config_groups {', '.join(acts)} quantize activations; bigviz runs weight-only compressed-tensors "
            "schemes (W4A16, W8A16, ...): load it with transformers' from_pretrained"
        )
    for extra in ("sparsity_config", "transform_config"):
        if qc.get(extra):
            out.append(f"its {extra} is not supported by bigviz; load it with transformers' from_pretrained")
    return out


_CT_PARTS = ("weight_packed", "weight", "weight_scale", "weight_zero_point", "weight_global_scale", "weight_shape")


def _ct_groups(plain: Mapping[str, TensorInfo], index: CheckpointIndex, qc: Mapping[str, Any]) -> dict[str, Group]:
    """Each module with a ``weight_scale``: its stored parts (local names, as the compressor
    takes them) into the module's ``weight``, in its logical shape (``weight_shape`` when packed)
    and the scale's dtype (the dtype the model computes in)."""
    out: dict[str, Group] = {}
    modules = [k.removesuffix(".weight_scale") for k in plain if k.endswith(".weight_scale")]
    packed = [f"{m}.weight_shape" for m in modules if f"{m}.weight_packed" in plain and f"{m}.weight_shape" in plain]
    shapes = _tensor_shapes(index, packed)
    build = functools.partial(_ct_decompress, json.dumps(dict(qc), sort_keys=True, default=str))
    for module in modules:
        keys = {part: f"{module}.{part}" for part in _CT_PARTS if f"{module}.{part}" in plain}
        if "weight" in keys:
            shape = plain[keys["weight"]].shape
        elif f"{module}.weight_shape" in shapes:
            shape = shapes[f"{module}.weight_shape"]
        else:
            continue  # no weight to build: reported by the load (its keys stay unexpected)
        rule = PackedRule(tuple(keys), build, "compressed-tensors, decompressed", stores_packed=False)
        out[f"{module}.weight"] = (keys, rule, shape, plain[keys["weight_scale"]].dtype)
    return out


def _tensor_shapes(index: CheckpointIndex, keys: Collection[str]) -> dict[str, tuple[int, ...]]:
    """The shapes stored as small integer tensors (compressed-tensors' ``weight_shape``)."""
    if not keys:
        return {}
    from bigviz.checkpoint.lazy import LazyWeights

    with LazyWeights(index, {k: k for k in keys}) as weights:
        return {key: tuple(int(d) for d in weights[key].tolist()) for key in keys}


@functools.lru_cache(maxsize=8)
def _ct_compressor(qc_json: str) -> tuple[Any, Any]:
    """The scheme and compressor transformers' ``CompressedTensorsDequantize`` uses for the
    dense layers of a checkpoint with this config."""
    from compressed_tensors.compressors import BaseCompressor, ModelCompressor
    from transformers.integrations.compressed_tensors import get_dense_scheme
    from transformers.utils.quantization_config import CompressedTensorsConfig

    config = ModelCompressor.from_compression_config(CompressedTensorsConfig.from_dict(json.loads(qc_json)))
    quant = config.quantization_config
    scheme = get_dense_scheme(quant)
    return scheme, BaseCompressor.get_value_from_registry(scheme.format or quant.format)


def _ct_decompress(qc_json: str, parts: Mapping[str, Tensor], dtype: torch.dtype | None) -> Tensor:
    scheme, compressor = _ct_compressor(qc_json)
    state = compressor.decompress(dict(parts), scheme) if "weight_scale" in parts else dict(parts)
    weight = state["weight"]
    release_free_heap()
    return weight.to(dtype) if dtype is not None else weight  # type: ignore[no-any-return]


def _bnb8_groups(plain: Mapping[str, TensorInfo]) -> dict[str, Group]:
    out: dict[str, Group] = {}
    for module, weight, key in _weights_with(plain, ".SCB"):
        keys = {"weight": weight, "SCB": key}
        if f"{module}.weight_format" in plain:
            keys["weight_format"] = f"{module}.weight_format"  # always row-major now: read, not used
        rule = PackedRule(tuple(keys), _bnb8_build, "bitsandbytes Int8Params")
        out[weight] = (keys, rule, plain[weight].shape, "int8")
    return out


def _bnb8_build(parts: Mapping[str, Tensor], dtype: torch.dtype | None) -> Tensor:
    """bitsandbytes' ``Int8Params`` with its row scales, as transformers' ``Bnb8bitDeserialize``
    makes it."""
    import bitsandbytes as bnb

    weight = parts["weight"]
    return bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False, CB=weight, SCB=parts["SCB"])  # type: ignore[no-any-return]


def _bnb4_groups(plain: Mapping[str, TensorInfo], index: CheckpointIndex, qc: Mapping[str, Any]) -> dict[str, Group]:
    out: dict[str, Group] = {}
    states = [k for k in plain if ".quant_state.bitsandbytes__" in k]
    shapes = _bnb4_shapes(index, states)
    storage = str(qc.get("bnb_4bit_quant_storage", "uint8")).removeprefix("torch.")
    for state in states:
        weight = state.split(".quant_state.", 1)[0]
        if weight not in plain:
            continue
        keys = {"weight": weight}
        keys |= {k[len(weight) + 1 :]: k for k in plain if k.startswith(weight + ".")}
        rule = PackedRule(tuple(keys), _bnb4_build, "bitsandbytes Params4bit")
        out[weight] = (keys, rule, shapes.get(state, plain[weight].shape), storage)
    return out


def _bnb4_shapes(index: CheckpointIndex, states: Collection[str]) -> dict[str, tuple[int, ...]]:
    """The logical shape of each 4-bit weight, from its quant state (a few bytes of JSON each:
    the packed weight's shape says only its byte count)."""
    if not states:
        return {}
    from bigviz.checkpoint.lazy import LazyWeights

    out: dict[str, tuple[int, ...]] = {}
    with LazyWeights(index, {k: k for k in states}) as weights:
        for key in states:
            try:
                doc = json.loads(bytes(weights[key].tolist()).decode())
                out[key] = tuple(int(d) for d in doc["shape"])
            except (ValueError, KeyError, TypeError):
                continue  # reported by the load as a shape mismatch
    return out


def _bnb4_build(parts: Mapping[str, Tensor], dtype: torch.dtype | None) -> Tensor:
    """bitsandbytes' ``Params4bit.from_prequantized``, as transformers' ``Bnb4bitDeserialize``
    makes it."""
    import bitsandbytes as bnb

    weight = parts["weight"]
    stats = {role: t for role, t in parts.items() if role != "weight"}
    return bnb.nn.Params4bit.from_prequantized(
        data=weight, quantized_stats=stats, requires_grad=False, device=weight.device
    )  # type: ignore[no-any-return]


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

    groups = _groups(_method(qc), qc, checkpoint_view(checkpoint.entries, None), checkpoint)
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
