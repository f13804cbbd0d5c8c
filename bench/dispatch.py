"""Dispatch and offload speed on gpt2-large: bigviz against accelerate, side by side.

    python bench/dispatch.py           # ~5 minutes here; prints a markdown table and ratios
    python bench/dispatch.py --quick --rounds 1   # ~2 minutes: fewer tokens, one round

The checkpoint (bigviz GPT "gpt2-large", random weights, 500 MB safetensors shards) is built
once under bench/_work/gpt2-large and reused (bench/load.py uses the same folder). Every
scenario runs in a fresh subprocess, so dispatch times include nothing cached in-process
(the page cache stays warm, as on any machine that just read the files). On a shared
machine noise only adds time, so each fast scenario runs ``--rounds`` times (interleaved)
and the best figures are kept.

Scenarios (issue 4, item 11): half the blocks on disk (the last 18 of 36) against all in
RAM: load + dispatch time, greedy decode per token (batch 1, KV cache, 16 new tokens after
an 8-token prompt), one 128-token forward; prefetch on against off, also with the disk
blocks evicted from the page cache first (cold); peak RssAnon with everything on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
WORK = ROOT / "_work"
CKPT = WORK / "gpt2-large"
ACC_OFFLOAD = WORK / "accelerate-offload"
PRESET = "gpt2-large"
N_LAYER = 36

warnings.filterwarnings("ignore")


# ---------------------------------------------------------------------------- checkpoint
def ensure_checkpoint() -> Path:
    """Build the gpt2-large checkpoint once (random weights); reuse it when present."""
    if (CKPT / "model.safetensors.index.json").exists():
        return CKPT
    import torch

    from bigviz.checkpoint.save import save_sharded
    from bigviz.models import GPT, GPTConfig

    print(f"building {CKPT} (once) ...", file=sys.stderr)
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(PRESET))
    WORK.mkdir(parents=True, exist_ok=True)
    try:
        save_sharded(model.state_dict(), CKPT, max_shard_size="500MB", progress=False)
    except FileExistsError:  # bench/load.py built it meanwhile
        pass
    return CKPT


def device_map(kind: str) -> dict[str, str]:
    """ "ram": everything on the CPU; "half": the last half of the blocks on disk; "disk": all."""
    if kind == "disk":
        return {"": "disk"}
    dm = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.drop": "cpu"}
    for i in range(N_LAYER):
        dm[f"transformer.h.{i}"] = "disk" if kind == "half" and i >= N_LAYER // 2 else "cpu"
    dm.update({"transformer.ln_f": "cpu", "lm_head": "cpu"})
    return dm


# ------------------------------------------------------------------------- measurements
def decode(model: Any, *, prompt: int, steps: int) -> tuple[list[float], list[int]]:
    """Greedy decode with the KV cache; per-step seconds and the tokens made."""
    import torch

    from bigviz.models import KVCache

    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 50257, (1, prompt), generator=gen)
    times, tokens = [], []
    with torch.no_grad():
        cache = KVCache()
        logits, _ = model(idx, cache=cache)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            start = time.perf_counter()
            logits, _ = model(nxt, cache=cache)
            times.append(time.perf_counter() - start)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(nxt))
    return times, tokens


def forward_time(model: Any, tokens: int) -> float:
    import torch

    idx = torch.randint(0, 50257, (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        start = time.perf_counter()
        model(idx)
        return time.perf_counter() - start


def evict(ranges: list[tuple[Path, int, int]]) -> None:
    """Drop these byte ranges of files from the page cache (only our files: polite)."""
    for path, begin, length in ranges:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, begin, length, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------- child
def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One scenario in this (fresh) process; returns its figures."""
    import torch

    import bigviz
    from bigviz.modeling.process_memory import PeakMemory
    from bigviz.models import GPT, GPTConfig

    torch.manual_seed(0)
    with bigviz.init_empty_weights():
        model = GPT(GPTConfig.preset(PRESET))
    out: dict[str, Any] = {}
    with PeakMemory(("RssAnon",)) as peak:  # sampled every 2 ms
        start = time.perf_counter()
        model = _load(spec, model)
        out["dispatch_s"] = time.perf_counter() - start
        if spec.get("cold"):
            evict(_disk_ranges(spec, model))
            out["forward_s"] = forward_time(model, spec["forward_tokens"])
        else:
            times, tokens = decode(model, prompt=8, steps=spec["steps"])
            # best step: on a shared machine noise only ever adds time; the median is kept too
            out["token_s"], out["token_median_s"] = min(times), statistics.median(times)
            out["tokens"] = tokens
            out["forward_s"] = min(forward_time(model, spec["forward_tokens"]) for _ in range(spec["repeats"]))
    out["anon_above_base"] = peak.above()["RssAnon"]
    return out


