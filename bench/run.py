"""Run the benchmarks, bigviz and its peers side by side, and assemble bench/RESULTS.md.

    python bench/run.py                      # every bench but beyond_ram (about 10 minutes here)
    python bench/run.py --only planning      # one bench: its section is replaced, the others kept
    python bench/run.py --only beyond_ram    # the larger-than-RAM bench (a model 1.25x the RAM: long)
    python bench/run.py --quick              # smaller settings where a bench offers them
    python bench/run.py --print --only load  # print only: no record is written

Each bench is its own script (planning.py, load.py, dispatch.py, slider.py, workload.py, gpu.py,
pipeline.py, beyond_ram.py) that prints a markdown section with ratios against accelerate and
the goals; run one alone to see it. A run writes each bench's section to bench/results/<bench>.md
(the section it replaces goes to the dated diary, bench/history/), then assembles RESULTS.md
whole from every section there is (bench/records.py): a bench not run keeps its last figures.
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
sys.path.insert(0, str(HERE))

import records  # noqa: E402  (bench/records.py: the section files and RESULTS.md)

BENCHES = ["planning", "load", "dispatch", "slider", "workload", "gpu", "pipeline"]
OPTIONAL = ["beyond_ram", "quant"]  # run only when named: larger than RAM; gpt2-large four ways (~10 min)
QUICK = {"dispatch", "quant"}  # benches that take --quick
TITLES = {
    "planning": "Planning",
    "load": "Checkpoint loading",
    "dispatch": "Dispatch and offload",
    "slider": "Planner slider latency",
    "workload": "KV cache and activations",
    "gpu": "GPU: CPU offload against the transfer floor",
    "pipeline": "Pipeline stages: memory per rank, generating across stages",
    "quant": "Quantized weights",
    "beyond_ram": "Larger than RAM",
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
    cmd += ["--no-results"] if name in OPTIONAL else []  # this run records it, once
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    took = time.perf_counter() - start
    if result.returncode != 0:
        return (f"## {name}: FAILED (exit {result.returncode})\n\n```\n{result.stderr[-3000:]}\n```\n", took)
    text = result.stdout.strip() + "\n"
    if not text.startswith("## "):  # a section of its own (a bench printing only ### subsections gets its title)
        text = f"## {TITLES[name]} (`python bench/{name}.py`)\n\n{text}"
    return text, took


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=BENCHES + OPTIONAL, action="append")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--print", action="store_true", help="print the sections, write no record")
    args = parser.parse_args()
    names = args.only or BENCHES
    for name in names:
        print(f"running bench/{name}.py ...", flush=True)
        text, took = run(name, args.quick)
        print(text, flush=True)
        if not args.print and "FAILED" not in text.splitlines()[0]:
            how = f"`python bench/{name}.py{' --quick' if args.quick and name in QUICK else ''}`, {took:.0f} s"
            records.write_section(name, text, note=f"{how}, load {os.getloadavg()[0]:.1f} at the end")
    if not args.print:
        print(f"wrote {records.assemble(machine())} ({datetime.date.today()})")


if __name__ == "__main__":
    main()
