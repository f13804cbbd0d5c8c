"""bitsandbytes' stored formats: an 8-bit weight (``Int8Params``: int8 rows and their
``SCB`` scales) and a 4-bit one (``Params4bit``: packed values, ``absmax``, ``quant_map``, the
nested parts of double quantization and its ``quant_state`` JSON), the keys of each weight,
every part checked against the shape its quant state says, and the weight built by
bitsandbytes as transformers' deserializers build it.

Example:
    >>> bnb_bits({"load_in_8bit": True}), bnb_bits({"load_in_4bit": True}), bnb_bits({})
    (8, 4, 0)
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import Tensor

from bigviz.checkpoint.index import CheckpointIndex, TensorInfo
from bigviz.checkpoint.stored_parts import (
    DAMAGED,
    Group,
    Layout,
    PackedRule,
    at,
    ceil_div,
    missing_part,
    numel,
    part_problem,
)

__all__ = ["bnb_bits", "bnb8_groups", "bnb4_groups"]


def bnb_bits(qc: Mapping[str, Any]) -> int:
    if qc.get("load_in_4bit") or qc.get("_load_in_4bit"):
        return 4
    return 8 if qc.get("load_in_8bit") or qc.get("_load_in_8bit") else 0


def bnb8_groups(plain: Mapping[str, TensorInfo]) -> Layout:
    """Each module with ``SCB``, a ``weight_format`` or an int8 ``weight``: its int8 weight and
    its row scales (one float32 per output row)."""
    out: dict[str, Group] = {}
    problems: list[str] = []
    modules = {k.removesuffix(s) for k in plain for s in (".SCB", ".weight_format") if k.endswith(s)}
    modules |= {k.removesuffix(".weight") for k, i in plain.items() if k.endswith(".weight") and i.dtype == "int8"}
    for module in sorted(modules):
        weight = f"{module}.weight"
        if weight not in plain:
            continue  # reported by the load: the model's weight is missing, its parts unexpected
        info = plain[weight]
        keys = {"weight": weight}
        rows = info.shape[0] if info.shape else 0
        scales = f"{rows} float32 row scales"
        if f"{module}.SCB" in plain:
            keys["SCB"] = f"{module}.SCB"
            scb = plain[keys["SCB"]]
            if scb.numel != rows or not scb.dtype.startswith(("float", "bfloat")):
                problems.append(part_problem(scb, f"{scales} (one per row of the {list(info.shape)} weight)"))
        else:
            problems.append(missing_part(info, "bitsandbytes 8-bit", f"{info.name.removesuffix('weight')}SCB", scales))
        if info.dtype != "int8" or len(info.shape) != 2:
            problems.append(part_problem(info, "a 2-dimensional int8 weight (bitsandbytes 8-bit stores int8 rows)"))
        if f"{module}.weight_format" in plain:
            keys["weight_format"] = f"{module}.weight_format"  # always row-major now: read, not used
        rule = PackedRule(tuple(keys), _bnb8_build, "bitsandbytes Int8Params")
        out[weight] = (keys, rule, info.shape, "int8")
    return out, problems


def _bnb8_build(parts: Mapping[str, Tensor], dtype: torch.dtype | None) -> Tensor:
    """bitsandbytes' ``Int8Params`` with its row scales, as transformers' ``Bnb8bitDeserialize``
    makes it."""
    import bitsandbytes as bnb

    weight = parts["weight"]
    return bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False, CB=weight, SCB=parts["SCB"])  # type: ignore[no-any-return]


_BNB4_STATE = "quant_state.bitsandbytes__"
_BNB4_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")


def _bnb4_parts(plain: Mapping[str, TensorInfo]) -> dict[str, dict[str, str]]:
    """Weight name -> its 4-bit parts (role -> key): ``absmax``, ``quant_map``, the nested
    ones of double quantization, and its ``quant_state.bitsandbytes__<type>`` JSON."""
    out: dict[str, dict[str, str]] = {}
    for key in plain:
        weight, role = "", ""
        if f".{_BNB4_STATE}" in key:
            weight, _, rest = key.partition(".quant_state.")
            role = f"quant_state.{rest}"
        else:
            for part in _BNB4_PARTS:
                if key.endswith(f".{part}"):
                    weight, role = key.removesuffix(f".{part}"), part
        if weight in plain and role:
            out.setdefault(weight, {"weight": weight})[role] = key
    return out


def bnb4_groups(plain: Mapping[str, TensorInfo], index: CheckpointIndex, qc: Mapping[str, Any]) -> Layout:
    out: dict[str, Group] = {}
    problems: list[str] = []
    groups = _bnb4_parts(plain)
    states = [key for keys in groups.values() for role, key in keys.items() if role.startswith("quant_state.")]
    docs = _bnb4_states(index, plain, states)
    storage = str(qc.get("bnb_4bit_quant_storage", "uint8")).removeprefix("torch.")
    for weight, keys in groups.items():
        found = [k for r, k in keys.items() if r.startswith("quant_state.")]
        doc = docs.get(found[0]) if len(found) == 1 else None
        problems += _bnb4_problems(plain, keys, doc, storage)
        shape = tuple(int(d) for d in doc["shape"]) if isinstance(doc, dict) else plain[weight].shape
        rule = PackedRule(tuple(keys), _bnb4_build, "bitsandbytes Params4bit")
        out[weight] = (keys, rule, shape, storage)
    return out, problems


def _bnb4_states(
    index: CheckpointIndex, plain: Mapping[str, TensorInfo], states: Collection[str]
) -> dict[str, dict[str, Any] | str]:
    """Each 4-bit weight's quant state (a few bytes of JSON: the packed weight's shape says only
    its byte count), or why it cannot be read; the keys a state needs are checked here."""
    if not states:
        return {}
    from bigviz.checkpoint.lazy import LazyWeights

    with LazyWeights(index, {k: plain[k].name for k in states}) as weights:
        return {key: _bnb4_state(weights[key]) for key in states}


def _bnb4_state(raw: Tensor) -> dict[str, Any] | str:
    """A quant state's JSON with an integer ``blocksize`` and ``shape``, or why it is not one."""
    why = "not a bitsandbytes quant state (JSON with quant_type, a positive blocksize and shape)"
    try:
        doc = json.loads(bytes(raw.tolist()).decode())
        if not isinstance(doc, dict) or not all(k in doc for k in ("quant_type", "blocksize", "shape")):
            return why
        doc["shape"] = [int(d) for d in doc["shape"]]
        doc["blocksize"] = int(doc["blocksize"])
    except (ValueError, TypeError, UnicodeDecodeError) as err:
        return f"{why}: {err}"
    return doc if doc["blocksize"] > 0 else why


