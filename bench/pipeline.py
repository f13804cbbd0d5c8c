"""Benchmark: memory per rank of a two-stage pipeline, bigviz against every rank loading the
whole checkpoint.

Builds a GPT-2 checkpoint once (default gpt2-medium: 355M parameters, 1.4 GB fp32, 500 MB
safetensors shards, with its config.json) in ``bench/_work/``, then runs two processes under
``torchrun`` on this CPU (gloo), twice:

- bigviz: ``python -m bigviz.distributed CKPT --stages 2``: each rank builds the model on meta
  and loads only its stage's tensors (memory-mapped safetensors);
- the usual way with ``torch.distributed.pipelining`` alone: each rank loads the whole
  checkpoint (``safetensors.torch.load_file`` of every shard into the model), then
  ``pipeline()`` + ``SplitPoint`` keep its stage; same cut as bigviz's plan.

Both run the same 2 micro-batches through ``ScheduleGPipe``. Per rank: peak RSS above the
rank's RSS just before loading (``ru_maxrss``), against the stage's planned bytes and the
model's bytes; and the logits of both runs, which must be equal.

Usage:
    .venv/bin/python bench/pipeline.py [--preset gpt2-medium] [--shard 500MB]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WORK = Path(__file__).resolve().parent / "_work"
IDS = "464,3290,318,257,922,1110,13,632"  # 8 token ids
GOAL = 0.75  # bigviz peak above baseline / model bytes, per rank, for 2 stages (a stage is ~0.5)


def ensure_checkpoint(preset: str, shard: str) -> Path:
    folder = WORK / f"{preset}-pipeline"
    if (folder / "config.json").exists():
        return folder
    import torch

    import bigviz
    from bigviz.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(preset)).eval()
    bigviz.save_sharded(model, folder, max_shard_size=shard, config=model.config, progress=False)
    return folder


def torchrun(*args: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(args[:3])} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def naive_worker(checkpoint: str, out: str) -> None:
    """One rank of the usual way: the whole checkpoint in memory, then torch's tracer keeps a stage."""
    import safetensors.torch
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, SplitPoint, pipeline

    import bigviz
    from bigviz.distributed import empty_model
    from bigviz.modeling.process_memory import max_rss, rss

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = empty_model(checkpoint)
    split = bigviz.plan_pipeline(model, 2).split_points[0]
    before = rss()
    state: dict[str, torch.Tensor] = {}
    for file in bigviz.CheckpointIndex.open(checkpoint).files:
        state.update(safetensors.torch.load_file(file))
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    del state
    batch = torch.tensor([[int(i) for i in IDS.split(",")]] * 2)
    pipe = pipeline(model, mb_args=(batch[:1],), split_spec={split: SplitPoint.BEGINNING})
    stage = PipelineStage(pipe.get_stage_module(rank), rank, 2, torch.device("cpu"))
    with torch.no_grad():
        logits = ScheduleGPipe(stage, 2).step(batch) if rank == 0 else ScheduleGPipe(stage, 2).step()
    report = {"rank": rank, "rss_before_load_bytes": before, "peak_rss_bytes": max_rss()}
    if rank == 1:
        report["logits"] = logits[:, -1].tolist()
    gathered = [None, None] if rank == 0 else None
    dist.gather_object(report, gathered, dst=0)
    if rank == 0:
        Path(out).write_text(json.dumps({"ranks": gathered}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="gpt2-medium")
    parser.add_argument("--shard", default="500MB")
    parser.add_argument("--naive-worker", nargs=2, metavar=("CHECKPOINT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.naive_worker:
        naive_worker(*args.naive_worker)
        return
    import torch

    import bigviz

    ckpt = ensure_checkpoint(args.preset, args.shard)
    total = bigviz.CheckpointIndex.open(ckpt).total_bytes
    with tempfile.TemporaryDirectory() as tmp:
        torchrun(
            "-m",
            "bigviz.distributed",
            str(ckpt),
            "--stages",
            "2",
            "--input-ids",
            IDS,
            "--microbatches",
            "2",
            "--split",
            "wrap",
            "--out",
            f"{tmp}/logits.pt",
            "--report",
            f"{tmp}/bigviz.json",
        )
        torchrun(__file__, "--naive-worker", str(ckpt), f"{tmp}/naive.json")
        ours = json.loads(Path(f"{tmp}/bigviz.json").read_text())
        theirs = json.loads(Path(f"{tmp}/naive.json").read_text())
        same = torch.equal(
            torch.load(f"{tmp}/logits.pt"), torch.tensor(next(r["logits"] for r in theirs["ranks"] if "logits" in r))
        )
    print(
        f"{args.preset} checkpoint: {total / 1e9:.2f} GB fp32; two ranks on this CPU (gloo), 2 micro-batches of "
        f"8 tokens; logits of both runs equal: {same}\n"
    )
    print(
        "| rank | stage bytes (GB) | bigviz peak above baseline (GB) | whole checkpoint per rank (GB) | "
        "bigviz / model | whole / model |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    worst = 0.0
    for mine, other in zip(
        sorted(ours["ranks"], key=lambda r: r["rank"]), sorted(theirs["ranks"], key=lambda r: r["rank"])
    ):
        a = mine["peak_rss_bytes"] - mine["rss_before_load_bytes"]
        b = other["peak_rss_bytes"] - other["rss_before_load_bytes"]
        worst = max(worst, a / total)
        print(
            f"| {mine['rank']} | {mine['planned_bytes'] / 1e9:.2f} | {a / 1e9:.2f} | {b / 1e9:.2f} | "
            f"{a / total:.2f}x | {b / total:.2f}x |"
        )
    print(
        f"\nbigviz's largest rank holds {worst:.2f}x the model above its baseline (goal <= {GOAL}x for 2 stages: "
        f"{'met' if worst <= GOAL else 'not met'}). RSS counts the stage's memory-mapped weights once read."
    )


if __name__ == "__main__":
    main()
