"""Pure rules for writing checkpoints: which tensors to store, and which shard each goes to.

Example:
    >>> import torch
    >>> w = torch.ones(4)
    >>> kept, dropped = unique_tensors({"wte.weight": w, "lm_head.weight": w})
    >>> list(kept), dropped
    (['wte.weight'], [('lm_head.weight', 'wte.weight')])
    >>> plan_shards({"a": torch.ones(4), "b": torch.ones(4), "c": torch.ones(8)}, 32)
    [['a', 'b'], ['c']]
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from bigviz.core.sizes import parse_size

__all__ = ["parse_size", "unique_tensors", "plan_shards"]


def unique_tensors(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[tuple[str, str]]]:
    """Drop names whose tensor is the same view of the same storage as an earlier name.

    Tied weights (``lm_head.weight`` is ``wte.weight``) are saved once, under the first name,
    as transformers does. Different views of one storage (slices of a fused matrix) are kept.

    Returns:
        (kept ``{name: tensor}`` in key order, ``[(dropped name, kept name), ...]``).
    """
    seen: dict[tuple, str] = {}
    kept: dict[str, torch.Tensor] = {}
    dropped: list[tuple[str, str]] = []
    for name, t in state.items():
        if t.numel() == 0:
            kept[name] = t
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key in seen:
            dropped.append((name, seen[key]))
        else:
            seen[key] = name
            kept[name] = t
    return kept, dropped


def plan_shards(tensors: Mapping[str, torch.Tensor], max_shard_size: int) -> list[list[str]]:
    """Greedy in key order: start a new shard when the next tensor would overflow this one.

    A tensor larger than ``max_shard_size`` ends up alone in its shard. An empty state
    dict gives one empty shard (an empty but valid checkpoint).
    """
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards
