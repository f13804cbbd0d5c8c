"""Promise: the Python writers (``save_device_map``, ``save_max_memory``, ``save_html``, a
pipeline plan's ``save_json``) give a path that cannot hold a file a clear ``OSError`` naming
it, with nothing made: a folder (the old error named a temporary file, ``/.tmp.tmp-...``), a
FIFO or a device (a rename would have replaced it with a regular file), a path under a file."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from torch import nn

import bigviz


def _plan() -> bigviz.DevicePlan:
    return bigviz.plan(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), {"cpu": "1GB"})


WRITERS: dict[str, Callable[[Path], object]] = {
    "save_device_map": lambda path: bigviz.save_device_map({"": "cpu"}, path),
    "save_max_memory": lambda path: bigviz.save_max_memory({"cpu": "1GB"}, path),
    "save_html": lambda path: bigviz.save_html(_plan(), path),
}


def _listing(folder: Path) -> list[tuple[str, bool]]:
    return sorted((str(p.relative_to(folder)), p.is_fifo()) for p in folder.rglob("*"))


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("kind", ["folder", "fifo", "under a file"])
def test_a_path_that_cannot_hold_a_file_is_named(tmp_path: Path, writer: str, kind: str):
    (tmp_path / "user.txt").write_text("mine")
    target = {"folder": tmp_path / "maps", "fifo": tmp_path / "pipe", "under a file": tmp_path / "user.txt" / "m.json"}[
        kind
    ]
    if kind == "folder":
        target.mkdir()
    elif kind == "fifo":
        os.mkfifo(target)
    before = _listing(tmp_path)
    with pytest.raises(OSError) as err:
        WRITERS[writer](target)
    assert str(target) in str(err.value) and ".tmp" not in str(err.value), str(err.value)
    assert _listing(tmp_path) == before  # nothing made, the FIFO still a FIFO
    assert (tmp_path / "user.txt").read_text() == "mine"
