"""How much memory this process holds, and its peak over a block: the one helper the UI's
run report, the benchmarks, the tests and the notebooks measure with.

Two numbers matter for a model that does not fit:

* ``RssAnon``, anonymous resident memory: what the process really holds (weights copied
  into RAM, activations). It is what runs a machine out of memory.
* ``VmRSS`` (``RssAnon + RssFile + RssShmem``): also counts the pages of memory-mapped files
  (safetensors read in place), which the kernel can drop at will (page cache).

They are read from ``/proc/self/status`` (Linux, :func:`bigviz.osio.procfs.status_fields`);
elsewhere psutil's RSS stands for both.
A peak is sampled by a thread every ``interval`` seconds (a spike shorter than that can be
missed; ``max_rss`` is the kernel's own lifetime high-water mark to check against).

Example:
    >>> import mmap
    >>> with PeakMemory() as peak:
    ...     block = mmap.mmap(-1, 32 * 2**20, flags=mmap.MAP_PRIVATE)  # fresh anonymous pages
    ...     block[::4096] = b"x" * (32 * 2**20 // 4096)  # touched: now resident
    >>> peak.above()["RssAnon"] >= 32 * 2**20, rss_anon() > 0
    (True, True)
"""

from __future__ import annotations

import resource
import sys
import threading
from collections.abc import Sequence
from types import TracebackType

from bigviz.osio.procfs import mapped_file_bytes, status_fields

__all__ = [
    "status_bytes",
    "rss",
    "rss_anon",
    "resident_bytes",
    "mapped_file_bytes",
    "max_rss",
    "PeakMemory",
]

FIELDS = ("VmRSS", "RssAnon")


def status_bytes(*fields: str) -> dict[str, int]:
    """Fields of ``/proc/self/status`` in bytes (``{}`` where there is no such file; psutil's
    RSS for every field then).

    Example:
        >>> sorted(status_bytes("VmRSS", "RssAnon"))
        ['RssAnon', 'VmRSS']
    """
    found = status_fields(*fields)
    return found if found is not None else dict.fromkeys(fields, _psutil_rss())


def _psutil_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def rss_anon() -> int:
    """Anonymous resident bytes of this process (what can run a machine out of memory)."""
    return status_bytes("RssAnon")["RssAnon"]


def rss() -> int:
    """Resident bytes now (``VmRSS``: the measure ``max_rss`` peaks over)."""
    return status_bytes("VmRSS")["VmRSS"]


def resident_bytes() -> int:
    """Resident bytes, memory-mapped file pages included (``RssAnon + RssFile``)."""
    found = status_fields("RssAnon", "RssFile")
    return found["RssAnon"] + found["RssFile"] if found is not None else _psutil_rss()


def max_rss() -> int:
    """The kernel's lifetime peak RSS of this process, in bytes (``ru_maxrss``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


class PeakMemory:
    """The peak of ``fields`` of ``/proc/self/status`` over a block, sampled in a thread.

    Attributes:
        base: the values when sampling started.
        peak: the highest value of each field seen in the current window.

    Example:
        >>> import mmap
        >>> with PeakMemory(("RssAnon",), interval=0.001) as peak:
        ...     first = peak.take()          # the first window's peaks; a new one starts
        ...     block = mmap.mmap(-1, 16 * 2**20, flags=mmap.MAP_PRIVATE)
        ...     block[::4096] = b"x" * (16 * 2**20 // 4096)
        >>> peak.peak["RssAnon"] - first["RssAnon"] >= 16 * 2**20
        True
    """

    def __init__(self, fields: Sequence[str] = FIELDS, *, interval: float = 0.002) -> None:
        self.fields = tuple(fields)
        self.interval = interval
        self.base = status_bytes(*self.fields)
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bigviz-peak-memory")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> dict[str, int]:
        """Read the fields now and raise the peaks; returns what was read."""
        now = status_bytes(*self.fields)
        for key, value in now.items():
            if value > self.peak[key]:
                self.peak[key] = value
        return now

    def take(self) -> dict[str, int]:
        """The peaks of the window so far; the next window starts from the values now."""
        now = self.sample()
        peak, self.peak = self.peak, dict(now)
        return peak

    def above(self) -> dict[str, int]:
        """How far each peak rose above ``base``."""
        return {key: self.peak[key] - self.base[key] for key in self.fields}

    def start(self) -> PeakMemory:
        self.base = status_bytes(*self.fields)
        self.peak = dict(self.base)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def __enter__(self) -> PeakMemory:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()
