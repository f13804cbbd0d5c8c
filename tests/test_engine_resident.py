"""Issue 12, larger than RAM, in small: a resident/streamed split checked page by page.

A small GPT is saved with one shard per block; part of it is mapped to "cpu", the rest to
"disk", and the model is treated as larger than RAM (``resident="copy"``). Checked with
``mincore``: the resident weights live in process memory (every page present, none of them
file-backed), the disk units' file pages are dropped from the page cache once used (except
the units read ahead for the next forward), and outputs are bit-exact against the model in RAM.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import pytest
import torch

import bigviz
from bigviz.checkpoint.probe import resident_pages
from bigviz.checkpoint.save import save_sharded
from bigviz.engine.prefetch import CpuFetcher, _pages
from bigviz.engine.readahead import StreamingFetcher, file_span
from bigviz.engine.resident import decide, mapped_bytes, settle_residency
from bigviz.models import GPT, GPTConfig

pytestmark = pytest.mark.skipif(
    not hasattr(os, "posix_fadvise") or not os.path.exists("/proc/self/maps"), reason="page-cache control needs Linux"
)

PAGE = mmap.PAGESIZE
CONFIG = GPTConfig(n_layer=6, n_head=4, n_embd=128, vocab_size=300, block_size=32)  # blocks of 200 pages


def _tensor_ranges(folder: Path) -> dict[str, tuple[Path, int, int]]:
    """checkpoint key -> (file, byte offset in the file, length), from safetensors headers."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        raw = (folder / file).read_bytes()[:8]
        size = struct.unpack("<Q", raw)[0]
        with open(folder / file, "rb") as f:
            f.seek(8)
            header = json.loads(f.read(size))
        for key, info in header.items():
            if key != "__metadata__":
                begin, end = info["data_offsets"]
                out[key] = (folder / file, 8 + size + begin, end - begin)
    return out


def _evict(folder: Path) -> None:
    for path in folder.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _inner_pages(path: Path, offset: int, length: int) -> tuple[int, int]:
    """(in the page cache, all) of the pages lying wholly inside ``[offset, offset + length)``."""
    first, last = -(-offset // PAGE) * PAGE, (offset + length) // PAGE * PAGE
    if last <= first:
        return 0, 0
    return sum(resident_pages(path, first, last - first)), (last - first) // PAGE


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT]:
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    folder = tmp_path_factory.mktemp("resident") / "ckpt"
    block = sum(p.numel() * 4 for p in model.transformer.h[0].parameters())
    save_sharded(model, folder, max_shard_size=block, progress=False)
    return folder, model


def _split_map(n_cpu: int) -> dict[str, str]:
    device_map = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.ln_f": "cpu", "lm_head": "cpu"}
    device_map.update({f"transformer.h.{i}": "cpu" if i < n_cpu else "disk" for i in range(CONFIG.n_layer)})
    return device_map


def _dispatch(folder: Path, device_map: dict[str, str], resident: str) -> GPT:
    with bigviz.init_empty_weights():
        model = GPT(CONFIG)
    return bigviz.load_checkpoint_and_dispatch(model, folder, device_map, resident=resident)


