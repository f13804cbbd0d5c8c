"""The planner: budgets in, a :class:`~bigviz.core.plan.DevicePlan` out, in linear time.

One greedy pass over the size tree in definition order fills devices in order (GPUs, then
mps, cpu, disk). A module that does not fit is split into its direct tensors and children,
unless it is no-split, in which case it moves on to the next device. Each module is looked at
a bounded number of times, so the pass is O(modules x devices), where accelerate's planner is
quadratic when layer sizes decrease along the model.

Room for offloaded weights streamed in at forward time is reserved only when the pass
actually offloads something: the pass is repeated (at most a few times) with the reserve the
previous pass showed was needed.

Example:
    >>> from bigviz.core.tree import SizeTree, TensorSpec
    >>> layers = [TensorSpec(f"layers.{i}.weight", 10_000, "float32") for i in range(10)]
    >>> tree = SizeTree.build(layers + [TensorSpec("head.weight", 100_000, "float32")])
    >>> plan = make_plan(tree, {0: 560_000, 1: 10**9}, PlanOptions(strategy="sequential"))
    >>> plan.device_map, round(plan.usage_of(0).fraction, 2)
    ({'layers': 0, 'head': 1}, 0.71)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from dataclasses import dataclass, field, replace

from bigviz.core.devicemap import clean_device_map
from bigviz.core.errors import PlanError
from bigviz.core.names import ancestors, is_prefix, parent
from bigviz.core.nosplit import check_no_split, is_no_split, no_split_problems
from bigviz.core.offload_units import UnitRule, above_blocks, streamed_needs, unit_sizes
from bigviz.core.reasons import write_reason
from bigviz.core.run_charges import (
    Run,
    charge_run,
    check_run_fits,
    follower_hold,
    follower_step,
    keep_step,
    run_bytes,
    run_room,
    run_usage,
    streamed_run_needs,
)
from bigviz.core.plan import STRATEGIES, DevicePlan, DeviceUsage, Placement, PlanOptions, Why
from bigviz.core.tree import SizeTree
from bigviz.core.devices import Device, device_label, execution_device, normalize_device, streamed_devices
from bigviz.core.sizes import UNLIMITED, format_size, parse_max_memory, parse_size

__all__ = [
    "make_plan",
    "unit_rule",
    "PlanError",
    "is_no_split",
    "no_split_problems",
    "check_no_split",
    "balanced_budgets",
]

_MAX_PASSES = 6
_RUN_PASSES = 10
"""Extra passes a workload may take: the KV cache of a streamed layer lives on the execution
device, so each layer pushed off it brings its cache back there; the reserve grows towards
what is needed geometrically (by the ratio of a layer's cache to its weights plus cache)."""


_Placed = tuple[Any, ...]
"""``(name, device, bytes, override, tied_to, *why)``: one flat tuple of plain values per
placement, which the garbage collector stops tracking at its first collection (reasons kept
as partials, or nested tuples, made it run full collections over every live object)."""


@dataclass
class _Pass:
    """Mutable state of one greedy pass."""

    remaining: dict[Device, int]
    used: dict[Device, int]
    placed: list[_Placed] = field(default_factory=list)
    where: dict[str, Device] = field(default_factory=dict)  # tie leader -> the device it went to
    unplaced: list[str] = field(default_factory=list)
    # room set aside on a leader's device for the tied follower units still to come
    promised: dict[str, tuple[Device, int]] = field(default_factory=dict)
    follower_units: dict[str, int] = field(default_factory=dict)
    run: Run | None = None  # a workload's KV cache and activations, when one is planned
    ties: _Ties | None = None


@dataclass(frozen=True)
class _Ties:
    """Tie pairs ``(follower, leader)`` indexed by every module (and tensor) that holds one
    end, so a module only ever looks at its own ties: O(ties x depth) in all, where scanning
    every tie at every module was quadratic (2,000 tied pairs: 15x the work of 500)."""

    by_follower: dict[str, list[tuple[str, str]]]  # name -> ties whose follower is under it
    by_leader: dict[str, list[tuple[str, str]]]  # name -> ties whose leader is under it

    @classmethod
    def index(cls, tree: SizeTree) -> _Ties:
        by_follower: dict[str, list[tuple[str, str]]] = {}
        by_leader: dict[str, list[tuple[str, str]]] = {}
        for follower, leader in tree.leader_of.items():
            for name in ancestors(follower):
                by_follower.setdefault(name, []).append((follower, leader))
            for name in ancestors(leader):
                by_leader.setdefault(name, []).append((follower, leader))
        return cls(by_follower, by_leader)


def make_plan(tree: SizeTree, max_memory: Mapping[Any, object], options: PlanOptions | None = None) -> DevicePlan:
    """Place every module of ``tree`` within ``max_memory``.

    A balanced plan (``"auto"``, ``"balanced"``) caps each GPU at its share; where those caps
    would stream weights in from CPU RAM or disk and filling the GPUs in order streams fewer, the
    filled plan is returned, with a note: an uneven split costs nothing at run time, an offloaded
    layer costs every forward (``"balanced_low_0"`` keeps its low GPU 0: that is its purpose).

    Args:
        tree: the model's size tree.
        max_memory: budgets per device (bytes or strings such as ``"10GiB"``); ``"disk"``
            is unlimited unless given.
        options: strategy, no-split classes, reserves and overrides.

    Raises:
        PlanError: for an unknown strategy, bad overrides or reserves, or a model that does
            not fit in the budgets (listing what is left over and how to fix it).
    """
    options = options or PlanOptions()
    result = _make_plan(tree, max_memory, options)
    streamed = sum(result.offloaded_bytes().values())
    capped = any(u.cap < u.budget for u in result.usage)  # no GPU capped: the fill in order is this plan
    if options.strategy not in ("auto", "balanced") or not streamed or not capped:
        return result
    try:
        filled = _make_plan(tree, max_memory, replace(options, strategy="sequential"))
    except PlanError:
        return result
    if sum(filled.offloaded_bytes().values()) >= streamed:
        return result
    note = (
        f"the balanced shares would stream {format_size(streamed)} in per forward; the GPUs filled in "
        f"order stream {format_size(sum(filled.offloaded_bytes().values()))}: placed in order instead"
    )
    return replace(filled, strategy=options.strategy, notes=(note, *filled.notes), _cache={})


def _make_plan(tree: SizeTree, max_memory: Mapping[Any, object], options: PlanOptions) -> DevicePlan:
    """:func:`make_plan` for the strategy ``options`` names, as it is."""
    budgets = parse_max_memory(max_memory)
    budgets.setdefault("disk", UNLIMITED)
    overrides, reserve = _check_inputs(tree, budgets, options)
    main = _main_device(budgets, options)
    caps, notes = _strategy_caps(tree, budgets, options)
    offload = {d: 0 for d in budgets}
    ties = _Ties.index(tree)
    for _ in range(_MAX_PASSES + (_RUN_PASSES if options.kv_cache or options.activations or options.held else 0)):
        state = _greedy(tree, caps, reserve, offload, overrides, options, ties)
        staging = _offload_needs(tree, state, main, options)
        streamed_run = streamed_run_needs(state.run, main)  # a streamed layer's cache lives on main
        needed = {d: staging[d] + streamed_run.get(d, 0) for d in budgets}
        if all(needed[d] <= offload[d] for d in budgets):
            break
        offload = {d: max(offload[d], needed[d]) for d in budgets}
    else:  # no fixed point in a few passes: reserve what any plan could need, then it holds
        bound = _offload_bound(tree, options)
        offload = {d: max(offload[d], bound if needed[d] else 0) for d in budgets}
        state = _greedy(tree, caps, reserve, offload, overrides, options, ties)
        staging = _offload_needs(tree, state, main, options)
    if state.unplaced:
        raise PlanError(_does_not_fit(tree, budgets, state))
    if options.strategy != "sequential" and _spread_streamed(tree, state, ties, main):
        staging = _offload_needs(tree, state, main, options)
        notes.append(
            "CPU and disk blocks interleaved (same blocks, same bytes on each): each block streamed "
            "from disk is read while resident ones compute (strategy='sequential' keeps them in order)"
        )
    # the room reported kept for weights is what the final placement's units need (the unit rule,
    # as the engine fetches them); the passes may have reserved more on the way
    notes += [
        f"{device_label(d)} keeps {format_size(v)} free for offloaded weights streamed in at forward time"
        for d, v in staging.items()
        if v > 0
    ]
    kv, act, slack = run_usage(state.run, main)
    usage = tuple(
        DeviceUsage(
            d,
            budgets[d],
            caps[d],
            reserve.get(d, 0) + slack.get(d, 0),
            max(staging[d], 0),
            state.used[d],
            kv.get(d, 0),
            act.get(d, 0),
        )
        for d in budgets
    )
    if state.run is not None:
        check_run_fits(usage, bool(overrides))
    notes += _warnings(usage, main, options.prefetch)
    capped = {g: _share_name(options.strategy) for g in budgets if caps[g] < budgets[g]}
    kept = {d: (reserve.get(d, 0), state.run.slack.get(d, 0.0) if state.run else 0.0) for d in budgets}
    return DevicePlan(
        _placements(tree, state, capped, kept),
        usage,
        options.strategy,
        main,
        tuple(notes),
        tree,
        workload=options.workload,
        rule=unit_rule(options, main),
        prefetch=options.prefetch,
    )


def _warnings(usage: tuple[DeviceUsage, ...], main: Device, prefetch: bool = True) -> list[str]:
    """What a person should know: a device over its budget, an execution device left empty.

    A device whose room for streamed weights is more than its whole budget is flagged, not
    refused (a plan of weights only is made whatever the budgets, so a disk always takes what
    is left): its usage is over budget, ``plan.fits()`` is False, and the note says it would
    run out of memory at the first streamed block. A run (``context_length``) there is refused
    (:func:`~bigviz.core.run_charges.check_run_fits`)."""
    out = []
    for u in usage:
        over = -u.free
        if u.offload_reserve and u.reserve + u.offload_reserve > u.budget:
            kept = f" (+ {format_size(u.reserve)} reserved)" if u.reserve else ""
            fewer = ", prefetch=False (room for the running block only, no read-ahead)" if prefetch else ""
            out.append(
                f"does not fit: {device_label(u.device)} must keep {format_size(u.offload_reserve)} free for the "
                f"offloaded weights streamed in at forward time{kept}, {format_size(over)} over its whole budget "
                f"of {format_size(u.budget)}: the first streamed block would run out of memory there "
                f"(plan.fits() is False). Give it more memory{fewer}, or plan a smaller dtype"
            )
        elif over > 0 and u.used:
            out.append(
                f"{device_label(u.device)} is over its budget by {format_size(over)} "
                f"(overrides put more there than fits)"
            )
        elif u.device == main and u.used == 0 and u.offload_reserve and u.budget:
            out.append(
                f"{device_label(u.device)} holds no weights: its {format_size(u.budget)} is all "
                f"needed for the offloaded weights streamed in; give it more memory or use a "
                f"smaller dtype"
            )
    return out


def _check_inputs(
    tree: SizeTree, budgets: dict[Device, int], options: PlanOptions
) -> tuple[dict[str, Device], dict[Device, int]]:
    problems = []
    if options.strategy not in STRATEGIES:
        problems.append(f"unknown strategy {options.strategy!r}: use one of {', '.join(STRATEGIES)}")
    overrides: dict[str, Device] = {}
    for name, device in options.overrides.items():
        if name not in tree.nodes and name not in tree.tensors:
            problems.append(f"override {name!r} names no module or tensor of the model")
            continue
        try:
            overrides[name] = normalize_device(device)
        except ValueError as err:
            problems.append(f"override {name!r}: {err}")
            continue
        if overrides[name] not in budgets:
            problems.append(
                f"override {name!r} sends it to {device_label(overrides[name])}, which has "
                f"no budget: add it to max_memory"
            )
    reserve: dict[Device, int] = {}
    for device, size in (options.reserve or {}).items():
        try:
            reserve[normalize_device(device)] = parse_size(size)  # type: ignore[arg-type]
        except ValueError as err:
            problems.append(f"reserve[{device!r}]: {err}")
            continue
        if normalize_device(device) not in budgets:  # a typo'd device would keep nothing free, silently
            problems.append(
                f"reserve[{device!r}] keeps room on {device_label(normalize_device(device))}, which has "
                f"no budget: add it to max_memory or drop it from reserve"
            )
    PlanError.check(problems, "cannot plan")
    return overrides, reserve


def _main_device(budgets: Mapping[Device, int], options: PlanOptions) -> Device:
    if options.rule.main_device is not None:
        return normalize_device(options.rule.main_device)
    return execution_device(budgets)


def _next_largest_layer(tree: SizeTree, blocks: frozenset[str]) -> int:
    """The layer accelerate keeps free on its main device while filling it: the largest layer
    (a no-split module, or a leaf module outside one) still to place. It recounts that as it
    goes, so the first layer (the embeddings, placed first) does not count."""
    layers = []
    inside: str | None = None
    for name, node in tree.nodes.items():
        if inside is not None and is_prefix(inside, name):
            continue
        if name and is_no_split(tree, name, blocks):
            layers.append(node.total_bytes)
            inside = name
        elif not node.children and node.total_bytes:
            layers.append(node.total_bytes)
    return max(layers[1:], default=0)


def _strategy_caps(
    tree: SizeTree, budgets: dict[Device, int], options: PlanOptions
) -> tuple[dict[Device, int], list[str]]:
    """How much of each GPU the strategy lets the pass fill (balanced ones spread the model).

    The split transformers' ``from_pretrained(device_map="auto")`` makes, by accelerate's own
    arithmetic: ``get_balanced_memory`` gives each GPU but the last ``total // n`` plus a
    buffer of 1.25 x the larger of the largest no-split block and the mean leaf module
    (``balanced_low_0``: ``total // (n - 1)`` on GPUs 1.., and GPU 0 only what they leave), then
    ``infer_auto_device_map`` keeps the largest layer free on GPU 0, its main device, which
    is what evens the split. bigviz keeps that layer off GPU 0's share rather than as a reserve,
    so the split is the same whether or not anything is offloaded. A run's caches spread with
    their layers (``total``) and its largest step widens the buffer.
    """
    gpus = sorted(d for d in budgets if isinstance(d, int) and budgets[d] > 0)
    if options.strategy == "sequential" or len(gpus) < 2:
        return dict(budgets), []
    blocks = options.rule.blocks
    caps = balanced_budgets(
        tree,
        budgets,
        blocks,
        low_zero=options.strategy == "balanced_low_0",
        run_bytes=sum(options.kv_cache.values()),  # a workload's caches spread with their layers
        run_step=max(options.activations.values(), default=0),
    )
    caps[gpus[0]] = max(0, caps[gpus[0]] - _next_largest_layer(tree, blocks))  # kept for the main device
    capped = [g for g in gpus if caps[g] < budgets[g]]
    notes = [
        f"{options.strategy}: {device_label(g)} filled up to {format_size(caps[g])} of "
        f"{format_size(budgets[g])} so the model spreads over the GPUs"
        + (" (less its largest layer, as transformers' device_map='auto' keeps it)" if g == gpus[0] else "")
        for g in capped
    ]
    return caps, notes


def balanced_budgets(
    tree: SizeTree,
    budgets: Mapping[Device, int],
    blocks: frozenset[str] = frozenset(),
    *,
    low_zero: bool = False,
    run_bytes: int = 0,
    run_step: int = 0,
) -> dict[Device, int]:
    """accelerate's ``get_balanced_memory`` arithmetic on a size tree: each GPU but the last
    (those with a budget) gets at most ``total // n`` plus a buffer of 1.25 x the larger of the
    largest no-split block (``blocks``) and the mean leaf module; ``low_zero`` spreads over GPUs
    1.. and leaves GPU 0 only what they cannot hold. ``run_bytes`` (a run's KV caches) adds to the
    total and ``run_step`` (its largest step) to the buffer. Other devices keep their budgets.

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> tree = SizeTree.build([TensorSpec(f"h.{i}.weight", 100, "float32") for i in range(4)])
        >>> balanced_budgets(tree, {0: 10**6, 1: 10**6, "cpu": 10**9})
        {0: 1300, 1: 1000000, 'cpu': 1000000000}
    """
    caps = dict(budgets)
    gpus = sorted(d for d in budgets if isinstance(d, int) and budgets[d] > 0)
    if len(gpus) < 2:
        return caps
    total = tree.total("") + run_bytes
    leaves = [n.total_bytes for n in tree.nodes.values() if not n.children and n.total_bytes]
    mean_leaf = sum(leaves) // max(len(leaves), 1)
    block = max((n.total_bytes for name, n in tree.nodes.items() if is_no_split(tree, name, blocks)), default=0)
    share = total // (len(gpus) - 1 if low_zero else len(gpus)) + int(1.25 * max(block, mean_leaf)) + run_step
    for g in gpus[:-1]:
        if not (low_zero and g == gpus[0]):
            caps[g] = min(budgets[g], share)
    if low_zero:
        caps[gpus[0]] = min(budgets[gpus[0]], max(0, total - sum(caps[g] for g in gpus[1:])))
    return caps


def _greedy(
    tree: SizeTree,
    caps: Mapping[Device, int],
    reserve: Mapping[Device, int],
    offload: Mapping[Device, int],
    overrides: Mapping[str, Device],
    options: PlanOptions,
    ties: _Ties,
) -> _Pass:
    state = _Pass({d: caps[d] - reserve.get(d, 0) - offload[d] for d in caps}, {d: 0 for d in caps}, ties=ties)
    must_split = {a for name in overrides for a in ancestors(parent(name))} if overrides else set()
    if options.kv_cache or options.activations or options.held:  # overrides are placed first: charge their run too
        state.run = Run.build(tree, options, _main_device(caps, options), _streamed(_main_device(caps, options)))
    for name in sorted(overrides, key=lambda n: n.count(".") + bool(n)):  # outer ones first
        device = overrides[name]
        _put(tree, state, name, device, _override_charge(tree, name, overrides), ("override",), override=True)
    state.follower_units = {
        f: _follower_unit_bytes(tree, f, leader, options.rule.blocks) for f, leader in tree.leader_of.items()
    }
    devices = list(caps)
    streamed = _streamed(_main_device(caps, options))
    index = 0
    stack = [""] if "" not in overrides else []
    while stack:
        name = stack.pop()
        if name in overrides:
            continue
        size = tree.total(name)
        splittable = (
            name in tree.nodes
            and bool(tree.nodes[name].children)
            and (name in must_split or not is_no_split(tree, name, options.rule.blocks))
        )
        leader = _outside_leader(ties, name, state.where)
        if name in must_split or (leader and splittable):
            _split(tree, name, stack)
            continue
        if leader:
            device = state.where[leader]
            for follower, _ in ties.by_follower.get(name, ()):
                if follower in state.promised:
                    state.remaining[device] += state.promised.pop(follower)[1]
            _put(tree, state, name, device, size, ("tied", leader), tied_to=leader)
            continue
        index = _fit(tree, state, name, size, splittable, stack, devices, index, streamed)
    return state


def _override_charge(tree: SizeTree, name: str, overrides: Mapping[str, Device]) -> int:
    """Bytes an override adds to its device: its subtree less the overrides nested in it
    (each nested one is charged to its own device)."""
    inner = [o for o in overrides if o != name and is_prefix(name, o)]
    outermost = [o for o in inner if not any(m != o and is_prefix(m, o) for m in inner)]
    return tree.total(name) - sum(tree.total(o) for o in outermost)


def _fit(
    tree: SizeTree,
    state: _Pass,
    name: str,
    size: int,
    splittable: bool,
    stack: list[str],
    devices: list[Device],
    index: int,
    streamed: tuple[str, ...],
) -> int:
    """Place ``name`` or split it; returns the resident-device cursor the pass goes on from.

    Resident devices (the GPUs, or the cpu when it executes) fill one way, in order, so
    consecutive layers stay together. A unit that fits none of them from the cursor on goes
    alone to the first streamed device (cpu, disk) with room, and the cursor stays: one big
    embedding does not push every later layer off the GPUs, as it does in accelerate.
    """
    assert state.ties is not None
    followers = [f for f, _ in state.ties.by_leader.get(name, ()) if not is_prefix(name, f)]
    resident = [d for d in devices if d not in streamed]
    here = resident[index] if index < len(resident) else None
    if size == 0 and not followers and not run_bytes(state.run, name, here):
        device = here if here is not None else devices[0]
        _put(tree, state, name, device, 0, ("empty",))
        return index
    miss = None  # (device, bytes needed, bytes left) of the resident device it did not fit
    if here is not None and _fits(state, name, size, followers, here):
        _accept(tree, state, name, here, size, _promises(state, followers, here), None)
        keep_step(state.run, state.remaining, followers, here)
        return index
    if splittable:
        _split(tree, name, stack)  # try the parts; streamed weights are planned per block
        return index
    if here is not None:
        miss = (here, size + run_bytes(state.run, name, here), max(state.remaining[here], 0))
        for later in range(index + 1, len(resident)):
            device = resident[later]
            if _fits(state, name, size, followers, device):
                _accept(tree, state, name, device, size, _promises(state, followers, device), miss)
                keep_step(state.run, state.remaining, followers, device)
                return later
    for device in (d for d in devices if d in streamed):
        if _fits(state, name, size, followers, device):
            _accept(tree, state, name, device, size, _promises(state, followers, device), miss, streamed=True)
            keep_step(state.run, state.remaining, followers, device)
            return index
    state.unplaced.append(name)
    return index


def _promises(state: _Pass, followers: list[str], device: Device) -> dict[str, int]:
    """Room a leader placed on ``device`` keeps for the tied modules that will follow it there:
    their units' weights and, where they run, their cache and held outputs (their largest
    step is kept once, as the device's step: :func:`keep_step`)."""
    return {f: state.follower_units[f] + follower_hold(state.run, f, device) for f in followers}


def _fits(state: _Pass, name: str, size: int, followers: list[str], device: Device) -> bool:
    """``name`` fits ``device`` with its run and the room its tied followers will take there."""
    need = size + run_bytes(state.run, name, device)
    if followers:
        need += sum(_promises(state, followers, device).values()) + follower_step(state.run, followers, name, device)
    return need <= state.remaining[device]


def _accept(
    tree: SizeTree,
    state: _Pass,
    name: str,
    device: Device,
    size: int,
    promises: Mapping[str, int],
    miss: tuple[Device, int, int] | None,
    *,
    streamed: bool = False,
) -> None:
    """Put a unit that fits, keeping room for the tied modules that will follow it."""
    extra = sum(promises.values())
    why = ("fits", state.remaining[device], extra, streamed, run_room(state.run, name, device), *(miss or (None, 0, 0)))
    _put(tree, state, name, device, size, why, described=True)
    state.remaining[device] -= extra
    state.promised.update({f: (device, b) for f, b in promises.items()})


def _follower_unit_bytes(tree: SizeTree, follower: str, leader: str, no_split: frozenset[str]) -> int:
    """Bytes of the unit a tied follower will be placed in: its outermost no-split
    ancestor not holding the leader, else its module if that is a leaf, else itself (0)."""
    for module in reversed(list(ancestors(parent(follower)))):
        if module and not is_prefix(module, leader) and is_no_split(tree, module, no_split):
            return tree.total(module)
    module = parent(follower)
    return tree.total(module) if not tree.nodes[module].children else 0


def _split(tree: SizeTree, name: str, stack: list[str]) -> None:
    node = tree.nodes[name]
    units = list(node.tensors) + list(node.children)  # accelerate's order: own tensors first
    stack.extend(reversed(units))


def _outside_leader(ties: _Ties, name: str, where: Mapping[str, Device]) -> str:
    """A placed leader of a tied tensor inside ``name`` whose leader lies outside ``name``."""
    for _, leader in ties.by_follower.get(name, ()):
        if not is_prefix(name, leader) and leader in where:
            return leader
    return ""


def _put(
    tree: SizeTree,
    state: _Pass,
    name: str,
    device: Device,
    size: int,
    why: Why,
    *,
    override: bool = False,
    tied_to: str = "",
    described: bool = False,
) -> None:
    if state.run is not None:
        why = charge_run(state.run, state.remaining, name, device, why, described)
    state.placed.append((name, device, size, override, tied_to, *why))
    state.remaining[device] -= size
    state.used[device] += size
    assert state.ties is not None
    for _, leader in state.ties.by_leader.get(name, ()):  # only leaders are looked up: not every tensor
        state.where[leader] = device


def _spread_streamed(tree: SizeTree, state: _Pass, ties: _Ties, main: Device) -> bool:
    """When the CPU executes, spread the sibling blocks streamed from disk evenly between the
    resident ones of the same size (``h.0 cpu, h.1 disk, h.2 cpu, ...`` instead of every
    resident block first): a streamed block is then read while the resident block before it
    computes, where a run of resident blocks would leave the disk idle (it can read ahead only
    as far as the stream's buffer). Same count and bytes per device; overrides and modules
    holding a tie keep their place. Returns whether anything moved."""
    if main != "cpu":
        return False
    groups: dict[tuple[str, int], list[int]] = {}
    for i, placed in enumerate(state.placed):
        name, device, size, override, tied_to = placed[:5]
        if override or tied_to or device not in ("cpu", "disk") or name not in tree.nodes or not size:
            continue
        if ties.by_follower.get(name) or ties.by_leader.get(name):
            continue
        groups.setdefault((parent(name), size), []).append(i)
    moved = False
    for idx in groups.values():
        devices = [state.placed[i][1] for i in idx]
        n, k = len(idx), devices.count("cpu")
        if k in (0, n):
            continue
        # evenly apart (a line drawn on the grid): runs of either kind differ by at most one
        want = ["cpu" if (2 * (j + 1) * k + n) // (2 * n) > (2 * j * k + n) // (2 * n) else "disk" for j in range(n)]
        first = want.index("cpu")  # begin with a resident block, as the greedy pass did (one alone stays put)
        want = want[first:] + want[:first]
        if want == devices:
            continue
        slots = {d: [state.placed[i] for i in idx if state.placed[i][1] == d] for d in ("cpu", "disk")}
        names = [state.placed[i][0] for i in idx]
        for i, name, was, device in zip(idx, names, devices, want, strict=True):
            taken = slots[device].pop(0)  # the slot's reason was written for another block: say why it moved
            why = taken[5:] if was == device else _interleaved(taken[5:], device, parent(name))
            state.placed[i] = (name, *taken[1:5], *why)
        moved = True
    return moved


def _interleaved(why: Why, device: Device, blocks: str) -> Why:
    """The reason of a block the interleaving moved to ``device`` (its run's part kept)."""
    if why and why[0] == "run":
        return ("run", _interleaved(why[1], device, blocks), *why[2:])
    return ("interleaved", device, blocks)


def _share_name(strategy: str) -> str:
    """What a balanced strategy lets a GPU fill, as the reasons name it."""
    return f"{'balanced' if strategy == 'auto' else strategy} share"


def _placements(
    tree: SizeTree, state: _Pass, capped: Mapping[Device, str], kept: Mapping[Device, tuple[int, float]]
) -> tuple[Placement, ...]:
    """The placements of the pass that became the plan, their reasons written (room on a GPU
    a balanced strategy caps is said to be left of its share, not of its budget: ``capped``;
    the headroom each device keeps: ``kept``)."""
    out = []
    for placed in state.placed:
        name, device, size, override, tied_to = placed[:5]
        node = tree.nodes.get(name)
        reason = write_reason(tree, name, device, size, placed[5:], capped, kept)
        out.append(
            Placement(
                name,
                device,
                size,
                reason,
                node.class_name if node else "",
                "module" if node else "tensor",
                override,
                tied_to,
            )
        )
    return tuple(out)


def _streamed(main: Device) -> tuple[str, ...]:
    """Devices whose weights are streamed to the execution device at forward time."""
    return streamed_devices(main)


def unit_rule(options: PlanOptions, main: Device) -> UnitRule:
    """The unit rule of a plan made with ``options``, executing on ``main``.

    Example:
        >>> unit_rule(PlanOptions(rule=UnitRule(blocks=frozenset({"Block"}))), 0)
        UnitRule(main_device=0, blocks=frozenset({'Block'}), preload=frozenset(), reads={}, offload_buffers=False, same_module={})
    """
    return replace(options.rule, main_device=main)


def _offload_bound(tree: SizeTree, options: PlanOptions) -> int:
    """The most `_offload_needs` can ask of one device: the largest two modules that can be
    a unit (never a container or a module holding blocks), or single tensors."""
    rule = unit_rule(options, 0)
    above = above_blocks(tree, rule.blocks)
    units = [n.total_bytes for name, n in tree.nodes.items() if not n.container and name not in above]
    units += [tree.tensors[t].nbytes for t in tree.tensors]
    biggest = sorted(units, reverse=True)[: 2 if options.prefetch else 1]
    return sum(biggest)


def _offload_needs(tree: SizeTree, state: _Pass, main: Device, options: PlanOptions) -> dict[Device, int]:
    """Reserve what the engine really holds for streamed units, as the unit rule makes them
    from the device map this placement gives (:mod:`bigviz.core.offload_units`): on a GPU (or
    mps) executing, room for the running unit and the prefetched one, and on the cpu the
    pinned staging of disk units on their way to it. With the CPU executing, disk units are
    computed on straight from the memory-mapped files (page cache, not the process's memory):
    nothing is reserved."""
    needs = {d: 0 for d in state.remaining}
    streamed = _streamed(main)
    if not options.offload_reserve or main == "cpu" or not any(p[1] in streamed for p in state.placed):
        return needs
    placed = clean_device_map({p[0]: p[1] for p in state.placed}, tree)
    units = unit_sizes(tree, placed, unit_rule(options, main), cleaned=True)
    for device, nbytes in streamed_needs(units, main, prefetch=options.prefetch).items():
        if device in needs:
            needs[device] = nbytes
    return needs


def _does_not_fit(tree: SizeTree, budgets: Mapping[Device, int], state: _Pass) -> str:
    left = sum(tree.total(n) for n in state.unplaced)
    names = ", ".join(state.unplaced[:8]) + (" ..." if len(state.unplaced) > 8 else "")
    given = ", ".join(f"{device_label(d)} {format_size(b)}" for d, b in budgets.items())
    what, fix = f"the model ({format_size(tree.total(''))})", ""
    if state.run is not None:
        kv = sum(state.run.kv_own.values())
        what += f" with its run ({format_size(kv)} of KV cache, {format_size(max(state.run.act_sub.values(), default=0))} of activations per device)"
        fix = " shorten the context or the batch,"
    return (
        f"{what} does not fit the budgets ({given}): "
        f"{format_size(left)} left unplaced ({names}). Raise max_memory,{fix} use a smaller dtype, "
        f"or leave 'disk' out of max_memory so it is unlimited."
    )
