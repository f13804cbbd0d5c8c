"""Token-by-token generation shared by the reference models (minGPT's loop plus a KV cache).

Both :class:`~bigviz.models.gpt.GPT` and :class:`~bigviz.models.llama.Llama` take
``forward(idx, *, cache=None) -> (logits, loss)`` and a context length, which is all this
loop needs. New tokens are created on ``idx.device`` even when the logits come back from
another device (a dispatched model's ``lm_head`` may live elsewhere).

Example:
    >>> import torch
    >>> from bigviz.models import build
    >>> model = build("gpt-tiny").eval()
    >>> generate(model, torch.zeros(1, 3, dtype=torch.long), 4, max_len=64).shape
    torch.Size([1, 7])
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from bigviz.models.cache import KVCache

__all__ = ["generate", "next_token"]


class CausalLM(Protocol):
    def __call__(
        self, idx: Tensor, targets: Tensor | None = None, *, cache: KVCache | None = None
    ) -> tuple[Tensor, Tensor | None]: ...


def lm_loss(logits: Tensor, targets: Tensor | None) -> Tensor | None:
    """Next-token cross-entropy over ``(B, T, V)`` logits; targets of -1 are ignored. The
    targets move to the logits' device: a device map may put the head anywhere."""
    if targets is None:
        return None
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.to(logits.device).view(-1), ignore_index=-1)


def next_token(
    logits: Tensor, *, do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None
) -> Tensor:
    """Pick one token per row from last-position logits ``(B, V)``; returns ``(B, 1)``.

    Greedy (argmax) unless ``do_sample``; then logits are divided by ``temperature``,
    cut to the ``top_k`` largest and sampled. Softmax runs in float32 so half-precision
    models sample from a proper distribution.

    Example:
        >>> next_token(torch.tensor([[0.1, 3.0, -1.0]])).tolist()
        [[1]]
    """
    if not do_sample:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1)


def _check_args(max_new_tokens: int, temperature: float, top_k: int | None) -> None:
    problems = []
    if max_new_tokens < 0:
        problems.append(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature <= 0:
        problems.append(f"temperature={temperature} must be > 0 (use do_sample=False for greedy)")
    if top_k is not None and top_k < 1:
        problems.append(f"top_k={top_k} must be >= 1 or None")
    if problems:
        raise ValueError("generate: " + "; ".join(problems))


@torch.no_grad()
def generate(
    model: CausalLM,
    idx: Tensor,
    max_new_tokens: int,
    *,
    max_len: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    use_cache: bool = True,
) -> Tensor:
    """Extend ``idx`` ``(B, T)`` by ``max_new_tokens``; returns ``(B, T + max_new_tokens)``.

    With ``use_cache`` the prompt is run once (prefill), then one token per step. When the
    cache reaches ``max_len`` it is reset and the last ``max_len`` tokens are run again, which
    is exactly what the uncached path does (it crops to ``max_len`` every step), so both paths
    give the same tokens.

    Args:
        model: A causal LM following the ``forward(idx, *, cache=None)`` contract.
        idx: Prompt token ids ``(B, T)``.
        max_new_tokens: How many tokens to append.
        max_len: The model's context length (``block_size`` / ``max_seq_len``).
        do_sample: Sample instead of taking the argmax.
        temperature: Divides the logits before sampling.
        top_k: Sample only among the ``top_k`` most likely tokens.
        use_cache: Reuse keys and values between steps.
    """
    _check_args(max_new_tokens, temperature, top_k)
    cache = KVCache() if use_cache else None
    for _ in range(max_new_tokens):
        if cache is None or cache.seq_len == 0 or cache.seq_len >= max_len:
            if cache is not None:
                cache.reset()
            step = idx[:, -max_len:]  # (B, <= max_len): the whole (cropped) context
        else:
            step = idx[:, -1:]  # (B, 1): the cache holds everything before it
        logits, _ = model(step, cache=cache)  # (B, T_step, V)
        last = logits[:, -1, :]  # (B, V)
        new = next_token(last, do_sample=do_sample, temperature=temperature, top_k=top_k)
        idx = torch.cat((idx, new.to(idx.device)), dim=1)
    return idx
