"""The Planner's widgets, built and laid out; :mod:`bigviz.ui.planner` wires them up.

Budgets are shown in GiB. Slider ranges follow the model: from 0 to a round number above
both the budget and 1.25x the model, so the part of the range where placements change is
wide enough to drag through.

Example:
    >>> slider_spec(8 * 2**30, 6 * 2**30)
    (10.0, 0.02, '.2f')
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from typing import Any

import ipywidgets as widgets

from bigviz.core.plan import STRATEGIES
from bigviz.core.devices import Device, device_label
from bigviz.ui.palette import chip
from bigviz.core.hardware import DISK_BANDWIDTH, HARDWARE_PRESETS, LINK_BANDWIDTH
from bigviz.ui.presets import DTYPE_CHOICES

__all__ = [
    "GiB",
    "CUSTOM",
    "KV_DTYPES",
    "slider_spec",
    "Controls",
    "make_controls",
    "budget_row",
    "DeviceRows",
    "assemble",
]

GiB = 2**30
CUSTOM = "(custom budgets)"


def _nice(x: float, *, up: bool) -> float:
    """The nearest 1-2-2.5-5 x 10^k at or above (``up``) or below ``x``."""
    if x <= 0:
        return 1.0
    base = 10.0 ** math.floor(math.log10(x))
    steps = (1, 2, 2.5, 5, 10)
    if up:
        return next(m * base for m in steps if m * base >= x * (1 - 1e-9))
    return max(m * base for m in steps if m * base <= x * (1 + 1e-9))


def slider_spec(budget: int, model_bytes: int) -> tuple[float, float, str]:
    """``(max, step, readout_format)`` in GiB for a budget slider."""
    top = _nice(max(budget, 1.25 * model_bytes, 1) / GiB, up=True)
    step = _nice(top / 500, up=False)
    digits = max(0, -math.floor(math.log10(step)))
    return top, step, f".{digits}f"


@dataclass
class Controls:
    """Every control of the Planner (the device rows live in ``devices``)."""

    title: widgets.HTML
    status: widgets.HTML
    log: widgets.Output
    preset: widgets.Dropdown
    devices: widgets.VBox
    add_gpu: widgets.Button
    remove_gpu: widgets.Button
    strategy: widgets.Dropdown
    dtype: widgets.Dropdown
    no_split: widgets.Text
    usage: widgets.HTML
    link: widgets.Dropdown
    disk: widgets.Dropdown
    cost: widgets.HTML
    legend: widgets.HTML
    depth: widgets.IntSlider
    table: widgets.HTML
    dispatch: widgets.HTML
    module: widgets.Combobox
    target: widgets.Dropdown
    assign: widgets.Button
    unassign: widgets.Button
    overrides: widgets.HTML
    json_path: widgets.Text
    save_json: widgets.Button
    json_view: widgets.HTML
    html_path: widgets.Text
    save_html: widgets.Button
    checkpoint: widgets.Text
    offload_folder: widgets.Text
    run: widgets.Button
    progress: widgets.IntProgress
    run_result: widgets.HTML
    batch: widgets.BoundedIntText
    context: widgets.BoundedIntText
    kv_dtype: widgets.Dropdown
    find_context: widgets.Button
    fit: widgets.HTML

    def close(self) -> None:
        for f in fields(self):
            getattr(self, f.name).close()


def _label(text: str, width: str = "110px") -> widgets.Label:
    return widgets.Label(text, layout=widgets.Layout(width=width))


KV_DTYPES: dict[str, str | None] = {
    "as compute": None,
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float8": "float8_e4m3fn",
    "float32": "float32",
}
"""Dropdown label -> dtype of the KV cache (``None``: the compute dtype)."""


def make_controls(
    *,
    strategy: str,
    dtype_label: str,
    no_split: str,
    modules: list[str],
    depth: int,
    max_depth: int,
    batch: int = 1,
    context: int = 0,
    kv_label: str = "as compute",
    max_context: int | None = None,
) -> Controls:
    """Build the controls (the per-device rows are added by :func:`budget_row`)."""
    wide = widgets.Layout(width="98%")
    narrow = {"description_width": "60px"}
    return Controls(
        title=widgets.HTML(),
        status=widgets.HTML(),
        log=widgets.Output(),
        preset=widgets.Dropdown(options=[CUSTOM, *HARDWARE_PRESETS], value=CUSTOM, description="hardware", layout=wide),
        devices=widgets.VBox(),
        add_gpu=widgets.Button(
            description="+ GPU", tooltip="add a GPU with the last GPU's budget", layout=widgets.Layout(width="90px")
        ),
        remove_gpu=widgets.Button(
            description="- GPU", tooltip="remove the last GPU", layout=widgets.Layout(width="90px")
        ),
        strategy=widgets.Dropdown(options=list(STRATEGIES), value=strategy, description="strategy"),
        dtype=widgets.Dropdown(options=list(DTYPE_CHOICES), value=dtype_label, description="dtype"),
        no_split=widgets.Text(
            value=no_split,
            description="no-split",
            continuous_update=False,
            layout=wide,
            placeholder="classes or name globs, comma-separated",
        ),
        usage=widgets.HTML(),
        legend=widgets.HTML(),
        cost=widgets.HTML(),
        table=widgets.HTML(),
        dispatch=widgets.HTML(),
        link=widgets.Dropdown(
            options=list(LINK_BANDWIDTH), value="PCIe 4 x16 (~25 GB/s pinned)", description="link", layout=wide
        ),
        disk=widgets.Dropdown(options=list(DISK_BANDWIDTH), value="NVMe (~3 GB/s)", description="disk", layout=wide),
        depth=widgets.IntSlider(
            value=depth, min=1, max=max(max_depth, 1), description="depth", continuous_update=False
        ),
        module=widgets.Combobox(
            options=modules,
            placeholder="type to search a module",
            description="module",
            ensure_option=False,
            layout=widgets.Layout(width="420px"),
        ),
        target=widgets.Dropdown(description="device", layout=widgets.Layout(width="200px")),
        assign=widgets.Button(description="Assign", button_style="primary"),
        unassign=widgets.Button(description="Unassign"),
        overrides=widgets.HTML(),
        json_path=widgets.Text(value="device_map.json", description="JSON"),
        save_json=widgets.Button(description="Save JSON", icon="save"),
        json_view=widgets.HTML(),
        html_path=widgets.Text(value="plan.html", description="report"),
        save_html=widgets.Button(description="Save HTML report", icon="save"),
        checkpoint=widgets.Text(
            description="checkpoint",
            placeholder="folder, index or .safetensors file",
            layout=widgets.Layout(width="420px"),
        ),
        offload_folder=widgets.Text(
            description="offload to",
            placeholder="(optional) folder for disk weights",
            layout=widgets.Layout(width="420px"),
        ),
        run=widgets.Button(description="Load and dispatch", button_style="warning", icon="play"),
        progress=widgets.IntProgress(value=0, min=0, max=3, description="", layout=widgets.Layout(width="300px")),
        run_result=widgets.HTML(),
        batch=widgets.BoundedIntText(
            value=batch,
            min=1,
            max=1 << 20,
            description="batch",
            style=narrow,
            layout=widgets.Layout(width="150px"),
            continuous_update=False,
        ),
        context=widgets.BoundedIntText(
            value=context,
            min=0,
            max=max_context or 1 << 24,
            step=1024,
            description="context",
            style=narrow,
            continuous_update=False,
            tooltip="tokens each sequence's KV cache holds; 0: weights only",
            layout=widgets.Layout(width="190px"),
        ),
        kv_dtype=widgets.Dropdown(
            options=list(KV_DTYPES),
            value=kv_label,
            description="KV dtype",
            style=narrow,
            layout=widgets.Layout(width="230px"),
        ),
        find_context=widgets.Button(
            description="Longest context",
            icon="search",
            tooltip="find the longest context that fits these budgets (bisection)",
        ),
        fit=widgets.HTML(),
    )


def budget_row(
    device: Device, budget: int, reserve: int, model_bytes: int
) -> tuple[widgets.HBox, widgets.FloatSlider, widgets.BoundedFloatText]:
    """One device's row: its chip, a budget slider and a reserve box, both in GiB."""
    top, step, fmt = slider_spec(budget, model_bytes)
    slider = widgets.FloatSlider(
        value=budget / GiB,
        min=0.0,
        max=top,
        step=step,
        readout_format=fmt,
        continuous_update=False,
        description="GiB",
        style={"description_width": "28px"},
        layout=widgets.Layout(width="250px"),
    )
    reserve_box = widgets.BoundedFloatText(
        value=reserve / GiB,
        min=0.0,
        max=top,
        step=step * 10,
        description="reserve",
        style={"description_width": "50px"},
        tooltip="GiB kept free for activations and KV cache",
        layout=widgets.Layout(width="130px"),
    )
    name = widgets.HTML(chip(device), layout=widgets.Layout(width="62px"))
    return widgets.HBox([name, slider, reserve_box]), slider, reserve_box


