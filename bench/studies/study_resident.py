"""Study (issue 12, question a): how should "cpu" weights be made resident when the model
does not fit in the page cache?

    python bench/beyond_ram.py --build-only     # the checkpoint (kept in bench/_work/beyond-ram)
    python bench/studies/study_resident.py              # ~6 minutes; prints a markdown table

The first shards (execution order) up to ``--resident`` bytes (default: 2/3 of RAM, as
bench/beyond_ram.py's "auto" budget) are the resident part; the other shards stream. For each
way of making the resident part resident, in a fresh process with the page cache dropped:

1. make it resident (timed: wall and CPU seconds);
2. stream every other shard through the page cache once (4 buffered readers: what streaming
   that does not drop its pages does to the rest of memory);
3. check how much of the resident part is still in memory (``mincore``) and time reading
   all of it again (what the next forward pays for what was evicted).

Ways: ``fault`` (mmap, pages faulted in order by one thread: bigviz today), ``willneed``
(mmap + MADV_WILLNEED in 128 KiB steps, then faulted), ``populate`` (mmap +
MADV_POPULATE_READ, 4 threads), ``map_populate`` (mmap with MAP_POPULATE), ``mlock``
(MADV_POPULATE_READ with 4 threads, then mlock: locked file pages), ``anon_read`` (anonymous
memory, filled by 4 buffered readers: the page cache holds a second copy for a while),
``anon_direct`` (anonymous memory, 4 O_DIRECT readers: no page cache at all).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from study_common import (
    CHECKPOINT,
    GiB,
    MAP_POPULATE,
    Clock,
    Region,
    drop_all,
    gb,
    meminfo,  # noqa: E402
    note_load,
    proc_status,
    run_all,
    shards,
    split_resident,
)

from bigviz.checkpoint.probe import split_ranges, timed_read  # noqa: E402
from bigviz.osio.direct import ALIGN  # noqa: E402

METHODS = ["fault", "willneed", "populate", "map_populate", "mlock", "anon_read", "anon_direct"]
READERS = 4
CHUNK = 16 * 2**20


# ------------------------------------------------------------------------ making resident
def make_resident(method: str, files: list[Path]) -> list[Region]:
    if method.startswith("anon"):
        return _anonymous(files, direct=method == "anon_direct")
    flags = MAP_POPULATE if method == "map_populate" else 0
    regions = [Region.file(p, flags=flags) for p in files]
    if method == "fault":
        for r in regions:
            r.touch()
    elif method == "willneed":
        for r in regions:
            r.willneed()
        for r in regions:
            r.touch()
    elif method in ("populate", "mlock"):
        jobs = [
            lambda r=r, b=b: r.madvise(22, b, min(64 * 2**20, r.length - b))
            for r in regions
            for b in range(0, r.length, 64 * 2**20)
        ]
        run_all(jobs, READERS)  # MADV_POPULATE_READ, 64 MiB per call, 4 at a time
        if method == "mlock":
            for r in regions:
                r.mlock()
    return regions


def _anonymous(files: list[Path], *, direct: bool) -> list[Region]:
    """Each file read into its own anonymous mapping by READERS threads (preadv into place)."""
    regions = [Region(-(-p.stat().st_size // ALIGN) * ALIGN) for p in files]
    ranges = [(p, 0, p.stat().st_size) for p in files]
    targets = {p: r.buffer() for p, r in zip(files, regions)}
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = {p: os.open(p, flags) for p in files}
    try:
        run_all([lambda part=part: _read_into(part, fds, targets) for part in split_ranges(ranges, READERS)], READERS)
    finally:
        for fd in fds.values():
            os.close(fd)
    return regions


def _read_into(part: list[tuple[Path, int, int]], fds: dict[Path, int], targets: dict[Path, memoryview]) -> None:
    for path, offset, length in part:
        end = offset + length
        while offset < end:
            want = min(CHUNK, end - offset)
            n = os.preadv(fds[path], [targets[path][offset : offset + -(-want // ALIGN) * ALIGN]], offset)
            if n <= 0:
                break
            offset += n


# ------------------------------------------------------------------------------ child
def child(method: str, resident: list[Path], streamed: list[Path]) -> dict[str, Any]:
    base = proc_status()
    out: dict[str, Any] = {"method": method}
    with Clock() as made:
        regions = make_resident(method, resident)
    status = proc_status()
    out.update(
        make_s=made.wall,
        make_cpu_s=made.cpu,
        anon=status["RssAnon"] - base["RssAnon"],
        file=status["RssFile"] - base["RssFile"],
        locked=status.get("VmLck", 0),
        resident_before=_resident(regions),
        cached_after_make=meminfo("Cached")["Cached"],
    )
    timing = timed_read([(p, 0, p.stat().st_size) for p in streamed], readers=READERS, chunk_bytes=CHUNK)
    out.update(stream_s=timing.seconds, stream_gbps=timing.bandwidth / 1e9, resident_after=_resident(regions))
    with Clock() as again:
        for r in regions:
            r.touch()
    out.update(retouch_s=again.wall, anon_peak_kb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    for r in regions:
        r.close()
    return out


def _resident(regions: list[Region]) -> float:
    total = sum(r.length for r in regions)
    return sum(r.resident() * r.length for r in regions) / total


# ------------------------------------------------------------------------------ parent
def run(method: str, budget: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", method, "--resident", str(budget)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"method": method, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}
    return json.loads(lines[-1])


def report(rows: list[dict[str, Any]], resident: list[Path], streamed: list[Path], drop: str) -> str:
    size_r = sum(p.stat().st_size for p in resident)
    size_s = sum(p.stat().st_size for p in streamed)
    lines = [
        f"Resident part: {len(resident)} shards, {gb(size_r)}; streamed through the page cache after it: "
        f"{len(streamed)} shards, {gb(size_s)} (4 buffered readers). Page cache dropped ({drop}) before "
        "each way; each in a fresh process.",
        "",
        "| way | make resident | GB/s | CPU s | RssAnon | RssFile | locked | resident after streaming | "
        "stream GB/s | read it all again |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | failed: `{r['error']}` |||||||||")
            continue
        lines.append(
            f"| {r['method']} | {r['make_s']:.1f} s | {size_r / r['make_s'] / 1e9:.2f} | {r['make_cpu_s']:.1f} | "
            f"{r['anon'] / GiB:.1f} GiB | {r['file'] / GiB:.1f} GiB | {r['locked'] / GiB:.1f} GiB | "
            f"{r['resident_after']:.0%} (was {r['resident_before']:.0%}) | {r['stream_gbps']:.2f} | "
            f"{r['retouch_s']:.1f} s |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resident", type=int, help="bytes of the resident part (default: 2/3 of RAM)")
    parser.add_argument("--only", action="append", choices=METHODS)
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    budget = args.resident or beyond_ram_budget()
    resident, streamed = split_resident(shards(CHECKPOINT), budget)
    if args.child:
        print(json.dumps(child(args.child, resident, streamed)))
        return
    rows = []
    for method in args.only or METHODS:
        drop = drop_all(resident + streamed)
        print(f"  {method} (load {note_load()}) ...", file=sys.stderr, flush=True)
        rows.append(run(method, budget))
        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    print(report(rows, resident, streamed, drop))


def beyond_ram_budget() -> int:
    import psutil

    return psutil.virtual_memory().total * 2 // 3


if __name__ == "__main__":
    main()
