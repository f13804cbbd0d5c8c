"""One rank of the pipelined-generate test, launched by torchrun (see
``tests/distributed/test_pipeline_distributed.py``): for each checkpoint, build this rank's stage, generate
through the pipeline with bigviz's Python API, and gather every rank's cache bytes and what it
kept on meta. Rank 0 writes the tokens and the numbers to OUT with ``torch.save``.

Usage: torchrun --nproc-per-node 2 tests/distributed/pipeline_worker.py OUT NEW MICROBATCHES PROMPT CKPT...

PROMPT is one prompt (``1,2,3``), repeated once per micro-batch, or several of any lengths
(``1,2,3;4,5``), left padded with 0 and given with their attention mask.
"""

from __future__ import annotations

import sys


def main(out: str, new: int, microbatches: int, prompt: str, folders: list[str]) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import bigviz
    from bigviz.distributed import build_stage_module, close_process_group, empty_model, generate
    from bigviz.distributed.models import generation_config
    from bigviz.distributed.generation import generation_ids

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [[int(i) for i in p.split(",")] for p in prompt.split(";")]
    rows = rows * microbatches if len(rows) == 1 else rows
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows]) if ";" in prompt else None
    results = {}
    for folder in folders:
        model = empty_model(folder)
        context = ids.shape[1] + new - 1
        plan = bigviz.plan_pipeline(
            model, world, batch_size=len(ids), context_length=context, microbatches=microbatches
        )
        built = build_stage_module(model, folder, plan, rank, split="wrap")
        held = {id(t) for t in (*built.module.parameters(), *built.module.buffers())}
        strays = [n for n, p in model.named_parameters() if id(p) not in held and not p.is_meta]
        eos = generation_ids(generation_config(folder)) if generation_config(folder) is not None else {}
        padded = {"attention_mask": mask} if rank == 0 and mask is not None else {}
        result = generate(built, ids if rank == 0 else None, new, microbatches=microbatches, **eos, **padded)
        mine = {"cache_bytes": result.cache_bytes, "planned_kv": plan.kv_of(rank), "strays": strays[:5]}
        gathered: list[object] = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            results[folder] = {"tokens": result.tokens, "ranks": gathered}
    if rank == 0:
        torch.save(results, out)
    close_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:])
