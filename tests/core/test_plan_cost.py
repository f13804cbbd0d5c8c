"""DevicePlan.cost(): time per forward from resident and streamed bytes (pure, no torch)."""

from __future__ import annotations

import pytest

from bigviz.core.planner import make_plan
from bigviz.core.tree import SizeTree, TensorSpec

GB = 10**9


def _plan(cpu: int, n: int = 6, layer_bytes: int = GB) -> object:
    tree = SizeTree.build([TensorSpec(f"h.{i}.weight", layer_bytes // 4, "float32") for i in range(n)])
    return make_plan(tree, {"cpu": cpu, "disk": 10**13})


def test_streamed_bytes_over_the_disk_bandwidth_is_the_floor_of_a_forward() -> None:
    plan = _plan(cpu=3 * GB)
    streamed = plan.offloaded_bytes()["disk"]
    assert streamed == 3 * GB  # three of the six 1 GB layers are resident in the 3 GB budget
    e = plan.cost(disk_bandwidth=2 * GB)
    assert e.seconds == pytest.approx(streamed / (2 * GB))
    assert e.bottleneck == "disk"
    assert e.first_seconds >= e.seconds  # the resident part is read once, before the first


def test_more_resident_bytes_means_less_to_read_per_forward() -> None:
    small, large = _plan(cpu=2 * GB), _plan(cpu=4 * GB)
    assert large.offloaded_bytes()["disk"] < small.offloaded_bytes()["disk"]
    assert large.cost(disk_bandwidth=GB).seconds < small.cost(disk_bandwidth=GB).seconds


def test_compute_overlaps_reads_the_slower_stage_sets_the_pace() -> None:
    plan = _plan(cpu=3 * GB)
    disk_bound = plan.cost(disk_bandwidth=GB, compute_seconds=0.6)
    compute_bound = plan.cost(disk_bandwidth=100 * GB, compute_seconds=6.0)
    assert disk_bound.bottleneck == "disk" and compute_bound.bottleneck == "compute"
    assert disk_bound.seconds < 3.0 + 0.6  # overlapped, not added
    assert compute_bound.seconds == pytest.approx(6.0, rel=0.1)


def test_a_preset_name_or_a_bad_bandwidth() -> None:
    plan = _plan(cpu=3 * GB)
    assert plan.cost(disk_bandwidth="SATA").seconds == pytest.approx(3 * GB / (0.5 * GB))
    with pytest.raises(ValueError, match="bandwidth"):
        plan.cost(disk_bandwidth=0)
    with pytest.raises(ValueError, match="unknown disk"):
        plan.cost(disk_bandwidth="floppy")
    # the name as the manual writes it: "NVMe" is "NVMe (~3 GB/s)" (it also starts "NVMe Gen4 ...")
    assert plan.cost(disk_bandwidth="NVMe").seconds == plan.cost(disk_bandwidth="NVMe (~3 GB/s)").seconds
    assert plan.cost(disk_bandwidth="nvme gen4").seconds < plan.cost(disk_bandwidth="NVMe").seconds
    with pytest.raises(ValueError, match="unknown disk 'N' \\(it starts 2 of them\\)"):
        plan.cost(disk_bandwidth="N")
