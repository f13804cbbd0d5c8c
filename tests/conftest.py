"""Shared test fixtures: tiny bigviz reference models, tiny transformers models, GPU skipping.

Every fixture is function-scoped and cheap (well under a second): each test gets its own
model, so one test's in-place changes never leak into another. Nothing is downloaded: the
transformers models are built from small configs with random (seeded) weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bigviz.models import GPT, GPTConfig, Llama, LlamaConfig

SEED = 0


def cuda_available() -> bool:
    """True when a CUDA device can run the ``@pytest.mark.gpu`` tests."""
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.gpu`` tests, with a reason, on machines without CUDA."""
    if cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # a marker, not any keyword "gpu"
            item.add_marker(skip_gpu)


@pytest.fixture
def tiny_gpt() -> GPT:
    """bigviz GPT "gpt-tiny" (2 layers, 2 heads, 32 wide, vocab 128, block 64), eval."""
    torch.manual_seed(SEED)
    return GPT(GPTConfig.preset("gpt-tiny")).eval()


@pytest.fixture
def tiny_llama() -> Llama:
    """bigviz Llama "llama-tiny" (2 layers, 4 heads on 2 kv heads, dim 64, vocab 256), eval."""
    torch.manual_seed(SEED)
    return Llama(LlamaConfig.preset("llama-tiny")).eval()


@pytest.fixture
def hf_gpt2() -> nn.Module:
    """transformers GPT2LMHeadModel, 2 layers, 2 heads, 32 wide, vocab 128, 64 positions."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(SEED)
    config = GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=64,
        bos_token_id=0, eos_token_id=0,  # GPT-2's 50256 is outside this tiny vocabulary
    )  # fmt: skip
    return GPT2LMHeadModel(config).eval()


@pytest.fixture
def hf_bert() -> nn.Module:
    """transformers BertModel, 2 layers, 2 heads, 32 wide, vocab 128, 64 positions."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(SEED)
    config = BertConfig(
        num_hidden_layers=2,
        num_attention_heads=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=128,
        max_position_embeddings=64,
    )
    return BertModel(config).eval()


@pytest.fixture
def hf_llama() -> nn.Module:
    """transformers LlamaForCausalLM with llama-tiny's shape (GQA: 4 heads, 2 kv heads)."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    config = HFLlamaConfig(
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
    )
    return LlamaForCausalLM(config).eval()
