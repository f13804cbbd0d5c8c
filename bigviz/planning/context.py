"""The longest context whose run fits, by bisection on the (linear-time) planner.

Example:
    >>> import torch
    >>> from bigviz.models import build
    >>> with torch.device("meta"):
    ...     model = build("gpt-tiny")
    >>> max_context(model, {"cpu": "10MiB"})
    64
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.nn as nn

from bigviz.core.errors import PlanError
from bigviz.core.plan import DevicePlan
from bigviz.core.workload import longest_fit
from bigviz.modeling.budgets import get_max_memory
from bigviz.modeling.inventory import ModelInventory
from bigviz.planning.device_plan import plan
from bigviz.planning.models import ModelLike, resolve_model

__all__ = ["max_context", "position_limit"]


def max_context(
    model: ModelLike,
    max_memory: Mapping[Any, object] | None = None,
    batch_size: int = 1,
    *,
    allow_offload: bool = False,
    device_map: DevicePlan | Mapping[str, object] | None = None,
    limit: int | None = None,
    **plan_kwargs: object,
) -> int:
    """The longest context whose run fits, by bisection on the (linear-time) planner.

    "Fits" means the plan succeeds with every device within its budget (weights, KV cache,
    activations of the prefill, reserves: by default each device kind's headroom, the CUDA
    context and fragmentation on a GPU, the allocator's slack on the CPU, see
    :mod:`bigviz.core.headroom`; ``reserve=0`` answers with the bare arithmetic), and:

    * by default, nothing is offloaded: every module stays on the GPUs (or the CPU when no
      GPU is planned for);
    * with ``allow_offload=True``, the planner may stream modules in from cpu and disk,
      re-planning for each context;
    * with ``device_map`` (a plan or a map), that placement is kept as it is, offload
      included, and only the run must fit beside it.

    Args:
        model: what :func:`plan` takes.
        max_memory: budgets, as for :func:`plan`.
        batch_size: sequences run together.
        limit: the largest context worth trying (default: the model's position limit,
            ``max_position_embeddings`` / ``n_positions`` / ``block_size``, else 2**24).
        **plan_kwargs: more :func:`plan` options (``dtype``, ``kv_dtype``, ``encoder_length``,
            ``reserve``, ``strategy``, ...).

    Returns:
        The number of tokens, 0 when not even the weights fit.

    Example:
        >>> import torch
        >>> from bigviz.models import build
        >>> with torch.device("meta"):
        ...     model = build("gpt-tiny")        # 123.5 KiB of weights, block_size 64
        >>> max_context(model, {"cpu": "10MiB"}), max_context(model, {"cpu": 160_000})
        (64, 12)
        >>> max_context(model, {"cpu": 160_000}, reserve=0)   # no headroom: the bare arithmetic
        15
    """
    model = resolve_model(model)
    budgets = get_max_memory(max_memory)
    top = limit if limit is not None else position_limit(model) or 2**24
    model = ModelInventory.of(model) if isinstance(model, nn.Module) else model  # walked once, planned often
    kwargs = dict(plan_kwargs)
    if device_map is not None:
        units = device_map.unit_map if isinstance(device_map, DevicePlan) else device_map
        given: Mapping[str, object] = kwargs.get("overrides") or {}  # type: ignore[assignment]
        kwargs["overrides"] = {**dict(units), **dict(given)}

    def fits(tokens: int) -> bool:
        try:
            result = plan(model, budgets, batch_size=batch_size, context_length=tokens, **kwargs)  # type: ignore[arg-type]
        except PlanError:
            return False
        if any(u.free < 0 for u in result.usage):
            return False
        return allow_offload or device_map is not None or not any(result.offloaded_bytes().values())

    return longest_fit(fits, top)


def position_limit(model: ModelLike) -> int | None:
    """The longest context a model's positions allow, when it says."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "block_size", "max_seq_len"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
