"""Streaming that does not pollute: disk units read ahead by parallel readers, dropped after use.

When a model does not fit in RAM, the CPU executes its disk units straight on memory-mapped
checkpoint pages (zero copy: page cache, not the process's memory), and those pages must
neither stay behind (they would evict the resident weights and the next units) nor be faulted
in one page at a time by the compute thread. :class:`StreamingFetcher` therefore:

1. reads a unit in *before* it runs, in execution order: its mapped bytes are cut into
   ``chunk_bytes`` pieces and ``readers`` threads pull them in with
   ``madvise(MADV_POPULATE_READ)`` (several requests in flight: a virtual disk gives one
   reader about half of what it gives four). ctypes drops the GIL, so compute overlaps;
2. after the unit's forward (:meth:`StreamingFetcher.release`), drops the unit's pages:
   ``madvise(MADV_DONTNEED)`` on the process's private mapping (a clean private page is just
   unmapped: a later access reads the file again) and then ``posix_fadvise(DONTNEED)`` on the
   file range (the page cache drops pages no process maps). A unit's tensors are dropped as
   one range: the page cache holds pages in multi-page folios, dropped only whole.

How many units are read ahead is the scheduler's ``depth``; as a release frees a unit's pages,
the scheduler starts the next read then (``reads_on_release``), not when the next streamed unit
starts: reads go on while resident units compute. Where a tensor is in a file is
found from ``/proc/self/maps`` (:func:`file_span`), so any memory-mapped tensor works (a
converted copy is anonymous memory: nothing to read or drop).

Example:
    >>> import os, tempfile, torch
    >>> from bigviz.checkpoint.lazy import map_file
    >>> path = os.path.join(tempfile.mkdtemp(), "w.bin"); _ = open(path, "wb").write(bytes(3 * 4096))
    >>> view = map_file(path)[4096:]
    >>> span = file_span(view)
    >>> (os.path.samefile(span.path, path), span.offset, span.length) if span else "not Linux"
    (True, 4096, 8192)
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import mmap
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from torch import Tensor

from bigviz.engine.prefetch import Handle, _cast, _read
from bigviz.engine.binding import BoundUnit as Unit
from bigviz.engine.packed import packed_of, parts
from bigviz.engine.weights import nbytes
from bigviz.modeling.packed import Packed, split

__all__ = [
    "FileSpan",
    "FileMaps",
    "file_span",
    "StreamingFetcher",
    "StreamStats",
    "populate",
    "prefault",
    "drop_pages",
    "merge_spans",
]

PAGE = mmap.PAGESIZE
MADV_DONTNEED = 4
MADV_POPULATE_READ = 22  # Linux 5.14+
MADV_POPULATE_WRITE = 23  # Linux 5.14+


@dataclass(frozen=True)
class FileSpan:
    """Where a memory-mapped tensor's bytes are: ``path[offset:offset + length]``, mapped at
    ``address``."""

    path: str
    offset: int
    length: int
    address: int


class FileMaps:
    """The file-backed mappings of this process, read from ``/proc/self/maps`` when made.

    A snapshot: mappings come and go (an address may be mapped to another file later), so
    take a new one for each batch of lookups.

    Example:
        >>> FileMaps().find(0) is None
        True
    """

    def __init__(self) -> None:
        rows = []
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith("/"):
                        start, end = (int(x, 16) for x in parts[0].split("-"))
                        rows.append((start, end, int(parts[2], 16), parts[5].rstrip("\n")))
        except OSError:
            pass  # not Linux: nothing is file-backed as far as we can tell
        rows.sort()
        self._rows, self._starts = rows, [r[0] for r in rows]

    def find(self, address: int) -> tuple[int, int, int, str] | None:
        """``(start, end, file offset, path)`` of the mapping holding ``address``, or None."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0 and address < self._rows[i][1]:
            return self._rows[i]
        return None


