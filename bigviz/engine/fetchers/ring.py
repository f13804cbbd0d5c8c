"""Streaming into one ring of bytes: disk units read with ``O_DIRECT`` into a buffer made once.

When the CPU executes a model larger than RAM, its disk units are read in before they run and
let go after. :class:`RingFetcher` reads them into one *ring*: a buffer of process memory,
allocated and faulted in once, ``1 + ahead`` times the largest unit
(:data:`~bigviz.core.stream_plan.RING_AHEAD`). Each unit's tensors are placed one after the
other behind the previous unit's (a tensor is never split; one that does not fit before the
end of the ring starts again at its beginning), so while a unit computes, the next one is
already read into the part of the ring the running unit does not use, and the rest of it
follows as soon as the running unit is released. The ring, not a count of units, bounds the
read-ahead: process memory stays at the ring's size whatever the units' sizes.

Reads use ``O_DIRECT`` (the disk writes straight into the ring; the page cache is never
involved, so nothing resident is evicted and nothing needs dropping); where the filesystem
refuses it, buffered reads dropped from the page cache behind them. They go to the very file
the model mapped (its device and inode, as the store holding it open says): a shard replaced
by rename while the model runs is still read from the file the model opened, as in every other
streaming mode, and a shard truncated or rewritten in place is refused by the store's check.

The ring asks for transparent huge pages before its first touch
(:func:`~bigviz.osio.pages.hugepages`): a 2 MiB page is one physical run, so a 16 MiB read
reaches a virtio disk as a few requests of its largest size rather than sixteen of about
1 MiB (254 runs of 4 KiB pages per request). Alternated on this project's VM, later forwards of
a 32.1 GB GPT at half the RAM resident took 8.3-9.8 s against 11.2-15.9 s with 4 KiB pages
(``bench/studies/first_forward.py``). Where the kernel offers no huge pages the ring is the same
memory of 4 KiB pages.

Why not read into the page cache (``madvise(MADV_POPULATE_READ)`` on the mapped file, then
drop the pages: :class:`~bigviz.engine.fetchers.cache.StreamingFetcher`)? Measured on this
project's 2-core virtual machine, 1.8 GB shards read cold by 4 threads (``bench/studies/stream_touch.py``,
summarised in ``bench/RESULTS.md``): the page cache path's *first* pass of the compute over
freshly read pages took 0.14-4.8 s more than the second (a guest whose freed pages go back to
the hypervisor, as with virtio-balloon free page reporting, pays a fault per page the first
time it touches new memory); ``O_DIRECT`` into memory made once costs the same on every pass.

Why a ring and not whole-unit buffers (``depth + 1`` of them)? Three buffers of the bench's
1.8 GB blocks held 5.1 GiB beside the resident part; a ring of two blocks holds 3.4 GiB and
reads the next block whole while one computes. A ring of 1.5 blocks (2.5 GiB, the size until
issue 26) left the next block only the fragments beside the running one, a third of it where
its tensors are 604 MB, and its later forwards ran 13-21% slower on a 50.2 GB GPT
(:data:`~bigviz.core.stream_plan.RING_AHEAD` says what was measured).

A unit waited for while an earlier unit still runs (a unit nested in another, a guess of the
next unit that did not come true while the ring is full) gets what does not fit in the ring
in a buffer of its own, freed at its release: never a deadlock, never a wrong byte. Read-ahead
of units that did not run next is given up when a later unit is waited for. The offload hook
runs an offloaded module's forward under ``torch.no_grad()`` and points the module back at
``meta`` before the release, so nothing keeps a view of ring bytes that are read over.

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
    >>> with RingFetcher(capacity=2**16) as fetcher:
    ...     tensors = fetcher.start(unit, background=True).wait()
    ...     float(tensors["w"][5]), tensors["w"].data_ptr() != store["w"].data_ptr()
    (5.0, True)
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from bigviz.core.stream_plan import RING_AHEAD
from bigviz.engine.binding import BoundUnit as Unit
from bigviz.engine.fetchers.cache import StreamStats
from bigviz.engine.fetchers.protocol import Handle, run_now
from bigviz.engine.fetchers.spans import FileMaps, FileSpan, Where, file_span, mapped_where, span_identity, unit_parts
from bigviz.engine.packed import rebuild
from bigviz.modeling.packed import Packed
from bigviz.osio.direct import ALIGN, Piece, block_room, pieces_of, read_piece
from bigviz.osio.pages import HUGE_PAGE, hugepages
from bigviz.core.errors import UsageError

if TYPE_CHECKING:
    from bigviz.engine.timeline import Timeline

__all__ = ["RingFetcher", "ring_capacity"]

MERGE_GAP = 64 * 2**10  # tensors of a unit less than this apart in a file are read in one go ...
MERGE_MOST = 64 * 2**20  # ... while the read stays this small, or one of them is under SMALL
SMALL = 2**20


def ring_capacity(largest: int, ahead: float = RING_AHEAD) -> int:
    """Bytes of a ring for units of at most ``largest`` bytes (their room in it, aligned):
    the running unit and ``ahead`` of one more, in whole ``ALIGN`` blocks.

    Example:
        >>> ring_capacity(10 * 2**20) == 20 * 2**20, ring_capacity(10 * 2**20, 0.5) == 15 * 2**20
        (True, True)
    """
    if largest < 0 or ahead < 0:
        raise UsageError(f"ring_capacity: largest={largest!r} and ahead={ahead!r} must be >= 0")
    blocks = -(-largest // ALIGN)
    return (blocks + max(1, -(-int(blocks * ahead * ALIGN) // ALIGN))) * ALIGN


@dataclass
class _Extent:
    """One read of a unit: file bytes ``[offset, offset + length)`` at ``head`` in ``size``
    bytes of room (whole ``ALIGN`` blocks), and the views on it: key -> (offset in the
    room, bytes, dtype, shape)."""

    path: str
    offset: int
    length: int
    head: int
    size: int
    views: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]]
    identity: tuple[int, int] | None = None  # the file mapped, read even if renamed since


@dataclass
class _Layout:
    """Where a unit's bytes come from (its extents, in file order) and the keys in no file
    (converted copies: handed out as the store gives them). ``where`` is the file-backed
    tensors' addresses it was made for."""

    where: Where
    extents: list[_Extent]
    kept: frozenset[str]

    @property
    def size(self) -> int:
        return sum(e.size for e in self.extents)


