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

import difflib
import fnmatch
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from bigviz.core.errors import PlanError
from bigviz.core.names import ancestors, is_prefix, join, parent
from bigviz.core.plan import STRATEGIES, DevicePlan, DeviceUsage, Placement, PlanOptions
from bigviz.core.tree import SizeTree
from bigviz.core.devices import Device, device_label, execution_device, normalize_device, streamed_devices
from bigviz.core.sizes import UNLIMITED, format_size, parse_max_memory, parse_size

__all__ = ["make_plan", "PlanError", "is_no_split", "no_split_problems", "check_no_split"]

_MAX_PASSES = 6
_RUN_PASSES = 10
"""Extra passes a workload may take: the KV cache of a streamed layer lives on the execution
device, so each layer pushed off it brings its cache back there; the reserve grows towards
what is needed geometrically (by the ratio of a layer's cache to its weights plus cache)."""


@dataclass
class _Pass:
    """Mutable state of one greedy pass."""

    remaining: dict[Device, int]
    used: dict[Device, int]
    placements: list[Placement] = field(default_factory=list)
    where: dict[str, Device] = field(default_factory=dict)
    unplaced: list[str] = field(default_factory=list)
    # room set aside on a leader's device for the tied follower units still to come
    promised: dict[str, tuple[Device, int]] = field(default_factory=dict)
    follower_units: dict[str, int] = field(default_factory=dict)
    run: _Run | None = None  # a workload's KV cache and activations, when one is planned
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


