"""Where a model's tensors live, and the stores offloaded tensors are read from.

A *slot* is a place a tensor lives in a module: ``(module, attribute)``. One tensor can sit
in several slots (a tie: GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``), so the
engine works on :class:`TensorGroup` objects (one tensor, all its names and slots) and
writes tensors into slots directly, never through ``nn.Module.__setattr__`` (fast, and it
accepts a meta placeholder where a real tensor was).

A *store* is any ``Mapping[str, Tensor]`` of CPU tensors: a plain dict, the pinned copies
made at dispatch, or a :class:`~bigviz.checkpoint.lazy.LazyWeights` over safetensors files
(zero-copy views of memory-mapped files). :func:`write_offload_folder` writes tensors once
as safetensors; nothing is rewritten per access.

Example:
    >>> import torch
    >>> model = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})
    >>> model["b"].weight = model["a"].weight
    >>> [g.names for g in tensor_groups(model) if len(g.names) > 1]
    [['a.weight', 'b.weight']]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from bigviz.core.names import join
from bigviz.modeling.packed import is_packed, split, stored_nbytes

__all__ = [
    "Slot",
    "TensorGroup",
    "tensor_groups",
    "set_slot",
    "get_slot",
    "meta_like",
    "nbytes",
    "pin",
    "find_source",
    "write_offload_folder",
    "open_offload_folder",
]

Slot = tuple[nn.Module, str, str]  # (module, attribute, "param" | "buffer")
_PLAIN = (Tensor, nn.Parameter)  # a quick test before asking whether a tensor is packed


@dataclass(eq=False)
class TensorGroup:
    """One tensor object with every name and slot that holds it (more than one: a tie).

    Attributes:
        tensor: The tensor (a ``Parameter`` for parameters), as found before dispatch.
        names: Its full names in definition order (the first is its canonical name).
        slots: Every ``(module, attribute, kind)`` holding it (a shared module's slot once).
        aliases: Names of *other* tensor objects sharing its memory (ties by storage),
            tried as store keys when none of ``names`` is in a store.
        slot_of: name -> the slot it names.
    """

    tensor: Tensor
    names: list[str]
    slots: list[Slot] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)
    slot_of: dict[str, Slot] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.slots[0][2]

    @property
    def is_meta(self) -> bool:
        return self.tensor.device.type == "meta"


def tensor_groups(model: nn.Module, *, ties: Iterable[Iterable[str]] = ()) -> list[TensorGroup]:
    """Every parameter and buffer of ``model`` once, with all its names and slots.

    Args:
        model: The model to walk (shared submodules and tied tensors are found once).
        ties: Extra groups of names known to be one tensor (e.g. from
            :func:`bigviz.modeling.sizes.find_tied_parameters`), recorded as aliases.

    Example:
        >>> import torch
        >>> [g.names for g in tensor_groups(torch.nn.Linear(2, 3))]
        [['weight'], ['bias']]
    """
    groups: dict[int, TensorGroup] = {}
    seen_slots: set[tuple[int, str]] = set()
    for mname, module in model.named_modules(remove_duplicate=False):
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for attr, tensor in table.items():
                if tensor is None:
                    continue
                group = groups.setdefault(id(tensor), TensorGroup(tensor, []))
                name, slot = join(mname, attr), (module, attr, kind)
                group.names.append(name)
                group.slot_of[name] = slot
                if (id(module), attr) not in seen_slots:
                    seen_slots.add((id(module), attr))
                    group.slots.append(slot)
    result = list(groups.values())
    _add_aliases(result, ties)
    return result


def _add_aliases(groups: list[TensorGroup], ties: Iterable[Iterable[str]]) -> None:
    by_name = {name: g for g in groups for name in g.names}
    for tie in ties:
        names = [n for n in tie if n in by_name]
        for name in names:
            group = by_name[name]
            group.aliases.extend(n for n in names if n not in group.names and n not in group.aliases)


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
    if tensor.device.type == "meta":
        return tensor
    if type(tensor) not in _PLAIN and is_packed(tensor):  # a plain stand-in with the weight's shape and dtype
        return as_slot_value(torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"), kind)
    placeholder = torch.empty_like(tensor, device="meta")
    return as_slot_value(placeholder, kind, requires_grad=tensor.requires_grad)


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


def find_source(group: TensorGroup, stores: Iterable[Mapping[str, Tensor]]) -> tuple[str, Mapping[str, Tensor]] | None:
    """The first ``(key, store)`` holding this tensor under one of its names or aliases.

    Example:
        >>> import torch
        >>> g = TensorGroup(torch.zeros(1), ["a.weight", "b.weight"])
        >>> find_source(g, [{"b.weight": torch.ones(1)}])[0]
        'b.weight'
    """
    stores = list(stores)
    for name in [*group.names, *group.aliases]:
        for store in stores:
            if name in store:
                return name, store
    return None


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
