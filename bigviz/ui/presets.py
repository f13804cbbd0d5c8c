"""The Planner's choices of hardware, dtype and bandwidth, and the cost sentence it shows.

The hardware presets and bandwidths are pure data in :mod:`bigviz.core.hardware`
(re-exported here), the cost model in :mod:`bigviz.core.cost` (``DevicePlan.cost()``); this
module adds the dtype choices of the dtype dropdown and the cost as HTML.

Example:
    >>> budgets = preset_budgets("2x A100 80 GB")
    >>> sorted(budgets, key=str), budgets[1] // 2**30
    ([0, 1, 'cpu'], 80)
    >>> from bigviz.core.cost import UnitCost, predict_forward
    >>> "nothing is offloaded" in cost_html(predict_forward([UnitCost("a")], disk_bandwidth=1e9))
    True
"""

from __future__ import annotations

import html

from bigviz.core.cost import ForwardEstimate
from bigviz.core.hardware import DISK_BANDWIDTH, HARDWARE_PRESETS, LINK_BANDWIDTH, preset_budgets
from bigviz.core.sizes import format_seconds, format_size

__all__ = [
    "HARDWARE_PRESETS",
    "DTYPE_CHOICES",
    "LINK_BANDWIDTH",
    "DISK_BANDWIDTH",
    "preset_budgets",
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


def cost_html(cost: ForwardEstimate, sentence: str = "") -> str:
    """One or two sentences saying what a plan costs per forward pass (``sentence``: the
    prediction in words, shown under it)."""
    if not cost.streamed:
        return "<div class='bigviz-cost'><b>Cost:</b> nothing is offloaded: no weights stream per forward pass.</div>"
    parts = []
    if cost.read_bytes:
        parts.append(f"{format_size(cost.read_bytes)} read from disk")
    if cost.copy_bytes:
        parts.append(f"{format_size(cost.copy_bytes)} copied to the GPU")
    times = [
        f"{what} {format_seconds(t)}" for what, t in (("link", cost.copy_seconds), ("disk", cost.read_seconds)) if t
    ]
    return (
        f"<div class='bigviz-cost'><b>Cost per forward pass:</b> {' and '.join(parts)}, "
        f"about <b>{format_seconds(cost.seconds)}</b> "
        f"({', '.join(times) + ', overlapped' if len(times) > 1 else ''.join(times)}). "
        f"Every generated token pays it again." + (f"<br>{html.escape(sentence)}" if sentence else "") + "</div>"
    )
