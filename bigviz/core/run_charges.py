"""What a planned workload charges per device during a planner pass: each layer's KV cache,
and room for the largest step's activations, on the device the layer runs on.

A layer's KV cache is charged once, with the unit that holds it (or, for a layer split into
parts, with its first part); a device keeps room for the largest step it runs, plus what the
outputs of the modules it holds keep alive for the whole forward (the input embeddings, on
their device only). A unit
streamed in from cpu or disk runs on the execution device: its cache and its step are
charged there, outside the pass's fill, and the next pass reserves them. Used by
:mod:`bigviz.core.planner` only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from bigviz.core.devices import Device, device_label
from bigviz.core.errors import PlanError
from bigviz.core.names import ancestors, is_prefix, parent
from bigviz.core.plan import DeviceUsage, PlanOptions, Why
from bigviz.core.sizes import format_size
from bigviz.core.tree import SizeTree

__all__ = [
    "Run",
    "run_bytes",
    "run_room",
    "room_text",
    "charge_run",
    "run_text",
    "check_run_fits",
    "streamed_run_needs",
    "run_usage",
    "slack_bytes",
    "follower_hold",
    "follower_step",
    "keep_step",
]


@dataclass
class Run:
    """A workload's bytes per module and what one pass has charged of them.

    A layer's KV cache is charged once, with the unit that holds it (or, for a layer split
    into parts, with its first part); a device keeps room for the largest step it runs. A
    unit streamed in from cpu or disk runs on the execution device: its cache and its step
    are charged there, outside the pass's fill, and the next pass reserves them.
    """

    kv_own: Mapping[str, int]
    kv_sub: dict[str, int]  # module -> cache bytes of the layers inside it
    act_own: Mapping[str, int]
    act_sub: dict[str, int]  # module -> the largest step inside it
    overrides: frozenset[str]
    main: Device
    streamed: tuple[str, ...]
    held_own: Mapping[str, int] = field(default_factory=dict)
    held_sub: dict[str, int] = field(default_factory=dict)  # module -> activations held all forward inside it
    slack: Mapping[Device, float] = field(default_factory=dict)  # share of the run kept free on top
    charged: set[str] = field(default_factory=set)
    kv: dict[Device, int] = field(default_factory=dict)
    act: dict[Device, int] = field(default_factory=dict)
    held: dict[Device, int] = field(default_factory=dict)
    slack_bytes: dict[Device, int] = field(default_factory=dict)
    stream_kv: int = 0
    stream_act: int = 0
    stream_held: int = 0

    @classmethod
    def build(cls, tree: SizeTree, options: PlanOptions, main: Device, streamed: tuple[str, ...]) -> Run:
        unknown = [n for n in [*options.kv_cache, *options.activations, *options.held] if n not in tree.nodes]
        if unknown:
            raise PlanError(
                f"cannot plan: KV cache or activation bytes given for names that are no module "
                f"of the model: {', '.join(repr(n) for n in unknown[:8])}; key them by module name"
            )
        kv_sub: dict[str, int] = {}
        act_sub: dict[str, int] = {}
        held_sub: dict[str, int] = {}
        for name, node in reversed(tree.nodes.items()):  # post-order: children before parents
            kv_sub[name] = options.kv_cache.get(name, 0) + sum(kv_sub[c] for c in node.children)
            act_sub[name] = max([options.activations.get(name, 0), *(act_sub[c] for c in node.children)])
            held_sub[name] = options.held.get(name, 0) + sum(held_sub[c] for c in node.children)
        return cls(
            options.kv_cache,
            kv_sub,
            options.activations,
            act_sub,
            frozenset(options.overrides),
            main,
            streamed,
            options.held,
            held_sub,
            dict(options.run_slack),
        )

    def unit(self, name: str) -> tuple[int, list[str], int, int]:
        """Cache bytes a unit brings, the split layers it charges for the first time, its step,
        and the activations its modules' outputs hold all forward (the input embeddings)."""
        inside, held = self.kv_sub.get(name, 0), self.held_sub.get(name, 0)
        if name in self.overrides:  # nested overrides carry their own caches to their own devices
            nested = [o for o in self.overrides if o != name and is_prefix(name, o)]
            outer = [o for o in nested if not any(m != o and is_prefix(m, o) for m in nested)]
            inside -= sum(self.kv_sub.get(o, 0) for o in outer)
            held -= sum(self.held_sub.get(o, 0) for o in outer)
        step = self.act_sub.get(name, 0)
        first = []
        for holder in ancestors(parent(name)) if name else ():
            if holder not in self.charged and (holder in self.kv_own or holder in self.held_own):
                first.append(holder)
                inside += self.kv_own.get(holder, 0)
                held += self.held_own.get(holder, 0)
            step = max(step, self.act_own.get(holder, 0))
        return inside, first, step, held

    def with_slack(self, device: Device, run: int) -> int:
        """``run`` bytes charged on ``device`` with the share kept free on top (the allocator's slack)."""
        return run + slack_bytes(run, self.slack.get(device, 0.0))

    def resident_bytes(self, name: str, device: Device) -> int:
        """Room a unit's run takes on a resident device besides its weights."""
        kv, _, step, held = self.unit(name)
        return self.with_slack(device, kv + held + max(0, step - self.act.get(device, 0)))


