"""save_sharded: transformers' file layout, sharding rules, ties, atomic writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from bigviz.checkpoint.index import CheckpointIndex
from bigviz.checkpoint.lazy import LazyWeights
from bigviz.checkpoint.save import save_sharded


def _state(n: int = 6, width: int = 16) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(width, width) for i in range(n)}  # 1 KiB each


def _read_back(folder: Path) -> dict[str, torch.Tensor]:
    index = CheckpointIndex.open(folder)
    with LazyWeights(index) as weights:
        return {k: weights[k].clone() for k in weights}


@pytest.mark.parametrize("safe", [True, False])
def test_round_trip_equal_tensors(tmp_path: Path, safe: bool) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    model.register_buffer("steps", torch.tensor(7))
    model.register_buffer("mask", torch.tensor([True, False]))
    model.half_w = nn.Parameter(torch.randn(3, dtype=torch.bfloat16))
    folder = save_sharded(model, tmp_path / "ckpt", max_shard_size=200, safe_serialization=safe, progress=False)
    back = _read_back(folder)
    assert back.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_file_names_and_index_format_match_transformers(tmp_path: Path) -> None:
    state = _state()
    folder = save_sharded(state, tmp_path / "c", max_shard_size="2500B", progress=False)
    names = sorted(p.name for p in folder.iterdir())
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + ["model.safetensors.index.json"]
    text = (folder / "model.safetensors.index.json").read_text()
    doc = json.loads(text)
    assert list(doc) == ["metadata", "weight_map"]
    assert doc["metadata"] == {"total_parameters": 6 * 256, "total_size": 6 * 1024}
    assert list(doc["weight_map"]) == sorted(state)
    assert doc["weight_map"]["layers.0.weight"] == "model-00001-of-00003.safetensors"
    assert text == json.dumps(doc, indent=2, sort_keys=True) + "\n"
    for shard in folder.glob("*.safetensors"):  # readable by the safetensors library itself
        with safetensors.safe_open(shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}


def test_bin_variant_names(tmp_path: Path) -> None:
    folder = save_sharded(_state(), tmp_path / "c", max_shard_size="2500B", safe_serialization=False, progress=False)
    assert sorted(p.name for p in folder.iterdir()) == [
        "pytorch_model-00001-of-00003.bin",
        "pytorch_model-00002-of-00003.bin",
        "pytorch_model-00003-of-00003.bin",
        "pytorch_model.bin.index.json",
    ]


def test_single_shard_is_plain_file_without_index(tmp_path: Path) -> None:
    folder = save_sharded(_state(), tmp_path / "c", progress=False)
    assert [p.name for p in folder.iterdir()] == ["model.safetensors"]
    assert safetensors.torch.load_file(folder / "model.safetensors").keys() == _state().keys()


def test_shard_sizes_respected_greedy_and_oversize_alone(tmp_path: Path) -> None:
    state = {
        "a": torch.ones(100),
        "b": torch.ones(100),
        "big": torch.ones(1000),
        "c": torch.ones(100),
        "d": torch.ones(100),
        "e": torch.ones(100),
    }  # 400 B each, big = 4000 B
    folder = save_sharded(state, tmp_path / "c", max_shard_size=1000, progress=False)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shards: dict[str, list[str]] = {}
    for name in state:  # key order
        shards.setdefault(weight_map[name], []).append(name)
    assert list(shards.values()) == [["a", "b"], ["big"], ["c", "d"], ["e"]]
    for shard, names in shards.items():
        data = sum(state[n].numel() * 4 for n in names)
        assert data <= 1000 or names == ["big"]
        assert (folder / shard).stat().st_size < data + 200  # header is small


def test_tied_tensors_saved_once_under_first_name(tmp_path: Path, hf_gpt2: nn.Module) -> None:
    state = hf_gpt2.state_dict()
    assert (
        state["lm_head.weight"] is state["transformer.wte.weight"]
        or state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    )
    folder = save_sharded(hf_gpt2, tmp_path / "c", progress=False)
    keys = CheckpointIndex.open(folder).keys()
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys


def test_views_of_one_storage_are_kept_and_non_contiguous_saved(tmp_path: Path) -> None:
    fused = torch.arange(12.0).reshape(3, 4)
    state = {"q": fused[0], "k": fused[1], "t": fused.t(), "col": fused[:, 1]}
    for safe in (True, False):
        folder = save_sharded(state, tmp_path / f"c{safe}", safe_serialization=safe, progress=False)
        back = _read_back(folder)
        for name, tensor in state.items():
            assert torch.equal(back[name], tensor), name
    bin_file = tmp_path / "cFalse" / "pytorch_model.bin"
    assert bin_file.stat().st_size < 4000  # views did not drag whole storages along


def test_meta_tensors_give_a_clear_error(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="meta device.*load_checkpoint_in_model"):
        save_sharded(model, tmp_path / "c", progress=False)
    assert not (tmp_path / "c").exists()


def test_existing_folder_needs_overwrite(tmp_path: Path) -> None:
    folder = save_sharded({"a": torch.ones(2)}, tmp_path / "c", progress=False)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_sharded({"b": torch.ones(2)}, folder, progress=False)
    assert CheckpointIndex.open(folder).keys() == {"a"}
    save_sharded({"b": torch.ones(2)}, folder, overwrite=True, progress=False)
    assert CheckpointIndex.open(folder).keys() == {"b"}
    (tmp_path / "empty").mkdir()
    save_sharded({"a": torch.ones(2)}, tmp_path / "empty", progress=False)  # empty is fine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "empty"]  # no temp folders left


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_failure_mid_save_leaves_nothing_behind(tmp_path: Path) -> None:
    # complex32 has no safetensors code: the writer fails on the second shard, after the first
    state = {"a": torch.ones(256), "b": torch.ones(256), "bad": torch.ones(4, dtype=torch.complex32)}
    with pytest.raises(TypeError, match="bad"):
        save_sharded(state, tmp_path / "new", max_shard_size=1024, progress=False)
    assert list(tmp_path.iterdir()) == []
    old = save_sharded({"keep": torch.ones(2)}, tmp_path / "old", progress=False)
    with pytest.raises(TypeError):
        save_sharded(state, old, max_shard_size=1024, overwrite=True, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["old"]
    assert CheckpointIndex.open(old).keys() == {"keep"}  # the old checkpoint survived


def test_metadata_and_from_pretrained_reads_bigviz_checkpoint(tmp_path: Path, hf_gpt2: nn.Module) -> None:
    from transformers import GPT2LMHeadModel

    folder = save_sharded(hf_gpt2, tmp_path / "gpt2", max_shard_size="20KB", metadata={"who": "test"}, progress=False)
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    with safetensors.safe_open(next(folder.glob("model-*")), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "who": "test"}
    hf_gpt2.config.save_pretrained(folder)
    loaded = GPT2LMHeadModel.from_pretrained(folder)
    reference = hf_gpt2.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


@pytest.mark.parametrize("kind", ["gpt_neox", "mixtral"])
def test_a_transformers_model_is_saved_in_its_stored_names_as_save_pretrained_writes(tmp_path: Path, kind: str) -> None:
    """transformers renames or fuses some weights when it loads them (GPT-NeoX's embed_out is
    lm_head in memory; Mixtral's experts are stored one by one, fused in memory) and reverts that
    when it saves: save_sharded writes the same keys and bytes as save_pretrained (it wrote the
    in-memory names, a layout older transformers and other tools cannot read), and both
    from_pretrained and bigviz read it back to the same logits."""
    transformers = pytest.importorskip("transformers")
    import bigviz

    torch.manual_seed(0)
    if kind == "gpt_neox":
        config = transformers.GPTNeoXConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
        )
        model = transformers.GPTNeoXForCausalLM(config).eval()
    else:
        config = transformers.MixtralConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=3,
        )  # fmt: skip
        model = transformers.MixtralForCausalLM(config).eval()
    ours = save_sharded(model, tmp_path / "bigviz", config=model.config, max_shard_size="20KB", progress=False)
    model.save_pretrained(tmp_path / "hf")

    def stored(folder: Path) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for path in folder.glob("*.safetensors"):
            out |= safetensors.torch.load_file(path)
        return out

    mine, theirs = stored(ours), stored(tmp_path / "hf")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert mine.keys() != model.state_dict().keys()  # the stored names are not the in-memory ones
    ids = torch.randint(0, 64, (1, 6))
    again = type(model).from_pretrained(ours).eval()
    with bigviz.init_empty_weights():
        empty = type(model)(config).eval()
    bigviz.load_checkpoint_in_model(empty, ours, progress=False)
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.equal(again(ids).logits, expected) and torch.equal(empty(ids).logits, expected)
