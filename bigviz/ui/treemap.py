"""The plan as a plotly treemap: the module tree sized by bytes, coloured by device.

Two parts, so the Planner can update a live figure cheaply:

* :func:`layout_of` turns a :class:`~bigviz.core.tree.SizeTree` into the treemap's
  ``ids``/``parents``/``values`` (it changes only when the sizes change, e.g. a new dtype);
* :func:`style_of` turns a :class:`~bigviz.core.plan.DevicePlan` into colours, labels,
  borders and hover data (it changes on every re-plan).

plotly draws a blank treemap, without an error, when children sum to more than their parent
under ``branchvalues="total"``; the values here are the tree's integer bytes, so a parent is
always its children plus its own tensors. Modules that hold no bytes (dropout, activations,
tied-only heads) are left out: they would be invisible anyway, and the table lists them.

Example:
    >>> import torch.nn as nn, bigviz
    >>> plan = bigviz.plan(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]), {0: 60_000, "cpu": 10**6})
    >>> fig = treemap(plan)
    >>> fig.data[0].ids[0], list(fig.data[0].marker.colors)
    ('/', ['#E8E8E8', '#0072B2', '#F0E442', '#F0E442', '#F0E442'])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from bigviz.core.names import ancestors, leaf, owner, parent
from bigviz.core.pipeline import PipelinePlan
from bigviz.core.plan import DevicePlan
from bigviz.core.tree import SizeTree
from bigviz.core.devices import Device, device_label, device_sort_key
from bigviz.core.sizes import format_size
from bigviz.ui.palette import device_color
from bigviz.ui.stages import stage_style_of, stage_title
from bigviz.ui.tiles import TreemapLayout, TreemapStyle
from bigviz.core.errors import ArgumentTypeError, UsageError

if TYPE_CHECKING:
    import plotly.graph_objects as go

__all__ = [
    "ROOT_ID",
    "OVERRIDE_MARK",
    "BORDER_WIDTH",
    "TreemapLayout",
    "TreemapStyle",
    "layout_of",
    "style_of",
    "treemap",
    "apply_style",
    "apply_layout",
    "plan_of",
    "maxdepth_for",
    "figure_title",
    "figure_of",
    "style_for",
]

ROOT_ID = "/"
"""The root's id. Every other id is ``"/" + name`` with a non-empty name, so no module
(not even one called ``model`` or ``/``) can collide with it."""
OVERRIDE_MARK = "\u270e "  # a pencil: "you placed this by hand"
BORDER_WIDTH = 2.0
"""One border width for every tile (white; black around an override). plotly draws the path
bar with NaN coordinates, so a zoomed-in view has no way back, when widths vary per tile."""
HOVER = (
    "<b>%{customdata[0]}</b><br>%{customdata[1]} (%{customdata[2]} of the model)"
    "<br>device: %{customdata[3]}<br>%{customdata[4]}<extra></extra>"
)


def _node_id(name: str) -> str:
    return ROOT_ID if name == "" else ROOT_ID + name


def layout_of(tree: SizeTree) -> TreemapLayout:
    """The treemap's nodes for a size tree (modules with bytes, plus the own tensors of
    modules that also have children, so a parent's area is fully accounted for).

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> t = SizeTree.build([TensorSpec("model.w", 4, "float32"), TensorSpec("model.x.w", 2, "float32")])
        >>> lay = layout_of(t)
        >>> lay.ids, lay.parents, lay.values
        (('/', '/model', '/model.w', '/model.x'), ('', '/', '/model', '/model'), (24, 24, 16, 8))
    """
    rows: list[tuple[str, str, int, str, int]] = []
    root = tree.nodes[""]
    rows.append(("", "", root.total_bytes, root.class_name or "model", 0))
    for name, node in tree.nodes.items():
        if not name or node.total_bytes == 0:
            continue
        rows.append((name, _node_id(parent(name)), node.total_bytes, leaf(name), node.depth))
        if node.children:  # own tensors of a module with children get their own tiles
            for tensor in node.tensors:
                size = tree.tensor_bytes(tensor)
                if size:
                    rows.append((tensor, _node_id(name), size, leaf(tensor), node.depth + 1))
    if root.children:
        rows[1:1] = [(t, ROOT_ID, tree.tensor_bytes(t), leaf(t), 1) for t in root.tensors if tree.tensor_bytes(t)]
    names, parents, values, labels, depths = zip(*rows)
    return TreemapLayout(names, tuple(_node_id(n) for n in names), parents, values, labels, depths)


def style_of(layout: TreemapLayout, plan: DevicePlan) -> TreemapStyle:
    """Colours, labels, borders and hover data of every node under ``plan``."""
    units = plan.unit_map
    by_name = {p.name: p for p in plan.placements}
    split = _split_bytes(plan, set(layout.names))
    total = layout.total or 1
    colors, labels, lines, data = [], [], [], []
    for name, value, label in zip(layout.names, layout.values, layout.labels):
        key = owner(name, units)
        device = units[key] if key is not None else _only_device(split.get(name, {}))
        override = key == name and by_name[name].override
        colors.append(device_color(device))
        labels.append(OVERRIDE_MARK + label if override else label)
        lines.append("#000000" if override else "#FFFFFF")
        where = device_label(device) if device is not None else "split"
        data.append(
            (name or "<model>", format_size(value), f"{value / total:.1%}", where, _reason(name, key, by_name, split))
        )
    return TreemapStyle(tuple(colors), tuple(labels), tuple(lines), tuple(data))


def _split_bytes(plan: DevicePlan, names: set[str]) -> dict[str, dict[Device, int]]:
    """Bytes per device under every drawn module that the plan splits."""
    out: dict[str, dict[Device, int]] = {}
    for p in plan.placements:
        for anc in ancestors(parent(p.name)) if p.name else ():
            if anc in names:
                per = out.setdefault(anc, {})
                per[p.device] = per.get(p.device, 0) + p.nbytes
    return out


def _only_device(parts: Mapping[Device, int]) -> Device | None:
    """The device of a module planned in parts when every part with bytes is on it."""
    holding = {d for d, b in parts.items() if b} or set(parts)
    return holding.pop() if len(holding) == 1 else None


def _reason(name: str, key: str | None, by_name: Mapping[str, Any], split: Mapping[str, Mapping[Device, int]]) -> str:
    if key is None:
        parts = sorted(split.get(name, {}).items(), key=lambda kv: device_sort_key(kv[0]))
        if _only_device(dict(parts)) is not None:
            return f"planned in parts, all on {device_label(_only_device(dict(parts)))}"
        return "split: " + ", ".join(f"{format_size(b)} on {device_label(d)}" for d, b in parts)
    if key != name:  # the unit's own tile carries the full reason; repeating it bloats the figure
        return f"placed with {key or '<model>'}, of which it is part"
    return by_name[key].reason


def plan_of(plan_or_planner: Any) -> DevicePlan:
    """The plan of a :class:`DevicePlan` or of anything with a ``.plan`` (a Planner)."""
    plan = plan_or_planner if isinstance(plan_or_planner, DevicePlan) else getattr(plan_or_planner, "plan", None)
    if not isinstance(plan, DevicePlan):
        raise ArgumentTypeError(f"expected a DevicePlan or a Planner, got {type(plan_or_planner).__name__}")
    if plan.tree is None:
        raise UsageError(
            "this DevicePlan carries no size tree (plan.tree is None): make it with "
            "bigviz.plan(...) or make_plan(tree, ...), which keep the tree"
        )
    return plan


def treemap(
    plan_or_planner: Any, *, depth: int | None = None, height: int = 560, title: str | None = None
) -> go.Figure:
    """A plotly treemap of where every module goes.

    The figure is a :class:`~bigviz.ui.treefigure.TreemapFigure`: in a notebook it shows
    plotly's interactive figure and, for readers without plotly's JavaScript (GitHub,
    nbviewer, offline), the same treemap as SVG (``fig.to_svg()``).

    Args:
        plan_or_planner: a :class:`DevicePlan` (from ``bigviz.plan``) or a ``Planner``,
            coloured by device; or a ``PipelinePlan`` (from ``bigviz.plan_pipeline``),
            coloured by pipeline stage.
        depth: module levels drawn below the model (``None``: all; a Planner's own depth
            control when given a Planner). Click a tile to zoom into it.
        height: figure height in pixels.
        title: figure title (default: model class, size and strategy).

    Example:
        >>> import torch.nn as nn, bigviz
        >>> fig = treemap(bigviz.plan(nn.Sequential(nn.Linear(8, 8)), {"cpu": "1MB"}), depth=1)
        >>> fig.data[0].maxdepth, fig.data[0].branchvalues
        (2, 'total')
    """
    if isinstance(plan_or_planner, PipelinePlan):
        if plan_or_planner.tree is None:
            raise UsageError(
                "this PipelinePlan carries no size tree: make it with bigviz.plan_pipeline(...) "
                "or PipelinePlan.load_json(path, tree=...)"
            )
        layout = layout_of(plan_or_planner.tree)
        return figure_of(
            layout,
            style_for(layout, plan_or_planner),
            depth=depth,
            height=height,
            title=title if title is not None else figure_title(plan_or_planner),
        )
    plan = plan_of(plan_or_planner)
    if depth is None and not isinstance(plan_or_planner, DevicePlan):
        depth = getattr(plan_or_planner, "depth", None)
    assert plan.tree is not None  # checked by plan_of
    layout = layout_of(plan.tree)
    return figure_of(
        layout,
        style_of(layout, plan),
        depth=depth,
        height=height,
        title=title if title is not None else figure_title(plan),
    )


def figure_of(layout: TreemapLayout, style: TreemapStyle, *, depth: int | None, height: int, title: str) -> go.Figure:
    """The plotly figure for a treemap's shape and style."""
    import plotly.graph_objects as go

    trace = go.Treemap(
        ids=list(layout.ids),
        parents=list(layout.parents),
        values=list(layout.values),
        labels=list(style.labels),
        branchvalues="total",
        sort=False,
        marker=dict(colors=list(style.colors), line=dict(width=BORDER_WIDTH, color=list(style.line_colors))),
        customdata=[list(c) for c in style.customdata],
        hovertemplate=HOVER,
        texttemplate="%{label}<br>%{customdata[1]}",
        maxdepth=maxdepth_for(depth),
        pathbar=dict(visible=True),
        root=dict(color=style.colors[0]),
    )
    from bigviz.ui.treefigure import TreemapFigure

    fig = TreemapFigure(trace)
    fig.update_layout(
        height=height,
        margin=dict(t=66, l=6, r=6, b=6),  # title above, path bar below it
        title=dict(text=title, font=dict(size=15)),
        uniformtext=dict(minsize=9, mode="hide"),
    )
    return fig


