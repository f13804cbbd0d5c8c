"""Cut a chain of items into k contiguous parts, each under its caps, with the smallest bottleneck.

The search under :mod:`bigviz.core.stages` (pipeline stages), on plain integers: each item has
a metric (bytes, or FLOPs per token) and bytes; part ``i`` may hold at most ``caps[i]`` of
each. :func:`reachable` finds, for each part, the sorted intervals of positions where it can
start (prefix sums and bisect: a part starting in ``a..b`` can end anywhere up to the
farthest position its cap reaches, except past an item too big for it); :func:`smallest`
binary-searches the smallest bottleneck whose caps still reach the end; :func:`choose` then
puts each boundary, from the last part back, nearest to its even share of the metric. Written
here because no library the project uses partitions under per-part caps on two measures
(torch's pipelining splits by a given count or by hand).

Example:
    >>> chain = Chain([3, 1, 1, 3], [3, 1, 1, 3])
    >>> caps = lambda t: [(t, t), (t, t)]  # two parts, the same cap on both measures
    >>> best = smallest(chain, caps, 8)
    >>> best, choose(chain, reachable(chain, caps(best)), caps(best), (1, 1))
    (4, [0, 2, 4])
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from itertools import accumulate

__all__ = ["Chain", "Intervals", "reachable", "choose", "smallest"]


class Chain:
    """Prefix sums of the balanced metric and of bytes, and per-stage caps on both."""

    def __init__(self, metric: Sequence[int], nbytes: Sequence[int]) -> None:
        self.n = len(metric)
        self.wm, self.wb = list(metric), list(nbytes)
        self.pm = list(accumulate(metric, initial=0))
        self.pb = list(accumulate(nbytes, initial=0))
        self._by_m = sorted(range(self.n), key=self.wm.__getitem__)
        self._by_b = sorted(range(self.n), key=self.wb.__getitem__)
        self._sorted_m = [self.wm[i] for i in self._by_m]
        self._sorted_b = [self.wb[i] for i in self._by_b]

    def far(self, p: int, cap: tuple[int, int]) -> int:
        """The last end q such that items p..q-1 fit ``cap`` (p itself when item p does not)."""
        return (
            min(bisect.bisect_right(self.pm, self.pm[p] + cap[0]), bisect.bisect_right(self.pb, self.pb[p] + cap[1]))
            - 1
        )

    def near(self, q: int, cap: tuple[int, int]) -> int:
        """The first start p such that items p..q-1 fit ``cap``."""
        return max(bisect.bisect_left(self.pm, self.pm[q] - cap[0]), bisect.bisect_left(self.pb, self.pb[q] - cap[1]))

    def too_big(self, cap: tuple[int, int]) -> list[int]:
        """Positions of the items that alone exceed ``cap`` (usually none, or the head)."""
        if not self.n or (self._sorted_m[-1] <= cap[0] and self._sorted_b[-1] <= cap[1]):
            return []
        big_m = self._by_m[bisect.bisect_right(self._sorted_m, cap[0]) :]
        big_b = self._by_b[bisect.bisect_right(self._sorted_b, cap[1]) :]
        return sorted(set(big_m) | set(big_b))


Intervals = list[tuple[int, int]]


def _ends(chain: Chain, starts: Intervals, cap: tuple[int, int], limit: int) -> Intervals:
    """Every position where a stage can end, given where it can start (sorted intervals).

    From starts a..b a stage ends at p+1 for every p in a..b whose item fits, and at every
    position up to far(b) when item b fits: the gaps are exactly the items too big for it.
    """
    big = chain.too_big(cap)
    found: Intervals = []
    for a, b in starts:
        b = min(b, chain.n - 1)  # a stage starting at the end would be empty
        lo = a + 1
        for hole in big[bisect.bisect_left(big, a) : bisect.bisect_right(big, b)]:
            if lo <= hole:
                found.append((lo, hole))
            lo = hole + 2
        if lo <= b + 1:
            found.append((lo, b + 1))
        far = chain.far(b, cap)
        if far >= b + 2:  # implies item b fits
            found.append((b + 2, far))
    return _merge([(a, min(b, limit)) for a, b in found if a <= limit])


def _merge(intervals: Intervals) -> Intervals:
    out: Intervals = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def reachable(chain: Chain, caps: Sequence[tuple[int, int]]) -> list[Intervals] | None:
    """Where each stage can start (``[0]`` for stage 0), or None when the caps cannot hold
    the chain in ``len(caps)`` non-empty stages."""
    k = len(caps)
    starts: list[Intervals] = [[(0, 0)]]
    for i, cap in enumerate(caps):
        ends = _ends(chain, starts[-1], cap, chain.n - (k - 1 - i))
        if not ends:
            return None
        starts.append(ends)
    return starts if starts[-1][-1][1] == chain.n else None


def choose(chain: Chain, starts: list[Intervals], caps: Sequence[tuple[int, int]], shares: Sequence[int]) -> list[int]:
    """Stage boundaries (0, b1, ..., n): from the last stage back, each start is the feasible
    one nearest to its even share of the metric."""
    k, total = len(caps), chain.pm[-1]
    bounds = [chain.n]
    for i in range(k - 1, 0, -1):
        end = bounds[-1]
        lo_fit = chain.near(end, caps[i])
        target = total * sum(shares[:i]) / sum(shares)
        candidates = []
        for a, b in starts[i]:
            a, b = max(a, lo_fit), min(b, end - 1)
            if a <= b:
                mid = min(max(bisect.bisect_left(chain.pm, target, a, b + 1), a), b)
                candidates += [a, b, mid, max(a, mid - 1)]
        even = chain.n * i / k
        bounds.append(min(candidates, key=lambda p: (abs(chain.pm[p] - target), abs(p - even))))
    return [0] + bounds[::-1]


def smallest(chain: Chain, caps: Callable[[int], Sequence[tuple[int, int]]], upper: int) -> int:
    """The smallest bottleneck T in [0, upper] whose caps hold the chain (binary search)."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if reachable(chain, caps(mid)) is not None else (mid + 1, hi)
    return lo
