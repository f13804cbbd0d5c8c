"""A plan as HTML: usage bars, the placements table, and a standalone report file.

:func:`render_report` makes a full page that works offline (plotly.js inlined, an
interactive treemap); :func:`report_fragment` makes the same content as a ``<div>`` for a
notebook's static ``text/html`` output, with the treemap drawn as SVG: no script and no
network, so it shows on GitHub, nbviewer, in an untrusted notebook and offline.

Example:
    >>> import os, tempfile, torch.nn as nn, bigviz
    >>> plan = bigviz.plan(nn.Sequential(nn.Linear(8, 8)), {"cpu": "1MB"})
    >>> path = save_html(plan, os.path.join(tempfile.mkdtemp(), "plan.html"))
    >>> text = open(path).read()
    >>> "bigviz-treemap" in text and "<table class='bigviz-table'" in text
    True
"""

from __future__ import annotations

import html
import json
import os
from typing import Any

from bigviz.core.plan import DevicePlan, DeviceUsage
from bigviz.core.serialize import write_text_atomic
from bigviz.core.devices import device_label
from bigviz.core.sizes import UNLIMITED, format_count, format_size
from bigviz.ui.palette import chip, device_color, legend_html
from bigviz.core.cost import ForwardEstimate
from bigviz.ui.presets import cost_html
from bigviz.ui.svg import figure_svg, svg_img
from bigviz.ui.treemap import OVERRIDE_MARK, plan_of, treemap

