"""Issue 24: ``bigviz.dispatch_plan(...)`` says, before anything moves, how each unit will live
at run time (mapped, resident copy or streamed; which fetcher; the ring; the read-ahead), and
``load_checkpoint_and_dispatch`` with the same arguments does exactly that.

A small GPT saved with one shard per block, dispatched under machine facts given as data (the
available RAM of a machine the model fits in, of one it does not, of one whose RAM cannot even
hold the "cpu" part), with the ring and with the page cache. The engine's fetcher, its
read-ahead, its ring, the units it streams, and whether each "cpu" weight is a memory map or a
copy in process memory are checked against the printed plan.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import bigviz
from bigviz.checkpoint.save import save_sharded
from bigviz.core.errors import PlanError
from bigviz.core.stream_plan import RAM_SHARE, MachineFacts, ring_bytes
from bigviz.engine.fetchers.cache import StreamingFetcher
from bigviz.engine.fetchers.cpu import CpuFetcher
from bigviz.engine.fetchers.ring import RingFetcher
from bigviz.engine.fetchers.spans import file_span
from bigviz.models import GPT, GPTConfig
from bigviz.osio.direct import ALIGN

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="file spans need Linux")

CONFIG = GPTConfig(n_layer=5, n_head=4, n_embd=64, vocab_size=200, block_size=16)
FETCHER_CLASS = {"cpu": CpuFetcher, "ring": RingFetcher, "cache": StreamingFetcher}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPT]:
    torch.manual_seed(1)
    model = GPT(CONFIG).eval()
    folder = tmp_path_factory.mktemp("chain") / "ckpt"
    block = sum(p.numel() * 4 for p in model.transformer.h[0].parameters())
    save_sharded(model, folder, max_shard_size=block, progress=False)
    return folder, model


def _map(n_cpu: int) -> dict[str, str]:
    device_map = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.ln_f": "cpu", "lm_head": "cpu"}
    device_map.update({f"transformer.h.{i}": "cpu" if i < n_cpu else "disk" for i in range(CONFIG.n_layer)})
    return device_map


def _meta() -> GPT:
    with bigviz.init_empty_weights():
        return GPT(CONFIG)


def _facts(folder: Path, device_map: dict[str, str], room: str) -> MachineFacts:
    """Facts of a machine whose RAM holds the whole model ("all"), the "cpu" part and the
    ring but not the whole model ("part"), or not even the "cpu" part ("less")."""
    probe = bigviz.dispatch_plan(_meta(), folder, device_map, machine=MachineFacts(10**12)).stream
    assert probe is not None
    block = max(u.nbytes for u in probe.units if u.residency == "streamed")
    wanted = {
        "all": probe.resident_bytes + probe.streamed_bytes + block,
        "part": probe.resident_bytes + ring_bytes(block) + block // 8,
        "less": probe.resident_bytes // 2,
    }[room]
    return MachineFacts(int(wanted / RAM_SHARE) + 1)


def _check_engine_did(model: GPT, plan: bigviz.DispatchPlan) -> None:
    """The dispatched model runs exactly as ``plan`` says."""
    stream = plan.stream
    assert stream is not None
    state = model._bigviz_dispatch
    residency = bigviz.residency(model)
    assert residency.plan == stream  # the plan carried out is the plan printed
    # the units: the same, in the same order, each streamed by the fetcher named
    assert [u.name for u in state.units] == [u.name for u in plan.units]
    streamed = [u for u in stream.units if u.residency == "streamed"]
    assert [u.name for u in streamed] == [u.name for u in plan.units]
    assert {u.fetcher for u in streamed} == {stream.fetcher}
    fetcher = state.scheduler.fetcher
    assert type(fetcher) is FETCHER_CLASS[stream.fetcher] and residency.fetcher == type(fetcher).__name__
    assert state.scheduler.depth == max(1, stream.depth)
    if stream.fetcher == "ring":  # the planned ring, rounded up to whole blocks of its reads
        assert stream.ring_bytes <= fetcher.capacity <= stream.ring_bytes + 8 * ALIGN * len(plan.units)
        assert residency.ring_bytes == fetcher.capacity
    if stream.fetch_ahead:  # the first streamed units are on their way before the first forward
        ahead = [h.unit.name for h in state.scheduler._pending.values()]
        assert ahead == [u.name for u in state.units[: stream.fetch_ahead]]
    # the resident part: memory maps of the checkpoint, or a copy in process memory
    kept = {u.name: u.residency for u in stream.units if u.residency != "streamed"}
    for entry, how in kept.items():
        module = model.get_submodule(entry) if entry else model
        for tensor in module.parameters():
            mapped = file_span(tensor) is not None
            assert mapped == (how == "mapped"), f"{entry}: planned {how}, found {'mapped' if mapped else 'a copy'}"


@pytest.mark.parametrize(
    ("room", "resident", "stream", "mode", "fetcher"),
    [
        ("all", "auto", "ring", "map", "cpu"),
        ("part", "auto", "ring", "copy", "ring"),
        ("part", "auto", "cache", "copy", "cache"),
        ("all", "copy", "ring", "copy", "ring"),
        ("part", "map", "ring", "map", "cpu"),
        ("less", "auto", "ring", "map", "cpu"),  # issue 22: the copy would not fit, kept mapped
    ],
)
def test_the_engine_does_what_the_dispatch_plan_printed(
    checkpoint: tuple[Path, GPT], room: str, resident: str, stream: str, mode: str, fetcher: str
) -> None:
    folder, reference = checkpoint
    device_map = _map(2)
    facts = _facts(folder, device_map, room)
    plan = bigviz.dispatch_plan(_meta(), folder, device_map, resident=resident, stream=stream, machine=facts)
    printed = plan.summary()
    assert plan.stream is not None and (plan.stream.mode, plan.stream.fetcher) == (mode, fetcher)
    assert f"streamed by the {fetcher} fetcher" in printed  # said before anything moves
    assert ("copied into RAM once" in printed) == (mode == "copy")
    if room == "less":
        assert "do not fit" in plan.stream.reason and "available RAM" in plan.stream.reason
    model = bigviz.load_checkpoint_and_dispatch(
        _meta(), folder, device_map, resident=resident, stream=stream, machine=facts
    )
    try:
        _check_engine_did(model, plan)
        idx = torch.arange(7).view(1, 7)
        with torch.no_grad():
            for _ in range(2):  # and it computes the same, twice (the ring read over in between)
                assert torch.equal(model(idx)[0], reference(idx)[0])
    finally:
        bigviz.remove_hooks(model)


def test_a_copy_larger_than_ram_is_refused_before_anything_is_read(checkpoint: tuple[Path, GPT]) -> None:
    # issue 22: a "cpu" budget above the machine's RAM must not take the model into process memory
    folder, _ = checkpoint
    device_map = _map(4)
    facts = _facts(folder, device_map, "less")
    model = _meta()
    with pytest.raises(PlanError, match=r"resident='copy' refused.*available RAM") as info:
        bigviz.load_checkpoint_and_dispatch(model, folder, device_map, resident="copy", machine=facts)
    assert "max_memory" in str(info.value)  # the fix: a lower cpu budget
    assert all(p.is_meta for p in model.parameters()) and not hasattr(model, "_bigviz_dispatch")


def test_the_dispatch_of_a_plan_is_the_plans_dispatch(checkpoint: tuple[Path, GPT]) -> None:
    # the chain: a DevicePlan planned for a machine whose RAM does not hold the model streams
    # what the planner reserved room for, through the ring the planner left out of the cpu budget
    folder, reference = checkpoint
    meta = _meta()
    total = sum(p.numel() * 4 for p in reference.parameters())
    block = sum(p.numel() * 4 for p in reference.transformer.h[0].parameters())
    facts = MachineFacts(int((total - 2 * block) / RAM_SHARE))
    budget = facts.room - ring_bytes(block)
    device_plan = bigviz.plan(meta, {"cpu": budget, "disk": "1TB"})
    device, load, dispatch = bigviz.plan_chain(meta, folder, device_plan, machine=facts)
    assert device is device_plan and load is not None and dispatch is not None
    assert dispatch.stream is not None and dispatch.stream.mode == "copy" and dispatch.stream.fetcher == "ring"
    assert dispatch.stream.resident_bytes + dispatch.stream.ring_bytes <= facts.room
    model = bigviz.load_checkpoint_and_dispatch(meta, folder, device_plan, machine=facts)
    try:
        _check_engine_did(model, dispatch)
    finally:
        bigviz.remove_hooks(model)


def test_residency_of_a_model_bigviz_did_not_dispatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="not dispatched by bigviz"):
        bigviz.residency(torch.nn.Linear(2, 2))
