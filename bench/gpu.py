"""CPU offload to a GPU: per-token decode against the transfer floor, bigviz against accelerate.

    python bench/gpu.py            # needs CUDA; prints a markdown table
    python bench/gpu.py --quick    # fewer tokens

Without CUDA it says so and exits with status 0 (nothing to measure).

On gpt2-large (the checkpoint of bench/dispatch.py, built if missing), embeddings and head
on GPU 0 and every block streamed from pinned CPU memory ("cpu" in the map), each decode
step must copy all block weights host-to-device. The floor is those bytes over the pinned
host-to-device bandwidth measured here; accelerate (no pinned memory, no side stream, no
prefetch) runs the same map; disk-mapped blocks (warm page cache, pinned staging) too.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
warnings.filterwarnings("ignore")

import dispatch as bench_dispatch  # noqa: E402  (bench/dispatch.py: checkpoint and decode loop)


def h2d_bandwidth(nbytes: int = 256 * 2**20, *, pinned: bool = True, repeat: int = 10) -> float:
    """Host-to-device bytes per second for one large copy (best of ``repeat``)."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8)
    host = host.pin_memory() if pinned else host
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        device.copy_(host, non_blocking=pinned)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def gpu_map(storage: str | int) -> dict[str, Any]:
    """Embeddings and head on GPU 0, every block on ``storage``."""
    dm: dict[str, Any] = {"transformer.wte": 0, "transformer.wpe": 0, "transformer.drop": 0}
    dm.update({f"transformer.h.{i}": storage for i in range(bench_dispatch.N_LAYER)})
    dm.update({"transformer.ln_f": 0, "lm_head": 0})
    return dm


def build_meta() -> Any:
    import bigviz
    from bigviz.models import GPT, GPTConfig

    with bigviz.init_empty_weights():
        return GPT(GPTConfig.preset(bench_dispatch.PRESET))


def load(engine: str, device_map: dict[str, Any], *, prefetch: bool = True) -> Any:
    if engine == "bigviz":
        import bigviz

        return bigviz.load_checkpoint_and_dispatch(build_meta(), bench_dispatch.CKPT, device_map, prefetch=prefetch)
    import accelerate

    return accelerate.load_checkpoint_and_dispatch(
        build_meta(),
        str(bench_dispatch.CKPT / "model.safetensors.index.json"),
        device_map=device_map,
        offload_folder=str(bench_dispatch.ACC_OFFLOAD),
        no_split_module_classes=["Block"],
    )


def per_token(model: Any, steps: int) -> tuple[float, float, list[int]]:
    """Best and median seconds per decode step (CUDA synchronised) and the tokens made."""
    times, tokens = bench_dispatch.decode(_Synced(model), prompt=8, steps=steps)
    return min(times), statistics.median(times), tokens


class _Synced:
    """Calls the model and waits for the GPU, so a step's time includes its copies."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        out = self.model(*args, **kwargs)
        torch.cuda.synchronize()
        return out


def release(model: Any) -> None:
    import torch

    import bigviz

    bigviz.remove_hooks(model)
    del model
    gc.collect()
    torch.cuda.empty_cache()


def block_bytes() -> int:
    from bigviz.checkpoint.index import CheckpointIndex

    entries = CheckpointIndex.open(bench_dispatch.CKPT).entries.values()
    return sum(info.nbytes for info in entries if info.name.startswith("transformer.h."))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 decode steps instead of 16")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here (torch.cuda.is_available() is False); nothing to measure.")
        return
    bench_dispatch.ensure_checkpoint()
    steps = 8 if args.quick else 16
    pinned, pageable = h2d_bandwidth(pinned=True), h2d_bandwidth(pinned=False)
    offloaded = block_bytes()
    floor = offloaded / pinned
    rows: list[tuple[str, float | None, float | None, str]] = []
    scenarios = [
        ("all on GPU 0", "bigviz", {"": 0}, True),
        ("bigviz, blocks on cpu (pinned, prefetch)", "bigviz", gpu_map("cpu"), True),
        ("bigviz, blocks on cpu, prefetch off", "bigviz", gpu_map("cpu"), False),
        ("bigviz, blocks on disk (staging, prefetch)", "bigviz", gpu_map("disk"), True),
        ("accelerate, blocks on cpu", "accelerate", gpu_map("cpu"), True),
    ]
    reference = None
    for name, engine, device_map, prefetch in scenarios:
        try:
            model = load(engine, device_map, prefetch=prefetch)
            best, median, tokens = per_token(model, steps)
            reference = reference or tokens
            rows.append((name, best, median, "same" if tokens == reference else "DIFFERENT"))
            release(model)
        except Exception as exc:  # report, keep going
            rows.append((name, None, None, f"failed: {type(exc).__name__}: {str(exc)[:80]}"))
        print(f"  {rows[-1]}", file=sys.stderr)
    print(f"## CPU offload to {torch.cuda.get_device_name(0)}: {bench_dispatch.PRESET}\n")
    print(
        f"pinned H2D {pinned / 1e9:.1f} GB/s, pageable {pageable / 1e9:.1f} GB/s; "
        f"streamed per token: {offloaded / 1e9:.2f} GB; floor {floor * 1e3:.1f} ms/token\n"
    )
    print("| scenario | decode / token, best (median) | / floor | tokens |")
    print("|---|---|---|---|")
    for name, best, median, note in rows:
        if best is None:
            print(f"| {name} | - | - | {note} |")
            continue
        print(f"| {name} | {best * 1e3:.1f} ms ({median * 1e3:.1f} ms) | {best / floor:.2f}x | {note} |")


if __name__ == "__main__":
    main()
