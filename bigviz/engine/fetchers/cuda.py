"""Fetching for GPU execution: copies on a side CUDA stream, through pinned staging buffers.

:class:`CudaFetcher` copies a unit's tensors to the GPU on its own stream. Pinned CPU tensors
go straight there; memory-mapped ones are first paged in
(:func:`~bigviz.engine.fetchers.cpu.page_in`) and copied into one of two pinned staging
buffers (the next unit is staged while the current one's copy is in flight). The compute
stream waits on an event, and every fetched tensor is ``record_stream``-ed on it, so the
caching allocator never reuses memory still being read.

Example:
    >>> staging_size([])
    0
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from bigviz.engine.binding import BoundUnit
from bigviz.engine.fetchers.cpu import page_in
from bigviz.engine.fetchers.protocol import Handle, cast, read, run_now
from bigviz.engine.packed import packed_of, parts, rebuild
from bigviz.engine.weights import nbytes
from bigviz.modeling.packed import split

__all__ = ["CudaFetcher", "staging_size"]

_ALIGN = 64  # bytes: every staged tensor starts on a cache-line boundary


class _StagingRing:
    """Two pinned byte buffers, used in turn; a buffer is reused once its copy finished."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._buffers: list[Tensor] = []
        self._events: list[Any] = [None, None]
        self._turn = 0
        self._lock = threading.Lock()

    def acquire(self) -> tuple[int, Tensor]:
        with self._lock:
            if not self._buffers:
                self._buffers = [torch.empty(self.size, dtype=torch.uint8).pin_memory() for _ in range(2)]
            slot, self._turn = self._turn, 1 - self._turn
        event = self._events[slot]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer has finished
        return slot, self._buffers[slot]

    def release(self, slot: int, event: Any) -> None:
        self._events[slot] = event


def staging_size(units: Sequence[BoundUnit]) -> int:
    """Bytes one staging buffer needs: the largest disk unit, each tensor aligned."""
    sizes = [sum(_aligned(n) for n in u.key_nbytes.values()) for u in units if u.storage == "disk"]
    return max(sizes, default=0)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class CudaFetcher:
    """Copies to a GPU on a side stream; disk tensors pass through pinned staging buffers."""

    def __init__(self, device: torch.device, units: Sequence[BoundUnit], *, background: bool) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._ring = _StagingRing(staging_size(units))
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="bigviz-prefetch") if background else None

    def start(self, unit: BoundUnit, *, background: bool) -> Handle:
        # With a worker, every fetch goes through it (even a synchronous one) so that the
        # staging ring is only ever used by one thread at a time.
        if self._executor is None:
            return Handle(unit, run_now(self._job, unit), device=self.device)
        return Handle(unit, self._executor.submit(self._job, unit), device=self.device)

    def _job(self, unit: BoundUnit) -> tuple[dict[str, Tensor], Any]:
        out: dict[str, Tensor] = {}
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            slot, buffer, offset = None, None, 0
            try:
                for store, keys in unit.keys_by_source():
                    packs = {key: p for key in keys if (p := packed_of(store, key)) is not None}  # parts, unbuilt
                    plain = {key: read(store, key) for key in keys if key not in packs}
                    packs |= {key: p for key, t in plain.items() if (p := split(t)) is not None}
                    sources = {k: t for k, t in plain.items() if k not in packs} | parts(packs)
                    page_in(store, sources)  # read at disk speed, not page fault by page fault
                    moved = {}
                    for key, source in sources.items():
                        if not source.is_pinned():
                            if buffer is None:
                                slot, buffer = self._ring.acquire()
                            source, offset = _stage(source, buffer, offset)
                        moved[key] = source.to(self.device, non_blocking=True)
                    # a packed weight's parts go as they are; it is built (FP8: dequantized) on the GPU
                    out |= {key: cast(unit, key, t) for key, t in rebuild(moved, packs).items()}
            finally:  # even after a failed read: the buffer is reused only once copies finish
                event = torch.cuda.Event()
                event.record(self.stream)
                if slot is not None:
                    self._ring.release(slot, event)
        return out, event

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self.stream.synchronize()


def _stage(source: Tensor, buffer: Tensor, offset: int) -> tuple[Tensor, int]:
    size = nbytes(source)
    if offset + size > buffer.numel():  # a store handing out wider dtypes than planned
        return source.pin_memory(), offset
    view = buffer[offset : offset + size].view(source.dtype).view(source.shape)
    view.copy_(source)  # mmap -> pinned: the one CPU copy on the way to the GPU
    return view, offset + _aligned(size)
