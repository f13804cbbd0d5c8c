"""Pipeline stages across ranks: ``plan_pipeline`` cuts a model between its no-split blocks.

Example:
    >>> import torch
    >>> from bigviz.models import GPT, GPTConfig
    >>> with torch.device("meta"):
    ...     model = GPT(GPTConfig.preset("gpt-tiny", n_layer=4))
    >>> plan_pipeline(model, 2).split_points
    ('transformer.h.2',)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from bigviz.core.pipeline import PipelinePlan
from bigviz.core.stages import make_pipeline_plan
from bigviz.planning.models import ModelLike, as_tree, default_no_split

__all__ = ["plan_pipeline"]


def plan_pipeline(
    model_or_checkpoint: ModelLike,
    stages: int | Sequence[int | str],
    *,
    no_split_module_classes: Collection[str] | None = None,
    balance: str = "bytes",
    dtype: torch.dtype | str | None = None,
) -> PipelinePlan:
    """Cut a model into pipeline stages (one per rank) between its no-split blocks.

    Stages are contiguous runs of blocks in execution order; embeddings run in the first
    stage, the final norm and head in the last. The largest stage is as small as it can be
    (exact, in n log n), and every cut says why it is there. A tied tensor used in two
    stages (GPT-2's ``wte`` / ``lm_head``) is loaded by both, and the plan says so.

    Args:
        model_or_checkpoint: an ``nn.Module`` (on meta is fine), a :class:`SizeTree`, or a
            checkpoint path (planned from its headers).
        stages: the number of stages, or one byte budget per stage (``["40GiB", "40GiB"]``):
            stages then never exceed their budget and are balanced by fill fraction.
        no_split_module_classes: the blocks; default: the model's ``_no_split_modules`` (or,
            for a checkpoint, its repeated numbered blocks).
        balance: ``"bytes"`` (weights per stage) or ``"compute"`` (estimated FLOPs per token).
        dtype: plan for this dtype, e.g. ``torch.float16``.

    Raises:
        PipelineError: a bad stage count, more stages than blocks, or budgets too small
            (saying which stage does not fit and by how much).

    Example:
        >>> from bigviz.models import GPT, GPTConfig
        >>> with torch.device("meta"):
        ...     model = GPT(GPTConfig.preset("gpt-tiny", n_layer=4))
        >>> pipe = plan_pipeline(model, 2)
        >>> pipe.split_points, pipe.stages[1][-1], pipe.shared[0].leader
        (('transformer.h.2',), 'lm_head', 'transformer.wte.weight')
    """
    tree = as_tree(model_or_checkpoint, dtype)
    no_split = (
        no_split_module_classes if no_split_module_classes is not None else default_no_split(model_or_checkpoint, tree)
    )
    label = str(dtype).removeprefix("torch.") if dtype is not None else None
    return make_pipeline_plan(tree, stages, no_split=list(no_split), balance=balance, dtype=label)
