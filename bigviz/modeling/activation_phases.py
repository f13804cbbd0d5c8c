"""The activations of a transformers decoder's prefill step, phase by phase, from its config.

What :mod:`bigviz.modeling.workload` asks of each layer besides its cache: the tensors its
attention, MLP or experts, or state-space scan keep alive at their peak, and what the whole
forward carries (embeddings, residual stream, masks, rotary tables), as
:class:`~bigviz.core.workload.Term` s the workload model sums per token and per batch. The
terms follow the code that runs: transformers' attention implementations (eager's score
matrix at the softmax peak, SDPA's masks, none for flash attention), DeepSeek's latent
attention, dense and mixture-of-experts MLPs, and on the CPU PyTorch's reference scan for
Mamba and Mamba-2.

Example:
    >>> score_bytes("float32"), score_bytes("bfloat16")
    (8.0, 10.0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bigviz.core.dtypes import itemsize
from bigviz.core.workload import StepSpec, Term

__all__ = ["Dims", "ATTENTION_TYPES", "INT64", "score_terms", "score_bytes", "decoder_steps", "mamba_steps"]

INT64 = 8.0  # bytes of the int64 positions and ids a forward carries


@dataclass(frozen=True)
class Dims:
    """The shapes of a transformers decoder, read from its (text) config."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    attn: str  # "eager", "sdpa", "flash_attention_2", ...

    @classmethod
    def of(cls, config: Any) -> Dims:
        heads = int(getattr(config, "num_attention_heads", 0) or 0)
        hidden = int(config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else 0)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
        attn = getattr(config, "_attn_implementation", None) or "eager"
        return cls(
            int(config.num_hidden_layers),
            hidden,
            heads,
            int(kv_heads),
            int(head_dim),
            int(ffn),
            int(getattr(config, "vocab_size", 0) or 0),
            str(attn),
        )


ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "hybrid", "hybrid_sliding")


def score_terms(heads: int, size: float, per: str) -> tuple[Term, ...]:
    """Eager attention's scores at the softmax peak (none for fused kernels: ``size`` 0)."""
    return (Term(heads, size, per=per),) if size else ()


def decoder_steps(
    config: Any,
    dims: Dims,
    types: Sequence[str],
    kwargs: Sequence[Mapping[str, Any]],
    cpu: bool,
    dtype: str,
    states: Sequence[tuple[tuple[int, str | None], ...]] = (),
) -> tuple[tuple[Term, ...], list[StepSpec], list[str]]:
    """Attention decoders (GPT-2, Llama, Mistral, Gemma 2, Qwen2, Mixtral, DeepSeek, ...).
    The input embeddings' output is not carried here: it is held on its own device."""
    gpt2 = getattr(config, "model_type", "") == "gpt2"
    masks = _mask_terms(dims, types, kwargs)
    rope = () if gpt2 else (Term(2 * _rope_dim(config, dims), batched=False),)
    positions = (Term(dims.hidden, batched=False),) if gpt2 else ()  # GPT-2's wpe output
    carried = (*positions, Term(dims.hidden), *rope, *masks, Term(1, INT64), Term(1, INT64, batched=False))
    notes = [f"attention: {dims.attn}" + (" (reference kernels on CPU)" if cpu else " (fused kernels)")]
    attention = _attention_phases(config, dims, bool(masks), cpu, dtype)
    steps = []
    for index in range(dims.layers):
        mlp = _mlp_phase(config, dims, index, gpt2)
        if dims.attn == "eager":  # the layer keeps the returned attention weights (``h, _ = attn(...)``)
            mlp = (*mlp, Term(dims.heads, per="pair"))
        mixer = _state_phase(dims, states[index], cpu) if states and states[index] else ()
        kinds = types[index] if index < len(types) else "full_attention"
        own = attention if kinds in ATTENTION_TYPES or not mixer else ()
        steps.append(StepSpec((*own, *((mixer,) if mixer else ()), mlp)))
    return carried, steps, notes


def _state_phase(dims: Dims, states: Sequence[tuple[int, str | None]], cpu: bool) -> tuple[Term, ...]:
    """A recurrent or convolutional mixer's peak, sized by the states its cache holds (read
    from the model): its projections and conv output, about as wide as the conv state
    (channels x kernel); on the CPU, the reference scan's float32 tensors, three times the
    recurrent state per token (Mamba's selective scan; Mamba-2's and DeltaNet's chunked forms
    keep fewer). An estimate: the README's accuracy table says how close it is."""
    conv = sum(n for n, dtype in states if dtype is None)
    recurrent = sum(n for n, dtype in states if dtype is not None)
    phase = (Term(dims.hidden), Term(conv))
    return (*phase, Term(3 * recurrent, 4.0)) if cpu and recurrent else phase


def _rope_dim(config: Any, dims: Dims) -> int:
    return int(getattr(config, "qk_rope_head_dim", None) or dims.head_dim)


def _mask_terms(dims: Dims, types: Sequence[str], kwargs: Sequence[Mapping[str, Any]]) -> tuple[Term, ...]:
    """The (B, 1, T, T) masks the model builds once per layer type and keeps all forward:
    eager attention adds a float mask to its scores; SDPA needs a boolean one only for a
    sliding window (a plain causal mask becomes ``is_causal``); flash attention none."""
    kinds = {t for t in types if t in ("full_attention", "sliding_attention", "chunked_attention")}
    if dims.attn == "eager":
        return tuple(Term(1, batched=True, per="pair") for _ in kinds)
    if dims.attn == "sdpa":
        return tuple(Term(1, 1.0, per="pair") for t in kinds if t != "full_attention")
    return ()


