"""Larger than RAM: a GPT bigger than this machine, run from disk, against the disk's own floor.

    python bench/beyond_ram.py                  # the whole run, ~8-12 min with the checkpoint built
    python bench/beyond_ram.py --only auto      # one scenario (disk, auto, accelerate; repeatable)
    python bench/beyond_ram.py --small          # ~300 MB, the same code path, under a minute
    python bench/beyond_ram.py --report bench/_work/beyond-ram-results.json   # a saved run's table
    python bench/beyond_ram.py --quantize int8  # also int8 weights (in bfloat16), all-disk and 2/3 (issue 25)
    python bench/beyond_ram.py --memory in-use  # on a machine in use: the page cache full (bench/in_use.py)

The checkpoint: a bigviz GPT (``n_embd`` 6144: blocks of 1.81 GB) about ``--ram-multiple``
times this machine's RAM, written block by block (one block's tensors in RAM at a time),
deterministic random weights, as a transformers-style sharded safetensors folder in
``bench/_work/beyond-ram`` (git-ignored). It is kept between runs and reused when complete
(``--rebuild`` to make one for this machine's RAM again, about 3 minutes; ``--delete`` to remove
it at the end). Then, page cache dropped before each measurement, side by side:

- the read floor: every shard read cold by ``--readers`` parallel readers, best of two
  (``--full-floor``: one sequential reader and O_DIRECT too);
- bigviz's disk probe (``bigviz.checkpoint.probe.measure_read_bandwidth``), against the floor;
- one block's and the head's compute (weights in RAM), for the prediction;
- bigviz, ``device_map={"": "disk"}``: dispatch, first forward (16 tokens), the next;
- bigviz, ``device_map="auto"``, ``max_memory={"cpu": 2/3 of RAM}``: the same; the resident
  part is read once into process memory (dispatch), disk blocks are streamed and dropped;
  the next forward is compared with ``bigviz.core.cost``'s prediction (the engine's
  read-ahead depth, compute measured above, the floor's bandwidth and the probe's);
- accelerate, ``device_map="auto"``, the same budget and an offload folder (it rewrites what
  does not fit its budget, ~15 GB: left out, with a message, when the disk lacks the room).

With ``--quantize int8`` (or ``int4``), the bigviz all-disk and 2/3 scenarios again with the
weights quantized while loading (``load_checkpoint_and_dispatch(..., quantization="int8")``):
the planner sizes them packed, the blocks it puts on disk are written once, packed, to an
offload folder (about a quarter of their float32 bytes) and streamed from there; they compute
in bfloat16 (``--quantized-dtype``; int8 then runs on torch's packed int8 kernel); the later
forwards are compared with the float32 ones of the same run and with the time to read the
packed bytes at the floor's speed (or the compute, when that is slower).

Every scenario runs in a fresh process; its anonymous RAM (RssAnon) peak is reported. A guard
kills a scenario when the machine's available memory falls under 1 GiB. Ratios against the
issue's goals are taken against cold ``O_DIRECT`` reads of the same bytes made in the same minute
(this virtual disk's speed varies twofold between minutes; the floor of the run's start is shown
beside them). Prints a
markdown table and records it as bench/results/beyond_ram.md, the section of bench/RESULTS.md it
reassembles (bench/records.py; the section it replaces goes to the diary, bench/history/; not with
--small or --no-results; with ``--memory in-use``, as bench/results/beyond_ram_in_use.md), and
copies the timeline of the first size's 2/3 split to ``docs/larger-than-ram-run.svg`` (the README's picture); the raw figures go to
``bench/_work/beyond-ram-results.json``.

The page cache is dropped with ``sync; echo 3 > /proc/sys/vm/drop_caches`` when run as root
(``--drop files`` to only evict the checkpoint's own files: the default when not root).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
import zlib
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
warnings.filterwarnings("ignore")


WORK = HERE / "_work"
TOKENS = 16
MEMORY_SAMPLE = 4 * 2**30  # fresh memory faulted in before each dispatch, for its rate
GiB = 2**30
GUARD_BYTES = 1 * GiB  # a scenario is killed when MemAvailable falls below this
DEFAULT_SIZES = "1.25,2"  # the two model sizes, as multiples of the RAM
SKIPPED = "\n\n(nothing measured at this size)"  # ends the text of a size skipped: no run records only skips
PICTURES: list[Path] = []  # the timelines drawn in this run, in order


# ------------------------------------------------------------------------------ sizing
@dataclass(frozen=True)
class Shape:
    """The GPT to build and the machine it must not fit."""

    n_embd: int
    n_head: int
    n_layer: int
    vocab_size: int
    block_size: int
    ram: int  # bytes of RAM the model is compared with (a pretend figure in --small mode)

    def config(self) -> Any:
        from bigviz.models import GPTConfig

        return GPTConfig(
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            vocab_size=self.vocab_size,
            block_size=self.block_size,
        )

    @property
    def block_bytes(self) -> int:
        c = self.n_embd
        return 4 * (12 * c * c + 13 * c)  # c_attn, c_proj, c_fc, mlp.c_proj, 2 LayerNorms, biases

    @property
    def embedding_bytes(self) -> int:
        return 4 * (self.vocab_size + self.block_size) * self.n_embd

    @property
    def model_bytes(self) -> int:
        return self.embedding_bytes + self.n_layer * self.block_bytes + 4 * 2 * self.n_embd

    @property
    def cpu_budget(self) -> int:
        return self.ram * 2 // 3


def machine_ram() -> int:
    import psutil

    return psutil.virtual_memory().total


def choose_shape(args: argparse.Namespace, free: int) -> Shape | str:
    """The model to build, or a sentence saying why the bench must skip (the disk is short)."""
    if args.small:
        base = dict(n_embd=args.small_n_embd, n_head=max(1, args.small_n_embd // 64), vocab_size=8192, block_size=256)
        target = _size(args.size) if args.size else int(_size(args.small_ram) * args.ram_multiple)
    else:
        base = dict(n_embd=args.n_embd, n_head=args.n_embd // 128, vocab_size=50257, block_size=1024)
        target = _size(args.size) if args.size else int(args.ram_multiple * machine_ram())
    one = Shape(n_layer=1, ram=0, **base)
    n_layer = max(2, round((target - one.embedding_bytes) / one.block_bytes))
    existing = _existing_layers(folder_for(args), base)
    if existing and not args.size and not args.rebuild:
        n_layer = existing  # reuse the checkpoint already built (bench/_work is kept between runs)
    shape = Shape(n_layer=n_layer, ram=machine_ram(), **base)
    if args.small:  # a pretend machine the small model does not fit
        shape = Shape(n_layer=n_layer, ram=int(shape.model_bytes / args.ram_multiple), **base)
    if "accelerate" not in args.skip and disk_need(shape, accelerate=True) > free:
        args.skip.append("accelerate")
        print(
            f"bench/beyond_ram.py: accelerate left out: it would rewrite {accelerate_copy(shape) / 1e9:.1f} GB "
            f"into its offload folder and the disk has {(free - shape.model_bytes) / 1e9:.1f} GB free beside "
            "the checkpoint (it needs that plus 10% headroom)",
            file=sys.stderr,
        )
    need = disk_need(shape, accelerate=False)
    if need > free:
        return (
            f"the disk has {free / 1e9:.1f} GB free; this {shape.model_bytes / 1e9:.1f} GB model "
            f"({shape.model_bytes / shape.ram:.2f}x RAM) needs {need / 1e9:.1f} GB: itself and 10% headroom. "
            "Free some space, or pass a smaller --size / --ram-multiple."
        )
    return shape


def _existing_layers(folder: Path, base: dict[str, int]) -> int | None:
    """Blocks of a complete checkpoint of this width already in ``folder`` (None: none there)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if any(config.get(k) != v for k, v in base.items()):
        return None
    shape = Shape(n_layer=int(config["n_layer"]), ram=0, **base)
    return shape.n_layer if _complete(folder, shape) else None


def accelerate_copy(shape: Shape) -> int:
    """Bytes accelerate rewrites into its offload folder: what does not fit its cpu budget."""
    return max(0, shape.model_bytes - shape.cpu_budget)


