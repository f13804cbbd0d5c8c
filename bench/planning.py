"""Planning speed and quality: bigviz against accelerate's infer_auto_device_map, side by side.

    python bench/planning.py            # prints a markdown section with ratios
    python bench/planning.py --full     # also times accelerate on the full 8000-layer chain (~2 min)

Cases (issue 2):
- the seed's 100B model (1000 x nn.Linear(10000, 10000) on meta), two 80 GiB GPUs + CPU;
  goal: bigviz <= 0.2x accelerate's time;
- a chain of layers whose sizes decrease along the model (accelerate re-scans the remaining
  layers after each one: quadratic); goal: 8000 layers planned in under 2 s;
- GPU 0 fill when nothing is offloaded (ten 40 KB layers and a 400 KB head, GPU 0 at 560 KB):
  goal: >= 70% (accelerate keeps room for the head and fills ~29%);
- RAM and disk only (issue 9): gpt2-large on meta with a CPU budget of 1/4, 1/2 and 3/4 of
  the model: bytes each planner keeps in RAM (the CPU computes on the memory-mapped pages of
  disk blocks, so bigviz reserves no RAM for them; accelerate keeps room for a block).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch.nn as nn

import bigviz
import bigviz.core

warnings.filterwarnings("ignore")


def _best(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def seed_100b() -> nn.Module:
    with bigviz.init_empty_weights():
        return nn.Sequential(*[nn.Linear(10000, 10000) for _ in range(1000)])


def decreasing_chain(n: int) -> nn.Module:
    # Layer i holds (n - i) x 16 weights: each layer is smaller than the one before it.
    with bigviz.init_empty_weights():
        return nn.Sequential(*[nn.Linear(n - i, 16, bias=False) for i in range(n)])


class LayersAndHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(100, 100, bias=False) for _ in range(10)])  # 40 KB each
        self.head = nn.Linear(1000, 100, bias=False)  # 400 KB


def main() -> None:
    from accelerate import infer_auto_device_map as acc_infer

    parser = argparse.ArgumentParser()
    parser.add_argument("--full", action="store_true", help="time accelerate on 8000 layers too")
    args = parser.parse_args()
    rows = []

    model = seed_100b()
    budget = {0: "80GiB", 1: "80GiB", "cpu": "200GiB"}
    ours = _best(lambda: bigviz.infer_auto_device_map(model, budget))
    theirs = _best(lambda: acc_infer(model, budget))
    rows.append(("seed 100B model (1000 layers)", ours, theirs, f"ratio {ours / theirs:.3f} (goal <= 0.2)"))

    sizes = [2000, 4000] + ([8000] if args.full else [])
    for n in sizes + ([] if args.full else [8000]):
        chain = decreasing_chain(n)
        total = bigviz.compute_module_sizes(chain)[""]
        budget = {0: total // 3, "cpu": total // 3, "disk": total}
        ours = _best(lambda: bigviz.infer_auto_device_map(chain, budget), repeat=2)
        theirs = _best(lambda: acc_infer(chain, budget), repeat=1) if n in sizes else float("nan")
        goal = f"goal < 2 s: {'met' if ours < 2 else 'MISSED'}" if n == 8000 else ""
        ratio = f"ratio {ours / theirs:.4f}" if theirs == theirs else "accelerate not run (use --full; ~100 s)"
        rows.append((f"decreasing chain, {n} layers", ours, theirs, f"{ratio}; {goal}".strip("; ")))

    small = LayersAndHead()
    budget = {0: 560_000, 1: 10**9}
    ours_map = bigviz.infer_auto_device_map(small, budget)
    theirs_map = acc_infer(small, budget)
    sizes = bigviz.compute_module_sizes(small)
    leaves = [f"layers.{i}" for i in range(10)] + ["head"]
    fill = {
        name: sum(sizes[leaf] for leaf in leaves if bigviz.core.device_of(leaf, dm) == 0)
        for name, dm in (("bigviz", ours_map), ("accelerate", dict(theirs_map)))
    }

    ram_rows = _ram_and_disk(acc_infer)

    print("## Planning (`python bench/planning.py`)\n")
    print("| case | bigviz (s) | accelerate (s) | result |\n|---|---:|---:|---|")
    for case, a, b, note in rows:
        print(f"| {case} | {a:.3f} | {'' if b != b else f'{b:.3f}'} | {note} |")
    print(
        f"\nGPU 0 fill with nothing offloaded (10 x 40 KB layers + 400 KB head, GPU 0 = 560 KB): "
        f"bigviz {fill['bigviz'] / 560_000:.0%} (`{ours_map}`), accelerate {fill['accelerate'] / 560_000:.0%} "
        f"(`{dict(theirs_map)}`); goal >= 70%."
    )
    print(
        "\nRAM and disk only, gpt2-large (3.1 GB fp32) on meta, `infer_auto_device_map` with the same "
        "budgets: bytes kept in RAM (the rest streams from disk)\n"
    )
    print("| CPU budget | bigviz in RAM | accelerate in RAM | ratio |\n|---:|---:|---:|---:|")
    for budget, ours_ram, theirs_ram in ram_rows:
        print(
            f"| {budget / 1e9:.2f} GB | {ours_ram / 1e9:.2f} GB | {theirs_ram / 1e9:.2f} GB | "
            f"{ours_ram / theirs_ram:.2f}x |"
        )


def _ram_and_disk(acc_infer) -> list[tuple[int, int, int]]:
    from bigviz.models import GPT, GPTConfig

    with bigviz.init_empty_weights():
        model = GPT(GPTConfig.preset("gpt2-large"))
    sizes = bigviz.compute_module_sizes(model)
    tree = bigviz.module_tree(model)
    rows = []
    for share in (0.25, 0.5, 0.75):
        budget = int(sizes[""] * share)
        out = []
        for device_map in (
            bigviz.infer_auto_device_map(model, {"cpu": budget}),
            dict(acc_infer(model, {"cpu": budget}, no_split_module_classes=["Block"])),
        ):
            out.append(sum(tree.tensor_bytes(t) for t in tree.tensors if bigviz.core.device_of(t, device_map) == "cpu"))
        rows.append((budget, out[0], out[1]))
    return rows


if __name__ == "__main__":
    main()
