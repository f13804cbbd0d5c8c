"""Issue 12: the fetcher that streams disk units into reused O_DIRECT slots, on hand-made units.

A guess that did not come true (a slot given to another unit before its reader waited) reads
again, and a shard cut short is an error naming the unit. The whole model streamed through
slots (bit-exact, the page cache untouched, buffers made once) is checked in
``test_engine_resident.py``.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch

from bigviz.checkpoint.lazy import map_file
from bigviz.engine.prefetch import FetchError
from bigviz.engine.resident import settle_residency
from bigviz.engine.slots import SlotFetcher
from bigviz.models import GPTConfig

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="file spans need Linux")

PAGE = mmap.PAGESIZE
CONFIG = GPTConfig(n_layer=6, n_head=4, n_embd=128, vocab_size=300, block_size=32)


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


def test_a_file_cut_short_is_an_error_naming_the_unit(tmp_path: Path) -> None:
    (unit,) = _units(tmp_path, 1, numel=200_000)
    os.truncate(tmp_path / "w.bin", 100_000)  # the mapping stays, the bytes are gone
    with (
        SlotFetcher(slots=1) as fetcher,
        pytest.raises(FetchError, match="'u0'.*short read.*truncated.*load the model again"),
    ):
        fetcher.start(unit, background=True).wait()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="slots=0"):
        SlotFetcher(slots=0)
    with pytest.raises(ValueError, match="stream='fast'.*'slots'.*'cache'"):
        settle_residency(torch.nn.Linear(2, 2), stream="fast")


def test_a_converted_tensor_is_handed_out_and_the_layout_is_found_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bigviz.engine import slots

    (unit,) = _units(tmp_path, 1)
    unit.dtypes = {"b": torch.float16}  # the model declares another dtype: a new copy at each fetch
    made: list[int] = []

    class CountingMaps(slots.FileMaps):
        def __init__(self) -> None:
            made.append(1)
            super().__init__()

    monkeypatch.setattr(slots, "FileMaps", CountingMaps)
    with SlotFetcher(slots=1) as fetcher:
        for _ in range(3):
            got = fetcher.start(unit, background=False).wait()
            assert torch.equal(got["a"], unit._store["a"]) and got["a"].data_ptr() != unit._store["a"].data_ptr()
            assert got["b"].dtype == torch.float16 and torch.equal(got["b"], unit._store["b"].half())
            fetcher.release(unit)
    assert len(made) == 1, f"/proc/self/maps parsed {len(made)} times for one unit"