def file_span(tensor: Tensor, maps: FileMaps | None = None) -> FileSpan | None:
    """Where ``tensor``'s bytes lie in a file it is memory-mapped from; None when it is not
    (anonymous memory, another device, empty, not contiguous, or not Linux).

    Args:
        tensor: A tensor.
        maps: A snapshot of the mappings (default: a new one; pass one for many lookups).
    """
    if tensor.device.type != "cpu" or tensor.numel() == 0 or split(tensor) is not None or not tensor.is_contiguous():
        return None  # (a packed weight is several tensors: see unit_parts)
    address = tensor.data_ptr()
    row = (maps if maps is not None else FileMaps()).find(address)
    if row is None or row[3].endswith(" (deleted)") or address + nbytes(tensor) > row[1]:
        return None
    start, _end, offset, path = row
    return FileSpan(path, offset + address - start, nbytes(tensor), address)


class _Libc:
    def __init__(self) -> None:
        self.fn = None
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self.fn = libc.madvise
        self.ok = {MADV_POPULATE_READ: self.fn is not None, MADV_POPULATE_WRITE: self.fn is not None}

    def madvise(self, address: int, length: int, advice: int) -> bool:
        return self.fn is not None and self.fn(address, length, advice) == 0

    def populate(self, address: int, length: int, advice: int) -> bool:
        """``madvise(advice)`` over the pages of ``[address, address + length)``; False when it
        fails, and never tried again where the kernel does not know it (EINVAL: before 5.14)."""
        if not self.ok[advice] or length <= 0:
            return False
        begin = address - address % PAGE
        if self.madvise(begin, address + length - begin, advice):
            return True
        if ctypes.get_errno() == errno.EINVAL:  # an older kernel; other errors may pass (EINTR, EAGAIN)
            self.ok[advice] = False
        return False


_LIBC = _Libc()


def populate(address: int, length: int) -> bool:
    """Read ``[address, address + length)`` of a mapping in now (at disk speed, mapped).
    False where the kernel cannot (before 5.14): the compute thread then faults pages in."""
    return _LIBC.populate(address, length, MADV_POPULATE_READ)


def prefault(address: int, length: int) -> bool:
    """Fault ``[address, address + length)`` of this process's anonymous memory in now, in one
    call (``madvise(MADV_POPULATE_WRITE)``). A read into fresh memory otherwise takes one page
    fault per 4 KiB page, which on a virtual machine costs more than the read: measured here,
    7.2 GB read into fresh memory by 4 threads ran at 0.45-0.55 GB/s, and at 1.05-1.31 GB/s
    with each piece prefaulted first. False where the kernel cannot (before 5.14): the read
    then faults the pages in itself."""
    return _LIBC.populate(address, length, MADV_POPULATE_WRITE)


