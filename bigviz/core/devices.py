"""Devices, one vocabulary: what a device-map value names, how it prints, which one executes.

A device is a GPU index (``0``), ``"mps"``, ``"cpu"`` or ``"disk"``; users also write
``"cuda:1"``, ``"0"`` (JSON gives int keys back as strings) and ``torch.device`` objects, and
:func:`normalize_device` turns each into the one canonical form. Everything else in bigviz
speaks this form: the planner, device maps, loading (which asks :func:`torch_name` for
torch's spelling) and the engine (``bigviz.engine.devices.torch_device``).

Example:
    >>> normalize_device("cuda:1"), normalize_device("0"), device_label("cpu")
    (1, 0, 'CPU')
    >>> execution_device(["cpu", 1, "disk", 0]), streamed_devices("cpu")
    (0, ('disk',))
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from bigviz.core.errors import UsageError

__all__ = [
    "Device",
    "NAMED_DEVICES",
    "OFFLOAD_DEVICES",
    "normalize_device",
    "device_label",
    "device_sort_key",
    "torch_name",
    "execution_device",
    "tie_home",
    "streamed_devices",
    "computes",
    "missing_device_problems",
    "MISSING_DEVICE_FIX",
]

Device = int | str
"""A placement target: a GPU index (int), ``"mps"``, ``"cpu"`` or ``"disk"``."""

NAMED_DEVICES = ("mps", "cpu", "disk")
"""The devices with names, in fill order (after the GPUs)."""
OFFLOAD_DEVICES = ("cpu", "disk")
"""Where offloaded weights are stored between forwards."""


def normalize_device(device: object) -> Device:
    """The canonical form of a device: GPU index (int), ``"mps"``, ``"cpu"`` or ``"disk"``.

    Accepts ints, digit strings (``"0"``, as JSON gives them back), ``"cuda"``,
    ``"cuda:1"`` and ``torch.device`` objects (which print as ``"cuda:1"``).

    Raises:
        ValueError: quoting the value, for anything else.

    Example:
        >>> normalize_device("cuda:1"), normalize_device("0"), normalize_device("disk")
        (1, 0, 'disk')
    """
    if isinstance(device, bool):
        raise UsageError(f"unknown device {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise UsageError(f"unknown device {device!r}: GPU indices are >= 0")
        return device
    text = str(device).strip()
    if text.isdigit():
        return int(text)
    if text == "cuda":
        return 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    if text in NAMED_DEVICES:
        return text
    raise UsageError(f"unknown device {device!r}: use a GPU index (0, 1, ...), 'cuda:N', 'cpu', 'disk' or 'mps'")


def device_label(device: Device) -> str:
    """How a person reads a device: ``"GPU 0"``, ``"CPU"``, ``"disk"``, ``"MPS"``.

    Example:
        >>> device_label(0), device_label("cpu"), device_label("mps")
        ('GPU 0', 'CPU', 'MPS')
    """
    if isinstance(device, int):
        return f"GPU {device}"
    return {"cpu": "CPU", "mps": "MPS"}.get(device, device)


def device_sort_key(device: Device) -> tuple[int, int]:
    """Order in which devices fill: GPUs by index, then mps, cpu, disk.

    Example:
        >>> sorted(["disk", "cpu", "mps", 1, 0], key=device_sort_key)
        [0, 1, 'mps', 'cpu', 'disk']
    """
    if isinstance(device, int):
        return (0, device)
    return (1, NAMED_DEVICES.index(device))


def torch_name(device: object) -> str:
    """torch's spelling of a device: ``0`` -> ``"cuda:0"``; ``"cpu"``, ``"mps"``, ``"disk"``
    as they are (``"disk"`` is bigviz's, for tensors left in files).

    Example:
        >>> torch_name(1), torch_name("cuda"), torch_name("disk")
        ('cuda:1', 'cuda:0', 'disk')
    """
    canonical = normalize_device(device)
    return f"cuda:{canonical}" if isinstance(canonical, int) else canonical


def computes(device: Device) -> bool:
    """True for devices that run modules (GPUs, mps, cpu); ``"disk"`` only stores.

    Example:
        >>> computes(0), computes("disk")
        (True, False)
    """
    return device != "disk"


def tie_home(devices: Sequence[object]) -> Device:
    """The one rule for where a tensor tied across devices lives (one object under every name,
    so the tie survives): with the user that computes fastest, a GPU (the first one named),
    then mps, then the CPU; on disk only when every user is. The loader puts it there and the
    dispatch keeps it resident there, lending it to the other users.

    Example:
        >>> tie_home(["cpu", 1, "cuda:0"]), tie_home(["disk", "mps"]), tie_home(["disk", "disk"])
        (1, 'mps', 'disk')
    """
    canonical = [d if isinstance(d, int) or d in NAMED_DEVICES else normalize_device(d) for d in devices]
    return min(canonical, key=lambda d: 0 if isinstance(d, int) else 1 + NAMED_DEVICES.index(d))


def execution_device(devices: Iterable[object]) -> Device:
    """The one rule for where offloaded modules run: the lowest GPU among ``devices``, else
    ``"mps"``, else ``"cpu"``.

    ``devices`` may be a device map's values, a ``max_memory``'s keys or the devices a machine
    has (``bigviz.modeling.budgets.available_devices``), in any spelling; values that name
    no device are ignored here (the map's checks report them).

    Example:
        >>> execution_device(["cpu", "cuda:2", 1]), execution_device(["disk", "mps"]), execution_device([])
        (1, 'mps', 'cpu')
    """
    found: set[Device] = set()
    for value in devices:
        try:
            found.add(normalize_device(value))
        except ValueError:
            continue
    gpus = sorted(d for d in found if isinstance(d, int))
    if gpus:
        return gpus[0]
    return "mps" if "mps" in found else "cpu"


def streamed_devices(main: Device) -> tuple[str, ...]:
    """Devices whose weights are streamed to the execution device ``main`` at forward time.

    With the CPU executing, cpu weights are simply resident and only disk streams; with a
    GPU (or mps) executing, both cpu and disk stream.

    Example:
        >>> streamed_devices("cpu"), streamed_devices(0)
        (('disk',), ('cpu', 'disk'))
    """
    return ("disk",) if main == "cpu" else OFFLOAD_DEVICES


MISSING_DEVICE_FIX = (
    "Fix: plan again for this machine (bigviz.plan(model) or device_map='auto'), or change those entries "
    "to an available device."
)


def missing_device_problems(
    device_map: Mapping[str, object],
    have: Collection[Device],
    *,
    main_device: object = None,
    cuda_count: int | None = None,
) -> list[str]:
    """One sentence per device that ``device_map`` (or ``main_device``) names and ``have``
    lacks, with the modules sent there and what exists; ``"disk"`` always exists. Values
    that name no device are left to the map's own checks.

    Args:
        device_map: module name -> device, in any spelling.
        have: the devices this machine has (``bigviz.modeling.budgets.available_devices()``).
        main_device: the execution device asked for, checked too.
        cuda_count: the GPUs torch sees, said in the sentence when given.

    Example:
        >>> missing_device_problems({"h.0": 3, "h.1": "cuda:3", "head": "cpu"}, ["cpu", "disk"])
        ['device map names GPU 3 (h.0, h.1), which this machine does not have (cuda:3); available: CPU, disk']
    """
    missing: dict[Device, list[str]] = {}
    wanted = [*device_map.items(), *([("main_device", main_device)] if main_device is not None else [])]
    for name, value in wanted:
        try:
            device = normalize_device(value)
        except ValueError:
            continue
        if device not in have and device != "disk":
            missing.setdefault(device, []).append(name or "'' (whole model)")
    problems = []
    for device, names in sorted(missing.items(), key=lambda kv: device_sort_key(kv[0])):
        shown = ", ".join(names[:5]) + (f", ... ({len(names)} in all)" if len(names) > 5 else "")
        sees = f"; torch sees {cuda_count} CUDA GPU{'s' if cuda_count != 1 else ''}" if cuda_count is not None else ""
        problems.append(
            f"device map names {device_label(device)} ({shown}), which this machine does not have "
            f"({torch_name(device)}{sees}); available: {', '.join(device_label(d) for d in have) or 'none'}"
        )
    return problems
