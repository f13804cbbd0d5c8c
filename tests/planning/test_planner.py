"""The planner on tiny trees with hand-worked bytes: exact maps, reasons, planner."""

from __future__ import annotations

import pytest

from bigviz.core.offload_units import UnitRule
from bigviz.core.plan import PlanOptions
from bigviz.core import planner
from bigviz.core.planner import PlanError, make_plan
from bigviz.core.tree import SizeTree, TensorSpec

KB = 1000


def _layers_and_head(n: int = 10, layer: int = 40 * KB, head: int = 400 * KB) -> SizeTree:
    # n float32 layers of `layer` bytes (layer/4 elements each), then a head.
    specs = [TensorSpec(f"layers.{i}.weight", layer // 4, "float32") for i in range(n)]
    specs.append(TensorSpec("head.weight", head // 4, "float32"))
    classes = {"": "Net", "layers": "ModuleList", **{f"layers.{i}": "Layer" for i in range(n)}, "head": "Head"}
    return SizeTree.build(specs, classes)


def test_nothing_offloaded_means_no_reserve_and_gpu0_filled():
    # 10 x 40 KB layers fill 400 KB of GPU 0's 560 KB; the 400 KB head does not fit the
    # remaining 160 KB and goes to GPU 1. Nothing is offloaded, so nothing is reserved:
    # accelerate would keep room for the head on GPU 0 and fill only 29% of it. (A balanced
    # strategy keeps that layer off GPU 0's share, as transformers' device_map="auto" does.)
    plan = make_plan(_layers_and_head(), {0: 560 * KB, 1: 10**9}, PlanOptions(strategy="sequential"))
    assert plan.device_map == {"layers": 0, "head": 1}
    assert plan.usage_of(0).used == 400 * KB
    assert plan.usage_of(0).offload_reserve == 0
    assert plan.usage_of(0).fraction >= 0.70


def test_sequential_fills_in_order_and_offloads_to_cpu_then_disk():
    # GPU 0: 100 KB. Offloaded layers stream into GPU 0, so it keeps 2 x 40 KB free
    # (current + prefetched): 20 KB usable -> no layer fits -> everything leaves GPU 0.
    # CPU: 200 KB = 5 layers, keeping room for 2 disk layers (80 KB) -> 3 layers. Then disk.
    plan = make_plan(_layers_and_head(head=40 * KB), {0: 100 * KB, "cpu": 200 * KB}, PlanOptions(strategy="sequential"))
    devices = [p.device for p in plan.placements if p.name.startswith(("layers.", "head"))]
    assert devices == ["cpu"] * 3 + ["disk"] * 8
    assert plan.usage_of(0).offload_reserve == 80 * KB
    assert plan.usage_of("cpu").offload_reserve == 80 * KB
    assert plan.usage_of("cpu").used == 120 * KB


def test_reserve_uses_one_unit_without_prefetch():
    plan = make_plan(
        _layers_and_head(head=40 * KB), {0: 100 * KB, "cpu": 10**9}, PlanOptions(strategy="sequential", prefetch=False)
    )
    # 100 KB - 40 KB reserve = 60 KB: one 40 KB layer on GPU 0.
    assert plan.device_map["layers.0"] == 0 and plan.device_map["layers.1"] == "cpu"
    assert plan.usage_of(0).offload_reserve == 40 * KB


def test_no_split_module_moves_whole_with_a_reason():
    # block.a (30 KB) + block.b (30 KB) = 60 KB does not fit GPU 0's 50 KB.
    specs = [TensorSpec("block.a.w", 30 * KB // 4, "float32"), TensorSpec("block.b.w", 30 * KB // 4, "float32")]
    tree = SizeTree.build(specs, {"": "M", "block": "Block", "block.a": "Linear", "block.b": "Linear"})
    split = make_plan(tree, {0: 50 * KB, "cpu": 10**6}, PlanOptions(offload_reserve=False))
    assert split.device_map == {"block.a": 0, "block.b": "cpu"}
    whole = make_plan(tree, {0: 50 * KB, "cpu": 10**6}, PlanOptions(rule=UnitRule(blocks=frozenset({"Block"}))))
    assert whole.device_map == {"": "cpu"}
    reason = whole.placements[0].reason
    assert "Block is no-split and did not fit GPU 0" in reason and "CPU" in reason


def test_no_split_glob_patterns():
    tree = _layers_and_head(n=3, head=4 * KB)
    plan = make_plan(
        tree,
        {0: 50 * KB, "cpu": 10**6},
        PlanOptions(rule=UnitRule(blocks=frozenset({"layers.*"})), offload_reserve=False),
    )
    # Each 40 KB layer is whole: one fits GPU 0's 50 KB. The 4 KB head still fits the 10 KB
    # left there: streamed-off layers do not push later small modules off the GPU.
    assert plan.device_map == {"layers.0": 0, "layers.1": "cpu", "layers.2": "cpu", "head": 0}


def test_one_big_module_does_not_push_later_layers_off_the_gpus():
    # emb (100 KB) fits neither GPU 0 (50 KB) nor GPU 1 (90 KB): it is streamed from the CPU,
    # and GPU 0 keeps 100 KB for it, so GPU 0 holds nothing. The four 20 KB layers then go
    # to GPU 1 instead of following the embedding to the CPU (accelerate's one-way rule).
    specs = [TensorSpec("emb.weight", 25_000, "float32")]
    specs += [TensorSpec(f"layers.{i}.weight", 5_000, "float32") for i in range(4)]
    plan = make_plan(
        SizeTree.build(specs),
        {0: 50 * KB, 1: 90 * KB, "cpu": 10**6},
        PlanOptions(strategy="sequential", prefetch=False),
    )
    assert plan.device_map == {"emb": "cpu", "layers": 1}
    assert "streamed in from CPU at forward time" in plan.placements[0].reason


def test_balanced_spreads_and_sequential_does_not():
    tree = _layers_and_head(n=8, head=40 * KB)  # 9 x 40 KB = 360 KB
    budgets = {0: 10**6, 1: 10**6}
    seq = make_plan(tree, budgets, PlanOptions(strategy="sequential"))
    assert seq.device_map == {"": 0}
    bal = make_plan(tree, budgets, PlanOptions(strategy="balanced"))
    # share = 180 KB + buffer 1.25 x 40 KB = 230 KB, less the 40 KB layer accelerate keeps
    # free on GPU 0 = 190 KB: 4 units; the rest on GPU 1 (transformers' device_map="auto").
    assert bal.usage_of(0).used == 160 * KB and bal.usage_of(1).used == 200 * KB
    assert make_plan(tree, budgets, PlanOptions(strategy="auto")).device_map == bal.device_map


def test_balanced_low_0_keeps_gpu0_for_what_does_not_fit():
    tree = _layers_and_head(n=8, head=40 * KB)
    plan = make_plan(tree, {0: 10**6, 1: 10**6, 2: 10**6}, PlanOptions(strategy="balanced_low_0"))
    assert plan.usage_of(0).used == 0
    assert plan.usage_of(1).used + plan.usage_of(2).used == 360 * KB
    assert plan.usage_of(1).used > 0 and plan.usage_of(2).used > 0


def test_overrides_are_honoured_and_planned_around():
    tree = _layers_and_head(n=4, head=40 * KB)
    plan = make_plan(tree, {0: 10**6, "cpu": 10**6}, PlanOptions(overrides={"layers.2": "cpu"}))
    assert plan.device_of("layers.2.weight") == "cpu"
    assert plan.device_of("layers.1.weight") == 0 and plan.device_of("head.weight") == 0
    assert next(p for p in plan.placements if p.name == "layers.2").override


def test_nested_overrides_charge_each_device_once():
    tree = _layers_and_head(n=4, head=40 * KB)
    plan = make_plan(
        tree, {0: 10**6, "cpu": 10**6, "disk": 10**6}, PlanOptions(overrides={"layers": "cpu", "layers.3": "disk"})
    )
    assert plan.usage_of("cpu").used == 120 * KB and plan.usage_of("disk").used == 40 * KB
    assert plan.device_of("layers.3.weight") == "disk" and plan.device_of("layers.0.weight") == "cpu"


def test_bad_inputs_are_all_reported():
    with pytest.raises(PlanError) as err:
        make_plan(
            _layers_and_head(),
            {0: 10},
            PlanOptions(strategy="fastest", overrides={"nope": 0, "head": 3}, reserve={0: "lots"}),
        )
    text = str(err.value)
    assert "'fastest'" in text and "'nope'" in text and "GPU 3" in text and "'lots'" in text


def test_does_not_fit_names_what_is_left():
    with pytest.raises(PlanError, match="does not fit.*head"):
        make_plan(_layers_and_head(), {"cpu": 100 * KB, "disk": 400 * KB})


def test_ties_follow_their_leader():
    specs = [
        TensorSpec("emb.weight", 100, "float32"),
        TensorSpec("body.weight", 100, "float32"),
        TensorSpec("out.weight", 100, "float32"),
    ]
    tree = SizeTree.build(specs, ties=[("emb.weight", "out.weight")])
    assert tree.total("") == 800  # the tied weight counted once
    plan = make_plan(tree, {0: 500, "cpu": 10**6}, PlanOptions(offload_reserve=False))
    assert plan.device_map == {"emb": 0, "body": "cpu", "out": 0}
    out = next(p for p in plan.placements if p.name == "out")
    assert out.tied_to == "emb.weight" and "tied to emb.weight" in out.reason


def test_user_reserve_lowers_what_fits():
    tree = _layers_and_head(n=4, head=40 * KB)
    plan = make_plan(tree, {0: 200 * KB, 1: 10**6}, PlanOptions(strategy="sequential", reserve={0: "80KB"}))
    assert plan.usage_of(0).used == 120 * KB and plan.usage_of(0).reserve == 80 * KB


def test_planning_for_gpus_the_machine_lacks():
    plan = make_plan(_layers_and_head(), {7: 10**9})
    assert plan.device_map == {"": 7}


def test_decreasing_chain_of_8000_layers_looks_at_each_module_a_bounded_number_of_times(monkeypatch):
    # accelerate re-scans the remaining layers after each one here (quadratic). bigviz's pass
    # places each module once per pass; speed itself is measured in bench/planning.py.
    specs = [TensorSpec(f"{i}.weight", 8000 - i, "float32") for i in range(8000)]
    tree = SizeTree.build(specs)
    calls = []
    fit = planner._fit
    monkeypatch.setattr(planner, "_fit", lambda *a, **k: calls.append(1) or fit(*a, **k))
    plan = make_plan(tree, {0: tree.total("") // 3, "cpu": tree.total("") // 3})
    assert {p.device for p in plan.placements} == {0, "cpu", "disk"}
    assert 0 < len(calls) <= planner._MAX_PASSES * len(tree.nodes)


def test_plan_exports():
    plan = make_plan(_layers_and_head(n=2, head=4 * KB), {0: 10**6})
    frame = plan.to_frame()
    assert list(frame.columns)[:4] == ["module", "class", "device", "bytes"]
    assert frame["bytes"].sum() == plan.tree.total("")
    assert "<table>" in plan._repr_html_() and "GPU 0" in plan.summary()
    assert plan.to_dict()["device_map"] == plan.device_map


def test_a_reserve_for_a_device_without_a_budget_is_refused_like_an_override():
    with pytest.raises(PlanError, match=r"reserve\[1\] keeps room on GPU 1, which has no budget"):
        make_plan(_layers_and_head(), {0: 10**9, "cpu": 10**9}, PlanOptions(reserve={1: 100 * KB}))


def test_a_gpu_that_cannot_hold_the_streamed_weights_is_flagged():
    # GPU 0 executes and holds nothing: the room for the running 200 KB head and a prefetched
    # layer is more than its 30 KB. The plan says it does not fit (a vague note used to be all)
    tree = _layers_and_head(n=4, layer=40 * KB, head=200 * KB)
    options = PlanOptions(strategy="sequential", rule=UnitRule(blocks=frozenset({"Layer"})))
    plan = make_plan(tree, {0: 30 * KB, "cpu": 10**9}, options)
    assert not plan.fits(allow_offload=True) and plan.usage_of(0).free < 0
    note = next(n for n in plan.notes if n.startswith("does not fit"))
    assert "GPU 0 must keep 234.4 KiB free" in note and "over its whole budget of 29.3 KiB" in note
    assert "prefetch=False" in note and not any("holds no weights" in n for n in plan.notes)


def test_interleaved_blocks_say_they_were_interleaved():
    # CPU executes and holds 6 of 10 layers; the 4 on disk are spread between them, and a moved
    # layer says so rather than "did not fit" with the room left at the end of the pass
    options = PlanOptions(rule=UnitRule(blocks=frozenset({"Layer"})))
    plan = make_plan(_layers_and_head(head=4 * KB), {"cpu": 250 * KB, "disk": 10**9}, options)
    moved = [p for p in plan.placements if p.name.startswith("layers.") and "interleaved" in p.reason]
    assert moved and any(p.device == "disk" for p in moved) and any(p.device == "cpu" for p in moved)
    assert all("did not fit" not in p.reason for p in moved)
    assert "streamed from disk between layers's blocks kept on the CPU" in next(
        p.reason for p in moved if p.device == "disk"
    )
