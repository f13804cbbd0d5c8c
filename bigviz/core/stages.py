"""Cut a model into pipeline stages: contiguous runs of no-split units, balanced, in n log n.

The units come from the size tree in definition order (taken as execution order): a no-split
module is a *block*; modules outside the blocks before the first block (embeddings) run in
the first stage, those after the last block (final norm, head) in the last stage, and those
between two blocks stay with the block before them. Cuts go only before blocks.

Balancing is exact for the bottleneck: a binary search on the largest stage (bytes, or FLOPs
per token with ``balance="compute"``) with a feasibility check that keeps, for each stage,
the set of item positions where it can end (sorted intervals, found with bisect on prefix
sums). With per-stage budgets the stages are balanced by fill fraction (bytes / budget) and
never exceed a budget; when they cannot fit, the error says which stage does not fit and by
how much. Among the cuts that reach the smallest bottleneck, each is put nearest to its even
share of the total. The search itself, on plain integers, is :mod:`bigviz.core.partition`; this
module makes its items (blocks with the units they carry, their bytes, FLOPs and run) and its
caps, and turns the boundaries into a plan.

Example:
    >>> from bigviz.core.tree import SizeTree, TensorSpec
    >>> specs = [TensorSpec("emb.weight", 600, "float32")]
    >>> specs += [TensorSpec(f"h.{i}.weight", 100, "float32") for i in range(8)]
    >>> plan = make_pipeline_plan(SizeTree.build(specs), 2, no_split=["h.*"])
    >>> plan.stages[0], plan.stage_bytes
    (('emb', 'h.0'), (2800, 2800))
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from bigviz.core.names import ancestors, is_embedding_name, owner, parent
from bigviz.core.pipeline import (
    BALANCES,
    PipelineError,
    PipelinePlan,
    PipelineRun,
    PipelineUnit,
    SharedTensor,
    StageCut,
)
from bigviz.core.nosplit import is_no_split as _is_no_split
from bigviz.core.partition import Chain, choose, reachable, smallest
from bigviz.core.tree import SizeTree
from bigviz.core.sizes import UNLIMITED, format_size, parse_size

__all__ = ["pipeline_units", "make_pipeline_plan", "cut_pipeline", "over_budget", "unit_flops"]

_FIX = "Fix: give the stages more memory or use more stages"
_FIX_DTYPE = ", or plan for a smaller dtype (dtype=torch.float16 halves float32 bytes)"


def pipeline_units(tree: SizeTree, no_split: Collection[str]) -> list[tuple[str, str]]:
    """``(unit, role)`` in definition order: no-split modules are blocks, every other
    module is walked into, down to leaf modules and the own tensors of walked modules.

    Without any no-split module every unit is a block (cuts may go anywhere between them).

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> t = SizeTree.build([TensorSpec(n, 1, "float32") for n in ("emb.w", "h.0.w", "h.1.w", "head.w")])
        >>> pipeline_units(t, ["h.*"])
        [('emb', 'first'), ('h.0', 'block'), ('h.1', 'block'), ('head', 'last')]
    """
    patterns = frozenset(no_split)
    units: list[tuple[str, bool]] = []
    stack = [""]
    while stack:
        name = stack.pop()
        node = tree.nodes.get(name)
        if node is None:  # an own tensor of a module that is walked into
            units.append((name, False))
        elif node.children and not _is_no_split(tree, name, patterns):
            stack.extend(reversed(list(node.tensors) + list(node.children)))
        else:
            units.append((name, _is_no_split(tree, name, patterns)))
    if not any(is_block for _, is_block in units):
        return [(name, "block") for name, _ in units]
    first = next(i for i, (_, b) in enumerate(units) if b)
    last = max(i for i, (_, b) in enumerate(units) if b)
    roles = [
        "block" if b else "first" if i < first else "last" if i > last else "between" for i, (_, b) in enumerate(units)
    ]
    return [(name, role) for (name, _), role in zip(units, roles)]


def unit_flops(tree: SizeTree, name: str) -> int:
    """FLOPs per token of a unit, estimated as 2 x the elements of its matrix weights.

    Tied followers count (a tied head still multiplies); lookup tables (embeddings) and
    vectors (norms, biases) do not. Attention's sequence-length term is left out.

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> t = SizeTree.build([TensorSpec("wte.weight", 12, "float32", (4, 3)),
        ...                     TensorSpec("fc.weight", 12, "float32", (4, 3)),
        ...                     TensorSpec("fc.bias", 4, "float32", (4,))])
        >>> unit_flops(t, "wte"), unit_flops(t, "fc")
        (0, 24)
    """
    total = 0
    for tensor in tree.subtree_tensors(name):
        spec = tree.tensors[tensor]
        matrix = len(spec.shape) >= 2 or (not spec.shape and spec.numel > 1)
        if spec.kind == "param" and matrix and not _is_lookup(tree, parent(tensor)):
            total += 2 * spec.numel
    return total


def _is_lookup(tree: SizeTree, module: str) -> bool:
    node = tree.nodes.get(module)
    if node is not None and node.class_name:
        return node.class_name.endswith("Embedding")
    return is_embedding_name(module)  # planned from headers: no class names


@dataclass(frozen=True)
class _Items:
    """The chain the cuts split: one item per block (with the units it carries)."""

    names: tuple[tuple[str, ...], ...]
    roles: dict[str, str]
    nbytes: tuple[int, ...]  # with the tied tensors an item would borrow (an upper bound)
    flops: tuple[int, ...]
    kv: tuple[int, ...] = ()  # KV cache of the layers in the item (empty without a run)
    act: tuple[int, ...] = ()  # the largest step in the item (empty without a run)
    outs: tuple[int, ...] = ()  # outputs the item's modules keep alive all forward (input embeddings)

    @property
    def held(self) -> tuple[int, ...]:
        """What adds up along a stage: weights, KV cache and held outputs."""
        if not self.kv:
            return self.nbytes
        outs = self.outs or (0,) * len(self.nbytes)
        return tuple(b + k + o for b, k, o in zip(self.nbytes, self.kv, outs))

    def act_of(self, i: int) -> int:
        return self.act[i] if self.act else 0

    def span_act(self, span: Iterable[int]) -> int:
        """A stage's activations, by the planner's rule (``bigviz.plan``'s
        :func:`~bigviz.core.run_charges.run_usage`): its largest step plus the outputs its
        modules hold all forward."""
        span = list(span)
        return max((self.act_of(i) for i in span), default=0) + sum(self.outs[i] for i in span if self.outs)


def _item_run(
    tree: SizeTree,
    groups: Sequence[Sequence[str]],
    kv_cache: Mapping[str, int],
    activations: Mapping[str, int],
    held: Mapping[str, int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """KV cache, activation and held-output bytes per item, by the planner's rule
    (``bigviz.plan``): a layer's cache, and an output kept alive all forward, go with the
    unit holding the module (a layer split into parts: with its first part); an item keeps
    room for the largest step run inside it or by a module around it."""
    held = held or {}
    unknown = [n for n in [*kv_cache, *activations, *held] if n not in tree.nodes]
    PipelineError.check(
        [f"{n!r} is no module of the model" for n in unknown[:8]],
        "cannot plan the run: KV cache or activation bytes given for names that are no module",
        fix="Fix: key kv_cache= and activations= by module name",
    )
    item_of = {name: i for i, group in enumerate(groups) for name in group}
    under: dict[str, list[int]] = {}
    for name, i in item_of.items():
        for holder in ancestors(parent(name)) if name else ():
            under.setdefault(holder, []).append(i)

    def items_of(module: str) -> list[int]:
        key = owner(module, item_of)
        return [item_of[key]] if key is not None else under.get(module, [])

    kv, act, outs = [0] * len(groups), [0] * len(groups), [0] * len(groups)
    for per_item, given in ((kv, kv_cache), (outs, held)):
        for module, nbytes in given.items():
            found = items_of(module)
            if found:
                per_item[min(found)] += nbytes
    for module, nbytes in activations.items():
        for i in items_of(module):
            act[i] = max(act[i], nbytes)
    return tuple(kv), tuple(act), tuple(outs)


def _reserves(items: _Items, k: int) -> tuple[int, ...]:
    """Room for activations each stage keeps whatever the cuts: the largest step among the
    items it can hold (stage ``s`` holds some of items ``s .. n - k + s``), a sliding-window
    maximum. Exact when every layer's step is the same size; an upper bound otherwise."""
    n = len(items.names)
    if not items.act or k > n:
        return (0,) * k
    width, window, out = n - k + 1, deque[int](), []
    for i in range(n):
        while window and items.act[window[-1]] <= items.act[i]:
            window.pop()
        window.append(i)
        if window[0] <= i - width:
            window.popleft()
        if i >= width - 1:
            out.append(items.act[window[0]])
    return tuple(out)


