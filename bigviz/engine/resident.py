"""Resident means resident: "cpu" weights of a model larger than RAM, read once into process memory.

A model that fits in RAM keeps the zero-copy path: its "cpu" weights are views of the
memory-mapped checkpoint, read in on first use and kept by the page cache. A model that does
not fit cannot rely on the page cache: the disk units streaming through it would evict the
"cpu" weights, which would then be read again, page by page, in every forward. Its stream
plan (:mod:`bigviz.core.stream_plan`, decided before anything moves) then says ``"copy"``, and
the dispatch makes the resident part resident for the model's lifetime and streams the rest
without polluting:

- every memory-mapped "cpu" tensor is read once, at disk speed (``readers`` threads, a
  progress bar), into **anonymous memory** (:func:`make_resident`): each 16 MiB piece of the
  copy is prefaulted in one call, then read with ``O_DIRECT`` (the disk writes into it, the
  page cache never holds a second copy); where the filesystem refuses ``O_DIRECT``, buffered
  reads whose pages are dropped behind them; when units also stream from disk, the copy runs
  beside the first forward (:mod:`bigviz.engine.resident_copy`);
- the disk units get a :class:`~bigviz.engine.fetchers.ring.RingFetcher`: read ahead in execution
  order by parallel readers with ``O_DIRECT`` into one ring buffer allocated once and reused,
  two times the largest unit (no page cache, nothing to drop; fresh memory per unit costs a
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

Nor does leaving the weights in the page cache, populated by the kernel, save the copy's cost
on a virtual machine whose freed memory goes back to the host: the host fills page-cache pages
fast, but the guest's first touch of each one then costs more CPU than faulting in anonymous
memory (``bench/studies/fresh_memory.py --file``, 2026-12-03: a 1.8 GB shard read in at
1.03 GiB/s, then read by the guest at 0.25 GiB/s with 6.6 CPU-seconds per GiB, and again at
1.13 GiB/s; anonymous memory faulted in cold at 0.36-0.51 GiB/s, 1.9-2.8 CPU-seconds per GiB).

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

import ctypes
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from bigviz.checkpoint.progress import byte_bar
from bigviz.core.errors import DeviceMapError
from bigviz.core.stream_plan import StreamPlan
from bigviz.engine.fetchers.spans import FileMaps, FileSpan, can_open, file_span, span_identity
from bigviz.osio.direct import ALIGN, CHUNK, Piece, block_room, pieces_of, read_piece
from bigviz.modeling.packed import Packed, release_module_state, split

__all__ = ["ResidentReport", "Residency", "make_resident", "mapped_bytes", "residency"]

_CHUNK = CHUNK  # bytes per read of the copy (a multiple of ALIGN)


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
    """How a dispatched model keeps and streams its weights: its stream plan, as carried out
    (:func:`residency` gives it; ``DispatchPlan.stream`` said it before anything moved).

    Attributes:
        plan: The stream plan the dispatch executed.
        copy: The resident copy, when one was made: its report, or the copy still running
            while the first forward runs (``copied`` waits for it).
        fetcher: The class of the fetcher streaming the units (``""``: none).
        ring_bytes: Bytes of the ring made (the plan's, rounded up to whole blocks of its
            reads; 0 without one).
    """

    plan: StreamPlan
    copy: Any = None
    fetcher: str = ""
    ring_bytes: int = 0

    @property
    def copied(self) -> ResidentReport | None:
        """The resident copy's report, when one was made; a copy still running in the
        background (:class:`~bigviz.engine.resident_copy.ResidentCopy`) is waited for."""
        if self.copy is None or isinstance(self.copy, ResidentReport):
            return self.copy
        report: ResidentReport = self.copy.wait()
        return report

    @property
    def mode(self) -> str:
        """``"map"`` (zero-copy memory maps) or ``"copy"`` (resident weights in process memory)."""
        return self.plan.mode

    @property
    def reason(self) -> str:
        return self.plan.reason

    @property
    def resident_bytes(self) -> int:
        """Bytes of "cpu" weights kept in RAM (copied when ``mode="copy"``)."""
        return self.plan.resident_bytes

    @property
    def streamed_bytes(self) -> int:
        """Bytes of the streamed units (fetched per forward)."""
        return self.plan.streamed_bytes

    @property
    def available(self) -> int:
        """Available RAM the plan was made for."""
        return self.plan.available


def residency(model: nn.Module) -> Residency:
    """How a model dispatched by bigviz keeps and streams its weights.

    Raises:
        DeviceMapError: the model is not dispatched by bigviz.

    Example:
        >>> import torch, bigviz
        >>> model = bigviz.dispatch_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"": "cpu"}, force_hooks=True)
        >>> residency(model).mode, residency(model).fetcher
        ('map', '')
    """
    state = getattr(model, "_bigviz_dispatch", None)
    if state is None or getattr(state, "residency", None) is None:
        raise DeviceMapError(
            f"{type(model).__name__} is not dispatched by bigviz: dispatch it first "
            "(bigviz.load_checkpoint_and_dispatch or bigviz.dispatch_model)"
        )
    found: Residency = state.residency
    return found


def _cpu_tensors(model: nn.Module) -> Iterator[tuple[nn.Module, str, str, Tensor]]:
    """``(module, attribute, kind, tensor)`` for each parameter and buffer slot on the CPU."""
    for module in model.modules():
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for attr, tensor in table.items():
                if tensor is not None and tensor.device.type == "cpu" and not tensor.is_meta:  # offloaded: no data
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
        span = file_span(tensor, maps, deleted=True)
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
    copies: dict[tuple[int, int, torch.dtype, tuple[int, ...]], Tensor] = {}
    maps = FileMaps()
    pieces = [(m, a, k, t, p, file_span(t, maps, deleted=True)) for m, a, k, t, p in _plain_tensors(model)]
    todo = [(m, a, k, t, s) for m, a, k, t, p, s in pieces if p is None and s is not None]
    unique: dict[tuple[int, int], FileSpan] = {(s.address, s.length): s for *_, s in pieces if s is not None}
    start = time.perf_counter()
    with byte_bar(sum(s.length for s in unique.values()), "resident", enabled=progress) as bar:
        buffers, direct_bytes = _read_all(list(unique.values()), readers, bar.update, direct=direct)
    _take_copies(todo, buffers, copies)
    _copy_packed([x for x in pieces if x[4] is not None], buffers, copies)
    total = sum(s.length for s in unique.values())
    return ResidentReport(len(unique), total, time.perf_counter() - start, direct_bytes)


def _take_copies(todo: Iterable[tuple[nn.Module, str, str, Tensor, FileSpan]], buffers: dict, copies: dict) -> None:
    """Each plain tensor of ``todo`` ``(module, attribute, kind, tensor, its file span)`` made a
    view of its span's copy in ``buffers`` (one view per span, dtype and shape, kept in
    ``copies``: tied slots share it); a parameter keeps its identity (``param.data``)."""
    for module, attr, kind, tensor, span in todo:
        key = (span.address, span.length, tensor.dtype, tuple(tensor.shape))
        if key not in copies:
            copies[key] = buffers[(span.address, span.length)].view(tensor.dtype).view(tensor.shape)
        if kind == "param":
            tensor.data = copies[key]
        else:
            module._buffers[attr] = copies[key]


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


def _read_all(
    spans: list[FileSpan], readers: int, done: Callable[[int], object], *, direct: bool
) -> tuple[dict[tuple[int, int], Tensor], int]:
    """Each span read into a new anonymous buffer, in file order, by ``readers`` threads.

    Returns ``{(address, length): uint8 tensor}`` and the bytes read with ``O_DIRECT``. Each
    piece of a buffer is prefaulted just before it is read (:func:`bigviz.osio.direct.read_piece`),
    so threads fault memory in while others wait on the disk. With ``direct`` a span's buffer
    covers the whole file blocks around it and is read with ``O_DIRECT`` (the disk writes
    straight into it and the page cache is left alone); else, or where the filesystem refuses
    ``O_DIRECT``, with buffered reads whose pages are dropped from the page cache behind them.
    """
    out: dict[tuple[int, int], Tensor] = {}
    pieces: list[Piece] = []
    for span in sorted(spans, key=lambda s: (s.path, s.offset)):
        if not can_open(span):  # replaced by rename and no descriptor left on it: only the mapping has it
            out[(span.address, span.length)] = _copy_mapped(span)
            done(span.length)  # type: ignore[operator]
            continue
        out[(span.address, span.length)], mine = _spans_pieces(span, direct)
        pieces += mine
    direct_bytes = 0
    with ThreadPoolExecutor(max(1, readers), thread_name_prefix="bigviz-resident") as pool:
        for need, was_direct in pool.map(lambda piece: read_piece(piece, direct), pieces):
            direct_bytes += need if was_direct else 0
            done(need)
    return out, direct_bytes


def _spans_pieces(span: FileSpan, direct: bool) -> tuple[Tensor, list[Piece]]:
    """A new anonymous buffer for ``span`` (the span's bytes as a uint8 tensor; with ``direct``
    it covers the whole file blocks around them, aligned for ``O_DIRECT``) and the pieces that
    read it."""
    head, size = block_room(span.offset, span.length, direct=direct)
    raw = torch.empty(size + ALIGN, dtype=torch.uint8)
    base = -raw.data_ptr() % ALIGN
    address = raw.data_ptr() + base
    pieces = pieces_of(
        span.path, span.offset, span.length, address, direct=direct, chunk=_CHUNK, identity=span_identity(span)
    )
    return raw[base + head : base + head + span.length], pieces


def _copy_mapped(span: FileSpan) -> Tensor:
    """A copy of ``span``'s bytes read through its memory mapping (page faults: the slow way,
    for a file that no path or descriptor leads to any more)."""
    copy = torch.empty(span.length, dtype=torch.uint8)
    ctypes.memmove(copy.data_ptr(), span.address, span.length)
    return copy
