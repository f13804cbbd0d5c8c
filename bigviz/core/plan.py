"""A device plan as data: where each module goes, how many bytes, and why.

``make_plan`` (in ``bigviz.core.planner``) makes a :class:`DevicePlan` from a
:class:`~bigviz.core.tree.SizeTree` and byte budgets; nothing here allocates or imports
torch. A plan is frozen: to change it, plan again (with ``overrides``).

Example:
    >>> from bigviz.core.tree import SizeTree, TensorSpec
    >>> from bigviz.core.planner import make_plan
    >>> tree = SizeTree.build([TensorSpec(f"h.{i}.weight", 250, "float32") for i in range(4)])
    >>> p = make_plan(tree, {0: 3000, "cpu": 10**6})
    >>> p.device_map  # GPU 0 keeps room for two streamed-in layers (current + prefetched)
    {'h.0': 0, 'h.1': 'cpu', 'h.2': 'cpu', 'h.3': 'cpu'}
"""

from __future__ import annotations

import html
import json
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from bigviz.core.cost import ForwardEstimate, plan_forward, weights_compute_seconds
from bigviz.core.devicemap import clean_device_map, device_of
from bigviz.core.devices import Device, device_label, streamed_devices
from bigviz.core.hardware import DISK_BANDWIDTH, LINK_BANDWIDTH, find_bandwidth
from bigviz.core.names import owner
from bigviz.core.offload_units import UnitRule, unit_table
from bigviz.core.sizes import format_count, format_size
from bigviz.core.stream_plan import MachineFacts, StreamOptions, StreamPlan, make_stream_plan
from bigviz.core.errors import UsageError

if TYPE_CHECKING:
    import pandas as pd

    from bigviz.core.dispatch_plan import DispatchPlan
    from bigviz.core.tree import SizeTree
    from bigviz.core.workload import Workload

__all__ = ["Placement", "DeviceUsage", "PlanOptions", "DevicePlan", "STRATEGIES", "Why"]

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")

Why = tuple[Any, ...]
"""Why a unit went where it went, as plain values: a code and the numbers the planner's pass
saw then (``("tied", leader)``, ``("fits", left, ...)``). Only the pass that becomes the plan
writes its reasons as text (``Placement.reason``): the passes thrown away (one at least per
plan that offloads) format nothing, where formatting sizes and devices was 40% of a pass
(8,000 layers)."""


@dataclass(frozen=True)
class PlanOptions:
    """The planner's knobs.

    Attributes:
        strategy: ``"auto"`` (= ``"balanced"``), ``"balanced"``, ``"balanced_low_0"`` or
            ``"sequential"``, with accelerate's meanings.
        no_split: module class names (``"Block"``) or glob patterns of module names
            (``"transformer.h.*"``) that are placed whole.
        reserve: bytes per device kept free (the CUDA context, a margin of your own).
        overrides: ``{module: device}`` placements to honour; the rest is planned around them.
        offload_reserve: keep room on the execution device for the offloaded weights
            streamed in at forward time (only when something is actually offloaded).
        prefetch: the engine holds the next offloaded unit while the current one runs, so
            the offload reserve covers the two largest offloaded units instead of one.
        kv_cache: ``{layer module: bytes}`` of KV cache (or recurrent state) a run keeps for
            that module, charged on the device the module runs on: its own, or the execution
            device when it is streamed in from cpu or disk.
        activations: ``{module: bytes}`` alive at the peak of that module's step; each
            device keeps room for the largest step it runs.
        held: ``{module: bytes}`` its output keeps alive for the whole forward on the device
            the module runs on (the input embeddings), charged there beside the largest step.
        run_slack: ``{device: share}`` of the run charged on a device (its KV cache and
            activations) kept free on top, for the allocator's slack (reported in the device's
            ``reserve``; see :mod:`bigviz.core.headroom`).
        workload: the :class:`~bigviz.core.workload.Workload` the two above were made for
            (kept in the plan for reports).
        rule: the unit rule (:class:`~bigviz.core.offload_units.UnitRule`): its blocks are the
            modules placed whole (class names, or globs of module names such as
            ``"transformer.h.*"``), and the offload reserve is computed from the units it makes,
            the ones the engine will fetch. Its ``main_device`` is the execution device for
            offloaded modules (``None``: the first GPU, else the cpu).
    """

    strategy: str = "auto"
    reserve: Mapping[Any, object] = field(default_factory=dict)  # any spelling: make_plan checks them
    overrides: Mapping[str, object] = field(default_factory=dict)
    offload_reserve: bool = True
    prefetch: bool = True
    kv_cache: Mapping[str, int] = field(default_factory=dict)
    activations: Mapping[str, int] = field(default_factory=dict)
    held: Mapping[str, int] = field(default_factory=dict)
    run_slack: Mapping[Device, float] = field(default_factory=dict)
    workload: Workload | None = None
    rule: UnitRule = field(default_factory=UnitRule)


