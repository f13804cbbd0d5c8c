"""Lazy exports for package ``__init__`` files: a name's module is imported on first use.

This keeps ``import bigviz`` (and ``bigviz.checkpoint``, ``bigviz.ui``) from loading torch,
plotly or ipywidgets until a name that needs them is used.

Example:
    >>> __getattr__, __dir__ = lazy_exports("demo", {"dumps": "json"}, {})
    >>> __getattr__("dumps")([1])
    '[1]'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` serving ``exports`` (name -> module path).

    Values are cached in ``namespace`` (the package's ``globals()``), so later look-ups are
    plain attribute reads.
    """
    names = sorted(exports)

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return names + [n for n in namespace if n.startswith("__") and n.endswith("__")]

    return __getattr__, __dir__
