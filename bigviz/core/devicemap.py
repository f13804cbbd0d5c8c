"""Device maps as data: find a tensor's device, clean a map, and check one against a tree.

A device map's keys are module (or tensor) names, ``""`` meaning the whole model; its
values are GPU indices, ``"cpu"``, ``"disk"`` or ``"mps"``. A tensor's device is the value
of the longest key that is a dot-boundary prefix of its name (``h.1`` is not a prefix of
``h.10.x``).

Example:
    >>> clean_device_map({"a.x": 0, "a.y": 0, "b": "cpu"}, tree=None)
    {'a': 0, 'b': 'cpu'}
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from typing import Any, TYPE_CHECKING

from bigviz.core.errors import DeviceMapError
from bigviz.core.names import ancestors, owner, parent, under_any
from bigviz.core.devices import Device, execution_device, missing_device_problems, normalize_device

if TYPE_CHECKING:
    from bigviz.core.tree import SizeTree

__all__ = [
    "device_of",
    "clean_device_map",
    "complete_tied",
    "complete_computed",
    "device_map_problems",
    "validate_device_map",
    "key_problems",
    "check_keys",
]


def device_of(name: str, device_map: Mapping[str, Device]) -> Device | None:
    """The device a tensor or module name maps to, or ``None`` if no key covers it.

    Example:
        >>> device_of("h.10.attn.weight", {"h.1": 0, "h.10": "cpu"})
        'cpu'
    """
    key = owner(name, device_map)
    return None if key is None else device_map[key]


def clean_device_map(device_map: Mapping[str, Device], tree: SizeTree | None = None) -> dict[str, Device]:
    """Collapse children that share a device into their parent, as accelerate does.

    With a ``tree`` a parent collapses only when every module and tensor below it is covered
    with one device; without one, when all map keys under it agree (keys' siblings unknown).

    Example:
        >>> clean_device_map({"h.0": 0, "h.1": 0, "lm_head": 0}, tree=None)
        {'': 0}
    """
    if tree is not None:
        return _clean_with_tree(device_map, tree)
    return _clean_keys_only(device_map)


def _clean_keys_only(device_map: Mapping[str, Device]) -> dict[str, Device]:
    first_seen: dict[str, int] = {}
    for i, key in enumerate(device_map):
        for anc in ancestors(key):
            first_seen.setdefault(anc, i)
    cleaned = dict(device_map)
    depth = max((_depth(k) for k in cleaned), default=0)
    for level in range(depth, 0, -1):  # deepest first: a parent folds after its children
        under: dict[str, int] = {}
        groups: dict[str, list[str]] = {}
        for key in cleaned:
            for anc in ancestors(parent(key)) if key else ():
                under[anc] = under.get(anc, 0) + 1
            if key and _depth(key) == level:
                groups.setdefault(parent(key), []).append(key)
        for prefix, keys in groups.items():
            values = {cleaned[k] for k in keys}
            if prefix not in cleaned and under[prefix] == len(keys) and len(values) == 1:
                for k in keys:
                    del cleaned[k]
                cleaned[prefix] = values.pop()
    return dict(sorted(cleaned.items(), key=lambda kv: first_seen[kv[0]]))


def _depth(name: str) -> int:
    return name.count(".") + 1 if name else 0


_MIXED = object()  # a subtree whose parts live on more than one device


def _clean_with_tree(device_map: Mapping[str, Device], tree: SizeTree) -> dict[str, Device]:
    """Collapse with a tree, looking only at the map's keys and the modules above them (a
    module no key lies under or above is unmapped and never collapses): a planner's map of
    no-split blocks is cleaned without walking every tensor inside them."""
    if any(v is None for v in device_map.values()):  # not devices: keep the node-by-node rule's answer
        return _clean_every_node(device_map, tree)
    keys = {k for k in device_map if (k in tree.nodes or k in tree.tensors) and not under_any(k, device_map)}
    above = _modules_above(keys)
    uniform = _uniform_above(device_map, tree, above)
    out: dict[str, Device] = {}
    stack = [""]
    while stack:
        name = stack.pop()
        value = device_map[name] if name in keys else uniform.get(name)
        if value is not None and value is not _MIXED:
            out[name] = value  # type: ignore[assignment]
        elif name in above:  # under any other module nothing is mapped
            node = tree.nodes[name]
            out.update({t: device_map[t] for t in node.tensors if t in device_map})
            stack.extend(reversed(node.children))
    return out


def _modules_above(keys: Collection[str]) -> set[str]:
    """Every module that strictly contains a key."""
    above: set[str] = set()
    for name in keys:
        while name:
            name = parent(name)
            if name in above:
                break  # its own ancestors are in already
            above.add(name)
    return above


def _uniform_above(device_map: Mapping[str, Device], tree: SizeTree, above: set[str]) -> dict[str, object]:
    """The one device of each module in ``above``: ``_MIXED`` when its parts differ or some
    are unmapped, ``None`` when it holds no tensor at all."""
    order, tensorless = tree.order, _tensorless(tree)
    uniform: dict[str, object] = {}
    for name in sorted(above, key=order.__getitem__, reverse=True):  # children before parents
        node = tree.nodes[name]
        parts: list[object] = [device_map.get(t) for t in node.tensors]  # no key above it: only their own
        for c in node.children:
            if c in device_map:
                parts.append(device_map[c])
            elif c in above:
                if uniform[c] is not None:
                    parts.append(uniform[c])
            elif c not in tensorless:
                parts.append(_MIXED)  # nothing under it is mapped
        uniform[name] = _one_device(parts)
    return uniform


def _one_device(parts: list[object]) -> object:
    values = {id(p) if p is _MIXED else p for p in parts}
    return parts[0] if len(values) == 1 and parts[0] is not None else (None if not parts else _MIXED)


def _tensorless(tree: SizeTree) -> frozenset[str]:
    """Modules with no tensor anywhere below them (cached on the tree)."""

    def build() -> frozenset[str]:
        empty: set[str] = set()
        for name, node in reversed(tree.nodes.items()):  # post-order: children before parents
            if not node.tensors and all(c in empty for c in node.children):
                empty.add(name)
        return frozenset(empty)

    return tree.memo(("tensorless",), build)


def _clean_every_node(device_map: Mapping[str, Device], tree: SizeTree) -> dict[str, Device]:
    """The collapse rule node by node, over the whole tree: what :func:`_clean_with_tree`
    gives for maps of devices, and its answer for maps holding ``None``."""
    uniform: dict[str, object] = {}
    for name in reversed(list(tree.nodes)):  # post-order: children before parents
        node = tree.nodes[name]
        if name in device_map:
            uniform[name] = device_map[name]
            continue
        parts: list[object] = [device_of(t, device_map) for t in node.tensors]
        parts += [uniform[c] for c in node.children if uniform[c] is not None]
        uniform[name] = _one_device(parts)
    out: dict[str, Device] = {}
    stack = [""]
    while stack:
        name = stack.pop()
        value = uniform[name]
        if value is not None and value is not _MIXED:
            out[name] = value  # type: ignore[assignment]
            continue
        node = tree.nodes[name]
        out.update({t: device_map[t] for t in node.tensors if t in device_map})
        stack.extend(reversed(node.children))
    return out


def key_problems(device_map: Mapping[Any, object]) -> list[str]:
    """Keys that are not module names (strings), quoted: ``{0: "cpu"}`` is a slip for
    ``{"0": "cpu"}`` or ``{"": 0}``, and nothing downstream can look an int up.

    Example:
        >>> key_problems({"h.0": 0, 1: "cpu"})
        ["key 1 (an int) is not a module name: device-map keys are module names as strings ('h.0', '1'; '' for the whole model)"]
    """
    return [
        f"key {key!r} (a{'n' if type(key).__name__[0] in 'aeiou' else ''} {type(key).__name__}) is not "
        "a module name: device-map keys are module names as strings ('h.0', '1'; '' for the whole model)"
        for key in device_map
        if not isinstance(key, str)
    ]


def check_keys(device_map: Mapping[Any, object]) -> None:
    """Raise `DeviceMapError` (a ``ValueError``) quoting every key of ``device_map`` that is not a string.

    Example:
        >>> check_keys({"": "cpu"})
    """
    DeviceMapError.check(key_problems(device_map), "invalid device_map")


def device_map_problems(
    tree: SizeTree, device_map: Mapping[str, object], devices: Collection[Device] | None = None
) -> list[str]:
    """Every problem with a device map, as sentences: keys that are not strings, unknown keys,
    unknown or unavailable devices, and the modules and tensors left without a device."""
    problems = key_problems(device_map)
    for key, value in device_map.items():
        if not isinstance(key, str):
            continue  # reported above; difflib cannot compare it with module names
        if key and key not in tree.nodes and key not in tree.tensors:
            close = difflib.get_close_matches(key, list(tree.nodes) + list(tree.tensors), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"key {key!r} names no module or tensor of the model{hint}")
        try:
            normalize_device(value)
        except ValueError as err:
            problems.append(f"key {key!r}: {err}")
    if devices is not None:
        problems += missing_device_problems({k: v for k, v in device_map.items() if isinstance(k, str)}, devices)
    missing = _uncovered(tree, device_map)
    if missing:
        problems.append("not covered by any key (add them, or a parent, to the map): " + ", ".join(missing))
    return problems


def complete_tied(tree: SizeTree, device_map: Mapping[str, object]) -> dict[str, object]:
    """Add entries for tied tensors the map leaves out, on their leader's device.

    A map planned from checkpoint headers has no ``lm_head`` when ``lm_head.weight`` is a
    tied duplicate the checkpoint does not store; the module then runs where its weight is.

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> t = SizeTree.build([TensorSpec("emb.weight", 4, "float32"), TensorSpec("head.weight", 4, "float32")],
        ...                    ties=[("emb.weight", "head.weight")])
        >>> complete_tied(t, {"emb": "cpu"})
        {'emb': 'cpu', 'head': 'cpu'}
    """
    out = dict(device_map)
    for follower, leader in tree.leader_of.items():
        key = owner(leader, out)
        if owner(follower, out) is not None or key is None:
            continue
        module = parent(follower)
        rest = [t for t in tree.subtree_tensors(module) if t != follower and owner(t, out) is None]
        out[module if module and not rest else follower] = out[key]
    return out


def complete_computed(tree: SizeTree, device_map: Mapping[str, object]) -> dict[str, object]:
    """Add entries for what a map leaves out that no checkpoint holds: non-persistent buffers
    the model computes itself (``model.rotary_emb``). A map planned from checkpoint headers
    cannot name them; they go to the execution device (the first GPU in the map, else the
    CPU), where a dispatch keeps the buffers of offloaded modules too.

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> t = SizeTree.build([TensorSpec("h.0.w", 4, "float32"),
        ...                     TensorSpec("rope.inv_freq", 2, "float32", kind="buffer", persistent=False)])
        >>> complete_computed(t, {"h": 0})
        {'h': 0, 'rope': 0}
    """
    out = dict(device_map)
    gaps = [name for name in _uncovered(tree, out) if name != "<whole model>"]
    computed = [g for g in gaps if g and all(not tree.tensors[t].persistent for t in tree.subtree_tensors(g))]
    if computed:
        out.update(dict.fromkeys(computed, execution_device(out.values())))
    return out


def validate_device_map(
    tree: SizeTree, device_map: Mapping[str, object], devices: Collection[Device] | None = None
) -> dict[str, Device]:
    """The map with canonical devices, or `DeviceMapError` (a ``ValueError``) listing every problem.

    Tied tensors the map leaves out go with their leader (see :func:`complete_tied`), and
    non-persistent buffers it leaves out to the execution device (see :func:`complete_computed`).

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> t = SizeTree.build([TensorSpec(f"b{i}.l{j}.weight", 1, "float32")
        ...                     for i in (1, 2) for j in (1, 2, 3)])
        >>> validate_device_map(t, {"b1": 0, "b2.l1": 1, "b2.l2": 1})
        Traceback (most recent call last):
        ...
        bigviz.core.errors.DeviceMapError: invalid device_map (1 problem):
          - not covered by any key (add them, or a parent, to the map): b2.l3
    """
    completed = complete_computed(tree, complete_tied(tree, device_map))
    DeviceMapError.check(device_map_problems(tree, completed, devices), "invalid device_map")
    return {k: normalize_device(v) for k, v in completed.items()}


def _uncovered(tree: SizeTree, device_map: Mapping[str, object]) -> list[str]:
    """The largest modules (or single tensors) no key covers, in definition order."""
    covered = {name: owner(name, device_map) is not None for name in tree.tensors}
    full_gap: dict[str, bool] = {}
    for name in reversed(list(tree.nodes)):
        node = tree.nodes[name]
        parts = [not covered[t] for t in node.tensors] + [full_gap[c] for c in node.children]
        full_gap[name] = bool(parts) and all(parts) and owner(name, device_map) is None
    out: list[str] = []
    stack = [""]
    while stack:
        name = stack.pop()
        if full_gap[name]:  # full_gap is only true for subtrees that hold tensors
            out.append(name or "<whole model>")
            continue
        node = tree.nodes[name]
        out.extend(t for t in node.tensors if not covered[t])
        stack.extend(reversed(node.children))
    return out
