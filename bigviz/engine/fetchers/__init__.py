"""The fetchers: how an offload unit's weights reach the execution device, one class per way.

* :mod:`~bigviz.engine.fetchers.protocol`: what every fetcher is (``start``, ``close``; a
  :class:`~bigviz.engine.fetchers.protocol.Handle` to wait on);
* :mod:`~bigviz.engine.fetchers.cpu`: zero-copy views of memory-mapped files, paged in ahead;
* :mod:`~bigviz.engine.fetchers.cuda`: copies to a GPU through pinned staging buffers;
* :mod:`~bigviz.engine.fetchers.ring`: ``O_DIRECT`` reads into one reused ring (a model
  larger than RAM, the CPU executing);
* :mod:`~bigviz.engine.fetchers.cache`: read into the page cache ahead, dropped after use;
* :mod:`~bigviz.engine.fetchers.spans`: where a memory-mapped tensor lies in its file.

Which one a dispatch uses is its stream plan's (``DispatchPlan.stream.fetcher``, decided in
:mod:`bigviz.core.stream_plan`); :func:`make_fetcher` only makes the one named. *When* units
are fetched is :mod:`bigviz.engine.scheduler`'s.

Example:
    >>> import torch
    >>> type(make_fetcher("cpu", [], torch.device("cpu"), readers=4, background=True)).__name__
    'CpuFetcher'
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bigviz.engine.binding import BoundUnit
from bigviz.engine.fetchers.protocol import Fetcher
from bigviz.core.errors import UsageError
from bigviz.core.stream_plan import RING_AHEAD

__all__ = ["make_fetcher"]


def make_fetcher(
    kind: str,
    units: Sequence[BoundUnit],
    device: torch.device,
    *,
    readers: int,
    background: bool,
    ahead: float = RING_AHEAD,
) -> Fetcher:
    """The fetcher a stream plan names (``"cpu"``, ``"cuda"``, ``"ring"``, ``"cache"``), for
    ``units`` executing on ``device``. A ring is sized for the streamed disk units here: the
    largest unit and ``ahead`` of one more (the plan's ``ring_ahead``), rounded up to whole
    blocks of the reads their files need.

    Raises:
        ValueError: an unknown kind (a stream plan made elsewhere).
    """
    if kind == "cuda":
        from bigviz.engine.fetchers.cuda import CudaFetcher

        return CudaFetcher(device, units, background=background)
    if kind == "ring":
        from bigviz.engine.fetchers.ring import RingFetcher

        ring = RingFetcher(readers=readers)
        ring.prepare([u for u in units if u.storage == "disk"], ahead)
        return ring
    if kind == "cache":
        from bigviz.engine.fetchers.cache import StreamingFetcher

        return StreamingFetcher(readers=readers)
    if kind in ("cpu", ""):
        from bigviz.engine.fetchers.cpu import CpuFetcher

        return CpuFetcher(device)
    raise UsageError(f"unknown fetcher kind {kind!r}: expected 'cpu', 'cuda', 'ring' or 'cache'")
