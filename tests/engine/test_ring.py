"""Issue 12: the fetcher that streams disk units into one reused O_DIRECT ring, on hand-made units.

The invariant: bytes handed to a forward are never read over before its release, whatever
the order of starts, waits and releases (read-ahead that did not come true, a unit waited for
inside another, a ring too small): checked by a random walk against the file's values. The
whole model streamed through the ring (bit-exact, the page cache untouched, one ring made
once) is checked in ``tests/engine/test_resident.py``.
"""

from __future__ import annotations

import mmap
import os
import random
from pathlib import Path

import pytest
import torch

from bigviz.checkpoint.lazy import map_file
import bigviz
from bigviz.core.errors import FetchError
from bigviz.engine.fetchers import ring
from bigviz.engine.fetchers.ring import RingFetcher, ring_capacity
from bigviz.osio.direct import ALIGN

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="file spans need Linux")

PAGE = mmap.PAGESIZE


class _Unit:
    """What a fetcher reads of a bound unit."""

    def __init__(self, name: str, store: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
        self.name, self.storage, self.dtypes, self._store = name, "disk", {}, store
        self.expected = expected  # the same values, not read from the file (its pages stay as they are)

    def keys_by_source(self) -> list[tuple[dict[str, torch.Tensor], list[str]]]:
        return [(self._store, list(self._store))]


def _units(tmp_path: Path, sizes: list[int]) -> list[_Unit]:
    """A unit of two tensors per size (``numel`` each) at odd offsets in one file, values
    unique per unit."""
    path = tmp_path / "w.bin"
    values = torch.arange(2 * sum(sizes) + 7, dtype=torch.float32)
    path.write_bytes(values.numpy().tobytes())
    whole = map_file(path).view(torch.float32)
    out, a = [], 3  # not page aligned: O_DIRECT reads the blocks around it
    for i, numel in enumerate(sizes):
        parts = {"a": slice(a, a + numel), "b": slice(a + numel, a + 2 * numel)}
        store = {k: whole[p].view(-1, 1) if k == "b" else whole[p] for k, p in parts.items()}
        expected = {k: values[p].view(-1, 1) if k == "b" else values[p] for k, p in parts.items()}
        out.append(_Unit(f"u{i}", store, expected))
        a += 2 * numel
    return out


def _exact(got: dict[str, torch.Tensor], unit: _Unit) -> bool:
    return set(got) == set(unit.expected) and all(torch.equal(got[k], v) for k, v in unit.expected.items())


@pytest.fixture
def unmerged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor its own read: a unit's tensors land apart in the ring (wrapping between them)."""
    monkeypatch.setattr(ring, "MERGE_MOST", 0)
    monkeypatch.setattr(ring, "SMALL", 0)


def test_the_next_unit_is_read_into_the_room_the_running_one_leaves(tmp_path: Path, unmerged: None) -> None:
    a, b, c = _units(tmp_path, [3 * ALIGN // 4] * 3)  # 3 blocks a tensor, read from 12 bytes in: 4 blocks of room
    with RingFetcher(readers=2) as fetcher:
        fetcher.prepare([a, b, c], 0.5)  # a unit takes 8 blocks: a ring of 1.5 units holds 12
        assert fetcher.capacity == ring_capacity(8 * ALIGN, 0.5) == 12 * ALIGN
        got_a = fetcher.start(a, background=False).wait()
        hb, hc = fetcher.start(b, background=True), fetcher.start(c, background=True)
        read_b, read_c = fetcher._reads[id(b)], fetcher._reads[id(c)]
        assert read_b.placed.count(None) == 1 and read_c.placed == [None, None]  # b's first tensor only
        read_b.futures[0].result()
        assert _exact(got_a, a)  # b's read went beside a, not over it
        fetcher.release(a)  # a's room goes to b's second tensor, then to c's first
        assert None not in read_b.placed and read_c.placed.count(None) == 1
        got_b = hb.wait()
        assert _exact(got_b, b)
        fetcher.release(b)
        assert _exact(hc.wait(), c) and fetcher.made == 1 and fetcher.overflows == 0


def test_read_ahead_that_did_not_come_true_is_given_up_and_read_again(tmp_path: Path) -> None:
    a, b, c = _units(tmp_path, [3000, 3000, 3000])
    with RingFetcher(capacity=ring_capacity(6 * ALIGN), readers=2) as fetcher:
        ha = fetcher.start(a, background=True)
        hb = fetcher.start(b, background=True)
        got_b = hb.wait()  # b ran first: a's read-ahead, started before b, is given up
        assert _exact(got_b, b) and id(a) not in fetcher._reads
        got_a = ha.wait()  # ... and read again when a runs after all (into room b leaves, or its own)
        assert _exact(got_a, a) and _exact(got_b, b)
        fetcher.release(a)
        fetcher.release(b)
        assert _exact(fetcher.start(c, background=False).wait(), c)


def test_a_unit_waited_for_inside_another_gets_a_buffer_of_its_own(tmp_path: Path) -> None:
    a, b, c = _units(tmp_path, [3000, 3000, 3000])
    with RingFetcher(capacity=ring_capacity(6 * ALIGN), readers=2) as fetcher:
        got_a = fetcher.start(a, background=False).wait()
        got_b = fetcher.start(b, background=False).wait()  # a still runs and b does not fit beside it
        assert fetcher.overflows == 1 and fetcher.held_bytes > fetcher.capacity
        assert _exact(got_a, a) and _exact(got_b, b)
        fetcher.release(b)
        assert fetcher.held_bytes == fetcher._ring.numel()  # b's own buffer went with its release
        fetcher.release(a)
        assert _exact(fetcher.start(c, background=False).wait(), c) and fetcher.overflows == 1


@pytest.mark.parametrize("seed", range(6))
def test_bytes_handed_out_are_never_read_over_before_their_release(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A random walk of starts, waits and releases over units of mixed sizes, some tensors
    read apart (wrapping), through rings from one unit to three: every unit held by a forward
    keeps its exact values until released."""
    rng = random.Random(seed)
    sizes = [rng.choice([700, 1500, 4000, 9000]) for _ in range(7)]
    units = _units(tmp_path, sizes)
    capacity = ring_capacity(2 * (-(-9000 * 4 // ALIGN) + 1) * ALIGN, rng.choice([0.0, 0.5, 2.0]))
    if seed % 2:
        monkeypatch.setattr(ring, "MERGE_MOST", 0)
        monkeypatch.setattr(ring, "SMALL", 0)
    with RingFetcher(capacity=capacity, readers=3) as fetcher:
        held: dict[int, dict[str, torch.Tensor]] = {}
        handles: dict[int, object] = {}
        for _ in range(120):
            i = rng.randrange(len(units))
            action = rng.random()
            if action < 0.4:
                handles[i] = fetcher.start(units[i], background=True)
            elif action < 0.75 and len(held) < 3:
                handle = handles.pop(i, None) or fetcher.start(units[i], background=False)
                held[i] = handle.wait()  # type: ignore[attr-defined]
            elif held:
                j = rng.choice(sorted(held))
                fetcher.release(units[j])
                del held[j]
            for j, tensors in held.items():
                assert _exact(tensors, units[j]), f"seed {seed}: {units[j].name} read over while held"
        assert fetcher.made == 1


def test_a_file_cut_short_is_an_error_naming_the_unit(tmp_path: Path) -> None:
    (unit,) = _units(tmp_path, [200_000])
    os.truncate(tmp_path / "w.bin", 100_000)  # the mapping stays, the bytes are gone
    with (
        RingFetcher() as fetcher,
        pytest.raises(FetchError, match="'u0'.*short read.*truncated.*load the model again"),
    ):
        fetcher.start(unit, background=True).wait()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity=100"):
        RingFetcher(capacity=100)
    with pytest.raises(ValueError, match="readers=0"):
        RingFetcher(readers=0)
    with pytest.raises(ValueError, match="stream='fast'.*'ring'.*'cache'"):
        bigviz.dispatch_plan(torch.nn.Linear(2, 2), device_map={"": "disk"}, stream="fast")


def test_a_converted_tensor_is_handed_out_and_the_layout_is_found_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (unit,) = _units(tmp_path, [3000])
    unit.dtypes = {"b": torch.float16}  # the model declares another dtype: a new copy at each fetch
    made: list[int] = []

    class CountingMaps(ring.FileMaps):
        def __init__(self) -> None:
            made.append(1)
            super().__init__()

    monkeypatch.setattr(ring, "FileMaps", CountingMaps)
    with RingFetcher() as fetcher:
        for _ in range(3):
            got = fetcher.start(unit, background=False).wait()
            assert torch.equal(got["a"], unit._store["a"]) and got["a"].data_ptr() != unit._store["a"].data_ptr()
            assert got["b"].dtype == torch.float16 and torch.equal(got["b"], unit._store["b"].half())
            fetcher.release(unit)
    assert len(made) == 1, f"/proc/self/maps parsed {len(made)} times for one unit"


def _vma_field(address: int, field: str) -> int | None:
    """A field of the ``/proc/self/smaps`` entry of the mapping that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                begin, end = (int(x, 16) for x in head.split("-"))
                inside = begin <= address < end
            elif inside and head == field + ":":
                return int(line.split()[1])
    return None


def test_the_ring_starts_on_a_huge_page_and_asks_for_huge_pages(tmp_path: Path) -> None:
    """Reads into 2 MiB pages reach the disk as larger requests (osio.pages.hugepages): the
    ring starts on a huge-page boundary, its mapping marked for transparent huge pages (where
    the kernel offers them), and its bytes are still the file's."""
    from bigviz.osio.pages import HUGE_PAGE

    (unit,) = _units(tmp_path, [HUGE_PAGE])  # two 8 MiB tensors
    with RingFetcher(readers=2) as fetcher:
        fetcher.prepare([unit])
        assert _exact(fetcher.start(unit, background=False).wait(), unit)
        address = fetcher._ring.data_ptr()
        assert address % HUGE_PAGE == 0 and fetcher._ring.numel() == fetcher.capacity
        offered = Path("/sys/kernel/mm/transparent_hugepage/enabled")
        if offered.exists() and "[never]" not in offered.read_text():
            assert _vma_field(address, "THPeligible") == 1
        fetcher.release(unit)
