"""Run a plan: load and dispatch a checkpoint with bigviz's engine, then measure memory per
device and put it next to what the plan predicted.

What is measured, per device:

* a GPU: the growth of ``torch.cuda.memory_allocated(i)`` during the load;
* the CPU: the growth of the process's resident memory (``RssAnon + RssFile`` from
  ``/proc/self/status`` on Linux, psutil's RSS elsewhere), which counts memory-mapped
  weights once they are read;
* disk: the growth of the bytes of files mapped into the process (``/proc/self/maps``),
  i.e. checkpoint shards or offload files the engine reads weights from in place.

Other activity in the process during the load shows up too; the numbers are a check of the
plan, not an accounting.

Example:
    >>> snap = memory_snapshot([])
    >>> snap["cpu"] > 0
    True
"""

from __future__ import annotations

import html
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigviz.core.plan import DevicePlan
from bigviz.core.dtypes import FLOATING_DTYPES
from bigviz.core.quant import QUANT_METHODS
from bigviz.core.devices import Device
from bigviz.core.sizes import format_size
from bigviz.modeling.process_memory import mapped_file_bytes, resident_bytes
from bigviz.ui.palette import chip
from bigviz.core.errors import UsageError

__all__ = ["memory_snapshot", "RunReport", "run_plan"]

Progress = Callable[[int, str], None]


def memory_snapshot(devices: Sequence[Device]) -> dict[Device, int]:
    """Memory in use now on each GPU of ``devices``, plus ``"cpu"`` and ``"disk"``."""
    out: dict[Device, int] = {}
    gpus = [d for d in devices if isinstance(d, int)]
    if gpus:
        import torch

        for g in gpus:
            out[g] = torch.cuda.memory_allocated(g) if torch.cuda.is_available() else 0
    out["cpu"] = resident_bytes()
    out["disk"] = mapped_file_bytes()
    return out


@dataclass(frozen=True)
class RunReport:
    """Predicted and measured bytes per device after a load."""

    planned: Mapping[Device, int]
    measured: Mapping[Device, int]
    seconds: float

    def rows(self) -> list[dict[str, Any]]:
        return [
            {"device": d, "planned": self.planned.get(d, 0), "measured": self.measured.get(d, 0)} for d in self.planned
        ]

    def html(self) -> str:
        body = "".join(
            f"<tr><td>{chip(r['device'])}</td><td class='num'>{format_size(r['planned'])}</td>"
            f"<td class='num'>{format_size(max(r['measured'], 0))}</td></tr>"
            for r in self.rows()
        )
        return (
            f"<div>Loaded and dispatched in {self.seconds:.1f} s.</div><table class='bigviz-table'>"
            f"<tr><th>device</th><th>planned</th><th>measured</th></tr>{body}</table>"
            "<div style='font-size:11px;color:#555'>GPU: memory_allocated growth; CPU: resident memory "
            "growth; disk: growth of file bytes mapped into the process.</div>"
        )


def run_plan(
    plan: DevicePlan,
    model: Any,
    checkpoint: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    progress: Progress | None = None,
    **kwargs: Any,
) -> tuple[Any, RunReport]:
    """Load ``checkpoint`` into ``model`` placed as ``plan`` says, and measure the result.

    Args:
        plan: the plan to execute (passed as ``device_map``).
        model: the ``nn.Module`` the plan was made for (on meta is fine).
        checkpoint: a weights file, an index file or a folder.
        dtype: floating dtype to load weights in (the plan's dtype); ``"int8"`` / ``"int4"``:
            the weights are quantized while they load (``quantization=``), as the plan sized them.
        progress: called with ``(step, message)`` for steps 1 to 3.
        **kwargs: passed to :func:`bigviz.engine.big_modeling.load_checkpoint_and_dispatch`
            (``offload_folder``, ``strict``, ``prefetch``, ...).

    Raises:
        ValueError: for a checkpoint path that does not exist.
    """
    import time

    from bigviz.engine.big_modeling import load_checkpoint_and_dispatch

    if not Path(checkpoint).exists():
        raise UsageError(
            f"checkpoint {str(checkpoint)!r} does not exist: give a weights file, an index "
            "file or a folder holding them"
        )
    if dtype in QUANT_METHODS:  # the plan sized them quantized: quantize them while they load
        kwargs.setdefault("quantization", dtype)
    elif dtype is not None and dtype not in FLOATING_DTYPES:
        raise UsageError(
            f"the plan sizes weights as {dtype}, which bigviz cannot load into: choose a "
            "floating dtype, int8, int4 (or 'as built') in the planner to run it"
        )
    elif dtype is not None:
        import torch

        kwargs.setdefault("dtype", getattr(torch, dtype))
    step = progress or (lambda i, msg: None)
    devices = [u.device for u in plan.usage]
    step(1, "measuring memory before loading")
    before = memory_snapshot(devices)
    start = time.perf_counter()
    step(2, f"loading {Path(checkpoint).name} and dispatching")
    model = load_checkpoint_and_dispatch(model, checkpoint, device_map=plan, **kwargs)
    seconds = time.perf_counter() - start
    after = memory_snapshot(devices)
    step(3, "done")
    planned = {u.device: u.used for u in plan.usage}
    measured = {d: after.get(d, 0) - before.get(d, 0) for d in planned}
    return model, RunReport(planned, measured, seconds)


def describe_error(err: BaseException) -> str:
    """An error as a short red HTML line."""
    return f"<div style='color:#D55E00'><b>{type(err).__name__}:</b> {html.escape(str(err))}</div>"
