"""How fast does this machine hand a process memory it has not touched? (issue 26, 2026-12-02)

The first forward of a model larger than RAM makes its resident part (and the ring) out of
fresh anonymous memory. On a guest whose freed pages go back to the hypervisor (free page
reporting: ``page_reporting.page_reporting_order`` on the kernel command line, a
``virtio_balloon`` driver), a page touched for the first time since it was reported costs a
trip to the host. This study faults memory in with ``MADV_POPULATE_WRITE`` (no disk involved)
in three states and prints GiB/s:

* *cold*: the page cache dropped, then ``--wait`` seconds for the freed pages to be reported
  (what the bench's scenarios, and a user's first load, get);
* *just freed*: the same size touched, freed and touched again at once (pages the host still
  backs);
* each with 1 and 2 threads, with and without ``MADV_HUGEPAGE`` (transparent huge pages, where
  the kernel's setting is ``madvise``);
* with ``--file``: *page cache*, a cold file mapped and read in by ``MADV_POPULATE_READ`` (the
  host's I/O thread writes the pages), then every page read once by 2 threads (a ``sum``) and
  again (the same ``sum`` on pages already touched): does memory the host filled still cost the
  guest its first touch?

Each line also gives the CPU-seconds per GiB the process spent (all threads): on this VM the
trip to the host is CPU time of the guest's own cores, the cores a forward computes on.
With ``--since-drop``, how the rate falls in the seconds after a drop of the page cache, as the
freed pages are reported (2026-12-03, 4 GiB each: 2.52 GiB/s at once, 0.88 after 12 s,
0.52-0.53 after 30 and 60 s, the first 512 MiB of those at 1.7-1.8 and the rest 0.47-0.48).
(2026-12-03: 10.9 GB prefaulted and read into with ``O_DIRECT`` by 4 threads in 16.3 s with
28.8 CPU-seconds on 2 cores; a 1.8 GB shard populated in 1.8 s, then its first matmul took
5.0 s and the next 0.5-0.6 s.)

Run as root (it drops the page cache)::

    python bench/studies/fresh_memory.py --gib 4 --rounds 2     # about 3 minutes
    python bench/studies/fresh_memory.py --rounds 1 --file bench/_work/beyond-ram/model-00002-of-00019.safetensors
    python bench/studies/fresh_memory.py --since-drop 0,4,12,24,40,60 --fill bench/_work/beyond-ram
    python bench/studies/fresh_memory.py --in-use --wait 40 --gib 12   # a machine in use
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import sys
import threading
import time

GiB = 2**30
MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
PAGE = mmap.PAGESIZE
HUGE = 2 * 2**20

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def drop_page_cache() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def touch(size: int, *, threads: int, huge: bool) -> tuple[float, float]:
    """Seconds to fault ``size`` bytes of new anonymous memory in, ``threads`` at once, and the
    CPU-seconds the process spent on it."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    base = libc.mmap(None, size + HUGE, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if base in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    start = (base + HUGE - 1) // HUGE * HUGE
    try:
        if huge and libc.madvise(start, size, MADV_HUGEPAGE) != 0:
            raise OSError(ctypes.get_errno(), "MADV_HUGEPAGE refused")
        step = size // threads
        failed: list[int] = []

        def part(i: int) -> None:
            if libc.madvise(start + i * step, step, MADV_POPULATE_WRITE) != 0:
                failed.append(ctypes.get_errno())

        workers = [threading.Thread(target=part, args=(i,)) for i in range(threads)]
        began, cpu = time.perf_counter(), time.process_time()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
        if failed:
            raise OSError(failed[0], "MADV_POPULATE_WRITE failed (Linux 5.14+)")
        return seconds, cpu
    finally:
        libc.munmap(base, size + HUGE)


def touch_file(path: str) -> tuple[float, float, float, float, int]:
    """A cold file's pages read in by the host (``MADV_POPULATE_READ``), then touched by the
    guest: (populate seconds, first touch seconds, second touch seconds, first touch
    CPU-seconds, bytes)."""
    import torch

    torch.set_num_threads(2)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    size = len(mapped) // PAGE * PAGE
    view = torch.frombuffer(mapped, dtype=torch.uint8, count=size).view(torch.int32)
    began = time.perf_counter()
    if libc.madvise(view.data_ptr(), size, MADV_POPULATE_READ) != 0:
        raise OSError(ctypes.get_errno(), "MADV_POPULATE_READ failed (Linux 5.14+)")
    populated = time.perf_counter() - began
    times = []
    for _ in range(2):
        began, cpu = time.perf_counter(), time.process_time()
        view.sum()
        times.append((time.perf_counter() - began, time.process_time() - cpu))
    del view
    mapped.close()
    return populated, times[0][0], times[1][0], times[0][1], size


