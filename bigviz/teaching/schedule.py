"""The pipeline bubble, drawn: which stage works on which micro-batch in each time slot.

Notebook 09 teaches why micro-batches keep pipeline stages busy. A picture of the schedule
makes the formula :func:`bigviz.core.pipeline.pipeline_bubble` visible: one pass of ``m``
micro-batches through ``p`` stages of equal time takes ``m + p - 1`` slots, of which each
stage works ``m``; the idle slots (the bubble, ``(p - 1) / (m + p - 1)`` of the time) are
the fill before the last stage starts and the drain after the first stage ends.

Example:
    >>> schedule(3, 2)
    [[0, 1, None, None], [None, 0, 1, None], [None, None, 0, 1]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bigviz.core.errors import UsageError
from bigviz.core.pipeline import pipeline_bubble

__all__ = ["schedule", "draw_schedules"]


def schedule(stages: int, microbatches: int) -> list[list[int | None]]:
    """For each stage, the micro-batch it runs in each slot (``None``: idle), for one pass
    (a forward, or a prefill) with stages of equal time and free sends: micro-batch ``j``
    reaches stage ``s`` in slot ``s + j``, as in GPipe's forward.

    Example:
        >>> [sum(x is None for x in row) for row in schedule(4, 4)]   # p - 1 idle slots each
        [3, 3, 3, 3]
    """
    if stages < 1 or microbatches < 1:
        raise UsageError(f"stages={stages}, microbatches={microbatches}: each must be >= 1")
    slots = microbatches + stages - 1
    return [[j if 0 <= (j := t - s) < microbatches else None for t in range(slots)] for s in range(stages)]


def draw_schedules(stages: int, microbatches: Sequence[int], *, title: str = "") -> Any:
    """One panel per micro-batch count: stages as rows, time slots as columns, each working
    slot in its stage's colour (the treemap's) and numbered by its micro-batch, each idle slot
    hatched; the panel's title gives the bubble ``(p - 1) / (m + p - 1)`` as computed by
    :func:`~bigviz.core.pipeline.pipeline_bubble` and counted from the drawn slots. Returns the
    matplotlib figure.

    Example:
        >>> fig = draw_schedules(4, [1, 4])
        >>> [ax.get_title(loc="left").split(": bubble")[1] for ax in fig.axes]
        [' (p-1)/(m+p-1) = 3/4 = 75%', ' (p-1)/(m+p-1) = 3/7 = 43%']
    """
    import matplotlib.pyplot as plt

    from bigviz.ui.palette import text_color
    from bigviz.ui.stages import stage_color

    longest = max(microbatches) + stages - 1
    fig, axes = plt.subplots(
        len(microbatches), 1, figsize=(9, 0.6 + 0.42 * (stages + 1) * len(microbatches)), sharex=True, squeeze=False
    )
    for ax, m in zip(axes[:, 0], microbatches):
        rows = schedule(stages, m)
        for s, row in enumerate(rows):
            for t, j in enumerate(row):
                if j is None:
                    ax.barh(s, 1, left=t, color="white", edgecolor="#BBBBBB", hatch="////", lw=0.5)
                else:
                    ax.barh(s, 1, left=t, color=stage_color(s), edgecolor="white", lw=1)
                    ax.text(t + 0.5, s, str(j), ha="center", va="center", fontsize=8, color=text_color(stage_color(s)))
        idle = sum(x is None for x in rows[0])
        ax.set_title(
            f"m = {m} micro-batch{'es' if m != 1 else ''}: {m + stages - 1} slots, each stage idle in {idle}: "
            f"bubble (p-1)/(m+p-1) = {stages - 1}/{m + stages - 1} = {pipeline_bubble(stages, m):.0%}",
            loc="left",
            fontsize=9,
        )
        ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)], fontsize=8)
        ax.set_ylim(stages - 0.5, -0.5)
        ax.set_xlim(0, longest)
    axes[-1, 0].set_xlabel("time (slots: one stage's work on one micro-batch)")
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    return fig
