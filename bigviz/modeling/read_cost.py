"""What the disk's reads take from compute: seconds of compute lost per byte read beside it.

A streamed forward reads from disk while it computes. On a machine whose reads are not free
to the cores that compute (a virtual machine: the host copies every byte into the guest's
memory and shares the cores, and the copy shares the memory bandwidth the matrix products
need) the compute runs slower while the disk reads: on this project's 2-core VM the blocks of
a 32.1 GB GPT computed 1.2x slower than with the disk idle while 15 GB streamed beside them
(issue 26), so a split where compute sets the pace ran 1.2x its compute floor with compute
never waiting on a read. The cost model (:mod:`bigviz.core.cost`) counts this as
``MachineFacts.read_cost``: each streamed byte adds ``read_cost`` seconds to the compute.

Measured here, as the compute rate is (:mod:`bigviz.modeling.compute_rate`), on one block in
RAM: ``repeat`` forwards timed alone, then ``repeat`` more while ``readers`` threads read
``files`` with ``O_DIRECT`` as the ring does (16 MiB pieces, huge pages); the median forward
beside the reads minus the median forward alone, divided by the bytes read per forward. Medians
on both sides: the best alone against the mean beside (as first written) counted this shared
machine's minute-to-minute noise as a cost of the reads, 0.04-0.20 s per GB in five runs of
2026-12-03. Nothing in torch or the kernel reports it; it is a property of the machine, so it
is measured on it.

Example:
    >>> import os, tempfile, torch
    >>> path = os.path.join(tempfile.mkdtemp(), "blob.bin")
    >>> _ = open(path, "wb").write(os.urandom(8 * 2**20))
    >>> block = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    >>> measure_read_cost(block, torch.randn(1, 16, 256), files=[path], repeat=3) >= 0
    True
"""

from __future__ import annotations

import ctypes
import os
import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from bigviz.core.errors import UsageError
from bigviz.osio.direct import CHUNK, pieces_of, read_piece
from bigviz.osio.pages import huge_anonymous

__all__ = ["measure_read_cost"]


def measure_read_cost(
    module: nn.Module,
    *args: Any,
    files: Sequence[str | os.PathLike[str]],
    readers: int = 4,
    repeat: int = 5,
    **kwargs: Any,
) -> float:
    """Seconds of ``module``'s compute lost per byte read beside it: ``MachineFacts.read_cost``
    for runs of the same tokens and threads (0.0 where reads cost compute nothing).

    Args:
        module, args, kwargs: one block in RAM and its inputs, as for
            :func:`~bigviz.modeling.compute_rate.measure_compute_rate`.
        files: files to read beside the forwards (the checkpoint's shards), round and round
            until ``repeat`` forwards are done; their bytes are never kept.
        readers: threads reading, as the ring's.
        repeat: forwards timed alone, and as many beside the reads (the median of each).

    Raises:
        UsageError: no file, an empty one, ``readers`` or ``repeat`` below 1.
        OSError: a file cannot be read.
    """
    if readers < 1 or repeat < 1:
        raise UsageError(f"measure_read_cost: readers={readers!r} and repeat={repeat!r} must be >= 1")
    sizes = [(str(f), os.path.getsize(f)) for f in files]
    if not sizes or not all(n for _, n in sizes):
        raise UsageError(
            f"measure_read_cost: files={[str(f) for f in files]!r}: give at least one non-empty file to read "
            "beside the forwards (the checkpoint's shards)"
        )
    with torch.no_grad():
        module(*args, **kwargs)  # warm-up: first-call allocations and kernel choice
        alone = statistics.median(_timed(module, args, kwargs) for _ in range(repeat))
        reading = _Reading(sizes, readers)
        try:
            reading.start()
            reading.wait_for_first()
            windows = [_window(module, args, kwargs) for _ in range(repeat)]
        finally:
            reading.stop()
    beside = statistics.median(b - a for a, b in windows)
    per_forward = reading.bytes_between(windows[0][0], windows[-1][1]) / repeat
    return max(0.0, beside - alone) / per_forward if per_forward else 0.0


def _window(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, float]:
    start = time.perf_counter()
    module(*args, **kwargs)
    return start, time.perf_counter()


def _timed(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    start, end = _window(module, args, kwargs)
    return end - start


class _Reading:
    """``readers`` threads reading ``sizes`` (path, bytes) with ``O_DIRECT`` (buffered where
    refused), 16 MiB pieces in file order, round and round, until :meth:`stop`; each piece's
    end time and bytes recorded."""

    def __init__(self, sizes: Sequence[tuple[str, int]], readers: int) -> None:
        self.sizes, self.readers = sizes, readers
        self.done: list[tuple[float, float, int]] = []  # (start, end, bytes) of each piece read
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._first = threading.Event()
        self._lock = threading.Lock()
        self._next = 0
        self._pieces = [(path, at, min(CHUNK, n - at)) for path, n in sizes for at in range(0, n, CHUNK)]
        self._buffer, skip = huge_anonymous(readers * CHUNK)
        self._buffer.write(b"\1" * len(self._buffer))  # touched before: the reads time the disk, not new memory
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._buffer)) + skip
        self._pool = ThreadPoolExecutor(readers, thread_name_prefix="bigviz-read-cost")

    def start(self) -> None:
        for slot in range(self.readers):
            self._pool.submit(self._loop, self._base + slot * CHUNK)

    def _take(self) -> tuple[str, int, int]:
        with self._lock:
            piece = self._pieces[self._next % len(self._pieces)]
            self._next += 1
            return piece

    def _loop(self, address: int) -> None:
        try:
            while not self._stop.is_set():
                path, offset, length = self._take()
                (piece,) = pieces_of(path, offset, length, address, direct=True)
                start = time.perf_counter()
                need, _ = read_piece(piece, True)
                with self._lock:
                    self.done.append((start, time.perf_counter(), need))
                self._first.set()
        except BaseException as err:  # raised by stop()
            self.error = err
            self._first.set()

    def wait_for_first(self) -> None:
        self._first.wait()
        if self.error is not None:
            raise self.error

    def bytes_between(self, begin: float, end: float) -> float:
        """Bytes read in ``[begin, end]``: each piece's share of its own time inside it."""
        total = 0.0
        with self._lock:
            for a, b, n in self.done:
                inside = min(b, end) - max(a, begin)
                if inside > 0:
                    total += n * inside / max(b - a, 1e-9)
        return total

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True)
        self._buffer.close()
        if self.error is not None:
            raise self.error