def _items(
    tree: SizeTree,
    units: list[tuple[str, str]],
    kv_cache: Mapping[str, int] | None = None,
    activations: Mapping[str, int] | None = None,
    held: Mapping[str, int] | None = None,
) -> _Items:
    groups: list[list[str]] = []
    head: list[str] = []
    for name, role in units:
        if role == "block":
            groups.append(head + [name])
            head = []
        elif role == "first":
            head.append(name)
        else:  # between or last: stays with the block before it
            groups[-1].append(name)
    item_of = {name: i for i, group in enumerate(groups) for name in group}
    nbytes = [sum(tree.total(n) for n in g) for g in groups]
    for follower, lead in tree.leader_of.items():
        i, j = item_of[owner(follower, item_of)], item_of[owner(lead, item_of)]  # type: ignore[index]
        if i != j:
            nbytes[i] += tree.tensor_bytes(lead)
    kv, act, outs = _item_run(tree, groups, kv_cache, activations or {}, held) if kv_cache is not None else ((), (), ())
    return _Items(
        tuple(tuple(g) for g in groups),
        dict(units),
        tuple(nbytes),
        tuple(sum(unit_flops(tree, n) for n in g) for g in groups),
        kv,
        act,
        outs,
    )


@dataclass(frozen=True)
class _Request:
    k: int
    budgets: tuple[int | None, ...]
    balance: str


