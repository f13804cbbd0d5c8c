"""The Planner's choices of hardware, dtype and bandwidth, and the cost sentence it shows.

The hardware presets, bandwidths and the cost model itself are pure and live in
:mod:`bigviz.core.cost` (re-exported here); this module adds the dtype choices of the
dtype dropdown and the cost as HTML.

Example:
    >>> budgets = preset_budgets("2x A100 80 GB")
    >>> sorted(budgets, key=str), budgets[1] // 2**30
    ([0, 1, 'cpu'], 80)
    >>> "nothing is offloaded" in cost_html(plan_cost({"cpu": 0, "disk": 0}, main_device=0))
    True
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

from bigviz.core.cost import DISK_BANDWIDTH, HARDWARE_PRESETS, LINK_BANDWIDTH, plan_cost, preset_budgets
from bigviz.core.sizes import format_size

__all__ = [
    "HARDWARE_PRESETS",
    "DTYPE_CHOICES",
    "LINK_BANDWIDTH",
    "DISK_BANDWIDTH",
    "preset_budgets",
    "plan_cost",
    "cost_html",
]

DTYPE_CHOICES: dict[str, str | None] = {
    "as built": None,
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "int8 (torchao)": "int8",
    "int4 (bitsandbytes)": "int4",
}
"""Dropdown label -> dtype the planner re-sizes floating tensors to (``None``: unchanged);
``int8`` / ``int4``: the linear layers' weights quantized as ``load_checkpoint_and_dispatch(...,
quantization=...)`` loads them (see :mod:`bigviz.core.quant`)."""


def cost_html(cost: Mapping[str, Any]) -> str:
    """One or two sentences saying what a plan costs per forward pass."""
    if not cost["streamed_bytes"]:
        return "<div class='bigviz-cost'><b>Cost:</b> nothing is offloaded: no weights stream per forward pass.</div>"
    parts = []
    if cost["cpu_bytes"]:
        parts.append(f"{format_size(cost['cpu_bytes'])} from CPU RAM")
    if cost["disk_bytes"]:
        parts.append(f"{format_size(cost['disk_bytes'])} from disk")
    return (
        f"<div class='bigviz-cost'><b>Cost per forward pass:</b> {' and '.join(parts)} streamed in, "
        f"at least <b>{cost['seconds_per_forward'] * 1000:,.0f} ms</b> "
        f"(link {cost['link_seconds'] * 1000:,.0f} ms, disk {cost['disk_seconds'] * 1000:,.0f} ms). "
        f"Every generated token pays it again."
        + (f"<br>{html.escape(cost['forward'])}" if cost.get("forward") else "")
        + "</div>"
    )