__all__ = ["dispatch_html", "usage_html", "table_html", "report_fragment", "render_report", "save_html"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:18px;color:#222}
.bigviz-table{border-collapse:collapse;font-size:12px}
.bigviz-table th,.bigviz-table td{border-bottom:1px solid #ddd;padding:2px 8px;text-align:left;vertical-align:top}
.bigviz-table td.num{text-align:right;white-space:nowrap}
.bigviz-report h2{font-size:16px;margin:16px 0 6px}
"""


KV_FILL = "repeating-linear-gradient(90deg,#1a1a1a 0 2px,#8c8c8c 2px 4px)"
"""Budget-bar fill of the KV cache: dark stripes, beside the weights' device colour."""
ACTIVATION_FILL = "repeating-linear-gradient(0deg,#CC79A7 0 2px,#f3d6e6 2px 4px)"
"""Budget-bar fill of the activations: reddish-purple stripes (Okabe-Ito)."""

FRAGMENT_SVG_WIDTH = 640
"""Width of the treemap picture in a report fragment: about the room beside its 430 px side
panel in a notebook, so its text shows at full size instead of scaled down."""

# Inline, not only in _CSS: notebook outputs and the widget carry no stylesheet, and a size
# must never wrap ("58.6" over "MiB").
_NUM = "class='num' style='text-align:right;white-space:nowrap'"


def usage_html(plan: DevicePlan) -> str:
    """One bar per device, stacked: weights (device colour), KV cache (dark stripes),
    activations (purple stripes), reserve for activations (hatched), room for streamed-in
    offloaded weights (light hatch), free space; red when over budget."""
    rows = [_usage_row(u) for u in plan.usage]
    key = ""
    if any(u.kv_cache or u.activations for u in plan.usage):
        key = (
            f"<div style='margin:2px 0 4px'>{_swatch(KV_FILL)} KV cache &nbsp; {_swatch(ACTIVATION_FILL)} "
            f"activations (prefill peak) &nbsp; {_workload_text(plan)}</div>"
        )
    return f"<div class='bigviz-usage' style='font-size:12px'>{key}{''.join(rows)}</div>"


def _swatch(fill: str) -> str:
    return f"<span style='display:inline-block;width:14px;height:10px;background:{fill};vertical-align:middle'></span>"


def _workload_text(plan: DevicePlan) -> str:
    w = plan.workload
    if w is None or not w.active:
        return ""
    return html.escape(
        f"(batch {w.batch_size} x {w.context_length:,} tokens" + (f", cache in {w.kv_dtype})" if w.kv_dtype else ")")
    )


def _usage_row(u: DeviceUsage) -> str:
    label = chip(u.device)
    run = (
        f" + {format_size(u.kv_cache)} KV cache + {format_size(u.activations)} activations"
        if u.kv_cache or u.activations
        else ""
    )
    if u.budget >= UNLIMITED:
        return f"<div style='margin:3px 0'>{label} {format_size(u.used)}{run} (no limit)</div>"
    budget = max(u.budget, 1)
    parts = [
        (u.used, device_color(u.device), "weights"),
        (u.kv_cache, KV_FILL, "KV cache"),
        (u.activations, ACTIVATION_FILL, "activations (peak of the largest step)"),
        (u.reserve, "repeating-linear-gradient(45deg,#999 0 3px,#ddd 3px 6px)", "reserve"),
        (
            u.offload_reserve,
            "repeating-linear-gradient(45deg,#bbb 0 3px,#f4f4f4 3px 6px)",
            "room for streamed-in offloaded weights",
        ),
    ]
    segments, left = [], 100.0
    for size, background, what in parts:
        pct = min(100.0 * size / budget, left)
        left -= pct
        if pct > 0:
            segments.append(
                f"<div title='{what}: {format_size(size)}' style='width:{pct:.2f}%;"
                f"background:{background};height:100%'></div>"
            )
    over = u.free < 0
    border = "2px solid #D55E00" if over else "1px solid #bbb"
    extra = f" (+ {format_size(u.reserve + u.offload_reserve)} reserved)" if u.reserve or u.offload_reserve else ""
    warn = " <b style='color:#D55E00'>over budget</b>" if over else ""
    return (
        f"<div style='margin:3px 0'>{label} {format_size(u.used)}{run} of {format_size(u.budget)}{extra}{warn}"
        f"<div style='display:flex;width:100%;max-width:420px;height:12px;border:{border};"
        f"background:#fff'>{''.join(segments)}</div></div>"
    )


def table_html(plan: DevicePlan, *, max_rows: int | None = None) -> str:
    """The placements as an HTML table: module, class, device, size, share, reason. The class
    column is left out when no placement has one (a plan made from checkpoint headers).

    Example:
        >>> import torch.nn as nn, bigviz
        >>> t = table_html(bigviz.plan(nn.Linear(4, 4), {"cpu": "1MB"}))
        >>> t.count("<tr>")
        2
    """
    total = sum(p.nbytes for p in plan.placements) or 1
    shown = plan.placements if max_rows is None else plan.placements[:max_rows]
    classes = any(p.class_name for p in plan.placements)
    rows = [
        f"<tr><td><code>{html.escape(p.name or '<model>')}</code></td>"
        + (f"<td>{html.escape(p.class_name)}</td>" if classes else "")
        + f"<td>{chip(p.device)}</td><td {_NUM}>{format_size(p.nbytes)}</td>"
        f"<td {_NUM}>{p.nbytes / total:.1%}</td>"
        f"<td>{OVERRIDE_MARK if p.override else ''}{html.escape(p.reason)}</td></tr>"
        for p in shown
    ]
    more = len(plan.placements) - len(shown)
    if more > 0:
        rows.append(
            f"<tr><td colspan='7'>... and {format_count(more, 'more unit')} (the full table: planner.table "
            f"or plan.to_frame())</td></tr>"
        )
    head = f"<tr><th>module</th>{'<th>class</th>' if classes else ''}<th>device</th><th>size</th><th>share</th><th>reason</th></tr>"
    return f"<table class='bigviz-table'>{head}{''.join(rows)}</table>"


def dispatch_html(plan: DevicePlan, *, max_rows: int = 200) -> str:
    """What a dispatch of ``plan`` does, as HTML: the dispatch plan's summary (resident bytes,
    room held for streamed units, how each unit lives at run time), then one row per offload
    unit in fetch order (the module its hook sits on, where its weights are stored, the fetcher
    its stream plan names, its tensors, bytes and names).

    Example:
        >>> import torch.nn as nn, bigviz
        >>> model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        >>> text = dispatch_html(bigviz.plan(model, {0: 60_000, "cpu": "1MB"}))
        >>> text.count("<tr>") - 1, "from CPU" in text  # a header row, then one row per unit
        (3, True)
    """
    if plan.tree is None:
        return "<i>This plan carries no size tree: plan again to see its dispatch.</i>"
    dispatch = plan.dispatch_plan()
    if not dispatch.units:
        note = "<div><i>Nothing is offloaded: no weights stream at forward time.</i></div>"
    else:
        note = ""
    rows = [
        f"<tr><td {_NUM}>{r['order']}</td><td><code>{html.escape(r['unit'])}</code></td><td>{chip(r['storage'])}</td>"
        f"<td>{html.escape(r['fetcher'])}</td><td {_NUM}>{r['tensors']}</td><td {_NUM}>{r['size']}</td>"
        f"<td style='font-size:11px'>{html.escape(_shorten(r['fetches']))}</td></tr>"
        for r in dispatch.rows()[:max_rows]
    ]
    more = len(dispatch.units) - max_rows
    if more > 0:
        rows.append(
            f"<tr><td colspan='7'>... and {format_count(more, 'more unit')} (all of them: planner.dispatch_plan.to_frame())</td></tr>"
        )
    head = (
        "<tr><th>fetch order</th><th>unit (hooked module)</th><th>stored on</th><th>fetcher</th><th>tensors</th>"
        "<th>size</th><th>fetches</th></tr>"
    )
    summary = html.escape(dispatch.summary()).replace("\n", "<br>")
    return (
        f"<div class='bigviz-dispatch'><div style='font-family:monospace;font-size:12px'>{summary}</div>"
        f"{note}<table class='bigviz-dispatch-table'>{head}{''.join(rows)}</table></div>"
    )


def _shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _budgets_html(plan: DevicePlan) -> str:
    run = any(u.kv_cache or u.activations for u in plan.usage)
    rows = "".join(
        f"<tr><td>{chip(u.device)}</td><td {_NUM}>{format_size(u.budget)}</td>"
        f"<td {_NUM}>{format_size(u.reserve)}</td><td {_NUM}>{format_size(u.offload_reserve)}</td>"
        f"<td {_NUM}>{format_size(u.used)}</td>"
        + (f"<td {_NUM}>{format_size(u.kv_cache)}</td><td {_NUM}>{format_size(u.activations)}</td>" if run else "")
        + f"<td {_NUM}>{format_size(u.free) if u.budget < UNLIMITED else 'unlimited'}</td></tr>"
        for u in plan.usage
    )
    head = (
        "<tr><th>device</th><th>budget</th><th>reserve</th><th>offload room</th><th>weights</th>"
        + ("<th>KV cache</th><th>activations</th>" if run else "")
        + "<th>free</th></tr>"
    )
    return f"<table class='bigviz-table'>{head}{rows}</table>"


def report_fragment(
    plan_or_planner: Any,
    *,
    include_plotlyjs: bool | str | None = None,
    max_rows: int | None = None,
    cost: ForwardEstimate | None = None,
    depth: int | None = None,
    figure: Any = None,
) -> str:
    """The report's body as one ``<div>``: legend, budgets, cost, treemap, table, device map.

    Args:
        plan_or_planner: a ``DevicePlan`` or a ``Planner``.
        include_plotlyjs: ``None`` (the default) draws the treemap as an SVG image (a
            ``data:`` URI, which HTML sanitizers keep), with no script at all; otherwise plotly's interactive figure, with plotly.js inlined
            (``True``) or loaded from its CDN (``"cdn"``).
        max_rows: rows of the placements table (``None``: all).
        cost: the plan's predicted cost per forward (``DevicePlan.cost()``; default: the
            planner's, or PCIe 4 and NVMe).
        depth: module levels drawn in the treemap.
        figure: the ``bigviz.treemap`` figure of this plan, when already made.

    Example:
        >>> import torch.nn as nn, bigviz
        >>> div = report_fragment(bigviz.plan(nn.Linear(4, 4), {"cpu": "1MB"}))
        >>> "data:image/svg+xml;base64," in div and "<script" not in div
        True
    """
    plan = plan_of(plan_or_planner)
    if cost is None and plan_or_planner is not plan:  # a Planner: its chosen link and disk
        cost = plan_or_planner.cost()
    if cost is None:  # a DevicePlan: at the presets' bandwidths
        cost = plan.cost()
    fig = figure if figure is not None else treemap(plan_or_planner, depth=depth)
    if include_plotlyjs is None:
        alt = f"treemap: {fig.layout.title.text or 'the plan'}"
        picture = figure_svg(fig, width=FRAGMENT_SVG_WIDTH)
        figure_html = f"<div id='bigviz-treemap' class='bigviz-treemap'>{svg_img(picture, alt=alt)}</div>"
    else:
        figure_html = fig.to_html(
            full_html=False,
            include_plotlyjs=include_plotlyjs,
            div_id="bigviz-treemap",
            config={"displaylogo": False, "responsive": True},
        )
    captions = {u.device: format_size(u.used) for u in plan.usage}
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in plan.notes)
    device_map = html.escape(json.dumps(plan.device_map, indent=1))
    head = (
        f"<div style='font-size:13px;margin-bottom:6px'><b>{html.escape(plan.strategy)}</b> plan, "
        f"{format_count(len(plan.placements), 'unit')}, execution on {device_label(plan.main_device)}</div>"
    )
    side = (
        f"{head}{legend_html([u.device for u in plan.usage], captions=captions)}"
        f"<h2>Budgets</h2>{usage_html(plan)}"
        + (f"<ul style='font-size:12px;padding-left:18px'>{notes}</ul>" if notes else "")
        + f"<h2>Cost</h2><div style='font-size:13px'>{cost_html(cost)}</div>"
    )
    return (
        f"<div class='bigviz-report'><div style='display:flex;gap:18px;align-items:flex-start'>"
        f"<div style='flex:0 0 430px;max-width:430px'>{side}</div>"
        f"<div style='flex:1 1 auto;min-width:0'>{figure_html}</div></div>"
        f"<h2>Budgets per device</h2><div style='overflow-x:auto'>{_budgets_html(plan)}</div>"
        f"<h2>Placements ({format_count(len(plan.placements), 'unit')})</h2>{table_html(plan, max_rows=max_rows)}"
        f"<h2>Device map</h2><details><summary>JSON ({format_count(len(plan.device_map), 'key')})</summary>"
        f"<pre style='font-size:12px'>{device_map}</pre></details></div>"
    )


def render_report(
    plan_or_planner: Any,
    *,
    title: str = "bigviz device plan",
    include_plotlyjs: bool | str = True,
    depth: int | None = None,
) -> str:
    """A standalone HTML page of the plan; with ``include_plotlyjs=True`` (the default)
    plotly.js is inlined (about 4.7 MB) so the page works offline.

    Example:
        >>> import torch.nn as nn, bigviz
        >>> page = render_report(bigviz.plan(nn.Linear(4, 4), {"cpu": "1MB"}), include_plotlyjs="cdn")
        >>> page.startswith("<!DOCTYPE html>") and "Placements (1 unit)" in page
        True
    """
    body = report_fragment(plan_or_planner, include_plotlyjs=include_plotlyjs, depth=depth)
    return (
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_CSS}</style></head><body><h1 style='font-size:20px'>{html.escape(title)}</h1>"
        f"{body}</body></html>\n"
    )


def save_html(
    plan_or_planner: Any, path: str | os.PathLike[str], *, title: str = "bigviz device plan", depth: int | None = None
) -> str:
    """Write :func:`render_report` to ``path`` (atomically: a crash leaves no half file).

    Returns:
        The path written, as a string.

    Example:
        >>> import os, tempfile, torch.nn as nn, bigviz
        >>> out = save_html(bigviz.plan(nn.Linear(4, 4), {"cpu": "1MB"}), os.path.join(tempfile.mkdtemp(), "r.html"))
        >>> os.path.getsize(out) > 1_000_000  # plotly.js is inside: it opens offline
        True
    """
    page = render_report(plan_or_planner, title=title, depth=depth)
    write_text_atomic(page, path)  # usual permissions (0o644 with the usual umask), never half written
    return str(path)
