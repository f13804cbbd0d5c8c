"""The live Planner in a real JupyterLab, in headless Chromium: it renders, fits its column,
a dragged slider recolours the treemap (a re-plan in the kernel), a clicked tile picks its
module, the figure follows a resize, and a page reloaded while the kernel runs draws the
current plan, not the first one.

One JupyterLab server and one kernel for the module (starting them is most of the time);
everything is stopped at the end, kernel included, even when a check fails.

``BIGVIZ_SCREENCAST=docs/planner-live.png pytest tests/browser`` also writes the animated
PNG the README shows (the planner before and after a drag, and after a click on a tile).
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bigviz.ui.palette import device_color
from tests.browser.conftest import browser_page, jupyter_server

pytestmark = [pytest.mark.browser, pytest.mark.slow]

NOTEBOOK = "planner.ipynb"
SETUP = """\
import bigviz
from bigviz.models import GPT, GPTConfig

with bigviz.init_empty_weights():
    model = GPT(GPTConfig.preset("gpt2"))  # 475 MiB in float32: little of it fits GPU 0 at first
planner = bigviz.Planner(model, {0: "0.1GiB", "cpu": "2GiB"}, strategy="sequential")
planner"""
PICKED = "transformer.wte"  # a leaf tile, large enough to click

# In the page: the planner's parts, found from the figure's column.
JS_PARTS = """
const column = document.querySelector('.bigviz-figure-column');
const gd = column && column.querySelector('.js-plotly-plot');
const svg = gd && gd.querySelector('svg.main-svg');
const fills = gd ? [...gd.querySelectorAll('.treemaplayer path.surface')].map(p => p.style.fill) : [];
"""


def _rgb(hex_color: str) -> str:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


GPU0 = _rgb(device_color(0))


def _notebook(root: Path) -> None:
    cell = {"cell_type": "code", "id": "planner", "metadata": {}, "execution_count": None, "outputs": [],
            "source": SETUP}
    nb = {"nbformat": 4, "nbformat_minor": 5, "cells": [cell],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}}
    (root / NOTEBOOK).write_text(json.dumps(nb))


KERNEL_READY = """() => {
    const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const context = panel && panel.sessionContext;
    const kernel = context && context.session && context.session.kernel;
    return !!kernel && kernel.connectionStatus === 'connected' && context.kernelDisplayStatus === 'idle'
        && !!document.querySelector('.jp-Notebook .jp-Cell');
}"""


def _open_and_run(page: Any, url: str) -> None:
    """Open the notebook, wait for its kernel to be connected and idle, run every cell."""
    page.goto(url)
    page.wait_for_function(KERNEL_READY, timeout=180_000)
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def _fills(page: Any) -> list[str]:
    return page.evaluate(f"() => {{ {JS_PARTS} return fills; }}")


def _wait_for_treemap(page: Any) -> list[str]:
    """Wait until the treemap is drawn and fits its column; its tile colours."""
    page.wait_for_function(f"() => {{ {JS_PARTS} return fills.length >= 10; }}", timeout=180_000)
    _wait_for_fit(page)
    return _fills(page)


def _wait_for_fit(page: Any) -> None:
    """The plot is as wide as its column (within 2 px) and nothing of it is cut off."""
    page.wait_for_function(f"""() => {{ {JS_PARTS}
        if (!svg) return false;
        const c = column.getBoundingClientRect(), s = svg.getBoundingClientRect();
        return s.width > 100 && Math.abs(s.width - c.width) <= 2 && s.right <= c.right + 1; }}""")


def _geometry(page: Any) -> dict[str, float]:
    return page.evaluate(f"""() => {{ {JS_PARTS}
        const out = column.closest('.jp-OutputArea-output');
        const right = column.parentElement, body = right.parentElement;  // settings | treemap
        const left = body.children[0].getBoundingClientRect();
        return {{column: column.getBoundingClientRect().width, plot: svg.getBoundingClientRect().width,
                 plot_right: svg.getBoundingClientRect().right, out_right: out.getBoundingClientRect().right,
                 overflow: out.scrollWidth - out.clientWidth, body_top: body.getBoundingClientRect().top,
                 wrapped: right.getBoundingClientRect().top >= left.bottom}}; }}""")


def _resize(page: Any, size: dict[str, int], before: dict[str, float]) -> dict[str, float]:
    """Resize the page, wait for the figure's column to change width and the plot to fit it."""
    page.set_viewport_size(size)
    page.wait_for_function(f"""() => {{ {JS_PARTS}
        return Math.abs(column.getBoundingClientRect().width - {before['column']}) > 20; }}""")
    _wait_for_fit(page)
    return _geometry(page)


