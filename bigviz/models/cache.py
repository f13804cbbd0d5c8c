"""Pieces both reference models share: the key/value cache and causal attention over it.

Generating one token at a time would recompute the keys and values of the whole prefix at
every step. A :class:`KVCache` keeps them, per layer, so each step only runs the new token
through the model. Each layer's tensors stay on the device that layer runs on, so a model
split across devices (or partly offloaded) can keep one cache object.

Example:
    >>> import torch
    >>> cache = KVCache()
    >>> k = v = torch.zeros(1, 2, 5, 4)  # (B, heads, T, head_dim)
    >>> _ = cache.update(0, k, v)
    >>> cache.seq_len
    5
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["KVCache", "causal_attention"]


class KVCache:
    """Keys and values seen so far, one ``(B, kv_heads, T, head_dim)`` pair per layer.

    The model reads :attr:`seq_len` once, before its first block runs, to number the new
    positions; each block then calls :meth:`update` with its own ``layer_idx``. The object
    is mutated in place and deliberately has no ``.to()`` method: dispatch hooks that move
    arguments between devices must leave it alone (it is named ``cache`` in every forward,
    and the models list that name in ``_skip_keys_device_placement``).

    Example:
        >>> import torch
        >>> cache = KVCache()
        >>> k, v = cache.update(1, torch.ones(2, 4, 3, 8), torch.ones(2, 4, 3, 8))
        >>> k.shape, cache.seq_len, len(cache)
        (torch.Size([2, 4, 3, 8]), 0, 2)
    """

    def __init__(self) -> None:
        self.keys: list[Tensor | None] = []
        self.values: list[Tensor | None] = []

    def __len__(self) -> int:
        """Number of layer slots (filled or not)."""
        return len(self.keys)

    def __repr__(self) -> str:
        return f"KVCache(layers={len(self)}, seq_len={self.seq_len}, nbytes={self.nbytes})"

    @property
    def seq_len(self) -> int:
        """Positions already cached: the length of layer 0's keys (0 when empty)."""
        first = self.keys[0] if self.keys else None
        return 0 if first is None else first.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held by all cached keys and values (the memory a plan must leave for it)."""
        tensors = [t for t in self.keys + self.values if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append this step's ``k``, ``v`` for one layer and return all of them so far.

        Args:
            layer_idx: Which layer is writing (0-based).
            k: New keys, ``(B, kv_heads, T_new, head_dim)``.
            v: New values, same shape as ``k``.

        Returns:
            ``(keys, values)`` of shape ``(B, kv_heads, T_old + T_new, head_dim)``.
        """
        while len(self.keys) <= layer_idx:  # layers may write in any order
            self.keys.append(None)
            self.values.append(None)
        old_k, old_v = self.keys[layer_idx], self.values[layer_idx]
        if old_k is not None and old_v is not None:
            k = torch.cat((old_k, k), dim=2)
            v = torch.cat((old_v, v), dim=2)
        else:  # a view (GPT's split of its fused q/k/v projection) would keep the whole projection alive
            k, v = k.contiguous(), v.contiguous()
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v

    def reset(self) -> None:
        """Forget everything (used when the context window is full and must slide)."""
        self.keys.clear()
        self.values.clear()


def causal_attention(q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float = 0.0) -> Tensor:
    """Causal scaled-dot-product attention where the queries are the *last* keys' positions.

    With a cache, ``q`` holds only the new ``T_q`` positions while ``k``/``v`` hold all
    ``T_k``. SDPA's ``is_causal`` aligns its mask to the top-left corner, which is only right
    when ``T_q == T_k``; for one new token no mask is needed; otherwise (a chunk appended to
    a cache) the mask is built aligned to the bottom-right.

    Args:
        q: Queries ``(B, heads, T_q, head_dim)``.
        k: Keys ``(B, heads, T_k, head_dim)`` with ``T_k >= T_q``.
        v: Values, same shape as ``k``.
        dropout_p: Attention dropout (training only; pass 0.0 in eval).

    Returns:
        ``(B, heads, T_q, head_dim)``.

    Example:
        >>> import torch
        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> causal_attention(q, k, v).shape
        torch.Size([1, 2, 4, 8])
    """
    t_q, t_k = q.shape[2], k.shape[2]
    if t_q == t_k:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if t_q == 1:  # the newest token may look at everything
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(diagonal=t_k - t_q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
