"""Quantized weights on gpt2-large: float32, bfloat16, int8 and int4 side by side, and the peers.

    python bench/quant.py            # ~10 minutes here; prints a markdown section with ratios
    python bench/quant.py --quick    # gpt2 (124 M) instead: ~2 minutes, the same code path
    python bench/run.py --only quant --quick   # the same, through the bench runner

A run records its section as bench/results/quant.md and reassembles bench/RESULTS.md
(bench/records.py; the section it replaces goes to the diary, bench/history/; not with
--no-results).

bigviz: the gpt2-large checkpoint of ``bench/dispatch.py`` (bigviz GPT, random weights, float32,
``bench/_work/gpt2-large``, built once), loaded four ways (``dtype=torch.bfloat16``,
``quantization="int8"`` (torchao) computed in float32 and in bfloat16 (``dtype=torch.bfloat16``:
bigviz's ``Int8Linear`` runs torch's packed int8 kernel), ``quantization="int4"`` (bitsandbytes
nf4)), all in RAM and
with half of the blocks on disk (int8/int4: written once, packed, to an offload folder, and
streamed packed). For each: the plan's bytes per device against the bytes held after the load
(and, on disk, the bytes the dispatch streams), the load time, the anonymous RAM peak while
loading (the float model must never be in memory), and greedy decode per token (KV cache, an
8-token prompt, the best of ``--rounds`` runs of 16 tokens).

The peers, on the same weights (the checkpoint converted once to transformers' GPT-2 layout,
``bench/_work/hf-gpt2-large``): transformers + accelerate ``from_pretrained`` with
bitsandbytes 8-bit all in RAM, with ``llm_int8_enable_fp32_cpu_offload`` and half of the blocks
offloaded (the issue's anchor), and with torchao's ``Int8WeightOnlyConfig`` in float32 and in
bfloat16; or the error each
gives. Every scenario runs in a fresh process.

The larger-than-RAM run with int8 weights needs a quiet machine and about 45 minutes:
``python bench/beyond_ram.py --quantize int8`` (see its docstring).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
warnings.filterwarnings("ignore")

WORK = HERE / "_work"
PROMPT, STEPS = 8, 16
MODES = ("float32", "bfloat16", "int8", "int8 in bfloat16", "int4")


# ------------------------------------------------------------------------------ checkpoints
def ensure_checkpoints(preset: str) -> tuple[Path, Path]:
    """The bigviz checkpoint (``bench/dispatch.py``'s for gpt2-large) and the same weights in
    transformers' GPT-2 layout (Conv1D: the linear weights transposed), each written once."""
    if preset == "gpt2-large":
        from dispatch import ensure_checkpoint

        ours = ensure_checkpoint()
    else:
        ours = WORK / preset
        if not (ours / "model.safetensors.index.json").exists() and not (ours / "model.safetensors").exists():
            import torch

            from bigviz.checkpoint.save import save_sharded
            from bigviz.models import GPT, GPTConfig

            torch.manual_seed(0)
            save_sharded(GPT(GPTConfig.preset(preset)).state_dict(), ours, max_shard_size="500MB", progress=False)
    theirs = WORK / f"hf-{preset}"
    if not (theirs / "config.json").exists():
        _convert(ours, theirs, preset)
    return ours, theirs


class _Transposed(dict):
    """The bigviz checkpoint's tensors in transformers' GPT-2 names and layout, read one at a time."""

    def __init__(self, weights: Any) -> None:
        super().__init__({k: None for k in weights if k != "lm_head.weight"})
        self.weights = weights

    def __getitem__(self, key: str) -> Any:
        tensor = self.weights[key]
        conv1d = key.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))
        return tensor.t().contiguous() if conv1d else tensor

    def items(self) -> Any:
        return ((k, self[k]) for k in self)

    def values(self) -> Any:
        return (self[k] for k in self)


def _convert(ours: Path, theirs: Path, preset: str) -> None:
    from transformers import GPT2Config

    from bigviz.checkpoint.lazy import LazyWeights
    from bigviz.checkpoint.save import write_checkpoint_files
    from bigviz.models import GPTConfig

    print(f"converting {ours} to transformers' GPT-2 layout in {theirs} (once) ...", file=sys.stderr)
    c = GPTConfig.preset(preset)
    config = GPT2Config(
        n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, vocab_size=c.vocab_size, n_positions=c.block_size,
        architectures=["GPT2LMHeadModel"], tie_word_embeddings=True,
    )  # fmt: skip
    theirs.mkdir(parents=True, exist_ok=True)
    with LazyWeights(ours) as weights:
        write_checkpoint_files(_Transposed(weights), theirs, max_shard_size=500 * 10**6, stem="model")
    config.save_pretrained(theirs)


