"""Headroom: what a device needs free beyond the bytes a plan counts, by default.

A plan counts tensors: weights, each layer's cache, the largest step's activations. A process
needs more than that, and how much depends on the kind of device:

* **CPU**: the allocator's slack. glibc's ``malloc`` keeps freed blocks on its heap once its
  mmap threshold has moved up (after the first large free), and transformers' dynamic cache
  grows by ``torch.cat`` (a new copy per step, the old one freed), so a run's memory seen by
  the system (its anonymous RSS) rises above the tensors alive at any moment. Measured with
  ``python bench/headroom.py``: a CPU run planned to the byte peaked at up to 1.09x its budget,
  and a run's first prefill at up to 1.6x the tensors it had alive (the slack scales with the
  run, not with the weights). Default: 25% of the run charged on the CPU.
* **GPU** (CUDA): the CUDA context (about 300-800 MiB per process and GPU, depending on the
  GPU, the driver and CUDA's lazy module loading; PyTorch's forum reports 700-800 MiB before
  lazy loading), cuBLAS(Lt) workspaces (32 MiB per handle on Hopper, 4 MiB on Ampere and
  before: PyTorch's ``CUBLASLT_WORKSPACE_SIZE`` defaults, pytorch/pytorch#120925, following
  cuBLAS' documented recommendation), and the caching allocator's fragmentation (blocks
  rounded up, a growing cache's freed blocks too small for the next step). Default: 1 GiB
  plus 10% of the run charged on the GPU. These figures come from those sources, not from a
  measurement here: no GPU was lent where bigviz was built.
* **MPS**: no CUDA context; the CPU's slack (unified memory, the same allocator pressure).
* **disk**: none.

``reserve=None`` (the default of :func:`bigviz.plan` and :func:`bigviz.max_context` when a run
is planned) keeps these; ``reserve=0`` plans the bare arithmetic; a mapping gives some devices
their own reserve (and no slack) and keeps the default for the others.

Example:
    >>> room = default_headroom([0, "cpu", "disk"])
    >>> room.reserve, room.run_slack
    ({0: 1073741824}, {0: 0.1, 'cpu': 0.25})
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bigviz.core.devices import Device, device_label, normalize_device
from bigviz.core.sizes import format_size

__all__ = ["Headroom", "KIND_HEADROOM", "device_kind", "default_headroom", "headroom"]

GiB = 2**30


@dataclass(frozen=True)
class KindHeadroom:
    """A device kind's default: bytes kept free whatever runs, a share of the run on top, why."""

    fixed: int
    run_slack: float
    why: str


KIND_HEADROOM: dict[str, KindHeadroom] = {
    "cpu": KindHeadroom(0, 0.25, "allocator slack (glibc keeps freed blocks; the dynamic cache grows by copies)"),
    "gpu": KindHeadroom(GiB, 0.10, "CUDA context, cuBLAS workspace, caching-allocator fragmentation"),
    "mps": KindHeadroom(0, 0.25, "allocator slack"),
}
"""The default headroom per device kind (see the module docstring for the figures' sources)."""


def device_kind(device: Device) -> str | None:
    """``"gpu"`` for a CUDA index, ``"cpu"``, ``"mps"``, or None (disk keeps no headroom)."""
    if isinstance(device, int):
        return "gpu"
    return device if device in ("cpu", "mps") else None


@dataclass(frozen=True)
class Headroom:
    """What each device keeps free: ``reserve`` bytes, and ``run_slack`` (a share of the run
    charged there), with the notes a plan shows about them."""

    reserve: dict[Any, object] = field(default_factory=dict)  # sizes as given: the planner parses them
    run_slack: dict[Device, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def default_headroom(devices: Iterable[Device]) -> Headroom:
    """The default headroom of each device (see :data:`KIND_HEADROOM`)."""
    return headroom(devices, None)


def headroom(
    devices: Iterable[Device], reserve: Mapping[object, object] | int | str | None, *, defaults: bool = True
) -> Headroom:
    """The headroom a plan keeps on ``devices`` for ``reserve`` as the user gave it.

    Args:
        devices: the planned devices.
        reserve: ``None``: each device's default; a size (``0``, ``"2GiB"``): that many bytes
            on every device and no slack (``0``: the bare arithmetic); a mapping: those bytes
            on the devices it names (no slack there), the default on the others.
        defaults: False for a plan of weights only (as accelerate counts them): devices
            ``reserve`` does not name keep nothing.

    Example:
        >>> headroom(["cpu"], 0).reserve, headroom(["cpu"], 0).run_slack
        ({}, {})
        >>> room = headroom([0, 1], {1: "2GiB"})
        >>> room.reserve, room.run_slack
        ({1: '2GiB', 0: 1073741824}, {0: 0.1})
    """
    devices = list(devices)
    if reserve is not None and not isinstance(reserve, Mapping):  # the planner parses (and reports) sizes
        return Headroom({} if reserve == 0 else {d: reserve for d in devices}, {}, ())
    given: dict[Any, object] = {}
    for key, value in (reserve or {}).items():
        try:
            given[normalize_device(key)] = value
        except ValueError:
            given[key] = value  # not a device: the planner says so, with the others
    room = Headroom(given)
    notes = []
    for device in devices:
        kind = device_kind(device)
        if device in given or kind is None or not defaults:
            continue
        default = KIND_HEADROOM[kind]
        if default.fixed:
            room.reserve[device] = default.fixed
        if default.run_slack:
            room.run_slack[device] = default.run_slack
        fixed = f"{format_size(default.fixed)} + " if default.fixed else ""
        notes.append(
            f"{device_label(device)} keeps {fixed}{default.run_slack:.0%} of its run free by default "
            f"({default.why}); reserve=0 plans the bare arithmetic"
        )
    return Headroom(room.reserve, room.run_slack, tuple(notes))
