"""Generation across pipeline stages in one process: every stage of a model cut and loaded as
its rank would, each with the KV cache of its own layers, chained by hand: the greedy tokens
equal the model's own ``generate`` and each stage's cache bytes equal the stage plan's
prediction. ``bigviz.distributed.generate`` on a one-rank group (the ring's bookkeeping, EOS,
bad arguments); two and three processes are in ``test_pipeline_distributed.py``."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import bigviz
from bigviz.core.pipeline import PipelineError
from bigviz.distributed import build_stage_module, cache_nbytes, empty_model, generate, generation_ids
from bigviz.distributed.models import generation_config
from tests.distributed.pipeline_models import BUILDERS, build, save, single_process_generate

pytestmark = pytest.mark.slow  # seven checkpoints saved and generated from once, then cut into stages

PROMPT = torch.tensor([[5, 3, 17, 2, 9, 11], [1, 4, 1, 5, 9, 2]])
NEW = 5


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each model's checkpoint and its own greedy tokens for PROMPT."""
    out = {}
    for name in BUILDERS:
        model = build(name)
        folder = save(model, tmp_path_factory.mktemp(name) / "ckpt")
        out[name] = (folder, single_process_generate(model, PROMPT, NEW))
    return out


def _stages(folder: Path, n: int, **plan_kwargs) -> list:
    """Every stage cut from its own model on meta, as each rank does."""
    built = []
    for rank in range(n):
        model = empty_model(folder)
        plan = bigviz.plan_pipeline(model, n, **plan_kwargs)
        built.append(build_stage_module(model, folder, plan, rank, split="wrap"))
    return built


def _chain(stages: list, prompt: torch.Tensor, new: int, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, list]:
    """Greedy generation through the stages in order, one cache per stage (``mask``: left
    padding, extended by one per new token as generate does)."""
    caches = [s.module.new_cache() for s in stages]
    masked = {} if mask is None else {"attention_mask": mask}
    ids, x, start = prompt, prompt, 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for _ in range(new):
                y = x
                for stage, cache in zip(stages, caches):
                    y = stage.module.step(y, cache=cache, start=start, **masked)
                start += x.shape[1]
                x = y[:, -1].argmax(dim=-1, keepdim=True)
                ids = torch.cat((ids, x), dim=1)
                if mask is not None:
                    masked = {"attention_mask": torch.cat((masked["attention_mask"], torch.ones_like(x)), dim=1)}
    finally:
        torch.set_num_threads(threads)
    return ids, caches


@pytest.mark.parametrize("name", list(BUILDERS))
def test_tokens_through_three_stages_equal_the_models_generate(folders, name):
    folder, want = folders[name]
    context = PROMPT.shape[1] + NEW - 1  # generate never caches its last token
    stages = _stages(folder, 3, batch_size=len(PROMPT), context_length=context)
    tokens, caches = _chain(stages, PROMPT, NEW)
    assert torch.equal(tokens, want)
    plan = stages[0].plan
    got = [cache_nbytes(c) for c in caches]
    if name == "hf-gemma2":  # sliding-window layers keep window - 1 tokens; the plan counts the window
        assert got[2] == plan.stage_kv[2] and all(g <= p for g, p in zip(got, plan.stage_kv))
    else:
        assert got == list(plan.stage_kv), f"cache bytes per stage {got}, planned {plan.stage_kv}"


def test_a_stage_keeps_only_its_own_layers_in_its_cache(folders):
    folder, _ = folders["hf-llama"]
    stages = _stages(folder, 2)
    _, caches = _chain(stages, PROMPT, 2)
    first = {id(layer) for layer in caches[0].layers}
    assert len(first) == 2 and caches[0].layers[2] is caches[0].layers[0]  # the others' layers: aliases
    assert caches[1].layers[2].keys.shape[2] == PROMPT.shape[1] + 1 and caches[1].layers[0] is caches[1].layers[2]


