"""Fetching for CPU execution: a unit's tensors *are* the store's, paged in ahead.

:class:`CpuFetcher` hands out the store's tensors themselves: zero-copy views of memory-mapped
safetensors files; nothing is copied. Fetched ahead (in a background thread), a unit's cold
pages are read in first: a page-cache hint for all of them, then
``madvise(MADV_POPULATE_READ)`` (:func:`bigviz.osio.pages.populate`) for each, so the compute
thread finds every page present. Asking ``mincore`` first (0.2 ms a block) skips the work when
they already are: populating costs CPU even then (85 ms per token for gpt2-large's 18 disk
blocks on 2 cores). With ``mps`` executing, tensors are copied there, synchronously.

Example:
    >>> import torch
    >>> from bigviz.engine.binding import bound_units
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> (unit,) = bound_units(model, {"0": "disk"}, main_device="cpu")
    >>> unit.sources = {k: {k: torch.ones(2)} for k in unit.slots}
    >>> sorted(CpuFetcher().start(unit, background=False).wait())
    ['0.bias', '0.weight']
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from bigviz.engine.binding import BoundUnit
from bigviz.engine.fetchers.protocol import Handle, cast, hint, read, run_now
from bigviz.engine.packed import PART, expand
from bigviz.engine.weights import nbytes
from bigviz.modeling.packed import split
from bigviz.osio.pages import available, page_residency, populate

__all__ = ["CpuFetcher", "paged_in", "page_in"]


def paged_in(tensor: Tensor) -> bool:
    """True if every page of ``tensor`` is in memory (unknown: False; not a CPU tensor, empty
    or pinned: True, nothing to page in)."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return True
    if not available():
        return tensor.is_pinned()
    status = page_residency(tensor.data_ptr(), nbytes(tensor))
    return status is not None and b"\x00" not in status


def page_in(store: Mapping[str, Tensor], tensors: Mapping[str, Tensor]) -> None:
    """Make the cold ones of ``tensors`` (read from ``store``) resident, from this thread."""
    flat = expand(tensors, {k: p for k, t in tensors.items() if (p := split(t)) is not None})  # packed: its parts
    cold = [key for key, tensor in flat.items() if not paged_in(tensor)]
    if cold:
        hint(store, list(dict.fromkeys(key.split(PART)[0] for key in cold)))  # the kernel reads them all at once ...
        for key in cold:
            tensor = flat[key]
            populate(tensor.data_ptr(), nbytes(tensor))  # ... and this waits for (and maps) each in turn


class CpuFetcher:
    """Zero-copy fetches for CPU execution, with page-in from a background thread.

    Args:
        device: The execution device. Not the CPU (``mps``): tensors are copied there,
            synchronously, as no stream API is shared with CUDA.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")
        self._executor: ThreadPoolExecutor | None = None

    def start(self, unit: BoundUnit, *, background: bool) -> Handle:
        if not background:
            return Handle(unit, run_now(self._job, unit, hint=False))
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="bigviz-prefetch")
        return Handle(unit, self._executor.submit(self._job, unit, hint=True))

    def _job(self, unit: BoundUnit, *, hint: bool) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for store, keys in unit.keys_by_source():
            tensors = {key: read(store, key) for key in keys}
            if hint:
                page_in(store, tensors)  # disk reads happen here, not in the compute thread
            if self.device.type != "cpu":
                tensors = {key: tensor.to(self.device) for key, tensor in tensors.items()}
            out.update({key: cast(unit, key, tensor) for key, tensor in tensors.items()})
        return out

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
