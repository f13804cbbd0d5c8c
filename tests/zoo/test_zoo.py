"""The transformers zoo: every architecture plans, loads, offloads and runs as ``from_pretrained`` does.

For each architecture of `tests.zoo.specs` (tiny configs, random weights, written by
``save_pretrained`` in 20 KB shards, nothing downloaded):

- plans made from the meta model and from the checkpoint folder place every tensor exactly
  once, within the budget;
- loads with an all-cpu, a half-disk (every other block), an all-disk and an ``"auto"`` map give
  the logits of ``from_pretrained``, bit for bit, in float32 and in bfloat16;
- greedy ``generate`` and its KV-cache step give transformers' tokens and logits;
- the map planned from the checkpoint, exported as JSON, runs unchanged in bigviz and in
  ``from_pretrained(device_map=...)``;
- ``cpu_offload`` / ``disk_offload`` / ``remove_hooks`` cycles give the same logits and leave
  no file open or mapped and no thread running.
"""

from __future__ import annotations

import gc
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import bigviz
from bigviz.core.names import is_prefix

pytest.importorskip("transformers")

from tests.zoo.helpers import forward, inputs, meta_model, reference, save_checkpoint  # noqa: E402
from tests.zoo.specs import SPECS, Spec  # noqa: E402

ZOO = [pytest.param(s, id=s.name, marks=[pytest.mark.slow] if s.slow else []) for s in SPECS]
GENERATIVE = [p for p, s in zip(ZOO, SPECS) if s.generative]
DTYPES = [pytest.param(None, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """spec name -> its sharded checkpoint folder (written once per run)."""
    root = tmp_path_factory.mktemp("zoo")
    cache: dict[str, Path] = {}

    def get(spec: Spec) -> Path:
        if spec.name not in cache:
            cache[spec.name] = save_checkpoint(spec, root / spec.name)
        return cache[spec.name]

    return get


@pytest.fixture(scope="module")
def references(checkpoints):
    """spec name -> (``from_pretrained`` model in float32, its logits), loaded once per run.
    Tests that hook the model take their hooks off again."""
    cache: dict[str, tuple[nn.Module, torch.Tensor]] = {}

    def get(spec: Spec) -> tuple[nn.Module, torch.Tensor]:
        if spec.name not in cache:
            model = reference(spec, checkpoints(spec))
            cache[spec.name] = (model, forward(model, spec))
        return cache[spec.name]

    return get


def half_disk(model: nn.Module) -> dict[str, str]:
    """Every other block on disk: instances of the model's ``_no_split_modules``, or (for
    models that declare none) the items of its ``ModuleList``s."""
    classes = set(model._no_split_modules or ())
    modules = dict(model.named_modules())
    blocks = [n for n, m in modules.items() if n and type(m).__name__ in classes]
    if len(blocks) < 2:
        blocks = [n for n in modules if n and isinstance(modules[n.rpartition(".")[0]], nn.ModuleList)]
    blocks = [b for b in blocks if not any(o != b and is_prefix(o, b) for o in blocks)]  # outermost
    assert len(blocks) >= 2, f"{type(model).__name__}: fewer than two blocks to split"
    return {"": "cpu", **{b: "disk" for b in blocks[1::2]}}


def total_bytes(spec: Spec, dtype: torch.dtype | None = None) -> int:
    return bigviz.compute_module_sizes(meta_model(spec), dtype=dtype)[""]


@pytest.mark.parametrize("spec", ZOO)
def test_plans_place_every_tensor_once_within_budget(spec: Spec, checkpoints):
    folder = checkpoints(spec)
    budget = total_bytes(spec) // 2
    for source in (meta_model(spec), folder):
        plan = bigviz.plan(source, {"cpu": budget})
        tree = plan.tree
        for name in tree.tensors:
            owners = [p.name for p in plan.placements if is_prefix(p.name, name)]
            assert len(owners) == 1, f"{name} placed {len(owners)} times: {owners}"
        assert plan.usage_of("cpu").used <= budget
        assert "disk" in plan.device_map.values()
    # the checkpoint's plan names what the model has (tied head, computed buffers included)
    assert set(bigviz.plan(folder, {"cpu": budget}).tree.tensors) == set(
        bigviz.plan(meta_model(spec), {"cpu": budget}).tree.tensors
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", ZOO)
def test_loads_equal_from_pretrained(spec: Spec, dtype: torch.dtype | None, checkpoints, references, tmp_path: Path):
    folder = checkpoints(spec)
    expected = forward(reference(spec, folder, dtype), spec, dtype) if dtype else references(spec)[1]
    maps = {"all-cpu": {"": "cpu"}, "half-disk": half_disk(meta_model(spec)), "all-disk": {"": "disk"}, "auto": "auto"}
    for name, device_map in maps.items():
        model = bigviz.load_checkpoint_and_dispatch(
            meta_model(spec),
            folder,
            device_map,
            dtype=dtype,
            offload_folder=tmp_path / name,
            max_memory={"cpu": total_bytes(spec, dtype) // 2} if device_map == "auto" else None,
        )
        got = forward(model, spec, dtype)
        assert got.dtype == expected.dtype and torch.equal(got, expected), f"{name} map"
        if name == "auto":
            assert "disk" in model.hf_device_map.values()
        bigviz.remove_hooks(model)


def _generate(model: nn.Module, spec: Spec) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    out = model.generate(
        **inputs(spec),
        max_new_tokens=3,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        pad_token_id=0,
    )
    return out.sequences, out.logits  # logits of the first step, then of KV-cache steps


@pytest.mark.parametrize("spec", GENERATIVE)
def test_generate_and_cache_step_equal_transformers(spec: Spec, checkpoints, references, tmp_path: Path):
    folder = checkpoints(spec)
    tokens, logits = _generate(references(spec)[0], spec)
    model = bigviz.load_checkpoint_and_dispatch(
        meta_model(spec), folder, half_disk(meta_model(spec)), offload_folder=tmp_path
    )
    got_tokens, got_logits = _generate(model, spec)
    assert torch.equal(got_tokens, tokens)
    assert len(got_logits) == len(logits) == 3
    for step, (a, b) in enumerate(zip(got_logits, logits)):
        assert torch.equal(a, b), f"step {step}"
    bigviz.remove_hooks(model)


@pytest.mark.parametrize("spec", ZOO)
def test_exported_map_runs_in_bigviz_and_from_pretrained(spec: Spec, checkpoints, references, tmp_path: Path):
    folder = checkpoints(spec)
    expected = references(spec)[1]
    plan = bigviz.plan(folder, {"cpu": total_bytes(spec) // 2})
    bigviz.save_device_map(plan.device_map, tmp_path / "map.json")
    exported = json.loads((tmp_path / "map.json").read_text())
    theirs = reference(spec, folder, device_map=exported, offload_folder=tmp_path / "theirs")
    assert torch.equal(forward(theirs, spec), expected)
    ours = bigviz.load_checkpoint_and_dispatch(
        meta_model(spec), folder, bigviz.load_device_map(tmp_path / "map.json"), offload_folder=tmp_path / "ours"
    )
    assert torch.equal(forward(ours, spec), expected)
    bigviz.remove_hooks(ours)


def _open_under(folder: Path) -> list[str]:
    """Files under ``folder`` this process has open or memory-mapped."""
    folder = str(folder.resolve())
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    maps = [line.split(maxsplit=5)[-1] for line in Path("/proc/self/maps").read_text().splitlines()]
    return sorted({p.strip() for p in fds + maps if p.strip().startswith(folder)})


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("spec", ZOO)
def test_offload_cycles_leave_no_open_files_or_threads(spec: Spec, checkpoints, references, tmp_path: Path):
    folder = checkpoints(spec)
    model, expected = references(spec)
    threads = threading.active_count()
    bigviz.cpu_offload(model, "cpu")
    assert torch.equal(forward(model, spec), expected)
    bigviz.remove_hooks(model)
    bigviz.disk_offload(model, tmp_path / "off", "cpu")
    assert torch.equal(forward(model, spec), expected)
    assert torch.equal(forward(model, spec), expected)  # the files stay open between forwards
    bigviz.remove_hooks(model)
    assert torch.equal(forward(model, spec), expected)  # weights back in memory, files let go
    gc.collect()
    assert _open_under(tmp_path) == []
    assert threading.active_count() <= threads
    # a model loaded with everything on disk lets its checkpoint's files go once unhooked
    # (the reference model, loaded by transformers, may map some itself: only ours count)
    before = _open_under(folder)
    loaded = bigviz.load_checkpoint_and_dispatch(meta_model(spec), folder, {"": "disk"}, offload_folder=tmp_path / "l")
    assert torch.equal(forward(loaded, spec), expected)
    bigviz.remove_hooks(loaded)
    del loaded
    gc.collect()
    assert set(_open_under(folder)) <= set(before) and _open_under(tmp_path) == []
    assert threading.active_count() <= threads
