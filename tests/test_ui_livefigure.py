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
