"""The run in a pipeline plan, on real models built on meta: each stage's KV cache and
activations by the same per-layer rules as ``bigviz.plan``, micro-batches, budgets that hold
the weights but not the run, ``max_context`` for a pipeline, a saved plan's cuts kept."""

from __future__ import annotations

import pytest
import torch

import bigviz
from bigviz.core.pipeline import PipelineError
from bigviz.models import GPT, GPTConfig
from tests.distributed.pipeline_models import hf_llama


@pytest.fixture(scope="module")
def llama():
    with torch.device("meta"):
        return hf_llama(6, positions=512).eval()


def test_stage_kv_and_activations_follow_the_planners_rules(llama):
    """One stage holding everything charges what ``bigviz.plan`` charges one device; with
    micro-batches the caches stay for the whole batch and the activations shrink to one."""
    whole = bigviz.plan_pipeline(llama, 1, batch_size=4, context_length=100, device_type="cpu")
    device = bigviz.plan(llama, {"cpu": "10GiB"}, batch_size=4, context_length=100)
    usage = next(u for u in device.usage if u.device == "cpu")
    assert whole.stage_kv == (usage.kv_cache,) and whole.stage_activations == (usage.activations,)
    assert usage.kv_cache == sum(bigviz.kv_cache_bytes(llama, 4, 100).values())
    micro = bigviz.plan_pipeline(llama, 1, batch_size=4, context_length=100, microbatches=4, device_type="cpu")
    one = bigviz.plan(llama, {"cpu": "10GiB"}, batch_size=1, context_length=100)
    assert micro.stage_kv == whole.stage_kv
    assert micro.stage_activations == (next(u for u in one.usage if u.device == "cpu").activations,)
    assert micro.run.microbatches == 4 and "4 micro-batches of up to 1" in micro.summary()


def test_each_stage_keeps_its_own_layers_caches(llama):
    plan = bigviz.plan_pipeline(llama, 3, batch_size=2, context_length=64, kv_dtype=torch.float16)
    per_layer = bigviz.kv_cache_bytes(llama, 2, 64, dtype=torch.float16)
    for s in range(3):
        assert plan.stage_kv[s] == sum(per_layer[b] for b in plan.blocks(s))
    assert plan.run.kv_dtype == "float16" and sum(plan.stage_kv) == sum(per_layer.values())
    assert all(a > 0 for a in plan.stage_activations)


def test_budgets_that_hold_the_weights_but_not_the_run_are_refused_per_stage(llama):
    weights = bigviz.plan_pipeline(llama, 2)
    budget = int(max(weights.stage_bytes) * 1.05)
    bigviz.plan_pipeline(llama, [budget, budget])  # the weights fit
    with pytest.raises(PipelineError) as info:
        bigviz.plan_pipeline(llama, [budget, budget], batch_size=8, context_length=512)
    lines = [p for p in info.value.problems if p.startswith("stage ")]
    assert lines and all("KV cache +" in p and "activations =" in p and "over" in p for p in lines)


def test_max_context_for_a_pipeline_is_the_longest_run_that_plans(llama):
    budgets = ["800KiB", "800KiB"]
    best = bigviz.max_context(llama, stages=budgets, batch_size=2, microbatches=2)
    assert 0 < best < 512
    bigviz.plan_pipeline(llama, budgets, batch_size=2, context_length=best, microbatches=2)
    with pytest.raises(PipelineError):
        bigviz.plan_pipeline(llama, budgets, batch_size=2, context_length=best + 1, microbatches=2)
    # more micro-batches: smaller activations, a longer context
    assert bigviz.max_context(llama, stages=budgets, batch_size=2, microbatches=1) <= best
    with pytest.raises(bigviz.PlanError, match="one budget per stage"):
        bigviz.max_context(llama, stages=bigviz.plan_pipeline(llama, 2))


