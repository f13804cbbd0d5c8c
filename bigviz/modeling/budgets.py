"""Budgets from the machine you are on, when the user gives no ``max_memory``.

Example:
    >>> budgets = get_max_memory()
    >>> "cpu" in budgets
    True
"""

from __future__ import annotations

from collections.abc import Mapping

import psutil
import torch

from bigviz.core.devices import Device, execution_device, missing_device_problems
from bigviz.core.sizes import parse_max_memory
from bigviz.core.stream_plan import RAM_SHARE, MachineFacts

__all__ = ["get_max_memory", "available_devices", "default_execution_device", "absent_device_problems", "machine_facts"]
SINGLE_GPU_SHARE = 0.9  # with one GPU and no budget given, leave room for the CUDA context


def available_devices() -> list[Device]:
    """Devices this machine has: GPU indices, then ``"mps"``, ``"cpu"`` and ``"disk"``."""
    devices: list[Device] = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices.append("mps")
    return devices + ["cpu", "disk"]


def default_execution_device() -> Device:
    """Where this machine runs a model when nothing says otherwise: the first GPU, else mps,
    else the CPU (`bigviz.core.devices.execution_device` over `available_devices`).

    Example:
        >>> default_execution_device() in available_devices()
        True
    """
    return execution_device(available_devices())


def absent_device_problems(device_map: Mapping[str, object], *, main_device: object = None) -> list[str]:
    """A sentence per device that ``device_map`` (or ``main_device``) names and this machine
    lacks (see `bigviz.core.devices.missing_device_problems`).

    Example:
        >>> absent_device_problems({"": "cpu"})
        []
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return missing_device_problems(device_map, available_devices(), main_device=main_device, cuda_count=gpus)


def machine_facts(
    *, disk_bandwidth: float | None = None, compute_rate: float | None = None, read_cost: float = 0.0
) -> MachineFacts:
    """This machine's facts for a stream plan: its available RAM now (and the disk bandwidth,
    when one was measured: ``bigviz.checkpoint.probe.measure_read_bandwidth``; the compute
    rate, when one was: ``bigviz.modeling.compute_rate.measure_compute_rate``; the compute the
    reads take, when measured: ``bigviz.modeling.read_cost.measure_read_cost``).

    Example:
        >>> machine_facts().available_ram > 0
        True
    """
    return MachineFacts(int(psutil.virtual_memory().available), disk_bandwidth, compute_rate, read_cost)


def get_max_memory(max_memory: Mapping[object, object] | None = None) -> dict[Device, int]:
    """Byte budgets: ``max_memory`` parsed if given, else what this machine has free now
    (free memory per GPU, 90% of available RAM; a single GPU scaled to 90%).

    Disk is left out: the planner treats it as unlimited unless it is named.
    """
    if max_memory is not None:
        return parse_max_memory(max_memory)
    budgets: dict[Device, int] = {}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, _total = torch.cuda.mem_get_info(i)
            budgets[i] = free
        if len(budgets) == 1:
            budgets[0] = int(budgets[0] * SINGLE_GPU_SHARE)
    if "mps" in available_devices():
        budgets["mps"] = int(psutil.virtual_memory().available * RAM_SHARE / 2)
    budgets["cpu"] = int(psutil.virtual_memory().available * RAM_SHARE)
    return budgets
