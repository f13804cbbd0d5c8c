"""Run every benchmark, bigviz and its peers side by side, and write bench/RESULTS.md.

    python bench/run.py                    # all benches (about 10 minutes here), writes RESULTS.md
    python bench/run.py --only planning    # one bench, printed, RESULTS.md untouched
    python bench/run.py --quick            # smaller settings where a bench offers them

Each bench is its own script (planning.py, load.py, dispatch.py, slider.py, workload.py, gpu.py) that prints
a markdown section with ratios against accelerate and the goals; run one alone to see it.
The peers come from the `bench` extra: pip install -e ".[bench]".
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = ["planning", "load", "dispatch", "slider", "workload", "gpu", "pipeline"]
QUICK = {"dispatch"}  # benches that take --quick
TITLES = {
    "planning": "Planning",
    "load": "Checkpoint loading",
    "dispatch": "Dispatch and offload",
    "slider": "Planner slider latency",
    "workload": "KV cache and activations",
    "gpu": "GPU: CPU offload against the transfer floor",
    "pipeline": "Pipeline stages: memory per rank, generating across stages",
}


def machine() -> str:
    import psutil
    import torch

    try:
        import accelerate
        import transformers

        peers = f"accelerate {accelerate.__version__}, transformers {transformers.__version__}"
    except ImportError:
        peers = "peers not installed (pip install -e '.[bench]')"
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{os.cpu_count()} cores ({cpu}), {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, {gpu}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, {peers}"
    )


def run(name: str, quick: bool) -> tuple[str, float]:
    cmd = [sys.executable, str(HERE / f"{name}.py")] + (["--quick"] if quick and name in QUICK else [])
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    took = time.perf_counter() - start
    if result.returncode != 0:
        return (f"## {name}: FAILED (exit {result.returncode})\n\n```\n{result.stderr[-3000:]}\n```\n", took)
    text = result.stdout.strip() + "\n"
    if not text.startswith("#"):
        text = f"## {TITLES[name]} (`python bench/{name}.py`)\n\n{text}"
    return text, took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=BENCHES, action="append")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    names = args.only or BENCHES
    sections = []
    for name in names:
        print(f"running bench/{name}.py ...", flush=True)
        text, took = run(name, args.quick)
        print(text, flush=True)
        sections.append(f"{text}\n_(bench/{name}.py took {took:.0f} s)_\n")
    if args.only:
        return
    header = (
        f"# Benchmark results\n\nWritten by `python bench/run.py` on {datetime.date.today()}.\n"
        f"Machine: {machine()}.\nThe machine is shared and noisy: ratios from one run, side by side, "
        f"are what to compare.\n"
    )
    (HERE / "RESULTS.md").write_text(header + "\n" + "\n".join(sections))
    print(f"wrote {HERE / 'RESULTS.md'}")


if __name__ == "__main__":
    main()
