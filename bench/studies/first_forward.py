"""Where does the first forward of a split go? (issue 26, 2026-12-03)

At the 1/2 and 2/3 splits of the larger-than-RAM bench the dispatch plus the first forward
took 1.7-3.1x the time the disk needs to read the whole checkpoint, and the resident copy made
during it ran at 0.22-0.28 GB/s, where the same disk reads 1.5-2.2 GB/s and the machine hands
over fresh memory at 0.6-1.6 GB/s. This study dispatches the bench's checkpoint at one split in
a fresh process (page cache dropped first) and records, during the first forward:

* each piece of the resident copy: which thread, when its prefault (``MADV_POPULATE_WRITE``)
  began and ended, when its ``O_DIRECT`` read ended;
* each resident module's wait for its bytes (the copy's pre-hook) and when it ran;
* the streamed units' reads and computes (``bigviz.timeline``);

then prints the copy's bytes per second in one-second bins beside the ring's, the time the
copy's threads spent faulting memory and reading, and the forward's waits. ``--variant``
changes one thing:

* ``default``: as the dispatch does it;
* ``readers=N``: the copy with N reader threads;
* ``copy-first``: the first forward starts only once the copy is done (no compute, no ring
  reads beside it): the copy's speed on its own in the same process;
* ``no-prefault``: the copy's pieces are not faulted in before their reads;
* ``threads=N``: torch computes with N threads;
* ``prelude``: first what the bench does before its dispatch (fresh memory timed, the whole
  checkpoint read cold, the page cache dropped); ``prelude-wait=S``: then S seconds idle;
* ``floors``: each later forward follows a cold read of its streamed part (the bench's
  same-minute floor);
* ``peak``: the bench's memory sampler (``/proc/self/status`` every 2 ms) runs throughout;
* ``ring-4k``: the ring without transparent huge pages (as before 2026-12-03);
* ``populate``: no anonymous copy: the resident part stays memory-mapped and its pages are
  read into the page cache (``MADV_POPULATE_READ``) by the copy's threads, in the same order,
  each module waiting for its own (``prelude-populate``: after the prelude). Page-cache pages
  are filled by the host's I/O thread, not faulted in on the guest's cores: alone, 10.9 GB of
  shards populated in 6.3-8.4 s with 0.3-2.9 s of CPU, against 11.7-22.3 s and 10-21 s of CPU
  for the anonymous copy (``MADV_POPULATE_WRITE`` + ``O_DIRECT``, 4 threads, alternated,
  2026-12-03). Beside the first forward at 1/2 of the RAM it was not faster: the populate
  reads ran at 0.7-1.0 GB/s, the ring's reads started later, and the dispatch + first forward
  took 26.5-40.1 s against 19.4-23.7 s (fresh), 33.8 s against 31.7 s after the prelude
  (where the copy itself took 15.1 s against 29.8 s). Later forwards on the mapped weights ran
  as fast (8.6-10.8 s against 8.5-10.4 s).

Two more forwards follow the first (their times printed). ``--fraction 0``: all on disk.
``--memory in-use``: instead of dropping the whole page cache, only the checkpoint's pages are
evicted and the bench's filler is read through the page cache before each variant
(``bench/in_use.py``): the memory the dispatch gets is reclaimed page cache, as on a machine in
use, not pages this VM had handed back to its host.

Run as root, with the checkpoint of ``python bench/beyond_ram.py --build-only``::

    python bench/studies/first_forward.py --fraction 1/2 --variant default --variant copy-first
    python bench/studies/first_forward.py --fraction 2/3 --memory in-use --variant default --variant readers=2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # beyond_ram.py
sys.path.insert(0, str(HERE.parents[1]))  # bigviz from this checkout

import beyond_ram  # noqa: E402

CHECKPOINT = HERE.parent / "_work" / "beyond-ram"


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One dispatch + first forward, instrumented, in this fresh process."""
    import torch

    import bigviz
    import bigviz.engine.resident_copy as rc
    from bigviz.models import GPT, GPTConfig
    from bigviz.osio import direct
    from bigviz.osio.pages import prefault

    origin = time.perf_counter()
    pieces: list[tuple[str, float, float, float, int]] = []
    waits: list[tuple[str, float, float]] = []
    lock = threading.Lock()
    no_prefault = spec["variant"] == "no-prefault"

    def read_piece(piece: Any, want_direct: bool) -> tuple[int, bool]:
        t0 = time.perf_counter()
        if not no_prefault:
            prefault(piece.address, piece.length)
        t1 = time.perf_counter()
        direct.read_into(piece, direct.os.O_DIRECT)
        t2 = time.perf_counter()
        with lock:
            pieces.append((threading.current_thread().name, t0 - origin, t1 - origin, t2 - origin, piece.need))
        return piece.need, True

    rc.read_piece = read_piece  # the copy's reads, timed
    if spec["variant"] == "ring-4k":  # the ring as it was before 2026-12-03: 4 KiB pages
        import bigviz.engine.fetchers.ring as ring

        ring.hugepages = lambda address, length: False
    if spec["variant"].endswith("populate"):  # the resident part stays mapped, its pages read in by MADV_POPULATE_READ
        from bigviz.osio.pages import populate

        def copy_by_populate(self: Any, readers: int, direct: bool) -> Any:
            step = 16 << 20
            work = []
            left: dict[Any, int] = {}
            for span in self._spans:
                key = (span.address, span.length)
                start = span.address & ~4095
                end = span.address + span.length
                parts = [(key, a, min(step, end - a)) for a in range(start, end, step)]
                work += parts
                left[key] = len(parts)

            def one(item: Any) -> int:
                t0 = time.perf_counter()
                populate(item[1], item[2])
                with lock:
                    pieces.append(
                        (
                            threading.current_thread().name,
                            t0 - origin,
                            t0 - origin,
                            time.perf_counter() - origin,
                            item[2],
                        )
                    )
                return item[2]

            with rc.ThreadPoolExecutor(max(1, readers)) as pool:
                for (key, _, _), n in zip(work, pool.map(one, work)):
                    with self._bar_lock:
                        self._bar.update(n)
                    left[key] -= 1
                    if left[key] == 0:
                        with self._cond:
                            self._done.add(key)
                            self._cond.notify_all()
            return rc.ResidentReport(len(self._spans), self._total, time.perf_counter() - self._start, 0)

        rc.ResidentCopy._copy = copy_by_populate  # type: ignore[method-assign]
    readers = int(spec["variant"].split("=")[1]) if spec["variant"].startswith("readers=") else None
    names: dict[int, str] = {}
    original_before = rc.ResidentCopy._before

    def before(self: Any, module: Any, args: Any) -> None:
        t0 = time.perf_counter()
        original_before(self, module, args)
        waits.append((names.get(id(module), "?"), t0 - origin, time.perf_counter() - origin))

    rc.ResidentCopy._before = before  # type: ignore[method-assign]
    if readers is not None:
        base_init = rc.ResidentCopy.__init__

        def init(self: Any, *a: Any, **k: Any) -> None:
            base_init(self, *a, **{**k, "readers": readers})

        rc.ResidentCopy.__init__ = init  # type: ignore[method-assign]

    if spec["variant"].startswith("threads="):  # torch's compute threads (default: one per core)
        torch.set_num_threads(int(spec["variant"].split("=")[1]))
    with bigviz.init_empty_weights():
        model = GPT(GPTConfig(**spec["config"]))
    names.update({id(m): n for n, m in model.named_modules()})
    idx = torch.randint(
        0, spec["config"]["vocab_size"], (1, beyond_ram.TOKENS), generator=torch.Generator().manual_seed(1)
    )
    out: dict[str, Any] = {"variant": spec["variant"]}
    if spec["variant"].startswith("prelude"):  # what the bench did before its dispatch until 2026-12-03
        out["memory_rate"] = beyond_ram.fresh_memory_rate(min(beyond_ram.MEMORY_SAMPLE, spec["budget"] // 4))
        out["whole_s"] = beyond_ram._paired_floor({**spec, "drop": "global", "readers": 4}, None)
        if "wait=" in spec["variant"]:  # then a pause: does the machine recover?
            time.sleep(float(spec["variant"].split("wait=")[1]))
    sampler = None
    if spec["variant"] == "peak":  # the bench's anonymous-memory sampler, every 2 ms
        from bigviz.modeling.process_memory import PeakMemory

        sampler = PeakMemory(("RssAnon",)).start()
    start, cpu = time.perf_counter(), time.process_time()
    model = bigviz.load_checkpoint_and_dispatch(
        model,
        spec["ckpt"],
        {"": "disk"} if not spec["budget"] else "auto",
        max_memory={"cpu": spec["budget"]} if spec["budget"] else None,
        resident=spec["resident"],
    )
    out["dispatch_s"] = time.perf_counter() - start
    copy = bigviz.residency(model).copy
    if spec["variant"] == "copy-first" and copy is not None and not isinstance(copy, rc.ResidentReport):
        t0 = time.perf_counter()
        copy.wait()
        out["copy_alone_s"] = time.perf_counter() - t0
    forward_start = time.perf_counter()
    with bigviz.timeline(model) as line, torch.no_grad():
        model(idx)
    out["first_s"] = time.perf_counter() - forward_start
    out["cpu_s"] = time.process_time() - cpu  # all threads, dispatch + first forward
    out["total_s"] = time.perf_counter() - start
    placed = {str(k): str(v) for k, v in getattr(model, "hf_device_map", {}).items()}
    for key in ("next_s", "third_s"):
        if spec["variant"] == "floors":  # the bench's same-minute read of the streamed part, just before
            out[key[:-2] + "_floor_s"] = beyond_ram._paired_floor({**spec, "drop": "global", "readers": 4}, placed)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(idx)
        out[key] = time.perf_counter() - t0
    if sampler is not None:
        sampler.stop()
    report = bigviz.residency(model).copied
    out["copy_bytes"] = report.nbytes if report else 0
    out["copy_s"] = report.seconds if report else 0.0
    out["start"] = start - origin
    out["forward_start"] = forward_start - origin
    out["pieces"] = pieces
    out["waits"] = waits
    shift = line._t0 - origin  # the timeline's clock to this study's (both perf_counter)
    out["streamed"] = [
        {
            "name": u.name,
            "pieces": [[a + shift, b + shift] for a, b in u.pieces],
            "wait": [u.wait_start + shift, u.compute_start + shift],
            "compute_end": u.compute_end + shift,
            "bytes": u.read_bytes,
        }
        for u in line.units
    ]
    return out


def summarize(r: dict[str, Any]) -> str:
    pieces, streamed = r["pieces"], r["streamed"]
    gb = 1e9
    lines = [f"## {r['variant']}", ""]
    lines.append(
        f"dispatch {r['dispatch_s']:.1f} s, first forward {r['first_s']:.1f} s, total {r['total_s']:.1f} s; "
        f"copy {r['copy_bytes'] / gb:.1f} GB in {r['copy_s']:.1f} s ({r['copy_bytes'] / gb / max(r['copy_s'], 1e-9):.2f} GB/s)"
        + (f", waited for alone {r['copy_alone_s']:.1f} s" if "copy_alone_s" in r else "")
        + (f", {r['cpu_s']:.0f} CPU-seconds ({r['cpu_s'] / r['total_s']:.1f} cores)" if "cpu_s" in r else "")
        + f"; next forwards {r['next_s']:.1f} s, {r['third_s']:.1f} s"
        + (f"; prelude: whole read {r['whole_s']:.1f} s" if "whole_s" in r else "")
    )
    fault = sum(p[2] - p[1] for p in pieces)
    read = sum(p[3] - p[2] for p in pieces)
    threads = sorted({p[0] for p in pieces})
    lines.append(
        f"copy threads {len(threads)}: prefault {fault:.1f} thread-s"
        + (f" ({sum(p[4] for p in pieces) / gb / fault:.2f} GB/s per thread)" if fault > 0 else "")
        + f", reads (O_DIRECT; populate: page cache) {read:.1f} thread-s "
        f"({sum(p[4] for p in pieces) / gb / max(read, 1e-9):.2f} GB/s per thread)"
    )
    waited = sum(b - a for _, a, b in r["waits"])
    swait = sum(u["wait"][1] - u["wait"][0] for u in streamed)
    lines.append(f"resident modules waited {waited:.1f} s, streamed units waited {swait:.1f} s")
    end = r["total_s"] + r["start"]
    bins = int(end) + 1
    copy_bins, ring_bins, fault_bins = [0.0] * bins, [0.0] * bins, [0.0] * bins

    def spread(table: list[float], a: float, b: float, amount: float) -> None:
        if b <= a:
            table[min(bins - 1, int(a))] += amount
            return
        for i in range(int(a), min(bins, int(b) + 1)):
            overlap = min(b, i + 1) - max(a, i)
            if overlap > 0:
                table[i] += amount * overlap / (b - a)

    for _, t0, t1, t2, n in pieces:
        spread(copy_bins, t1, t2, n)
        spread(fault_bins, t0, t1, n)
    for u in streamed:
        each = u["bytes"] / max(1, len(u["pieces"]))
        for a, b in u["pieces"]:
            spread(ring_bins, a, b, each)
    lines += ["", "| second | copy read GB/s | copy faulted GB/s | ring read GB/s | forward |", "|---|---|---|---|---|"]
    for i in range(int(r["start"]), bins):
        doing = [n for n, a, b in r["waits"] if a <= i + 1 and b >= i and b - a > 0.05]
        doing += [
            u["name"]
            for u in streamed
            if u["wait"][0] <= i + 1 and u["wait"][1] >= i and u["wait"][1] - u["wait"][0] > 0.05
        ]
        lines.append(
            f"| {i} | {copy_bins[i] / gb:.2f} | {fault_bins[i] / gb:.2f} | {ring_bins[i] / gb:.2f} | "
            f"{'waits ' + ', '.join(doing) if doing else ''} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=CHECKPOINT)
    parser.add_argument("--fraction", default="1/2", help="the cpu budget, a fraction of the RAM")
    parser.add_argument(
        "--variant",
        action="append",
        help="default, readers=N, copy-first, no-prefault, ring-4k, threads=N, prelude, prelude-wait=S, floors, peak, "
        "populate, prelude-populate",
    )
    parser.add_argument("--resident", default="auto", help="copy: as if larger than RAM (a small checkpoint)")
    parser.add_argument(
        "--memory",
        choices=["dropped", "in-use"],
        default="dropped",
        help="in-use: evict the checkpoint's pages and refill the page cache with the bench's filler (bench/in_use.py)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    from bigviz.models import GPTConfig

    config = json.loads((args.checkpoint / "config.json").read_text())
    keep = set(GPTConfig().to_dict())
    config = {k: v for k, v in config.items() if k in keep and k != "model_type"}
    files = beyond_ram.shard_files(args.checkpoint)
    ram = beyond_ram.machine_ram()
    budget = int(ram * Fraction(args.fraction))
    filler = None
    if args.memory == "in-use":
        import in_use

        filler, _ = in_use.prepare(HERE.parent / "_work", ram)
    for variant in args.variant or ["default"]:
        beyond_ram.drop_caches(files, "files" if filler else "global")
        if filler is not None:
            print(f"refilled the page cache in {in_use.refill(filler).seconds:.1f} s", flush=True)
        spec = {
            "config": config,
            "ckpt": str(args.checkpoint),
            "budget": budget,
            "variant": variant,
            "resident": args.resident,
        }
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, check=False
        )
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            print(f"## {variant}: failed\n{proc.stderr[-2000:]}")
            continue
        result = json.loads(lines[-1])
        tag = "-in-use" if filler else ""
        (HERE.parent / "_work" / f"first-forward-{variant}{tag}.json").write_text(json.dumps(result) + "\n")
        print(summarize(result), flush=True)


if __name__ == "__main__":
    main()