def run_bytes(run: Run | None, name: str, device: Device | None) -> int:
    """Bytes of KV cache and activations a unit adds to ``device`` (0 without a workload,
    and on a streamed device: what a streamed unit runs is reserved on the execution device)."""
    if run is None or device is None or device in run.streamed:
        return 0
    return run.resident_bytes(name, device)


def run_room(run: Run | None, name: str, device: Device) -> tuple[int, ...] | None:
    """What a unit placed now brings besides its weights, for its reason (see
    :func:`room_text`): ``None`` without a workload, ``()`` on a streamed device (its run is
    told about in :func:`charge_run`), else its KV cache and the activations it adds."""
    if run is None:
        return None
    if device in run.streamed:
        return ()
    kv, _, step, held = run.unit(name)
    return (kv, held + max(0, step - run.act.get(device, 0)))


def slack_bytes(run: int, share: float) -> int:
    """Bytes kept free on top of ``run`` bytes of a run for a slack ``share`` (rounded up).

    Example:
        >>> slack_bytes(1001, 0.1)
        101
    """
    return math.ceil(run * share)


def follower_hold(run: Run | None, name: str, device: Device | None) -> int:
    """Room a tied module that will follow its leader to ``device`` needs there for its run
    besides its largest step (:func:`follower_step`): its cache and held outputs, the slack on
    top; 0 without a workload or on a streamed device (it runs on the execution device)."""
    if run is None or device is None or device in run.streamed:
        return 0
    kv, _, _, held = run.unit(name)
    return run.with_slack(device, kv + held)


def follower_step(run: Run | None, names: list[str], leader: str, device: Device | None) -> int:
    """Bytes raising ``device``'s largest step to the steps of the tied modules ``names`` adds,
    beyond what placing ``leader`` there charges (a tied head's logits are often the largest
    step of all: the room is kept once, as a step, not added to every block's)."""
    if run is None or device is None or device in run.streamed or not names:
        return 0
    step = max(run.unit(n)[2] for n in names)
    return run.with_slack(device, max(0, step - max(run.act.get(device, 0), run.unit(leader)[2])))


def keep_step(run: Run | None, remaining: dict[Device, int], names: list[str], device: Device) -> None:
    """Raise ``device``'s largest step to the tied modules' that will follow there, charged
    now (:func:`follower_step`): the blocks placed before them see the room already taken."""
    if run is None or device in run.streamed or not names:
        return
    step = max(run.unit(n)[2] for n in names)
    added = max(0, step - run.act.get(device, 0))
    if added:
        remaining[device] -= run.with_slack(device, added)
        run.slack_bytes[device] = run.slack_bytes.get(device, 0) + run.with_slack(device, added) - added
        run.act[device] = step


def room_text(size: int, room: tuple[int, ...] | None) -> str:
    """``"1.1 GiB weights + 0.4 GiB KV cache + 52 MiB activations"`` (just the size without
    a workload)."""
    if room is None:
        return format_size(size)
    if not room:
        return f"{format_size(size)} weights"
    kv, grow = room
    return (
        f"{format_size(size)} weights"
        + (f" + {format_size(kv)} KV cache" if kv else "")
        + (f" + {format_size(grow)} activations" if grow else "")
    )


