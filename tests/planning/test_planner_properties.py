"""Property tests: for random trees and budgets, every tensor is placed exactly once and no
budget is exceeded, whatever the strategy."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bigviz.core.names import is_prefix
from bigviz.core.offload_units import UnitRule
from bigviz.core.plan import STRATEGIES, PlanOptions
from bigviz.core.planner import PlanError, make_plan
from bigviz.core.tree import SizeTree, TensorSpec


@st.composite
def trees(draw):
    """Random module trees up to depth 3 with float32 / int64 tensors."""
    specs, classes = [], {"": "Root"}
    for i in range(draw(st.integers(1, 6))):
        classes[f"m{i}"] = draw(st.sampled_from(["Block", "Seq"]))
        for j in range(draw(st.integers(0, 4))):
            classes[f"m{i}.c{j}"] = "Leaf"
            for k in range(draw(st.integers(1, 3))):
                specs.append(
                    TensorSpec(
                        f"m{i}.c{j}.t{k}",
                        draw(st.integers(0, 500)),
                        draw(st.sampled_from(["float32", "int64", "float16"])),
                    )
                )
        if draw(st.booleans()):
            specs.append(TensorSpec(f"m{i}.own", draw(st.integers(1, 300)), "float32"))
    if not specs:
        specs.append(TensorSpec("m0.only", 10, "float32"))
    ties = []
    names = [s.name for s in specs]
    if len(names) > 2 and draw(st.booleans()):
        a, b = draw(st.permutations(names))[:2]
        ties.append((a, b))
    return SizeTree.build(specs, classes, ties)


@st.composite
def budgets(draw):
    out = {g: draw(st.integers(0, 6000)) for g in range(draw(st.integers(0, 3)))}
    out["cpu"] = draw(st.integers(0, 6000))
    if draw(st.booleans()):
        out["disk"] = draw(st.integers(0, 20000))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tree=trees(),
    limits=budgets(),
    strategy=st.sampled_from(STRATEGIES),
    no_split=st.sampled_from([frozenset(), frozenset({"Block"})]),
    prefetch=st.booleans(),
)
def test_every_tensor_placed_once_and_budgets_hold(tree, limits, strategy, no_split, prefetch):
    try:
        plan = make_plan(
            tree, limits, PlanOptions(strategy=strategy, rule=UnitRule(blocks=no_split), prefetch=prefetch)
        )
    except PlanError as err:
        assert "does not fit" in str(err)
        assert "disk" in limits  # only a bounded disk can make a model not fit
        return
    units = [p.name for p in plan.placements]
    for tensor in tree.tensors:
        owners = [u for u in units if is_prefix(u, tensor)]
        assert len(owners) == 1, (tensor, owners)
    for usage in plan.usage:
        assert usage.used + usage.reserve + usage.offload_reserve <= max(usage.budget, 0) or (
            usage.used == 0 and usage.offload_reserve > 0
        ), usage
    assert sum(u.used for u in plan.usage) == tree.total("")
    # a tied follower always sits with its leader
    for follower, leader in tree.leader_of.items():
        assert plan.device_of(follower) == plan.device_of(leader)
    # the cleaned map says the same as the unit map for every tensor
    cleaned = plan.device_map
    from bigviz.core.devicemap import device_of

    for tensor in tree.tensors:
        assert device_of(tensor, cleaned) == plan.device_of(tensor)
