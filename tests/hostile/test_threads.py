"""Promise: several threads may call one dispatched (offloaded) model at once; each gets the
right answer. A dispatched forward holds the model's lock: offloaded units swap weights in and
out of shared modules, so two forwards at once would see each other's half-set modules."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import bigviz
from bigviz.models import GPT, GPTConfig

THREADS, CALLS = 4, 12


@pytest.fixture
def busy_switching() -> Iterator[None]:
    """Switch threads every 10 us, so unsafe code interleaves on any machine, busy or not."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _run_threads(model: torch.nn.Module, inputs: list[torch.Tensor]) -> tuple[dict, list[BaseException]]:
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def work(t: int) -> None:
        try:
            start.wait()
            for call in range(CALLS):
                with torch.no_grad():
                    outputs[(t, call)] = model(inputs[t])[0]
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outputs, errors


@pytest.mark.parametrize("prefetch", [True, False])
def test_concurrent_forwards_of_a_disk_offloaded_model(tmp_path: Path, busy_switching, prefetch: bool):
    torch.manual_seed(0)
    reference = GPT(GPTConfig.preset("gpt-tiny")).eval()
    folder = bigviz.save_sharded(reference, tmp_path / "ckpt", progress=False)
    with bigviz.init_empty_weights():
        model = GPT(reference.config)
    device_map = {
        "transformer.wte": "cpu",
        "transformer.wpe": "cpu",
        "transformer.h": "disk",
        "transformer.ln_f": "disk",
        "lm_head": "cpu",
    }
    model = bigviz.load_checkpoint_and_dispatch(model, folder, device_map, prefetch=prefetch)
    inputs = [torch.randint(0, 128, (1, 4 + t), generator=torch.Generator().manual_seed(t)) for t in range(THREADS)]
    with torch.no_grad():
        expected = [reference(x)[0] for x in inputs]
    outputs, errors = _run_threads(model, inputs)
    assert errors == []
    assert len(outputs) == THREADS * CALLS
    for (t, call), out in outputs.items():
        assert torch.equal(out, expected[t]), (t, call)
    assert all(p.is_meta for p in model.transformer.h.parameters())  # all back on meta after
    bigviz.remove_hooks(model)


def test_concurrent_forwards_of_a_cpu_offloaded_model(busy_switching):
    torch.manual_seed(0)
    reference = GPT(GPTConfig.preset("gpt-tiny")).eval()
    model = GPT(reference.config).eval()
    model.load_state_dict(reference.state_dict())
    model = bigviz.cpu_offload(model, "cpu")
    inputs = [torch.randint(0, 128, (2, 3 + t), generator=torch.Generator().manual_seed(t)) for t in range(THREADS)]
    with torch.no_grad():
        expected = [reference(x)[0] for x in inputs]
    outputs, errors = _run_threads(model, inputs)
    assert errors == []
    for (t, _), out in outputs.items():
        assert torch.equal(out, expected[t])
