"""The chain of plans, pure: what the planner promises is what the dispatch plan fetches.

For random trees (nested modules, containers, blocks by class or by glob, parametrized
weights, ties, buffers), random budgets and options, the offload reserve of every device in
the DevicePlan equals the room the DispatchPlan of the same plan holds (its two largest
streamed units), and no unit is ever bigger than a block. No torch, no files.
"""

from __future__ import annotations

import fnmatch

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bigviz.core.dispatch_plan import make_dispatch_plan
from bigviz.core.names import ancestors, is_prefix, parent
from bigviz.core.nosplit import is_no_split
from bigviz.core.offload_units import UnitRule, offload_units, streamed_needs
from bigviz.core.plan import STRATEGIES, PlanOptions
from bigviz.core.planner import PlanError, make_plan
from bigviz.core.tree import SizeTree, TensorSpec


@st.composite
def trees(draw):
    """Random models: a root holding lists of blocks (containers), plain modules, and blocks
    with sub-modules, parametrized weights, buffers and a tie."""
    specs, classes, containers = [], {"": "Net"}, []
    for i in range(draw(st.integers(1, 4))):
        group = f"g{i}"
        if draw(st.booleans()):  # a ModuleList of blocks
            classes[group] = "ModuleList"
            containers.append(group)
            for b in range(draw(st.integers(1, 4))):
                _block(draw, specs, classes, f"{group}.{b}")
        else:
            classes[group] = draw(st.sampled_from(["Seq", "Mixer"]))
            _block(draw, specs, classes, group)
            if draw(st.booleans()):
                specs.append(TensorSpec(f"{group}.own", draw(st.integers(1, 200)), "float32"))
    ties = []
    params = [s.name for s in specs if s.kind == "param"]
    if len(params) > 2 and draw(st.booleans()):
        a, b = draw(st.permutations(params))[:2]
        ties.append((a, b))
    return SizeTree.build(specs, classes, ties, containers=containers)


def _block(draw, specs, classes, name):
    classes.setdefault(name, "Block")
    for j in range(draw(st.integers(1, 3))):
        child = f"{name}.c{j}"
        classes[child] = "Linear"
        specs.append(TensorSpec(f"{child}.weight", draw(st.integers(1, 400)), "float32"))
        if draw(st.booleans()):
            specs.append(TensorSpec(f"{child}.stat", draw(st.integers(1, 50)), "float32", kind="buffer"))
    if draw(st.integers(0, 5)) == 0:  # weight norm: the module is placed whole
        classes[f"{name}.p"] = "Conv"
        classes[f"{name}.p.parametrizations"] = "ModuleDict"
        classes[f"{name}.p.parametrizations.weight"] = "ParametrizationList"
        for part in ("original0", "original1"):
            specs.append(TensorSpec(f"{name}.p.parametrizations.weight.{part}", draw(st.integers(1, 100)), "float32"))


@st.composite
def budgets(draw):
    out = {g: draw(st.integers(0, 5000)) for g in range(draw(st.integers(1, 2)))}
    out["cpu"] = draw(st.integers(0, 5000))
    return out


NO_SPLIT = [frozenset(), frozenset({"Block"}), frozenset({"g*.*"}), frozenset({"g[0-9]"}), frozenset({"Mixer"})]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tree=trees(),
    limits=budgets(),
    strategy=st.sampled_from(STRATEGIES),
    no_split=st.sampled_from(NO_SPLIT),
    prefetch=st.booleans(),
    offload_buffers=st.booleans(),
    preload=st.sampled_from([frozenset(), frozenset({"Seq"})]),
)
def test_the_planners_reserve_is_what_the_dispatch_plan_holds(
    tree, limits, strategy, no_split, prefetch, offload_buffers, preload
):
    options = PlanOptions(
        strategy=strategy,
        rule=UnitRule(blocks=no_split, offload_buffers=offload_buffers, preload=preload),
        prefetch=prefetch,
    )
    try:
        plan = make_plan(tree, limits, options)
    except PlanError:
        return  # budgets too small for the model (disk is unlimited here, so this is rare)
    dispatch = plan.dispatch_plan()
    held = dispatch.held_bytes()
    for usage in plan.usage:
        assert usage.offload_reserve == held.get(usage.device, 0), (usage, held, dispatch.summary())
    assert dispatch.problems == ()
    fetched = {f.key for u in dispatch.units for f in u.fetches} | {r.key for r in dispatch.resident}
    assert fetched == {g[0] for g in _groups(tree)}  # every tensor (tie group) fetched or resident
    if not preload:  # preload classes fetch a whole module on purpose
        _assert_never_bigger_than_a_block(tree, dispatch, no_split)


