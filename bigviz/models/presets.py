"""Named model sizes: how both configs turn a preset name plus overrides into a config.

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Cfg:
    ...     width: int = 1
    >>> from_preset(Cfg, {"wide": {"width": 8}}, "wide", {})
    Cfg(width=8)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["from_preset"]

C = TypeVar("C")


def from_preset(
    cls: type[C], presets: Mapping[str, Mapping[str, Any]], name: str, overrides: Mapping[str, Any]
) -> C:
    """Build ``cls`` from ``presets[name]`` updated by ``overrides``.

    Raises:
        ValueError: ``name`` is not a preset (the message lists the valid ones).
        TypeError: an override names no field of ``cls`` (the message lists the fields).
    """
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(presets)}")
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"unknown {cls.__name__} field(s) {unknown}; valid: {sorted(fields)}")
    return cls(**{**presets[name], **overrides})
