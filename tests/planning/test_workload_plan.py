"""Planning the run: the pure workload formulas, and the planner charging each layer's KV
cache and each device's largest step on the device that runs them (no torch needed for
most of it: trees and byte counts are made by hand)."""

from __future__ import annotations

import re

import pytest

from bigviz.core.offload_units import UnitRule
from bigviz.core.plan import PlanOptions
from bigviz.core.planner import PlanError, make_plan
from bigviz.core.tree import SizeTree, TensorSpec
from bigviz.core.workload import (
    CacheSpec,
    RunSpec,
    StepSpec,
    Term,
    Workload,
    activation_bytes,
    layer_cache_bytes,
    longest_fit,
)

LAYER = 1000  # bytes of weights per layer
KV, ACT = 300, 200  # bytes of KV cache per layer, bytes of a layer's step


def _tree(n: int = 10, head: int = 2000) -> SizeTree:
    layers = [TensorSpec(f"h.{i}.w", LAYER // 4, "float32") for i in range(n)]
    return SizeTree.build(layers + [TensorSpec("head.w", head // 4, "float32")])


def _options(n: int = 10, **kwargs: object) -> PlanOptions:
    kv = {f"h.{i}": KV for i in range(n)}
    act = {**{f"h.{i}": ACT for i in range(n)}, "head": 2 * ACT}
    return PlanOptions(
        **{
            "strategy": "sequential",
            "rule": UnitRule(blocks=frozenset({"h.*"})),
            "kv_cache": kv,
            "activations": act,
            "workload": Workload(1, 100),
            **kwargs,
        }
    )


# ---- formulas ---------------------------------------------------------------------------------
def test_cache_formulas_per_layout():
    w = Workload(batch_size=3, context_length=50)
    assert CacheSpec("full_attention", heads=2, k_dim=8, v_dim=8).nbytes(w, "float16") == 3 * 50 * 2 * 16 * 2
    sliding = CacheSpec("sliding_attention", heads=2, k_dim=8, v_dim=8, window=20)
    assert sliding.nbytes(w, "float16") == 3 * 20 * 2 * 16 * 2
    assert sliding.nbytes(Workload(3, 10), "float16") == 3 * 10 * 2 * 16 * 2  # under the window
    latent = CacheSpec("latent_attention", heads=1, k_dim=512, v_dim=64)  # DeepSeek's MLA
    assert latent.nbytes(w, "bfloat16") == 3 * 50 * 576 * 2
    state = CacheSpec("state", state=((128 * 4, None), (128 * 16, "float32")))  # Mamba: conv + ssm
    assert state.nbytes(w, "bfloat16") == state.nbytes(Workload(3, 5000), "bfloat16") == 3 * (512 * 2 + 2048 * 4)
    assert CacheSpec("none").nbytes(w, "float32") == 0
    assert CacheSpec("full_attention", heads=1, k_dim=4, v_dim=4).nbytes(Workload(1, 0), "float32") == 0


def test_kv_dtype_of_the_workload_wins_and_the_state_keeps_its_own():
    spec = CacheSpec("state", state=((10, None), (10, "float32")))
    assert spec.nbytes(Workload(1, 1, kv_dtype="fp16"), "float32") == 10 * 2 + 10 * 4
    full = CacheSpec("full_attention", heads=1, k_dim=4, v_dim=4)
    assert layer_cache_bytes({"a": (full, full)}, Workload(2, 10, "float8_e4m3fn"), "float32") == {"a": 2 * 2 * 10 * 8}


def test_bad_workloads_and_specs_say_what_is_wrong():
    with pytest.raises(ValueError) as err:
        Workload(batch_size=0, context_length=-1, kv_dtype="float13")
    assert "batch_size=0" in str(err.value) and "context_length=-1" in str(err.value) and "float13" in str(err.value)
    with pytest.raises(ValueError, match="window"):
        CacheSpec("sliding_attention", heads=1, k_dim=1, v_dim=1)
    with pytest.raises(ValueError, match="unknown cache kind"):
        CacheSpec("paged")


def test_steps_take_their_largest_phase_plus_what_the_forward_carries():
    step = StepSpec(((Term(10),), (Term(4), Term(1, 8.0, per="pair")), (Term(2, batched=False, per="fixed"),)))
    w = Workload(batch_size=2, context_length=5)
    # phases: 2*5*10*4 = 400; 2*5*4*4 + 2*25*8 = 560; 2*4 = 8 -> 560
    assert step.nbytes(w, "float32") == 560
    assert activation_bytes({"l": step}, (Term(1),), w, "float32") == {"l": 560 + 40}
    assert activation_bytes({"l": step}, (Term(1),), Workload(2, 0), "float32") == {"l": 0}
    spec = RunSpec("float32", {"l": (CacheSpec("full_attention", heads=1, k_dim=1, v_dim=1),)}, {"l": step})
    assert spec.kv_cache(w) == {"l": 2 * 5 * 2 * 4} and spec.activations(w) == {"l": 560}


@pytest.mark.parametrize("edge", [0, 1, 7, 1000, 4096])
def test_longest_fit_finds_the_edge_in_logarithmic_calls(edge: int):
    calls: list[int] = []
    assert longest_fit(lambda n: calls.append(n) or n <= edge, 10**6) == edge
    assert len(calls) <= 2 * (edge.bit_length() + 1) + 1
    assert longest_fit(lambda n: n <= edge, 5) == min(edge, 5)


# ---- the planner -------------------------------------------------------------------------------
def test_without_a_workload_plans_and_reasons_are_unchanged():
    plain = make_plan(
        _tree(), {0: 6000, 1: 10**6}, PlanOptions(strategy="sequential", rule=UnitRule(blocks=frozenset({"h.*"})))
    )
    assert plain.workload is None and set(plain.kv_cache.values()) == {0}
    assert plain.placements[0].reason == "fits: 1000 B of 5.9 KiB left on GPU 0"


def test_each_layer_cache_and_the_largest_step_are_charged_where_it_runs():
    plan = make_plan(_tree(), {0: 7000, 1: 10_000}, _options())
    on0 = [p.name for p in plan.placements if p.device == 0]
    on1 = [p.name for p in plan.placements if p.device == 1]
    # GPU 0: 5 layers x (1000 + 300) + one step of 200 = 6700 <= 7000; a sixth would need 8000
    assert on0 == [f"h.{i}" for i in range(5)]
    assert plan.kv_cache == {0: 5 * KV, 1: 5 * KV, "disk": 0}
    assert plan.activations == {0: ACT, 1: 2 * ACT, "disk": 0}  # the head's step is the largest on GPU 1
    assert "head" in on1
    u = plan.usage_of(0)
    assert (u.used, u.kv_cache, u.activations, u.free) == (5 * LAYER, 5 * KV, ACT, 7000 - 6700)
    assert (
        plan.placements[0].reason
        == "fits: 1000 B weights + 300 B KV cache + 200 B activations of 6.8 KiB left on GPU 0"
    )
    assert plan.placements[1].reason == "fits: 1000 B weights + 300 B KV cache of 5.4 KiB left on GPU 0"
    assert all("KV cache" in p.reason for p in plan.placements if p.name.startswith("h."))
    assert not any(re.search(r"(?<![0-9.])0 B KV cache", p.reason) for p in plan.placements)  # none said as none
    assert "KV cache" in plan.summary() and "batch 1 x 100 tokens" in plan.summary()


def test_a_streamed_layer_keeps_its_cache_on_the_execution_device():
    plan = make_plan(_tree(), {0: 9000, "cpu": 10**6}, _options())
    streamed = [p for p in plan.placements if p.device == "cpu"]
    assert streamed and all("live on GPU 0, where it runs" in p.reason for p in streamed)
    assert plan.kv_cache[0] == 10 * KV and plan.kv_cache["cpu"] == 0  # every layer's cache on GPU 0
    assert plan.activations[0] == 2 * ACT  # the streamed head's step runs there too
    u = plan.usage_of(0)
    assert u.free >= 0 and u.used + u.kv_cache + u.activations + u.offload_reserve <= 9000
    # the largest fill that still fits: 2 layers resident, room for two streamed units (head + layer)
    assert u.used == 2 * LAYER and u.offload_reserve == 2000 + LAYER


def test_a_run_that_cannot_fit_is_refused_with_the_numbers():
    with pytest.raises(PlanError) as err:
        make_plan(_tree(), {0: 6000, "cpu": 10**6}, _options())
    text = str(err.value)
    assert "the run does not fit" in text and "GPU 0" in text and "KV cache" in text
    assert "Shorten the context" in text


def test_a_split_layer_charges_its_cache_once_with_its_first_part():
    tree = SizeTree.build([TensorSpec(f"h.{i}.{p}.w", 250, "float32") for i in range(2) for p in ("a", "b")])
    options = PlanOptions(
        strategy="sequential", kv_cache={"h.0": 100, "h.1": 100}, activations={"h.0": 50}, workload=Workload(1, 10)
    )
    plan = make_plan(tree, {0: 1600, 1: 10_000}, options)  # h.0 (2000 B) is split over both GPUs
    assert plan.device_map == {"h.0.a": 0, "h.0.b": 1, "h.1": 1}
    assert plan.kv_cache == {0: 100, 1: 100, "disk": 0}  # h.0's cache once, with its first part
    assert plan.activations == {0: 50, 1: 50, "disk": 0}  # each part of h.0 runs part of its step
    reasons = {p.name: p.reason for p in plan.placements}
    assert "+ 100 B KV cache + 50 B activations" in reasons["h.0.a"] and "KV cache" not in reasons["h.0.b"]


def test_overrides_carry_their_layers_cache_to_their_device():
    plan = make_plan(_tree(4), {0: 10**6, 1: 10**6}, _options(4, overrides={"h.2": 1, "h.3": 1}))
    assert plan.kv_cache[1] == 2 * KV and plan.kv_cache[0] == 2 * KV
    assert "you put it on GPU 1" in plan.placements[0].reason + plan.placements[1].reason


def test_unknown_module_names_are_reported():
    with pytest.raises(PlanError, match="'nope'"):
        make_plan(_tree(2), {0: 10**6}, PlanOptions(kv_cache={"nope": 1}, workload=Workload(1, 1)))


def test_balanced_spreads_weights_and_caches_together():
    plan = make_plan(_tree(), {0: 20_000, 1: 20_000}, _options(strategy="balanced"))
    assert plan.offloaded_bytes() == {"cpu": 0, "disk": 0}
    assert abs(plan.kv_cache[0] - plan.kv_cache[1]) <= 2 * KV


def test_the_planner_stays_linear_with_a_workload():
    """Work counted, not timed: a bounded number of passes, each visiting every module a
    bounded number of times, whatever the model's length."""
    from bigviz.core import planner

    passes = planner._MAX_PASSES + planner._RUN_PASSES
    for n in (100, 400, 1600):
        tree = _tree(n)
        visits = {"n": 0}
        original = tree.subtree_tensors

        def counting(name: str, original=original, visits=visits) -> list[str]:
            visits["n"] += 1
            return original(name)

        tree.subtree_tensors = counting  # type: ignore[method-assign]
        plan = make_plan(tree, {0: 800 * n, "cpu": 10**9}, _options(n))
        assert 0 < plan.usage_of(0).used < n * LAYER  # some layers resident, the rest streamed
        assert plan.usage_of(0).free >= 0
        assert visits["n"] <= passes * 2 * len(tree.nodes)


def test_headroom_larger_than_the_budget_points_to_reserve():
    import torch

    import bigviz
    from bigviz.models import build

    with torch.device("meta"):
        model = build("gpt-tiny")
    with pytest.raises(bigviz.PlanError) as info:  # 1 GiB of default GPU headroom in 300 KiB
        bigviz.plan(model, {0: "300KiB", "cpu": "10MiB"}, context_length=1)
    assert "headroom kept free on GPU 0 is its whole budget" in str(info.value) and "reserve=0" in str(info.value)
    assert "Shorten the context" not in str(info.value)
    bigviz.plan(model, {0: "300KiB", "cpu": "10MiB"}, context_length=1, reserve=0)  # the fix it names
