"""A placement's reason as a person reads it, from what the planner's pass recorded.

The pass (:mod:`bigviz.core.planner`) records each placement's reason as data (a ``Why``
tuple: fitted with so much room left, streamed, tied, an override, empty); this module writes
it in words once the plan is made, naming the room a balanced strategy left a GPU (its share,
not its budget) and the headroom each device keeps (:mod:`bigviz.core.headroom`): its reserve
kept free and the share of a unit's run kept on top. Kept apart from the pass so the placement
rules read without the wording.

Example:
    >>> from bigviz.core.tree import SizeTree, TensorSpec
    >>> tree = SizeTree.build([TensorSpec("h.0.weight", 1000, "uint8")])
    >>> write_reason(tree, "h.0", 0, 1000, ("fits", 5000, 0, False, None, None, 0, 0), kept={0: (2**30, 0.0)})
    'fits: 1000 B of 4.9 KiB left on GPU 0; headroom: 1.0 GiB kept free'
"""

from __future__ import annotations

from collections.abc import Mapping

from bigviz.core.devices import Device, device_label
from bigviz.core.plan import Why
from bigviz.core.run_charges import room_text, run_text, slack_bytes
from bigviz.core.sizes import format_size
from bigviz.core.tree import SizeTree

__all__ = ["write_reason"]


def write_reason(
    tree: SizeTree,
    name: str,
    device: Device,
    size: int,
    why: Why,
    capped: Mapping[Device, str] | None = None,
    kept: Mapping[Device, tuple[int, float]] | None = None,
) -> str:
    """A placement's reason as a person reads it (``kept``: each device's headroom, its
    reserve bytes and the share of the run kept free on top, named where it shrank the room)."""
    code = why[0]
    if code == "fits":
        return _write_fits(tree, name, device, size, *why[1:], capped=capped or {}, kept=kept or {})
    if code == "run":  # a workload's cache and activations, where they live
        text = write_reason(tree, name, device, size, why[1], capped, kept) + run_text(*why[2:])
        share = (kept or {}).get(device if why[4] is None else why[4], (0, 0.0))[1]
        slack = slack_bytes(why[2] + why[3], share)
        return text + (f"; headroom: {format_size(slack)} for its run ({share:.0%} of it)" if slack else "")
    if code == "tied":
        return f"tied to {why[1]}, which is on {device_label(device)}"
    if code == "interleaved":  # moved by the planner's CPU/disk interleaving, not by the room left
        where = f"{why[2]}'s" if why[2] else "the"
        if why[1] == "disk":
            return (
                f"interleaved: streamed from disk between {where} blocks kept on the CPU, so the disk reads it while "
                "the block before it computes (the same blocks and bytes on each device as in order; "
                "strategy='sequential' keeps them in order)"
            )
        return (
            f"interleaved: kept on the CPU between {where} blocks streamed from disk, computing while the next one "
            "is read (the same blocks and bytes on each device as in order; strategy='sequential' keeps them in order)"
        )
    if code == "override":
        return f"override: you put it on {device_label(device)}"
    return f"holds no weights: stays with its neighbours on {device_label(device)}"


def _write_fits(
    tree: SizeTree,
    name: str,
    device: Device,
    size: int,
    left: int,
    extra: int,
    streamed: bool,
    room: tuple[int, ...] | None,
    here: Device | None,
    need: int,
    free: int,
    *,
    capped: Mapping[Device, str],
    kept: Mapping[Device, tuple[int, float]],
) -> str:
    on = f"of {device_label(device)}'s {capped[device]}" if device in capped else f"on {device_label(device)}"
    where = f"{room_text(size, room)} of {format_size(left)} left {on}"
    text = f"streamed in from {device_label(device)} at forward time ({where})" if streamed else f"fits: {where}"
    if extra:
        text += f", with {format_size(extra)} kept for the modules tied to it"
    text += _headroom_text(device, room, kept)
    if here is None:
        return text
    of = f" of its {capped[here]}" if here in capped else ""
    reserve = kept.get(here, (0, 0.0))[0]
    of += f", {format_size(reserve)} more kept free as headroom" if reserve else ""
    return (
        f"{_what(tree, name)} did not fit {device_label(here)} ({format_size(need)} needed, "
        f"{format_size(free)} left{of}): {text}"
    )


def _headroom_text(device: Device, room: tuple[int, ...] | None, kept: Mapping[Device, tuple[int, float]]) -> str:
    """What a reason adds about the headroom on ``device``: the bytes kept free there and,
    for a unit whose run is charged there, the share of its run kept free on top (the
    allocator's slack; :mod:`bigviz.core.headroom`). Empty where the device keeps none."""
    reserve, share = kept.get(device, (0, 0.0))
    slack = slack_bytes(sum(room), share) if room else 0
    parts = [f"{format_size(reserve)} kept free"] if reserve else []
    if slack:
        parts.append(f"{format_size(slack)} for its run ({share:.0%} of it)")
    return f"; headroom: {' + '.join(parts)}" if parts else ""


def _what(tree: SizeTree, name: str) -> str:
    node = tree.nodes.get(name)
    if node is None:
        return "this tensor"
    if node.children:
        return f"{node.class_name or 'this module'} is no-split and"
    return f"{node.class_name or 'this module'} (a leaf module)"
