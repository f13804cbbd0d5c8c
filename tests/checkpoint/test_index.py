"""CheckpointIndex: every layout, headers only, and every kind of broken checkpoint."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from bigviz.checkpoint.errors import CheckpointError
from bigviz.checkpoint.index import CheckpointIndex, TensorInfo
from bigviz.checkpoint.lazy import LazyWeights
from bigviz.checkpoint.save import save_sharded

STATE = {
    "linear1.weight": torch.ones(4, 2),
    "linear1.bias": torch.zeros(4),
    "linear2.weight": torch.full((3, 4), 2.0),
    "linear2.bias": torch.arange(3, dtype=torch.int64),
}


def _sharded(folder: Path, safe: bool = True) -> Path:
    return save_sharded(STATE, folder, max_shard_size=50, safe_serialization=safe, progress=False)


def _expect_entries(index: CheckpointIndex) -> None:
    assert set(index.keys()) == set(STATE) and len(index) == 4
    info = index.entries["linear2.weight"]
    assert (info.dtype, info.shape, info.nbytes, info.numel) == ("float32", (3, 4), 48, 12)
    assert index.entries["linear2.bias"].dtype == "int64"
    assert index.total_bytes == sum(t.numel() * t.element_size() for t in STATE.values())
    with LazyWeights(index) as weights:
        assert all(torch.equal(weights[k], v) for k, v in STATE.items())


@pytest.mark.parametrize("suffix", [".safetensors", ".bin", ".pt", ".pth"])
def test_single_file_of_each_suffix(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"weights{suffix}"
    if suffix == ".safetensors":
        save_sharded(STATE, tmp_path / "s", progress=False).joinpath("model.safetensors").rename(path)
    else:
        torch.save(STATE, path)
    index = CheckpointIndex.open(path)
    assert index.format == ("safetensors" if suffix == ".safetensors" else "torch")
    assert index.files == [path] and index.path == path
    _expect_entries(index)
    assert CheckpointIndex.open(tmp_path).path == path  # a folder with one weights file


def test_safetensors_offsets_are_absolute(tmp_path: Path) -> None:
    folder = save_sharded(STATE, tmp_path / "c", progress=False)
    index = CheckpointIndex.open(folder)
    raw = (folder / "model.safetensors").read_bytes()
    for name, info in index.entries.items():
        begin, end = info.data_offsets
        assert raw[begin:end] == STATE[name].numpy().tobytes()
    assert isinstance(info, TensorInfo) and index.metadata == {"format": "pt"}


@pytest.mark.parametrize("safe", [True, False])
def test_sharded_folder_and_index_path(tmp_path: Path, safe: bool) -> None:
    folder = _sharded(tmp_path / "c", safe)
    index = CheckpointIndex.open(folder)
    assert index.path.name == ("model.safetensors.index.json" if safe else "pytorch_model.bin.index.json")
    assert len(index.files) == 3 and index.metadata["total_size"] == index.total_bytes
    _expect_entries(index)
    _expect_entries(CheckpointIndex.open(index.path))


def test_variant_index_only_when_unambiguous(tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "c")
    (folder / "model.safetensors.index.json").rename(folder / "model.safetensors.index.fp16.json")
    _expect_entries(CheckpointIndex.open(folder))
    (folder / "model.safetensors.index.fp32.json").write_text(
        (folder / "model.safetensors.index.fp16.json").read_text()
    )
    with pytest.raises(CheckpointError, match="ambiguous.*fp16.*fp32"):
        CheckpointIndex.open(folder)


@pytest.mark.parametrize("safe", [True, False])
def test_the_single_file_before_its_index_as_transformers_reads(tmp_path: Path, safe: bool) -> None:
    """A folder holding both a single weights file and a sharded index of the same format is
    read as ``from_pretrained`` reads it: the single file (a save interrupted between the two
    can leave both; the loader and the save's own ranking must agree on which is live)."""
    from bigviz.checkpoint.commit import _preference

    folder = _sharded(tmp_path / "c", safe)
    single = "model.safetensors" if safe else "pytorch_model.bin"
    other = {k: v + 1 for k, v in STATE.items()}
    save_sharded(other, tmp_path / "one", safe_serialization=safe, progress=False)
    (tmp_path / "one" / single).rename(folder / single)
    index = CheckpointIndex.open(folder)
    assert index.path.name == single and len(index.files) == 1
    with LazyWeights(index) as weights:
        assert torch.equal(weights["linear1.weight"], other["linear1.weight"])
    assert _preference(single) < _preference(f"{single}.index.json")
    (folder / single).unlink()
    assert CheckpointIndex.open(folder).path.name == f"{single}.index.json"


def test_prefers_safetensors_when_both_formats(tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "c")
    for p in _sharded(tmp_path / "b", safe=False).iterdir():
        p.rename(folder / p.name)
    assert CheckpointIndex.open(folder).format == "safetensors"
    assert CheckpointIndex.open(folder, prefer_safe=False).format == "torch"


def test_accelerate_flat_index_json_with_bin_files(tmp_path: Path) -> None:
    # the layout in accelerate's docs: index.json maps names to first/second_state_dict.bin
    torch.save({k: v for k, v in STATE.items() if k.startswith("linear1")}, tmp_path / "first_state_dict.bin")
    torch.save({k: v for k, v in STATE.items() if k.startswith("linear2")}, tmp_path / "second_state_dict.bin")
    mapping = {k: "first_state_dict.bin" if k.startswith("linear1") else "second_state_dict.bin" for k in STATE}
    (tmp_path / "index.json").write_text(json.dumps(mapping))
    index = CheckpointIndex.open(tmp_path)
    assert index.format == "torch" and index.path.name == "index.json"
    _expect_entries(index)


def test_missing_shards_are_all_listed(tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "c")
    (folder / "model-00001-of-00003.safetensors").unlink()
    (folder / "model-00003-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError) as err:
        CheckpointIndex.open(folder)
    text = str(err.value)
    assert "model-00001-of-00003.safetensors" in text and "model-00003-of-00003.safetensors" in text
    assert "missing" in text and len(err.value.problems) == 2


def _write_raw(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> None:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)


@pytest.mark.parametrize(
    "case, expect",
    [
        ("truncated", "beyond the file end"),
        ("length", "header length"),
        ("json", "not valid JSON"),
        ("overlap", "overlap"),
        ("dtype", "unknown dtype"),
        ("size", "needs 16"),
    ],
)
def test_corrupt_safetensors_files(tmp_path: Path, case: str, expect: str) -> None:
    path = tmp_path / "model.safetensors"
    if case == "truncated":
        save_sharded(STATE, tmp_path / "c", progress=False)
        raw = (tmp_path / "c" / "model.safetensors").read_bytes()
        path.write_bytes(raw[:-10])
    elif case == "length":
        _write_raw(path, b"{}", length=10**6)
    elif case == "json":
        _write_raw(path, b"{not json")
    else:
        entries = {
            "overlap": {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
            },
            "dtype": {"a": {"dtype": "F31", "shape": [4], "data_offsets": [0, 16]}},
            "size": {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}},
        }[case]
        _write_raw(path, json.dumps(entries).encode(), b"\0" * 24)
    with pytest.raises(CheckpointError, match=expect) as err:
        CheckpointIndex.open(path)
    assert str(path) in str(err.value) and "re-download" in str(err.value)


def test_every_corrupt_shard_reported_at_once(tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "c")
    for name in ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"):
        raw = (folder / name).read_bytes()
        (folder / name).write_bytes(raw[:-4])
    with pytest.raises(CheckpointError) as err:
        CheckpointIndex.open(folder)
    assert len(err.value.problems) == 2


@pytest.mark.parametrize("safe", [True, False])
def test_missing_and_corrupt_shards_in_one_error(tmp_path: Path, safe: bool) -> None:
    """A folder with a missing shard and a damaged one: both named in one error, each fix said."""
    folder = _sharded(tmp_path / "c", safe=safe)
    shards = sorted(p for p in folder.iterdir() if not p.name.endswith(".json"))
    assert len(shards) == 3
    shards[0].unlink()
    shards[2].write_bytes(shards[2].read_bytes()[:-4])  # truncated
    with pytest.raises(CheckpointError) as err:
        CheckpointIndex.open(folder)
    problems = err.value.problems
    assert len(problems) == 2, problems
    gone = "shard named by the index is missing"
    assert any(shards[0].name in p and gone in p for p in problems)
    assert any(shards[2].name in p and gone not in p for p in problems)
    assert "copy the missing shards" in str(err.value)


def test_index_naming_a_tensor_the_shard_lacks(tmp_path: Path) -> None:
    folder = _sharded(tmp_path / "c")
    doc = json.loads((folder / "model.safetensors.index.json").read_text())
    doc["weight_map"]["ghost.weight"] = "model-00001-of-00003.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="ghost.weight.*does not hold it"):
        CheckpointIndex.open(folder)


def test_malicious_pickle_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"w": torch.ones(2), "evil": Evil()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="would build objects other than tensors"):
        CheckpointIndex.open(tmp_path)
    assert not marker.exists()


def test_garbage_and_empty_folders(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"hello" * 20)
    with pytest.raises(CheckpointError, match="not a readable torch checkpoint"):
        CheckpointIndex.open(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="no checkpoint found.*notes.txt"):
        CheckpointIndex.open(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointIndex.open(tmp_path / "nope")
