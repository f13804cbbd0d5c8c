"""How plans and sizes read as text: counts, durations, and reasons that say what "left" means."""

from __future__ import annotations

import pytest

from bigviz.core.planner import make_plan
from bigviz.core.offload_units import UnitRule
from bigviz.core.plan import PlanOptions
from bigviz.core.sizes import format_count, format_seconds
from bigviz.core.tree import SizeTree, TensorSpec

pytestmark = pytest.mark.core


def _blocks(n: int = 8, size: int = 1000) -> SizeTree:
    return SizeTree.build([TensorSpec(f"h.{i}.weight", size, "float32") for i in range(n)])


def test_room_a_balanced_strategy_caps_is_left_of_a_share_not_of_the_budget():
    """A balanced plan fills each GPU up to its share; "2.0 MiB left" then means left of that
    share, with the budget's room unused: the reason must say which."""
    options = PlanOptions(rule=UnitRule(blocks=frozenset({"h.*"})))
    balanced = make_plan(_blocks(), {0: 30_000, 1: 30_000}, options)
    reasons = {p.name: p.reason for p in balanced.placements}
    first_on_1 = next(p for p in balanced.placements if p.device == 1).name
    assert reasons["h.0"].endswith("left of GPU 0's balanced share")
    assert "left of its balanced share):" in reasons[first_on_1]
    assert balanced.usage_of(0).cap < balanced.usage_of(0).budget  # capped indeed
    sequential = make_plan(_blocks(), {0: 30_000, 1: 30_000}, PlanOptions(strategy="sequential"))
    assert all("share" not in p.reason for p in sequential.placements)
    assert sequential.placements[0].reason.endswith("left on GPU 0")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.0, "0 ms"), (0.0002, "0.2 ms"), (0.0049, "4.9 ms"), (0.0123, "12 ms"), (0.5, "500 ms"), (61.25, "61.2 s")],
)
def test_durations_are_never_rounded_to_nothing(seconds: float, text: str):
    assert format_seconds(seconds) == text


def test_counts_agree_with_their_noun():
    assert [format_count(n, "block") for n in (0, 1, 2, 1234)] == ["0 blocks", "1 block", "2 blocks", "1,234 blocks"]
