"""When each block of a forward pass waited for its weights and when it computed.

:class:`ForwardTimeline` hooks a model's blocks for the forward passes run inside its
``with``: for each call of a block, when it was *called*, when its weights were *ready* (its
first child started: bigviz's offload hook fetches the block's weights between the two) and
when it was *done*. It also counts what the computing thread did meanwhile: the bytes it read
from a disk itself (page faults on cold mapped weights) and how long it was *blocked*: neither
on a core nor waiting for one, i.e. waiting for a disk or for prefetch. Other programs keeping
the cores busy lengthen the wall-clock time, not the blocked time.

:func:`draw_timelines` draws several timelines one above the other (matplotlib, on a shared
time axis), with the reads a :class:`~bigviz.teaching.slow_disk.SlowDisk` logged, per thread.

Example:
    >>> import torch
    >>> blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 4)) for _ in range(3)])
    >>> with ForwardTimeline(list(blocks)) as timeline:
    ...     _ = blocks(torch.ones(1, 4))
    >>> [m.block for m in timeline.marks], timeline.marks[0].called <= timeline.marks[0].ready
    ([0, 1, 2], True)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from bigviz.teaching.machine import disk_read_bytes, thread_times
from bigviz.teaching.slow_disk import Read
from bigviz.ui.palette import device_color

__all__ = ["BlockMarks", "ForwardTimeline", "draw_timelines"]


@dataclass
class BlockMarks:
    """One call of a block, in seconds since the timeline began (``nan`` until seen)."""

    block: int
    called: float
    ready: float = float("nan")
    done: float = float("nan")

    @property
    def waited(self) -> float:
        """Seconds between the call and the weights being there (the offload hook's fetch)."""
        return self.ready - self.called

    @property
    def computed(self) -> float:
        """Seconds the block computed (with page faults on cold weights, if it took any)."""
        return self.done - self.ready


@dataclass
class ForwardTimeline:
    """Marks of every call of ``blocks`` inside the ``with``, and the computing thread's counters.

    Args:
        blocks: the modules to mark, in order (``model.transformer.h``); block ``i`` is
            ``blocks[i]``.

    Attributes (after the ``with``):
        marks: one :class:`BlockMarks` per call, in call order.
        seconds: wall-clock seconds of the ``with``.
        read: bytes the process read from a disk meanwhile (0 where ``/proc`` does not say).
        read_by_compute: of those, bytes the computing thread read itself.
        blocked: seconds the computing thread was neither on a core nor waiting for one.
    """

    blocks: Sequence[nn.Module]
    marks: list[BlockMarks] = field(default_factory=list)
    seconds: float = 0.0
    read: int = 0
    read_by_compute: int = 0
    blocked: float = 0.0
    t0: float = 0.0
    thread: int = 0

    def __enter__(self) -> ForwardTimeline:
        self._hooks: list[Any] = []
        self._open: dict[int, BlockMarks] = {}
        for i, block in enumerate(self.blocks):
            self._hooks.append(block.register_forward_pre_hook(lambda m, a, i=i: self._called(i)))
            self._hooks.append(block.register_forward_hook(lambda m, a, o, i=i: self._done(i)))
            for child in block.children():
                self._hooks.append(child.register_forward_pre_hook(lambda m, a, i=i: self._ready(i)))
        self.thread = threading.get_native_id()  # the thread that computes
        self._start = (disk_read_bytes(), disk_read_bytes(self.thread), thread_times(self.thread))
        self.t0 = time.perf_counter()
        return self

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def _called(self, i: int) -> None:
        self._open[i] = BlockMarks(i, self._now())
        self.marks.append(self._open[i])
        if not list(self.blocks[i].children()):  # a leaf: nothing marks "ready" later
            self._open[i].ready = self._open[i].called

    def _ready(self, i: int) -> None:
        marks = self._open.get(i)
        if marks is not None and marks.ready != marks.ready:  # nan: the first child to start
            marks.ready = self._now()

    def _done(self, i: int) -> None:
        marks = self._open.pop(i, None)
        if marks is not None:
            marks.done = self._now()

    def __exit__(self, *exc: object) -> None:
        self.seconds = self._now()
        read0, read0_compute, (core0, wait0) = self._start
        self.read = disk_read_bytes() - read0
        self.read_by_compute = disk_read_bytes(self.thread) - read0_compute
        core, wait = thread_times(self.thread)
        self.blocked = max(0.0, self.seconds - (core - core0) - (wait - wait0)) if core else 0.0
        for hook in self._hooks:
            hook.remove()

    def relative(self, reads: Sequence[Read]) -> list[tuple[str, float, float]]:
        """``(who, start, end)`` of the ``reads`` made during this timeline, in its seconds:
        who is "computing thread" or "another thread" (prefetch's)."""
        out = []
        for r in reads:
            start, end = r.start - self.t0, r.end - self.t0
            if end >= 0 and start <= self.seconds:
                out.append(("computing thread" if r.thread == self.thread else "another thread", start, end))
        return out


WAITING = "#FFFFFF"  # hatched in grey: no work for this block's thread
READING = device_color("disk")
COMPUTING = device_color("cpu")  # the CPU executes


def draw_timelines(
    timelines: Mapping[str, ForwardTimeline],
    *,
    reads: Mapping[str, Sequence[Read]] | None = None,
    title: str = "",
    names: str = "h.",
) -> Any:
    """One panel per timeline (blocks as rows: waiting for weights hatched, computing in the
    CPU's colour), over a shared time axis in ms, each with the reads of ``reads[label]`` (a
    :class:`~bigviz.teaching.slow_disk.SlowDisk`'s log) beneath, per thread, in the disk's
    colour. Returns the matplotlib figure (``plt.show()`` it, or save it).

    Example:
        >>> import torch
        >>> blocks = [torch.nn.Sequential(torch.nn.Linear(4, 4)) for _ in range(2)]
        >>> with ForwardTimeline(blocks) as timeline:
        ...     _ = blocks[1](blocks[0](torch.ones(1, 4)))
        >>> fig = draw_timelines({"in memory": timeline})
        >>> [ax.get_title(loc="left").split(":")[0] for ax in fig.axes]
        ['in memory']
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n_blocks = max((len(t.blocks) for t in timelines.values()), default=0)
    fig, axes = plt.subplots(
        len(timelines), 1, figsize=(9, 1.2 + 0.28 * (n_blocks + 3) * len(timelines)), sharex=True, squeeze=False
    )
    for ax, (label, timeline) in zip(axes[:, 0], timelines.items()):
        for m in timeline.marks:
            ax.barh(m.block, m.waited * 1e3, left=m.called * 1e3, color=WAITING, edgecolor="#888888", hatch="////")
            ax.barh(m.block, m.computed * 1e3, left=m.ready * 1e3, color=COMPUTING, edgecolor="#333333", lw=0.5)
        lanes = {"computing thread": n_blocks + 0.6, "another thread": n_blocks + 1.6}
        for who, start, end in timeline.relative((reads or {}).get(label, ())):
            ax.barh(lanes[who], (end - start) * 1e3, left=start * 1e3, height=0.7, color=READING)
        ticks = [*range(n_blocks), *lanes.values()]
        ax.set_yticks(ticks, [f"{names}{i}" for i in range(n_blocks)] + ["reads: computing", "reads: prefetch"])
        ax.tick_params(axis="y", labelsize=8)
        ax.set_ylim(n_blocks + 2.2, -0.7)
        ax.set_title(f"{label}: {timeline.seconds * 1e3:,.0f} ms", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("ms since the forward pass began")
    handles = [
        Patch(facecolor=WAITING, edgecolor="#888888", hatch="////", label="block waits for its weights"),
        Patch(facecolor=COMPUTING, edgecolor="#333333", label="block computes"),
        Patch(facecolor=READING, label="a read (one tensor)"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig
