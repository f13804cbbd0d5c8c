"""The compute the disk's reads take (issue 26): bigviz.modeling.read_cost on real files."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from bigviz.modeling.read_cost import _Reading, measure_read_cost


def _files(tmp_path: Path, sizes: list[int]) -> list[str]:
    out = []
    for i, n in enumerate(sizes):
        path = tmp_path / f"shard-{i}.bin"
        path.write_bytes(os.urandom(n))
        out.append(str(path))
    return out


class _Sleeper(torch.nn.Module):
    """A forward of 10 ms, and ``extra`` more while the measurement's readers run."""

    def __init__(self, extra: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reading = any(t.name.startswith("bigviz-read-cost") for t in threading.enumerate())
        time.sleep(0.01 + (self.extra if reading else 0.0))
        return x * self.weight


def test_a_forward_slowed_by_the_reads_has_a_cost_and_one_that_is_not_has_less(tmp_path: Path) -> None:
    files = _files(tmp_path, [3 * 2**20 + 123, 5 * 2**20])
    x = torch.ones(4)
    slowed = measure_read_cost(_Sleeper(0.05), x, files=files, readers=2, repeat=4)
    free = measure_read_cost(_Sleeper(0.0), x, files=files, readers=2, repeat=4)
    assert slowed > 0
    assert slowed > free >= 0


def test_the_readers_read_the_files_round_and_round_and_count_what_they_read(tmp_path: Path) -> None:
    sizes = [3 * 2**20 + 123, 2**20]
    reading = _Reading([(f, n) for f, n in zip(_files(tmp_path, sizes), sizes)], readers=2)
    start = time.perf_counter()
    reading.start()
    reading.wait_for_first()
    deadline = time.perf_counter() + 10
    while sum(n for *_, n in reading.done) < 3 * sum(sizes) and time.perf_counter() < deadline:
        time.sleep(0.01)
    reading.stop()
    read = sum(n for *_, n in reading.done)
    assert read >= 3 * sum(sizes)  # past the end of the last file: round again
    assert {n for *_, n in reading.done} <= {3 * 2**20 + 123, 2**20}  # whole pieces, the files' own sizes
    assert reading.bytes_between(start, time.perf_counter()) == pytest.approx(read)
    assert reading.bytes_between(start - 10, start - 5) == 0


def test_nothing_to_read_is_a_clear_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    for files in ([], [str(empty)]):
        with pytest.raises(ValueError, match="non-empty file"):
            measure_read_cost(torch.nn.Linear(2, 2), torch.ones(2), files=files)
    with pytest.raises(ValueError, match="readers"):
        measure_read_cost(torch.nn.Linear(2, 2), torch.ones(2), files=_files(tmp_path, [4096]), readers=0)


def test_a_file_that_cannot_be_read_is_raised_not_hidden(tmp_path: Path) -> None:
    path = tmp_path / "gone.bin"
    path.write_bytes(os.urandom(2**20))
    reading = _Reading([(str(path), 2**21)], readers=1)  # says 2 MiB: the second piece is past the end
    reading.start()
    with pytest.raises(OSError):
        reading.wait_for_first()
        deadline = time.perf_counter() + 10
        while reading.error is None and time.perf_counter() < deadline:
            time.sleep(0.01)
        reading.stop()