def _drag_gpu_slider(page: Any, fraction: float) -> None:
    """Drag GPU 0's budget slider (the first slider of the app) to ``fraction`` of its track."""
    slider = page.locator(".jp-OutputArea-output .widget-hslider").first
    handle = slider.locator(".noUi-handle").first
    track = slider.locator(".noUi-target").first
    h, t = handle.bounding_box(), track.bounding_box()
    assert h and t, "the GPU 0 slider is not on the page"
    page.mouse.move(h["x"] + h["width"] / 2, h["y"] + h["height"] / 2)
    page.mouse.down()
    target = t["x"] + fraction * t["width"]
    page.mouse.move(target, h["y"] + h["height"] / 2, steps=12)
    page.mouse.up()


def _click_tile(page: Any, module: str) -> None:
    box = page.evaluate(f"""() => {{ {JS_PARTS}
        const tile = [...gd.querySelectorAll('g.slice')].find(g => g.__data__ && g.__data__.data
                                                               && g.__data__.data.id === '/{module}');
        if (!tile) return null;
        const r = tile.querySelector('path.surface').getBoundingClientRect();
        return {{x: r.x + r.width / 2, y: r.y + r.height / 2}}; }}""")
    assert box, f"no tile of {module} in the treemap"
    page.mouse.move(box["x"], box["y"])
    page.mouse.click(box["x"], box["y"])


def _module_box(page: Any) -> Any:
    return page.locator("input[placeholder='type to search a module']").first


class Screencast:
    """Frames of the planner, written as an animated PNG when ``BIGVIZ_SCREENCAST`` names a file."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.target = os.environ.get("BIGVIZ_SCREENCAST")
        self.frames: list[bytes] = []

    def shoot(self) -> None:
        if self.target:
            self.frames.append(self.page.locator(".jp-OutputArea-output").first.screenshot())

    def save(self) -> None:
        if not self.target or not self.frames:
            return
        import io

        from PIL import Image

        images = [Image.open(io.BytesIO(f)).convert("RGB") for f in self.frames]
        width = min(960, images[0].width)
        images = [im.resize((width, round(im.height * width / im.width)), Image.LANCZOS) for im in images]
        images[0].save(self.target, save_all=True, append_images=images[1:], duration=1600, loop=0,
                       optimize=True)


def test_live_planner_in_jupyterlab(tmp_path):
    _notebook(tmp_path)
    with jupyter_server(tmp_path) as server, browser_page(width=1280, height=800) as page:
        server.start_kernel(NOTEBOOK)  # starts while the page loads
        _open_and_run(page, server.page_url(NOTEBOOK))
        first = _wait_for_treemap(page)
        cast = Screencast(page)
        cast.shoot()

        # 1280x800: the treemap fits the column left by the settings; nothing is cut off
        geo = _geometry(page)
        assert geo["plot_right"] <= geo["out_right"] + 1 and geo["overflow"] <= 1, geo
        assert page.evaluate("() => [...document.querySelectorAll('.bigviz-table td.num')].every("
                             "td => getComputedStyle(td).whiteSpace === 'nowrap')")

        # a drag re-plans in the kernel: more of the model lands on GPU 0, tiles turn its colour
        _drag_gpu_slider(page, 0.7)
        page.wait_for_function(f"""() => {{ {JS_PARTS}
            return fills.filter(f => f === '{GPU0}').length > {first.count(GPU0)}; }}""")
        dragged = _fills(page)
        assert Counter(dragged) != Counter(first)
        page.wait_for_function("() => document.body.innerText.includes('re-planned in')")
        assert _geometry(page)["body_top"] == geo["body_top"], "the status line moved the app"
        cast.shoot()

        # a click on a tile puts its module in the search box
        _click_tile(page, PICKED)
        page.wait_for_function(f"() => document.querySelector(\"input[placeholder='type to search a module']\")"
                               f".value === '{PICKED}'")
        cast.shoot()

        # the figure follows the page: wider beside the settings, then, too narrow for both,
        # under them at the output's full width
        assert not geo["wrapped"]
        wide = _resize(page, {"width": 1700, "height": 900}, geo)
        assert wide["plot"] > geo["plot"] + 300 and not wide["wrapped"], (wide, geo)
        narrow = _resize(page, {"width": 1000, "height": 800}, wide)
        assert narrow["wrapped"] and narrow["overflow"] <= 1 and narrow["plot_right"] <= narrow["out_right"] + 1

        # a reload with the kernel running draws the current plan, not the first one (saved
        # first, as autosave does: the page finds the widget's output in the file)
        page.set_viewport_size({"width": 1280, "height": 800})
        page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
        page.reload()
        page.wait_for_function("() => window.jupyterapp && document.querySelector('.jp-Notebook .jp-Cell')")
        assert Counter(_wait_for_treemap(page)) == Counter(dragged)
        assert _module_box(page).input_value() == PICKED
        cast.save()