def disk_need(shape: Shape, *, accelerate: bool) -> int:
    """Free bytes the run needs: the model, accelerate's copy, 10% (at least 2 GB) headroom.

    (Issue 12's rule of thumb, 2.5x the model, assumed accelerate rewrites all of it and
    left a wide margin; at 1.25x RAM on a 24 GiB machine with ~70 GB free it does not fit,
    while what the run writes does: 32 + 15 + 3 GB.)
    """
    return shape.model_bytes + (accelerate_copy(shape) if accelerate else 0) + max(shape.model_bytes // 10, 2 * 10**9)


def _size(text: str) -> int:
    from bigviz.core.sizes import parse_size

    return parse_size(text)


# -------------------------------------------------------------------------- checkpoint
def tensor_shapes(shape: Shape, layer: int | None) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one shard: the embeddings (None), block ``layer``, or ``-1``: ln_f."""
    c, p = shape.n_embd, f"transformer.h.{layer}."
    if layer is None:
        return {"transformer.wte.weight": (shape.vocab_size, c), "transformer.wpe.weight": (shape.block_size, c)}
    if layer < 0:
        return {"transformer.ln_f.weight": (c,), "transformer.ln_f.bias": (c,)}
    return {
        p + "ln_1.weight": (c,),
        p + "ln_1.bias": (c,),
        p + "attn.c_attn.weight": (3 * c, c),
        p + "attn.c_attn.bias": (3 * c,),
        p + "attn.c_proj.weight": (c, c),
        p + "attn.c_proj.bias": (c,),
        p + "ln_2.weight": (c,),
        p + "ln_2.bias": (c,),
        p + "mlp.c_fc.weight": (4 * c, c),
        p + "mlp.c_fc.bias": (4 * c,),
        p + "mlp.c_proj.weight": (c, 4 * c),
        p + "mlp.c_proj.bias": (c,),
    }


def make_tensor(name: str, dims: tuple[int, ...]) -> Any:
    """Deterministic weights: the same name always gets the same values (GPT-2's init scale)."""
    import torch

    if name.endswith(".bias"):
        return torch.zeros(dims)
    if len(dims) == 1:  # a LayerNorm weight
        return torch.ones(dims)
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(dims, generator=generator).mul_(0.02)


def shard_layers(shape: Shape) -> list[int | None]:
    return [None, *range(shape.n_layer), -1]


MARK = ".made-by-bench-beyond-ram"  # only folders holding it are ever removed by this script


def _remove_ours(path: Path) -> None:
    """Remove ``path`` if this script made it (it holds ``MARK``); anything else is left alone."""
    if not path.exists():
        return
    if not (path / MARK).is_file():
        raise SystemExit(
            f"bench/beyond_ram.py: {path} exists and was not made by this script: "
            f"move it away or give another --work folder; nothing was deleted"
        )
    shutil.rmtree(path)


def build_checkpoint(shape: Shape, folder: Path) -> float:
    """Write the checkpoint one shard at a time into a staging folder, then rename it into place.
    Returns the seconds it took (0 when a complete one with this config was already there)."""
    if _complete(folder, shape):
        return 0.0
    from safetensors.torch import save_file

    stage = folder.with_name(folder.name + ".partial")
    _remove_ours(stage)  # our own leftover from a killed run
    _remove_ours(folder)  # an incomplete one of ours (config differs): refused before hours of writing
    stage.mkdir(parents=True)
    (stage / MARK).write_text("made by bench/beyond_ram.py\n")
    start, layers = time.perf_counter(), shard_layers(shape)
    names = [f"model-{i:05d}-of-{len(layers):05d}.safetensors" for i in range(1, len(layers) + 1)]
    weight_map, total = {}, 0
    for name, layer in zip(names, layers):
        tensors = {k: make_tensor(k, dims) for k, dims in tensor_shapes(shape, layer).items()}
        save_file(tensors, str(stage / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * 4 for t in tensors.values())
        del tensors  # one shard in RAM at a time
        print(f"  wrote {name} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    index = {
        "metadata": {"total_size": total, "total_parameters": total // 4},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (stage / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (stage / "config.json").write_text(json.dumps(shape.config().to_dict(), indent=2, sort_keys=True) + "\n")
    os.sync()
    stage.rename(folder)
    return time.perf_counter() - start


def _complete(folder: Path, shape: Shape) -> bool:
    try:
        config = json.loads((folder / "config.json").read_text())
        index = json.loads((folder / "model.safetensors.index.json").read_text())
    except (OSError, ValueError):
        return False
    files = set(index["weight_map"].values())
    return config == json.loads(json.dumps(shape.config().to_dict())) and all((folder / f).is_file() for f in files)


def shard_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("model-*.safetensors"))


# ---------------------------------------------------------------------- page cache
def drop_caches(files: list[Path], mode: str) -> str:
    """Drop the page cache: globally (root) or only these files' pages. Returns what was done."""
    if mode == "global":
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "global"
    from bigviz.osio.pages import drop_file_pages

    for path in files:
        drop_file_pages(path)
    return "files"


def drop_mode(requested: str, small: bool) -> str:
    if requested != "auto":
        return requested
    can = os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)
    return "global" if can and not small else "files"


def load_average() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


# ----------------------------------------------------------------------------- floor
def read_floor(files: list[Path], readers: int, drop: str, *, full: bool = False) -> dict[str, Any]:
    """All shards read cold by ``readers`` parallel readers, buffered (each a contiguous part) and
    ``O_DIRECT`` in the ring's order (:func:`in_ring_order`), best of two each (the floor is the
    faster); with ``full``, one sequential reader too."""
    from bigviz.checkpoint.probe import ReadTiming, timed_read

    ranges = [(p, 0, p.stat().st_size) for p in files]
    out: dict[str, Any] = {}
    runs = [
        ("parallel", dict(readers=readers, chunk_bytes=16 * 2**20)),
        ("direct", dict(readers=readers)),
        ("parallel", dict(readers=readers, chunk_bytes=16 * 2**20)),
        ("direct", dict(readers=readers)),
    ]  # O_DIRECT too, in the ring's order (buffered reads pay for fresh page-cache pages on this VM)
    if full:
        runs += [("sequential", dict(readers=1, chunk_bytes=16 * 2**20))]
    for name, knobs in runs:
        drop_caches(files, drop)
        try:
            if name == "direct":
                cpu = time.process_time()
                seconds = in_ring_order(ranges, readers=readers)
                timing = ReadTiming(
                    bytes=sum(n for *_, n in ranges), seconds=seconds, cpu_seconds=time.process_time() - cpu
                )
            else:
                timing = timed_read(ranges, **knobs)
        except OSError as exc:  # O_DIRECT refused by this filesystem
            out[name + "_error"] = f"{type(exc).__name__}: {exc}"
            continue
        if name not in out or timing.seconds < out[name]["seconds"]:
            out[name] = {"seconds": timing.seconds, "bytes": timing.bytes, "cpu_seconds": timing.cpu_seconds}
        print(
            f"  floor {name}: {timing.seconds:.1f} s ({timing.bandwidth / 1e9:.2f} GB/s), load {load_average()}",
            file=sys.stderr,
            flush=True,
        )
    out["probe"] = run_probe(files, readers, drop)
    return out


def run_probe(files: list[Path], readers: int, drop: str) -> dict[str, Any]:
    """bigviz's disk probe on the checkpoint (measured now, not from the cache)."""
    from bigviz.checkpoint.probe import measure_read_bandwidth

    drop_caches(files, drop)
    start = time.perf_counter()
    probe = measure_read_bandwidth(files[0].parent, parallel=readers, cache=False)
    took = time.perf_counter() - start
    print(f"  probe: {probe} in {took:.1f} s", file=sys.stderr, flush=True)
    return {
        "seconds": took,
        "parallel": probe.parallel,
        "sequential": probe.sequential,
        "method": probe.method,
        "sample_bytes": probe.sample_bytes,
        "chunk_bytes": probe.chunk_bytes,
    }


# ------------------------------------------------------------------------ scenarios
def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One scenario in this fresh process."""
    if spec["engine"] == "compute":
        return compute_child(spec)
    import torch

    import bigviz
    from bigviz.models import GPT, GPTConfig

    with bigviz.init_empty_weights():
        model = GPT(GPTConfig(**spec["config"]))
    from bigviz.modeling.process_memory import PeakMemory

    out: dict[str, Any] = {"phase": "dispatch"}
    idx = torch.randint(0, spec["config"]["vocab_size"], (1, TOKENS), generator=torch.Generator().manual_seed(1))
    sample = min(MEMORY_SAMPLE, spec["budget"] // 4) if spec.get("budget") else MEMORY_SAMPLE
    if spec.get("paired"):  # the same minute's floor of the first forward's memory (its read: after the forwards)
        out["memory_rate"], out["memory_cores"] = fresh_memory(sample)
        out["memory_sample"] = sample
    with PeakMemory(("RssAnon",)) as peak:  # sampled every 2 ms
        try:
            start, cpu = time.perf_counter(), time.process_time()
            model = _dispatch(spec, model)
            out["dispatch_s"] = time.perf_counter() - start
            out["map"] = {str(k): str(v) for k, v in getattr(model, "hf_device_map", {}).items()}
            state = getattr(model, "_bigviz_dispatch", None)
            if spec.get("quantization"):  # what is streamed and held, packed (not the float32 shape's bytes)
                from bigviz.modeling.packed import held_bytes

                dispatched = getattr(state, "residency", None) is not None  # all in RAM: nothing streamed
                out["streamed_bytes"] = bigviz.residency(model).streamed_bytes if dispatched else 0
                out["resident_bytes"] = held_bytes(model).get("cpu", 0)
            if getattr(state, "scheduler", None) is not None:
                out["depth"] = state.scheduler.depth  # units read ahead (for the prediction)
                out["ring"] = getattr(state.scheduler.fetcher, "capacity", None)  # CPU streaming: its ring
            if state is not None and getattr(state, "residency", None) is not None:
                out["residency"] = bigviz.residency(model).reason
            out["threads"] = torch.get_num_threads()
            out["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            for key in ("first_s", "next_s", "third_s"):
                out["phase"] = key
                if key != "first_s" and spec.get("paired"):
                    out[key[:-2] + "_floor_s"] = _paired_floor(spec, out["map"])
                    block = _resident_block(model, out["map"])
                    if block is not None:  # the compute floor of the same minute: a resident block, alone
                        x = torch.randn(1, TOKENS, spec["config"]["n_embd"], generator=torch.Generator().manual_seed(2))
                        with torch.no_grad():  # a forward's worth of it: as many runs as the model has blocks
                            mean, best = _sustained(lambda: block(x), spec["config"]["n_layer"])
                        out[key[:-2] + "_block_s"], out[key[:-2] + "_block_best_s"] = mean, best
                timed = key == "next_s" and getattr(state, "scheduler", None) is not None
                with bigviz.timeline(model) if timed else _nothing() as line, torch.no_grad():
                    stolen, start = steal_seconds(), time.perf_counter()
                    model(idx)
                    out[key] = time.perf_counter() - start
                    out[key[:-2] + "_steal_s"] = steal_seconds() - stolen  # CPU the host took from this VM
                if key == "first_s":  # CPU-seconds of the dispatch + first forward, all threads together
                    out["first_cpu_s"] = time.process_time() - cpu
                if line is not None:
                    out["timeline"] = _timeline_data(line)
                if key == "first_s" and state is not None and getattr(state, "residency", None) is not None:
                    copied = bigviz.residency(model).copied  # made while the first forward ran (read after it)
                    if copied is not None:
                        out["copy"] = {"bytes": copied.nbytes, "seconds": copied.seconds, "direct": copied.direct_bytes}
            if spec.get("paired"):
                # The whole checkpoint read cold after the forwards, not before the dispatch: read
                # just before it, 32 GB slowed the first forward's fresh memory by a third
                # (bench/studies/first_forward.py --variant prelude: 33-41 s against 25-32 s).
                out["first_floor_s"] = _paired_floor(spec, None)
            out["phase"] = "done"
        except Exception as exc:  # what a peer does wrong is a result, not a crash of the bench
            out["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            out["failed_after_s"] = time.perf_counter() - start
    out["anon_peak"] = peak.peak["RssAnon"] - peak.base["RssAnon"]
    if spec.get("paired") and "first_s" in out:
        # Fresh memory again, the model still held (outside the RAM peak): the dispatch has
        # taken the pages the machine had warm, so those it hands out now are cold, as most of
        # the dispatch's were (the sample before it came partly from pages freed too recently
        # to have gone back to the host: 1.2-3.2 GB/s at the resident splits, this one
        # 0.32-0.38 GB/s, 2026-12-03).
        after = min(sample, _mem_available() // 2)  # as much as before, where the RAM left allows
        if after >= sample // 2:
            out["memory_rate_after"], out["memory_cores_after"] = fresh_memory(after)
    return out


def fresh_memory_rate(nbytes: int = MEMORY_SAMPLE, threads: int = 2) -> float:
    """Bytes per second at which this machine hands the process anonymous memory it has not
    touched (:func:`fresh_memory`'s rate)."""
    return fresh_memory(nbytes, threads)[0]


def fresh_memory(nbytes: int = MEMORY_SAMPLE, threads: int = 2) -> tuple[float, float]:
    """Bytes per second at which this machine hands the process anonymous memory it has not
    touched, and how many cores that kept busy: ``nbytes`` faulted in by ``threads`` at once
    (``MADV_POPULATE_WRITE``, no disk), then freed. The first forward of a model larger than
    RAM makes its resident part and its ring out of such memory; on a guest whose freed pages
    go back to the hypervisor (free page reporting) that costs a trip to the host per page,
    0.2-0.5 GiB/s here after the page cache was dropped (bench/studies/fresh_memory.py), so it
    can take longer than reading the whole checkpoint. That trip is CPU time of the guest's own
    cores, the cores the forward computes on: 1.9-2.8 CPU-seconds per GiB, one core's worth
    whether 1 or 2 threads fault (``bench/studies/fresh_memory.py``, 2026-12-03). (0.0, 0.0)
    where the kernel cannot populate (not Linux, before 5.14)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from bigviz.osio.pages import prefault

    buffer = torch.empty(nbytes, dtype=torch.uint8)  # not touched: torch does not fill it
    base, step = buffer.data_ptr(), nbytes // threads
    start, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(threads) as pool:
        done = list(pool.map(lambda i: prefault(base + i * step, step), range(threads)))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    del buffer
    return (nbytes / seconds, cpu / seconds) if all(done) else (0.0, 0.0)


def first_limit(shape: Shape, r: dict[str, Any], compute: dict[str, Any] | None = None) -> dict[str, float] | None:
    """The first forward's limit at the same minute. It reads the whole checkpoint once (the
    disk: measured cold just after the forwards), and its process makes the resident part and
    the ring out of fresh memory and computes the whole forward, both on the machine's cores.
    The disk and the cores overlap; on the cores the two add up: faulting in fresh memory kept
    ``memory_cores`` cores busy (measured with it) and the forward's compute
    ``compute["threads"]`` of them, so the cores need
    ``(memory x memory_cores + compute floor x threads) / cores`` seconds, and the memory no
    less than it took when measured. The limit is the longer of the read and that (without
    ``compute`` or ``memory_cores``: the fresh memory alone, which can only make it shorter).

    The fresh memory is measured twice: just before the dispatch (``memory_rate``, a sample of
    ``memory_sample`` bytes) and after the forwards, the model still held
    (``memory_rate_after``). The pages the first sample frees are the first the dispatch gets,
    as fast again; the rest come as the second sample's did, once the dispatch had taken what
    the machine had warm (pages freed too recently to have gone back to the host). So ``memory`` is the sample's bytes at the first
    rate and the rest at the second (all at the first rate where the second was not measured).
    None when the run did not measure the read and the memory."""
    whole, rate = r.get("first_floor_s"), r.get("memory_rate")
    if not whole or not rate:
        return None
    resident, _, _ = split_bytes(shape, r["map"])
    made = resident + (r.get("ring") or 0)
    after = r.get("memory_rate_after")
    warm = min(made, int(r.get("memory_sample") or 0)) if after else made
    memory = warm / rate + (made - warm) / after if after else made / rate
    rate = made / memory if memory else rate
    cores = r.get("cores") or os.cpu_count() or 1
    busy = min(float(r.get("memory_cores_after") or r.get("memory_cores") or 0.0), cores)
    work = 0.0
    if compute and busy:
        now = {**compute, "block_s": r.get("next_block_s") or compute["block_s"]}  # the nearest minute's
        work = compute_floor(shape, now)
    threads = min(int(compute.get("threads") or cores), cores) if compute else 0
    cpu = max(memory, (memory * busy + work * threads) / cores)  # no faster than it was measured
    return {
        "whole": whole,
        "memory": memory,
        "made": made,
        "rate": rate,
        "busy": busy,
        "compute": work,
        "cpu": cpu,
        "limit": max(whole, cpu),
    }


def steal_seconds() -> float:
    """CPU seconds the hypervisor has taken from this virtual machine since boot, all CPUs
    together (``steal`` in ``/proc/stat``; 0 where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0
    except (OSError, ValueError):
        return 0.0


@contextlib.contextmanager
def _nothing() -> Any:
    yield None


def _timeline_data(line: Any) -> dict[str, Any]:
    """A forward's timeline as plain data, seconds from the forward's start (bigviz.timeline)."""
    origin = line.bounds[-1][0]
    units = [
        {
            "name": u.name,
            "read": None if u.read_start is None else [u.read_start - origin, u.read_end - origin],
            "wait": u.wait_start - origin,
            "compute": [u.compute_start - origin, u.compute_end - origin],
            "bytes": u.read_bytes,
            "pieces": [[a - origin, b - origin] for a, b in u.pieces],
        }
        for u in line.forwards[-1]
    ]
    return {"summary": line.summary(), "units": units, "seconds": line.bounds[-1][1] - origin}


def in_ring_order(blocks: list[tuple[Any, int, int]], *, readers: int) -> float:
    """Seconds to read ``blocks`` (``(path, offset, length)``, ``offset`` a multiple of 4096)
    with ``O_DIRECT`` as the ring reads them: 16 MiB pieces in file order, taken in turn by ``readers``
    threads, into ``2 * readers`` slots of one buffer made first (of huge pages, as the ring's,
    touched by one thread). Four readers each on a contiguous quarter (``timed_read``) read up to 1.4x slower than the
    ring's forwards on this disk, which made that floor no floor.

    Raises:
        OSError: ``O_DIRECT`` refused, or a file shorter than asked.
    """
    import ctypes
    from concurrent.futures import ThreadPoolExecutor

    from bigviz.osio.direct import CHUNK, pieces_of, read_piece
    from bigviz.osio.pages import huge_anonymous

    slots = 2 * readers
    buffer, skip = huge_anonymous(slots * CHUNK)  # huge pages, as the ring's memory (osio.pages.hugepages)
    buffer.write(b"\1" * len(buffer))  # touched by one thread, before the clock starts
    base = ctypes.addressof(ctypes.c_char.from_buffer(buffer)) + skip  # the view is gone at once: close() may run
    futures: list[Any] = []
    try:
        with ThreadPoolExecutor(readers) as pool:
            start = time.perf_counter()
            for path, offset, length in blocks:
                for at in range(offset, offset + length, CHUNK):
                    if len(futures) >= slots:
                        futures[-slots].result()  # its slot is free again
                    slot = base + len(futures) % slots * CHUNK
                    (piece,) = pieces_of(str(path), at, min(CHUNK, offset + length - at), slot, direct=True)
                    futures.append(pool.submit(read_piece, piece, True))
            for future in futures:
                future.result()
            return time.perf_counter() - start
    finally:
        futures.clear()
        buffer.close()


def _paired_floor(spec: dict[str, Any], device_map: dict[str, str] | None) -> float:
    """Seconds to read the streamed part (the checkpoint bytes of the modules on "disk"; every
    shard whole when ``device_map`` is None) cold by ``spec["readers"]`` parallel readers with
    ``O_DIRECT`` in 16 MiB requests, as the ring reads, just before a forward (or a dispatch),
    then the page cache dropped again: this disk's speed varies twofold from minute to minute,
    so a forward is compared with a read made next to it."""
    from bigviz.checkpoint.index import CheckpointIndex
    from bigviz.checkpoint.probe import timed_read
    from bigviz.core.devicemap import device_of

    files = shard_files(Path(spec["ckpt"]))
    if device_map is None:
        ranges = [(p, 0, p.stat().st_size) for p in files]
    else:
        ranges = [
            (info.file, info.data_offsets[0], info.nbytes)
            for key, info in CheckpointIndex.open(spec["ckpt"]).entries.items()
            if info.data_offsets is not None and str(device_of(key, device_map)) == "disk"
        ]
    merged: list[list[Any]] = []  # contiguous ranges of a file in one, from a 4096-byte boundary (O_DIRECT)
    for path, offset, length in sorted(ranges, key=lambda r: (str(r[0]), r[1])):
        first, end = offset // 4096 * 4096, offset + length
        if merged and merged[-1][0] == path and first <= merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], end)
        else:
            merged.append([path, first, end])
    blocks = [(path, first, end - first) for path, first, end in merged]
    drop_caches(files, spec["drop"])
    try:
        seconds = in_ring_order(blocks, readers=spec["readers"])
    except OSError:  # O_DIRECT refused by this filesystem: buffered, as the ring then reads
        drop_caches(files, spec["drop"])
        seconds = timed_read(blocks, readers=spec["readers"], chunk_bytes=16 * 2**20).seconds
    drop_caches(files, spec["drop"])
    return seconds


def _resident_block(model: Any, device_map: dict[str, str]) -> Any:
    """A block of ``model`` held in RAM ("cpu" in its device map, its weights resident), or None
    (all on disk): timed alone just before a later forward, it is the compute floor of that
    minute, on the same memory the forward computes from."""
    from bigviz.core.devicemap import device_of

    for i, block in enumerate(model.transformer.h):
        where = device_of(f"transformer.h.{i}", device_map)
        if str(where) == "cpu" and all(p.device.type == "cpu" for p in block.parameters()):
            return block
    return None


def _dispatch(spec: dict[str, Any], model: Any) -> Any:
    budget = {"cpu": spec["budget"]} if spec.get("budget") else None
    device_map = {"": "disk"} if spec["map"] == "disk" else "auto"
    if spec["engine"] == "bigviz":
        import bigviz

        quantized = {"quantization": spec.get("quantization"), "offload_folder": spec["offload"]}
        if spec.get("quantized_dtype") == "bfloat16":  # int8 in bfloat16: torch's packed int8 kernel (Int8Linear)
            import torch

            quantized["dtype"] = torch.bfloat16
        return bigviz.load_checkpoint_and_dispatch(
            model,
            spec["ckpt"],
            device_map,
            max_memory=budget,
            resident=spec.get("resident", "auto"),
            **(quantized if spec.get("quantization") else {}),
        )
    import accelerate

    return accelerate.load_checkpoint_and_dispatch(
        model,
        str(Path(spec["ckpt"]) / "model.safetensors.index.json"),
        device_map=device_map,
        max_memory=budget,
        offload_folder=spec["offload"],
        no_split_module_classes=["Block"],
    )


def compute_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Seconds of one block's and of the head's forward on ``TOKENS`` tokens, weights in RAM;
    and the compute the block loses per byte read beside it (the checkpoint's shards read with
    ``O_DIRECT`` by the bench's readers, as the ring reads: ``MachineFacts.read_cost``)."""
    import torch

    from bigviz.models import GPTConfig
    from bigviz.models.gpt import Block

    config = GPTConfig(**spec["config"])
    torch.manual_seed(0)
    with torch.no_grad():
        block = Block(config, 0).eval()
        x = torch.randn(1, TOKENS, config.n_embd)
        block_s, block_best_s = _sustained(lambda: block(x), config.n_layer)  # a forward's worth
        read_cost = None
        if spec.get("ckpt"):  # what the ring's reads take from this compute (bigviz.modeling.read_cost)
            from bigviz.modeling.read_cost import measure_read_cost

            files = [str(f) for f in shard_files(Path(spec["ckpt"]))]
            read_cost = measure_read_cost(block, x, files=files, readers=spec.get("readers", 4), repeat=5)
        block = None  # its weights freed before the head is made
        head = torch.nn.Linear(config.n_embd, config.vocab_size, bias=False)
        head_s = _best(lambda: head(x))
    out = {"block_s": block_s, "block_best_s": block_best_s, "head_s": head_s, "threads": torch.get_num_threads()}
    if read_cost is not None:
        out["read_cost"] = read_cost
    return out


def _sustained(fn: Any, runs: int) -> tuple[float, float]:
    """Seconds per call of ``fn`` run ``runs`` times back to back after a warm-up: the mean (what
    a forward of that many blocks gets from the machine in that minute) and the best run. The
    compute floor takes the mean: the best of 3 runs of one block, scaled to a forward, caught
    the machine's fastest half second and set the floor of the same minute up to a third apart
    from one forward to the next (7.4 s and 9.9 s at 2/3 of the RAM, 32.1 GB, 2026-12-03)."""
    fn()
    times = []
    for _ in range(max(1, runs)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sum(times) / len(times), min(times)


def _best(fn: Any, repeat: int = 3) -> float:
    """Seconds of the best of ``repeat`` runs of ``fn`` after a warm-up."""
    return _sustained(fn, repeat)[1]


def run_child(spec: dict[str, Any], *, timeout: float) -> dict[str, Any]:
    """Run one scenario in a fresh process, killing it if the machine runs low on memory."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=HERE.parent,
    )
    guard = _Guard(proc)
    guard.start()
    start = time.perf_counter()
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s", "failed_after_s": time.perf_counter() - start}
    finally:
        guard.stop()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if guard.killed:
        return {
            "error": f"killed by the bench's memory guard (MemAvailable < 1 GiB) at {guard.anon / GiB:.1f} GiB RssAnon",
            "failed_after_s": time.perf_counter() - start,
            "anon_peak": guard.anon,
        }
    if proc.returncode != 0 or not lines:
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        why = ""
        if proc.returncode == -7:  # SIGBUS: a memory-mapped file could not be backed
            why = (
                f"SIGBUS (a memory-mapped file could not be written or read: the disk full? "
                f"{shutil.disk_usage(HERE).free / 1e9:.1f} GB free now); "
            )
        return {"error": f"exit {proc.returncode}: {why}{last[:200]}", "failed_after_s": time.perf_counter() - start}
    return json.loads(lines[-1])


class _Guard(threading.Thread):
    """Kills the child when MemAvailable falls under GUARD_BYTES; records its RssAnon."""

    def __init__(self, proc: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.proc, self.killed, self.anon = proc, False, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.25):
            self.anon = max(self.anon, _proc_anon(self.proc.pid))
            if _mem_available() < GUARD_BYTES and self.proc.poll() is None:
                self.killed = True
                self.proc.kill()
                return

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 2**62


def _proc_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fractions(text: str) -> list[tuple[str, Fraction]]:
    """``"0,1/4,1/2,2/3"`` -> labels and fractions of the RAM (checked: 0 <= f < 1)."""
    out = []
    for label in (t.strip() for t in text.split(",") if t.strip()):
        value = Fraction(label)
        if not 0 <= value < 1:
            raise SystemExit(f"bench/beyond_ram.py: --fractions {label!r}: give fractions of the RAM in [0, 1)")
        out.append((label, value))
    return out


def split_scenarios(text: str, shape: Shape) -> dict[str, dict[str, Any]]:
    """The scenarios of one size: bigviz at each resident split (the 'cpu' budget a fraction of
    the RAM; 0: ``{"": "disk"}``), then accelerate at 2/3 (its own offload folder)."""
    scenarios: dict[str, dict[str, Any]] = {}
    for label, value in fractions(text):
        if value == 0:
            scenarios["bigviz all-disk"] = {"engine": "bigviz", "map": "disk", "paired": True, "fraction": "0"}
        else:
            name = "bigviz auto" if label == "2/3" else f"bigviz auto {label}"
            budget = int(shape.ram * value)
            scenarios[name] = {"engine": "bigviz", "map": "auto", "paired": True, "budget": budget, "fraction": label}
    scenarios["accelerate auto"] = {"engine": "accelerate", "map": "auto", "fraction": "2/3"}
    return scenarios


# --------------------------------------------------------------------------- report
def split_bytes(shape: Shape, device_map: dict[str, str]) -> tuple[int, int, list[tuple[str, int, str]]]:
    """(resident, streamed, units in execution order) of a device map over this GPT."""
    from bigviz.core.devicemap import device_of

    units = [("transformer.wte", shape.embedding_bytes, "wte")]
    units += [(f"transformer.h.{i}", shape.block_bytes, "block") for i in range(shape.n_layer)]
    units.append(("lm_head", 0, "head"))  # tied to wte: nothing more to read
    resident = streamed = 0
    placed = []
    for name, nbytes, kind in units:
        where = str(device_of(name + ".weight", device_map) or device_of(name, device_map) or "cpu")
        placed.append((kind, nbytes if where == "disk" else 0, where))
        if where == "disk":
            streamed += nbytes
        else:
            resident += nbytes
    return resident, streamed, placed


def predict(
    shape: Shape,
    device_map: dict[str, str],
    compute: dict[str, float],
    bandwidth: float,
    depth: int = 2,
    ring: int | None = None,
) -> Any:
    """bigviz.core.cost's prediction of a later forward, at the floor's bandwidth, with the
    engine's read-ahead (its ring's bytes when the CPU streams, else ``depth`` units) and the
    compute the reads take (``compute["read_cost"]``, where measured)."""
    from bigviz.core.cost import UnitCost, predict_forward

    resident, _, placed = split_bytes(shape, device_map)
    seconds = {"wte": 0.0, "block": compute["block_s"], "head": compute["head_s"]}
    units = [UnitCost(kind, read_bytes=nbytes, compute_seconds=seconds[kind]) for kind, nbytes, _ in placed]
    return predict_forward(
        units,
        disk_bandwidth=bandwidth,
        depth=depth,
        resident_bytes=resident,
        ring=ring,
        read_cost=compute.get("read_cost", 0.0),
    )


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.0f} MB"


def fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def ratio(num: float | None, den: float | None) -> str:
    return "-" if not num or not den else f"{num / den:.2f}x"


def best_floor(floor: dict[str, Any]) -> float | None:
    """Seconds of the faster whole read at the start of the run (buffered or O_DIRECT)."""
    found = [floor[k]["seconds"] for k in ("parallel", "direct") if k in floor]
    return min(found) if found else None


def report(
    shape: Shape,
    floor: dict[str, Any],
    results: dict[str, dict[str, Any]],
    compute: dict[str, Any],
    info: dict[str, Any],
) -> str:
    best = best_floor(floor)
    bandwidth = shape.model_bytes / best if best else None
    lines = [
        _header(shape, info),
        "",
        "| measurement | time | / floor | anonymous RAM peak | notes |",
        "|---|---|---|---|---|",
    ]
    lines += _floor_rows(floor, shape, info["readers"], best)
    for name, r in results.items():
        lines += _scenario_rows(name, r, shape, best, bandwidth, compute, floor.get("probe"))
    lines += ["", *_goals(shape, results, best, bandwidth, compute)]
    lines += ["", *splits_table(shape, results, compute, bandwidth, best)]
    return "\n".join(lines)


def timeline_svg(data: dict[str, Any], title: str, *, width: int = 900) -> str:
    """One forward's timeline (``_timeline_data``) as an SVG picture: a row of reads and a row of
    computes, a bar per streamed unit (resident blocks compute in the gaps of the lower row),
    compute waiting on reads in red."""
    seconds = max(data["seconds"], 1e-9)
    left, right, row = 70, 10, 26
    scale = (width - left - right) / seconds

    def bar(t0: float, t1: float, y: int, colour: str, tip: str) -> str:
        x, w = left + t0 * scale, max(1.0, (t1 - t0) * scale)
        return (
            f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 6}" fill="{colour}"><title>{tip}</title></rect>'
        )

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{3 * row + 40}" font-family="sans-serif" font-size="12">',
        f'<text x="{left}" y="14">{title}</text>',
        f'<text x="4" y="{20 + row - 10}">disk</text><text x="4" y="{20 + 2 * row - 10}">compute</text>',
    ]
    for u in data["units"]:
        for a, b in u.get("pieces") or ([u["read"]] if u["read"] is not None else []):
            if b > 0:
                parts.append(bar(max(0.0, a), b, 20, "#4a7ebb", f"read {u['name']}: {max(0.0, a):.2f}-{b:.2f} s"))
        if u["compute"][0] - u["wait"] > 1e-3:
            parts.append(bar(u["wait"], u["compute"][0], 20 + row, "#d9534f", f"{u['name']} waits on its read"))
        parts.append(bar(*u["compute"], 20 + row, "#5cb85c", f"compute {u['name']}"))
    for t in range(int(seconds) + 1):
        x = left + t * scale
        parts.append(f'<text x="{x:.0f}" y="{20 + 3 * row}" text-anchor="middle">{t} s</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def compute_floor(shape: Shape, compute: dict[str, float]) -> float:
    """Seconds of the whole forward with every weight in RAM: every block and the head."""
    return shape.n_layer * compute["block_s"] + compute["head_s"]


def same_minute(shape: Shape, r: dict[str, Any], compute: dict[str, Any]) -> list[dict[str, float]]:
    """Each later forward of a split against its limit and prediction at the disk's speed of the
    same minute (its streamed part read cold with O_DIRECT just before it) and, where a block
    stays resident, at the compute speed of the same minute (that block run alone just before
    it, as many times as the model has blocks; else the run's compute floor): seconds,
    bandwidth, compute floor, limit, predicted."""
    _, streamed, _ = split_bytes(shape, r["map"])
    out = []
    for key in ("next_s", "third_s"):
        paired = r.get(key[:-2] + "_floor_s")
        if key not in r or not compute:
            continue
        if not paired or not streamed:  # nothing streamed: compute alone sets the limit
            bandwidth = 1e12
        else:
            bandwidth = streamed / paired
        now = {**compute, "block_s": r.get(key[:-2] + "_block_s") or compute["block_s"]}
        guess = predict(shape, r["map"], now, bandwidth, r.get("depth", 2), r.get("ring"))
        out.append(
            {
                "seconds": r[key],
                "bandwidth": bandwidth,
                "compute": compute_floor(shape, now),
                "limit": guess.limit_seconds,
                "predicted": guess.seconds,
            }
        )
    return out


def splits_table(
    shape: Shape,
    results: dict[str, dict[str, Any]],
    compute: dict[str, Any],
    bandwidth: float | None,
    best: float | None,
) -> list[str]:
    """Each split's later forwards against their limit (bigviz.core.cost: the longer of reading
    the streamed bytes at the disk's speed and the compute floor, plus what cannot overlap) and
    against the prediction (the same model with the engine's ring), with the disk's speed of
    the run's start and of the same minute (a cold O_DIRECT read of the streamed part just
    before each forward); where the time went (the timeline of the next forward: compute
    waiting on reads, the disk idle)."""
    if not compute or not bandwidth:
        return ["(no split table: the compute floor or the read floor was not measured)"]
    lines = [
        f"### Splits, {gb(shape.model_bytes)}, {shape.model_bytes / shape.ram:.2f}x the RAM",
        "",
        "The compute floor "
        f"(one block in RAM, {TOKENS} tokens, {compute.get('threads', '?')} threads, run {shape.n_layer} times back "
        f"to back, a forward's worth: {compute['block_s']:.2f} s per block{_best_note(compute)}) is "
        f"{compute_floor(shape, compute):.1f} s per forward; the read "
        f"floor at the run's start {bandwidth / 1e9:.2f} GB/s. Limit = the cost model's forward with reads ahead "
        "without bound; *same minute*: at the speed the disk read the streamed part cold (O_DIRECT, as the ring "
        "reads) just before each forward, and the whole checkpoint just after the third forward, and at the "
        "compute speed of a resident block run alone just before each forward (as many times as the model has "
        "blocks; all-disk: the run's floor). Two later forwards per split: the worse ratio is shown.",
        "",
        "| split: cpu budget | resident | streamed | compute floor: start / same minute | disk: start / same minute "
        "| limit: start / "
        "same minute | predicted (same minute) | measured (later) | / limit (same minute) | / predicted "
        "| compute waited | disk idle | first + dispatch / whole read: start / same minute | fresh memory: "
        "resident + ring, same minute; cores: it + compute | first + dispatch / first limit | RAM peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if r.get("engine") == "accelerate" or name.startswith("accelerate") or "next_s" not in r:
            continue
        if "streamed_bytes" in r:  # quantized: its own lines under the goals
            continue
        resident, streamed, _ = split_bytes(shape, r["map"])
        at_start = predict(shape, r["map"], compute, bandwidth, r.get("depth", 2), r.get("ring"))
        rows = same_minute(shape, r, compute)
        worst = max(rows, key=lambda x: x["seconds"] / x["limit"])
        off = max(rows, key=lambda x: abs(x["seconds"] / x["predicted"] - 1))
        line = r.get("timeline", {}).get("summary", {})
        budget = "all disk" if r.get("fraction") == "0" else f"{r.get('fraction', '2/3')} of RAM"
        first = r["first_s"] + r["dispatch_s"]
        limit = first_limit(shape, r, compute)
        floors = fmt_s(compute_floor(shape, compute))
        if any(r.get(k) for k in ("next_block_s", "third_block_s")):
            floors += " / " + ", ".join(fmt_s(x["compute"]) for x in rows)
        disk = f"{bandwidth / 1e9:.2f} / " + (
            "-" if not streamed else ", ".join(f"{x['bandwidth'] / 1e9:.2f}" for x in rows)
        )
        lines.append(
            f"| {budget} | {gb(resident)} | {gb(streamed)} | {floors} | {disk} GB/s | "
            f"{fmt_s(at_start.limit_seconds)} / {', '.join(fmt_s(x['limit']) for x in rows)} "
            f"({at_start.bottleneck}) | {', '.join(fmt_s(x['predicted']) for x in rows)} | "
            f"{', '.join(fmt_s(x['seconds']) for x in rows)} | **{ratio(worst['seconds'], worst['limit'])}** | "
            f"{ratio(off['seconds'], off['predicted'])} | {fmt_s(line.get('wait'))} | "
            f"{fmt_s(line.get('disk_idle'))} | {ratio(first, best)} / **{ratio(first, r.get('first_floor_s'))}** | "
            f"{_memory_cell(limit)} | **{ratio(first, limit['limit'] if limit else None)}** | "
            f"{r['anon_peak'] / GiB:.2f} GiB |"
        )
    lines += [
        "",
        "Goals (issue 26): later forwards at most 1.1x the limit; prediction within 15% of the "
        "measurement; first forward with dispatch at most 1.15x the whole-checkpoint read floor. "
        "Where a forward misses its limit, the timeline says why: compute waiting on reads (the schedule), "
        "or the streamed blocks' compute slower than the compute floor (the machine: contention, "
        "reader threads on the compute cores, cold memory). The first forward also makes the resident "
        "part and the ring out of memory the process has not touched: *fresh memory* is the time this "
        "machine took to hand over that much (faulted in by 2 threads, no disk: the sample taken just before "
        "the dispatch at its rate, the rest at the rate of a sample taken after the forwards, the model held, "
        "once the dispatch had taken the pages the machine still had warm) and the cores that kept busy. On this "
        "VM that is CPU work on the cores the forward "
        "computes on, so the cores need the fresh memory's work plus the forward's compute (*cores*); the "
        "*first limit* is the longer of that and the whole read (the disk and the cores overlap, neither can "
        "be skipped).",
    ]
    return lines


def _best_note(compute: dict[str, Any]) -> str:
    """The best single run beside the mean, where it was recorded."""
    best = compute.get("block_best_s")
    return f"; the best run {best:.2f} s" if best else ""


def _memory_cell(limit: dict[str, float] | None) -> str:
    if not limit:
        return "-"
    cell = f"{gb(limit['made'])} at {limit['rate'] / 1e9:.2f} GB/s: {fmt_s(limit['memory'])}"
    if limit.get("busy"):
        cell += f" on {limit['busy']:.1f} cores; + compute {fmt_s(limit['compute'])}: cores {fmt_s(limit['cpu'])}"
    return cell


def _first_cpu(r: dict[str, Any]) -> str:
    """How busy the process kept the cores through the dispatch + first forward."""
    cpu, cores = r.get("first_cpu_s"), r.get("cores")
    if not cpu or not cores:
        return ""
    first = r["first_s"] + r["dispatch_s"]
    return f"; the process used {cpu / first:.1f} of {cores} cores through it ({cpu:.0f} CPU-seconds)"


def _header(shape: Shape, info: dict[str, Any]) -> str:
    return (
        f"## Larger than RAM (`python bench/beyond_ram.py{info['argv']}`, {info.get('date', datetime.date.today())})\n\n"
        f"bigviz GPT, n_embd {shape.n_embd}, {shape.n_layer} blocks of {gb(shape.block_bytes)} + "
        f"embeddings {gb(shape.embedding_bytes)}: {gb(shape.model_bytes)} fp32, "
        f"{shape.model_bytes / shape.ram:.2f}x the RAM ({shape.ram / GiB:.1f} GiB"
        f'{", pretend: --small" if info["small"] else ""}); cpu budget for "auto": '
        f"{shape.cpu_budget / GiB:.1f} GiB (2/3 of RAM). {TOKENS}-token forwards. {_cache_note(info)} Checkpoint {'written in ' + format(info['build_s'], '.0f') + ' s' if info['build_s'] else 'reused'}. "
        f"Load average (1/5/15 min) at the start: {info['load_start']}, at the end: {info['load_end']}."
    )


def _cache_note(info: dict[str, Any]) -> str:
    """How the page cache was before each line: dropped, or (``--memory in-use``) the
    checkpoint's pages evicted and the rest of the RAM holding a filler."""
    if info.get("memory") != "in-use":
        return f"Page cache dropped ({info['drop']}) before each line."
    refills = info.get("refills") or [{"nbytes": 0, "seconds": 0.0}]
    most = max(r["nbytes"] for r in refills)
    took = ", ".join(f"{r['seconds']:.0f}" for r in refills)
    return (
        "A machine in use (`--memory in-use`, bench/in_use.py): before each line the checkpoint's own pages "
        f"evicted, then a {gb(info.get('filler_bytes', most))} filler file the scenarios never read read through "
        f"the page cache ({took} s), so the memory a scenario gets is reclaimed page cache, not pages this VM "
        "had handed back to its host."
    )


def _floor_rows(floor: dict[str, Any], shape: Shape, readers: int, best: float | None) -> list[str]:
    rows = []
    labels = {
        "parallel": f"all shards, {readers} parallel readers, buffered (best of two)",
        "direct": f"all shards, {readers} readers in the ring's order, O_DIRECT (best of two)",
        "sequential": "one sequential reader",
    }
    probe = floor.get("probe")
    if probe:
        rows.append(
            f"| bigviz disk probe: {probe['sample_bytes'] >> 20} MiB by 1 reader, then by {readers} "
            f"({probe['method']}, {probe['chunk_bytes'] >> 20} MiB requests) | {fmt_s(probe['seconds'])} | - | - | "
            f"{probe['sequential'] / 1e9:.2f} GB/s with 1 reader, {probe['parallel'] / 1e9:.2f} GB/s with "
            f"{readers}: {probe['parallel'] * best / shape.model_bytes if best else 0:.2f}x the floor's |"
        )
    for key, label in labels.items():
        if key not in floor:
            if key + "_error" in floor:
                rows.append(f"| {label} | - | - | - | {floor[key + '_error']} |")
            continue
        r = floor[key]
        what = "**read floor**: " if r["seconds"] == best else ""
        rows.append(
            f"| {what}{label} | {fmt_s(r['seconds'])} | {ratio(r['seconds'], best)} | - | "
            f"{r['bytes'] / r['seconds'] / 1e9:.2f} GB/s, CPU {r['cpu_seconds']:.1f} s |"
        )
    return rows


def _scenario_rows(
    name: str,
    r: dict[str, Any],
    shape: Shape,
    best: float | None,
    bandwidth: float | None,
    compute: dict[str, Any],
    probe: dict[str, Any] | None,
) -> list[str]:
    anon = f"{r['anon_peak'] / GiB:.2f} GiB" if "anon_peak" in r else "-"
    if "error" in r and "first_s" not in r:
        where = f"dispatch {fmt_s(r.get('dispatch_s'))}, then " if "dispatch_s" in r else ""
        return [
            f"| {name} | {fmt_s(r.get('failed_after_s'))} | {ratio(r.get('failed_after_s'), best)} | {anon} | "
            f"{where}failed in {r.get('phase', '?')}: `{r['error']}` |"
        ]
    resident, streamed, _ = split_bytes(shape, r.get("map", {}))
    if "streamed_bytes" in r:  # quantized: the packed bytes
        resident, streamed = r["resident_bytes"], r["streamed_bytes"]
    split = f"resident {gb(resident)}, streamed {gb(streamed)}"
    first = r["first_s"] + r["dispatch_s"]
    copy = r.get("copy")
    if copy:
        how = "O_DIRECT" if copy["direct"] == copy["bytes"] else f"{gb(copy['direct'])} of it O_DIRECT"
        split += f"; resident copy {copy['bytes'] / copy['seconds'] / 1e9:.2f} GB/s ({how})"
    whole = r.get("first_floor_s")
    if whole:
        split += f"; the whole checkpoint read cold after the forwards: {whole:.1f} s ({ratio(first, whole)})"
    if r.get("memory_rate"):
        split += f"; fresh memory faulted in just before the dispatch at {r['memory_rate'] / 1e9:.2f} GB/s"
    if r.get("memory_rate_after"):
        split += f", after the forwards (the model held) at {r['memory_rate_after'] / 1e9:.2f} GB/s"
    rows = [
        f"| {name}: dispatch + first forward | {fmt_s(first)} | {ratio(first, best)} | {anon} | "
        f"dispatch {fmt_s(r['dispatch_s'])}; {split} |"
    ]
    for key, label in (("next_s", "next forward"), ("third_s", "third forward")):
        if key in r:
            row = _later_row(name, label, r[key], r, shape, best, bandwidth, compute, probe, streamed)
            paired = r.get(key[:-2] + "_floor_s")
            if paired:  # the same bytes read cold just before this forward
                row = (
                    row[:-2]
                    + f"; the streamed part read cold just before it: {paired:.1f} s ({ratio(r[key], paired)}) |"
                )
            rows.append(row)
    return rows


def _later_row(
    name: str,
    label: str,
    seconds: float,
    r: dict[str, Any],
    shape: Shape,
    best: float | None,
    bandwidth: float | None,
    compute: dict[str, Any],
    probe: dict[str, Any] | None,
    streamed: int,
) -> str:
    floor_part = streamed / bandwidth if bandwidth else None
    note = f"read of the streamed part at the floor's speed: {fmt_s(floor_part)} ({ratio(seconds, floor_part)})"
    if "streamed_bytes" in r:  # packed weights: the compute measured is float32's, no prediction made from it
        note += "; not predicted (the bench measures float32's block compute, not the packed block's)"
    elif compute and bandwidth:
        depth, ring = r.get("depth", 2), r.get("ring")
        guess = predict(shape, r["map"], compute, bandwidth, depth, ring)
        ahead = f"a {ring / GiB:.2f} GiB ring" if ring else f"{depth} unit(s) read ahead"
        note += (
            f"; predicted {guess.seconds:.1f} s ({guess.bottleneck}-bound, {ahead}) "
            f"at the floor's bandwidth ({ratio(seconds, guess.seconds)} of it)"
        )
        if probe:
            at_probe = predict(shape, r["map"], compute, probe["parallel"], depth, ring).seconds
            note += f", {at_probe:.1f} s at the probe's"
    stolen = r.get(("next" if label == "next forward" else "third") + "_steal_s")
    if stolen:  # a forward slower than its limit, with the host taking CPU meanwhile, says so
        note += f"; the host took {stolen:.1f} s of CPU (steal) during it"
    return f"| {name}: {label} | {fmt_s(seconds)} | {ratio(seconds, best)} | | {note} |"


def _goals(
    shape: Shape,
    results: dict[str, dict[str, Any]],
    best: float | None,
    bandwidth: float | None,
    compute: dict[str, Any],
) -> list[str]:
    lines = []
    for name, r in results.items():  # every split: the goals of issue 26, at the disk's speed of the same minute
        if not name.startswith("bigviz") or "streamed_bytes" in r or "next_s" not in r:
            continue
        parts = []
        rows = same_minute(shape, r, compute) if compute else []
        if rows:
            parts.append(
                "later forwards / limit (same minute): "
                + ", ".join(f"**{ratio(x['seconds'], x['limit'])}**" for x in rows)
                + " (goal <= 1.1x); / predicted: "
                + ", ".join(f"{ratio(x['seconds'], x['predicted'])}" for x in rows)
                + " (goal 0.87-1.15x)"
            )
        first = r["first_s"] + r["dispatch_s"]
        limit = first_limit(shape, r, compute)
        parts.append(
            f"dispatch + first forward / whole read: {ratio(first, best)} of the run's floor, "
            f"**{ratio(first, r.get('first_floor_s'))}** of the same minute's (goal <= 1.15x)"
            + (
                f", / the first limit (the longer of that read and the cores' work: {fmt_s(limit['memory'])} to make "
                f"{gb(limit['made'])} of fresh memory"
                + (
                    f" on {limit['busy']:.1f} cores + {fmt_s(limit['compute'])} of compute, {fmt_s(limit['cpu'])} "
                    "on the machine's cores"
                    if limit.get("busy")
                    else ""
                )
                + f"): **{ratio(first, limit['limit'])}**"
                if limit
                else ""
            )
            + _first_cpu(r)
        )
        budget = int(shape.ram * Fraction(r.get("fraction", "2/3")))  # the split's cpu budget (0: all-disk)
        room = budget + (r.get("ring") or 0) + GiB
        parts.append(
            f"anonymous RAM peak {r['anon_peak'] / GiB:.2f} GiB against the cpu budget + the ring + 1 GiB = "
            f"{room / GiB:.2f} GiB: {'met' if r['anon_peak'] <= room else 'not met'}"
        )
        lines.append(f"- {name}: " + "; ".join(parts))
    lines += _quantized_goals(results, bandwidth, compute, shape)
    if compute:
        lines.append(
            f"- compute, weights in RAM: one block {compute['block_s'] * 1e3:.0f} ms, the head "
            f"{compute['head_s'] * 1e3:.0f} ms; all blocks + head "
            f"{(shape.n_layer * compute['block_s'] + compute['head_s']):.1f} s per forward"
            + (
                f"; beside the ring's reads a block loses {compute['read_cost'] * 1e9:.3f} s of compute per GB "
                "read (bigviz.modeling.read_cost; the prediction counts it, the limit does not)"
                if "read_cost" in compute
                else ""
            )
        )
    return lines


def _quantized_goals(
    results: dict[str, dict[str, Any]], bandwidth: float | None, compute: dict[str, Any], shape: Shape
) -> list[str]:
    """Issue 25: later forwards with packed weights against float32's, and against the time to
    read the packed bytes at the floor's speed (or the compute, when slower)."""
    lines = []
    for name, r in results.items():
        base = results.get(name.rsplit(" ", 1)[0], {})
        if "streamed_bytes" not in r or "next_s" not in r:
            continue
        later = max(r[k] for k in ("next_s", "third_s") if k in r)
        if "next_s" in base:
            ratio_fp32 = later / max(base[k] for k in ("next_s", "third_s") if k in base)
            lines.append(f"- {name}, slower later forward / float32's: **{ratio_fp32:.2f}x** (goal <= 0.35x)")
        if bandwidth:
            read = r["streamed_bytes"] / bandwidth
            work = shape.n_layer * compute.get("block_s", 0) + compute.get("head_s", 0) if compute else 0.0
            lines.append(
                f"- {name}, slower later forward / max(read the packed {gb(r['streamed_bytes'])} at the floor's "
                f"speed {read:.1f} s, float32 compute {work:.1f} s): **{later / max(read, work):.2f}x** (goal <= 1.1x)"
            )
    return lines


# ------------------------------------------------------------------------------ main
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ram-multiple", type=float, default=1.25, help="model size / RAM (default 1.25)")
    parser.add_argument("--size", help="model size instead (e.g. 30GB); skips if the disk lacks 2.5x")
    parser.add_argument("--n-embd", type=int, default=6144, help="width (blocks of 48 x n_embd^2 bytes)")
    parser.add_argument(
        "--small", action="store_true", help="pretend RAM of --small-ram (240MB): models of 300 and 480 MB"
    )
    parser.add_argument("--small-ram", default="240MB", help="the pretend RAM of --small (e.g. 2GB for a moderate run)")
    parser.add_argument(
        "--small-n-embd", type=int, default=512, help="width of --small's GPT (blocks of 48 x n_embd^2 bytes)"
    )
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help="model sizes as multiples of the RAM, measured one after the other"
    )
    parser.add_argument(
        "--fractions",
        default="0,1/4,1/2,2/3",
        help="resident splits: the 'cpu' budget as a fraction of the RAM (0: all-disk)",
    )
    parser.add_argument("--readers", type=int, default=4, help="parallel readers for the floor")
    parser.add_argument("--drop", choices=["auto", "global", "files"], default="auto")
    parser.add_argument(
        "--memory",
        choices=["dropped", "in-use"],
        default="dropped",
        help="in-use: evict only the checkpoint's pages and refill the page cache with a filler file "
        "before each scenario (a machine in use, bench/in_use.py); recorded apart (default: dropped)",
    )
    parser.add_argument("--work", type=Path, default=WORK, help="where the checkpoint goes")
    parser.add_argument("--keep", action="store_true", help="(the default now) keep the checkpoint")
    parser.add_argument("--delete", action="store_true", help="delete the checkpoint at the end")
    parser.add_argument("--build-only", action="store_true", help="make the checkpoint (kept), measure nothing")
    parser.add_argument("--skip", action="append", default=[], choices=["accelerate", "floor", "compute"])
    parser.add_argument("--timeout", type=float, default=900, help="seconds a scenario may take")
    parser.add_argument("--full-floor", action="store_true", help="also time one sequential reader and O_DIRECT")
    parser.add_argument("--rebuild", action="store_true", help="build the checkpoint again for this machine's RAM")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        choices=["disk", "auto", "accelerate", "quantized", "0", "1/4", "1/2", "2/3"],
        help="run only these scenarios (repeatable; disk = 0, auto = 2/3)",
    )
    parser.add_argument(
        "--quantize", choices=["int8", "int4"], help="also run bigviz all-disk and 2/3 with quantized weights"
    )
    parser.add_argument(
        "--quantized-dtype",
        choices=["float32", "bfloat16"],
        default="bfloat16",
        help="what the quantized runs compute in (default bfloat16: int8 runs torch's packed int8 kernel)",
    )
    parser.add_argument(
        "--no-results", action="store_true", help="do not record the results (bench/results/, bench/RESULTS.md)"
    )
    parser.add_argument("--report", type=Path, help="print the report of a saved run (its -results.json)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args()


def folder_for(args: argparse.Namespace) -> Path:
    """The checkpoint's folder: one per size (1.25x RAM keeps the name earlier runs used)."""
    name = "beyond-ram-small" if args.small else "beyond-ram"
    if args.size:
        return args.work / f"{name}-{args.size}"
    return args.work / (name if args.ram_multiple == 1.25 else f"{name}-{args.ram_multiple:g}x")


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.report:
        raw = json.loads(args.report.read_text())
        print(report(Shape(**raw["shape"]), raw["floor"], raw["results"], raw["compute"], raw["info"]))
        return
    sizes = [None] if args.size else [float(x) for x in args.sizes.split(",")]
    texts, measured = {}, False
    for i, multiple in enumerate(sizes):
        if multiple is not None:
            args.ram_multiple = multiple
        text = measure_size(args, first=i == 0, more=sizes[i + 1 :])
        if text:
            print(text)
            texts[multiple or 0.0] = text
            measured |= not text.endswith(SKIPPED)
    if measured and not (
        args.small or args.no_results or args.build_only
    ):  # its section replaced, the old one kept in the diary
        sys.path.insert(0, str(HERE))
        import records

        if not args.size:  # a size not measured now (not asked for, or skipped: no disk room) keeps its last table
            kept = kept_sizes(args)
            for m, t in kept.items():
                if m not in texts:
                    texts[m] = t
                elif texts[m].endswith(SKIPPED):
                    texts[m] = texts[m][: -len(SKIPPED)] + "\n\n" + t
        section = "\n\n".join(texts[m] for m in sorted(texts))
        name, note = _record(args)
        records.write_section(name, section, note=note)
        records.assemble()
        shown = [p for p in PICTURES if p.name.endswith("-timeline-2of3.svg")] or PICTURES
        if shown and not _tag(
            args
        ):  # the README's picture: the first size's 2/3 split (tests/test_readme.py checks it)
            shutil.copyfile(shown[0], HERE.parent / "docs" / "larger-than-ram-run.svg")


def kept_sizes(args: argparse.Namespace) -> dict[float, str]:
    """The report of each of the default sizes (``--sizes``' default) from the raw figures of its
    last run (``bench/_work/beyond-ram*-results.json``), where one was kept: a run of one size
    records its own table and keeps the other's, marked as from that run."""
    out = {}
    for multiple in (float(x) for x in DEFAULT_SIZES.split(",")):
        folder = folder_for(argparse.Namespace(**{**vars(args), "ram_multiple": multiple}))
        path = folder.parent / f"{folder.name}{_tag(args)}-results.json"
        if not path.is_file():
            continue
        raw = json.loads(path.read_text())
        text = report(Shape(**raw["shape"]), raw["floor"], raw["results"], raw["compute"], raw["info"])
        out[multiple] = text.replace(
            "\n\n",
            f"\n\n(Kept from this size's last run, {raw['info'].get('date', 'date not recorded')}: not "
            f"measured again in this one; its raw figures in `bench/_work/{path.name}`.)\n\n",
            1,
        )
    return out


def measure_size(args: argparse.Namespace, *, first: bool, more: list[float | None]) -> str | None:
    """One model size: its checkpoint (built or reused), every split measured, the report. Its
    checkpoint is removed after (it was made here) when ``--delete``, or when the next size
    needs its room."""
    folder = folder_for(args)
    folder.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder.parent).free
    shape = choose_shape(args, free + _ours(folder))
    if isinstance(shape, str):
        print(f"bench/beyond_ram.py: {args.ram_multiple:g}x RAM skipped: {shape}")
        return f"### {args.ram_multiple:g}x the RAM: skipped\n\n{shape}{SKIPPED}"
    if not first:
        args.skip = [*args.skip, "accelerate"]  # accelerate once, at the first size
    try:
        return measure(args, shape, folder)
    finally:
        later = [m for m in more if m is not None]
        need = max((disk_need(_scaled(shape, m), accelerate=False) for m in later), default=0)
        if not args.build_only and (args.delete or need > shutil.disk_usage(folder.parent).free):
            if not args.delete:
                print(f"removing {folder} (made by this script): the next size needs its room", file=sys.stderr)
            _remove_ours(folder)


def _scaled(shape: Shape, multiple: float) -> Shape:
    """About the model of ``multiple`` times the same RAM (for the disk room it will need)."""
    n_layer = max(2, round((multiple * shape.ram - shape.embedding_bytes) / shape.block_bytes))
    return Shape(shape.n_embd, shape.n_head, n_layer, shape.vocab_size, shape.block_size, shape.ram)


def _ours(folder: Path) -> int:
    """Bytes of a checkpoint of ours already there (reused, so it needs no new room)."""
    return sum(p.stat().st_size for p in folder.glob("*") if p.is_file()) if folder.is_dir() else 0


def _tag(args: argparse.Namespace) -> str:
    """What the file names of a run carry after the checkpoint's folder name."""
    return "-in-use" if getattr(args, "memory", "dropped") == "in-use" else ""


def _record(args: argparse.Namespace) -> tuple[str, str]:
    """The record a run writes (``bench/results/<name>.md``) and the note in its stamp: in-use runs
    keep a record of their own (and leave the README's picture alone)."""
    if _tag(args):
        return "beyond_ram_in_use", "`python bench/beyond_ram.py --memory in-use`"
    return "beyond_ram", "`python bench/beyond_ram.py`"


def _filler(args: argparse.Namespace, info: dict[str, Any]) -> Path | None:
    """With ``--memory in-use``: the page-cache filler, written once (bench/in_use.py)."""
    if _tag(args) == "":
        return None
    if args.small:
        raise SystemExit("bench/beyond_ram.py: --memory in-use fills this machine's real RAM: not with --small")
    if getattr(args, "drop", "auto") == "global":
        raise SystemExit(
            "bench/beyond_ram.py: --memory in-use evicts only the checkpoint's pages (a global drop would "
            "empty the page cache it fills): leave out --drop global"
        )
    from in_use import prepare

    try:
        path, info["filler_write_s"] = prepare(args.work, machine_ram())
    except OSError as err:
        raise SystemExit(f"bench/beyond_ram.py --memory in-use: {err.strerror or err}") from err
    info["filler_bytes"] = path.stat().st_size
    return path


def measure(args: argparse.Namespace, shape: Shape, folder: Path) -> str | None:
    info = {
        "small": args.small,
        "readers": args.readers,
        "memory": args.memory,
        "drop": "files" if _tag(args) else drop_mode(args.drop, args.small),
        "load_start": load_average(),
        "argv": "".join(" " + a for a in sys.argv[1:]),
        "date": str(datetime.date.today()),
    }
    verb = "reusing" if _complete(folder, shape) else "building"
    print(f"{verb} {folder} ({shape.model_bytes / 1e9:.1f} GB, {shape.n_layer} blocks) ...", file=sys.stderr)
    info["build_s"] = build_checkpoint(shape, folder)
    if args.build_only:
        return None
    offload = folder.parent / "beyond-ram-offload"
    if offload.exists():  # each scenario's offload folder is removed after it: it must be new
        raise SystemExit(f"bench/beyond_ram.py: {offload} already exists: move it away (nothing was deleted)")
    files = shard_files(folder)
    filler = _filler(args, info)
    floor = {} if "floor" in args.skip else read_floor(files, args.readers, info["drop"], full=args.full_floor)
    spec = {
        "config": shape.config().to_dict(),
        "ckpt": str(folder),
        "budget": shape.cpu_budget,
        "offload": str(folder.parent / "beyond-ram-offload"),
        "resident": "copy" if args.small else "auto",
        "drop": info["drop"],
        "readers": args.readers,
    }  # --small: the pretend RAM is smaller than the model
    spec["config"].pop("model_type", None)
    compute = {} if "compute" in args.skip else run_child({**spec, "engine": "compute"}, timeout=args.timeout)
    scenarios = split_scenarios(args.fractions, shape)
    if args.quantize:  # the same bigviz runs, all-disk and 2/3, with packed weights (issue 25)
        for base in ("bigviz all-disk", "bigviz auto"):
            if base in scenarios:
                extra = {k: v for k, v in scenarios[base].items() if k != "paired"}
                suffix = args.quantize + ("-bf16" if args.quantized_dtype == "bfloat16" else "")
                scenarios[f"{base} {suffix}"] = {
                    **extra,
                    "quantization": args.quantize,
                    "quantized_dtype": args.quantized_dtype,
                }
    results = {}
    only = {{"disk": "0", "auto": "2/3"}.get(o, o) for o in args.only}
    for name, extra in scenarios.items():
        short = "accelerate" if extra["engine"] == "accelerate" else extra["fraction"]
        short = "quantized" if extra.get("quantization") else short
        if extra["engine"] in args.skip or (only and short not in only):
            continue
        free = shutil.disk_usage(folder.parent).free  # a shared disk: what others left now
        if extra["engine"] == "accelerate" and free < accelerate_copy(shape) * 1.1:
            results[name] = {
                "error": f"left out: it rewrites {gb(accelerate_copy(shape))} into its offload folder "
                f"and the disk has {gb(free)} free now",
                "failed_after_s": 0.0,
            }
            continue
        drop_caches(files, info["drop"])
        if filler is not None:  # the rest of the RAM: page cache again (what the last scenario freed)
            from in_use import refill

            filled = refill(filler)
            info.setdefault("refills", []).append({"nbytes": filled.nbytes, "seconds": filled.seconds})
        print(f"  {name} (load {load_average()}) ...", file=sys.stderr, flush=True)
        results[name] = {**run_child({**spec, **extra}, timeout=args.timeout), "fraction": extra["fraction"]}
        shutil.rmtree(spec["offload"], ignore_errors=True)  # made by this scenario (refused if there before)
        print(f"  {name}: { {k: v for k, v in results[name].items() if k != 'map'} }", file=sys.stderr, flush=True)
    info["load_end"] = load_average()
    compute = compute if "error" not in compute else {}
    raw = {"shape": shape.__dict__, "floor": floor, "results": results, "compute": compute, "info": info}
    for name, r in results.items():  # a picture of each split's next forward
        if "timeline" in r:
            title = f"{gb(shape.model_bytes)}, {name}: next forward {r['next_s']:.1f} s (green: streamed units compute)"
            label = r["fraction"].replace("/", "of") + (f"-{name.rsplit(' ', 1)[1]}" if "streamed_bytes" in r else "")
            svg = folder.parent / f"{folder.name}{_tag(args)}-timeline-{label}.svg"
            svg.write_text(timeline_svg(r["timeline"], title) + "\n")
            PICTURES.append(svg)
    (folder.parent / f"{folder.name}{_tag(args)}-results.json").write_text(json.dumps(raw, indent=1) + "\n")
    return report(shape, floor, results, compute, info)


if __name__ == "__main__":
    main()
