"""The static HTML report: bars, table, fragment, full page, atomic save."""

from __future__ import annotations

import base64
import os
import re

import pytest
from torch import nn

import bigviz
from bigviz.core.plan import DeviceUsage
from bigviz.ui.report import _usage_row, render_report, report_fragment, save_html, table_html, usage_html
from bigviz.ui.svg import figure_svg

LAYER = 16_640


def _plan():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    return bigviz.plan(model, {0: 4 * LAYER, "cpu": 10**6}, strategy="sequential", reserve={0: LAYER})


def test_usage_bars_show_weights_reserve_and_unlimited_disk():
    text = usage_html(_plan())
    assert "title='reserve: 16.2 KiB'" in text
    assert "room for streamed-in offloaded weights" in text
    assert "(no limit)" in text  # disk
    over = _usage_row(DeviceUsage(0, budget=100, cap=100, reserve=10, offload_reserve=0, used=200))
    assert "over budget" in over and "#D55E00" in over


def test_table_lists_every_unit_or_says_how_many_are_left_out():
    plan = _plan()
    full = table_html(plan)
    assert full.count("<tr>") == len(plan.placements) + 1
    assert all(f"<code>{p.name}</code>" in full for p in plan.placements)
    short = table_html(plan, max_rows=2)
    assert short.count("<tr>") == 4 and "and 4 more units" in short


def test_fragment_draws_svg_without_script_and_the_page_inlines_plotly():
    plan = _plan()
    fragment = report_fragment(plan)
    assert fragment.startswith("<div") and "<script" not in fragment and "cdn.plot.ly" not in fragment
    (data,) = re.findall(r"src='data:image/svg\+xml;base64,([^']+)'", fragment)
    assert base64.b64decode(data).decode() == figure_svg(bigviz.treemap(plan), width=640)
    assert 'src="https://cdn.plot.ly' in report_fragment(plan, include_plotlyjs="cdn")
    page = render_report(plan, title="A <test>")
    assert page.startswith("<!DOCTYPE html>") and "<title>A &lt;test&gt;</title>" in page
    assert 'src="https://cdn.plot.ly' not in page and len(page) > 1_000_000
    assert '"0": 0' in page or "&quot;0&quot;: 0" in page  # the device map JSON


def test_save_html_is_atomic_and_creates_folders(tmp_path, monkeypatch):
    plan = _plan()
    out = save_html(plan, tmp_path / "sub" / "plan.html")
    assert os.path.getsize(out) > 1_000_000
    monkeypatch.setattr("bigviz.ui.report.render_report", lambda *a, **k: "<html>new</html>")

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("bigviz.ui.report.os.replace", fail)
    with pytest.raises(OSError, match="disk full"):
        save_html(plan, out)
    assert os.path.getsize(out) > 1_000_000  # the old report is intact
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["plan.html"]  # no temp file left


def test_top_level_export_is_the_report_writer(tmp_path):
    assert bigviz.save_html is save_html
    assert bigviz.treemap(_plan()).data[0].type == "treemap"
