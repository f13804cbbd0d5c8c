"""Fetching offloaded units' weights: how a unit's tensors reach the execution device.

Two fetchers, one per kind of execution device (a model larger than RAM streams its disk
units with :class:`~bigviz.engine.ring.RingFetcher` instead):

* :class:`CpuFetcher` (the CPU executes): a unit's tensors *are* the store's tensors, i.e.
  zero-copy views of memory-mapped safetensors files; nothing is copied. Prefetching pages
  the next unit in from a background thread when it is not in memory already (a
  page-cache hint, then ``madvise(MADV_POPULATE_READ)``: read at disk speed, and mapped).
* :class:`CudaFetcher` (a GPU executes): copies run on a side CUDA stream. Pinned CPU
  tensors go straight to the GPU; memory-mapped ones are first copied into one of two
  pinned staging buffers (a ring: the next unit is staged while the current one's copy is
  in flight). The compute stream waits on an event, and every fetched tensor is
  ``record_stream``-ed on it, so the caching allocator never reuses memory still being read.

A fetch that fails in the background raises :class:`FetchError` in the caller, naming the
unit. When fetches happen (the next unit ahead of time) is :mod:`bigviz.engine.scheduler`'s.

Example:
    >>> import torch
    >>> from bigviz.engine.binding import bound_units
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> (unit,) = bound_units(model, {"0": "disk"}, main_device="cpu")
    >>> unit.sources = {k: {k: torch.ones(2)} for k in unit.slots}
    >>> sorted(CpuFetcher().start(unit, background=False).wait())
    ['0.bias', '0.weight']
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
from torch import Tensor

from bigviz.engine.binding import BoundUnit
from bigviz.engine.packed import PART, expand, packed_of, parts, rebuild
from bigviz.engine.weights import nbytes
from bigviz.modeling.packed import split

__all__ = ["FetchError", "Handle", "Fetcher", "CpuFetcher", "CudaFetcher"]

_ALIGN = 64  # bytes: every staged tensor starts on a cache-line boundary
_PLAIN = (Tensor, torch.nn.Parameter)


class FetchError(RuntimeError):
    """Reading an offloaded unit's weights failed (the cause is chained)."""


class Handle:
    """A fetch of one unit, done or in flight; :meth:`wait` gives key -> ready tensor."""

    def __init__(self, unit: BoundUnit, result: Future, *, device: torch.device | None = None) -> None:
        self.unit = unit
        self._result = result
        self._device = device  # CUDA only: whose current stream must wait for the copies

    def wait(self) -> dict[str, Tensor]:
        """The unit's tensors, ready to be used on the current stream.

        Raises:
            FetchError: the read failed (in the background or here), naming the unit.
        """
        try:
            result = self._result.result()
            _verify(self.unit)  # read ahead, maybe before a file changed: check it is unchanged now
        except Exception as exc:
            raise FetchError(
                f"fetching the weights of {self.unit.name!r} (offloaded to {self.unit.storage}) failed: {exc}"
            ) from exc
        if isinstance(result, tuple):  # CUDA: (tensors, event recorded after the copies)
            tensors, event = result
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(event)
            for tensor in tensors.values():
                tensor.record_stream(stream)  # freed only once the compute stream is done
            return tensors
        return result


class Fetcher(Protocol):
    def start(self, unit: BoundUnit, *, background: bool) -> Handle: ...

    def close(self) -> None: ...


def _run_now(fn: Any, *args: Any, **kwargs: Any) -> Future:
    """Run ``fn`` here, returning a finished Future: errors surface in ``Handle.wait`` as
    they do for background fetches, with the unit named."""
    future: Future = Future()
    try:
        future.set_result(fn(*args, **kwargs))
    except Exception as exc:
        future.set_exception(exc)
    return future


def _verify(unit: BoundUnit) -> None:
    """Check the files behind the unit's tensors are unchanged (one ``fstat`` per file), so a
    shard truncated between forwards is an error here, not a SIGBUS in the compute thread."""
    for store, keys in unit.keys_by_source():
        verify = getattr(store, "verify", None)
        if verify is not None:
            verify(keys)


def _read(store: Mapping[str, Tensor], key: str) -> Tensor:
    try:
        return store[key]
    except Exception as exc:
        raise FetchError(f"reading {key!r}: {type(exc).__name__}: {exc}") from exc


def _hint(store: Mapping[str, Tensor], keys: Sequence[str]) -> None:
    prefetch = getattr(store, "prefetch", None)
    if prefetch is not None:
        prefetch(keys)  # page-cache hint: the kernel reads ahead while we compute


