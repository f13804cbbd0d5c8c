"""Each stored quantized format: which checkpoint keys make one weight, and how it is built.

:mod:`bigviz.checkpoint.quantized` reads a checkpoint's ``quantization_config`` and decides
whether bigviz runs it; this module knows the formats' layouts, one rule per format:
:func:`format_layout` maps each weight the model has to the keys that store it (its roles:
``qdata`` and ``scale``, ``weight`` and ``SCB``, ``blocks`` and ``scales``, ...), its logical
shape and dtype, and a :class:`~bigviz.checkpoint.stored_parts.PackedRule` whose ``build``
makes the weight from those parts with the format's own library (torchao's tensor subclass,
transformers' FP8 and MXFP4 dequantization, the compressed-tensors compressor transformers
picks; bitsandbytes' ``Int8Params`` and ``Params4bit`` in :mod:`bigviz.checkpoint.stored_bnb`),
so the weights equal what ``from_pretrained`` makes; and it names every part that is missing
or of the wrong size (:mod:`bigviz.checkpoint.stored_parts`' sentences).

Example:
    >>> sorted(TORCHAO_CPU_TYPES)
    ['Int8Tensor', 'IntxUnpackedToInt8Tensor']
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import Tensor

from bigviz.checkpoint.convert import CheckpointView
from bigviz.checkpoint.index import CheckpointIndex, TensorInfo
from bigviz.checkpoint.stored_bnb import bnb4_groups, bnb8_groups, bnb_bits
from bigviz.checkpoint.stored_parts import (
    Builder,
    Group,
    Layout,
    PackedRule,
    ceil_div,
    missing_part,
    numel,
    part_problem,
)
from bigviz.checkpoint.safetensors_io import read_header
from bigviz.osio.pages import release_free_heap

__all__ = [
    "TORCHAO_CPU_TYPES",
    "format_groups",
    "format_layout",
    "torchao_types",
    "ct_problems",
]


TORCHAO_CPU_TYPES = frozenset({"Int8Tensor", "IntxUnpackedToInt8Tensor"})
"""torchao tensor subclasses whose linear layers run on a CPU (their kernels dequantize per
matmul); torchao's int4 subclasses need CUDA or the ``mslk`` kernels."""


def format_groups(method: str, qc: Mapping[str, Any], view: CheckpointView, index: CheckpointIndex) -> dict[str, Group]:
    """Weight name -> (role -> checkpoint key, rule, logical shape, logical dtype)."""
    return format_layout(method, qc, view, index)[0]


def format_layout(method: str, qc: Mapping[str, Any], view: CheckpointView, index: CheckpointIndex) -> Layout:
    """The groups of :func:`format_groups` and the problems of their parts, from the headers
    (and a 4-bit weight's quant state, a few bytes of JSON): every part the format needs is
    there, and each part's shape and dtype agree with the weight's logical shape. A part of the
    wrong size is not caught by the libraries when the weight is built (a short 4-bit ``absmax``
    is read past its end under autograd), so it is named here, before anything is read.

    Example:
        >>> format_layout("fp8", {}, CheckpointView({}), CheckpointIndex.__new__(CheckpointIndex))
        ({}, [])
    """
    plain = {k: info for k, info in view.entries.items() if k not in view.source_of}
    if method == "torchao":
        return _torchao_groups(plain, index)
    if method == "fp8":
        return _fp8_groups(plain, qc)
    if method == "mxfp4":
        return _mxfp4_groups(plain), []
    if method == "compressed-tensors":
        return _ct_groups(plain, index, qc), []
    if method == "bitsandbytes":
        return bnb8_groups(plain) if bnb_bits(qc) == 8 else bnb4_groups(plain, index, qc)
    return {}, []


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


def torchao_types(index: CheckpointIndex) -> set[str]:
    return {str(d.get("_type")) for d in _torchao_metadata(index).values() if d.get("_type") != "Tensor"}


