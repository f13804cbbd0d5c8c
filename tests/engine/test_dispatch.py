"""dispatch_model and load_checkpoint_and_dispatch on bigviz's reference models (CPU).

Every parity check is bitwise (``torch.equal``): on the CPU an offloaded module computes
with the very same numbers and kernels as the in-memory one.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import bigviz
from bigviz.checkpoint.save import save_sharded
from bigviz.engine.big_modeling import load_checkpoint_and_dispatch
from bigviz.engine.dispatch import dispatch_model
from bigviz.engine.hooks import remove_hooks
from bigviz.engine.offload_hooks import OffloadedTrainingError
from bigviz.models import GPT, GPTConfig, Llama, LlamaConfig

KINDS = ["all-cpu", "half-disk", "alternating", "all-disk"]


def build(family: str, *, meta: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if meta:
        with bigviz.init_empty_weights():
            return build_plain(family)
    return build_plain(family).eval()


def build_plain(family: str) -> nn.Module:
    if family == "gpt":
        return GPT(GPTConfig.preset("gpt-mini"))
    return Llama(LlamaConfig.preset("llama-tiny", n_layers=4))


def entries(model: nn.Module) -> list[str]:
    """Blocks, and every other module owning tensors directly, in definition order."""
    blocks = set(model._no_split_modules)
    names: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(b + ".") for b in names):
            continue
        owns = any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))
        if type(module).__name__ in blocks or (owns and name):
            names.append(name)
    return names


def make_map(model: nn.Module, kind: str) -> dict[str, str]:
    if kind == "all-disk":
        return {"": "disk"}
    names = entries(model)
    blocks = [n for n in names if type(model.get_submodule(n)).__name__ in model._no_split_modules]
    if kind == "all-cpu":
        return dict.fromkeys(names, "cpu")
    if kind == "half-disk":
        return {n: "disk" if n in blocks[len(blocks) // 2 :] else "cpu" for n in names}
    alternating = {n: "disk" if i % 2 else "cpu" for i, n in enumerate(names)}
    for tie in bigviz.find_tied_parameters(model):  # the loader wants tied modules together
        homes = [next(n for n in names if t == n or t.startswith(n + ".")) for t in tie]
        alternating.update(dict.fromkeys(homes, alternating[homes[0]]))
    return alternating


@pytest.fixture(params=["gpt", "llama"])
def family(request: pytest.FixtureRequest) -> str:
    return request.param


def inputs(model: nn.Module) -> torch.Tensor:
    vocab = model.config.vocab_size
    return torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", KINDS)
def test_materialised_model_output_is_bitwise_equal(family: str, kind: str, tmp_path: Path):
    reference = build(family)
    idx = inputs(reference)
    with torch.no_grad():
        expected, _ = reference(idx)
    model = dispatch_model(copy.deepcopy(reference), make_map(reference, kind), offload_folder=tmp_path / "off")
    with torch.no_grad():
        got, _ = model(idx)
    assert torch.equal(got, expected)
    state = getattr(model, "_bigviz_dispatch", None)  # one device: no hooks at all
    disk_units = [u for u in state.units if u.storage == "disk"] if state is not None else []
    assert bool(disk_units) == (kind != "all-cpu")
    for unit in disk_units:  # offloaded weights are on meta between forwards
        assert all(p.is_meta for p in unit.module.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_dispatch_matches_and_generates_the_same_tokens(family: str, kind: str, tmp_path: Path):
    reference = build(family)
    idx = inputs(reference)
    with torch.no_grad():
        expected, _ = reference(idx)
    tokens = reference.generate(idx[:1], 6)
    folder = save_sharded(reference.state_dict(), tmp_path / "ckpt", max_shard_size="200KB", progress=False)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir())
    model = load_checkpoint_and_dispatch(build(family, meta=True), folder, make_map(reference, kind))
    assert not model.training
    with torch.no_grad():
        got, _ = model(idx)
    assert torch.equal(got, expected)
    assert torch.equal(model.generate(idx[:1], 6), tokens)
    assert sorted((p.name, p.stat().st_mtime_ns) for p in folder.iterdir()) == before  # read in place
    assert not (tmp_path / "off").exists()


def test_auto_plan_under_a_small_budget_offloads_and_matches(tmp_path: Path):
    reference = build("gpt")
    folder = save_sharded(reference.state_dict(), tmp_path / "ckpt", progress=False)
    total = sum(p.numel() * p.element_size() for p in reference.parameters())
    idx = inputs(reference)
    with torch.no_grad():
        expected, _ = reference(idx)
    for strategy in ("auto", "sequential"):
        model = load_checkpoint_and_dispatch(
            build("gpt", meta=True), folder, strategy, max_memory={"cpu": total * 4 // 5, "disk": "1GB"}
        )
        assert "disk" in model.hf_device_map.values() and "cpu" in model.hf_device_map.values()
        with torch.no_grad():
            assert torch.equal(model(idx)[0], expected)
        remove_hooks(model)


def test_a_device_plan_is_accepted(tmp_path: Path):
    reference = build("gpt")
    folder = save_sharded(reference.state_dict(), tmp_path / "ckpt", progress=False)
    plan = bigviz.plan(build("gpt", meta=True), {"cpu": "1MB", "disk": "1GB"})
    model = load_checkpoint_and_dispatch(build("gpt", meta=True), folder, plan)
    assert model.hf_device_map == {k: v for k, v in plan.device_map.items()}
    idx = inputs(reference)
    with torch.no_grad():
        assert torch.equal(model(idx)[0], reference(idx)[0])


def test_remove_hooks_restores_forward_and_weights(tmp_path: Path):
    reference = build("gpt")
    model = copy.deepcopy(reference)
    dispatch_model(model, make_map(model, "alternating"), offload_folder=tmp_path / "off")
    remove_hooks(model)
    assert not any("forward" in m.__dict__ or hasattr(m, "_hf_hook") for m in model.modules())
    assert not hasattr(model, "hf_device_map") and "to" not in model.__dict__
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        assert got.device.type == "cpu" and torch.equal(got, want), name
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survived the round trip
    assert model.to("cpu") is model


def test_remove_hooks_keeps_a_tie_whose_both_halves_were_on_disk(tmp_path: Path):
    reference = build("gpt")
    both = {**make_map(reference, "all-cpu"), "transformer.wte": "disk", "lm_head": "disk"}
    model = dispatch_model(copy.deepcopy(reference), both, offload_folder=tmp_path)
    with pytest.raises(ValueError, match="already dispatched"):
        dispatch_model(model, both, offload_folder=tmp_path)
    remove_hooks(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)


def test_remove_hooks_leaves_checkpoint_weights_on_meta(tmp_path: Path):
    folder = save_sharded(build("gpt").state_dict(), tmp_path / "ckpt", progress=False)
    model = load_checkpoint_and_dispatch(build("gpt", meta=True), folder, make_map(build("gpt"), "half-disk"))
    remove_hooks(model)
    assert model.transformer.h[3].attn.c_attn.weight.device.type == "meta"
    assert model.transformer.h[0].attn.c_attn.weight.device.type == "cpu"


@pytest.mark.parametrize("method", ["to", "cuda", "cpu", "half"])
def test_moving_a_dispatched_model_raises_with_the_fix(method: str, tmp_path: Path):
    model = dispatch_model(build("gpt"), {"": "disk"}, offload_folder=tmp_path / "off")
    args = ("cpu",) if method == "to" else ()
    with pytest.raises(RuntimeError, match=r"remove_hooks\(model\)"):
        getattr(model, method)(*args)


@pytest.mark.skipif(torch.cuda.device_count() > 3, reason="this machine has a GPU 3")
def test_missing_gpu_raises_before_anything_is_loaded(tmp_path: Path):
    folder = save_sharded(build("gpt").state_dict(), tmp_path / "ckpt", progress=False)
    model = build("gpt", meta=True)
    bad = {**make_map(build("gpt"), "all-cpu"), "transformer.h.1": 3}
    with pytest.raises(ValueError, match=r"GPU 3 \(transformer.h.1\).*available"):
        load_checkpoint_and_dispatch(model, folder, bad)
    assert all(p.device.type == "meta" for p in model.parameters())
    plain = build("gpt")
    with pytest.raises(ValueError, match="GPU 3"):
        dispatch_model(plain, bad)
    assert not hasattr(plain, "_hf_hook")


def test_an_incomplete_map_is_refused_before_loading(tmp_path: Path):
    folder = save_sharded(build("gpt").state_dict(), tmp_path / "ckpt", progress=False)
    model = build("gpt", meta=True)
    incomplete = {k: v for k, v in make_map(build("gpt"), "all-cpu").items() if k != "transformer.ln_f"}
    with pytest.raises(ValueError, match="transformer.ln_f"):
        load_checkpoint_and_dispatch(model, folder, incomplete)
    assert all(p.device.type == "meta" for p in model.parameters())


def test_problems_are_collected_before_anything_moves(tmp_path: Path):
    model = build("gpt")
    with pytest.raises(ValueError, match="offload_folder"):
        dispatch_model(model, {"": "disk"})
    assert model.transformer.h[0].attn.c_attn.weight.device.type == "cpu" and not hasattr(model, "_hf_hook")
    meta = build("gpt", meta=True)
    with pytest.raises(ValueError, match="no weights mapping"):
        dispatch_model(meta, {"": "disk"}, offload_folder=tmp_path)


def test_a_folder_with_other_files_is_not_emptied(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds files bigviz did not write.*notes.txt"):
        dispatch_model(build("gpt"), {"": "disk"}, offload_folder=tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_tied_weights_fetched_by_both_units_or_kept_resident(tmp_path: Path):
    reference = build("gpt")
    idx = inputs(reference)
    with torch.no_grad():
        expected, _ = reference(idx)
    both = {**make_map(reference, "all-cpu"), "transformer.wte": "disk", "lm_head": "disk"}
    model = dispatch_model(copy.deepcopy(reference), both, offload_folder=tmp_path / "a")
    units = {u.name: u for u in model._bigviz_dispatch.units}
    assert "transformer.wte.weight" in units["lm_head"].slots  # one stored tensor, two users
    with torch.no_grad():
        assert torch.equal(model(idx)[0], expected)
    one = {**make_map(reference, "all-cpu"), "lm_head": "disk"}
    model = dispatch_model(copy.deepcopy(reference), one, offload_folder=tmp_path / "b")
    assert model.lm_head.weight is model.transformer.wte.weight  # resident for both
    assert not model._bigviz_dispatch.units


def test_offload_buffers_streams_buffers_too(tmp_path: Path):
    reference = build("llama")
    idx = inputs(reference)
    with torch.no_grad():
        expected, _ = reference(idx)
    model = dispatch_model(copy.deepcopy(reference), {"": "disk"}, offload_folder=tmp_path, offload_buffers=True)
    assert model.model.rotary_emb.inv_freq.is_meta
    with torch.no_grad():
        assert torch.equal(model(idx)[0], expected)
    kept = dispatch_model(copy.deepcopy(reference), {"": "disk"}, offload_folder=tmp_path / "k")
    assert kept.model.rotary_emb.inv_freq.device.type == "cpu"


def test_training_through_offloaded_weights_fails_loudly_inference_does_not(tmp_path: Path):
    model = dispatch_model(build("gpt"), make_map(build("gpt"), "half-disk"), offload_folder=tmp_path)
    idx = inputs(model)
    logits, loss = model(idx, idx)  # grad mode on: works, like an in-memory model
    with pytest.raises(OffloadedTrainingError, match=r"transformer.h.3.*torch.no_grad"):
        loss.backward()
    with torch.no_grad():
        assert not model(idx)[0].requires_grad
    model.requires_grad_(False)
    assert not model(idx)[0].requires_grad  # nothing trainable: no guard, no graph


def test_hf_device_map_and_skip_keys(tmp_path: Path):
    model = dispatch_model(build("gpt"), make_map(build("gpt"), "half-disk"), offload_folder=tmp_path)
    assert model.hf_device_map["transformer.h.3"] == "disk"
    assert model._bigviz_dispatch.options.skip_keys == ("cache", "past_key_values")
    own = dispatch_model(build("gpt"), {"": "disk"}, offload_folder=tmp_path / "b", skip_keys="state")
    assert own._bigviz_dispatch.options.skip_keys == ("state",)


class UsesChildWeight(nn.Module):
    """Reads its child's weight without calling the child, in a way no code scan sees."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        child = self.proj  # not a `self.proj.weight` chain: found only at run time
        return nn.functional.linear(x, child.weight, child.bias)


def test_preload_module_classes_fetches_the_whole_module(tmp_path: Path):
    torch.manual_seed(0)
    model = nn.Sequential(UsesChildWeight(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    expected = model(x)
    leafwise = {"0.proj": "disk", "1": "cpu"}
    broken = dispatch_model(copy.deepcopy(model), leafwise, offload_folder=tmp_path / "a")
    with pytest.raises((RuntimeError, NotImplementedError)) as err:
        broken(x)
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert "'0.proj'" in notes and "preload_module_classes" in notes  # names the module and the fix
    fixed = dispatch_model(
        copy.deepcopy(model), leafwise, offload_folder=tmp_path / "b", preload_module_classes=["UsesChildWeight"]
    )
    assert [u.name for u in fixed._bigviz_dispatch.units] == ["0"]
    with torch.no_grad():
        assert torch.equal(fixed(x), expected)
