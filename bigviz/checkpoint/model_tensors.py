"""Describe a model's tensors for loading: names, tie groups, persistence, shapes, dtypes.

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> model = torch.nn.ModuleDict({"a": lin, "b": lin})  # one module under two names
    >>> [(t.name, t.aliases) for t in describe_model(model)]
    [('a.weight', ('a.weight', 'b.weight')), ('a.bias', ('a.bias', 'b.bias'))]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ModelTensor", "describe_model", "tie_model"]


@dataclass(frozen=True)
class ModelTensor:
    """One tensor object of a model and every name it is reachable under (tied names).

    Attributes:
        name: the first name (definition order), used for the device map and results.
        aliases: every name of this tensor object, ``name`` first.
        shape: its shape.
        dtype: its dtype.
        kind: ``"param"`` or ``"buffer"``.
        persistent: False for buffers registered with ``persistent=False`` under every name.
        is_meta: True while it has no data.
        requires_grad: kept when the tensor is replaced.
        device: where it is now, e.g. ``"meta"``, ``"cpu"``, ``"cuda:0"``.
    """

    name: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    persistent: bool
    is_meta: bool
    requires_grad: bool
    device: str = "cpu"


def describe_model(model: torch.nn.Module) -> list[ModelTensor]:
    """Every distinct parameter and buffer of ``model``, grouped by object identity."""
    groups: dict[int, list[tuple[str, torch.Tensor, str, bool]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for leaf, p in module._parameters.items():
            if p is not None:
                groups.setdefault(id(p), []).append((prefix + leaf, p, "param", True))
        for leaf, b in module._buffers.items():
            if b is not None:
                persistent = leaf not in module._non_persistent_buffers_set
                groups.setdefault(id(b), []).append((prefix + leaf, b, "buffer", persistent))
    out = []
    for members in groups.values():
        name, tensor, kind, _ = members[0]
        out.append(ModelTensor(
            name=name,
            aliases=tuple(m[0] for m in members),
            shape=tuple(tensor.shape),
            dtype=tensor.dtype,
            kind=kind,
            persistent=any(m[3] for m in members),
            is_meta=tensor.is_meta,
            requires_grad=bool(tensor.requires_grad),
            device=str(tensor.device),
        ))
    return out


def tie_model(model: torch.nn.Module) -> None:
    """Let a transformers-style model re-tie its weights (a no-op for other modules).

    A transformers model built on meta (or under ``init_empty_weights``) is not tied until
    ``tie_weights()`` runs; without it the tied duplicate (``lm_head.weight``) would count as a
    separate, missing tensor. This only rebinds meta or existing parameters; it reads no data.
    """
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
