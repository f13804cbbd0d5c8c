"""``bigviz demo``: the whole story in one run, on a CPU (about 10 s on an idle 2-core machine,
several times that while other programs keep the cores busy, or on the first run after an
install, when Python compiles its bytecode; it prints its own total).

1. Plan two models too big for this machine (gpt2-xl; Llama 2 70B's shape, ``llama-70b``) on the
   ``meta`` device.
2. Take bigviz's tiny trained byte-level GPT (shipped, so its text is readable) and save it
   as a sharded safetensors checkpoint with its config.
3. Plan it from the checkpoint's headers alone, with its run (KV cache and activations),
   under a CPU budget that puts about half of its blocks on disk.
4. Load and dispatch it with bigviz's engine, generate text, check it against the model in
   memory.
5. The cost of a generated token: memory per device and time per token, predicted by the
   plan and measured here.
6. Write ``device_map.json`` and ``report.html``, and say where to look next.

The output folder must be new, empty, or an earlier demo's output: it holds the demo's
``bigviz-demo.json`` marker, read (not just found by name), which records the size and SHA-256
of every file the demo wrote. The demo never deletes anything it did not write: it replaces
its own files, unchanged since it wrote them, and only its checkpoint's own files
(``save_sharded(overwrite=True)``); links and outputs of the wrong type are refused, all before
step 1.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import bigviz
from bigviz.core.serialize import parse_json, write_json_atomic
from bigviz.core.devices import device_label
from bigviz.core.sizes import format_count, format_size
from bigviz.models import GPT, GPTConfig, Llama, LlamaConfig, decode_bytes, encode_bytes, tiny_gpt

MARKER = "bigviz-demo.json"  # says "an earlier demo wrote this folder", and what it wrote
WRITTEN_BY = "bigviz demo"
MARKER_FORMAT = 2  # 2: with each file's size and SHA-256
OUTPUTS = ("gpt2-xl.device_map.json", "llama-70b.device_map.json", "checkpoint", "device_map.json", "report.html")
PROMPT = "Big models "
DISK_SPEED = "NVMe ("  # the cost model's disk for a cold read (DevicePlan.cost's default)
WARM_SPEED = "page cache"  # pages just written are in the page cache


def _say(text: str = "") -> None:
    print(text, flush=True)


def _count(n: int) -> str:
    """``1557611200`` -> ``"1.558B"``, ``68976648192`` -> ``"69.0B"``: parameter counts as
    people say them, with the digits the notebooks and the README use."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3f}{unit}" if n < 10 * scale else f"{n / scale:.1f}{unit}"
    return str(n)


