"""Run a pipeline plan across processes and machines with ``torch.distributed.pipelining``.

bigviz plans and loads; torch runs. ``bigviz.plan_pipeline`` cuts a model into stages;
:func:`build_stage` turns one stage into a ``torch.distributed.pipelining.PipelineStage``
on one rank, loading only that stage's tensors through bigviz's checkpoint loader; a torch
schedule (``ScheduleGPipe``, ``Schedule1F1B``) moves micro-batches through the stages.

:func:`generate` runs greedy generation across the stages, each rank keeping the KV cache of
its own layers (a ring of point-to-point sends; see :mod:`bigviz.distributed.generation`).

The command line runs a checkpoint end to end (see ``python -m bigviz.distributed --help``)::

    torchrun --standalone --nproc-per-node 2 -m bigviz.distributed CHECKPOINT \\
        --stages 2 --prompt-ids 1,2,3 --max-new-tokens 16 --microbatches 2 --out tokens.pt

Names are imported on first use, so ``import bigviz.distributed`` stays light.
"""

from __future__ import annotations

from bigviz.core.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "build_stage": "bigviz.distributed.stage",
    "build_stage_module": "bigviz.distributed.stage",
    "check_pipeline": "bigviz.distributed.stage",
    "StageBuild": "bigviz.distributed.stage",
    "empty_model": "bigviz.distributed.models",
    "checkpoint_dtype": "bigviz.distributed.models",
    "decoder_layout": "bigviz.distributed.adapters",
    "DecoderStage": "bigviz.distributed.adapters",
    "DecoderLayout": "bigviz.distributed.adapters",
    "HFStage": "bigviz.distributed.adapters",
    "cache_nbytes": "bigviz.distributed.adapters",
    "generate": "bigviz.distributed.generation",
    "close_process_group": "bigviz.distributed.generation",
    "generation_ids": "bigviz.distributed.generation",
    "GenerateResult": "bigviz.distributed.generation",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("bigviz.distributed", _EXPORTS, globals())
