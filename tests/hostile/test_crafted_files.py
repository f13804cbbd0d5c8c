"""Promise: crafted safetensors headers, index files and JSON files are refused up front, with
the file (and the tensor or entry) named: no RecursionError, no bool taken for an int, no read
outside the checkpoint folder, and the model stays as it was (on meta)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from torch import nn

import bigviz
from bigviz.checkpoint.errors import CheckpointError
from bigviz.checkpoint.index import CheckpointIndex
from bigviz.checkpoint.safetensors_io import write_safetensors

from tests.hostile.helpers import snapshot


def _raw_safetensors(path: Path, header: bytes, data: bytes = b"\0" * 64) -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def _meta_linear() -> nn.Module:
    with torch.device("meta"):
        return nn.Linear(2, 2)


def _refused(path: Path, *needles: str) -> None:
    """Opening and loading ``path`` raise a CheckpointError naming each needle; model untouched."""
    files = snapshot(path.parent)
    with pytest.raises(CheckpointError) as info:
        CheckpointIndex.open(path)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    model = _meta_linear()
    with pytest.raises(CheckpointError):
        bigviz.load_checkpoint_in_model(model, path, progress=False)
    assert all(p.is_meta for p in model.parameters())
    assert snapshot(path.parent) == files


@pytest.mark.parametrize("depth", [100_000, 5_000])
def test_deeply_nested_header(tmp_path: Path, depth: int):
    header = b'{"w": {"dtype": "F32", "shape": ' + b"[" * depth + b"]" * depth + b', "data_offsets": [0, 0]}}'
    path = _raw_safetensors(tmp_path / "deep.safetensors", header)
    _refused(path, str(path), "nested too deeply")


def test_header_nested_just_below_the_parser_limit(tmp_path: Path):
    for depth in range(940, 1000, 6):  # parses, then must not overflow while being reported
        shape = b"[" * depth + b"]" * depth
        path = _raw_safetensors(
            tmp_path / f"d{depth}.safetensors",
            b'{"weight": {"dtype": "F32", "shape": ' + shape + b', "data_offsets": [0, 16]}}',
        )
        with pytest.raises(CheckpointError) as info:
            CheckpointIndex.open(path)
        assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("shape", [True, 4], "invalid shape [True, 4]"),
        ("shape", [2, 2.0], "invalid shape"),
        ("data_offsets", [False, 16], "invalid data_offsets [False, 16]"),
        ("dtype", ["F32"], "unknown dtype ['F32']"),
        ("dtype", {"F32": 1}, "unknown dtype"),
    ],
)
def test_wrong_json_types_in_a_header(tmp_path: Path, field: str, value: object, needle: str):
    entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16], field: value}
    path = _raw_safetensors(tmp_path / "w.safetensors", json.dumps({"weight": entry}).encode())
    _refused(path, str(path), "'weight'", needle)


def _sharded(folder: Path) -> Path:
    folder.mkdir()
    write_safetensors(folder / "model-00001-of-00001.safetensors", {"weight": torch.ones(2, 2), "bias": torch.ones(2)})
    return folder / "model.safetensors.index.json"


def _write_index(index: Path, weight_map: dict) -> None:
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize(
    "entry",
    [
        "../outside/model.safetensors",
        "/abs/model.safetensors",
        "sub/../../outside/model.safetensors",
        "..\\outside\\model.safetensors",
        "C:\\models\\model.safetensors",
        "",
    ],
)
def test_index_entries_leading_out_of_the_folder(tmp_path: Path, entry: str):
    outside = tmp_path / "outside"
    outside.mkdir()
    write_safetensors(outside / "model.safetensors", {"weight": torch.full((2, 2), 7.0), "bias": torch.ones(2)})
    index = _sharded(tmp_path / "ckpt")
    _write_index(index, {"weight": entry, "bias": "model-00001-of-00001.safetensors"})
    _refused(index, str(index), "'weight'", repr(entry))
    _refused(index.parent, "'weight'")  # the folder finds the same index


def test_index_entry_through_a_symlinked_directory(tmp_path: Path):
    outside = tmp_path / "outside"
    outside.mkdir()
    write_safetensors(outside / "model.safetensors", {"weight": torch.full((2, 2), 7.0)})
    index = _sharded(tmp_path / "ckpt")
    os.symlink(outside, index.parent / "sub")
    _write_index(index, {"weight": "sub/model.safetensors", "bias": "model-00001-of-00001.safetensors"})
    _refused(index, "'weight'", "'sub/model.safetensors'", "leads out of the checkpoint folder")


def test_a_hugging_face_cache_snapshot_still_loads(tmp_path: Path):
    """The hub cache keeps each file as a symlink into ../../blobs: that is not an escape."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    source = nn.Linear(2, 2)
    bigviz.save_sharded(source, tmp_path / "saved", max_shard_size=16, progress=False)
    for i, path in enumerate(sorted((tmp_path / "saved").iterdir())):
        (blobs / f"blob{i}").write_bytes(path.read_bytes())
        os.symlink(f"../../blobs/blob{i}", snap / path.name)
    model = _meta_linear()
    bigviz.load_checkpoint_in_model(model, snap, progress=False)
    assert torch.equal(model.weight, source.weight) and torch.equal(model.bias, source.bias)