def style_for(layout: TreemapLayout, plan: DevicePlan | PipelinePlan) -> TreemapStyle:
    """The style of a device plan (by device) or of a pipeline plan (by stage)."""
    if isinstance(plan, PipelinePlan):
        return stage_style_of(layout, plan)
    return style_of(layout, plan)


def maxdepth_for(depth: int | None) -> int:
    """plotly counts the root as a level: showing ``depth`` module levels needs one more."""
    return -1 if depth is None else max(int(depth), 1) + 1


def figure_title(plan: DevicePlan | PipelinePlan) -> str:
    """The treemap's title: model class, size, parameters and strategy (or stages)."""
    if isinstance(plan, PipelinePlan):
        return stage_title(plan)
    assert plan.tree is not None
    root = plan.tree.nodes[""]
    return (
        f"{root.class_name or 'model'}: {format_size(root.total_bytes)}, "
        f"{root.n_params / 1e6:,.1f}M parameters, {plan.strategy} plan"
    )


def apply_style(trace: Any, style: TreemapStyle, previous: TreemapStyle | None = None) -> None:
    """Set a treemap trace's per-plan properties, skipping those equal to ``previous``
    (each one set on a FigureWidget is sent to the browser). Call it inside
    ``fig.batch_update()`` so the browser redraws once."""
    if previous is None or style.colors != previous.colors:
        trace.marker.colors = style.colors
        trace.root.color = style.colors[0]
    if previous is None or style.labels != previous.labels:
        trace.labels = style.labels
    if previous is None or style.line_colors != previous.line_colors:
        trace.marker.line.color = style.line_colors
    if previous is None or style.customdata != previous.customdata:
        trace.customdata = style.customdata


def apply_layout(trace: Any, layout: TreemapLayout) -> None:
    """Set a treemap trace's shape (after a dtype change resized the tree)."""
    trace.ids = layout.ids
    trace.parents = layout.parents
    trace.values = layout.values