@dataclass(eq=False)
class _Read:
    """One unit's read: where each extent went (``(buffer, byte offset)``: the ring or the
    read's own buffer; ``None`` while queued), the reads in flight, whether a forward holds it
    (``busy``) or it was given up."""

    unit: Unit
    layout: _Layout
    seq: int
    tensors: Mapping[str, Tensor]
    placed: list[tuple[Tensor, int] | None]
    futures: list[Future] = field(default_factory=list)
    own: Tensor | None = None  # extents that did not fit in the ring
    packs: Mapping[str, Packed] = field(default_factory=dict)  # packed weights: built from their parts once read
    busy: bool = False
    gone: bool = False  # released or given up: its ring bytes may be read over


@dataclass(eq=False)
class _Alloc:
    read: _Read
    start: int  # ring offset


class _RingHandle(Handle):
    """A unit's read into the ring; if it was given up meanwhile (a later unit was waited for
    first), :meth:`wait` reads it again."""

    def __init__(self, unit: Unit, fetcher: RingFetcher, read: _Read) -> None:
        super().__init__(unit, Future())
        self._fetcher, self._read = fetcher, read

    def wait(self) -> dict[str, Tensor]:
        if self._read.gone:
            return self._fetcher.start(self.unit, background=False).wait()
        self._result = run_now(self._fetcher._ready, self._read)
        return super().wait()  # errors name the unit; files checked unchanged


