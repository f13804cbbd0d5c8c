"""Issue 24: the benchmark records keep. ``bench/RESULTS.md`` is assembled whole from one
section file per bench; a bench run replaces its own section only, and what it replaces goes
to the dated diary (``bench/run.py`` used to rewrite the file from its seven benches and drop
the larger-than-RAM record on its next run)."""

from __future__ import annotations

import datetime
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("records", BENCH / "records.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "HERE", tmp_path)
    monkeypatch.setattr(module, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(module, "HISTORY", tmp_path / "history")
    return module


def test_a_run_of_one_bench_keeps_every_other_record(records: ModuleType, tmp_path: Path) -> None:
    day1, day2 = datetime.date(2026, 12, 1), datetime.date(2026, 12, 2)
    records.write_section("beyond_ram", "## Larger than RAM\n\n32.1 GB, 1.09x the floor", today=day1)
    records.write_section("planning", "## Planning\n\n0.068 s", today=day1)
    records.assemble()
    records.write_section("planning", "## Planning\n\n0.061 s", note="`python bench/planning.py`", today=day2)
    text = records.assemble("2 cores").read_text()
    assert "0.061 s" in text and "0.068 s" not in text  # the latest planning figures
    assert "1.09x the floor" in text  # the larger-than-RAM record was not run again: kept
    assert text.index("## Planning") < text.index("## Larger than RAM")  # a fixed order
    assert "measured 2026-12-02" in text and "measured 2026-12-01" in text
    diary = (tmp_path / "history" / "2026-12-01.md").read_text()
    assert "0.068 s" in diary  # the replaced figures are in the diary of their day
    assert "history/2026-12-01.md" in text


def test_the_repository_records_are_assembled_whole() -> None:
    results = {p.stem for p in (BENCH / "results").glob("*.md")}
    assert {"planning", "load", "dispatch", "slider", "beyond_ram"} <= results
    text = (BENCH / "RESULTS.md").read_text()
    assert "Assembled by `python bench/run.py`" in text and "## Larger than RAM" in text
    assert (BENCH / "studies" / "README.md").exists() and list((BENCH / "history").glob("*.md"))