def _size_lines(model: torch.nn.Module, dtype: torch.dtype | None) -> str:
    """The top of the size table, with friendly sizes instead of byte counts."""
    table = bigviz.size_table(model, dtype=dtype, max_depth=1)
    rows = [
        (
            r.module,
            r._2,
            _count(r.parameters),
            format_size(r.bytes),
            f"{r.share:.1%}",
            f"tied to {r.tied_to}" if r.tied_to else "",
        )
        for r in table.itertuples()
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join(
        "  "
        + "  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row[:5], widths)))
        + (f"  {row[5]}" if row[5] else "")
        for row in rows
    )


def plan_big_models(out: Path) -> None:
    """Step 1: size and place models that do not fit here, without allocating them."""
    cases = [
        ("gpt2-xl", "", lambda: GPT(GPTConfig.preset("gpt2-xl")), {0: "4GiB", "cpu": "2GiB"}, None),
        (
            "llama-70b",
            " (Llama 2 70B's shape, 32k vocabulary)",
            lambda: Llama(LlamaConfig.preset("llama-70b")),
            {0: "24GiB", "cpu": "64GiB"},
            torch.float16,
        ),
    ]
    for name, what, build, budget, dtype in cases:
        start = time.perf_counter()
        with bigviz.init_empty_weights():
            model = build()
        plan = bigviz.plan(model, budget, dtype=dtype)
        took = time.perf_counter() - start
        params = sum(p.numel() for p in model.parameters())
        _say(
            f"\n== {name}{what}: {_count(params)} parameters, {format_size(plan.tree.total(''))} in "
            f"{'float16' if dtype else 'float32'}; built on meta and planned in {took:.2f} s "
            f"(budgets {', '.join(f'{device_label(k)} {v}' for k, v in budget.items())})"
        )
        _say(_size_lines(model, dtype))
        _say(plan.summary())
        bigviz.save_device_map(plan.device_map, out / f"{name}.device_map.json")


def load_tiny() -> GPT:
    """Step 2: bigviz's shipped byte-level GPT, trained (``bigviz.models.tiny_gpt``)."""
    model = tiny_gpt()
    _say(
        f"\n== bigviz's tiny trained GPT: {_count(sum(p.numel() for p in model.parameters()))} parameters, "
        f"{format_size(bigviz.compute_module_sizes(model)[''])}; it reads and writes bytes, and learned "
        "a few paragraphs about loading big models"
    )
    return model


def measured_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of weights each device holds now; meta tensors are offloaded to disk."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        kind = tensor.device.type
        key = "disk" if tensor.is_meta else ("cpu" if kind == "cpu" else str(tensor.device.index or 0))
        out[key] = out.get(key, 0) + tensor.numel() * tensor.element_size()
    return out


def _seconds_per_token(model: torch.nn.Module, tokens: int) -> tuple[list[int], float]:
    """Greedy tokens after ``PROMPT``, and the median seconds per new token over 3 runs."""
    idx = encode_bytes(PROMPT)
    times, out = [], []
    for _ in range(4):  # the first run warms up (first page faults, kernels)
        start = time.perf_counter()
        out = model.generate(idx, tokens)[0].tolist()
        times.append((time.perf_counter() - start) / tokens)
    return out, statistics.median(times[1:])


def _plan_from_headers(ckpt: Path, trained: GPT, context: int) -> bigviz.DevicePlan:
    """Step 3: half of the weights in CPU RAM, plus room for the run; the rest on disk."""
    weights = bigviz.compute_module_sizes(trained)[""]
    run = bigviz.plan(ckpt, {"cpu": 2 * weights}, batch_size=1, context_length=context)
    run_bytes = run.kv_cache["cpu"] + run.activations["cpu"]
    budget = {"cpu": weights // 2 + run_bytes}
    plan = bigviz.plan(ckpt, budget, batch_size=1, context_length=context)  # headers + config.json
    _say(
        f"\n== planned from the checkpoint's headers alone, for a run of {context} tokens, under "
        f"cpu={format_size(budget['cpu'])}\n   (half the weights, {format_size(weights // 2)}, plus "
        f"{format_size(run_bytes)} for the run's KV cache and activations):"
    )
    _say(plan.summary())
    shown = {p.device: p for p in plan.placements if p.name.startswith("transformer.h.")}
    for placement in shown.values():  # one block kept in RAM, one streamed from disk: the reasons
        _say(f"  {placement.name}: {placement.reason}")
    return plan


def run_offloaded(out: Path, trained: GPT, tokens: int) -> bool:
    """Steps 2 to 6. Returns whether the offloaded model generated exactly the same text."""
    ckpt = out / "checkpoint"
    bigviz.save_sharded(trained, ckpt, max_shard_size="200KB", config=trained.config, overwrite=True, progress=False)
    shards = sorted(p.name for p in ckpt.glob("*.safetensors"))
    _say(f"   saved as {format_count(len(shards), 'shard')} + index + config.json to {ckpt}")
    context = len(PROMPT.encode()) + tokens - 1  # generate never caches its last token
    plan = _plan_from_headers(ckpt, trained, context)
    bigviz.save_device_map(plan.device_map, out / "device_map.json")
    bigviz.save_html(plan, out / "report.html")
    with bigviz.init_empty_weights():
        model = GPT(trained.config)
    start = time.perf_counter()
    model = bigviz.load_checkpoint_and_dispatch(model, ckpt, device_map=plan.device_map)
    loaded_s = time.perf_counter() - start
    try:
        want, memory_s = _seconds_per_token(trained, tokens)
        got, offload_s = _seconds_per_token(model, tokens)
        same = got == want
        held = measured_bytes(model)
        _say(
            f"\n== loaded and dispatched in {loaded_s:.2f} s; generated {tokens} tokens with "
            f"{held.get('disk', 0) / max(sum(held.values()), 1):.0%} of the weights on disk:\n"
            f"   {decode_bytes(got)!r}\n   identical to the model in memory: {same}"
        )
        run = bigviz.measure_generate(model, encode_bytes(PROMPT), tokens)
        prompt_only = bigviz.plan(
            ckpt,
            {"cpu": 2 * bigviz.compute_module_sizes(trained)[""]},
            batch_size=1,
            context_length=len(PROMPT.encode()),
        )
        _say(_cost_lines(plan, prompt_only.activations["cpu"], held, run, memory_s, offload_s))
    finally:
        bigviz.remove_hooks(model)
    return same


def _cost_lines(
    plan: bigviz.DevicePlan, prefill: int, held: dict[str, int], run: object, memory_s: float, offload_s: float
) -> str:
    """Step 5: memory and time of a generated token, the plan's prediction against this run.

    ``prefill`` is the predicted activations of the prompt's prefill (the plan itself keeps
    room for the largest step it could run: a prefill of its whole context)."""
    streamed = plan.offloaded_bytes()
    warm = plan.cost(disk_bandwidth=WARM_SPEED).seconds
    cold = plan.cost(disk_bandwidth=DISK_SPEED).seconds
    rows = [
        ("weights in CPU RAM", plan.usage_of("cpu").used, held.get("cpu", 0), ""),
        (
            "weights on disk",
            plan.usage_of("disk").used,
            held.get("disk", 0),
            "on meta between forwards, read from the shards for every token",
        ),
        (
            "KV cache (CPU)",
            plan.kv_cache["cpu"],
            run.cache_bytes.get("cpu", 0),  # type: ignore[attr-defined]
            f"{run.cache_tokens} tokens",
        ),  # type: ignore[attr-defined]
        (
            "prompt's prefill activations",
            prefill,
            run.prefill_activations,  # type: ignore[attr-defined]
            f"the plan keeps {format_size(plan.activations['cpu'])} for the largest step it allows",
        ),
    ]
    lines = [
        "\n== the cost of a generated token: predicted by the plan, measured here",
        f"   {'':29}{'predicted':>11}{'measured':>11}",
    ]
    lines += [f"   {name:29}{format_size(p):>11}{format_size(m):>11}  {note}".rstrip() for name, p, m, note in rows]
    lines.append(
        f"   {'time per token':29}{(memory_s + warm) * 1e3:>8.2f} ms{offload_s * 1e3:>8.2f} ms  "
        f"predicted: {memory_s * 1e3:.2f} ms in memory (measured) + {format_size(streamed['disk'])} "
        f"from the page cache"
    )
    lines.append(
        f"   from a cold disk (NVMe, about 3 GB/s) each token would wait {cold * 1e3:.2f} ms more for its "
        "weights; prefetch reads the next block while this one computes (notebook 06 measures it)"
    )
    return "\n".join(lines)


def prepare_output(out: Path) -> None:
    """Make ``out`` ready for the demo's files, deleting nothing; every check before step 1.

    ``out`` must be new, empty, or an earlier demo's output: its marker ``bigviz-demo.json`` is
    bigviz's own (read, not just found by name) and every output already there is the one the
    demo wrote (same size and SHA-256), or one it was writing when it stopped. Links (the folder,
    an output, anything in ``checkpoint``) and outputs of the wrong type are refused.

    Raises:
        FileExistsError: naming what is in the way and why, with the fix.
    """
    if out.is_symlink():
        raise FileExistsError(f"--out {str(out)!r} is a link: the demo does not write through links; give a folder")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {str(out)!r} is a file: give a folder for the demo's files")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and MARKER not in held:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise FileExistsError(
            f"--out {str(out)!r} is not empty ({shown}) and is not an earlier bigviz demo output "
            f"(it has no {MARKER}); the demo never deletes or overwrites files it did not write: "
            "give a new or empty folder"
        )
    record = _read_marker(out) if held else _new_record()
    problems = _output_problems(out, record)
    if problems:
        raise FileExistsError(
            f"--out {str(out)!r} holds an earlier demo output, but the demo will not replace what is there now: "
            + "; ".join(problems)
            + ". The demo never deletes or overwrites files it did not write: move these away or give a new folder"
        )
    out.mkdir(parents=True, exist_ok=True)
    _write_marker(out, record, writing=OUTPUTS)


def record_outputs(out: Path, *, writing: tuple[str, ...] = ()) -> None:
    """Record in the marker what the demo wrote (size and SHA-256 of each file), so that the
    next run tells its own files from files changed or put there by hand."""
    record = _read_marker(out)
    files = dict(record["files"])
    for name in OUTPUTS:
        for path in _files_of(out / name):
            files[str(path.relative_to(out))] = _stamp(path)
    _write_marker(out, {**record, "files": files}, writing=writing)


def _new_record() -> dict[str, object]:
    return {"written_by": WRITTEN_BY, "format": MARKER_FORMAT, "outputs": list(OUTPUTS), "files": {}, "writing": []}


def _read_marker(out: Path) -> dict[str, Any]:
    """The marker's record, if bigviz wrote it (a legacy marker: every output trusted by name)."""
    path = out / MARKER
    why = ""
    if path.is_symlink() or not path.is_file():
        why = "it is a link" if path.is_symlink() else "it is not a file"
    elif path.stat().st_size > 2**20:
        why = "it is too large"
    else:
        try:
            data = parse_json(path.read_bytes(), path, "bigviz demo marker")
        except ValueError as err:
            data, why = None, str(err)
        if data == {"written_by": WRITTEN_BY, "outputs": list(OUTPUTS)}:  # bigviz 0.1's marker
            return {**_new_record(), "writing": list(OUTPUTS)}
        if not why and not _is_record(data):
            why = "its content is not the demo's record"
    if why:
        raise FileExistsError(
            f"--out {str(out)!r} has a {MARKER} that the demo did not write ({why}); the demo never deletes or "
            "overwrites files it did not write: give a new or empty folder"
        )
    return data  # type: ignore[no-any-return]


def _is_record(data: object) -> bool:
    if not isinstance(data, dict) or data.get("written_by") != WRITTEN_BY or data.get("format") != MARKER_FORMAT:
        return False
    files, writing = data.get("files"), data.get("writing")
    return (
        isinstance(files, dict)
        and all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()
        )
        and isinstance(writing, list)
        and all(w in OUTPUTS for w in writing)
    )


