"""The treemap drawn as SVG, with no script: the squarified layout keeps areas proportional
and tiles inside their parents; the picture shows the plan's colours, labels, overrides and
depth; notebooks get it as ``image/svg+xml`` and inside ``text/html``, and nbconvert (what
nbviewer runs) shows it."""

from __future__ import annotations

import base64
import json
import re
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import bigviz
from bigviz.ui.palette import device_color
from bigviz.ui.svg import figure_svg, squarify, svg_img, treemap_svg
from bigviz.ui.treemap import OVERRIDE_MARK

NS = {"s": "http://www.w3.org/2000/svg"}
LAYER = 16_640  # bytes of nn.Linear(64, 64) in float32


def _tiles(svg: str) -> dict[str, dict[str, str]]:
    """Each drawn tile by the name its tooltip starts with: its rect's attributes and texts."""
    root = ET.fromstring(svg)
    out = {}
    for g in root.iter(f"{{{NS['s']}}}g"):
        title, rect = g.find("s:title", NS), g.find("s:rect", NS)
        if title is not None and rect is not None:
            name = title.text.split(":")[0]
            out[name] = {**rect.attrib, "texts": [t.text for t in g.findall("s:text", NS)]}
    return out


def _fills(svg: str) -> dict[str, str]:
    return {name: tile["fill"] for name, tile in _tiles(svg).items()}


def _box(tile: dict[str, str]) -> tuple[float, float, float, float]:
    return tuple(float(tile[k]) for k in ("x", "y", "width", "height"))


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.integers(1, 10**6), min_size=1, max_size=25),
    w=st.floats(10, 2000),
    h=st.floats(10, 2000),
    spare=st.integers(0, 10**6),
)
def test_squarify_areas_are_proportional_inside_and_disjoint(values, w, h, spare):
    total = sum(values) + spare  # a parent's own bytes leave room empty
    rects = squarify(values, (5.0, 7.0, w, h), total=total)
    assert len(rects) == len(values)
    for v, (x, y, rw, rh) in zip(values, rects):
        assert rw * rh == pytest.approx(w * h * v / total, rel=1e-6, abs=1e-6)
        assert x >= 5 - 1e-6 and y >= 7 - 1e-6 and x + rw <= 5 + w + 1e-6 and y + rh <= 7 + h + 1e-6
    for i, (x, y, rw, rh) in enumerate(rects):
        for x2, y2, rw2, rh2 in rects[i + 1 :]:
            overlap = max(0, min(x + rw, x2 + rw2) - max(x, x2)) * max(0, min(y + rh, y2 + rh2) - max(y, y2))
            assert overlap <= 1e-6 * w * h


def test_squarify_makes_squares_of_equal_values():
    rects = squarify([1] * 16, (0, 0, 400, 400))
    assert all(r[2] == pytest.approx(100) and r[3] == pytest.approx(100) for r in rects)
    assert rects[0][:2] == (0, 0)  # first value first, as plotly's sort=False


def _plan():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)) for _ in range(4)])
    # the cpu keeps room to stage two disk units on their way to GPU 0: "2.0" is put there by hand
    plan = bigviz.plan(
        model,
        {0: 6 * LAYER, "cpu": 3 * LAYER, "disk": 10**6},
        strategy="sequential",
        overrides={"3.1": 0, "2.0": "cpu"},
    )
    assert {u.device for u in plan.usage if u.used} == {0, "cpu", "disk"}
    return plan


