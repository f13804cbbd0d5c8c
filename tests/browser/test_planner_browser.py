"""The live Planner in a real JupyterLab, in headless Chromium: it renders, fits its column,
a dragged slider recolours the treemap (a re-plan in the kernel) without moving the app, a
clicked tile picks its module (and the zoomed view keeps its path bar), the figure follows a
resize, and a page reloaded while the kernel runs draws the current plan, not the first one.
Then the same notebook in Notebook 7's page (the same server and kernel): drawn as it is now,
fitted, and a drag and a click work there too.

One JupyterLab server, one kernel and one browser for the test (starting them is most of
its time); all are stopped at the end, kernel included, even when a check fails. Waits are
on conditions in the page, with generous time limits for a loaded machine.

``BIGVIZ_SCREENCAST=docs/planner-live.png pytest tests/browser`` also writes the animated
PNG the README shows (the planner, then two drags of GPU 0's slider that recolour it).
"""

from __future__ import annotations

import io
import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from bigviz.ui.palette import device_color
from tests.browser.conftest import browser_page, jupyter_server, one_cell_notebook

pytestmark = [pytest.mark.browser, pytest.mark.slow]

NOTEBOOK = "planner.ipynb"
SETUP = """\
import bigviz
from bigviz.models import GPT, GPTConfig

with bigviz.init_empty_weights():
    model = GPT(GPTConfig.preset("gpt2"))  # 475 MiB in float32: a third of it fits GPU 0 at first
planner = bigviz.Planner(model, {0: "0.2GiB", "cpu": "2GiB"}, strategy="sequential")
planner"""
PICKED = "transformer.wte"  # a leaf tile, large enough to click
PICKED_NB7 = "transformer.h.11.mlp"
SEARCH_BOX = "input[placeholder='type to search a module']"


def _rgb(hex_color: str) -> str:
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


GPU0 = _rgb(device_color(0))

# In the page: the planner's parts, found from the figure's column.
JS_PARTS = """
const column = document.querySelector('.bigviz-figure-column');
const gd = column && column.querySelector('.js-plotly-plot');
const svg = gd && gd.querySelector('svg.main-svg');
const fills = gd ? [...gd.querySelectorAll('.treemaplayer path.surface')].map(p => p.style.fill) : [];
"""
KERNEL_READY = """() => {
    const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const context = panel && panel.sessionContext;
    const kernel = context && context.session && context.session.kernel;
    return !!kernel && kernel.connectionStatus === 'connected' && context.kernelDisplayStatus === 'idle'
        && !!document.querySelector('.jp-Notebook .jp-Cell');
}"""
FITS = f"""() => {{ {JS_PARTS}
    if (!svg) return false;
    const c = column.getBoundingClientRect(), s = svg.getBoundingClientRect();
    return s.width > 100 && Math.abs(s.width - c.width) <= 2 && s.right <= c.right + 1; }}"""


def _notebook(root: Path) -> None:
    one_cell_notebook(root / NOTEBOOK, SETUP)


