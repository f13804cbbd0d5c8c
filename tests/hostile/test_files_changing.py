"""Promise: a checkpoint shard truncated or rewritten while a disk-offloaded model runs gives an
error naming the file and the module at the next fetch, never a SIGBUS that kills the process,
never garbage. A shard *replaced* by rename is harmless: the model keeps reading the file it
opened. Each case runs in a subprocess, so a SIGBUS would show as its exit status."""

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
    from bigviz.models import GPT, GPTConfig

    DEVICE_MAP = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.h": "disk",
                  "transformer.ln_f": "cpu", "lm_head": "cpu"}


    def change(shard, mode):
        if mode == "truncate":
            os.truncate(shard, shard.stat().st_size // 2)
        elif mode == "rewrite":  # same size, new bytes, same file (what cp or a download in place does)
            with open(shard, "r+b") as f:
                f.seek(shard.stat().st_size - 4096)
                f.write(b"\\xff" * 4096)
        elif mode == "replace":  # a new file renamed over the old one
            tmp = shard.with_suffix(".new")
            tmp.write_bytes(b"\\0" * shard.stat().st_size)
            os.replace(tmp, shard)


    def case(folder, mode):
        torch.manual_seed(0)
        ref = GPT(GPTConfig.preset("gpt-tiny")).eval()
        bigviz.save_sharded(ref, folder, max_shard_size="20KB", progress=False)
        with bigviz.init_empty_weights():
            model = GPT(ref.config)
        model = bigviz.load_checkpoint_and_dispatch(model, folder, DEVICE_MAP)
        x = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            want = ref(x)[0]
            first = torch.equal(model(x)[0], want)
        weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        shard = folder / weight_map["transformer.h.1.mlp.c_fc.weight"]
        units = sorted({".".join(k.split(".")[:3]) for k, f in weight_map.items() if folder / f == shard})
        change(shard, mode)
        result = {"first": first, "units": units, "shard": str(shard), "errors": []}
        for _ in range(2):
            try:
                with torch.no_grad():
                    result["same"] = torch.equal(model(x)[0], want)
            except Exception as err:
                result["errors"].append([type(err).__name__, str(err)])
        result["meta"] = all(p.is_meta for p in model.transformer.h.parameters())
        return result


    root = Path(sys.argv[1])
    print(json.dumps({mode: case(root / mode, mode) for mode in sys.argv[2:]}))
""")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """All three cases in one subprocess (one torch import)."""
    root = tmp_path_factory.mktemp("changing")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root), "truncate", "rewrite", "replace"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"exit {done.returncode} (-7 is SIGBUS): {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["truncate", "rewrite"])
def test_a_shard_changed_under_a_running_model_is_an_error_not_a_crash(results: dict, mode: str):
    result = results[mode]
    assert result["first"]
    assert len(result["errors"]) == 2, result  # every later forward says so too
    for kind, message in result["errors"]:
        assert kind == "FetchError" and result["shard"] in message and "changed" in message, message
        assert any(f"'{unit}'" in message for unit in result["units"]), (result["units"], message)
    assert result["meta"]  # nothing left half set


def test_a_shard_replaced_by_rename_keeps_serving_what_was_opened(results: dict):
    result = results["replace"]
    assert result["first"] and result["errors"] == [] and result["same"]
