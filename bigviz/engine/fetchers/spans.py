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

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from torch import Tensor

from bigviz.engine.fetchers.protocol import cast, read
from bigviz.engine.packed import packed_of, parts
from bigviz.engine.weights import nbytes
from bigviz.modeling.packed import Packed, split
from bigviz.osio.pages import PAGE, discard, drop_file_pages
from bigviz.osio.procfs import FileMaps, open_identified

__all__ = [
    "FileSpan",
    "FileMaps",
    "file_span",
    "span_identity",
    "can_open",
    "merge_spans",
    "drop_pages",
    "mapped_where",
    "unit_tensors",
    "unit_parts",
    "Where",
]

_SHARED_MEMORY = ("/dev/shm/", "/memfd:", "/SYSV")  # shared memory shows as deleted files: not a checkpoint


@dataclass(frozen=True)
class FileSpan:
    """Where a memory-mapped tensor's bytes are: ``path[offset:offset + length]``, mapped at
    ``address``; ``device`` and ``inode``: the file the mapping holds (``/proc/self/maps``:
    0 when unknown), which ``path`` may no longer name (a file replaced by rename)."""

    path: str
    offset: int
    length: int
    address: int
    device: int = 0
    inode: int = 0


def file_span(tensor: Tensor, maps: FileMaps | None = None, *, deleted: bool = False) -> FileSpan | None:
    """Where ``tensor``'s bytes lie in a file it is memory-mapped from; None when it is not
    (anonymous memory, another device, empty, not contiguous, or not Linux).

    A file replaced by rename or removed since it was mapped counts when this process still
    holds a descriptor on it (it can be read), or with ``deleted`` (only its mapping leads to
    it then); shared memory (``/dev/shm``, ``memfd``) never counts.

    Args:
        tensor: A tensor.
        maps: A snapshot of the mappings (default: a new one; pass one for many lookups).
        deleted: Count files that no path or descriptor leads to any more.
    """
    if tensor.device.type != "cpu" or tensor.numel() == 0 or tensor.is_meta or split(tensor) is not None:
        return None  # (a packed weight is several tensors: see unit_parts)
    if not tensor.is_contiguous():
        return None
    address = tensor.data_ptr()
    maps = maps if maps is not None else FileMaps()
    row = maps.find(address)
    if row is None or address + nbytes(tensor) > row[1]:
        return None
    start, _end, offset, path, (device, inode) = row
    if path.endswith(" (deleted)"):  # replaced or removed since mapped
        path = path.removesuffix(" (deleted)")
        if path.startswith(_SHARED_MEMORY):
            return None
        if not deleted and maps.held((device, inode)) is None:
            return None
    return FileSpan(path, offset + address - start, nbytes(tensor), address, device, inode)


def span_identity(span: FileSpan) -> tuple[int, int] | None:
    """``(device, inode)`` of the file ``span`` maps; None where ``/proc/self/maps`` gave none."""
    return (span.device, span.inode) if span.inode else None


def can_open(span: FileSpan) -> bool:
    """Whether the file ``span`` maps can still be opened (by its path, or through a
    descriptor this process holds on it: see :func:`~bigviz.osio.procfs.open_identified`)."""
    try:
        fd = open_identified(span.path, span_identity(span))
    except OSError:
        return False
    with contextlib.suppress(OSError):
        os.close(fd)
    return True


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
        [FileSpan(path='f', offset=0, length=170, address=1000, device=0, inode=0)]
    """
    out: list[FileSpan] = []
    for span in sorted(spans, key=lambda s: (s.path, s.address)):
        last = out[-1] if out else None
        same = last is not None and last.path == span.path and span.address - last.address == span.offset - last.offset
        if last is not None and same and span.address <= last.address + last.length + gap:
            end = max(last.address + last.length, span.address + span.length)
            out[-1] = replace(last, length=end - last.address)
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


def unit_parts(unit: object) -> tuple[dict[str, Tensor], dict[str, Packed]]:
    """What a unit reads as plain tensors: :func:`unit_tensors`, but each packed (quantized)
    weight as its parts (unbuilt: views of the mapped files), under ``key + PART + part``; and
    the packed weights, to build once the parts are read (:func:`bigviz.engine.packed.rebuild`)."""
    out: dict[str, Tensor] = {}
    packs: dict[str, Packed] = {}
    for store, keys in unit.keys_by_source():  # type: ignore[attr-defined]
        for key in keys:
            packed = packed_of(store, key)
            if packed is None:
                tensor = cast(unit, key, read(store, key))  # type: ignore[arg-type]
                packed = split(tensor)
                if packed is None:
                    out[key] = tensor
                    continue
            packs[key] = packed
    return out | parts(packs), packs