@dataclass(frozen=True)
class Placement:
    """One planned unit: a module (or a single tensor of a split module)."""

    name: str
    device: Device
    nbytes: int
    reason: str
    class_name: str = ""
    kind: str = "module"  # "module" or "tensor"
    override: bool = False
    tied_to: str = ""


@dataclass(frozen=True)
class DeviceUsage:
    """A device's budget and what the plan puts there.

    ``budget`` is what the user gave (or the machine has); ``cap`` is the part the
    strategy lets the planner fill (balanced strategies lower it); ``reserve`` is kept free
    for activations; ``offload_reserve`` for streamed-in offloaded weights; ``kv_cache`` and
    ``activations`` are what a planned workload keeps there (0 without one).
    """

    device: Device
    budget: int
    cap: int
    reserve: int
    offload_reserve: int
    used: int
    kv_cache: int = 0
    activations: int = 0

    @property
    def free(self) -> int:
        return self.budget - self.used - self.reserve - self.offload_reserve - self.kv_cache - self.activations

    @property
    def fraction(self) -> float:
        """Share of the usable budget (budget minus reserves) that weights, KV cache and
        activations fill."""
        usable = self.budget - self.reserve - self.offload_reserve
        held = self.used + self.kv_cache + self.activations
        return held / usable if usable > 0 else (0.0 if held == 0 else float("inf"))


