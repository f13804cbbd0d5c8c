"""Why disk units are streamed into reused O_DIRECT buffers, not through the page cache.

    python bench/studies/stream_touch.py                    # shards of bench/_work/beyond-ram (or --files)
    python bench/studies/stream_touch.py --files a.safetensors b.safetensors --rounds 2

For each large file, alternately, read cold by 4 threads in 16 MiB pieces:

- ``cache``: the file memory-mapped and each piece read into the page cache with
  ``madvise(MADV_POPULATE_READ)`` (bigviz's ``StreamingFetcher``, ``stream="cache"``), pages
  dropped afterwards;
- ``slot``: each piece read with ``O_DIRECT`` into one buffer allocated once and reused
  (as bigviz's ``RingFetcher``, the default, reads into its ring).

It prints the read speed, the CPU time the whole machine spent during the read (``/proc/stat``
user + system ticks), and how long a first and a second pass over the bytes take (a numpy sum:
what a forward does to its weights). On a machine where fresh memory is cheap the two passes
cost the same; on a virtual machine whose freed pages return to the hypervisor the first pass
over fresh page-cache pages pays a fault per page. Needs root to drop the page cache between
files (else it warns: the figures are then warm reads).
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bigviz.osio.pages import drop_file_pages, populate, prefault  # noqa: E402

PIECE = 16 * 2**20


def _ticks() -> int:
    with open("/proc/stat") as f:
        return sum(int(x) for x in f.readline().split()[1:4])


def _cache(path: Path, pool: ThreadPoolExecutor) -> np.ndarray:
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    os.close(fd)
    arr = np.frombuffer(m, dtype=np.uint8)
    base = arr.ctypes.data
    list(pool.map(lambda o: populate(base + o, min(PIECE, size - o)), range(0, size, PIECE)))
    return arr


def _slot(path: Path, pool: ThreadPoolExecutor, slot: mmap.mmap) -> np.ndarray:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    size = os.fstat(fd).st_size

    def one(offset: int) -> int:
        n = -(-min(PIECE, size - offset) // 4096) * 4096
        return os.preadv(fd, [memoryview(slot)[offset : offset + n]], offset)

    try:
        list(pool.map(one, range(0, size, PIECE)))
    finally:
        os.close(fd)
    return np.frombuffer(slot, dtype=np.uint8)[:size]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", nargs="*", type=Path)
    parser.add_argument("--rounds", type=int, default=3, help="cache/slot pairs (each on new files)")
    args = parser.parse_args()
    files = (
        args.files or sorted((Path(__file__).resolve().parents[1] / "_work" / "beyond-ram").glob("*.safetensors"))[1:]
    )
    if len(files) < 2:
        sys.exit("stream_touch: no large files: run bench/beyond_ram.py --build-only first, or pass --files")
    if os.geteuid() != 0:
        print("warning: not root: the page cache cannot be dropped, reads may be warm", file=sys.stderr)
    biggest = max(f.stat().st_size for f in files)
    slot = mmap.mmap(-1, biggest + 4096)
    prefault(np.frombuffer(slot, dtype=np.uint8).ctypes.data, len(slot))
    print(f"{'how':6} {'file':34} {'GB/s':>5} {'cpu ticks':>9} {'1st pass s':>10} {'2nd pass s':>10}")
    with ThreadPoolExecutor(4) as pool:
        for i in range(min(2 * args.rounds, len(files))):
            how, path = ("cache", "slot")[i % 2], files[i]
            os.sync()
            drop_file_pages(path)
            t, c = time.perf_counter(), _ticks()
            arr = _cache(path, pool) if how == "cache" else _slot(path, pool, slot)
            read, ticks = time.perf_counter() - t, _ticks() - c
            view = arr[: len(arr) // 4 * 4].view(np.float32)
            passes = []
            for _ in range(2):
                t = time.perf_counter()
                view.sum()
                passes.append(time.perf_counter() - t)
            print(f"{how:6} {path.name:34} {len(arr) / read / 1e9:5.2f} {ticks:9d} {passes[0]:10.3f} {passes[1]:10.3f}")
            del view, arr
            drop_file_pages(path)


if __name__ == "__main__":
    main()
