"""See a plan and change it: the treemap figure builder (pure), the Planner widget app and
the static HTML report.

plotly and ipywidgets load on first use, so ``import bigviz.ui`` stays cheap. The figure
builder is ``bigviz.treemap`` (here, ``bigviz.ui.treemap`` is its module).

Example:
    >>> import torch.nn as nn, bigviz
    >>> fig = bigviz.treemap(bigviz.plan(nn.Linear(4, 4), {"cpu": "1MB"}))
    >>> fig.data[0].type
    'treemap'
"""

from __future__ import annotations

from bigviz.core.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "Planner": "bigviz.ui.planner",
    "save_html": "bigviz.ui.report",
    "render_report": "bigviz.ui.report",
    "HARDWARE_PRESETS": "bigviz.core.hardware",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("bigviz.ui", _EXPORTS, globals())
