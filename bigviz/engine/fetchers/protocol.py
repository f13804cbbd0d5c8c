"""What every fetcher is: a unit's weights brought to the execution device, now or ahead.

A fetcher reads one offload unit's tensors (:meth:`Fetcher.start`, in the background or now)
and hands back a :class:`Handle`; :meth:`Handle.wait` gives key -> tensor, ready on the
execution device, or raises :class:`~bigviz.core.errors.FetchError` naming the unit (a read
that failed in the background fails here, in the caller). *When* units are fetched is the
scheduler's (:mod:`bigviz.engine.scheduler`); *which* fetcher a dispatch uses is its stream
plan's (:mod:`bigviz.core.stream_plan`). The fetchers, one per way of reading:

* :class:`~bigviz.engine.fetchers.cpu.CpuFetcher`: zero-copy views of memory-mapped files,
  paged in ahead (the CPU executes and the model fits in RAM);
* :class:`~bigviz.engine.fetchers.cuda.CudaFetcher`: copies to a GPU on a side stream,
  through pinned staging buffers;
* :class:`~bigviz.engine.fetchers.ring.RingFetcher`: ``O_DIRECT`` reads into one reused
  ring (the CPU executes a model larger than RAM);
* :class:`~bigviz.engine.fetchers.cache.StreamingFetcher`: read into the page cache ahead,
  dropped after use (``stream="cache"``).

Example:
    >>> import torch
    >>> from bigviz.engine.binding import bound_units
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> (unit,) = bound_units(model, {"0": "disk"}, main_device="cpu")
    >>> unit.sources = {k: {k: torch.ones(2)} for k in unit.slots}
    >>> handle = Handle(unit, run_now(lambda: {"w": torch.ones(1)}))
    >>> handle.wait()["w"].item()
    1.0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import torch
from torch import Tensor

from bigviz.core.errors import FetchError
from bigviz.engine.binding import BoundUnit
from bigviz.modeling.packed import split

__all__ = ["FetchError", "Handle", "Fetcher", "run_now", "verify", "read", "hint", "cast"]

_PLAIN = (Tensor, torch.nn.Parameter)


class Handle:
    """A fetch of one unit, done or in flight; :meth:`wait` gives key -> ready tensor."""

    def __init__(self, unit: BoundUnit, result: Future, *, device: torch.device | None = None) -> None:
        self.unit = unit
        self._result = result
        self._device = device  # CUDA only: whose current stream must wait for the copies

    def add_done_callback(self, fn: Any) -> None:
        """Call ``fn(future)`` once the fetch is done (at once if it is): a timeline's read end."""
        self._result.add_done_callback(fn)

    def wait(self) -> dict[str, Tensor]:
        """The unit's tensors, ready to be used on the current stream.

        Raises:
            FetchError: the read failed (in the background or here), naming the unit.
        """
        try:
            result = self._result.result()
            verify(self.unit)  # read ahead, maybe before a file changed: check it is unchanged now
        except Exception as exc:
            raise FetchError(
                f"fetching the weights of {self.unit.name!r} (offloaded to {self.unit.storage}) failed: {exc}"
            ) from exc
        if isinstance(result, tuple):  # CUDA: (tensors, event recorded after the copies)
            tensors, event = result
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(event)
            for tensor in tensors.values():
                tensor.record_stream(stream)  # freed only once the compute stream is done
            return tensors
        return result


class Fetcher(Protocol):
    def start(self, unit: BoundUnit, *, background: bool) -> Handle: ...

    def close(self) -> None: ...


def run_now(fn: Any, *args: Any, **kwargs: Any) -> Future:
    """Run ``fn`` here, returning a finished Future: errors surface in ``Handle.wait`` as
    they do for background fetches, with the unit named."""
    future: Future = Future()
    try:
        future.set_result(fn(*args, **kwargs))
    except Exception as exc:
        future.set_exception(exc)
    return future


def verify(unit: BoundUnit) -> None:
    """Check the files behind the unit's tensors are unchanged (one ``fstat`` per file), so a
    shard truncated between forwards is an error here, not a SIGBUS in the compute thread."""
    for store, keys in unit.keys_by_source():
        verify = getattr(store, "verify", None)
        if verify is not None:
            verify(keys)


def read(store: Mapping[str, Tensor], key: str) -> Tensor:
    try:
        return store[key]
    except Exception as exc:
        raise FetchError(f"reading {key!r}: {type(exc).__name__}: {exc}") from exc


def hint(store: Mapping[str, Tensor], keys: Sequence[str]) -> None:
    prefetch = getattr(store, "prefetch", None)
    if prefetch is not None:
        prefetch(keys)  # page-cache hint: the kernel reads ahead while we compute


def cast(unit: BoundUnit, key: str, tensor: Tensor) -> Tensor:
    want = unit.dtypes.get(key)
    if want is None or tensor.dtype == want or (type(tensor) not in _PLAIN and split(tensor) is not None):
        return tensor  # (a packed weight has the dtype of its format: never cast)
    return tensor.to(want)
