"""The limit of a streamed forward (issue 26): max(reads of the streamed bytes, compute of the
whole forward with every weight in RAM) plus what cannot overlap, in the one cost model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigviz.core.cost import UnitCost, predict_forward, weights_compute_seconds
from bigviz.core.planner import make_plan
from bigviz.core.stream_plan import RAM_SHARE, MachineFacts
from bigviz.core.tree import SizeTree, TensorSpec

GB = 10**9

units_st = st.lists(
    st.tuples(st.booleans(), st.integers(1, 4 * GB), st.floats(0.0, 5.0, allow_nan=False)), min_size=1, max_size=24
)


def _units(spec: list[tuple[bool, int, float]]) -> list[UnitCost]:
    return [
        UnitCost(f"u{i}", read_bytes=n if streamed else 0, compute_seconds=c) for i, (streamed, n, c) in enumerate(spec)
    ]


def _closed_form(units: list[UnitCost], disk: float) -> float:
    """The issue's bound, made exact: the disk reads everything, then what computes from the
    last streamed unit on; compute runs everything, after what the first streamed unit must
    read beyond the compute of the resident units before it."""
    streamed = [i for i, u in enumerate(units) if u.streamed]
    compute = sum(u.compute_seconds for u in units)
    if not streamed:
        return compute
    reads = sum(u.read_bytes for u in units) / disk
    tail = sum(u.compute_seconds for u in units[streamed[-1] :])
    head = sum(u.compute_seconds for u in units[: streamed[0]])
    return max(reads + tail, compute + max(0.0, units[streamed[0]].read_bytes / disk - head))


@settings(max_examples=200, deadline=None)
@given(units_st, st.integers(0, 4), st.sampled_from([None, GB, 3 * GB, 8 * GB]))
def test_no_forward_beats_the_limit_and_the_limit_beats_every_stage(spec, depth, ring) -> None:
    units = _units(spec)
    e = predict_forward(units, disk_bandwidth=GB, depth=depth, ring=ring if any(u.streamed for u in units) else None)
    assert e.limit_seconds <= e.seconds + 1e-9
    assert e.limit_seconds >= max(e.read_seconds, e.compute_seconds) - 1e-9
    assert e.limit_seconds >= _closed_form(units, GB) - 1e-6


def test_the_limit_is_the_disk_or_the_compute_whichever_is_longer_plus_the_ends() -> None:
    streamed = [UnitCost(f"h.{i}", read_bytes=GB, compute_seconds=0.5) for i in range(8)]
    assert predict_forward(streamed, disk_bandwidth=GB).limit_seconds == pytest.approx(8 * 1.0 + 0.5)
    slow = [UnitCost(u.name, read_bytes=GB, compute_seconds=2.0) for u in streamed]
    assert predict_forward(slow, disk_bandwidth=GB).limit_seconds == pytest.approx(1.0 + 8 * 2.0)


def test_a_split_where_compute_sets_the_pace_is_judged_against_compute_not_the_disk() -> None:
    """The issue's 16 GiB split: 12-14 s of streaming under 17 s of compute."""
    block, per_block = 1_800_000_000, 1.07
    units = [UnitCost(f"h.{i}", read_bytes=block if i >= 9 else 0, compute_seconds=per_block) for i in range(16)]
    e = predict_forward(units, disk_bandwidth=0.9e9, ring=int(2.5 * block))
    assert e.bottleneck == "compute"
    assert e.limit_seconds == pytest.approx(16 * per_block, rel=1e-6)  # the reads hide under the resident compute
    assert e.read_seconds == pytest.approx(7 * block / 0.9e9)


def test_more_read_ahead_reaches_the_limit() -> None:
    units = [UnitCost(f"h.{i}", read_bytes=GB if i % 3 else 0, compute_seconds=0.4) for i in range(12)]
    tight = predict_forward(units, disk_bandwidth=GB, depth=1)
    loose = predict_forward(units, disk_bandwidth=GB, depth=len(units))
    assert tight.limit_seconds == loose.limit_seconds == pytest.approx(loose.seconds)


