"""``python -m bigviz.distributed``: run a checkpoint as pipeline stages under ``torchrun``.

Generate across stages (each rank keeps the KV cache of its own layers)::

    torchrun --standalone --nproc-per-node 2 -m bigviz.distributed CHECKPOINT \\
        --stages 2 --prompt-ids 1,2,3 --max-new-tokens 16 --microbatches 2 --out tokens.pt

or run one forward (torch's pipeline schedules) and keep the last position's logits::

    torchrun --standalone --nproc-per-node 2 -m bigviz.distributed CHECKPOINT \\
        --stages 2 --input-ids 1,2,3,4 --microbatches 2 --out logits.pt

Several machines: the same command on each, with ``--nnodes N --node-rank R
--rdzv-backend c10d --rdzv-endpoint HOST:PORT`` in place of ``--standalone``.

Every rank checks everything first from headers alone (the stage plan with the run it must
hold, the checkpoint against the model, the ids, the context against the model's positions,
the number of processes; rank 0, which writes, the output paths), then the ranks join the
process group and share what they found, before any of them loads a weight: a bad request
is said once, by rank 0, and every rank exits. Every collective and every send between
stages waits at most ``--timeout`` seconds, so a rank that dies does not leave the others
hanging. Then each rank loads its own stage's tensors and runs; rank 0 writes the tokens
(or logits) with ``torch.save`` and, with ``--report``, a JSON file with the plan and what
each rank loaded, held and measured.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigviz.core.dtypes import load_dtype
from bigviz.checkpoint.outputs import input_files, output_problems, write_output

__all__ = ["main", "parse_stages", "parse_ids"]

SCHEDULES = ("gpipe", "1f1b")
DEFAULT_TIMEOUT_S = 1800  # torch's own default for gloo; loading a large stage can take minutes
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
        raise argparse.ArgumentTypeError(f"{text!r}: give token ids as integers >= 0, e.g. 1,2,3,4")
    return [int(p) for p in parts]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bigviz.distributed",
        description="Run a checkpoint as pipeline stages, one per process: each rank loads only its stage. "
        "--prompt-ids generates (greedy, each rank keeping the KV cache of its layers); --input-ids runs one "
        "forward with a torch schedule. Rank 0 writes the result.",
        epilog="Launch with torchrun, one process per stage: torchrun --standalone --nproc-per-node 2 "
        "-m bigviz.distributed CHECKPOINT --stages 2 --prompt-ids 1,2,3 --max-new-tokens 16 --out tokens.pt",
    )
    parser.add_argument("checkpoint", help="checkpoint folder with config.json (transformers or bigviz)")
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--stages", type=parse_stages, help="number of stages, or per-stage budgets: 20GiB,20GiB")
    how.add_argument("--plan", help="a pipeline plan saved with PipelinePlan.save_json")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--prompt-ids",
        type=parse_ids,
        action="append",
        help="generate from this prompt, e.g. 1,2,3; repeat it for a batch of prompts of any lengths (left padded "
        "with the pad token, with their attention mask, as generate takes them)",
    )
    what.add_argument("--input-ids", type=parse_ids, help="run one forward of these ids, e.g. 1,2,3,4")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens to generate (with --prompt-ids)")
    parser.add_argument("--microbatches", type=int, default=1, help="micro-batches in flight")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="sequences (one --prompt-ids repeated), cut into the micro-batches; default: one per micro-batch "
        "(several --prompt-ids: the batch is those prompts)",
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="generate --max-new-tokens tokens even after an end-of-sequence token"
    )
    parser.add_argument("--out", required=True, help="where rank 0 writes the tokens or the logits (torch.save)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out (and --report) if they exist")
    parser.add_argument("--report", default=None, help="also write a JSON report: plan, and per rank what it did")
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
        help="trace with torch's front end, wrap the stage's modules, or auto (trace, else wrap); "
        "generation always wraps (a traced stage keeps no cache)",
    )
    parser.add_argument("--schedule", default=None, choices=SCHEDULES, help="the forward's schedule (default gpipe)")
    parser.add_argument("--backend", default=None, help="gloo or nccl (default: nccl with CUDA, else gloo)")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds any rank waits for another (default 1800)"
    )
    return parser


@dataclass(frozen=True)
class _Env:
    """Where this process runs, as torchrun says (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``)."""

    world: int | None
    rank: int
    local_rank: int
    joinable: bool  # torchrun's rendezvous is there: the ranks can share what they found

    @classmethod
    def read(cls) -> _Env:
        env = os.environ
        world = int(env["WORLD_SIZE"]) if env.get("WORLD_SIZE", "").isdigit() else None
        joinable = world is not None and bool(env.get("MASTER_ADDR")) and bool(env.get("MASTER_PORT"))
        return cls(world, int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0")), joinable)


@dataclass
class _Job:
    """Everything checked, nothing loaded: what every rank runs."""

    args: argparse.Namespace
    rank: int
    world: int
    model: Any
    plan: Any
    dtype: str | None
    device_type: str
    eos: dict[str, Any]
    pad: int = 0  # the token left padding puts before a shorter prompt (the generation config's pad token)
    saved: Any = None  # the plan given with --plan, as saved (job.plan: re-planned for the run)

    @property
    def generating(self) -> bool:
        return self.args.prompt_ids is not None

    @property
    def prompts(self) -> list[list[int]]:
        """Every prompt given (``--prompt-ids`` once or more); empty for a forward."""
        return list(self.args.prompt_ids or [])

    @property
    def batch_size(self) -> int:
        if len(self.prompts) > 1:
            return len(self.prompts)
        return self.args.batch_size or self.args.microbatches

    @property
    def ids(self) -> list[int]:
        """The ids of a forward, or the longest prompt (the positions the run needs)."""
        return max(self.prompts, key=len) if self.generating else self.args.input_ids

    def batch(self) -> tuple[list[list[int]], list[list[int]] | None]:
        """The rows of the batch, and their attention mask when some are padded: one prompt
        repeated ``batch_size`` times, or several left padded with the pad token."""
        if len(self.prompts) <= 1:
            return [self.ids] * self.batch_size, None
        width = max(len(p) for p in self.prompts)
        rows = [[self.pad] * (width - len(p)) + p for p in self.prompts]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in self.prompts]
        return rows, (mask if any(0 in m for m in mask) else None)

    @property
    def context(self) -> int:
        """Positions the run uses: the prompt and every new token but the last."""
        return len(self.ids) + (max(self.args.max_new_tokens or 1, 1) - 1 if self.generating else 0)


def _argument_problems(args: argparse.Namespace, env: _Env) -> list[str]:
    problems = []
    if args.microbatches < 1:
        problems.append(f"--microbatches {args.microbatches}: give 1 or more")
    if args.batch_size is not None and args.batch_size < max(args.microbatches, 1):
        problems.append(
            f"--batch-size {args.batch_size}: give at least one sequence per micro-batch (>= --microbatches)"
        )
    if args.prompt_ids is not None and (args.max_new_tokens is None or args.max_new_tokens < 1):
        problems.append("--prompt-ids generates: give --max-new-tokens N (1 or more)")
    if args.input_ids is not None and args.max_new_tokens is not None:
        problems.append("--max-new-tokens is for --prompt-ids (generate); --input-ids runs one forward")
    if args.prompt_ids is not None and args.schedule is not None:
        problems.append("--schedule is for --input-ids (a forward); generation sends between stages itself")
    if args.prompt_ids is not None and args.split == "trace":
        problems.append("--split trace keeps no KV cache: generation runs the stage's own modules (wrap)")
    if args.timeout <= 0:
        problems.append(f"--timeout {args.timeout}: give seconds > 0")
    if args.dtype != "auto":
        try:  # the loaders' one rule, here before any rank joins the group (it was a traceback after)
            load_dtype(args.dtype, name="--dtype")
        except ValueError as err:
            problems.append(str(err))
    prompts = args.prompt_ids or []
    if len(prompts) > 1 and args.batch_size is not None:
        problems.append(
            f"--batch-size {args.batch_size} repeats one prompt; with {len(prompts)} --prompt-ids the batch is those "
            "prompts: leave --batch-size out"
        )
    if len(prompts) > 1 and args.microbatches > len(prompts):
        problems.append(
            f"--microbatches {args.microbatches} for {len(prompts)} prompts: give at least one prompt per micro-batch"
        )
    ids = max(prompts, key=len) if prompts else args.input_ids
    rows = len(prompts) if len(prompts) > 1 else (args.batch_size or max(args.microbatches, 1))
    tokens = rows * (len(ids or ()) + (args.max_new_tokens or 0))
    if tokens > MAX_TOKENS:
        problems.append(f"batch x (ids + new tokens) = {tokens:,} tokens: more than {MAX_TOKENS:,} in one run")
    if not Path(args.checkpoint).exists():
        problems.append(f"checkpoint {args.checkpoint} does not exist")
    if env.world is None:
        problems.append(
            "not launched by torchrun (no WORLD_SIZE): run torchrun --standalone --nproc-per-node "
            "N -m bigviz.distributed ... with N the number of stages"
        )
    elif not env.joinable:
        problems.append("WORLD_SIZE is set but not MASTER_ADDR and MASTER_PORT: launch the processes with torchrun")
    return problems


def _output_problems(args: argparse.Namespace) -> list[str]:
    """Rank 0 writes: the command line's one rule for written files (:mod:`bigviz.checkpoint.outputs`):
    never an input, never an existing file without ``--overwrite``, in a folder that exists."""
    inputs = [*input_files(args.checkpoint), *([Path(args.plan)] if args.plan else [])]
    return output_problems({"--out": args.out, "--report": args.report}, overwrite=args.overwrite, inputs=inputs)


def _prepare(args: argparse.Namespace, env: _Env) -> tuple[_Job | None, list[str]]:
    """Check the request from headers alone: the same on every rank, and the output paths on
    rank 0. Returns the job (when the checks got that far) and every problem found."""
    from bigviz.checkpoint.errors import CheckpointError

    problems = _argument_problems(args, env) + (_output_problems(args) if env.rank == 0 else [])
    if not Path(args.checkpoint).exists():
        return None, problems
    errors = (ValueError, CheckpointError, OSError, ImportError)  # PipelineError and PlanError too
    try:
        job = _job(args, env)
    except errors as err:
        return None, [*problems, str(err)]
    problems += _request_problems(job, env)
    try:
        from bigviz.distributed.stage import check_pipeline

        adapter = job.generating or args.split == "wrap"
        check_pipeline(job.model, args.checkpoint, job.saved or job.plan, adapter=adapter)
    except errors as err:
        problems.append(str(err))
    return job, problems


def _job(args: argparse.Namespace, env: _Env) -> _Job:
    """The model on meta, the dtype and the stage plan counting the run."""
    import torch

    from bigviz.core.errors import PlanError
    from bigviz.core.pipeline import PipelinePlan
    from bigviz.distributed.models import checkpoint_dtype, empty_model, generation_config
    from bigviz.planning import plan_pipeline

    model = empty_model(args.checkpoint)
    dtype = checkpoint_dtype(args.checkpoint) if args.dtype == "auto" else args.dtype.removeprefix("torch.")
    cuda = torch.cuda.is_available() and args.backend != "gloo"
    job = _Job(args, env.rank, env.world or 1, model, None, dtype, "cuda" if cuda else "cpu", {})
    job.saved = PipelinePlan.load_json(args.plan) if args.plan is not None else None
    stages = job.saved or args.stages
    knobs: dict[str, Any] = dict(no_split_module_classes=args.no_split, balance=args.balance, dtype=dtype)
    from bigviz.planning.positions import position_rule

    rule = position_rule(model)
    table = rule.tokens if rule is not None and rule.table else None
    # past a table of positions plan_pipeline refuses; the request's check names it in the flags' terms
    context = min(job.context, table) if table is not None else job.context
    run = dict(batch_size=job.batch_size, context_length=context, microbatches=args.microbatches)
    try:
        kv = None if job.generating else {}  # a forward keeps no cache
        job.plan = plan_pipeline(model, stages, **knobs, **run, device_type=job.device_type, kv_cache=kv)
    except ValueError as err:
        if job.generating or isinstance(err, PlanError):
            raise
        job.plan = plan_pipeline(model, stages, **knobs)  # a forward of a model whose run bigviz cannot read
    if job.generating:
        from bigviz.distributed.generation import generation_ids

        said = generation_ids(generation_config(args.checkpoint))
        job.pad = said["pad_token_id"] if said["pad_token_id"] is not None else 0
        job.eos = {} if args.ignore_eos else said
    return job


def _request_problems(job: _Job, env: _Env) -> list[str]:
    """The request against the model and the plan: processes, ids, positions, schedule."""
    from bigviz.planning.positions import position_rule

    args, plan, problems = job.args, job.plan, []
    if env.world is not None and env.world != plan.n_stages:
        problems.append(
            f"{env.world} processes for a {plan.n_stages}-stage plan: launch one per stage "
            f"(torchrun --nproc-per-node {plan.n_stages})"
        )
    flag = "--prompt-ids" if job.generating else "--input-ids"
    vocab = _vocab_size(job.model)
    outside = sorted({i for ids in (job.prompts or [job.ids]) for i in ids if vocab is not None and i >= vocab})
    if outside:
        problems.append(f"{flag} {outside} are outside the vocabulary (0 .. {vocab - 1})")  # type: ignore[operator]
    rule = position_rule(job.model)
    limit = rule.tokens if rule is not None and rule.table else None  # past a trained length: planned, noted
    if limit is not None and job.context > limit:
        what = f"{len(job.ids)} prompt tokens + {args.max_new_tokens} new" if job.generating else f"{len(job.ids)} ids"
        problems.append(
            f"{flag}: {what} need {job.context} positions and {type(job.model).__name__} has {limit}: "
            f"shorten the prompt{' or --max-new-tokens' if job.generating else ''}"
        )
    from bigviz.modeling.twin import is_transformers_model

    _, mask = job.batch()
    if mask is not None and not is_transformers_model(job.model):
        problems.append(
            f"--prompt-ids of {sorted({len(p) for p in job.prompts})} tokens need padding, and {type(job.model).__name__} "
            "(bigviz's own model) takes no attention mask: give prompts of one length, or run them separately"
        )
    if args.schedule == "1f1b" and args.microbatches < plan.n_stages:
        problems.append(
            f"--schedule 1f1b needs at least as many micro-batches as stages ({args.microbatches} < "
            f"{plan.n_stages}): give --microbatches {plan.n_stages} or more, or --schedule gpipe"
        )
    return problems


def _vocab_size(model: Any) -> int | None:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is None:
        config = getattr(model, "config", None)
        return getattr(config, "vocab_size", None)
    return int(embeddings.num_embeddings)


# ---- the group: joined before anything loads ------------------------------------------
def _join(args: argparse.Namespace, env: _Env) -> Any:
    """Join the process group (every collective and send then waits at most ``--timeout``)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and args.backend != "gloo"
    if cuda:
        torch.cuda.set_device(torch.device("cuda", env.local_rank))
    timeout = timedelta(seconds=args.timeout if args.timeout > 0 else DEFAULT_TIMEOUT_S)
    dist.init_process_group(args.backend or ("nccl" if cuda else "gloo"), timeout=timeout)
    return dist.group.WORLD


