"""The zoo's runs: for every generative architecture, the cache a plan predicts is what
``generate`` holds.

Each architecture of `tests.zoo.specs` that generates (with Mllama and the newer decoders of
``RUN_SPECS``) is built tiny, in float32,
and planned for the run its inputs make (batch 1, the spec's prompt, 3 new tokens; an
encoder-decoder's encoder over its input, Mllama's cross-attention over one image's tiles),
then ``generate`` runs and the cache is measured after every forward (the storages it holds,
the states a model keeps on its modules included):

- at the end it holds exactly ``bigviz.kv_cache_bytes`` (every layer: keys and values,
  recurrent and conv states, cross-attention caches);
- at its peak it never holds more than the plan charges (``plan.kv_cache``), and exactly that
  when no layer slides (a sliding layer holds the prompt until its first decode step: the plan
  charges the whole context there, the prompt being at most the context).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import bigviz
from bigviz.modeling.memory import cache_bytes_by_device, module_states, output_cache
from bigviz.modeling.workload import run_spec

pytest.importorskip("transformers")

from tests.zoo.helpers import inputs, quiet_transformers  # noqa: E402
from tests.zoo.specs import MLLAMA, RUN_SPECS, SPECS, Spec, build_config, model_class  # noqa: E402

NEW = 3
RUNS = [
    pytest.param(s, id=s.name, marks=[pytest.mark.slow] if s.slow else [])
    for s in [*SPECS, MLLAMA, *RUN_SPECS]
    if s.generative
]


def _model(spec: Spec) -> nn.Module:
    quiet_transformers()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_class(spec)(build_config(spec)).eval()


def _source(model: nn.Module, given: dict[str, torch.Tensor]) -> int | None:
    """Tokens the cross-attention of an encoder-decoder reads: its encoder's output length."""
    if not getattr(model.config, "is_encoder_decoder", False):
        return None
    with torch.no_grad():
        encoded = model.get_encoder()(**{k: v for k, v in given.items() if not k.startswith("decoder_")})
    return int(encoded.last_hidden_state.shape[1])


def _generate(model: nn.Module, given: dict[str, torch.Tensor]) -> tuple[int, dict[str, int], dict[str, int]]:
    """``(tokens the cache holds, cache bytes at the end, their peak over the forwards)`` of a
    greedy generate (its last token is never cached; an encoder-decoder's decoder starts from
    its start token)."""
    peak: dict[str, int] = {}
    before = module_states(model)

    def held(out: Any) -> dict[str, int]:
        states = [t for key, t in module_states(model).items() if before.get(key) is not t]
        return cache_bytes_by_device(output_cache(out), states)

    def after(module: nn.Module, args: Any, out: Any) -> None:
        for device, nbytes in held(out).items():
            peak[device] = max(peak.get(device, 0), nbytes)

    hook = model.register_forward_hook(after)
    try:
        with torch.no_grad():
            out = model.generate(
                **given,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
                pad_token_id=0,
                return_dict_in_generate=True,
            )
    finally:
        hook.remove()
    return int(out.sequences.shape[1]) - 1, held(out), peak


@pytest.mark.parametrize("spec", RUNS)
def test_generate_holds_the_cache_the_plan_predicts(spec: Spec):
    model = _model(spec)
    given = inputs(spec)
    source = _source(model, given)
    context, final, peak = _generate(model, given)
    predicted = bigviz.kv_cache_bytes(model, 1, context, encoder_length=source)
    assert final == {"cpu": sum(predicted.values())}, (final, predicted)
    plan = bigviz.plan(model, {"cpu": "1GB"}, context_length=context, encoder_length=source, reserve=0)
    sliding = any(s.kind == "sliding_attention" for specs in run_spec(model).caches.values() for s in specs)
    if sliding:
        assert peak["cpu"] <= plan.kv_cache["cpu"]
    else:
        assert peak == final == {"cpu": plan.kv_cache["cpu"]}