def _plan() -> object:
    tree = SizeTree.build([TensorSpec(f"h.{i}.weight", GB // 4, "float32") for i in range(6)])
    return make_plan(tree, {"cpu": 3 * GB, "disk": 10**13})


def test_the_machine_s_compute_rate_counts_the_compute_of_the_whole_forward() -> None:
    plan = _plan()
    ram = int((3 * GB + 2 * GB) / RAM_SHARE)  # the resident 3 GB and a ring, not the model: streamed
    fast = plan.cost(machine=MachineFacts(ram, disk_bandwidth=GB, compute_rate=60 * GB))
    slow = plan.cost(machine=MachineFacts(ram, disk_bandwidth=GB, compute_rate=GB / 2))
    assert fast.compute_seconds == pytest.approx(6 * GB / (60 * GB))
    assert fast.bottleneck == "disk" and slow.bottleneck == "compute"
    assert slow.compute_seconds == pytest.approx(12.0)
    assert slow.limit_seconds >= 12.0 and fast.limit_seconds >= 3.0
    given = plan.cost(machine=MachineFacts(ram, disk_bandwidth=GB, compute_rate=GB / 2), compute_seconds=1.0)
    assert given.compute_seconds == pytest.approx(1.0)  # seconds given win over the rate
    assert plan.cost(machine=MachineFacts(ram, disk_bandwidth=GB)).compute_seconds == 0.0


def test_a_compute_rate_that_is_no_rate() -> None:
    with pytest.raises(ValueError, match="compute_rate"):
        weights_compute_seconds(GB, compute_rate=0)


# ---- the compute the reads take (MachineFacts.read_cost) ---------------------------------------


@settings(max_examples=150, deadline=None)
@given(units_st, st.integers(0, 4), st.floats(0.0, 1e-9, allow_nan=False))
def test_reads_that_cost_compute_slow_the_prediction_by_at_most_their_cost_and_leave_the_limit(
    spec, depth, cost
) -> None:
    units = _units(spec)
    free = predict_forward(units, disk_bandwidth=GB, depth=depth)
    paid = predict_forward(units, disk_bandwidth=GB, depth=depth, read_cost=cost)
    taken = sum(u.read_bytes for u in units) * cost
    assert paid.read_cost_seconds == pytest.approx(taken)
    assert paid.limit_seconds == pytest.approx(free.limit_seconds)  # the limit: compute at its floor
    assert paid.compute_seconds == pytest.approx(free.compute_seconds + taken)
    assert free.seconds - 1e-9 <= paid.seconds <= free.seconds + taken + 1e-6


def test_where_compute_sets_the_pace_the_reads_cost_shows_in_full() -> None:
    """The 2/3 split of the bench: compute never waits, yet the forward is the compute floor
    plus what the reads beside it took (0.125 s per GB on the 2-core VM of issue 26)."""
    block, per_block = 1_800_000_000, 0.5
    units = [UnitCost(f"h.{i}", read_bytes=block if i % 3 == 2 else 0, compute_seconds=per_block) for i in range(18)]
    e = predict_forward(units, disk_bandwidth=2e9, ring=2 * block, read_cost=0.125e-9)
    assert e.bottleneck == "compute" and e.stall_seconds == pytest.approx(0.0)
    assert e.limit_seconds == pytest.approx(18 * per_block)
    assert e.seconds == pytest.approx(18 * per_block + 6 * block * 0.125e-9)
    assert "taken by the reads" in e.explain()


def test_the_machine_s_read_cost_reaches_the_plan_s_cost_when_the_cpu_executes() -> None:
    plan = _plan()
    ram = int((3 * GB + 2 * GB) / RAM_SHARE)
    free = plan.cost(machine=MachineFacts(ram, disk_bandwidth=GB, compute_rate=GB / 2))
    paid = plan.cost(machine=MachineFacts(ram, disk_bandwidth=GB, compute_rate=GB / 2, read_cost=0.2e-9))
    assert free.read_cost_seconds == 0.0
    assert paid.read_cost_seconds == pytest.approx(paid.read_bytes * 0.2e-9) and paid.read_bytes > 0
    assert paid.seconds == pytest.approx(free.seconds + paid.read_cost_seconds)
    assert paid.limit_seconds == pytest.approx(free.limit_seconds)


def test_a_read_cost_that_is_no_cost() -> None:
    units = [UnitCost("h.0", read_bytes=GB, compute_seconds=1.0)]
    for bad in (-1e-9, float("nan")):
        with pytest.raises(ValueError, match="read_cost"):
            predict_forward(units, disk_bandwidth=GB, read_cost=bad)
