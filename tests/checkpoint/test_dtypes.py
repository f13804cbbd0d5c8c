"""A checkpoint is opened and planned with one dtype table: what opens can be planned."""

from __future__ import annotations

from pathlib import Path

import torch

import bigviz
from bigviz.checkpoint.safetensors_io import write_safetensors


def test_a_checkpoint_of_mx_scales_and_fp8_opens_plans_and_loads(tmp_path: Path):
    scales = torch.arange(8, dtype=torch.uint8).view(torch.float8_e8m0fnu)  # MX block scales
    weight = torch.randn(8, 4).to(torch.float8_e4m3fn)
    folder = tmp_path / "mx"
    folder.mkdir()
    write_safetensors(
        folder / "model.safetensors",
        {"proj.weight": weight, "proj.scales": scales, "head.weight": torch.randn(4, 2).to(torch.float8_e5m2)},
    )
    index = bigviz.CheckpointIndex.open(folder)
    assert {k: v.dtype for k, v in index.entries.items()} == {
        "proj.weight": "float8_e4m3fn",
        "proj.scales": "float8_e8m0fnu",
        "head.weight": "float8_e5m2",
    }
    plan = bigviz.plan(folder, {"cpu": 64})
    assert plan.tree.total("") == 32 + 8 + 8 and plan.usage_of("cpu").used == 48
    weights = bigviz.LazyWeights(index)
    assert torch.equal(weights["proj.scales"].view(torch.uint8), scales.view(torch.uint8))
    weights.close()
