"""LazyWeights: zero-copy views, a names map, dtype rules, prefetch, files mapped once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from bigviz.checkpoint.index import CheckpointIndex
from bigviz.checkpoint.lazy import LazyWeights
from bigviz.checkpoint.save import save_sharded

STATE = {
    "model.layers.0.w": torch.arange(6.0).reshape(2, 3),
    "model.layers.0.b": torch.ones(3),
    "model.norm.w": torch.full((3,), 0.5),
    "model.steps": torch.tensor(4),
}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return save_sharded(STATE, tmp_path / "c", max_shard_size=32, progress=False)


def test_identity_mapping_reads_every_tensor(folder: Path) -> None:
    with LazyWeights(folder) as weights:
        assert set(weights) == set(STATE) and len(weights) == 4
        for name, tensor in STATE.items():
            assert torch.equal(weights[name], tensor) and weights.nbytes(name) == tensor.numel() * tensor.element_size()


def test_names_map_renames_keys(folder: Path) -> None:
    names = {"layers.0.w": "model.layers.0.w", "norm.w": "model.norm.w"}
    with LazyWeights(CheckpointIndex.open(folder), names) as weights:
        assert list(weights) == ["layers.0.w", "norm.w"] and "model.norm.w" not in weights
        assert torch.equal(weights["layers.0.w"], STATE["model.layers.0.w"])
        with pytest.raises(KeyError):
            weights["model.layers.0.w"]
    with pytest.raises(KeyError, match="ghost"):
        LazyWeights(folder, {"x": "ghost"})


def test_dtype_converts_floats_except_kept_modules(folder: Path) -> None:
    names = {k.removeprefix("model."): k for k in STATE}
    with LazyWeights(folder, names, dtype=torch.float16, keep_dtype=["norm"]) as weights:
        assert weights["layers.0.w"].dtype == torch.float16
        assert weights["norm.w"].dtype == torch.float32  # kept
        assert weights["steps"].dtype == torch.int64  # not floating
        assert torch.equal(weights["layers.0.w"], STATE["model.layers.0.w"].half())


def test_views_share_one_mapping_per_file(tmp_path: Path) -> None:
    folder = save_sharded({"a": torch.ones(4), "b": torch.zeros(4)}, tmp_path / "one", progress=False)
    with LazyWeights(folder) as weights:
        a, b, again = weights["a"], weights["b"], weights["a"]
        base = a.untyped_storage().data_ptr()
        assert b.untyped_storage().data_ptr() == base == again.untyped_storage().data_ptr()
        info = weights.info("a")
        assert a.data_ptr() - base == info.data_offsets[0]  # a view at the header offset
        a.add_(1)  # private mapping: the file is never written
    with LazyWeights(folder) as weights:
        assert torch.equal(weights["a"], torch.ones(4))


def test_prefetch_from_a_thread_and_unknown_names(folder: Path) -> None:
    with LazyWeights(folder) as weights:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                weights.prefetch(list(weights) + ["not-there"])
            except BaseException as err:  # noqa: BLE001 - surfaced to the test
                errors.append(err)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        assert errors == [] and torch.equal(weights["model.norm.w"], STATE["model.norm.w"])


def test_tensors_outlive_close(folder: Path) -> None:
    weights = LazyWeights(folder)
    tensor = weights["model.layers.0.w"]
    weights.prefetch(["model.layers.0.w"])
    weights.close()
    assert torch.equal(tensor, STATE["model.layers.0.w"])  # the mapping lives with the tensor
    weights.prefetch(["model.layers.0.w"])  # ignored once closed
    with pytest.raises(ValueError, match="closed"):
        weights["model.layers.0.w"]


def test_files_mapped_up_front_survive_a_replaced_folder(tmp_path: Path) -> None:
    folder = save_sharded({"w": torch.ones(3)}, tmp_path / "c", progress=False)
    with LazyWeights(folder) as weights:
        save_sharded({"w": torch.zeros(3)}, folder, overwrite=True, progress=False)  # rename-replaced
        assert torch.equal(weights["w"], torch.ones(3))  # still the files it opened


def test_torch_files_are_mapped_once_at_open(tmp_path: Path) -> None:
    torch.save(STATE, tmp_path / "w.pt")
    index = CheckpointIndex.open(tmp_path / "w.pt")
    with LazyWeights(index) as weights:
        first, second = weights["model.norm.w"], weights["model.norm.w"]
        assert first.data_ptr() == second.data_ptr() == index.torch_state(tmp_path / "w.pt")["model.norm.w"].data_ptr()
        weights.prefetch(["model.norm.w"])  # madvise on the pickle's mapping


def test_misaligned_offsets_from_other_writers_still_read(tmp_path: Path) -> None:
    import json
    import struct

    header = json.dumps({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]}}).encode()
    header += b" " * ((-len(header) % 4) + 1)  # data starts at an address that is not 4-aligned
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + torch.tensor([1.0, 2.0, 3.0]).numpy().tobytes())
    with LazyWeights(path) as weights:
        assert weights.info("w").data_offsets[0] % 4 != 0
        assert torch.equal(weights["w"], torch.tensor([1.0, 2.0, 3.0]))


def _resident_fraction(path: Path) -> float:
    """Share of ``path``'s pages in the page cache (mincore over a fresh mapping)."""
    import ctypes
    import ctypes.util
    import mmap
    import os

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        anchor = ctypes.c_char.from_buffer(m)
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec) == 0
        del anchor
    return sum(v & 1 for v in vec) / pages


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux page-cache controls")
def test_prefetch_brings_a_large_tensor_into_the_page_cache(tmp_path: Path) -> None:
    import os
    import time

    folder = save_sharded({"w": torch.randn(4096, 2048)}, tmp_path / "c", progress=False)  # 32 MiB
    path = folder / "model.safetensors"
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # evict it
    os.close(fd)
    if _resident_fraction(path) > 0.1:
        pytest.skip("the kernel kept the file cached; cannot observe prefetch here")
    with LazyWeights(folder) as weights:
        weights.prefetch(["w"])
        deadline = time.monotonic() + 300  # the kernel reads in the background: slow on a busy disk
        while _resident_fraction(path) <= 0.95 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _resident_fraction(path) > 0.95  # the whole tensor, not one readahead window
