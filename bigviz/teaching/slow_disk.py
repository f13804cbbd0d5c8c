"""A checkpoint read as if from a slower device: reads that cost time whatever the CPU load.

Prefetch hides the time a block's weights take to arrive behind the time the block before
computes. On a fast local disk whose pages the kernel reads ahead of the faults, there is
little left to hide, and the wall-clock difference is decided by the CPU load of the moment.
A device of known bandwidth makes the demonstration one a reader can check by hand:
:class:`SlowDisk` copies each tensor out of the checkpoint (from the page cache or the disk)
into fresh memory, then waits until the read would have ended on a device of ``bandwidth``
bytes/s, one read at a time as on one device (two threads reading at once share it). Waiting
holds no core, so other programs keeping the cores busy do not change how long a read takes:
the time of a cloud volume at its baseline (AWS gp3: 125 MiB/s), a hard disk or a network
filesystem, not of this machine's disk.

It is a ``Mapping[str, Tensor]``, the seam between storage and bigviz's hooks: pass it as the
``weights`` of :func:`bigviz.dispatch_model` for a model built on ``meta``, and every
offloaded block is read through it at forward time. Each read is logged in :attr:`SlowDisk.reads`.

Example:
    >>> import pathlib, tempfile, torch, bigviz
    >>> folder = bigviz.save_sharded({"w": torch.zeros(1024)}, pathlib.Path(tempfile.mkdtemp()) / "c",
    ...                              progress=False)
    >>> with SlowDisk.open(folder, "1MiB/s") as disk:
    ...     w = disk["w"]  # 4 KiB at 1 MiB/s: about 4 ms
    >>> read = disk.reads[0]
    >>> read.nbytes, read.end - read.start >= 4096 / 2**20
    (4096, True)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from bigviz.checkpoint.index import CheckpointIndex
from bigviz.checkpoint.lazy import LazyWeights
from bigviz.core.errors import UsageError
from bigviz.core.sizes import format_size, parse_size

__all__ = ["SlowDisk", "Read", "parse_bandwidth"]


@dataclass(frozen=True)
class Read:
    """One tensor read: its name, the native id of the thread that read it, when the device
    began and finished it (``time.perf_counter()`` seconds) and its bytes."""

    name: str
    thread: int
    start: float
    end: float
    nbytes: int


def parse_bandwidth(bandwidth: float | str) -> float:
    """Bytes per second from ``2e8`` or ``"200MiB/s"`` (a size as ``parse_size`` reads it, per second).

    Example:
        >>> parse_bandwidth("200MiB/s"), parse_bandwidth(1e9)
        (209715200.0, 1000000000.0)
    """
    value = float(parse_size(bandwidth.strip().removesuffix("/s"))) if isinstance(bandwidth, str) else float(bandwidth)
    if not value > 0:
        raise UsageError(f"bandwidth {bandwidth!r} must be more than 0 bytes per second, e.g. '200MiB/s'")
    return value


class SlowDisk(Mapping[str, Tensor]):
    """Tensors of ``weights``, each copied out and delivered at ``bandwidth`` bytes/s at most.

    Args:
        weights: name -> tensor (e.g. :class:`~bigviz.checkpoint.lazy.LazyWeights` over a
            checkpoint: :meth:`open` makes one).
        bandwidth: bytes per second, or a string such as ``"200MiB/s"``.

    Attributes:
        reads: every read so far, in the order they finished (:class:`Read`).
    """

    def __init__(self, weights: Mapping[str, Tensor], bandwidth: float | str) -> None:
        self.weights = weights
        self.bandwidth = parse_bandwidth(bandwidth)
        self.reads: list[Read] = []
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the device finishes the reads already asked of it
        self._owned: Any = None

    @classmethod
    def open(cls, checkpoint: str | Path | CheckpointIndex, bandwidth: float | str) -> SlowDisk:
        """Every tensor of a checkpoint (folder, index or file), under its checkpoint name."""
        index = CheckpointIndex.open(checkpoint)
        weights = LazyWeights(index, {name: name for name in index.keys()})
        disk = cls(weights, bandwidth)
        disk._owned = weights
        return disk

    def __getitem__(self, name: str) -> Tensor:
        source = self.weights[name]
        asked = time.perf_counter()
        copy = source.clone()  # the bytes, read: from the page cache, or the disk when cold
        nbytes = copy.numel() * copy.element_size()
        with self._lock:  # one device: a read starts once the ones before it are done
            start = max(asked, self._free_at)
            self._free_at = end = start + nbytes / self.bandwidth
        time.sleep(max(0.0, end - time.perf_counter()))  # no core held meanwhile
        self.reads.append(Read(name, threading.get_native_id(), start, max(end, time.perf_counter()), nbytes))
        return copy

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)

    def __contains__(self, name: object) -> bool:
        return name in self.weights

    def seconds_for(self, nbytes: int) -> float:
        """How long this device takes to read ``nbytes``."""
        return nbytes / self.bandwidth

    def close(self) -> None:
        """Close the checkpoint files :meth:`open` mapped (a no-op for ``weights`` given)."""
        if self._owned is not None:
            self._owned.close()
            self._owned = None

    def __enter__(self) -> SlowDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SlowDisk({len(self)} tensors at {format_size(self.bandwidth)}/s)"