class DeviceRows:
    """The per-device rows, kept in step with the budgets: rows of devices still there are
    kept, so references to their sliders stay valid across presets and added GPUs."""

    def __init__(self, box: widgets.VBox, on_budget: Callable[..., None], on_reserve: Callable[..., None]) -> None:
        self.box = box
        self.on_budget, self.on_reserve = on_budget, on_reserve
        self.sliders: dict[Device, widgets.FloatSlider] = {}
        self.reserves: dict[Device, widgets.BoundedFloatText] = {}
        self.rows: dict[Device, widgets.HBox] = {}

    def sync(
        self,
        budgets: Mapping[Device, int],
        reserve: Mapping[Device, int],
        model_bytes: int,
        quietly: Callable[[], AbstractContextManager[None]],
    ) -> None:
        """Show ``budgets``; values set here do not fire the callbacks (``quietly``)."""
        for device in [d for d in self.sliders if d not in budgets]:
            for table in (self.sliders, self.reserves, self.rows):
                table.pop(device).close()
        for device, budget in budgets.items():
            if device not in self.sliders:
                row, slider, box = budget_row(device, budget, reserve.get(device, 0), model_bytes)
                slider.observe(functools.partial(self.on_budget, device), names="value")
                box.observe(functools.partial(self.on_reserve, device), names="value")
                self.sliders[device], self.reserves[device], self.rows[device] = slider, box, row
                continue
            slider, box = self.sliders[device], self.reserves[device]
            with quietly():
                slider.max = box.max = max(slider.max, slider_spec(budget, model_bytes)[0])
                slider.value = budget / GiB
                box.value = reserve.get(device, 0) / GiB
        for table in (self.sliders, self.reserves, self.rows):  # in fill order, in place
            ordered = [(d, table.pop(d)) for d in budgets]
            table.update(ordered)
        self.box.children = [self.rows[d] for d in budgets]


