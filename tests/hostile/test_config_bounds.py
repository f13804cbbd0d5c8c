"""Promise: a ``config.json`` is checked before anything is built from it. A sizing number (layers,
widths, heads, vocabulary, positions, experts; in the config and its sub-configs, as transformers
or bigviz spell them) that is not a whole number, not positive, or absurd (10**12 layers, a
hundred-trillion-parameter estimate) is a ``ValueError`` naming the file, the key and the value,
at once: no hang, no model with no layers. An unknown model type's error is short, with the
closest names. Real configs are not refused: every config class transformers ships, and bigviz's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bigviz
from bigviz.cli import main
from bigviz.core.config_bounds import MAX_LAYERS, config_problems
from bigviz.models import GPTConfig, LlamaConfig

from tests.hostile.helpers import snapshot

LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "max_position_embeddings": 256,
}
GPT = {"model_type": "bigviz-gpt", **GPTConfig.preset("gpt-tiny").to_dict()}
BIGVIZ_LLAMA = LlamaConfig.preset("llama-tiny").to_dict()


def _write(folder: Path, data: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "base, key, value, says",
    [
        (LLAMA, "num_hidden_layers", 10**12, "num_hidden_layers = 1000000000000: more layers than bigviz builds"),
        (LLAMA, "num_hidden_layers", -3, "num_hidden_layers = -3: must be at least 1"),
        (LLAMA, "num_hidden_layers", 0, "num_hidden_layers = 0: must be at least 1"),
        (LLAMA, "num_hidden_layers", "32", "num_hidden_layers = '32' (a string): write a whole number without quotes"),
        (LLAMA, "num_hidden_layers", 2.5, "num_hidden_layers = 2.5 (a float): must be a whole number"),
        (LLAMA, "num_hidden_layers", True, "num_hidden_layers = True (a bool)"),
        (LLAMA, "hidden_size", 10**12, "hidden_size = 1000000000000"),
        (LLAMA, "hidden_size", 0, "hidden_size = 0: must be at least 1"),
        (LLAMA, "num_attention_heads", -1, "num_attention_heads = -1"),
        (LLAMA, "num_key_value_heads", 0, "num_key_value_heads = 0"),
        (LLAMA, "vocab_size", 10**15, "vocab_size = 1000000000000000"),
        (LLAMA, "intermediate_size", [128, -5], "intermediate_size = [128, -5]: must be at least 1"),
        (LLAMA, "max_position_embeddings", "4k", "max_position_embeddings = '4k' (a string)"),
        (GPT, "n_layer", 10**12, "n_layer = 1000000000000: more layers than bigviz builds"),
        (GPT, "n_layer", -3, "n_layer = -3: must be at least 1"),
        (GPT, "n_embd", "32", "n_embd = '32' (a string)"),
        (GPT, "block_size", 0, "block_size = 0: must be at least 1"),
        (BIGVIZ_LLAMA, "n_layers", 10**9, "n_layers = 1000000000"),
        (BIGVIZ_LLAMA, "ffn_dim", 0, "ffn_dim = 0"),
    ],
)
def test_bad_sizing_numbers_are_refused_naming_file_key_and_value(tmp_path: Path, capsys, base, key, value, says):
    path = _write(tmp_path / "cfg", {**base, key: value})
    before = snapshot(tmp_path)
    assert main(["plan", str(path), "--max-memory", "cpu=1GB", "--out", str(tmp_path / "map.json")]) == 2
    err = capsys.readouterr().err
    assert says in err and str(path) in err and "Traceback" not in err, err
    with pytest.raises(ValueError, match="cannot build a model from it"):
        bigviz.plan(path, {"cpu": "1GB"})
    with pytest.raises(ValueError, match="cannot build a model from it"):
        bigviz.model_from_config({**base, key: value})
    assert snapshot(tmp_path) == before  # no map written


def test_sub_configs_and_experts_are_checked_too():
    problems = config_problems({"model_type": "x", "text_config": {"num_hidden_layers": -3, "hidden_size": 8}})
    assert problems == ["text_config.num_hidden_layers = -3: must be at least 1"]
    problems = config_problems({"num_hidden_layers": 4, "hidden_size": 4096, "num_local_experts": 10**9})
    assert "num_local_experts = 1000000000" in problems[0]
    huge = config_problems({"num_hidden_layers": 100, "hidden_size": 10**6, "intermediate_size": 10**6})
    assert "parameters" in huge[0] and "hidden_size = 1000000" in huge[0]
    # ints too large for str(): named by their power of ten, no ValueError from Python's digit limit
    assert "about 10**" in config_problems({"num_hidden_layers": 2, "hidden_size": 10**5000})[0]


def test_configs_given_as_objects_are_checked(tmp_path: Path):
    with pytest.raises(ValueError, match="n_layer = 1000000000000"):
        bigviz.kv_cache_bytes(GPTConfig(n_layer=10**12, n_head=2, n_embd=8), 1, 8)
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})
    config.num_hidden_layers = -3  # set after the constructor's checks
    with pytest.raises(ValueError, match="num_hidden_layers = -3"):
        bigviz.model_from_config(config)


def test_a_checkpoint_folders_config_is_checked(tmp_path: Path, capsys):
    """Planning a checkpoint builds its config's model on meta to name modules: checked too."""
    model = bigviz.model_from_config(LLAMA)
    pytest.importorskip("transformers")
    folder = tmp_path / "ckpt"
    bigviz.save_sharded(model.to_empty(device="cpu"), folder, progress=False)
    _write(folder, {**LLAMA, "num_hidden_layers": 10**12, "architectures": ["LlamaForCausalLM"]})
    before = snapshot(folder)
    assert main(["plan", str(folder), "--max-memory", "cpu=1GB", "--out", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert "num_hidden_layers = 1000000000000" in err and str(folder / "config.json") in err
    assert snapshot(folder) == before


def test_the_distributed_entry_point_checks_the_config(tmp_path: Path, capsys, monkeypatch):
    from bigviz.distributed import cli

    folder = tmp_path / "ckpt"
    model = bigviz.models.GPT(GPTConfig.preset("gpt-tiny"))
    bigviz.save_sharded(model, folder, config=model.config, progress=False)
    _write(folder, {**GPT, "n_layer": 10**12})
    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = [str(folder), "--stages", "1", "--input-ids", "1", "--out", str(tmp_path / "x.pt")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "n_layer = 1000000000000" in err and str(folder / "config.json") in err
    assert not (tmp_path / "x.pt").exists()


def test_an_unknown_model_type_is_short_and_names_close_ones(tmp_path: Path, capsys):
    pytest.importorskip("transformers")
    path = _write(tmp_path / "cfg", {**LLAMA, "model_type": "lama"})
    assert main(["plan", str(path), "--max-memory", "cpu=1GB", "--out", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert len(err) < 1000, len(err)
    assert "'lama'" in err and "'llama'" in err and str(path) in err and "upgrade transformers" in err
    for odd in (3, ["llama"], None):
        _write(tmp_path / "cfg", {**LLAMA, "model_type": odd})
        with pytest.raises(ValueError, match="model_type") as caught:
            bigviz.model_from_config(path)
        assert len(str(caught.value)) < 1000 and str(path) in str(caught.value)


def test_a_config_transformers_cannot_build_is_named(tmp_path: Path):
    """Errors from deep inside a constructor (a validator, a division) name the file, not a traceback."""
    pytest.importorskip("transformers")
    path = _write(tmp_path / "cfg", {**LLAMA, "num_attention_heads": 5})  # 64 is not divisible by 5
    with pytest.raises(ValueError, match="cannot build a 'llama'") as caught:
        bigviz.model_from_config(path)
    assert str(path) in str(caught.value)
    path = _write(tmp_path / "cfg", {**GPT, "n_head": 3})  # bigviz's GPTConfig refuses 32 % 3
    with pytest.raises(ValueError, match="cannot build a 'bigviz-gpt' model") as caught:
        bigviz.model_from_config(path)
    assert "divisible" in str(caught.value) and str(path) in str(caught.value)


def test_bigviz_configs_pass():
    """No false refusals: bigviz's shipped configs and presets."""
    for name in bigviz.shipped_configs():
        assert config_problems(json.loads(bigviz.config_path(name).read_text())) == [], name
    assert config_problems(GPTConfig.preset("gpt2-xl").to_dict()) == []
    assert config_problems(LlamaConfig.preset("llama-70b").to_dict()) == []
    assert MAX_LAYERS >= 1000  # DeepNet's 1,000 layers still plan


@pytest.mark.slow
def test_every_transformers_config_passes():
    """No false refusals: every config class of the installed transformers with its defaults (820
    in 5.24: MoE, encoder-decoders, multimodal sub-configs, per-layer lists, lxmert's dict of
    layers, a float position count)."""
    transformers = pytest.importorskip("transformers")
    refused = {}
    for model_type, config_class in transformers.CONFIG_MAPPING.items():
        try:
            data = config_class().to_dict()
        except Exception:  # a config class that needs arguments: nothing to check
            continue
        if config_problems(data):
            refused[model_type] = config_problems(data)
    assert refused == {}


def test_a_quantizers_own_settings_are_not_sizing_numbers():
    """torchao writes ``dim = -1`` (per-row scales) inside ``quantization_config``: a checkpoint
    stored quantized builds; remote code named there is still refused, and sizing numbers
    outside it are still checked."""
    quantizer = {"quant_type": {"default": {"_data": {"granularity": {"_data": {"dim": -1}}}}}}
    assert config_problems({"model_type": "llama", "num_hidden_layers": 2, "quantization_config": quantizer}) == []
    nested = {"text_config": {"num_hidden_layers": 2, "quantization_config": quantizer}}
    assert config_problems(nested) == []
    assert config_problems({"quantization_config": {"auto_map": {"AutoModel": "m.X"}}})
    assert config_problems({"num_hidden_layers": -2, "quantization_config": quantizer})
