"""The ``bigviz`` command: ``plan`` on presets and checkpoints, and the demo end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

import bigviz
from bigviz.cli import main, parse_max_memory_arg
from bigviz.models import build


def test_max_memory_argument():
    assert parse_max_memory_arg("cpu=8GiB,0=16GiB") == {"cpu": "8GiB", "0": "16GiB"}
    with pytest.raises(Exception, match="DEVICE=SIZE"):
        parse_max_memory_arg("cpu8GiB")


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["plan", "--help"]])
def test_help_is_plain_text(argv, capsys):
    """argparse prints descriptions as they are: no reST markup from docstrings."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and ":func:" not in text and len(text) > 200
    if argv[0] == "--help":
        assert "bigviz demo" in text and "examples:" in text


def test_plan_preset_writes_map_and_report(tmp_path, capsys):
    out, html = tmp_path / "map.json", tmp_path / "report.html"
    code = main(
        [
            "plan",
            "llama-70b",
            "--dtype",
            "float16",
            "--max-memory",
            "0=24GiB,cpu=64GiB",
            "--out",
            str(out),
            "--html",
            str(html),
        ]
    )
    assert code == 0
    device_map = bigviz.load_device_map(out)
    assert {0, "cpu", "disk"} <= set(device_map.values())
    assert json.loads(out.read_text())["model.embed_tokens"] == 0
    assert "GPU 0" in capsys.readouterr().out and html.stat().st_size > 10_000


def test_plan_reserve_keeps_memory_free_per_device(tmp_path, capsys):
    """--reserve is plan(reserve=): the map is the one bigviz.plan makes with that reserve, a GPU
    told to keep 6 GiB free holds less of the model, ``0`` is the bare arithmetic (a plan of
    weights only keeps nothing by default); a bad device or size is refused, nothing written."""
    with bigviz.init_empty_weights():
        model = build("llama-70b")
    held = {}
    for reserve, given in ((None, None), ("0=6GiB", {0: "6GiB"}), ("0", 0)):
        out = tmp_path / f"{reserve}.json"
        extra = [] if reserve is None else ["--reserve", reserve]
        argv = ["plan", "llama-70b", "--dtype", "float16", "--max-memory", "0=24GiB,cpu=64GiB", "--out", str(out)]
        assert main([*argv, *extra]) == 0
        device_map = bigviz.load_device_map(out)
        want = bigviz.plan(model, {0: "24GiB", "cpu": "64GiB"}, dtype="float16", reserve=given)
        assert device_map == want.device_map, reserve
        held[reserve] = sum(1 for v in device_map.values() if v == 0)
    assert held["0=6GiB"] < held["0"] == held[None]
    capsys.readouterr()
    for bad, said in (("x=1GiB", "unknown device 'x'"), ("0=lots", "'lots'"), ("0=1GiB,0=2GiB", "twice")):
        try:  # argparse refuses what it cannot read (SystemExit 2); the planner what it cannot use
            code = main(["plan", "gpt2", "--reserve", bad, "--out", str(tmp_path / "bad.json")])
        except SystemExit as e:
            code = e.code
        assert code == 2 and said in capsys.readouterr().err, bad
    assert not (tmp_path / "bad.json").exists()


def test_plan_checkpoint_from_headers(tmp_path):
    torch.manual_seed(0)
    model = build("gpt-mini")  # 4 blocks of B bytes
    bigviz.save_sharded(model, tmp_path / "ckpt", max_shard_size="200KB")
    sizes = bigviz.compute_module_sizes(model)
    block = sizes["transformer.h.0"]
    # Room for the embeddings and one block: the CPU computes on disk blocks' memory-mapped
    # pages, so no RAM is kept for them.
    budget = sizes["transformer.wte"] + sizes["transformer.wpe"] + block + 1000
    out = tmp_path / "map.json"
    code = main(
        [
            "plan",
            str(tmp_path / "ckpt"),
            "--max-memory",
            f"cpu={budget}",
            "--no-split",
            "transformer.h.*",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    device_map = bigviz.load_device_map(out)
    assert device_map["transformer.h.0"] == "cpu"
    assert [device_map[f"transformer.h.{i}"] for i in (1, 2, 3)] == ["disk"] * 3
    assert all(not k.startswith("transformer.h.0.") for k in device_map)  # blocks kept whole


def test_plan_reports_bad_input(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "missing"), "--out", str(tmp_path / "m.json")]) == 2
    assert "neither a checkpoint path nor a preset" in capsys.readouterr().err
    assert main(["plan", "gpt2", "--max-memory", "cpu=lots", "--out", str(tmp_path / "m.json")]) == 2
    assert "'lots'" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


@pytest.mark.slow
def test_demo_runs_end_to_end(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bigviz.cli", "demo", "--quick", "--out", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "identical to the model in memory: True" in out
    assert not re.search(r"\d{7,}", out), "sizes are printed friendly (KiB, GiB), not as raw byte counts"
    # the cost of a token: the plan's prediction next to the measurement, for memory and time
    kv = re.search(r"KV cache \(CPU\)\s+(\S+ \S+)\s+(\S+ \S+)", out)
    assert kv and kv.group(1) == kv.group(2), out  # the cache is predicted exactly
    assert re.search(r"time per token\s+[\d.]+ ms\s+[\d.]+ ms", out)
    assert "report.html: open it in a browser" in out and "notebooks" in out  # where to look next
    device_map = bigviz.load_device_map(tmp_path / "d" / "device_map.json")
    assert "disk" in device_map.values()
    assert (tmp_path / "d" / "report.html").stat().st_size > 10_000