class Page:
    """The browser page, with waits that fail with what the page shows (not a bare timeout)."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text[:200]) if m.type == "error" else None)

    def wait(self, condition: str, what: str, *, timeout: float = 90_000) -> None:
        try:
            self.page.wait_for_function(condition, timeout=timeout)
        except Exception as err:  # playwright's TimeoutError, with the page's state added
            state = self.page.evaluate(
                f"() => {{ {JS_PARTS} return {{tiles: fills.length, "
                f"plot: svg ? svg.getBoundingClientRect().width : null, "
                f"column: column ? column.getBoundingClientRect().width : null}}; }}"
            )
            raise AssertionError(
                f"{what}: not seen in {timeout / 1000:.0f} s ({state}); console errors: {self.errors[-5:]}"
            ) from err

    def reconnect(self, url: str | None = None) -> list[str]:
        """Save, then reload the page (or open ``url``: the notebook in another app) once the
        kernel is idle, and return the treemap's colours.

        A page connecting to a running kernel gets the widgets' state from it; JupyterLab's
        widget manager gives the kernel 4 s to answer and, when a starved kernel misses that
        (on a loaded 2-core machine), can leave an output as "widget model not found".
        Connecting while the kernel is idle avoids most of it; one more reload is the remedy a
        person would use, so it is allowed once, and only for that error.
        """
        self.wait(KERNEL_READY, "an idle kernel before reconnecting", timeout=180_000)
        self.page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
        for attempt in (1, 2):
            self.errors.clear()
            if url is not None and attempt == 1:
                self.page.goto(url)
            else:
                self.page.reload()
            try:
                return self.treemap()
            except AssertionError:
                if attempt == 2 or not any("widget model not found" in e for e in self.errors):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def fills(self) -> list[str]:
        return self.page.evaluate(f"() => {{ {JS_PARTS} return fills; }}")

    def open_and_run(self, url: str) -> None:
        """Open the notebook, wait for its kernel to be connected and idle, run every cell."""
        self.page.goto(url)
        self.wait(KERNEL_READY, "the notebook with a connected, idle kernel", timeout=180_000)
        self.page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")

    def treemap(self) -> list[str]:
        """Wait until the treemap is drawn and fits its column; its tile colours."""
        self.wait(f"() => {{ {JS_PARTS} return fills.length >= 10; }}", "the planner's treemap", timeout=180_000)
        self.wait(FITS, "the treemap as wide as its column")
        return self.fills()

    def geometry(self) -> dict[str, Any]:
        return self.page.evaluate(f"""() => {{ {JS_PARTS}
            const out = column.closest('.jp-OutputArea-output');
            const right = column.parentElement, body = right.parentElement;  // settings | treemap
            const left = body.children[0].getBoundingClientRect();
            return {{column: column.getBoundingClientRect().width, plot: svg.getBoundingClientRect().width,
                     plot_right: svg.getBoundingClientRect().right, out_right: out.getBoundingClientRect().right,
                     overflow: out.scrollWidth - out.clientWidth, body_top: body.getBoundingClientRect().top,
                     wrapped: right.getBoundingClientRect().top >= left.bottom}}; }}""")

    def resize(self, width: int, height: int, before: dict[str, Any]) -> dict[str, Any]:
        """Resize the page; wait for the figure's column to change width and the plot to fit it."""
        self.page.set_viewport_size({"width": width, "height": height})
        self.wait(
            f"() => {{ {JS_PARTS} return Math.abs(column.getBoundingClientRect().width - {before['column']}) > 20; }}",
            f"the figure's column resized at {width}x{height}",
        )
        self.wait(FITS, f"the treemap refitted to its column at {width}x{height}")
        return self.geometry()

    def drag_gpu_slider(self, fraction: float) -> None:
        """Drag GPU 0's budget slider (the app's first slider) to ``fraction`` of its track."""
        slider = self.page.locator(".jp-OutputArea-output .widget-hslider").first
        h = slider.locator(".noUi-handle").first.bounding_box()
        t = slider.locator(".noUi-target").first.bounding_box()
        assert h and t, "the GPU 0 slider is not on the page"
        y = h["y"] + h["height"] / 2
        self.page.mouse.move(h["x"] + h["width"] / 2, y)
        self.page.mouse.down()
        self.page.mouse.move(t["x"] + fraction * t["width"], y, steps=12)
        self.page.mouse.up()

    def click_tile(self, module: str) -> None:
        box = self.page.evaluate(f"""() => {{ {JS_PARTS}
            const tile = [...gd.querySelectorAll('g.slice')].find(
                g => g.__data__ && g.__data__.data && g.__data__.data.id === '/{module}');
            if (!tile) return null;
            const surface = tile.querySelector('path.surface');
            surface.scrollIntoView({{block: 'center'}});  // a click lands only inside the viewport
            const r = surface.getBoundingClientRect();
            return {{x: r.x + r.width / 2, y: r.y + r.height / 2}}; }}""")
        assert box, f"no tile of {module} in the treemap"
        self.page.mouse.move(box["x"], box["y"])
        self.page.mouse.click(box["x"], box["y"])


class Screencast:
    """Frames of the planner, saved as an animated PNG when ``BIGVIZ_SCREENCAST`` names a file."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.target = os.environ.get("BIGVIZ_SCREENCAST")
        self.frames: list[bytes] = []

    def shoot(self) -> None:
        """The part of the planner's output in view (its top: settings and treemap)."""
        if not self.target:
            return
        box = self.page.locator(".jp-OutputArea-output").first.bounding_box()
        shown = self.page.locator(".jp-Notebook").first.bounding_box()  # the notebook's scrolled area
        top = max(box["y"], shown["y"])
        bottom = min(box["y"] + box["height"], shown["y"] + shown["height"])
        clip = {"x": box["x"], "y": top, "width": box["width"], "height": bottom - top}
        self.frames.append(self.page.screenshot(clip=clip))

    def save(self) -> None:
        if not self.target or not self.frames:
            return
        from PIL import Image

        images = [Image.open(io.BytesIO(f)).convert("RGB") for f in self.frames]
        width = min(1000, images[0].width)
        images = [im.resize((width, round(im.height * width / im.width)), Image.LANCZOS) for im in images]
        images[0].save(self.target, save_all=True, append_images=images[1:], duration=1800, loop=0)


