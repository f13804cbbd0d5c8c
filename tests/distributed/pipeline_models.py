"""Tiny decoder LMs for the pipeline tests (random, seeded weights; nothing downloaded), each
saved as a sharded checkpoint with its config, and single-process greedy generation to
compare the pipelines with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import bigviz
from bigviz.models import GPT, GPTConfig, Llama, LlamaConfig


def hf_llama(
    layers: int = 4, *, hidden: int = 64, ffn: int = 172, heads: int = 4, vocab: int = 256, positions: int = 128
) -> nn.Module:
    """Grouped-query attention (``heads`` query heads, 2 key/value heads)."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(
        HFLlamaConfig(
            hidden_size=hidden,
            intermediate_size=ffn,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=2,
            vocab_size=vocab,
            max_position_embeddings=positions,
        )
    )


def hf_gpt2() -> nn.Module:
    """Learned positions, a fused qkv projection, a tied head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(n_layer=4, n_head=2, n_embd=32, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0)
    )


def hf_gemma2() -> nn.Module:
    """Alternating sliding-window and full attention, soft-capped logits, a tied head: a
    forward that differs from Llama's in the ways a hand-written stage would miss."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(
        Gemma2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=128,
            sliding_window=3,
            max_position_embeddings=64,
        )
    )


def hf_mixtral() -> nn.Module:
    """Experts stored one by one in the checkpoint, fused in the model: a stage must read the
    keys each fused tensor is converted from."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(
        MixtralConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        )
    )


def hf_qwen2() -> nn.Module:
    """A tied head (tie_word_embeddings) and q/k/v biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
    )


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "gpt": lambda: GPT(GPTConfig.preset("gpt-tiny", n_layer=4)),
    "llama": lambda: Llama(LlamaConfig.preset("llama-tiny", n_layers=4)),
    "hf-llama": hf_llama,
    "hf-gpt2": hf_gpt2,
    "hf-gemma2": hf_gemma2,
    "hf-mixtral": hf_mixtral,
    "hf-qwen2": hf_qwen2,
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[name]().eval()


def save(model: nn.Module, folder: Path, *, shard: str = "40KB", eos: int | None = None) -> Path:
    """A sharded checkpoint with its config; a transformers model's generation config says
    ``eos`` (None: no end-of-sequence token, so generation runs to the end)."""
    if isinstance(model, (GPT, Llama)):
        return bigviz.save_sharded(model, folder, max_shard_size=shard, config=model.config, progress=False)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    model.save_pretrained(folder, max_shard_size=shard)
    return folder


def single_process_generate(
    model: nn.Module, ids: torch.Tensor, new: int, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The model's own greedy ``generate`` on one thread, as torchrun's workers run
    (OMP_NUM_THREADS=1: a matmul's sums may be ordered differently on two threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            if isinstance(model, (GPT, Llama)):
                return model.generate(ids, new)
            masked = {} if attention_mask is None else {"attention_mask": attention_mask}
            return model.generate(ids, max_new_tokens=new, do_sample=False, **masked)
    finally:
        torch.set_num_threads(threads)