@pytest.mark.parametrize(
    "doc, needle",
    [
        ("[" * 100_000, "nested too deeply"),
        ('{"weight_map": ' + "[" * 50_000 + "]" * 50_000 + "}", "nested too deeply"),
        ('{"weight_map": [], "metadata": {}}', "'weight_map' must map"),
        ('{"weight_map": {"weight": "model-00001-of-00001.safetensors"}, "metadata": [1]}', "'metadata' must be"),
        ('{"weight_map": {"weight": true}}', "maps to True"),
        ('{"weight_map": {"weight": ["a"]}}', "not a file name"),
        ("[1, 2]", "must be a JSON object"),
        ('{"weight_map": {"weight": "model-00001-of-00001.safetensors"', "not valid JSON"),
    ],
)
def test_crafted_index_files(tmp_path: Path, doc: str, needle: str):
    index = _sharded(tmp_path / "ckpt")
    index.write_text(doc)
    _refused(index, str(index), needle)


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[" * 100_000, "nested too deeply"),
        ('{"a": ' + "[" * 100_000, "nested too deeply"),
        ('{"a": true}', "unknown device True"),
        ('{"a": [0]}', "unknown device [0]"),
        ("[0, 1]", "JSON object"),
    ],
)
def test_crafted_device_map_and_max_memory_files(tmp_path: Path, text: str, needle: str):
    path = tmp_path / "map.json"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        bigviz.load_device_map(path)
    assert str(path) in str(info.value) and needle in str(info.value)
    with pytest.raises(ValueError) as info:
        bigviz.load_max_memory(path)
    assert str(path) in str(info.value)


def _two_shards(folder: Path) -> Path:
    """A two-shard checkpoint of an ``nn.Linear(2, 2)``: weight in one shard, bias in the other."""
    return bigviz.save_sharded(nn.Linear(2, 2).state_dict(), folder, max_shard_size=16, progress=False)


@pytest.mark.parametrize("name", ["model.safetensors.index.json", "index.json"])
def test_an_index_naming_one_tensor_in_two_files_names_both(tmp_path: Path, name: str):
    """JSON keeps the last duplicate key: the tensor would silently be read from the second
    file. Refused, naming the tensor and both files."""
    folder = _two_shards(tmp_path / "c")
    index = folder / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    first, second = sorted(set(doc["weight_map"].values()))
    lines = [
        '{"metadata": {}, "weight_map": {',
        f'"weight": "{first}",',
        f'"weight": "{second}",',
        f'"bias": "{second}"',
    ]
    text = "\n".join(lines) + "}}"
    if name == "index.json":  # accelerate's flat index
        index.unlink()
        text = "{" + "\n".join(lines[1:]) + "}"
    (folder / name).write_text(text)
    _refused(folder / name, "'weight'", first, second, "listed 2 times")
    _refused(folder, "'weight'", first, second)  # the folder too


def test_an_index_naming_a_tensor_twice_in_the_same_file_is_refused_too(tmp_path: Path):
    folder = _two_shards(tmp_path / "c")
    index = folder / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    shard = doc["weight_map"]["weight"]
    body = ", ".join(f'"{k}": "{v}"' for k, v in doc["weight_map"].items())
    index.write_text('{"weight_map": {' + body + f', "weight": "{shard}"' + "}}")
    _refused(index, "'weight'", "the same file each time")


def test_a_safetensors_header_naming_a_tensor_twice_is_refused(tmp_path: Path):
    header = (
        b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
        b'"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}'
    )
    path = _raw_safetensors(tmp_path / "twice.safetensors", header + b" " * (-len(header) % 8))
    _refused(path, str(path), "'w' appears twice")


def test_a_device_map_file_naming_a_module_twice_is_refused(tmp_path: Path):
    path = tmp_path / "map.json"
    path.write_text('{"0": "cpu", "0": "disk"}')
    with pytest.raises(ValueError, match=r"'0' appears twice \('cpu', then 'disk'\)") as info:
        bigviz.load_device_map(path)
    assert str(path) in str(info.value)
