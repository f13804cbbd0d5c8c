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

from bigviz.core.errors import PlanError
from bigviz.core.plan import DevicePlan
from bigviz.core.workload import Workload, longest_fit
from bigviz.planning.inputs import place, planner_inputs, with_workload
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
    activations of the prefill, reserves), and:

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
        **plan_kwargs: more :func:`plan` options (``dtype``, ``kv_dtype``, ``strategy``, ...).

    Returns:
        The number of tokens, 0 when not even the weights fit.

    Example:
        >>> import torch
        >>> from bigviz.models import build
        >>> with torch.device("meta"):
        ...     model = build("gpt-tiny")        # 123.5 KiB of weights, block_size 64
        >>> max_context(model, {"cpu": "10MiB"}), max_context(model, {"cpu": 160_000})
        (64, 15)
    """
    model = resolve_model(model)
    top = limit if limit is not None else position_limit(model) or 2**24
    kwargs = dict(plan_kwargs)
    kv_dtype = kwargs.pop("kv_dtype", None)
    if device_map is not None:
        units = device_map.unit_map if isinstance(device_map, DevicePlan) else device_map
        given: Mapping[str, object] = kwargs.get("overrides") or {}  # type: ignore[assignment]
        kwargs["overrides"] = {**dict(units), **dict(given)}
    # prepared once, as bigviz.plan prepares them (the default cpu budget included); each
    # context tried only changes the run planned beside the weights
    inputs = planner_inputs(model, max_memory, **kwargs)  # type: ignore[arg-type]

    def fits(tokens: int) -> bool:
        workload = Workload(batch_size, tokens, None if kv_dtype is None else str(kv_dtype))
        try:
            result = place(with_workload(inputs, workload))
        except PlanError:
            return False
        return result.fits(allow_offload=allow_offload or device_map is not None)

    return longest_fit(fits, top)


def position_limit(model: ModelLike) -> int | None:
    """The longest context a model's positions allow, when it says."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "block_size", "max_seq_len"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
