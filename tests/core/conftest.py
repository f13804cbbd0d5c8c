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
    """Any import of a heavy library during the test raises ImportError."""
    real = builtins.__import__

    def guarded(name: str, *args: object, **kwargs: object) -> object:
        if name.split(".")[0] in HEAVY:
            raise ImportError(f"tests/core must not import {name}: bigviz.core is pure Python")
        return real(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", guarded)
    yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark this folder's tests ``core`` (run them alone with ``pytest -m core``)."""
    for item in items:
        if "tests/core/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.core)
