"""Pipeline stages across ranks: ``plan_pipeline`` cuts a model between its no-split blocks,
counting, when asked, the run each stage holds besides its weights.

Example:
    >>> import torch
    >>> from bigviz.models import GPT, GPTConfig
    >>> with torch.device("meta"):
    ...     model = GPT(GPTConfig.preset("gpt-tiny", n_layer=4))
    >>> plan_pipeline(model, 2).split_points
    ('transformer.h.2',)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from bigviz.core.pipeline import PipelineError, PipelinePlan, PipelineRun
from bigviz.core.stages import cut_pipeline, make_pipeline_plan, over_budget
from bigviz.core.tree import SizeTree
from bigviz.core.workload import RunBytes
from bigviz.core.counts import check_count
from bigviz.planning.inputs import no_split_names
from bigviz.planning.models import ModelLike, as_tree, resolve_model
from bigviz.planning.positions import check_context, position_rule
from bigviz.planning.workload import model_run_spec, with_given

__all__ = ["plan_pipeline", "pipeline_run_bytes", "run_knobs"]


def plan_pipeline(
    model_or_checkpoint: ModelLike,
    stages: int | Sequence[int | str] | PipelinePlan,
    *,
    no_split_module_classes: Collection[str] | str | None = None,
    balance: str = "bytes",
    dtype: torch.dtype | str | None = None,
    batch_size: int = 1,
    context_length: int | None = None,
    kv_dtype: torch.dtype | str | None = None,
    microbatches: int = 1,
    device_type: str = "cuda",
    kv_cache: Mapping[str, int] | None = None,
    activations: Mapping[str, int] | None = None,
) -> PipelinePlan:
    """Cut a model into pipeline stages (one per rank) between its no-split blocks.

    Stages are contiguous runs of blocks in execution order; embeddings run in the first
    stage, the final norm and head in the last. The largest stage is as small as it can be
    (exact, in n log n), and every cut says why it is there. A tied tensor used in two
    stages (GPT-2's ``wte`` / ``lm_head``) is loaded by both, and the plan says so.

    With ``context_length`` the plan counts the run too, by the same per-layer rules as
    :func:`bigviz.plan`: each stage keeps the KV cache of its layers for the whole batch
    (``batch_size`` sequences of ``context_length`` tokens: every micro-batch's cache stays
    on the rank while the others pass), and room for the activations of one micro-batch's
    prefill (a stage runs one micro-batch at a time). Stages are balanced on weights + KV
    cache + activations, budgets hold all three, and a run that cannot fit is refused with
    the numbers per stage.

    Args:
        model_or_checkpoint: an ``nn.Module`` (on meta is fine), a :class:`SizeTree`, or a
            checkpoint path (planned from its headers).
        stages: the number of stages, one byte budget per stage (``["40GiB", "40GiB"]``:
            stages then never exceed their budget and are balanced by fill fraction), or a
            :class:`PipelinePlan` whose cuts and budgets to keep (re-planned for this model
            and run; refused when a stage no longer fits its budget).
        no_split_module_classes: the blocks (class names or module-name globs, checked as
            :func:`bigviz.plan` checks them: ``"Block"`` alone is one class, a name the model
            does not have is refused); default: the model's ``_no_split_modules`` (or, for a
            checkpoint, its repeated numbered blocks).
        balance: ``"bytes"`` (weights, and the run, per stage) or ``"compute"`` (estimated
            FLOPs per token).
        dtype: plan for this dtype, e.g. ``torch.float16``.
        batch_size: sequences in flight, all micro-batches together (with ``context_length``).
        context_length: tokens each sequence's cache holds (a prompt of ``P`` and ``N`` new
            tokens: ``P + N - 1``); ``None`` or 0: weights only. Past a table of positions
            (GPT-2's ``n_positions``) it is refused, past a rotary model's trained length it
            warns, as in :func:`bigviz.plan`.
        kv_dtype: the cache's dtype (default: the compute dtype).
        microbatches: how many micro-batches the batch is cut into.
        device_type: ``"cuda"`` (fused attention kernels) or ``"cpu"`` (PyTorch's reference
            paths, e.g. SDPA's math kernel): the activations differ.
        kv_cache, activations: ``{module: bytes}`` by hand, for a model whose layout bigviz
            does not know (KV cache for the whole batch, activations for one micro-batch).

    Raises:
        PipelineError: a bad stage count, more stages than blocks, or budgets too small for
            the weights or the run (saying which stage does not fit and by how much).
        PlanError: a no-split entry that matches nothing in the model, or a context past the
            model's table of positions.

    Example:
        >>> from bigviz.models import GPT, GPTConfig
        >>> with torch.device("meta"):
        ...     model = GPT(GPTConfig.preset("gpt-tiny", n_layer=4))
        >>> pipe = plan_pipeline(model, 2)
        >>> pipe.split_points, pipe.stages[1][-1], pipe.shared[0].leader
        (('transformer.h.2',), 'lm_head', 'transformer.wte.weight')
        >>> run = plan_pipeline(model, 2, batch_size=4, context_length=64, microbatches=2)
        >>> run.stage_kv          # 2 layers x 4 sequences x 64 tokens x (k + v) x 32 wide x 4 bytes
        (131072, 131072)
    """
    model_or_checkpoint = resolve_model(model_or_checkpoint)
    tree = as_tree(model_or_checkpoint, dtype)
    keep = stages if isinstance(stages, PipelinePlan) else None
    given = no_split_module_classes if no_split_module_classes is not None else (keep.no_split if keep else None)
    # the check bigviz.plan makes: a typo (or a class of another model) would cut inside blocks silently
    no_split = no_split_names(model_or_checkpoint, tree, given)
    if context_length:  # past a table of positions there is no position: refused as bigviz.plan refuses it
        check_context(position_rule(model_or_checkpoint), check_count("context_length", context_length, minimum=0))
    label = str(dtype).removeprefix("torch.") if dtype is not None else (keep.dtype if keep is not None else None)
    run = _run(batch_size, context_length, kv_dtype, microbatches, device_type, kv_cache, activations)
    counted = pipeline_run_bytes(
        model_or_checkpoint, tree, run, dtype=dtype, kv_cache=kv_cache, activations=activations
    )
    knobs = dict(no_split=no_split, dtype=label, run=run, **run_knobs(counted))
    if keep is None:
        return make_pipeline_plan(tree, stages, balance=balance, **knobs)  # type: ignore[arg-type]
    plan = cut_pipeline(tree, keep.split_points, balance=keep.balance, budgets=keep.budgets, **knobs)  # type: ignore[arg-type]
    PipelineError.check(
        over_budget(plan),
        f"the {plan.n_stages} stages of this plan do not hold {'the run' if run else 'the weights'} within their budgets",
        fix="Fix: shorten the context or the batch, use more micro-batches (activations), a smaller KV cache "
        "dtype, or plan the stages again (bigviz.plan_pipeline(model, budgets, ...))",
    )
    return plan


def _run(
    batch_size: int,
    context_length: int | None,
    kv_dtype: torch.dtype | str | None,
    microbatches: int,
    device_type: str,
    kv_cache: Mapping[str, int] | None,
    activations: Mapping[str, int] | None,
) -> PipelineRun | None:
    """The run to plan, or None for weights only (no context, no bytes given by hand)."""
    run = PipelineRun(
        batch_size=batch_size,
        context_length=context_length or 0,
        kv_dtype=None if kv_dtype is None else str(kv_dtype).removeprefix("torch."),
        microbatches=microbatches,
        device_type=device_type,
    )
    return run if run.context_length or kv_cache is not None or activations is not None else None


def pipeline_run_bytes(
    model: ModelLike,
    tree: SizeTree,
    run: PipelineRun | None,
    *,
    dtype: object = None,
    kv_cache: Mapping[str, int] | None = None,
    activations: Mapping[str, int] | None = None,
) -> RunBytes | None:
    """The bytes per module of a pipeline's run: the caches of the whole batch, the
    activations and held outputs (the input embeddings) of one micro-batch's prefill; None
    without a run. Read from the model by the rules of :func:`bigviz.plan` (the same
    :class:`~bigviz.core.workload.RunBytes`, bytes given by hand as
    :func:`~bigviz.planning.workload.with_given` takes them), so a stage holding the whole
    model charges what ``bigviz.plan`` charges one device.

    Example:
        >>> from bigviz.models import build
        >>> with torch.device("meta"):
        ...     model = build("gpt-tiny")
        >>> run = pipeline_run_bytes(model, as_tree(model), PipelineRun(batch_size=2, context_length=8))
        >>> run.kv_cache["transformer.h.0"], sorted(run.activations)[-1]
        (4096, 'transformer.h.1')
    """
    if run is None:
        return None
    if kv_cache is not None and activations is not None:
        return RunBytes(dict(kv_cache), dict(activations))
    spec = model_run_spec(model, tree, dtype=dtype, device_type=run.device_type)
    whole = with_given(RunBytes.of(spec, run.workload()), kv_cache, activations)
    micro = with_given(RunBytes.of(spec, run.workload(microbatch=True)), kv_cache, activations)
    return RunBytes(whole.kv_cache, micro.activations, micro.held)


def run_knobs(run: RunBytes | None) -> dict[str, Mapping[str, int] | None]:
    """``kv_cache``, ``activations`` and ``held`` for :func:`~bigviz.core.stages.make_pipeline_plan`
    and :func:`~bigviz.core.stages.cut_pipeline` (all None without a run: weights only)."""
    if run is None:
        return {"kv_cache": None, "activations": None, "held": None}
    return {"kv_cache": run.kv_cache, "activations": run.activations, "held": run.held}