def test_tiles_carry_the_plan_colours_borders_and_nest_in_their_parents():
    plan = _plan()
    fig = bigviz.treemap(plan)
    svg = figure_svg(fig)
    assert "<script" not in svg and "http" not in svg.replace("http://www.w3.org/2000/svg", "")
    tiles = _tiles(svg)
    trace = fig.data[0]
    assert set(tiles) == {c[0] for c in trace.customdata}  # every node with bytes is drawn
    for name, color in zip((c[0] for c in trace.customdata), trace.marker.colors):
        assert tiles[name]["fill"] == color
    for p in plan.placements:  # the picture agrees with the plan, not only with the figure
        if p.nbytes:
            assert tiles[p.name]["fill"] == device_color(p.device), p.name
    assert tiles["3.1"]["stroke"] == "#000000" and "stroke" not in tiles["3.0"]
    assert any(t.startswith(OVERRIDE_MARK) for t in tiles["3.1"]["texts"])
    for child, parent in [("0.0", "0"), ("3.1", "3"), ("2", "<model>")]:
        (x, y, w, h), (px, py, pw, ph) = _box(tiles[child]), _box(tiles[parent])
        assert px <= x and py <= y and x + w <= px + pw + 1e-6 and y + h <= py + ph + 1e-6
    legend = re.findall(r"rx='3' fill='([^']+)'/><text[^>]*>([^<]+)</text>", svg)
    assert [label for _, label in legend] == ["GPU 0", "CPU", "disk", "split"]


def test_depth_limits_the_drawn_levels_and_text_is_escaped():
    fig = bigviz.treemap(_plan(), depth=1)
    names = set(_tiles(figure_svg(fig)))
    assert names == {"<model>", "0", "1", "2", "3"}
    svg = treemap_svg(
        ["r", "r/a"], ["", "r"], [2, 2], ["<root>", "a&b"], ["#E8E8E8", "#F0E442"], title="x < y", width=300, height=200
    )
    ET.fromstring(svg)  # well-formed XML
    assert "&lt;root&gt;" in svg and "a&amp;b" in svg and "x &lt; y" in svg


def test_figure_svg_reads_the_figure_as_it_is_now():
    fig = bigviz.treemap(_plan())
    fig.data[0].marker.colors = ["#123456"] * len(fig.data[0].ids)
    assert set(t["fill"] for t in _tiles(fig.to_svg()).values()) == {"#123456"}


def test_planner_bundle_shows_the_treemap_without_script():
    planner = bigviz.Planner(nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]), {0: 3 * LAYER, "cpu": 10**6})
    bundle = planner._repr_mimebundle_()
    svg, page = bundle["image/svg+xml"], bundle["text/html"]
    assert ET.fromstring(svg).tag == "{http://www.w3.org/2000/svg}svg"
    assert "<script" not in page and "cdn.plot.ly" not in page and "<svg" not in page  # sanitizers drop inline svg
    (data,) = re.findall(r"src='data:image/svg\+xml;base64,([^']+)'", page)
    picture = base64.b64decode(data).decode()  # the same treemap, drawn for the report's column
    assert _fills(picture) == _fills(svg) and "width='640'" in picture
    assert {t["fill"] for t in _tiles(svg).values()} >= {device_color(0), device_color("cpu")}
    assert svg_img(svg).startswith("<img alt='treemap'")


def test_nbconvert_shows_the_saved_planner_and_figure(tmp_path):
    """What nbviewer does with a saved notebook: the planner's HTML with the picture, and the
    figure's SVG (plotly's JSON alone would show nothing)."""
    nbformat = pytest.importorskip("nbformat")
    nbconvert = pytest.importorskip("nbconvert")
    plan = _plan()
    planner = bigviz.Planner(nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]), {0: 3 * LAYER, "cpu": 10**6})
    fig = bigviz.treemap(plan)
    outputs = [
        planner._repr_mimebundle_(),
        {"application/vnd.plotly.v1+json": json.loads(fig.to_json()), "image/svg+xml": fig.to_svg()},
    ]
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("x", outputs=[nbformat.v4.new_output("display_data", data=d) for d in outputs])
        ]
    )
    html, _ = nbconvert.HTMLExporter().from_notebook_node(nb)
    pictures = re.findall(r"src=['\"]data:image/svg\+xml;base64,([^'\"]+)['\"]", html)
    pictures = [base64.b64decode(p).decode() for p in pictures]
    assert len(pictures) == 2 and _fills(pictures[0]) == _fills(outputs[0]["image/svg+xml"])
    assert pictures[1] == fig.to_svg()
    assert "cdn.plot.ly" not in html and re.search(r"<table class=['\"]bigviz-table['\"]>", html)
