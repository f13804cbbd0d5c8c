"""Issue 26: ``bench/beyond_ram.py --memory in-use`` measures a machine whose RAM holds page cache
(``bench/in_use.py``). The filler it reads is written once, marked as the bench's, never written
over a file that is not; a write that fails leaves nothing; a refill reads every byte; the
report says which memory a run measured, and an in-use run keeps its own records."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def in_use() -> ModuleType:
    return _load("in_use")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return _load("beyond_ram")


def test_the_filler_is_written_once_marked_and_reused(in_use: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / in_use.FILLER_NAME
    size = 3 * in_use.CHUNK + 4096  # not a whole number of chunks
    assert in_use.ensure_filler(path, size) > 0
    assert path.stat().st_size == size and in_use.is_ours(path)
    assert not (tmp_path / (path.name + ".partial")).exists()
    stamp = path.stat().st_mtime_ns
    assert in_use.ensure_filler(path, size) == 0.0  # reused
    assert path.stat().st_mtime_ns == stamp
    in_use.ensure_filler(path, in_use.CHUNK)  # ours, another size: written again
    assert path.stat().st_size == in_use.CHUNK and in_use.is_ours(path)


def test_a_file_that_is_not_the_filler_is_never_overwritten(in_use: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / in_use.FILLER_NAME
    path.write_bytes(b"someone's data")
    with pytest.raises(FileExistsError, match="not the bench's page-cache filler"):
        in_use.ensure_filler(path, in_use.CHUNK)
    assert path.read_bytes() == b"someone's data"


def test_a_write_that_fails_leaves_no_half_filler(
    in_use: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / in_use.FILLER_NAME

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(in_use.os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        in_use.ensure_filler(path, 2 * in_use.CHUNK)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("readers", [1, 3, 4])
def test_a_refill_reads_every_byte(in_use: ModuleType, tmp_path: Path, readers: int) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(5 * in_use.CHUNK + 123))
    done = in_use.refill(path, readers=readers)
    assert done.nbytes == path.stat().st_size and done.seconds >= 0


def test_a_refill_of_a_missing_file_raises(in_use: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(OSError):
        in_use.refill(tmp_path / "gone")


def test_the_filler_leaves_room_for_the_processes(in_use: ModuleType) -> None:
    ram = 24 * 2**30
    size = in_use.filler_bytes(ram)
    assert size == ram - in_use.LEFT_FREE and size % in_use.CHUNK == 0
    assert in_use.filler_bytes(2**20) == in_use.CHUNK  # never empty


def _args(bench: ModuleType, tmp_path: Path, **over: object) -> argparse.Namespace:
    return argparse.Namespace(**{"memory": "in-use", "small": False, "work": tmp_path, **over})


def test_in_use_runs_are_named_and_recorded_apart(bench: ModuleType, tmp_path: Path) -> None:
    assert bench._tag(_args(bench, tmp_path)) == "-in-use"
    assert bench._tag(_args(bench, tmp_path, memory="dropped")) == ""
    assert bench._filler(_args(bench, tmp_path, memory="dropped"), {}) is None
    records = _load("records")
    assert records.ORDER.index("beyond_ram_in_use") == records.ORDER.index("beyond_ram") + 1


def test_in_use_refuses_small_runs_and_a_disk_without_room(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SystemExit, match="not with --small"):
        bench._filler(_args(bench, tmp_path, small=True), {})
    monkeypatch.setattr(bench, "machine_ram", lambda: 8 * 2**30)
    monkeypatch.setattr(bench.shutil, "disk_usage", lambda _: argparse.Namespace(free=4 * 2**30))
    with pytest.raises(SystemExit, match="the filler needs"):
        bench._filler(_args(bench, tmp_path), {})
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_the_filler_is_made_for_this_machines_ram(
    bench: ModuleType, in_use: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "machine_ram", lambda: in_use.LEFT_FREE + 2 * in_use.CHUNK)
    info: dict[str, object] = {}
    path = bench._filler(_args(bench, tmp_path), info)
    assert path == tmp_path / in_use.FILLER_NAME
    assert path.stat().st_size == 2 * in_use.CHUNK == info["filler_bytes"]


def test_the_report_says_which_memory_it_measured(bench: ModuleType) -> None:
    dropped = bench._cache_note({"drop": "global"})
    assert dropped == "Page cache dropped (global) before each line."
    note = bench._cache_note(
        {
            "memory": "in-use",
            "drop": "files",
            "filler_bytes": 21 * 10**9,
            "refills": [{"nbytes": 21 * 10**9, "seconds": 30.4}, {"nbytes": 21 * 10**9, "seconds": 12.0}],
        }
    )
    assert "--memory in-use" in note and "21.0 GB filler" in note and "(30, 12 s)" in note
