"""Hardware presets, bandwidth cost, and the Planner's widget-free state."""

from __future__ import annotations

import re

import pytest
from torch import nn

import bigviz
from bigviz.core.sizes import UNLIMITED, format_seconds
from bigviz.core.planner import make_plan
from bigviz.core.tree import SizeTree, TensorSpec
from bigviz.ui.presets import DISK_BANDWIDTH, HARDWARE_PRESETS, LINK_BANDWIDTH, cost_html, preset_budgets
from bigviz.ui.state import PlannerState

GiB = 2**30


@pytest.mark.parametrize(
    "name, gpus, gpu_gib",
    [
        ("Colab T4", 1, 15),
        ("RTX 4090", 1, 24),
        ("A100 40 GB", 1, 40),
        ("A100 80 GB", 1, 80),
        ("2x A100 80 GB", 2, 80),
        ("8x A100 80 GB", 8, 80),
        ("H100 80 GB", 1, 81559 / 1024),  # what nvidia-smi reports: 81,559 MiB, not 80 GiB
        ("H200 141 GB", 1, 140),
        ("CPU-only laptop", 0, None),
    ],
)
def test_gpu_presets(name, gpus, gpu_gib):
    budgets = preset_budgets(name)
    assert [d for d in budgets if isinstance(d, int)] == list(range(gpus))
    assert all(budgets[i] == gpu_gib * GiB for i in range(gpus))
    assert budgets["cpu"] > 0 and "disk" not in budgets


@pytest.mark.parametrize("total", [16, 32, 64])
def test_apple_presets_share_unified_memory(total):
    budgets = preset_budgets(f"Apple M-series {total} GB")
    assert set(budgets) == {"mps", "cpu"}
    assert budgets["mps"] + budgets["cpu"] <= total * GiB
    assert budgets["mps"] > budgets["cpu"]


def test_every_preset_plans_a_model():
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    for name, budgets in HARDWARE_PRESETS.items():
        plan = bigviz.plan(model, budgets, strategy="sequential")
        first = 0 if 0 in budgets else ("mps" if "mps" in budgets else "cpu")
        assert (plan.main_device, plan.device_map) == (first, {"": first}), name


def test_preset_names_say_what_they_hold_in_binary_units():
    """Issue 28: "RAM 340 GB" held 340 GiB; every size a name states is what the preset holds."""
    for name, budgets in HARDWARE_PRESETS.items():
        ram = re.search(r"RAM (\d+) GiB", name)
        if ram and name.startswith("CPU-only"):
            continue  # the laptop's RAM, of which the preset gives the model 14 GiB (named too)
        if ram:
            assert budgets["cpu"] == int(ram.group(1)) * GiB, name
        held = re.search(r": ([\d.]+) GiB", name)
        if held:
            assert abs(budgets[0] - float(held.group(1)) * GiB) < 0.05 * GiB, name
        assert " GB)" not in name or "unified" in name, name  # a decimal "GB" only in the name sold


def test_unknown_or_ambiguous_preset_lists_the_names():
    with pytest.raises(ValueError, match="unknown hardware preset 'TPU'.*Colab T4"):
        preset_budgets("TPU")
    with pytest.raises(ValueError, match="unknown hardware preset 'A100'"):
        preset_budgets("A100")  # three presets start with it


def _layers(n: int) -> SizeTree:
    return SizeTree.build([TensorSpec(f"h.{i}.weight", 250 * 10**6, "float32") for i in range(n)])  # 1 GB each


def test_cost_counts_link_and_disk_time():
    # GPU 0 keeps room for two streamed 1 GB layers only; the CPU for 5 and the staging of 2 from disk
    plan = make_plan(_layers(8), {0: 2 * 10**9, "cpu": 7 * 10**9, "disk": 10**13})
    cost = plan.cost(link_bandwidth="PCIe 5", disk_bandwidth="NVMe (")
    assert cost.copy_bytes == 8 * 10**9 and cost.read_bytes == 3 * 10**9
    assert cost.copy_seconds == pytest.approx(8e9 / 50e9)
    assert cost.read_seconds == pytest.approx(1.0)
    assert 1.0 <= cost.seconds < 1.16  # reads and copies overlap: less than their sum
    on_cpu = make_plan(_layers(1), {"cpu": 0, "disk": 10**13}).cost(disk_bandwidth="SATA")
    assert on_cpu.copy_seconds == 0 and on_cpu.seconds == pytest.approx(2.0)
    resident = make_plan(_layers(1), {0: 2 * 10**9}).cost()
    assert format_seconds(cost.seconds) in cost_html(cost) and "nothing is offloaded" in cost_html(resident)
    assert all(v > 0 for v in [*LINK_BANDWIDTH.values(), *DISK_BANDWIDTH.values()])


def _state() -> PlannerState:
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])  # 16,640 bytes each
    return PlannerState.from_model(model, {0: 40_000, "cpu": 10**6})


def test_state_replans_from_a_cached_tree_per_dtype():
    state = _state()
    tree32 = state.tree
    state.set_dtype("fp16")
    assert state.tree.total("") * 2 == tree32.total("")
    assert state.tree is state.tree  # cached
    state.set_dtype(None)
    assert state.tree is tree32


def test_state_overrides_survive_budget_changes_and_are_checked():
    state = _state()
    state.assign("2", 0)
    for budget in (10_000, 50_000, 10**6):
        state.set_budget(0, budget)
        assert state.replan().device_of("2") == 0
    with pytest.raises(ValueError, match=r"'20' names no module.*did you mean '2'"):
        state.assign("20", 0)
    with pytest.raises(ValueError, match="GPU 3 has no budget"):
        state.assign("1", 3)
    with pytest.raises(ValueError, match="'1' has no override"):
        state.unassign("1")
    state.assign("1", "disk")  # disk is always there
    assert state.replan().device_of("1") == "disk"


def test_removing_a_device_drops_its_overrides():
    state = _state()
    state.add_gpu(20_000)
    state.assign("3", 1)
    assert state.remove_device(1) == ["3"]
    assert state.overrides == {} and 1 not in state.budgets
    state.assign("0", 0)
    assert state.set_budgets(preset_budgets("CPU-only laptop")) == ["0"]
    assert list(state.budgets) == ["cpu"]


def test_max_memory_leaves_out_unlimited_disk_but_keeps_a_budgeted_one():
    state = _state()
    assert "disk" not in state.max_memory
    state.budgets["disk"] = 5 * GiB
    state.set_budgets({0: "1GiB", "cpu": "2GiB"})
    assert state.max_memory == {0: GiB, "cpu": 2 * GiB, "disk": 5 * GiB}
    assert state.replan().usage_of("disk").budget < UNLIMITED
