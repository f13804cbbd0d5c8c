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

import torch
from torch import Tensor, nn


__all__ = [
    "Slot",
    "set_slot",
    "get_slot",
    "meta_like",
    "nbytes",
    "pin",
    "write_offload_folder",
    "open_offload_folder",
]

Slot = tuple[nn.Module, str, str]  # (module, attribute, "param" | "buffer")


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
    return nn.Parameter(value, requires_grad=requires_grad and value.is_floating_point())


def meta_like(tensor: Tensor, kind: str) -> Tensor:
    """A placeholder with ``tensor``'s shape and dtype on ``meta`` (no memory).

    Example:
        >>> import torch
        >>> meta_like(torch.zeros(2, 3), "param").device
        device(type='meta')
    """
    if tensor.device.type == "meta":
        return tensor
    placeholder = torch.empty_like(tensor, device="meta")
    return as_slot_value(placeholder, kind, requires_grad=tensor.requires_grad)


def nbytes(tensor: Tensor) -> int:
    """Bytes a tensor's elements take (works on ``meta``).

    Example:
        >>> import torch
        >>> nbytes(torch.zeros(4, dtype=torch.float16))
        8
    """
    return tensor.numel() * tensor.element_size()


def pin(tensor: Tensor) -> Tensor:
    """A page-locked CPU copy of ``tensor`` (made once, at dispatch), for fast async copies.

    Example:
        >>> import torch
        >>> pin(torch.ones(2)).device.type  # pinned only when CUDA exists
        'cpu'
    """
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
