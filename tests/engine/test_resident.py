"""Issue 12, larger than RAM, in small: a resident/streamed split checked page by page.

A small GPT is saved with one shard per block; part of it is mapped to "cpu", the rest to
"disk", and the model is treated as larger than RAM (``resident="copy"``, or machine facts
saying so: the stream plan decides before anything moves, the engine carries it out). Checked with
``mincore``: the resident weights live in process memory (every page present, none of them
file-backed), the disk units' file pages are dropped from the page cache once used (except
the units read ahead for the next forward), and outputs are bit-exact against the model in RAM.
Disk units stream into one reused ``O_DIRECT`` ring by default (the page cache untouched); the
page-cache streaming (``stream="cache"``) is checked too.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import bigviz
from bigviz.checkpoint.index import CheckpointIndex
from bigviz.checkpoint.save import save_sharded
from bigviz.core.stream_plan import RING_AHEAD_LEAST, MachineFacts, ring_bytes
from bigviz.engine.fetchers.cache import StreamingFetcher
from bigviz.engine.fetchers.cpu import CpuFetcher, paged_in
from bigviz.engine.fetchers.ring import RingFetcher
from bigviz.engine.fetchers.spans import file_span
from bigviz.engine.resident import mapped_bytes
from bigviz.models import GPT, GPTConfig
from bigviz.osio.pages import cached_pages as resident_pages
from bigviz.osio.pages import drop_file_pages

pytestmark = pytest.mark.skipif(
    not hasattr(os, "posix_fadvise") or not os.path.exists("/proc/self/maps"), reason="page-cache control needs Linux"
)

PAGE = mmap.PAGESIZE
CONFIG = GPTConfig(n_layer=6, n_head=4, n_embd=128, vocab_size=300, block_size=32)  # blocks of 200 pages


def _tensor_ranges(folder: Path) -> dict[str, tuple[Path, int, int]]:
    """checkpoint key -> (file, byte offset in the file, length), from safetensors headers."""
    entries = CheckpointIndex.open(folder).entries
    return {key: (info.file, info.data_offsets[0], info.nbytes) for key, info in entries.items() if info.data_offsets}


def _evict(folder: Path) -> None:
    for path in folder.glob("*.safetensors"):
        drop_file_pages(path)


def _inner_pages(path: Path, offset: int, length: int) -> tuple[int, int]:
    """(in the page cache, all) of the pages lying wholly inside ``[offset, offset + length)``."""
    first, last = -(-offset // PAGE) * PAGE, (offset + length) // PAGE * PAGE
    if last <= first:
        return 0, 0
    return sum(resident_pages(path, first, last - first)), (last - first) // PAGE


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT]:
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    folder = tmp_path_factory.mktemp("resident") / "ckpt"
    block = sum(p.numel() * 4 for p in model.transformer.h[0].parameters())
    save_sharded(model, folder, max_shard_size=block, progress=False)
    return folder, model


def _split_map(n_cpu: int) -> dict[str, str]:
    device_map = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.ln_f": "cpu", "lm_head": "cpu"}
    device_map.update({f"transformer.h.{i}": "cpu" if i < n_cpu else "disk" for i in range(CONFIG.n_layer)})
    return device_map


def _dispatch(folder: Path, device_map: dict[str, str], resident: str, **kwargs: object) -> GPT:
    with bigviz.init_empty_weights():
        model = GPT(CONFIG)
    return bigviz.load_checkpoint_and_dispatch(model, folder, device_map, resident=resident, **kwargs)


def test_resident_weights_stay_in_memory_and_streamed_pages_are_dropped(checkpoint: tuple[Path, GPT]) -> None:
    folder, reference = checkpoint
    idx = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(idx)[0]
    _evict(folder)
    # five disk units: with 2 read ahead, a release starts the read 3 units on, whose kernel
    # read-ahead (up to read_ahead_kb past it) reaches the head of the unit after it in a shard;
    # with only 4 units that would be the unit just released, whose pages are checked below
    model = _dispatch(folder, _split_map(1), "copy", stream="cache")  # through the page cache
    state, residency = model._bigviz_dispatch, bigviz.residency(model)
    assert residency.mode == "copy" and isinstance(state.scheduler.fetcher, StreamingFetcher)
    assert residency.copied is not None and 0 < residency.copied.nbytes <= residency.resident_bytes
    resident = [p for p in model.parameters() if not p.is_meta]  # offloaded placeholders report "cpu" too
    assert resident and all(file_span(p) is None and paged_in(p) for p in resident)
    ranges = _tensor_ranges(folder)
    disk = [u for u in state.units if u.storage == "disk"]
    left_after_use: dict[str, tuple[int, int]] = {}

    def pages_of(unit: object) -> tuple[int, int]:
        counts = [_inner_pages(*ranges[key]) for key in unit.slots]  # type: ignore[attr-defined]
        return sum(c for c, _ in counts), sum(n for _, n in counts)

    def after_use(unit: object) -> None:
        state.scheduler.fetcher.wait_dropped()
        left_after_use[unit.name] = pages_of(unit)  # type: ignore[attr-defined]

    for unit in disk:  # runs just after the unit's forward (and its hook's release)
        unit.module.register_forward_hook(lambda m, a, o, u=unit: after_use(u))
    for run in range(2):
        left_after_use.clear()
        with torch.no_grad():
            assert torch.equal(model(idx)[0], expected), f"forward {run}"
        assert sorted(left_after_use) == sorted(u.name for u in disk)
        for name, (cached, whole) in left_after_use.items():
            assert whole > 100 and cached == 0, f"forward {run}: {name}: {cached} of {whole} pages left after use"
        for handle in list(state.scheduler._pending.values()):
            handle.wait()  # units read ahead for the next forward: their reads are done
        ahead = [h.unit for h in state.scheduler._pending.values()]
        assert len(disk) == CONFIG.n_layer - 1 and len(ahead) == state.scheduler.depth + 1 < len(disk)
        for unit in ahead:
            cached, whole = pages_of(unit)
            assert cached == whole, f"{unit.name}: read ahead for the next forward, {cached} of {whole} pages"
        # the resident part never went back to the file: still every page present
        assert all(file_span(p) is None and paged_in(p) for p in resident)
    state.scheduler.fetcher.wait_dropped()
    stats = state.scheduler.fetcher.stats
    assert stats.units_dropped == 2 * len(disk) and stats.bytes_dropped > 0
    bigviz.remove_hooks(model)


def test_disk_units_stream_through_one_reused_ring_bit_exact(checkpoint: tuple[Path, GPT]) -> None:
    folder, reference = checkpoint
    device_map = _split_map(1)
    _evict(folder)
    model = _dispatch(folder, device_map, "copy")
    state = model._bigviz_dispatch
    fetcher = state.scheduler.fetcher
    assert isinstance(fetcher, RingFetcher)
    disk = [u for u in state.units if u.storage == "disk"]
    largest = max(u.nbytes for u in disk)
    assert 2 * largest <= fetcher.capacity < 2.1 * largest  # the running unit and the next, not depth + 1 buffers
    seen: dict[str, int] = {}  # unit -> address its weights had in its forward

    def in_forward(unit: object) -> None:
        seen[unit.name] = unit.module.attn.c_attn.weight.data_ptr()  # type: ignore[attr-defined]

    for unit in disk:
        unit.module.mlp.register_forward_hook(lambda m, a, o, u=unit: in_forward(u))
    idx = torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference(idx)[0]
    addresses: set[int] = set()
    for run in range(3):
        with torch.set_grad_enabled(run == 2):  # a plain call too: the hooks run offloaded modules without autograd
            assert torch.equal(model(idx)[0].detach(), expected), f"forward {run}"
        assert sorted(seen) == sorted(u.name for u in disk)
        addresses |= set(seen.values())
    # the weights of five units were read into one ring, made once; none needed a buffer of its own
    ring = fetcher._ring
    assert fetcher.made == 1 and fetcher.overflows == 0 and fetcher.held_bytes == ring.numel()
    assert all(ring.data_ptr() <= a < ring.data_ptr() + ring.numel() for a in addresses)
    assert fetcher.stats.units_read >= 3 * len(disk)
    # O_DIRECT left the page cache alone (or the buffered fallback dropped what it read)
    cached = sum(sum(resident_pages(p) or b"") for p in folder.glob("*.safetensors"))
    assert cached < 50, f"disk units went through the page cache: {cached} pages cached"
    bigviz.remove_hooks(model)


def test_all_on_disk_with_a_tied_head_stays_exact(checkpoint: tuple[Path, GPT]) -> None:
    folder, reference = checkpoint
    model = _dispatch(folder, {"": "disk"}, "copy")
    assert isinstance(model._bigviz_dispatch.scheduler.fetcher, RingFetcher)
    idx = torch.arange(6).view(1, 6)
    for run in range(3):
        with torch.no_grad():
            assert torch.equal(model(idx)[0], reference(idx)[0]), f"forward {run}"
    bigviz.remove_hooks(model)


def test_a_model_that_fits_keeps_zero_copy_maps(checkpoint: tuple[Path, GPT]) -> None:
    folder, reference = checkpoint
    idx = torch.randint(0, CONFIG.vocab_size, (1, 5), generator=torch.Generator().manual_seed(4))
    model = _dispatch(folder, _split_map(3), "auto")  # a few hundred KB: fits in any RAM
    assert bigviz.residency(model).mode == "map" and bigviz.residency(model).copied is None
    assert isinstance(model._bigviz_dispatch.scheduler.fetcher, CpuFetcher)
    assert 0 < mapped_bytes(model) <= bigviz.residency(model).resident_bytes
    with torch.no_grad():
        assert torch.equal(model(idx)[0], reference(idx)[0])
    bigviz.remove_hooks(model)


def _larger_than_ram(folder: Path) -> tuple[GPT, Any]:
    """The GPT loaded with 4 blocks resident on a pretend machine whose RAM holds the resident
    part and the ring, not the whole model; and its stream plan."""
    with bigviz.init_empty_weights():
        model = GPT(CONFIG)
    plan = bigviz.dispatch_plan(model, folder, _split_map(4), machine=MachineFacts(10**12)).stream
    block = max(u.nbytes for u in plan.units if u.residency == "streamed")
    small = MachineFacts(int((plan.resident_bytes + ring_bytes(block, RING_AHEAD_LEAST) + block // 8) / 0.9))
    assert plan.resident_bytes + plan.streamed_bytes > small.room
    return bigviz.load_checkpoint_and_dispatch(model, folder, _split_map(4), machine=small), plan


def test_a_map_naming_tensors_on_cpu_is_copied_too(checkpoint: tuple[Path, GPT]) -> None:
    """A device map may place a parameter or buffer on its own (transformers' "auto" maps do:
    BART's ``final_logits_bias``): the resident copy reads it in its turn (no module to wait on),
    where it once asked for a submodule of that name and failed after the load."""
    folder, reference = checkpoint
    device_map = _split_map(4)
    del device_map["transformer.ln_f"]
    device_map |= {"transformer.ln_f.weight": "cpu", "transformer.ln_f.bias": "cpu"}
    with bigviz.init_empty_weights():
        model = GPT(CONFIG)
    plan = bigviz.dispatch_plan(model, folder, device_map, machine=MachineFacts(10**12)).stream
    block = max(u.nbytes for u in plan.units if u.residency == "streamed")
    small = MachineFacts(int((plan.resident_bytes + ring_bytes(block, RING_AHEAD_LEAST) + block // 8) / 0.9))
    model = bigviz.load_checkpoint_and_dispatch(model, folder, device_map, machine=small)
    assert bigviz.residency(model).mode == "copy"
    idx = torch.arange(7).view(1, 7)
    with torch.no_grad():
        assert torch.equal(model(idx)[0], reference(idx)[0])
    report = bigviz.residency(model).copied
    assert report is not None and report.nbytes == plan.resident_bytes and mapped_bytes(model) == 0
    with torch.no_grad():
        assert torch.equal(model(idx)[0], reference(idx)[0])
    bigviz.remove_hooks(model)


def test_auto_copies_when_the_model_does_not_fit(checkpoint: tuple[Path, GPT]) -> None:
    folder, reference = checkpoint
    model, plan = _larger_than_ram(folder)
    residency = bigviz.residency(model)
    assert residency.mode == "copy" and residency.fetcher == "RingFetcher"
    idx = torch.arange(7).view(1, 7)
    with torch.no_grad():  # the first forward runs while the copy is made: each block waits for its own bytes
        assert torch.equal(model(idx)[0], reference(idx)[0])
    report = residency.copied  # waits for the copy, if still running
    assert report is not None and report.nbytes == plan.resident_bytes and mapped_bytes(model) == 0
    assert not any(m._forward_pre_hooks for m in model.modules())  # the copy's waits are gone with it
    with torch.no_grad():
        assert torch.equal(model(idx)[0], reference(idx)[0])
    bigviz.remove_hooks(model)


def test_one_bar_shows_the_copy_and_the_first_forwards_streamed_reads(checkpoint: tuple[Path, GPT]) -> None:
    """Issue 26: the first forward of a model larger than RAM is one pass over the checkpoint:
    the resident copy and the streamed blocks read beside it. One progress bar counts both, to
    the checkpoint's bytes, and closes when the first forward is over (the ring stops telling it)."""
    folder, reference = checkpoint
    model, plan = _larger_than_ram(folder)  # progress shown
    copy = bigviz.residency(model).copy
    fetcher = model._bigviz_dispatch.scheduler.fetcher
    assert copy is not None and fetcher.on_read is not None  # told each piece the ring reads
    bar = copy._bar
    streamed = fetcher.pass_bytes  # the disk blocks' file bytes: their weights (not the buffers made in memory)
    assert plan.streamed_bytes * 0.9 < streamed <= plan.streamed_bytes
    assert bar.total == plan.resident_bytes + streamed and "streamed" in bar.desc
    idx = torch.arange(7).view(1, 7)
    with torch.no_grad():
        assert torch.equal(model(idx)[0], reference(idx)[0])
    assert bigviz.residency(model).copied is not None  # the copy is done
    assert bar.n == bar.total  # every resident byte copied and every streamed byte read, once
    assert bar.disable and fetcher.on_read is None  # closed; later forwards are not counted
    with torch.no_grad():
        model(idx)
    assert bar.n == bar.total and not model._forward_hooks
    bigviz.remove_hooks(model)


@pytest.mark.parametrize("show_after", [0.0, 3600.0])
def test_the_bar_the_user_sees_ends_at_the_whole_pass_or_is_never_shown(
    checkpoint: tuple[Path, GPT], capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, show_after: float
) -> None:
    """What is printed, not the bar's counters: a bar shown (the work took longer than its
    delay, here none) ends at 100% of the pass; a load and forward quicker than the delay shows
    no bar at all, not one left at the copy's share of the pass (it once forced a display when the
    streamed bytes joined the bar, and tqdm does not redraw at close a bar it never showed)."""
    import bigviz.checkpoint.progress as progress

    monkeypatch.setattr(progress, "SHOW_AFTER_S", show_after)
    folder, reference = checkpoint
    model, _ = _larger_than_ram(folder)
    with torch.no_grad():
        assert torch.equal(model(torch.arange(7).view(1, 7))[0], reference(torch.arange(7).view(1, 7))[0])
    assert bigviz.residency(model).copied is not None  # waits for the copy
    bigviz.remove_hooks(model)
    shown = [line for line in capfd.readouterr().err.replace("\r", "\n").splitlines() if "resident copy" in line]
    if show_after:
        assert shown == []
    else:
        assert shown and "resident copy + streamed: 100%" in shown[-1], shown[-3:]


def test_the_resident_copy_runs_beside_the_first_forward_and_says_when_it_failed(tmp_path: Path) -> None:
    """ResidentCopy on its own: modules wait for their own bytes only; a read that fails (the
    file truncated after it was mapped) is raised at the next wait, not lost in its thread."""
    from bigviz.checkpoint.lazy import map_file
    from bigviz.engine.resident_copy import ResidentCopy

    values = torch.randn(4, 2048)
    paths = []
    for i in range(4):
        paths.append(tmp_path / f"w{i}.bin")
        paths[-1].write_bytes(values[i].numpy().tobytes())
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 32, bias=False) for _ in range(4)))
    for i, layer in enumerate(model):
        layer.weight.data = map_file(paths[i]).view(torch.float32).view(32, 64)
    copy = ResidentCopy(model, ["0", "1", "2", "3"], readers=2, progress=False)
    x = torch.randn(1, 64)
    with torch.no_grad():
        for i in (2, 0):  # in any order: each layer waits for its own bytes
            assert torch.equal(model[i](x), x @ values[i].view(32, 64).t())
    report = copy.wait()
    assert report.tensors == 4 and report.nbytes == 4 * 2048 * 4
    assert all(file_span(layer.weight) is None for layer in model)  # copies now, not the mapped files
    assert not any(layer._forward_pre_hooks for layer in model)

    broken = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    path = tmp_path / "short.bin"
    path.write_bytes(values[0].numpy().tobytes())
    broken[0].weight.data = map_file(path).view(torch.float32).view(32, 64)
    os.truncate(path, 1024)  # never touched through the mapping: that would be SIGBUS
    copy = ResidentCopy(broken, ["0"], readers=1, progress=False, direct=False)
    with pytest.raises(OSError, match="short read"):
        copy.wait()
    assert not broken[0]._forward_pre_hooks


