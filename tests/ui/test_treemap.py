"""The treemap figure builder: shape (ids, parents, sums), colours by device, overrides,
hover text, depth, dtype. Pure: no widgets, no browser."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from torch import nn

import bigviz
from bigviz.core.dtypes import FLOATING_DTYPES
from bigviz.core.tree import SizeTree, TensorSpec
from bigviz.core.planner import make_plan
from bigviz.core.plan import PlanOptions
from bigviz.models import GPT, GPTConfig, Llama, LlamaConfig
from bigviz.ui.palette import GPU_COLORS, OKABE_ITO, SPLIT_COLOR, device_color, legend_html
from bigviz.ui.treemap import BORDER_WIDTH, OVERRIDE_MARK, ROOT_ID, layout_of, style_of, treemap

GiB = 2**30


@pytest.fixture(scope="module")
def big_models() -> dict[str, nn.Module]:
    with bigviz.init_empty_weights():
        return {"gpt2-xl": GPT(GPTConfig.preset("gpt2-xl")), "llama-7b": Llama(LlamaConfig.preset("llama-7b"))}


def _check_shape(fig) -> None:
    trace = fig.data[0]
    ids, parents, values = list(trace.ids), list(trace.parents), list(trace.values)
    assert len(ids) == len(set(ids)), "treemap ids must be unique"
    assert ids[0] == ROOT_ID and parents[0] == "" and parents.count("") == 1
    assert trace.branchvalues == "total"
    index = {i: k for k, i in enumerate(ids)}
    children_sum: dict[str, int] = defaultdict(int)
    for node, par in zip(ids[1:], parents[1:]):
        assert par in index, f"{node}'s parent {par} is not a node"
        children_sum[par] += values[index[node]]
    for par, total in children_sum.items():
        assert total <= values[index[par]], f"children of {par} sum above it: blank treemap"
    assert all(isinstance(v, int) and v >= 0 for v in values)


@pytest.mark.parametrize("name", ["gpt2-xl", "llama-7b"])
def test_treemap_sums_and_ids_on_real_architectures(big_models, name):
    model = big_models[name]
    total = bigviz.module_tree(model).total("")
    plan = bigviz.plan(model, {0: total // 3, "cpu": total // 3})  # GPU, CPU and disk
    fig = treemap(plan)
    _check_shape(fig)
    assert fig.data[0].values[0] == total
    devices = {u.device for u in plan.usage if u.used}
    assert devices == {0, "cpu", "disk"}
    assert {device_color(d) for d in devices} <= set(fig.data[0].marker.colors)


def test_colours_follow_each_placement():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])  # 16,640 bytes each
    plan = bigviz.plan(model, {0: 70_000, "cpu": 60_000, "disk": 10**6}, strategy="sequential")
    fig = treemap(plan)
    by_id = dict(zip(fig.data[0].ids, fig.data[0].marker.colors))
    assert len({plan.device_of(str(i)) for i in range(6)}) == 3
    for i in range(6):
        assert by_id[f"/{i}"] == device_color(plan.device_of(str(i)))
    assert by_id[ROOT_ID] == SPLIT_COLOR  # parts on three devices
    hover = {c[0]: c for c in fig.data[0].customdata}
    assert hover["<model>"][4].startswith("split: ")
    assert hover["0"][3] == "GPU 0" and "fits" in hover["0"][4]
    assert hover["5"][3] == "disk"


def test_root_id_never_collides_with_a_module_named_like_the_model():
    tensors = [
        TensorSpec("model.weight", 4, "float32"),
        TensorSpec("model.model.weight", 4, "float32"),
        TensorSpec("x.weight", 2, "float32"),
    ]
    tree = SizeTree.build(tensors, {"": "model", "model": "model", "model.model": "model", "x": "X"})
    fig = treemap(make_plan(tree, {"cpu": 10**6}))
    _check_shape(fig)
    assert list(fig.data[0].ids) == ["/", "/model", "/model.weight", "/model.model", "/x"]


def test_own_tensors_of_a_parent_get_tiles_and_zero_byte_modules_are_left_out():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Parameter(torch.zeros(10, 8))  # held by the root, beside children
            self.body = nn.Linear(8, 8)
            self.act = nn.ReLU()  # no bytes
            self.head = nn.Linear(8, 10, bias=False)

    fig = treemap(bigviz.plan(Net(), {"cpu": 10**6}))
    _check_shape(fig)
    ids = list(fig.data[0].ids)
    assert "/pos" in ids and "/act" not in ids
    values = dict(zip(ids, fig.data[0].values))
    assert values["/pos"] + values["/body"] + values["/head"] == values["/"]


def test_tied_head_has_no_tile_and_is_counted_once(tiny_gpt):
    plan = bigviz.plan(tiny_gpt, {"cpu": 10**9})
    fig = treemap(plan)
    assert "/lm_head" not in fig.data[0].ids
    assert fig.data[0].values[0] == bigviz.module_tree(tiny_gpt).total("")


def test_overrides_are_marked_with_label_and_border(tiny_llama):
    tree = bigviz.module_tree(tiny_llama)
    block = next(n for n in tree.nodes if n.endswith("layers.1"))
    plan = bigviz.plan(tiny_llama, {0: 10**9, "cpu": 10**9}, overrides={block: "cpu"})
    trace = treemap(plan).data[0]
    k = list(trace.ids).index("/" + block)
    assert trace.labels[k].startswith(OVERRIDE_MARK)
    assert trace.marker.line.color[k] == "#000000" and trace.marker.colors[k] == device_color("cpu")
    others = [lab for i, lab in enumerate(trace.labels) if i != k]
    assert not any(lab.startswith(OVERRIDE_MARK) for lab in others)
    assert set(c for i, c in enumerate(trace.marker.line.color) if i != k) == {"#FFFFFF"}
    # one width for all tiles: per-tile widths make plotly draw its path bar with NaNs
    assert trace.marker.line.width == BORDER_WIDTH
    assert "override" in trace.customdata[k][4]


def test_depth_sets_maxdepth_counting_the_root(tiny_gpt):
    plan = bigviz.plan(tiny_gpt, {"cpu": 10**9})
    assert treemap(plan).data[0].maxdepth == -1
    assert treemap(plan, depth=2).data[0].maxdepth == 3
    assert layout_of(plan.tree).max_depth >= 3


def test_float16_halves_floating_bytes(tiny_llama):
    """Every floating tensor a checkpoint holds halves; buffers the model computes itself keep
    the dtype the loader gives them (as built: rotary tables stay float32)."""
    fp32 = bigviz.plan(tiny_llama, {"cpu": 10**9})
    fp16 = bigviz.plan(tiny_llama, {"cpu": 10**9}, dtype=torch.float16)
    tree = fp32.tree
    halved = [t for t, s in tree.tensors.items() if s.dtype in FLOATING_DTYPES and s.persistent]
    floating = sum(tree.tensor_bytes(t) for t in halved)
    other = tree.total("") - floating
    assert floating and other < floating // 100
    assert treemap(fp16).data[0].values[0] == floating // 2 + other
    assert list(treemap(fp16).data[0].ids) == list(treemap(fp32).data[0].ids)


def test_plan_of_errors_say_what_to_pass():
    with pytest.raises(TypeError, match="DevicePlan or a Planner"):
        treemap({"": 0})
    plan = bigviz.plan(nn.Linear(2, 2), {"cpu": 10**6})
    bare = type(plan)(plan.placements, plan.usage, plan.strategy, plan.main_device)
    with pytest.raises(ValueError, match="carries no size tree"):
        treemap(bare)


def test_style_changes_with_the_plan_but_layout_does_not():
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])
    tree = bigviz.module_tree(model)
    small = make_plan(tree, {0: 10_000, "cpu": 10**6}, PlanOptions(strategy="sequential"))
    large = make_plan(tree, {0: 10**6, "cpu": 10**6}, PlanOptions(strategy="sequential"))
    layout = layout_of(tree)
    assert style_of(layout, small).colors != style_of(layout, large).colors
    assert set(style_of(layout, large).colors) == {device_color(0)}


def test_palette_is_okabe_ito_with_one_hue_per_device():
    okabe = set(OKABE_ITO.values())
    assert set(GPU_COLORS) <= okabe
    named = [device_color(d) for d in ("cpu", "disk")]
    six_gpus = [device_color(i) for i in range(6)]
    assert len(set(six_gpus + named + [SPLIT_COLOR])) == 9
    assert device_color(6) != device_color(0)
    assert device_color("mps") not in named
    assert "GPU 1" in legend_html([1, "cpu"]) and "split across devices" in legend_html([0])