@dataclass(frozen=True)
class DevicePlan:
    """A finished placement of every module, with bytes and reasons, ready to export or run."""

    placements: tuple[Placement, ...]
    usage: tuple[DeviceUsage, ...]
    strategy: str
    main_device: Device
    notes: tuple[str, ...] = ()
    tree: SizeTree | None = field(default=None, compare=False, repr=False)
    _cache: dict[Hashable, Any] = field(default_factory=dict, compare=False, repr=False)
    workload: Workload | None = None
    rule: UnitRule | None = field(default=None, compare=False, repr=False)
    """The unit rule the offload reserve was computed with (the dispatch fetches these units)."""
    prefetch: bool = field(default=True, compare=False, repr=False)

    def dispatch_plan(
        self,
        *,
        prefetch: bool | None = None,
        machine: MachineFacts | None = None,
        stream: StreamOptions | None = None,
    ) -> DispatchPlan:
        """The dispatch this plan promises: its offload units, made by the same unit rule the
        planner reserved room with, and their stream plan (pure; needs the plan's tree).

        Args:
            prefetch: the engine fetches the next unit while the current one computes
                (default: as planned).
            machine: the machine's facts (default: none, the budgets are the machine).
            stream: what is asked of the streaming (``resident``, ``stream``, ``readers``).

        Example:
            >>> from bigviz.core.tree import SizeTree, TensorSpec
            >>> from bigviz.core.planner import make_plan
            >>> tree = SizeTree.build([TensorSpec(f"h.{i}.weight", 250, "float32") for i in range(4)])
            >>> p = make_plan(tree, {0: 3000, "cpu": 10**6})
            >>> d = p.dispatch_plan()
            >>> [u.name for u in d.units], d.held_bytes()[0] == p.usage_of(0).offload_reserve
            (['h.1', 'h.2', 'h.3'], True)
        """
        from bigviz.core.dispatch_plan import make_dispatch_plan

        if self.tree is None:
            raise UsageError("this DevicePlan carries no size tree (read from JSON?): plan again to see its dispatch")
        return make_dispatch_plan(
            self.tree,
            self.device_map,
            self._rule(),
            prefetch=self.prefetch if prefetch is None else prefetch,
            machine=machine,
            stream=stream,
        )

    def _rule(self) -> UnitRule:
        return self.rule if self.rule is not None else UnitRule(self.main_device)

    def stream_plan(self, machine: MachineFacts | None = None, stream: StreamOptions | None = None) -> StreamPlan:
        """How the dispatch of this plan keeps and streams its weights
        (:func:`bigviz.core.stream_plan.make_stream_plan` over the units the unit rule makes;
        pure). ``machine``: the machine's facts (default: none, the budgets are the machine).

        Example:
            >>> from bigviz.core.tree import SizeTree, TensorSpec
            >>> from bigviz.core.planner import make_plan
            >>> tree = SizeTree.build([TensorSpec(f"h.{i}.weight", 250, "float32") for i in range(4)])
            >>> s = make_plan(tree, {"cpu": 2000, "disk": 10**6}).stream_plan()
            >>> s.mode, s.fetcher, s.ring_bytes
            ('copy', 'ring', 2000)
        """
        options = stream if stream is not None else StreamOptions(prefetch=self.prefetch)
        key = ("stream plan", machine, options)
        if key in self._cache:  # a plan is frozen: its stream plan too (the Planner asks twice a move)
            found: StreamPlan = self._cache[key]
            return found
        self._cache[key] = made = self._make_stream_plan(machine, options)
        return made

    def _make_stream_plan(self, machine: MachineFacts | None, options: StreamOptions) -> StreamPlan:
        streamed = streamed_devices(self.main_device)
        if self.tree is not None:
            table = unit_table(self.tree, self.device_map, self._rule(), cleaned=True)
            units = [(name, storage, nbytes) for name, (storage, nbytes) in table.items()]
        else:  # read from JSON: each streamed placement stands for a unit
            units = [(p.name, str(p.device), p.nbytes) for p in self.placements if p.device in streamed]
        mapping = self.device_map
        kept: dict[str, int] = {}
        devices: dict[str, Device] = {}
        for p in self.placements:  # by device-map entry, as the dispatch plan groups them
            if p.device not in streamed and p.device != "disk":
                found = owner(p.name, mapping)
                entry = p.name if found is None else found
                kept[entry] = kept.get(entry, 0) + p.nbytes
                devices[entry] = p.device
        return make_stream_plan(units, kept, self.main_device, machine, options, resident_devices=devices)

    def cost(
        self,
        *,
        disk_bandwidth: float | str | None = None,
        compute_seconds: float | None = None,
        link_bandwidth: float | str | None = None,
        depth: int | None = None,
        machine: MachineFacts | None = None,
        stream: StreamOptions | None = None,
    ) -> ForwardEstimate:
        """Predicted time per forward pass, as the dispatch of this plan will stream it
        (:meth:`stream_plan`): streamed units read from disk (and copied to a GPU) overlapped
        with compute, as far ahead as the stream plan reads, resident units computed only, the
        resident part read once before the first forward (:mod:`bigviz.core.cost`; pure).

        Args:
            disk_bandwidth: bytes/s, e.g. measured by
                ``bigviz.checkpoint.probe.measure_read_bandwidth(checkpoint).bandwidth``, or a
                :data:`~bigviz.core.hardware.DISK_BANDWIDTH` preset name (or unique start of
                one); default: the machine's measured bandwidth, else ``"NVMe ("``.
            compute_seconds: the whole model's compute per forward (measured), spread over
                the units by bytes; default: the weights' bytes at ``machine.compute_rate``
                when the machine's facts carry one, else 0 (compute not counted).
            link_bandwidth: host-to-GPU bytes/s or a :data:`~bigviz.core.hardware.LINK_BANDWIDTH`
                name; default: PCIe 4 x16 when a GPU executes, none for the CPU.
            depth: streamed units read ahead (default: the stream plan's).
            machine, stream: as for :meth:`stream_plan`; the machine's ``read_cost`` (compute
                lost per byte read beside it) adds to the streamed units' compute when the
                CPU executes.

        Example:
            >>> from bigviz.core.tree import SizeTree, TensorSpec
            >>> from bigviz.core.planner import make_plan
            >>> tree = SizeTree.build([TensorSpec(f"h.{i}.weight", 250 * 10**6, "float32") for i in range(4)])
            >>> p = make_plan(tree, {"cpu": 2 * 10**9, "disk": 10**10})
            >>> e = p.cost(disk_bandwidth=1e9, compute_seconds=1.0)
            >>> e.seconds, e.bottleneck
            (2.25, 'disk')
            >>> from bigviz.core.stream_plan import MachineFacts
            >>> slow_cpu = MachineFacts(42 * 10**8, disk_bandwidth=1e9, compute_rate=1e9)  # 1 s per GB computed
            >>> e = p.cost(machine=slow_cpu)  # 2 GB streamed in 2 s, hidden under 4 s of compute
            >>> e.seconds, e.limit_seconds, e.bottleneck
            (4.0, 4.0, 'compute')
        """
        plan = self.stream_plan(machine, stream)
        if compute_seconds is None:
            rate = machine.compute_rate if machine is not None else None
            compute_seconds = (
                weights_compute_seconds(sum(p.nbytes for p in self.placements), compute_rate=rate) if rate else 0.0
            )
        if disk_bandwidth is None:
            disk_bandwidth = machine.disk_bandwidth if machine is not None and machine.disk_bandwidth else "NVMe ("
        disk = find_bandwidth(disk_bandwidth, DISK_BANDWIDTH, "disk")
        link = None
        if self.main_device != "cpu":
            link = find_bandwidth("PCIe 4 x16" if link_bandwidth is None else link_bandwidth, LINK_BANDWIDTH, "link")
        rows = [(p.name, str(p.device) if p.device in ("cpu", "disk") else "gpu", p.nbytes) for p in self.placements]
        return plan_forward(
            rows,
            disk_bandwidth=disk,
            compute_seconds=compute_seconds,
            link_bandwidth=link,
            main_device="cpu" if self.main_device == "cpu" else "gpu",
            depth=plan.depth if depth is None else depth,
            ring=(plan.ring_bytes or None) if depth is None else None,
            rereads=any(u.rereads for u in plan.units if u.storage == "disk"),
            read_cost=machine.read_cost if machine is not None and self.main_device == "cpu" else 0.0,
        )

    def fits(self, *, allow_offload: bool = False) -> bool:
        """Every device within its budget (weights, KV cache, activations, reserves), and,
        unless ``allow_offload``, nothing streamed in from cpu or disk: the one test of "the
        run fits" (``bigviz.max_context``, the Planner's longest context).

        Example:
            >>> from bigviz.core.tree import SizeTree, TensorSpec
            >>> from bigviz.core.planner import make_plan
            >>> tree = SizeTree.build([TensorSpec(f"h.{i}.weight", 250, "float32") for i in range(4)])
            >>> p = make_plan(tree, {0: 3000, "cpu": 10**6})
            >>> p.fits(), p.fits(allow_offload=True)
            (False, True)
        """
        if any(u.free < 0 for u in self.usage):
            return False
        return allow_offload or not any(self.offloaded_bytes().values())

    @property
    def kv_cache(self) -> dict[Device, int]:
        """Bytes of KV cache per device (each layer's, on the device it runs on)."""
        return {u.device: u.kv_cache for u in self.usage}

    @property
    def activations(self) -> dict[Device, int]:
        """Bytes kept per device for the peak activations of the largest step it runs."""
        return {u.device: u.activations for u in self.usage}

    @property
    def unit_map(self) -> Mapping[str, Device]:
        """``{unit: device}`` before cleaning: one key per planned unit."""
        if "units" not in self._cache:
            self._cache["units"] = MappingProxyType({p.name: p.device for p in self.placements})
        units: Mapping[str, Device] = self._cache["units"]
        return units

    @property
    def device_map(self) -> dict[str, Device]:
        """The device map, cleaned as accelerate cleans it (a fresh dict each time)."""
        if "map" not in self._cache:
            self._cache["map"] = clean_device_map(self.unit_map, self.tree)
        return dict(self._cache["map"])

    @property
    def max_memory(self) -> dict[Device, int]:
        """The budgets this plan was made for."""
        return {u.device: u.budget for u in self.usage}

    def device_of(self, name: str) -> Device | None:
        """Where a module or tensor goes under this plan."""
        return device_of(name, self.unit_map)

    def usage_of(self, device: Device) -> DeviceUsage:
        for u in self.usage:
            if u.device == device:
                return u
        raise KeyError(f"{device_label(device)} is not part of this plan")

    def offloaded_bytes(self) -> dict[str, int]:
        """Bytes streamed to the execution device per forward pass, by source (cpu, disk)."""
        out = {"cpu": 0, "disk": 0}
        offload_from = streamed_devices(self.main_device)
        for p in self.placements:
            if p.device in offload_from:
                out[str(p.device)] += p.nbytes
        return out

    def summary(self) -> str:
        """A few lines a person reads: per-device use against budget."""
        lines = [
            f"DevicePlan ({self.strategy}, {format_count(len(self.placements), 'unit')}, "
            f"execution on {device_label(self.main_device)})"
        ]
        for u in self.usage:
            budget = format_size(u.budget)
            extra = ""
            if u.reserve or u.offload_reserve:
                extra = f" (+ reserve {format_size(u.reserve + u.offload_reserve)})"
            run = ""
            if u.kv_cache or u.activations:
                run = f" + KV cache {format_size(u.kv_cache)} + activations {format_size(u.activations)}"
            lines.append(f"  {device_label(u.device):>7}: {format_size(u.used):>10}{run} of {budget}{extra}")
        if self.workload is not None and self.workload.active:
            w = self.workload
            lines.insert(
                1,
                f"  workload: batch {w.batch_size} x {w.context_length:,} tokens"
                + (f", KV cache in {w.kv_dtype}" if w.kv_dtype else ""),
            )
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_frame(self) -> pd.DataFrame:
        """One row per planned unit: module, class, device, bytes, size, reason, override, tied."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "module": p.name or "<model>",
                    "class": p.class_name,
                    "device": device_label(p.device),
                    "bytes": p.nbytes,
                    "size": format_size(p.nbytes),
                    "reason": p.reason,
                    "override": p.override,
                    "tied_to": p.tied_to,
                }
                for p in self.placements
            ],
            columns=["module", "class", "device", "bytes", "size", "reason", "override", "tied_to"],
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data: the device map, budgets (string keys) and placements, and
        with a workload, the run and its KV cache and activation bytes per device."""
        out: dict[str, Any] = {
            "strategy": self.strategy,
            "main_device": self.main_device,
            "device_map": self.device_map,
            "max_memory": {str(k): v for k, v in self.max_memory.items()},
            "placements": [
                {"name": p.name, "device": p.device, "bytes": p.nbytes, "reason": p.reason} for p in self.placements
            ],
        }
        if self.workload is not None:
            out["workload"] = {
                "batch_size": self.workload.batch_size,
                "context_length": self.workload.context_length,
                "kv_dtype": self.workload.kv_dtype,
            }
            out["kv_cache"] = {str(k): v for k, v in self.kv_cache.items()}
            out["activations"] = {str(k): v for k, v in self.activations.items()}
        return out

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def _repr_html_(self, max_rows: int = 60) -> str:
        usage_rows = "".join(
            f"<tr><td>{device_label(u.device)}</td><td>{format_size(u.used)}"
            + (
                f" + {format_size(u.kv_cache)} KV cache + {format_size(u.activations)} activations"
                if u.kv_cache or u.activations
                else ""
            )
            + f"</td><td>{format_size(u.budget)}</td><td>{format_size(u.reserve + u.offload_reserve)}</td>"
            f"<td>{_bar(u.fraction)}</td></tr>"
            for u in self.usage
        )
        rows = "".join(
            f"<tr><td><code>{html.escape(p.name or '<model>')}</code></td><td>{html.escape(p.class_name)}</td>"
            f"<td>{device_label(p.device)}</td><td style='text-align:right'>{format_size(p.nbytes)}</td>"
            f"<td>{html.escape(p.reason)}</td></tr>"
            for p in self.placements[:max_rows]
        )
        more = len(self.placements) - max_rows
        if more > 0:
            rows += f"<tr><td colspan=5>... {more} more (see .to_frame())</td></tr>"
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in self.notes)
        return (
            f"<div class='bigviz-plan'><b>DevicePlan</b> ({html.escape(self.strategy)}, execution on "
            f"{device_label(self.main_device)})<table><tr><th>device</th><th>used</th><th>budget</th>"
            f"<th>reserved</th><th>fill</th></tr>{usage_rows}</table>"
            + (f"<ul>{notes}</ul>" if notes else "")
            + f"<table><tr><th>module</th><th>class</th><th>device</th><th>size</th><th>reason</th></tr>"
            f"{rows}</table></div>"
        )


def _bar(fraction: float) -> str:
    pct = min(fraction, 1.0) * 100 if fraction != float("inf") else 100
    color = "#d55e00" if fraction > 1 else "#0072b2"
    return (
        f"<div style='width:120px;background:#eee'><div style='width:{pct:.0f}%;background:{color};"
        f"height:10px'></div></div>{fraction:.0%}"
    )
