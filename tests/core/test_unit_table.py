"""The planner's fast paths give what the full rules give, on trees and maps they never saw.

`unit_table` (what the planner reserves room from, once per pass) reads only the streamed
entries of a map and caches per entry; `offload_units` (what the dispatch plan is made of)
walks every tensor. The cleaning of a device map with a tree looks only at the keys and the
modules above them; the node-by-node rule looks at every module. Both pairs must agree
exactly: ties (resident for every user when one user computes, else fetched by each unit),
tensor-level entries, blocks by class or glob, containers, direct reads, preload classes,
modules shared under two names, buffers kept or offloaded, cpu and disk mixed in a unit, an
uncovered tensor, keys nested in others. No torch, no files.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bigviz.core.devicemap import _clean_every_node, clean_device_map
from bigviz.core.names import ancestors, parent
from bigviz.core.offload_units import UnitRule, offload_units, unit_sizes, unit_table
from bigviz.core.tree import SizeTree, TensorSpec

CLASSES = ["Block", "Linear", "Seq", "ModuleList"]
DEVICES = [0, 1, "cpu", "disk", "cuda:0", "mps"]


@st.composite
def trees(draw: st.DrawFn) -> SizeTree:
    """Random nesting (a module under any earlier one), classes, containers, buffers, empty
    modules, sizes including 0, parametrized weights and tie groups of two or three."""
    names, classes, containers = [""], {"": "Net"}, []
    for i in range(draw(st.integers(1, 14))):
        up = draw(st.sampled_from(names))
        name = f"{up}.m{i}" if up else f"m{i}"
        names.append(name)
        classes[name] = draw(st.sampled_from(CLASSES))
        if classes[name] == "ModuleList":
            containers.append(name)
    specs = []
    for name in names:
        for j in range(draw(st.integers(0, 2))):
            kind = draw(st.sampled_from(["param", "param", "buffer"]))
            specs.append(
                TensorSpec(f"{name}.t{j}" if name else f"t{j}", draw(st.integers(0, 50)), "float32", kind=kind)
            )
    if draw(st.booleans()):  # weight norm: its module is placed whole
        holder = draw(st.sampled_from(names[1:]))
        for part in ("original0", "original1"):
            specs.append(TensorSpec(f"{holder}.parametrizations.weight.{part}", 7, "float32"))
    ties, free = [], [s.name for s in specs]
    for _ in range(draw(st.integers(0, 2))):
        if len(free) >= 3:
            group = draw(st.permutations(free))[: draw(st.integers(2, 3))]
            ties.append(group)
            free = [n for n in free if n not in group]
    return SizeTree.build(specs, classes, ties, containers=containers)


@st.composite
def device_maps(draw: st.DrawFn, tree: SizeTree) -> dict[str, object]:
    """A partition of the tree (modules whole or split into their tensors and children),
    sometimes cleaned, with an entry dropped (an uncovered tensor) or a key over the others."""
    out: dict[str, object] = {}
    stack = [""]
    while stack:
        node = tree.nodes[stack.pop()]
        if draw(st.integers(0, 2)) == 0 or not (node.children or node.tensors):
            out[node.name] = draw(st.sampled_from(DEVICES))
            continue
        out.update({t: draw(st.sampled_from(DEVICES)) for t in node.tensors})  # tensor-level entries
        stack.extend(node.children)
    if draw(st.booleans()):
        out = dict(clean_device_map({k: _canonical(v) for k, v in out.items()}, tree))
    if out and draw(st.integers(0, 6)) == 0:
        del out[draw(st.sampled_from(sorted(out)))]
    if draw(st.integers(0, 6)) == 0:
        out[draw(st.sampled_from(sorted(tree.nodes)))] = draw(st.sampled_from(DEVICES))  # may nest
    return out


@st.composite
def rules(draw: st.DrawFn, tree: SizeTree) -> UnitRule:
    modules = sorted(tree.nodes)
    reads = {}
    if len(modules) > 2 and draw(st.booleans()):  # a module read by an enclosing one's code
        read = draw(st.sampled_from(modules[1:]))
        reads[read] = draw(st.sampled_from(list(ancestors(parent(read)))))
    same = {}
    if len(modules) > 2 and draw(st.integers(0, 3)) == 0:
        first, alias = draw(st.permutations(modules[1:]))[:2]
        same[alias] = first
    return UnitRule(
        draw(st.sampled_from([0, "cpu", "mps"])),
        blocks=draw(st.sampled_from([frozenset(), frozenset({"Block"}), frozenset({"m*.m*"}), frozenset({"m[0-9]"})])),
        preload=draw(st.sampled_from([frozenset(), frozenset({"Seq"})])),
        reads=reads,
        offload_buffers=draw(st.booleans()),
        same_module=same,
    )


def _canonical(device: object) -> object:
    return 0 if device == "cuda:0" else device


def _full(tree: SizeTree, device_map: dict[str, object], rule: UnitRule) -> dict[str, tuple[str, int]]:
    return {u.name: (u.storage, u.nbytes) for u in offload_units(tree, device_map, rule).units}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_unit_table_is_the_full_rule(data: st.DataObject) -> None:
    tree = data.draw(trees())
    rule = data.draw(rules(tree))
    for _ in range(3):  # several maps on one tree: what is cached per entry must hold for each
        device_map = data.draw(device_maps(tree))
        full = _full(tree, device_map, rule)
        assert unit_table(tree, device_map, rule) == full, (device_map, rule)
        assert sorted(unit_sizes(tree, device_map, rule)) == sorted(full.values())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_cleaning_with_a_tree_is_the_node_by_node_rule(data: st.DataObject) -> None:
    tree = data.draw(trees())
    device_map = {k: _canonical(v) for k, v in data.draw(device_maps(tree)).items()}
    device_map["not.in.the.model"] = "cpu"  # keys naming nothing are ignored by both
    cleaned = clean_device_map(device_map, tree)
    assert cleaned == _clean_every_node(device_map, tree)
    assert list(cleaned) == list(_clean_every_node(device_map, tree))  # same order: definition order


def test_a_cached_entry_follows_where_its_tie_lives_in_each_map() -> None:
    specs = [
        TensorSpec("emb.weight", 10, "float32"),
        TensorSpec("h.0.w", 20, "float32"),
        TensorSpec("h.1.w", 20, "float32"),
        TensorSpec("head.weight", 10, "float32"),
        TensorSpec("head.bias", 1, "float32"),
    ]
    tree = SizeTree.build(specs, ties=[("emb.weight", "head.weight")])
    rule = UnitRule(0)
    on_gpu = {"emb": "disk", "h.0": "cpu", "h.1": "disk", "head": 0}  # the tie stays with its GPU user
    assert unit_table(tree, on_gpu, rule) == {"h.0": ("cpu", 80), "h.1": ("disk", 80)} == _full(tree, on_gpu, rule)
    streamed = {**on_gpu, "head": "cpu"}  # now every user streams it: fetched by each
    assert unit_table(tree, streamed, rule) == {
        "emb": ("disk", 40),
        "h.0": ("cpu", 80),
        "h.1": ("disk", 80),
        "head": ("cpu", 44),
    }
    assert unit_table(tree, streamed, rule) == _full(tree, streamed, rule)
    uncovered = {k: v for k, v in streamed.items() if k != "head"}  # the group is a problem, fetched by none
    assert unit_table(tree, uncovered, rule) == {"h.0": ("cpu", 80), "h.1": ("disk", 80)}
