"""Study (issue 12, question b): how should disk units be streamed past a resident part?

    python bench/beyond_ram.py --build-only     # the checkpoint (kept in bench/_work/beyond-ram)
    python bench/studies/study_streaming.py             # ~10 minutes; prints a markdown table

The first shards up to 2/3 of RAM are the resident part, kept as bigviz keeps "cpu" weights
today: memory-mapped and read in (file pages, evictable). The other shards (one block each)
are the streamed units; each way below streams all of them once, in order, with the resident
part fully in memory at the start and the streamed shards cold. Measured: wall time and
bandwidth, CPU seconds of the process (all threads), how much of the resident part survives
(``mincore``), and how much the page cache grew.

Ways, with ``k`` readers per unit and ``d`` units read ahead of the one in use (``d + 1``
reusable buffers of one unit each):

- ``mmap_fault``: map the unit, fault its pages in order, unmap (no read-ahead: bigviz with
  prefetch off);
- ``mmap_populate``: a background thread reads the next unit in (MADV_WILLNEED, then
  MADV_POPULATE_READ) while this one is used (bigviz's CpuFetcher today);
- ``mmap_populate_dontneed``: the same, then ``posix_fadvise(DONTNEED)`` on the unit once used;
- ``buffered``: ``preadv`` into the buffers through the page cache, pages left there;
- ``buffered_dontneed``: the same, then ``posix_fadvise(DONTNEED)`` on the unit once used;
- ``direct``: ``O_DIRECT`` ``preadv`` into page-aligned buffers (no page cache at all).

The disk drifts over minutes: ``direct k=4 d=1`` runs first and last as a reference.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from study_common import (
    CHECKPOINT,
    GiB,
    Clock,
    Region,
    drop,
    drop_all,
    gb,
    meminfo,
    note_load,  # noqa: E402
    shards,
    split_resident,
)

from bigviz.checkpoint.probe import split_ranges  # noqa: E402
from bigviz.osio.direct import ALIGN  # noqa: E402

CHUNK = 16 * 2**20


@dataclass(frozen=True)
class Way:
    name: str
    readers: int = 1
    depth: int = 1
    chunk: int = CHUNK

    @property
    def label(self) -> str:
        if self.name.startswith("mmap"):
            return self.name
        mib = "" if self.chunk == CHUNK else f", {self.chunk >> 20} MiB requests"
        return f"{self.name} k={self.readers} d={self.depth}{mib}"


GRID = [
    Way("direct", 4, 1),
    Way("mmap_fault", 1, 0),
    Way("mmap_populate"),
    Way("mmap_populate_dontneed"),
    Way("buffered", 4, 1),
    Way("buffered_dontneed", 1, 1),
    Way("buffered_dontneed", 4, 1),
    Way("buffered_dontneed", 8, 1),
    Way("buffered_dontneed", 4, 2),
    Way("direct", 1, 1),
    Way("direct", 2, 1),
    Way("direct", 8, 1),
    Way("direct", 16, 1),
    Way("direct", 8, 2),
    Way("direct", 8, 1, 4 * 2**20),
    Way("direct", 4, 1),
]


# ------------------------------------------------------------------------ buffered / direct
class Pipeline:
    """Units read by ``k`` readers each into ``d + 1`` reusable buffers, ``d`` units ahead."""

    def __init__(self, units: list[Path], way: Way) -> None:
        self.units, self.way = units, way
        size = max(-(-p.stat().st_size // ALIGN) * ALIGN for p in units)
        self.buffers = [Region(size) for _ in range(way.depth + 1)]
        for b in self.buffers:  # fault the buffers in once: they are reused, as a fetcher would
            b.buffer()[::4096] = bytes(len(range(0, b.length, 4096)))
        self.pool = ThreadPoolExecutor(way.readers * max(1, way.depth))
        flags = os.O_RDONLY | (os.O_DIRECT if way.name == "direct" else 0)
        self.fds = [os.open(p, flags) for p in units]

    def start(self, i: int) -> list[Future]:
        target = self.buffers[i % len(self.buffers)].buffer()
        parts = split_ranges([(self.units[i], 0, self.units[i].stat().st_size)], self.way.readers)
        return [self.pool.submit(self._read, self.fds[i], target, part) for part in parts]

    def _read(self, fd: int, target: memoryview, part: list[tuple[Path, int, int]]) -> None:
        for _, offset, length in part:
            end = offset + length
            while offset < end:
                want = min(self.way.chunk, end - offset)
                n = os.preadv(fd, [target[offset : offset + -(-want // ALIGN) * ALIGN]], offset)
                if n <= 0:
                    break
                offset += n

    def run(self, use: Callable[[int, memoryview], None] | None = None) -> None:
        pending = {i: self.start(i) for i in range(min(self.way.depth + 1, len(self.units)))}
        for i in range(len(self.units)):
            for f in pending.pop(i):
                f.result()
            if use is not None:
                use(i, self.buffers[i % len(self.buffers)].buffer())
            if self.way.name == "buffered_dontneed":
                os.posix_fadvise(self.fds[i], 0, 0, os.POSIX_FADV_DONTNEED)
            nxt = i + self.way.depth + 1
            if nxt < len(self.units):
                pending[nxt] = self.start(nxt)

    def close(self) -> None:
        self.pool.shutdown()
        for fd in self.fds:
            os.close(fd)
        for b in self.buffers:
            b.close()


# ------------------------------------------------------------------------------ mmap
def stream_mmap(units: list[Path], way: Way) -> None:
    if way.name == "mmap_fault":
        for p in units:
            region = Region.file(p)
            region.touch()
            region.close()
        return
    worker = ThreadPoolExecutor(1)
    regions = [Region.file(p) for p in units]

    def page_in(r: Region) -> None:
        r.willneed()
        r.populate()

    ahead = worker.submit(page_in, regions[0])
    for i, region in enumerate(regions):
        ahead.result()
        if i + 1 < len(regions):
            ahead = worker.submit(page_in, regions[i + 1])
        region.touch()
        region.close()
        if way.name == "mmap_populate_dontneed":
            fd = os.open(units[i], os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    worker.shutdown()


def stream(units: list[Path], way: Way) -> None:
    if way.name.startswith("mmap"):
        stream_mmap(units, way)
        return
    pipeline = Pipeline(units, way)
    try:
        pipeline.run()
    finally:
        pipeline.close()


# --------------------------------------------------------------------------- measure
def measure(way: Way, resident: list[Region], streamed: list[Path]) -> dict[str, Any]:
    for r in resident:  # the resident part fully in memory again (reads only what was evicted)
        r.populate(threads=4)
    drop(streamed)
    cached = meminfo("Cached")["Cached"]
    with Clock() as clock:
        stream(streamed, way)
    total = sum(p.stat().st_size for p in streamed)
    return {
        "way": way.label,
        "seconds": clock.wall,
        "gbps": total / clock.wall / 1e9,
        "cpu": clock.cpu,
        "survived": sum(r.resident() * r.length for r in resident) / sum(r.length for r in resident),
        "cache_growth": meminfo("Cached")["Cached"] - cached,
        "load": note_load(),
    }


def report(rows: list[dict[str, Any]], resident: list[Path], streamed: list[Path], drop_note: str) -> str:
    lines = [
        f"Resident part: {len(resident)} shards, {gb(sum(p.stat().st_size for p in resident))} (mapped, read in); "
        f"streamed: {len(streamed)} shards of one block, {gb(sum(p.stat().st_size for p in streamed))}, "
        f"cold. Page cache dropped ({drop_note}) once at the start.",
        "",
        "| way | time | GB/s | CPU s | resident part still in memory | page cache growth | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['way']} | {r['seconds']:.1f} s | {r['gbps']:.2f} | {r['cpu']:.1f} | {r['survived']:.0%} | "
            f"{r['cache_growth'] / GiB:+.1f} GiB | {r['load']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resident", type=int, help="bytes of the resident part (default: 2/3 of RAM)")
    parser.add_argument("--quick", action="store_true", help="the reference and three ways only")
    args = parser.parse_args()
    import psutil

    files = shards(CHECKPOINT)
    resident_files, streamed = split_resident(files, args.resident or psutil.virtual_memory().total * 2 // 3)
    drop_note = drop_all(files)
    resident = [Region.file(p) for p in resident_files]
    grid = GRID if not args.quick else [GRID[0], GRID[2], GRID[6], GRID[-1]]
    rows = []
    for way in grid:
        rows.append(measure(way, resident, streamed))
        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    print(report(rows, resident_files, streamed, drop_note))
    for r in resident:
        r.close()


if __name__ == "__main__":
    main()