def test_tied_weights_are_copied_once_and_stay_tied(checkpoint: tuple[Path, GPT]) -> None:
    folder, _ = checkpoint
    model = _dispatch(folder, _split_map(6), "copy")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    bigviz.remove_hooks(model)


def test_unknown_modes_are_refused_before_anything_is_read(checkpoint: tuple[Path, GPT]) -> None:
    with bigviz.init_empty_weights():
        model = GPT(CONFIG)
    with pytest.raises(ValueError, match="resident='always'"):
        bigviz.dispatch_plan(model, checkpoint[0], _split_map(2), resident="always")
    with bigviz.init_empty_weights():
        model = GPT(CONFIG)
    with pytest.raises(ValueError, match="resident='pinned'.*'auto', 'copy', 'map'"):
        bigviz.load_checkpoint_and_dispatch(model, checkpoint[0], _split_map(2), resident="pinned")
    assert all(p.is_meta for p in model.parameters()) and not hasattr(model, "_bigviz_dispatch")


# ------------------------------------------------------------------ the copy itself, byte by byte
def _mapped_spans(path: Path, ranges: list[tuple[int, int]]) -> tuple[list[torch.Tensor], list]:
    from bigviz.checkpoint.lazy import map_file

    whole = map_file(path)
    views = [whole[offset : offset + length] for offset, length in ranges]
    return views, [file_span(v) for v in views]


