"""``bigviz demo``: the whole story in one run, on a CPU, in under two minutes.

1. Plan two models too big for this machine (gpt2-xl, a 70B Llama) on the ``meta`` device.
2. Train a tiny character-level GPT for a few seconds, so its generated text means something.
3. Save it as a sharded safetensors checkpoint.
4. Plan it from the checkpoint's headers alone, under a budget that forces disk offload.
5. Load and dispatch it with bigviz's engine, generate text, and check it against the model
   in memory; print each device's predicted and measured bytes.
6. Write ``device_map.json`` and ``report.html`` (open it in a browser).

The output folder must be new, empty, or an earlier demo's output (it holds the demo's
``bigviz-demo.json`` marker). The demo never deletes anything: it overwrites its own files
by name and replaces only its checkpoint's own files (``save_sharded(overwrite=True)``).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

import bigviz
from bigviz.core.serialize import write_json_atomic
from bigviz.core.devices import device_label
from bigviz.core.sizes import format_size
from bigviz.models import GPT, GPTConfig, Llama, LlamaConfig

MARKER = "bigviz-demo.json"  # says "an earlier demo wrote this folder"
OUTPUTS = ("gpt2-xl.device_map.json", "llama-70b.device_map.json", "checkpoint", "device_map.json",
           "report.html")
TEXT = "Big models break naive loading: build on meta, plan every block, stream offloaded blocks from disk. "
PROMPT = "Big models "


def _say(text: str) -> None:
    print(text, flush=True)


def plan_big_models(out: Path) -> None:
    """Step 1: size and place models that do not fit here, without allocating them."""
    cases = [("gpt2-xl", lambda: GPT(GPTConfig.preset("gpt2-xl")), {0: "4GiB", "cpu": "2GiB"}, None),
             ("llama-70b", lambda: Llama(LlamaConfig.preset("llama-70b")),
              {0: "24GiB", "cpu": "64GiB"}, torch.float16)]
    for name, build, budget, dtype in cases:
        start = time.perf_counter()
        with bigviz.init_empty_weights():
            model = build()
        plan = bigviz.plan(model, budget, dtype=dtype)
        took = time.perf_counter() - start
        table = bigviz.size_table(model, dtype=dtype, max_depth=1)
        _say(f"\n== {name}: {table['parameters'].iloc[0] / 1e9:.2f}B parameters, "
             f"{format_size(plan.tree.total(''))}"
             f"{' in fp16' if dtype else ''}; built on meta and planned in {took:.2f} s")
        _say(table.to_string(index=False, formatters={"share": "{:.1%}".format}))
        _say(plan.summary())
        bigviz.save_device_map(plan.device_map, out / f"{name}.device_map.json")


def train_tiny(steps: int) -> GPT:
    """Step 2: a byte-level GPT that memorises ``TEXT`` (a few seconds on two cores)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=96, vocab_size=256, block_size=64))
    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    for step in range(steps):
        # windows as long as the context, so every position the demo generates at is trained
        starts = torch.randint(0, len(data) - 65, (32,))
        x = torch.stack([data[s:s + 64] for s in starts])
        y = torch.stack([data[s + 1:s + 65] for s in starts])
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            _say(f"  step {step:4d}  loss {loss.item():.3f}")
    return model.eval()


def _generate(model: torch.nn.Module, tokens: int) -> list[int]:
    idx = torch.tensor([list(PROMPT.encode())], dtype=torch.long)
    return model.generate(idx, tokens)[0].tolist()


def measured_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of weights each device holds now; meta tensors are offloaded to disk."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        kind = tensor.device.type
        key = "disk" if kind == "meta" else ("cpu" if kind == "cpu" else str(tensor.device.index or 0))
        out[key] = out.get(key, 0) + tensor.numel() * tensor.element_size()
    return out


def run_offloaded(out: Path, trained: GPT, tokens: int) -> bool:
    """Steps 3 to 6. Returns whether the offloaded model generated exactly the same text."""
    ckpt = out / "checkpoint"
    bigviz.save_sharded(trained, ckpt, max_shard_size="400KB", overwrite=True)
    files = sorted(p.name for p in ckpt.iterdir())
    _say(f"\n== saved {len(files) - 1} shards + index to {ckpt}: {', '.join(files[:3])} ...")
    total = bigviz.compute_module_sizes(trained)[""]
    budget = {"cpu": int(total * 0.8), "disk": "1GiB"}
    plan = bigviz.plan(str(ckpt), budget)  # from tensor names and header sizes alone
    _say(f"== planned from headers under cpu={format_size(budget['cpu'])}:\n{plan.summary()}")
    bigviz.save_device_map(plan.device_map, out / "device_map.json")
    bigviz.save_html(plan, out / "report.html")
    with bigviz.init_empty_weights():
        model = GPT(trained.config)
    start = time.perf_counter()
    model = bigviz.load_checkpoint_and_dispatch(model, ckpt, device_map=plan.device_map,
                                                offload_folder=out / "offload")
    _say(f"== loaded and dispatched in {time.perf_counter() - start:.2f} s; placements:")
    measured = measured_bytes(model)
    for usage in plan.usage:
        key = str(usage.device)
        _say(f"  {device_label(usage.device):>5}: predicted {format_size(usage.used):>10}, "
             f"measured {format_size(measured.get(key, 0)):>10}")
    start = time.perf_counter()
    got = _generate(model, tokens)
    took = time.perf_counter() - start
    want = _generate(trained, tokens)
    on_disk = measured.get("disk", 0) / max(sum(measured.values()), 1)
    _say(f"== generated {tokens} tokens in {took:.2f} s with {on_disk:.0%} of the weights on disk:\n"
         f"  {bytes(got).decode(errors='replace')!r}")
    same = got == want
    _say(f"  identical to the model in memory: {same}")
    bigviz.remove_hooks(model)
    return same


def prepare_output(out: Path) -> None:
    """Make ``out`` ready for the demo's files, deleting nothing.

    Raises:
        FileExistsError: ``out`` is a file, or a non-empty folder the demo did not write
            (no ``bigviz-demo.json`` in it).
    """
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {str(out)!r} is a file: give a folder for the demo's files")
    if out.is_dir():
        held = sorted(p.name for p in out.iterdir())
        if held and MARKER not in held:
            shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
            raise FileExistsError(
                f"--out {str(out)!r} is not empty ({shown}) and is not an earlier bigviz demo output "
                f"(it has no {MARKER}); the demo never deletes or overwrites files it did not write: "
                "give a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic({"written_by": "bigviz demo", "outputs": list(OUTPUTS)}, out / MARKER)


def main(out: str | Path = "bigviz-demo", *, quick: bool = False) -> int:
    """Run the demo, writing its files under ``out``. Returns a process exit code."""
    out = Path(out)
    prepare_output(out)
    start = time.perf_counter()
    _say("bigviz demo: plan, save, load, offload and run models bigger than your devices")
    plan_big_models(out)
    _say("\n== training a tiny byte-level GPT (so its text is readable)")
    trained = train_tiny(60 if quick else 800)
    same = run_offloaded(out, trained, 20 if quick else 50)
    _say(f"\nwrote {out / 'device_map.json'} and {out / 'report.html'} "
         f"(open the report in a browser); total {time.perf_counter() - start:.1f} s")
    return 0 if same else 1
