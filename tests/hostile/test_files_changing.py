"""Promise: a checkpoint shard truncated or rewritten while a disk-offloaded model runs gives an
error naming the file and the module at the next fetch, never a SIGBUS that kills the process,
never garbage. A shard *replaced* by rename (or moved away and a new file put in its place) is
harmless: the model keeps reading the file it opened. Both hold in every way disk units are
streamed: zero-copy maps (``resident="map"``), the ``O_DIRECT`` ring (``resident="copy"``) and the
page cache (``stream="cache"``), whether the change comes before the first forward or between
two; and for the zero-copy "cpu" weights of a dispatched model, whose files are checked before
each forward. Each case runs in a subprocess, so a SIGBUS would show as its exit status."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import torch
    import bigviz
    from bigviz.engine.resident import make_resident
    from bigviz.models import GPT, GPTConfig

    DEVICE_MAP = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.h": "disk",
                  "transformer.ln_f": "cpu", "lm_head": "cpu"}


    def change(shard, mode):
        size = shard.stat().st_size
        if mode == "truncate":
            os.truncate(shard, size // 2)
        elif mode == "rewrite":  # same size, new bytes, same file (what cp or a download in place does)
            with open(shard, "r+b") as f:
                f.seek(size - 4096)
                f.write(b"\\xff" * 4096)
        elif mode == "replace":  # a new file renamed over the old one
            tmp = shard.with_suffix(".new")
            tmp.write_bytes(b"\\0" * size)
            os.replace(tmp, shard)
        elif mode == "move":  # the old file moved away (kept), a new one in its place
            os.rename(shard, shard.with_suffix(".old"))
            shard.write_bytes(b"\\0" * size)


    def run_twice(model, x, want, result):
        # every later forward says so too: two, each error recorded
        for _ in range(2):
            try:
                with torch.no_grad():
                    result["same"] = torch.equal(model(x)[0], want)
            except Exception as err:
                result["errors"].append([type(err).__name__, str(err)])


    def dispatched(folder, stream):
        with bigviz.init_empty_weights():
            model = GPT(GPTConfig.preset("gpt-tiny"))
        return bigviz.load_checkpoint_and_dispatch(
            model, folder, DEVICE_MAP, resident="map" if stream == "map" else "copy",
            stream="cache" if stream == "cache" else "ring")


    def case(folder, stream, mode, when):
        torch.manual_seed(0)
        ref = GPT(GPTConfig.preset("gpt-tiny")).eval()
        bigviz.save_sharded(ref, folder, max_shard_size="20KB", progress=False)
        model = dispatched(folder, stream)
        x = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = ref(x)[0]
            first = True if when == "before" else torch.equal(model(x)[0], want)
        weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        shard = folder / weight_map["transformer.h.1.mlp.c_fc.weight"]
        units = sorted({".".join(k.split(".")[:3]) for k, f in weight_map.items() if folder / f == shard})
        change(shard, mode)
        result = {"first": first, "units": units, "shard": str(shard), "errors": [],
                  "fetcher": type(model._bigviz_dispatch.scheduler.fetcher).__name__}
        run_twice(model, x, want, result)
        result["meta"] = all(p.is_meta for p in model.transformer.h.parameters())
        bigviz.remove_hooks(model)
        return result


    def resident_copy_after(folder, mode):
        # "cpu" weights copied into process memory after their shard was replaced by rename:
        # the copy reads the file the model mapped, not the new one
        from bigviz.osio.procfs import FileMaps
        torch.manual_seed(0)
        ref = GPT(GPTConfig.preset("gpt-tiny")).eval()
        bigviz.save_sharded(ref, folder, max_shard_size="20KB", progress=False)
        model = dispatched(folder, "map")
        weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        change(folder / weight_map["transformer.wte.weight"], mode)
        make_resident(model, progress=False)  # the copy, made after the rename
        x = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            same = torch.equal(model(x)[0], ref(x)[0])
        return {"same": same, "resident": FileMaps().find(model.transformer.wte.weight.data_ptr()) is None}


    def cpu_case(folder, mode, where, resident):
        # the shard holding zero-copy "cpu" weights (the embeddings) changed under the model
        torch.manual_seed(0)
        ref = GPT(GPTConfig.preset("gpt-tiny")).eval()
        bigviz.save_sharded(ref, folder, max_shard_size="20KB", progress=False)
        with bigviz.init_empty_weights():
            model = GPT(GPTConfig.preset("gpt-tiny"))
        device_map = DEVICE_MAP if where == "split" else {"": "cpu"}
        model = bigviz.load_checkpoint_and_dispatch(model, folder, device_map, resident=resident)
        x = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = ref(x)[0]
            first = torch.equal(model(x)[0], want)
        weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        shard = folder / weight_map["transformer.wte.weight"]
        change(shard, mode)
        result = {"first": first, "shard": str(shard), "errors": []}
        run_twice(model, x, want, result)
        bigviz.remove_hooks(model)
        return result


    root = Path(sys.argv[1])
    out = {}
    for spec in sys.argv[2:]:
        if spec.startswith("resident-"):
            out[spec] = resident_copy_after(root / spec, spec.split("-")[1])
        elif spec.startswith("cpu-"):
            out[spec] = cpu_case(root / spec, *spec.split("-")[1:])
        else:
            out[spec] = case(root / spec, *spec.split("-"))
    print(json.dumps(out))
""")

