""":class:`TreemapFigure`: the plotly figure ``bigviz.treemap`` returns, which also shows as
a picture where plotly cannot run.

In a notebook a plotly figure is JSON that plotly's JavaScript draws; on GitHub, nbviewer,
in an untrusted notebook or offline nothing draws it. This figure adds an ``image/svg+xml``
output (drawn by :mod:`bigviz.ui.svg`, no script, no network) next to plotly's: frontends
with plotly show the interactive figure, the others the picture.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from bigviz.ui.svg import figure_svg

__all__ = ["TreemapFigure"]


class TreemapFigure(go.Figure):
    """A plotly ``Figure`` holding one treemap, shown with an SVG copy in notebooks.

    Example:
        >>> import torch.nn as nn, bigviz
        >>> fig = bigviz.treemap(bigviz.plan(nn.Linear(4, 4), {"cpu": "1MB"}))
        >>> fig._repr_mimebundle_()["image/svg+xml"] == fig.to_svg()  # next to plotly's own output
        True
    """

    def to_svg(self) -> str:
        """The figure as it is now, drawn as a standalone SVG document."""
        return figure_svg(self)

    def _repr_mimebundle_(
        self, include: Any = None, exclude: Any = None, validate: bool = True, **kwargs: Any
    ) -> dict[str, Any]:
        bundle = dict(super()._repr_mimebundle_(include, exclude, validate, **kwargs) or {})
        bundle.setdefault("image/svg+xml", self.to_svg())
        return bundle

    def _ipython_display_(self) -> None:
        """Display the bundle above (plotly's own display would skip the SVG)."""
        import plotly.io as pio
        from IPython.display import display

        if pio.renderers.render_on_display and pio.renderers.default:
            display(self._repr_mimebundle_(), raw=True)
        else:
            print(repr(self))