def _left_padded(pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of 6, 3 and 1 tokens, left padded with ``pad``, and their mask."""
    rows = [[5, 3, 17, 2, 9, 11], [4, 1, 5], [7]]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@pytest.mark.parametrize("name", [n for n in BUILDERS if n.startswith("hf-")])
def test_left_padded_prompts_through_three_stages_equal_generate_with_the_mask(tmp_path, name):
    """Prompts of different lengths in one batch, as a tokenizer pads them for generate (on the
    left, with a mask): the stages give transformers' tokens, positions counted after the pads
    (GPT-2's learned positions, Gemma 2's sliding window, Mixtral's experts); without the mask
    the padded rows' logits differ, so the mask is what makes them equal."""
    model = build(name)
    folder = save(model, tmp_path / "ckpt")  # no EOS in its generation config: NEW tokens each
    ids, mask = _left_padded(pad=0)
    want = single_process_generate(model, ids, NEW, mask)
    stages = _stages(folder, 3)
    tokens, _ = _chain(stages, ids, NEW, mask)
    assert torch.equal(tokens, want), (tokens, want)
    with torch.no_grad():
        logits = []
        for masked in ({"attention_mask": mask}, {}):
            y = ids
            for stage, cache in zip(stages, [s.module.new_cache() for s in stages]):
                y = stage.module.step(y, cache=cache, **masked)
            logits.append(y[:, -1])
    assert torch.allclose(logits[0][0], logits[1][0], atol=1e-5)  # the unpadded row: the same either way
    assert not torch.allclose(logits[0][1:], logits[1][1:])  # the padded rows: the mask counts


# ---- the API on a one-rank group -------------------------------------------------------
@pytest.fixture
def one_rank():
    """A gloo group of one process (this one)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_generate_on_one_rank_with_microbatches(folders, one_rank):
    folder, want = folders["hf-qwen2"]
    (stage,) = _stages(folder, 1)
    result = generate(stage, PROMPT, NEW, microbatches=2)
    assert torch.equal(result.tokens, want) and result.microbatches == 2 and result.passes == NEW
    plan = bigviz.plan_pipeline(empty_model(folder), 1, batch_size=2, context_length=PROMPT.shape[1] + NEW - 1)
    assert result.cache_bytes == plan.stage_kv[0] and 0 < result.busy_s <= result.wall_s


def test_generation_stops_at_eos_as_transformers_does(tmp_path, one_rank):
    """A token the model emits on its third step is its EOS: transformers stops there (and
    pads a sequence that stopped while another goes on); so does the pipeline."""
    model = build("hf-llama")
    free = single_process_generate(model, PROMPT, NEW)
    eos = int(free[0, PROMPT.shape[1] + 2])
    folder = save(model, tmp_path / "ckpt", eos=eos)
    want = single_process_generate(model, PROMPT, NEW)  # the model's generation config now has the EOS
    assert want.shape[1] < free.shape[1] or (want == eos).any()
    (stage,) = _stages(folder, 1)
    ids = generation_ids(generation_config(folder))
    assert ids == {"eos_token_id": [eos], "pad_token_id": eos}
    got = generate(stage, PROMPT, NEW, **ids).tokens
    assert torch.equal(got, want), (got, want)
    rows = [generate(stage, PROMPT[i : i + 1], NEW, **ids).tokens for i in range(2)]  # each on its own
    both = generate(stage, PROMPT, NEW, microbatches=2, **ids).tokens  # each micro-batch stops on its own
    for i, row in enumerate(rows):
        assert torch.equal(both[i, : row.shape[1]], row[0]) and (both[i, row.shape[1] :] == eos).all()


def test_generate_takes_a_left_padded_batch_with_its_mask(folders, one_rank, tmp_path):
    """The API with a mask: micro-batches cut the mask with the prompt, each extends its own;
    a mask of ones is no mask; a mask that is wrong is refused before anything runs."""
    model = build("hf-llama")
    (stage,) = _stages(save(model, tmp_path / "ckpt"), 1)
    ids, mask = _left_padded(pad=0)
    want = single_process_generate(model, ids, NEW, mask)
    for microbatches in (1, 2, 3):
        got = generate(stage, ids, NEW, microbatches=microbatches, attention_mask=mask)
        assert torch.equal(got.tokens, want), microbatches
    folder, same_length = folders["hf-qwen2"]
    (qwen,) = _stages(folder, 1)
    assert torch.equal(generate(qwen, PROMPT, NEW, attention_mask=torch.ones_like(PROMPT)).tokens, same_length)
    right = mask.flip(1)
    for bad, message in (
        (right, r"rows \[1, 2\] are not padded on the left .*padding_side = 'left'"),
        (mask[:, 1:], r"attention_mask of shape \(3, 5\) for a prompt of shape \(3, 6\)"),
        (mask * 2, "values other than 0 and 1"),
        (mask.float(), "integer or boolean tensor"),
    ):
        with pytest.raises(PipelineError, match=message):
            generate(stage, ids, NEW, attention_mask=bad)
    (gpt,) = _stages(folders["gpt"][0], 1)
    with pytest.raises(PipelineError, match="bigviz's own model\\) takes no attention mask"):
        generate(gpt, ids, NEW, attention_mask=mask)


def test_bad_arguments_are_refused_on_every_rank_before_anything_runs(folders, one_rank):
    folder, _ = folders["gpt"]
    (stage,) = _stages(folder, 1)
    with pytest.raises(PipelineError) as info:
        generate(stage, PROMPT[:1], 0, microbatches=2)
    text = str(info.value)
    assert "max_new_tokens=0: give 1 or more" in text and "at least one sequence per micro-batch" in text
    with pytest.raises(PipelineError, match="integer tensor"):
        generate(stage, PROMPT.float(), 2)
    model = empty_model(folder)
    traced = build_stage_module(model, folder, bigviz.plan_pipeline(model, 1), 0, example_args=(PROMPT[:1],))
    assert traced.method == "trace"
    with pytest.raises(PipelineError, match="keeps no cache: build the stage with split='wrap'"):
        generate(traced, PROMPT, 2)


def test_close_process_group_waits_then_leaves_and_is_safe_twice():
    """The worker's last step (see its docstring for the abort it prevents): a barrier, then the
    group is destroyed; with no group it does nothing."""
    from bigviz.distributed import close_process_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    gathered: list[object] = [None]
    dist.all_gather_object(gathered, {"rank": 0})
    close_process_group()
    assert not dist.is_initialized() and gathered == [{"rank": 0}]
    close_process_group()  # nothing to close: no error
