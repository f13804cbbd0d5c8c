"""Issue 12, the planner side: the default "cpu" budget leaves room for streamed units when a
model does not fit, and the Planner predicts a forward's time from resident and streamed bytes
at a disk bandwidth (a preset, or the disk probe's measurement)."""

from __future__ import annotations

import os

import pytest
from torch import nn

import bigviz.planning
import bigviz.planning.device_plan
from bigviz.core.streaming import forward_estimate, ring_bytes
from bigviz.ui.planner import Planner

LAYER = 16_640  # bytes of nn.Linear(64, 64) in float32


def _model(n: int = 8) -> nn.Module:
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(n)])


@pytest.mark.parametrize("ram_layers, budget", [(20, 20 * LAYER), (6, 6 * LAYER - ring_bytes(LAYER))])
def test_the_default_cpu_budget_leaves_room_for_streamed_units(
    monkeypatch: pytest.MonkeyPatch, ram_layers: int, budget: int
) -> None:
    # a model that does not fit keeps the CPU's streaming ring (1.5 layers) out of the budget
    monkeypatch.setattr(bigviz.planning.device_plan, "get_max_memory", lambda max_memory: {"cpu": ram_layers * LAYER})
    plan = bigviz.planning.plan(_model(), None)
    assert plan.max_memory["cpu"] == budget
    assert sum(p.nbytes for p in plan.placements if p.device == "cpu") == min(8, budget // LAYER) * LAYER


def test_an_explicit_cpu_budget_means_resident_bytes() -> None:
    plan = bigviz.planning.plan(_model(), {"cpu": 5 * LAYER, "disk": 10**9})
    assert plan.max_memory["cpu"] == 5 * LAYER
    assert sum(p.nbytes for p in plan.placements if p.device == "cpu") == 5 * LAYER


def test_the_planner_predicts_a_forward_at_the_measured_bandwidth(tmp_path: os.PathLike) -> None:
    planner = Planner(_model(), {"cpu": 3 * LAYER, "disk": 10**9}, strategy="sequential")
    disk_bytes = planner.plan.offloaded_bytes()["disk"]
    assert disk_bytes == 5 * LAYER
    preset = planner.cost()
    assert preset["forward_seconds"] == pytest.approx(disk_bytes / preset["disk_bandwidth"])
    assert "preset" in preset["forward"] and "per forward" in preset["forward"]
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(os.urandom(2**20))
    probe = planner.measure_disk(weights, parallel=2, sample_bytes=2**18, cache=False)
    measured = planner.cost()
    assert "measured" in measured["forward"]
    assert measured["forward_seconds"] == pytest.approx(disk_bytes / probe.bandwidth)
    assert measured["forward_first_seconds"] == pytest.approx((disk_bytes + 3 * LAYER) / probe.bandwidth)
    assert "Predicted" in planner.controls.cost.value


def test_compute_overlaps_reads_in_the_estimate() -> None:
    plan = bigviz.planning.plan(_model(), {"cpu": 4 * LAYER, "disk": 10**9}, strategy="sequential")
    read = 4 * LAYER / 1e6
    overlapped = forward_estimate(plan, disk_bandwidth=1e6, compute_seconds=read)
    assert read < overlapped.seconds < 2 * read  # neither serial nor free
    assert forward_estimate(plan, disk_bandwidth=1e6, compute_seconds=read, depth=0).seconds > overlapped.seconds
