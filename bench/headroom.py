"""Headroom: does a CPU run planned to the byte fit its budget, measured as the process sees it?

    python bench/headroom.py            # prints a markdown section (a minute or two here)

A Llama-shaped model with random weights is planned on a CPU budget; ``bigviz.max_context``
gives the longest context with the bare arithmetic (``reserve=0``) and with the default
reserve. Each context is then run for real in a fresh process: the model is built, a prompt of
``context - 15`` tokens generates 16 more (the cache ends holding the planned context), and the
peak of the process's anonymous memory (``RssAnon``, sampled every 2 ms) above what it held
before the model was built is compared with the budget. Run twice: with glibc's default
allocator (freed blocks below its moving mmap threshold stay on the heap) and with
``MALLOC_MMAP_THRESHOLD_=65536`` (large blocks always mapped, freed memory goes back).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=512,
    max_position_embeddings=16384,
)
BATCH, NEW, BUDGET = 4, 16, 160 * 2**20


def _model(device: str = "meta"):  # type: ignore[no-untyped-def]
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()


def contexts() -> dict[str, int]:
    """The longest context with no reserve and with the default one."""
    import bigviz

    model = _model()
    return {
        "reserve=0": bigviz.max_context(model, {"cpu": BUDGET}, BATCH, reserve=0),
        "default reserve": bigviz.max_context(model, {"cpu": BUDGET}, BATCH),
    }


def run_once(context: int) -> dict[str, int]:
    """In this (fresh) process: build, generate to ``context``, return the peak above the start."""
    import torch

    from bigviz.modeling.process_memory import PeakMemory

    _model()  # imports transformers and the model's module before the window: only the run is measured
    with PeakMemory(("RssAnon",)) as peak:
        model = _model("cpu")
        prompt = torch.randint(3, CONFIG["vocab_size"], (BATCH, context - NEW + 1))
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert out.shape[1] == context + 1
    return {"peak": peak.above()["RssAnon"]}


def measure(context: int, *, release: bool) -> int:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if release:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    code = f"import json, bench.headroom as h; print(json.dumps(h.run_once({context})))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak"])


def main() -> None:
    from bigviz.core.sizes import format_size

    print(f"### Headroom on the CPU: budget {format_size(BUDGET)}, batch {BATCH}, Llama-shaped model")
    print()
    print("| plan | context | allocator | peak RssAnon above start | / budget |")
    print("|---|---:|---|---:|---:|")
    for label, context in contexts().items():
        for release in (False, True):
            peak = measure(context, release=release)
            allocator = "MALLOC_MMAP_THRESHOLD_=65536" if release else "glibc default"
            print(f"| {label} | {context:,} | {allocator} | {format_size(peak)} | {peak / BUDGET:.2f} |")


if __name__ == "__main__":
    main()
