"""Issue 12, the planner side: the default "cpu" budget leaves room for streamed units when a
model does not fit, and the Planner predicts a forward's time from resident and streamed bytes
at a disk bandwidth (a preset, or the disk probe's measurement)."""

from __future__ import annotations

import os

import pytest
from torch import nn

import bigviz.planning
import bigviz.planning.device_plan
from bigviz.core.stream_plan import ring_bytes
from bigviz.ui.planner import Planner

LAYER = 16_640  # bytes of nn.Linear(64, 64) in float32


def _model(n: int = 8) -> nn.Module:
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(n)])


@pytest.mark.parametrize("ram_layers, budget", [(20, 20 * LAYER), (6, 6 * LAYER - ring_bytes(LAYER))])
def test_the_default_cpu_budget_leaves_room_for_streamed_units(
    monkeypatch: pytest.MonkeyPatch, ram_layers: int, budget: int
) -> None:
    # a model that does not fit keeps the CPU's streaming ring (1.5 layers) out of the budget
    from bigviz.core.stream_plan import MachineFacts
    from bigviz.planning import inputs

    room = ram_layers * LAYER  # what the machine's RAM holds (90% of its available RAM)
    monkeypatch.setattr(inputs, "get_max_memory", lambda max_memory: {"cpu": room})
    monkeypatch.setattr(inputs, "machine_facts", lambda: MachineFacts(-(-room * 10 // 9)))
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
    assert preset.seconds == pytest.approx(disk_bytes / preset.disk_bandwidth)
    assert "preset" in planner.controls.cost.value and "per forward" in planner.controls.cost.value
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(os.urandom(2**20))
    probe = planner.measure_disk(weights, parallel=2, sample_bytes=2**18, cache=False)
    measured = planner.cost()
    assert "measured" in planner.controls.cost.value
    assert measured.seconds == pytest.approx(disk_bytes / probe.bandwidth)
    assert measured.first_seconds == pytest.approx((disk_bytes + 3 * LAYER) / probe.bandwidth)
    assert "Predicted" in planner.controls.cost.value


def test_compute_overlaps_reads_in_the_estimate() -> None:
    plan = bigviz.planning.plan(_model(), {"cpu": 4 * LAYER, "disk": 10**9}, strategy="sequential")
    read = 4 * LAYER / 1e6
    overlapped = plan.cost(disk_bandwidth=1e6, compute_seconds=read)
    assert read < overlapped.seconds < 2 * read  # neither serial nor free
    assert plan.cost(disk_bandwidth=1e6, compute_seconds=read, depth=0).seconds > overlapped.seconds


def _gpt(n_layer: int) -> nn.Module:
    from bigviz.models import GPT, GPTConfig

    with bigviz.init_empty_weights():
        return GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=64, vocab_size=100, block_size=16))


def _sizes(model: nn.Module) -> tuple[int, int]:
    """Bytes of one block, and of everything but the blocks (tied weights once)."""
    block = sum(t.numel() * t.element_size() for t in model.transformer.h[0].state_dict().values())
    total = sum(t.numel() * t.element_size() for t in model.parameters())  # a tie counts once
    return block, total - len(model.transformer.h) * block


@pytest.mark.parametrize("n_layer, resident", [(17, 8), (6, 2), (5, 4), (4, 1)])
def test_the_cpu_spreads_streamed_blocks_between_resident_ones(n_layer: int, resident: int) -> None:
    model = _gpt(n_layer)
    size, rest = _sizes(model)
    budget = {"cpu": rest + resident * size + size // 2, "disk": 10**12}
    spread = bigviz.plan(model, budget)  # "auto": the CPU executes, blocks interleaved
    in_order = bigviz.plan(model, budget, strategy="sequential")
    order = lambda m: [str(m[f"transformer.h.{i}"]) for i in range(n_layer)]  # noqa: E731
    assert order(in_order.device_map) == ["cpu"] * resident + ["disk"] * (n_layer - resident)
    got = "".join("c" if d == "cpu" else "d" for d in order(spread.device_map))
    assert got.count("c") == resident and got[0] == "c"
    doubled = got * 2  # the forward wraps around: a run across its end counts whole
    runs = {kind: {len(r) for r in doubled.split(other)[1:-1] if r} for kind, other in (("c", "d"), ("d", "c"))}
    assert all(max(v) - min(v) <= 1 for v in runs.values()), got  # each kind evenly apart
    assert max(runs["c"]) == -(-resident // (n_layer - resident)), got  # no longer run of resident blocks
    assert [(u.device, u.used) for u in spread.usage] == [(u.device, u.used) for u in in_order.usage]
    moved = got != "c" * resident + "d" * (n_layer - resident)
    assert any("interleaved" in n for n in spread.notes) == moved and not any(
        "interleaved" in n for n in in_order.notes
    )
    assert bigviz.infer_auto_device_map(model, budget) == in_order.device_map  # accelerate's order


def test_overrides_and_a_gpu_keep_the_order() -> None:
    model = _gpt(6)
    size, rest = _sizes(model)
    budget = {"cpu": rest + 3 * size + size // 2, "disk": 10**12}
    pinned = bigviz.plan(model, budget, overrides={"transformer.h.1": "cpu"}).device_map
    assert pinned["transformer.h.1"] == "cpu"  # yours stays where you put it
    on_gpu = bigviz.plan(model, {0: rest + size + size // 2, "cpu": 3 * size + size // 2, "disk": 10**12})
    blocks = [str(on_gpu.device_of(f"transformer.h.{i}")) for i in range(6)]
    assert blocks == sorted(blocks, key=["0", "cpu", "disk"].index) and "disk" in blocks  # a GPU executes: in order


def test_accelerates_fallback_allocation_keyword_is_accepted_false_and_refused_true():
    import torch.nn as nn

    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    budget = {"cpu": "1MB"}
    assert bigviz.infer_auto_device_map(model, budget, fallback_allocation=False) == {"": "cpu"}
    with pytest.raises(bigviz.UsageError, match="fallback_allocation=True"):
        bigviz.infer_auto_device_map(model, budget, None, None, None, False, True, False, True)
