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
share of the total.

Example:
    >>> from bigviz.core.tree import SizeTree, TensorSpec
    >>> specs = [TensorSpec("emb.weight", 600, "float32")]
    >>> specs += [TensorSpec(f"h.{i}.weight", 100, "float32") for i in range(8)]
    >>> plan = make_pipeline_plan(SizeTree.build(specs), 2, no_split=["h.*"])
    >>> plan.stages[0], plan.stage_bytes
    (('emb', 'h.0'), (2800, 2800))
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import accumulate

from bigviz.core.names import leaf, owner, parent
from bigviz.core.pipeline import BALANCES, PipelineError, PipelinePlan, PipelineUnit, SharedTensor, StageCut
from bigviz.core.nosplit import is_no_split as _is_no_split
from bigviz.core.tree import SizeTree
from bigviz.core.sizes import UNLIMITED, format_size, parse_size

__all__ = ["pipeline_units", "make_pipeline_plan", "cut_pipeline", "unit_flops"]

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
    name = leaf(module).lower()  # planned from headers: no class names
    return "emb" in name or name in ("wte", "wpe")


@dataclass(frozen=True)
class _Items:
    """The chain the cuts split: one item per block (with the units it carries)."""

    names: tuple[tuple[str, ...], ...]
    roles: dict[str, str]
    nbytes: tuple[int, ...]  # with the tied tensors an item would borrow (an upper bound)
    flops: tuple[int, ...]


def _items(tree: SizeTree, units: list[tuple[str, str]]) -> _Items:
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
    return _Items(
        tuple(tuple(g) for g in groups),
        dict(units),
        tuple(nbytes),
        tuple(sum(unit_flops(tree, n) for n in g) for g in groups),
    )


class _Chain:
    """Prefix sums of the balanced metric and of bytes, and per-stage caps on both."""

    def __init__(self, metric: Sequence[int], nbytes: Sequence[int]) -> None:
        self.n = len(metric)
        self.wm, self.wb = list(metric), list(nbytes)
        self.pm = list(accumulate(metric, initial=0))
        self.pb = list(accumulate(nbytes, initial=0))
        self._by_m = sorted(range(self.n), key=self.wm.__getitem__)
        self._by_b = sorted(range(self.n), key=self.wb.__getitem__)
        self._sorted_m = [self.wm[i] for i in self._by_m]
        self._sorted_b = [self.wb[i] for i in self._by_b]

    def far(self, p: int, cap: tuple[int, int]) -> int:
        """The last end q such that items p..q-1 fit ``cap`` (p itself when item p does not)."""
        return (
            min(bisect.bisect_right(self.pm, self.pm[p] + cap[0]), bisect.bisect_right(self.pb, self.pb[p] + cap[1]))
            - 1
        )

    def near(self, q: int, cap: tuple[int, int]) -> int:
        """The first start p such that items p..q-1 fit ``cap``."""
        return max(bisect.bisect_left(self.pm, self.pm[q] - cap[0]), bisect.bisect_left(self.pb, self.pb[q] - cap[1]))

    def too_big(self, cap: tuple[int, int]) -> list[int]:
        """Positions of the items that alone exceed ``cap`` (usually none, or the head)."""
        if not self.n or (self._sorted_m[-1] <= cap[0] and self._sorted_b[-1] <= cap[1]):
            return []
        big_m = self._by_m[bisect.bisect_right(self._sorted_m, cap[0]) :]
        big_b = self._by_b[bisect.bisect_right(self._sorted_b, cap[1]) :]
        return sorted(set(big_m) | set(big_b))


Intervals = list[tuple[int, int]]


def _ends(chain: _Chain, starts: Intervals, cap: tuple[int, int], limit: int) -> Intervals:
    """Every position where a stage can end, given where it can start (sorted intervals).

    From starts a..b a stage ends at p+1 for every p in a..b whose item fits, and at every
    position up to far(b) when item b fits: the gaps are exactly the items too big for it.
    """
    big = chain.too_big(cap)
    found: Intervals = []
    for a, b in starts:
        b = min(b, chain.n - 1)  # a stage starting at the end would be empty
        lo = a + 1
        for hole in big[bisect.bisect_left(big, a) : bisect.bisect_right(big, b)]:
            if lo <= hole:
                found.append((lo, hole))
            lo = hole + 2
        if lo <= b + 1:
            found.append((lo, b + 1))
        far = chain.far(b, cap)
        if far >= b + 2:  # implies item b fits
            found.append((b + 2, far))
    return _merge([(a, min(b, limit)) for a, b in found if a <= limit])