# ------------------------------------------------------------------------------ one scenario
def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One scenario, in this fresh process."""
    import torch

    from bigviz.modeling.process_memory import PeakMemory
    from bigviz.modeling.quant import quiet_torchao

    quiet_torchao()
    torch.manual_seed(0)
    out: dict[str, Any] = {}
    try:
        with PeakMemory(("RssAnon",)) as peak:
            start = time.perf_counter()
            model = (_bigviz if spec["engine"] == "bigviz" else _transformers)(spec, out)
            out["load_s"] = time.perf_counter() - start
        out["load_anon_peak"] = peak.peak["RssAnon"] - peak.base["RssAnon"]
        rounds = [_decode(model, spec["engine"]) for _ in range(spec["rounds"])]
        out["decode_s"] = min(rounds)
    except Exception as exc:  # what a peer (or a mode) cannot do is a result
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:240]}"
    return out


def _bigviz(spec: dict[str, Any], out: dict[str, Any]) -> Any:
    import torch

    import bigviz
    from bigviz.modeling.packed import held_bytes
    from bigviz.models import GPT, GPTConfig

    with bigviz.init_empty_weights():
        model = GPT(GPTConfig.preset(spec["preset"]))
    kwargs: dict[str, Any] = {}
    method, _, compute = spec["mode"].partition(" in ")
    if "bfloat16" in (method, compute):
        kwargs["dtype"] = torch.bfloat16
    if method in ("int8", "int4"):
        kwargs["quantization"] = method
    n = spec["n_layer"]
    disk = {f"transformer.h.{i}": "disk" for i in range(n // 2, n)} if spec.get("half") else {}
    plan = bigviz.plan(model, {"cpu": "200GiB"}, overrides=disk, **kwargs)  # the second half of the blocks on disk
    model = bigviz.load_checkpoint_and_dispatch(
        model, spec["ckpt"], plan, offload_folder=spec["offload"], resident="map", **kwargs
    )
    state = getattr(model, "_bigviz_dispatch", None)
    out["planned"] = {"cpu": plan.usage_of("cpu").used, "disk": plan.usage_of("disk").used}
    out["held"] = {
        "cpu": held_bytes(model).get("cpu", 0),
        "disk": sum(u.nbytes for u in state.units if u.storage == "disk") if state is not None else 0,
    }
    return model


def _transformers(spec: dict[str, Any], out: dict[str, Any]) -> Any:
    import torch
    from transformers import BitsAndBytesConfig, GPT2LMHeadModel, TorchAoConfig

    if spec["mode"].startswith("torchao int8"):
        from torchao.quantization import Int8WeightOnlyConfig

        config: Any = TorchAoConfig(Int8WeightOnlyConfig())
    else:
        config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_enable_fp32_cpu_offload=spec.get("fp32_offload", False))
    device_map: Any = "cpu"
    if spec.get("half"):
        n = spec["n_layer"]
        device_map = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.ln_f": "cpu", "lm_head": "cpu"}
        device_map |= {f"transformer.h.{i}": ("disk" if i >= n // 2 else "cpu") for i in range(n)}
    model = GPT2LMHeadModel.from_pretrained(
        spec["hf"],
        quantization_config=config,
        device_map=device_map,
        offload_folder=spec["offload"],
        dtype=torch.bfloat16 if spec["mode"].endswith("bfloat16") else torch.float32,
    )
    kinds: dict[str, int] = {}
    for p in model.parameters():
        kinds[type(p).__name__ if p.device.type != "meta" else "offloaded"] = kinds.get(type(p).__name__, 0) + 1
    out["kinds"] = kinds
    return model.eval()


def _decode(model: Any, engine: str) -> float:
    """Seconds per new token of greedy decoding with the KV cache (the prompt's prefill excluded)."""
    import torch

    idx = torch.randint(0, 50257, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if engine == "bigviz":
            from bigviz.models import KVCache

            cache = KVCache()
            logits, _ = model(idx, cache=cache)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            for _ in range(STEPS):
                logits, _ = model(nxt, cache=cache)
                nxt = logits[:, -1].argmax(-1, keepdim=True)
            return (time.perf_counter() - start) / STEPS
        out = model(idx, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        start = time.perf_counter()
        for _ in range(STEPS):
            out = model(nxt, past_key_values=cache, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        return (time.perf_counter() - start) / STEPS


def run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    offload = Path(spec["offload"])
    shutil.rmtree(offload, ignore_errors=True)  # ours, from an earlier scenario
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        shutil.rmtree(offload, ignore_errors=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1][:240] if done.stderr else ''}"}
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------ report
def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def report(preset: str, results: dict[str, dict[str, Any]], load: str) -> str:
    lines = [
        f"## Quantized weights: {preset} (`python bench/quant.py{' --quick' if preset != 'gpt2-large' else ''}`)",
        "",
        f"bigviz GPT {preset} (random weights, float32 checkpoint). Load average at the start: {load} "
        "(a shared machine: times are noisy; compare within the table, and re-run on a quiet machine).",
        "",
        "| scenario | plan: CPU / disk | held: CPU / disk (streamed) | plan = held | load | anon RAM peak while loading | decode per token |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "error" in r and "decode_s" not in r:
            lines.append(f"| {name} | | | | | | `{r['error']}` |")
            continue
        planned, held = r.get("planned"), r.get("held")
        plan_cell = f"{gib(planned['cpu'])} / {gib(planned['disk'])}" if planned else "-"
        held_cell = (
            f"{gib(held['cpu'])} / {gib(held['disk'])}"
            if held
            else ", ".join(f"{k}: {v}" for k, v in r.get("kinds", {}).items())
        )
        same = ("yes" if planned == held else "**no**") if planned else "-"
        lines.append(
            f"| {name} | {plan_cell} | {held_cell} | {same} | {r['load_s']:.1f} s | {gib(r['load_anon_peak'])} | "
            f"{r['decode_s'] * 1000:.0f} ms |"
        )
    lines += ["", *goals(results)]
    return "\n".join(lines)


def goals(results: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    equal = [n for n, r in results.items() if r.get("planned") is not None]
    if equal:
        ok = all(results[n]["planned"] == results[n]["held"] for n in equal)
        out.append(
            f"- plan bytes = bytes held after the load, per device, every bigviz mode: **{'met' if ok else 'not met'}**"
        )
    fp32, bf16 = results.get("bigviz float32, in RAM", {}), results.get("bigviz bfloat16, in RAM", {})
    int8, int8_bf16 = results.get("bigviz int8, in RAM", {}), results.get("bigviz int8 in bfloat16, in RAM", {})
    if "decode_s" in fp32 and "decode_s" in int8_bf16:
        ratio = int8_bf16["decode_s"] / fp32["decode_s"]
        out.append(
            f"- int8 decode per token / float32, in RAM: **{ratio:.2f}x** computed in bfloat16 (goal <= 1.0x: "
            f"{'met' if ratio <= 1.0 else 'not met'}; torch's packed int8 kernel, bigviz's Int8Linear)"
            + (
                f", {int8['decode_s'] / fp32['decode_s']:.2f}x computed in float32 (torchao's path)"
                if "decode_s" in int8
                else ""
            )
            + (
                f"; against bfloat16 weights: {int8_bf16['decode_s'] / bf16['decode_s']:.2f}x"
                if "decode_s" in bf16
                else ""
            )
        )
    half_fp, half_8 = results.get("bigviz float32, half on disk", {}), results.get("bigviz int8, half on disk", {})
    if "held" in half_fp and "held" in half_8:
        out.append(
            f"- streamed per forward, half on disk: int8 {gib(half_8['held']['disk'])} against float32 "
            f"{gib(half_fp['held']['disk'])} (**{half_8['held']['disk'] / half_fp['held']['disk']:.2f}x**)"
        )
    return out


def scenarios(preset: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        out[f"bigviz {mode}, in RAM"] = {"engine": "bigviz", "mode": mode}
    for mode in ("float32", "int8", "int8 in bfloat16"):  # the second half of the blocks on disk, the rest in RAM
        out[f"bigviz {mode}, half on disk"] = {"engine": "bigviz", "mode": mode, "half": True}
    out["transformers bnb 8-bit, in RAM"] = {"engine": "transformers", "mode": "bnb int8"}
    out["transformers bnb 8-bit + fp32 cpu offload, half on disk"] = {
        "engine": "transformers", "mode": "bnb int8", "fp32_offload": True, "half": True,
    }  # fmt: skip
    out["transformers torchao int8, in RAM"] = {"engine": "transformers", "mode": "torchao int8"}
    out["transformers torchao int8 in bfloat16, in RAM"] = {
        "engine": "transformers",
        "mode": "torchao int8 in bfloat16",
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="gpt2 (124 M) instead of gpt2-large")
    parser.add_argument("--rounds", type=int, default=2, help="decode runs per scenario (the best is kept)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--no-results", action="store_true", help="do not record the results (bench/results/, bench/RESULTS.md)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    preset = "gpt2" if args.quick else "gpt2-large"
    ours, theirs = ensure_checkpoints(preset)
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    from bigviz.models import GPTConfig

    common = {
        "preset": preset,
        "ckpt": str(ours),
        "hf": str(theirs),
        "offload": str(WORK / "quant-offload"),
        "rounds": args.rounds,
        "n_layer": GPTConfig.preset(preset).n_layer,
    }
    results = {}
    for name, spec in scenarios(preset).items():
        print(f"  {name} ...", file=sys.stderr, flush=True)
        results[name] = run_child({**common, **spec}, args.timeout)
        print(f"  {name}: {results[name]}", file=sys.stderr, flush=True)
    text = report(preset, results, load)
    print(text)
    if not args.no_results:  # its section replaced, the old one kept in the diary
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import records

        how = f"`python bench/quant.py{' --quick' if args.quick else ''}`, load {load.split()[0]} at the start"
        records.write_section("quant", text, note=how)
        records.assemble()


if __name__ == "__main__":
    main()
