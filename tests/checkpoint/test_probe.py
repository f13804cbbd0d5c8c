"""The disk probe: what it reads, what it caches, what it leaves behind (no timing asserted)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from bigviz.checkpoint import probe as probe_module
from bigviz.checkpoint.probe import (
    CACHE_VERSION,
    DiskProbe,
    cache_file,
    measure_read_bandwidth,
    split_ranges,
    timed_read,
)
from bigviz.osio.pages import cached_pages as resident_pages
from bigviz.osio.pages import drop_file_pages

MiB = 2**20
SMALL = dict(parallel=2, sample_bytes=MiB // 2, chunk_bytes=128 * 1024)


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own cache folder: the user's real cache is never touched."""
    home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    """A checkpoint-like folder: two shards of random bytes (sizes not page multiples), an index."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model-00001-of-00002.safetensors").write_bytes(os.urandom(MiB + 123))
    (folder / "model-00002-of-00002.safetensors").write_bytes(os.urandom(MiB // 2 + 7))
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


class CountReads:
    """Wraps ``timed_read`` to count the bytes the probe reads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[int] = []
        real = probe_module.timed_read

        def counted(ranges, **knobs):
            timing = real(ranges, **knobs)
            self.calls.append(timing.bytes)
            return timing

        monkeypatch.setattr(probe_module, "timed_read", counted)


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


# ----------------------------------------------------------------------------- reading
def test_split_ranges_covers_every_byte_once_on_aligned_cuts() -> None:
    a, b = Path("a"), Path("b")
    ranges = [(a, 0, 10_000), (b, 8192, 5_003), (a, 20_480, 1)]
    for parts in (1, 2, 3, 7, 50):
        pieces = split_ranges(ranges, parts)
        assert 1 <= len(pieces) <= max(parts, 1) + 1
        flat = [r for part in pieces for r in part]
        covered: dict[Path, list[tuple[int, int]]] = {}
        for path, offset, length in flat:
            assert length > 0
            covered.setdefault(path, []).append((offset, offset + length))
        for path, offset, length in ranges:  # each input range is tiled exactly, in order
            spans = [s for s in covered[path] if offset <= s[0] < offset + length]
            assert spans[0][0] == offset and spans[-1][1] == offset + length
            assert all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
            assert all((s[0] - offset) % 4096 == 0 for s in spans)  # cuts stay aligned to the range


def test_timed_read_reads_exactly_the_ranges(shards: Path) -> None:
    f = shards / "model-00001-of-00002.safetensors"
    for readers in (1, 3):
        for direct in (False, True):
            try:
                timing = timed_read(
                    [(f, 0, MiB + 123), (f, 4096, 100)], readers=readers, chunk_bytes=64 * 1024, direct=direct
                )
            except OSError:
                assert direct  # a filesystem without O_DIRECT (tmpfs) refuses it; buffered reads never fail
                continue
            assert timing.bytes == MiB + 123 + 100
            assert timing.seconds > 0 and timing.cpu_seconds >= 0 and timing.bandwidth > 0


def test_resident_pages_sees_the_page_cache(shards: Path) -> None:
    f = shards / "model-00002-of-00002.safetensors"
    f.read_bytes()
    pages = resident_pages(f)
    if pages is None:
        pytest.skip("mincore is not available on this platform")
    assert len(pages) == -(-f.stat().st_size // os.sysconf("SC_PAGE_SIZE"))
    assert set(pages) <= {0, 1}
    assert len(resident_pages(f, 4096, 4096)) == 1


# ------------------------------------------------------------------------------ probe
def test_probe_result_structure(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = CountReads(monkeypatch)
    probe = measure_read_bandwidth(shards, cache=False, **SMALL)
    assert isinstance(probe, DiskProbe) and not probe.cached
    assert probe.readers == 2 and probe.chunk_bytes == 128 * 1024 and probe.method in ("direct", "dropped", "buffered")
    assert probe.sample_bytes == MiB // 2 == reads.calls[0] == reads.calls[1]  # two different ranges, both full
    assert probe.sequential > 0 and probe.parallel > 0 and probe.bandwidth == max(probe.sequential, probe.parallel)
    st = (shards / "model-00001-of-00002.safetensors").stat()
    assert probe.device == f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    assert "GB/s" in str(probe)


def test_a_sample_larger_than_the_files_reads_what_there_is(tmp_path: Path) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(3 * 4096 + 5))
    probe = measure_read_bandwidth(f, parallel=3, sample_bytes=MiB, cache=False)
    assert probe.sample_bytes == 3 * 4096  # the unaligned tail of a multi-page file is left out


def test_index_folder_and_file_probe_the_same_device(shards: Path) -> None:
    a = measure_read_bandwidth(shards / "model.safetensors.index.json", cache=False, **SMALL)
    b = measure_read_bandwidth(shards / "model-00002-of-00002.safetensors", cache=False, **SMALL)
    assert a.device == b.device and a.filesystem == b.filesystem


def test_links_are_followed_as_in_a_hub_cache(shards: Path, tmp_path: Path) -> None:
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "model.safetensors").symlink_to(shards / "model-00001-of-00002.safetensors")
    probe = measure_read_bandwidth(snapshot, cache=False, **SMALL)
    assert probe.sample_bytes == MiB // 2


