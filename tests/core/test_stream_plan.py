"""The stream plan (pure, no torch): one rule for the planner's default cpu budget, cost() and
the engine, and the refusal of a resident copy larger than the RAM (issue 22)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigviz.core.errors import PlanError
from bigviz.core.offload_units import UnitRule, largest_unit
from bigviz.core.plan import PlanOptions
from bigviz.core.planner import make_plan
from bigviz.core.stream_plan import (
    DEFAULT_DEPTH,
    RAM_SHARE,
    RING_AHEAD,
    RING_AHEAD_LEAST,
    MachineFacts,
    StreamOptions,
    make_stream_plan,
    resident_room,
    ring_bytes,
)
from bigviz.core.tree import SizeTree, TensorSpec

MB = 10**6


def _tree(n: int, layer: int) -> SizeTree:
    """``n`` blocks of ``layer`` bytes (class ``Block``: each one unit when streamed)."""
    specs = [TensorSpec(f"h.{i}.{p}.weight", layer // 8, "float32") for i in range(n) for p in "ab"]
    return SizeTree.build(
        specs, {"": "Net", "h": "ModuleList", **{f"h.{i}": "Block" for i in range(n)}}, containers=["h"]
    )


BLOCKS = PlanOptions(rule=UnitRule(blocks=frozenset({"Block"})))


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 30), layer=st.integers(1, 50).map(lambda k: 4 * k * MB), ram=st.integers(1, 2000))
def test_a_model_planned_with_the_default_budget_streams_as_planned(n: int, layer: int, ram: int) -> None:
    # the planner's default cpu budget and the stream plan are one rule: a model planned with
    # resident_room on a machine is copied when it does not fit (never left mapped for lack of
    # room, unless the ring alone is more than the RAM), and kept mapped when it does
    facts = MachineFacts(ram * MB)
    tree = _tree(n, layer)
    budget = resident_room(facts, model_bytes=tree.total(""), largest_unit=largest_unit(tree, frozenset({"Block"})))
    plan = make_plan(tree, {"cpu": budget, "disk": 10**15}, BLOCKS)
    stream = plan.stream_plan(facts)
    if plan.offloaded_bytes()["disk"] == 0:
        assert stream.mode == "map"
    elif ring_bytes(layer, RING_AHEAD_LEAST) > facts.room:  # not even the least ring fits
        assert stream.mode == "map" and "do not fit" in stream.reason
    else:
        assert stream.mode == "copy" and stream.fetcher == "ring"
        assert stream.resident_bytes + stream.ring_bytes <= facts.room
    assert plan.dispatch_plan(machine=facts).stream == stream  # the dispatch carries the same plan


def test_the_ring_or_the_page_cache_and_how_far_ahead() -> None:
    units = [(f"h.{i}", "disk", 100 * MB) for i in range(6)]
    facts = MachineFacts(int(500 * MB / RAM_SHARE))
    ring = make_stream_plan(units, {"h.6": 200 * MB}, "cpu", facts)
    assert (ring.mode, ring.fetcher, ring.ring_bytes, ring.depth) == (
        "copy",
        "ring",
        ring_bytes(100 * MB),
        DEFAULT_DEPTH,
    )
    cache = make_stream_plan(
        units, {"h.6": 200 * MB}, "cpu", MachineFacts(8 * 10**9), StreamOptions(resident="copy", stream="cache")
    )
    assert (cache.fetcher, cache.ring_bytes, cache.depth) == ("cache", 0, DEFAULT_DEPTH)
    tight = make_stream_plan(
        units, {"h.6": 200 * MB}, "cpu", MachineFacts(1200 * MB), StreamOptions(resident="copy", stream="cache")
    )
    assert tight.depth == 1  # the RAM left beside the copy holds one unit ahead
    off = make_stream_plan(units, {"h.6": 200 * MB}, "cpu", facts, StreamOptions(prefetch=False))
    assert off.depth == 0 and off.fetch_ahead == 0
    assert [u.residency for u in ring.units] == ["resident copy"] + ["streamed"] * 6


def test_a_gpu_streams_through_pinned_staging_one_unit_ahead() -> None:
    units = [("h.0", "cpu", 10), ("h.1", "disk", 10)]
    plan = make_stream_plan(units, {"emb": 5}, 0, MachineFacts(10), resident_devices={"emb": 0})
    assert (plan.mode, plan.fetcher, plan.depth, plan.resident_bytes) == ("map", "cuda", 1, 0)
    assert [(u.residency, u.rereads) for u in plan.units] == [
        ("on device", False),
        ("streamed", False),
        ("streamed", True),
    ]


def test_when_the_ring_alone_fills_the_ram_no_budget_is_advised() -> None:
    """A ring of two 400 MB disk units in 300 MB of room: no 'cpu' budget makes a copy fit, so
    the reason and the refusal say so (they advised a budget below 0 B)."""
    units = [("h.1", "disk", 400 * MB), ("h.2", "disk", 400 * MB)]
    facts = MachineFacts(int(300 * MB / RAM_SHARE))
    auto = make_stream_plan(units, {"h.0": 10 * MB}, "cpu", facts)
    assert auto.mode == "map" and "the ring alone" in auto.reason and "below 0 B" not in auto.reason, auto.reason
    with pytest.raises(PlanError, match="no cpu budget helps: the ring alone") as info:
        make_stream_plan(units, {"h.0": 10 * MB}, "cpu", facts, StreamOptions(resident="copy"))
    assert "below 0 B" not in str(info.value)


def test_a_copy_larger_than_the_ram_is_kept_mapped_or_refused() -> None:
    units = [("h.1", "disk", 100 * MB)]
    facts = MachineFacts(int(300 * MB / RAM_SHARE))
    auto = make_stream_plan(units, {"h.0": 400 * MB}, "cpu", facts)
    assert auto.mode == "map" and "available RAM" in auto.reason and "lower the 'cpu' budget" in auto.reason
    with pytest.raises(
        PlanError, match=r"resident='copy' refused: the resident part \(381\.5 MiB\).*300 MB|resident='copy' refused"
    ):
        make_stream_plan(units, {"h.0": 400 * MB}, "cpu", facts, StreamOptions(resident="copy"))


@pytest.mark.parametrize("resident", ["auto", "map"])
def test_mapped_disk_units_of_a_model_larger_than_the_ram_are_read_each_forward(resident: str) -> None:
    """Kept memory-mapped (a copy that would not fit, or resident="map" asked for), the disk
    units of a model larger than the RAM are read again in every forward: the page cache cannot
    keep them. The cost model then counts their reads; a model that fits reads them once.
    (Less RAM once predicted no reads at all, a faster forward than with more RAM.)"""
    units = [("h.1", "disk", 100 * MB), ("h.2", "disk", 100 * MB)]
    tight = MachineFacts(int(300 * MB / RAM_SHARE))
    plan = make_stream_plan(units, {"h.0": 400 * MB}, "cpu", tight, StreamOptions(resident=resident))
    assert plan.mode == "map" and all(u.rereads for u in plan.units if u.storage == "disk")
    roomy = make_stream_plan(units, {"h.0": 400 * MB}, "cpu", MachineFacts(10**12), StreamOptions(resident=resident))
    assert roomy.mode == "map" and not any(u.rereads for u in roomy.units)
    tree = _tree(6, 40 * MB)
    planned = make_plan(tree, {"cpu": 100 * MB, "disk": 10**12}, BLOCKS)
    streamed = sum(p.nbytes for p in planned.placements if str(p.device) == "disk")
    costs = [
        planned.cost(disk_bandwidth=10**8, compute_seconds=0.01, machine=MachineFacts(ram)).read_bytes
        for ram in (10**12, int((tree.total("") - 1) / RAM_SHARE), 50 * MB, 10 * MB)
    ]
    assert costs[0] == 0 and streamed > 0 and costs[1:] == [streamed] * 3


def test_without_machine_facts_the_budgets_are_the_machine() -> None:
    plan = make_plan(_tree(4, 4 * MB), {"cpu": 8 * MB, "disk": 10**12})
    assert plan.stream_plan().mode == "copy"  # it has disk units: the model did not fit its cpu budget
    fits = make_plan(_tree(4, 4 * MB), {"cpu": 10**9})
    assert fits.stream_plan().mode == "map" and fits.stream_plan().fetcher == ""


@pytest.mark.parametrize("bad", [dict(resident="pinned"), dict(stream="fast"), dict(readers=0)])
def test_bad_knobs_are_named(bad: dict) -> None:
    with pytest.raises(PlanError, match=next(iter(bad))):
        make_stream_plan([], {}, "cpu", None, StreamOptions(**bad))


@settings(max_examples=200, deadline=None)
@given(resident=st.integers(0, 2000), largest=st.integers(1, 500), ram=st.integers(1, 4000))
def test_the_ring_holds_the_next_unit_whole_where_the_ram_has_room(resident: int, largest: int, ram: int) -> None:
    # two units where the RAM beside the resident part holds them (the next unit is read whole
    # while one computes), else what fits down to 1.5 units, else the resident part stays mapped
    facts = MachineFacts(ram)
    units = [(f"h.{i}", "disk", largest if i == 0 else largest // 2) for i in range(3)]
    plan = make_stream_plan(units, {"": resident} if resident else {}, "cpu", facts, StreamOptions(resident="auto"))
    total = resident + largest + 2 * (largest // 2)
    if total <= facts.room:
        assert plan.mode == "map" and plan.ring_bytes == 0
    elif resident + ring_bytes(largest, RING_AHEAD_LEAST) > facts.room:
        assert plan.mode == "map" and "do not fit" in plan.reason
    else:
        assert plan.mode == "copy" and plan.resident_bytes + plan.ring_bytes <= facts.room
        assert RING_AHEAD_LEAST <= plan.ring_ahead <= RING_AHEAD
        assert plan.ring_bytes == ring_bytes(largest, plan.ring_ahead)
        if resident + ring_bytes(largest, RING_AHEAD) <= facts.room:
            assert plan.ring_ahead == RING_AHEAD  # room for two units: never less
        else:
            assert plan.ring_bytes > facts.room - resident - largest // 100 - 2  # all the room there is