STREAMS = ["map", "ring", "cache"]
CASES = [f"{s}-{m}-{w}" for s in STREAMS for m in ("truncate", "rewrite", "replace", "move") for w in ("between",)]
CASES += [f"{s}-{m}-before" for s in STREAMS for m in ("replace", "truncate")]
CPU_CASES = [f"cpu-{m}-{w}-map" for m in ("truncate", "rewrite", "replace") for w in ("split", "all")]
CPU_CASES += ["cpu-truncate-split-copy"]  # copied into memory: the file is not read any more


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every case in one subprocess (one torch import)."""
    root = tmp_path_factory.mktemp("changing")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root), *CASES, "resident-replace", "resident-move", *CPU_CASES],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"exit {done.returncode} (-7 is SIGBUS): {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("stream", STREAMS)
def test_each_stream_mode_is_what_it_says(results: dict, stream: str):
    want = {"map": "CpuFetcher", "ring": "RingFetcher", "cache": "StreamingFetcher"}[stream]
    assert results[f"{stream}-replace-between"]["fetcher"] == want


@pytest.mark.parametrize("case", [c for c in CASES if "truncate" in c or "rewrite" in c])
def test_a_shard_changed_under_a_running_model_is_an_error_not_a_crash(results: dict, case: str):
    result = results[case]
    assert result["first"]
    assert len(result["errors"]) == 2, result  # every later forward says so too
    for kind, message in result["errors"]:
        assert kind == "FetchError" and result["shard"] in message and "changed" in message, message
        assert any(f"'{unit}'" in message for unit in result["units"]), (result["units"], message)
    assert result["meta"]  # nothing left half set


@pytest.mark.parametrize("case", [c for c in CASES if "replace" in c or "move" in c])
def test_a_shard_replaced_by_rename_keeps_serving_what_was_opened(results: dict, case: str):
    result = results[case]
    assert result["first"] and result["errors"] == [] and result["same"], result


@pytest.mark.parametrize("mode", ["replace", "move"])
def test_a_resident_copy_made_after_a_rename_copies_the_file_the_model_opened(results: dict, mode: str):
    result = results[f"resident-{mode}"]
    assert result["resident"] and result["same"], result


@pytest.mark.parametrize("case", [c for c in CPU_CASES if c.endswith("-map") and "replace" not in c])
def test_a_shard_under_zero_copy_cpu_weights_changed_is_an_error_not_a_sigbus(results: dict, case: str):
    """The weights on the CPU are views of the mapped shard: its files are checked before each
    forward (one fstat each), on a split map and on a map with nothing offloaded."""
    result = results[case]
    assert result["first"] and len(result["errors"]) == 2, result
    for kind, message in result["errors"]:
        assert kind == "FetchError" and result["shard"] in message and "changed" in message, message
        assert "'transformer.wte'" in message, message


@pytest.mark.parametrize("case", [c for c in CPU_CASES if "replace" in c or c.endswith("-copy")])
def test_a_shard_under_cpu_weights_renamed_or_already_copied_is_harmless(results: dict, case: str):
    result = results[case]
    assert result["first"] and result["errors"] == [] and result["same"], result
