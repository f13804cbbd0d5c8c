"""The live treemap's first display: the browser's model starts with the figure in it.

plotly's view draws the model's data once, when it renders, and ignores later data updates; a
comm opened before the data arrives can leave the first display blank for good on a slow
machine (tests/browser runs the cell in JupyterLab and Notebook 7 under load). Here, without a
browser: what the comm_open message carries, for a bare LiveFigure and for the Planner's.
"""

from __future__ import annotations

from typing import Any

import comm
import plotly.graph_objects as go
import pytest
import torch

import bigviz
from bigviz.ui.livefigure import LiveFigure


@pytest.fixture
def opened(monkeypatch) -> list[dict[str, Any]]:
    """The state of every widget comm opened while the test runs (as the browser receives it)."""
    states: list[dict[str, Any]] = []
    create = comm.create_comm

    def recording(**kwargs: Any) -> Any:
        if kwargs.get("target_name") == "jupyter.widget":
            states.append(kwargs["data"]["state"])
        return create(**kwargs)

    monkeypatch.setattr(comm, "create_comm", recording)
    return states


def _figures(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in states if "_widget_data" in s]


def test_the_comm_opens_with_the_figure(opened):
    fig = LiveFigure(go.Figure(go.Treemap(ids=["r", "a"], parents=["", "r"], values=[3, 3]), layout={"height": 300}))
    (state,) = _figures(opened)
    assert state["_widget_data"][0]["ids"] == ["r", "a"] and state["_widget_data"][0]["values"] == [3, 3]
    assert state["_widget_layout"]["height"] == 300
    assert fig.comm is not None and fig.model_id  # opened once, at the end of __init__
    with fig.batch_update():  # later changes still go out as plotly's update messages
        fig.data[0].values = [4, 4]
    assert fig.get_state()["_widget_data"][0]["values"] == [4, 4]


def test_the_planners_treemap_opens_with_its_tiles(opened):
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    planner = bigviz.Planner(model, {"cpu": "10KiB"})
    trace = _figures(opened)[-1]["_widget_data"][0]
    assert len(trace["ids"]) >= 5 and list(trace["marker"]["colors"]) == list(planner.view.colors)


def test_a_figure_whose_updates_are_lost_is_shown_anew(opened, monkeypatch):
    """anywidget drops a model's messages when its code took over 2 s to load (a busy machine):
    the view keeps its first state. plotly's view answers each update it applies; an update a
    drawn view never answered makes the Planner show a new figure widget with the current plan."""
    from bigviz.ui import livefigure

    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    planner = bigviz.Planner(model, {0: "10KiB", "cpu": "1MiB"}, strategy="sequential")
    first = planner.view.figure
    first._js2py_layoutDelta = {"layout_delta": {}, "layout_edit_id": 0}  # the view's first draw
    planner.budget_sliders[0].value = planner.budget_sliders[0].max  # a re-plan: an update sent
    assert not first.lost  # not yet: the view has LOST_AFTER_S to answer
    first._js2py_traceDeltas = {"trace_deltas": [], "trace_edit_id": first._last_trace_edit_id}  # answered
    monkeypatch.setattr(livefigure, "LOST_AFTER_S", 0.0)
    assert not first.lost
    planner.budget_sliders[0].value = planner.budget_sliders[0].min  # this one is never answered
    assert first.lost
    first._check()  # what the kernel's event loop runs LOST_AFTER_S after the update
    fresh = planner.view.figure
    assert fresh is not first and planner.view.box.children[0] is fresh and first.comm is None
    assert list(_figures(opened)[-1]["_widget_data"][0]["marker"]["colors"]) == list(planner.view.colors)
    assert not fresh.lost and fresh._config == first._config
