"""Promise: a model already dispatched (by any of bigviz's entry points, or by accelerate) is
refused by every dispatching entry point, naming it, before anything is read or opened: no
hooks stacked on hooks, no files or threads of the first dispatch leaked, the model still runs
as it did. ``remove_hooks`` first, and it dispatches again."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import bigviz
from bigviz.models import GPT, GPTConfig

DEVICE_MAP = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.h": "disk",
              "transformer.ln_f": "cpu", "lm_head": "cpu"}  # fmt: skip


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return bigviz.save_sharded(GPT(GPTConfig.preset("gpt-tiny")), tmp_path_factory.mktemp("c") / "ckpt", progress=False)


def _meta() -> GPT:
    with bigviz.init_empty_weights():
        return GPT(GPTConfig.preset("gpt-tiny"))


def _loaded(checkpoint: Path) -> GPT:
    model = _meta()
    bigviz.load_checkpoint_in_model(model, checkpoint, progress=False)
    return model


FIRST: dict[str, Callable[[Path, Path], torch.nn.Module]] = {
    "load_checkpoint_and_dispatch": lambda ckpt, tmp: bigviz.load_checkpoint_and_dispatch(_meta(), ckpt, DEVICE_MAP),
    "dispatch_model": lambda ckpt, tmp: bigviz.dispatch_model(_loaded(ckpt), DEVICE_MAP, offload_folder=tmp / "a"),
    "cpu_offload": lambda ckpt, tmp: bigviz.cpu_offload(_loaded(ckpt), "cpu"),
    "disk_offload": lambda ckpt, tmp: bigviz.disk_offload(_loaded(ckpt), tmp / "a"),
    "accelerate": lambda ckpt, tmp: pytest.importorskip("accelerate").cpu_offload(_loaded(ckpt), torch.device("cpu")),
}
AGAIN: dict[str, Callable[[torch.nn.Module, Path, Path], object]] = {
    "load_checkpoint_and_dispatch": lambda m, ckpt, tmp: bigviz.load_checkpoint_and_dispatch(m, ckpt, DEVICE_MAP),
    "load_checkpoint_and_dispatch(auto)": lambda m, ckpt, tmp: bigviz.load_checkpoint_and_dispatch(m, ckpt, "auto"),
    "dispatch_model": lambda m, ckpt, tmp: bigviz.dispatch_model(m, DEVICE_MAP, offload_folder=tmp / "b"),
    "cpu_offload": lambda m, ckpt, tmp: bigviz.cpu_offload(m, "cpu"),
    "disk_offload": lambda m, ckpt, tmp: bigviz.disk_offload(m, tmp / "b"),
    "dispatch_model(a block)": lambda m, ckpt, tmp: bigviz.dispatch_model(m.transformer.h[0], {"": "cpu"}),
}


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0


@pytest.mark.parametrize("first", list(FIRST))
@pytest.mark.parametrize("again", list(AGAIN))
def test_a_dispatched_model_is_refused_by_every_entry_point(checkpoint: Path, tmp_path: Path, first: str, again: str):
    model = FIRST[first](checkpoint, tmp_path)
    if again.endswith("(a block)") and not hasattr(model.transformer.h[0], "_hf_hook"):
        pytest.skip("no hook on the block: it runs in place, there is nothing to stack")
    with torch.no_grad():
        want = model(_ids())[0]
    files, threads = _open_files(), threading.active_count()
    forward = model.forward
    with pytest.raises(ValueError, match="already dispatched") as err:
        AGAIN[again](model, checkpoint, tmp_path)
    assert "remove_hooks" in str(err.value)
    assert _open_files() == files and threading.active_count() == threads  # nothing opened or started
    assert model.forward is forward and not (tmp_path / "b").exists()
    with torch.no_grad():
        assert torch.equal(model(_ids())[0], want)  # it still runs as it did


@pytest.mark.parametrize("first", ["load_checkpoint_and_dispatch", "disk_offload", "cpu_offload"])
def test_after_remove_hooks_it_dispatches_again(checkpoint: Path, tmp_path: Path, first: str):
    model = FIRST[first](checkpoint, tmp_path)
    with torch.no_grad():
        want = model(_ids())[0]
    bigviz.remove_hooks(model)
    if first == "load_checkpoint_and_dispatch":  # its disk weights were read in place: load them again
        model = bigviz.load_checkpoint_and_dispatch(model, checkpoint, DEVICE_MAP)
    else:
        model = bigviz.dispatch_model(model, DEVICE_MAP, offload_folder=tmp_path / "c")
    with torch.no_grad():
        assert torch.equal(model(_ids())[0], want)
