"""A balanced plan never streams weights in where filling the GPUs in order would not."""

from __future__ import annotations

import bigviz


def test_a_balanced_plan_that_would_offload_is_filled_in_order_instead():
    # Llama 3.1 70B, 32k tokens, two 80 GiB cards with 1.5 GiB headroom each: GPU 0 also holds
    # the embeddings' output, so its balanced share is a little under its budget, one layer moves
    # to GPU 1, which then overflows: the balanced caps alone would stream 5.1 GiB from the CPU
    config = bigviz.config_path("llama-3.1-70b")
    hardware = {0: "80GiB", 1: "80GiB", "cpu": "340GiB"}
    run = dict(context_length=32768, reserve={0: "1.5GiB", 1: "1.5GiB"})
    balanced = bigviz.plan(config, hardware, strategy="auto", **run)
    in_order = bigviz.plan(config, hardware, strategy="sequential", **run)
    assert sum(in_order.offloaded_bytes().values()) == 0
    assert balanced.offloaded_bytes() == {"cpu": 0, "disk": 0} and all(u.free >= 0 for u in balanced.usage)
    assert balanced.strategy == "auto" and any("placed in order instead" in n for n in balanced.notes)
    assert balanced.device_map == in_order.device_map


def test_balanced_low_0_keeps_its_low_gpu_0():
    config = bigviz.config_path("llama-3.1-70b")
    plan = bigviz.plan(config, {0: "80GiB", 1: "80GiB", "cpu": "340GiB"}, strategy="balanced_low_0")
    assert not any("placed in order instead" in n for n in plan.notes)