def _parse_request(stages: object, balance: str, n_items: int, units: list[tuple[str, str]]) -> _Request:
    problems: list[str] = []
    budgets: tuple[int | None, ...] = ()
    if isinstance(stages, bool) or not isinstance(stages, (int, list, tuple)):
        problems.append(f"stages={stages!r}: give a number of stages or a list of per-stage budgets")
    elif isinstance(stages, int):
        if stages < 1:
            problems.append(f"stages={stages}: give 1 or more stages")
        budgets = (None,) * max(stages, 0)
    elif not stages:
        problems.append("stages=[]: give at least one per-stage budget")
    else:
        parsed = []
        for i, size in enumerate(stages):
            try:
                parsed.append(parse_size(size))
            except ValueError as err:
                problems.append(f"budget of stage {i}: {err}")
        budgets = tuple(parsed)
    if balance not in BALANCES:
        problems.append(f"balance={balance!r}: use one of {', '.join(BALANCES)}")
    if budgets and len(budgets) > n_items:
        blocks = [n for n, r in units if r == "block"]
        shown = ", ".join(blocks[:6]) + (" ..." if len(blocks) > 6 else "")
        problems.append(
            f"{len(budgets)} stages but only {n_items} no-split units to cut between "
            f"({shown}): use at most {n_items} stages, or finer no-split classes"
        )
    PipelineError.check(problems, "cannot plan pipeline stages")
    return _Request(len(budgets), budgets, balance)


