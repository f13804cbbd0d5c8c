"""Promise: bigviz never runs code from a checkpoint and never offers to. A config with
``auto_map`` (Python files transformers would import after a ``[y/N]`` prompt) is refused,
naming ``auto_map`` and the file, with no prompt: in the config-only planner, a checkpoint's
planner, ``model_from_config`` and every rank of ``python -m bigviz.distributed``; whatever
stdin holds (``y``, or nothing). transformers is always called with ``trust_remote_code=False``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import bigviz
from bigviz.cli import main

transformers = pytest.importorskip("transformers")

EVIL = """
import pathlib
pathlib.Path({ran!r}).write_text("the checkpoint's code ran")  # transformers imports a copy: an absolute path
from transformers import PretrainedConfig, PreTrainedModel
class EvilConfig(PretrainedConfig):
    model_type = "evil-model"
class EvilModel(PreTrainedModel):
    config_class = EvilConfig
"""
TINY = {"num_hidden_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32, "vocab_size": 64}


def _folder(tmp_path: Path, model_type: str, **extra: object) -> Path:
    """A checkpoint folder asking for its own code (``evil.py``, which leaves ``RAN`` when imported)."""
    folder = tmp_path / "remote"
    folder.mkdir(exist_ok=True)
    (folder / "evil.py").write_text(EVIL.format(ran=str(folder / "RAN")))
    auto_map = {
        "AutoConfig": "evil.EvilConfig",
        "AutoModel": "evil.EvilModel",
        "AutoModelForCausalLM": "evil.EvilModel",
    }
    config = {"model_type": model_type, **TINY, "auto_map": auto_map, **extra}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def no_prompt(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``input()`` answers "y" and records the question: nothing may ask one."""
    asked: list[str] = []

    def answer(prompt: str = "") -> str:
        asked.append(prompt)
        return "y"

    monkeypatch.setattr("builtins.input", answer)
    return asked


# "evil-model": transformers knows no such type, so it would prompt for the checkpoint's code;
# "t5": known, but has no causal-LM class, so AutoModelForCausalLM would prompt for evil.EvilModel
@pytest.mark.parametrize("model_type", ["evil-model", "t5", "llama"])
def test_the_config_only_planner_refuses_auto_map(tmp_path: Path, capsys, no_prompt, model_type):
    folder = _folder(tmp_path, model_type)
    assert (
        main(["plan", str(folder / "config.json"), "--max-memory", "cpu=1GB", "--out", str(tmp_path / "m.json")]) == 2
    )
    err = capsys.readouterr().err
    assert "auto_map" in err and str(folder / "config.json") in err and "never runs code" in err
    assert no_prompt == [] and not (folder / "RAN").exists() and not (tmp_path / "m.json").exists()
    for call in (bigviz.model_from_config, lambda p: bigviz.plan(p, {"cpu": "1GB"})):
        with pytest.raises(ValueError, match="auto_map"):
            call(folder)
    assert no_prompt == [] and not (folder / "RAN").exists()


def test_a_checkpoint_with_auto_map_is_refused(tmp_path: Path, capsys, no_prompt):
    """Weights beside the config: bigviz builds the config's model on meta to name modules."""
    from safetensors.torch import save_file
    import torch

    folder = _folder(tmp_path, "evil-model", architectures=["EvilModel"])
    save_file({"w": torch.zeros(4)}, folder / "model.safetensors")
    assert main(["plan", str(folder), "--max-memory", "cpu=1GB", "--out", str(tmp_path / "m.json")]) == 2
    assert "auto_map" in capsys.readouterr().err
    assert no_prompt == [] and not (folder / "RAN").exists()


def test_nested_auto_map_and_config_objects_are_refused(tmp_path: Path, no_prompt):
    with pytest.raises(ValueError, match="text_config.auto_map"):
        bigviz.model_from_config({"model_type": "llama", **TINY, "text_config": {"auto_map": {"AutoModel": "x.Y"}}})
    config = transformers.LlamaConfig(**TINY)
    config.auto_map = {"AutoModelForCausalLM": "evil.EvilModel"}
    with pytest.raises(ValueError, match="auto_map"):
        bigviz.model_from_config(config)
    assert no_prompt == []


def test_every_rank_of_the_distributed_entry_point_refuses_auto_map(tmp_path: Path, capsys, monkeypatch, no_prompt):
    from bigviz.distributed import cli

    from safetensors.torch import save_file
    import torch

    folder = _folder(tmp_path, "evil-model")
    save_file({"w": torch.zeros(4)}, folder / "model.safetensors")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        argv = [str(folder), "--stages", "2", "--input-ids", "1", "--out", str(tmp_path / "x.pt")]
        assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "auto_map" in err and str(folder / "config.json") in err
    assert no_prompt == [] and not (folder / "RAN").exists()


@pytest.mark.slow
@pytest.mark.parametrize("stdin", [b"y\n", None])
def test_no_prompt_whatever_stdin_holds(tmp_path: Path, stdin: bytes | None):
    """The commands as users run them: "y" waiting on stdin, or stdin closed. No prompt, no code
    run, no traceback; exit status 2."""
    folder = _folder(tmp_path, "evil-model")
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "PYTHONPATH": str(Path(__file__).parents[2])}
    commands = [
        [sys.executable, "-m", "bigviz.cli", "plan", str(folder / "config.json"), "--out", str(tmp_path / "m.json")],
        [sys.executable, "-m", "bigviz.distributed", str(folder), "--stages", "1", "--input-ids", "1"]
        + ["--out", str(tmp_path / "x.pt")],
    ]
    for command in commands:
        done = subprocess.run(
            command,
            input=stdin,
            stdin=subprocess.DEVNULL if stdin is None else None,
            capture_output=True,
            env=env,
            timeout=300,
        )
        out = (done.stdout + done.stderr).decode()
        assert done.returncode == 2, out
        assert "auto_map" in out and "[y/N]" not in out and "Traceback" not in out
        assert not (folder / "RAN").exists()