_RANGES = [(0, 4096), (8, 100), (4100, 9000), (12_288, 8192), (3 * 4096 + 4, 40_000)]


@pytest.mark.parametrize("direct", [True, False])
def test_the_copy_holds_every_byte_at_any_offset_and_bypasses_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    from bigviz.engine import resident

    monkeypatch.setattr(resident, "_CHUNK", 2 * PAGE)  # many pieces per span, the last one partial
    data = torch.randint(0, 256, (61_237,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    path = tmp_path / "w.bin"
    path.write_bytes(data.numpy().tobytes())  # its length is no multiple of a block: O_DIRECT reads end short
    ranges = [*_RANGES, (61_237 - 5001, 5001)]  # the last span ends with the file
    views, spans = _mapped_spans(path, ranges)
    assert all(spans)
    drop_file_pages(path)
    copies, direct_bytes = resident._read_all(spans, 3, lambda n: None, direct=direct)
    for (offset, length), span in zip(ranges, spans):
        copy = copies[(span.address, span.length)]
        assert torch.equal(copy, data[offset : offset + length]), (offset, length)
        assert file_span(copy) is None and copy.data_ptr() % 8 in (
            0,
            offset % 8,
        )  # anonymous; views as any dtype the map did
    total, bypass = sum(length for _, length in ranges), direct and _o_direct_works(tmp_path)
    assert direct_bytes == (total if bypass else 0)
    if bypass:  # O_DIRECT: the disk wrote into the copy, the page cache never held a page of it
        assert sum(resident_pages(path) or b"\1") == 0


def test_a_filesystem_refusing_o_direct_gets_buffered_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from bigviz.engine import resident
    from bigviz.osio import direct

    real = direct.read_into

    def refuse(piece: object, flags: int) -> None:
        if flags:
            raise OSError(errno.EINVAL, "Invalid argument")
        real(piece, flags)  # type: ignore[arg-type]

    monkeypatch.setattr(direct, "read_into", refuse)
    data = torch.arange(20_000, dtype=torch.int32)
    path = tmp_path / "w.bin"
    path.write_bytes(data.numpy().tobytes())
    views, spans = _mapped_spans(path, [(4, 40_000), (40_004, 39_996)])
    copies, direct_bytes = resident._read_all(spans, 2, lambda n: None, direct=True)
    assert direct_bytes == 0
    assert torch.equal(copies[(spans[0].address, 40_000)].view(torch.int32), data[1:10_001])
    assert torch.equal(copies[(spans[1].address, 39_996)].view(torch.int32), data[10_001:])


def test_a_file_cut_short_under_the_copy_is_an_error_naming_it(tmp_path: Path) -> None:
    from bigviz.engine import resident

    path = tmp_path / "w.bin"
    path.write_bytes(bytes(50_000))
    views, spans = _mapped_spans(path, [(0, 50_000)])
    os.truncate(path, 20_000)  # another program shortens the file (the mapping's tail would SIGBUS)
    with pytest.raises(OSError, match=r"w\.bin: short read at byte 20480|w\.bin: short read at byte 20000"):
        resident._read_all(spans, 2, lambda n: None, direct=True)


def _o_direct_works(folder: Path) -> bool:
    probe = folder / "o-direct-probe"
    probe.write_bytes(bytes(PAGE))
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [mmap.mmap(-1, PAGE)], 0) == PAGE
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.mark.parametrize("stream", ["ring", "cache"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])  # bfloat16: converted copies, in no file
def test_where_a_unit_lies_in_its_files_is_found_once(
    checkpoint: tuple[Path, GPT], monkeypatch: pytest.MonkeyPatch, stream: str, dtype: torch.dtype | None
) -> None:
    from bigviz.osio import procfs

    parsed = []
    real = procfs.FileMaps.__init__

    def counting(self: procfs.FileMaps) -> None:
        parsed.append(1)
        real(self)

    monkeypatch.setattr(procfs.FileMaps, "__init__", counting)
    folder, reference = checkpoint
    with bigviz.init_empty_weights():
        model = GPT(CONFIG)
    model = bigviz.load_checkpoint_and_dispatch(
        model, folder, _split_map(2), resident="copy", stream=stream, dtype=dtype
    )
    idx = torch.arange(6).view(1, 6)
    with torch.no_grad():
        first = model(idx)[0]
        if dtype is None:
            assert torch.equal(first, reference(idx)[0])
        after_first = len(parsed)
        for _ in range(2):
            assert torch.equal(model(idx)[0], first)
    disk = [u for u in model._bigviz_dispatch.units if u.storage == "disk"]
    assert 0 < after_first and len(parsed) - after_first == 0, "/proc/self/maps parsed again in later forwards"
    assert len(disk) == 4
    bigviz.remove_hooks(model)


def test_a_tied_weight_streamed_by_two_units_is_read_once_and_never_dropped_under_a_read_ahead(
    checkpoint: tuple[Path, GPT],
) -> None:
    # all on disk, the embedding and the head share one offloaded tensor: dropping it when the
    # embedding is done would make the head read it again, and dropping it when the head is done
    # would undo the embedding's read-ahead for the next forward
    folder, reference = checkpoint
    _evict(folder)
    model = _dispatch(folder, {"": "disk"}, "copy", stream="cache")
    assert model.lm_head.weight is model.transformer.wte.weight
    state = model._bigviz_dispatch
    tied = _tensor_ranges(folder)["transformer.wte.weight"]
    idx = torch.arange(6).view(1, 6)
    for run in range(3):
        with torch.no_grad():
            assert torch.equal(model(idx)[0], reference(idx)[0]), f"forward {run}"
        state.scheduler.fetcher.wait_dropped()
        cached, whole = _inner_pages(*tied)
        assert whole > 30 and cached == whole, f"forward {run}: the tied weight kept {cached} of {whole} pages"
    bigviz.remove_hooks(model)