def _agree(problems: list[str], joined: bool) -> list[str]:
    """Every rank's problems, on every rank (a problem only one rank sees stops them all)."""
    if not joined:
        return problems
    from bigviz.distributed.generation import shared_problems

    return shared_problems(problems)


def _leave(joined: bool, *, failed: bool = False) -> None:
    """Leave the group: after a barrier when this rank finished (see ``close_process_group``);
    at once when it failed (the others may never reach a barrier; torchrun stops them)."""
    if joined:
        import torch.distributed as dist

        from bigviz.distributed.generation import close_process_group

        close_process_group() if not failed else dist.destroy_process_group()


# ---- running ------------------------------------------------------------------------------
def _run(job: _Job) -> dict[str, Any] | None:
    """Build and run this rank's stage; rank 0 gets every rank's report."""
    import torch
    import torch.distributed as dist

    from bigviz.distributed.stage import build_stage_module
    from bigviz.modeling.process_memory import PeakMemory, max_rss

    args = job.args
    device = torch.device("cuda", torch.cuda.current_device()) if job.device_type == "cuda" else torch.device("cpu")
    rows, mask = job.batch()
    batch = torch.tensor(rows, dtype=torch.long, device=device)  # (B, T)
    split = "wrap" if job.generating else args.split
    with PeakMemory(("RssAnon", "VmRSS"), interval=0.01) as peak:
        built = build_stage_module(
            job.model, args.checkpoint, job.plan, job.rank, device=device, example_args=(batch[:1],), split=split,
            dtype=job.dtype,
        )  # fmt: skip
        loaded = peak.take()
        if job.generating:
            attention = torch.tensor(mask, dtype=torch.long, device=device) if mask is not None else None
            report = _generate(job, built, batch, attention)
        else:
            report = _forward(job, built, batch)
    report |= _stage_report(job, built) | {
        "rss_before_load_bytes": peak.base["VmRSS"],
        "anon_before_load_bytes": peak.base["RssAnon"],
        "load_peak_anon_above_bytes": loaded["RssAnon"] - peak.base["RssAnon"],
        "peak_anon_above_bytes": max(loaded["RssAnon"], peak.peak["RssAnon"]) - peak.base["RssAnon"],
        "peak_rss_above_bytes": max(loaded["VmRSS"], peak.peak["VmRSS"]) - peak.base["VmRSS"],
        "peak_rss_bytes": max_rss(),
    }
    gathered: list[Any] | None = [None] * job.world if job.rank == 0 else None
    dist.gather_object(report, gathered, dst=0)
    return {"ranks": gathered} if job.rank == 0 else None


