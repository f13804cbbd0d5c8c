"""When offloaded units are fetched: the next one (in recorded order) while the current computes.

:class:`Scheduler` records the order units run in during the first forward (guessing
definition order until then) and, as each unit starts, starts fetching the next ``depth`` ones
with its fetcher (:mod:`bigviz.engine.fetchers`: *how* a unit is read). How many units ahead
is the dispatch's stream plan's (``depth``). A fetch that fails in the background raises
:class:`~bigviz.core.errors.FetchError` in the caller, naming the unit.

Example:
    >>> import torch
    >>> from bigviz.engine.binding import bound_units
    >>> from bigviz.engine.fetchers.cpu import CpuFetcher
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> units = bound_units(model, {"0": "disk", "1": "disk"}, main_device="cpu")
    >>> for unit in units:
    ...     unit.sources = {k: {k: torch.ones(2)} for k in unit.slots}
    >>> with Scheduler(units, CpuFetcher(), prefetch=True) as scheduler:
    ...     sorted(scheduler.acquire(units[0]))
    ['0.bias', '0.weight']
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from bigviz.engine.binding import BoundUnit
from bigviz.engine.fetchers.protocol import Fetcher, Handle

if TYPE_CHECKING:
    from bigviz.engine.timeline import Timeline

__all__ = ["Scheduler"]


class Scheduler:
    """Hands out units' weights, fetching the next unit (in recorded order) ahead of time.

    Args:
        units: All offload units, in definition order (the guess before a pass is seen).
        fetcher: How a unit's weights are read.
        prefetch: Fetch the next unit in the background while the current one computes.
        wrap: After the last unit, prefetch the first one (for the next forward). Cheap
            page-in hints only: a GPU fetcher would hold a unit's memory between calls.
    """

    def __init__(
        self, units: Sequence[BoundUnit], fetcher: Fetcher, *, prefetch: bool, wrap: bool = True, depth: int = 1
    ) -> None:
        self.units = list(units)
        self.depth = depth  # units fetched ahead of the running one (issue 12: a fetcher may want more)
        self.fetcher = fetcher
        self.prefetch = prefetch
        self.wrap = wrap
        n = len(self.units)
        self._guess = {id(u): self.units[(i + 1) % n] for i, u in enumerate(self.units)}
        self._guess_pos = {id(u): i for i, u in enumerate(self.units)}
        self._seen: list[BoundUnit] = []
        self._seen_ids: set[int] = set()
        self._next: dict[int, BoundUnit] | None = None  # recorded order, once a pass completed
        self._next_pos: dict[int, int] = {}
        self._pending: OrderedDict[int, Handle] = OrderedDict()
        self._depth = 0
        self._this_pass: set[int] = set()  # units fetched since the outermost pass began
        self.timeline: Timeline | None = None  # set while bigviz.timeline(model) records

    def __enter__(self) -> Scheduler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def order(self) -> list[str]:
        """Names of the units in the execution order recorded on the first forward."""
        return [u.name for u in self._seen]

    def begin_pass(self) -> None:
        """A forward of the whole model starts (called by the root hook)."""
        if self._depth == 0:
            self._this_pass = set()
        self._depth += 1
        if self.timeline is not None:
            self.timeline.forward_began()

    def not_fetched(self) -> list[BoundUnit]:
        """Units not fetched since the outermost forward began (for error messages)."""
        return [u for u in self.units if id(u) not in self._this_pass]

    def end_pass(self, *, completed: bool = True) -> None:
        """A forward of the whole model ended: the first complete one fixes the order."""
        self._depth = max(0, self._depth - 1)
        if self.timeline is not None:
            self.timeline.forward_ended()
        if not completed and self._next is None:
            self._seen, self._seen_ids = [], set()  # a failed pass says nothing about the order
        elif self._depth == 0 and self._next is None and self._seen:
            n = len(self._seen)
            self._next = {id(u): self._seen[(i + 1) % n] for i, u in enumerate(self._seen)}
            self._next_pos = {id(u): i for i, u in enumerate(self._seen)}

    def acquire(self, unit: BoundUnit) -> dict[str, Tensor]:
        """Key -> tensor for ``unit``, ready on the execution device (starts the next fetch)."""
        self._this_pass.add(id(unit))
        if self.timeline is not None:
            self.timeline.waiting(unit)
        handle = self._pending.pop(id(unit), None)
        if handle is None:
            handle = self._start(unit, background=False)
        if self._next is None and id(unit) not in self._seen_ids:
            self._seen_ids.add(id(unit))
            self._seen.append(unit)
        if self.prefetch:
            self._prefetch_after(unit)
        tensors = handle.wait()
        if self.timeline is not None:
            self.timeline.computing(unit)
        return tensors

    def _start(self, unit: BoundUnit, *, background: bool) -> Handle:
        handle = self.fetcher.start(unit, background=background)
        if self.timeline is not None and not hasattr(self.fetcher, "timeline"):  # else it times its own reads
            self.timeline.requested(unit, handle)
            handle.add_done_callback(lambda _: self.timeline.read_done(unit, handle) if self.timeline else None)
        return handle

    def _prefetch_after(self, unit: BoundUnit, count: int | None = None) -> None:
        nxt: BoundUnit | None = unit
        for _ in range(self.depth if count is None else count):
            nxt = self._next_of(nxt)  # type: ignore[arg-type]
            if nxt is None or nxt is unit:
                break
            if id(nxt) not in self._pending:
                self._pending[id(nxt)] = self._start(nxt, background=True)
        while len(self._pending) > self.depth + 1:  # a guess that did not come true: drop the oldest
            self._pending.popitem(last=False)

    def fetch_ahead(self, n: int) -> None:
        """Start fetching the first ``n`` units (definition order) now, before any forward:
        their reads overlap whatever runs first (the resident part of a model larger than RAM)."""
        for unit in self.units[:n]:
            if id(unit) not in self._pending:
                self._pending[id(unit)] = self._start(unit, background=True)

    def release(self, unit: BoundUnit) -> None:
        """``unit``'s forward is over: a fetcher that keeps something for it may let it go.

        A fetcher whose ``reads_on_release`` is true (memory it holds is freed by the release:
        :class:`~bigviz.engine.fetchers.ring.RingFetcher`,
        :class:`~bigviz.engine.fetchers.cache.StreamingFetcher`) then starts the next read at once,
        ``depth + 1`` units on: the reads keep running while resident units between two
        streamed ones compute, instead of waiting for the next streamed unit to start.
        """
        if self.timeline is not None:
            self.timeline.computed(unit)
        release = getattr(self.fetcher, "release", None)
        streaming = getattr(self.fetcher, "reads_on_release", False)
        if release is not None and streaming:
            release(unit, still_needed=self._still_needed)
        elif release is not None:
            release(unit)
        if self.prefetch and streaming:
            self._prefetch_after(unit, self.depth + 1)

    def _still_needed(self, unit_id: int) -> bool:
        """A unit has not run yet in this forward, or is already read ahead for the next one."""
        return unit_id in self._pending or unit_id not in self._this_pass

    def _next_of(self, unit: BoundUnit) -> BoundUnit | None:
        recorded = self._next is not None and id(unit) in self._next
        table, pos = (self._next, self._next_pos) if recorded else (self._guess, self._guess_pos)
        nxt = table[id(unit)]  # type: ignore[index]
        is_wrap = pos[id(nxt)] <= pos[id(unit)]
        return None if is_wrap and not self.wrap else nxt

    def close(self) -> None:
        """Stop the background worker and drop fetched-ahead weights."""
        self._pending.clear()
        self.fetcher.close()
