"""Slider latency of the Planner, headless: set a budget slider, time until the plan and the
treemap's colours are updated (the callback runs synchronously without a browser).

Goal (issue 5): at most 150 ms from slider move to updated plan and figure on a
1000-module model.

Run:
    .venv/bin/python bench/slider.py            # ~20 moves per model, markdown table
    .venv/bin/python bench/slider.py --moves 40
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch.nn as nn

import bigviz
from bigviz.models import GPT, GPTConfig, Llama, LlamaConfig
from bigviz.ui.planner import Planner

GOAL_MS = 150.0


def _sequential() -> nn.Module:
    with bigviz.init_empty_weights():
        return nn.Sequential(*[nn.Linear(256, 256) for _ in range(1000)])


def _gpt() -> nn.Module:
    with bigviz.init_empty_weights():
        return GPT(GPTConfig.preset("gpt2-xl"))


def _llama() -> nn.Module:
    with bigviz.init_empty_weights():
        return Llama(LlamaConfig.preset("llama-70b"))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "nn.Sequential(1000 x Linear)": _sequential,
    "GPT gpt2-xl (meta)": _gpt,
    "Llama llama-70b (meta)": _llama,
}


def measure(model: nn.Module, moves: int) -> dict[str, float]:
    """Move GPU 0's slider through 20%..80% of the model; time each move."""
    total = bigviz.module_tree(model).total("")
    gib = 2**30
    planner = Planner(model, {0: total // 4, "cpu": total // 3})
    slider = planner.budget_sliders[0]
    times, changed = [], 0
    for i in range(moves):
        value = (0.2 + 0.6 * ((i * 7) % moves) / moves) * total / gib
        before = planner.view.colors
        start = time.perf_counter()
        slider.value = value
        elapsed = time.perf_counter() - start
        changed += planner.view.colors != before
        times.append(elapsed * 1000)
    times.sort()
    return {
        "modules": len(planner.state.base_tree.nodes),
        "tiles": len(planner.view.layout.ids),
        "median": statistics.median(times),
        "p90": times[int(0.9 * (len(times) - 1))],
        "max": times[-1],
        "changed": changed,
        "moves": moves,
        "live": planner.view.live,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moves", type=int, default=20)
    args = parser.parse_args()
    print(f"Planner slider latency, headless ({args.moves} moves each; goal <= {GOAL_MS:.0f} ms)\n")
    print("| model | modules | tiles | median ms | p90 ms | max ms | colours changed | goal |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, build in MODELS.items():
        r = measure(build(), args.moves)
        ok = "met" if r["p90"] <= GOAL_MS else "MISSED"
        print(
            f"| {name} | {r['modules']} | {r['tiles']} | {r['median']:.1f} | {r['p90']:.1f} | {r['max']:.1f} "
            f"| {r['changed']}/{r['moves']} | {ok} (p90 <= {GOAL_MS:.0f}) |"
        )
    print("\nFigureWidget live updates:", "yes" if r["live"] else "no (static fallback)")


if __name__ == "__main__":
    main()
