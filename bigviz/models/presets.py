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

__all__ = ["from_preset", "config_dict", "from_config_dict"]

C = TypeVar("C")


def from_preset(cls: type[C], presets: Mapping[str, Mapping[str, Any]], name: str, overrides: Mapping[str, Any]) -> C:
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


def config_dict(config: Any) -> dict[str, Any]:
    """A config dataclass as JSON-ready data, with its class's ``model_type``.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class Cfg:
        ...     width: int = 1
        ...     model_type = "demo"
        >>> config_dict(Cfg(3))
        {'width': 3, 'model_type': 'demo'}
    """
    return {**dataclasses.asdict(config), "model_type": type(config).model_type}


def from_config_dict(classes: Mapping[str, type[C]], data: Mapping[str, Any]) -> C:
    """The config ``data`` describes, its class picked by ``data["model_type"]``.

    Raises:
        ValueError: an unknown model type, or fields the class does not have (all named).
    """
    model_type = data.get("model_type")
    if model_type not in classes:
        raise ValueError(f"model_type {model_type!r} is not a bigviz model; known: {', '.join(classes)}")
    cls = classes[model_type]
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - fields - {"model_type"})
    if unknown:
        raise ValueError(f"{model_type} config: unknown field(s) {unknown}; valid: {sorted(fields)}")
    return cls(**{k: v for k, v in data.items() if k != "model_type"})
