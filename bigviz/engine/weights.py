"""Where a model's tensors live, and the stores offloaded tensors are read from.

A *slot* is a place a tensor lives in a module: ``(module, attribute)``. One tensor can sit
in several slots (a tie: GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``: the model's
inventory, :mod:`bigviz.modeling.inventory`, groups them), and the engine writes tensors into
slots directly, never through ``nn.Module.__setattr__`` (fast, and it accepts a meta
placeholder where a real tensor was).

A *store* is any ``Mapping[str, Tensor]`` of CPU tensors: a plain dict, the pinned copies
made at dispatch, or a :class:`~bigviz.checkpoint.lazy.LazyWeights` over safetensors files
(zero-copy views of memory-mapped files). :func:`write_offload_folder` writes tensors once
as safetensors; nothing is rewritten per access.

Example:
    >>> import torch
    >>> layer = torch.nn.Linear(2, 2)
    >>> set_slot((layer, "bias", "param"), meta_like(layer.bias, "param"))
    >>> layer.bias.device.type
    'meta'
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from bigviz.modeling.packed import is_packed, split, stored_nbytes

__all__ = [
    "Slot",
    "set_slot",
    "get_slot",
    "meta_like",
    "Offloaded",
    "OffloadedParameter",
    "OffloadedBuffer",
    "OffloadedWeightError",
    "offloaded_placeholder",
    "nbytes",
    "pin",
    "write_offload_folder",
    "open_offload_folder",
]

Slot = tuple[nn.Module, str, str]  # (module, attribute, "param" | "buffer")
_PLAIN = (Tensor, nn.Parameter)  # a quick test before asking whether a tensor is packed


def get_slot(slot: Slot) -> Tensor:
    """The tensor currently in ``slot``.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> get_slot((layer, "weight", "param")) is layer.weight
        True
    """
    module, attr, kind = slot
    return (module._parameters if kind == "param" else module._buffers)[attr]


def set_slot(slot: Slot, value: Tensor) -> None:
    """Put ``value`` in ``slot`` (a parameter slot must get an ``nn.Parameter``).

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> set_slot((layer, "bias", "param"), torch.nn.Parameter(torch.zeros(2)))
        >>> layer.bias.tolist()
        [0.0, 0.0]
    """
    module, attr, kind = slot
    (module._parameters if kind == "param" else module._buffers)[attr] = value


def as_slot_value(value: Tensor, kind: str, *, requires_grad: bool = False) -> Tensor:
    """Wrap ``value`` for a slot: an ``nn.Parameter`` sharing its memory, or the tensor itself.

    Example:
        >>> import torch
        >>> type(as_slot_value(torch.zeros(1), "param")).__name__
        'Parameter'
    """
    if kind != "param":
        return value
    if type(value) not in _PLAIN and is_packed(value):  # a quantized weight: as its library made it
        return value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
    return nn.Parameter(value, requires_grad=requires_grad and value.is_floating_point())


def meta_like(tensor: Tensor, kind: str) -> Tensor:
    """A placeholder with ``tensor``'s shape and dtype on ``meta`` (no memory).

    Example:
        >>> import torch
        >>> meta_like(torch.zeros(2, 3), "param").device
        device(type='meta')
    """
    if tensor.device.type == "meta" and not isinstance(tensor, Offloaded):
        return tensor
    if type(tensor) not in _PLAIN and is_packed(tensor):  # a plain stand-in with the weight's shape and dtype
        return as_slot_value(torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"), kind)
    placeholder = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    return as_slot_value(placeholder, kind, requires_grad=tensor.requires_grad)


class OffloadedWeightError(RuntimeError):
    """An offloaded weight was computed with outside its module's forward (it holds no data
    then: the result would be garbage)."""


class Offloaded:
    """What an offloaded tensor is between forwards: a ``meta`` tensor (no data) that reports
    the device it will be used on.

    Model code places its inputs by a child's weight (Llama 4:
    ``input_ids.to(self.embed_tokens.weight.device)``, Mllama's ``pixel_values``, transformers'
    ``model.device`` in ``generate``). A plain ``meta`` placeholder sends the inputs to ``meta``,
    and ``F.embedding`` of ``meta`` ids with real weights returns uninitialised memory, no
    error. So ``.device`` gives the execution device, while ``is_meta`` stays true (nothing is
    in memory: the weight is fetched when its module runs). And computing with it outside that
    forward, beside tensors that hold data, is refused naming the weight
    (:class:`OffloadedWeightError`) instead of giving garbage: a parent reading a child's
    weight without calling the child. Operations on ``meta`` tensors alone (sizing, planning)
    work as on any ``meta`` tensor.
    """

    _bigviz_device: torch.device | None = None
    _bigviz_name: str = ""
    _bigviz_unit: str = ""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        found = self.__dict__.get("_bigviz_device")
        return found if found is not None else torch._C.TensorBase.device.__get__(self)  # type: ignore[attr-defined]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not kwargs and len(args) == 1:  # an attribute or a method of the placeholder alone: no data met
            ours = [args[0]] if isinstance(args[0], Offloaded) else []
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args)
        else:
            leaves = tree_leaves((args, kwargs or {}))
            ours = [t for t in leaves if isinstance(t, Offloaded)]
            if any(isinstance(t, Tensor) and not t.is_meta for t in leaves):
                raise _used_outside(func, ours)
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **(kwargs or {}))
        if not ours:
            return out
        # what is derived from it (``weight.T``, ``weight.detach()``, a chunk) is the same no-data weight
        if type(out) is Tensor:
            return _derived(out, ours[0])
        if type(out) in (tuple, list):
            return type(out)(_derived(t, ours[0]) if type(t) is Tensor else t for t in out)
        return out  # torch.Size, dtypes, numbers: as they are

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return (
            f"{type(self).__name__}({self._bigviz_name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"runs on {self.device}, no data between forwards: offloaded with {self._bigviz_unit!r})"
        )


class OffloadedParameter(Offloaded, nn.Parameter):
    """An offloaded parameter between forwards (see :class:`Offloaded`)."""


class OffloadedBuffer(Offloaded, Tensor):
    """An offloaded buffer between forwards (see :class:`Offloaded`)."""


def offloaded_placeholder(tensor: Tensor, kind: str, *, device: torch.device, name: str, unit: str) -> Tensor:
    """The placeholder an offloaded ``tensor`` (named ``name``, fetched by unit ``unit``)
    holds between forwards: on ``meta``, reporting ``device`` (see :class:`Offloaded`).

    Example:
        >>> import torch
        >>> w = offloaded_placeholder(torch.zeros(2, 3), "param", device=torch.device("cpu"), name="w", unit="")
        >>> w.device, w.is_meta, isinstance(w, torch.nn.Parameter)
        (device(type='cpu'), True, True)
        >>> torch.ones(3) @ w.T  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        bigviz.engine.weights.OffloadedWeightError: offloaded weight 'w' was used ...
    """
    meta = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    cls = OffloadedParameter if kind == "param" else OffloadedBuffer
    out = Tensor._make_subclass(cls, meta, kind == "param" and tensor.requires_grad and meta.is_floating_point())
    out._bigviz_device, out._bigviz_name, out._bigviz_unit = device, name, unit  # type: ignore[attr-defined]
    return out


def _derived(tensor: Tensor, source: Offloaded) -> Tensor:
    """``tensor`` (computed from ``source`` alone) as an offloaded placeholder too, so that it
    is refused beside real data as ``source`` is (no graph: there is nothing to differentiate)."""
    if not tensor.is_meta:
        return tensor
    out = Tensor._make_subclass(OffloadedBuffer, tensor.detach(), False)
    out._bigviz_device, out._bigviz_name, out._bigviz_unit = (  # type: ignore[attr-defined]
        source._bigviz_device,
        source._bigviz_name,
        source._bigviz_unit,
    )
    return out


def _used_outside(func: Any, placeholders: list[Offloaded]) -> OffloadedWeightError:
    names = ", ".join(repr(p._bigviz_name) for p in placeholders) or "an offloaded weight"
    units = sorted({p._bigviz_unit for p in placeholders})
    what = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return OffloadedWeightError(
        f"offloaded weight {names} was used (by {what}) outside the forward of {', '.join(map(repr, units))}, "
        "where it is fetched: between forwards it is on meta and holds no data, so the result would be "
        "garbage. A module's code reads it without calling the module that owns it: pass "
        "preload_module_classes=[<that module's class name>] so it fetches its children's weights, or keep "
        "that module on a device that computes"
    )


def nbytes(tensor: Tensor) -> int:
    """Bytes a tensor's elements take (works on ``meta``).

    Example:
        >>> import torch
        >>> nbytes(torch.zeros(4, dtype=torch.float16))
        8
    """
    if type(tensor) not in _PLAIN and is_packed(tensor):
        return stored_nbytes(tensor)  # a quantized weight: its packed parts
    return tensor.numel() * tensor.element_size()


def pin(tensor: Tensor) -> Tensor:
    """A page-locked CPU copy of ``tensor`` (made once, at dispatch), for fast async copies.

    Example:
        >>> import torch
        >>> pin(torch.ones(2)).device.type  # pinned only when CUDA exists
        'cpu'
    """
    packed = split(tensor) if type(tensor) not in _PLAIN else None
    if packed is not None:  # each part pinned; the weight built over them
        return packed.build({part: pin(t) for part, t in packed.parts.items()})
    cpu = tensor.detach().to("cpu")
    if not torch.cuda.is_available():
        return cpu.clone() if cpu.data_ptr() == tensor.data_ptr() else cpu
    return cpu.pin_memory()


def write_offload_folder(tensors: Mapping[str, Tensor], folder: str | Path) -> None:
    """Write ``tensors`` once into an offload folder, as safetensors shards with an index.

    Always written, never reused by name: a folder left by another model with the same shapes
    would otherwise be read silently. The one writer is
    :func:`bigviz.checkpoint.offload_folder.write_offload_folder`: only files bigviz's record in the
    folder lists are ever replaced; a folder holding anything else is refused, untouched.

    Example:
        >>> import torch, tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     write_offload_folder({"w": torch.ones(2)}, d)
        ...     open_offload_folder(d)["w"].tolist()
        [1.0, 1.0]
    """
    from bigviz.checkpoint.offload_folder import write_offload_folder as write

    write(tensors, folder)


def open_offload_folder(folder: str | Path) -> Mapping[str, Tensor]:
    """A :class:`~bigviz.checkpoint.lazy.LazyWeights` over what bigviz wrote in ``folder`` (kept
    open), or over the checkpoint it holds when bigviz did not write it.

    Example:
        >>> import torch, tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     write_offload_folder({"w": torch.zeros(1)}, d)
        ...     len(open_offload_folder(d))
        1
    """
    from bigviz.checkpoint.offload_folder import open_offload_folder as open_folder

    return open_folder(folder)
