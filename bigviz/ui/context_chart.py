"""The Planner's memory-against-context chart: what each device holds as the context grows.

Under the budget bars (one context), a small chart answers the next question, "how far does
it go?": for contexts from 0 to twice the planned one (or the model's position limit), each
device that holds part of the run is drawn as a line, its weights, KV cache, activations and
reserves as a share of its budget, with the 100% line; where a line crosses it, that device is
full. The placement of the current plan is kept (every unit pinned where it is, as
``bigviz.max_context(device_map=plan)`` keeps it), so the chart shows this map's limits, and the
numbers come from the planner itself at each context (its own charging rules: a layer's cache
on the device it runs on, each device's largest step once, sliding windows, states), not from a
straight line.

Example:
    >>> import torch
    >>> from bigviz.models import build
    >>> from bigviz.ui.state import PlannerState
    >>> with torch.device("meta"):
    ...     model = build("gpt-tiny")
    >>> state = PlannerState.from_model(model, {0: 400_000, "cpu": 10**8})
    >>> state.set_reserve(0, 0)   # a toy GPU budget: none of the default 1 GiB headroom kept free
    >>> state.set_workload(context_length=32)
    >>> curves = context_curves(state, state.replan(), points=5)
    >>> curves.tokens, curves.devices
    ((0, 16, 32, 48, 64), (0,))
"""

from __future__ import annotations

import html
from dataclasses import dataclass, replace

from bigviz.core.devices import Device, device_label
from bigviz.core.plan import DevicePlan
from bigviz.core.planner import PlanError, make_plan
from bigviz.core.sizes import UNLIMITED, format_size
from bigviz.ui.palette import device_color
from bigviz.ui.state import PlannerState

__all__ = ["ContextCurves", "context_curves", "context_chart_svg"]

_LIFTED = 2**62  # every budget lifted: the placement is pinned, the chart shows what it needs


@dataclass(frozen=True)
class ContextCurves:
    """What each device needs, with the placement kept, at a few contexts.

    Attributes:
        tokens: the contexts planned, from 0 up.
        devices: devices with a budget that hold part of the run (KV cache or activations).
        needs: per device, bytes held at each context: weights, KV cache, activations, reserves.
        budgets: per device, its budget.
        current: the context of the plan the chart belongs to.
        batch_size: sequences in the run.
    """

    tokens: tuple[int, ...]
    devices: tuple[Device, ...]
    needs: dict[Device, tuple[int, ...]]
    budgets: dict[Device, int]
    current: int
    batch_size: int

    def full_at(self, device: Device) -> int | None:
        """The context at which ``device`` reaches its budget, interpolated between the planned
        contexts (``None``: not within the chart)."""
        need, budget = self.needs[device], self.budgets[device]
        for (t0, n0), (t1, n1) in zip(zip(self.tokens, need), zip(self.tokens[1:], need[1:])):
            if n1 > budget >= n0 and n1 > n0:
                return int(t0 + (t1 - t0) * (budget - n0) / (n1 - n0))
        return 0 if need and need[0] > budget else None


def context_curves(state: PlannerState, plan: DevicePlan, *, points: int = 7) -> ContextCurves | None:
    """Plan the state's run at ``points`` contexts with ``plan``'s placement pinned (budgets
    lifted so that each plan holds); ``None`` without a run, or when the run cannot be planned.

    Each point is one planner pass over the pinned units (linear in the units), so the chart
    costs about ``points`` re-plans.
    """
    workload = state.workload
    if not workload.active or state.run_specs is None or plan.workload is None:
        return None
    top = 2 * workload.context_length
    if state.position_limit:
        top = max(min(top, state.position_limit), workload.context_length)
    tokens = tuple(sorted({round(top * i / (points - 1)) for i in range(points)}))
    lifted = {d: _LIFTED for d in state.budgets}
    needs: dict[Device, list[int]] = {u.device: [] for u in plan.usage}
    try:
        for t in tokens:
            options = replace(state.options(replace(workload, context_length=t)), overrides=dict(plan.unit_map))
            for u in make_plan(state.tree, lifted, options).usage:
                needs[u.device].append(u.used + u.kv_cache + u.activations + u.reserve + u.offload_reserve)
    except PlanError:
        return None
    budgets = {u.device: u.budget for u in plan.usage}
    devices = tuple(
        u.device for u in plan.usage if (u.kv_cache or u.activations) and u.budget < UNLIMITED and u.budget > 0
    )
    return ContextCurves(
        tokens,
        devices,
        {d: tuple(needs[d]) for d in devices},
        {d: budgets[d] for d in devices},
        workload.context_length,
        workload.batch_size,
    )


