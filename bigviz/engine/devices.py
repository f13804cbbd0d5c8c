"""Devices as the engine sees them: torch devices, what this machine has, moving arguments.

Device maps name devices the planner's way (``0``, ``"cpu"``, ``"disk"``, ``"mps"``; see
:func:`bigviz.core.devices.normalize_device`); the engine turns them into ``torch.device``
objects, checks the machine has them before anything is loaded, and moves a forward's
arguments and outputs through nested tuples, lists and dicts.

Example:
    >>> import torch
    >>> torch_device(0), torch_device("cpu")
    (device(type='cuda', index=0), device(type='cpu'))
    >>> send_to_device({"x": torch.ones(1), "cache": object()}, "cpu", skip_keys=["cache"])["x"]
    tensor([1.])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from bigviz.core.devices import MISSING_DEVICE_FIX, computes, normalize_device, torch_name
from bigviz.core.errors import DeviceMapError, UsageError
from bigviz.modeling.budgets import absent_device_problems, available_devices

__all__ = [
    "torch_device",
    "available_devices",
    "check_devices_exist",
    "send_to_device",
    "map_tensors",
    "any_tensor",
    "find_device",
]

DeviceLike = int | str | torch.device
MISSING_DEVICES = "this machine lacks devices the map names"


def torch_device(device: DeviceLike) -> torch.device:
    """The ``torch.device`` that executes work for a device-map value (not ``"disk"``).

    Example:
        >>> torch_device("cuda:1")
        device(type='cuda', index=1)
    """
    if isinstance(device, torch.device):
        return device if device.type != "cuda" or device.index is not None else torch.device("cuda", 0)
    canonical = normalize_device(device)
    if not computes(canonical):
        raise UsageError("'disk' stores weights; it cannot execute a module (use 'cpu' or a GPU)")
    return torch.device(torch_name(canonical))


def check_devices_exist(device_map: Mapping[str, Any], *, main_device: Any = None) -> None:
    """Raise before anything is loaded if the map (or ``main_device``) names absent devices.

    Raises:
        DeviceMapError: (a ``ValueError``) naming every missing device, the modules mapped to
            it and what exists.

    Example:
        >>> check_devices_exist({"": "cpu"})
        >>> check_devices_exist({"h.0": 3})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        bigviz.core.errors.DeviceMapError: this machine lacks devices the map names (1 problem):
          - device map names GPU 3 (h.0), which this machine does not have (cuda:3; ...
    """
    DeviceMapError.check(
        absent_device_problems(device_map, main_device=main_device), MISSING_DEVICES, fix=MISSING_DEVICE_FIX
    )


def send_to_device(obj: Any, device: DeviceLike, *, skip_keys: Iterable[str] = (), non_blocking: bool = False) -> Any:
    """Move every tensor inside ``obj`` (tuples, lists, dicts, nested) to ``device``.

    Objects that are not tensors or containers (a KV cache, a config) pass through; so do
    dict entries whose key is in ``skip_keys``. A container comes back as the same object
    when nothing in it moved, which keeps the no-move case (everything on the CPU) cheap.

    Example:
        >>> import torch
        >>> args = (torch.ones(2), [torch.zeros(1)], "text")
        >>> send_to_device(args, "cpu") is args
        True
    """
    target = torch_device(device)

    def move(t: torch.Tensor) -> torch.Tensor:
        return t if t.device == target else t.to(target, non_blocking=non_blocking)

    return map_tensors(obj, move, skip_keys=skip_keys)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], *, skip_keys: Iterable[str] = ()) -> Any:
    """Apply ``fn`` to every tensor in nested tuples, lists and dicts; rebuild only what changed.

    Example:
        >>> import torch
        >>> map_tensors({"a": (torch.ones(1),)}, lambda t: t * 3)["a"][0].item()
        3.0
    """
    return _map(obj, fn, frozenset(skip_keys))


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], skip: frozenset[str]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        moved = [_map(item, fn, skip) for item in obj]
        if all(a is b for a, b in zip(moved, obj)):
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*moved)
        return type(obj)(moved)
    if isinstance(obj, Mapping):
        items = {k: v if k in skip else _map(v, fn, skip) for k, v in obj.items()}
        if all(items[k] is v for k, v in obj.items()):
            return obj
        return _rebuild_mapping(obj, items)
    return obj


def _rebuild_mapping(original: Mapping[str, Any], items: dict[str, Any]) -> Any:
    try:  # keeps the type of dict subclasses such as transformers' ModelOutput
        return type(original)(**items)
    except TypeError:
        try:
            return type(original)(items)
        except TypeError:
            return items


def any_tensor(obj: Any, predicate: Callable[[torch.Tensor], bool], *, skip_keys: Iterable[str] = ()) -> bool:
    """True if some tensor inside ``obj`` satisfies ``predicate`` (stops at the first).

    Example:
        >>> import torch
        >>> any_tensor((1, [torch.ones(1, requires_grad=True)]), lambda t: t.requires_grad)
        True
    """
    skip = frozenset(skip_keys)
    if isinstance(obj, torch.Tensor):
        return predicate(obj)
    if isinstance(obj, (list, tuple)):
        return any(any_tensor(item, predicate, skip_keys=skip) for item in obj)
    if isinstance(obj, Mapping):
        return any(any_tensor(v, predicate, skip_keys=skip) for k, v in obj.items() if k not in skip)
    return False


def find_device(obj: Any, *, skip_keys: Iterable[str] = ()) -> torch.device | None:
    """The device of the first tensor found in ``obj`` (depth first), or None.

    Example:
        >>> import torch
        >>> find_device(((), {"x": torch.ones(1)}))
        device(type='cpu')
    """
    skip = frozenset(skip_keys)
    if isinstance(obj, torch.Tensor):
        return obj.device
    if isinstance(obj, (list, tuple)):
        items: Iterable[Any] = obj
    elif isinstance(obj, Mapping):
        items = (v for k, v in obj.items() if k not in skip)
    else:
        return None
    for item in items:
        found = find_device(item, skip_keys=skip)
        if found is not None:
            return found
    return None
