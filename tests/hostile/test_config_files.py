"""Promise: a hostile ``config.json`` or ``--plan`` file is a clear error naming the file, read
through bigviz's one JSON parser: a JSON array, nesting 100,000 deep, bytes that are not UTF-8,
a key given twice, numbers written as strings, a FIFO, a folder, a file of many megabytes. No
``RecursionError``, no traceback, no hang; nothing written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import bigviz
from bigviz.cli import main
from bigviz.core.pipeline import PipelineError, PipelinePlan
from bigviz.models import GPT, GPTConfig

from tests.hostile.helpers import snapshot

GPT_CONFIG = {"model_type": "bigviz-gpt", **GPTConfig.preset("gpt-tiny").to_dict()}
HOSTILE: dict[str, bytes] = {
    "array": b"[1, 2, 3]",
    "string": b'"llama"',
    "deep": b'{"a": ' * 100_000 + b"1" + b"}" * 100_000,
    "deep list": b"[" * 100_000 + b"]" * 100_000,
    "latin-1": '{"model_type": "café"}'.encode("latin-1"),
    "utf-16": json.dumps(GPT_CONFIG).encode("utf-16"),
    "truncated": json.dumps(GPT_CONFIG).encode()[:-5],
    "duplicate": b'{"model_type": "bigviz-gpt", "n_layer": 2, "n_layer": 48}',
    "empty": b"",
    "huge digits": b'{"n_layer": ' + b"9" * 5000 + b"}",
}
SAYS = {
    "array": "a model config is a JSON object",
    "string": "a model config is a JSON object",
    "deep": "nested too deeply",
    "deep list": "nested too deeply",
    "latin-1": "not valid JSON",
    "utf-16": "not valid JSON",
    "truncated": "not valid JSON",
    "duplicate": "key 'n_layer' appears twice (2, then 48)",
    "empty": "not valid JSON",
    "huge digits": "not valid JSON",
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_config_files_are_named(tmp_path: Path, capsys, case: str):
    folder = tmp_path / "cfg"
    folder.mkdir()
    path = folder / "config.json"
    path.write_bytes(HOSTILE[case])
    before = snapshot(tmp_path)
    assert main(["plan", str(path), "--max-memory", "cpu=1GB", "--out", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert SAYS[case] in err and str(path) in err and "Traceback" not in err, err
    for call in (bigviz.model_from_config, lambda p: bigviz.plan(p, {"cpu": "1GB"}), bigviz.Planner):
        with pytest.raises(ValueError, match=SAYS[case].replace("(", r"\(").replace(")", r"\)")) as caught:
            call(folder)
        assert str(path) in str(caught.value)
    assert snapshot(tmp_path) == before


def test_numbers_as_strings_are_named(tmp_path: Path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GPT_CONFIG, "n_layer": "2", "vocab_size": "128"}))
    with pytest.raises(ValueError) as caught:
        bigviz.model_from_config(path)
    text = str(caught.value)
    assert "n_layer = '2' (a string)" in text and "vocab_size = '128' (a string)" in text and str(path) in text


def test_odd_files_as_config(tmp_path: Path):
    """A FIFO would block a read forever, a folder or a 20 MB file is no config: all named at once."""
    fifo = tmp_path / "fifo" / "config.json"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        bigviz.model_from_config(fifo)
    big = tmp_path / "big.json"
    big.write_bytes(b'{"model_type": "llama", "pad": "' + b"x" * (20 * 2**20) + b'"}')
    with pytest.raises(ValueError, match="larger than 16 MiB"):
        bigviz.model_from_config(big)
    with pytest.raises(ValueError, match="cannot read"):
        bigviz.model_from_config(tmp_path / "missing.json")


def test_a_checkpoints_hostile_config_is_named(tmp_path: Path, capsys):
    """The config.json beside a checkpoint's weights is read the same way."""
    folder = tmp_path / "ckpt"
    bigviz.save_sharded(GPT(GPTConfig.preset("gpt-tiny")), folder, progress=False)
    for case in ("array", "deep", "latin-1", "duplicate"):
        (folder / "config.json").write_bytes(HOSTILE[case])
        assert main(["plan", str(folder), "--max-memory", "cpu=1GB", "--out", str(tmp_path / "m.json")]) == 2
        err = capsys.readouterr().err
        assert SAYS[case] in err and str(folder / "config.json") in err and "Traceback" not in err, (case, err)


# ---- --plan files of python -m bigviz.distributed -----------------------------------------------
@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    with bigviz.init_empty_weights():
        model = GPT(GPTConfig.preset("gpt-tiny"))
    path = tmp_path / "plan.json"
    bigviz.plan_pipeline(model, 2).save_json(path)
    return path


def _edit(path: Path, change) -> Path:  # type: ignore[no-untyped-def]
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("case", ["array", "deep", "deep list", "latin-1", "utf-16", "truncated", "empty"])
def test_hostile_plan_files_are_named(plan_file: Path, case: str):
    plan_file.write_bytes(HOSTILE[case])
    with pytest.raises(PipelineError) as caught:
        PipelinePlan.load_json(plan_file)
    assert str(plan_file) in str(caught.value)


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda d: d["units"][0].update(stage="0"), "units[0].stage is '0', not a whole number"),
        (lambda d: d["units"][1].update(bytes="12"), "units[1].bytes is '12', not a whole number"),
        (lambda d: d["units"][1].update(flops=True), "units[1].flops is True, not a whole number"),
        (lambda d: d["stages"][0].update(bytes=1.5), "stages[0].bytes is 1.5, not a whole number"),
        (lambda d: d["stages"][1].update(budget="1GB"), "stages[1].budget is '1GB'"),
        (lambda d: d["cuts"][0].update(before=3), "cuts[0].before is 3, not a string"),
        (lambda d: d.update(units=[1, 2]), "units[0] is not a JSON object"),
        (lambda d: d.update(notes="x"), "the plan.notes is 'x', not a list"),
        (lambda d: d.update(shared=[{"name": "w"}]), "shared[0] has no 'leader'"),
    ],
)
def test_plan_fields_of_the_wrong_type_are_named(plan_file: Path, change, says: str):  # type: ignore[no-untyped-def]
    _edit(plan_file, change)
    with pytest.raises(PipelineError) as caught:
        PipelinePlan.load_json(plan_file)
    assert says in str(caught.value) and str(plan_file) in str(caught.value)


def test_a_plan_with_a_key_twice_is_refused(plan_file: Path, tmp_path: Path, capsys, monkeypatch):
    text = plan_file.read_text()
    plan_file.write_text(text.replace('"balance":', '"balance": "compute", "balance":', 1))
    with pytest.raises(PipelineError, match="key 'balance' appears twice"):
        PipelinePlan.load_json(plan_file)
    from bigviz.distributed import cli

    folder = tmp_path / "ckpt"
    model = GPT(GPTConfig.preset("gpt-tiny"))
    bigviz.save_sharded(model, folder, config=model.config, progress=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [str(folder), "--plan", str(plan_file), "--input-ids", "1", "--out", str(tmp_path / "x.pt")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "appears twice" in err and str(plan_file) in err and not (tmp_path / "x.pt").exists()