def _merge(intervals: Intervals) -> Intervals:
    out: Intervals = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _reachable(chain: _Chain, caps: Sequence[tuple[int, int]]) -> list[Intervals] | None:
    """Where each stage can start (``[0]`` for stage 0), or None when the caps cannot hold
    the chain in ``len(caps)`` non-empty stages."""
    k = len(caps)
    starts: list[Intervals] = [[(0, 0)]]
    for i, cap in enumerate(caps):
        ends = _ends(chain, starts[-1], cap, chain.n - (k - 1 - i))
        if not ends:
            return None
        starts.append(ends)
    return starts if starts[-1][-1][1] == chain.n else None


def _choose(
    chain: _Chain, starts: list[Intervals], caps: Sequence[tuple[int, int]], shares: Sequence[int]
) -> list[int]:
    """Stage boundaries (0, b1, ..., n): from the last stage back, each start is the feasible
    one nearest to its even share of the metric."""
    k, total = len(caps), chain.pm[-1]
    bounds = [chain.n]
    for i in range(k - 1, 0, -1):
        end = bounds[-1]
        lo_fit = chain.near(end, caps[i])
        target = total * sum(shares[:i]) / sum(shares)
        candidates = []
        for a, b in starts[i]:
            a, b = max(a, lo_fit), min(b, end - 1)
            if a <= b:
                mid = min(max(bisect.bisect_left(chain.pm, target, a, b + 1), a), b)
                candidates += [a, b, mid, max(a, mid - 1)]
        even = chain.n * i / k
        bounds.append(min(candidates, key=lambda p: (abs(chain.pm[p] - target), abs(p - even))))
    return [0] + bounds[::-1]


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
    (shares: budgets when bytes are balanced against budgets, else equal), bytes the budget."""

    shares: tuple[int, ...]
    byte_caps: tuple[int, ...]

    def __call__(self, t: int) -> list[tuple[int, int]]:
        top = max(max(self.shares), 1)  # all-zero budgets: every cap is 0
        return [(t * s // top, cb) for s, cb in zip(self.shares, self.byte_caps)]

    @classmethod
    def of(cls, request: _Request) -> _Caps:
        known = [b for b in request.budgets if b is not None]
        proportional = request.balance == "bytes" and len(known) == request.k
        shares = tuple(known) if proportional else (1,) * request.k
        return cls(shares, tuple(UNLIMITED if b is None else b for b in request.budgets))


def _smallest(chain: _Chain, caps: _Caps, upper: int) -> int:
    """The smallest bottleneck T in [0, upper] whose caps hold the chain (binary search)."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _reachable(chain, caps(mid)) is not None else (mid + 1, hi)
    return lo


def _balance(chain: _Chain, request: _Request) -> tuple[list[int], int] | None:
    """The boundaries with the smallest bottleneck, and that bottleneck; ``None`` when even
    the budgets themselves cannot hold the chain (the caller says which stage, by how much)."""
    caps = _Caps.of(request)
    upper = max(caps.shares) if caps.shares != (1,) * request.k else max(chain.pm[-1], 1)
    if _reachable(chain, caps(upper)) is None:
        return None
    best = _smallest(chain, caps, upper)
    reach = _reachable(chain, caps(best))
    assert reach is not None  # feasible at `upper`, and feasibility grows with T
    return _choose(chain, reach, caps(best), caps.shares), best


def make_pipeline_plan(
    tree: SizeTree,
    stages: int | Sequence[int | str],
    *,
    no_split: Collection[str] = (),
    balance: str = "bytes",
    dtype: str | None = None,
) -> PipelinePlan:
    """Cut ``tree`` into pipeline stages between no-split units.

    Args:
        tree: the model's size tree.
        stages: the number of stages, or one byte budget per stage (``["20GiB", "20GiB"]``).
        no_split: classes or name globs of the blocks (``"Block"``, ``"transformer.h.*"``).
        balance: ``"bytes"`` (weights per stage) or ``"compute"`` (FLOPs per token).
        dtype: recorded in the plan (the tree is already sized for it).

    Raises:
        PipelineError: a bad stage count, more stages than blocks, an unknown balance, or
            budgets too small (saying which stage does not fit and by how much).
    """
    units = pipeline_units(tree, no_split)
    items = _items(tree, units)
    request = _parse_request(stages, balance, len(items.names), units)
    metric = items.flops if balance == "compute" else items.nbytes
    chain = _Chain(metric, items.nbytes)
    balanced = _balance(chain, request)
    if balanced is None:
        raise _does_not_fit(tree, items, request)
    bounds, best = balanced
    return _assemble(tree, items, bounds, request, no_split, dtype, best)


def cut_pipeline(
    tree: SizeTree,
    split_points: Sequence[str],
    *,
    no_split: Collection[str] = (),
    balance: str = "bytes",
    budgets: Sequence[int | None] | None = None,
    dtype: str | None = None,
) -> PipelinePlan:
    """The plan with stages beginning at ``split_points`` (blocks of ``tree``, in order).

    This re-derives a plan for a model from a saved one: the same cuts, this model's units.

    Raises:
        PipelineError: naming every split point that is not a block, or out of order.

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> t = SizeTree.build([TensorSpec(f"h.{i}.w", 4, "float32") for i in range(4)])
        >>> cut_pipeline(t, ["h.1"], no_split=["h.*"]).stages
        (('h.0',), ('h.1', 'h.2', 'h.3'))
    """
    units = pipeline_units(tree, no_split)
    items = _items(tree, units)
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
    return _assemble(tree, items, [0, *positions, len(items.names)], request, no_split, dtype, None)


