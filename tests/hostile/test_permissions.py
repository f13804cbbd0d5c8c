"""Promise: files bigviz writes get the usual permissions (``0o666`` less the umask), not the
``0o600`` of a ``tempfile.mkstemp`` file: device maps, budgets, reports, checkpoints, offload
folders."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch import nn

import bigviz


@pytest.fixture(params=[0o022, 0o002])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}


def test_written_files_get_the_usual_permissions(tmp_path: Path, umask: int):
    want = 0o666 & ~umask
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    plan = bigviz.plan(model, {"cpu": "1GB"})
    bigviz.save_device_map(plan.device_map, tmp_path / "out" / "map.json")
    bigviz.save_max_memory({"cpu": "1GB"}, tmp_path / "out" / "budget.json")
    bigviz.save_html(plan, tmp_path / "out" / "report.html")
    bigviz.save_sharded(model, tmp_path / "out" / "ckpt", max_shard_size=60, progress=False)
    bigviz.save_sharded(model, tmp_path / "out" / "ckpt", max_shard_size=200, overwrite=True, progress=False)
    bigviz.disk_offload(nn.Sequential(nn.Linear(4, 4)), tmp_path / "out" / "offload")
    modes = _modes(tmp_path / "out")
    assert len(modes) >= 5 and set(modes.values()) == {want}, {k: oct(v) for k, v in modes.items()}


def test_a_replaced_file_keeps_its_mode(tmp_path: Path):
    path = tmp_path / "map.json"
    bigviz.save_device_map({"": "cpu"}, path)
    os.chmod(path, 0o640)
    bigviz.save_device_map({"": 0}, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and bigviz.load_device_map(path) == {"": 0}
