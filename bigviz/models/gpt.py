"""A GPT-2 family decoder in the minGPT / nanoGPT style, read top to bottom.

Parameter names are GPT-2's (``transformer.wte``, ``transformer.h.0.attn.c_attn``, ...) with
minGPT's ``nn.Linear`` layout (HF's GPT-2 uses ``Conv1D``, whose weights are transposed), so
a minGPT-style checkpoint loads as it is. Every block is self-contained: it only needs the
tensors it is given and its own parameters, which is what lets a dispatch engine put each
block on a different device, or stream it in from disk.

Example:
    >>> import torch
    >>> model = GPT(GPTConfig.preset("gpt-tiny")).eval()
    >>> logits, loss = model(torch.zeros(2, 5, dtype=torch.long))
    >>> logits.shape, loss
    (torch.Size([2, 5, 128]), None)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn
from torch import Tensor

from bigviz.models.cache import KVCache, causal_attention
from bigviz.models.generation import generate as generate_tokens
from bigviz.models.generation import lm_loss
from bigviz.models.presets import config_dict, from_preset

__all__ = ["GPTConfig", "CausalSelfAttention", "MLP", "Block", "GPT", "GPT_PRESETS"]

# name -> config fields; the four GPT-2 sizes, plus two small ones for tests and demos
GPT_PRESETS: dict[str, dict[str, int]] = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M params
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
    "gpt-tiny": dict(n_layer=2, n_head=2, n_embd=32, vocab_size=128, block_size=64),
    "gpt-mini": dict(n_layer=4, n_head=4, n_embd=128, vocab_size=512, block_size=128),
}


@dataclass
class GPTConfig:
    """Hyperparameters of a GPT-2 style model (defaults: GPT-2 small, 124M).

    Example:
        >>> GPTConfig.preset("gpt2-xl").n_layer
        48
    """

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    block_size: int = 1024  # the longest context: wpe has one row per position
    dropout: float = 0.0
    bias: bool = True  # GPT-2 has biases in Linears and LayerNorms
    tie_weights: bool = True  # lm_head shares wte's matrix, as in GPT-2
    model_type: ClassVar[str] = "bigviz-gpt"  # how a checkpoint's config.json names this family

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """The config of a named size ("gpt2" ... "gpt2-xl", "gpt-tiny", "gpt-mini").

        Example:
            >>> GPTConfig.preset("gpt2", block_size=256).block_size
            256
        """
        return from_preset(cls, GPT_PRESETS, name, overrides)

    def to_dict(self) -> dict[str, Any]:
        """The fields and ``model_type``: what ``config.json`` of a checkpoint records.

        Example:
            >>> GPTConfig.preset("gpt-tiny").to_dict()["model_type"]
            'bigviz-gpt'
        """
        return config_dict(self)


class CausalSelfAttention(nn.Module):
    """Multi-head masked self-attention; one fused projection makes q, k and v."""

    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # which slot of the KV cache is ours
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, *, cache: KVCache | None = None) -> Tensor:
        B, T, C = x.shape  # batch, new positions, n_embd
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, nh, T, hs): heads become a batch dimension
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, nh, T_past + T, hs)
        dropout_p = self.dropout if self.training else 0.0
        y = causal_attention(q, k, v, dropout_p=dropout_p)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: 4x wider, GELU (GPT-2's tanh approximation)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2 was trained with the approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    """One transformer layer (pre-norm, two residual branches): the unit a device map
    must never split, because the residual adds tensors from both halves."""

    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, *, cache: KVCache | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), cache=cache)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class GPT(nn.Module):
    """GPT-2 language model: token + position embeddings, ``n_layer`` Blocks, a tied head.

    Example:
        >>> import torch
        >>> model = GPT(GPTConfig.preset("gpt-tiny"))
        >>> model.lm_head.weight is model.transformer.wte.weight
        True
    """

    _no_split_modules: ClassVar[list[str]] = ["Block"]
    _tied_weights_keys: ClassVar[list[str]] = ["lm_head.weight"]
    _skip_keys_device_placement: ClassVar[list[str]] = ["cache"]

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()
        if not self.lm_head.weight.is_meta:  # on meta there are no values to set: skip the work
            self._init_parameters()

    def tie_weights(self) -> None:
        """Make ``lm_head`` share the embedding matrix (when the config ties them): one
        Parameter object under two names, saved once, loaded once, placed together. Loaders
        call this again after replacing meta tensors, as transformers does."""
        if self.config.tie_weights:
            self.lm_head.weight = self.transformer.wte.weight

    def _init_parameters(self) -> None:
        """nanoGPT's init: N(0, 0.02) weights, zero biases, and the projections that feed
        the residual stream scaled by 1/sqrt(2 * n_layer) so its variance does not grow
        with depth."""
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, *, cache: KVCache | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Logits ``(B, T, vocab_size)`` and, given ``targets`` ``(B, T)``, the mean
        cross-entropy (targets of -1 are ignored). With a ``cache``, ``idx`` holds only the
        new tokens and their positions continue from ``cache.seq_len``."""
        B, T = idx.shape
        start = cache.seq_len if cache is not None else 0
        if start + T > self.config.block_size:
            raise ValueError(
                f"GPT: {start} cached + {T} new positions exceed block_size="
                f"{self.config.block_size}; crop the input or reset the cache"
            )
        # made on idx's device, not a parameter's: wpe may live on another device
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)  # (T,)
        tok_emb = self.transformer.wte(idx)  # (B, T, C)
        pos_emb = self.transformer.wpe(pos)  # (T, C), broadcast over the batch
        # a device map may put wte and wpe on different devices: meet on the token side
        x = self.transformer.drop(tok_emb + pos_emb.to(tok_emb.device))
        for block in self.transformer.h:
            x = block(x, cache=cache)
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, vocab_size)
        return logits, lm_loss(logits, targets)

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        *,
        use_cache: bool = True,
    ) -> Tensor:
        """Append ``max_new_tokens`` to ``idx`` ``(B, T)``; returns ``(B, T + max_new_tokens)``.

        Greedy unless ``do_sample``. Without the cache the context is cropped to
        ``block_size`` at every step, as in minGPT; with it the result is the same.

        Example:
            >>> import torch
            >>> model = GPT(GPTConfig.preset("gpt-tiny")).eval()
            >>> model.generate(torch.zeros(1, 3, dtype=torch.long), 5).shape
            torch.Size([1, 8])
        """
        return generate_tokens(
            self, idx, max_new_tokens, max_len=self.config.block_size, do_sample=do_sample,
            temperature=temperature, top_k=top_k, use_cache=use_cache,
        )  # fmt: skip