def _pages_of(span: FileSpan) -> tuple[int, int, int]:
    """``(address, file offset, length)`` of every page a span touches."""
    first = span.address // PAGE * PAGE
    last = -(-(span.address + span.length) // PAGE) * PAGE
    return first, span.offset + first - span.address, last - first


def drop_pages(span: FileSpan) -> int:
    """Unmap and evict every page ``span`` touches, from this process and the page cache.

    Returns the bytes dropped. The mapping must be private and clean (checkpoint weights are
    never written): a later read faults the bytes in again from the file, so a page shared
    with a neighbouring unit costs that unit one page read, never a wrong value.
    """
    address, offset, length = _pages_of(span)
    if length == 0 or not _LIBC.madvise(address, length, MADV_DONTNEED):
        return 0
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            fd = os.open(span.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return length


Where = tuple[tuple[str, int, int], ...]


def mapped_where(tensors: Mapping[str, Tensor], kept: frozenset[str]) -> Where:
    """``(key, address, bytes)`` of the tensors not in ``kept`` (those found in no file: a
    converted copy is new memory at each fetch), to tell whether what a unit maps moved."""
    return tuple((key, t.data_ptr(), nbytes(t)) for key, t in tensors.items() if key not in kept)


def unit_tensors(unit: Unit) -> dict[str, Tensor]:
    """Key -> the tensor a unit reads, as its store gives it (a mapped view of the checkpoint,
    or a converted copy where the model declares another dtype)."""
    out: dict[str, Tensor] = {}
    for store, keys in unit.keys_by_source():
        out.update({key: _cast(unit, key, _read(store, key)) for key in keys})
    return out


def unit_parts(unit: Unit) -> tuple[dict[str, Tensor], dict[str, Packed]]:
    """What a unit reads as plain tensors: :func:`unit_tensors`, but each packed (quantized)
    weight as its parts (unbuilt: views of the mapped files), under ``key + PART + part``; and
    the packed weights, to build once the parts are read (:func:`bigviz.engine.packed.rebuild`)."""
    out: dict[str, Tensor] = {}
    packs: dict[str, Packed] = {}
    for store, keys in unit.keys_by_source():
        for key in keys:
            packed = packed_of(store, key)
            if packed is None:
                tensor = _cast(unit, key, _read(store, key))
                packed = split(tensor)
                if packed is None:
                    out[key] = tensor
                    continue
            packs[key] = packed
    return out | parts(packs), packs


def merge_spans(spans: Sequence[FileSpan], *, gap: int = PAGE) -> list[FileSpan]:
    """Spans of one mapping that follow each other (less than ``gap`` bytes apart) joined into
    one: a unit's tensors lie side by side in its file, and the page cache keeps pages in
    folios of several pages, which are only dropped whole (small tensors between large ones
    would otherwise keep the folios they share with them).

    Example:
        >>> a, b = FileSpan("f", 0, 100, 1000), FileSpan("f", 120, 50, 1120)
        >>> merge_spans([b, a])
        [FileSpan(path='f', offset=0, length=170, address=1000)]
    """
    out: list[FileSpan] = []
    for span in sorted(spans, key=lambda s: (s.path, s.address)):
        last = out[-1] if out else None
        same = last is not None and last.path == span.path and span.address - last.address == span.offset - last.offset
        if last is not None and same and span.address <= last.address + last.length + gap:
            end = max(last.address + last.length, span.address + span.length)
            out[-1] = FileSpan(last.path, last.offset, end - last.address, last.address)
        else:
            out.append(span)
    return out


@dataclass
class StreamStats:
    """What a :class:`StreamingFetcher` did (counted, for tests and reports)."""

    units_read: int = 0
    bytes_read: int = 0
    units_dropped: int = 0
    bytes_dropped: int = 0


class StreamingFetcher:
    """CPU execution of disk units larger than RAM: read ahead in parallel, dropped after use.

    Args:
        readers: Threads reading chunks (in the order units are started).
        chunk_bytes: Bytes per read request.
        drop: Drop a unit's pages after its forward (:meth:`release`).

    Example:
        >>> fetcher = StreamingFetcher(readers=2)
        >>> fetcher.stats
        StreamStats(units_read=0, bytes_read=0, units_dropped=0, bytes_dropped=0)
        >>> fetcher.close()
    """

    reads_on_release = True  # a release drops the unit's pages: the scheduler may start the next read

    def __init__(self, *, readers: int = 4, chunk_bytes: int = 16 * 2**20, drop: bool = True) -> None:
        if readers < 1 or chunk_bytes < PAGE:
            raise ValueError(
                f"StreamingFetcher: readers={readers!r} must be >= 1 and chunk_bytes={chunk_bytes!r} >= {PAGE}"
            )
        self.readers, self.chunk_bytes, self.drop = readers, chunk_bytes, drop
        self.stats = StreamStats()
        self._pool: ThreadPoolExecutor | None = None
        self._dropper: ThreadPoolExecutor | None = None
        self._spans: dict[int, list[FileSpan]] = {}  # unit id -> spans read, until released
        self._where: dict[int, tuple[frozenset[str], Where, list[FileSpan]]] = {}  # unit id -> spans found
        self._users: dict[tuple[int, int], set[int]] = {}  # (address, length) -> ids of the units fetching it
        self._lock = threading.Lock()

    def start(self, unit: Unit, *, background: bool) -> Handle:
        """Queue ``unit``'s reads (background or not: the readers do them either way)."""
        future: Future = Future()
        try:
            tensors = unit_tensors(unit)
            spans = self._spans_of(unit, tensors)
        except Exception as exc:
            future.set_exception(exc)
            return Handle(unit, future)
        with self._lock:
            self._spans[id(unit)] = spans
        chunks = [(a, n) for s in spans for a, n in _chunks(s, self.chunk_bytes)]
        if not chunks:
            future.set_result(tensors)
            return Handle(unit, future)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.readers, thread_name_prefix="bigviz-read")
        _when_all([self._pool.submit(populate, a, n) for a, n in chunks], future, tensors)
        self.stats.units_read += 1
        self.stats.bytes_read += sum(s.length for s in spans)
        return Handle(unit, future)

    def _spans_of(self, unit: Unit, tensors: Mapping[str, Tensor]) -> list[FileSpan]:
        """Where ``tensors`` lie in their files. Found once per unit from ``/proc/self/maps``
        (parsing it takes milliseconds: per unit and token, that is most of a small model's
        forward) and reused while its file-backed tensors are the same mapped bytes."""
        known = self._where.get(id(unit))
        if known is not None and known[1] == mapped_where(tensors, known[0]):
            return known[2]
        maps = FileMaps()
        found = {key: file_span(t, maps) for key, t in tensors.items()}
        kept = frozenset(key for key, span in found.items() if span is None)
        spans = [span for span in found.values() if span is not None]
        self._where[id(unit)] = (kept, mapped_where(tensors, kept), spans)
        for span in spans:
            self._users.setdefault((span.address, span.length), set()).add(id(unit))
        return spans

    def release(self, unit: Unit, *, still_needed: Callable[[int], bool] | None = None) -> None:
        """``unit``'s forward is over: drop its pages (when ``drop``).

        Bytes another unit fetches too (a tied weight offloaded under two names, such as an
        embedding and the head that reuses it) are kept while ``still_needed(id(that unit))``:
        it has not run yet in this forward, or it is already read ahead for the next one.
        Dropping them would make that unit read them again, or find its read-ahead undone.
        """
        with self._lock:
            spans = self._spans.pop(id(unit), [])
        if still_needed is not None:
            spans = [s for s in spans if not self._shared_and_needed(id(unit), s, still_needed)]
        if self.drop and spans:
            if self._dropper is None:  # unmapping 1 GB takes tens of ms: not in the compute thread
                self._dropper = ThreadPoolExecutor(1, thread_name_prefix="bigviz-drop")
            self._dropper.submit(self._drop, merge_spans(spans))

    def _shared_and_needed(self, unit: int, span: FileSpan, still_needed: Callable[[int], bool]) -> bool:
        users = self._users.get((span.address, span.length), ())
        return any(other != unit and still_needed(other) for other in users)

    def _drop(self, spans: list[FileSpan]) -> None:
        dropped = sum(drop_pages(s) for s in spans)
        with self._lock:
            self.stats.bytes_dropped += dropped
            self.stats.units_dropped += 1

    def wait_dropped(self) -> None:
        """Return once every drop asked for so far is done."""
        if self._dropper is not None:
            self._dropper.submit(lambda: None).result()

    def close(self) -> None:
        for name in ("_pool", "_dropper"):
            pool = getattr(self, name)
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=name == "_pool")
                setattr(self, name, None)


def _chunks(span: FileSpan, size: int) -> list[tuple[int, int]]:
    return [(span.address + i, min(size, span.length - i)) for i in range(0, span.length, size)]


def _when_all(parts: Sequence[Future], done: Future, result: Mapping[str, Tensor]) -> None:
    """Complete ``done`` with ``result`` once every part has finished (its error if one failed)."""
    left = [len(parts)]
    lock = threading.Lock()

    def one(part: Future) -> None:
        error = part.exception() if not part.cancelled() else RuntimeError("read cancelled")
        with lock:
            left[0] -= 1
            last = left[0] == 0
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            elif last:
                done.set_result(dict(result))

    for part in parts:
        part.add_done_callback(one)
