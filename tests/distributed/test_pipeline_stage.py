"""Pipeline stages in one process: every stage of a model built from meta, loaded from a
sharded checkpoint, chained by hand. The logits equal the whole model's, bit for bit; each
rank loads exactly its stage's tensors (a tied head's tensor on both ends); every bad plan,
checkpoint or request is refused before a weight is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import bigviz
from bigviz.checkpoint.load import check_checkpoint
from bigviz.core.pipeline import PipelineError
from bigviz.distributed import build_stage_module, empty_model
from bigviz.models import GPT, GPTConfig
from tests.distributed.pipeline_models import BUILDERS, hf_llama

IDS = torch.tensor([[5, 3, 17, 2, 9, 11]])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each model saved as a sharded checkpoint with its config, and its own logits for IDS."""
    out = {}
    for name, build in BUILDERS.items():
        torch.manual_seed(0)
        model = build().eval()
        folder = tmp_path_factory.mktemp(name) / "ckpt"
        if name.startswith("hf"):
            model.save_pretrained(folder, max_shard_size="40KB")
        else:
            bigviz.save_sharded(model, folder, max_shard_size="40KB", config=model.config, progress=False)
        with torch.no_grad():
            result = model(IDS)
        out[name] = (folder, result[0] if isinstance(result, tuple) else result.logits)
    return out


def _keys(folder: Path) -> set[str]:
    return set(bigviz.CheckpointIndex.open(folder).keys())


def _run_all(folder: Path, stages: int, **kwargs) -> tuple[torch.Tensor, list]:
    """Build every stage on its own fresh model (as each rank does) and chain them; only
    the stage's own tensors ever leave meta."""
    x, builds = IDS.to(kwargs.get("device", "cpu")), []
    for rank in range(stages):
        model = empty_model(folder)
        plan = bigviz.plan_pipeline(model, stages)
        built = build_stage_module(model, folder, plan, rank, **kwargs)
        held = {id(t) for t in (*built.module.parameters(), *built.module.buffers())}
        others = [n for n, p in model.named_parameters() if id(p) not in held and not p.is_meta]
        assert not others, f"stage {rank} materialised other stages' tensors: {others[:5]}"
        with torch.no_grad():
            x = built.module(x)
        builds.append(built)
    return x, builds


@pytest.mark.parametrize("name", list(BUILDERS))
def test_stages_chained_give_the_models_logits_and_load_only_their_tensors(checkpoints, name):
    folder, want = checkpoints[name]
    logits, builds = _run_all(folder, 3, split="wrap")
    assert torch.equal(logits, want)
    filled = _filled(folder)  # model tensor -> the checkpoint keys it is read from
    plan = builds[0].plan
    assert plan.n_stages == 3 and assert_shards(folder)
    for rank, built in enumerate(builds):
        assert built.method == "wrap" and built.rank == rank
        expected = {t for t in plan.tensors_of(rank) if t in filled}  # its units' tensors + shared ties
        assert set(built.loaded) == expected, f"rank {rank}"
        index = bigviz.CheckpointIndex.open(folder)
        assert built.nbytes == sum(index[k].nbytes for t in expected for k in filled[t])
        assert not any(p.is_meta for p in built.module.parameters())
    loaded = [set(b.loaded) for b in builds]
    assert set.union(*loaded) == set(filled)  # together the ranks load the checkpoint ...
    twice = (loaded[0] & loaded[2]) | (loaded[0] & loaded[1]) | (loaded[1] & loaded[2])
    assert twice == {s.leader for s in plan.shared}  # ... and only tied tensors twice


def _filled(folder: Path) -> dict[str, tuple[str, ...]]:
    """Every model tensor the checkpoint fills, with the keys it is read (or fused) from."""
    plan = check_checkpoint(empty_model(folder), folder)
    return {load.name: load.keys for load in plan.loads}


def assert_shards(folder: Path) -> bool:
    return len(bigviz.CheckpointIndex.open(folder).files) > 3  # really sharded