class RingFetcher:
    """CPU execution of disk units larger than RAM: read ahead into one ring, ``O_DIRECT``.

    Args:
        capacity: Bytes of the ring (:func:`ring_capacity` of the largest unit); ``None``:
            sized by :meth:`prepare`, or by the first unit started.
        readers: Threads reading ``16 MiB`` pieces.
        direct: Read with ``O_DIRECT`` where the filesystem allows it.
    """

    reads_on_release = True  # a release frees ring bytes: the scheduler may start the next read

    def __init__(self, *, capacity: int | None = None, readers: int = 4, direct: bool = True) -> None:
        if (capacity is not None and capacity < ALIGN) or readers < 1:
            raise UsageError(
                f"RingFetcher: capacity={capacity!r} must be >= {ALIGN} bytes and readers={readers!r} >= 1"
            )
        self.capacity = None if capacity is None else capacity // ALIGN * ALIGN
        self.readers, self.direct = readers, direct
        self.stats = StreamStats()
        self.made = 0  # rings allocated: for tests and reports
        self.overflows = 0  # units (part) read into a buffer of their own
        self._ring: Tensor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._reads: dict[int, _Read] = {}
        self._live: deque[_Alloc] = deque()  # ring allocations, oldest first
        self._head = 0
        self._queue: deque[tuple[_Read, int]] = deque()  # extents waiting for room, in start order
        self._layouts: dict[int, _Layout] = {}
        self._clock = itertools.count(1)
        self.timeline: Timeline | None = None  # set while bigviz.timeline(model) records: reads timed
        self.on_read: Callable[[int], object] | None = None  # told the bytes of each piece read (a progress bar)
        self._done_bytes = 0  # bytes read so far (pieces finished), for watch()
        self._done_lock = threading.Lock()
        self.merge_most = MERGE_MOST  # the largest read tensors are merged into (prepare lowers it)

    def __enter__(self) -> RingFetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def held_bytes(self) -> int:
        """Process memory the ring and any overflow buffers hold now."""
        own = sum(r.own.numel() for r in self._reads.values() if r.own is not None)
        return (0 if self._ring is None else self._ring.numel()) + own

    def prepare(self, units: Sequence[Unit], ahead: float = RING_AHEAD) -> int:
        """Find the units' layouts and size the ring for the largest (unless given); returns
        the capacity.

        Reads are merged into extents of at most half the ring's room beyond the largest
        unit (issue 26): an extent is placed whole, so a unit read as one 64 MiB extent could
        not start into the room a ring leaves free while the unit before it computes, and
        every streamed unit's read waited for the previous one's compute (the timeline of a
        GPT with 12.6 MB blocks in a ring of 1.5 blocks showed it). Tensors are still never split.
        """
        maps = FileMaps()  # /proc/self/maps parsed once for all of them
        largest = self._largest(units, maps)
        if self.capacity is None and largest:
            room = ring_capacity(largest, ahead) - largest
            most = max(ALIGN, min(MERGE_MOST, room // 2))
            if most < self.merge_most:
                self.merge_most = most
                self._layouts.clear()
                largest = self._largest(units, maps)
            self.capacity = ring_capacity(largest, ahead)
        return self.capacity or 0

    def watch(self, on_read: Callable[[int], object] | None) -> int:
        """Tell ``on_read`` the bytes of every piece read from now on (``None``: stop); returns
        the bytes read before, so that a count started late misses nothing and counts nothing
        twice."""
        with self._done_lock:
            self.on_read = on_read
            return self._done_bytes

    def _read_counted(self, piece: Piece, direct: bool) -> tuple[int, bool]:
        """:func:`read_piece`, counted (and told to ``on_read``, if set)."""
        done = read_piece(piece, direct)
        with self._done_lock:
            self._done_bytes += done[0]
            on_read = self.on_read
        if on_read is not None:
            on_read(done[0])
        return done

    @property
    def pass_bytes(self) -> int:
        """Bytes one forward reads from disk: every prepared unit's reads (its tensors' file
        bytes, with the small gaps merged reads span). What ``on_read`` is told over a forward."""
        return sum(e.length for layout in self._layouts.values() for e in layout.extents)

    def _largest(self, units: Sequence[Unit], maps: FileMaps) -> int:
        sizes = []
        for unit in units:
            try:
                sizes.append(self._layout(unit, unit_parts(unit)[0], maps).size)
            except Exception:  # noqa: BLE001 - its fetch will fail, naming the unit (FetchError)
                continue
        return max(sizes, default=0)

    def start(self, unit: Unit, *, background: bool) -> Handle:
        """Queue ``unit``'s reads behind those already started (readers do them as the ring
        has room, background or not)."""
        try:
            tensors, packs = unit_parts(unit)  # a packed weight's parts are read, not the weight
            layout = self._layout(unit, tensors)
        except Exception as exc:
            future: Future = Future()
            future.set_exception(exc)
            return Handle(unit, future)
        read = self._reads.get(id(unit))
        if read is not None and read.layout is layout:
            return _RingHandle(unit, self, read)  # already read (or on its way)
        if read is not None:
            self._give_up(read)
        if self.capacity is None:
            self.capacity = ring_capacity(layout.size)
        read = _Read(unit, layout, next(self._clock), tensors, [None] * len(layout.extents), packs=packs)
        self._reads[id(unit)] = read
        self._queue.extend((read, i) for i in range(len(layout.extents)))
        self.stats.units_read += 1
        self.stats.bytes_read += sum(e.length for e in layout.extents)
        self._pump()
        return _RingHandle(unit, self, read)

    def release(self, unit: Unit, **_: object) -> None:
        """``unit``'s forward is over: its ring bytes are free for the next reads."""
        read = self._reads.get(id(unit))
        if read is None or not read.busy:
            return
        self._give_up(read)
        self.stats.units_dropped += 1
        self.stats.bytes_dropped += sum(e.length for e in read.layout.extents)
        self._pump()

    # ------------------------------------------------------------------ the ring
    def _ready(self, read: _Read) -> dict[str, Tensor]:
        """Wait for ``read`` (a forward is about to use it): read-ahead started before it
        that nothing uses is given up; what the ring cannot hold now goes to a buffer of its
        own. Returns its tensors: views of the ring (and of that buffer)."""
        for other in list(self._reads.values()):
            if other.seq < read.seq and not other.busy:
                self._give_up(other)
        self._pump()
        left = [i for i, at in enumerate(read.placed) if at is None]
        if left:
            self._queue = deque(q for q in self._queue if q[0] is not read)
            extents = [read.layout.extents[i] for i in left]
            read.own = torch.empty(sum(e.size for e in extents) + ALIGN, dtype=torch.uint8)
            at = -read.own.data_ptr() % ALIGN
            for i, extent in zip(left, extents, strict=True):
                self._submit(read, i, read.own, at)
                at += extent.size
            self.overflows += 1
        errors = [f.exception() for f in read.futures]
        for error in errors:
            if error is not None:
                self._give_up(read)
                raise error
        out = {key: read.tensors[key] for key in read.layout.kept}
        for where, extent in zip(read.placed, read.layout.extents, strict=True):
            buffer, base = where  # type: ignore[misc]
            for key, (offset, length, dtype, shape) in extent.views.items():
                out[key] = buffer[base + offset : base + offset + length].view(dtype).view(shape)
        read.busy = True
        return rebuild(out, read.packs)  # packed weights built over their parts in the ring

    def _pump(self) -> None:
        """Place queued extents, in start order, while the ring has room; start their reads."""
        while self._live and self._live[0].read.gone:
            for future in self._live.popleft().read.futures:  # bytes read over only once written
                with contextlib.suppress(Exception):
                    future.result()
        if not self._live:
            self._head = 0
        while self._queue:
            read, i = self._queue[0]
            if read.gone:
                self._queue.popleft()
                continue
            size = read.layout.extents[i].size
            at = self._fit(size)
            if at is None:
                return
            self._queue.popleft()
            if self._ring is None:
                self._ring = self._make_ring()
            self._live.append(_Alloc(read, at))
            self._head = at + size
            self._submit(read, i, self._ring, at)

    def _make_ring(self) -> Tensor:
        """The ring's bytes, from a huge-page boundary, transparent huge pages asked for before
        the first touch (:func:`~bigviz.osio.pages.hugepages`: reads into 2 MiB pages go to the
        disk as larger requests; here twice as fast, at a sixth of the CPU)."""
        assert self.capacity is not None
        raw = torch.empty(self.capacity + HUGE_PAGE, dtype=torch.uint8)
        skip = -raw.data_ptr() % HUGE_PAGE
        hugepages(raw.data_ptr() + skip, self.capacity)
        self.made += 1
        return raw[skip : skip + self.capacity]  # the view keeps the allocation alive

    def _fit(self, size: int) -> int | None:
        """Where ``size`` bytes go behind the newest allocation, or ``None`` (no room now)."""
        assert self.capacity is not None
        if not self._live:
            return 0 if size <= self.capacity else None
        tail = self._live[0].start
        if self._head > tail:  # in use: [tail, head)
            if self._head + size <= self.capacity:
                return self._head
            return 0 if size <= tail else None
        return self._head if self._head + size <= tail else None  # in use: [tail, end) and [0, head)

    def _submit(self, read: _Read, i: int, buffer: Tensor, at: int) -> None:
        """Start extent ``i``'s reads into ``buffer`` at byte ``at`` (aligned)."""
        extent = read.layout.extents[i]
        read.placed[i] = (buffer, at)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.readers, thread_name_prefix="bigviz-ring")
        address = buffer.data_ptr() + at
        timeline = self.timeline
        if timeline is not None:
            timeline.queued(read.unit, read)
        reader = self._read_counted
        for piece in pieces_of(
            extent.path, extent.offset, extent.length, address, direct=True, identity=extent.identity
        ):
            if timeline is None:
                read.futures.append(self._pool.submit(reader, piece, self.direct))
            else:  # when each piece ran, in the reader thread
                job = (read.unit, read, piece.need, reader, piece, self.direct)
                read.futures.append(self._pool.submit(timeline.timed, *job))

    def _give_up(self, read: _Read) -> None:
        """``read`` is released, or nothing will use it: its ring bytes may be read over once
        its reads in flight are done."""
        read.gone, read.busy, read.own = True, False, None
        if self._reads.get(id(read.unit)) is read:
            del self._reads[id(read.unit)]

    def _layout(self, unit: Unit, tensors: Mapping[str, Tensor], maps: FileMaps | None = None) -> _Layout:
        """Where ``tensors`` are read from and go to; found once per unit (``/proc/self/maps``
        is parsed then) and reused while its file-backed tensors are the same mapped bytes (a
        converted copy is new memory at each fetch: it does not count)."""
        known = self._layouts.get(id(unit))
        if known is not None and known.where == mapped_where(tensors, known.kept):
            return known
        maps = FileMaps() if maps is None else maps
        spans = {key: file_span(t, maps) for key, t in tensors.items()}
        kept = frozenset(key for key in tensors if spans[key] is None)
        files = _identities(unit, spans)
        groups: list[list] = []  # [path, first byte, end byte, keys]
        small = min(SMALL, self.merge_most // 16)
        for key, span in sorted(
            ((k, s) for k, s in spans.items() if s is not None), key=lambda i: (i[1].path, i[1].offset)
        ):
            last = groups[-1] if groups else None
            if (
                last is not None
                and last[0] == span.path
                and files[last[3][0]] == files[key]
                and span.offset <= last[2] + MERGE_GAP
                and (
                    max(last[2], span.offset + span.length) - last[1] <= self.merge_most
                    or min(last[2] - last[1], span.length) < small
                )
            ):
                last[2] = max(last[2], span.offset + span.length)
                last[3].append(key)
            else:
                groups.append([span.path, span.offset, span.offset + span.length, [key]])
        extents = []
        for path, first, end, keys in groups:
            head, size = block_room(first, end - first, direct=True)
            views = {}
            for key in keys:
                span, tensor = spans[key], tensors[key]
                offset = head + span.offset - first  # type: ignore[union-attr]
                views[key] = (offset, span.length, tensor.dtype, tuple(tensor.shape))  # type: ignore[union-attr]
            extents.append(_Extent(path, first, end - first, head, size, views, files[keys[0]]))
        layout = _Layout(mapped_where(tensors, kept), extents, kept)
        self._layouts[id(unit)] = layout
        return layout

    def close(self) -> None:
        """Stop the readers and free the ring (tensors handed out keep their own memory alive)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._reads.clear()
        self._queue.clear()
        self._live.clear()
        self._ring = None


def _identities(unit: Unit, spans: Mapping[str, FileSpan | None]) -> dict[str, tuple[int, int] | None]:
    """Key -> the file (``(device, inode)``) its bytes must be read from: as the store that
    holds the file open says (a :class:`~bigviz.checkpoint.lazy.LazyWeights`), else as the
    memory mapping says. Reads go to that file even after its path was given to another one
    (a shard replaced by rename while the model runs)."""
    out: dict[str, tuple[int, int] | None] = {}
    stores = {key: store for store, keys in unit.keys_by_source() for key in keys}
    for key, span in spans.items():
        if span is None:
            continue
        held = getattr(stores.get(key), "identity", None)  # a packed weight's part: its mapping says
        out[key] = (held(key) if held is not None else None) or span_identity(span)
    return out
