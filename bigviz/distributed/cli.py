"""``python -m bigviz.distributed``: run a checkpoint as pipeline stages under ``torchrun``.

One machine, two processes (CPU with gloo, or one GPU each with NCCL)::

    torchrun --standalone --nproc-per-node 2 -m bigviz.distributed CHECKPOINT \\
        --stages 2 --input-ids 1,2,3,4 --microbatches 2 --out logits.pt

Several machines: the same command on each, with ``--nnodes N --node-rank R
--rdzv-backend c10d --rdzv-endpoint HOST:PORT`` in place of ``--standalone``.

Every rank checks everything first, identically and from headers alone (the plan, the
checkpoint against the model, the input ids, the output path, the number of processes), so
a bad request fails on every rank before any process loads a weight or joins the group.
Then each rank loads its own stage's tensors, a torch schedule runs the micro-batches, and
rank 0 writes the last position's logits (one row per micro-batch) with ``torch.save``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigviz.core.outputs import input_files, output_problems, write_output

__all__ = ["main", "parse_stages", "parse_ids"]

SCHEDULES = ("gpipe", "1f1b")
MAX_TOKENS = 2**24  # the batch is built in memory: micro-batches x ids tokens


def parse_stages(text: str) -> int | list[str]:
    """``"2"`` -> 2 stages; ``"20GiB,20GiB"`` -> one budget per stage.

    Example:
        >>> parse_stages("3"), parse_stages("8GiB, 4GiB")
        (3, ['8GiB', '4GiB'])
    """
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_ids(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``.

    Raises:
        argparse.ArgumentTypeError: quoting what is not a non-negative integer.

    Example:
        >>> parse_ids("1, 2,3")
        [1, 2, 3]
    """
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if not p.isdigit()]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"--input-ids {text!r}: give token ids as integers >= 0, e.g. 1,2,3,4")
    return [int(p) for p in parts]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bigviz.distributed",
        description="Run a checkpoint as pipeline stages: each rank loads only its stage, a torch schedule runs "
        "the micro-batches, rank 0 writes the last position's logits.",
        epilog="Launch with torchrun, one process per stage: torchrun --standalone --nproc-per-node 2 "
        "-m bigviz.distributed CHECKPOINT --stages 2 --input-ids 1,2,3,4 --out logits.pt",
    )
    parser.add_argument("checkpoint", help="checkpoint folder with config.json (transformers or bigviz)")
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--stages", type=parse_stages, help="number of stages, or per-stage budgets: 20GiB,20GiB")
    how.add_argument("--plan", help="a pipeline plan saved with PipelinePlan.save_json")
    parser.add_argument("--input-ids", type=parse_ids, required=True, help="token ids, e.g. 1,2,3,4")
    parser.add_argument("--microbatches", type=int, default=1, help="micro-batches (the batch repeats the ids)")
    parser.add_argument("--out", required=True, help="where rank 0 writes the last position's logits (torch.save)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out (and --report) if they exist")
    parser.add_argument("--report", default=None, help="also write a JSON report: plan, and per rank what it loaded")
    parser.add_argument("--dtype", default="auto", help="load weights as this dtype; auto: the checkpoint's")
    parser.add_argument("--balance", default="bytes", choices=["bytes", "compute"])
    parser.add_argument(
        "--no-split",
        action="append",
        default=None,
        metavar="PATTERN",
        help="block class or module-name glob (repeatable); default: the model's own",
    )
    parser.add_argument(
        "--split",
        default="auto",
        choices=["auto", "trace", "wrap"],
        help="trace with torch's front end, wrap the stage's modules, or auto (trace, else wrap)",
    )
    parser.add_argument("--schedule", default="gpipe", choices=SCHEDULES)
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    return parser


@dataclass
class _Job:
    """Everything checked, nothing loaded: what every rank runs."""

    args: argparse.Namespace
    rank: int
    world: int
    model: Any
    plan: Any
    dtype: str | None


def _argument_problems(args: argparse.Namespace, world: int | None, rank: int) -> list[str]:
    problems = []
    if args.microbatches < 1:
        problems.append(f"--microbatches {args.microbatches}: give 1 or more")
    elif args.microbatches * len(args.input_ids) > MAX_TOKENS:
        problems.append(
            f"--microbatches {args.microbatches} x {len(args.input_ids)} ids: more than {MAX_TOKENS:,} tokens in one run"
        )
    if rank == 0:  # the writer: its own file system (another machine's may lack the folder)
        inputs = [*input_files(args.checkpoint), *([Path(args.plan)] if args.plan else [])]
        outputs = {"--out": args.out, "--report": args.report}
        problems += output_problems(outputs, overwrite=args.overwrite, inputs=inputs)
    if not Path(args.checkpoint).exists():
        problems.append(f"checkpoint {args.checkpoint} does not exist")
    if world is None:
        problems.append(
            "not launched by torchrun (no WORLD_SIZE): run torchrun --standalone --nproc-per-node "
            "N -m bigviz.distributed ... with N the number of stages"
        )
    return problems