def test_gpt_tie_is_loaded_by_first_and_last_stage(checkpoints):
    folder, _ = checkpoints["gpt"]
    _, builds = _run_all(folder, 2, split="wrap")
    first, last = (set(b.loaded) for b in builds)
    assert "transformer.wte.weight" in first and "transformer.wte.weight" in last
    assert "transformer.wpe.weight" not in last and "transformer.ln_f.weight" not in first
    assert {n.split(".")[2] for n in first if n.startswith("transformer.h.")} == {"0", "1"}
    assert builds[1].plan.notes == (
        "lm_head.weight is tied to transformer.wte.weight (stage 0): stage 1 loads that tensor too (16.0 KiB)",
    )
    with bigviz.LazyWeights(bigviz.CheckpointIndex.open(folder)) as weights:
        assert torch.equal(builds[1].module.part("lm_head").weight, weights["transformer.wte.weight"])


@pytest.mark.slow
def test_torch_tracer_splits_gpt_and_falls_back_for_llama(checkpoints):
    folder, want = checkpoints["gpt"]
    logits, builds = _run_all(folder, 2, example_args=(IDS,))
    assert [b.method for b in builds] == ["trace", "trace"] and torch.equal(logits, want)
    assert set(builds[1].loaded) >= {"transformer.wte.weight", "transformer.ln_f.weight"}
    folder, want = checkpoints["llama"]
    model = empty_model(folder)
    built = build_stage_module(model, folder, bigviz.plan_pipeline(model, 2), 0, example_args=(IDS,))
    assert built.method == "wrap" and built.fallback  # the tracer cannot capture it: said why
    with pytest.raises(PipelineError, match="torch's tracer could not split Llama"):
        model = empty_model(folder)
        build_stage_module(model, folder, bigviz.plan_pipeline(model, 2), 0, example_args=(IDS,), split="trace")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gpt", "hf-llama"])
def test_stages_on_a_gpu(checkpoints, name):
    folder, want = checkpoints[name]
    logits, builds = _run_all(folder, 2, split="wrap", device="cuda:0")
    assert all(p.device.type == "cuda" for b in builds for p in b.module.parameters())
    assert all(b.device == torch.device("cuda:0") for b in builds)
    torch.testing.assert_close(logits.cpu(), want, rtol=1e-4, atol=1e-5)


# ---- refused before anything loads ----------------------------------------------------
def _untouched(model: nn.Module) -> bool:
    return all(p.is_meta for p in model.parameters())


def test_plan_for_another_model_is_refused(checkpoints):
    folder, _ = checkpoints["gpt"]
    with torch.device("meta"):
        six = GPT(GPTConfig.preset("gpt-tiny", n_layer=6))
    plan = bigviz.plan_pipeline(six, 3)  # cuts at h.2 and h.4 of six blocks
    model = empty_model(folder)
    with pytest.raises(PipelineError) as info:
        build_stage_module(model, folder, plan, 0)
    text = str(info.value)
    assert "nothing was loaded" in text and "split point 'transformer.h.4' is not a no-split block" in text
    assert _untouched(model)


def test_checkpoint_of_another_model_is_refused(checkpoints, tmp_path):
    folder, _ = checkpoints["gpt"]
    wide = GPT(GPTConfig.preset("gpt-tiny", n_layer=4, n_embd=64))
    other = bigviz.save_sharded(wide, tmp_path / "wide", config=wide.config, progress=False)
    model = empty_model(folder)
    with pytest.raises(PipelineError) as info:
        build_stage_module(model, other, bigviz.plan_pipeline(model, 2), 1)
    assert "shape mismatch: transformer.wte.weight: checkpoint 'transformer.wte.weight' has shape [128, 64]" in str(
        info.value
    )
    assert len(info.value.problems) > 10 and _untouched(model)


