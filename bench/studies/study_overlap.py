"""Study (issue 12, question c): does compute overlap with reads on 2 cores?

    python bench/beyond_ram.py --build-only     # the checkpoint (kept in bench/_work/beyond-ram)
    python bench/studies/study_overlap.py               # ~10 minutes; prints a markdown table

Streams ``--units`` block shards (in order) with the reader of bench/studies/study_streaming.py
(``--reader direct`` or ``buffered_dontneed``, ``k`` readers per unit, ``d`` units ahead) and
runs each block's real forward (bigviz GPT ``Block``, ``--tokens`` tokens) on its weights as
zero-copy views into the read buffer, the way an engine with reusable buffers would. For each
token count:

- read only (the pipeline, no compute);
- compute only (one unit's weights, already read, computed ``units`` times);
- read then compute, unit by unit (no overlap);
- overlapped (reads ``d`` units ahead), torch with 2 threads and with 1 thread.

Each figure is taken ``--repeat`` times, interleaved, and the best kept (on a shared machine
noise only adds time).

Overlap efficiency = (read + compute - overlapped) / min(read, compute): 1 when the shorter
one is hidden entirely, 0 when nothing is. The compute's own slowdown while reads run (CPU
taken by the readers and the kernel) is reported too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from study_common import CHECKPOINT, drop, drop_all, header, note_load, shards  # noqa: E402
from study_streaming import Pipeline, Way  # noqa: E402


def block_and_views(config: Any, unit: Path) -> tuple[Any, Any]:
    """A meta Block, and a function: buffer -> {param name: tensor view into the buffer}."""
    import torch

    from bigviz.models.gpt import Block

    with torch.device("meta"):
        block = Block(config, 0).eval()
    data_start, doc = header(unit)
    prefix = ".".join(next(iter(doc)).split(".")[:3]) + "."  # "transformer.h.<i>."

    def views(buffer: memoryview) -> dict[str, Any]:
        out = {}
        for name, info in doc.items():
            begin, end = info["data_offsets"]
            t = torch.frombuffer(buffer, dtype=torch.float32, count=(end - begin) // 4, offset=data_start + begin)
            out[name.removeprefix(prefix)] = t.view(info["shape"])
        return out

    return block, views


def run_once(units: list[Path], way: Way, config: Any, tokens: int, *, compute: bool, threads: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(threads)
    block, views = block_and_views(config, units[0])
    x = torch.randn(1, tokens, config.n_embd, generator=torch.Generator().manual_seed(0))
    spent = [0.0]

    def use(i: int, buffer: memoryview) -> None:
        start = time.perf_counter()
        with torch.no_grad():
            torch.func.functional_call(block, views(buffer), (x,))
        spent[0] += time.perf_counter() - start

    drop(units)
    pipeline = Pipeline(units, way)
    try:
        start = time.perf_counter()
        pipeline.run(use if compute else None)
        total = time.perf_counter() - start
    finally:
        pipeline.close()
    return {"total": total, "compute": spent[0]}


def compute_only(units: list[Path], config: Any, tokens: int, threads: int) -> float:
    """Seconds to compute ``len(units)`` blocks with weights already in memory."""
    import torch

    torch.set_num_threads(threads)
    block, views = block_and_views(config, units[0])
    pipeline = Pipeline(units[:1], Way("buffered", 4, 0))
    try:
        pipeline.run()
        weights = views(pipeline.buffers[0].buffer())
        x = torch.randn(1, tokens, config.n_embd, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.func.functional_call(block, weights, (x,))  # warm-up
            start = time.perf_counter()
            for _ in units:
                torch.func.functional_call(block, weights, (x,))
            return time.perf_counter() - start
    finally:
        pipeline.close()


def study(units: list[Path], way: Way, config: Any, tokens: int, repeat: int) -> dict[str, Any]:
    """Every figure ``repeat`` times, interleaved; the best of each kept (noise only adds time)."""
    serial_way = Way(way.name, way.readers, 0, way.chunk)
    runs: dict[str, list[float]] = {}
    for _ in range(repeat):
        figures = {
            "read": run_once(units, way, config, tokens, compute=False, threads=2)["total"],
            "compute": compute_only(units, config, tokens, threads=2),
            "compute1": compute_only(units, config, tokens, threads=1),
            "serial": run_once(units, serial_way, config, tokens, compute=True, threads=2)["total"],
        }
        for threads in (2, 1):
            both = run_once(units, way, config, tokens, compute=True, threads=threads)
            figures[f"overlap{threads}"], figures[f"overlap{threads}_compute"] = both["total"], both["compute"]
        for key, value in figures.items():
            runs.setdefault(key, []).append(value)
    return {"tokens": tokens, **{k: min(v) for k, v in runs.items()}, "load": note_load()}


def efficiency(read: float, comp: float, total: float) -> float:
    return (read + comp - total) / min(read, comp)


def report(rows: list[dict[str, Any]], units: list[Path], way: Way) -> str:
    size = sum(p.stat().st_size for p in units) / 1e9
    lines = [
        f"{len(units)} block shards ({size:.1f} GB) streamed with `{way.label}`; each block's forward "
        "computed on views into its read buffer. Efficiency: (read + compute - total) / min(read, compute).",
        "",
        "| tokens | read only | compute only (2 threads / 1) | read, then compute | overlapped, 2 threads "
        "(efficiency; compute inside) | overlapped, 1 thread (efficiency; compute inside) | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e2 = efficiency(r["read"], r["compute"], r["overlap2"])
        e1 = efficiency(r["read"], r["compute1"], r["overlap1"])
        lines.append(
            f"| {r['tokens']} | {r['read']:.1f} s | {r['compute']:.1f} s / {r['compute1']:.1f} s | "
            f"{r['serial']:.1f} s | {r['overlap2']:.1f} s ({e2:.2f}; {r['overlap2_compute']:.1f} s) | "
            f"{r['overlap1']:.1f} s ({e1:.2f}; {r['overlap1_compute']:.1f} s) | {r['load']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, default=6, help="block shards streamed (default 6)")
    parser.add_argument("--reader", default="direct", choices=["direct", "buffered_dontneed"])
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--tokens", type=int, action="append", help="default: 16 and 128")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each figure, best kept (default 2)")
    args = parser.parse_args()
    import json

    from bigviz.models import GPTConfig

    files = shards(CHECKPOINT)
    config = json.loads((CHECKPOINT / "config.json").read_text())
    config.pop("model_type", None)
    config = GPTConfig(**config)
    units = files[1 : 1 + args.units]  # block shards (the first holds the embeddings)
    drop_all(files)
    way = Way(args.reader, args.readers, args.depth)
    rows = []
    for tokens in args.tokens or [16, 128]:
        rows.append(study(units, way, config, tokens, args.repeat))
        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    print(report(rows, units, way))
    os.sync()


if __name__ == "__main__":
    main()