def curve(size: int, piece: int) -> list[tuple[float, float]]:
    """``size`` bytes faulted in by 2 threads, ``piece`` bytes at a time, every piece kept until
    the end: (seconds, CPU-seconds) of each, in order. Where the machine hands out the pages it
    still has warm first, the first pieces come fast and the rest at the cold rate."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    base = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if base in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    out = []
    try:
        for at in range(0, size - piece + 1, piece):
            half = piece // 2
            failed: list[int] = []

            def part(i: int, at: int = at, half: int = half) -> None:
                if libc.madvise(base + at + i * half, half, MADV_POPULATE_WRITE) != 0:
                    failed.append(ctypes.get_errno())

            workers = [threading.Thread(target=part, args=(i,)) for i in range(2)]
            began, cpu = time.perf_counter(), time.process_time()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            if failed:
                raise OSError(failed[0], "MADV_POPULATE_WRITE failed (Linux 5.14+)")
            out.append((time.perf_counter() - began, time.process_time() - cpu))
    finally:
        libc.munmap(base, size)
    return out


def fill_page_cache(folder: str, most: int = 16 * GiB) -> int:
    """Read the files of ``folder`` through the page cache, up to ``most`` bytes (so that the
    next drop frees about as much as a bench scenario's does); returns the bytes read."""
    total = 0
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and total < most:
            with open(path, "rb") as f:
                while chunk := f.read(64 * 2**20):
                    total += len(chunk)
    return total


def since_drop(waits: list[float], size: int, fill: str | None) -> None:
    """After each drop of the page cache (refilled from ``fill`` first), wait, then fault
    ``size`` bytes in, a piece of 512 MiB at a time, kept: how the rate falls as the freed
    pages are reported to the host, and how much still comes warm."""
    piece = 512 * 2**20
    print("| seconds after the drop | GiB/s, all | first 512 MiB | the rest | CPU-s per GiB |\n|---|---|---|---|---|")
    for wait in waits:
        if fill:
            fill_page_cache(fill)
        drop_page_cache()
        time.sleep(wait)
        parts = curve(size // piece * piece, piece)
        seconds, cpu = sum(p[0] for p in parts), sum(p[1] for p in parts)
        n = len(parts) * piece / GiB
        rest = sum(p[0] for p in parts[1:])
        print(
            f"| {wait:g} | {n / seconds:.2f} | {piece / GiB / parts[0][0]:.2f} | "
            f"{(n - piece / GiB) / rest:.2f} | {cpu / n:.2f} |",
            flush=True,
        )


def in_use(size: int, wait: float) -> None:
    """The page cache dropped, ``wait`` seconds, then the bench's filler read through the page
    cache (``bench/in_use.py``: the RAM less 2 GiB), then ``size`` bytes faulted in, 512 MiB at a
    time: the rate of memory the kernel reclaims from the page cache (a machine in use), the
    pages still free first."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from pathlib import Path

    import in_use as filler_file
    from beyond_ram import machine_ram

    path, _ = filler_file.prepare(Path(__file__).resolve().parents[1] / "_work", machine_ram())
    drop_page_cache()
    time.sleep(wait)
    done = filler_file.refill(path)
    piece = 512 * 2**20
    parts = curve(size // piece * piece, piece)
    seconds, cpu = sum(p[0] for p in parts), sum(p[1] for p in parts)
    n = len(parts) * piece / GiB
    print(
        f"| filler read in | GiB/s, all | slowest 512 MiB | CPU-s per GiB |\n|---|---|---|---|\n"
        f"| {done.nbytes / GiB:.1f} GiB in {done.seconds:.1f} s | {n / seconds:.2f} | "
        f"{piece / GiB / max(p[0] for p in parts):.2f} | {cpu / n:.2f} |\n"
        f"each 512 MiB, GiB/s: {' '.join(f'{piece / GiB / p[0]:.2f}' for p in parts)}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="memory faulted in per measurement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--wait", type=float, default=8.0, help="seconds after the drop (free page reporting)")
    parser.add_argument("--file", help="also: this file's pages read in by the host, then touched by the guest")
    parser.add_argument(
        "--since-drop",
        help="instead: comma-separated seconds to wait after a drop of the page cache, then the rate "
        "(first 512 MiB and the rest apart)",
    )
    parser.add_argument("--fill", help="with --since-drop: a folder read through the page cache before each drop")
    parser.add_argument(
        "--in-use",
        action="store_true",
        help="instead: after a drop and --wait seconds, the bench's filler read through the page cache, then "
        "--gib faulted in (memory reclaimed from the page cache, bench/in_use.py)",
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("fresh_memory.py drops the page cache: run it as root")
    size = int(args.gib * GiB) // HUGE * HUGE
    if args.in_use:
        in_use(size, args.wait)
        return
    if args.since_drop:
        since_drop([float(x) for x in args.since_drop.split(",")], size, args.fill)
        return
    print("| state | threads | huge pages | GiB/s | CPU-s per GiB |\n|---|---|---|---|---|")
    for _ in range(args.rounds):
        for huge in (False, True):
            for threads in (1, 2):
                drop_page_cache()
                time.sleep(args.wait)
                cold = touch(size, threads=threads, huge=huge)
                warm = touch(size, threads=threads, huge=huge)  # the pages just freed, at once
                for state, (seconds, cpu) in (("cold", cold), ("just freed", warm)):
                    print(
                        f"| {state} | {threads} | {'yes' if huge else 'no'} | {size / GiB / seconds:.2f} "
                        f"| {cpu / (size / GiB):.2f} |",
                        flush=True,
                    )
        if args.file:
            drop_page_cache()
            time.sleep(args.wait)
            populated, first, second, cpu, n = touch_file(args.file)
            print(
                f"| page cache: populated by the host | - | no | {n / GiB / populated:.2f} | - |\n"
                f"| page cache: first touch by the guest (sum, 2 threads) | 2 | no | {n / GiB / first:.2f} "
                f"| {cpu / (n / GiB):.2f} |\n"
                f"| page cache: second touch (sum, 2 threads) | 2 | no | {n / GiB / second:.2f} | - |",
                flush=True,
            )


if __name__ == "__main__":
    main()
