"""The Planner's memory-against-context chart: the planner's own numbers at each context, with
the placement kept, drawn under the budget bars (issue 28)."""

from __future__ import annotations

import pytest
import torch

import bigviz
from bigviz.models import LlamaConfig, build
from bigviz.models.llama import Llama
from bigviz.ui.context_chart import context_chart_svg, context_curves
from bigviz.ui.planner import Planner


@pytest.fixture
def llama() -> torch.nn.Module:
    with torch.device("meta"):
        return Llama(LlamaConfig.preset("llama-tiny", max_seq_len=2048))


def test_the_curves_are_the_planners_needs_with_the_placement_kept(llama):
    planner = Planner(llama, {0: 3_000_000, 1: 3_000_000, "cpu": 10**8}, context_length=256, batch_size=2, reserve=0)
    plan = planner.plan
    curves = context_curves(planner.state, plan)
    assert curves is not None and curves.tokens[0] == 0 and curves.tokens[-1] == 512 and 256 in curves.tokens
    assert set(curves.devices) == {d for d in (0, 1) if plan.usage_of(d).kv_cache}
    for d in curves.devices:
        u = plan.usage_of(d)
        here = curves.needs[d][curves.tokens.index(256)]
        assert here == u.used + u.kv_cache + u.activations + u.reserve + u.offload_reserve
        assert list(curves.needs[d]) == sorted(curves.needs[d]) and curves.needs[d][-1] > curves.needs[d][0]
        lifted = {device: 2**62 for device in plan.max_memory}  # past its budget: the need, not a refusal
        pinned = bigviz.plan(llama, lifted, overrides=plan.unit_map, batch_size=2, context_length=512, reserve=0)
        v = pinned.usage_of(d)  # the last point: the same placement planned at twice the context
        assert curves.needs[d][-1] == v.used + v.kv_cache + v.activations + v.reserve + v.offload_reserve


def test_where_a_device_is_full_matches_max_context_of_the_placement(llama):
    planner = Planner(llama, {0: 2_000_000, "cpu": 10**8}, context_length=256, reserve=0)
    curves = context_curves(planner.state, planner.plan, points=33)
    assert curves is not None
    full = curves.full_at(0)
    longest = bigviz.max_context(llama, {0: 2_000_000, "cpu": 10**8}, device_map=planner.plan, limit=512, reserve=0)
    assert full is not None and abs(full - longest) <= 512 / 32  # within one step of the chart
    svg = context_chart_svg(curves)
    assert "<svg" in svg and "GPU 0</b> full at about" in svg and "256 (planned)" in svg


def test_the_planner_shows_the_chart_under_the_bars_only_for_a_run(llama):
    planner = Planner(llama, {0: 3_000_000, "cpu": 10**8}, reserve=0)
    assert "bigviz-context" not in planner.controls.usage.value
    planner.controls.context.value = 128
    usage = planner.controls.usage.value
    assert usage.index("bigviz-usage") < usage.index("bigviz-context") and "Memory against context" in usage
    planner.controls.context.value = 0
    assert "bigviz-context" not in planner.controls.usage.value


def test_no_chart_for_a_model_without_a_known_layout():
    with torch.device("meta"):
        model = build("gpt-tiny")
    tree = bigviz.module_tree(model)
    planner = Planner(tree, {0: 10**6, "cpu": 10**8}, reserve=0)
    assert context_curves(planner.state, planner.plan) is None
