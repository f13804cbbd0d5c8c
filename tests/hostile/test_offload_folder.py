"""Promise: bigviz only reuses or deletes the offload-folder files its own record
(``bigviz-offload.json``) says it wrote. A folder holding anything else (a saved checkpoint,
your files) is refused by ``disk_offload``, ``dispatch_model`` and ``.bin`` loads with a disk
map, naming the folder and the files, before anything is written or moved."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import bigviz
from bigviz.models import GPT, GPTConfig

from tests.hostile.helpers import assert_same_state, model_state, snapshot


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("gpt-tiny")).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(5))


def _folder_with_a_checkpoint(folder: Path, *, sharded: bool = True) -> dict[str, bytes]:
    """An offload folder someone pointed at their saved checkpoint (no bigviz record in it)."""
    bigviz.save_sharded(_gpt(9), folder, max_shard_size="30KB" if sharded else "1GB", progress=False)
    return snapshot(folder)


def _refused(err: pytest.ExceptionInfo, folder: Path, files: dict[str, bytes]) -> None:
    message = str(err.value)
    assert str(folder) in message and "bigviz-offload.json" in message, message
    assert sorted(files)[0] in message  # the files are named
    assert snapshot(folder) == files


@pytest.mark.parametrize("sharded", [True, False])
def test_disk_offload_refuses_a_folder_holding_a_checkpoint(tmp_path: Path, sharded: bool):
    folder = tmp_path / "off"
    files = _folder_with_a_checkpoint(folder, sharded=sharded)
    model = _gpt()
    before = model_state(model)
    with pytest.raises(ValueError) as err:
        bigviz.disk_offload(model, folder)
    _refused(err, folder, files)
    assert_same_state(model, before) and not hasattr(model, "_hf_hook")


def test_dispatch_model_refuses_a_folder_holding_other_files(tmp_path: Path):
    folder = tmp_path / "off"
    files = _folder_with_a_checkpoint(folder)
    (folder / "notes.txt").write_text("mine")
    files = snapshot(folder)
    model = _gpt()
    before = model_state(model)
    device_map = {
        "transformer.wte": "cpu",
        "transformer.wpe": "cpu",
        "transformer.h": "disk",
        "transformer.ln_f": "cpu",
        "lm_head": "cpu",
    }
    with pytest.raises(ValueError) as err:
        bigviz.dispatch_model(model, device_map, offload_folder=folder)
    _refused(err, folder, files)
    assert "notes.txt" in str(err.value)
    assert_same_state(model, before) and not hasattr(model, "_hf_hook")


def test_a_bin_load_with_a_disk_map_refuses_a_folder_holding_a_checkpoint(tmp_path: Path):
    source = _gpt(1)
    bigviz.save_sharded(source, tmp_path / "bin", safe_serialization=False, progress=False)
    folder = tmp_path / "off"
    files = _folder_with_a_checkpoint(folder, sharded=False)  # a user's model.safetensors
    with bigviz.init_empty_weights():
        model = GPT(source.config)
    device_map = {
        "transformer.wte": "cpu",
        "transformer.wpe": "cpu",
        "transformer.h": "disk",
        "transformer.ln_f": "cpu",
        "lm_head": "cpu",
    }
    with pytest.raises(ValueError) as err:
        bigviz.load_checkpoint_and_dispatch(model, tmp_path / "bin", device_map, offload_folder=folder)
    _refused(err, folder, files)
    assert all(p.is_meta for p in model.parameters())


def test_its_own_offload_folder_is_reused_and_only_its_files_replaced(tmp_path: Path):
    folder = tmp_path / "off"
    first, second = _gpt(1), _gpt(2)
    with torch.no_grad():
        want = second(_ids())[0]
    bigviz.remove_hooks(bigviz.disk_offload(copy.deepcopy(first), folder))
    record = json.loads((folder / "bigviz-offload.json").read_text())
    old_files = set(record["files"])
    model = bigviz.disk_offload(copy.deepcopy(second), folder)  # bigviz's own folder: replaced
    with torch.no_grad():
        assert torch.equal(model(_ids())[0], want)
    record = json.loads((folder / "bigviz-offload.json").read_text())
    on_disk = {p.name for p in folder.iterdir()}
    assert on_disk == set(record["files"]) | {"bigviz-offload.json"}  # no stale files of the first
    assert not old_files & set(record["files"])
    for name, size in record["files"].items():
        assert (folder / name).stat().st_size == size


def test_a_file_added_to_its_offload_folder_is_kept(tmp_path: Path):
    folder = tmp_path / "off"
    bigviz.remove_hooks(bigviz.disk_offload(_gpt(1), folder))
    (folder / "notes.txt").write_text("mine")
    files = snapshot(folder)
    model = _gpt(2)
    with pytest.raises(ValueError) as err:
        bigviz.disk_offload(model, folder)
    _refused(err, folder, files)
    assert "notes.txt" in str(err.value)


def test_a_file_of_its_own_changed_by_hand_is_no_longer_its_own(tmp_path: Path):
    folder = tmp_path / "off"
    bigviz.remove_hooks(bigviz.disk_offload(_gpt(1), folder))
    record = json.loads((folder / "bigviz-offload.json").read_text())
    mine = folder / sorted(record["files"])[0]
    mine.write_bytes(b"my own bytes now")
    files = snapshot(folder)
    with pytest.raises(ValueError) as err:
        bigviz.disk_offload(_gpt(2), folder)
    assert mine.name in str(err.value) and "changed" in str(err.value)
    assert snapshot(folder) == files


def test_a_crafted_offload_record_is_refused(tmp_path: Path):
    folder = tmp_path / "off"
    folder.mkdir()
    (folder / "secret.txt").write_text("keep")
    for record in ('{"files": {"../secret.txt": 4}}', "[" * 100_000, '{"files": {"secret.txt": true}}'):
        (folder / "bigviz-offload.json").write_text(record)
        files = snapshot(folder)
        with pytest.raises(ValueError, match="bigviz-offload.json"):
            bigviz.disk_offload(_gpt(1), folder)
        assert snapshot(folder) == files


def test_an_empty_or_new_folder_is_fine_and_a_meta_model_reads_it_back(tmp_path: Path):
    model = bigviz.disk_offload(_gpt(3), tmp_path / "new" / "off")
    with torch.no_grad():
        want = model(_ids())[0]
    bigviz.remove_hooks(model)
    with bigviz.init_empty_weights():
        meta = GPT(GPTConfig.preset("gpt-tiny"))
    bigviz.disk_offload(meta, tmp_path / "new" / "off")
    with torch.no_grad():
        assert torch.equal(meta(_ids())[0], want)
    assert all(p.is_meta for p in meta.parameters())
