"""A Llama family decoder, read top to bottom: RMSNorm, rotary positions, grouped-query
attention, a SwiGLU MLP, and the decoder layer and model built from them.

Parameter names are Hugging Face's (``model.embed_tokens``, ``model.layers.0.self_attn.q_proj``,
``model.norm``, ``lm_head``) and the rotary convention is theirs (``rotate_half``), so an HF
Llama state dict loads as it is and gives the same logits. Every decoder layer only needs the
tensors it is given (hidden states, cos, sin) and its own parameters, so a dispatch engine can
put each layer on a different device or stream it in from disk.

Example:
    >>> import torch
    >>> model = Llama(LlamaConfig.preset("llama-tiny")).eval()
    >>> logits, _ = model(torch.zeros(1, 6, dtype=torch.long))
    >>> logits.shape
    torch.Size([1, 6, 256])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from bigviz.models.cache import KVCache, causal_attention
from bigviz.models.generation import generate as generate_tokens
from bigviz.models.generation import lm_loss
from bigviz.models.presets import config_dict, from_preset

__all__ = [
    "LlamaConfig", "RMSNorm", "RotaryEmbedding", "LlamaAttention", "LlamaMLP",
    "LlamaDecoderLayer", "LlamaModel", "Llama", "LLAMA_PRESETS",
]  # fmt: skip

# name -> config fields; Llama 2's 7B/13B/70B shapes (70B uses 8 kv heads) and a tiny one
LLAMA_PRESETS: dict[str, dict[str, int]] = {
    "llama-7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008),
    "llama-13b": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824),
    "llama-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    "llama-tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=172, vocab_size=256, max_seq_len=128),
}


@dataclass
class LlamaConfig:
    """Hyperparameters of a Llama style model (defaults: the 7B shape).

    Example:
        >>> cfg = LlamaConfig.preset("llama-70b")
        >>> cfg.head_dim, cfg.n_heads // cfg.n_kv_heads  # 8 query heads share each kv head
        (128, 8)
    """

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: one kv head per query head (no grouping)
    ffn_dim: int = 11008
    vocab_size: int = 32000
    max_seq_len: int = 2048  # the context generate() keeps; RoPE itself has no table size
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_weights: bool = False
    model_type: ClassVar[str] = "bigviz-llama"  # how a checkpoint's config.json names this family

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        problems = []
        if self.dim % self.n_heads:
            problems.append(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        elif self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if problems:
            raise ValueError("LlamaConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """The config of a named size ("llama-7b", "llama-13b", "llama-70b", "llama-tiny").

        Example:
            >>> LlamaConfig.preset("llama-tiny", n_layers=3).n_layers
            3
        """
        return from_preset(cls, LLAMA_PRESETS, name, overrides)

    def to_dict(self) -> dict[str, Any]:
        """The fields and ``model_type``: what ``config.json`` of a checkpoint records."""
        return config_dict(self)


class RMSNorm(nn.Module):
    """LayerNorm without the mean and the bias: x / rms(x) * weight, computed in float32
    so half-precision models do not lose the small variances."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _inv_freq(head_dim: int, theta: float, device: torch.device | None = None) -> Tensor:
    """One rotation frequency per pair of channels: theta^(-2i/head_dim), shape (head_dim/2,)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta**exponents)


class RotaryEmbedding(nn.Module):
    """cos and sin of ``position * frequency``, computed on the fly for the positions asked.

    ``inv_freq`` is a non-persistent buffer: derived from the config, never saved. It is
    rebuilt when it cannot be trusted: left on the meta device by an empty build (a
    checkpoint never fills it) or rounded by ``model.half()`` (RoPE phases need float32).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim, self.theta = config.head_dim, config.rope_theta
        self.register_buffer("inv_freq", _inv_freq(self.head_dim, self.theta), persistent=False)

    def forward(self, positions: Tensor, *, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        inv_freq = self.inv_freq
        if inv_freq.is_meta or inv_freq.dtype != torch.float32:
            inv_freq = _inv_freq(self.head_dim, self.theta, positions.device)
        freqs = torch.outer(positions.float(), inv_freq)  # (T, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim): HF's half-split layout
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """(B, kv_heads, T, hd) -> (B, kv_heads * n_rep, T, hd): each kv head serves n_rep
    query heads. The cache keeps the small tensor; only attention sees the repeat."""
    if n_rep == 1:
        return x
    B, n_kv, T, hd = x.shape
    return x[:, :, None].expand(B, n_kv, n_rep, T, hd).reshape(B, n_kv * n_rep, T, hd)


class LlamaAttention(nn.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # which slot of the KV cache is ours
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.head_dim
        kv_dim = config.n_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.k_proj = nn.Linear(config.dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, kv_dim, bias=False)
        self.o_proj = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, *, cache: KVCache | None = None) -> Tensor:
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_heads, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, hd).transpose(1, 2)  # (B, nkv, T, hd)
        # rotate q and k by their positions; cos/sin (T, hd) broadcast over batch and heads
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, nkv, T_past + T, hd), rotated once
        n_rep = self.n_heads // self.n_kv_heads
        y = causal_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep))  # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, dim)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); the gate decides how much of ``up`` passes."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """One pre-norm layer with two residual branches: the unit a device map never splits."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, *, cache: KVCache | None = None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache=cache)
        return x + self.mlp(self.post_attention_layernorm(x))  # (B, T, dim)


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm: token ids in, hidden states out."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, idx: Tensor, *, cache: KVCache | None = None) -> Tensor:
        start = cache.seq_len if cache is not None else 0
        # made on idx's device, not a buffer's: rotary_emb may live on another device
        pos = torch.arange(start, start + idx.shape[1], device=idx.device)  # (T,)
        x = self.embed_tokens(idx)  # (B, T, dim)
        cos, sin = self.rotary_emb(pos, dtype=x.dtype)  # 2 x (T, head_dim), shared by all layers
        for layer in self.layers:
            x = layer(x, cos, sin, cache=cache)
        return self.norm(x)