@dataclass(frozen=True)
class _Caps:
    """Caps per stage for a bottleneck T: the balanced metric gets T x share / top share
    (shares: budgets when bytes are balanced against budgets, else equal), bytes the budget;
    both less the stage's activation reserve when it is counted in them (a cap below zero
    holds nothing)."""

    shares: tuple[int, ...]
    byte_caps: tuple[int, ...]
    reserves: tuple[int, ...] = ()
    metric_reserves: bool = True  # False when the metric is FLOPs

    def __call__(self, t: int) -> list[tuple[int, int]]:
        top = max(max(self.shares), 1)  # all-zero budgets: every cap is 0
        reserves = self.reserves or (0,) * len(self.shares)
        return [
            (max(t * s // top - (r if self.metric_reserves else 0), -1), max(cb - r, -1) if cb < UNLIMITED else cb)
            for s, cb, r in zip(self.shares, self.byte_caps, reserves)
        ]

    @classmethod
    def of(cls, request: _Request, reserves: tuple[int, ...] = ()) -> _Caps:
        known = [b for b in request.budgets if b is not None]
        proportional = request.balance == "bytes" and len(known) == request.k
        shares = tuple(known) if proportional else (1,) * request.k
        caps = tuple(UNLIMITED if b is None else b for b in request.budgets)
        return cls(shares, caps, reserves, request.balance == "bytes")


def _balance(chain: Chain, request: _Request, reserves: tuple[int, ...] = ()) -> tuple[list[int], int] | None:
    """The boundaries with the smallest bottleneck, and that bottleneck; ``None`` when even
    the budgets themselves cannot hold the chain (the caller says which stage, by how much)."""
    caps = _Caps.of(request, reserves)
    proportional = caps.shares != (1,) * request.k
    upper = max(caps.shares) if proportional else max(chain.pm[-1] + max(reserves, default=0), 1)
    if reachable(chain, caps(upper)) is None:
        return None
    best = smallest(chain, caps, upper)
    reach = reachable(chain, caps(best))
    assert reach is not None  # feasible at `upper`, and feasibility grows with T
    return choose(chain, reach, caps(best), caps.shares), best


def make_pipeline_plan(
    tree: SizeTree,
    stages: int | Sequence[int | str],
    *,
    no_split: Collection[str] = (),
    balance: str = "bytes",
    dtype: str | None = None,
    kv_cache: Mapping[str, int] | None = None,
    activations: Mapping[str, int] | None = None,
    held: Mapping[str, int] | None = None,
    run: PipelineRun | None = None,
) -> PipelinePlan:
    """Cut ``tree`` into pipeline stages between no-split units.

    With a run (``kv_cache`` and ``activations``: bytes per module, as ``bigviz.plan``
    charges them), each stage holds its layers' KV cache besides its weights, and room for
    the largest step it runs; stages are balanced on all three, and budgets hold all three.

    Args:
        tree: the model's size tree.
        stages: the number of stages, or one byte budget per stage (``["20GiB", "20GiB"]``).
        no_split: classes or name globs of the blocks (``"Block"``, ``"transformer.h.*"``).
        balance: ``"bytes"`` (weights, and the run, per stage) or ``"compute"`` (FLOPs per token).
        dtype: recorded in the plan (the tree is already sized for it).
        kv_cache: KV cache bytes per layer module, for the whole batch.
        activations: activation bytes per module step, for one micro-batch.
        held: bytes a module's output keeps alive all forward (``RunBytes.held``: the input
            embeddings), for one micro-batch; added to its stage's activations.
        run: what those bytes were computed for (recorded in the plan).

    Raises:
        PipelineError: a bad stage count, more stages than blocks, an unknown balance, or
            budgets too small (saying which stage does not fit and by how much).

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> tree = SizeTree.build([TensorSpec(f"h.{i}.w", 100, "float32") for i in range(4)])
        >>> kv = {f"h.{i}": 100 for i in range(4)}
        >>> plan = make_pipeline_plan(tree, [1100, 1100], no_split=["h.*"], kv_cache=kv,
        ...                           activations={f"h.{i}": 50 for i in range(4)}, run=PipelineRun())
        >>> plan.stage_bytes, plan.stage_kv, plan.stage_activations, plan.stage_totals
        ((800, 800), (200, 200), (50, 50), (1050, 1050))
    """
    units = pipeline_units(tree, no_split)
    items = _items(tree, units, _run_map(kv_cache, activations), activations, held)
    request = _parse_request(stages, balance, len(items.names), units)
    metric = items.flops if balance == "compute" else items.held
    chain = Chain(metric, items.held)
    reserves = _reserves(items, request.k)
    balanced = _balance(chain, request, reserves)
    if balanced is None:
        raise _does_not_fit(tree, items, request)
    bounds, best = balanced
    return _assemble(tree, items, bounds, request, no_split, dtype, best, run)


def _run_map(kv_cache: Mapping[str, int] | None, activations: Mapping[str, int] | None) -> Mapping[str, int] | None:
    """The KV cache map when a run is planned (either map given), else None (weights only)."""
    return dict(kv_cache or {}) if kv_cache is not None or activations is not None else None


def cut_pipeline(
    tree: SizeTree,
    split_points: Sequence[str],
    *,
    no_split: Collection[str] = (),
    balance: str = "bytes",
    budgets: Sequence[int | None] | None = None,
    dtype: str | None = None,
    kv_cache: Mapping[str, int] | None = None,
    activations: Mapping[str, int] | None = None,
    held: Mapping[str, int] | None = None,
    run: PipelineRun | None = None,
) -> PipelinePlan:
    """The plan with stages beginning at ``split_points`` (blocks of ``tree``, in order).

    This re-derives a plan for a model from a saved one: the same cuts, this model's units
    (and, given ``kv_cache`` and ``activations``, the run's bytes per stage; budgets are
    recorded, not checked: see :func:`over_budget`).

    Raises:
        PipelineError: naming every split point that is not a block, or out of order.

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> t = SizeTree.build([TensorSpec(f"h.{i}.w", 4, "float32") for i in range(4)])
        >>> cut_pipeline(t, ["h.1"], no_split=["h.*"]).stages
        (('h.0',), ('h.1', 'h.2', 'h.3'))
    """
    units = pipeline_units(tree, no_split)
    items = _items(tree, units, _run_map(kv_cache, activations), activations, held)
    where = {next(n for n in group if items.roles[n] == "block"): i for i, group in enumerate(items.names)}
    problems = [
        f"split point {p!r} is not a no-split block of this model (blocks: {', '.join(list(where)[:4])} ...)"
        for p in split_points
        if p not in where
    ]
    positions = [where[p] for p in split_points if p in where]
    if not problems and (positions != sorted(set(positions)) or (positions and positions[0] == 0)):
        problems.append(
            f"split points {list(split_points)} must be distinct blocks in execution order, after the first block"
        )
    PipelineError.check(
        problems,
        "the pipeline plan does not match this model",
        fix="Fix: make the plan for this model (bigviz.plan_pipeline(model, ...))",
    )
    k = len(split_points) + 1
    request = _Request(k, tuple(budgets) if budgets is not None else (None,) * k, balance)
    return _assemble(tree, items, [0, *positions, len(items.names)], request, no_split, dtype, None, run)


def over_budget(plan: PipelinePlan) -> list[str]:
    """The stages whose weights and run exceed their budget, one line each with the numbers.

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> t = SizeTree.build([TensorSpec(f"h.{i}.w", 4, "float32") for i in range(4)])
        >>> over_budget(cut_pipeline(t, ["h.1"], no_split=["h.*"], budgets=[16, 32]))
        ['stage 1 needs 48 B with a budget of 32 B: 16 B over']
    """
    return [
        f"stage {s} needs {plan.stage_text(s)} with a budget of {format_size(budget)}: "
        f"{format_size(total - budget)} over"
        for s, (total, budget) in enumerate(zip(plan.stage_totals, plan.budgets))
        if budget is not None and total > budget
    ]


def _assemble(
    tree: SizeTree,
    items: _Items,
    bounds: list[int],
    request: _Request,
    no_split: Collection[str],
    dtype: str | None,
    best: int | None,
    run: PipelineRun | None = None,
) -> PipelinePlan:
    stage_of_item = [s for s in range(request.k) for _ in range(bounds[s], bounds[s + 1])]
    stage_of = {n: stage_of_item[i] for i, group in enumerate(items.names) for n in group}
    shared = _shared(tree, stage_of)
    stage_bytes = [0] * request.k
    stage_flops = [0] * request.k
    stage_kv, stage_act = [0] * request.k, [0] * request.k
    for i, group in enumerate(items.names):
        stage = stage_of_item[i]
        stage_bytes[stage] += sum(tree.total(n) for n in group)
        stage_flops[stage] += items.flops[i]
        if items.kv:
            stage_kv[stage] += items.kv[i]
    if items.kv:
        stage_act = [items.span_act(range(bounds[s], bounds[s + 1])) for s in range(request.k)]
    for s in shared:
        for stage in s.stages[1:]:
            stage_bytes[stage] += s.nbytes
    with_run = bool(items.kv)
    if with_run and run is None:
        run = PipelineRun()
    if not with_run:
        run = None
    load = [b + kv + a for b, kv, a in zip(stage_bytes, stage_kv, stage_act)]
    cuts = _cuts(items, bounds, load, stage_flops, request, best, with_run)
    starts = {c.before: c.reason for c in cuts}
    units = tuple(
        PipelineUnit(
            n,
            stage_of[n],
            items.roles[n],
            tree.total(n),
            unit_flops(tree, n),
            tree.nodes[n].class_name if n in tree.nodes else "",
            starts.get(n) or _role_reason(items.roles[n], stage_of[n]),
        )
        for group in items.names
        for n in group
    )
    notes = tuple(
        f"{s.name} is tied to {s.leader} (stage {s.stages[0]}): stage"
        f"{'s' if len(s.stages) > 2 else ''} {', '.join(map(str, s.stages[1:]))} load"
        f"{'' if len(s.stages) > 2 else 's'} that tensor too ({format_size(s.nbytes)})"
        for s in shared
    )
    return PipelinePlan(
        units,
        tuple(cuts),
        tuple(stage_bytes),
        tuple(stage_flops),
        request.budgets,
        shared,
        request.balance,
        tuple(no_split),
        dtype,
        notes,
        tree,
        run,
        tuple(stage_kv) if with_run else (),
        tuple(stage_act) if with_run else (),
    )


def _role_reason(role: str, stage: int) -> str:
    return {
        "first": "runs before the first block (embeddings): first stage",
        "last": "runs after the last block (final norm, head): last stage",
        "between": "runs between two blocks: stays with the block before it",
    }.get(role, f"in stage {stage}")


def _shared(tree: SizeTree, stage_of: dict[str, int]) -> tuple[SharedTensor, ...]:
    """Tied tensors whose names fall in more than one stage: the leader's stage first."""
    out = []
    for group in tree.ties:
        lead_stage = stage_of[owner(group[0], stage_of)]  # type: ignore[index]
        others = sorted({stage_of[owner(f, stage_of)] for f in group[1:]} - {lead_stage})  # type: ignore[index]
        if others:
            follower = next(f for f in group[1:] if stage_of[owner(f, stage_of)] in others)  # type: ignore[index]
            out.append(SharedTensor(follower, group[0], (lead_stage, *others), tree.tensor_bytes(group[0])))
    return tuple(out)


def _cuts(
    items: _Items,
    bounds: list[int],
    stage_bytes: list[int],
    stage_flops: list[int],
    request: _Request,
    best: int | None,
    with_run: bool = False,
) -> list[StageCut]:
    """One cut per stage boundary, with the reason it is where it is (``stage_bytes``: what
    each stage holds, its run included)."""
    compute = request.balance == "compute"
    load = stage_flops if compute else stage_bytes
    metric = items.flops if compute else items.held
    balanced = "weights + KV cache + activations" if with_run and not compute else request.balance

    def fmt(x: int) -> str:
        return f"{x / 1e9:.3g} GFLOP/token" if compute else format_size(x)

    cuts = []
    for s in range(1, request.k):
        b = bounds[s]
        first_block = next(n for n in items.names[b] if items.roles[n] == "block")
        if best is None:
            reason = f"given: stage {s} begins here ({fmt(load[s - 1])} | {fmt(load[s])})"
        else:
            later, earlier = load[s - 1] + metric[b], load[s] + metric[b - 1]
            reason = (
                f"balanced by {balanced}: stage {s - 1} {fmt(load[s - 1])}, stage {s} "
                f"{fmt(load[s])}; one block later stage {s - 1} would be {fmt(later)}, one block "
                f"earlier stage {s} would be {fmt(earlier)}"
            )
            if request.budgets[s - 1] is not None:
                reason += f" (budget {format_size(request.budgets[s - 1])})"  # type: ignore[arg-type]
        cuts.append(StageCut(s, first_block, reason))
    return cuts


def _needs(weights: int, kv: int, act: int, run: bool) -> str:
    """``"1.0 GiB"``, or with a run ``"1.0 GiB weights + 64 MiB KV cache + 8 MiB activations = ..."``."""
    if not run:
        return format_size(weights)
    return (
        f"{format_size(weights)} weights + {format_size(kv)} KV cache + {format_size(act)} activations = "
        f"{format_size(weights + kv + act)}"
    )


def _does_not_fit(tree: SizeTree, items: _Items, request: _Request) -> PipelineError:
    """Which stage does not fit its budget, and by how much (found before anything loads)."""
    budgets = [b for b in request.budgets if b is not None]
    run = bool(items.kv)
    total, kv = sum(items.nbytes), sum(items.kv)
    problems = []
    if total + kv > sum(budgets):
        tied = ", tied tensors counted in each stage that loads them" if tree.ties else ""
        what = f"weights ({format_size(total)}{tied})" + (f" and KV cache ({format_size(kv)})" if run else "")
        problems.append(
            f"the stages' {what} exceed the {len(budgets)} budgets "
            f"together ({format_size(sum(budgets))}) by {format_size(total + kv - sum(budgets))}"
        )
    for i, group in enumerate(items.names):
        need = items.held[i] + items.act_of(i)
        if need > max(budgets):
            problems.append(
                f"{' + '.join(group)} alone needs {_needs(items.nbytes[i], items.kv[i] if run else 0, items.span_act((i,)), run)}"
                f", more than the largest budget ({format_size(max(budgets))})"
            )
    if 0 not in items.nbytes:  # every block holds bytes: a stage with nothing to spend holds none
        problems += [
            f"stage {s} has a budget of 0 B: every stage holds at least one block"
            for s, b in enumerate(budgets)
            if b == 0
        ]
    for s, (span, weights, cache, act), budget in _even_fill(items, request.budgets):  # type: ignore[arg-type]
        need = weights + cache + act
        problems.append(
            f"stage {s} ({span}) needs {_needs(weights, cache, act, run)} with a budget of "
            f"{format_size(budget)}: {format_size(need - budget)} over"
        )
    root = tree.nodes[""].class_name or "the model"
    wide = any(spec.dtype in ("float32", "float64") for spec in tree.tensors.values())
    return PipelineError(
        f"cannot cut {root} ({format_size(tree.total(''))}) into {request.k} stages within the budgets",
        problems,
        fix=_FIX + (_FIX_DTYPE if wide else ""),
    )


def _even_fill(items: _Items, budgets: Sequence[int]) -> list[tuple[int, tuple[str, int, int, int], int]]:
    """The stages over budget when the bytes are spread by budget share, budgets ignored:
    ``(stage, (its span, weights, KV cache, activations), budget)``."""
    if min(budgets) == 0:
        return []
    held = items.held
    chain = Chain(held, [0] * len(held))
    reserves = _reserves(items, len(budgets))
    caps = _Caps(tuple(budgets), (UNLIMITED,) * len(budgets), reserves)
    top = (chain.pm[-1] + max(reserves)) * max(budgets) // min(budgets) + 1
    best = smallest(chain, caps, top)
    reach = reachable(chain, caps(best))
    if reach is None:
        return []
    bounds = choose(chain, reach, caps(best), caps.shares)
    out = []
    for s, budget in enumerate(budgets):
        span_items = range(bounds[s], bounds[s + 1])
        weights = sum(items.nbytes[i] for i in span_items)
        cache = sum(items.kv[i] for i in span_items) if items.kv else 0
        act = items.span_act(span_items)
        if weights + cache + act > budget:
            first, last = items.names[bounds[s]][0], items.names[bounds[s + 1] - 1][-1]
            span = first if first == last else f"{first} .. {last}"
            out.append((s, (span, weights, cache, act), budget))
    return out
