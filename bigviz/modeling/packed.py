"""Packed (quantized) weights as the plain tensors they are made of, and back.

A quantized weight is not one block of memory: torchao's ``Int8Tensor`` is a tensor subclass
holding ``qdata``, ``scale`` and ``zero_point``; bitsandbytes' ``Int8Params`` is an int8
parameter with its row scales (``SCB``) as an attribute; its ``Params4bit`` packs two values a
byte and keeps ``absmax`` and a code in a ``QuantState``. Whatever moves weights (an offload
folder, a resident copy, a ring of streamed bytes, a copy to a GPU) works on plain tensors
(``data_ptr``, file offsets, ``view``): :func:`split` gives a packed weight's plain *parts* and a
``build`` that makes the same weight from parts put elsewhere (read into the ring, copied to a
device), so the packed bytes travel and nothing is dequantized on the way.

Every format uses its library's own means: torchao's ``__tensor_flatten__`` /
``__tensor_unflatten__`` (what ``torch.compile`` and torchao's safetensors support use),
bitsandbytes' ``Int8Params`` and ``QuantState`` constructors (what transformers' bitsandbytes
integration uses). None of these libraries is imported unless a weight of theirs is seen.

Example:
    >>> import torch
    >>> split(torch.ones(2)) is None, stored_nbytes(torch.ones(2))
    (True, 8)
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from bigviz.core.errors import ArgumentTypeError

__all__ = [
    "Packed",
    "is_packed",
    "split",
    "stored_nbytes",
    "clone",
    "held_bytes",
    "release_module_state",
    "packed_kind",
]


@dataclass(frozen=True)
class Packed:
    """A packed weight as plain tensors.

    Attributes:
        parts: name -> plain tensor (what is stored, read and streamed).
        build: parts (the same names; placed anywhere) -> the packed weight.
        kind: the format, e.g. ``"torchao Int8Tensor"`` or ``"bitsandbytes Params4bit"``.
    """

    parts: dict[str, Tensor]
    build: Callable[[Mapping[str, Tensor]], Tensor]
    kind: str

    @property
    def nbytes(self) -> int:
        """Bytes of the parts: what the weight takes in memory or in a file."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())


def packed_kind(tensor: Tensor) -> str:
    """The packed format of ``tensor`` (``""``: a plain tensor).

    Example:
        >>> packed_kind(torch.zeros(1)), packed_kind(torch.nn.Parameter(torch.zeros(1)))
        ('', '')
    """
    cls = type(tensor)
    if cls in (Tensor, nn.Parameter):
        return ""
    name = cls.__name__
    if name in ("Int8Params", "Params4bit") and cls.__module__.startswith("bitsandbytes"):
        if tensor.is_meta or (name == "Params4bit" and getattr(tensor, "quant_state", None) is None):
            return ""  # a layer's placeholder, before its weight is loaded: nothing packed yet
        return f"bitsandbytes {name}"
    if hasattr(tensor, "__tensor_flatten__") and not isinstance(tensor, torch._subclasses.FakeTensor):
        return f"{cls.__module__.split('.')[0]} {name}"
    return ""


def is_packed(tensor: object) -> bool:
    """True for a quantized weight made of several tensors (a torchao tensor subclass, a
    bitsandbytes ``Int8Params`` / ``Params4bit``)."""
    return isinstance(tensor, Tensor) and packed_kind(tensor) != ""


def split(tensor: Tensor, *, module: nn.Module | None = None) -> Packed | None:
    """``tensor`` as plain parts and how to build it back; None for a plain tensor.

    Args:
        tensor: a weight.
        module: the module holding it: a bitsandbytes ``Linear8bitLt`` that ran a forward
            keeps the weight's row scales in its ``state``, not on the weight.

    Example:
        >>> import torchao.quantization as tq  # doctest: +SKIP
    """
    kind = packed_kind(tensor)
    if not kind:
        return None
    if kind == "bitsandbytes Int8Params":
        return _split_int8params(tensor, module, kind)
    if kind == "bitsandbytes Params4bit":
        return _split_params4bit(tensor, kind)
    return _split_subclass(tensor, kind)


def _split_subclass(tensor: Tensor, kind: str) -> Packed:
    """A traceable tensor subclass (torchao's): its inner tensors, rebuilt by its own
    ``__tensor_unflatten__`` with the same context (block size, dtype, ...)."""
    names, context = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    parts = {name: getattr(tensor, name) for name in names}
    if any(type(p) is not Tensor for p in parts.values()):
        raise ArgumentTypeError(f"{kind}: nested tensor subclasses cannot be moved packed by bigviz")
    cls, shape, stride = type(tensor), tensor.shape, tensor.stride()
    requires_grad = tensor.requires_grad

    def build(new: Mapping[str, Tensor]) -> Tensor:
        value = cls.__tensor_unflatten__(dict(new), context, shape, stride)  # type: ignore[attr-defined]
        return value.requires_grad_(requires_grad) if requires_grad else value

    return Packed(parts, build, kind)


