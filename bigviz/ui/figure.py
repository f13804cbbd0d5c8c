"""The Planner's live treemap: a plotly ``FigureWidget`` updated in place, or, where that
cannot run, the same figure re-drawn into an ``Output`` widget.

plotly >= 6 builds ``FigureWidget`` on anywidget; without it (or in a frontend that does
not load it) the static figure still shows through plotly's own notebook renderer, with an
SVG copy for frontends without plotly. The live figure fits the width of its column and
follows it (:mod:`bigviz.ui.livefigure`), a page reloaded while the kernel runs draws the
current plan, and a click on a tile picks its module.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from bigviz.core.pipeline import PipelinePlan
from bigviz.core.plan import DevicePlan
from bigviz.ui.svg import figure_svg
from bigviz.core.errors import StateError
from bigviz.ui.treemap import (
    TreemapLayout,
    TreemapStyle,
    apply_layout,
    apply_style,
    figure_title,
    layout_of,
    maxdepth_for,
    style_for,
    style_of,
    treemap,
)

__all__ = ["FigureView", "COLUMN_CLASS"]

COLUMN_CLASS = "bigviz-figure-column"
"""CSS class of the box whose width the live figure follows."""


class FigureView:
    """A treemap that follows a changing plan.

    Attributes:
        widget: the ipywidget to place in a layout.
        live: True for a ``FigureWidget`` updated in place, False for the static fallback.
        figure: the plotly figure shown (a ``FigureWidget`` when ``live``).
    """

    def __init__(self, plan: DevicePlan, *, depth: int | None = None, height: int = 560, live: bool = True) -> None:
        assert plan.tree is not None
        self.depth = depth
        self.height = height
        self.layout: TreemapLayout = layout_of(plan.tree)
        self.style: TreemapStyle = style_of(self.layout, plan)
        self.fallback_reason = ""
        static = treemap(plan, depth=depth, height=height)
        import ipywidgets as widgets

        parts: list[Any] = []
        try:
            if not live:
                raise StateError("a static figure was asked for (live=False)")
            from bigviz.ui.livefigure import FigureHelper, LiveFigure

            self.figure: Any = LiveFigure(static)
            self.figure._config = {"responsive": True, "displaylogo": False}  # width follows its box
            self.figure.on_lost(self._renew)
            self.widget: Any = self.figure
            self.live = True
            self.helper: Any = FigureHelper(column_class=COLUMN_CLASS)
            parts = [self.figure, self.helper]
        except Exception as err:  # ImportError without anywidget; anything a frontend lacks
            self.fallback_reason = f"{type(err).__name__}: {err}"
            self.helper = None
            self.figure = static
            self.widget = widgets.Output()
            self.live = False
            self._show_static()
            parts = [self.widget]
        self.box = widgets.VBox(parts, layout=widgets.Layout(width="100%", min_width="0"))
        """The figure and its helper, to place in a layout (the figure fits this box's width)."""
        self.box.add_class(COLUMN_CLASS)

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

    def _renew(self) -> None:
        """The browser stopped applying this figure's updates (``LiveFigure.lost``): show a new
        figure widget in its place, built with the current figure."""
        old, self.figure = self.figure, self.figure.renewed()
        self.widget = self.figure
        self.box.children = (self.figure, *self.box.children[1:])
        old.close()

    def close(self) -> None:
        """Close the figure's widgets."""
        for child in self.box.children:
            child.close()
        self.box.close()

    def on_pick(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(module_name)`` when a tile of the live figure is clicked (the
        click also zooms into the tile, as plotly does). The model's own tile is ignored."""
        if not self.live:
            return

        def clicked(tile_id: str) -> None:
            ids = self.layout.ids
            name = self.layout.names[ids.index(tile_id)] if tile_id in ids else ""
            if name:
                callback(name)

        self.helper.on_click(clicked)

    def set_depth(self, depth: int | None) -> None:
        self.depth = depth
        self.figure.data[0].maxdepth = maxdepth_for(depth)
        if not self.live:
            self._show_static()

    def _show_static(self) -> None:
        """Put the figure into the Output widget as plotly's notebook mime type, with an
        SVG and an HTML copy for frontends without plotly's renderer."""
        data = {
            "application/vnd.plotly.v1+json": {**json.loads(self.figure.to_json()), "config": {"displaylogo": False}},
            "image/svg+xml": figure_svg(self.figure),
            "text/html": self.figure.to_html(full_html=False, include_plotlyjs="cdn"),
            "text/plain": "treemap (static: FigureWidget unavailable)",
        }
        self.widget.outputs = ({"output_type": "display_data", "data": data, "metadata": {}},)