def test_bad_requests_are_refused(checkpoints):
    folder, _ = checkpoints["llama"]
    model = empty_model(folder)
    plan = bigviz.plan_pipeline(model, 2)
    with pytest.raises(PipelineError, match=r"rank 2 is not a stage of this 2-stage plan \(0 \.\. 1\)"):
        build_stage_module(model, folder, plan, 2)
    with pytest.raises(PipelineError, match="split='trace' needs example_args"):
        build_stage_module(model, folder, plan, 0, split="trace")
    # blocks finer than the layers: the adapter runs whole layers only
    fine = bigviz.plan_pipeline(model, 3, no_split_module_classes=["LlamaAttention", "LlamaMLP"])
    with pytest.raises(PipelineError) as info:
        build_stage_module(model, folder, fine, 0, split="wrap")
    assert "the stage adapter runs whole layers" in str(info.value)
    assert _untouched(model)


def test_a_buffer_nothing_can_fill_is_refused_before_loading(checkpoints):
    folder, _ = checkpoints["hf-llama"]
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # buffers on meta too: the rotary inv_freq is never saved
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).eval()
    with pytest.raises(PipelineError) as info:
        build_stage_module(model, folder, bigviz.plan_pipeline(model, 2), 1)
    assert "model.rotary_emb.inv_freq" in str(info.value) and "bigviz.init_empty_weights()" in str(info.value)
    assert _untouched(model)


def test_a_model_without_decoder_parts_needs_the_tracer(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    folder = bigviz.save_sharded(model, tmp_path / "seq", progress=False)
    with torch.device("meta"):
        empty = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    plan = bigviz.plan_pipeline(empty, 2)
    with pytest.raises(PipelineError, match="pass example_args so torch's tracer"):
        build_stage_module(empty, folder, plan, 0)


def test_a_layout_without_its_calls_says_which_one_is_missing():
    from bigviz.distributed.adapters import DecoderLayout

    layout = DecoderLayout("my-family", first=("emb",), blocks="layers", last=("head",))
    with pytest.raises(TypeError, match="'my-family' stage layout has no embed"):
        layout.embed(None, torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="'my-family' stage layout has no run_block"):
        layout.run_block(nn.Identity(), torch.zeros(1, 2, 4), {})


# ---- each rank's memory: its stage, not the model ---------------------------------------
_MEASURE_RANK = """
import json, sys, torch, bigviz
from bigviz.distributed import build_stage_module, empty_model
from bigviz.modeling.process_memory import PeakMemory
folder, rank, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
model = empty_model(folder)
plan = bigviz.plan_pipeline(model, 2, dtype=getattr(torch, dtype))
with PeakMemory(("RssAnon",), interval=0.001) as peak:
    built = build_stage_module(model, folder, plan, rank, split="wrap", dtype=dtype)
print(json.dumps({"anon": peak.above()["RssAnon"], "stage": plan.stage_bytes[rank], "model": sum(plan.stage_bytes)}))
"""


def _rank_memory(folder: Path, rank: int, dtype: str) -> dict[str, int]:
    import json
    import subprocess
    import sys

    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE_RANK, str(folder), str(rank), dtype],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_each_rank_holds_its_stage_not_the_model(tmp_path):
    """A transformers checkpoint cast to bfloat16 on load (so every loaded tensor is a new
    anonymous copy): each rank's peak anonymous memory while its stage loads stays within its
    stage's bytes, far from the model's (initialising the other stages' tensors as missing
    keys costs them too)."""
    torch.manual_seed(0)
    model = hf_llama(4, hidden=512, ffn=1376, heads=8, vocab=8192)
    model.save_pretrained(tmp_path / "llama", max_shard_size="10MB")
    for rank in (0, 1):
        got = _rank_memory(tmp_path / "llama", rank, "bfloat16")
        assert got["stage"] < 0.6 * got["model"]
        assert got["anon"] <= got["stage"] + 4 * 2**20, got  # its stage, plus a little
