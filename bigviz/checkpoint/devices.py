"""Device-map look-ups for loading: which device each tensor goes to, and is it usable here.

Example:
    >>> device_of("h.10.w", {"h.1": 0, "": "cpu"}), device_of("h.1.w", {"h.1": 0})
    ('cpu', 'cuda:0')
    >>> device_problems({"": "cuda:3"}, can_map_disk=True, offload_folder=None)[0][:40]
    "device_map sends '' to cuda:3, but this "
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from bigviz.core import units
from bigviz.core.names import owner
from bigviz.modeling.budgets import available_devices

__all__ = ["normalize_device", "device_of", "device_problems"]


def normalize_device(value: int | str | torch.device) -> str:
    """The torch device string for a device-map value: ``0`` / ``"cuda:0"`` -> ``"cuda:0"``;
    ``"cpu"``, ``"disk"``, ``"mps"`` as they are.

    Raises:
        ValueError: not a device name.

    Example:
        >>> normalize_device(1), normalize_device(torch.device("cpu")), normalize_device("disk")
        ('cuda:1', 'cpu', 'disk')
    """
    device = units.normalize_device(value)
    return f"cuda:{device}" if isinstance(device, int) else device


def device_of(name: str, device_map: Mapping[str, int | str | torch.device] | None) -> str | None:
    """The device of tensor ``name`` under ``device_map`` (``"cpu"`` with no map; None if uncovered)."""
    if device_map is None:
        return "cpu"
    key = owner(name, device_map)
    return None if key is None else normalize_device(device_map[key])


def device_problems(device_map: Mapping[str, object] | None, *, can_map_disk: bool,
                    offload_folder: object) -> list[str]:
    """Every entry of ``device_map`` naming a device this machine lacks or cannot use."""
    problems: list[str] = []
    disk_keys = []
    for key, value in (device_map or {}).items():
        try:
            device = normalize_device(value)  # type: ignore[arg-type]
        except ValueError:
            problems.append(f"device_map[{key!r}] = {value!r} is not a device: use an int (GPU), "
                            "'cpu', 'disk' or 'mps'")
            continue
        missing = _unavailable(device)
        if missing:
            problems.append(f"device_map sends {key!r} to {device}, but this machine {missing} "
                            f"(available: {', '.join(_available())})")
        if device == "disk":
            disk_keys.append(key)
    if disk_keys and not can_map_disk and offload_folder is None:
        problems.append(f"device_map sends {disk_keys[:5]} to disk, but this checkpoint is not "
                        "safetensors (it cannot be read in place): pass offload_folder= to write "
                        "those weights there once, as safetensors")
    return problems


def _unavailable(device: str) -> str:
    if units.normalize_device(device) in available_devices():
        return ""
    if device.startswith("cuda"):
        count = sum(isinstance(d, int) for d in available_devices())
        return f"has {count} CUDA device{'s' if count != 1 else ''}"
    return f"has no {device} device"


def _available() -> list[str]:
    return [normalize_device(d) for d in available_devices()]