def _stage_report(job: _Job, built: Any) -> dict[str, Any]:
    plan, r = job.plan, job.rank
    return {
        "rank": r,
        "stage": built.rank,
        "method": built.method,
        "fallback": built.fallback,
        "device": str(built.device),
        "modules": list(plan.stages[r]),
        "loaded": built.loaded,
        "bytes_loaded": built.nbytes,
        "planned_bytes": plan.stage_bytes[r],
        "planned_kv_bytes": plan.kv_of(r),
        "planned_activation_bytes": plan.activations_of(r),
    }


def _forward(job: _Job, built: Any, batch: Any) -> dict[str, Any]:
    """One forward of the micro-batches with torch's schedule; the last rank keeps the logits."""
    import time

    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(built.module, built.rank, built.n_stages, built.device)
    schedule = (Schedule1F1B if job.args.schedule == "1f1b" else ScheduleGPipe)(stage, job.args.microbatches)
    start = time.perf_counter()
    with torch.no_grad():
        out = schedule.step(batch) if job.rank == 0 else schedule.step()
    report: dict[str, Any] = {"wall_s": time.perf_counter() - start}
    if built.rank == job.world - 1:
        logits = out[0] if isinstance(out, (tuple, list)) else out
        report["result"] = logits[:, -1, :].detach().to("cpu")  # (B, vocab): the last position
    return report


