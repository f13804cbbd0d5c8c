"""Shared pieces of the bench/studies/study_*.py scripts (issue 12): mappings, residency, memory figures.

The studies run on the checkpoint `bench/beyond_ram.py --keep` leaves in bench/_work/beyond-ram
(a GPT larger than this machine's RAM, one shard per block). Helpers here wrap what Python
does not expose directly: ``mmap`` with ``madvise``/``mlock`` on a known address (ctypes),
``mincore`` residency of any mapping, the process's anonymous / file / locked memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import mmap
import os
import struct
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
sys.path.insert(0, str(BENCH))  # beyond_ram.py
sys.path.insert(0, str(BENCH.parent))  # bigviz from this checkout

import beyond_ram  # noqa: E402  (the checkpoint, page-cache drops, load average)

CHECKPOINT = BENCH / "_work" / "beyond-ram"
PAGE = mmap.PAGESIZE
GiB = 2**30
MADV_WILLNEED, MADV_DONTNEED, MADV_POPULATE_READ = 3, 4, 22
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
for _name in ("munmap", "mlock", "munlock"):
    getattr(_libc, _name).argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_LOW_BIT = bytes(b & 1 for b in range(256))


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


class Region:
    """A memory mapping (a file read-only, or anonymous memory) at a known address."""

    def __init__(self, length: int, path: Path | None = None, *, flags: int = 0) -> None:
        self.path, self.length = path, length
        fd = os.open(path, os.O_RDONLY) if path is not None else -1
        kind = mmap.MAP_SHARED if path is not None else mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        prot = mmap.PROT_READ if path is not None else mmap.PROT_READ | mmap.PROT_WRITE
        try:
            address = _libc.mmap(None, length, prot, kind | flags, fd, 0)
        finally:
            if fd >= 0:
                os.close(fd)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path or 'anonymous memory'} failed")
        self.address = address

    @classmethod
    def file(cls, path: Path, *, flags: int = 0) -> Region:
        return cls(path.stat().st_size, path, flags=flags)

    def madvise(self, advice: int, begin: int = 0, length: int | None = None) -> None:
        length = self.length - begin if length is None else length
        _check(_libc.madvise(self.address + begin, length, advice), f"madvise({advice})")

    def populate(self, *, threads: int = 1, chunk: int = 64 * 2**20) -> None:
        """MADV_POPULATE_READ: read in and map every page (``threads`` calls at once)."""
        spans = [(b, min(chunk, self.length - b)) for b in range(0, self.length, chunk)]
        run_all([lambda b=b, n=n: self.madvise(MADV_POPULATE_READ, b, n) for b, n in spans], threads)

    def willneed(self, *, chunk: int = 128 * 1024) -> None:
        """MADV_WILLNEED in 128 KiB steps (one call reads at most the read-ahead window)."""
        for begin in range(0, self.length, chunk):
            self.madvise(MADV_WILLNEED, begin, min(chunk, self.length - begin))

    def mlock(self) -> None:
        _check(_libc.mlock(self.address, self.length), "mlock")

    def munlock(self) -> None:
        _check(_libc.munlock(self.address, self.length), "munlock")

    def touch(self) -> int:
        """Read one byte of every page (page faults, in order, this thread); returns their sum."""
        import numpy as np

        view = np.ctypeslib.as_array((ctypes.c_uint8 * self.length).from_address(self.address))
        return int(view[::PAGE].sum())

    def resident(self) -> float:
        """Fraction of the pages in memory (mincore)."""
        status = ctypes.create_string_buffer(-(-self.length // PAGE))
        _check(_libc.mincore(self.address, self.length, status), "mincore")
        raw = status.raw.translate(_LOW_BIT)
        return raw.count(1) / len(raw)

    def buffer(self) -> memoryview:
        """A writable memoryview (anonymous mappings: a read target)."""
        return memoryview((ctypes.c_uint8 * self.length).from_address(self.address)).cast("B")

    def close(self) -> None:
        if self.address:
            _libc.munmap(self.address, self.length)
            self.address = 0


def run_all(jobs: Sequence[Callable[[], Any]], threads: int) -> list[Any]:
    if threads <= 1:
        return [job() for job in jobs]
    with ThreadPoolExecutor(threads) as pool:
        return [f.result() for f in [pool.submit(job) for job in jobs]]


def header(path: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """(offset of the data, name -> {dtype, shape, data_offsets}) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        doc = json.loads(f.read(n))
    doc.pop("__metadata__", None)
    return 8 + n, doc


def proc_status() -> dict[str, int]:
    """RssAnon, RssFile, VmLck of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("RssAnon", "RssFile", "VmLck", "VmRSS"):
                out[key] = int(line.split()[1]) * 1024
    return out


def meminfo(*keys: str) -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in keys:
                out[key] = int(line.split()[1]) * 1024
    return out


class Clock:
    """Wall and process CPU seconds of a block of code."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def shards(folder: Path = CHECKPOINT) -> list[Path]:
    files = beyond_ram.shard_files(folder)
    if not files:
        raise SystemExit(f"no checkpoint in {folder}: run `python bench/beyond_ram.py --keep` (or --build-only) first")
    return files


def split_resident(files: Sequence[Path], budget: int) -> tuple[list[Path], list[Path]]:
    """The first shards (execution order) that fit ``budget`` are resident; the rest stream."""
    resident, used = [], 0
    for i, path in enumerate(files):
        size = path.stat().st_size
        if used + size > budget and i > 0:
            return resident, list(files[i:])
        resident.append(path)
        used += size
    return resident, []


def drop(files: Sequence[Path]) -> None:
    """Evict these files' (unmapped) pages: the streamed part starts cold, the rest is untouched."""
    beyond_ram.drop_caches(list(files), "files")


def drop_all(files: Sequence[Path]) -> str:
    return beyond_ram.drop_caches(list(files), beyond_ram.drop_mode("auto", False))


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def note_load() -> str:
    return beyond_ram.load_average()
