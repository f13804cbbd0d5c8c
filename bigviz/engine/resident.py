"""Resident means resident: "cpu" weights of a model larger than RAM, read once into process memory.

A model that fits in RAM keeps the zero-copy path: its "cpu" weights are views of the
memory-mapped checkpoint, read in on first use and kept by the page cache. A model that does
not fit cannot rely on the page cache: the disk units streaming through it would evict the
"cpu" weights, which would then be read again, page by page, in every forward. Then
:func:`settle_residency` makes the resident part resident for the model's lifetime and
streams the rest without polluting:

- every memory-mapped "cpu" tensor is read once, at disk speed (``readers`` threads, a
  progress bar), into **anonymous memory** (:func:`make_resident`): each 16 MiB piece of the
  copy is prefaulted in one call, then read with ``O_DIRECT`` (the disk writes into it, the
  page cache never holds a second copy); where the filesystem refuses ``O_DIRECT``, buffered
  reads whose pages are dropped behind them;
- the disk units get a :class:`~bigviz.engine.ring.RingFetcher`: read ahead in execution
  order by parallel readers with ``O_DIRECT`` into one ring buffer allocated once and reused,
  1.5 times the largest unit (no page cache, nothing to drop; fresh memory per unit costs a
  fault per page on a virtual machine), the next reads starting as soon as a unit is done
  (so reads run on while resident units compute).

Why an anonymous copy rather than locking the mapped pages (``mlock``), measured on two 1.8 GB
shards, cold, on a loaded 2-core machine (``/proc/self/status`` deltas):

- anonymous copy, 4 readers, ``preadv`` into fresh memory: 0.46-0.73 GB/s; +3.4 GiB RssAnon.
  Most of that time is page faults (one per 4 KiB page, costly on a virtual machine): 7.2 GB
  read into fresh memory ran at 0.45-0.55 GB/s, and at 1.05-1.31 GB/s with each piece
  prefaulted (``MADV_POPULATE_WRITE``) and read with ``O_DIRECT`` (this module now), as fast
  as reading the same files into the page cache (0.86-0.96 GB/s in the same run);
- ``mlock`` of torch's own mapping (private, writable: copy-on-write): 0.12 GB/s, and
  +3.4 GiB RssAnon *and* VmLck: locking a writable private mapping breaks copy-on-write for
  every page, so it makes the same anonymous copy, one fault at a time;
- ``mlock`` of a shared read-only mapping after a 4-thread populate: 0.82 GB/s, +3.4 GiB
  locked page cache. Faster (no copy), but it needs ``RLIMIT_MEMLOCK`` above the resident size
  (8 MiB for a normal user: root or a configured limit), a second mapping of every file
  beside torch's, and locked pages leave the kernel no way out when memory runs short.

So: an anonymous copy. It needs no privilege, works on whatever maps the weights, counts as the
process's own memory (what ``max_memory={"cpu": ...}`` budgets), and is reclaimed only by
swapping, which the kernel does after dropping clean file pages (the streamed units, which the
fetcher drops anyway).

Example:
    >>> import os, tempfile, torch
    >>> from bigviz.checkpoint.lazy import map_file
    >>> path = os.path.join(tempfile.mkdtemp(), "w.bin")
    >>> _ = open(path, "wb").write(torch.arange(2048.0).numpy().tobytes())
    >>> layer = torch.nn.Linear(32, 64, bias=False)
    >>> layer.weight.data = map_file(path).view(torch.float32).view(64, 32)  # zero-copy, mapped
    >>> report = make_resident(layer, progress=False)
    >>> report.tensors, report.nbytes, layer.weight[1, 0].item()
    (1, 8192, 32.0)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psutil
import torch
from torch import Tensor, nn

from bigviz.core.streaming import DEFAULT_DEPTH
from bigviz.checkpoint.probe import ALIGN  # O_DIRECT: offsets, lengths and addresses, multiples of it
from bigviz.engine.readahead import FileMaps, FileSpan, StreamingFetcher, file_span, prefault
from bigviz.modeling.packed import Packed, release_module_state, split

__all__ = [
    "ResidentReport",
    "Residency",
    "make_resident",
    "settle_residency",
    "decide",
    "check_mode",
    "stream_depth",
    "RESIDENCY_MODES",
]

RESIDENCY_MODES = ("auto", "copy", "map")
PAGE_CACHE_SHARE = 0.9  # of available RAM: what the page cache can be expected to keep


@dataclass(frozen=True)
class ResidentReport:
    """What :func:`make_resident` did: tensors and bytes copied, how long it took, and how many
    bytes were read with ``O_DIRECT``."""

    tensors: int
    nbytes: int
    seconds: float
    direct_bytes: int = 0  # of them read with O_DIRECT (the rest: buffered, dropped behind)


@dataclass(frozen=True)
class Residency:
    """How a dispatched model keeps its weights (``model._bigviz_residency``).

    Attributes:
        mode: ``"map"`` (zero-copy memory maps, page cache) or ``"copy"`` (resident weights in
            process memory, disk units streamed and dropped).
        resident_bytes: Bytes of memory-mapped "cpu" weights (copied when ``mode="copy"``).
        streamed_bytes: Bytes of disk units (read per forward).
        available: Available RAM when decided.
        reason: Why this mode.
        copied: The copy, when one was made.
    """

    mode: str
    resident_bytes: int
    streamed_bytes: int
    available: int
    reason: str
    copied: ResidentReport | None = None


def check_mode(resident: object) -> None:
    """Raise a ValueError naming the choices unless ``resident`` is one of them.

    Example:
        >>> check_mode("auto")
    """
    if resident not in RESIDENCY_MODES:
        raise ValueError(
            f"resident={resident!r}: use one of {', '.join(map(repr, RESIDENCY_MODES))} "
            "('auto': copy the resident weights into RAM only when the model does not fit)"
        )


def decide(resident_bytes: int, streamed_bytes: int, *, available: int, requested: str = "auto") -> tuple[str, str]:
    """``(mode, reason)``: copy when the model does not fit in the page cache.

    Example:
        >>> decide(10, 5, available=100)[0], decide(60, 50, available=100)[0]
        ('map', 'copy')
    """
    check_mode(requested)
    total, room = resident_bytes + streamed_bytes, int(available * PAGE_CACHE_SHARE)
    if requested != "auto":
        return requested, f"resident={requested!r} asked for"
    if total <= room:
        return "map", f"the model ({total:,} B) fits in the page cache ({room:,} B): zero-copy memory maps"
    return "copy", (
        f"the model ({total:,} B) does not fit in the page cache ({room:,} B): the resident part "
        "is copied into process memory, disk units are streamed, never kept"
    )


def stream_depth(available: int, largest_unit: int, *, margin: int = 2**30, most: int = DEFAULT_DEPTH) -> int:
    """Units to read ahead: as many as RAM holds beside the running one (``margin`` kept for
    everything else), at least 1, at most ``most``. Pages read ahead and evicted before use
    would be read twice. (The scheduler starts the read ``depth + 1`` units on when a unit is
    done, as that unit's pages are dropped: it takes the done unit's place, so RAM still holds
    the running unit and ``depth`` ahead of it.)

    Example:
        >>> GB = 10**9
        >>> stream_depth(20 * GB, 2 * GB), stream_depth(6 * GB, 2 * GB), stream_depth(GB, 2 * GB)
        (2, 1, 1)
    """
    fits = (available - margin) // max(1, largest_unit)
    return max(1, min(most, fits - 1))


def _cpu_tensors(model: nn.Module) -> Iterator[tuple[nn.Module, str, str, Tensor]]:
    """``(module, attribute, kind, tensor)`` for each parameter and buffer slot on the CPU."""
    for module in model.modules():
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for attr, tensor in table.items():
                if tensor is not None and tensor.device.type == "cpu":
                    yield module, attr, kind, tensor


def _plain_tensors(model: nn.Module) -> Iterator[tuple[nn.Module, str, str, Tensor, Packed | None]]:
    """:func:`_cpu_tensors`, a packed (quantized) weight once per part: ``(module, attribute,
    kind, part, the packed weight)``; a plain tensor comes with None."""
    seen: dict[int, Packed | None] = {}  # a tied weight is split once: one object is built again
    for module, attr, kind, tensor in _cpu_tensors(model):
        if id(tensor) not in seen:
            seen[id(tensor)] = split(tensor, module=module)
        packed = seen[id(tensor)]
        if packed is None:
            yield module, attr, kind, tensor, None
        else:
            for part in packed.parts.values():
                yield module, attr, kind, part, packed


def mapped_bytes(model: nn.Module) -> int:
    """Bytes of the model's CPU tensors that are memory-mapped from files (counted once; a
    packed weight by its parts)."""
    seen: dict[tuple[int, int], int] = {}
    maps = FileMaps()
    for _, _, _, tensor, _ in _plain_tensors(model):
        span = file_span(tensor, maps)
        if span is not None:
            seen[(span.address, span.length)] = span.length
    return sum(seen.values())


def make_resident(model: nn.Module, *, readers: int = 4, progress: bool = True, direct: bool = True) -> ResidentReport:
    """Copy every memory-mapped CPU tensor of ``model`` into anonymous memory, read from its
    file by ``readers`` threads; ties (the same bytes in several slots) stay one tensor.
    ``direct``: read with ``O_DIRECT`` where the filesystem allows it (no page cache on the
    way), else buffered reads dropped from the page cache behind them.

    Parameters keep their identity (``param.data`` is replaced), so optimisers, hooks and
    weight ties made by object identity are unaffected.
    """
    from tqdm.auto import tqdm

    copies: dict[tuple[int, int, torch.dtype, tuple[int, ...]], Tensor] = {}
    maps = FileMaps()
    pieces = [(m, a, k, t, p, file_span(t, maps)) for m, a, k, t, p in _plain_tensors(model)]
    todo = [(m, a, k, t, s) for m, a, k, t, p, s in pieces if p is None and s is not None]
    unique: dict[tuple[int, int], FileSpan] = {(s.address, s.length): s for *_, s in pieces if s is not None}
    start = time.perf_counter()
    with tqdm(
        total=sum(s.length for s in unique.values()), unit="B", unit_scale=True, desc="resident", disable=not progress
    ) as bar:
        buffers, direct_bytes = _read_all(list(unique.values()), readers, bar.update, direct=direct)
    for module, attr, kind, tensor, span in todo:
        key = (span.address, span.length, tensor.dtype, tuple(tensor.shape))
        if key not in copies:
            copies[key] = buffers[(span.address, span.length)].view(tensor.dtype).view(tensor.shape)
        if kind == "param":
            tensor.data = copies[key]
        else:
            module._buffers[attr] = copies[key]
    _copy_packed([x for x in pieces if x[4] is not None], buffers, copies)
    total = sum(s.length for s in unique.values())
    return ResidentReport(len(unique), total, time.perf_counter() - start, direct_bytes)


def _copy_packed(pieces: list, buffers: dict[tuple[int, int], Tensor], copies: dict) -> None:
    """Packed weights built again over the copies of their mapped parts (one object per weight:
    its slots, tied ones too, get the same); what a layer keeps of the old one goes.
    ``pieces``: ``(module, attribute, kind, part, packed weight, the part's file span)``."""
    spans = {id(part): span for _, _, _, part, _, span in pieces}
    built: dict[int, Tensor] = {}
    for module, attr, kind, _, packed, _ in pieces:
        if id(packed) not in built:
            parts = {}
            for name, tensor in packed.parts.items():
                span = spans.get(id(tensor))
                if span is None:
                    parts[name] = tensor  # in memory already
                    continue
                key = (span.address, span.length, tensor.dtype, tuple(tensor.shape))
                if key not in copies:
                    copies[key] = buffers[(span.address, span.length)].view(tensor.dtype).view(tensor.shape)
                parts[name] = copies[key]
            built[id(packed)] = packed.build(parts)
        value = built[id(packed)]
        if kind == "param" and not isinstance(value, nn.Parameter):
            value = nn.Parameter(value, requires_grad=False)
        (module._parameters if kind == "param" else module._buffers)[attr] = value
        release_module_state(module)


_CHUNK = 16 * 2**20  # a multiple of ALIGN


@dataclass(frozen=True)
class _Piece:
    """One read of a span's copy: file bytes ``[offset, offset + upto)`` into ``address``
    (``need`` of them belong to the span); with ``O_DIRECT``, ``offset``, ``length`` (the room
    at ``address``) and ``address`` are multiples of ``ALIGN``."""

    path: str
    offset: int
    length: int
    upto: int
    need: int
    address: int


def _read_all(
    spans: list[FileSpan], readers: int, done: object, *, direct: bool
) -> tuple[dict[tuple[int, int], Tensor], int]:
    """Each span read into a new anonymous buffer, in file order, by ``readers`` threads.

    Returns ``{(address, length): uint8 tensor}`` and the bytes read with ``O_DIRECT``. Each
    piece of a buffer is prefaulted just before it is read (:func:`prefault`), so threads fault
    memory in while others wait on the disk. With ``direct`` a span's buffer covers the whole
    file blocks around it and is read with ``O_DIRECT`` (the disk writes straight into it and
    the page cache is left alone); else, or where the filesystem refuses ``O_DIRECT``, with
    buffered reads whose pages are dropped from the page cache behind them.
    """
    out: dict[tuple[int, int], Tensor] = {}
    pieces: list[_Piece] = []
    for span in sorted(spans, key=lambda s: (s.path, s.offset)):
        head, size = block_room(span.offset, span.length, direct=direct)
        raw = torch.empty(size + ALIGN, dtype=torch.uint8)
        base = -raw.data_ptr() % ALIGN
        out[(span.address, span.length)] = raw[base + head : base + head + span.length]
        pieces += pieces_of(span.path, span.offset, span.length, raw.data_ptr() + base, direct=direct)
    direct_bytes = 0
    with ThreadPoolExecutor(max(1, readers), thread_name_prefix="bigviz-resident") as pool:
        for need, was_direct in pool.map(lambda piece: _read_piece(piece, direct), pieces):
            direct_bytes += need if was_direct else 0
            done(need)  # type: ignore[operator]
    return out, direct_bytes


def block_room(offset: int, length: int, *, direct: bool) -> tuple[int, int]:
    """``(head, size)``: where file bytes ``[offset, offset + length)`` start in the buffer
    that receives them, and that buffer's size. With ``direct`` the buffer covers the whole
    ``ALIGN`` blocks around them (``O_DIRECT`` reads whole blocks)."""
    head = offset % ALIGN if direct else 0
    return head, (-(-(head + length) // ALIGN) * ALIGN if direct else length)


def pieces_of(path: str, offset: int, length: int, address: int, *, direct: bool) -> list[_Piece]:
    """The reads that put file bytes ``[offset, offset + length)`` at ``address + head``
    (:func:`block_room`), ``_CHUNK`` bytes each; ``address`` is a multiple of ``ALIGN``."""
    head, size = block_room(offset, length, direct=direct)
    out = []
    for i in range(0, size, _CHUNK):
        upto = min(_CHUNK, head + length - i)
        out.append(
            _Piece(path, offset - head + i, min(_CHUNK, size - i), upto, upto - (head if i == 0 else 0), address + i)
        )
    return out


def _read_piece(piece: _Piece, direct: bool) -> tuple[int, bool]:
    """Read one piece, prefaulted first: ``(its bytes of the span, read with O_DIRECT)``."""
    prefault(piece.address, piece.length)
    if direct and hasattr(os, "O_DIRECT"):
        with contextlib.suppress(OSError):  # EINVAL: no O_DIRECT on this filesystem; buffered below
            _read_into(piece, os.O_DIRECT)
            return piece.need, True
    _read_into(piece, 0)
    return piece.need, False


def _read_into(piece: _Piece, flags: int) -> None:
    """``piece.upto`` bytes read; an ``O_DIRECT`` read asks for whole blocks (``length``): the
    last one may end past the file, and is then short."""
    view = memoryview((ctypes.c_char * piece.length).from_address(piece.address)).cast("B")
    ask = piece.length if flags else piece.upto
    fd = os.open(piece.path, os.O_RDONLY | flags)
    try:
        if not flags and hasattr(os, "posix_fadvise"):  # no kernel read-ahead past the piece: it would stay cached
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, piece.offset, piece.length, os.POSIX_FADV_RANDOM)
        got = 0
        while got < piece.upto:
            n = os.preadv(fd, [view[got:ask]], piece.offset + got)
            if n <= 0:
                raise OSError(
                    f"{piece.path}: short read at byte {piece.offset + got}: the file is shorter than when "
                    "the model was loaded (changed or truncated since); restore it, or load the model again"
                )
            got += n
        if not flags and hasattr(os, "posix_fadvise"):  # the copy is ours now: the page cache need not keep it
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, piece.offset, piece.length, os.POSIX_FADV_DONTNEED)  # whole pages
    finally:
        os.close(fd)


def settle_residency(
    model: nn.Module,
    *,
    resident: str = "auto",
    readers: int = 4,
    progress: bool = True,
    available: int | None = None,
    stream: str = "ring",
) -> Residency:
    """Choose how a dispatched model keeps its weights (:func:`decide`) and set it up.

    With ``"copy"``: memory-mapped CPU weights are copied into process memory
    (:func:`make_resident`) and, when the CPU executes disk units, they are streamed by a
    :class:`~bigviz.engine.ring.RingFetcher` (``stream="ring"``: ``O_DIRECT`` into one
    reused ring of 1.5 times the largest disk unit) or a
    :class:`~bigviz.engine.readahead.StreamingFetcher` (``stream="cache"``: through the page
    cache, dropped after use, up to ``DEFAULT_DEPTH`` units ahead as the RAM left allows:
    :func:`stream_depth`). With ``"map"``: nothing changes (zero copy). Recorded in
    ``model._bigviz_residency``.

    Args:
        model: A model dispatched by bigviz (or a plain one: then only its tensors count).
        resident: ``"auto"``, ``"copy"`` or ``"map"``.
        readers: Parallel readers for the copy and for streaming.
        progress: Show a progress bar while copying.
        available: Available RAM in bytes (default: measured now).
        stream: ``"ring"`` or ``"cache"``: how disk units are streamed (see above).
    """
    if stream not in ("ring", "cache"):
        raise ValueError(f"stream={stream!r}: expected 'ring' (one reused O_DIRECT buffer) or 'cache' (page cache)")
    from bigviz.engine.ring import RingFetcher  # it reads with this module's pieces

    state = getattr(model, "_bigviz_dispatch", None)
    streaming = [u for u in getattr(state, "units", []) if u.storage == "disk"]
    streamed = sum(u.nbytes for u in streaming)
    mapped = mapped_bytes(model)
    free = psutil.virtual_memory().available if available is None else available
    mode, reason = decide(mapped, streamed, available=free, requested=resident)
    copied = None
    if mode == "copy":
        copied = make_resident(model, readers=readers, progress=progress) if mapped else None
        scheduler = getattr(state, "scheduler", None)
        if streaming and scheduler is not None and state.options.main_device.type == "cpu":
            scheduler.fetcher.close()
            if stream == "ring":
                ring = RingFetcher(readers=readers)
                capacity = ring.prepare(streaming)
                scheduler.fetcher, scheduler.depth = ring, DEFAULT_DEPTH  # the ring bounds what is read ahead
                reason += f"; disk units read ahead into a ring of {capacity / 2**30:.2f} GiB"
            else:
                left = psutil.virtual_memory().available if available is None else max(0, available - mapped)
                scheduler.fetcher = StreamingFetcher(readers=readers)
                scheduler.depth = stream_depth(left, max(u.nbytes for u in streaming))
                reason += f"; {scheduler.depth} unit(s) read ahead"
            if scheduler.prefetch:
                scheduler.fetch_ahead(scheduler.depth)  # the first forward's first disk units
    residency = Residency(mode, mapped, streamed, free, reason, copied)
    model._bigviz_residency = residency
    return residency
