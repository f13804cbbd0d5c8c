"""Streaming into reused buffers: disk units read with ``O_DIRECT`` into a few slots made once.

When the CPU executes a model larger than RAM, its disk units are read in before they run and
let go after. :class:`SlotFetcher` reads each unit into a *slot*: a buffer of process memory,
allocated and faulted in once, reused by unit after unit. Reads use ``O_DIRECT`` (the disk
writes straight into the slot; the page cache is never involved, so nothing resident is
evicted and nothing needs dropping); where the filesystem refuses it, buffered reads dropped
from the page cache behind them. A unit's tensors are views of its slot, handed to the unit's
forward; its release gives the slot back, and the scheduler starts the next read into it.

Why not read into the page cache (``madvise(MADV_POPULATE_READ)`` on the mapped file, then
drop the pages: :class:`~bigviz.engine.readahead.StreamingFetcher`)? Measured on this
project's 2-core virtual machine, 1.8 GB shards read cold by 4 threads (``/work`` scripts
summarised in ``bench/RESULTS.md``):

- the page cache path read at 0.68-1.9 GB/s and used 38-51 CPU ticks per shard; the *first*
  pass of the compute over freshly read pages then took 0.14-4.8 s more than the second
  (a guest whose freed pages go back to the hypervisor, as with virtio-balloon free page
  reporting, pays a fault per page the first time it touches new memory). In a forward of
  the 32 GB bench model that made streamed blocks compute 2-10x slower than resident ones;
- ``O_DIRECT`` into one reused buffer read at 1.14-1.43 GB/s, used 12-18 ticks, and the
  first pass cost the same as the second.

A slot is process memory (``RssAnon``): the fetcher holds at most ``slots`` of them, each
the size of the largest unit read so far. Units tied to each other (an embedding and the
head that reuses it, both on disk) are read once per unit. A slot is reused as soon as its unit
is released: the offload hook runs an offloaded module's forward under ``torch.no_grad()``
(offloaded modules are inference-only, their outputs guarded against backward), so no autograd
graph keeps a view of a slot, and the hook points the module back at ``meta`` before the release.

Example:
    >>> import os, tempfile, torch
    >>> from bigviz.checkpoint.lazy import map_file
    >>> path = os.path.join(tempfile.mkdtemp(), "w.bin")
    >>> _ = open(path, "wb").write(torch.arange(64.0).numpy().tobytes())
    >>> store = {"w": map_file(path).view(torch.float32)}
    >>> class Unit:  # what a fetcher reads of a bound unit
    ...     name, storage, dtypes = "lin", "disk", {}
    ...     def keys_by_source(self): return [(store, ["w"])]
    >>> unit = Unit()
    >>> with SlotFetcher(slots=1) as fetcher:
    ...     tensors = fetcher.start(unit, background=True).wait()
    ...     float(tensors["w"][5]), tensors["w"].data_ptr() != store["w"].data_ptr()
    (5.0, True)
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import Tensor

from bigviz.engine.binding import BoundUnit as Unit
from bigviz.engine.prefetch import Handle
from bigviz.engine.readahead import FileMaps, StreamStats, Where, _when_all, file_span, mapped_where, unit_tensors
from bigviz.engine.resident import ALIGN, _read_piece, block_room, pieces_of

__all__ = ["SlotFetcher"]

MERGE_GAP = 64 * 2**10  # tensors of a unit less than this apart in a file are read in one go


@dataclass
class _Layout:
    """Where a unit's bytes go in a slot: ``reads`` (path, file offset, length, slot offset),
    each file-backed key's view (slot offset, bytes, dtype, shape), and the keys not in a file
    (converted copies: handed out as the store gives them, nothing to read). ``where`` is the
    file-backed tensors' addresses it was made for."""

    where: Where
    size: int
    reads: list[tuple[str, int, int, int]]
    views: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]]
    kept: frozenset[str]


@dataclass(eq=False)
class _Slot:
    raw: Tensor
    size: int
    owner: int | None = None  # id of the unit it holds or is reading
    gen: int = 0  # bumped each time the slot is given to a unit: older handles are stale
    started: int = 0  # order of the last start: the oldest idle slot is reused first
    future: Future | None = None
    busy: bool = False  # handed to a forward and not yet released
    layout: _Layout | None = None  # what it holds or is reading

    @property
    def address(self) -> int:
        return self.raw.data_ptr() + (-self.raw.data_ptr() % ALIGN)


class _SlotHandle(Handle):
    """A unit's read into a slot; if the slot was given to another unit meanwhile (a guess
    of the next unit that did not come true), :meth:`wait` reads the unit again."""

    def __init__(self, unit: Unit, future: Future, fetcher: SlotFetcher, slot: _Slot) -> None:
        super().__init__(unit, future)
        self._fetcher, self._slot, self._gen = fetcher, slot, slot.gen

    def wait(self) -> dict[str, Tensor]:
        tensors = super().wait()
        if self._slot.gen != self._gen:
            return self._fetcher.start(self.unit, background=False).wait()
        self._slot.busy = True
        return tensors


