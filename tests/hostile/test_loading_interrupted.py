"""Promise: a load interrupted midway (Ctrl-C, a read error) leaves the model exactly as it was:
values and objects, into a real model (``load_sharded_checkpoint`` copies in place) as into a
model on meta. The fault is injected at the third tensor (and at every tensor in turn)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import bigviz
from bigviz.checkpoint import loader as load_module
from bigviz.models import GPT, GPTConfig

from tests.hostile.helpers import assert_same_state, model_state


def _gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("gpt-tiny")).eval()


def _fail_at(monkeypatch: pytest.MonkeyPatch, n: int, error: BaseException) -> list[str]:
    """Make the ``n``-th tensor conversion of a load raise ``error``."""
    seen: list[str] = []
    convert = load_module._convert

    def faulty(tensor: torch.Tensor, load: object) -> torch.Tensor:
        seen.append(load.name)  # type: ignore[attr-defined]
        if len(seen) == n:
            raise error
        return convert(tensor, load)

    monkeypatch.setattr(load_module, "_convert", faulty)
    return seen


@pytest.mark.parametrize("at", [1, 3, 8, 14])
def test_interrupted_load_sharded_checkpoint_rolls_back_values(tmp_path: Path, monkeypatch, at: int):
    folder = bigviz.save_sharded(_gpt(1), tmp_path / "ckpt", max_shard_size="20KB", progress=False)
    model = _gpt(2)
    before = model_state(model)
    objects = {name: (p, p.data_ptr()) for name, p in model.named_parameters()}
    seen = _fail_at(monkeypatch, at, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        bigviz.load_sharded_checkpoint(model, folder)
    assert len(seen) == at
    assert_same_state(model, before)  # values, not only objects
    for name, p in model.named_parameters():  # the same objects, on the same memory
        assert p is objects[name][0] and p.data_ptr() == objects[name][1], name
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survived


def test_interrupted_load_with_a_dtype_change_and_a_read_error(tmp_path: Path, monkeypatch):
    folder = bigviz.save_sharded(_gpt(1), tmp_path / "ckpt", progress=False)
    model = _gpt(2).to(torch.bfloat16)
    before = model_state(model)
    _fail_at(monkeypatch, 5, OSError("disk read error"))
    with pytest.raises(OSError, match="disk read error"):
        bigviz.load_sharded_checkpoint(model, folder)
    assert_same_state(model, before)


def test_a_load_that_succeeds_after_an_interrupted_one(tmp_path: Path, monkeypatch):
    source = _gpt(1)
    folder = bigviz.save_sharded(source, tmp_path / "ckpt", max_shard_size="20KB", progress=False)
    model = _gpt(2)
    _fail_at(monkeypatch, 6, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        bigviz.load_sharded_checkpoint(model, folder)
    monkeypatch.undo()
    assert bigviz.load_sharded_checkpoint(model, folder) == ([], [])
    assert_same_state(model, model_state(source))


def test_interrupted_load_into_a_materialised_model_keeps_objects_and_values(tmp_path: Path, monkeypatch):
    folder = bigviz.save_sharded(_gpt(1), tmp_path / "ckpt", progress=False)
    model = _gpt(2)
    before = model_state(model)
    params = dict(model.named_parameters())
    _fail_at(monkeypatch, 4, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        bigviz.load_checkpoint_in_model(model, folder, progress=False)
    assert_same_state(model, before)
    assert all(p is params[n] for n, p in model.named_parameters())


def test_interrupted_load_into_a_meta_model_leaves_it_on_meta(tmp_path: Path, monkeypatch):
    folder = bigviz.save_sharded(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), tmp_path / "c", progress=False)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    _fail_at(monkeypatch, 3, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        bigviz.load_checkpoint_in_model(model, folder, progress=False)
    assert all(p.is_meta for p in model.parameters())


def _llama_checkpoint(tmp_path: Path) -> tuple[Path, nn.Module, object]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt", reference, config


def test_a_dispatch_that_fails_after_the_load_leaves_the_model_as_it_was(tmp_path: Path, monkeypatch):
    """load_checkpoint_and_dispatch loads, then dispatches: a refusal found in the dispatch (a
    non-persistent buffer on disk with offload_buffers=True and no folder to write it) or any
    failure there (injected) puts back the model it was given: every tensor the same object on
    meta, no hooks, no device map. Then the same model loads."""
    transformers = pytest.importorskip("transformers")
    from bigviz.engine import big_modeling

    folder, reference, config = _llama_checkpoint(tmp_path)
    with bigviz.init_empty_weights():
        model = transformers.LlamaForCausalLM(config).eval()
    objects = {name: t for name, t in [*model.named_parameters(), *model.named_buffers()]}
    device_map = {"": "disk", "model.embed_tokens": "cpu"}
    with pytest.raises(ValueError, match="(?s)load_checkpoint_and_dispatch.*model.rotary_emb.*offload_buffers=False"):
        bigviz.load_checkpoint_and_dispatch(model, folder, device_map, offload_buffers=True)

    def check_untouched() -> None:
        now = dict([*model.named_parameters(), *model.named_buffers()])
        assert now.keys() == objects.keys() and all(now[k] is objects[k] for k in now)
        assert not any(hasattr(m, "_hf_hook") for m in model.modules()) and not hasattr(model, "hf_device_map")

    check_untouched()
    assert model.model.embed_tokens.weight.is_meta

    def failing(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(big_modeling, "execute_dispatch", failing)
    with pytest.raises(KeyboardInterrupt):
        bigviz.load_checkpoint_and_dispatch(model, folder, device_map)
    check_untouched()
    monkeypatch.undo()
    model = bigviz.load_checkpoint_and_dispatch(model, folder, device_map)
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    bigviz.remove_hooks(model)


def test_a_quantized_load_that_fails_in_the_dispatch_puts_the_float_layers_back(tmp_path: Path, monkeypatch):
    """quantization= replaces layers before the load: a failure after it puts the model's own
    layers back (the same objects), not the quantized ones."""
    pytest.importorskip("torchao")
    transformers = pytest.importorskip("transformers")
    from bigviz.engine import big_modeling

    folder, _, config = _llama_checkpoint(tmp_path)
    with bigviz.init_empty_weights():
        model = transformers.LlamaForCausalLM(config).eval()
    layers = dict(model.named_modules())
    classes = {name: type(m) for name, m in layers.items()}

    def failing(*args: object, **kwargs: object) -> None:
        raise OSError("injected")

    monkeypatch.setattr(big_modeling, "execute_dispatch", failing)
    with pytest.raises(OSError, match="injected"):
        bigviz.load_checkpoint_and_dispatch(
            model, folder, {"": "cpu", "model.layers.1": "disk"}, quantization="int8", offload_folder=tmp_path / "off"
        )
    after = dict(model.named_modules())
    assert after.keys() == layers.keys() and all(after[k] is layers[k] for k in after)
    assert {name: type(m) for name, m in after.items()} == classes
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert all(p.is_meta for p in model.parameters())
