"""How fast ``O_DIRECT`` reads into memory depending on how that memory was first touched.

    python bench/studies/direct_into.py                  # shards of bench/_work/beyond-ram (or --files)
    python bench/studies/direct_into.py --rounds 2

Three buffers of one shard's size, made once, each read into in turn (one file each, page cache
dropped before each read, 4 threads, 16 MiB pieces: as bigviz's ring reads):

- ``two-threads``: a tensor filled by torch with two threads before the reads (its pages were
  faulted in by two threads at once, interleaved);
- ``one-thread``: the same, filled with one thread;
- ``by-reads``: never touched before the first read (the reads fault its pages in, piece by
  piece, as they do the ring's).

It prints each read's speed and CPU time. On this project's 2-core VM (2026-12-02, 1.7 GB
reads, alternating): ``two-threads`` 1.48-1.50 GB/s, ``one-thread`` 1.97-2.14 GB/s,
``by-reads`` 2.09-2.14 GB/s after its first read (which pays the first touch, 0.7 s of CPU).
The likely cause: pages faulted in by one thread at a time are physically contiguous in long
runs, so each request goes to the disk in fewer, larger segments. bigviz's ring is touched
first by its own reads (the fast case); a buffer filled or zeroed by torch's threads before
``O_DIRECT`` reads into it would be the slow one. Needs root to drop the page cache.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bigviz.osio.direct import ALIGN, pieces_of, read_piece  # noqa: E402

WORK = Path(__file__).resolve().parents[1] / "_work" / "beyond-ram"


def _buffer(size: int, threads: int | None) -> tuple[torch.Tensor, int]:
    """A tensor of ``size`` bytes (and an aligned address in it), filled by ``threads`` threads
    first (``None``: left untouched)."""
    tensor = torch.empty(size + ALIGN, dtype=torch.uint8)
    if threads is not None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        tensor.fill_(1)
        torch.set_num_threads(before)
    return tensor, tensor.data_ptr() + (-tensor.data_ptr() % ALIGN)


def _read(path: Path, size: int, address: int, pool: ThreadPoolExecutor) -> tuple[float, float]:
    """(seconds, CPU seconds of this process) of reading ``size`` bytes of ``path`` cold."""
    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=False)
    start, cpu = time.perf_counter(), time.process_time()
    for future in [pool.submit(read_piece, p, True) for p in pieces_of(path, 0, size, address, direct=True)]:
        future.result()
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--files", nargs="*", type=Path, help="large files to read (default: the bench's shards)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    files = args.files or sorted(WORK.glob("*.safetensors"))[1:]
    if not files:
        raise SystemExit(f"no files: pass --files, or build the bench's checkpoint ({WORK})")
    if os.geteuid() != 0:
        print("warning: not root, the page cache is not dropped: the reads may be warm", file=sys.stderr)
    size = min(p.stat().st_size for p in files) // ALIGN * ALIGN
    buffers = {"two-threads": _buffer(size, 2), "one-thread": _buffer(size, 1), "by-reads": _buffer(size, None)}
    with ThreadPoolExecutor(4) as pool:
        step = 0
        for _ in range(args.rounds):
            for name, (_, address) in buffers.items():
                path = files[step % len(files)]  # another file each time: none read just before
                step += 1
                seconds, cpu = _read(path, size, address, pool)
                print(f"{name:12s} {size / seconds / 1e9:.2f} GB/s  {seconds:.2f} s  CPU {cpu:.2f} s  ({path.name})")


if __name__ == "__main__":
    main()