class SlotFetcher:
    """CPU execution of disk units larger than RAM: read ahead into reused slots, ``O_DIRECT``.

    Args:
        slots: Buffers kept (the running unit and those read ahead: the scheduler's
            ``depth + 1``). When every slot is in use by a forward, one more is made.
        readers: Threads reading ``16 MiB`` pieces.
        direct: Read with ``O_DIRECT`` where the filesystem allows it.
    """

    reads_on_release = True  # a release frees the unit's slot: the scheduler may start the next read

    def __init__(self, *, slots: int, readers: int = 4, direct: bool = True) -> None:
        if slots < 1 or readers < 1:
            raise ValueError(f"SlotFetcher: slots={slots!r} and readers={readers!r} must be >= 1")
        self.slots, self.readers, self.direct = slots, readers, direct
        self.stats = StreamStats()
        self.made = 0  # slots allocated (a resize counts): for tests and reports
        self._pool: ThreadPoolExecutor | None = None
        self._slots: list[_Slot] = []
        self._by_unit: dict[int, _Slot] = {}
        self._layouts: dict[int, _Layout] = {}
        self._clock = itertools.count(1)

    def __enter__(self) -> SlotFetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def slot_bytes(self) -> int:
        """Process memory the slots hold now."""
        return sum(s.size for s in self._slots)

    def start(self, unit: Unit, *, background: bool) -> Handle:
        """Queue ``unit``'s reads into a slot (the readers do them, background or not)."""
        try:
            tensors = unit_tensors(unit)
            layout = self._layout(unit, tensors)
        except Exception as exc:
            future: Future = Future()
            future.set_exception(exc)
            return Handle(unit, future)
        slot = self._by_unit.get(id(unit))
        if slot is not None and slot.layout is layout and slot.future is not None:
            return _SlotHandle(unit, slot.future, self, slot)  # already read (or on its way)
        slot = self._take(layout.size)
        slot.gen, slot.owner, slot.started, slot.busy = slot.gen + 1, id(unit), next(self._clock), False
        slot.layout = layout
        self._by_unit[id(unit)] = slot
        out = {key: tensors[key] for key in layout.kept}
        base = self._base(slot)
        for key, (offset, length, dtype, shape) in layout.views.items():
            out[key] = slot.raw[base + offset : base + offset + length].view(dtype).view(shape)
        pieces = [
            p for path, off, n, at in layout.reads for p in pieces_of(path, off, n, slot.address + at, direct=True)
        ]
        slot.future = future = Future()
        if not pieces:
            future.set_result(dict(out))
            return _SlotHandle(unit, future, self, slot)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.readers, thread_name_prefix="bigviz-slot")
        _when_all([self._pool.submit(_read_piece, p, self.direct) for p in pieces], future, out)
        self.stats.units_read += 1
        self.stats.bytes_read += sum(p.need for p in pieces)
        return _SlotHandle(unit, future, self, slot)

    def release(self, unit: Unit, **_: object) -> None:
        """``unit``'s forward is over: its slot is free for the next read."""
        slot = self._by_unit.pop(id(unit), None)
        if slot is None:
            return
        slot.owner, slot.busy, slot.layout = None, False, None
        self.stats.units_dropped += 1
        self.stats.bytes_dropped += sum(n for _, _, n, _ in self._layouts[id(unit)].reads)

    def _take(self, size: int) -> _Slot:
        """A slot for a new read: a free one, a new one while fewer than ``slots`` exist, else
        the idle one started longest ago (its read is let finish first), else one more."""
        slot = next((s for s in self._slots if s.owner is None), None)
        if slot is None and len(self._slots) >= self.slots:
            idle = sorted((s for s in self._slots if not s.busy), key=lambda s: s.started)
            slot = idle[0] if idle else None
        if slot is None:
            slot = _Slot(torch.empty(0, dtype=torch.uint8), 0)
            self._slots.append(slot)
        if slot.future is not None:
            with contextlib.suppress(Exception):
                slot.future.result()  # a read still writing into it must finish first
        if slot.owner is not None:
            self._by_unit.pop(slot.owner, None)
        if slot.size < size:
            slot.raw, slot.size = torch.empty(0, dtype=torch.uint8), 0  # free the old one first
            slot.raw, slot.size = torch.empty(size + ALIGN, dtype=torch.uint8), size
            self.made += 1
        return slot

    @staticmethod
    def _base(slot: _Slot) -> int:
        return -slot.raw.data_ptr() % ALIGN

    def _layout(self, unit: Unit, tensors: Mapping[str, Tensor]) -> _Layout:
        """Where ``tensors`` are read from and go to; found once per unit (``/proc/self/maps``
        is parsed then) and reused while its file-backed tensors are the same mapped bytes (a
        converted copy is new memory at each fetch: it does not count)."""
        known = self._layouts.get(id(unit))
        if known is not None and known.where == mapped_where(tensors, known.kept):
            return known
        maps = FileMaps()
        spans = {key: file_span(t, maps) for key, t in tensors.items()}
        kept = frozenset(key for key in tensors if spans[key] is None)
        ranges: list[list] = []  # [path, first byte, end byte, keys]
        for key, span in sorted(
            ((k, s) for k, s in spans.items() if s is not None), key=lambda i: (i[1].path, i[1].offset)
        ):
            last = ranges[-1] if ranges else None
            if last is not None and last[0] == span.path and span.offset <= last[2] + MERGE_GAP:
                last[2] = max(last[2], span.offset + span.length)
                last[3].append(key)
            else:
                ranges.append([span.path, span.offset, span.offset + span.length, [key]])
        reads, views, at = [], {}, 0
        for path, first, end, keys in ranges:
            head, size = block_room(first, end - first, direct=True)
            reads.append((path, first, end - first, at))
            for key in keys:
                span, tensor = spans[key], tensors[key]
                offset = at + head + span.offset - first  # type: ignore[union-attr]
                views[key] = (offset, span.length, tensor.dtype, tuple(tensor.shape))  # type: ignore[union-attr]
            at += size
        layout = _Layout(mapped_where(tensors, kept), at, reads, views, kept)
        self._layouts[id(unit)] = layout
        return layout

    def close(self) -> None:
        """Stop the readers and free the slots (tensors handed out keep their own memory alive)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._slots.clear()
        self._by_unit.clear()