def _groups(tree):
    tied = {n for g in tree.ties for n in g}
    return [*tree.ties, *((n,) for n in tree.tensors if n not in tied)]


def _assert_never_bigger_than_a_block(tree, dispatch, no_split):
    """A unit fetching a tensor of a block sits at or below that block: blocks stream one by
    one (a unit above a block fetches only tensors outside it, e.g. a module's own)."""
    every = [n for n in tree.nodes if n and is_no_split(tree, n, no_split)]
    # the outermost: a block inside a block is part of it ("g*.*" matches g0.0 and g0.0.c0)
    blocks = [b for b in every if not any(o != b and is_prefix(o, b) for o in every)]
    for unit in dispatch.units:
        for name in (n for f in unit.fetches for n in f.names):
            for block in (b for b in blocks if is_prefix(b, name)):
                assert is_prefix(block, unit.name), f"unit {unit.name!r} fetches {name} of block {block}"


def test_globs_are_honoured_by_the_planner_and_the_dispatch_alike():
    # a model read from checkpoint headers: no classes, its blocks given as a glob
    specs = [TensorSpec(f"body.h.{i}.{p}", 250, "float32") for i in range(6) for p in ("a", "b")]
    specs.append(TensorSpec("body.norm", 10, "float32"))
    tree = SizeTree.build(specs)
    plan = make_plan(tree, {0: 4500, "cpu": 10**6}, PlanOptions(rule=UnitRule(blocks=frozenset({"body.h.*"}))))
    assert plan.device_map == {"body.norm": 0, "body.h": "cpu"}
    dispatch = plan.dispatch_plan()
    assert [(u.name, u.nbytes) for u in dispatch.units] == [(f"body.h.{i}", 2000) for i in range(6)]
    assert plan.usage_of(0).offload_reserve == 4000 == dispatch.held_bytes()[0]  # two blocks, not the list
    # without the glob nothing says where blocks end: the engine would fetch the whole list at
    # once, and the planner reserves exactly that (it used to reserve 4000 and run out of memory)
    whole = make_plan(tree, {0: 4500, "cpu": 10**6})
    assert whole.device_map == {"": "cpu"} and [u.name for u in whole.dispatch_plan().units] == [""]
    assert whole.usage_of(0).offload_reserve == 12040 == whole.dispatch_plan().held_bytes()[0]


def test_a_cleaned_map_gives_the_units_the_engine_fetches():
    # the planner splits 'mix' (it does not fit the GPU) and both halves land on the cpu: the
    # cleaned map names 'mix' whole, so the engine fetches it as one unit (2400 B, not two of
    # 1200 B), and the reserve the plan keeps on the GPU is the largest such unit
    specs = [
        TensorSpec("emb.weight", 100, "float32"),
        TensorSpec("mix.a.weight", 300, "float32"),
        TensorSpec("mix.b.weight", 300, "float32"),
        TensorSpec("head.weight", 100, "float32"),
        TensorSpec("tail.weight", 600, "float32"),
    ]
    tree = SizeTree.build(
        specs,
        {
            "": "Net",
            "emb": "Embedding",
            "mix": "Mixer",
            "mix.a": "Linear",
            "mix.b": "Linear",
            "head": "Linear",
            "tail": "Linear",
        },
    )
    plan = make_plan(tree, {0: 2800, "cpu": 10**6}, PlanOptions(strategy="sequential", prefetch=False))
    assert plan.device_map == {"emb": 0, "mix": "cpu", "head": "cpu", "tail": "cpu"}
    dispatch = plan.dispatch_plan()
    assert [(u.name, u.nbytes) for u in dispatch.units] == [("mix", 2400), ("head", 400), ("tail", 2400)]
    assert plan.usage_of(0).offload_reserve == 2400 == dispatch.held_bytes()[0]
    halves = make_dispatch_plan(
        tree, {"emb": 0, "mix.a": "cpu", "mix.b": "cpu", "head": "cpu", "tail": "cpu"}, UnitRule(0)
    )
    assert [u.name for u in halves.units] == ["mix.a", "mix.b", "head", "tail"]  # the map's own entries


