"""The stream plan: how each unit of a dispatch lives at run time, decided before anything moves.

The last decision of the chain of plans (``DevicePlan`` -> ``LoadPlan`` -> ``DispatchPlan``):
whether the weights kept in RAM stay memory-mapped (zero copy: the page cache holds them) or
are copied once into process memory (a model larger than RAM: the units streamed through the
page cache would evict them), which fetcher brings the streamed units in, how large its ring
is, and how many units it reads ahead. One pure function, :func:`make_stream_plan`, makes it
from the dispatch's units and the machine's facts (:class:`MachineFacts`: available RAM, disk
bandwidth), passed in as data. The planner's default "cpu" budget (:func:`resident_room`),
``DevicePlan.cost()`` and the engine all read it: the engine only executes it.

The rule, for the CPU executing (a GPU executing streams its cpu and disk units through
pinned staging buffers: :data:`FETCHERS` ``"cuda"``):

* the model fits in RAM (its resident and streamed bytes within :data:`RAM_SHARE` of the
  available RAM): everything stays memory-mapped; disk units are paged in one unit ahead
  and the page cache keeps them (``"cpu"`` fetcher);
* it does not: the resident part is copied into process memory and the disk units stream
  through a ring of ``1 + RING_AHEAD`` times the largest unit (less, down to
  ``1 + RING_AHEAD_LEAST``, where the RAM beside the resident part has no room for it),
  ``O_DIRECT`` (``stream="ring"``), or through the page cache, dropped after use (``stream="cache"``);
* the resident part and the ring do not fit in RAM either (a "cpu" budget larger than the
  machine's memory): copying would take the whole model into process memory, so ``"auto"``
  keeps it mapped (pages read again as needed) and ``resident="copy"`` is refused, naming the
  bytes and the RAM, before anything is read.

Example:
    >>> units = [(f"h.{i}", "disk", 100) for i in range(4)]  # (unit, storage, bytes), in fetch order
    >>> plan = make_stream_plan(units, {"h.4": 300}, "cpu", MachineFacts(available_ram=700))
    >>> plan.mode, plan.fetcher, plan.ring_bytes, plan.depth
    ('copy', 'ring', 200, 2)
    >>> print(plan.summary())
    300 B copied into RAM once, 4 disk units streamed by the ring fetcher (O_DIRECT into one ring of 200 B, 2 units ahead, 4 readers)
      why: the model (700 B) does not fit in 90% of the available RAM (630 B): the resident part is copied into process memory, disk units are streamed, never kept; disk units read ahead into a ring of 200 B

    Less RAM beside the resident part: the ring shrinks to what fits (1.5 units here):

    >>> make_stream_plan(units, {"h.4": 300}, "cpu", MachineFacts(available_ram=500)).ring_bytes
    150
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bigviz.core.devices import Device, device_label, normalize_device
from bigviz.core.errors import PlanError
from bigviz.core.sizes import format_size

__all__ = [
    "RAM_SHARE",
    "DEFAULT_DEPTH",
    "RING_AHEAD",
    "RING_AHEAD_LEAST",
    "RESIDENCY_MODES",
    "STREAMS",
    "FETCHERS",
    "MachineFacts",
    "StreamOptions",
    "UnitStream",
    "StreamPlan",
    "make_stream_plan",
    "ring_bytes",
    "resident_room",
    "check_stream_options",
]

RAM_SHARE = 0.9
"""Of the available RAM, what a model may count on (transformers keeps 10% for everything
else; the page cache cannot be expected to keep more)."""
DEFAULT_DEPTH = 2  # streamed units read ahead of the running one, by a ring or through the page cache
RING_AHEAD = 1.0
"""The ring holds the largest unit and this share of one more. A unit's tensors are placed whole
and in order, so a ring of 1.5 units left the next unit only the fragments beside the running
one (a third of a GPT block: 604 MB tensors against 0.9 GB split at the ring's end) and its
reads waited for the compute (issue 26: a 50.2 GB GPT's later forwards, same hour, alternated:
all-disk 32.0-33.6 s with 1.5 units, 23.9-28.1 s with 2; at 2/3 of the RAM 20.7-22.6 s and
18.4-19.9 s). With two units the next one is read whole while the one before computes."""
RING_AHEAD_LEAST = 0.5
"""Where the RAM beside the resident part holds less than two units, the ring shrinks to what
fits, down to this share of one more unit (below it the resident part stays mapped)."""
MAPPED_DEPTH = 1  # the zero-copy and GPU fetchers: the next unit, while the current one computes
STREAM_MARGIN = 2**30  # RAM kept for everything else when page-cache streaming sizes its read-ahead
RESIDENCY_MODES = ("auto", "copy", "map")
STREAMS = ("ring", "cache")
FETCHERS = {
    "cpu": "zero-copy views of the memory-mapped files, paged in one unit ahead",
    "cuda": "copies to the GPU on a side stream, through pinned staging buffers",
    "ring": "O_DIRECT reads into one ring made once",
    "cache": "read into the page cache ahead, dropped after use",
}
"""Fetcher kind -> what it does (``bigviz.engine.fetchers`` has one class per kind)."""


@dataclass(frozen=True)
class MachineFacts:
    """What the machine running a dispatch offers, measured by the caller (``bigviz`` measures
    them with ``bigviz.modeling.budgets.machine_facts``) or given by hand for a machine you do
    not have.

    Attributes:
        available_ram: Bytes of RAM available now (``psutil.virtual_memory().available``).
        disk_bandwidth: Cold read bytes/s of the disk holding the checkpoint, if measured
            (``bigviz.checkpoint.probe.measure_read_bandwidth``): ``cost()`` uses it.
        compute_rate: Bytes of weights a forward computes through per second, with every
            weight in RAM, for the tokens and threads of the run (one block's bytes / its
            forward's seconds: ``bigviz.modeling.compute_rate.measure_compute_rate``):
            ``cost()`` counts the compute of the whole forward with it (the limit of a
            streamed forward is the longer of its reads and this compute).
        read_cost: Seconds of compute lost per byte the disk reads beside it (a virtual
            machine's host copies each byte in on the cores that compute:
            ``bigviz.modeling.read_cost.measure_read_cost``); ``cost()`` adds it to the
            compute of each streamed unit in its prediction, not to the limit. 0: reads cost
            compute nothing.
    """

    available_ram: int
    disk_bandwidth: float | None = None
    compute_rate: float | None = None
    read_cost: float = 0.0

    @property
    def room(self) -> int:
        """Bytes of RAM a model may count on (:data:`RAM_SHARE` of the available RAM)."""
        return int(self.available_ram * RAM_SHARE)


@dataclass(frozen=True)
class StreamOptions:
    """What a user may ask of the stream plan.

    Attributes:
        resident: ``"auto"`` (copy the resident weights into RAM only when the model does not
            fit), ``"copy"`` or ``"map"`` (force either).
        stream: ``"ring"`` (``O_DIRECT`` into one reused ring) or ``"cache"`` (through the
            page cache, dropped after use): how the CPU streams disk units once copied.
        readers: Threads reading for the copy and for streaming.
        prefetch: Fetch the next unit while the current one computes (0 read ahead without).
    """

    resident: str = "auto"
    stream: str = "ring"
    readers: int = 4
    prefetch: bool = True


def check_stream_options(options: StreamOptions) -> None:
    """Raise a `PlanError` naming every knob out of range, with the choices.

    Example:
        >>> check_stream_options(StreamOptions())
    """
    problems = []
    if options.resident not in RESIDENCY_MODES:
        problems.append(
            f"resident={options.resident!r}: use one of {', '.join(map(repr, RESIDENCY_MODES))} "
            "('auto': copy the resident weights into RAM only when the model does not fit)"
        )
    if options.stream not in STREAMS:
        problems.append(
            f"stream={options.stream!r}: expected 'ring' (one reused O_DIRECT buffer) or 'cache' (page cache)"
        )
    if isinstance(options.readers, bool) or not isinstance(options.readers, int) or options.readers < 1:
        problems.append(f"readers={options.readers!r}: give an int >= 1 (threads reading)")
    PlanError.check(problems, "cannot plan the streaming")


@dataclass(frozen=True)
class UnitStream:
    """How one unit lives at run time.

    Attributes:
        name: The offload unit (the module its fetch is hooked on), or the device-map entry
            of resident weights.
        storage: Where its bytes come from: ``"cpu"``, ``"disk"``, or a computing device.
        residency: ``"mapped"`` (zero-copy memory maps, kept by the page cache),
            ``"resident copy"`` (read once into process memory), ``"streamed"`` (fetched for
            each forward) or ``"on device"`` (resident on a GPU or mps).
        fetcher: For a streamed unit, the fetcher kind (:data:`FETCHERS`); else ``""``.
        nbytes: Its bytes.
        rereads: A streamed unit read again from disk in every forward (``False``: the page
            cache keeps it, or it streams from pinned RAM). A memory-mapped disk unit of a
            model larger than the RAM is read again too: the page cache cannot keep it.
    """

    name: str
    storage: str
    residency: str
    fetcher: str
    nbytes: int
    rereads: bool = False


@dataclass(frozen=True)
class StreamPlan:
    """How a dispatch keeps and streams its weights (see the module docstring).

    Attributes:
        mode: ``"map"`` (memory-mapped weights stay mapped) or ``"copy"`` (copied into
            process memory once, before the first forward).
        fetcher: The fetcher kind of the streamed units (:data:`FETCHERS`; ``""``: none).
        depth: Units read ahead of the running one (0: no prefetch).
        ring_bytes: Bytes of the ring (``"ring"`` only; the engine rounds it up to whole
            blocks of its reads).
        ring_ahead: The share of one more unit the ring holds beside the largest
            (:data:`RING_AHEAD`, less where the RAM has no room for it).
        readers: Threads reading.
        resident_bytes: Bytes kept in RAM ("cpu" weights while the CPU executes).
        streamed_bytes: Bytes fetched per forward.
        available: Available RAM the plan was made for (0: unknown).
        reason: Why this mode.
        units: Each unit's residency and streaming, resident groups first, then the
            streamed units in fetch order.
    """

    mode: str
    fetcher: str
    depth: int
    ring_bytes: int
    readers: int
    resident_bytes: int
    streamed_bytes: int
    available: int
    reason: str
    units: tuple[UnitStream, ...] = ()
    ring_ahead: float = RING_AHEAD

    @property
    def fetch_ahead(self) -> int:
        """Units fetched before the first forward (their reads overlap the resident part's
        compute): the read-ahead of a copy's streaming fetcher, else none."""
        return self.depth if self.mode == "copy" and self.fetcher in STREAMS else 0

    def unit(self, name: str) -> UnitStream:
        """The unit (or resident entry) called ``name``."""
        for unit in self.units:
            if unit.name == name:
                return unit
        raise KeyError(f"the stream plan has no unit {name!r}: {', '.join(u.name for u in self.units[:8])}")

    def summary(self) -> str:
        """A line a person reads (what ``bigviz.dispatch_plan`` prints), and why."""
        parts = []
        if self.resident_bytes:
            kept = "copied into RAM once" if self.mode == "copy" else "kept in RAM as loaded (zero copy)"
            parts.append(f"{format_size(self.resident_bytes)} {kept}")
        streamed = [u for u in self.units if u.residency == "streamed"]
        if streamed:
            storages = sorted({u.storage for u in streamed})
            how = FETCHERS[self.fetcher]
            if self.fetcher == "ring":
                how = f"O_DIRECT into one ring of {format_size(self.ring_bytes)}"
            ahead = f"{self.depth} unit{'s' if self.depth != 1 else ''} ahead" if self.depth else "no read-ahead"
            parts.append(
                f"{len(streamed)} {'/'.join(storages)} unit{'s' if len(streamed) != 1 else ''} streamed by the "
                f"{self.fetcher} fetcher ({how}, {ahead}"
                + (f", {self.readers} readers)" if self.fetcher in STREAMS else ")")
            )
        head = ", ".join(parts) if parts else "nothing kept in RAM, nothing streamed"
        return f"{head}\n  why: {self.reason}"

    def rows(self) -> list[dict[str, Any]]:
        """One dict per unit: unit, storage, residency, fetcher, bytes."""
        return [
            {
                "unit": u.name or "<model>",
                "storage": u.storage,
                "residency": u.residency,
                "fetcher": u.fetcher,
                "bytes": u.nbytes,
                "rereads": u.rereads,
            }
            for u in self.units
        ]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data."""
        return {
            "mode": self.mode,
            "fetcher": self.fetcher,
            "depth": self.depth,
            "ring_bytes": self.ring_bytes,
            "ring_ahead": self.ring_ahead,
            "readers": self.readers,
            "resident_bytes": self.resident_bytes,
            "streamed_bytes": self.streamed_bytes,
            "available": self.available,
            "reason": self.reason,
            "units": self.rows(),
        }


def ring_bytes(largest_unit: int, ahead: float = RING_AHEAD) -> int:
    """Bytes of the ring the CPU streams disk units through: the running unit and ``ahead``
    of the next (``bigviz.engine.fetchers.ring.ring_capacity`` adds the alignment of its reads).

    Example:
        >>> ring_bytes(2 * 10**9), ring_bytes(2 * 10**9, 0.5)
        (4000000000, 3000000000)
    """
    return int(largest_unit * (1 + ahead))


def resident_room(facts: MachineFacts, *, model_bytes: int, largest_unit: int, ahead: float = RING_AHEAD) -> int:
    """The default "cpu" budget (resident bytes) on a machine: all of its room when the whole
    model fits (it stays memory-mapped), else its room less the ring the streamed units pass
    through (the resident part is copied, the ring sits beside it). The ring of ``ahead``
    (two units) is kept only where it leaves the resident part at least its own size; else the
    least ring (:data:`RING_AHEAD_LEAST`): a ring taking most of the RAM would leave nothing
    resident, nor room for the run. The stream plan sizes its ring by the room the budget
    leaves, so a model planned with this budget streams as planned.

    Example:
        >>> facts = MachineFacts(available_ram=1000)  # room: 900 bytes
        >>> resident_room(facts, model_bytes=800, largest_unit=100), resident_room(facts, model_bytes=1500, largest_unit=100)
        (900, 700)
        >>> resident_room(facts, model_bytes=1500, largest_unit=300)  # two units would take 600 of 900: 1.5 kept
        450
    """
    if _fits(model_bytes, facts):
        return facts.room
    ring = ring_bytes(largest_unit, ahead)
    if facts.room - ring < ring:
        ring = ring_bytes(largest_unit, min(ahead, RING_AHEAD_LEAST))
    return max(0, facts.room - ring)


def _lower_budget(room: int, ring: int, why: str) -> str:
    """What to lower the 'cpu' budget to so a resident copy fits beside the ring, or, when the
    ring alone fills the room, that no budget does.

    Example:
        >>> _lower_budget(10 * 2**30, 2**30, "to copy it")
        "lower the 'cpu' budget (max_memory={'cpu': ...}) below 9.0 GiB to copy it"
        >>> _lower_budget(2**30, 2**31, "to copy it")[:57]
        'no cpu budget helps: the ring alone (2.0 GiB) needs more '
    """
    if room > ring:
        return f"lower the 'cpu' budget (max_memory={{'cpu': ...}}) below {format_size(room - ring)} {why}"
    return (
        f"no cpu budget helps: the ring alone ({format_size(ring)}) needs more than the room ({format_size(room)}); "
        "keep blocks smaller (no_split_module_classes) or free RAM"
    )


def _fits(total: int, facts: MachineFacts) -> bool:
    """The one test of "the model fits in RAM" (the planner's and the engine's)."""
    return total <= facts.room


Unit = tuple[str, str, int]
"""An offload unit as the stream plan sees it: ``(name, storage, bytes)``."""


def make_stream_plan(
    units: Sequence[Unit],
    resident: Mapping[str, int],
    main_device: object,
    facts: MachineFacts | None,
    options: StreamOptions = StreamOptions(),
    *,
    resident_devices: Mapping[str, Device] | None = None,
) -> StreamPlan:
    """How each unit of a dispatch lives at run time (pure; see the module docstring).

    Args:
        units: The offload units ``(name, storage, bytes)``, in fetch order (``DispatchPlan.units``).
        resident: Resident weights: device-map entry -> bytes kept on the device the entry
            names (``resident_devices``; default "cpu").
        main_device: The execution device.
        facts: The machine's facts (``None``: planned for the budgets, so a plan with disk
            units streams them: its model does not fit the "cpu" budget).
        options: What the user asked for.
        resident_devices: entry -> device of ``resident`` (default: every entry on "cpu").

    Raises:
        PlanError: a knob out of range, or ``resident="copy"`` for a resident part that with
            its ring does not fit in the available RAM (named, with the bytes).
    """
    check_stream_options(options)
    devices = dict(resident_devices or {})
    in_ram = sum(b for entry, b in resident.items() if devices.get(entry, "cpu") == "cpu")
    how = _decide(units, in_ram, normalize_device(main_device), facts, options)
    rows = [_resident_row(entry, nbytes, devices.get(entry, "cpu"), how.mode) for entry, nbytes in resident.items()]
    rows += [
        UnitStream(
            name,
            storage,
            "streamed",
            how.fetcher,
            nbytes,
            how.fetcher in STREAMS or _staged(storage, how) or (how.rereads and storage == "disk"),
        )
        for name, storage, nbytes in units
    ]
    return StreamPlan(
        how.mode,
        how.fetcher if units else "",
        how.depth if units else 0,
        how.ring,
        options.readers,
        in_ram,
        sum(n for _, _, n in units),
        facts.available_ram if facts is not None else 0,
        how.reason,
        tuple(rows),
        how.ahead,
    )


@dataclass(frozen=True)
class _How:
    """What :func:`_decide` decided for the whole dispatch."""

    mode: str
    fetcher: str
    depth: int
    ring: int
    reason: str
    ahead: float = RING_AHEAD
    rereads: bool = False  # memory-mapped disk units read again each forward: the page cache cannot keep them


def _ring_ahead(largest: int, in_ram: int, facts: MachineFacts | None) -> float:
    """How much of one more unit the ring holds: :data:`RING_AHEAD`, or what the RAM beside the
    resident part has room for, down to :data:`RING_AHEAD_LEAST` (a ring that does not fit
    even then is the residency rule's to refuse)."""
    if facts is None or largest <= 0:
        return RING_AHEAD
    fits = (facts.room - in_ram) / largest - 1
    return max(RING_AHEAD_LEAST, min(RING_AHEAD, fits))


def _decide(
    units: Sequence[Unit], in_ram: int, main: Device, facts: MachineFacts | None, options: StreamOptions
) -> _How:
    """The rule of the module docstring: the mode of the weights kept in RAM, the fetcher of
    the streamed units, how far ahead it reads, the ring."""
    depth = MAPPED_DEPTH if options.prefetch else 0
    if main != "cpu":  # a GPU (or mps) executes: cpu and disk units cross the link
        reason = (
            f"{device_label(main)} executes: cpu units stream from pinned RAM, disk units through "
            "pinned staging (the page cache keeps them as RAM allows)"
        )
        return _How("map", "cuda" if isinstance(main, int) else "cpu", depth, 0, reason)
    disk = [n for _, storage, n in units if storage == "disk"]
    largest = max(disk, default=0)
    ahead = _ring_ahead(largest, in_ram, facts)
    ring = ring_bytes(largest, ahead) if disk and options.stream == "ring" else 0
    mode, reason = _residency(options.resident, in_ram, in_ram + sum(disk), ring, facts)
    if mode == "map" or not disk:  # mapped: the page cache keeps the disk units only where the model fits
        rereads = bool(disk) and facts is not None and not _fits(in_ram + sum(disk), facts)
        return _How(mode, "cpu", depth, 0, reason, rereads=rereads)
    if options.stream == "ring":
        depth = DEFAULT_DEPTH if options.prefetch else 0  # the ring bounds what is read ahead
        return _How(
            "copy", "ring", depth, ring, f"{reason}; disk units read ahead into a ring of {format_size(ring)}", ahead
        )
    if options.prefetch:  # through the page cache: as many units as the RAM left holds
        left = (facts.available_ram - in_ram) if facts is not None else 0
        depth = max(1, min(DEFAULT_DEPTH, (left - STREAM_MARGIN) // max(1, largest) - 1))
    return _How("copy", "cache", depth, 0, f"{reason}; {depth} unit(s) read ahead")


def _resident_row(entry: str, nbytes: int, device: Device, mode: str) -> UnitStream:
    kept = "on device" if device != "cpu" else ("resident copy" if mode == "copy" else "mapped")
    return UnitStream(entry, str(device), kept, "", nbytes)


def _staged(storage: str, how: _How) -> bool:
    """A disk unit staged to a GPU is read again in every forward (as RAM allows, the page
    cache keeps it; the cost model does not count on that)."""
    return storage == "disk" and how.fetcher == "cuda"


def _residency(requested: str, in_ram: int, total: int, ring: int, facts: MachineFacts | None) -> tuple[str, str]:
    """``(mode, reason)`` of the weights kept in RAM (the CPU executing)."""
    if facts is None:  # planned for its budgets: disk units mean the model does not fit the "cpu" one
        if requested == "map" or (requested == "auto" and total <= in_ram):
            return "map", "zero-copy memory maps" + (" (resident='map' asked for)" if requested == "map" else "")
        return "copy", (
            "the model does not fit its 'cpu' budget (no machine facts given: the budgets are the machine): "
            "the resident part is kept in process memory, disk units are streamed, never kept"
        )
    room = facts.room
    over = in_ram + ring > room
    over_text = (
        f"the resident part ({format_size(in_ram)}) and the ring ({format_size(ring)}) do not fit in "
        f"{RAM_SHARE:.0%} of the available RAM ({format_size(room)} of {format_size(facts.available_ram)})"
    )
    if requested == "copy" and over and in_ram:
        raise PlanError(
            f"resident='copy' refused: {over_text}",
            fix=f"Fix: {_lower_budget(room, ring, 'so the rest streams from disk')}, or pass resident='map'.",
        )
    if requested != "auto":
        return requested, f"resident={requested!r} asked for"
    if _fits(total, facts):
        return "map", (
            f"the model ({format_size(total)}) fits in {RAM_SHARE:.0%} of the available RAM "
            f"({format_size(room)}): zero-copy memory maps"
        )
    if over:
        return "map", (
            f"{over_text}: copying it would take more than the machine's memory, so it stays memory-mapped "
            f"(pages read again as needed); {_lower_budget(room, ring, 'to copy the resident part and stream the rest')}"
        )
    return "copy", (
        f"the model ({format_size(total)}) does not fit in {RAM_SHARE:.0%} of the available RAM "
        f"({format_size(room)}): the resident part is copied into process memory, disk units are "
        "streamed, never kept"
    )
