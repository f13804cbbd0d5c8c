"""Held outputs (``RunBytes.held``: the input embeddings, alive all forward) in pipeline stages:
charged to the stage holding the module, on top of its largest step, as ``bigviz.plan``
charges a device."""

from __future__ import annotations

from bigviz.core.pipeline import PipelineRun
from bigviz.core.stages import cut_pipeline, make_pipeline_plan
from bigviz.core.tree import SizeTree, TensorSpec


def _tree() -> SizeTree:
    specs = [TensorSpec("wte.weight", 100, "float32")]
    specs += [TensorSpec(f"h.{i}.w", 100, "float32") for i in range(4)]
    return SizeTree.build(specs)


def test_held_outputs_add_to_the_stage_that_holds_the_module():
    tree, kv, act = _tree(), {f"h.{i}": 10 for i in range(4)}, {f"h.{i}": 50 for i in range(4)}
    knobs = dict(no_split=["h.*"], kv_cache=kv, activations=act, run=PipelineRun())
    plan = cut_pipeline(tree, ["h.2"], held={"wte": 30}, **knobs)
    assert plan.stage_activations == (50 + 30, 50)
    assert plan.stage_kv == (20, 20)  # the cache is not where held outputs go
    assert cut_pipeline(tree, ["h.2"], **knobs).stage_activations == (50, 50)


def test_held_outputs_weigh_in_the_balance_and_the_budgets():
    tree, kv, act = _tree(), {f"h.{i}": 0 for i in range(4)}, {f"h.{i}": 0 for i in range(4)}
    knobs = dict(no_split=["h.*"], kv_cache=kv, activations=act, run=PipelineRun())
    plain = make_pipeline_plan(tree, 2, **knobs)
    heavy = make_pipeline_plan(tree, 2, held={"wte": 800}, **knobs)
    assert heavy.stage_activations[0] == 800
    assert len(heavy.stages[0]) < len(plain.stages[0])  # the first stage takes fewer blocks