def context_chart_svg(curves: ContextCurves, *, width: int = 420, height: int = 130) -> str:
    """A small SVG: per device, its need as a share of its budget against the context, the
    100% line, the planned context marked; the caption names where each device is full."""
    left, right, top, bottom = 34, 8, 8, 22
    w, h = width - left - right, height - top - bottom
    shares = [n / curves.budgets[d] for d in curves.devices for n in curves.needs[d]]
    ymax = max(1.2, *shares) if shares else 1.2
    ymin = max(0.0, int(min(shares, default=0) * 10) / 10 - 0.1)  # weights dominate: start near the lowest
    xmax = max(curves.tokens[-1], 1)

    def x(t: float) -> float:
        return left + w * t / xmax

    def y(share: float) -> float:
        return top + h * (1 - (share - ymin) / (ymax - ymin))

    parts = [
        f"<rect x='{left}' y='{top}' width='{w}' height='{h}' fill='#fff' stroke='#bbb'/>",
        f"<line x1='{left}' x2='{left + w}' y1='{y(1):.1f}' y2='{y(1):.1f}' stroke='#000' stroke-dasharray='6,3'/>",
        f"<text x='{left - 3}' y='{y(1) + 4:.1f}' font-size='10' text-anchor='end'>100%</text>",
        f"<text x='{left - 3}' y='{top + h + 4}' font-size='10' text-anchor='end'>{ymin:.0%}</text>",
        f"<line x1='{x(curves.current):.1f}' x2='{x(curves.current):.1f}' y1='{top}' y2='{top + h}' "
        "stroke='#888' stroke-dasharray='3,3'/>",
        f"<text x='{left}' y='{height - 6}' font-size='10'>0</text>",
        f"<text x='{left + w}' y='{height - 6}' font-size='10' text-anchor='end'>{xmax:,} tokens</text>",
        f"<text x='{x(curves.current):.1f}' y='{height - 6}' font-size='10' text-anchor='middle'>"
        f"{curves.current:,} (planned)</text>",
    ]
    for d in curves.devices:
        points = " ".join(f"{x(t):.1f},{y(n / curves.budgets[d]):.1f}" for t, n in zip(curves.tokens, curves.needs[d]))
        parts.append(
            f"<polyline points='{points}' fill='none' stroke='{device_color(d)}' stroke-width='2'>"
            f"<title>{html.escape(device_label(d))} of {format_size(curves.budgets[d])}</title></polyline>"
        )
    svg = (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
        f"font-family='sans-serif' role='img' aria-label='memory against context'>{''.join(parts)}</svg>"
    )
    return f"<div class='bigviz-context' style='font-size:12px;margin-top:6px'>{_caption(curves)}{svg}</div>"


def _caption(curves: ContextCurves) -> str:
    found = []
    for d in curves.devices:
        full = curves.full_at(d)
        chip = f"<b style='color:{device_color(d)}'>{html.escape(device_label(d))}</b>"
        found.append(f"{chip} full at about {full:,} tokens" if full is not None else f"{chip} has room")
    batch = f"batch {curves.batch_size}, " if curves.batch_size != 1 else ""
    return f"<div>Memory against context ({batch}this placement kept; share of each budget): {'; '.join(found)}</div>"
