"""Where the time of a streamed forward goes: a per-unit timeline, recorded when asked.

A forward of a model larger than RAM reads its streamed units from disk while earlier units
compute. Whether it reaches its limit (``ForwardEstimate.limit_seconds``: the longer of the
reads and the compute, plus the ends) depends on the schedule: reads that keep the disk busy
while resident blocks compute, compute that never waits on a read the disk could have done
sooner. :func:`timeline` records, for every offload unit of every forward, when its read
started and ended (in the reader threads), when the forward asked for its weights, when it
got them (compute starts) and when its compute ended. Resident units are not hooked: their
compute is the gaps between streamed units' computes.

Off by default and cheap when on: a few ``perf_counter`` calls per unit and per 16 MiB piece
read, under one lock; nothing is recorded once the ``with`` block is left.

Example:
    >>> import os, tempfile, torch, bigviz
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    >>> x = torch.randn(2, 8)
    >>> folder = tempfile.mkdtemp()
    >>> _ = bigviz.dispatch_model(model, {"0": "cpu", "1": "disk", "2": "disk"}, offload_folder=folder)
    >>> with bigviz.timeline(model) as t:
    ...     _ = model(x); _ = model(x)
    >>> [u.name for u in t.forwards[1]]
    ['1', '2']
    >>> all(u.read_end <= u.compute_start <= u.compute_end for u in t.units)
    True
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from bigviz.core.errors import StateError

__all__ = ["UnitTimes", "Timeline", "timeline"]


@dataclass
class UnitTimes:
    """One unit in one forward, seconds since the recording began.

    Attributes:
        name: The unit's module name.
        forward: Which forward (0 = the first recorded) it computed in.
        read_start: When its read began (the first piece in a reader thread, or the fetch
            was asked for, for fetchers that read in one go); ``None``: nothing was read.
        read_end: When its last byte was read (at the latest, when its compute started).
        wait_start: When the forward asked for its weights (its hook ran).
        compute_start: When it had them: its compute began.
        compute_end: When its compute ended (its weights were let go).
        read_bytes: Bytes read for it (ring reads; 0 where the fetcher does not count).
        read_queued: When its first bytes were given room and queued for the readers (ring
            reads; ``None`` elsewhere): a read queued late waited for ring room.
        pieces: ``(start, end)`` of each piece read for it (ring reads, 16 MiB pieces): the
            disk is busy in these, not over all of ``read_start``-``read_end`` (a unit's
            later extents wait for ring room while the unit before it computes).
    """

    name: str
    forward: int
    read_start: float | None
    read_end: float | None
    wait_start: float
    compute_start: float
    compute_end: float = float("nan")
    read_bytes: int = 0
    read_queued: float | None = None
    pieces: tuple[tuple[float, float], ...] = ()

    @property
    def wait(self) -> float:
        """Seconds compute waited for this unit's weights."""
        return self.compute_start - self.wait_start


