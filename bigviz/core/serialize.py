"""Device maps and ``max_memory`` as JSON files that survive the round trip.

JSON object keys are always strings, so ``max_memory={0: "10GiB"}`` comes back as
``{"0": "10GiB"}``; these helpers turn digit keys back into GPU indices. Device-map *values*
stay ints, so the file can be given to transformers' ``from_pretrained(device_map=...)``
as it is.

Example:
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "map.json")
    >>> save_device_map({"h.0": 0, "lm_head": "cpu"}, path)
    >>> load_device_map(path)
    {'h.0': 0, 'lm_head': 'cpu'}
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bigviz.core.units import Device, normalize_device, parse_max_memory

__all__ = ["save_device_map", "load_device_map", "save_max_memory", "load_max_memory", "write_json_atomic"]


def write_json_atomic(data: Any, path: str | os.PathLike[str]) -> None:
    """Write JSON to a temporary file beside ``path`` and rename it into place, so a crash
    never leaves a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _read_json(path: str | os.PathLike[str], what: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); is this a {what} file?") from err


def save_device_map(device_map: Mapping[str, object], path: str | os.PathLike[str]) -> None:
    """Write a device map as JSON (``{"module": 0 | "cpu" | "disk" | "mps"}``).

    Devices are written in canonical form (``"cuda:1"`` becomes ``1``).
    """
    write_json_atomic({str(k): normalize_device(v) for k, v in device_map.items()}, path)


def load_device_map(path: str | os.PathLike[str]) -> dict[str, Device]:
    """Read a device map written by :func:`save_device_map`, by a planner export (a file with
    a ``"device_map"`` key) or by hand.

    Raises:
        ValueError: naming the file and each bad entry.
    """
    data = _read_json(path, "device map")
    if isinstance(data, dict) and isinstance(data.get("device_map"), dict):
        data = data["device_map"]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a device map is a JSON object {{module: device}}, got {type(data).__name__}")
    out: dict[str, Device] = {}
    problems = []
    for key, value in data.items():
        try:
            out[key] = normalize_device(value)
        except ValueError as err:
            problems.append(f"{key!r}: {err}")
    if problems:
        raise ValueError(f"{path}: invalid device map entries:\n  " + "\n  ".join(problems))
    return out


def save_max_memory(max_memory: Mapping[object, object], path: str | os.PathLike[str]) -> None:
    """Write ``max_memory`` as JSON; values keep their form (``"10GiB"`` or bytes)."""
    parse_max_memory(max_memory)  # refuse to write what could not be read back
    write_json_atomic({str(normalize_device(k)): v for k, v in max_memory.items()}, path)


def load_max_memory(path: str | os.PathLike[str]) -> dict[Device, object]:
    """Read ``max_memory`` from JSON with GPU keys back as ints (``"0"`` -> ``0``).

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "mm.json")
        >>> save_max_memory({0: "10GiB", "cpu": 2**30}, p)
        >>> load_max_memory(p)
        {0: '10GiB', 'cpu': 1073741824}
    """
    data = _read_json(path, "max_memory")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: max_memory is a JSON object {{device: size}}")
    parse_max_memory(data)  # validates keys and values, naming each problem
    return {normalize_device(k): v for k, v in data.items()}