def _output_problems(out: Path, record: Mapping[str, Any]) -> list[str]:
    """Each output already in ``out`` the demo would replace but did not write as it is."""
    problems = []
    for name in OUTPUTS:
        path = out / name
        if not os.path.lexists(path):
            continue
        want_dir = name == "checkpoint"
        if path.is_symlink():
            problems.append(f"{name} is a link (to {os.readlink(path)!r})")
        elif path.is_dir() != want_dir or not (path.is_dir() or path.is_file()):
            problems.append(f"{name} is {'not a folder' if want_dir else 'not a file'}")
        elif name not in record["writing"]:
            problems += [_file_problem(out, f, record["files"]) for f in _files_of(path, links=True)]
        elif want_dir:  # being written when the demo stopped: its contents are the demo's, but no links
            problems += [f"{p.relative_to(out)} is a link" for p in _files_of(path, links=True) if p.is_symlink()]
    return [p for p in problems if p]


def _file_problem(out: Path, path: Path, files: Mapping[str, Any]) -> str:
    name = str(path.relative_to(out))
    if path.is_symlink() or not path.is_file():
        return f"{name} is a link" if path.is_symlink() else f"{name} is not a file"
    if name not in files:
        return f"{name} was not written by the demo"
    if _stamp(path) != files[name]:
        return f"{name} changed since the demo wrote it"
    return ""