def score_bytes(dtype: str) -> float:
    """Bytes per attention score at eager attention's softmax peak: the scores (plus mask) in
    the compute dtype, a float32 copy of them when the dtype is narrower (``softmax(...,
    dtype=torch.float32)`` casts its input first), and the float32 probabilities: 8 bytes in
    float32, 10 in bfloat16 or float16.

    Example:
        >>> score_bytes("float32"), score_bytes("bfloat16")
        (8.0, 10.0)
    """
    size = itemsize(dtype)
    return float(size + 4 + (4 if size < 4 else 0))


def _attention_phases(
    config: Any, dims: Dims, masked: bool, cpu: bool, dtype: str = "float32"
) -> tuple[tuple[Term, ...], ...]:
    """What is alive at each peak of the attention, besides the carried tensors."""
    if getattr(config, "kv_lora_rank", None):
        return (_mla_phase(config, dims, cpu),)
    gpt2 = getattr(config, "model_type", "") == "gpt2"
    q, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    repeat = 2 * q if dims.kv_heads != dims.heads and (masked or dims.attn == "eager") else 0
    normed = Term(dims.hidden)
    if dims.attn == "eager":  # scores (+ mask) next to their float32 softmax (see score_bytes)
        return ((normed, Term((3 * q if gpt2 else q) + repeat), Term(dims.heads, score_bytes(dtype), per="pair")),)
    # SDPA turns a boolean mask into a float one for the call
    mask_copy = (Term(1, per="pair"),) if masked else ()
    if gpt2:  # the fused c_attn output (q, k, v are views of it), SDPA's output and its copy
        return ((normed, Term(3 * q + 2 * q)), (normed, Term(3 * q + q), *mask_copy))
    return (
        (normed, Term(4 * q + 2 * kv)),  # rotary on q: q, q * cos, rotate_half(q) * sin, their sum; k, v
        (normed, Term(2 * q + repeat), *mask_copy),  # the call: rotated q, (repeated k, v), output
        (normed, Term(3 * q + repeat)),  # the output made contiguous
    )


def _mla_phase(config: Any, dims: Dims, cpu: bool) -> tuple[Term, ...]:
    """DeepSeek's multi-head latent attention: the latent is expanded into every head's key
    and value for the attention (transformers caches the latent, not the expansion)."""
    heads = dims.heads
    qk = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
    v, rope = int(config.v_head_dim), int(config.qk_rope_head_dim)
    latent = int(config.kv_lora_rank) + rope
    per_token = Term(heads * (3 * qk + rope + (int(config.qk_nope_head_dim) + v)) + latent)
    if cpu and qk != v:  # SDPA's math kernel: scaled q, scores and their softmax (float32)
        return (
            Term(dims.hidden),
            per_token,
            Term(heads * qk),
            Term(heads, 8.0, per="pair"),
            Term(1, 4.0, batched=False, per="pair"),
        )
    return (Term(dims.hidden), per_token, Term(2 * heads * v))


def _mlp_phase(config: Any, dims: Dims, index: int, gpt2: bool) -> tuple[Term, ...]:
    """The feed-forward's peak: gated MLPs keep act(gate), up and their product (3 x F);
    GPT-2's tanh GELU keeps four 4H tensors; experts run on ``top_k`` copies of each token."""
    if gpt2:  # attn_output, residual and ln_2 out stay alive in GPT2Block
        return (Term(3 * dims.hidden), Term(4 * dims.ffn))
    experts = _experts(config, index)
    if experts is None:
        return (Term(2 * dims.hidden), Term(3 * dims.ffn))
    n, top_k, ffn, shared = experts
    routed = Term(top_k * (dims.hidden + 4 * ffn))  # gathered tokens, gate_up, act(gate), product
    router = (Term(n, 4.0), Term(n), Term(top_k * 4, INT64))  # logits, probabilities, choices
    return (Term(2 * dims.hidden), routed, *router)


def _experts(config: Any, index: int) -> tuple[int, int, int, int] | None:
    """``(experts, top_k, expert width, shared width)`` of layer ``index``, or ``None`` for a
    dense layer (DeepSeek's first ``first_k_dense_replace`` layers are dense)."""
    n = (
        getattr(config, "num_local_experts", None)
        or getattr(config, "n_routed_experts", None)
        or getattr(config, "num_experts", None)
    )
    top_k = getattr(config, "num_experts_per_tok", None)
    if not n or not top_k or index < int(getattr(config, "first_k_dense_replace", 0) or 0):
        return None
    ffn = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = int(getattr(config, "n_shared_experts", 0) or 0) * int(ffn)
    return int(n), int(top_k), int(ffn), shared


def mamba_steps(config: Any, dims: Dims, cpu: bool) -> tuple[tuple[Term, ...], list[StepSpec], list[str]]:
    """Mamba's mixer: in_proj (2 x inner), the conv, dt, and the selective scan. PyTorch's
    reference scan keeps three (B, inner, T, state) float32 tensors; mamba-ssm's kernel none."""
    inner = int(getattr(config, "intermediate_size", None) or getattr(config, "expand", 2) * dims.hidden)
    state = int(config.state_size)
    phase: tuple[Term, ...] = (Term(3 * dims.hidden), Term(2 * inner), Term(6 * inner))
    if cpu:
        phase = (*phase, Term(3 * inner * state, 4.0))
    carried = (Term(3 * dims.hidden), Term(1, INT64), Term(1, INT64, batched=False))
    note = "selective scan: " + ("PyTorch reference (CPU)" if cpu else "fused kernel (mamba-ssm)")
    if getattr(config, "model_type", "") != "mamba":  # Mamba-2's chunked scan: the cache is exact, this is not
        note += "; activations: Mamba's formula, not checked against this model type"
    return carried, [StepSpec((phase,))] * dims.layers, [note]
