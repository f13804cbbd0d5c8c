"""Pipeline stages in the treemap and the Planner's stage mode, headless: tiles coloured by
the stage that holds them, hover says why, the planner re-plans stages on every change."""

from __future__ import annotations

import pytest
import torch

import bigviz
from bigviz.models import GPT, GPTConfig
from bigviz.ui.palette import SPLIT_COLOR
from bigviz.ui.stages import stage_color, stage_legend_html
from bigviz.ui.treemap import treemap


@pytest.fixture(scope="module")
def gpt() -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig.preset("gpt2", n_layer=8))


def _tiles(fig) -> dict[str, tuple[str, tuple]]:
    trace = fig.data[0]
    return {i: (c, tuple(d)) for i, c, d in zip(trace.ids, trace.marker.colors, trace.customdata)}


def test_treemap_colours_every_module_by_its_stage(gpt):
    plan = bigviz.plan_pipeline(gpt, 3)
    fig = treemap(plan)
    tiles = _tiles(fig)
    for unit in plan.units:
        if f"/{unit.name}" in tiles:
            colour, data = tiles[f"/{unit.name}"]
            assert colour == stage_color(unit.stage) and data[3] == f"stage {unit.stage}"
    assert tiles["/"][0] == SPLIT_COLOR and tiles["/transformer.h"][1][4] == "spans stages 0 .. 2"
    cut = plan.cuts[0]
    assert tiles[f"/{cut.before}"][1][4] == cut.reason  # the cut's reason in the hover
    assert tiles["/transformer.h.0.attn"][1][4] == "part of transformer.h.0, in stage 0"
    assert "tied to lm_head.weight: stage 2 loads it too" in tiles["/transformer.wte"][1][4]
    assert fig.layout.title.text == "GPT: 366.5 MiB, 3 pipeline stages balanced by bytes"
    assert sum(1 for c in fig.data[0].marker.colors if c == stage_color(1)) >= len(plan.blocks(1))


def test_a_plan_from_json_needs_its_tree_for_the_treemap(gpt, tmp_path):
    plan = bigviz.plan_pipeline(gpt, 2)
    plan.save_json(tmp_path / "p.json")
    with pytest.raises(ValueError, match="carries no size tree"):
        treemap(bigviz.PipelinePlan.load_json(tmp_path / "p.json"))
    again = bigviz.PipelinePlan.load_json(tmp_path / "p.json", tree=bigviz.module_tree(gpt))
    assert list(treemap(again).data[0].marker.colors) == list(treemap(plan).data[0].marker.colors)


def test_legend_lists_stage_bytes_and_budgets(gpt):
    plan = bigviz.plan_pipeline(gpt, ["400MiB", "400MiB"])
    text = stage_legend_html(plan)
    assert "stage 0: " in text and " of 400.0 MiB" in text and "several stages" in text


def test_planner_stage_mode(gpt):
    planner = bigviz.Planner(gpt, {0: "200MiB", "cpu": "2GiB"})
    assert planner.pipeline_plan is None
    planner.show_stages(4)
    plan = planner.pipeline_plan
    assert plan is not None and plan.n_stages == 4 and planner.stage_controls.mode.value == "stages"
    trace = planner.view.figure.data[0]
    k = list(trace.ids).index(f"/{plan.split_points[-1]}")
    assert trace.marker.colors[k] == stage_color(3) and "pipeline stages" in planner.view.figure.layout.title.text
    assert "stage 3: " in planner.controls.legend.value and plan.split_points[0] in planner.stage_controls.summary.value
    planner.stage_controls.count.value = 2  # a control re-plans the stages
    assert planner.pipeline_plan.n_stages == 2
    planner.controls.dtype.value = "float16"  # so does the dtype
    assert planner.pipeline_plan.dtype == "float16" and sum(planner.pipeline_plan.stage_bytes) < sum(plan.stage_bytes)
    planner.stage_controls.balance.value = "compute"
    assert planner.pipeline_plan.balance == "compute"
    planner.stage_controls.count.value = 8
    assert planner.pipeline_plan.n_stages == 8
    planner.budget_sliders[0].value = 0.5  # device re-plans keep the stage colours
    assert planner.view.colors[k] == stage_color(planner.pipeline_plan.stage_of(plan.split_points[-1]))
    planner.show_devices()
    assert planner.pipeline_plan is None
    assert planner.view.colors == tuple(treemap(planner.plan).data[0].marker.colors)  # by device again
    assert "GPU 0" in planner.controls.legend.value and "stage 0" not in planner.controls.legend.value


def test_the_legend_and_title_show_each_stages_run(gpt):
    plan = bigviz.plan_pipeline(gpt, 2, batch_size=4, context_length=512, microbatches=2)
    text = stage_legend_html(plan)
    for s in range(2):
        assert f"stage {s}: " in text
    assert text.count("KV cache") == 2 and text.count("activations") == 2
    assert "run: batch 4, 512 tokens" in treemap(plan).layout.title.text
    assert plan.stage_frame()["kv_cache"].tolist() == list(plan.stage_kv)
