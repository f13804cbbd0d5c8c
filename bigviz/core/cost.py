"""Time per forward pass of a model whose weights stream from disk: a pipeline, predicted.

Pure arithmetic, no I/O: bytes, bandwidths and seconds in, a :class:`ForwardEstimate` out.
The numbers come from elsewhere: the disk's bandwidth from
``bigviz.checkpoint.probe.measure_read_bandwidth``, the bytes from a plan (resident units
read nothing per forward, streamed units read their bytes), compute from a measurement or
from :func:`compute_seconds`.

A forward runs the model's units in execution order. A unit's weights pass through up to
three stages, each serving one unit at a time, in order:

1. **read** (streamed units only): ``read_bytes / disk_bandwidth``;
2. **copy** to the execution device (a GPU executing offloaded weights):
   ``copy_bytes / link_bandwidth``;
3. **compute**: ``compute_seconds``.

A unit starts a stage when it has left the previous one and the stage is free. Reads run
ahead of compute, but only ``depth`` streamed units ahead: the read of a streamed unit waits
until the streamed unit ``depth + 1`` places before it has finished computing (its buffer,
or its pages, are then free); resident units in between hold no buffer, so reads run on
past them. ``depth=0`` is no read-ahead: a unit is read when its turn to compute comes. So a forward takes about ``max(read, copy, compute)`` when the stages overlap,
plus what cannot overlap: the first read before any compute, the last compute after every
read. That bound, reached when reads may run ahead without limit, is the forward's **limit**
(``ForwardEstimate.limit_seconds``): where more of the model stays resident, the compute of the
whole forward (weights in RAM) sets it, not the disk. Resident weights are read once, before
the first forward (``load_seconds``).

Compute comes in as seconds (measured), or as a machine's compute rate: the bytes of weights a
forward computes through per second (:func:`weights_compute_seconds`; measured with
``bigviz.modeling.compute_rate.measure_compute_rate`` on one block in RAM, for the tokens
and threads of the run, and carried by ``MachineFacts.compute_rate``).

Reads are not always free to the compute beside them: on a virtual machine the host copies
each byte read into the guest and shares its cores and memory bandwidth with the matrix
products, so compute runs slower while the disk reads. ``read_cost`` (seconds of compute lost
per byte read, ``MachineFacts.read_cost``, measured by
``bigviz.modeling.read_cost.measure_read_cost``) adds ``read_cost x read_bytes`` to each
streamed unit's compute in the prediction. The limit stays the issue's physical one: the
compute floor measured with the disk idle, so a machine whose reads cost compute cannot reach
its limit where compute sets the pace, and the prediction says by how much.

Example:
    >>> units = [UnitCost("h.0", compute_seconds=0.5)] + [
    ...     UnitCost(f"h.{i}", read_bytes=2 * 10**9, compute_seconds=0.5) for i in range(1, 4)]
    >>> e = predict_forward(units, disk_bandwidth=2e9, resident_bytes=2 * 10**9)
    >>> e.seconds, e.read_seconds, e.compute_seconds, e.bottleneck, e.load_seconds
    (3.5, 3.0, 2.0, 'disk', 1.0)
    >>> predict_forward(units, disk_bandwidth=2e9, depth=0).seconds  # no overlap: read, compute, ...
    5.0

    Half the units resident, reads hidden under compute: the compute of the whole forward is
    the limit, and a read-ahead of one unit reaches it:

    >>> units = [UnitCost(f"h.{i}", read_bytes=10**9 if i % 2 else 0, compute_seconds=1.0) for i in range(4)]
    >>> e = predict_forward(units, disk_bandwidth=1e9, depth=1)
    >>> e.limit_seconds, e.seconds, e.bottleneck
    (4.0, 4.0, 'compute')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from bigviz.core.errors import UsageError

__all__ = [
    "UnitCost",
    "ForwardEstimate",
    "predict_forward",
    "estimate_forward",
    "compute_seconds",
    "weights_compute_seconds",
    "plan_forward",
]


@dataclass(frozen=True)
class UnitCost:
    """What one unit of a forward pass costs, in execution order.

    Attributes:
        name: The unit's module name (for explanations).
        read_bytes: Bytes read from disk for it in every forward (0: resident in RAM or on
            the execution device).
        copy_bytes: Bytes copied host-to-device for it in every forward (a GPU executing
            offloaded weights: its cpu and disk bytes; 0 when the CPU executes).
        compute_seconds: Its compute time on the execution device.

    Example:
        >>> UnitCost("h.3", read_bytes=1800 * 10**6, compute_seconds=0.3).streamed
        True
    """

    name: str
    read_bytes: int = 0
    copy_bytes: int = 0
    compute_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not (self.read_bytes < 0 or self.copy_bytes < 0 or self.compute_seconds < 0):
            return  # the Planner makes one per placement at every slider move: check cheaply first
        problems = [
            f"{field}={getattr(self, field)!r} must be >= 0"
            for field in ("read_bytes", "copy_bytes", "compute_seconds")
            if getattr(self, field) < 0
        ]
        raise UsageError(f"UnitCost {self.name!r}: " + "; ".join(problems))

    @property
    def streamed(self) -> bool:
        """True when the unit is read from disk in every forward."""
        return self.read_bytes > 0


@dataclass(frozen=True)
class ForwardEstimate:
    """A predicted forward pass.

    Attributes:
        seconds: Wall time of one forward, weights resident as planned (a later forward).
        read_seconds: Time the disk is busy with streamed units (the floor when it is the
            bottleneck).
        copy_seconds: Time the host-to-device link is busy.
        compute_seconds: Time compute is busy.
        stall_seconds: Time compute waits for weights.
        load_seconds: Reading the resident bytes once, before the first forward.
        bottleneck: The busiest stage: ``"disk"``, ``"link"`` or ``"compute"``.
        read_bytes: Bytes read from disk per forward.
        copy_bytes: Bytes copied to the execution device per forward.
        disk_bandwidth: The disk's bytes/s it was predicted with.
        link_bandwidth: The link's bytes/s (``None``: nothing crosses one).
        limit_seconds: The physical limit of this forward: the same units with reads running
            ahead without bound (every buffer free), that is ``max(disk, link, compute)`` busy
            time plus what cannot overlap (the reads before the first streamed unit can
            compute, the compute after the last read), compute at its floor (the disk idle).
            ``seconds`` above it is time the read-ahead the plan allows (its depth, its ring)
            loses, and the compute the reads take (``read_cost_seconds``); a measured forward
            is judged against this, not against the disk alone.
        read_cost_seconds: Compute lost to the reads beside it (``read_cost x read_bytes``;
            included in ``compute_seconds`` and ``seconds``, not in ``limit_seconds``).
    """

    seconds: float
    read_seconds: float
    copy_seconds: float
    compute_seconds: float
    stall_seconds: float
    load_seconds: float
    bottleneck: str
    read_bytes: int = 0
    copy_bytes: int = 0
    disk_bandwidth: float = 0.0
    link_bandwidth: float | None = None
    limit_seconds: float = 0.0
    read_cost_seconds: float = 0.0

    @property
    def streamed(self) -> bool:
        """True when weights are read or copied in every forward."""
        return bool(self.read_bytes or self.copy_bytes)

    @property
    def first_seconds(self) -> float:
        """The first forward after a cold start: the resident part read once, then a forward."""
        return self.load_seconds + self.seconds

    @property
    def overlap(self) -> float:
        """How much of the non-bottleneck work was hidden: 1 = perfectly, 0 = not at all
        (stages run one after the other).

        Example:
            >>> predict_forward([UnitCost("a", read_bytes=10, compute_seconds=1.0)],
            ...                 disk_bandwidth=10).overlap   # one unit: nothing to overlap
            0.0
        """
        busiest = max(self.read_seconds, self.copy_seconds, self.compute_seconds)
        others = self.read_seconds + self.copy_seconds + self.compute_seconds - busiest
        return 1.0 if others <= 0 else max(0.0, min(1.0, (busiest + others - self.seconds) / others))

    def explain(self) -> str:
        """One sentence a person reads (what the Planner shows).

        Example:
            >>> print(estimate_forward(resident_bytes=0, streamed_bytes=4 * 10**9, disk_bandwidth=2e9,
            ...                        compute_seconds=1.0, units=4).explain())
            2.25 s per forward: disk 2.00 s, compute 1.00 s, overlapped (the disk is the bottleneck)
        """
        parts = [f"disk {self.read_seconds:.2f} s"] if self.read_seconds else []
        if self.copy_seconds:
            parts.append(f"link {self.copy_seconds:.2f} s")
        parts.append(f"compute {self.compute_seconds:.2f} s")
        if self.read_cost_seconds:
            parts[-1] += f" ({self.read_cost_seconds:.2f} s of it taken by the reads)"
        text = f"{self.seconds:.2f} s per forward: {', '.join(parts)}"
        if self.read_seconds or self.copy_seconds:
            text += f", overlapped (the {self.bottleneck} is the bottleneck)"
        if self.limit_seconds and self.seconds > self.limit_seconds * 1.005:
            text += f"; {self.limit_seconds:.2f} s with reads ahead without bound (the limit)"
        if self.load_seconds:
            text += f"; {self.load_seconds:.2f} s more before the first, to read the resident weights"
        return text


def predict_forward(
    units: Sequence[UnitCost],
    *,
    disk_bandwidth: float,
    link_bandwidth: float | None = None,
    depth: int = 2,
    resident_bytes: int = 0,
    ring: int | None = None,
    read_cost: float = 0.0,
) -> ForwardEstimate:
    """Predict one forward pass over ``units`` (in execution order) as a three-stage pipeline.

    Linear in the number of units. See the module docstring for the model.

    Args:
        units: Every unit the forward runs, in execution order.
        disk_bandwidth: Bytes per second the disk reads (cold, with the fetcher's readers).
        link_bandwidth: Bytes per second host-to-device (required when a unit copies bytes).
        depth: Streamed units read ahead of the one computing (0: no read-ahead).
        resident_bytes: Bytes read once before the first forward (the resident part).
        ring: Bytes of the buffer streamed units are read into (CPU streaming: the engine's
            ring, :func:`~bigviz.core.stream_plan.ring_bytes`). When given, it bounds the read-ahead instead of
            ``depth``: the reads run on while the bytes read and not yet freed (a unit's are
            freed when it has computed) fit in the ring, byte by byte.
        read_cost: Seconds of compute lost per byte read beside it (``MachineFacts.read_cost``):
            each streamed unit's compute grows by ``read_cost x read_bytes`` in the prediction,
            not in the limit.

    Raises:
        ValueError: a bandwidth is missing or not positive, ``depth`` or ``read_cost`` negative.

    Example:
        >>> units = [UnitCost(f"h.{i}", read_bytes=10**9, compute_seconds=0.8) for i in range(3)]
        >>> ring = predict_forward(units, disk_bandwidth=1e9, ring=int(1.5e9))  # half a unit read while one computes
        >>> round(ring.seconds, 2), round(ring.stall_seconds, 2), predict_forward(units, disk_bandwidth=1e9).seconds
        (4.4, 2.0, 3.8)

        Compute-bound, on a machine whose reads take 0.1 s of compute per GB: the prediction
        grows by what the reads take, the limit does not:

        >>> units = [UnitCost(f"h.{i}", read_bytes=10**9 if i % 2 else 0, compute_seconds=1.0) for i in range(4)]
        >>> e = predict_forward(units, disk_bandwidth=2e9, depth=1, read_cost=0.1e-9)
        >>> round(e.seconds, 2), e.limit_seconds, round(e.read_cost_seconds, 2)
        (4.2, 4.0, 0.2)
    """
    _check(units, disk_bandwidth=disk_bandwidth, link_bandwidth=link_bandwidth, depth=depth)
    if ring is not None and ring <= 0:
        raise UsageError(f"ring={ring!r} must be > 0 bytes")
    if not read_cost >= 0:
        raise UsageError(f"read_cost={read_cost!r} must be >= 0 seconds per byte (measure_read_cost)")
    limit, _ = _simulate(units, disk_bandwidth, link_bandwidth, depth=len(units), ring=None)
    taken = sum(u.read_bytes for u in units) * read_cost
    if taken:
        units = [
            UnitCost(u.name, u.read_bytes, u.copy_bytes, u.compute_seconds + u.read_bytes * read_cost) for u in units
        ]
    compute_end, stall = _simulate(units, disk_bandwidth, link_bandwidth, depth=depth, ring=ring)
    busy = _busy(units, disk_bandwidth, link_bandwidth)
    return ForwardEstimate(
        seconds=compute_end,
        read_seconds=busy["disk"],
        copy_seconds=busy["link"],
        compute_seconds=busy["compute"],
        stall_seconds=stall,
        load_seconds=resident_bytes / disk_bandwidth,
        bottleneck=max(("disk", "link", "compute"), key=lambda k: busy[k]),
        read_bytes=sum(u.read_bytes for u in units),
        copy_bytes=sum(u.copy_bytes for u in units),
        disk_bandwidth=disk_bandwidth,
        link_bandwidth=link_bandwidth,
        limit_seconds=min(limit, compute_end),
        read_cost_seconds=taken,
    )


def _simulate(
    units: Sequence[UnitCost], disk: float, link: float | None, *, depth: int, ring: int | None
) -> tuple[float, float]:
    """(when the last unit has computed, seconds compute waited) of one forward through the
    three stages, reads ``depth`` streamed units (or a ``ring``'s bytes) ahead."""
    read_free = copy_free = compute_end = stall = 0.0
    streamed_ends: list[float] = []  # when each streamed unit finished computing
    streamed_bytes: list[int] = []
    gate = _RingGate(ring, streamed_ends, streamed_bytes) if ring is not None else None
    for unit in units:
        ready = 0.0
        if unit.streamed and gate is not None:
            read_free = ready = gate.read(read_free, unit.read_bytes, disk)
        elif unit.streamed:
            at = len(streamed_ends) - depth - 1
            freed = streamed_ends[at] if at >= 0 else 0.0
            start = max(read_free, compute_end if depth == 0 else freed)  # depth 0: read on demand
            read_free = ready = start + unit.read_bytes / disk
        if unit.copy_bytes:
            copy_free = ready = max(copy_free, ready) + unit.copy_bytes / link  # type: ignore[operator]
        start = max(compute_end, ready)
        stall += start - compute_end
        compute_end = start + unit.compute_seconds
        if unit.streamed:
            streamed_ends.append(compute_end)
            streamed_bytes.append(unit.read_bytes)
    return compute_end, stall


def estimate_forward(
    *,
    resident_bytes: int,
    streamed_bytes: int,
    disk_bandwidth: float,
    compute_seconds: float,
    units: int = 1,
    resident_units: int = 0,
    depth: int = 2,
    copied_bytes: int = 0,
    link_bandwidth: float | None = None,
) -> ForwardEstimate:
    """:func:`predict_forward` from a plan's totals: ``units`` equal streamed units after
    ``resident_units`` equal resident ones (a planner fills RAM first, in execution order),
    compute spread over all of them in proportion to their bytes.

    Args:
        resident_bytes: Bytes kept in RAM (or on the execution device).
        streamed_bytes: Bytes read from disk in every forward.
        disk_bandwidth: Bytes per second the disk reads.
        compute_seconds: Compute of the whole forward.
        units: How many units the streamed bytes are in (read-ahead works per unit).
        resident_units: How many units the resident bytes are in (0: one, if any bytes).
        depth: Streamed units read ahead.
        copied_bytes: Bytes copied host-to-device per forward (GPU execution).
        link_bandwidth: Host-to-device bytes per second.

    Example:
        >>> e = estimate_forward(resident_bytes=16 * 10**9, streamed_bytes=14 * 10**9, disk_bandwidth=2e9,
        ...                      compute_seconds=6.0, units=8, resident_units=8)
        >>> round(e.seconds, 2), e.bottleneck, e.load_seconds
        (8.28, 'disk', 8.0)
        >>> round(estimate_forward(resident_bytes=16 * 10**9, streamed_bytes=14 * 10**9, disk_bandwidth=2e9,
        ...                        compute_seconds=6.0, units=8, resident_units=8, depth=8).seconds, 2)
        7.35

        With two units read ahead the disk idles while the resident part computes; with all
        eight read ahead (8 x 1.75 GB of buffers) it never does: 7.0 s of reads + 0.35 s.
    """
    total = resident_bytes + streamed_bytes
    n_resident = resident_units or (1 if resident_bytes else 0)
    n_streamed = max(1, units) if streamed_bytes else 0
    steps = [
        UnitCost(f"resident {i}", compute_seconds=_share(compute_seconds, resident_bytes / n_resident, total))
        for i in range(n_resident)
    ]
    per_unit = streamed_bytes // n_streamed if n_streamed else 0
    copy = copied_bytes // (n_resident + n_streamed) if copied_bytes else 0
    steps += [
        UnitCost(f"streamed {i}", read_bytes=per_unit, compute_seconds=_share(compute_seconds, per_unit, total))
        for i in range(n_streamed)
    ]
    if copy:
        steps = [UnitCost(s.name, s.read_bytes, copy, s.compute_seconds) for s in steps]
    if not steps:
        steps = [UnitCost("model", compute_seconds=compute_seconds)]
    return predict_forward(
        steps, disk_bandwidth=disk_bandwidth, link_bandwidth=link_bandwidth, depth=depth, resident_bytes=resident_bytes
    )


def compute_seconds(parameters: int, tokens: int, *, flops_per_second: float) -> float:
    """Seconds of a forward's matrix products: ``2 x parameters x tokens`` FLOPs (attention
    over the context is left out: small for short contexts).

    Example:
        >>> compute_seconds(7 * 10**9, 16, flops_per_second=100e9)
        2.24
    """
    if flops_per_second <= 0:
        raise UsageError(f"flops_per_second={flops_per_second!r} must be > 0 (measure it: one block's forward)")
    return 2 * parameters * tokens / flops_per_second


def weights_compute_seconds(nbytes: int, *, compute_rate: float) -> float:
    """Seconds a forward computes through ``nbytes`` of weights at ``compute_rate`` bytes/s (a
    machine's rate, measured on one block in RAM for the tokens and threads of the run:
    ``MachineFacts.compute_rate``).

    Example:
        >>> weights_compute_seconds(18 * 10**9, compute_rate=1.8e9 / 1.07)  # 1.07 s per 1.8 GB block
        10.7
    """
    if not compute_rate or compute_rate <= 0:
        raise UsageError(
            f"compute_rate={compute_rate!r} must be > 0 bytes/s (measure it: "
            "bigviz.modeling.compute_rate.measure_compute_rate on one block in RAM)"
        )
    return round(nbytes / compute_rate, 9)


def plan_forward(
    placements: Sequence[tuple[str, str, int]],
    *,
    disk_bandwidth: float,
    compute_seconds: float = 0.0,
    link_bandwidth: float | None = None,
    main_device: str = "cpu",
    depth: int = 2,
    ring: int | None = None,
    rereads: bool = True,
    read_cost: float = 0.0,
) -> ForwardEstimate:
    """:func:`predict_forward` for a plan's placements ``(name, device, bytes)`` in execution
    order: disk units are read per forward (``rereads``; else the page cache keeps them: read
    once, before the first forward), "cpu" ones are resident (read once, before the first
    forward) unless a GPU executes (then they cross the link), compute is spread over the units
    in proportion to their bytes. Read-ahead as the stream plan says
    (:class:`~bigviz.core.stream_plan.StreamPlan`): ``depth`` units, or the bytes of a ``ring``;
    ``read_cost`` as for :func:`predict_forward`.

    Example:
        >>> rows = [("h.0", "cpu", 4 * 10**9), ("h.1", "disk", 2 * 10**9), ("h.2", "disk", 2 * 10**9)]
        >>> e = plan_forward(rows, disk_bandwidth=2e9, compute_seconds=0.8, ring=3 * 10**9)
        >>> round(e.seconds, 2), e.bottleneck, e.load_seconds
        (2.2, 'disk', 2.0)
    """
    total = sum(n for _, _, n in placements) or 1
    gpu = main_device != "cpu"
    units = []
    for name, device, nbytes in placements:
        read = nbytes if device == "disk" and rereads else 0
        copy = nbytes if gpu and device in ("cpu", "disk") else 0
        compute = compute_seconds * nbytes / total
        if read or copy or compute != 0:  # one that reads, copies and computes nothing moves no stage on
            units.append(UnitCost(name, read_bytes=read, copy_bytes=copy, compute_seconds=compute))
    once = ("cpu",) if rereads else ("cpu", "disk")
    resident = sum(n for _, d, n in placements if d in once)
    streams = any(u.read_bytes for u in units)
    return predict_forward(
        units or [UnitCost("model")],
        disk_bandwidth=disk_bandwidth,
        link_bandwidth=link_bandwidth,
        depth=depth,
        resident_bytes=resident,
        ring=ring if streams else None,
        read_cost=read_cost,
    )


class _RingGate:
    """The reader of a ring: its position in the stream of streamed bytes may run at most
    ``ring`` bytes past those freed (by units done computing, at ``ends``)."""

    def __init__(self, ring: int, ends: list[float], sizes: list[int]) -> None:
        self.ring, self.ends, self.sizes = ring, ends, sizes
        self.pos = self.freed = 0  # bytes read, bytes freed
        self.done = 0  # units whose bytes are freed

    def read(self, now: float, nbytes: int, bandwidth: float) -> float:
        """When a unit of ``nbytes``, read from ``now`` on, is all read."""
        end = self.pos + nbytes
        while self.pos < end:
            while self.done < len(self.ends) and self.ends[self.done] <= now:
                self._free()
            upto = min(end, self.freed + self.ring)
            if upto > self.pos:
                now += (upto - self.pos) / bandwidth
                self.pos = upto
            elif self.done < len(self.ends):
                now = max(now, self.ends[self.done])
                self._free()
            else:  # larger than the ring: the engine reads the rest into a buffer of its own
                now += (end - self.pos) / bandwidth
                self.pos = end
        return now

    def _free(self) -> None:
        self.freed += self.sizes[self.done]
        self.done += 1


def _share(seconds: float, nbytes: float, total: int) -> float:
    return seconds * nbytes / total if total else 0.0


def _busy(units: Sequence[UnitCost], disk: float, link: float | None) -> dict[str, float]:
    return {
        "disk": sum(u.read_bytes for u in units) / disk,
        "link": sum(u.copy_bytes for u in units) / link if link else 0.0,
        "compute": sum(u.compute_seconds for u in units),
    }


def _check(units: Sequence[UnitCost], *, disk_bandwidth: float, link_bandwidth: float | None, depth: int) -> None:
    problems = []
    if not disk_bandwidth or disk_bandwidth <= 0:
        problems.append(f"disk_bandwidth={disk_bandwidth!r} must be > 0 bytes/s (measure_read_bandwidth)")
    copying = [u.name for u in units if u.copy_bytes]
    if copying and (link_bandwidth is None or link_bandwidth <= 0):
        problems.append(f"units {copying[:3]} copy bytes to the device: give link_bandwidth > 0 bytes/s")
    if not isinstance(depth, int) or depth < 0:
        problems.append(f"depth={depth!r} must be an int >= 0 (streamed units read ahead)")
    if problems:
        raise UsageError("predict_forward: " + "; ".join(problems))