def _load(spec: dict[str, Any], model: Any) -> Any:
    dm = device_map(spec["map"])
    if spec["engine"] == "bigviz":
        import bigviz

        return bigviz.load_checkpoint_and_dispatch(model, CKPT, dm, prefetch=spec.get("prefetch", True))
    import accelerate

    shutil.rmtree(ACC_OFFLOAD, ignore_errors=True)  # accelerate rewrites its offload every time
    return accelerate.load_checkpoint_and_dispatch(
        model,
        str(CKPT / "model.safetensors.index.json"),
        device_map=dm,
        offload_folder=str(ACC_OFFLOAD),
        no_split_module_classes=["Block"],
    )


def _disk_ranges(spec: dict[str, Any], model: Any) -> list[tuple[Path, int, int]]:
    """Byte ranges of what the scenario reads from disk: checkpoint ranges of the disk
    blocks (bigviz reads the checkpoint in place) or accelerate's offload files."""
    if spec["engine"] == "accelerate":
        return [(p, 0, 0) for p in ACC_OFFLOAD.rglob("*") if p.is_file()]
    from bigviz.checkpoint.index import CheckpointIndex

    disk = [k for k, v in device_map(spec["map"]).items() if v == "disk"]
    ranges = []
    for info in CheckpointIndex.open(CKPT).entries.values():
        if any(info.name == d or info.name.startswith(d + ".") for d in disk) and info.data_offsets:
            begin, end = info.data_offsets
            ranges.append((info.file, begin, end - begin))
    return ranges


