"""Device colours from the Okabe-Ito palette, which stays distinct under the common forms of
colour blindness, and the HTML legend chips a treemap lacks.

GPUs take one hue each, in index order; ``cpu``, ``disk`` and ``mps`` get hues no GPU uses
(mps replaces CUDA GPUs on a Mac, so it may share the sky blue of GPU 5). A module whose
parts live on several devices is drawn in a light neutral grey.

Example:
    >>> device_color(0), device_color("cpu"), device_color("disk")
    ('#0072B2', '#F0E442', '#6E6E6E')
"""

from __future__ import annotations

import html
from collections.abc import Iterable

from bigviz.core.devices import Device, device_label

__all__ = ["OKABE_ITO", "GPU_COLORS", "SPLIT_COLOR", "device_color", "text_color", "chip", "legend_html"]

OKABE_ITO = {
    "black": "#000000",
    "orange": "#E69F00",
    "sky_blue": "#56B4E9",
    "bluish_green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "reddish_purple": "#CC79A7",
}
GPU_COLORS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9")
# Past six GPUs the hues repeat, darkened, so GPU 6 still differs from GPU 0.
_DARKER = ("#004C77", "#9A6A00", "#00694D", "#8F4E75", "#8E3B00", "#2C7FB0")
_NAMED = {"cpu": "#F0E442", "disk": "#6E6E6E", "mps": "#56B4E9"}
SPLIT_COLOR = "#E8E8E8"
"""Colour of a module split across devices (its parts carry the device colours)."""
_DARK_TEXT = {"#F0E442", "#E69F00", "#56B4E9", "#CC79A7", "#E8E8E8"}


def device_color(device: Device | None) -> str:
    """The colour of a device; :data:`SPLIT_COLOR` for ``None`` (a split module).

    Example:
        >>> device_color(1), device_color(7), device_color(None)
        ('#E69F00', '#9A6A00', '#E8E8E8')
    """
    if device is None:
        return SPLIT_COLOR
    if isinstance(device, int):
        cycle, index = divmod(device, len(GPU_COLORS))
        return (GPU_COLORS if cycle % 2 == 0 else _DARKER)[index]
    return _NAMED.get(device, SPLIT_COLOR)


def text_color(background: str) -> str:
    """Black or white, whichever reads better on ``background``."""
    return "#000000" if background in _DARK_TEXT else "#FFFFFF"


def chip(device: Device | None, text: str | None = None) -> str:
    """A small coloured label for a device, as inline HTML.

    Example:
        >>> "GPU 0" in chip(0)
        True
    """
    color = device_color(device)
    label = html.escape(text if text is not None else (device_label(device) if device is not None else "split"))
    return (
        f"<span style='display:inline-block;padding:1px 7px;margin:1px 3px 1px 0;border-radius:3px;"
        f"background:{color};color:{text_color(color)};font-size:12px;white-space:nowrap'>{label}</span>"
    )


def legend_html(
    devices: Iterable[Device], *, captions: dict[Device, str] | None = None, show_split: bool = True
) -> str:
    """A row of chips, one per device (treemaps have no legend of their own).

    Args:
        devices: the devices to show, in order.
        captions: optional text after each device's name (``"3.1 GiB of 8.0 GiB"``).
        show_split: add the grey chip that marks modules split across devices.

    Example:
        >>> html_text = legend_html([0, "cpu"], captions={0: "1 GiB"})
        >>> "GPU 0: 1 GiB" in html_text and "CPU" in html_text
        True
    """
    captions = captions or {}
    chips = [chip(d, f"{device_label(d)}: {captions[d]}" if d in captions else None) for d in devices]
    if show_split:
        chips.append(chip(None, "split across devices"))
    return f"<div class='bigviz-legend' style='line-height:1.9'>{''.join(chips)}</div>"