@dataclass
class _Read:
    tag: object
    start: float | None = None
    end: float | None = None
    nbytes: int = 0
    queued: float | None = None
    pieces: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class Timeline:
    """The units of the forwards run while recording (:func:`timeline`), in compute order."""

    units: list[UnitTimes] = field(default_factory=list)
    _t0: float = field(default_factory=time.perf_counter, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _reads: dict[int, _Read] = field(default_factory=dict, repr=False)  # id(unit) -> its read not yet used
    _open: dict[int, UnitTimes] = field(default_factory=dict, repr=False)  # id(unit) -> computing now
    _forward: int = field(default=-1, repr=False)
    _depth: int = field(default=0, repr=False)
    bounds: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each forward

    def now(self) -> float:
        """Seconds since the recording began."""
        return time.perf_counter() - self._t0

    # ----------------------------------------------------------- called by the engine
    def forward_began(self) -> None:
        if self._depth == 0:
            self._forward += 1
            self.bounds.append((self.now(), float("nan")))
        self._depth += 1

    def forward_ended(self) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and self.bounds:
            self.bounds[-1] = (self.bounds[-1][0], self.now())

    def requested(self, unit: object, tag: object) -> None:
        """A fetch of ``unit`` was asked for (``tag``: which fetch): its read starts now unless
        the fetcher says when (:meth:`timed`)."""
        with self._lock:
            read = self._reads.get(id(unit))
            if read is None or read.tag is not tag:
                self._reads[id(unit)] = _Read(tag, start=self.now())

    def queued(self, unit: object, tag: object) -> None:
        """Part of the read ``tag`` of ``unit`` got room and was queued for the readers."""
        now = self.now()
        with self._lock:
            read = self._reads.get(id(unit))
            if read is None or read.tag is not tag:
                read = self._reads[id(unit)] = _Read(tag)
            if read.queued is None:
                read.queued = now

    def read_done(self, unit: object, tag: object) -> None:
        """The fetch ``tag`` of ``unit`` is done (a fetcher that reads in one go)."""
        now = self.now()
        with self._lock:
            read = self._reads.get(id(unit))
            if read is not None and read.tag is tag and read.end is None:
                read.end = now

    def timed(self, unit: object, tag: object, nbytes: int, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one piece of ``unit``'s read (in a reader thread), recording when it ran."""
        start = self.now()
        try:
            return fn(*args)
        finally:
            end = self.now()
            with self._lock:
                read = self._reads.get(id(unit))
                if read is None or read.tag is not tag:
                    read = self._reads[id(unit)] = _Read(tag, start=start)
                read.start = start if read.start is None else min(read.start, start)
                read.queued = start if read.queued is None else read.queued
                read.end = end if read.end is None else max(read.end, end)
                read.nbytes += nbytes
                read.pieces.append((start, end))

    def waiting(self, unit: Any) -> None:
        """The forward asks for ``unit``'s weights."""
        now = self.now()
        with self._lock:
            self._open[id(unit)] = UnitTimes(unit.name, max(0, self._forward), None, None, now, now)

    def computing(self, unit: Any) -> None:
        """``unit``'s weights are ready: its compute starts."""
        now = self.now()
        with self._lock:
            times = self._open.get(id(unit))
            if times is None:
                return
            read = self._reads.pop(id(unit), None)
            if read is not None:
                times.read_start = now if read.start is None else read.start
                times.read_end = now if read.end is None else min(read.end, now)
                times.read_bytes = read.nbytes
                times.read_queued = read.queued
                times.pieces = tuple(read.pieces)
            times.compute_start = now

    def computed(self, unit: object) -> None:
        """``unit``'s compute ended (its weights are let go)."""
        now = self.now()
        with self._lock:
            times = self._open.pop(id(unit), None)
            if times is not None:
                times.compute_end = now
                self.units.append(times)

    # ----------------------------------------------------------- what a person reads
    @property
    def forwards(self) -> list[list[UnitTimes]]:
        """The units of each forward, in compute order."""
        out: list[list[UnitTimes]] = [[] for _ in range(self._forward + 1)]
        for u in sorted(self.units, key=lambda u: u.compute_start):
            out[u.forward].append(u)
        return out

    def summary(self, forward: int = -1) -> dict[str, float]:
        """One forward's totals: ``seconds`` (wall), ``compute`` (streamed units' compute),
        ``wait`` (compute waiting on reads), ``disk`` (time some read was running: the union
        of its units' pieces read, or of their read intervals where pieces are not timed),
        ``disk_idle`` (wall minus that)."""
        if not self.bounds:
            return {"seconds": 0.0, "compute": 0.0, "wait": 0.0, "disk": 0.0, "disk_idle": 0.0}
        index = forward % len(self.bounds)
        start, end = self.bounds[index]
        units = self.forwards[index]
        spans = sorted(
            (max(start, a), b)
            for u in units
            if u.read_start is not None
            for a, b in (u.pieces or ((u.read_start, u.read_end),))
        )
        busy, reach = 0.0, start
        for a, b in spans:  # union of read intervals inside the forward
            a = max(a, reach)
            if b is not None and b > a:
                busy, reach = busy + b - a, b
        seconds = end - start
        return {
            "seconds": seconds,
            "compute": sum(u.compute_end - u.compute_start for u in units),
            "wait": sum(u.wait for u in units),
            "disk": busy,
            "disk_idle": max(0.0, seconds - busy),
        }

    def table(self, forward: int = -1) -> str:
        """One forward as text: a row per streamed unit (read, wait, compute, in ms from the
        forward's start) and the totals."""
        index = forward % max(1, len(self.bounds))
        origin = self.bounds[index][0] if self.bounds else 0.0
        rows = [f"{'unit':<24} {'read start':>10} {'read end':>9} {'wait':>8} {'compute':>9} {'end':>9} (ms)"]
        for u in self.forwards[index] if self.bounds else []:
            read = (
                f"{(u.read_start - origin) * 1e3:>10.0f} {(u.read_end - origin) * 1e3:>9.0f}"  # type: ignore[operator]
                if u.read_start is not None
                else f"{'-':>10} {'-':>9}"
            )
            rows.append(
                f"{u.name[:24]:<24} {read} {u.wait * 1e3:>8.0f} {(u.compute_start - origin) * 1e3:>9.0f} "
                f"{(u.compute_end - origin) * 1e3:>9.0f}"
            )
        s = self.summary(index)
        rows.append(
            f"forward {index}: {s['seconds']:.2f} s, streamed units computing {s['compute']:.2f} s, "
            f"waiting {s['wait']:.2f} s, disk busy {s['disk']:.2f} s (idle {s['disk_idle']:.2f} s)"
        )
        return "\n".join(rows)


@contextlib.contextmanager
def timeline(model: nn.Module) -> Iterator[Timeline]:
    """Record a :class:`Timeline` of ``model``'s forwards while the ``with`` block runs.

    ``model`` must be dispatched by bigviz (``dispatch_model``, ``load_checkpoint_and_dispatch``)
    with offload units; a model all on one device has no streamed unit to time.

    Raises:
        StateError: ``model`` is not dispatched with offloaded units, or is being recorded already.
    """
    state = getattr(model, "_bigviz_dispatch", None)
    scheduler = getattr(state, "scheduler", None)
    if scheduler is None:
        raise StateError(
            "bigviz.timeline: this model has no offloaded units to time; dispatch it with modules on "
            "'cpu' (a GPU executing) or 'disk' first (bigviz.dispatch_model / load_checkpoint_and_dispatch)"
        )
    if scheduler.timeline is not None:
        raise StateError("bigviz.timeline: this model is being recorded already (one timeline at a time)")
    recording = Timeline()
    scheduler.timeline = recording
    fetcher = scheduler.fetcher
    if hasattr(fetcher, "timeline"):
        fetcher.timeline = recording
    try:
        yield recording
    finally:
        scheduler.timeline = None
        if hasattr(fetcher, "timeline"):
            fetcher.timeline = None
