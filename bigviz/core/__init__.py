"""Pure planning: names, devices, sizes, dtypes, size trees, device maps and the chain of plans.

No torch, no plotly: everything here is plain data and pure functions, testable without torch
and usable for hardware you do not own.
"""

from __future__ import annotations

from bigviz.core.devicemap import clean_device_map, device_of, validate_device_map
from bigviz.core.devices import Device, device_label, execution_device, normalize_device
from bigviz.core.errors import BigvizError, DeviceMapError, PlanError
from bigviz.core.plan import STRATEGIES, DevicePlan, DeviceUsage, Placement, PlanOptions
from bigviz.core.serialize import load_device_map, load_max_memory, save_device_map, save_max_memory
from bigviz.core.sizes import UNLIMITED, format_size, parse_max_memory, parse_size
from bigviz.core.planner import make_plan
from bigviz.core.tree import ModuleNode, SizeTree, TensorSpec

__all__ = [
    "STRATEGIES",
    "UNLIMITED",
    "BigvizError",
    "Device",
    "DeviceMapError",
    "DevicePlan",
    "DeviceUsage",
    "ModuleNode",
    "Placement",
    "PlanError",
    "PlanOptions",
    "SizeTree",
    "TensorSpec",
    "clean_device_map",
    "device_label",
    "device_of",
    "execution_device",
    "format_size",
    "load_device_map",
    "load_max_memory",
    "make_plan",
    "normalize_device",
    "parse_max_memory",
    "parse_size",
    "save_device_map",
    "save_max_memory",
    "validate_device_map",
]
