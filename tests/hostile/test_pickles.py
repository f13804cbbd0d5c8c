"""Promise: a torch pickle (``.bin``) is never mapped blindly. Compressed zip records are read
through torch's checked reader (right values, not garbage); records shorter than their tensors,
keys that are not strings, tensors on meta and non-tensor values are refused up front, naming
the file; a pickle that would run code is refused. The model is left as it was."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import bigviz
from bigviz.checkpoint.errors import CheckpointError
from bigviz.checkpoint.index import CheckpointIndex

from tests.hostile.helpers import snapshot

STATE = {"weight": torch.arange(6.0).reshape(3, 2), "bias": torch.tensor([1.0, -2.0, 3.0])}


def _rezip(src: Path, dst: Path, *, compression: int = zipfile.ZIP_STORED, cut: dict[str, int] | None = None) -> Path:
    """Rewrite a torch zip with another compression, or with some records cut short."""
    with zipfile.ZipFile(src) as old, zipfile.ZipFile(dst, "w", compression) as new:
        for info in old.infolist():
            data = old.read(info.filename)
            for suffix, length in (cut or {}).items():
                if info.filename.endswith(suffix):
                    data = data[:length]
            new.writestr(info.filename, data)
    return dst


def _meta_model() -> nn.Module:
    with torch.device("meta"):
        return nn.Linear(2, 3)


def _load(path: Path) -> nn.Module:
    model = _meta_model()
    bigviz.load_checkpoint_in_model(model, path, progress=False)
    return model


def test_compressed_records_give_the_right_values(tmp_path: Path):
    torch.save(STATE, tmp_path / "plain.bin")
    for method in (zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA):
        folder = tmp_path / f"c{method}"
        folder.mkdir()
        path = _rezip(tmp_path / "plain.bin", folder / "pytorch_model.bin", compression=method)
        if method != zipfile.ZIP_DEFLATED:
            with pytest.raises(CheckpointError, match=str(path)):  # torch cannot read these: said so
                _load(path)
            continue
        model = _load(path)
        assert torch.equal(model.weight, STATE["weight"]) and torch.equal(model.bias, STATE["bias"])


@pytest.mark.parametrize("record, length", [("data/0", 8), ("data/0", 0), ("data/1", 11)])
def test_records_shorter_than_their_tensors_are_refused(tmp_path: Path, record: str, length: int):
    torch.save(STATE, tmp_path / "plain.bin")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    path = _rezip(tmp_path / "plain.bin", folder / "pytorch_model.bin", cut={record: length})
    files = snapshot(folder)
    with pytest.raises(CheckpointError) as info:
        CheckpointIndex.open(folder)
    assert str(path) in str(info.value) and record in str(info.value) and "truncated or corrupt" in str(info.value)
    model = _meta_model()
    with pytest.raises(CheckpointError, match=record):
        bigviz.load_checkpoint_in_model(model, folder, progress=False)
    assert all(p.is_meta for p in model.parameters()) and snapshot(folder) == files


@pytest.mark.parametrize(
    "state, needles",
    [
        ({0: torch.ones(2), "bias": torch.ones(3)}, ["key 0 is an int, not a tensor name"]),
        ({("w", 1): torch.ones(2)}, ["key ('w', 1) is a tuple"]),
        (
            {"weight": torch.empty(3, 2, device="meta"), "bias": torch.ones(3)},
            ["'weight' is a tensor on the meta device"],
        ),
        (
            {"weight": {"inner": torch.ones(3, 2)}, "bias": [torch.ones(3)], "step": 3},
            ["'weight' holds a dict", "'bias' holds a list", "'step' holds an int"],
        ),
    ],
)
def test_pickles_that_are_not_flat_state_dicts(tmp_path: Path, state: dict, needles: list[str]):
    path = tmp_path / "pytorch_model.bin"
    torch.save(state, path)
    model = _meta_model()
    with pytest.raises(CheckpointError) as info:
        bigviz.load_checkpoint_in_model(model, path, progress=False)
    message = str(info.value)
    assert str(path) in message
    for needle in needles:
        assert needle in message, message
    assert all(p.is_meta for p in model.parameters())


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path: Path, capsys):
    path = tmp_path / "pytorch_model.bin"
    torch.save({"weight": torch.ones(3, 2), "bias": _Evil()}, path)
    with pytest.raises(CheckpointError, match="refused to unpickle"):
        _load(path)
    assert "pwned" not in capsys.readouterr().out