def _split_int8params(tensor: Tensor, module: nn.Module | None, kind: str) -> Packed:
    """bitsandbytes 8-bit: the int8 rows and their float32 scales (``SCB``)."""
    scb = getattr(tensor, "SCB", None)
    state = getattr(module, "state", None)
    if scb is None and state is not None:
        scb = getattr(state, "SCB", None)  # moved there by the module's first forward
    data = tensor.detach().as_subclass(Tensor)
    parts = {"weight": data} if scb is None else {"weight": data, "SCB": scb}
    cls = type(tensor)
    has_fp16 = bool(getattr(tensor, "has_fp16_weights", False))

    def build(new: Mapping[str, Tensor]) -> Tensor:
        weight = new["weight"]
        scales = new.get("SCB")
        return cls(weight, requires_grad=False, has_fp16_weights=has_fp16, CB=weight, SCB=scales)  # type: ignore[call-arg]

    return Packed(parts, build, kind)


def _split_params4bit(tensor: Tensor, kind: str) -> Packed:
    """bitsandbytes 4-bit: the packed bytes, and the quant state's tensors (absmax, code, and
    the nested ones of double quantization); the rest of the quant state is copied as it is."""
    state = tensor.quant_state  # type: ignore[attr-defined]
    parts = {"weight": tensor.detach().as_subclass(Tensor), "absmax": state.absmax, "code": state.code}
    if state.nested:
        parts |= {"nested_absmax": state.state2.absmax, "nested_code": state.state2.code}
    cls = type(tensor)
    fields = {
        k: getattr(tensor, k)
        for k in ("blocksize", "compress_statistics", "quant_type", "quant_storage", "module")
        if hasattr(tensor, k)
    }

    def build(new: Mapping[str, Tensor]) -> Tensor:
        fresh = copy.copy(state)
        fresh.absmax, fresh.code = new["absmax"], new["code"]
        if state.nested:
            fresh.state2 = copy.copy(state.state2)
            fresh.state2.absmax, fresh.state2.code = new["nested_absmax"], new["nested_code"]
        value = cls(new["weight"], requires_grad=False, quant_state=fresh, bnb_quantized=True, **fields)  # type: ignore[call-arg]
        return value

    return Packed(parts, build, kind)


def stored_nbytes(tensor: Tensor, *, module: nn.Module | None = None) -> int:
    """Bytes ``tensor`` takes: its parts' when packed, else its elements' (works on meta).

    Example:
        >>> stored_nbytes(torch.zeros(3, dtype=torch.float16))
        6
    """
    packed = split(tensor, module=module)
    if packed is not None:
        return packed.nbytes
    return tensor.numel() * tensor.element_size()


def clone(tensor: Tensor) -> Tensor:
    """A copy of ``tensor`` in new memory; a packed weight built again over copies of its parts.

    Example:
        >>> t = torch.ones(2)
        >>> clone(t).data_ptr() != t.data_ptr()
        True
    """
    packed = split(tensor)
    if packed is None:
        return tensor.clone()
    return packed.build({part: t.clone() for part, t in packed.parts.items()})


def held_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of weights each device holds now (``"cpu"``, ``"cuda:0"``, ...), each tensor once,
    a packed weight by its parts (what a quantized model really takes); tensors on ``meta``
    (offloaded) hold none.

    Example:
        >>> held_bytes(torch.nn.Linear(4, 2))
        {'cpu': 40}
    """
    out: dict[str, int] = {}
    seen: set[int] = set()
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for tensor in table.values():
                if tensor is None or id(tensor) in seen or tensor.is_meta:
                    continue
                seen.add(id(tensor))
                where = str(tensor.device)
                out[where] = out.get(where, 0) + stored_nbytes(tensor, module=module)
    return out


def release_module_state(module: nn.Module) -> None:
    """Forget what a module keeps of its packed weight beside the weight itself, so an
    offloaded weight's memory goes when the weight does (bitsandbytes' ``Linear8bitLt``
    moves the weight's int8 rows and scales into ``module.state`` at its first forward and
    takes them from a fresh weight again only while ``state`` is empty)."""
    if "bitsandbytes" not in sys.modules:
        return
    state = getattr(module, "state", None)
    if state is not None and type(module).__name__ == "Linear8bitLt":
        state.CB = None
        state.SCB = None
