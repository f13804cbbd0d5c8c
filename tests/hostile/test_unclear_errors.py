"""Promise: a bad count, device or context is a ``ValueError`` saying what and how to fix it,
never a ``TypeError`` from deep inside, never silently changed. ``--max-memory`` naming one
device twice is refused; a module name that is not a string is named; a count is a whole number
(``2.5`` is not taken as 2, ``True`` not as 1) wherever one is taken; a context past a table of
positions (GPT-2's ``n_positions``) is refused naming the key, and past a rotary model's trained
length (``max_position_embeddings``) planned with a note and a warning.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import bigviz
from bigviz.cli import main
from bigviz.core.errors import PlanError
from bigviz.models import build
from bigviz.ui.state import PlannerState


@pytest.mark.parametrize(
    "budgets, first, second",
    [("0=80GB,0=1GB", "0=80GB", "0=1GB"), ("cuda:0=80GB,0=1GB", "cuda:0=80GB", "0=1GB"), ("cpu=1GB,cpu=2GB", "", "")],
)
def test_max_memory_naming_a_device_twice_is_refused(tmp_path: Path, capsys, budgets: str, first: str, second: str):
    with pytest.raises(SystemExit) as done:
        main(["plan", "gpt-tiny", "--max-memory", budgets, "--out", str(tmp_path / "m.json")])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "names one device twice" in err and first in err and second in err
    assert not (tmp_path / "m.json").exists()


def _tiny() -> nn.Module:
    with torch.device("meta"):
        return build("gpt-tiny")


def test_assign_a_module_that_is_not_a_name():
    state = PlannerState.from_model(_tiny(), {"cpu": "1GB"})
    for module in (0, None, ["transformer.h.0"]):
        with pytest.raises(ValueError, match="is not a name: give the module's name as a string"):
            state.assign(module, "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has no override"):
        state.unassign(0)  # type: ignore[arg-type]
    planner = bigviz.Planner(_tiny(), {"cpu": "1GB"}, live=False)
    with pytest.raises(ValueError, match="is not a name"):
        planner.assign(0, "cpu")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [2.5, True, -1, "8", float("nan")])
def test_counts_are_whole_numbers_everywhere(bad: object):
    model = _tiny()
    state = PlannerState.from_model(model, {"cpu": "1GB"})
    with pytest.raises(PlanError, match="context_length="):
        state.set_workload(context_length=bad)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="batch_size="):
        state.set_workload(batch_size=bad)  # type: ignore[arg-type]
    assert state.workload == bigviz.Workload()  # unchanged
    with pytest.raises(PlanError, match="batch_size="):
        bigviz.plan(model, {"cpu": "1GB"}, batch_size=bad, context_length=8)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="context_length="):
        bigviz.plan(model, {"cpu": "1GB"}, context_length=bad)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="batch_size="):
        bigviz.max_context(model, {"cpu": "1GB"}, bad)  # type: ignore[arg-type]
    planner = bigviz.Planner(model, {"cpu": "1GB"}, live=False)
    with pytest.raises(PlanError, match="context_length="):
        planner.set_workload(context_length=bad)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="stages="):
        planner.show_stages(bad)  # type: ignore[arg-type]


def test_context_2_5_is_not_taken_as_2():
    state = PlannerState.from_model(_tiny(), {"cpu": "1GB"})
    with pytest.raises(
        PlanError, match=r"context_length=2.5 must be a whole number >= 0 \(a float is not taken as 2\)"
    ):
        state.set_workload(context_length=2.5)  # type: ignore[arg-type]
    state.set_workload(context_length=np.int64(8), batch_size=np.int32(2))  # integers of any kind are fine
    assert state.workload.context_length == 8 and state.workload.batch_size == 2


def test_max_context_of_no_batch_is_refused():
    model = _tiny()
    for batch in (0, -2):
        with pytest.raises(PlanError, match=f"batch_size={batch} must be a whole number >= 1"):
            bigviz.max_context(model, {"cpu": "1GB"}, batch_size=batch)
    with pytest.raises(PlanError, match="limit=0"):
        bigviz.max_context(model, {"cpu": "1GB"}, limit=0)
    assert bigviz.max_context(model, {"cpu": "1GB"}, batch_size=1) == 64  # block_size


def test_a_context_past_a_table_of_positions_is_refused():
    gpt = _tiny()  # bigviz's GPT: wpe has block_size=64 rows
    with pytest.raises(PlanError, match="context_length=65 is past the model's block_size=64"):
        bigviz.plan(gpt, {"cpu": "1GB"}, context_length=65)
    assert bigviz.plan(gpt, {"cpu": "1GB"}, context_length=64).workload.context_length == 64
    state = PlannerState.from_model(gpt, {"cpu": "1GB"})
    with pytest.raises(PlanError, match="block_size=64"):
        state.set_workload(context_length=100)
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32, vocab_size=50)
    with torch.device("meta"):
        gpt2 = transformers.GPT2LMHeadModel(config)
    with pytest.raises(PlanError, match="past the model's n_positions=32"):
        bigviz.plan(gpt2, {"cpu": "1GB"}, context_length=33)
    opt = transformers.OPTConfig(
        num_hidden_layers=1,
        hidden_size=16,
        ffn_dim=32,
        num_attention_heads=2,
        max_position_embeddings=32,
        vocab_size=50,
    )
    with torch.device("meta"):
        opt_model = transformers.OPTForCausalLM(opt)  # its table keeps 2 rows more (an offset)
    with pytest.raises(PlanError, match="max_position_embeddings=32"):
        bigviz.plan(opt_model, {"cpu": "1GB"}, context_length=40)


def test_a_context_past_a_rotary_models_trained_length_is_noted(tmp_path: Path, capsys):
    """Rotary positions have no hard end: transformers runs past ``max_position_embeddings``,
    and so does the plan, saying so; dynamic NTK scaling is made to stretch past it."""
    llama = {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_attention_heads": 2,
        "vocab_size": 50,
        "max_position_embeddings": 64,
    }
    with pytest.warns(UserWarning, match="past the model's max_position_embeddings=64"):
        plan = bigviz.plan(bigviz.model_from_config(llama), {"cpu": "1GB"}, context_length=100)
    assert any("past max_position_embeddings=64" in n for n in plan.notes)
    assert "past max_position_embeddings=64" in plan.summary()
    dynamic = {**llama, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = bigviz.plan(bigviz.model_from_config(dynamic), {"cpu": "1GB"}, context_length=100)
    assert not any("max_position_embeddings" in n for n in plan.notes)
    import json

    (tmp_path / "config.json").write_text(json.dumps(llama))
    argv = ["plan", str(tmp_path / "config.json"), "--context", "100", "--max-memory", "cpu=1GB"]
    assert main([*argv, "--out", str(tmp_path / "m.json")]) == 0
    captured = capsys.readouterr()
    assert "note: context 100 tokens is past max_position_embeddings=64" in captured.out
    assert "UserWarning" not in captured.err
    with torch.device("meta"):
        llama_ref = build("llama-tiny")  # bigviz's Llama: rotary, max_seq_len=128 is what generate keeps
    with pytest.warns(UserWarning, match="max_seq_len=128"):
        bigviz.plan(llama_ref, {"cpu": "1GB"}, context_length=200)
