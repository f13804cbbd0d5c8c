"""The engine on a CUDA device: pinned CPU offload, disk via staging, side-stream prefetch.

Marked ``gpu``: skipped cleanly (with the reason) on machines without CUDA.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import bigviz
from bigviz.checkpoint.save import save_sharded
from bigviz.engine.big_modeling import cpu_offload, cpu_offload_with_hook, load_checkpoint_and_dispatch
from bigviz.engine.dispatch import dispatch_model
from bigviz.engine.hooks import remove_hooks
from bigviz.engine.fetchers.cuda import CudaFetcher
from bigviz.models import GPT, GPTConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("gpt-mini")).eval()


def gpu_map(storage: dict[int, str]) -> dict[str, int | str]:
    """Embeddings and head on GPU 0; block i on ``storage.get(i, 0)``."""
    dm: dict[str, int | str] = {"transformer.wte": 0, "transformer.wpe": 0, "transformer.drop": 0}
    dm.update({f"transformer.h.{i}": storage.get(i, 0) for i in range(4)})
    dm.update({"transformer.ln_f": 0, "lm_head": 0})
    return dm


MAPS = {
    "cpu-streamed": gpu_map({2: "cpu", 3: "cpu"}),
    "disk": gpu_map({2: "disk", 3: "disk"}),
    "mixed": gpu_map({0: "cpu", 1: "disk", 3: "cpu"}),
}


def ids(n: int = 9) -> torch.Tensor:
    return torch.randint(0, 512, (2, n), generator=torch.Generator().manual_seed(1))


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", list(MAPS))
@pytest.mark.parametrize("prefetch", [True, False])
def test_parity_with_the_model_in_gpu_memory(kind: str, prefetch: bool, tmp_path: Path):
    reference = gpt().cuda()
    x = ids()
    with torch.no_grad():
        expected, _ = reference(x.cuda())
    model = dispatch_model(gpt(), MAPS[kind], offload_folder=tmp_path, prefetch=prefetch)
    with torch.no_grad():
        for _ in range(3):  # the first pass records the order; the next ones prefetch by it
            got, _ = model(x)  # input on the CPU: the output comes back there
            assert got.device.type == "cpu"
            close(got, expected)
    assert isinstance(model._bigviz_dispatch.scheduler.fetcher, CudaFetcher)


def test_cpu_units_are_pinned_once_and_weights_return_to_meta(tmp_path: Path):
    model = dispatch_model(gpt(), MAPS["cpu-streamed"])
    units = model._bigviz_dispatch.units
    assert [u.name for u in units] == ["transformer.h.2", "transformer.h.3"]
    assert all(store[key].is_pinned() for u in units for key, store in u.sources.items())
    with torch.no_grad():
        model(ids())
    torch.cuda.synchronize()
    assert all(p.is_meta for u in units for p in u.module.parameters())


def test_prefetch_copies_run_in_the_background_and_memory_is_released(tmp_path: Path):
    folder = save_sharded(gpt().state_dict(), tmp_path / "ckpt", progress=False)
    with bigviz.init_empty_weights():
        model = GPT(GPTConfig.preset("gpt-mini"))
    model = load_checkpoint_and_dispatch(model, folder, gpu_map({i: "disk" for i in range(4)}))
    threads: set[str] = set()
    original = model._bigviz_dispatch.scheduler.fetcher._job

    def spy(unit):
        threads.add(threading.current_thread().name)
        return original(unit)

    model._bigviz_dispatch.scheduler.fetcher._job = spy
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    with torch.no_grad():
        for _ in range(3):
            model(ids())
    torch.cuda.synchronize()
    assert any(t.startswith("bigviz-prefetch") for t in threads)
    block_bytes = sum(p.numel() * 4 for p in gpt().transformer.h[0].parameters())
    # at most the block fetched ahead may still be held (with wrap off: none)
    assert torch.cuda.memory_allocated() - resident <= block_bytes


def test_generation_parity_on_gpu(tmp_path: Path):
    reference = gpt().cuda()
    x = ids(5)[:1]
    expected = reference.generate(x.cuda(), 8).cpu()
    model = dispatch_model(gpt(), MAPS["mixed"], offload_folder=tmp_path)
    assert torch.equal(model.generate(x, 8).cpu(), expected)


def test_cpu_offload_streams_every_block_to_the_gpu():
    reference = gpt().cuda()
    x = ids()
    with torch.no_grad():
        expected, _ = reference(x.cuda())
    model = cpu_offload(gpt(), "cuda:0")
    assert all(p.is_meta for p in model.transformer.h.parameters())
    with torch.no_grad():
        close(model(x)[0], expected)
    remove_hooks(model)
    assert all(p.device.type == "cpu" for p in model.parameters())  # back where it was


def test_cpu_offload_with_hook_chain_moves_models():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    a, hook_a = cpu_offload_with_hook(a, "cuda:0")
    b, hook_b = cpu_offload_with_hook(b, "cuda:0", prev_module_hook=hook_a)
    x = torch.randn(2, 4)
    h = a(x)
    assert a.weight.device.type == "cuda"
    b(h)
    assert a.weight.device.type == "cpu" and b.weight.device.type == "cuda"
    hook_b.offload()
    assert b.weight.device.type == "cpu"


def test_moving_a_gpu_dispatched_model_raises():
    model = dispatch_model(gpt(), MAPS["cpu-streamed"])
    with pytest.raises(RuntimeError, match="remove_hooks"):
        model.cuda()
