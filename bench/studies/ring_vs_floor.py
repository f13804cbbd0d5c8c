"""Why does the ring read slower than the floor? (issue 26, 2026-12-02)

The larger-than-RAM bench's floor reads the streamed bytes with ``O_DIRECT`` in the ring's
order (16 MiB pieces in file order, 4 readers) into 8 slots of one 128 MiB buffer; the ring
reads the same pieces into a ring of 1.5 blocks (2.7 GB) while the model computes. In one run
the floor read at 2.1 GB/s and the ring at 1.2-1.5 GB/s. This study reads shards of the bench's
checkpoint (two shards at a time) the floor's way with one thing changed at a time:

* ``floor``: 8 slots of a 128 MiB buffer (the bench's floor);
* ``ring``: the same 8 in flight, but each piece at the next place of a 2.7 GB buffer touched
  once before (the ring's memory, walked through as the ring walks it);
* ``floor+compute`` and ``ring+compute``: the same, with a forward's kind of compute running
  beside the reads the whole time (16 tokens through a 400 MB weight on the 2 cores), whose
  speed is printed too;
* ``compute``: that compute alone, for 2 s.

Each round reads a different shard for each mode (the host caches part of the disk image, so
a second read of the same bytes may be faster), in a rotated order, page cache dropped before
each. Run as root, with the checkpoint of ``python bench/beyond_ram.py --build-only``::

    python bench/studies/ring_vs_floor.py --rounds 3        # about 4 minutes
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from bigviz.osio.direct import CHUNK, pieces_of, read_piece  # noqa: E402

RING = 2700 * 2**20
MODES = ("floor", "ring", "floor+compute", "ring+compute", "compute")


def read(paths: list[Path], *, buffer_bytes: int, readers: int = 4) -> float:
    """GB/s reading ``paths`` whole, one after the other, with ``O_DIRECT``, 16 MiB pieces in
    order, ``2 * readers`` in flight, each into the next place of a buffer of ``buffer_bytes``
    (touched first)."""
    buffer = mmap.mmap(-1, buffer_bytes)
    buffer.write(b"\1" * buffer_bytes)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    places = buffer_bytes // CHUNK
    ranges = [
        (path, at, min(CHUNK, size - at))
        for path in paths
        for size in [path.stat().st_size // 4096 * 4096]
        for at in range(0, size, CHUNK)
    ]
    futures: list[Any] = []
    try:
        with ThreadPoolExecutor(readers) as pool:
            start = time.perf_counter()
            for i, (path, at, length) in enumerate(ranges):
                if len(futures) >= 2 * readers:
                    futures[-2 * readers].result()
                (piece,) = pieces_of(str(path), at, length, base + i % places * CHUNK, direct=True)
                futures.append(pool.submit(read_piece, piece, True))
            for future in futures:
                future.result()
            return sum(length for _, _, length in ranges) / (time.perf_counter() - start) / 1e9
    finally:
        futures.clear()
        buffer.close()


class Compute(threading.Thread):
    """A GPT block's kind of compute, over and over until stopped: 16 tokens through a 400 MB
    float32 weight on 2 threads (memory-bound, as a forward of a few tokens is). ``rate``:
    weight bytes computed through per second."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.rate = 0.0

    def run(self) -> None:
        import torch

        torch.set_num_threads(2)
        weight, x = torch.randn(10240, 10240), torch.randn(16, 10240)
        x @ weight  # first touch before the clock
        done, start = 0, time.perf_counter()
        while not self.stop.is_set():
            x @ weight
            done += 1
        self.rate = done * weight.numel() * 4 / (time.perf_counter() - start)


def drop() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=HERE.parent / "_work" / "beyond-ram")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("ring_vs_floor.py drops the page cache: run it as root")
    shards = sorted(args.checkpoint.glob("*.safetensors"), key=lambda p: -p.stat().st_size)
    if len(shards) < 2 * (len(MODES) - 1) * args.rounds:
        sys.exit(
            f"{args.checkpoint}: {len(shards)} shards, {2 * (len(MODES) - 1) * args.rounds} needed (fewer --rounds)"
        )
    results: dict[str, list[str]] = {m: [] for m in MODES}
    n = 0
    for r in range(args.rounds):
        for k in range(len(MODES)):
            mode = MODES[(r + k) % len(MODES)]
            drop()
            compute = Compute() if "compute" in mode else None
            if compute:
                compute.start()
                time.sleep(0.5)
            if mode == "compute":  # alone, as long as a read takes
                time.sleep(2.0)
                speed = None
            else:
                pair, n = shards[n : n + 2], n + 2
                speed = read(pair, buffer_bytes=RING if mode.startswith("ring") else 8 * CHUNK)
            if compute:
                compute.stop.set()
                compute.join()
            cell = (f"read {speed:.2f}" if speed else "") + (" / " if speed and compute else "")
            cell += f"compute {compute.rate / 1e9:.1f}" if compute else ""
            results[mode].append(cell)
            print(f"round {r} {mode}: {cell} GB/s", file=sys.stderr, flush=True)
    print("| mode | GB/s, each round (read / compute: weight bytes per second) |\n|---|---|")
    for mode, cells in results.items():
        print(f"| {mode} | {', '.join(cells)} |")


if __name__ == "__main__":
    main()
