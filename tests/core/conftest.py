"""tests/core runs without torch: bigviz.core is pure Python, and these tests prove it.

Importing torch (or numpy, pandas, plotly) from a test in this folder, or from the core
modules it uses, fails the test. CI also runs this folder in a bare virtual environment
with no torch installed (`.ci/run`).
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator

import pytest

HEAVY = ("torch", "numpy", "pandas", "plotly", "ipywidgets")


@pytest.fixture(autouse=True)
def no_torch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An import of a heavy library by bigviz or by these tests raises ImportError (test tools
    such as hypothesis may use numpy themselves)."""
    real = builtins.__import__

    def guarded(name: str, globals: dict[str, object] | None = None, *args: object, **kwargs: object) -> object:
        importer = str((globals or {}).get("__name__", ""))
        if name.split(".")[0] in HEAVY and importer.startswith(("bigviz", "tests.core", "test_")):
            raise ImportError(f"{importer} must not import {name} in tests/core: bigviz.core is pure Python")
        return real(name, globals, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", guarded)
    yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark this folder's tests ``core`` (run them alone with ``pytest -m core``)."""
    for item in items:
        if "tests/core/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.core)
