"""A pipeline plan as data: which modules each pipeline stage (one rank) holds, and why.

``make_pipeline_plan`` (in :mod:`bigviz.core.stages`) cuts a size tree into stages between
no-split units; this module holds what it returns. A :class:`PipelinePlan` is frozen and
plain: it prints, tabulates, round-trips through JSON and is checked before any process loads
a weight. ``torch.distributed`` runs it (see :mod:`bigviz.distributed`); nothing here imports
torch.

Example:
    >>> from bigviz.core.tree import SizeTree, TensorSpec
    >>> from bigviz.core.stages import make_pipeline_plan
    >>> tree = SizeTree.build([TensorSpec(f"h.{i}.w", 100, "float32") for i in range(4)])
    >>> plan = make_pipeline_plan(tree, 2, no_split=["h.*"])
    >>> plan.stages, plan.split_points, plan.stage_bytes
    ((('h.0', 'h.1'), ('h.2', 'h.3')), ('h.2',), (800, 800))
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from bigviz.core.names import owner
from bigviz.core.serialize import read_json, write_json_atomic
from bigviz.core.errors import PlanError, UsageError, short_repr
from bigviz.core.sizes import format_count, format_size
from bigviz.core.workload import Workload

if TYPE_CHECKING:
    import pandas as pd

    from bigviz.core.tree import SizeTree

__all__ = [
    "BALANCES",
    "ROLES",
    "PipelineError",
    "PipelineRun",
    "PipelineUnit",
    "StageCut",
    "SharedTensor",
    "PipelinePlan",
    "pipeline_bubble",
]

BALANCES = ("bytes", "compute")
ROLES = ("first", "block", "between", "last")
"""Where a unit sits: before the first block (embeddings: first stage), a block (where cuts
go), between two blocks (stays with the block before it), after the last block (final norm,
head: last stage)."""
_FORMAT = "bigviz.PipelinePlan"
_VERSION = 1


class PipelineError(PlanError):
    """A pipeline plan that cannot be made, read or used; ``problems`` lists every reason.

    Example:
        >>> err = PipelineError("cannot plan", ["stages=0: give 1 or more stages"])
        >>> print(err)
        cannot plan (1 problem):
          - stages=0: give 1 or more stages
    """


@dataclass(frozen=True)
class PipelineRun:
    """The run a pipeline plan holds besides its weights: what each stage's KV cache and
    activations were planned for.

    Attributes:
        batch_size: sequences in flight together, all micro-batches (each rank keeps the KV
            cache of its layers for every one of them).
        context_length: tokens each sequence's cache holds at the end (a prompt of ``P``
            and ``N`` new tokens: ``P + N - 1``); the largest step is the prefill of this many.
        kv_dtype: the cache's dtype (``None``: the compute dtype).
        microbatches: how many micro-batches the batch is cut into; a stage runs one at a
            time, so it holds the activations of one micro-batch's prefill.
        device_type: ``"cuda"`` (fused attention kernels) or ``"cpu"`` (PyTorch's reference
            paths), which the activations were estimated for.

    Example:
        >>> PipelineRun(batch_size=8, context_length=4096, microbatches=4).microbatch_size
        2
    """

    batch_size: int = 1
    context_length: int = 0
    kv_dtype: str | None = None
    microbatches: int = 1
    device_type: str = "cuda"

    def __post_init__(self) -> None:
        problems = []
        try:  # batch, context and cache dtype: the workload's own rules
            object.__setattr__(self, "kv_dtype", self.workload().kv_dtype)
        except PlanError as err:
            problems += err.problems
        m = self.microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            problems.append(f"microbatches={m!r}: give an integer >= 1")
        elif not problems and m > self.batch_size:
            problems.append(
                f"microbatches={m} with batch_size={self.batch_size}: every micro-batch holds "
                f"at least one sequence (give batch_size >= microbatches)"
            )
        if self.device_type not in ("cuda", "cpu"):
            problems.append(f"device_type={self.device_type!r}: use 'cuda' or 'cpu'")
        PipelineError.check(problems, "invalid pipeline run")

    def workload(self, *, microbatch: bool = False) -> Workload:
        """The whole batch's workload (what the KV caches hold), or one micro-batch's (the
        activations a stage holds while it runs it)."""
        batch = self.microbatch_size if microbatch else self.batch_size
        return Workload(batch_size=batch, context_length=self.context_length, kv_dtype=self.kv_dtype)

    @property
    def microbatch_size(self) -> int:
        """Sequences in the largest micro-batch."""
        return -(-self.batch_size // max(self.microbatches, 1))


def pipeline_bubble(stages: int, microbatches: int, passes: int = 1) -> float:
    """The fraction of time a stage waits, for stages of equal time and free communication.

    One pass of ``microbatches`` through ``stages`` (a forward, or a prefill) takes
    ``microbatches + stages - 1`` slots of which each stage works ``microbatches``: the
    bubble is ``(p - 1) / (m + p - 1)``. Generating feeds each micro-batch's next token back
    to the first stage, a ring: ``passes`` passes (the prefill, then one per new token) take
    ``passes x max(m, p) + min(m, p) - 1`` slots, so with ``m >= p`` micro-batches in flight
    the stages stay busy but for one fill and one drain, and with fewer each token waits for
    the whole ring.

    Example:
        >>> round(pipeline_bubble(4, 1), 3), round(pipeline_bubble(4, 8), 3)   # (p-1)/(m+p-1)
        (0.75, 0.273)
        >>> round(pipeline_bubble(2, 2, passes=16), 3), round(pipeline_bubble(2, 1, passes=16), 3)
        (0.03, 0.5)
    """
    if stages < 1 or microbatches < 1 or passes < 1:
        raise UsageError(f"stages={stages}, microbatches={microbatches}, passes={passes}: each must be >= 1")
    slots = passes * max(microbatches, stages) + min(microbatches, stages) - 1
    return (slots - passes * microbatches) / slots


@dataclass(frozen=True)
class PipelineUnit:
    """One unit the plan never splits: a no-split block, or a module outside the blocks.

    Attributes:
        name: module (or tensor) name.
        stage: the stage that holds and runs it.
        role: one of :data:`ROLES`.
        nbytes: its bytes (a tied follower counts 0: its leader holds the bytes).
        flops: estimated floating-point operations per token (2 x matmul weights).
        class_name: module class, ``""`` when planned from checkpoint headers.
        reason: why it is in its stage.
    """

    name: str
    stage: int
    role: str
    nbytes: int
    flops: int
    class_name: str = ""
    reason: str = ""


@dataclass(frozen=True)
class StageCut:
    """Stage ``stage`` begins at module ``before`` (torch's ``SplitPoint.BEGINNING``)."""

    stage: int
    before: str
    reason: str


@dataclass(frozen=True)
class SharedTensor:
    """A tied tensor that several stages load: ``name`` is tied to ``leader``."""

    name: str
    leader: str
    stages: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class PipelinePlan:
    """Pipeline stages of a model: units per stage, cut points with reasons, bytes per stage.

    Attributes:
        units: every unit in execution order, with its stage.
        cuts: one per stage after the first, in order.
        stage_bytes: bytes each stage loads (tied tensors it borrows from another stage's
            modules included).
        stage_flops: estimated FLOPs per token of each stage.
        budgets: bytes per stage given to the planner (``None``: no budget).
        shared: tied tensors loaded by more than one stage.
        balance: ``"bytes"`` or ``"compute"``.
        no_split: no-split classes or name globs the units come from.
        dtype: the dtype the bytes were planned for (``None``: as stored).
        notes: what a person should know (ties, budgets).
        tree: the size tree (kept for the treemap; not saved in JSON).
        run: the run the stages were planned for (``None``: weights only).
        stage_kv: KV cache bytes each stage keeps for its layers, the whole batch
            (empty without a run).
        stage_activations: the activation peak of each stage, one micro-batch's prefill
            (empty without a run).
    """

    units: tuple[PipelineUnit, ...]
    cuts: tuple[StageCut, ...]
    stage_bytes: tuple[int, ...]
    stage_flops: tuple[int, ...]
    budgets: tuple[int | None, ...]
    shared: tuple[SharedTensor, ...] = ()
    balance: str = "bytes"
    no_split: tuple[str, ...] = ()
    dtype: str | None = None
    notes: tuple[str, ...] = ()
    tree: SizeTree | None = field(default=None, compare=False, repr=False)
    run: PipelineRun | None = None
    stage_kv: tuple[int, ...] = ()
    stage_activations: tuple[int, ...] = ()

    # ---- the shape of the pipeline ---------------------------------------------------
    @property
    def n_stages(self) -> int:
        return len(self.stage_bytes)

    @property
    def stages(self) -> tuple[tuple[str, ...], ...]:
        """Module names per stage, in execution order."""
        out: list[list[str]] = [[] for _ in range(self.n_stages)]
        for unit in self.units:
            out[unit.stage].append(unit.name)
        return tuple(tuple(names) for names in out)

    @property
    def split_points(self) -> tuple[str, ...]:
        """The module where each stage after the first begins (stage 0 begins the model)."""
        return tuple(cut.before for cut in self.cuts)

    def kv_of(self, stage: int) -> int:
        """KV cache bytes of one stage (0 without a run)."""
        return self.stage_kv[stage] if self.stage_kv else 0

    def activations_of(self, stage: int) -> int:
        """Activation bytes of one stage (0 without a run)."""
        return self.stage_activations[stage] if self.stage_activations else 0

    @property
    def stage_totals(self) -> tuple[int, ...]:
        """What each stage holds: weights, KV cache and activations."""
        return tuple(b + self.kv_of(s) + self.activations_of(s) for s, b in enumerate(self.stage_bytes))

    def bubble(self, *, passes: int = 1) -> float:
        """The predicted idle fraction of each stage (see :func:`pipeline_bubble`) for the
        plan's micro-batches (1 without a run) and ``passes`` passes."""
        return pipeline_bubble(self.n_stages, self.run.microbatches if self.run else 1, passes)

    def blocks(self, stage: int) -> tuple[str, ...]:
        """The no-split blocks of one stage, in order."""
        return tuple(u.name for u in self.units if u.stage == stage and u.role == "block")

    def stage_of(self, name: str) -> int | None:
        """The stage holding a module or tensor (the stage of the unit that owns it).

        Example:
            >>> from bigviz.core.tree import SizeTree, TensorSpec
            >>> from bigviz.core.stages import make_pipeline_plan
            >>> tree = SizeTree.build([TensorSpec(f"h.{i}.w", 1, "float32") for i in range(3)])
            >>> make_pipeline_plan(tree, 3, no_split=["h.*"]).stage_of("h.2.w")
            2
        """
        units = {u.name: u.stage for u in self.units}
        key = owner(name, units)
        return units[key] if key is not None else None

    def tensors_of(self, stage: int, tree: SizeTree | None = None) -> list[str]:
        """Every tensor a stage loads: its units' tensors and the tied tensors it shares.

        Raises:
            ValueError: when the plan carries no tree and none is given.
        """
        tree = tree if tree is not None else self.tree
        if tree is None:
            raise UsageError("this PipelinePlan carries no size tree: pass the model's tree")
        out = [t for u in self.units if u.stage == stage for t in tree.subtree_tensors(u.name)]
        out += [s.leader for s in self.shared if stage in s.stages and s.leader not in out]
        return out

    # ---- reading it ------------------------------------------------------------------
    def summary(self) -> str:
        """A few lines a person reads: bytes per stage, where each stage begins, why."""
        root = self.tree.nodes[""].class_name if self.tree is not None else ""
        total = sum(u.nbytes for u in self.units)
        lines = [
            f"PipelinePlan: {format_count(self.n_stages, 'stage')} of "
            f"{root or 'the model'} ({format_size(total)}), balanced by {self.balance}"
        ]
        if self.run is not None:
            lines.append(f"  run: {_run_text(self.run)}")
        for i, names in enumerate(self.stages):
            cap = self.budgets[i]
            budget = f" of {format_size(cap)}" if cap is not None else ""
            span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            lines.append(
                f"  stage {i}: {self.stage_text(i):>10}{budget}  {span} ({format_count(len(self.blocks(i)), 'block')})"
            )
        lines += [f"  cut before {c.before}: {c.reason}" for c in self.cuts]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def stage_text(self, stage: int) -> str:
        """``"1.2 GiB"``, or with a run ``"1.2 GiB weights + 256 MiB KV cache + 40 MiB activations = ..."``."""
        if self.run is None:
            return format_size(self.stage_bytes[stage])
        return (
            f"{format_size(self.stage_bytes[stage])} weights + {format_size(self.kv_of(stage))} KV cache + "
            f"{format_size(self.activations_of(stage))} activations = {format_size(self.stage_totals[stage])}"
        )

    def __str__(self) -> str:
        return self.summary()

    def to_frame(self) -> pd.DataFrame:
        """One row per unit: stage, module, role, class, bytes, size, GFLOP per token, reason."""
        import pandas as pd

        columns = ["stage", "module", "role", "class", "bytes", "size", "gflop_per_token", "reason"]
        return pd.DataFrame(
            [
                {
                    "stage": u.stage,
                    "module": u.name or "<model>",
                    "role": u.role,
                    "class": u.class_name,
                    "bytes": u.nbytes,
                    "size": format_size(u.nbytes),
                    "gflop_per_token": u.flops / 1e9,
                    "reason": u.reason,
                }
                for u in self.units
            ],
            columns=columns,
        )

    def stage_frame(self) -> pd.DataFrame:
        """One row per stage: its span, blocks, weights, KV cache, activations, total, budget.

        Example:
            >>> from bigviz.core.tree import SizeTree, TensorSpec
            >>> from bigviz.core.stages import make_pipeline_plan
            >>> tree = SizeTree.build([TensorSpec(f"h.{i}.w", 100, "float32") for i in range(4)])
            >>> plan = make_pipeline_plan(tree, 2, no_split=["h.*"], kv_cache={"h.0": 10, "h.3": 10},
            ...                           activations={"h.1": 5}, run=PipelineRun(context_length=8))
            >>> plan.stage_frame()[["stage", "weights", "kv_cache", "activations", "total"]].values.tolist()
            [[0, 800, 10, 5, 815], [1, 800, 10, 0, 810]]
        """
        import pandas as pd

        columns = ["stage", "first", "last", "blocks", "weights", "kv_cache", "activations", "total", "budget"]
        return pd.DataFrame(
            [
                {
                    "stage": i,
                    "first": names[0] or "<model>",
                    "last": names[-1] or "<model>",
                    "blocks": len(self.blocks(i)),
                    "weights": self.stage_bytes[i],
                    "kv_cache": self.kv_of(i),
                    "activations": self.activations_of(i),
                    "total": self.stage_totals[i],
                    "budget": self.budgets[i],
                }
                for i, names in enumerate(self.stages)
            ],
            columns=columns,
        )

    def _repr_html_(self) -> str:
        def cell(nbytes: int) -> str:
            return f"<td style='text-align:right'>{format_size(nbytes)}</td>"

        run = self.run is not None
        rows = "".join(
            f"<tr><td>{i}</td>{cell(b)}"
            + (f"{cell(self.kv_of(i))}{cell(self.activations_of(i))}{cell(self.stage_totals[i])}" if run else "")
            + f"<td>{_size_or_blank(self.budgets[i])}</td>"
            f"<td><code>{html.escape(names[0])}</code> .. <code>{html.escape(names[-1])}</code></td>"
            f"<td>{len(self.blocks(i))}</td></tr>"
            for i, (b, names) in enumerate(zip(self.stage_bytes, self.stages))
        )
        cuts = "".join(
            f"<li>before <code>{html.escape(c.before)}</code>: {html.escape(c.reason)}</li>" for c in self.cuts
        )
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        head = "<th>weights</th><th>KV cache</th><th>activations</th><th>total</th>" if run else "<th>bytes</th>"
        what = f"; run: {html.escape(_run_text(self.run))}" if self.run is not None else ""
        return (
            f"<div class='bigviz-pipeline'><b>PipelinePlan</b> ({format_count(self.n_stages, 'stage')}, balanced by "
            f"{html.escape(self.balance)}{what})<table><tr><th>stage</th>{head}<th>budget</th>"
            f"<th>modules</th><th>blocks</th></tr>{rows}</table><ul>{cuts}{notes}</ul></div>"
        )

    # ---- JSON ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (everything but the size tree)."""
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "balance": self.balance,
            "no_split": list(self.no_split),
            "dtype": self.dtype,
            "run": None if self.run is None else asdict(self.run),
            "stages": [
                {
                    "modules": list(names),
                    "bytes": b,
                    "flops": f,
                    "budget": budget,
                    "kv_cache": self.kv_of(i),
                    "activations": self.activations_of(i),
                }
                for i, (names, b, f, budget) in enumerate(
                    zip(self.stages, self.stage_bytes, self.stage_flops, self.budgets)
                )
            ],
            "split_points": list(self.split_points),
            "cuts": [{"stage": c.stage, "before": c.before, "reason": c.reason} for c in self.cuts],
            "shared": [
                {"name": s.name, "leader": s.leader, "stages": list(s.stages), "bytes": s.nbytes} for s in self.shared
            ],
            "units": [
                {
                    "name": u.name,
                    "stage": u.stage,
                    "role": u.role,
                    "bytes": u.nbytes,
                    "flops": u.flops,
                    "class": u.class_name,
                    "reason": u.reason,
                }
                for u in self.units
            ],
            "notes": list(self.notes),
        }

    def save_json(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON, atomically (a crash never leaves half a file)."""
        write_json_atomic(self.to_dict(), path)

    @classmethod
    def load_json(cls, path: str | os.PathLike[str], *, tree: SizeTree | None = None) -> PipelinePlan:
        """Read a plan written by :meth:`save_json`; ``tree`` re-attaches the size tree.

        Raises:
            PipelineError: naming the file and every field that is missing or wrong.

        Example:
            >>> import tempfile, os
            >>> from bigviz.core.tree import SizeTree, TensorSpec
            >>> from bigviz.core.stages import make_pipeline_plan
            >>> tree = SizeTree.build([TensorSpec(f"h.{i}.w", 8, "float32") for i in range(4)])
            >>> plan = make_pipeline_plan(tree, 2, no_split=["h.*"])
            >>> path = os.path.join(tempfile.mkdtemp(), "pipeline.json")
            >>> plan.save_json(path)
            >>> PipelinePlan.load_json(path) == plan
            True
        """
        try:
            data = read_json(path, "pipeline plan")
        except (UsageError, OSError) as err:  # not JSON, not UTF-8, nested too deeply, unreadable
            raise PipelineError(str(err)) from None
        return cls.from_dict(data, where=str(path), tree=tree)

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, where: str = "pipeline plan", tree: SizeTree | None = None
    ) -> PipelinePlan:
        """The plan :meth:`to_dict` describes (checked: every bad field is named)."""
        problems = _shape_problems(data)
        PipelineError.check(
            problems,
            f"{where} is not a bigviz pipeline plan",
            fix="Fix: write it with PipelinePlan.save_json (or bigviz.plan_pipeline(...).save_json)",
        )
        stages = data["stages"]
        run = PipelineRun(**data["run"]) if data.get("run") is not None else None
        return cls(
            units=tuple(
                PipelineUnit(
                    u["name"],
                    int(u["stage"]),
                    u["role"],
                    int(u["bytes"]),
                    int(u["flops"]),
                    u.get("class", ""),
                    u.get("reason", ""),
                )
                for u in data["units"]
            ),
            cuts=tuple(StageCut(int(c["stage"]), c["before"], c.get("reason", "")) for c in data["cuts"]),
            stage_bytes=tuple(int(s["bytes"]) for s in stages),
            stage_flops=tuple(int(s.get("flops", 0)) for s in stages),
            budgets=tuple(None if s.get("budget") is None else int(s["budget"]) for s in stages),
            shared=tuple(
                SharedTensor(s["name"], s["leader"], tuple(s["stages"]), int(s["bytes"]))
                for s in data.get("shared", [])
            ),
            balance=data["balance"],
            no_split=tuple(data.get("no_split", ())),
            dtype=data.get("dtype"),
            notes=tuple(data.get("notes", ())),
            tree=tree,
            run=run,
            stage_kv=tuple(int(s.get("kv_cache", 0)) for s in stages) if run is not None else (),
            stage_activations=tuple(int(s.get("activations", 0)) for s in stages) if run is not None else (),
        )


def _shape_problems(data: object) -> list[str]:
    """Everything missing or malformed in a plan's JSON data, one line each."""
    if not isinstance(data, Mapping):
        return [f"expected a JSON object, got {type(data).__name__}"]
    problems = []
    if data.get("format") != _FORMAT:
        problems.append(f"'format' is {data.get('format')!r}, expected {_FORMAT!r}")
    for key, kind in (("stages", list), ("units", list), ("cuts", list), ("balance", str)):
        if not isinstance(data.get(key), kind):
            problems.append(f"{key!r} is missing or not a {kind.__name__}")
    if problems:
        return problems
    optional = {"no_split": list, "notes": list, "dtype": (str, None), "shared": list}
    problems += _field_problems("the plan", data, {}, optional)
    n = len(data["stages"])
    for i, stage in enumerate(data["stages"]):
        problems += _field_problems(
            f"stages[{i}]",
            stage,
            {"bytes": int},
            {"flops": int, "budget": (int, None), "kv_cache": int, "activations": int},
        )
    for i, unit in enumerate(data["units"]):
        unit_fields = {"name": str, "stage": int, "role": str, "bytes": int, "flops": int}
        found = _field_problems(f"units[{i}]", unit, unit_fields, {"class": str, "reason": str})
        problems += found
        if not found and not (0 <= unit["stage"] < n and unit["role"] in ROLES):
            problems.append(
                f"units[{i}] ({unit['name']!r}): stage {unit['stage']!r} or role {unit['role']!r} "
                f"is out of range ({n} stages; roles {', '.join(ROLES)})"
            )
    run = data.get("run")
    if run is not None and (not isinstance(run, Mapping) or not set(run) <= _RUN_FIELDS):
        problems.append(
            f"'run' must be an object with some of {', '.join(sorted(_RUN_FIELDS))}, got {short_repr(run, 80)}"
        )
    elif run is not None:
        try:
            PipelineRun(**run)
        except PipelineError as err:
            problems += [f"run: {p}" for p in err.problems]
    for i, cut in enumerate(data["cuts"]):
        problems += _field_problems(f"cuts[{i}]", cut, {"stage": int, "before": str}, {"reason": str})
    shared_list = data.get("shared")
    for i, shared in enumerate(shared_list if isinstance(shared_list, list) else []):
        problems += _field_problems(f"shared[{i}]", shared, {"name": str, "leader": str, "stages": list, "bytes": int})
    if len(data["cuts"]) != max(n - 1, 0):
        problems.append(f"{len(data['cuts'])} cuts for {n} stages: expected {max(n - 1, 0)}")
    return problems[:50]


def _field_problems(
    where: str, item: object, required: Mapping[str, Any], optional: Mapping[str, Any] | None = None
) -> list[str]:
    """Each field of ``item`` of the wrong JSON type (an int is not a bool nor ``"12"``), or missing."""
    if not isinstance(item, Mapping):
        return [f"{where} is not a JSON object"]
    problems = [f"{where} has no {key!r}" for key in required if key not in item]
    for key, kind in {**required, **(optional or {})}.items():
        if key not in item:
            continue
        kinds = kind if isinstance(kind, tuple) else (kind,)
        value = item[key]
        ok = (value is None and None in kinds) or any(
            isinstance(value, k) and not (k is int and isinstance(value, bool)) for k in kinds if k is not None
        )
        if not ok:
            problems.append(
                f"{where}.{key} is {short_repr(value, 40)}, not {' or '.join(_json_type(k) for k in kinds)}"
            )
    return problems


_RUN_FIELDS = frozenset(f.name for f in fields(PipelineRun))


def _run_text(run: PipelineRun) -> str:
    """``"batch 8 (4 micro-batches of 2), 4096 tokens, KV cache in bfloat16"``."""
    batch = f"batch {run.batch_size}"
    if run.microbatches > 1:
        batch += f" ({run.microbatches} micro-batches of up to {run.microbatch_size})"
    kv = f", KV cache in {run.kv_dtype}" if run.kv_dtype else ""
    return f"{batch}, {run.context_length} tokens of context{kv}, activations for {run.device_type}"


def _json_type(kind: Any) -> str:
    return {int: "a whole number", str: "a string", list: "a list", None: "null"}.get(kind, str(kind))


def _size_or_blank(nbytes: int | None) -> str:
    return "" if nbytes is None else format_size(nbytes)
