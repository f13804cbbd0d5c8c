"""Issue 24: the Planner widget plans as ``bigviz.plan`` does.

Both prepare the planner's inputs with one function (``bigviz.planning.inputs.planner_inputs``:
the default "cpu" budget of a model larger than RAM, the no-split classes, the unit rule's
knobs) and run one (``place``: the planner, then the direct-read rule). A dozen models of
different shapes (torch modules read directly by a parent, transformers decoders, encoders,
mixtures of experts, encoder-decoders, vision models, bigviz's own GPT and Llama, a size tree,
a checkpoint folder) are planned both ways, under budgets that stream part of the model and
under no budget on a machine (facts given as data) whose RAM does not hold the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import bigviz
from bigviz.core.stream_plan import RAM_SHARE, MachineFacts
from bigviz.planning import as_tree
from bigviz.planning import inputs as planner_inputs_module
from bigviz.ui.planner import Planner
from tests.zoo.helpers import meta_model
from tests.zoo.specs import SPECS

ZOO = ["gpt2", "llama_tied", "qwen2_moe", "deberta_v2", "marian", "bert", "vit", "mamba"]


class _Attention(nn.Module):
    """A torch ``MultiheadAttention`` per block: its ``out_proj`` is read, never called."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.MultiheadAttention(32, 4) for _ in range(4))
        self.head = nn.Linear(32, 32)


def _models(tmp_path: Path) -> dict[str, object]:
    by_name = {s.name: s for s in SPECS}
    out: dict[str, object] = {name: meta_model(by_name[name]) for name in ZOO}
    out["multihead attention"] = _Attention()
    with bigviz.init_empty_weights():
        out["bigviz gpt"] = bigviz.models.build("gpt-tiny")
        out["bigviz llama"] = bigviz.models.build("llama-tiny")
    out["size tree"] = as_tree(nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)]))
    folder = tmp_path / "ckpt"
    bigviz.save_sharded(nn.Sequential(*[nn.Linear(48, 48) for _ in range(5)]), folder, progress=False)
    out["checkpoint folder"] = folder
    return out


def _budgets(model: object) -> dict[object, int]:
    """A GPU that holds a third of the model, a CPU another third: the rest streams from disk."""
    total = as_tree(model).total("")  # type: ignore[arg-type]
    return {0: total // 3, "cpu": total // 3, "disk": 10 * total}


@pytest.mark.slow
def test_the_widget_places_every_module_as_bigviz_plan_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    models = _models(tmp_path)
    assert len(models) >= 12
    differ = []
    for name, model in models.items():
        total = as_tree(model).total("")  # type: ignore[arg-type]
        small = MachineFacts(int(total * 0.6 / RAM_SHARE))  # RAM that holds 60% of the model
        for budgets in (_budgets(model), None):
            if budgets is None:  # no budget given: this machine's, pretending its RAM is small
                monkeypatch.setattr(planner_inputs_module, "machine_facts", lambda: small)
                monkeypatch.setattr(planner_inputs_module, "get_max_memory", lambda _: {"cpu": small.room})
            api = bigviz.plan(model, budgets)  # type: ignore[arg-type]
            widget = Planner(model, budgets, live=False)
            budgets_seen = {d: b for d, b in api.max_memory.items() if d in widget.max_memory}
            if widget.device_map != api.device_map or widget.max_memory != budgets_seen:
                differ.append(
                    f"{name} ({'no budget' if budgets is None else 'budgets'}): {api.device_map} != {widget.device_map}"
                )
            widget.close()
            monkeypatch.undo()
    assert not differ, "the widget and bigviz.plan placed these differently:\n" + "\n".join(differ)


def test_direct_reads_stay_on_the_execution_device_in_the_widget_too() -> None:
    # the old widget planned its own options: out_proj, read by its MultiheadAttention without a
    # call, was streamed from the CPU there and kept on the GPU by bigviz.plan
    model = _Attention()
    budgets = _budgets(model)
    widget = Planner(model, budgets, live=False)
    plan = bigviz.plan(model, budgets)
    reads = [m for m, _ in widget.state.rule.reads.items()]
    assert reads and all(plan.device_of(m) == 0 for m in reads)
    assert widget.device_map == plan.device_map
    assert all("read directly" in p.reason for p in widget.plan.placements if p.name in reads)
    widget.close()


def test_the_widget_leaves_room_for_the_stream_of_a_model_larger_than_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(10)])
    layer = 64 * 64 * 4 + 64 * 4
    small = MachineFacts(int(5 * layer / RAM_SHARE))
    monkeypatch.setattr(planner_inputs_module, "machine_facts", lambda: small)
    monkeypatch.setattr(planner_inputs_module, "get_max_memory", lambda _: {"cpu": small.room})
    widget = Planner(model, live=False)
    assert widget.max_memory["cpu"] == bigviz.plan(model).max_memory["cpu"] < small.room  # the ring is left out
    widget.close()


def test_one_fits_for_max_context_and_the_widget() -> None:
    with torch.device("meta"):
        model = bigviz.models.build("gpt-tiny")
    budgets = {"cpu": 160_000}
    widget = Planner(model, budgets, live=False)
    assert widget.longest_context() == bigviz.max_context(model, budgets)
    widget.close()


def _fits(model: nn.Module, tokens: int) -> bool:
    try:
        return bigviz.plan(model, context_length=tokens).fits(allow_offload=True)
    except bigviz.PlanError:
        return False


def test_max_context_without_a_budget_plans_as_bigviz_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    # the old max_context took this machine's memory itself, without the room the stream's ring
    # needs when the model is larger than RAM: it found a context bigviz.plan refuses (82 > 69)
    with torch.device("meta"):
        model = bigviz.models.build("gpt-tiny", n_layer=16, block_size=4096)  # positions past what fits
    small = MachineFacts(int(as_tree(model).total("") * 0.6 / RAM_SHARE))
    monkeypatch.setattr(planner_inputs_module, "machine_facts", lambda: small)
    monkeypatch.setattr(planner_inputs_module, "get_max_memory", lambda _: {"cpu": small.room})
    found = bigviz.max_context(model, allow_offload=True, limit=2**20)
    assert 0 < found and _fits(model, found) and not _fits(model, found + 1)
    widget = Planner(model, live=False)
    widget.state.position_limit = 2**20
    assert widget.longest_context(allow_offload=True) == found
    widget.close()