def _generate(job: _Job, built: Any, batch: Any, mask: Any = None) -> dict[str, Any]:
    """Greedy generation across the stages (``mask``: the padded prompts' attention mask);
    rank 0 keeps the tokens."""
    from bigviz.distributed.generation import generate

    prompt = batch if job.rank == 0 else None
    padded = {"attention_mask": mask} if job.rank == 0 and mask is not None else {}
    result = generate(built, prompt, job.args.max_new_tokens, microbatches=job.args.microbatches, **job.eos, **padded)
    report: dict[str, Any] = {
        "cache_bytes": result.cache_bytes,
        "busy_s": result.busy_s,
        "wall_s": result.wall_s,
        "idle": result.idle,
    }
    if result.tokens is not None:
        report["result"] = result.tokens.to("cpu")
    return report


# ---- writing ------------------------------------------------------------------------------
def _write(job: _Job, result: dict[str, Any]) -> None:
    """Rank 0: the tokens (or logits) with torch.save and the report as JSON, each written atomically with
    the usual permissions, replacing a file only with --overwrite (:mod:`bigviz.checkpoint.outputs`)."""
    import torch

    from bigviz.core.serialize import write_json_atomic

    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    out = next(r.pop("result") for r in ranks if "result" in r)
    args = job.args
    write_output(args.out, lambda tmp: torch.save(out, tmp), overwrite=args.overwrite)
    what = "token ids (prompt and new tokens)" if job.generating else "logits of the last position"
    print(f"wrote {args.out}: {what}, shape {tuple(out.shape)}, {out.dtype}")
    if args.report:
        report = {
            "checkpoint": str(args.checkpoint),
            "mode": "generate" if job.generating else "forward",
            "ids": job.prompts if len(job.prompts) > 1 else job.ids,
            "max_new_tokens": args.max_new_tokens,
            "batch_size": job.batch_size,
            "microbatches": args.microbatches,
            "schedule": args.schedule,
            "dtype": job.dtype,
            "eos": job.eos,
            "plan": job.plan.to_dict(),
            "predicted_bubble": job.plan.bubble(passes=args.max_new_tokens or 1),
            "ranks": ranks,
        }
        write_output(args.report, lambda tmp: write_json_atomic(report, tmp), overwrite=args.overwrite)
        print(f"wrote {args.report}")


