"""The hook protocol (bigviz.engine.hooks) and argument moving (bigviz.engine.devices)."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn

from bigviz.engine.devices import available_devices, check_devices_exist, find_device, send_to_device
from bigviz.engine.hooks import (
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
    remove_hooks,
)


class Recorder(ModelHook):
    """Logs every call into a shared list and adds ``delta`` to the output."""

    def __init__(self, log: list, tag: str, delta: float = 0.0) -> None:
        self.log, self.tag, self.delta = log, tag, delta

    def init_hook(self, module):
        self.log.append((self.tag, "init"))
        return module

    def pre_forward(self, module, *args, **kwargs):
        self.log.append((self.tag, "pre", tuple(kwargs)))
        return args, kwargs

    def post_forward(self, module, output):
        self.log.append((self.tag, "post"))
        return output + self.delta

    def detach_hook(self, module):
        self.log.append((self.tag, "detach"))
        return module


class WithKwarg(nn.Module):
    def forward(self, x, *, scale=1.0):
        return x * scale


def test_hook_sees_kwargs_and_changes_output():
    log: list = []
    module = add_hook_to_module(WithKwarg(), Recorder(log, "a", delta=1.0))
    assert module(torch.ones(2), scale=3.0).tolist() == [4.0, 4.0]
    assert log == [("a", "init"), ("a", "pre", ("scale",)), ("a", "post")]


def test_remove_restores_the_class_forward_and_output():
    module = add_hook_to_module(WithKwarg(), Recorder([], "a", delta=5.0))
    assert "forward" in module.__dict__
    remove_hook_from_module(module)
    assert "forward" not in module.__dict__ and not hasattr(module, "_hf_hook")
    assert not hasattr(module, "_old_forward")
    assert module(torch.ones(1)).item() == 1.0


def test_remove_puts_back_a_forward_someone_else_patched():
    module = WithKwarg()
    patched = lambda x: x + 100  # noqa: E731
    module.forward = patched
    add_hook_to_module(module, ModelHook())
    remove_hook_from_module(module)
    assert module.forward is patched


def test_append_chains_in_order_and_detaches_in_reverse():
    log: list = []
    module = WithKwarg()
    add_hook_to_module(module, Recorder(log, "a", delta=1.0))
    add_hook_to_module(module, Recorder(log, "b", delta=10.0), append=True)
    assert isinstance(module._hf_hook, SequentialHook)
    log.clear()
    assert module(torch.zeros(1)).item() == 11.0
    assert [entry[:2] for entry in log] == [("a", "pre"), ("b", "pre"), ("a", "post"), ("b", "post")]
    log.clear()
    remove_hook_from_module(module)
    assert log == [("b", "detach"), ("a", "detach")]


def test_replacing_a_hook_keeps_the_true_original_forward():
    module = WithKwarg()
    original = module.forward
    add_hook_to_module(module, Recorder([], "a", delta=1.0))
    add_hook_to_module(module, Recorder([], "b", delta=2.0))  # replaces "a"
    assert module(torch.zeros(1)).item() == 2.0
    assert module._old_forward == original


def test_no_grad_hook_runs_forward_without_autograd():
    class NoGrad(ModelHook):
        no_grad = True

    layer = add_hook_to_module(nn.Linear(2, 2), NoGrad())
    assert not layer(torch.ones(1, 2)).requires_grad
    assert SequentialHook(ModelHook(), NoGrad()).no_grad


def test_error_in_forward_reaches_the_hook_then_the_caller():
    calls: list = []

    class Cleanup(ModelHook):
        def on_forward_error(self, module):
            calls.append("cleanup")

    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    module = add_hook_to_module(Boom(), Cleanup())
    with pytest.raises(ValueError, match="boom"):
        module(torch.ones(1))
    assert calls == ["cleanup"]


def test_remove_hooks_recurses_children_before_parents():
    log: list = []
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)), nn.Linear(2, 2))
    add_hook_to_module(model, Recorder(log, "root"))
    add_hook_to_module(model[0][0], Recorder(log, "leaf"))
    log.clear()
    remove_hooks(model)
    assert log == [("leaf", "detach"), ("root", "detach")]
    assert not any(hasattr(m, "_hf_hook") for m in model.modules())


def test_accelerate_hooks_attach_with_bigviz_and_back():
    accelerate_hooks = pytest.importorskip("accelerate.hooks")

    class Plus(accelerate_hooks.ModelHook):
        def post_forward(self, module, output):
            return output + 1

    module = add_hook_to_module(WithKwarg(), Plus())
    assert module(torch.zeros(1)).item() == 1.0
    accelerate_hooks.remove_hook_from_module(module)
    assert module(torch.zeros(1)).item() == 0.0
    accelerate_hooks.add_hook_to_module(module, Recorder([], "ours", delta=2.0))
    assert module(torch.zeros(1)).item() == 2.0
    remove_hook_from_module(module)
    assert module(torch.zeros(1)).item() == 0.0


# ----------------------------------------------------------------------------- devices
Pair = namedtuple("Pair", "a b")


def test_send_to_device_keeps_unchanged_containers_and_skips_keys():
    cache = object()
    args = (torch.ones(1), [torch.zeros(2)], {"x": torch.ones(1), "cache": cache}, Pair(torch.ones(1), 3), "s")
    assert send_to_device(args, "cpu") is args
    kwargs = {"cache": cache, "x": torch.ones(1)}
    assert send_to_device(kwargs, "cpu", skip_keys=["cache"])["cache"] is cache


def test_send_to_device_rebuilds_every_kind_of_container():
    args = (Pair(torch.ones(2), 7), [torch.zeros(1)], {"k": torch.ones(1)})
    moved = send_to_device(args, torch.device("meta"))
    assert isinstance(moved[0], Pair) and moved[0].b == 7 and moved[0].a.device.type == "meta"
    assert moved[1][0].device.type == "meta" and moved[2]["k"].device.type == "meta"


def test_find_device_skips_keys_and_non_tensors():
    assert find_device(((), {"cache": torch.ones(1, device="meta"), "x": torch.ones(1)}), skip_keys=["cache"]) == (
        torch.device("cpu")
    )
    assert find_device(("text", 3)) is None


@pytest.mark.skipif(torch.cuda.device_count() > 3, reason="this machine has a GPU 3")
def test_missing_gpu_is_named_with_what_exists():
    with pytest.raises(ValueError) as info:
        check_devices_exist({"transformer.h.0": 3, "transformer.h.1": "cuda:3", "lm_head": "cpu"})
    message = str(info.value)
    assert "GPU 3 (transformer.h.0, transformer.h.1)" in message
    assert "available: CPU, disk" in message  # what the machine has, named as the planner names it
    assert available_devices()[-2:] == ["cpu", "disk"]


def test_removing_hooks_keeps_a_users_own_method_patches():
    module = nn.Linear(2, 2)
    mine = lambda *a, **k: "mine"  # noqa: E731
    module.to = mine
    add_hook_to_module(module, ModelHook())
    remove_hook_from_module(module)
    assert module.to is mine