def test_the_files_are_unchanged_and_may_be_read_only(shards: Path) -> None:
    before = digest(shards)
    for p in shards.iterdir():
        p.chmod(0o444)
    for method in ("auto", "dropped", "buffered"):
        measure_read_bandwidth(shards, cache=False, method=method, **SMALL)
    assert digest(shards) == before


def test_bad_inputs_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        measure_read_bandwidth(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no non-empty file"):
        measure_read_bandwidth(tmp_path / "empty")
    (tmp_path / "bad.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a checkpoint index"):
        measure_read_bandwidth(tmp_path / "bad.index.json")
    f = tmp_path / "f"
    f.write_bytes(b"x" * 10)
    with pytest.raises(ValueError) as err:
        measure_read_bandwidth(f, parallel=0, sample_bytes=10, method="fast")
    assert "parallel=0" in str(err.value) and "sample_bytes=10" in str(err.value) and "'fast'" in str(err.value)


# ----------------------------------------------------------------------- page cache
def _evictable(f: Path) -> bool:
    """True when dropping a file's pages works here (not tmpfs, mincore available)."""
    f.read_bytes()
    drop_file_pages(f)
    pages = resident_pages(f)
    return pages is not None and not any(pages)


@pytest.mark.parametrize("method", ["auto", "dropped"])
def test_the_probe_leaves_the_page_cache_as_it_found_it(shards: Path, method: str) -> None:
    warm, cold = shards / "model-00001-of-00002.safetensors", shards / "model-00002-of-00002.safetensors"
    if not _evictable(cold):
        pytest.skip("this filesystem keeps every page resident (tmpfs?): nothing to leave evicted")
    warm.read_bytes()
    warm_before = resident_pages(warm)
    assert warm_before is not None and all(warm_before)
    measure_read_bandwidth(shards, cache=False, method=method, parallel=2, sample_bytes=2 * MiB)
    assert resident_pages(warm) == warm_before  # what was resident is resident (and readable) again
    assert not any(resident_pages(cold))  # what was cold was not pulled in and left there


# ------------------------------------------------------------------------------ cache
def test_results_are_cached_per_device_under_xdg_cache_home(
    shards: Path, cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert cache_file() == cache_home / "bigviz" / "disk-bandwidth.json"
    first = measure_read_bandwidth(shards, **SMALL)
    doc = json.loads(cache_file().read_text())
    assert doc["format"] == "bigviz-disk-probe" and list(doc["entries"]) == [first.device]
    reads = CountReads(monkeypatch)
    again = measure_read_bandwidth(shards, **SMALL)
    assert reads.calls == [] and again.cached and again.parallel == first.parallel
    assert measure_read_bandwidth(shards, **{**SMALL, "sample_bytes": MiB // 4}).cached  # a smaller sample: same
    assert [p.name for p in (cache_home / "bigviz").iterdir()] == ["disk-bandwidth.json"]  # no temporary left


@pytest.mark.parametrize(
    "change", ["refresh", "readers", "bigger sample", "too old", "other filesystem", "other version"]
)
def test_cached_entries_are_measured_again_when_stale(
    shards: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    first = measure_read_bandwidth(shards, **SMALL)
    knobs = dict(SMALL)
    if change == "refresh":
        knobs["refresh"] = True
    elif change == "readers":
        knobs["parallel"] = 3
    elif change == "bigger sample":
        knobs["sample_bytes"] = MiB
    elif change == "too old":
        knobs["max_age"] = 0.0
    else:
        doc = json.loads(cache_file().read_text())
        if change == "other filesystem":
            doc["entries"][first.device]["filesystem"] = "ext4 /dev/elsewhere /mnt"
        else:
            doc["version"] = 0
        cache_file().write_text(json.dumps(doc))
    reads = CountReads(monkeypatch)
    probe = measure_read_bandwidth(shards, **knobs)
    assert not probe.cached and len(reads.calls) == 2
    entry = json.loads(cache_file().read_text())["entries"][first.device]
    assert entry["measured_at"] == probe.measured_at and entry["readers"] == knobs["parallel"]


def test_other_devices_entries_are_kept(shards: Path) -> None:
    cache_file().parent.mkdir(parents=True)
    other = {
        "device": "9:9",
        "filesystem": "xfs /dev/sdz /data",
        "sequential": 1.0,
        "parallel": 2.0,
        "readers": 4,
        "sample_bytes": 1,
        "chunk_bytes": 1,
        "method": "direct",
        "measured_at": 1.0,
    }
    cache_file().write_text(
        json.dumps({"format": "bigviz-disk-probe", "version": CACHE_VERSION, "entries": {"9:9": other}})
    )
    probe = measure_read_bandwidth(shards, **SMALL)
    entries = json.loads(cache_file().read_text())["entries"]
    assert entries["9:9"] == other and probe.device in entries


def test_a_file_that_is_not_ours_is_never_overwritten(shards: Path) -> None:
    cache_file().parent.mkdir(parents=True)
    cache_file().write_text("my notes, not a cache\n")
    with pytest.warns(UserWarning, match="not written by bigviz"):
        probe = measure_read_bandwidth(shards, **SMALL)
    assert cache_file().read_text() == "my notes, not a cache\n" and not probe.cached
    assert sorted(p.name for p in cache_file().parent.iterdir()) == ["disk-bandwidth.json"]


def test_cache_false_writes_nothing(shards: Path, cache_home: Path) -> None:
    measure_read_bandwidth(shards, cache=False, **SMALL)
    assert not cache_home.exists()