def test_a_saved_plans_cuts_are_kept_for_a_run(llama, tmp_path):
    plan = bigviz.plan_pipeline(llama, ["800KiB", "800KiB"])
    plan.save_json(tmp_path / "p.json")
    saved = bigviz.PipelinePlan.load_json(tmp_path / "p.json")
    again = bigviz.plan_pipeline(llama, saved, batch_size=1, context_length=32)
    assert again.split_points == plan.split_points and again.budgets == plan.budgets and again.stage_kv
    with pytest.raises(PipelineError, match="do not hold the run within their budgets") as info:
        bigviz.plan_pipeline(llama, saved, batch_size=16, context_length=512)
    assert "weights +" in str(info.value)
    longest = bigviz.max_context(llama, stages=saved)
    assert bigviz.max_context(llama, saved) == longest  # a plan in place of max_memory
    assert bigviz.plan_pipeline(llama, saved, context_length=longest).split_points == plan.split_points


def test_a_checkpoint_plans_its_run_from_its_config(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("gpt-tiny", n_layer=4))
    folder = bigviz.save_sharded(model, tmp_path / "gpt", config=model.config, progress=False)
    from_files = bigviz.plan_pipeline(folder, 2, batch_size=2, context_length=16)
    from_model = bigviz.plan_pipeline(model, 2, batch_size=2, context_length=16)
    assert from_files.stage_kv == from_model.stage_kv and from_files.stage_activations == from_model.stage_activations


def test_no_split_classes_are_checked_as_bigviz_plan_checks_them(llama):
    with pytest.raises(bigviz.PlanError, match="did you mean 'LlamaDecoderLayer'"):
        bigviz.plan_pipeline(llama, 3, no_split_module_classes=["LlamaDecoderLayr"])
    one = bigviz.plan_pipeline(llama, 3, no_split_module_classes="LlamaDecoderLayer")  # one class, not letters
    assert one.no_split == ("LlamaDecoderLayer",)
    assert all(p.count(".") == 2 and p.startswith("model.layers.") for p in one.split_points)


def test_a_context_past_the_position_table_is_refused_as_by_bigviz_plan():
    with torch.device("meta"):
        model = GPT(GPTConfig.preset("gpt-tiny", n_layer=4))  # block_size 64: a table of positions
    with pytest.raises(bigviz.PlanError, match="past the model's block_size=64"):
        bigviz.plan(model, {"cpu": "1GiB"}, context_length=65)
    with pytest.raises(bigviz.PlanError, match="past the model's block_size=64"):
        bigviz.plan_pipeline(model, 2, context_length=65)
    assert bigviz.plan_pipeline(model, 2, context_length=64).run.context_length == 64


def test_max_context_refuses_more_microbatches_than_sequences(llama):
    with pytest.raises(PipelineError, match="microbatches=2 with batch_size=1"):
        bigviz.max_context(llama, stages=["1GiB", "1GiB"], batch_size=1, microbatches=2)


def test_a_checkpoint_without_config_is_cut_in_execution_order(tmp_path):
    import shutil

    torch.manual_seed(0)
    model = hf_llama(4)
    model.save_pretrained(tmp_path / "full")
    (tmp_path / "raw").mkdir()
    shutil.copy(tmp_path / "full" / "model.safetensors", tmp_path / "raw")
    raw, full = bigviz.plan_pipeline(tmp_path / "raw", 2), bigviz.plan_pipeline(tmp_path / "full", 2)
    assert raw.stages[0][0] == "model.embed_tokens" and raw.stages[-1][-2:] == ("model.norm", "lm_head")
    assert raw.split_points == full.split_points
    # filling in order, GPU 0 takes the embeddings and the first layers, not the head
    sizes = bigviz.plan(tmp_path / "raw", {"cpu": "1GiB"}).tree
    gpu0 = sizes.total("model.embed_tokens") + 2 * sizes.total("model.layers.0")
    in_order = bigviz.plan(tmp_path / "raw", {0: gpu0, 1: "1GiB"}, strategy="sequential", reserve=0)
    assert in_order.device_map["model.embed_tokens"] == 0 and in_order.device_map["lm_head"] == 1