def assemble(c: Controls, figure: Any, *below: Any) -> widgets.VBox:
    """Lay the controls out: settings on the left, treemap on the right (``below`` it: more
    controls of the figure, such as the stage mode), tabs below.

    The treemap's column takes the width left by the settings (it never pushes past the
    output area: the figure fits it, see ``bigviz.ui.livefigure``); below 300 px it wraps
    under the settings at full width. The status line keeps its height when empty, so a
    re-plan message does not shift the app.
    """
    left = widgets.VBox(
        [
            c.preset,
            c.devices,
            widgets.HBox([c.add_gpu, c.remove_gpu]),
            c.strategy,
            c.dtype,
            c.no_split,
            widgets.HTML("<b>Run</b> (KV cache and prefill activations)"),
            widgets.HBox([c.batch, c.context]),
            widgets.HBox([c.kv_dtype, c.find_context]),
            c.fit,
            widgets.HTML("<b>Memory</b>"),
            c.usage,
            widgets.HTML("<b>Cost</b>"),
            c.link,
            c.disk,
            c.cost,
        ],
        layout=widgets.Layout(width="460px", min_width="460px"),
    )
    right = widgets.VBox(
        [c.legend, figure, *below, c.depth],
        layout=widgets.Layout(flex="1 1 300px", min_width="300px", overflow="hidden"),
    )
    c.status.layout = widgets.Layout(min_height="28px")  # one line of widget text
    overrides = widgets.VBox([widgets.HBox([c.module, c.target]), widgets.HBox([c.assign, c.unassign]), c.overrides])
    export = widgets.VBox(
        [widgets.HBox([c.json_path, c.save_json]), widgets.HBox([c.html_path, c.save_html]), c.json_view]
    )
    run = widgets.VBox([c.checkpoint, c.offload_folder, widgets.HBox([c.run, c.progress]), c.run_result])
    table = widgets.Box([c.table], layout=widgets.Layout(max_height="420px", overflow="auto"))
    dispatch = widgets.Box([c.dispatch], layout=widgets.Layout(max_height="420px", overflow="auto"))
    tabs = widgets.Tab(
        children=[table, dispatch, overrides, export, run],
        titles=("Placements", "Dispatch", "Overrides", "Export", "Run"),
    )
    body = widgets.HBox([left, right], layout=widgets.Layout(flex_flow="row wrap", width="100%"))
    return widgets.VBox([c.title, c.status, c.log, body, tabs])


def device_options(devices: list[Device]) -> list[tuple[str, Device]]:
    """``(label, device)`` pairs for a device dropdown."""
    return [(device_label(d), d) for d in devices]