# ------------------------------------------------------------------------------ parent
def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one scenario in a fresh subprocess; a failure is reported, not raised."""
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, cwd=ROOT.parent
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": error[:160]}
    return json.loads(lines[-1])


def scenarios(quick: bool) -> dict[str, dict[str, Any]]:
    common = {"steps": 8 if quick else 16, "forward_tokens": 128, "repeats": 1 if quick else 2}
    specs = {
        "bigviz RAM": {"engine": "bigviz", "map": "ram"},
        "bigviz half-disk": {"engine": "bigviz", "map": "half"},
        "bigviz half-disk, prefetch off": {"engine": "bigviz", "map": "half", "prefetch": False},
        "bigviz half-disk cold": {"engine": "bigviz", "map": "half", "cold": True},
        "bigviz half-disk cold, prefetch off": {"engine": "bigviz", "map": "half", "cold": True, "prefetch": False},
        "bigviz all-disk": {"engine": "bigviz", "map": "disk"},
        "accelerate RAM": {"engine": "accelerate", "map": "ram"},
        "accelerate half-disk": {"engine": "accelerate", "map": "half"},
        "accelerate half-disk cold": {"engine": "accelerate", "map": "half", "cold": True},
        "accelerate all-disk": {"engine": "accelerate", "map": "disk"},
    }
    if quick:
        for name in ("accelerate all-disk", "accelerate half-disk cold"):
            del specs[name]
    return {name: {**common, **spec} for name, spec in specs.items()}


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Best time of each figure over runs (noise only adds time); the highest memory peak."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    merged = dict(ok[0])
    for key in ("dispatch_s", "token_s", "token_median_s", "forward_s"):
        values = [r[key] for r in ok if key in r]
        if values:
            merged[key] = min(values)
    merged["anon_above_base"] = max(r["anon_above_base"] for r in ok)
    return merged


def fmt(value: Any, unit: str = "s") -> str:
    if value is None:
        return "-"
    if unit == "ms":
        return f"{value * 1000:.0f} ms"
    if unit == "GB":
        return f"{value / 1e9:.2f} GB"
    return f"{value:.2f} s"


def report(results: dict[str, dict[str, Any]], model_bytes: int) -> None:
    print(
        "| scenario | load + dispatch | decode / token, best (median) | 128-token forward | "
        "peak RssAnon above runtime | tokens |"
    )
    print("|---|---|---|---|---|---|")
    reference = results.get("bigviz RAM", {}).get("tokens")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error']} | | | | |")
            continue
        same = "-" if "tokens" not in r else ("same" if r["tokens"] == reference else "DIFFERENT")
        token = fmt(r.get("token_s"), "ms")
        if r.get("token_median_s") is not None:
            token += f" ({fmt(r['token_median_s'], 'ms')})"
        print(
            f"| {name} | {fmt(r.get('dispatch_s'))} | {token} | "
            f"{fmt(r.get('forward_s'))} | {fmt(r.get('anon_above_base'), 'GB')} | {same} |"
        )
    print()
    ratios(results, model_bytes)


def ratios(results: dict[str, dict[str, Any]], model_bytes: int) -> None:
    def get(name: str, key: str) -> float | None:
        return results.get(name, {}).get(key)

    def line(label: str, num: float | None, den: float | None, goal: str) -> None:
        value = "-" if num is None or not den else f"{num / den:.2f}x"
        print(f"- {label}: **{value}** (goal {goal})")

    in_ram = [t for t in (get("bigviz RAM", "token_s"), get("accelerate RAM", "token_s")) if t]
    ram = min(in_ram) if in_ram else None  # the faster all-in-RAM run: the stricter reference
    line(
        "bigviz half-disk decode / all-in-RAM decode (best RAM engine)",
        get("bigviz half-disk", "token_s"),
        ram,
        "<= 1.2x",
    )
    line("accelerate half-disk decode / all-in-RAM decode", get("accelerate half-disk", "token_s"), ram, "about 2x")
    line(
        "bigviz / accelerate 128-token forward, half-disk",
        get("bigviz half-disk", "forward_s"),
        get("accelerate half-disk", "forward_s"),
        "<= 1x",
    )
    line(
        "bigviz / accelerate load + dispatch, half-disk",
        get("bigviz half-disk", "dispatch_s"),
        get("accelerate half-disk", "dispatch_s"),
        "<= 0.2x",
    )
    line(
        "prefetch on / off, decode (warm page cache)",
        get("bigviz half-disk", "token_s"),
        get("bigviz half-disk, prefetch off", "token_s"),
        "< 1x helps",
    )
    line(
        "prefetch on / off, cold 128-token forward",
        get("bigviz half-disk cold", "forward_s"),
        get("bigviz half-disk cold, prefetch off", "forward_s"),
        "< 1x helps",
    )
    line(
        "bigviz all-disk peak RssAnon above runtime / model bytes",
        get("bigviz all-disk", "anon_above_base"),
        model_bytes,
        "<= 0.3x",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats, skip the slowest runs")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs of each scenario (accelerate's half- and all-disk ones run once); best kept",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    ensure_checkpoint()
    from bigviz.checkpoint.index import CheckpointIndex

    model_bytes = CheckpointIndex.open(CKPT).total_bytes
    start = time.perf_counter()
    specs = scenarios(args.quick)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in specs}
    for round_ in range(args.rounds):  # rounds interleave scenarios: noise spreads over all
        for name, spec in specs.items():
            if round_ == 0 or "accelerate half" not in name and "accelerate all" not in name:
                runs[name].append(run(spec))
                print(f"  {name}: {runs[name][-1]}", file=sys.stderr)
    results = {name: best(found) for name, found in runs.items()}
    shutil.rmtree(ACC_OFFLOAD, ignore_errors=True)
    print(
        f"## Dispatch and offload: {PRESET} ({model_bytes / 1e9:.2f} GB fp32), "
        f"{os.cpu_count()} CPUs, torch threads default\n"
    )
    report(results, model_bytes)
    print(f"\n(total bench time {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
