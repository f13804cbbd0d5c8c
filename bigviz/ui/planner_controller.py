"""The Planner's controller: widget events in, changes to the plan's settings out.

Each handler reads what a control says and calls the :class:`~bigviz.ui.planner.Planner`'s
public method that does it (so a click and a line of code take the same path); an error in a
handler is shown in the Planner's log and status line, never lost in the frontend
(:func:`guarded`). Nothing is drawn here (:mod:`bigviz.ui.planner_view`) and nothing is planned
here (:mod:`bigviz.ui.state`).

Example:
    >>> import torch.nn as nn
    >>> from bigviz.ui.planner import Planner
    >>> planner = Planner(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), {"cpu": "1MB"})
    >>> planner.controls.strategy.value = "sequential"  # the controller re-plans
    >>> planner.plan.strategy
    'sequential'
"""

from __future__ import annotations

import functools
import html
import json
import os
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from bigviz.core.devices import Device
from bigviz.core.planner import check_no_split
from bigviz.ui import controls as ctl
from bigviz.ui.presets import DTYPE_CHOICES
from bigviz.ui.run import describe_error

__all__ = ["PlannerController", "guarded"]


def guarded(method: Callable[..., None]) -> Callable[..., None]:
    """A widget callback whose errors land, visible, in the planner's log (not lost)."""

    @functools.wraps(method)
    def callback(self: PlannerController, *args: Any) -> None:
        if self.planner.quiet:
            return
        try:
            method(self, *args)
        except Exception as err:  # shown to the person at the controls, who can fix it
            self.planner.controls.status.value = describe_error(err)
            self.planner.controls.log.append_stderr(traceback.format_exc())

    return callback


class PlannerController:
    """Connects a Planner's widgets to its methods (:meth:`wire`), one handler per control.

    Args:
        planner: The :class:`~bigviz.ui.planner.Planner` (which makes its controller: the
            controller knows it only by the methods it calls, so the two files do not import
            each other).
    """

    def __init__(self, planner: Any) -> None:
        self.planner = planner

    def wire(self) -> None:
        p = self.planner
        c = p.controls
        c.preset.observe(self.on_preset, names="value")
        c.add_gpu.on_click(self.on_add_gpu)
        c.remove_gpu.on_click(self.on_remove_gpu)
        c.strategy.observe(self.on_strategy, names="value")
        c.dtype.observe(self.on_dtype, names="value")
        c.no_split.observe(self.on_no_split, names="value")
        c.link.observe(self.on_bandwidth, names="value")
        c.disk.observe(self.on_bandwidth, names="value")
        c.depth.observe(self.on_depth, names="value")
        c.assign.on_click(self.on_assign)
        c.unassign.on_click(self.on_unassign)
        c.save_json.on_click(self.on_save_json)
        c.save_html.on_click(self.on_save_html)
        c.run.on_click(self.on_run)
        for control in (p.stage_controls.mode, p.stage_controls.count, p.stage_controls.balance):
            control.observe(self.on_stages, names="value")
        c.batch.observe(self.on_workload, names="value")
        c.context.observe(self.on_workload, names="value")
        c.kv_dtype.observe(self.on_workload, names="value")
        c.find_context.on_click(self.on_find_context)
        p.view.on_pick(self.on_pick)

    @guarded
    def on_budget(self, device: Device, change: Mapping[str, Any]) -> None:
        self.planner.state.set_budget(device, round(change["new"] * ctl.GiB))
        self.planner.refresh()

    @guarded
    def on_reserve(self, device: Device, change: Mapping[str, Any]) -> None:
        self.planner.state.set_reserve(device, round(change["new"] * ctl.GiB))
        self.planner.refresh()

    @guarded
    def on_preset(self, change: Mapping[str, Any]) -> None:
        if change["new"] != ctl.CUSTOM:
            self.planner.apply_preset(change["new"])

    @guarded
    def on_add_gpu(self, _button: Any) -> None:
        self.planner.add_gpu()

    @guarded
    def on_remove_gpu(self, _button: Any) -> None:
        self.planner.remove_gpu()

    @guarded
    def on_strategy(self, change: Mapping[str, Any]) -> None:
        self.planner.state.strategy = change["new"]
        self.planner.refresh()

    @guarded
    def on_dtype(self, change: Mapping[str, Any]) -> None:
        self.planner.state.set_dtype(DTYPE_CHOICES[change["new"]])
        self.planner.sync_device_rows()  # a bigger dtype may need longer sliders
        self.planner.refresh()

    @guarded
    def on_no_split(self, change: Mapping[str, Any]) -> None:
        names = tuple(s.strip() for s in change["new"].split(",") if s.strip())
        check_no_split(self.planner.state.base_tree, names)  # a typo is shown, not silently ignored
        self.planner.state.no_split = names
        self.planner.refresh()

    @guarded
    def on_bandwidth(self, _change: Mapping[str, Any]) -> None:
        self.planner.show_cost()

    @guarded
    def on_depth(self, change: Mapping[str, Any]) -> None:
        self.planner.depth = change["new"]
        self.planner.view.set_depth(self.planner.depth)

    @guarded
    def on_stages(self, _change: Mapping[str, Any]) -> None:
        self.planner.refresh()

    def on_pick(self, module: str) -> None:
        """A treemap tile was clicked: its module goes into the search box, ready to assign."""
        self.planner.controls.module.value = module

    @guarded
    def on_assign(self, _button: Any) -> None:
        c = self.planner.controls
        self.planner.assign(c.module.value, c.target.value)

    @guarded
    def on_unassign(self, _button: Any) -> None:
        self.planner.unassign(self.planner.controls.module.value)

    @guarded
    def on_save_json(self, _button: Any) -> None:
        c = self.planner.controls
        path = self.planner.save_json(c.json_path.value)
        text = json.dumps(self.planner.device_map, indent=1)
        c.json_view.value = (
            f"<div>Wrote <code>{html.escape(os.path.abspath(path))}</code>:</div>"
            f"<pre style='max-height:300px;overflow:auto'>{html.escape(text)}</pre>"
        )

    @guarded
    def on_save_html(self, _button: Any) -> None:
        c = self.planner.controls
        path = self.planner.save_html(c.html_path.value)
        c.json_view.value = f"<div>Wrote <code>{html.escape(os.path.abspath(path))}</code></div>"

    @guarded
    def on_workload(self, _change: Mapping[str, Any]) -> None:
        c = self.planner.controls
        self.planner.set_workload(
            batch_size=c.batch.value, context_length=c.context.value, kv_dtype=ctl.KV_DTYPES[c.kv_dtype.value]
        )

    @guarded
    def on_find_context(self, _button: Any) -> None:
        self.planner.find_longest_context()

    @guarded
    def on_run(self, _button: Any) -> None:
        c = self.planner.controls
        kwargs = {"offload_folder": c.offload_folder.value} if c.offload_folder.value else {}
        self.planner.load_and_dispatch(c.checkpoint.value, **kwargs)
