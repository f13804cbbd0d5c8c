"""What hardware you plan for: memory presets of common machines, link and disk bandwidths
(pure data; what a plan costs at them is :mod:`bigviz.core.cost`'s, through
``DevicePlan.cost()``).

GPU budgets are the card's memory as ``nvidia-smi`` reports it; the 1 to 2 GB a CUDA context
takes is not subtracted (use the planner's per-device reserve for it and for activations).
Apple's unified memory is one pool: macOS lets the GPU wire about two thirds of it, so the
``mps`` budget is two thirds and the ``cpu`` budget most of the rest.

Example:
    >>> budgets = preset_budgets("2x A100 80 GB")
    >>> sorted(budgets, key=str), budgets[1] // 2**30
    ([0, 1, 'cpu'], 80)
    >>> find_bandwidth("PCIe 4", LINK_BANDWIDTH, "link") / 1e9
    25.0
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bigviz.core.devices import Device
from bigviz.core.errors import UsageError

__all__ = ["HARDWARE_PRESETS", "LINK_BANDWIDTH", "DISK_BANDWIDTH", "preset_budgets", "find_bandwidth"]

GiB = 2**30
GB = 10**9


def _gpus(n: int, gib: float, cpu_gib: float) -> dict[Device, int]:
    budgets: dict[Device, int] = {i: int(gib * GiB) for i in range(n)}
    budgets["cpu"] = int(cpu_gib * GiB)
    return budgets


def _apple(total_gib: int) -> dict[Device, int]:
    mps = total_gib * 2 / 3
    return {"mps": int(mps * GiB), "cpu": int((total_gib * 0.9 - mps) * GiB)}


HARDWARE_PRESETS: dict[str, dict[Device, int]] = {
    "Colab T4 16 GB: 15 GiB (RAM 12 GiB)": _gpus(1, 15, 12),
    "RTX 4090 24 GB: 24 GiB (RAM 64 GiB)": _gpus(1, 24, 64),
    "A100 40 GB: 40 GiB (RAM 85 GiB)": _gpus(1, 40, 85),
    "A100 80 GB: 80 GiB (RAM 170 GiB)": _gpus(1, 80, 170),
    "2x A100 80 GB: 80 GiB each (RAM 340 GiB)": _gpus(2, 80, 340),
    "8x A100 80 GB: 80 GiB each (RAM 1360 GiB)": _gpus(8, 80, 1360),
    "H100 80 GB: 79.6 GiB (RAM 200 GiB)": _gpus(1, 81559 / 1024, 200),
    "H200 141 GB: 140 GiB (RAM 250 GiB)": _gpus(1, 140, 250),
    "Apple M-series 16 GB unified (mps)": _apple(16),
    "Apple M-series 32 GB unified (mps)": _apple(32),
    "Apple M-series 64 GB unified (mps)": _apple(64),
    "CPU-only laptop: RAM 16 GiB, 14 GiB for the model": {"cpu": 14 * GiB},
}
"""Preset name -> ``max_memory`` in bytes (disk stays unlimited). A name gives the card as it
is sold (decimal "80 GB"), then what the preset holds, in binary units as every size bigviz prints
(what ``nvidia-smi`` reports: an A100 80 GB has 81,920 MiB = 80 GiB, an H100 80 GB 81,559 MiB,
a T4 "16 GB" 15 GiB usable)."""

LINK_BANDWIDTH: dict[str, float] = {
    "PCIe 3 x16 (~12 GB/s pinned)": 12 * GB,
    "PCIe 4 x16 (~25 GB/s pinned)": 25 * GB,
    "PCIe 5 x16 (~50 GB/s pinned)": 50 * GB,
    "pageable memory over PCIe 4 (~6 GB/s)": 6 * GB,
    "Apple unified memory (~100 GB/s)": 100 * GB,
}
"""Host-to-device copy speed: what a cpu-offloaded weight costs to bring to the GPU."""

DISK_BANDWIDTH: dict[str, float] = {
    "NVMe Gen4 (~7 GB/s)": 7 * GB,
    "NVMe (~3 GB/s)": 3 * GB,
    "SATA SSD (~0.5 GB/s)": 0.5 * GB,
    "hard disk (~0.15 GB/s)": 0.15 * GB,
    "page cache, warm (~10 GB/s)": 10 * GB,
}
"""Read speed of disk-offloaded weights (a warm page cache reads at memory speed)."""


def _find(name: str, table: Mapping[str, Any], what: str) -> Any:
    """Look up a preset by its full name, its name without the figure in brackets ("NVMe" is
    "NVMe (~3 GB/s)", not "NVMe Gen4 (~7 GB/s)"), or a unique start of it ("PCIe 5", "SATA")."""
    if name in table:
        return table[name]
    bare = [k for k in table if k.split(" (")[0].strip().lower() == name.strip().lower()]
    if len(bare) == 1:
        return table[bare[0]]
    hits = [k for k in table if k.lower().startswith(name.lower())]
    if len(hits) == 1:
        return table[hits[0]]
    why = f"it starts {len(hits)} of them" if hits else "no preset is named so"
    raise UsageError(f"unknown {what} {name!r} ({why}): use one of {', '.join(repr(k) for k in table)}")


def find_bandwidth(value: float | str, table: Mapping[str, float], what: str) -> float:
    """Bytes/s given as a number, or a :data:`DISK_BANDWIDTH` / :data:`LINK_BANDWIDTH` name.

    Example:
        >>> find_bandwidth("SATA", DISK_BANDWIDTH, "disk"), find_bandwidth(2e9, DISK_BANDWIDTH, "disk")
        (500000000.0, 2000000000.0)
        >>> find_bandwidth("NVMe", DISK_BANDWIDTH, "disk")  # the name before the figure
        3000000000.0
    """
    if isinstance(value, str):
        return float(_find(value, table, what))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UsageError(f"{what} bandwidth {value!r} must be a number of bytes/s > 0 or one of {sorted(table)}")
    return float(value)


def preset_budgets(name: str) -> dict[Device, int]:
    """``max_memory`` (bytes) of a hardware preset, by name or a unique start of it.

    Example:
        >>> preset_budgets("Colab T4")[0] // 2**30
        15
    """
    return dict(_find(name, HARDWARE_PRESETS, "hardware preset"))
