"""Pipeline stages in the treemap: the same module tree, coloured by the stage (rank) that
holds each module, with the cut's reason in the hover.

Stages take the GPU hues of the Okabe-Ito palette in order (stage 0 blue, 1 orange, 2 green,
...); a module whose parts lie in several stages (the model, the block list) is grey.

Example:
    >>> import torch, bigviz
    >>> from bigviz.models import GPT, GPTConfig
    >>> with torch.device("meta"):
    ...     model = GPT(GPTConfig.preset("gpt-tiny", n_layer=4))
    >>> fig = bigviz.treemap(bigviz.plan_pipeline(model, 2))
    >>> colours = dict(zip(fig.data[0].ids, fig.data[0].marker.colors))
    >>> colours["/transformer.h.0"] == stage_color(0), colours["/transformer.h.3"] == stage_color(1)
    (True, True)
"""

from __future__ import annotations

from collections.abc import Mapping

from bigviz.core.names import ancestors, owner, parent
from bigviz.core.pipeline import PipelinePlan
from bigviz.core.sizes import format_size
from bigviz.ui.palette import SPLIT_COLOR, chip, device_color
from bigviz.ui.tiles import TreemapLayout, TreemapStyle

__all__ = ["stage_color", "stage_style_of", "stage_title", "stage_legend_html"]


def stage_color(stage: int | None) -> str:
    """The colour of a pipeline stage (the GPU hues, in order); grey for ``None`` (several).

    Example:
        >>> stage_color(0), stage_color(1), stage_color(None)
        ('#0072B2', '#E69F00', '#E8E8E8')
    """
    return SPLIT_COLOR if stage is None else device_color(stage)


def _spans(plan: PipelinePlan, names: set[str]) -> dict[str, set[int]]:
    """The stages of the units under every drawn module (the modules that hold units)."""
    out: dict[str, set[int]] = {}
    for unit in plan.units:
        for anc in ancestors(parent(unit.name)) if unit.name else ():
            if anc in names:
                out.setdefault(anc, set()).add(unit.stage)
    return out


def stage_style_of(layout: TreemapLayout, plan: PipelinePlan) -> TreemapStyle:
    """Colours and hover data of every treemap node under a pipeline plan."""
    units = {u.name: u for u in plan.units}
    spans = _spans(plan, set(layout.names))
    tied = _tied_notes(plan)
    total = layout.total or 1
    colors, data = [], []
    for name, value in zip(layout.names, layout.values):
        key = owner(name, units)
        if key is not None:
            stage: int | None = units[key].stage
            reason = units[key].reason if key == name else f"part of {key or '<model>'}, in stage {stage}"
            reason += tied.get(name, "")
        else:
            stages = spans.get(name, set())
            stage = next(iter(stages)) if len(stages) == 1 else None
            reason = (
                f"in stage {stage}"
                if stage is not None
                else f"spans stages {min(stages, default=0)} .. {max(stages, default=0)}"
            )
        colors.append(stage_color(stage))
        where = f"stage {stage}" if stage is not None else "several stages"
        data.append((name or "<model>", format_size(value), f"{value / total:.1%}", where, reason))
    n = len(layout.names)
    return TreemapStyle(tuple(colors), layout.labels, ("#FFFFFF",) * n, tuple(data))


def _tied_notes(plan: PipelinePlan) -> Mapping[str, str]:
    """Hover text for the module of a tied tensor other stages load too."""
    return {
        parent(s.leader): f"; tied to {s.name}: stage {', '.join(map(str, s.stages[1:]))} loads it too"
        for s in plan.shared
    }


def stage_title(plan: PipelinePlan) -> str:
    """The figure title: model, size, stages and balance (and the run they hold)."""
    root = plan.tree.nodes[""] if plan.tree is not None else None
    size = format_size(root.total_bytes) if root is not None else ""
    name = (root.class_name if root is not None else "") or "model"
    title = f"{name}: {size}, {plan.n_stages} pipeline stages balanced by {plan.balance}"
    if plan.run is not None:
        title += f"; run: batch {plan.run.batch_size}, {plan.run.context_length} tokens"
    return title


def _stage_chip_text(plan: PipelinePlan, stage: int) -> str:
    """``"stage 0: 1.2 GiB"``, with a run ``"stage 0: 1.2 GiB weights + 64 MiB KV cache + 8 MiB
    activations = ..."``, and the budget."""
    budget = plan.budgets[stage]
    text = f"stage {stage}: {format_size(plan.stage_bytes[stage])}"
    if plan.run is not None:
        text = f"stage {stage}: {plan.stage_text(stage)}"
    return text + (f" of {format_size(budget)}" if budget is not None else "")


def stage_legend_html(plan: PipelinePlan) -> str:
    """One chip per stage with its bytes (weights, KV cache and activations when the plan
    counts a run) and budget, then the split chip.

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> from bigviz.core.stages import make_pipeline_plan
        >>> t = SizeTree.build([TensorSpec(f"h.{i}.w", 256, "float32") for i in range(2)])
        >>> "stage 1: 1.0 KiB" in stage_legend_html(make_pipeline_plan(t, 2, no_split=["h.*"]))
        True
    """
    chips = [chip(i, _stage_chip_text(plan, i)) for i in range(plan.n_stages)]
    chips.append(chip(None, "several stages"))
    return f"<div class='bigviz-legend' style='line-height:1.9'>{''.join(chips)}</div>"


class StageControls:
    """The Planner's stage mode: colour the treemap by devices or by pipeline stages, how
    many stages, balanced by bytes or compute, and a line per cut.

    Attributes:
        mode: ``"devices"`` or ``"stages"`` (a toggle).
        count: the number of stages.
        balance: ``"bytes"`` or ``"compute"``.
        summary: the plan's stages and cuts, as HTML.
        widget: the row to lay out.
    """

    def __init__(self, *, max_stages: int) -> None:
        import ipywidgets as widgets

        self.mode = widgets.ToggleButtons(
            options=["devices", "stages"], value="devices", description="colour by", style={"button_width": "80px"}
        )
        self.count = widgets.BoundedIntText(
            value=min(2, max(max_stages, 1)),
            min=1,
            max=max(max_stages, 1),
            description="stages",
            layout=widgets.Layout(width="150px"),
        )
        self.balance = widgets.Dropdown(
            options=["bytes", "compute"], value="bytes", description="balance", layout=widgets.Layout(width="200px")
        )
        self.summary = widgets.HTML()
        self.widget = widgets.VBox([widgets.HBox([self.mode, self.count, self.balance]), self.summary])

    def show(self, plan: PipelinePlan | None) -> None:
        """Describe ``plan`` (``None``: device mode, nothing to say)."""
        if plan is None:
            self.summary.value = ""
            return
        import html

        cuts = "".join(
            f"<li>stage {c.stage} begins at <code>{html.escape(c.before)}</code>: {html.escape(c.reason)}</li>"
            for c in plan.cuts
        )
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in plan.notes)
        self.summary.value = f"<ul style='font-size:12px;margin:2px 0'>{cuts}{notes}</ul>"

    def close(self) -> None:
        for w in (self.mode, self.count, self.balance, self.summary, self.widget):
            w.close()
