"""Issue 26: the schedule of a streamed forward, recorded by ``bigviz.timeline`` and checked
against the dispatch plan on a model that fits (the CI-sized version of the beyond-RAM bench).

A small GPT saved one shard per block, dispatched under machine facts of a machine whose RAM
holds the "cpu" part and the ring but not the model (so the engine streams as it would beyond
RAM), with resident blocks between streamed ones. Over three forwards, the timeline must show:
units computed in the plan's order, one at a time; no compute before its unit is read; reads
started in the plan's order; the read-ahead within what the plan allows (the ring's bytes, or
its depth); every streamed unit read again in every later forward; the same outputs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import bigviz
from bigviz.checkpoint.save import save_sharded
from bigviz.core.errors import StateError
from bigviz.core.stream_plan import RAM_SHARE, MachineFacts, ring_bytes
from bigviz.engine.timeline import Timeline, UnitTimes
from bigviz.models import GPT, GPTConfig

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="file spans need Linux")

CONFIG = GPTConfig(n_layer=7, n_head=4, n_embd=64, vocab_size=200, block_size=16)
FORWARDS = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT]:
    torch.manual_seed(2)
    model = GPT(CONFIG).eval()
    folder = tmp_path_factory.mktemp("timeline") / "ckpt"
    block = sum(p.numel() * 4 for p in model.transformer.h[0].parameters())
    save_sharded(model, folder, max_shard_size=block, progress=False)
    return folder, model


def _meta() -> GPT:
    with bigviz.init_empty_weights():
        return GPT(CONFIG)


def _map(disk: set[int]) -> dict[str, str]:
    device_map = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.ln_f": "cpu", "lm_head": "cpu"}
    device_map.update({f"transformer.h.{i}": "disk" if i in disk else "cpu" for i in range(CONFIG.n_layer)})
    return device_map


def _facts(folder: Path, device_map: dict[str, str]) -> MachineFacts:
    """A machine whose RAM holds the "cpu" part and the ring, not the whole model."""
    probe = bigviz.dispatch_plan(_meta(), folder, device_map, machine=MachineFacts(10**12)).stream
    assert probe is not None
    block = max(u.nbytes for u in probe.units if u.residency == "streamed")
    return MachineFacts(int((probe.resident_bytes + ring_bytes(block) + block // 8) / RAM_SHARE) + 1)


def _held_at(units: list[UnitTimes], when: float) -> list[UnitTimes]:
    """Units whose read had started by ``when`` and whose compute had not ended."""
    return [u for u in units if u.read_start is not None and u.read_start <= when < u.compute_end]


@pytest.mark.parametrize(
    ("disk", "stream"),
    [
        ({1, 2, 4, 6}, "ring"),  # runs of resident blocks between streamed ones
        (set(range(7)), "ring"),  # every block streamed
        ({0, 3, 4, 5}, "cache"),  # through the page cache, as far ahead as the plan's depth
    ],
)
def test_the_timeline_of_each_forward_follows_the_plan(
    checkpoint: tuple[Path, GPT], disk: set[int], stream: str
) -> None:
    folder, reference = checkpoint
    device_map = _map(disk)
    facts = _facts(folder, device_map)
    plan = bigviz.dispatch_plan(_meta(), folder, device_map, stream=stream, machine=facts)
    assert plan.stream is not None and plan.stream.fetcher == stream and plan.stream.mode == "copy"
    model = bigviz.load_checkpoint_and_dispatch(_meta(), folder, device_map, stream=stream, machine=facts)
    idx = torch.arange(9).view(1, 9)
    try:
        fetcher = model._bigviz_dispatch.scheduler.fetcher
        with bigviz.timeline(model) as t, torch.no_grad():
            for _ in range(FORWARDS):
                assert torch.equal(model(idx)[0], reference(idx)[0])
        assert isinstance(t, Timeline) and len(t.bounds) == FORWARDS
        order = [u.name for u in plan.units]
        assert order == [f"transformer.h.{i}" for i in sorted(disk)]
        everything = sorted(t.units, key=lambda u: u.compute_start)
        for k, forward in enumerate(t.forwards):
            start, end = t.bounds[k]
            assert [u.name for u in forward] == order  # computed in the plan's order, each once
            for u in forward:
                assert start <= u.wait_start <= u.compute_start <= u.compute_end <= end
                if k:  # every later forward reads its streamed units again
                    assert u.read_start is not None, f"forward {k}: {u.name} was not read"
                if u.read_start is not None:  # no compute on bytes not yet read
                    assert u.read_start <= u.read_end <= u.compute_start  # type: ignore[operator]
        for a, b in zip(everything, everything[1:]):  # one unit computes at a time
            assert a.compute_end <= b.compute_start
        starts = [u.read_start for u in everything if u.read_start is not None]
        assert starts == sorted(starts)  # reads begin in the plan's order, forward after forward
        for u in everything:  # the read-ahead stays within what the plan allows
            if u.read_start is None:
                continue
            held = _held_at(everything, u.read_start)
            if stream == "ring":  # the units read before it are whole in the ring, and some of it
                assert sum(v.read_bytes for v in held if v is not u) < fetcher.capacity
            else:
                assert len(held) <= plan.stream.depth + 1
        if stream == "ring":
            assert fetcher.overflows == 0  # nothing read outside the ring
            for u in everything:
                if u.read_start is not None:  # each piece timed, inside the unit's read
                    assert u.read_bytes > 0 and u.pieces
                    assert all(u.read_start <= a <= b <= u.read_end for a, b in u.pieces)  # type: ignore[operator]
        assert "forward 2:" in t.table() and t.summary()["seconds"] > 0
        # off once the block is left: nothing more is recorded
        with torch.no_grad():
            model(idx)
        assert len(t.bounds) == FORWARDS and model._bigviz_dispatch.scheduler.timeline is None
    finally:
        bigviz.remove_hooks(model)


def test_a_timeline_needs_a_dispatched_model_with_offloaded_units() -> None:
    with pytest.raises(StateError, match="no offloaded units"):
        with bigviz.timeline(torch.nn.Linear(2, 2)):
            pass


def test_one_timeline_at_a_time(checkpoint: tuple[Path, GPT]) -> None:
    folder, _ = checkpoint
    device_map = _map({1, 2})
    model = bigviz.load_checkpoint_and_dispatch(_meta(), folder, device_map, machine=_facts(folder, device_map))
    try:
        with bigviz.timeline(model):
            with pytest.raises(StateError, match="recorded already"):
                with bigviz.timeline(model):
                    pass
    finally:
        bigviz.remove_hooks(model)


class _Stack(torch.nn.Module):
    """Blocks of eight small layers each: a unit made of many tensors, none of them large."""

    def __init__(self, blocks: int = 5, width: int = 64) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)]) for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def test_the_next_unit_is_read_into_the_ring_while_the_one_before_computes(tmp_path: Path) -> None:
    """Issue 26: a unit's reads are merged into extents small enough for the half unit a ring
    leaves free while the unit before it computes; one extent per unit (the 64 MiB merge of
    small units) was queued only after the previous unit's compute, and compute waited for
    every read."""
    torch.manual_seed(3)
    reference = _Stack().eval()
    block = sum(p.numel() * 4 for p in reference.blocks[0].parameters())
    save_sharded(reference, tmp_path / "ckpt", max_shard_size=block, progress=False)
    device_map = {f"blocks.{i}": "disk" for i in range(5)}
    room = 2 * block  # RAM for a ring of 1.5 blocks, not for the model
    facts = MachineFacts(int(room / RAM_SHARE))
    with bigviz.init_empty_weights():
        model = _Stack()
    model = bigviz.load_checkpoint_and_dispatch(model, tmp_path / "ckpt", device_map, machine=facts)
    x = torch.randn(3, 64)
    try:
        assert type(model._bigviz_dispatch.scheduler.fetcher).__name__ == "RingFetcher"
        with bigviz.timeline(model) as t, torch.no_grad():
            for _ in range(FORWARDS):
                assert torch.equal(model(x), reference(x))
        for forward in t.forwards[1:]:
            for a, b in zip(forward, forward[1:]):
                assert b.read_queued is not None and b.read_queued < a.compute_end, (a.name, b.name)
    finally:
        bigviz.remove_hooks(model)
