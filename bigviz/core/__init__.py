"""Pure planning: names, units, size trees, device maps and plans. No torch, no plotly."""
from __future__ import annotations

from bigviz.core.devicemap import clean_device_map, device_of, validate_device_map
from bigviz.core.plan import STRATEGIES, DevicePlan, DeviceUsage, Placement, PlanOptions
from bigviz.core.serialize import load_device_map, load_max_memory, save_device_map, save_max_memory
from bigviz.core.strategies import PlanError, make_plan
from bigviz.core.tree import ModuleNode, SizeTree, TensorSpec
from bigviz.core.units import (UNLIMITED, Device, device_label, format_size, normalize_device,
                               parse_max_memory, parse_size)

__all__ = [
    "STRATEGIES", "UNLIMITED", "Device", "DevicePlan", "DeviceUsage", "ModuleNode", "Placement",
    "PlanError", "PlanOptions", "SizeTree", "TensorSpec", "clean_device_map", "device_label",
    "device_of", "format_size", "load_device_map", "load_max_memory", "make_plan", "normalize_device",
    "parse_max_memory", "parse_size", "save_device_map", "save_max_memory", "validate_device_map",
]
