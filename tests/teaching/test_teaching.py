"""bigviz.teaching: the instruments notebook 06 times prefetch with, on real checkpoints and models.

No timing assertions: the slower device's log is checked for what it guarantees by
construction (each read lasts at least bytes / bandwidth, one read at a time), and prefetch
for *who* reads (the computing thread or the background one), which the load does not change.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import bigviz
from bigviz.osio.pages import cached_pages as resident_pages
from bigviz.models import build
from bigviz.teaching import (
    ForwardTimeline,
    SlowDisk,
    can_drop_pages,
    disk_read_bytes,
    draw_timelines,
    drop_pages,
    mount_of,
    read_ahead_kib,
    thread_times,
)
from bigviz.teaching.slow_disk import parse_bandwidth

ALL_DISK = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.drop": "cpu",
            "transformer.h": "disk", "transformer.ln_f": "cpu", "lm_head": "cpu"}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = build("gpt-mini").eval()  # 4 blocks
    folder = bigviz.save_sharded(model, tmp_path_factory.mktemp("c") / "ckpt", max_shard_size="100KB", progress=False)
    return model, folder


def test_a_slow_disk_gives_copies_of_the_checkpoint_one_read_at_a_time(checkpoint):
    model, folder = checkpoint
    state = model.state_dict()
    with SlowDisk.open(folder, "64MiB/s") as disk:
        names = sorted(disk)
        threads = [threading.Thread(target=lambda n=n: disk[n]) for n in names]  # asked all at once
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        w = disk["transformer.h.0.mlp.c_fc.weight"]
        assert torch.equal(w, state["transformer.h.0.mlp.c_fc.weight"])
        w.zero_()  # a copy in fresh memory: the checkpoint (and the next read) are unchanged
        assert torch.equal(disk["transformer.h.0.mlp.c_fc.weight"], state["transformer.h.0.mlp.c_fc.weight"])
    assert set(names) == set(bigviz.CheckpointIndex.open(folder).keys())
    device = sorted(disk.reads, key=lambda r: r.start)
    assert len(device) == len(names) + 2 and {r.thread for r in device} > {threading.get_native_id()}
    for before, after in zip(device, device[1:]):
        assert after.start >= before.start + before.nbytes / disk.bandwidth - 1e-9  # one device, one read at a time
    assert all(r.end - r.start >= r.nbytes / disk.bandwidth - 1e-9 for r in device)


@pytest.mark.parametrize("prefetch", [False, True])
def test_who_reads_the_offloaded_blocks(checkpoint, prefetch):
    """Without prefetch the computing thread reads every block; with it, only the first (nothing
    computes before it), and the background thread the rest; the logits are the model's."""
    model, folder = checkpoint
    x = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        expected = model(x)[0]
    with SlowDisk.open(folder, "256MiB/s") as disk:
        with torch.device("meta"):
            meta = build("gpt-mini")
        meta = bigviz.dispatch_model(meta, ALL_DISK, weights=disk, prefetch=prefetch)
        with ForwardTimeline(list(meta.transformer.h)) as timeline, torch.no_grad():
            logits = meta(x)[0]
        bigviz.remove_hooks(meta)
    assert torch.equal(logits, expected)
    during = [r for r in disk.reads if r.end > timeline.t0]
    mine = {r.name.split(".")[2] for r in during if r.thread == timeline.thread}
    others = {r.name.split(".")[2] for r in during if r.thread != timeline.thread}
    if prefetch:
        assert mine == {"0"} and others >= {"1", "2", "3"}
    else:
        assert mine == {"0", "1", "2", "3"} and not others
    assert [m.block for m in timeline.marks] == [0, 1, 2, 3]
    assert all(m.called <= m.ready <= m.done <= timeline.seconds for m in timeline.marks)
    assert timeline.blocked >= 0 and 0 <= timeline.read_by_compute <= max(timeline.read, 0)


def test_the_timeline_of_repeated_calls_and_its_picture(checkpoint):
    model, _ = checkpoint
    with ForwardTimeline(list(model.transformer.h)) as timeline, torch.no_grad():
        model.generate(torch.zeros(1, 2, dtype=torch.long), 2)  # two forwards: every block twice
    assert [m.block for m in timeline.marks] == [0, 1, 2, 3] * 2
    fig = draw_timelines({"first": timeline, "second": timeline}, title="t")
    assert [ax.get_title(loc="left").split(":")[0] for ax in fig.axes] == ["first", "second"]
    assert len(fig.axes[0].patches) == 2 * len(timeline.marks)  # a wait and a compute bar per call


def test_machine_facts_and_dropping_a_checkpoint_from_the_page_cache(checkpoint):
    _, folder = checkpoint
    assert disk_read_bytes() >= 0 and all(t >= 0 for t in thread_times(threading.get_native_id()))
    assert thread_times(2**31 - 1) == (0.0, 0.0)  # no such thread: unknown, not an error
    device, fstype = mount_of(folder)
    assert read_ahead_kib("/dev/no-such-disk") is None and read_ahead_kib("") is None
    index = bigviz.CheckpointIndex.open(folder)
    assert drop_pages(index) == index.total_bytes
    if not can_drop_pages(folder):
        assert fstype in ("tmpfs", "ramfs", "") or not hasattr(os, "posix_fadvise")
        pytest.skip(f"{folder} is on {fstype or 'an unknown filesystem'}: its pages cannot be dropped")
    info = max(index.entries.values(), key=lambda i: i.nbytes)
    begin, end = info.data_offsets
    pages = resident_pages(info.file, begin, end - begin)
    # whole pages only: the first and last may hold the neighbours' bytes (or the header, just read)
    assert pages is not None and len(pages) > 2 and b"\x01" not in pages[1:-1], "its pages stayed in the page cache"


def test_bandwidths_are_read_as_sizes_per_second():
    assert parse_bandwidth("200MiB/s") == 200 * 2**20 and parse_bandwidth("1GB/s") == 1e9 and parse_bandwidth(5) == 5.0
    with pytest.raises(ValueError, match="more than 0"):
        parse_bandwidth(0)


@pytest.mark.parametrize(("stages", "microbatches"), [(1, 1), (2, 5), (4, 1), (4, 8), (7, 3)])
def test_a_drawn_schedule_has_the_bubble_of_the_formula(stages, microbatches):
    """Every stage runs every micro-batch once, in order, one slot after the stage before;
    the idle slots counted are the formula's bubble (p-1)/(m+p-1)."""
    from bigviz.core.pipeline import pipeline_bubble
    from bigviz.teaching import draw_schedules, schedule

    rows = schedule(stages, microbatches)
    slots = microbatches + stages - 1
    for s, row in enumerate(rows):
        assert len(row) == slots and [j for j in row if j is not None] == list(range(microbatches))
        assert row.index(0) == s  # a micro-batch reaches stage s after the s stages before it
    idle = sum(x is None for row in rows for x in row)
    assert idle / (stages * slots) == pytest.approx(pipeline_bubble(stages, microbatches))
    fig = draw_schedules(stages, [microbatches])
    assert f"= {stages - 1}/{slots} =" in fig.axes[0].get_title(loc="left")


def test_a_schedule_refuses_nonsense():
    from bigviz.teaching import schedule

    with pytest.raises(ValueError, match="stages=0"):
        schedule(0, 2)
