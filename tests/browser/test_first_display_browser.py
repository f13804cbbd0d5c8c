"""The live treemap's first display, with the cell RUN in each frontend, on a loaded machine.

A plain plotly ``FigureWidget`` can show empty axes for good on a fresh page: its view draws
the model's data once, when it renders, and the kernel used to open the widget's comm before
the data arrived (bigviz.ui.livefigure); and anywidget drops every message to a model whose code
took over 2 s to load, so a figure drawn on a busy machine may never follow an update. The other
browser test runs its cell in JupyterLab and only reconnects Notebook 7 to that kernel; a user
runs the cell in the page they have. Here each frontend runs a Planner cell in its own notebook
and kernel while every core is kept busy by spinning processes (a small Binder or a shared
laptop is where users meet this): the treemap must draw its tiles in the device colours, then
recolour after a slider drag.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from bigviz.ui.palette import device_color
from tests.browser.conftest import browser_page, jupyter_server, one_cell_notebook
from tests.browser.test_planner_browser import JS_PARTS, KERNEL_READY, Page, _rgb

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SETUP = """\
import bigviz
from bigviz.models import GPT, GPTConfig

with bigviz.init_empty_weights():
    model = GPT(GPTConfig.preset("gpt2"))
bigviz.Planner(model, {0: "0.2GiB", "cpu": "2GiB"}, strategy="sequential")"""
APPS = {"lab": "JupyterLab", "notebook": "Notebook 7"}
SPIN = "import time\nend = time.monotonic() + 900\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def busy_cores() -> Iterator[None]:
    """One spinning process per core (each gives up after 15 minutes on its own), stopped by
    their own ids when the block ends."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        yield
    finally:
        for process in spinners:
            process.kill()
            process.wait(10)


@pytest.mark.parametrize("app", list(APPS))
def test_the_treemap_draws_when_its_cell_runs_under_load(tmp_path, app):
    name = f"planner-{app}.ipynb"
    one_cell_notebook(tmp_path / name, SETUP)
    with browser_page(width=1280, height=800) as raw, jupyter_server(tmp_path) as server:
        page = Page(raw)
        server.start_kernel(name)
        page.page.goto(server.page_url(name, app=app))
        page.wait(KERNEL_READY, f"{APPS[app]} with a connected, idle kernel", timeout=180_000)
        with busy_cores():
            page.page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            fills = page.treemap()  # the tiles, drawn, fitted to their column
            assert len(fills) >= 10
            assert _rgb(device_color(0)) in fills and _rgb(device_color("cpu")) in fills, set(fills)
            drawn = page.page.evaluate(f"() => {{ {JS_PARTS} return gd.data[0].ids.length; }}")
            assert drawn >= 10, f"{APPS[app]}: the figure's view holds {drawn} tiles"
            # and it follows the plan: a drag re-plans, the tiles recolour (anywidget may have
            # dropped the figure's updates on this busy machine: then a new figure shows it)
            gpu0 = _rgb(device_color(0))
            page.drag_gpu_slider(0.9)
            page.wait(
                f"() => {{ {JS_PARTS} return fills.filter(f => f === '{gpu0}').length > {fills.count(gpu0)}; }}",
                f"more tiles in GPU 0's colour after a drag in {APPS[app]}",
                timeout=180_000,
            )
