"""Where a memory-mapped tensor's bytes lie in its file, for the fetchers that read them there.

A tensor that is a view of a memory-mapped checkpoint (safetensors read in place) has an
address; ``/proc/self/maps`` (:class:`~bigviz.osio.procfs.FileMaps`) says which file and offset
that address maps. :func:`file_span` turns one into the other, so any memory-mapped tensor can
be read directly (:class:`~bigviz.engine.fetchers.ring.RingFetcher`, the resident copy) or
populated and dropped (:class:`~bigviz.engine.fetchers.cache.StreamingFetcher`). A converted
copy (another dtype than the file's) is anonymous memory: it lies in no file.

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from bigviz.engine.fetchers.protocol import cast, read
from bigviz.engine.weights import nbytes
from bigviz.osio.pages import PAGE, discard, drop_file_pages
from bigviz.osio.procfs import FileMaps

__all__ = ["FileSpan", "FileMaps", "file_span", "merge_spans", "drop_pages", "mapped_where", "unit_tensors", "Where"]


@dataclass(frozen=True)
class FileSpan:
    """Where a memory-mapped tensor's bytes are: ``path[offset:offset + length]``, mapped at
    ``address``."""

    path: str
    offset: int
    length: int
    address: int


def file_span(tensor: Tensor, maps: FileMaps | None = None) -> FileSpan | None:
    """Where ``tensor``'s bytes lie in a file it is memory-mapped from; None when it is not
    (anonymous memory, another device, empty, not contiguous, or not Linux).

    Args:
        tensor: A tensor.
        maps: A snapshot of the mappings (default: a new one; pass one for many lookups).
    """
    if tensor.device.type != "cpu" or tensor.numel() == 0 or not tensor.is_contiguous():
        return None
    address = tensor.data_ptr()
    row = (maps if maps is not None else FileMaps()).find(address)
    if row is None or row[3].endswith(" (deleted)") or address + nbytes(tensor) > row[1]:
        return None
    start, _end, offset, path = row
    return FileSpan(path, offset + address - start, nbytes(tensor), address)


def drop_pages(span: FileSpan) -> int:
    """Unmap and evict every page ``span`` touches, from this process and the page cache.

    Returns the bytes dropped. The mapping must be private and clean (checkpoint weights are
    never written): a later read faults the bytes in again from the file, so a page shared
    with a neighbouring unit costs that unit one page read, never a wrong value.
    """
    dropped = discard(span.address, span.length)
    if dropped:
        first = span.address - span.address % PAGE
        drop_file_pages(span.path, span.offset + first - span.address, dropped, flush=False)
    return dropped


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


Where = tuple[tuple[str, int, int], ...]


def mapped_where(tensors: Mapping[str, Tensor], kept: frozenset[str]) -> Where:
    """``(key, address, bytes)`` of the tensors not in ``kept`` (those found in no file: a
    converted copy is new memory at each fetch), to tell whether what a unit maps moved."""
    return tuple((key, t.data_ptr(), nbytes(t)) for key, t in tensors.items() if key not in kept)


def unit_tensors(unit: object) -> dict[str, Tensor]:
    """Key -> the tensor a unit reads, as its store gives it (a mapped view of the checkpoint,
    or a converted copy where the model declares another dtype)."""
    out: dict[str, Tensor] = {}
    for store, keys in unit.keys_by_source():  # type: ignore[attr-defined]
        out.update({key: cast(unit, key, read(store, key)) for key in keys})  # type: ignore[arg-type]
    return out