def _files_of(path: Path, *, links: bool = False) -> list[Path]:
    """``path`` if a file, else every file under it (links listed when ``links``, never followed)."""
    if path.is_symlink():
        return [path] if links else []
    if path.is_file():
        return [path]
    found = []
    for root, dirs, names in os.walk(path):  # os.walk does not descend into linked folders
        found += [Path(root) / n for n in names + [d for d in dirs if (Path(root) / d).is_symlink()]]
    return sorted(p for p in found if links or not p.is_symlink())


def _stamp(path: Path) -> dict[str, object]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def _write_marker(out: Path, record: Mapping[str, Any], *, writing: tuple[str, ...]) -> None:
    write_json_atomic({**record, "writing": list(writing)}, out / MARKER)


def _next_steps(out: Path) -> str:
    return "\n".join(
        [
            "\n== where to look next",
            f"   {out / 'report.html'}: open it in a browser (works offline): the treemap of this plan, "
            "the budgets and every placement's reason",
            f"   {out / 'device_map.json'}: the map, for bigviz.load_checkpoint_and_dispatch or transformers' "
            "from_pretrained(device_map=...)",
            "   the notebooks explain each step, measured: in a clone of the bigviz repository, "
            'pip install -e ".[notebooks]" && jupyter lab notebooks/01_quickstart.ipynb',
            "   your own model: bigviz plan CHECKPOINT_OR_CONFIG --max-memory 0=24GiB,cpu=64GiB (bigviz plan --help)",
        ]
    )


def _since_start() -> float:
    """Seconds since this process started: imports included (torch's alone take seconds), as
    ``time bigviz demo`` measures; the time depends on the machine and on what else runs."""
    import psutil

    return time.time() - psutil.Process().create_time()


def main(out: str | Path = "bigviz-demo", *, quick: bool = False) -> int:
    """Run the demo, writing its files under ``out``. Returns a process exit code."""
    out = Path(out)
    prepare_output(out)
    start = time.perf_counter()
    _say("bigviz demo: plan, save, load, offload and run models bigger than your devices")
    plan_big_models(out)
    record_outputs(out, writing=OUTPUTS)
    trained = load_tiny()
    same = run_offloaded(out, trained, 24 if quick else 64)
    record_outputs(out)
    _say(_next_steps(out))
    _say(
        f"\ntotal {time.perf_counter() - start:.1f} s for the steps above; {_since_start():.1f} s since this process started"
    )
    return 0 if same else 1
