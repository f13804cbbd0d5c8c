"""The forward-time prediction of bigviz.core.cost: exact small cases and invariants (no I/O)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigviz.core.cost import (
    ForwardEstimate,
    UnitCost,
    compute_seconds,
    estimate_forward,
    plan_forward,
    predict_forward,
)

GB = 10**9


def streamed(n: int, *, read_s: float, compute_s: float, bw: float = 1e9) -> list[UnitCost]:
    return [UnitCost(f"h.{i}", read_bytes=int(read_s * bw), compute_seconds=compute_s) for i in range(n)]


def test_one_streamed_unit_cannot_overlap() -> None:
    e = predict_forward([UnitCost("a", read_bytes=2 * GB, compute_seconds=0.5)], disk_bandwidth=1e9)
    assert e.seconds == 2.5 and e.stall_seconds == 2.0 and e.overlap == 0.0 and e.bottleneck == "disk"


def test_everything_resident_is_pure_compute() -> None:
    e = predict_forward(
        [UnitCost("a", compute_seconds=0.25), UnitCost("b", compute_seconds=0.5)],
        disk_bandwidth=1e9,
        resident_bytes=3 * GB,
    )
    assert (e.seconds, e.read_seconds, e.stall_seconds, e.bottleneck) == (0.75, 0.0, 0.0, "compute")
    assert e.load_seconds == 3.0 and e.first_seconds == 3.75


def test_disk_bound_pipeline_is_all_reads_then_the_last_compute() -> None:
    e = predict_forward(streamed(5, read_s=1.0, compute_s=0.25), disk_bandwidth=1e9, depth=1)
    assert e.seconds == pytest.approx(5 * 1.0 + 0.25)
    assert e.stall_seconds == pytest.approx(5 * 1.0 - 4 * 0.25)


def test_compute_bound_pipeline_is_the_first_read_then_all_computes() -> None:
    e = predict_forward(streamed(5, read_s=0.25, compute_s=1.0), disk_bandwidth=1e9, depth=1)
    assert e.seconds == pytest.approx(0.25 + 5 * 1.0) and e.bottleneck == "compute"


def test_no_read_ahead_runs_every_stage_in_turn() -> None:
    units = streamed(4, read_s=1.0, compute_s=0.5)
    assert predict_forward(units, disk_bandwidth=1e9, depth=0).seconds == pytest.approx(4 * 1.5)


def test_reads_run_ahead_past_resident_units() -> None:
    # a long resident unit between two streamed ones: the second read happens during it
    units = [
        UnitCost("s0", read_bytes=GB, compute_seconds=0.1),
        UnitCost("r", compute_seconds=3.0),
        UnitCost("s1", read_bytes=GB, compute_seconds=0.1),
    ]
    e = predict_forward(units, disk_bandwidth=1e9, depth=1)
    assert e.seconds == pytest.approx(1.0 + 0.1 + 3.0 + 0.1)
    # with depth 0 the second read waits for its turn
    assert predict_forward(units, disk_bandwidth=1e9, depth=0).seconds == pytest.approx(1.1 + 3.0 + 1.1)


def test_read_ahead_is_limited_by_depth_buffers() -> None:
    # resident compute first (4 s), then 4 streamed units read in 1 s each: depth bounds what is read early
    units = [UnitCost("r", compute_seconds=4.0), *streamed(4, read_s=1.0, compute_s=0.0)]
    by_depth = [predict_forward(units, disk_bandwidth=1e9, depth=d).seconds for d in range(5)]
    assert by_depth == pytest.approx([8.0, 6.0, 5.0, 4.0, 4.0])


def test_a_gpu_adds_the_link_stage() -> None:
    units = [UnitCost(f"h.{i}", read_bytes=GB, copy_bytes=GB, compute_seconds=0.1) for i in range(3)]
    e = predict_forward(units, disk_bandwidth=1e9, link_bandwidth=2e9, depth=2)
    # disk 1 s per unit, link 0.5 s, compute 0.1 s: reads back to back, the last copy and compute after
    assert e.seconds == pytest.approx(3.0 + 0.5 + 0.1)
    assert (e.read_seconds, e.copy_seconds) == pytest.approx((3.0, 1.5)) and e.bottleneck == "disk"
    link_bound = predict_forward(units, disk_bandwidth=10e9, link_bandwidth=1e9, depth=2)
    assert link_bound.bottleneck == "link" and link_bound.seconds == pytest.approx(0.1 + 3.0 + 0.1)


def test_bad_inputs_are_all_named_at_once() -> None:
    with pytest.raises(ValueError) as err:
        predict_forward([UnitCost("h.0", copy_bytes=5)], disk_bandwidth=0, depth=-1)
    text = str(err.value)
    assert "disk_bandwidth=0" in text and "link_bandwidth" in text and "'h.0'" in text and "depth=-1" in text
    with pytest.raises(ValueError, match=r"UnitCost 'h.1'.*read_bytes=-1.*compute_seconds=-0.5"):
        UnitCost("h.1", read_bytes=-1, compute_seconds=-0.5)
    with pytest.raises(ValueError, match="flops_per_second"):
        compute_seconds(10, 1, flops_per_second=0)


def test_estimate_from_totals_matches_explicit_units() -> None:
    e = estimate_forward(
        resident_bytes=2 * GB,
        streamed_bytes=4 * GB,
        disk_bandwidth=1e9,
        compute_seconds=3.0,
        units=4,
        resident_units=2,
        depth=1,
    )
    units = [UnitCost("r", compute_seconds=0.5)] * 2 + [UnitCost("s", read_bytes=GB, compute_seconds=0.5)] * 4
    explicit = predict_forward(units, disk_bandwidth=1e9, depth=1, resident_bytes=2 * GB)
    assert e == explicit and e.load_seconds == 2.0
    nothing = estimate_forward(resident_bytes=0, streamed_bytes=0, disk_bandwidth=1e9, compute_seconds=1.5)
    assert nothing.seconds == 1.5 and nothing.read_seconds == 0.0


def test_estimate_spreads_copies_over_units() -> None:
    e = estimate_forward(
        resident_bytes=GB,
        streamed_bytes=GB,
        disk_bandwidth=1e9,
        compute_seconds=0.0,
        copied_bytes=2 * GB,
        link_bandwidth=1e9,
    )
    assert e.copy_seconds == pytest.approx(2.0) and e.read_seconds == pytest.approx(1.0)


def test_compute_seconds_is_two_flops_per_parameter_and_token() -> None:
    assert compute_seconds(10**9, 8, flops_per_second=16e9) == 1.0


def test_explain_names_the_bottleneck_and_the_load() -> None:
    e = estimate_forward(resident_bytes=GB, streamed_bytes=3 * GB, disk_bandwidth=1e9, compute_seconds=1.0, units=3)
    text = e.explain()
    assert text.startswith(f"{e.seconds:.2f} s per forward") and "disk 3.00 s" in text
    assert "disk is the bottleneck" in text and "1.00 s more before the first" in text
    assert "bottleneck" not in predict_forward([UnitCost("a", compute_seconds=1.0)], disk_bandwidth=1.0).explain()


units_strategy = st.lists(
    st.builds(
        UnitCost,
        name=st.just("u"),
        read_bytes=st.integers(0, 5 * GB),
        copy_bytes=st.integers(0, 2 * GB),
        compute_seconds=st.floats(0, 5, allow_nan=False),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(units=units_strategy, depth=st.integers(0, 6), disk=st.floats(1e8, 1e10), link=st.floats(1e8, 1e11))
def test_the_prediction_lies_between_the_busiest_stage_and_no_overlap(
    units: list[UnitCost], depth: int, disk: float, link: float
) -> None:
    e = predict_forward(units, disk_bandwidth=disk, link_bandwidth=link, depth=depth)
    busiest = max(e.read_seconds, e.copy_seconds, e.compute_seconds)
    serial = e.read_seconds + e.copy_seconds + e.compute_seconds
    assert busiest - 1e-9 <= e.seconds <= serial + 1e-9
    assert 0.0 <= e.overlap <= 1.0 and e.stall_seconds >= -1e-12
    assert isinstance(e, ForwardEstimate) and math.isfinite(e.seconds)


@settings(max_examples=100, deadline=None)
@given(units=units_strategy, depth=st.integers(0, 5), disk=st.floats(1e8, 1e10))
def test_more_read_ahead_or_bandwidth_is_never_slower(units: list[UnitCost], depth: int, disk: float) -> None:
    base = predict_forward(units, disk_bandwidth=disk, link_bandwidth=1e10, depth=depth).seconds
    deeper = predict_forward(units, disk_bandwidth=disk, link_bandwidth=1e10, depth=depth + 1).seconds
    faster = predict_forward(units, disk_bandwidth=disk * 2, link_bandwidth=1e10, depth=depth).seconds
    assert deeper <= base + 1e-9 and faster <= base + 1e-9


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.tuples(st.sampled_from(["gpu", "cpu", "disk"]), st.integers(0, 4 * GB)), min_size=0, max_size=12),
    compute=st.sampled_from([0.0, 0.5, 3.0]),
    gpu=st.booleans(),
    depth=st.integers(0, 3),
)
def test_plan_forward_is_the_pipeline_of_every_placement(
    rows: list[tuple[str, int]], compute: float, gpu: bool, depth: int
) -> None:
    # plan_forward leaves out the units that read, copy and compute nothing (GPU-resident ones
    # when compute is not counted, as in the Planner): the prediction must be the same, exactly
    placements = [(f"m.{i}", device, nbytes) for i, (device, nbytes) in enumerate(rows)]
    total = sum(n for _, _, n in placements) or 1
    units = [
        UnitCost(
            name,
            read_bytes=nbytes if device == "disk" else 0,
            copy_bytes=nbytes if gpu and device != "gpu" else 0,
            compute_seconds=compute * nbytes / total,
        )
        for name, device, nbytes in placements
    ]
    link = 25e9 if gpu else None
    main = "gpu" if gpu else "cpu"
    resident = sum(n for _, d, n in placements if d == "cpu")
    expected = predict_forward(
        units or [UnitCost("model")], disk_bandwidth=2e9, link_bandwidth=link, depth=depth, resident_bytes=resident
    )
    got = plan_forward(
        placements, disk_bandwidth=2e9, compute_seconds=compute, link_bandwidth=link, main_device=main, depth=depth
    )
    assert got == expected