def test_live_planner_in_jupyterlab(tmp_path):
    _notebook(tmp_path)
    with browser_page(width=1280, height=800) as raw, jupyter_server(tmp_path) as server:
        page, cast = Page(raw), Screencast(raw)
        server.start_kernel(NOTEBOOK)  # it starts while the page loads
        page.open_and_run(server.page_url(NOTEBOOK))
        first = page.treemap()
        output = raw.locator(".jp-OutputArea-output").first
        assert "over budget" not in output.inner_text(), "the first state (the picture's first frame) is a healthy plan"
        assert 0 < first.count(GPU0) < len(first), "the first state splits the model: GPU 0 holds part of it"
        output.evaluate("el => el.scrollIntoView({block: 'start'})")
        cast.shoot()

        # 1280x800: the treemap fits the column the settings leave; nothing is cut off
        geo = page.geometry()
        assert not geo["wrapped"] and geo["overflow"] <= 1 and geo["plot_right"] <= geo["out_right"] + 1, geo
        assert raw.evaluate(
            "() => [...document.querySelectorAll('.bigviz-table td.num')].every("
            "td => getComputedStyle(td).whiteSpace === 'nowrap')"
        ), "a size cell may wrap"

        # each drag re-plans in the kernel: more of the model lands on GPU 0, its tiles turn blue
        dragged = first
        for fraction in (0.3, 0.45):
            page.drag_gpu_slider(fraction)
            page.wait(
                f"() => {{ {JS_PARTS} return fills.filter(f => f === '{GPU0}').length > {dragged.count(GPU0)}; }}",
                f"more tiles in GPU 0's colour after a drag to {fraction:.0%}",
            )
            dragged = page.fills()
            cast.shoot()
        page.wait("() => document.body.innerText.includes('re-planned in')", "the re-plan status line")
        assert page.geometry()["body_top"] == geo["body_top"], "the status line moved the app"

        # a click on a tile puts its module in the search box; the zoomed view keeps its path bar
        page.click_tile(PICKED)
        page.wait(
            f"() => document.querySelector(\"{SEARCH_BOX}\").value === '{PICKED}'",
            f"{PICKED} in the module box after a click on its tile",
        )
        page.wait(
            f"() => {{ {JS_PARTS} const bar = [...gd.querySelectorAll('.pathbar path')];"
            "return bar.length > 0 && bar.every(p => !(p.getAttribute('d') || 'NaN').includes('NaN')); }",
            "the path bar of the zoomed treemap (a way back)",
        )

        # the figure follows the page: wider beside the settings, then, when both no longer
        # fit side by side, under them at the output's full width
        wide = page.resize(1700, 900, geo)
        assert wide["plot"] > geo["plot"] + 300 and not wide["wrapped"], (wide, geo)
        narrow = page.resize(1000, 800, wide)
        assert narrow["wrapped"] and narrow["overflow"] <= 1 and narrow["plot_right"] <= narrow["out_right"] + 1

        # a reload while the kernel runs draws the current plan, not the first one (saved
        # first, as autosave does: the page finds the widget's output in the file)
        raw.set_viewport_size({"width": 1280, "height": 800})
        assert Counter(page.reconnect()) == Counter(dragged) != Counter(first)
        assert raw.locator(SEARCH_BOX).first.input_value() == PICKED

        # the same notebook, kernel and widgets in Notebook 7's page: drawn as they are now,
        # fitted, a drag re-plans, a click picks
        assert Counter(page.reconnect(server.page_url(NOTEBOOK, app="notebook"))) == Counter(dragged)
        page.drag_gpu_slider(0.8)
        page.wait(
            f"() => {{ {JS_PARTS} return fills.filter(f => f === '{GPU0}').length > {dragged.count(GPU0)}; }}",
            "more tiles in GPU 0's colour after a drag in Notebook 7",
        )
        page.click_tile(PICKED_NB7)
        page.wait(
            f"() => document.querySelector(\"{SEARCH_BOX}\").value === '{PICKED_NB7}'",
            f"{PICKED_NB7} in the module box after a click on its tile in Notebook 7",
        )
        cast.save()
