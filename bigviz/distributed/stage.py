"""One pipeline stage on one rank: the model cut at the plan's points, only this stage's
tensors loaded.

Everything that can be wrong is checked before a byte of weight data is read
(:func:`check_pipeline`): the plan is re-derived for this model from its split points and
must give every stage the same blocks; the checkpoint must match the model (headers only);
and the stage adapter must know how to run every stage when it is used. Then:

1. the stage module: torch's splitting front end (``torch.distributed.pipelining.pipeline``
   with ``SplitPoint.BEGINNING`` at the plan's split points) when ``example_args`` are given,
   else, or where tracing fails, a :class:`~bigviz.distributed.adapters.DecoderStage` that
   runs the stage's own modules of the model;
2. the load: the whole model's load plan, made from headers with transformers' conversion
   rules (a fused expert tensor names the keys it is converted from), cut to this stage's
   tensors before a byte is read, executed straight onto the stage's device. Every other
   stage's tensors stay on meta (never read, never initialised as missing), so a rank's peak
   memory is its stage's bytes. A tied tensor used by two stages (GPT-2's ``wte`` /
   ``lm_head``) is loaded by both.

Example:
    >>> import tempfile, pathlib, torch, bigviz
    >>> from bigviz.models import GPT, GPTConfig
    >>> trained = GPT(GPTConfig.preset("gpt-tiny")).eval()
    >>> folder = bigviz.save_sharded(trained, pathlib.Path(tempfile.mkdtemp()) / "c", progress=False)
    >>> with bigviz.init_empty_weights():
    ...     model = GPT(trained.config).eval()
    >>> plan = bigviz.plan_pipeline(model, 2)
    >>> last = build_stage_module(model, folder, plan, 1, split="wrap")
    >>> last.method, last.loaded[0], "transformer.h.0.ln_1.weight" in last.loaded
    ('wrap', 'transformer.wte.weight', False)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigviz.checkpoint.errors import CheckpointError
from bigviz.checkpoint.index import CheckpointIndex
from bigviz.checkpoint.load import LoadResult, check_checkpoint, execute_load_plan, inventory_of, plan_load
from bigviz.checkpoint.load_plan import LoadPlan
from bigviz.modeling.inventory import ModelInventory
from bigviz.core.devices import normalize_device, torch_name
from bigviz.core.names import leaf, parent
from bigviz.core.pipeline import PipelineError, PipelinePlan
from bigviz.core.stages import cut_pipeline, over_budget
from bigviz.core.tree import SizeTree
from bigviz.core.sizes import format_size
from bigviz.distributed.adapters import DecoderLayout, decoder_layout
from bigviz.modeling.sizes import module_tree
from bigviz.planning.pipeline import pipeline_run_bytes, run_knobs
from bigviz.core.errors import StateError

__all__ = ["SPLITS", "StageBuild", "check_pipeline", "build_stage_module", "build_stage"]

SPLITS = ("auto", "trace", "wrap")
"""How a stage is cut out: ``"trace"`` (torch's tracer), ``"wrap"`` (bigviz's adapter),
``"auto"`` (trace when ``example_args`` are given, falling back to wrap)."""


@dataclass
class StageBuild:
    """What :func:`build_stage_module` made and loaded on one rank.

    Attributes:
        module: the stage's ``nn.Module`` (its tensors on ``device``).
        rank: the stage index.
        n_stages: stages in the pipeline.
        method: ``"trace"`` or ``"wrap"``.
        loaded: model tensor names read from the checkpoint (first name of a tied group).
        nbytes: bytes loaded.
        device: where the stage runs.
        plan: the pipeline plan re-derived for this model.
        fallback: why tracing was not used, when it was tried and failed.
    """

    module: nn.Module
    rank: int
    n_stages: int
    method: str
    loaded: list[str]
    nbytes: int
    device: torch.device
    plan: PipelinePlan = field(repr=False)
    fallback: str = ""

    def summary(self) -> str:
        """One line for a log: stage, method, what was loaded, where."""
        how = f"{self.method}" + (f", tracing failed: {self.fallback}" if self.fallback else "")
        return (
            f"stage {self.rank} of {self.n_stages} ({how}): loaded {len(self.loaded)} tensors "
            f"({format_size(self.nbytes)}) onto {self.device}"
        )


def check_pipeline(
    model: nn.Module, checkpoint: str | Path | CheckpointIndex, pipeline_plan: PipelinePlan, *, adapter: bool = True
) -> tuple[PipelinePlan, LoadPlan]:
    """Check, from headers alone, that ``pipeline_plan`` fits ``model`` and ``checkpoint``.

    Run it identically on every rank before anything loads. Returns the plan re-derived for
    this model and the checkpoint's load plan (which key fills which tensor).

    Args:
        adapter: also check that the stage adapter can run every stage (needed unless
            torch's tracer cuts the model).

    Raises:
        PipelineError: listing every problem: split points that are not this model's
            blocks, stages over their budget, checkpoint keys missing or unexpected, shapes,
            parts the adapter cannot run.
    """
    problems: list[str] = []
    model_plan = load_plan = None
    try:
        model_plan = _replan(model, pipeline_plan)
    except PipelineError as err:
        problems += err.problems
    try:
        load_plan = check_checkpoint(model, checkpoint)
    except CheckpointError as err:
        problems += err.problems
    if adapter and model_plan is not None:
        problems += _adapter_problems(model, model_plan)
    PipelineError.check(
        problems,
        f"the pipeline plan does not fit {type(model).__name__} and its checkpoint; nothing was loaded",
        fix="Fix: each line says what is wrong; a plan made for this model "
        "(bigviz.plan_pipeline(model, stages)) and the checkpoint it was saved to fit",
    )
    assert model_plan is not None and load_plan is not None
    return model_plan, load_plan


def _replan(model: nn.Module, plan: PipelinePlan) -> PipelinePlan:
    """The plan with the same cuts for this model: same blocks per stage, and each stage's
    weights (and run, when the plan counts one) within its budget."""
    tree = module_tree(model, plan.dtype)
    mine = cut_pipeline(
        tree,
        plan.split_points,
        no_split=plan.no_split,
        balance=plan.balance,
        budgets=plan.budgets,
        dtype=plan.dtype,
        run=plan.run,
        **run_knobs(pipeline_run_bytes(model, tree, plan.run, dtype=plan.dtype)),
    )
    problems = [
        f"stage {s}: the plan has blocks {_span(plan.blocks(s))}, this model {_span(mine.blocks(s))}"
        for s in range(plan.n_stages)
        if plan.blocks(s) != mine.blocks(s)
    ]
    unknown = [u.name for u in plan.units if u.name not in tree.nodes and u.name not in tree.tensors]
    problems += (
        [f"the plan names {len(unknown)} module(s) this model lacks: {', '.join(unknown[:5])}"] if unknown else []
    )
    problems += over_budget(mine)
    PipelineError.check(problems, "the pipeline plan does not match this model")
    return mine


def _span(blocks: Sequence[str]) -> str:
    return "none" if not blocks else blocks[0] if len(blocks) == 1 else f"{blocks[0]} .. {blocks[-1]} ({len(blocks)})"


def _stage_units(plan: PipelinePlan, stage: int) -> list[tuple[str, str]]:
    return [(u.name, u.role) for u in plan.units if u.stage == stage]


def _adapter_problems(model: nn.Module, plan: PipelinePlan) -> list[str]:
    try:
        layout = decoder_layout(model)
    except PipelineError as err:
        return err.problems
    return [f"stage {s}: {p}" for s in range(plan.n_stages) for p in layout.problems(_stage_units(plan, s))]


def _check_args(rank: int, split: str, plan: PipelinePlan, example_args: Any) -> None:
    problems = []
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.n_stages:
        problems.append(f"rank {rank!r} is not a stage of this {plan.n_stages}-stage plan (0 .. {plan.n_stages - 1})")
    if split not in SPLITS:
        problems.append(f"split={split!r}: use one of {', '.join(SPLITS)}")
    elif split == "trace" and example_args is None:
        problems.append("split='trace' needs example_args: the inputs of one micro-batch, e.g. (ids[:1],)")
    PipelineError.check(problems, "cannot build the pipeline stage")


def _default_device(device: torch.device | str | int | None) -> torch.device:
    """The stage's device: given, else this rank's GPU (``LOCAL_RANK``), else the CPU."""
    if device is not None:
        return device if isinstance(device, torch.device) else torch.device(torch_name(normalize_device(device)))
    if torch.cuda.is_available():
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def build_stage_module(
    model: nn.Module,
    checkpoint: str | Path | CheckpointIndex,
    pipeline_plan: PipelinePlan,
    rank: int,
    *,
    device: torch.device | str | int | None = None,
    example_args: Any = None,
    split: str = "auto",
    dtype: torch.dtype | str | None = None,
) -> StageBuild:
    """Cut stage ``rank`` out of ``model`` (built on meta) and load only its tensors.

    Args:
        model: the whole model, weights on meta (``bigviz.init_empty_weights()``).
        checkpoint: its checkpoint (folder, index or file).
        pipeline_plan: from ``bigviz.plan_pipeline`` (or ``PipelinePlan.load_json``).
        rank: the stage to build (one stage per rank).
        device: where it runs; default: ``cuda:LOCAL_RANK`` with CUDA, else the CPU.
        example_args: one micro-batch's inputs (e.g. ``(ids[:1],)``) for torch's tracer.
        split: ``"auto"``, ``"trace"`` or ``"wrap"`` (see :data:`SPLITS`).
        dtype: load floating weights as this dtype (default: the plan's, else as stored).

    Raises:
        PipelineError: anything :func:`check_pipeline` finds, before anything loads.
    """
    _check_args(rank, split, pipeline_plan, example_args)
    device = _default_device(device)
    trace_first = split == "trace" or (split == "auto" and example_args is not None)
    model_plan, load_plan = check_pipeline(model, checkpoint, pipeline_plan, adapter=not trace_first)
    loadable = {a for load in load_plan.loads for a in load.aliases}
    module, names, method, fallback = _stage_module(model, model_plan, rank, split, example_args, loadable)
    _check_fillable(model, names, loadable)
    result = _load(model, checkpoint, names, device, dtype if dtype is not None else model_plan.dtype)
    if method == "trace":
        for name in names:
            _set_tensor(module, name, _model_tensor(model, name))
        _retarget(module, device)
    _finish(module, device)
    return StageBuild(
        module, rank, model_plan.n_stages, method, result.loaded, result.bytes_loaded, device, model_plan, fallback
    )


def _stage_module(
    model: nn.Module, plan: PipelinePlan, rank: int, split: str, example_args: Any, loadable: set[str]
) -> tuple[nn.Module, list[str], str, str]:
    """The stage module, the model tensor names it holds, the method used, why not trace."""
    fallback = ""
    if split == "trace" or (split == "auto" and example_args is not None):
        try:
            return (*_traced(model, plan, rank, example_args, loadable), "trace", "")
        except Exception as err:  # torch's tracer fails in many model-specific ways
            if split == "trace":
                raise PipelineError(
                    f"torch's tracer could not split {type(model).__name__}: {type(err).__name__}: {err}",
                    fix="Fix: use split='wrap'",
                ) from err
            fallback = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
        PipelineError.check(
            _adapter_problems(model, plan),
            f"cannot build stage {rank} (tracing failed: {fallback}); nothing was loaded",
        )
    layout = decoder_layout(model)
    first, last = rank == 0, rank == plan.n_stages - 1
    module = layout.stage(model, plan.blocks(rank), first=first, last=last)
    assert plan.tree is not None  # _replan attaches the model's tree
    names = _tensor_names(plan.tree, layout, plan.blocks(rank), first=first, last=last)
    return module, names, "wrap", fallback


def _tensor_names(
    tree: SizeTree, layout: DecoderLayout, blocks: Sequence[str], *, first: bool, last: bool
) -> list[str]:
    modules = layout.modules_for(blocks, first=first, last=last)
    return [t for m in modules if m in tree.nodes for t in tree.subtree_tensors(m)]


def _traced(
    model: nn.Module, plan: PipelinePlan, rank: int, example_args: Any, loadable: set[str]
) -> tuple[nn.Module, list[str]]:
    """Split with torch's front end; every stage's tensors must be the model's, by name, so
    every rank decides the same way whether tracing is usable."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    args = example_args if isinstance(example_args, tuple) else (example_args,)
    if plan.dtype is not None:  # the tracer records dtypes: trace in the dtype the stage will run in
        _meta_params_to(model, getattr(torch, plan.dtype))
    with warnings.catch_warnings():  # torch's own pytree deprecations, nothing the user can act on
        warnings.simplefilter("ignore", FutureWarning)
        pipe = pipeline(model, mb_args=args, split_spec={p: SplitPoint.BEGINNING for p in plan.split_points})
    if pipe.num_stages != plan.n_stages:
        raise StateError(f"the tracer made {pipe.num_stages} stages, the plan has {plan.n_stages}")
    for stage in range(plan.n_stages):
        names = _held(pipe.get_stage_module(stage))
        bad = [n for n in names if (t := _model_tensor(model, n)) is None or (t.is_meta and n not in loadable)]
        if bad:
            raise StateError(f"traced stage {stage} holds tensors the checkpoint cannot fill: {bad[:5]}")
    module = pipe.get_stage_module(rank)
    return module, _held(module)


def _retarget(module: nn.Module, device: torch.device) -> None:
    """Point a traced stage at ``device``: tracing a model whose weights are on meta records
    ``device=meta`` in the graph (``.to(x.device)``, metadata asserts)."""
    meta = torch.device("meta")
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for node in graph.nodes:
            node.args = tuple(device if a == meta else a for a in node.args)
            node.kwargs = {k: device if v == meta else v for k, v in node.kwargs.items()}
        if isinstance(sub, torch.fx.GraphModule):
            sub.recompile()


def _meta_params_to(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters still on meta become ``dtype`` (no memory), ties kept: one new
    parameter per tensor object, put under every one of its names."""
    inventory = ModelInventory.of(model)
    for t in inventory.tensors:
        if t.kind == "param" and t.is_meta and t.dtype.is_floating_point and t.dtype != dtype:
            old = inventory.tensor(t.name)
            new = nn.Parameter(old.to(dtype), requires_grad=old.requires_grad)
            for alias in t.aliases:
                module, attr, _ = inventory.slots[alias]
                module._parameters[attr] = new


def _held(module: nn.Module) -> list[str]:
    """Every tensor name a stage module holds (each name of a tied tensor)."""
    return list(ModelInventory.of(module).slots)


def _model_tensor(model: nn.Module, name: str) -> torch.Tensor | None:
    try:
        module = model.get_submodule(parent(name))
    except AttributeError:
        return None
    tensor = getattr(module, leaf(name), None)
    return tensor if isinstance(tensor, torch.Tensor) else None


def _set_tensor(root: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    module = root.get_submodule(parent(name))
    store = module._parameters if leaf(name) in module._parameters else module._buffers
    store[leaf(name)] = tensor


def _load(
    model: nn.Module,
    checkpoint: str | Path | CheckpointIndex,
    names: Sequence[str],
    device: torch.device,
    dtype: torch.dtype | str | None,
) -> LoadResult:
    """Load the tensors that fill ``names`` (and their tied names), and nothing else.

    The load is planned for the whole model from headers (so transformers' conversion
    rules see every key: a fused expert tensor is read from the keys it is converted from),
    then cut to this stage's tensors before anything is read: every other stage's tensors
    stay on meta, neither read nor initialised as missing, so a rank's peak memory is its
    stage's bytes.
    """
    wanted = set(names)
    index, full = plan_load(model, checkpoint, {"": str(device)}, dtype=dtype, check=False)
    mine = replace(
        full,
        loads=tuple(load for load in full.loads if wanted.intersection(load.aliases)),
        computed=tuple(load for load in full.computed if wanted.intersection(load.aliases)),
    )
    return execute_load_plan(inventory_of(model), index, mine, progress=False)


def _check_fillable(model: nn.Module, names: Sequence[str], loadable: set[str]) -> None:
    """Before loading: every tensor of the stage is real already or filled by the checkpoint."""
    empty = [n for n in names if (t := _model_tensor(model, n)) is not None and t.is_meta and n not in loadable]
    PipelineError.check(
        empty,
        "these tensors of the stage are on meta and the checkpoint does not hold them; nothing was loaded",
        fix="Fix: build the model with bigviz.init_empty_weights(), which keeps buffers real "
        "(a rotary embedding's inv_freq is computed, not saved)",
    )


def _finish(module: nn.Module, device: torch.device) -> None:
    """Every tensor of the stage on ``device``; eval mode."""
    assert not any(t.is_meta for t in (*module.parameters(), *module.buffers())), "checked before loading"
    module.to(device).eval()


def build_stage(
    model: nn.Module,
    checkpoint: str | Path | CheckpointIndex,
    pipeline_plan: PipelinePlan,
    rank: int,
    *,
    device: torch.device | str | int | None = None,
    example_args: Any = None,
    split: str = "auto",
    dtype: torch.dtype | str | None = None,
    group: Any = None,
) -> Any:
    """A ``torch.distributed.pipelining.PipelineStage`` for stage ``rank``, loaded from ``checkpoint``.

    The process group must be initialised, with one rank per stage. Arguments are those of
    :func:`build_stage_module`; the returned stage carries its :class:`StageBuild` as
    ``stage.bigviz`` (what was loaded, how it was cut). Run it with a torch schedule::

        stage = build_stage(model, "ckpt/", plan, rank)
        schedule = ScheduleGPipe(stage, n_microbatches=2)
        with torch.no_grad():
            out = schedule.step(ids) if rank == 0 else schedule.step()  # logits on the last rank

    Raises:
        PipelineError: a plan whose stage count is not the group's size, and anything
            :func:`check_pipeline` finds, before anything loads.
    """
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    world = dist.get_world_size(group) if dist.is_initialized() else None
    if world is not None and world != pipeline_plan.n_stages:
        raise PipelineError(
            f"the plan has {pipeline_plan.n_stages} stages but the process group has {world} ranks",
            fix=f"Fix: launch {pipeline_plan.n_stages} processes (torchrun --nproc-per-node "
            f"{pipeline_plan.n_stages}) or plan for {world} stages",
        )
    built = build_stage_module(
        model, checkpoint, pipeline_plan, rank, device=device, example_args=example_args, split=split, dtype=dtype
    )
    stage = PipelineStage(built.module, rank, built.n_stages, built.device, group=group)
    stage.bigviz = built  # type: ignore[attr-defined]
    return stage
