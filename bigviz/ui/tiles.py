"""The treemap's data, as plain values: its shape (:class:`TreemapLayout`, from a size tree)
and what a plan paints on it (:class:`TreemapStyle`: colours, labels, borders, hover).

Shared by the device view (:mod:`bigviz.ui.treemap`) and the stage view
(:mod:`bigviz.ui.stages`), which make them; plotly never sees these types.

Example:
    >>> TreemapLayout(("",), ("/",), ("",), (10,), ("model",), (0,)).total
    10
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TreemapLayout", "TreemapStyle"]


@dataclass(frozen=True)
class TreemapLayout:
    """The shape of the treemap: one entry per drawn node, root first, in definition order."""

    names: tuple[str, ...]  # module or tensor name; "" is the whole model
    ids: tuple[str, ...]
    parents: tuple[str, ...]
    values: tuple[int, ...]
    labels: tuple[str, ...]
    depths: tuple[int, ...]

    @property
    def total(self) -> int:
        return self.values[0]

    @property
    def max_depth(self) -> int:
        return max(self.depths)


@dataclass(frozen=True)
class TreemapStyle:
    """What a plan changes in the treemap."""

    colors: tuple[str, ...]
    labels: tuple[str, ...]
    line_colors: tuple[str, ...]  # black marks an override (all tiles share BORDER_WIDTH)
    customdata: tuple[tuple[str, ...], ...]
