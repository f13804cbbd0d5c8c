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

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from bigviz.core.counts import check_count
from bigviz.core.errors import PlanError
from bigviz.core.pipeline import PipelinePlan, PipelineRun
from bigviz.core.plan import DevicePlan
from bigviz.core.workload import Workload, longest_fit
from bigviz.planning.inputs import place, planner_inputs, with_workload
from bigviz.planning.models import ModelLike, resolve_model
from bigviz.planning.pipeline import plan_pipeline
from bigviz.planning.positions import position_limit

__all__ = ["max_context", "position_limit"]


def max_context(
    model: ModelLike,
    max_memory: Mapping[Any, object] | None = None,
    batch_size: int = 1,
    *,
    allow_offload: bool = False,
    device_map: DevicePlan | Mapping[str, object] | None = None,
    limit: int | None = None,
    stages: Sequence[int | str] | PipelinePlan | None = None,
    microbatches: int = 1,
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
      included, and only the run must fit beside it;
    * with ``stages`` (one budget per pipeline stage, or a :class:`PipelinePlan` whose cuts
      and budgets to keep; a plan may also be given in place of ``max_memory``), the run of a pipeline: every stage's weights, its layers' KV
      cache for the whole batch and one micro-batch's activations within its budget
      (:func:`bigviz.plan_pipeline`; the cuts move with the context unless a plan is given).

    Args:
        model: what :func:`plan` takes.
        max_memory: budgets, as for :func:`plan`.
        batch_size: sequences run together.
        limit: the largest context worth trying (default: the model's position limit,
            ``max_position_embeddings`` / ``n_positions`` / ``block_size``, else 2**24).
        stages: plan pipeline stages instead of devices (``max_memory`` is then not given).
        microbatches: the pipeline's micro-batches (with ``stages``).
        **plan_kwargs: more :func:`plan` options (``dtype``, ``kv_dtype``, ``encoder_length``,
            ``reserve``, ``strategy``, ...; with ``stages``, those of :func:`bigviz.plan_pipeline`).

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
        >>> max_context(model, stages=["100KB", "100KB"], batch_size=2)   # two ranks of 100 kB each
        6
    """
    if isinstance(max_memory, PipelinePlan):  # max_context(model, pipeline_plan): that plan's stages
        max_memory, stages = None, max_memory
    batch_size = check_count("batch_size", batch_size)
    if limit is not None:
        limit = check_count("limit", limit)
    model = resolve_model(model)
    top = limit if limit is not None else position_limit(model) or 2**24
    with warnings.catch_warnings(record=True) as caught:  # each context tried may warn: said once below
        warnings.simplefilter("always")
        longest = _search(
            model, max_memory, batch_size, allow_offload, device_map, top, stages, microbatches, plan_kwargs
        )
    for message in dict.fromkeys(str(w.message) for w in caught):  # once each, at the caller's line
        category = next(w.category for w in caught if str(w.message) == message)
        warnings.warn(message, category, stacklevel=2)
    return longest


def _search(
    model: Any,
    max_memory: Any,
    batch_size: int,
    allow_offload: bool,
    device_map: DevicePlan | Mapping[str, object] | None,
    top: int,
    stages: Sequence[int | str] | PipelinePlan | None,
    microbatches: int,
    plan_kwargs: Mapping[str, object],
) -> int:
    """:func:`max_context`'s bisection, its arguments read."""
    if stages is not None:
        return _pipeline_context(model, stages, batch_size, microbatches, top, max_memory, plan_kwargs)
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


def _pipeline_context(
    model: ModelLike,
    stages: Sequence[int | str] | PipelinePlan,
    batch_size: int,
    microbatches: int,
    top: int,
    max_memory: object,
    plan_kwargs: Mapping[str, object],
) -> int:
    """The longest context whose pipeline run fits the stages' budgets."""
    budgets = stages.budgets if isinstance(stages, PipelinePlan) else stages
    if max_memory is not None or isinstance(budgets, int) or any(b is None for b in budgets):
        raise PlanError(
            "max_context(stages=...) needs one budget per stage (e.g. stages=['40GiB', '40GiB'] or a "
            "PipelinePlan made with budgets), and no max_memory: the stages are the budgets"
        )
    # invalid arguments are refused here, not read as "does not fit" by the search (which would return 0)
    PipelineRun(batch_size=batch_size, context_length=1, microbatches=microbatches)

    def fits(tokens: int) -> bool:
        try:
            plan_pipeline(
                model,
                stages,
                batch_size=batch_size,
                context_length=tokens,
                microbatches=microbatches,
                **plan_kwargs,  # type: ignore[arg-type]
            )
        except PlanError:
            return False
        return True

    return longest_fit(fits, top)