def make_plan(tree: SizeTree, max_memory: Mapping[object, object],
              options: PlanOptions | None = None) -> DevicePlan:
    """Place every module of ``tree`` within ``max_memory``.

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
    budgets = parse_max_memory(max_memory)
    budgets.setdefault("disk", UNLIMITED)
    overrides, reserve = _check_inputs(tree, budgets, options)
    main = _main_device(budgets, options)
    caps, notes = _strategy_caps(tree, budgets, options)
    offload = {d: 0 for d in budgets}
    ties = _Ties.index(tree)
    for _ in range(_MAX_PASSES + (_RUN_PASSES if options.kv_cache or options.activations else 0)):
        state = _greedy(tree, caps, reserve, offload, overrides, options, ties)
        needed = _offload_needs(state, main, options)
        streamed_run = _streamed_run_needs(state, main)  # a streamed layer's cache lives on main
        needed = {d: needed[d] + streamed_run.get(d, 0) for d in budgets}
        if all(needed[d] <= offload[d] for d in budgets):
            break
        offload = {d: max(offload[d], needed[d]) for d in budgets}
    else:  # no fixed point in a few passes: reserve what any plan could need, then it holds
        bound = _offload_bound(tree, options)
        offload = {d: max(offload[d], bound if needed[d] else 0) for d in budgets}
        state = _greedy(tree, caps, reserve, offload, overrides, options, ties)
    if state.unplaced:
        raise PlanError(_does_not_fit(tree, budgets, state))
    staging = {d: offload[d] - streamed_run.get(d, 0) for d in budgets}  # room kept for weights alone
    notes += [f"{device_label(d)} keeps {format_size(v)} free for offloaded weights streamed in at "
              f"forward time" for d, v in staging.items() if v > 0]
    kv, act = _run_usage(state, main)
    usage = tuple(DeviceUsage(d, budgets[d], caps[d], reserve.get(d, 0), max(staging[d], 0), state.used[d],
                              kv.get(d, 0), act.get(d, 0)) for d in budgets)
    if state.run is not None:
        _check_run_fits(usage, bool(overrides))
    notes += _warnings(usage, main)
    return DevicePlan(tuple(state.placements), usage, options.strategy, main, tuple(notes), tree,
                      workload=options.workload)


def _warnings(usage: tuple[DeviceUsage, ...], main: Device) -> list[str]:
    """What a person should know: a device over its budget, an execution device left empty."""
    out = []
    for u in usage:
        over = -u.free
        if over > 0 and u.used:
            out.append(f"{device_label(u.device)} is over its budget by {format_size(over)} "
                       f"(overrides put more there than fits)")
        elif u.device == main and u.used == 0 and u.offload_reserve and u.budget:
            out.append(f"{device_label(u.device)} holds no weights: its {format_size(u.budget)} is all "
                       f"needed for the offloaded weights streamed in; give it more memory or use a "
                       f"smaller dtype")
    return out


def _check_inputs(tree: SizeTree, budgets: dict[Device, int],
                  options: PlanOptions) -> tuple[dict[str, Device], dict[Device, int]]:
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
            problems.append(f"override {name!r} sends it to {device_label(overrides[name])}, which has "
                            f"no budget: add it to max_memory")
    reserve: dict[Device, int] = {}
    for device, size in (options.reserve or {}).items():
        try:
            reserve[normalize_device(device)] = parse_size(size)  # type: ignore[arg-type]
        except ValueError as err:
            problems.append(f"reserve[{device!r}]: {err}")
    PlanError.check(problems, "cannot plan")
    return overrides, reserve


def _main_device(budgets: Mapping[Device, int], options: PlanOptions) -> Device:
    if options.main_device is not None:
        return normalize_device(options.main_device)
    return execution_device(budgets)


def is_no_split(tree: SizeTree, name: str, patterns: frozenset[str]) -> bool:
    """True if module ``name`` is placed whole: its class or name matches a no-split pattern,
    or it holds a parametrized weight.

    Example:
        >>> from bigviz.core.tree import TensorSpec
        >>> t = SizeTree.build([TensorSpec("conv.parametrizations.weight.original0", 4, "float32")])
        >>> is_no_split(t, "conv", frozenset()), is_no_split(t, "", frozenset({"[0-9]*"}))
        (True, False)
    """
    return _is_no_split(tree, name, patterns)


def _is_glob(pattern: str) -> bool:
    """A no-split entry is a module-name glob if it has glob or dot characters, else a class."""
    return any(c in pattern for c in "*?[.")


def _is_no_split(tree: SizeTree, name: str, patterns: frozenset[str]) -> bool:
    node = tree.nodes[name]
    if join(name, "parametrizations") in node.children:
        return True  # torch's parametrize: the weight is computed from its parts (weight norm's g, v)
    for pattern in patterns:
        if _is_glob(pattern):
            if fnmatch.fnmatchcase(name, pattern):
                return True
        elif node.class_name == pattern:
            return True
    return False


def no_split_problems(tree: SizeTree, patterns: Collection[str]) -> list[str]:
    """Every no-split entry that matches nothing in ``tree`` (a typo would otherwise split
    every block silently), with the model's class names or an example pattern.

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> tree = SizeTree.build([TensorSpec("h.0.w", 4, "float32")],
        ...                       {"": "Net", "h": "ModuleList", "h.0": "Block"})
        >>> no_split_problems(tree, ["Block", "h.*"]), no_split_problems(tree, ["Blok"])
        ([], ["no-split class 'Blok' is not a class of this model (did you mean 'Block'?); its classes: Block, ModuleList, Net"])
    """
    classes = sorted({n.class_name for n in tree.nodes.values() if n.class_name})
    problems = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            problems.append(f"no-split entry {pattern!r} is not a string: give class names or module-name globs")
        elif _is_glob(pattern):
            if not any(fnmatch.fnmatchcase(name, pattern) for name in tree.nodes):
                problems.append(f"no-split pattern {pattern!r} matches no module name"
                                f"{_example_glob(tree)}")
        elif pattern not in classes:
            problems.append(_unknown_class(tree, pattern, classes))
    return problems


def _unknown_class(tree: SizeTree, pattern: str, classes: list[str]) -> str:
    if not classes:
        return (f"no-split class {pattern!r}: this model has no class names (a tree read from "
                f"checkpoint headers carries none); give module-name patterns{_example_glob(tree)}")
    close = difflib.get_close_matches(pattern, classes, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    shown = ", ".join(classes[:40]) + (f", ... ({len(classes)} in all)" if len(classes) > 40 else "")
    return f"no-split class {pattern!r} is not a class of this model{hint}; its classes: {shown}"


def _example_glob(tree: SizeTree) -> str:
    """`` (e.g. 'transformer.h.*')`` from the first numbered module, or nothing."""
    for name in tree.nodes:
        head, _, last = name.rpartition(".")
        if last.isdigit():
            return f" (e.g. {(head + '.*') if head else '[0-9]*'!r})"
    return ""


def check_no_split(tree: SizeTree, patterns: Collection[str]) -> None:
    """Raise `PlanError` listing every no-split entry that matches nothing (see
    `no_split_problems`).

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> check_no_split(SizeTree.build([TensorSpec("h.0.w", 4, "float32")]), ["h.*"])  # matches
    """
    PlanError.check(no_split_problems(tree, patterns), "cannot plan")


def _largest_unit(tree: SizeTree, patterns: frozenset[str]) -> int:
    """The biggest block that must move whole: a no-split module, else a leaf module."""
    sizes = [n.total_bytes for name, n in tree.nodes.items() if _is_no_split(tree, name, patterns)]
    if not sizes:
        sizes = [n.total_bytes for n in tree.nodes.values() if not n.children]
    return max(sizes, default=0)


def _strategy_caps(tree: SizeTree, budgets: dict[Device, int],
                   options: PlanOptions) -> tuple[dict[Device, int], list[str]]:
    """How much of each GPU the strategy lets the pass fill (balanced ones spread the model)."""
    caps = dict(budgets)
    gpus = [d for d in budgets if isinstance(d, int)]
    if options.strategy == "sequential" or len(gpus) < 2:
        return caps, []
    low0 = options.strategy == "balanced_low_0"
    total = tree.total("") + sum(options.kv_cache.values())  # a workload's caches spread with their layers
    buffer = int(1.25 * _largest_unit(tree, options.no_split)) + max(options.activations.values(), default=0)
    spread = gpus[1:] if low0 else gpus
    share = -(-total // len(spread))  # ceiling division
    for g in spread[:-1]:
        caps[g] = min(budgets[g], share + buffer)
    if low0:
        caps[gpus[0]] = min(budgets[gpus[0]], max(0, total - sum(caps[g] for g in gpus[1:])))
    capped = [g for g in gpus if caps[g] < budgets[g]]
    notes = [f"{options.strategy}: {device_label(g)} filled up to {format_size(caps[g])} of "
             f"{format_size(budgets[g])} so the model spreads over the GPUs" for g in capped]
    return caps, notes


def _greedy(tree: SizeTree, caps: Mapping[Device, int], reserve: Mapping[Device, int],
            offload: Mapping[Device, int], overrides: Mapping[str, Device],
            options: PlanOptions, ties: _Ties) -> _Pass:
    state = _Pass({d: caps[d] - reserve.get(d, 0) - offload[d] for d in caps}, {d: 0 for d in caps},
                  ties=ties)
    must_split = {a for name in overrides for a in ancestors(parent(name))} if overrides else set()
    if options.kv_cache or options.activations:  # overrides are placed first: charge their run too
        state.run = _Run.build(tree, options, _main_device(caps, options), _streamed(_main_device(caps, options)))
    for name in sorted(overrides, key=lambda n: n.count(".") + bool(n)):  # outer ones first
        device = overrides[name]
        _put(tree, state, name, device, _override_charge(tree, name, overrides),
             f"override: you put it on {device_label(device)}", override=True)
    state.follower_units = {f: _follower_unit_bytes(tree, f, l, options.no_split)
                            for f, l in tree.leader_of.items()}
    devices = list(caps)
    streamed = _streamed(_main_device(caps, options))
    index = 0
    stack = [""] if "" not in overrides else []
    while stack:
        name = stack.pop()
        if name in overrides:
            continue
        size = tree.total(name)
        splittable = name in tree.nodes and bool(tree.nodes[name].children) and (
            name in must_split or not _is_no_split(tree, name, options.no_split))
        leader = _outside_leader(ties, name, state.where)
        if name in must_split or (leader and splittable):
            _split(tree, name, stack)
            continue
        if leader:
            device = state.where[leader]
            for follower, _ in ties.by_follower.get(name, ()):
                if follower in state.promised:
                    state.remaining[device] += state.promised.pop(follower)[1]
            _put(tree, state, name, device, size,
                 f"tied to {leader}, which is on {device_label(device)}", tied_to=leader)
            continue
        index = _fit(tree, state, name, size, splittable, stack, devices, index, streamed)
    return state


def _override_charge(tree: SizeTree, name: str, overrides: Mapping[str, Device]) -> int:
    """Bytes an override adds to its device: its subtree less the overrides nested in it
    (each nested one is charged to its own device)."""
    inner = [o for o in overrides if o != name and is_prefix(name, o)]
    outermost = [o for o in inner if not any(m != o and is_prefix(m, o) for m in inner)]
    return tree.total(name) - sum(tree.total(o) for o in outermost)


def _fit(tree: SizeTree, state: _Pass, name: str, size: int, splittable: bool,
         stack: list[str], devices: list[Device], index: int, streamed: tuple[str, ...]) -> int:
    """Place ``name`` or split it; returns the resident-device cursor the pass goes on from.

    Resident devices (the GPUs, or the cpu when it executes) fill one way, in order, so
    consecutive layers stay together. A unit that fits none of them from the cursor on goes
    alone to the first streamed device (cpu, disk) with room, and the cursor stays: one big
    embedding does not push every later layer off the GPUs, as it does in accelerate.
    """
    assert state.ties is not None
    promises = {f: state.follower_units[f] for f, _ in state.ties.by_leader.get(name, ())
                if not is_prefix(name, f)}
    extra = sum(promises.values())
    resident = [d for d in devices if d not in streamed]
    here = resident[index] if index < len(resident) else None
    if size == 0 and not extra and not _run_bytes(tree, state, name, here):
        device = here if here is not None else devices[0]
        _put(tree, state, name, device, 0, f"holds no weights: stays with its neighbours on {device_label(device)}")
        return index
    miss = ""
    if here is not None and size + extra + _run_bytes(tree, state, name, here) <= state.remaining[here]:
        _accept(tree, state, name, here, size, promises, "")
        return index
    if splittable:
        _split(tree, name, stack)  # try the parts; streamed weights are planned per block
        return index
    if here is not None:
        need = size + _run_bytes(tree, state, name, here)
        miss = (f"{_what(tree, name)} did not fit {device_label(here)} ({format_size(need)} needed, "
                f"{format_size(max(state.remaining[here], 0))} left)")
        for later in range(index + 1, len(resident)):
            if size + extra + _run_bytes(tree, state, name, resident[later]) <= state.remaining[resident[later]]:
                _accept(tree, state, name, resident[later], size, promises, miss)
                return later
    for device in (d for d in devices if d in streamed):
        if size + extra <= state.remaining[device]:
            _accept(tree, state, name, device, size, promises, miss,
                    f"streamed in from {device_label(device)} at forward time")
            return index
    state.unplaced.append(name)
    return index


def _accept(tree: SizeTree, state: _Pass, name: str, device: Device, size: int,
            promises: Mapping[str, int], miss: str, how: str = "") -> None:
    """Put a unit that fits, keeping room for the tied modules that will follow it."""
    extra = sum(promises.values())
    left = state.remaining[device]
    room = f"{_with_run(tree, state, name, device, size)} of {format_size(left)} left on {device_label(device)}"
    text = f"{how} ({room})" if how else f"fits: {room}"
    if extra:
        text += f", with {format_size(extra)} kept for the modules tied to it"
    _put(tree, state, name, device, size, f"{miss}: {text}" if miss else text, described=True)
    state.remaining[device] -= extra
    state.promised.update({f: (device, b) for f, b in promises.items()})


def _follower_unit_bytes(tree: SizeTree, follower: str, leader: str, no_split: frozenset[str]) -> int:
    """Bytes of the unit a tied follower will be placed in: its outermost no-split
    ancestor not holding the leader, else its module if that is a leaf, else itself (0)."""
    for module in reversed(list(ancestors(parent(follower)))):
        if module and not is_prefix(module, leader) and _is_no_split(tree, module, no_split):
            return tree.total(module)
    module = parent(follower)
    return tree.total(module) if not tree.nodes[module].children else 0


def _what(tree: SizeTree, name: str) -> str:
    node = tree.nodes.get(name)
    if node is None:
        return "this tensor"
    if node.children:
        return f"{node.class_name or 'this module'} is no-split and"
    return f"{node.class_name or 'this module'} (a leaf module)"


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


def _put(tree: SizeTree, state: _Pass, name: str, device: Device, size: int, reason: str,
         *, override: bool = False, tied_to: str = "", described: bool = False) -> None:
    node = tree.nodes.get(name)
    if state.run is not None:
        reason = _charge_run(tree, state, name, device, reason, described)
    state.placements.append(Placement(
        name, device, size, reason, node.class_name if node else "", "module" if node else "tensor",
        override, tied_to))
    state.remaining[device] -= size
    state.used[device] += size
    for tensor in tree.subtree_tensors(name):
        state.where[tensor] = device


def _streamed(main: Device) -> tuple[str, ...]:
    """Devices whose weights are streamed to the execution device at forward time."""
    return streamed_devices(main)


def _offload_bound(tree: SizeTree, options: PlanOptions) -> int:
    """The most `_offload_needs` can ask of one device: streamed units are never split
    further (no-split modules, leaf modules, single tensors), and it keeps the largest two."""
    units = [n.total_bytes for name, n in tree.nodes.items()
             if not n.children or _is_no_split(tree, name, options.no_split)]
    units += [tree.tensor_bytes(t) for t in tree.tensors]
    biggest = sorted(units, reverse=True)[:2 if options.prefetch else 1]
    return sum(biggest)


def _offload_needs(state: _Pass, main: Device, options: PlanOptions) -> dict[Device, int]:
    """Reserve what the engine really holds for streamed units: on a GPU (or mps) executing,
    room for the running unit and the prefetched one, and on the cpu the pinned staging of
    disk units on their way to it. With the CPU executing, disk units are computed on straight
    from the memory-mapped files (page cache, not the process's memory): nothing is reserved."""
    needs = {d: 0 for d in state.remaining}
    if not options.offload_reserve or main == "cpu":
        return needs
    keep = 2 if options.prefetch else 1
    to_main = sorted((p.nbytes for p in state.placements if p.device in _streamed(main)), reverse=True)
    if main in needs:
        needs[main] = sum(to_main[:keep])
    from_disk = sorted((p.nbytes for p in state.placements if p.device == "disk"), reverse=True)
    if "cpu" in needs:
        needs["cpu"] = max(needs["cpu"], sum(from_disk[:keep]))
    return needs


@dataclass
class _Run:
    """A workload's bytes per module and what one pass has charged of them.

    A layer's KV cache is charged once, with the unit that holds it (or, for a layer split
    into parts, with its first part); a device keeps room for the largest step it runs. A
    unit streamed in from cpu or disk runs on the execution device: its cache and its step
    are charged there, outside the pass's fill, and the next pass reserves them.
    """

    kv_own: Mapping[str, int]
    kv_sub: dict[str, int]  # module -> cache bytes of the layers inside it
    act_own: Mapping[str, int]
    act_sub: dict[str, int]  # module -> the largest step inside it
    overrides: frozenset[str]
    main: Device
    streamed: tuple[str, ...]
    charged: set[str] = field(default_factory=set)
    kv: dict[Device, int] = field(default_factory=dict)
    act: dict[Device, int] = field(default_factory=dict)
    stream_kv: int = 0
    stream_act: int = 0

    @classmethod
    def build(cls, tree: SizeTree, options: PlanOptions, main: Device, streamed: tuple[str, ...]) -> _Run:
        unknown = [n for n in [*options.kv_cache, *options.activations] if n not in tree.nodes]
        if unknown:
            raise PlanError(f"cannot plan: KV cache or activation bytes given for names that are no module "
                            f"of the model: {', '.join(repr(n) for n in unknown[:8])}; key them by module name")
        kv_sub, act_sub = {}, {}
        for name, node in reversed(tree.nodes.items()):  # post-order: children before parents
            kv_sub[name] = options.kv_cache.get(name, 0) + sum(kv_sub[c] for c in node.children)
            act_sub[name] = max([options.activations.get(name, 0), *(act_sub[c] for c in node.children)])
        return cls(options.kv_cache, kv_sub, options.activations, act_sub, frozenset(options.overrides),
                   main, streamed)

    def unit(self, name: str) -> tuple[int, list[str], int]:
        """Cache bytes a unit brings, the split layers it charges for the first time, and its step."""
        inside = self.kv_sub.get(name, 0)
        if name in self.overrides:  # nested overrides carry their own caches to their own devices
            nested = [o for o in self.overrides if o != name and is_prefix(name, o)]
            inside -= sum(self.kv_sub.get(o, 0) for o in nested if not any(
                m != o and is_prefix(m, o) for m in nested))
        step = self.act_sub.get(name, 0)
        first = []
        for holder in ancestors(parent(name)) if name else ():
            if holder in self.kv_own and holder not in self.charged:
                first.append(holder)
                inside += self.kv_own[holder]
            step = max(step, self.act_own.get(holder, 0))
        return inside, first, step

    def resident_bytes(self, name: str, device: Device) -> int:
        """Room a unit's run takes on a resident device besides its weights."""
        kv, _, step = self.unit(name)
        return kv + max(0, step - self.act.get(device, 0))


def _run_bytes(tree: SizeTree, state: _Pass, name: str, device: Device | None) -> int:
    """Bytes of KV cache and activations a unit adds to ``device`` (0 without a workload,
    and on a streamed device: what a streamed unit runs is reserved on the execution device)."""
    run = state.run
    if run is None or device is None or device in run.streamed:
        return 0
    return run.resident_bytes(name, device)


def _with_run(tree: SizeTree, state: _Pass, name: str, device: Device, size: int) -> str:
    """``"1.1 GiB weights + 0.4 GiB KV cache + 52 MiB activations"`` (just the size without
    a workload; a streamed unit's cache is told about in :func:`_charge_run`)."""
    run = state.run
    if run is None:
        return format_size(size)
    if device in run.streamed:
        return f"{format_size(size)} weights"
    kv, _, step = run.unit(name)
    grow = max(0, step - run.act.get(device, 0))
    return (f"{format_size(size)} weights + {format_size(kv)} KV cache"
            + (f" + {format_size(grow)} activations" if grow else ""))


def _charge_run(tree: SizeTree, state: _Pass, name: str, device: Device, reason: str, described: bool) -> str:
    """Charge a placed unit's KV cache and step on the device it runs on; returns the reason,
    completed with where its run lives when the reason does not say it yet."""
    run = state.run
    assert run is not None
    kv, first, step = run.unit(name)
    run.charged.update(first)
    if device in run.streamed:
        run.stream_kv += kv
        run.stream_act = max(run.stream_act, step)
        return reason + (f"; its {format_size(kv)} KV cache and {format_size(step)} of activations live on "
                         f"{device_label(run.main)}, where it runs")
    state.remaining[device] -= kv + max(0, step - run.act.get(device, 0))
    run.kv[device] = run.kv.get(device, 0) + kv
    run.act[device] = max(run.act.get(device, 0), step)
    if described or not (kv or step):
        return reason
    return reason + f" (+ {format_size(kv)} KV cache, up to {format_size(step)} of activations there)"


def _check_run_fits(usage: tuple[DeviceUsage, ...], overridden: bool) -> None:
    """A run that does not fit is not a plan: its cache or activations would run out of memory."""
    over = [u for u in usage if u.free < 0 and (u.kv_cache or u.activations)]
    if not over:
        return
    lines = [f"{device_label(u.device)} needs {format_size(u.used)} weights + {format_size(u.kv_cache)} KV cache + "
             f"{format_size(u.activations)} activations + {format_size(u.reserve + u.offload_reserve)} reserved, "
             f"{format_size(-u.free)} over its {format_size(u.budget)}" for u in over]
    hint = " or move your overrides" if overridden else ""
    raise PlanError("the run does not fit", lines, fix="Shorten the context or the batch, use a smaller KV "
                                                      f"cache dtype, give the device more memory{hint}.")


def _streamed_run_needs(state: _Pass, main: Device) -> dict[Device, int]:
    """Room streamed units need on the execution device for their caches and steps."""
    run = state.run
    if run is None or not (run.stream_kv or run.stream_act):
        return {}
    return {main: run.stream_kv + max(0, run.stream_act - run.act.get(main, 0))}


def _run_usage(state: _Pass, main: Device) -> tuple[dict[Device, int], dict[Device, int]]:
    """KV cache and activation bytes per device, streamed units' counted on the execution device."""
    run = state.run
    if run is None:
        return {}, {}
    kv, act = dict(run.kv), dict(run.act)
    if run.stream_kv or run.stream_act:
        kv[main] = kv.get(main, 0) + run.stream_kv
        act[main] = max(act.get(main, 0), run.stream_act)
    return kv, act


def _does_not_fit(tree: SizeTree, budgets: Mapping[Device, int], state: _Pass) -> str:
    left = sum(tree.total(n) for n in state.unplaced)
    names = ", ".join(state.unplaced[:8]) + (" ..." if len(state.unplaced) > 8 else "")
    given = ", ".join(f"{device_label(d)} {format_size(b)}" for d, b in budgets.items())
    what, fix = f"the model ({format_size(tree.total(''))})", ""
    if state.run is not None:
        kv = sum(state.run.kv_own.values())
        what += f" with its run ({format_size(kv)} of KV cache, {format_size(max(state.run.act_sub.values(), default=0))} of activations per device)"
        fix = " shorten the context or the batch,"
    return (f"{what} does not fit the budgets ({given}): "
            f"{format_size(left)} left unplaced ({names}). Raise max_memory,{fix} use a smaller dtype, "
            f"or leave 'disk' out of max_memory so it is unlimited.")
