"""Issue 12: disk units of a model larger than RAM streamed into reused O_DIRECT slots.

A small GPT saved with one shard per block, part "cpu" and part "disk", treated as larger than
RAM (``resident="copy"``): the disk units are read into a few buffers made once and reused,
never through the page cache, and every forward is bit-exact against the model in RAM. The
fetcher itself is checked on hand-made units: a guess that did not come true (a slot given to
another unit before its reader waited) reads again, a slot handed out while autograd records
is never overwritten, and a shard cut short is an error naming the unit.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch

import bigviz
from bigviz.checkpoint.lazy import map_file
from bigviz.checkpoint.save import save_sharded
from bigviz.engine.prefetch import FetchError
from bigviz.engine.resident import settle_residency
from bigviz.engine.slots import SlotFetcher
from bigviz.models import GPT, GPTConfig

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="file spans need Linux")

PAGE = mmap.PAGESIZE
CONFIG = GPTConfig(n_layer=6, n_head=4, n_embd=128, vocab_size=300, block_size=32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT]:
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    folder = tmp_path_factory.mktemp("slots") / "ckpt"
    block = sum(p.numel() * 4 for p in model.transformer.h[0].parameters())
    save_sharded(model, folder, max_shard_size=block, progress=False)
    return folder, model


def _dispatch(folder: Path, device_map: dict[str, str] | str) -> GPT:
    with bigviz.init_empty_weights():
        model = GPT(CONFIG)
    return bigviz.load_checkpoint_and_dispatch(model, folder, device_map, resident="copy")


def _cached_pages(folder: Path) -> int:
    from bigviz.checkpoint.probe import resident_pages

    return sum(sum(resident_pages(p) or b"") for p in folder.glob("*.safetensors"))


def _evict(folder: Path) -> None:
    for path in folder.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_disk_units_stream_through_reused_slots_bit_exact(checkpoint: tuple[Path, GPT]) -> None:
    folder, reference = checkpoint
    device_map = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.ln_f": "cpu", "lm_head": "cpu"}
    device_map.update({f"transformer.h.{i}": "cpu" if i < 1 else "disk" for i in range(CONFIG.n_layer)})
    _evict(folder)
    model = _dispatch(folder, device_map)
    state = model._bigviz_dispatch
    fetcher = state.scheduler.fetcher
    assert isinstance(fetcher, SlotFetcher) and fetcher.slots == state.scheduler.depth + 1
    disk = [u for u in state.units if u.storage == "disk"]
    seen: dict[str, int] = {}  # unit -> address its weights had in its forward

    def in_forward(unit: object) -> None:
        seen[unit.name] = unit.module.attn.c_attn.weight.data_ptr()  # type: ignore[attr-defined]

    for unit in disk:
        unit.module.mlp.register_forward_hook(lambda m, a, o, u=unit: in_forward(u))
    idx = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(idx)[0]
    addresses: set[int] = set()
    for run in range(3):
        with torch.no_grad():
            assert torch.equal(model(idx)[0], expected), f"forward {run}"
        assert sorted(seen) == sorted(u.name for u in disk)
        addresses |= set(seen.values())
    # the weights of five units were read into at most depth + 1 buffers, made once
    assert len(fetcher._slots) <= fetcher.slots and fetcher.made == len(fetcher._slots)
    assert all(any(s.address <= a < s.address + s.size for s in fetcher._slots) for a in addresses)
    assert fetcher.stats.units_read >= 3 * len(disk)
    # O_DIRECT left the page cache alone (or the buffered fallback dropped what it read)
    assert _cached_pages(folder) < 50, "disk units went through the page cache"
    bigviz.remove_hooks(model)


def test_all_on_disk_with_a_tied_head_stays_exact(checkpoint: tuple[Path, GPT]) -> None:
    folder, reference = checkpoint
    model = _dispatch(folder, {"": "disk"})
    assert isinstance(model._bigviz_dispatch.scheduler.fetcher, SlotFetcher)
    idx = torch.arange(6).view(1, 6)
    for run in range(3):
        with torch.no_grad():
            assert torch.equal(model(idx)[0], reference(idx)[0]), f"forward {run}"
    bigviz.remove_hooks(model)


# ------------------------------------------------------------------ the fetcher on hand-made units
class _Unit:
    """What a fetcher reads of a bound unit."""

    def __init__(self, name: str, store: dict[str, torch.Tensor]) -> None:
        self.name, self.storage, self.dtypes, self._store = name, "disk", {}, store

    def keys_by_source(self) -> list[tuple[dict[str, torch.Tensor], list[str]]]:
        return [(self._store, list(self._store))]


def _units(tmp_path: Path, n: int, numel: int = 3000) -> list[_Unit]:
    """``n`` units of two tensors each at odd offsets in one file, values unique per unit."""
    path = tmp_path / "w.bin"
    values = torch.arange(n * 2 * numel + 7, dtype=torch.float32)
    path.write_bytes(values.numpy().tobytes())
    whole = map_file(path).view(torch.float32)
    out = []
    for i in range(n):
        a = 3 + 2 * i * numel  # not page aligned: O_DIRECT reads the blocks around it
        out.append(_Unit(f"u{i}", {"a": whole[a : a + numel], "b": whole[a + numel : a + 2 * numel].view(40, -1)}))
    return out


def _expected(unit: _Unit) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in unit._store.items()}


def test_a_slot_given_away_before_its_wait_reads_again(tmp_path: Path) -> None:
    a, b, c = _units(tmp_path, 3)
    with SlotFetcher(slots=1, readers=2) as fetcher:
        ha = fetcher.start(a, background=True)
        hb = fetcher.start(b, background=True)  # one slot: a's read is let finish, then b takes it
        got = ha.wait()  # a's slot now holds b: a is read again (b's read, idle, gives way)
        assert all(torch.equal(got[k], v) for k, v in _expected(a).items()) and len(fetcher._slots) == 1
        got_b = hb.wait()  # b lost its slot to a, which a forward now uses: one more slot is made
        assert all(torch.equal(got_b[k], v) for k, v in _expected(b).items()) and len(fetcher._slots) == 2
        assert all(torch.equal(got[k], v) for k, v in _expected(a).items())  # a's weights untouched
        fetcher.release(a)
        fetcher.release(b)
        got_c = fetcher.start(c, background=False).wait()
        assert all(torch.equal(got_c[k], v) for k, v in _expected(c).items())
        assert got_c["a"].shape == (3000,) and got_c["b"].shape == (40, 75)


def test_weights_handed_out_under_autograd_are_never_overwritten(tmp_path: Path) -> None:
    a, b = _units(tmp_path, 2)
    with SlotFetcher(slots=1) as fetcher:
        with torch.enable_grad():
            kept = fetcher.start(a, background=False).wait()  # the graph may keep views of these
        fetcher.release(a)
        with torch.no_grad():
            other = fetcher.start(b, background=False).wait()
        assert kept["a"].data_ptr() != other["a"].data_ptr()
        assert all(torch.equal(kept[k], v) for k, v in _expected(a).items())
        fetcher.release(b)
        with torch.no_grad():
            again = fetcher.start(a, background=False).wait()
        (slot,) = fetcher._slots  # without autograd the slot is reused: no third one
        assert fetcher.made == 2 and slot.address <= again["a"].data_ptr() < slot.address + slot.size


def test_a_file_cut_short_is_an_error_naming_the_unit(tmp_path: Path) -> None:
    (unit,) = _units(tmp_path, 1, numel=200_000)
    os.truncate(tmp_path / "w.bin", 100_000)  # the mapping stays, the bytes are gone
    with SlotFetcher(slots=1) as fetcher, pytest.raises(FetchError, match="'u0'.*short read"):
        fetcher.start(unit, background=True).wait()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="slots=0"):
        SlotFetcher(slots=0)
    with pytest.raises(ValueError, match="stream='fast'.*'slots'.*'cache'"):
        settle_residency(torch.nn.Linear(2, 2), stream="fast")
