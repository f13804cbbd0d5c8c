"""Each stored quantized format: which checkpoint keys make one weight, and how it is built.

:mod:`bigviz.checkpoint.quantized` reads a checkpoint's ``quantization_config`` and decides
whether bigviz runs it; this module knows the formats' layouts, one rule per format:
:func:`format_groups` maps each weight the model has to the keys that store it (its roles:
``qdata`` and ``scale``, ``weight`` and ``SCB``, ``blocks`` and ``scales``, ...), its logical
shape and dtype, and a :class:`PackedRule` whose ``build`` makes the weight from those parts
with the format's own library (torchao's tensor subclass, bitsandbytes' ``Int8Params`` and
``Params4bit``, transformers' FP8 and MXFP4 dequantization, the compressed-tensors
compressor transformers picks), so the weights equal what ``from_pretrained`` makes.

Example:
    >>> bnb_bits({"load_in_8bit": True}), bnb_bits({"load_in_4bit": True}), bnb_bits({})
    (8, 4, 0)
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from bigviz.checkpoint.convert import CheckpointView, Conversion
from bigviz.checkpoint.index import CheckpointIndex, TensorInfo
from bigviz.checkpoint.safetensors_io import read_header
from bigviz.osio.pages import release_free_heap

__all__ = [
    "TORCHAO_CPU_TYPES",
    "Builder",
    "PackedRule",
    "Group",
    "format_groups",
    "torchao_types",
    "ct_problems",
    "bnb_bits",
]


TORCHAO_CPU_TYPES = frozenset({"Int8Tensor", "IntxUnpackedToInt8Tensor"})
"""torchao tensor subclasses whose linear layers run on a CPU (their kernels dequantize per
matmul); torchao's int4 subclasses need CUDA or the ``mslk`` kernels."""


def bnb_bits(qc: Mapping[str, Any]) -> int:
    if qc.get("load_in_4bit") or qc.get("_load_in_4bit"):
        return 4
    return 8 if qc.get("load_in_8bit") or qc.get("_load_in_8bit") else 0


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


Group = tuple[dict[str, str], PackedRule, tuple[int, ...], str]


def format_groups(method: str, qc: Mapping[str, Any], view: CheckpointView, index: CheckpointIndex) -> dict[str, Group]:
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
        return _bnb8_groups(plain) if bnb_bits(qc) == 8 else _bnb4_groups(plain, index, qc)
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


def torchao_types(index: CheckpointIndex) -> set[str]:
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
