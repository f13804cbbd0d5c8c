"""The dispatch plan: what a dispatch will do with every tensor, decided before anything moves.

The last link of the chain of plans (``DevicePlan`` -> ``LoadPlan`` -> ``DispatchPlan``). It
lists the offload units (the module each hook sits on, where its tensors are stored, the
tensors and buffers it fetches, their bytes), the order they are fetched in (definition order
until a first forward records the real one), and the tensors that stay resident on a
computing device. It is made by one pure function from a size tree and a device map, with
:func:`~bigviz.core.offload_units.offload_units`, the same unit rule the planner reserves
room with; the engine (``bigviz.dispatch_model``) only carries it out.

Example:
    >>> from bigviz.core.offload_units import UnitRule
    >>> from bigviz.core.tree import SizeTree, TensorSpec
    >>> tree = SizeTree.build([TensorSpec(f"h.{i}.weight", 100, "float32") for i in range(3)])
    >>> plan = make_dispatch_plan(tree, {"h.0": 0, "h.1": "cpu", "h.2": "disk"}, UnitRule(main_device=0))
    >>> [(u.name, u.storage, u.nbytes) for u in plan.units], plan.streamed_bytes()
    ([('h.1', 'cpu', 400), ('h.2', 'disk', 400)], {'cpu': 400, 'disk': 400})
    >>> print(plan.summary())
    DispatchPlan: execution on GPU 0, 2 offload units, 800 B streamed per forward
      GPU 0: 1 resident tensor, 400 B; holds up to 800 B of streamed units (running + prefetched)
      from CPU: 1 unit, 400 B (h.1)
      from disk: 1 unit, 400 B (h.2)
      run: 2 cpu/disk units streamed by the cuda fetcher (copies to the GPU on a side stream, through pinned staging buffers, 1 unit ahead)
        resident on GPU 0: 1 entry, 400 B (h.0)
        streamed by the cuda fetcher: 2 units, 800 B (h.1, h.2)
        why: GPU 0 executes: cpu units stream from pinned RAM, disk units through pinned staging (the page cache keeps them as RAM allows)
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from bigviz.core.devices import Device, device_label, normalize_device, streamed_devices
from bigviz.core.errors import DeviceMapError
from bigviz.core.offload_units import OffloadUnit, Resident, UnitRule, offload_units, streamed_needs
from bigviz.core.names import owner
from bigviz.core.sizes import format_count, format_size
from bigviz.core.stream_plan import MachineFacts, StreamOptions, StreamPlan, make_stream_plan
from bigviz.core.tree import SizeTree

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["DispatchPlan", "make_dispatch_plan"]


@dataclass(frozen=True)
class DispatchPlan:
    """Offload units, resident tensors and fetch order of a dispatch, as data.

    Attributes:
        device_map: the map dispatched (canonical devices).
        main_device: where offloaded units execute.
        units: offload units, in fetch order (definition order until a first forward).
        resident: tensors kept on a computing device (ties: one entry for all names).
        rule: the unit rule's knobs the units were made with.
        prefetch: the next unit is fetched while the current one computes (so two are held).
        problems: tensors no device-map entry covers (sentences); a plan with problems is
            refused by `check`.
        stream: how each unit lives at run time (mapped, resident copy or streamed; which
            fetcher, its ring, its read-ahead): :mod:`bigviz.core.stream_plan`. The engine
            carries it out as it is.
    """

    device_map: Mapping[str, Device]
    main_device: Device
    units: tuple[OffloadUnit, ...]
    resident: tuple[Resident, ...]
    rule: UnitRule
    prefetch: bool = True
    problems: tuple[str, ...] = field(default=())
    stream: StreamPlan | None = None

    def check(self) -> DispatchPlan:
        """The plan itself, or `DeviceMapError` listing every tensor it leaves uncovered."""
        DeviceMapError.check(self.problems, "dispatch_model: cannot dispatch with this device map")
        return self

    def streamed_bytes(self) -> dict[str, int]:
        """Bytes brought to the execution device per forward pass, by storage.

        Example:
            >>> DispatchPlan({}, "cpu", (), (), UnitRule("cpu")).streamed_bytes()
            {'cpu': 0, 'disk': 0}
        """
        out = {"cpu": 0, "disk": 0}
        for unit in self.units:
            out[unit.storage] += unit.nbytes
        return out

    def held_bytes(self) -> dict[Device, int]:
        """Room the engine holds for streamed units: the running and prefetched units on the
        execution device, their pinned staging on the cpu (the planner's offload reserve)."""
        return streamed_needs(self.units, self.main_device, prefetch=self.prefetch)

    def resident_bytes(self) -> dict[Device, int]:
        """Bytes of the resident tensors per device."""
        out: dict[Device, int] = {}
        for r in self.resident:
            out[r.device] = out.get(r.device, 0) + r.nbytes
        return out

    def unit(self, name: str) -> OffloadUnit:
        """The unit hooked on module ``name``."""
        for unit in self.units:
            if unit.name == name:
                return unit
        raise KeyError(f"no offload unit is hooked on {name!r}; units: {', '.join(u.name for u in self.units[:8])}")

    def summary(self) -> str:
        """A few lines a person reads: resident bytes, and the units streamed from each storage."""
        streamed = self.streamed_bytes()
        lines = [
            f"DispatchPlan: execution on {device_label(self.main_device)}, {format_count(len(self.units), 'offload unit')}, "
            f"{format_size(sum(streamed.values()))} streamed per forward"
        ]
        held = self.held_bytes()
        for device, nbytes in sorted(self.resident_bytes().items(), key=lambda kv: str(kv[0])):
            count = sum(r.device == device for r in self.resident)
            extra = ""
            if device == self.main_device and held.get(device):
                how = "running + prefetched" if self.prefetch else "running"
                extra = f"; holds up to {format_size(held[device])} of streamed units ({how})"
            lines.append(
                f"  {device_label(device)}: {format_count(count, 'resident tensor')}, {format_size(nbytes)}{extra}"
            )
        for storage in ("cpu", "disk"):
            units = [u for u in self.units if u.storage == storage]
            if units:
                shown = ", ".join(u.name or "<model>" for u in units[:4]) + (", ..." if len(units) > 4 else "")
                lines.append(
                    f"  from {device_label(storage)}: {format_count(len(units), 'unit')}, "
                    f"{format_size(streamed[storage])} ({shown})"
                )
        if self.stream is not None:
            lines += _residency_lines(self.stream)
        lines += [f"  problem: {p}" for p in self.problems]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def rows(self) -> list[dict[str, Any]]:
        """One dict per unit, in fetch order: unit, storage, residency, fetcher, tensors,
        buffers, bytes, fetched."""
        how = {u.name: u for u in self.stream.units} if self.stream is not None else {}
        return [
            {
                "order": i,
                "unit": u.name or "<model>",
                "storage": u.storage,
                "residency": how[u.name].residency if u.name in how else "streamed",
                "fetcher": how[u.name].fetcher if u.name in how else "",
                "tensors": len(u.fetches),
                "buffers": len(u.buffers),
                "bytes": u.nbytes,
                "size": format_size(u.nbytes),
                "fetches": ", ".join(u.tensors),
            }
            for i, u in enumerate(self.units)
        ]

    def to_frame(self) -> pd.DataFrame:
        """One row per offload unit, in fetch order."""
        import pandas as pd

        columns = ["order", "unit", "storage", "residency", "fetcher", "tensors", "buffers", "bytes", "size", "fetches"]
        return pd.DataFrame(self.rows(), columns=columns)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data."""
        return {
            "main_device": self.main_device,
            "prefetch": self.prefetch,
            "device_map": dict(self.device_map),
            "units": [
                {
                    "name": u.name,
                    "storage": u.storage,
                    "bytes": u.nbytes,
                    "fetches": [
                        {"tensor": f.key, "names": list(f.names), "bytes": f.nbytes, "kind": f.kind} for f in u.fetches
                    ],
                }
                for u in self.units
            ],
            "resident": [
                {"tensor": r.key, "names": list(r.names), "device": r.device, "bytes": r.nbytes} for r in self.resident
            ],
            "stream": self.stream.to_dict() if self.stream is not None else None,
        }

    def _repr_html_(self, max_rows: int = 60) -> str:
        rows = "".join(
            f"<tr><td>{r['order']}</td><td><code>{html.escape(r['unit'])}</code></td><td>{device_label(r['storage'])}</td>"
            f"<td style='text-align:right'>{r['tensors']}</td><td style='text-align:right'>{r['size']}</td></tr>"
            for r in self.rows()[:max_rows]
        )
        more = len(self.units) - max_rows
        if more > 0:
            rows += f"<tr><td colspan=5>... {more} more (see .to_frame())</td></tr>"
        head = html.escape(self.summary()).replace("\n", "<br>")
        return (
            f"<div class='bigviz-dispatch'><div>{head}</div><table><tr><th>#</th><th>unit</th><th>from</th>"
            f"<th>tensors</th><th>size</th></tr>{rows}</table></div>"
        )


def make_dispatch_plan(
    tree: SizeTree,
    device_map: Mapping[str, object],
    rule: UnitRule,
    *,
    prefetch: bool = True,
    machine: MachineFacts | None = None,
    stream: StreamOptions | None = None,
) -> DispatchPlan:
    """The dispatch plan of ``device_map`` on ``tree`` (pure: no model, no file).

    Args:
        tree: the model's size tree (classes, containers and ties included).
        device_map: module (or tensor) name -> device, in any spelling.
        rule: the unit rule's knobs (execution device, blocks, preload classes, reads).
        prefetch: the engine fetches the next unit while the current one computes.
        machine: the machine's facts the stream plan is made for (default: none, the map is
            the machine: a model with disk units does not fit its "cpu" part).
        stream: what is asked of the streaming (``resident``, ``stream``, ``readers``).

    Raises:
        PlanError: a streaming knob out of range, or a resident copy that cannot fit in RAM.
    """
    layout = offload_units(tree, device_map, rule)
    mapping = MappingProxyType({k: normalize_device(v) for k, v in device_map.items()})
    main = normalize_device(rule.main_device)
    options = replace(stream, prefetch=prefetch) if stream is not None else StreamOptions(prefetch=prefetch)
    kept: dict[str, int] = {}
    devices: dict[str, Device] = {}
    for r in layout.resident:
        found = owner(r.names[0], mapping)
        entry = r.names[0] if found is None else found
        kept[entry] = kept.get(entry, 0) + r.nbytes
        devices[entry] = r.device
    units = [(u.name, u.storage, u.nbytes) for u in layout.units]
    plan = make_stream_plan(units, kept, main, machine, options, resident_devices=devices)
    return DispatchPlan(mapping, main, layout.units, layout.resident, rule, prefetch, layout.problems, plan)


def _residency_lines(stream: StreamPlan) -> list[str]:
    """How each unit lives at run time, grouped: the resident entries by residency, then the
    streamed units by fetcher (a few names each; ``rows()`` has them all)."""
    lines = [f"  run: {stream.summary().splitlines()[0]}"]
    groups: dict[tuple[str, str], list[str]] = {}
    sizes: dict[tuple[str, str], int] = {}
    for u in stream.units:
        key = (u.residency, u.fetcher if u.residency == "streamed" else u.storage)
        groups.setdefault(key, []).append(u.name or "<model>")
        sizes[key] = sizes.get(key, 0) + u.nbytes
    for (residency, how), names in groups.items():
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        if residency == "on device":
            what = f"resident on {device_label(normalize_device(how))}"
        else:
            what = {
                "streamed": f"streamed by the {how} fetcher",
                "mapped": "in RAM as loaded (zero copy: memory-mapped where read in place)",
                "resident copy": "copied into RAM once",
            }[residency]
        count = (
            format_count(len(names), "unit")
            if residency == "streamed"
            else format_count(len(names), "entry", "entries")
        )
        lines.append(f"    {what}: {count}, {format_size(sizes[(residency, how)])} ({shown})")
    lines.append(f"    why: {stream.reason}")
    return lines


def offloaded_storages(main_device: Device) -> frozenset[str]:
    """Map values whose modules are fetched at forward time rather than kept resident.

    Example:
        >>> sorted(offloaded_storages("cpu")), sorted(offloaded_storages(0))
        (['disk'], ['cpu', 'disk'])
    """
    return frozenset(streamed_devices(normalize_device(main_device)))
