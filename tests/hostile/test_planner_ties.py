"""Promise: sizing and planning stay linear with tied tensors. Work is counted, not timed: every
line the planner (and the sizing code) executes is counted with a trace function, for 300 and
for 1,200 tied pairs."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch
from torch import nn

from bigviz.core import devicemap, nosplit, offload_units, planner, run_charges, tree as tree_module
from bigviz.modeling import inventory, sizes
from bigviz.core.planner import make_plan
from bigviz.core.tree import SizeTree, TensorSpec


def _tied_tree(pairs: int) -> SizeTree:
    """``pairs`` embedding/head pairs, each head tied to its embedding, heads after all blocks."""
    specs = [TensorSpec(f"emb.{i}.weight", 400, "float32") for i in range(pairs)]
    specs += [TensorSpec(f"body.{i}.weight", 4000, "float32") for i in range(pairs)]
    specs += [TensorSpec(f"head.{i}.weight", 400, "float32") for i in range(pairs)]
    ties = [(f"emb.{i}.weight", f"head.{i}.weight") for i in range(pairs)]
    return SizeTree.build(specs, ties=ties)


def _lines_executed(fn: Callable[[], object], *modules: object) -> int:
    """Lines of ``modules`` (default: the planner's) executed by ``fn()``, loop iterations included."""
    # the planner and every module it runs: the unit rule, map cleaning, no-split, run charges
    planning = (planner, offload_units, devicemap, nosplit, run_charges)
    targets = {m.__file__ for m in modules or planning}  # type: ignore[attr-defined]
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def global_(frame, event, arg):
        return local if frame.f_code.co_filename in targets else None

    sys.settrace(global_)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


@pytest.mark.parametrize("budget_share", [2, 10**9])  # some blocks offloaded / everything fits
def test_planner_work_grows_linearly_with_tied_pairs(budget_share: int):
    work = {}
    for pairs in (300, 1200):
        tree = _tied_tree(pairs)
        total = tree.total("")
        budgets = {0: total // budget_share if budget_share > 1 else total, "cpu": total}
        work[pairs] = _lines_executed(lambda: make_plan(tree, budgets))
        plan = make_plan(tree, budgets)
        where = {p.name: p.device for p in plan.placements}
        for i in range(0, pairs, 97):  # every head placed with its embedding
            assert plan.device_of(f"head.{i}.weight") == plan.device_of(f"emb.{i}.weight"), (i, where)
    assert work[1200] <= 4.6 * work[300], work  # linear: 4x the pairs, about 4x the work (quadratic: 16x)


def _tied_model(pairs: int) -> nn.Module:
    with torch.device("meta"):
        model = nn.Module()
        model.emb = nn.ModuleList([nn.Linear(4, 4, bias=False) for _ in range(pairs)])
        model.body = nn.ModuleList([nn.Linear(16, 16, bias=False) for _ in range(pairs)])
        model.head = nn.ModuleList([nn.Linear(4, 4, bias=False) for _ in range(pairs)])
    for i in range(pairs):
        model.head[i].weight = model.emb[i].weight
    return model


def test_sizing_a_model_grows_linearly_with_tied_pairs():
    work = {}
    for pairs in (300, 1200):
        model = _tied_model(pairs)
        work[pairs] = _lines_executed(lambda: sizes.module_tree(model), sizes, tree_module, inventory)
        tree = sizes.module_tree(model)
        assert len(tree.ties) == pairs and tree.total("") == pairs * (16 + 256) * 4  # each tie once
    assert work[1200] <= 4.6 * work[300], work
