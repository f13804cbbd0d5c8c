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


def test_only_what_a_run_replaced_goes_to_the_diary(records: ModuleType, tmp_path: Path) -> None:
    """A run of one size of the larger-than-RAM bench carries the other size on, marked as
    kept: that size was not replaced, so it does not go to the diary (it goes, once, when a
    run measures it again). Before, every run sent the whole record, both sizes, and the
    diary held the same figures two and three times, some of them still current."""
    day = datetime.date(2026, 12, 3)
    kept = "(Kept from this size's last run, 2026-12-03: not measured again in this one.)\n\n"
    records.write_section("beyond_ram", "## 32 GB\n\nrun 1: 1.10x\n\n## 50 GB\n\nrun 1: 1.20x", today=day)
    records.write_section("beyond_ram", f"## 32 GB\n\nrun 2: 1.05x\n\n## 50 GB\n\n{kept}run 1: 1.20x", today=day)
    diary = tmp_path / "history" / "2026-12-03.md"
    assert "run 1: 1.10x" in diary.read_text() and "1.20x" not in diary.read_text()
    records.write_section("beyond_ram", f"## 32 GB\n\n{kept}run 2: 1.05x\n\n## 50 GB\n\nrun 2: 1.15x", today=day)
    text = diary.read_text()
    assert text.count("run 1: 1.20x") == 1 and text.count("run 1: 1.10x") == 1
    assert "run 2" not in text  # both current: in bench/results, not in the diary
    current = (tmp_path / "results" / "beyond_ram.md").read_text()
    assert "run 2: 1.05x" in current and "run 2: 1.15x" in current
    records.write_section("beyond_ram", f"## 32 GB\n\n{kept}run 2: 1.05x\n\n## 50 GB\n\n{kept}run 2: 1.15x", today=day)
    assert diary.read_text() == text  # nothing replaced, nothing archived
