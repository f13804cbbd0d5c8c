"""How fast a checkpoint's disk reads, cold: a quick probe, cached per filesystem.

The planner predicts the time of a forward pass that streams weights from disk from the
bytes it streams and the disk's read bandwidth (`bigviz.core.cost`). That bandwidth is
measured here on the checkpoint's own files: ``sample_bytes`` read by one reader
(``sequential``) and another ``sample_bytes`` by ``parallel`` readers, each reading its own
contiguous part (``parallel``: what a fetcher with several readers gets; on the virtual disk
this was written on, four readers read about twice as fast as one).

A cold read must come from the disk, not from the page cache. By default (method
``"dropped"``, what ``"auto"`` picks on Linux) the sampled range is dropped from the page
cache first (``posix_fadvise(DONTNEED)``) and read through it, as the engine's readers read
(with the kernel's read-ahead: on the virtual disk this was written on, buffered readers got
1.0 GB/s where ``O_DIRECT`` ones got 0.65); the probe then leaves the cache as it found it:
pages it brought in are dropped again, pages that were resident before stay resident (they
were just read). With ``O_DIRECT`` (method ``"direct"``, the fallback where ``mincore`` is
missing) the page cache is bypassed: nothing is evicted, nothing is added. Files are opened read-only;
nothing is ever written to them.

Results are cached in ``$XDG_CACHE_HOME/bigviz/disk-bandwidth.json`` (``~/.cache`` without
it), one entry per device, and measured again when the filesystem on that device changed,
the entry is older than ``max_age``, another reader count or a larger sample is asked for,
or ``refresh=True``. The probe writes that one file (atomically, through a temporary file of
its own) and never overwrites a file there that it did not write.

Example:
    >>> import os, tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (folder / "model.safetensors").write_bytes(os.urandom(2**20))
    >>> probe = measure_read_bandwidth(folder, parallel=2, sample_bytes=2**18, cache=False)
    >>> probe.readers, probe.sample_bytes, probe.parallel > 0 and probe.sequential > 0
    (2, 262144, True)
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from bigviz.osio.direct import ALIGN, open_file
from bigviz.osio.pages import PAGE, available, cached_pages, drop_file_pages, huge_anonymous
from bigviz.osio.procfs import mount_of
from bigviz.core.errors import UsageError

__all__ = ["DiskProbe", "ReadTiming", "measure_read_bandwidth", "timed_read", "split_ranges", "cache_file"]

CACHE_FORMAT = "bigviz-disk-probe"
CACHE_VERSION = 2  # 2: 'auto' measures buffered cold reads (as the engine reads)
MONTH = 30 * 24 * 3600.0

Range = tuple[Path, int, int]  # (file, offset, length)


# ------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class DiskProbe:
    """Cold read bandwidth of one device, as measured (or found in the cache).

    Attributes:
        device: The device's ``major:minor`` (``st_dev`` of the sampled files).
        filesystem: ``"fstype source mountpoint"`` of that device (from
            ``/proc/self/mountinfo``; empty where unknown): a cached entry is only used
            while it matches.
        sequential: Bytes per second, one reader.
        parallel: Bytes per second, ``readers`` readers together.
        readers: How many readers ``parallel`` used.
        sample_bytes: Bytes read for each of the two figures.
        chunk_bytes: Bytes per read request.
        method: ``"direct"`` (O_DIRECT), ``"dropped"`` (page cache dropped first) or
            ``"buffered"`` (neither was possible: the figure may be the page cache's).
        measured_at: When it was measured (seconds since the epoch).
        cached: True when this came from the cache file rather than a measurement now.
    """

    device: str
    filesystem: str
    sequential: float
    parallel: float
    readers: int
    sample_bytes: int
    chunk_bytes: int
    method: str
    measured_at: float
    cached: bool = False

    @property
    def bandwidth(self) -> float:
        """The best of the two figures: what a fetcher with enough readers can expect."""
        return max(self.sequential, self.parallel)

    def __str__(self) -> str:
        return (
            f"disk {self.device} ({self.filesystem or 'unknown filesystem'}): "
            f"{self.sequential / 1e9:.2f} GB/s with 1 reader, {self.parallel / 1e9:.2f} GB/s with "
            f"{self.readers} ({self.method}, {self.sample_bytes / 2**20:.0f} MiB each"
            f"{', cached' if self.cached else ''})"
        )


@dataclass(frozen=True)
class ReadTiming:
    """What one timed read did: bytes, wall seconds, and CPU seconds of this process."""

    bytes: int
    seconds: float
    cpu_seconds: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second (0 for an empty read)."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


# --------------------------------------------------------------------------- reading
def split_ranges(ranges: Sequence[Range], parts: int, *, align: int = ALIGN) -> list[list[Range]]:
    """Cut ``ranges`` (read in order) into ``parts`` contiguous pieces of about equal bytes.

    Cuts fall on multiples of ``align`` from each range's start (so ``O_DIRECT`` reads of
    aligned ranges stay aligned); a part may run a little over its share to get there.
    Empty pieces are left out.

    Example:
        >>> p = Path("f")
        >>> [[(r[1], r[2]) for r in part] for part in split_ranges([(p, 0, 10), (p, 20, 6)], 2, align=1)]
        [[(0, 8)], [(8, 2), (20, 6)]]
        >>> [[(r[1], r[2]) for r in part] for part in split_ranges([(p, 0, 10), (p, 20, 6)], 2, align=4)]
        [[(0, 8)], [(8, 2), (20, 6)]]
    """
    total = sum(length for _, _, length in ranges)
    quota = max(align, -(-total // max(1, parts) // align) * align)
    out: list[list[Range]] = [[]]
    room = quota
    for path, offset, length in ranges:
        while length > 0:
            take = length if length <= room else room - room % align  # cut on an aligned offset
            if take == 0:  # less than one aligned step left in this part: the rest goes on
                take = min(length, align)
            out[-1].append((path, offset, take))
            offset, length, room = offset + take, length - take, room - take
            if room <= 0:
                out.append([])
                room = quota
    return [part for part in out if part]


def timed_read(
    ranges: Sequence[Range], *, readers: int = 1, chunk_bytes: int = 4 * 2**20, direct: bool = False
) -> ReadTiming:
    """Read ``ranges`` with ``readers`` threads (each a contiguous part), timing it.

    Each reader reads its part in ``chunk_bytes`` requests into one reusable buffer, made
    (of huge pages) and touched before the clock starts, so nothing is kept and the time is
    the disk's, not the first touch of new memory. With ``direct`` the files are opened ``O_DIRECT`` (the page
    cache is neither read nor filled); offsets must then be multiples of 4096.

    Raises:
        OSError: a file cannot be opened or read (``EINVAL`` when ``direct`` is refused).

    Example:
        >>> import tempfile
        >>> p = Path(tempfile.mkdtemp()) / "x"; _ = p.write_bytes(b"a" * 10000)
        >>> timed_read([(p, 0, 10000)], readers=2, chunk_bytes=4096).bytes
        10000
    """
    parts = split_ranges(ranges, readers)
    chunk = max(ALIGN, chunk_bytes // ALIGN * ALIGN)
    buffers = [_buffer(chunk) for _ in parts]  # made and touched before the clock, as the ring's memory
    try:
        cpu, start = time.process_time(), time.perf_counter()
        if len(parts) <= 1:
            done = [_read_part(part, view, direct) for part, (_, view) in zip(parts, buffers)]
        else:
            with ThreadPoolExecutor(len(parts), thread_name_prefix="bigviz-probe") as pool:
                done = list(pool.map(lambda job: _read_part(job[0], job[1][1], direct), zip(parts, buffers)))
        seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu
    finally:
        for block, view in buffers:
            view.release()
            block.close()
    return ReadTiming(bytes=sum(done), seconds=seconds, cpu_seconds=cpu_seconds)


def _buffer(chunk: int) -> tuple[mmap.mmap, memoryview]:
    """A reader's buffer of ``chunk`` bytes from a huge page (reads into 2 MiB pages reach the
    disk as larger requests, as the ring's do: :func:`bigviz.osio.pages.hugepages`), touched."""
    block, skip = huge_anonymous(chunk)
    view = memoryview(block)[skip : skip + chunk]
    view[:] = bytes(chunk)
    return block, view