def _say(job: _Job, result: dict[str, Any]) -> None:
    for r in sorted(result["ranks"], key=lambda r: r["rank"]):
        held = f", KV cache {r['cache_bytes']} bytes (planned {r['planned_kv_bytes']})" if "cache_bytes" in r else ""
        print(
            f"rank {r['rank']}: stage {r['stage']} ({r['method']}) loaded {len(r['loaded'])} tensors, "
            f"{r['bytes_loaded']} bytes, on {r['device']}{held}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: check, agree, run, write. Returns a process exit code (2 for a bad request)."""
    args = _parser().parse_args(argv)
    env = _Env.read()
    job, problems = _prepare(args, env)
    joined = env.joinable and env.world is not None and env.world > 0
    if joined:
        _join(args, env)
    problems = _agree(problems, joined)
    if problems or job is None:
        if env.rank == 0:
            from bigviz.core.errors import format_problems

            text = format_problems("cannot run the pipeline; nothing was loaded", problems or ["(no job)"])
            print(f"bigviz.distributed: {text}", file=sys.stderr)
        _leave(joined)
        return 2
    failed = True
    try:
        if job.rank == 0:
            print(job.plan.summary(), flush=True)
        result = _run(job)
        failed = False
        if result is not None:
            _say(job, result)
            try:
                _write(job, result)
            except OSError as err:  # a file that appeared meanwhile, a full disk: said, not a traceback
                print(f"bigviz.distributed: the run finished but its output was not written: {err}", file=sys.stderr)
                return 1
    finally:
        _leave(joined, failed=failed)
    return 0
