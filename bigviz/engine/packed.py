"""Packed (quantized) weights on their way through the engine: split into plain parts where
bytes move, built back where the weight runs.

The fetchers, the resident copy and the ring of streamed bytes work on plain tensors (file
offsets, ``data_ptr``, ``view``). A unit's packed weight (a torchao tensor subclass, a
bitsandbytes ``Int8Params`` / ``Params4bit``, or FP8 parts that dequantize when built) is
handed to them as its parts under ``key + PART + part`` keys; once the parts are where the
weight will run, :func:`rebuild` makes the weight again. So the packed bytes are what is read,
copied and held, and a format no kernel runs packed is dequantized only on the execution
device, per fetch.

Example:
    >>> import torch
    >>> from bigviz.modeling.packed import Packed
    >>> packs = {"w": Packed({"a": torch.ones(1), "b": torch.ones(1)}, lambda p: p["a"] + p["b"], "sum")}
    >>> flat = expand({"w": torch.zeros(1), "x": torch.zeros(2)}, packs)
    >>> sorted(flat), rebuild(flat, packs)["w"].tolist()
    (['w\\x00a', 'w\\x00b', 'x'], [2.0])
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from bigviz.modeling.packed import Packed, split

__all__ = ["PART", "packed_of", "parts", "expand", "rebuild"]

PART = "\x00"
"""Between a key and a part's name (never in a tensor name)."""


def packed_of(store: Mapping[str, Tensor], key: str, value: Tensor | None = None) -> Packed | None:
    """The parts of ``store[key]`` without building it when the store can say
    (`~bigviz.checkpoint.packed_weights.PackedWeights.packed`), else of ``value`` (a packed
    weight in memory); None for a plain tensor."""
    own = getattr(store, "packed", None)
    if own is not None:
        found: Packed | None = own(key)
        if found is not None:
            return found
    return split(value) if value is not None else None


def parts(packs: Mapping[str, Packed]) -> dict[str, Tensor]:
    """Every part of ``packs``, under ``key + PART + part``."""
    return {f"{key}{PART}{part}": t for key, packed in packs.items() for part, t in packed.parts.items()}


def expand(tensors: Mapping[str, Tensor], packs: Mapping[str, Packed]) -> dict[str, Tensor]:
    """``tensors`` with each packed key replaced by its parts (``key + PART + part``)."""
    return {k: t for k, t in tensors.items() if k not in packs} | parts(
        {k: p for k, p in packs.items() if k in tensors}
    )


def rebuild(tensors: Mapping[str, Tensor], packs: Mapping[str, Packed]) -> dict[str, Tensor]:
    """The inverse of :func:`expand`: each packed key built from its parts as ``tensors`` has
    them (read into the ring, copied to a device)."""
    if not packs:
        return dict(tensors)
    out = {key: t for key, t in tensors.items() if PART not in key}
    for key, packed in packs.items():
        out[key] = packed.build({part: tensors[f"{key}{PART}{part}"] for part in packed.parts})
    return out