def test_dispatch_plan_lists_units_in_fetch_order_with_resident_ties_and_buffers():
    specs = [
        TensorSpec("emb.weight", 100, "float32"),
        TensorSpec("h.0.w", 200, "float32"),
        TensorSpec("h.0.mask", 10, "float32", kind="buffer"),
        TensorSpec("h.1.w", 200, "float32"),
        TensorSpec("head.weight", 100, "float32"),
    ]
    tree = SizeTree.build(specs, ties=[("emb.weight", "head.weight")])
    device_map = {"emb": "disk", "h.0": "cpu", "h.1": "disk", "head": 0}
    plan = make_dispatch_plan(tree, device_map, UnitRule(0))
    assert [(u.name, u.storage, u.tensors) for u in plan.units] == [
        ("h.0", "cpu", ("h.0.w",)),
        ("h.1", "disk", ("h.1.w",)),
    ]
    resident = {r.key: (r.names, r.device) for r in plan.resident}
    assert resident == {
        "emb.weight": (("emb.weight", "head.weight"), 0),  # the tie stays with its GPU user
        "h.0.mask": (("h.0.mask",), 0),
    }  # buffers stay on the execution device
    assert plan.streamed_bytes() == {"cpu": 800, "disk": 800} and plan.held_bytes() == {0: 1600, "cpu": 800}
    frame_rows = plan.rows()
    assert [r["unit"] for r in frame_rows] == ["h.0", "h.1"] and frame_rows[1]["bytes"] == 800
    assert "2 offload units" in plan.summary() and "from disk: 1 unit" in plan.summary()
    streamed = make_dispatch_plan(tree, device_map, UnitRule(0, offload_buffers=True))
    assert streamed.unit("h.0").buffers == ("h.0.mask",) and streamed.unit("h.0").nbytes == 840


def test_an_uncovered_tensor_is_a_problem_of_the_plan():
    tree = SizeTree.build([TensorSpec("a.w", 1, "float32"), TensorSpec("b.w", 1, "float32")])
    plan = make_dispatch_plan(tree, {"a": "disk"}, UnitRule("cpu"))
    assert plan.problems == ("b.w: no device-map entry covers it (add it, or one of its parents)",)
    with pytest.raises(ValueError, match="b.w: no device-map entry"):
        plan.check()


def test_readers_and_preload_classes_lift_the_unit():
    specs = [
        TensorSpec("enc.layer.w", 40, "float32"),
        TensorSpec("enc.rel.weight", 8, "float32"),
        TensorSpec("enc.out.w", 4, "float32"),
    ]
    tree = SizeTree.build(
        specs, {"": "Net", "enc": "Encoder", "enc.layer": "Linear", "enc.rel": "Embedding", "enc.out": "Linear"}
    )
    device_map = {"enc.layer": "cpu", "enc.rel": "disk", "enc.out": "cpu"}
    read = offload_units(tree, device_map, UnitRule("cpu", reads={"enc.rel": "enc"}))
    assert [(u.name, u.tensors) for u in read.units] == [("enc", ("enc.rel.weight",))]  # its reader fetches it
    pre = offload_units(tree, device_map, UnitRule(0, preload=frozenset({"Encoder"})))
    assert [(u.name, u.storage, u.nbytes) for u in pre.units] == [("enc", "disk", 208)]  # mixed cpu+disk: disk
    assert streamed_needs(pre.units, 0) == {0: 208, "cpu": 208}


def test_glob_sanity():  # the globs above match what they should
    assert fnmatch.fnmatchcase("g1.3", "g*.*") and not fnmatch.fnmatchcase("g1", "g*.*")
    assert list(ancestors("a.b"))[1:] == ["a", ""] and parent("a.b") == "a"
