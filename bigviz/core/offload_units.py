"""The one unit rule: which module fetches which offloaded tensor, for planner and engine alike.

An **offload unit** is a module whose tensors live in offloaded storage (``"disk"``, or
``"cpu"`` while a GPU executes) and are fetched all at once when its forward starts. The
planner reserves room on the execution device for the two largest units (the running one and
the prefetched next one); the engine fetches exactly these units. Both call
:func:`offload_units` on the same size tree and device map, so what is promised and what is
fetched cannot disagree.

The rule, per tensor mapped to offloaded storage:

1. Start at the module of its device-map entry (a tensor-level entry: the tensor's module).
2. Go down towards the tensor, one level at a time, while the module is never run
   (a container: ``ModuleList``, ``ModuleDict``) or holds blocks (no-split modules, by class
   name or module-name glob, and modules holding a parametrized weight): ``{"": "disk"}``
   streams block by block, never the whole model at once.
3. Go up to a module whose code reads the tensor's module's weights without calling it
   (``self.rel_embeddings.weight``): a fetch hooked below the reader would never run.
4. Go up to the outermost ancestor whose class is a preload class (it fetches all its
   offloaded tensors at once).

A tie group (one tensor under several names) lives where
:func:`~bigviz.core.devices.tie_home` puts it (the loader's rule too): when that is a computing
device it stays resident there for all its users; a tensor only offloaded is fetched by every
unit that uses it. Buffers stay resident on the execution device unless ``offload_buffers``.

Example:
    >>> from bigviz.core.tree import SizeTree, TensorSpec, TensorSpec
    >>> tree = SizeTree.build([TensorSpec(f"h.{i}.{p}.weight", 4, "float32") for i in range(2) for p in "ab"],
    ...                       {"": "Net", "h": "ModuleList", "h.0": "Block", "h.1": "Block"}, containers=["h"])
    >>> layout = offload_units(tree, {"": "disk"}, UnitRule(main_device="cpu", blocks=frozenset({"Block"})))
    >>> [(u.name, u.storage, u.nbytes) for u in layout.units]
    [('h.0', 'disk', 32), ('h.1', 'disk', 32)]
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field

from bigviz.core.devices import NAMED_DEVICES, Device, normalize_device, streamed_devices, tie_home
from bigviz.core.names import ancestors, is_prefix, join, owner, parent, under_any
from bigviz.core.nosplit import is_no_split
from bigviz.core.tree import SizeTree, TensorSpec

__all__ = [
    "UnitRule",
    "Fetch",
    "OffloadUnit",
    "Resident",
    "UnitLayout",
    "offload_units",
    "unit_sizes",
    "unit_table",
    "hook_module",
    "streamed_needs",
    "above_blocks",
    "largest_unit",
]


@dataclass(frozen=True)
class UnitRule:
    """The knobs of the unit rule (see the module docstring).

    Attributes:
        main_device: where offloaded units execute; decides which storages stream (``None``
            in planner options: the planner fills in the execution device it chose).
        blocks: no-split entries: class names or module-name globs (``"transformer.h.*"``).
        preload: class names whose instances fetch all their offloaded tensors at once.
        reads: module -> the module whose code reads its tensors without calling it.
        offload_buffers: fetch buffers of offloaded modules too (else they stay resident on
            the execution device).
        same_module: module name -> the first name of the same module object (a module
            shared under two names is one unit).
    """

    main_device: Device | None = None
    blocks: frozenset[str] = frozenset()
    preload: frozenset[str] = frozenset()
    reads: Mapping[str, str] = field(default_factory=dict)
    offload_buffers: bool = False
    same_module: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Fetch:
    """One stored tensor a unit fetches: its key (the first name of its tie group), the names
    it fills in the unit, its bytes and kind."""

    key: str
    names: tuple[str, ...]
    nbytes: int
    kind: str = "param"


@dataclass(frozen=True)
class OffloadUnit:
    """One module whose offloaded tensors are fetched at once, at the start of its forward.

    Attributes:
        name: the module the fetch is hooked on.
        storage: ``"disk"`` or ``"cpu"`` (a unit mixing both streams like disk).
        fetches: the stored tensors it fetches, in definition order.
        order: its module's position in definition order (the fetch order until a first
            forward records the real one).
    """

    name: str
    storage: str
    fetches: tuple[Fetch, ...]
    order: int

    @property
    def nbytes(self) -> int:
        """Bytes fetched per forward."""
        return sum(f.nbytes for f in self.fetches)

    @property
    def tensors(self) -> tuple[str, ...]:
        """Keys of the tensors it fetches."""
        return tuple(f.key for f in self.fetches)

    @property
    def buffers(self) -> tuple[str, ...]:
        """Keys of the buffers it fetches (``offload_buffers``)."""
        return tuple(f.key for f in self.fetches if f.kind == "buffer")


@dataclass(frozen=True)
class Resident:
    """A tensor (tie group) that stays on a computing device for every user."""

    key: str
    names: tuple[str, ...]
    device: Device
    nbytes: int
    kind: str = "param"


@dataclass(frozen=True)
class UnitLayout:
    """The rule's answer: offload units in definition order, resident tensors, and the
    tensors no device-map entry covers (sentences)."""

    units: tuple[OffloadUnit, ...]
    resident: tuple[Resident, ...]
    problems: tuple[str, ...] = ()


def offload_units(tree: SizeTree, device_map: Mapping[str, object], rule: UnitRule) -> UnitLayout:
    """Apply the unit rule to every tensor of ``tree`` under ``device_map`` (pure).

    Args:
        tree: the model's size tree (classes, containers and ties included).
        device_map: module (or tensor) name -> device, in any spelling.
        rule: the rule's knobs.
    """
    units: dict[str, tuple[str, dict[str, Fetch]]] = {}
    resident: list[Resident] = []
    problems: list[str] = []
    for group, spec, where in _assign(tree, device_map, rule, problems):
        if not isinstance(where, list):
            resident.append(Resident(group[0], group, where, spec.nbytes, spec.kind))
            continue
        for name, hook, storage in where:
            unit = units.setdefault(hook, (storage, {}))
            if storage == "disk" and unit[0] != "disk":
                units[hook] = unit = ("disk", unit[1])  # a unit mixing cpu and disk entries streams like disk
            known = unit[1].get(group[0])
            names = (*known.names, name) if known else (name,)
            unit[1][group[0]] = Fetch(group[0], names, spec.nbytes, spec.kind)
    order = tree.order
    built = [
        OffloadUnit(hook, storage, tuple(f.values()), order.get(hook, len(order)))
        for hook, (storage, f) in units.items()
    ]
    return UnitLayout(tuple(sorted(built, key=lambda u: u.order)), tuple(resident), tuple(problems))


def unit_sizes(
    tree: SizeTree, device_map: Mapping[str, object], rule: UnitRule, *, cleaned: bool = False
) -> list[tuple[str, int]]:
    """``(storage, bytes)`` of each unit :func:`offload_units` makes, without building them
    (what the planner needs, once per pass; see :func:`unit_table`).

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> tree = SizeTree.build([TensorSpec("a.w", 4, "float32"), TensorSpec("b.w", 2, "float32")])
        >>> unit_sizes(tree, {"a": "cpu", "b": "disk"}, UnitRule(0))
        [('cpu', 16), ('disk', 8)]
    """
    return list(unit_table(tree, device_map, rule, cleaned=cleaned).values())


def unit_table(
    tree: SizeTree, device_map: Mapping[str, object], rule: UnitRule, *, cleaned: bool = False
) -> dict[str, tuple[str, int]]:
    """Unit (the module its fetch is hooked on) -> ``(storage, bytes)``: the units
    :func:`offload_units` makes, in the order the map's entries bring them.

    A map whose keys do not nest (a planner's, cleaned) is read entry by entry: only the
    entries on streamed storage are looked at, and what each one fetches and where is worked
    out once per tree and rule (cached on the tree), so a planner pass costs O(streamed
    entries + their tied tensors) instead of a walk over every tensor. ``cleaned``: the caller
    knows the keys do not nest (``clean_device_map`` made it), so that is not checked.

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> tree = SizeTree.build([TensorSpec(f"h.{i}.{p}", 4, "float32") for i in range(3) for p in "ab"])
        >>> unit_table(tree, {"h.0": 0, "h.1": "cpu", "h.2": "disk"}, UnitRule(0))
        {'h.1': ('cpu', 32), 'h.2': ('disk', 32)}
    """
    mapping = _normalized(device_map)
    if not cleaned and any(under_any(k, mapping) for k in mapping):  # keys nest: the full rule
        return {u.name: (u.storage, u.nbytes) for u in offload_units(tree, mapping, rule).units}
    return _streamed_units(tree, mapping, rule)


def _streamed_units(tree: SizeTree, mapping: Mapping[str, Device], rule: UnitRule) -> dict[str, tuple[str, int]]:
    """:func:`unit_table` for a map whose keys do not nest, entry by streamed entry."""
    streamed = frozenset(streamed_devices(normalize_device(rule.main_device)))
    cache, group_of = _entry_cache(tree, rule), _tie_group_of(tree)
    units: dict[str, tuple[str, int]] = {}
    counted: dict[str, set[str]] = {}  # unit -> tie groups it already fetches (a group is fetched once per unit)
    for entry, device in mapping.items():
        if device not in streamed:
            continue
        if entry not in cache:
            cache[entry] = _entry_fetches(tree, entry, rule)
        plain, tied = cache[entry]
        for hook, nbytes in plain:
            _add(units, hook, str(device), nbytes)
        for name, hook in tied:
            group = group_of[name]
            if _fetched(tree, group, mapping, streamed, rule):
                seen = counted.setdefault(hook, set())
                _add(units, hook, str(device), 0 if group[0] in seen else tree.tensors[group[0]].nbytes)
                seen.add(group[0])
    return units


EntryFetches = tuple[tuple[tuple[str, int], ...], tuple[tuple[str, str], ...]]
"""What a streamed entry fetches: ``(unit, bytes)`` of its untied tensors summed per unit,
and ``(tensor, unit)`` of its tied ones (fetched unless their tie group stays resident)."""


def _entry_fetches(tree: SizeTree, entry: str, rule: UnitRule) -> EntryFetches:
    """Steps 1-4 of the rule for every tensor under one streamed device-map entry."""
    if entry not in tree.nodes and entry not in tree.tensors:
        return (), ()  # names nothing of the model
    above = above_blocks(tree, rule.blocks)
    tied_names = _tie_group_of(tree)
    hooks: dict[str, str] = {}  # tensor's module -> its unit: the tensors of a module share it
    plain: dict[str, int] = {}
    tied: list[tuple[str, str]] = []
    for name in tree.subtree_tensors(entry):
        home = parent(name)
        if home not in hooks:
            hooks[home] = hook_module(tree, name, entry, rule, above)
        spec = tree.tensors[name]
        if name in tied_names:
            tied.append((name, hooks[home]))
        elif spec.kind != "buffer" or rule.offload_buffers:  # else a buffer stays resident
            plain[hooks[home]] = plain.get(hooks[home], 0) + spec.nbytes
    return tuple(plain.items()), tuple(tied)


def _entry_cache(tree: SizeTree, rule: UnitRule) -> dict[str, EntryFetches]:
    """Entry -> what it fetches, for this tree and rule (filled as entries come up)."""
    key = (
        "entry fetches",
        rule.blocks,
        rule.preload,
        rule.offload_buffers,
        tuple(rule.reads.items()),
        tuple(rule.same_module.items()),
    )
    cache: dict[str, EntryFetches] = tree.memo(key, dict)
    return cache


def _fetched(
    tree: SizeTree, group: tuple[str, ...], mapping: Mapping[str, Device], streamed: frozenset[str], rule: UnitRule
) -> bool:
    """A tie group is fetched when every name of it is mapped and none keeps it resident."""
    devices = []
    for name in group:
        entry = owner(name, mapping)
        if entry is None:
            return False  # uncovered: a problem of the map, fetched by no unit
        devices.append(mapping[entry])
    return _resident_device(devices, tree.tensors[group[0]].kind, streamed, rule) is None


def _add(units: dict[str, tuple[str, int]], hook: str, storage: str, nbytes: int) -> None:
    kind, total = units.get(hook, (storage, 0))
    units[hook] = ("disk" if "disk" in (kind, storage) else storage, total + nbytes)


def _normalized(device_map: Mapping[str, object]) -> dict[str, Device]:
    return {k: v if isinstance(v, int) or v in NAMED_DEVICES else normalize_device(v) for k, v in device_map.items()}


Assignment = tuple[tuple[str, ...], TensorSpec, Device | list[tuple[str, str, str]]]


def _assign(
    tree: SizeTree, device_map: Mapping[str, object], rule: UnitRule, problems: list[str]
) -> Iterator[Assignment]:
    """The rule itself, per tie group: its resident device, or for each of its names the
    unit (hook module) that fetches it and from which storage. Uncovered names go to
    ``problems``."""
    streamed = frozenset(streamed_devices(normalize_device(rule.main_device)))
    mapping = _normalized(device_map)
    entry_of = _entries(tree, mapping)
    above = above_blocks(tree, rule.blocks)
    hooks: dict[tuple[str, str], str] = {}  # (tensor's module, entry) -> hook: tensors of a module share it
    for group in _groups(tree):
        entries = [entry_of[n] for n in group]
        if None in entries:
            problems += [
                f"{n}: no device-map entry covers it (add it, or one of its parents)"
                for n, e in zip(group, entries)
                if e is None
            ]
            continue
        spec = tree.tensors[group[0]]
        home = _resident_device([mapping[e] for e in entries if e is not None], spec.kind, streamed, rule)
        if home is not None:
            yield group, spec, home
            continue
        fetched = []
        for name, entry in zip(group, entries):
            assert entry is not None
            where = (parent(name), entry)
            hook = hooks.get(where) or hooks.setdefault(where, hook_module(tree, name, entry, rule, above))
            fetched.append((name, hook, str(mapping[entry])))
        yield group, spec, fetched


def _entries(tree: SizeTree, mapping: Mapping[str, Device]) -> dict[str, str | None]:
    """The device-map entry owning every module and tensor (``owner`` for all names at once,
    top-down over the tree: linear in its size)."""
    out: dict[str, str | None] = {}
    for name, node in tree.nodes.items():  # pre-order: a parent before its children
        out[name] = name if name in mapping else (out[parent(name)] if name else None)
        for tensor in node.tensors:
            out[tensor] = tensor if tensor in mapping else out[name]
    return out


def streamed_needs(
    units: Collection[OffloadUnit | tuple[str, int]], main_device: Device, *, prefetch: bool = True
) -> dict[Device, int]:
    """Room the engine holds for streamed units (or their ``(storage, bytes)``, see
    :func:`unit_sizes`): on the execution device, the largest unit
    (and the prefetched next one); on the cpu, the pinned staging of disk units on their way
    to a GPU. With the CPU executing, disk units are computed on in place (memory-mapped
    files: page cache, not the process's memory), so nothing is held.

    Example:
        >>> u = [OffloadUnit(f"h.{i}", s, (Fetch(f"h.{i}.w", (f"h.{i}.w",), b),), i)
        ...      for i, (s, b) in enumerate([("cpu", 10), ("disk", 30), ("disk", 20), ("cpu", 40)])]
        >>> streamed_needs(u, 0), streamed_needs(u, 0, prefetch=False), streamed_needs(u, "cpu")
        ({0: 70, 'cpu': 50}, {0: 40, 'cpu': 30}, {})
    """
    main = normalize_device(main_device)
    if main == "cpu":
        return {}
    keep = 2 if prefetch else 1
    sizes = [(u.storage, u.nbytes) if isinstance(u, OffloadUnit) else u for u in units]
    to_main = sorted((nbytes for _, nbytes in sizes), reverse=True)
    from_disk = sorted((nbytes for storage, nbytes in sizes if storage == "disk"), reverse=True)
    needs: dict[Device, int] = {main: sum(to_main[:keep])}
    if from_disk:
        needs["cpu"] = sum(from_disk[:keep])
    return needs


def hook_module(tree: SizeTree, name: str, entry: str, rule: UnitRule, above: frozenset[str]) -> str:
    """The module whose hook fetches tensor ``name`` of device-map ``entry`` (steps 1-4)."""
    hook = entry if entry in tree.nodes else parent(entry)  # a tensor-level entry hooks its module
    home = parent(name)
    while hook != home and (hook in above or tree.nodes[hook].container):
        rest = home[len(hook) + 1 :] if hook else home
        hook = join(hook, rest.split(".", 1)[0])
    if rule.reads:  # (most models have none: skip the walk up)
        hook = _lift_to_readers(hook, home, rule.reads)
    if rule.preload:
        for candidate in reversed(list(ancestors(hook))):  # outermost preload ancestor wins
            if candidate in tree.nodes and tree.nodes[candidate].class_name in rule.preload:
                hook = candidate
                break
    return rule.same_module.get(hook, hook)


def _lift_to_readers(hook: str, home: str, reads: Mapping[str, str]) -> str:
    """Move the hook up to a module whose code reads the tensor's module's weights directly:
    hooked on the tensor's own module, the fetch would never run, as it is never called."""
    for module in reversed(list(ancestors(home))):  # outermost first
        reader = reads.get(module)
        if reader is not None and is_prefix(hook, module) and reader != hook and is_prefix(reader, hook):
            return _lift_to_readers(reader, home, reads)
    return hook


def largest_unit(tree: SizeTree, blocks: frozenset[str]) -> int:
    """Bytes of the largest module the engine may stream as one unit: a no-split block, or a
    leaf module (what the default "cpu" budget leaves ring room for, before any map exists).

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> tree = SizeTree.build([TensorSpec(f"h.{i}.weight", 100 * (i + 1), "float32") for i in range(3)])
        >>> largest_unit(tree, frozenset())
        1200
    """
    sizes = [n.total_bytes for name, n in tree.nodes.items() if not n.children or is_no_split(tree, name, blocks)]
    return max(sizes, default=0)


def above_blocks(tree: SizeTree, blocks: frozenset[str]) -> frozenset[str]:
    """Modules that contain a block (a no-split module), the blocks themselves excluded.

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> tree = SizeTree.build([TensorSpec("m.h.0.w", 4, "float32")])
        >>> sorted(above_blocks(tree, frozenset({"m.h.*"})))
        ['', 'm', 'm.h']
    """
    return tree.memo(("above_blocks", blocks), lambda: _above(tree, blocks))


def _above(tree: SizeTree, blocks: frozenset[str]) -> frozenset[str]:
    """Ancestors of the outermost blocks: a module inside a block is part of it, even when a
    pattern matches it too (``"h.*"`` matches ``h.0.mlp`` as well as ``h.0``)."""
    above: set[str] = set()
    inside: dict[str, bool] = {}  # module -> it lies in a block (pre-order: parents first)
    for name in tree.nodes:
        up = parent(name) if name else None
        within = up is not None and (inside[up] or (bool(up) and is_no_split(tree, up, blocks)))
        inside[name] = within
        if name and not within and is_no_split(tree, name, blocks):
            for anc in ancestors(parent(name)):
                if anc in above:
                    break  # its ancestors are in already
                above.add(anc)
    return frozenset(above)


def _tie_group_of(tree: SizeTree) -> dict[str, tuple[str, ...]]:
    """Every tied tensor -> its tie group (cached on the tree)."""
    return tree.memo(("tie group of",), lambda: {n: g for g in tree.ties for n in g})


def _groups(tree: SizeTree) -> list[tuple[str, ...]]:
    """Every tensor once, as its tie group (leader first), in definition order of leaders."""

    def build() -> list[tuple[str, ...]]:
        group_of = _tie_group_of(tree)
        out: list[tuple[str, ...]] = []
        for name in (t for node in tree.nodes.values() for t in node.tensors):
            group = group_of.get(name, (name,))
            if group[0] == name:
                out.append(group)
        return out

    return tree.memo(("groups",), build)


def _resident_device(devices: list[Device], kind: str, streamed: frozenset[str], rule: UnitRule) -> Device | None:
    home = tie_home(devices)  # the loader's rule too: where the one object of a tie lives
    if home not in streamed:
        return home  # a tie with one resident home is resident for all its users
    if kind == "buffer" and not rule.offload_buffers:
        return normalize_device(rule.main_device)  # buffers are small and often read outside forward
    return None
