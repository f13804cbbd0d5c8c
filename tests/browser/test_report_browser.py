"""Open the saved HTML report in headless Chromium, offline: the treemap must render (its SVG
tiles exist, in the device colours) and a screenshot is taken.

``BIGVIZ_SCREENSHOT=docs/planner.png pytest tests/browser`` also writes the screenshot the
README shows.
"""

from __future__ import annotations

import os
import re
import shutil
import struct

import pytest

import bigviz
from bigviz.models import GPT, GPTConfig
from bigviz.ui.palette import device_color

pytestmark = pytest.mark.browser

BUDGETS = {0: "3GiB", "cpu": "2GiB"}  # gpt2-xl (5.8 GiB in float32) then spills to disk
OVERRIDE = "transformer.h.47"  # the last block, pinned to the GPU by hand


def _rgb(hex_color: str) -> str:
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> str:
    with bigviz.init_empty_weights():
        model = GPT(GPTConfig.preset("gpt2-xl"))
    plan = bigviz.plan(model, BUDGETS, overrides={OVERRIDE: 0})
    assert {u.device for u in plan.usage if u.used} == {0, "cpu", "disk"}
    path = tmp_path_factory.mktemp("report") / "gpt2-xl.html"
    return bigviz.save_html(plan, path, depth=3, title="gpt2-xl: one 3 GiB GPU, 2 GiB of RAM, disk")


def test_treemap_renders_offline_in_the_device_colours(chromium, report):
    dom = chromium(f"file://{report}", "--virtual-time-budget=5000", "--dump-dom").stdout
    assert 'class="treemaplayer"' in dom, "plotly did not draw the treemap"
    tiles = re.findall(r'<path class="surface"[^>]*>', dom)
    assert len(tiles) >= 50  # 48 blocks, the embeddings, the parents
    fills = " ".join(tiles)
    for device in (0, "cpu", "disk"):
        assert _rgb(device_color(device)) in fills, f"no tile in {device}'s colour"
    assert "\u270e 47" in dom  # the override's label mark


def test_screenshot_of_the_report(chromium, report, tmp_path):
    shot = tmp_path / "planner.png"
    chromium(f"file://{report}", "--virtual-time-budget=5000", "--window-size=1400,900", f"--screenshot={shot}")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1400, 900) and len(data) > 50_000  # a drawn page, not a blank one
    target = os.environ.get("BIGVIZ_SCREENSHOT")
    if target:
        shutil.copyfile(shot, target)