def test_resident_weights_stay_in_memory_and_streamed_pages_are_dropped(checkpoint: tuple[Path, GPT]) -> None:
    folder, reference = checkpoint
    idx = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(idx)[0]
    _evict(folder)
    model = _dispatch(folder, _split_map(2), "copy")
    state, residency = model._bigviz_dispatch, model._bigviz_residency
    assert residency.mode == "copy" and isinstance(state.scheduler.fetcher, StreamingFetcher)
    assert residency.copied is not None and residency.copied.nbytes == residency.resident_bytes > 0
    resident = [p for p in model.parameters() if p.device.type == "cpu"]
    assert resident and all(file_span(p) is None and _pages.resident(p) for p in resident)
    ranges = _tensor_ranges(folder)
    disk = [u for u in state.units if u.storage == "disk"]
    left_after_use: dict[str, tuple[int, int]] = {}

    def pages_of(unit: object) -> tuple[int, int]:
        counts = [_inner_pages(*ranges[key]) for key in unit.slots]  # type: ignore[attr-defined]
        return sum(c for c, _ in counts), sum(n for _, n in counts)

    def after_use(unit: object) -> None:
        state.scheduler.fetcher.wait_dropped()
        left_after_use[unit.name] = pages_of(unit)  # type: ignore[attr-defined]

    for unit in disk:  # runs just after the unit's forward (and its hook's release)
        unit.module.register_forward_hook(lambda m, a, o, u=unit: after_use(u))
    for run in range(2):
        left_after_use.clear()
        with torch.no_grad():
            assert torch.equal(model(idx)[0], expected), f"forward {run}"
        assert sorted(left_after_use) == sorted(u.name for u in disk)
        for name, (cached, whole) in left_after_use.items():
            assert whole > 100 and cached == 0, f"forward {run}: {name}: {cached} of {whole} pages left after use"
        for handle in list(state.scheduler._pending.values()):
            handle.wait()  # units read ahead for the next forward: their reads are done
        ahead = [h.unit for h in state.scheduler._pending.values()]
        assert len(disk) == CONFIG.n_layer - 2 and 0 < len(ahead) < len(disk)
        for unit in ahead:
            cached, whole = pages_of(unit)
            assert cached == whole, f"{unit.name}: read ahead for the next forward, {cached} of {whole} pages"
        # the resident part never went back to the file: still every page present
        assert all(file_span(p) is None and _pages.resident(p) for p in resident)
    state.scheduler.fetcher.wait_dropped()
    stats = state.scheduler.fetcher.stats
    assert stats.units_dropped == 2 * len(disk) and stats.bytes_dropped > 0
    bigviz.remove_hooks(model)


def test_a_model_that_fits_keeps_zero_copy_maps(checkpoint: tuple[Path, GPT]) -> None:
    folder, reference = checkpoint
    idx = torch.randint(0, CONFIG.vocab_size, (1, 5), generator=torch.Generator().manual_seed(4))
    model = _dispatch(folder, _split_map(3), "auto")  # a few hundred KB: fits in any RAM
    assert model._bigviz_residency.mode == "map" and model._bigviz_residency.copied is None
    assert isinstance(model._bigviz_dispatch.scheduler.fetcher, CpuFetcher)
    assert mapped_bytes(model) == model._bigviz_residency.resident_bytes > 0
    with torch.no_grad():
        assert torch.equal(model(idx)[0], reference(idx)[0])
    bigviz.remove_hooks(model)


def test_auto_copies_when_the_model_does_not_fit(checkpoint: tuple[Path, GPT]) -> None:
    folder, reference = checkpoint
    with bigviz.init_empty_weights():
        model = GPT(CONFIG)
    model = bigviz.load_checkpoint_and_dispatch(model, folder, _split_map(4), resident="map")
    total = model._bigviz_residency.resident_bytes + model._bigviz_residency.streamed_bytes
    residency = settle_residency(model, available=total // 2, progress=False)  # pretend: RAM is half the model
    assert residency.mode == "copy" and mapped_bytes(model) == 0
    idx = torch.arange(7).view(1, 7)
    with torch.no_grad():
        assert torch.equal(model(idx)[0], reference(idx)[0])
    bigviz.remove_hooks(model)


def test_tied_weights_are_copied_once_and_stay_tied(checkpoint: tuple[Path, GPT]) -> None:
    folder, _ = checkpoint
    model = _dispatch(folder, _split_map(6), "copy")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    bigviz.remove_hooks(model)


def test_unknown_modes_are_refused_before_anything_is_read(checkpoint: tuple[Path, GPT]) -> None:
    with pytest.raises(ValueError, match="resident='always'"):
        decide(1, 1, available=10, requested="always")
    with bigviz.init_empty_weights():
        model = GPT(CONFIG)
    with pytest.raises(ValueError, match="resident='pinned'.*'auto', 'copy', 'map'"):
        bigviz.load_checkpoint_and_dispatch(model, checkpoint[0], _split_map(2), resident="pinned")
    assert all(p.is_meta for p in model.parameters()) and not hasattr(model, "_bigviz_dispatch")
