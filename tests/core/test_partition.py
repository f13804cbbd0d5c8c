"""The partition search against brute force on small chains (bigviz.core.partition)."""

from __future__ import annotations

from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from bigviz.core.partition import Chain, choose, reachable, smallest


def brute_force(weights: list[int], k: int) -> int:
    """The smallest largest part over every cut of ``weights`` into ``k`` non-empty parts."""
    n = len(weights)
    best = None
    for cuts in combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        worst = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=9), st.integers(1, 4))
def test_the_smallest_bottleneck_is_the_brute_force_one(weights: list[int], k: int) -> None:
    k = min(k, len(weights))
    chain = Chain(weights, weights)

    def caps(t: int) -> list[tuple[int, int]]:
        return [(t, t)] * k

    best = smallest(chain, caps, sum(weights) + 1)
    assert best == brute_force(weights, k)
    bounds = choose(chain, reachable(chain, caps(best)), caps(best), (1,) * k)
    assert bounds[0] == 0 and bounds[-1] == len(weights) and len(bounds) == k + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:]))  # k non-empty parts, in order
    assert max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])) == best


def test_caps_on_bytes_bound_each_part_separately() -> None:
    """Two measures: the metric balanced, bytes capped per part; a part whose byte cap
    cannot hold an item forces the cut elsewhere, and no cut at all gives None."""
    chain = Chain([1, 1, 1, 1], [5, 1, 1, 5])
    assert reachable(chain, [(10, 6), (10, 6)]) is not None
    assert reachable(chain, [(10, 4), (10, 10)]) is None  # part 0 cannot hold item 0's 5 bytes
    bounds = choose(chain, reachable(chain, [(10, 6), (10, 6)]), [(10, 6), (10, 6)], (1, 1))
    assert bounds == [0, 2, 4]
