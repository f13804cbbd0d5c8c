"""Byte sizes and ``max_memory`` budgets, parsed the way users write them.

``"10GiB"`` is 10 * 2**30 bytes and ``"10GB"`` is 10 * 10**9. Accelerate reads a lowercase
``b`` (``"10Gb"``) as *bits*; that surprises people, so bigviz refuses it and says why.

Example:
    >>> parse_size("1.5GiB"), parse_size("500MB"), parse_size(1024)
    (1610612736, 500000000, 1024)
    >>> parse_max_memory({"0": "10GiB", "cpu": "30GB"})
    {0: 10737418240, 'cpu': 30000000000}
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from bigviz.core.devices import Device, device_label, device_sort_key, normalize_device
from bigviz.core.errors import PlanError, UsageError

__all__ = [
    "parse_size",
    "format_size",
    "format_seconds",
    "format_count",
    "parse_max_memory",
    "max_memory_problems",
    "UNLIMITED",
]

UNLIMITED = 2**62
"""The budget of a device with no limit (disk, when ``max_memory`` does not name it)."""

_UNITS = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Bytes from an int, a float or a string such as ``"10GiB"``, ``"10GB"``, ``"1.5 GiB"``.

    Raises:
        ValueError: quoting the value, when it is negative, not a number, or uses an unknown
            or ambiguous unit (``"10Gb"``: bits or bytes?).

    Example:
        >>> parse_size("10GiB"), parse_size("10GB"), parse_size("2KiB")
        (10737418240, 10000000000, 2048)
    """
    if isinstance(value, bool):
        raise UsageError(f"size {value!r} is a bool; give bytes (int) or a string like '10GiB'")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise UsageError(f"size {value!r} must be a finite number of bytes >= 0")
        return int(value)
    if not isinstance(value, str):
        raise UsageError(f"size {value!r} must be an int (bytes) or a string like '10GiB'")
    match = _SIZE_RE.match(value)
    if not match and _SIZE_RE.match(value.strip().removeprefix("-")):  # "-5GiB": a size, but negative
        raise UsageError(f"size {value!r} is negative: a size must be >= 0 bytes")
    if not match:
        raise UsageError(f"cannot parse size {value!r}: write a number and a unit, e.g. '10GiB', '500MB'")
    number, unit = float(match.group(1)), match.group(2)
    if not math.isfinite(number):  # "1e400": float() gives inf, and int(inf) would overflow
        raise UsageError(f"size {value!r} is too large: write a finite number of bytes, e.g. '10GiB'")
    if len(unit) >= 2 and unit.endswith("b") and unit[-2] not in "iI" and unit.lower() in _UNITS:
        raise UsageError(
            f"size {value!r} is ambiguous: a lowercase 'b' means bits to accelerate "
            f"({unit} = 1/8 of {unit[:-1]}B). Write {match.group(1)}{unit[:-1].upper()}B "
            f"(powers of 10) or {match.group(1)}{unit[:-1].upper()}iB (powers of 2)"
        )
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise UsageError(f"unknown unit {unit!r} in size {value!r}: use B, KB, MB, GB, TB or KiB, MiB, GiB, TiB")
    if not math.isfinite(number * factor):
        raise UsageError(f"size {value!r} is too large: write a finite number of bytes, e.g. '10GiB'")
    return int(round(number * factor))


def format_size(nbytes: int | float) -> str:
    """A short human-readable size in binary units.

    Example:
        >>> format_size(1536), format_size(3 * 2**30), format_size(12)
        ('1.5 KiB', '3.0 GiB', '12 B')
    """
    if nbytes == math.inf or nbytes >= UNLIMITED // 2:  # an unlimited budget less what it holds
        return "unlimited"
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover - loop always returns


def format_seconds(seconds: float) -> str:
    """A duration as people read it: seconds from 1 s up, milliseconds below, never rounded
    to zero (``"0 ms"`` for 0.2 ms would say that streaming costs nothing).

    Example:
        >>> format_seconds(2.345), format_seconds(0.0123), format_seconds(0.00123), format_seconds(0.0002)
        ('2.3 s', '12 ms', '1.2 ms', '0.2 ms')
        >>> format_seconds(0), format_seconds(4e-8)
        ('0 ms', 'under 0.001 ms')
    """
    if seconds >= 1:
        return f"{seconds:,.1f} s"
    ms = seconds * 1e3
    if ms >= 10:
        return f"{ms:.0f} ms"
    if ms >= 1:
        return f"{ms:.1f} ms"
    if ms <= 0:
        return "0 ms"
    return f"{ms:.2g} ms" if ms >= 0.001 else "under 0.001 ms"


def format_count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and its noun, singular for one: ``"1 unit"``, ``"41 units"``, ``"1 entry"``.

    Example:
        >>> format_count(1, "unit"), format_count(41, "unit"), format_count(2, "entry", "entries")
        ('1 unit', '41 units', '2 entries')
    """
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def parse_max_memory(max_memory: Mapping[Any, object]) -> dict[Device, int]:
    """Normalise a ``max_memory`` mapping: canonical device keys, byte values, fill order.

    Every bad key and value is reported in one error; two keys naming one device (``0`` and
    ``"cuda:0"``) are an error too, rather than one silently winning.

    Raises:
        PlanError: (a ``ValueError``) listing each unknown key, duplicate device and
            unparseable value, quoted.

    Example:
        >>> parse_max_memory({"cpu": "1GB", 1: "2GiB", "cuda:0": 10})
        {0: 10, 1: 2147483648, 'cpu': 1000000000}
        >>> parse_max_memory("10GiB")
        Traceback (most recent call last):
        ...
        bigviz.core.errors.PlanError: max_memory must be a dict {device: size}, got '10GiB' (a str); e.g. {0: '10GiB', 'cpu': '30GiB'}
    """
    budgets, problems = max_memory_problems(max_memory)
    PlanError.check(problems, "invalid max_memory")
    return budgets


def max_memory_problems(max_memory: object) -> tuple[dict[Device, int], list[str]]:
    """The budgets that parse, in fill order, and a sentence for each key or value that does
    not (for entry points that report every problem of a call at once).

    Example:
        >>> max_memory_problems({"gpu": "1GB", "cpu": "2GB"})
        ({'cpu': 2000000000}, ["key 'gpu': unknown device 'gpu': use a GPU index (0, 1, ...), 'cuda:N', 'cpu', 'disk' or 'mps'"])
    """
    if not isinstance(max_memory, Mapping):
        raise PlanError(
            f"max_memory must be a dict {{device: size}}, got {max_memory!r} "
            f"(a {type(max_memory).__name__}); e.g. {{0: '10GiB', 'cpu': '30GiB'}}"
        )
    out: dict[Device, int] = {}
    keys: dict[Device, object] = {}
    problems: list[str] = []
    for key, value in max_memory.items():
        try:
            device = normalize_device(key)
        except ValueError as err:
            problems.append(f"key {key!r}: {err}")
            continue
        if device in keys:
            problems.append(
                f"keys {keys[device]!r} and {key!r} both name {device_label(device)}: give each device one budget"
            )
            continue
        keys[device] = key
        try:
            out[device] = parse_size(value)  # type: ignore[arg-type,unused-ignore]
        except ValueError as err:
            problems.append(f"max_memory[{key!r}]: {err}")
    return {d: out[d] for d in sorted(out, key=device_sort_key)}, problems
