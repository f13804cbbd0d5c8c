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
found from ``/proc/self/maps`` (:func:`~bigviz.engine.fetchers.spans.file_span`), so any
memory-mapped tensor works (a converted copy is anonymous memory: nothing to read or drop).

Example:
    >>> fetcher = StreamingFetcher(readers=2)
    >>> fetcher.reads_on_release, fetcher.stats.units_read
    (True, 0)
    >>> fetcher.close()
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from torch import Tensor

from bigviz.engine.binding import BoundUnit as Unit
from bigviz.engine.fetchers.protocol import FetchError, Handle
from bigviz.engine.fetchers.spans import (
    FileMaps,
    FileSpan,
    Where,
    drop_pages,
    file_span,
    mapped_where,
    merge_spans,
    unit_tensors,
)
from bigviz.osio.pages import PAGE, populate
from bigviz.core.errors import UsageError

__all__ = ["StreamingFetcher", "StreamStats"]


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
            raise UsageError(
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
        error = part.exception() if not part.cancelled() else FetchError("read cancelled")
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
