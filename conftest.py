"""Settings for the whole test run (tests, doctests in bigviz/, notebooks).

The suite must pass on a busy machine (CI shares its 2 cores): nothing here waits on a clock
for a result that only takes longer under load. nbval's defaults do: 60 s for a kernel to
start and 5 s between two messages of a finished cell. Both are raised (they are only ever
reached when the machine is slow; a fast run never waits for them).
"""

from __future__ import annotations

import pytest

KERNEL_STARTUP_S = 600
CELL_OUTPUT_S = 300


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "nbval_kernel_startup_timeout", None) == 60:  # nbval's default
        config.option.nbval_kernel_startup_timeout = KERNEL_STARTUP_S


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(getattr(item, "output_timeout", None), (int, float)):  # an nbval cell
            item.output_timeout = max(item.output_timeout, CELL_OUTPUT_S)