class Llama(nn.Module):
    """Llama causal language model: a :class:`LlamaModel` and an untied ``lm_head``.

    Example:
        >>> import torch
        >>> model = Llama(LlamaConfig.preset("llama-tiny")).eval()
        >>> model.generate(torch.zeros(1, 2, dtype=torch.long), 3).shape
        torch.Size([1, 5])
    """

    _no_split_modules: ClassVar[list[str]] = ["LlamaDecoderLayer"]
    _skip_keys_device_placement: ClassVar[list[str]] = ["cache"]

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self._tied_weights_keys = ["lm_head.weight"] if config.tie_weights else []
        self.tie_weights()
        if not self.lm_head.weight.is_meta:  # on meta there are no values to set: skip the work
            self.apply(self._init_weights)

    def tie_weights(self) -> None:
        """Make ``lm_head`` share the embedding matrix (when the config ties them): one
        Parameter object under two names, saved once, loaded once, placed together. Loaders
        call this again after replacing meta tensors, as transformers does."""
        if self.config.tie_weights:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, *, cache: KVCache | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Logits ``(B, T, vocab_size)`` and, given ``targets`` ``(B, T)``, the mean
        cross-entropy (targets of -1 are ignored). With a ``cache``, ``idx`` holds only the
        new tokens and their positions continue from ``cache.seq_len``."""
        logits = self.lm_head(self.model(idx, cache=cache))  # (B, T, vocab_size)
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

        Greedy unless ``do_sample``; the context is kept to ``max_seq_len`` tokens.
        """
        return generate_tokens(
            self, idx, max_new_tokens, max_len=self.config.max_seq_len, do_sample=do_sample,
            temperature=temperature, top_k=top_k, use_cache=use_cache,
        )  # fmt: skip