class _Pages:
    """Page residency of CPU tensors, and reading them in (Linux: ``mincore``/``madvise``).

    ``populate`` (``madvise(MADV_POPULATE_READ)``) pulls a memory-mapped tensor from disk at
    full disk speed and maps it, so the compute thread later finds every page present. A
    hint alone (``posix_fadvise``/``madvise`` ``WILLNEED``) is a request the kernel serves
    when it likes: measured here, 1.5 s after hinting a cold 1.4 GB range, reading it still
    took 0.1 to 0.8 s; faulting it in page by page took 1.6 s; populating took 0.85 s.
    Both cost CPU even when every page is already there (85 ms per token for gpt2-large's
    18 disk blocks on 2 cores), so ``resident`` (``mincore``: 0.2 ms a block) is asked first.
    Elsewhere (or on kernels before 5.14) nothing is checked or populated; hints remain.
    """

    MADV_POPULATE_READ = 22

    def __init__(self) -> None:
        self._libc: Any = None
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            self._libc = libc

    @staticmethod
    def _span(tensor: Tensor) -> tuple[int, int]:
        start = tensor.data_ptr()
        aligned = start & ~(mmap.PAGESIZE - 1)
        return aligned, start + nbytes(tensor) - aligned

    def _usable(self, tensor: Tensor) -> bool:
        return self._libc is not None and tensor.device.type == "cpu" and tensor.numel() > 0

    def resident(self, tensor: Tensor) -> bool:
        """True if every page of ``tensor`` is in memory (unknown: False)."""
        if not self._usable(tensor):
            return tensor.device.type != "cpu" or tensor.numel() == 0 or tensor.is_pinned()
        address, length = self._span(tensor)
        status = ctypes.create_string_buffer((length + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
        if self._libc.mincore(address, length, status) != 0:
            return False
        return b"\x00" not in status.raw

    def populate(self, tensor: Tensor) -> None:
        """Read ``tensor``'s missing pages in now, in this thread."""
        if self._usable(tensor):
            address, length = self._span(tensor)
            if self._libc.madvise(address, length, self.MADV_POPULATE_READ) != 0:
                self._libc = None  # unsupported here (EINVAL before Linux 5.14): stop trying


_pages = _Pages()


def _page_in(store: Mapping[str, Tensor], tensors: Mapping[str, Tensor]) -> None:
    """Make the cold ones of ``tensors`` (read from ``store``) resident, from this thread."""
    flat = expand(tensors, {k: p for k, t in tensors.items() if (p := split(t)) is not None})  # packed: its parts
    cold = [key for key, tensor in flat.items() if not _pages.resident(tensor)]
    if cold:
        _hint(store, list(dict.fromkeys(key.split(PART)[0] for key in cold)))  # the kernel reads them all at once ...
        for key in cold:
            _pages.populate(flat[key])  # ... and this waits for (and maps) each in turn


def _cast(unit: BoundUnit, key: str, tensor: Tensor) -> Tensor:
    want = unit.dtypes.get(key)
    if want is None or tensor.dtype == want or (type(tensor) not in _PLAIN and split(tensor) is not None):
        return tensor  # (a packed weight has the dtype of its format: never cast)
    return tensor.to(want)


class CpuFetcher:
    """Zero-copy fetches for CPU execution, with page-in from a background thread.

    Args:
        device: The execution device. Not the CPU (``mps``): tensors are copied there,
            synchronously, as no stream API is shared with CUDA.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")
        self._executor: ThreadPoolExecutor | None = None

    def start(self, unit: BoundUnit, *, background: bool) -> Handle:
        if not background:
            return Handle(unit, _run_now(self._job, unit, hint=False))
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="bigviz-prefetch")
        return Handle(unit, self._executor.submit(self._job, unit, hint=True))

    def _job(self, unit: BoundUnit, *, hint: bool) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for store, keys in unit.keys_by_source():
            tensors = {key: _read(store, key) for key in keys}
            if hint:
                _page_in(store, tensors)  # disk reads happen here, not in the compute thread
            if self.device.type != "cpu":
                tensors = {key: tensor.to(self.device) for key, tensor in tensors.items()}
            out.update({key: _cast(unit, key, tensor) for key, tensor in tensors.items()})
        return out

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


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
            return Handle(unit, _run_now(self._job, unit), device=self.device)
        return Handle(unit, self._executor.submit(self._job, unit), device=self.device)

    def _job(self, unit: BoundUnit) -> tuple[dict[str, Tensor], Any]:
        out: dict[str, Tensor] = {}
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            slot, buffer, offset = None, None, 0
            try:
                for store, keys in unit.keys_by_source():
                    packs = {key: p for key in keys if (p := packed_of(store, key)) is not None}  # parts, unbuilt
                    plain = {key: _read(store, key) for key in keys if key not in packs}
                    packs |= {key: p for key, t in plain.items() if (p := split(t)) is not None}
                    sources = {k: t for k, t in plain.items() if k not in packs} | parts(packs)
                    _page_in(store, sources)  # read at disk speed, not page fault by page fault
                    moved = {}
                    for key, source in sources.items():
                        if not source.is_pinned():
                            if buffer is None:
                                slot, buffer = self._ring.acquire()
                            source, offset = _stage(source, buffer, offset)
                        moved[key] = source.to(self.device, non_blocking=True)
                    # a packed weight's parts go as they are; it is built (FP8: dequantized) on the GPU
                    out |= {key: _cast(unit, key, t) for key, t in rebuild(moved, packs).items()}
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
