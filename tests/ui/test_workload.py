"""The Planner's run controls, headless: batch, context and KV dtype re-plan; the budget bars
stack KV cache and activations; the longest context and its time per token are shown."""

from __future__ import annotations

import pytest
import torch

import bigviz
from bigviz.core.sizes import format_seconds
from bigviz.ui.planner import Planner
from bigviz.ui.report import ACTIVATION_FILL, KV_FILL, report_fragment


@pytest.fixture
def llama() -> torch.nn.Module:
    with torch.device("meta"):
        return bigviz.models.llama.Llama(bigviz.models.LlamaConfig.preset("llama-tiny", max_seq_len=2048))


def _planner(model: torch.nn.Module, **kwargs: object) -> Planner:
    return Planner(model, {0: 8_000_000, "cpu": 10**8}, reserve=0, **kwargs)


def test_context_control_plans_the_run_and_stacks_the_bars(llama):
    planner = _planner(llama)
    assert planner.plan.workload is None and "KV cache" not in planner.controls.usage.value
    planner.controls.context.value = 512
    plan = planner.plan
    assert plan.workload.context_length == 512 and plan.kv_cache[0] == sum(
        bigviz.kv_cache_bytes(llama, 1, 512).values()
    )
    usage = planner.controls.usage.value
    assert KV_FILL in usage and ACTIVATION_FILL in usage and "batch 1 x 512 tokens" in usage
    assert all("KV cache" in reason for reason in planner.table["reason"])
    planner.controls.batch.value = 3
    assert planner.plan.kv_cache[0] == 3 * plan.kv_cache[0]
    planner.controls.kv_dtype.value = "float16"
    assert planner.plan.kv_cache[0] == 3 * plan.kv_cache[0] // 2
    assert planner.workload == bigviz.Workload(3, 512, "float16")


def test_longest_context_and_time_per_token_are_shown(llama):
    planner = Planner(llama, {0: 3_000_000, "cpu": 10**8}, context_length=256, reserve=0)
    fit = planner.controls.fit.value
    longest = planner.longest_context()
    assert 256 <= longest < 2048 and f"<b>{longest:,} tokens</b> without offloading" in fit
    assert "nothing offloaded" in fit
    found = planner.find_longest_context()
    assert found["no_offload"] == longest and found["with_offload"] >= longest
    planner.budget_sliders[0].value = 2_000_000 / 2**30  # fewer GPU bytes: the result is out of date
    assert "settings changed" in planner.controls.fit.value
    planner.controls.find_context.click()
    assert "settings changed" not in planner.controls.fit.value
    assert planner.longest_context() < longest


def test_time_per_token_uses_the_cost_model(llama):
    planner = Planner(llama, {0: 700_000, "cpu": 10**8}, context_length=64, reserve=0)
    plan = planner.plan
    assert plan.offloaded_bytes()["cpu"] > 0
    expected = plan.cost(link_bandwidth=planner.controls.link.value, disk_bandwidth=planner.controls.disk.value).seconds
    assert planner.time_per_token() == pytest.approx(expected)
    assert f"{format_seconds(expected)} per token" in planner.controls.fit.value  # never rounded to "0 ms"


def test_a_run_that_does_not_fit_is_reported_and_recovers(llama):
    planner = _planner(llama)
    planner.controls.context.value = 2048
    planner.budget_sliders[0].value = 0.0005
    planner.budget_sliders["cpu"].value = 0.0005
    assert "Does not plan" in planner.controls.status.value
    planner.controls.context.value = 0
    planner.budget_sliders["cpu"].value = 0.1
    assert planner.plan.workload is None


def test_a_planner_from_a_tree_cannot_plan_a_run():
    tree = bigviz.module_tree(torch.nn.Sequential(torch.nn.Linear(8, 8)))
    planner = Planner(tree, {"cpu": 10**6})
    planner.controls.context.value = 100
    assert "cannot plan a run" in planner.controls.status.value
    with pytest.raises(ValueError, match="cannot plan a run"):
        planner.set_workload(context_length=100)


def test_report_lists_kv_cache_and_activations_per_device(llama):
    plan = bigviz.plan(llama, {0: 8_000_000, "cpu": 10**8}, context_length=128, reserve=0)
    html = report_fragment(plan)
    assert "<th>KV cache</th><th>activations</th>" in html
    assert "workload: batch 1 x 128 tokens" in plan.summary()


def test_a_planned_run_keeps_each_device_kinds_headroom_unless_told_otherwise(llama):
    """Once a run is planned, the Planner keeps the default headroom (on the CPU: a share of the
    run for the allocator's slack), says so in its notes and bars; a reserve box set by hand
    (or ``reserve=0``) replaces it for that device."""
    planner = Planner(llama, {"cpu": 10**8})
    assert planner.plan.usage_of("cpu").reserve == 0  # weights only: as accelerate counts them
    planner.controls.context.value = 512
    u = planner.plan.usage_of("cpu")
    assert u.reserve == -(-(u.kv_cache + u.activations) // 4)  # 25% of the run, rounded up
    assert any("CPU keeps 25% of its run free by default" in n for n in planner.plan.notes)
    assert "reserved" in planner.controls.usage.value
    assert planner.reserve_inputs["cpu"].value == u.reserve / 2**30  # the box shows what is kept
    planner.reserve_inputs["cpu"].value = 0.0
    assert planner.plan.usage_of("cpu").reserve == 0 and not any("by default" in n for n in planner.plan.notes)
