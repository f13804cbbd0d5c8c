"""The Planner's live treemap: a plotly ``FigureWidget`` updated in place, or, where that
cannot run, the same figure re-drawn into an ``Output`` widget.

plotly >= 6 builds ``FigureWidget`` on anywidget; without it (or in a frontend that does
not load it) the static figure still shows through plotly's own notebook renderer.
"""
from __future__ import annotations

import json
from typing import Any

from bigviz.core.pipeline import PipelinePlan
from bigviz.core.plan import DevicePlan
from bigviz.ui.treemap import (TreemapLayout, TreemapStyle, apply_layout, apply_style, figure_title,
                               layout_of, maxdepth_for, style_for, style_of, treemap)

__all__ = ["FigureView"]


class FigureView:
    """A treemap that follows a changing plan.

    Attributes:
        widget: the ipywidget to place in a layout.
        live: True for a ``FigureWidget`` updated in place, False for the static fallback.
        figure: the plotly figure shown (a ``FigureWidget`` when ``live``).
    """

    def __init__(self, plan: DevicePlan, *, depth: int | None = None, height: int = 560,
                 live: bool = True) -> None:
        assert plan.tree is not None
        self.depth = depth
        self.height = height
        self.layout: TreemapLayout = layout_of(plan.tree)
        self.style: TreemapStyle = style_of(self.layout, plan)
        self.fallback_reason = ""
        static = treemap(plan, depth=depth, height=height)
        try:
            import plotly.graph_objects as go

            if not live:
                raise RuntimeError("a static figure was asked for (live=False)")
            self.figure: Any = go.FigureWidget(static)
            self.widget: Any = self.figure
            self.live = True
        except Exception as err:  # ImportError without anywidget; anything a frontend lacks
            import ipywidgets as widgets

            self.fallback_reason = f"{type(err).__name__}: {err}"
            self.figure = static
            self.widget = widgets.Output()
            self.live = False
            self._show_static()

    @property
    def colors(self) -> tuple[str, ...]:
        """The tile colours the figure shows now."""
        return tuple(self.figure.data[0].marker.colors)

    def update(self, plan: DevicePlan | PipelinePlan, layout: TreemapLayout | None = None) -> None:
        """Show ``plan`` (coloured by device, or by stage for a ``PipelinePlan``): one
        ``batch_update`` (one redraw) on a live figure."""
        new_layout = layout if layout is not None else self.layout
        style = style_for(new_layout, plan)
        if not self.live:
            self.layout, self.style = new_layout, style
            self.figure = treemap(plan, depth=self.depth, height=self.height)
            self._show_static()
            return
        trace = self.figure.data[0]
        reshaped = new_layout is not self.layout
        with self.figure.batch_update():
            if reshaped:
                apply_layout(trace, new_layout)
            apply_style(trace, style, None if reshaped else self.style)
            title = figure_title(plan)
            if self.figure.layout.title.text != title:
                self.figure.layout.title.text = title
        self.layout, self.style = new_layout, style

    def set_depth(self, depth: int | None) -> None:
        self.depth = depth
        self.figure.data[0].maxdepth = maxdepth_for(depth)
        if not self.live:
            self._show_static()

    def _show_static(self) -> None:
        """Put the figure into the Output widget as plotly's notebook mime type, with an
        HTML copy for frontends without plotly's renderer."""
        data = {
            "application/vnd.plotly.v1+json": {**json.loads(self.figure.to_json()),
                                               "config": {"displaylogo": False}},
            "text/html": self.figure.to_html(full_html=False, include_plotlyjs="cdn"),
            "text/plain": "treemap (static: FigureWidget unavailable)",
        }
        self.widget.outputs = ({"output_type": "display_data", "data": data, "metadata": {}},)