def charge_run(run: Run, remaining: dict[Device, int], name: str, device: Device, why: Why, described: bool) -> Why:
    """Charge a placed unit's KV cache and step on the device it runs on; returns its reason,
    completed with where its run lives when the reason does not say it yet (see
    :func:`run_text`)."""
    kv, first, step, held = run.unit(name)
    run.charged.update(first)
    if device in run.streamed:
        run.stream_kv += kv
        run.stream_held += held
        run.stream_act = max(run.stream_act, step)
        return ("run", why, kv, step + held, run.main)
    added = kv + held + max(0, step - run.act.get(device, 0))
    remaining[device] -= run.with_slack(device, added)
    run.slack_bytes[device] = run.slack_bytes.get(device, 0) + run.with_slack(device, added) - added
    run.kv[device] = run.kv.get(device, 0) + kv
    run.held[device] = run.held.get(device, 0) + held
    run.act[device] = max(run.act.get(device, 0), step)
    step += held
    if described or not (kv or step):
        return why
    return ("run", why, kv, step, None)


def run_text(kv: int, step: int, streamed_to: Device | None) -> str:
    """What a reason adds about a unit's run: its cache and activations on ``streamed_to``,
    the execution device, for a streamed unit; else on its own device."""
    if streamed_to is not None:
        held = [f"{format_size(kv)} KV cache"] if kv else []
        held += [f"{format_size(step)} of activations"] if step else []
        return f"; its {' and '.join(held)} live on {device_label(streamed_to)}, where it runs" if held else ""
    held = [f"{format_size(kv)} KV cache"] if kv else []
    held += [f"up to {format_size(step)} of activations"] if step else []
    return f" (+ {', '.join(held)} there)" if held else ""


def check_run_fits(usage: tuple[DeviceUsage, ...], overridden: bool) -> None:
    """A run that does not fit is not a plan: its cache or activations would run out of memory."""
    over = [u for u in usage if u.free < 0 and (u.kv_cache or u.activations)]
    if not over:
        return
    lines = [
        f"{device_label(u.device)} needs {format_size(u.used)} weights + {format_size(u.kv_cache)} KV cache + "
        f"{format_size(u.activations)} activations + {format_size(u.reserve + u.offload_reserve)} reserved, "
        f"{format_size(-u.free)} over its {format_size(u.budget)}"
        for u in over
    ]
    hint = " or move your overrides" if overridden else ""
    kept = [u for u in over if u.reserve >= u.budget]  # the headroom alone: no shorter run can fit
    if kept:
        where = ", ".join(device_label(u.device) for u in kept)
        fix = (
            f"The headroom kept free on {where} is its whole budget: give a smaller reserve= "
            f"(reserve={{device: size}}, or reserve=0 for the bare arithmetic) or the device more memory{hint}."
        )
    else:
        fix = (
            "Shorten the context or the batch, use a smaller KV cache dtype, a smaller reserve= (the headroom "
            f"kept free), or give the device more memory{hint}."
        )
    raise PlanError("the run does not fit", lines, fix=fix)


def streamed_run_needs(run: Run | None, main: Device) -> dict[Device, int]:
    """Room streamed units need on the execution device for their caches and steps."""
    if run is None or not (run.stream_kv or run.stream_act or run.stream_held):
        return {}
    return {main: run.with_slack(main, run.stream_kv + run.stream_held + max(0, run.stream_act - run.act.get(main, 0)))}


def run_usage(run: Run | None, main: Device) -> tuple[dict[Device, int], dict[Device, int], dict[Device, int]]:
    """KV cache, activation and slack bytes per device (the slack: the share of the run kept
    free on top), streamed units' counted on the execution device."""
    if run is None:
        return {}, {}, {}
    slack = dict(run.slack_bytes)
    streamed = run.stream_kv + run.stream_held + max(0, run.stream_act - run.act.get(main, 0))
    if streamed:
        slack[main] = slack.get(main, 0) + run.with_slack(main, streamed) - streamed
    kv, act = dict(run.kv), dict(run.act)
    if run.stream_kv or run.stream_act or run.stream_held:
        kv[main] = kv.get(main, 0) + run.stream_kv
        act[main] = max(act.get(main, 0), run.stream_act)
    for device in {*run.held, main}:  # held outputs add to the largest step on their device
        extra = run.held.get(device, 0) + (run.stream_held if device == main else 0)
        if extra:
            act[device] = act.get(device, 0) + extra
    return kv, act, slack