def _read_part(part: Sequence[Range], view: memoryview, direct: bool) -> int:
    got = 0
    for path, offset, length in part:
        with open_file(path, direct=direct) as fd:
            got += _read_range(fd, view, offset, length)
    return got


def _read_range(fd: int, view: memoryview, offset: int, length: int) -> int:
    got, end = 0, offset + length
    while offset < end:
        want = min(len(view), end - offset)
        asked = -(-want // ALIGN) * ALIGN  # O_DIRECT lengths are whole blocks (short at EOF)
        n = os.preadv(fd, [view[:asked]], offset)
        if n <= 0:
            break  # end of file
        got += min(n, want)
        offset += n
    return got


def _drop_new_pages(path: Path, offset: int, before: bytes) -> None:
    """Drop the pages of a range that were not resident before (runs of zeros in ``before``)."""
    first = offset - offset % PAGE
    i = 0
    while i < len(before):
        if before[i]:
            i += 1
            continue
        j = i
        while j < len(before) and not before[j]:
            j += 1
        drop_file_pages(path, first + i * PAGE, (j - i) * PAGE)
        i = j


def _cold_read(ranges: Sequence[Range], readers: int, chunk: int, method: str) -> ReadTiming:
    """Time a read of ``ranges`` that must come from the disk, leaving the cache as found."""
    if method == "direct":
        return timed_read(ranges, readers=readers, chunk_bytes=chunk, direct=True)
    if method == "buffered":
        return timed_read(ranges, readers=readers, chunk_bytes=chunk)
    # whole files: the kernel's read-ahead brings in pages past the end of a range too
    before = {path: cached_pages(path) for path in dict.fromkeys(path for path, _, _ in ranges)}
    for path, offset, length in ranges:
        drop_file_pages(path, offset, length)
    try:
        return timed_read(ranges, readers=readers, chunk_bytes=chunk)
    finally:  # pages resident before were just read again; the others are dropped again
        for path, was in before.items():
            if was is not None:
                _drop_new_pages(path, 0, was)


# --------------------------------------------------------------------------- sampling
def _sample_files(path: Path) -> list[Path]:
    """The files to read: ``path`` itself, the shards an index names, or a folder's files;
    links resolved (a hub cache links to blobs), largest device first."""
    if not path.exists():
        raise FileNotFoundError(
            f"measure_read_bandwidth: {path} does not exist; give a checkpoint "
            "file, its index, or the folder holding it"
        )
    if path.is_dir():
        files = [p for p in sorted(path.iterdir()) if not p.name.startswith(".")]
    elif path.name.endswith(".json"):
        files = _index_files(path)
    else:
        files = [path]
    files = [p.resolve() for p in files if p.is_file() and p.stat().st_size > 0]
    if not files:
        raise UsageError(
            f"measure_read_bandwidth: {path} holds no non-empty file to read; give a "
            "checkpoint file, its index, or the folder holding it"
        )
    by_device: dict[int, list[Path]] = {}
    for p in files:
        by_device.setdefault(p.stat().st_dev, []).append(p)
    biggest = max(by_device.values(), key=lambda ps: sum(p.stat().st_size for p in ps))
    return sorted(biggest, key=lambda p: (-p.stat().st_size, str(p)))


def _index_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except (ValueError, AttributeError) as exc:
        raise UsageError(
            f"measure_read_bandwidth: {index} is not a checkpoint index "
            f"({type(exc).__name__}: {exc}); give the folder or a weights file"
        ) from None
    return [index.parent / name for name in sorted(set(weight_map.values()))]


def _sample_ranges(files: Sequence[Path], begin: int, length: int) -> list[Range]:
    """Bytes ``[begin, begin + length)`` of the files laid end to end (4096-aligned offsets)."""
    out: list[Range] = []
    position = 0  # a multiple of ALIGN: every range starts aligned in its file
    for path in files:
        size = path.stat().st_size
        usable = size - size % ALIGN or size  # a file's unaligned tail is left out (not a small file)
        lo, hi = max(begin, position), min(begin + length, position + usable)
        if hi > lo:
            out.append((path, lo - position, hi - lo))
        position += -(-usable // ALIGN) * ALIGN
    return out


# ----------------------------------------------------------------------------- cache
def cache_file() -> Path:
    """``$XDG_CACHE_HOME/bigviz/disk-bandwidth.json`` (``~/.cache/...`` without it).

    Example:
        >>> cache_file().name
        'disk-bandwidth.json'
    """
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "bigviz" / "disk-bandwidth.json"


def _load_cache(path: Path) -> dict[str, dict] | None:
    """The cache's entries; ``{}`` when there is no file; None when the file is not ours."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != CACHE_FORMAT or not isinstance(doc.get("entries"), dict):
        return None
    return doc["entries"] if doc.get("version") == CACHE_VERSION else {}


def _store(path: Path, probe: DiskProbe) -> None:
    """Record ``probe`` in the cache file (atomically); a file that is not ours is left alone."""
    entries = _load_cache(path)
    if entries is None:
        warnings.warn(
            f"{path} exists and was not written by bigviz's disk probe: left as it is, "
            "the measurement is not cached (move that file away to enable caching)",
            stacklevel=3,
        )
        return
    entries[probe.device] = {k: v for k, v in asdict(probe).items() if k != "cached"}
    doc = {"format": CACHE_FORMAT, "version": CACHE_VERSION, "entries": entries}
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        os.replace(temp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            temp.unlink()  # our own temporary file only
        warnings.warn(f"could not write the disk-probe cache {path}: {exc}", stacklevel=3)


def _cached(
    path: Path, device: str, filesystem: str, *, readers: int, sample_bytes: int, max_age: float
) -> DiskProbe | None:
    entry = (_load_cache(path) or {}).get(device)
    if not isinstance(entry, dict):
        return None
    try:
        probe = DiskProbe(**entry, cached=True)
    except TypeError:
        return None  # an entry from another layout: measure again
    fresh = time.time() - probe.measured_at <= max_age
    same = probe.filesystem == filesystem and probe.readers == readers
    return probe if fresh and same and probe.sample_bytes >= sample_bytes else None


# --------------------------------------------------------------------------- devices
def _identity(st_dev: int) -> tuple[str, str]:
    """``("major:minor", "fstype source mountpoint")`` of a device (filesystem "" if unknown)."""
    return f"{os.major(st_dev)}:{os.minor(st_dev)}", mount_of(os.major(st_dev), os.minor(st_dev))


def _method(files: Sequence[Path], requested: str) -> str:
    if requested != "auto":
        return requested
    if hasattr(os, "posix_fadvise") and available():
        return "dropped"  # buffered reads, as the engine reads (kernel read-ahead included)
    try:
        with open_file(files[0], direct=True) as fd:  # tmpfs and some others refuse O_DIRECT
            buffer = mmap.mmap(-1, ALIGN)
            try:
                os.preadv(fd, [buffer], 0)
            finally:
                buffer.close()
        return "direct"
    except (OSError, AttributeError):
        return "dropped" if hasattr(os, "posix_fadvise") and available() else "buffered"


# ------------------------------------------------------------------------------- probe
def measure_read_bandwidth(
    path: str | os.PathLike[str],
    *,
    parallel: int = 4,
    sample_bytes: int = 512 * 2**20,
    chunk_bytes: int = 16 * 2**20,
    cache: bool = True,
    refresh: bool = False,
    max_age: float = MONTH,
    method: str = "auto",
) -> DiskProbe:
    """Cold read bandwidth of the disk holding ``path``, with one reader and with ``parallel``.

    Args:
        path: A checkpoint folder, its index (``*.index.json``), or any file on the disk.
        parallel: Readers for the parallel figure.
        sample_bytes: Bytes read for each figure (two different ranges when the files hold
            enough; fewer when they hold less).
        chunk_bytes: Bytes per read request. With ``O_DIRECT`` nothing reads ahead: the bytes
            in flight are ``parallel x chunk_bytes``, and on the virtual disk this was
            written on 64 MiB in flight (4 x 16 MiB) reached twice the bandwidth of 16 MiB.
        cache: Use and update the cache file (:func:`cache_file`).
        refresh: Measure even when the cache has a valid entry.
        max_age: Seconds a cached entry stays valid.
        method: ``"auto"`` (O_DIRECT where the filesystem allows it, else drop the range
            from the page cache first), or ``"direct"`` / ``"dropped"`` / ``"buffered"``.

    Returns:
        A :class:`DiskProbe` (``cached=True`` when it came from the cache).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` holds nothing to read, or a knob is out of range.

    Example:
        >>> import os, tempfile, pathlib
        >>> f = pathlib.Path(tempfile.mkdtemp()) / "w.bin"; _ = f.write_bytes(os.urandom(2**19))
        >>> measure_read_bandwidth(f, parallel=2, sample_bytes=2**18, cache=False).method in (
        ...     "direct", "dropped", "buffered")
        True
    """
    _check_knobs(parallel=parallel, sample_bytes=sample_bytes, chunk_bytes=chunk_bytes, method=method)
    files = _sample_files(Path(path))
    device, filesystem = _identity(files[0].stat().st_dev)
    where = cache_file()
    if cache and not refresh:
        hit = _cached(where, device, filesystem, readers=parallel, sample_bytes=sample_bytes, max_age=max_age)
        if hit is not None:
            return hit
    probe = _measure(
        files,
        device,
        filesystem,
        parallel=parallel,
        sample_bytes=sample_bytes,
        chunk_bytes=chunk_bytes,
        method=_method(files, method),
    )
    if cache:
        _store(where, probe)
    return probe


def _check_knobs(*, parallel: int, sample_bytes: int, chunk_bytes: int, method: str) -> None:
    problems = []
    if not isinstance(parallel, int) or parallel < 1:
        problems.append(f"parallel={parallel!r} must be an int >= 1 (readers)")
    if not isinstance(sample_bytes, int) or sample_bytes < ALIGN:
        problems.append(f"sample_bytes={sample_bytes!r} must be an int >= {ALIGN}")
    if not isinstance(chunk_bytes, int) or chunk_bytes < ALIGN:
        problems.append(f"chunk_bytes={chunk_bytes!r} must be an int >= {ALIGN}")
    if method not in ("auto", "direct", "dropped", "buffered"):
        problems.append(f"method={method!r} must be 'auto', 'direct', 'dropped' or 'buffered'")
    if problems:
        raise UsageError("measure_read_bandwidth: " + "; ".join(problems))


def _measure(
    files: Sequence[Path],
    device: str,
    filesystem: str,
    *,
    parallel: int,
    sample_bytes: int,
    chunk_bytes: int,
    method: str,
) -> DiskProbe:
    span = sum(p.stat().st_size for p in files)
    sample = -(-sample_bytes // ALIGN) * ALIGN
    second = sample if span >= 2 * sample else 0  # another range when there is room: nothing warm
    one = _cold_read(_sample_ranges(files, 0, sample), 1, chunk_bytes, method)
    many = _cold_read(_sample_ranges(files, second, sample), parallel, chunk_bytes, method)
    return DiskProbe(
        device=device,
        filesystem=filesystem,
        sequential=one.bandwidth,
        parallel=many.bandwidth,
        readers=parallel,
        sample_bytes=min(one.bytes, many.bytes),
        chunk_bytes=chunk_bytes,
        method=method,
        measured_at=time.time(),
    )