def _assemble(
    tree: SizeTree,
    items: _Items,
    bounds: list[int],
    request: _Request,
    no_split: Collection[str],
    dtype: str | None,
    best: int | None,
) -> PipelinePlan:
    stage_of_item = [s for s in range(request.k) for _ in range(bounds[s], bounds[s + 1])]
    stage_of = {n: stage_of_item[i] for i, group in enumerate(items.names) for n in group}
    shared = _shared(tree, stage_of)
    stage_bytes = [0] * request.k
    stage_flops = [0] * request.k
    for i, group in enumerate(items.names):
        stage_bytes[stage_of_item[i]] += sum(tree.total(n) for n in group)
        stage_flops[stage_of_item[i]] += items.flops[i]
    for s in shared:
        for stage in s.stages[1:]:
            stage_bytes[stage] += s.nbytes
    cuts = _cuts(items, bounds, stage_bytes, stage_flops, request, best)
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
) -> list[StageCut]:
    """One cut per stage boundary, with the reason it is where it is."""
    compute = request.balance == "compute"
    load = stage_flops if compute else stage_bytes
    metric = items.flops if compute else items.nbytes

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
                f"balanced by {request.balance}: stage {s - 1} {fmt(load[s - 1])}, stage {s} "
                f"{fmt(load[s])}; one block later stage {s - 1} would be {fmt(later)}, one block "
                f"earlier stage {s} would be {fmt(earlier)}"
            )
            if request.budgets[s - 1] is not None:
                reason += f" (budget {format_size(request.budgets[s - 1])})"  # type: ignore[arg-type]
        cuts.append(StageCut(s, first_block, reason))
    return cuts


def _does_not_fit(tree: SizeTree, items: _Items, request: _Request) -> PipelineError:
    """Which stage does not fit its budget, and by how much (found before anything loads)."""
    budgets = [b for b in request.budgets if b is not None]
    total = sum(items.nbytes)
    problems = []
    if total > sum(budgets):
        tied = ", tied tensors counted in each stage that loads them" if tree.ties else ""
        problems.append(
            f"the stages' weights ({format_size(total)}{tied}) exceed the {len(budgets)} budgets "
            f"together ({format_size(sum(budgets))}) by {format_size(total - sum(budgets))}"
        )
    for group, size in zip(items.names, items.nbytes):
        if size > max(budgets):
            problems.append(
                f"{' + '.join(group)} alone needs {format_size(size)}, more than the largest "
                f"budget ({format_size(max(budgets))})"
            )
    if 0 not in items.nbytes:  # every block holds bytes: a stage with nothing to spend holds none
        problems += [
            f"stage {s} has a budget of 0 B: every stage holds at least one block"
            for s, b in enumerate(budgets)
            if b == 0
        ]
    for s, need, budget in _even_fill(items, request.budgets):  # type: ignore[arg-type]
        problems.append(
            f"stage {s} ({need[0]}) needs {format_size(need[1])} with a budget of "
            f"{format_size(budget)}: {format_size(need[1] - budget)} over"
        )
    root = tree.nodes[""].class_name or "the model"
    wide = any(spec.dtype in ("float32", "float64") for spec in tree.tensors.values())
    return PipelineError(
        f"cannot cut {root} ({format_size(tree.total(''))}) into {request.k} stages within the budgets",
        problems,
        fix=_FIX + (_FIX_DTYPE if wide else ""),
    )


def _even_fill(items: _Items, budgets: Sequence[int]) -> list[tuple[int, tuple[str, int], int]]:
    """The stages over budget when the bytes are spread by budget share, budgets ignored:
    ``(stage, (its span, bytes), budget)``."""
    if min(budgets) == 0:
        return []
    chain = _Chain(items.nbytes, [0] * len(items.nbytes))
    caps = _Caps(tuple(budgets), (UNLIMITED,) * len(budgets))
    best = _smallest(chain, caps, chain.pm[-1] * max(budgets) // min(budgets) + 1)
    reach = _reachable(chain, caps(best))
    if reach is None:
        return []
    bounds = _choose(chain, reach, caps(best), caps.shares)
    out = []
    for s, budget in enumerate(budgets):
        need = chain.pm[bounds[s + 1]] - chain.pm[bounds[s]]
        if need > budget:
            first, last = items.names[bounds[s]][0], items.names[bounds[s + 1] - 1][-1]
            span = first if first == last else f"{first} .. {last}"
            out.append((s, (span, need), budget))
    return out
