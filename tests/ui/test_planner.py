"""The Planner widget app, headless: controls re-plan and repaint, overrides stick, exports
round trip, errors are shown, the notebook mime bundle has HTML and text, and a plan runs."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import bigviz
from bigviz.core.planner import PlanError
from bigviz.ui.controls import CUSTOM
from bigviz.ui.palette import device_color
from bigviz.ui.planner import Planner
from bigviz.ui.treemap import OVERRIDE_MARK

GiB = 2**30
LAYER = 16_640  # bytes of nn.Linear(64, 64) in float32


def _model(n: int = 6) -> nn.Module:
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(n)])


def _planner(**kwargs) -> Planner:
    return Planner(_model(), {0: 3 * LAYER, "cpu": 10**6}, strategy="sequential", **kwargs)


def _colour_of(planner: Planner, name: str) -> str:
    trace = planner.view.figure.data[0]
    return trace.marker.colors[list(trace.ids).index("/" + name)]


def test_slider_move_replans_and_repaints_the_live_figure():
    planner = _planner()
    assert planner.view.live
    before_map, before_colors = planner.device_map, planner.view.colors
    slider = planner.budget_sliders[0]
    assert slider.continuous_update is False and slider.description == "GiB"
    slider.value = 10 * LAYER / GiB
    assert planner.device_map != before_map and planner.plan.device_of("5") == 0
    assert planner.view.colors != before_colors
    assert _colour_of(planner, "5") == device_color(0)
    assert planner.state.budgets[0] == round(10 * LAYER / GiB * GiB)
    assert "re-planned in" in planner.controls.status.value


def test_reserve_box_keeps_room_free():
    planner = _planner()
    planner.budget_sliders[0].value = 6.5 * LAYER / GiB
    assert planner.plan.device_of("5") == 0
    planner.reserve_inputs[0].value = 2 * LAYER / GiB
    assert planner.plan.usage_of(0).reserve == round(2 * LAYER / GiB * GiB)
    assert planner.plan.device_of("5") != 0
    assert "reserved" in planner.controls.usage.value


def test_overrides_stick_through_replans_and_are_marked():
    planner = _planner()
    planner.controls.module.value = "5"
    planner.controls.target.value = 0
    planner.controls.assign.click()
    assert planner.overrides == {"5": 0}
    for value in (1 * LAYER, 20 * LAYER, 4 * LAYER):
        planner.budget_sliders[0].value = value / GiB
        assert planner.plan.device_of("5") == 0
    planner.controls.strategy.value = "balanced"
    planner.controls.dtype.value = "float16"
    assert planner.plan.device_of("5") == 0
    trace = planner.view.figure.data[0]
    k = list(trace.ids).index("/5")
    assert trace.labels[k] == OVERRIDE_MARK + "5" and trace.marker.line.color[k] == "#000000"
    assert OVERRIDE_MARK in planner.controls.table.value and "<code>5</code>" in planner.controls.overrides.value
    planner.unassign("5")
    assert planner.overrides == {} and not planner.view.figure.data[0].labels[k].startswith(OVERRIDE_MARK)


def test_dtype_dropdown_resizes_the_treemap():
    planner = _planner()
    values32 = list(planner.view.figure.data[0].values)
    planner.controls.dtype.value = "float16"
    assert [v * 2 for v in planner.view.figure.data[0].values] == values32
    assert planner.plan.tree.total("") * 2 == values32[0]
    planner.controls.dtype.value = "int8 (torchao)"  # the linear layers' weights, as torchao packs them
    from bigviz.core.quant import QuantConfig, quantized_tree
    from bigviz.modeling.quant import quant_targets

    model = _model()
    expected = quantized_tree(planner.state.base_tree, QuantConfig("int8"), quant_targets(model, QuantConfig("int8")))
    assert planner.view.figure.data[0].values[0] == expected.total("") < values32[0] / 2  # (the last layer stays float)


def test_a_reconnecting_page_gets_the_current_figure():
    """What a reloaded page asks the kernel for (the widget's full state) is the figure now,
    not the one first drawn; tests/browser checks the reload itself."""
    planner = _planner()
    before = planner.view.figure.get_state()["_widget_data"][0]["marker"]["colors"]
    planner.budget_sliders[0].value = 10 * LAYER / GiB
    planner.controls.dtype.value = "float16"
    state = planner.view.figure.get_state()
    trace = state["_widget_data"][0]
    assert list(trace["marker"]["colors"]) == list(planner.view.colors) != list(before)
    assert list(trace["values"]) == list(planner.view.figure.data[0].values)
    assert state["_widget_layout"]["title"]["text"] == planner.view.figure.layout.title.text


def test_a_click_on_a_tile_picks_its_module():
    planner = _planner()
    helper = planner.view.helper  # what the browser side sends on a click (tests/browser checks it live)
    helper._received(helper, {"event": "click", "id": "/4"}, [])
    assert planner.controls.module.value == "4"
    for ignored in ({"event": "click", "id": "/"}, {"event": "click", "id": "/no.such"}, {"event": "other"}):
        helper._received(helper, ignored, [])  # the model's own tile, a stale id, another message
        assert planner.controls.module.value == "4"
    planner.controls.target.value = 0
    planner.controls.assign.click()
    assert planner.overrides == {"4": 0}


def test_gpu_buttons_and_presets_change_the_devices():
    planner = _planner()
    planner.controls.add_gpu.click()
    assert list(planner.budget_sliders) == [0, 1, "cpu"]
    assert planner.state.budgets[1] == planner.state.budgets[0]
    assert 1 in [d for _, d in planner.controls.target.options]
    planner.assign("4", 1)
    planner.controls.remove_gpu.click()
    assert list(planner.budget_sliders) == [0, "cpu"] and planner.overrides == {}
    assert "4" in planner.controls.log.outputs[-1]["text"]
    planner.controls.preset.value = "2x A100 80 GB: 80 GiB each (RAM 340 GiB)"
    assert planner.max_memory == {0: 80 * GiB, 1: 80 * GiB, "cpu": 340 * GiB}
    assert planner.budget_sliders[1].value == 80 and planner.budget_sliders[1].max >= 80
    planner.apply_preset("Apple M-series 32")
    assert list(planner.budget_sliders) == ["mps", "cpu"] and planner.plan.main_device == "mps"
    planner.add_gpu("1GiB")
    assert planner.controls.preset.value == CUSTOM


def test_callback_errors_are_shown_in_the_log_not_lost():
    planner = _planner()
    planner.controls.module.value = "no.such.module"
    planner.controls.assign.click()  # must not raise out of the widget callback
    assert "names no module" in planner.controls.status.value
    assert any("names no module" in o.get("text", "") for o in planner.controls.log.outputs)
    with pytest.raises(ValueError, match="names no module"):
        planner.assign("no.such.module", 0)


def test_settings_that_cannot_plan_block_exports(tmp_path):
    planner = Planner(_model(), {0: LAYER, "cpu": LAYER, "disk": 10 * LAYER}, strategy="sequential")
    planner.set_budget("disk", 0)
    assert "Does not plan" in planner.controls.status.value
    with pytest.raises(PlanError):
        planner.plan  # noqa: B018
    with pytest.raises(PlanError):
        planner.save_json(tmp_path / "map.json")
    assert not list(tmp_path.iterdir())  # nothing half-written
    planner.budget_sliders["disk"].value = 1.0
    assert planner.plan.device_map


def test_save_json_round_trips_and_the_button_shows_it(tmp_path):
    planner = _planner()
    path = tmp_path / "map.json"
    assert planner.save_json(path) == str(path)
    assert bigviz.load_device_map(path) == planner.device_map
    raw = json.loads(path.read_text())  # what transformers' from_pretrained gets
    assert set(raw.values()) <= {0, "cpu", "disk"} and set(raw) == set(planner.device_map)
    planner.controls.json_path.value = str(tmp_path / "button.json")
    planner.controls.save_json.click()
    assert bigviz.load_device_map(tmp_path / "button.json") == planner.device_map
    assert "button.json" in planner.controls.json_view.value and "&quot;" in planner.controls.json_view.value


def test_save_html_writes_an_offline_report(tmp_path):
    planner = _planner()
    planner.assign("1", "cpu")
    text = open(planner.save_html(tmp_path / "r.html")).read()
    assert 'id="bigviz-treemap"' in text and "<table class='bigviz-table'" in text
    assert 'src="https://cdn.plot.ly' not in text and len(text) > 1_000_000  # plotly.js inlined
    assert "<h2>Budgets</h2>" in text and OVERRIDE_MARK in text
    planner.controls.html_path.value = str(tmp_path / "b.html")
    planner.controls.save_html.click()
    assert (tmp_path / "b.html").stat().st_size > 1_000_000


def test_mime_bundle_has_widget_html_and_text():
    planner = _planner()
    bundle = planner._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "bigviz-treemap" in bundle["text/html"] and "<table" in bundle["text/html"]
    assert bundle["text/plain"] == planner.plan.summary() and "GPU 0" in bundle["text/plain"]


def test_cost_follows_plan_and_bandwidth_dropdowns():
    planner = _planner()
    cost = planner.cost()
    assert cost.copy_bytes == planner.plan.offloaded_bytes()["cpu"] > 0 and cost.read_bytes == 0
    assert cost.seconds == pytest.approx(cost.copy_bytes / 25e9)
    planner.controls.link.value = "PCIe 5 x16 (~50 GB/s pinned)"
    assert planner.cost().seconds == pytest.approx(cost.copy_bytes / 50e9)
    assert "Cost per forward pass" in planner.controls.cost.value
    planner.budget_sliders[0].value = 10 * LAYER / GiB
    assert not planner.cost().streamed


def test_depth_control_and_treemap_of_a_planner(tiny_gpt):
    planner = Planner(tiny_gpt, {"cpu": 10**9}, depth=2)
    assert planner.view.figure.data[0].maxdepth == 3
    planner.controls.depth.value = 4
    assert planner.view.figure.data[0].maxdepth == 5
    assert bigviz.treemap(planner).data[0].maxdepth == 5
    assert planner.controls.no_split.value == "Block"  # prefilled from the model
    planner.controls.no_split.value = ""
    assert planner.state.no_split == ()


def test_static_fallback_when_figurewidget_is_unavailable(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "anywidget", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "bigviz.ui.livefigure", raising=False)
    planner = _planner()
    assert not planner.view.live and "anywidget" in planner.view.fallback_reason
    first = planner.view.widget.outputs[0]["data"]
    assert {"application/vnd.plotly.v1+json", "image/svg+xml", "text/html"} <= set(first)
    assert planner.view.box.children == (planner.view.widget,)
    planner.budget_sliders[0].value = 10 * LAYER / GiB
    assert planner.view.widget.outputs[0]["data"] != first
    assert set(planner.view.colors) == {device_color(0)}


def test_live_false_asks_for_the_static_figure():
    planner = _planner(live=False)  # for frontends where FigureWidget stays blank (Colab)
    assert not planner.view.live and "live=False" in planner.view.fallback_reason
    figure = planner.view.widget.outputs[0]["data"]["application/vnd.plotly.v1+json"]
    assert figure["data"][0]["type"] == "treemap" and figure["data"][0]["ids"][0] == "/"


def test_load_and_dispatch_runs_the_plan_and_measures(tmp_path, tiny_gpt):
    from bigviz.checkpoint.save import save_sharded

    save_sharded(tiny_gpt, tmp_path / "ckpt", max_shard_size="50KB", progress=False)
    with bigviz.init_empty_weights():
        model = type(tiny_gpt)(tiny_gpt.config)
    total = bigviz.module_tree(model).total("")
    planner = Planner(model, {"cpu": total * 3 // 4})
    assert planner.plan.offloaded_bytes()["disk"] > 0
    loaded = planner.load_and_dispatch(tmp_path / "ckpt")
    x = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        assert torch.allclose(loaded(x)[0], tiny_gpt(x)[0], atol=1e-5)
    rows = {r["device"]: r for r in planner.last_run.rows()}
    assert rows["cpu"]["planned"] == planner.plan.usage_of("cpu").used
    assert set(rows) == {"cpu", "disk"}
    assert planner.controls.progress.value == 3 and "measured" in planner.controls.run_result.value


def test_run_button_reports_a_bad_checkpoint(tmp_path):
    planner = _planner()
    planner.controls.checkpoint.value = str(tmp_path / "missing")
    planner.controls.run.click()
    assert "does not exist" in planner.controls.status.value
    tree_planner = Planner(bigviz.module_tree(_model()), {"cpu": 10**6})
    with pytest.raises(ValueError, match="pass the model"):
        tree_planner.load_and_dispatch(tmp_path)


def test_a_real_kernel_displays_widget_svg_html_and_text():
    """IPython's display machinery (not only our method) gives every mime type: the planner's
    widget, SVG, HTML and text; a treemap figure's plotly JSON and SVG."""
    pytest.importorskip("ipykernel")
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", startup_timeout=600)  # a busy machine starts it slowly
    try:
        code = (
            "import torch.nn as nn, bigviz\nfrom bigviz.ui.planner import Planner\n"
            "p = Planner(nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)]), {0: 40_000, 'cpu': 10**6})\n"
            "display(bigviz.treemap(p))\np"
        )
        outputs: list[dict] = []
        reply = kc.execute_interactive(code, output_hook=outputs.append, timeout=600)
        assert reply["content"]["status"] == "ok", reply["content"]
        shown = [m["content"]["data"] for m in outputs if m["msg_type"] == "display_data"]
        results = [m["content"]["data"] for m in outputs if m["msg_type"] == "execute_result"]
        assert len(results) == 1 and len(shown) == 1
        assert {"application/vnd.jupyter.widget-view+json", "image/svg+xml", "text/html", "text/plain"} <= set(
            results[0]
        )
        assert "DevicePlan" in results[0]["text/plain"] and "<script" not in results[0]["text/html"]
        assert {"application/vnd.plotly.v1+json", "image/svg+xml"} <= set(shown[0])
        assert shown[0]["image/svg+xml"] == results[0]["image/svg+xml"]  # same plan, same depth
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_and_dispatch_on_a_gpu_measures_its_memory(tmp_path, tiny_gpt):
    from bigviz.checkpoint.save import save_sharded

    save_sharded(tiny_gpt, tmp_path / "ckpt", max_shard_size="50KB", progress=False)
    with bigviz.init_empty_weights():
        model = type(tiny_gpt)(tiny_gpt.config)
    total = bigviz.module_tree(model).total("")
    planner = Planner(model, {0: total // 2, "cpu": 10 * total})
    assert planner.plan.usage_of(0).used > 0 and planner.plan.usage_of("cpu").used > 0
    loaded = planner.load_and_dispatch(tmp_path / "ckpt")
    x = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        assert torch.allclose(loaded(x)[0].cpu(), tiny_gpt(x)[0], atol=1e-4)
    gpu = {r["device"]: r for r in planner.last_run.rows()}[0]
    assert gpu["planned"] == planner.plan.usage_of(0).used
    assert gpu["planned"] <= gpu["measured"] <= gpu["planned"] + total  # allocator rounding only


def test_dispatch_tab_lists_the_units_a_dispatch_fetches_and_follows_the_sliders():
    planner = _planner()
    assert "Dispatch" in planner.widget.children[-1].titles  # a tab beside the placements
    dispatch = planner.dispatch_plan
    offloaded = [name for name, device in planner.device_map.items() if device == "cpu"]
    assert [u.name for u in dispatch.units] == offloaded and all(u.storage == "cpu" for u in dispatch.units)
    assert all(u.nbytes == LAYER for u in dispatch.units)  # one Linear per unit, weight + bias
    # what the planner reserved on GPU 0 is what the dispatch holds: running + prefetched unit
    assert planner.plan.usage_of(0).offload_reserve == dispatch.held_bytes()[0] == 2 * LAYER
    assert planner.controls.dispatch.value == ""  # made only when someone opens the tab
    planner.widget.children[-1].selected_index = 1  # open the Dispatch tab
    text = planner.controls.dispatch.value
    assert text.count("<code>") == len(offloaded) and f"<code>{offloaded[-1]}</code>" in text
    assert "from CPU" in text and "fetch order" in text
    planner.budget_sliders[0].value = 10 * LAYER / GiB  # everything fits: nothing streams
    assert planner.dispatch_plan.units == () and "Nothing is offloaded" in planner.controls.dispatch.value
    planner.widget.children[-1].selected_index = 0  # closed: a move does not redraw it ...
    planner.budget_sliders[0].value = 3 * LAYER / GiB
    assert "Nothing is offloaded" in planner.controls.dispatch.value
    planner.widget.children[-1].selected_index = 1  # ... until it is opened again
    assert "from CPU" in planner.controls.dispatch.value