def _torchao_groups(plain: Mapping[str, TensorInfo], index: CheckpointIndex) -> Layout:
    out: dict[str, Group] = {}
    problems: list[str] = []
    for name, described in _torchao_metadata(index).items():
        kind = str(described.get("_type"))
        if kind not in TORCHAO_CPU_TYPES:
            continue
        module, _, param = name.rpartition(".")
        roles = [str(r) for r in described.get("_tensor_data_names", [])]
        keys = {role: f"{module}._{param}_{role}" for role in roles}
        if "qdata" not in keys or keys["qdata"] not in plain:
            continue  # no weight to build: its other parts stay unexpected, named by the load
        qdata = plain[keys["qdata"]]
        missing = [k for k in keys.values() if k not in plain]
        problems += [missing_part(qdata, f"torchao {kind}", k, "its part named in the metadata") for k in missing]
        problems += _torchao_problems(qdata, {r: plain[k] for r, k in keys.items() if k in plain}, described)
        keys = {role: key for role, key in keys.items() if key in plain}
        dtype = str(described.get("_data", {}).get("dtype", {}).get("_data", "float32"))
        rule = PackedRule(tuple(keys), _torchao_builder(described), f"torchao {kind}")
        out[name] = (keys, rule, qdata.shape, dtype)
    return out, problems


def _torchao_problems(qdata: TensorInfo, parts: Mapping[str, TensorInfo], described: Mapping[str, Any]) -> list[str]:
    """int8 values, and one scale (and zero point) per block of the metadata's ``block_size``
    (``[1, in]``: one per output row)."""
    out = [] if qdata.dtype == "int8" else [part_problem(qdata, "int8 values (torchao stores them as int8)")]
    block = described.get("_data", {}).get("block_size")
    if not isinstance(block, list) or len(block) != len(qdata.shape) or not all(int(b) > 0 for b in block):
        return out
    grid = [ceil_div(d, int(b)) for d, b in zip(qdata.shape, block)]
    for role in ("scale", "zero_point"):
        info = parts.get(role)
        if info is None:
            continue
        if info.numel != numel(grid):
            out.append(
                part_problem(
                    info,
                    f"{numel(grid)} values (a {grid} grid: one per {list(block)} block of the {list(qdata.shape)} weight)",
                )
            )
        elif role == "scale" and not info.dtype.startswith(("float", "bfloat")):
            out.append(part_problem(info, "floating-point scales"))
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


def _fp8_groups(plain: Mapping[str, TensorInfo], qc: Mapping[str, Any]) -> Layout:
    out: dict[str, Group] = {}
    problems: list[str] = []
    block = qc.get("weight_block_size")
    for module, weight, key in _weights_with(plain, ".weight_scale_inv"):
        keys = {"weight": weight, "weight_scale_inv": key}
        for extra in ("activation_scale", "input_scale"):  # static activation scales: unused on a CPU
            if f"{module}.{extra}" in plain:
                keys[extra] = f"{module}.{extra}"
        problems += _fp8_problems(plain[weight], plain[key], block)
        rule = PackedRule(tuple(keys), _fp8_dequantize, "fp8 block-scaled, dequantized", stores_packed=False)
        out[weight] = (keys, rule, plain[weight].shape, str(qc.get("dequantized_dtype", "bfloat16")))
    return out, problems


def _fp8_problems(weight: TensorInfo, scale: TensorInfo, block: object) -> list[str]:
    """float8 values, and a scale grid of ``ceil(rows / block) x ceil(cols / block)`` (or one
    scale for the whole weight) that divides the weight, as transformers' ``Fp8Dequantize``
    needs (it derives the block from the grid)."""
    out = []
    if not weight.dtype.startswith("float8") or len(weight.shape) < 2:
        out.append(part_problem(weight, "a float8 weight of at least 2 dimensions (float8_e4m3fn or float8_e5m2)"))
        return out
    if not scale.dtype.startswith(("float", "bfloat", "uint8")):
        out.append(part_problem(scale, "floating-point (or uint8 exponent) block scales"))
    if scale.numel == 1:
        return out
    *lead, rows, cols = weight.shape
    sizes = [int(b) for b in block] if isinstance(block, (list, tuple)) and len(block) == 2 else None
    grid = (ceil_div(rows, sizes[0]), ceil_div(cols, sizes[1])) if sizes and min(sizes) > 0 else tuple(scale.shape[-2:])
    expected = f"{[*lead, *grid]} scales (one per {sizes} block of the {list(weight.shape)} weight, or one in all)"
    if tuple(scale.shape) != (*lead, *grid):
        out.append(part_problem(scale, expected))
    elif len(grid) != 2 or rows % grid[0] or cols % grid[1]:
        out.append(
            part_problem(
                scale,
                f"a scale grid that divides the {list(weight.shape)} weight (transformers' "
                "Fp8Dequantize, which bigviz uses, reads each block as rows / grid rows)",
            )
        )
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


def ct_problems(qc: Mapping[str, Any]) -> list[str]:
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
