"""The Planner's view: what a plan looks like in its widgets (no decisions, no re-planning).

:class:`PlannerView` draws a plan, and what the person asked about it, into the controls
made by :mod:`bigviz.ui.controls`: the title, legend and budget bars, the cost sentence, the
run's verdict, the placements table, the dispatch tab (only when it is open: a slider move
re-plans in milliseconds, the dispatch of a thousand modules is made only when someone looks)
and the overrides. The model is :class:`~bigviz.ui.state.PlannerState`; the controller that
turns widget events into its changes is :mod:`bigviz.ui.planner_controller`; the facade users
hold is :class:`~bigviz.ui.planner.Planner`.

Example:
    >>> from bigviz.core.cost import predict_forward, UnitCost
    >>> "per forward" in cost_sentence(predict_forward([UnitCost("a", read_bytes=10**9)], disk_bandwidth=2e9), "preset")
    True
"""

from __future__ import annotations

import html
from typing import Any

from bigviz.core.cost import ForwardEstimate
from bigviz.core.pipeline import PipelinePlan
from bigviz.core.plan import DevicePlan
from bigviz.core.sizes import format_seconds, format_size
from bigviz.ui.context_chart import context_chart_svg, context_curves
from bigviz.ui.palette import chip, legend_html
from bigviz.ui.presets import cost_html
from bigviz.ui.report import dispatch_html, table_html, usage_html
from bigviz.ui.stages import StageControls, stage_legend_html
from bigviz.ui.state import PlannerState
from bigviz.ui.tiles import TreemapLayout
from bigviz.ui.treemap import layout_of

__all__ = ["PlannerView", "cost_sentence", "DISPATCH_TAB", "TABLE_ROWS"]

DISPATCH_TAB = 1  # index of the Dispatch tab (ui/controls.assemble)
TABLE_ROWS = 300  # rows drawn in the widget; planner.table has them all


def cost_sentence(estimate: ForwardEstimate, source: str) -> str:
    """The prediction in words, saying where the disk bandwidth came from (``source``:
    ``"measured"`` or ``"preset"``)."""
    return (
        f"Predicted (disk {source} {estimate.disk_bandwidth / 1e9:.2f} GB/s, compute not counted): {estimate.explain()}"
    )


class PlannerView:
    """Draws a plan into the Planner's widgets.

    Args:
        controls: The Planner's controls (:func:`bigviz.ui.controls.make_controls`).
        stage_controls: The pipeline-stage controls.
        state: The model the view reads (budgets, overrides, workload, dtype).
        tabs: The tab widget holding the placements and dispatch tabs.
    """

    def __init__(self, controls: Any, stage_controls: StageControls, state: PlannerState, tabs: Any) -> None:
        self.controls, self.stage_controls, self.state, self.tabs = controls, stage_controls, state, tabs
        self._layouts: dict[tuple[str | None, tuple[str, ...]], TreemapLayout] = {}
        self._dispatch_shown: DevicePlan | None = None  # the plan the Dispatch tab shows

    def layout(self) -> TreemapLayout:
        """The treemap's shape at the state's dtype (cached per dtype and modules kept unquantized)."""
        key = (self.state.dtype, self.state.unquantized)
        if key not in self._layouts:
            self._layouts[key] = layout_of(self.state.tree)
        return self._layouts[key]

    def show(self, plan: DevicePlan, stages: PipelinePlan | None, cost: str, fit: str) -> None:
        """Every view of ``plan`` (``stages``: the pipeline plan in stage mode)."""
        c = self.controls
        root = plan.tree.nodes[""] if plan.tree is not None else None
        dtype = self.state.dtype or "as built"
        c.title.value = (
            f"<b style='font-size:15px'>bigviz planner</b>: {html.escape(root.class_name if root else '')}"
            f", {format_size(root.total_bytes if root else 0)} ({dtype})"
        )
        captions = {u.device: f"{format_size(u.used)}" for u in plan.usage}
        c.legend.value = (
            legend_html([u.device for u in plan.usage], captions=captions)
            if stages is None
            else stage_legend_html(stages)
        )
        self.stage_controls.show(stages)
        c.usage.value = (
            usage_html(plan)
            + "".join(f"<div style='font-size:11px;color:#555'>{html.escape(n)}</div>" for n in plan.notes)
            + self.context_chart(plan)
        )
        c.cost.value = cost
        c.fit.value = fit
        c.table.value = table_html(plan, max_rows=TABLE_ROWS)
        self.show_dispatch(plan)
        c.overrides.value = self.overrides_html()

    def context_chart(self, plan: DevicePlan) -> str:
        """Memory against context under the bars, for a planned run (this placement kept)."""
        curves = context_curves(self.state, plan)
        return context_chart_svg(curves) if curves is not None and curves.devices else ""

    def show_error(self, message: str, fit: str) -> None:
        """Settings that do not plan: the reason, where the person looks."""
        self.controls.status.value = (
            f"<div style='color:#D55E00;white-space:pre-wrap'><b>Does not plan:</b> {html.escape(message)}</div>"
        )
        self.controls.fit.value = fit

    def show_timing(self, seconds: float) -> None:
        self.controls.status.value = (
            f"<span style='color:#555;font-size:12px'>re-planned in {seconds * 1000:.0f} ms</span>"
        )

    def show_dispatch(self, plan: DevicePlan | None, *, error: bool = False) -> None:
        """Fill the Dispatch tab when it is open (made only when someone looks at it)."""
        if plan is None or error or self.tabs.selected_index != DISPATCH_TAB or self._dispatch_shown is plan:
            return
        self.controls.dispatch.value = dispatch_html(plan)
        self._dispatch_shown = plan

    def fit_html(self, plan: DevicePlan | None, seconds_per_token: float | None, longest: Any, stale: bool) -> str:
        """The run's verdict: this plan's time per token, and the longest context that fits."""
        w = self.state.workload
        lines = []
        if w.active and plan is not None and seconds_per_token is not None:
            lines.append(
                f"This plan ({w.batch_size} x {w.context_length:,} tokens): "
                + (
                    f"at least <b>{format_seconds(seconds_per_token)} per token</b> streaming offloaded weights"
                    if seconds_per_token
                    else "nothing offloaded, no weights stream per token"
                )
            )
        if longest is not None:
            note = " <i>(settings changed: press Longest context)</i>" if stale else ""
            per_token = longest["seconds_per_token"]
            cost = f", at least {format_seconds(per_token)} per token" if per_token else ""
            lines.append(
                f"Longest context (batch {longest['batch_size']}): <b>{longest['no_offload']:,} tokens</b> "
                f"without offloading, {longest['with_offload']:,} with offloading{cost}{note}"
            )
        elif self.state.run_specs is not None:
            lines.append("<i>Set a context length, or press Longest context.</i>")
        return "<div class='bigviz-fit' style='font-size:12px'>" + "<br>".join(lines) + "</div>"

    def overrides_html(self) -> str:
        if not self.state.overrides:
            return "<i>No overrides: pick a module and a device, then Assign.</i>"
        items = "".join(f"<li><code>{html.escape(m)}</code> on {chip(d)}</li>" for m, d in self.state.overrides.items())
        return f"<ul>{items}</ul>"

    @staticmethod
    def cost_html(estimate: ForwardEstimate, source: str) -> str:
        """The cost sentence of a plan, at the bandwidths shown."""
        return cost_html(estimate, cost_sentence(estimate, source))