def _prepare(args: argparse.Namespace) -> _Job:
    """Check the request from headers alone; the same on every rank (so all fail together)."""
    from bigviz.core.pipeline import PipelineError, PipelinePlan
    from bigviz.distributed.models import checkpoint_dtype, empty_model
    from bigviz.distributed.stage import check_pipeline
    from bigviz.planning import plan_pipeline

    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    rank = int(os.environ.get("RANK", "0"))
    PipelineError.check(_argument_problems(args, world, rank), "cannot run the pipeline; nothing was loaded")
    model = empty_model(args.checkpoint)
    dtype = checkpoint_dtype(args.checkpoint) if args.dtype == "auto" else args.dtype.removeprefix("torch.")
    if args.plan is not None:
        plan = PipelinePlan.load_json(args.plan)
    else:
        plan = plan_pipeline(
            model, args.stages, no_split_module_classes=args.no_split, balance=args.balance, dtype=dtype
        )
    problems = []
    if world != plan.n_stages:
        problems.append(
            f"{world} processes for a {plan.n_stages}-stage plan: launch one per stage "
            f"(torchrun --nproc-per-node {plan.n_stages})"
        )
    vocab = _vocab_size(model)
    too_big = [i for i in args.input_ids if vocab is not None and i >= vocab]
    if too_big:
        problems.append(f"--input-ids {too_big} are outside the vocabulary (0 .. {vocab - 1})")  # type: ignore[operator]
    PipelineError.check(problems, "cannot run the pipeline; nothing was loaded")
    check_pipeline(model, args.checkpoint, plan, adapter=args.split == "wrap")
    return _Job(args, rank, plan.n_stages, model, plan, dtype)


def _vocab_size(model: Any) -> int | None:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is None:
        config = getattr(model, "config", None)
        return getattr(config, "vocab_size", None)
    return int(embeddings.num_embeddings)


def _run(job: _Job) -> dict[str, Any] | None:
    """Join the group, build and run this rank's stage; rank 0 gets every rank's report."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    from bigviz.distributed.stage import build_stage

    args = job.args
    cuda = torch.cuda.is_available() and args.backend != "gloo"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend or ("nccl" if cuda else "gloo"))
    try:
        batch = torch.tensor([args.input_ids] * args.microbatches, dtype=torch.long, device=device)  # (M, T)
        rss_before = _rss()
        stage = build_stage(
            job.model,
            args.checkpoint,
            job.plan,
            job.rank,
            device=device,
            example_args=(batch[:1],),
            split=args.split,
            dtype=job.dtype,
        )
        schedule = (Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe)(stage, args.microbatches)
        with torch.no_grad():
            out = schedule.step(batch) if job.rank == 0 else schedule.step()
        built = stage.bigviz
        report = {
            "rank": job.rank,
            "stage": built.rank,
            "method": built.method,
            "fallback": built.fallback,
            "device": str(built.device),
            "modules": list(job.plan.stages[job.rank]),
            "loaded": built.loaded,
            "bytes_loaded": built.nbytes,
            "planned_bytes": job.plan.stage_bytes[job.rank],
            "rss_before_load_bytes": rss_before,
            "peak_rss_bytes": _max_rss(),
        }
        if built.rank == job.world - 1:
            logits = out[0] if isinstance(out, (tuple, list)) else out
            report["logits"] = logits[:, -1, :].detach().to("cpu")  # (M, vocab): the last position
        gathered: list[Any] | None = [None] * job.world if job.rank == 0 else None
        dist.gather_object(report, gathered, dst=0)
        return {"ranks": gathered} if job.rank == 0 else None
    finally:
        dist.destroy_process_group()


def _rss() -> int:
    """Resident bytes of this process now (the baseline its stage's load adds to)."""
    from bigviz.modeling.process_memory import rss

    return rss()


def _max_rss() -> int:
    from bigviz.modeling.process_memory import max_rss

    return max_rss()


def _write(job: _Job, result: dict[str, Any]) -> None:
    """Rank 0: the logits with torch.save and the report as JSON, each written atomically with
    the usual permissions, replacing a file only with --overwrite (:mod:`bigviz.core.outputs`)."""
    import torch

    from bigviz.core.serialize import write_json_atomic

    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    logits = next(r.pop("logits") for r in ranks if "logits" in r)
    args = job.args
    write_output(args.out, lambda tmp: torch.save(logits, tmp), overwrite=args.overwrite)
    print(f"wrote {args.out}: logits of the last position, shape {tuple(logits.shape)}, {logits.dtype}")
    if args.report:
        report = {
            "checkpoint": str(args.checkpoint),
            "input_ids": args.input_ids,
            "microbatches": args.microbatches,
            "schedule": args.schedule,
            "dtype": job.dtype,
            "plan": job.plan.to_dict(),
            "ranks": ranks,
        }
        write_output(args.report, lambda tmp: write_json_atomic(report, tmp), overwrite=args.overwrite)
        print(f"wrote {args.report}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: check, run, write. Returns a process exit code (2 for a bad request)."""
    from bigviz.checkpoint.errors import CheckpointError

    args = _parser().parse_args(argv)
    speak = os.environ.get("LOCAL_RANK", "0") == "0"  # once per machine
    try:
        job = _prepare(args)
    except (ValueError, CheckpointError, OSError) as err:  # every check, before any loading
        if speak:
            print(f"bigviz.distributed: {err}", file=sys.stderr)
        return 2
    if job.rank == 0:
        print(job.plan.summary(), flush=True)
    result = _run(job)
    if result is not None:
        for r in sorted(result["ranks"], key=lambda r: r["rank"]):
            print(
                f"rank {r['rank']}: stage {r['stage']} ({r['method']}) loaded {len(r['loaded'])} tensors, "
                f"{r['bytes_loaded']} bytes, on {r['device']}"
            )
        try:
            _write(job, result)
        except OSError as err:  # a file that appeared meanwhile, a full disk: said, not a traceback
            print(f"bigviz.distributed: the run finished but its output was not written: {err}", file=sys.stderr)
            return 1
    return 0
