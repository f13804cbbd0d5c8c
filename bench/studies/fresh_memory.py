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
  the kernel's setting is ``madvise``).

Run as root (it drops the page cache)::

    python bench/studies/fresh_memory.py --gib 4 --rounds 2     # about 3 minutes
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
MADV_POPULATE_WRITE = 23
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


def touch(size: int, *, threads: int, huge: bool) -> float:
    """Seconds to fault ``size`` bytes of new anonymous memory in, ``threads`` at once."""
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
        began = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        seconds = time.perf_counter() - began
        if failed:
            raise OSError(failed[0], "MADV_POPULATE_WRITE failed (Linux 5.14+)")
        return seconds
    finally:
        libc.munmap(base, size + HUGE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="memory faulted in per measurement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--wait", type=float, default=8.0, help="seconds after the drop (free page reporting)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("fresh_memory.py drops the page cache: run it as root")
    size = int(args.gib * GiB) // HUGE * HUGE
    print("| state | threads | huge pages | GiB/s |\n|---|---|---|---|")
    for _ in range(args.rounds):
        for huge in (False, True):
            for threads in (1, 2):
                drop_page_cache()
                time.sleep(args.wait)
                cold = touch(size, threads=threads, huge=huge)
                warm = touch(size, threads=threads, huge=huge)  # the pages just freed, at once
                for state, seconds in (("cold", cold), ("just freed", warm)):
                    print(
                        f"| {state} | {threads} | {'yes' if huge else 'no'} | {size / GiB / seconds:.2f} |", flush=True
                    )


if __name__ == "__main__":
    main()
