"""Do reads into transparent huge pages reach the disk faster? (issue 26, 2026-12-03)

A virtio disk takes at most ``max_segments`` physical runs per request (254 here). Memory of
4 KiB pages gives a 16 MiB ``O_DIRECT`` read one run per page unless the pages happen to lie
side by side, so the kernel cuts it into requests of about 1 MiB; 2 MiB huge pages are runs of
2 MiB, and a request can reach the device's largest (``max_sectors_kb``, 4 MiB here). This
study reads two shards of the bench's checkpoint at a time, 16 MiB pieces by 4 threads with
``O_DIRECT``, page cache dropped before each, alternating:

* ``reused``: into a 512 MiB buffer made and touched once (what the ring does every forward),
  of 4 KiB pages (``4k``) or with ``MADV_HUGEPAGE`` (``huge``): GB/s and system CPU per GB;
* ``fresh``: two shards into memory never touched, each piece faulted in
  (``MADV_POPULATE_WRITE``) just before its read (what the resident copy does once), with
  4 KiB or huge pages: GB/s and the faulting threads' seconds.

Run as root (it drops the page cache), with the checkpoint of ``python bench/beyond_ram.py
--build-only``::

    python bench/studies/huge_pages.py --rounds 2     # about 2 minutes
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from bigviz.osio.direct import CHUNK  # noqa: E402
from bigviz.osio.pages import huge_anonymous, prefault  # noqa: E402

CHECKPOINT = HERE.parent / "_work" / "beyond-ram"
REUSED = 512 * 2**20


def drop() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    time.sleep(3)  # the freed pages go back to the host (free page reporting) as on a real first touch


def jobs_of(paths: list[Path]) -> list[tuple[Path, int, int]]:
    out = []
    for path in paths:
        size = path.stat().st_size // 4096 * 4096
        out += [(path, at, min(CHUNK, size - at)) for at in range(0, size, CHUNK)]
    return out


def buffer(nbytes: int, huge: bool) -> tuple[mmap.mmap, int]:
    """Private anonymous memory from a huge-page boundary, huge pages asked for or not."""
    if huge:
        block, skip = huge_anonymous(nbytes)
    else:
        block, skip = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), 0
    return block, ctypes.addressof(ctypes.c_char.from_buffer(block)) + skip


def read(job: tuple[Path, int, int], address: int) -> None:
    path, at, length = job
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        os.preadv(fd, [memoryview((ctypes.c_char * length).from_address(address)).cast("B")], at)
    finally:
        os.close(fd)


def reused(paths: list[Path], huge: bool) -> str:
    block, address = buffer(REUSED, huge)
    ctypes.memset(address, 1, REUSED)  # made once, by one thread
    jobs = jobs_of(paths)
    drop()
    cpu, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: read(jobs[i], address + i % (REUSED // CHUNK) * CHUNK), range(len(jobs))))
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    block.close()
    nbytes = sum(j[2] for j in jobs)
    return (
        f"{nbytes / seconds / 1e9:.2f} GB/s, {(after.ru_stime - cpu.ru_stime) / (nbytes / 1e9):.3f} system CPU-s per GB"
    )


def fresh(paths: list[Path], huge: bool) -> str:
    jobs = jobs_of(paths)
    nbytes = sum(j[2] for j in jobs)
    drop()
    block, address = buffer(nbytes, huge)
    places = [address + sum(j[2] for j in jobs[:i]) for i in range(len(jobs))]
    faulting = [0.0]

    def one(i: int) -> None:
        t = time.perf_counter()
        prefault(places[i], jobs[i][2])
        faulting[0] += time.perf_counter() - t
        read(jobs[i], places[i])

    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(len(jobs))))
    seconds = time.perf_counter() - start
    block.close()
    return f"{nbytes / seconds / 1e9:.2f} GB/s, faulting {faulting[0]:.1f} thread-s for {nbytes / 1e9:.1f} GB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=CHECKPOINT)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    shards = sorted(args.checkpoint.glob("*.safetensors"))
    queue = iter(shards[1:])  # a different pair of shards for every line (the host caches what it read)
    print("| round | memory | pages | result |\n|---|---|---|---|")
    for round_ in range(args.rounds):
        order = [False, True] if round_ % 2 == 0 else [True, False]
        for kind, fn, count in (("reused", reused, 2), ("fresh", fresh, 2)):
            for huge in order:
                paths = [next(queue, None) for _ in range(count)]
                if None in paths:
                    print("(out of shards: a larger checkpoint or fewer rounds)")
                    return
                line = fn(paths, huge)  # type: ignore[arg-type]
                print(f"| {round_ + 1} | {kind} | {'huge' if huge else '4 KiB'} | {line} |", flush=True)


if __name__ == "__main__":
    main()