def _bnb4_problems(
    plain: Mapping[str, TensorInfo], keys: Mapping[str, str], doc: dict[str, Any] | str | None, storage: str
) -> list[str]:
    """Every part a 4-bit weight needs, each of the size its quant state implies: the packed
    weight ``ceil(n / 2)`` bytes, ``absmax`` one value per block of ``blocksize``, a 16-value
    ``quant_map``; double-quantized, ``absmax`` in uint8 with ``nested_absmax`` one float32 per
    ``nested_blocksize`` of them and a 256-value ``nested_quant_map``."""
    weight = plain[keys["weight"]]
    fmt = "bitsandbytes 4-bit"
    states = [k for r, k in keys.items() if r.startswith("quant_state.")]
    if len(states) != 1:
        what = "one quant_state.bitsandbytes__nf4 or __fp4 (its shape and block size)"
        if not states:
            return [missing_part(weight, fmt, f"{weight.name}.{_BNB4_STATE}<nf4|fp4>", what)]
        return [f"{at(weight)}: expected {what}, found {len(states)}: {', '.join(states)}; {DAMAGED}"]
    if not isinstance(doc, dict):
        return [f"{at(plain[states[0]])}: {doc}; {DAMAGED}"]
    n = numel(doc["shape"])
    blocks = ceil_div(n, doc["blocksize"])
    nested = "nested_blocksize" in doc or any(r.startswith("nested_") for r in keys)
    of = f"the {doc['shape']} weight its quant state describes"
    want = {
        "absmax": (blocks, "uint8" if nested else "float32", f"one per {doc['blocksize']} values of {of}"),
        "quant_map": (16, "float32", "the 4-bit code"),
    }
    if nested:
        inner = int(doc.get("nested_blocksize", 0) or 0)
        if inner <= 0 or not all(k in doc for k in ("nested_dtype", "nested_offset")):
            return [
                f"{at(plain[states[0]])}: double-quantized parts without nested_blocksize, nested_dtype and "
                f"nested_offset in its quant state; {DAMAGED}"
            ]
        want["nested_absmax"] = (ceil_div(blocks, inner), "float32", f"one per {inner} absmax values")
        want["nested_quant_map"] = (256, "float32", "the 8-bit code of the absmax values")
    out = []
    if weight.nbytes != ceil_div(n, 2) or weight.dtype != storage:
        out.append(part_problem(weight, f"{ceil_div(n, 2)} bytes of {storage} (two 4-bit values a byte for {of})"))
    for role, (count, dtype, why) in want.items():
        what = f"{count} {dtype} values ({why})"
        if role not in keys:
            out.append(missing_part(weight, fmt, f"{weight.name}.{role}", what))
        elif plain[keys[role]].numel != count or plain[keys[role]].dtype != dtype:
            out.append(part_problem(plain[keys[role]], what))
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
