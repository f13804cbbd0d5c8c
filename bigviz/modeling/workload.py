"""Read what a model's run keeps, from the model or its config: the bridge from an
``nn.Module`` (or a transformers config) into :mod:`bigviz.core.workload`.

The cache layout follows transformers' own rules (``cache_utils.get_layer_types_and_kwargs``):
each layer's type (``full_attention``, ``sliding_attention``, ``chunked_attention``,
``linear_attention``, ...), ``num_key_value_heads``, ``head_dim``, ``sliding_window``,
DeepSeek's latent (``kv_lora_rank + qk_rope_head_dim``, which transformers caches in place
of the full keys and values), and Mamba's conv and recurrent states.

The activation estimate is the peak of the tensors a prefill step keeps alive in
transformers' (or bigviz's) code: per layer, the largest of its phases (attention, MLP or
experts, state-space scan), plus what the whole forward carries (embeddings, residual
stream, masks, rotary tables). It depends on the kernels that run: on a GPU bigviz assumes
fused kernels (SDPA's flash or memory-efficient attention, mamba-ssm's scan); on the CPU,
PyTorch's reference paths (a (T x T) score matrix when SDPA falls back to its math kernel,
Mamba's (B x I x T x N) scan tensors). Eager attention materialises the scores anywhere.

Example:
    >>> import torch
    >>> from bigviz.core.workload import Workload
    >>> from bigviz.models import build
    >>> with torch.device("meta"):
    ...     model = build("llama-tiny")                    # 2 layers, 2 kv heads of 16
    >>> kv_cache_bytes(model, 1, 100)                      # 100 tokens x 2 x 2 x 16 x 4 bytes
    {'model.layers.0': 25600, 'model.layers.1': 25600}
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from bigviz.core.dtypes import FLOATING_DTYPES, canonical_dtype
from bigviz.core.workload import CacheSpec, RunSpec, StepSpec, Term, Workload
from bigviz.modeling.configs import model_from_config
from bigviz.models.gpt import GPT
from bigviz.models.llama import Llama
from bigviz.core.errors import UsageError

__all__ = ["run_spec", "kv_cache_bytes", "compute_dtype"]

ModelOrConfig = Any  # nn.Module, transformers PretrainedConfig, GPTConfig/LlamaConfig, config path
_INT64 = 8.0


# ---- public entry points ---------------------------------------------------------------------
def compute_dtype(model: nn.Module) -> str:
    """The dtype a model computes in: the most common floating dtype of its parameters."""
    counts: Counter[str] = Counter()
    for p in model.parameters():
        name = canonical_dtype(p.dtype)
        if name in FLOATING_DTYPES:
            counts[name] += p.numel()
    return counts.most_common(1)[0][0] if counts else "float32"


def kv_cache_bytes(
    model_or_config: ModelOrConfig, batch_size: int, context_length: int, dtype: torch.dtype | str | None = None
) -> dict[str, int]:
    """Bytes of KV cache (or recurrent state) per layer module for a run.

    Args:
        model_or_config: an ``nn.Module`` (on meta is fine), a transformers config, a
            ``config.json`` path (or folder), or a bigviz ``GPTConfig`` / ``LlamaConfig``.
        batch_size: sequences decoded together.
        context_length: tokens each sequence's cache holds.
        dtype: the cache's dtype (default: the model's compute dtype).

    Example:
        >>> from bigviz.models import GPTConfig
        >>> kv_cache_bytes(GPTConfig.preset("gpt-tiny"), 2, 10, dtype="float16")
        {'transformer.h.0': 2560, 'transformer.h.1': 2560}
    """
    model = _as_model(model_or_config)
    spec = run_spec(model)
    kv_dtype = canonical_dtype(dtype) if dtype is not None else None
    return spec.kv_cache(Workload(batch_size=batch_size, context_length=context_length, kv_dtype=kv_dtype))


def _as_model(source: ModelOrConfig) -> nn.Module:
    return source if isinstance(source, nn.Module) else model_from_config(source)  # a config: checked, on meta


def run_spec(model: nn.Module, *, dtype: torch.dtype | str | None = None, device_type: str = "cuda") -> RunSpec:
    """What ``model``'s run keeps per module: caches, steps and carried tensors.

    Args:
        model: a bigviz reference model or a transformers model (on meta is fine).
        dtype: the compute dtype to plan for (default: the model's).
        device_type: ``"cuda"`` (fused attention and scan kernels) or ``"cpu"``
            (PyTorch's reference paths); see the module docstring.

    Raises:
        ValueError: for a model whose attention layout bigviz does not know, saying how to
            give the bytes by hand (``kv_cache=`` and ``activations=`` of ``bigviz.plan``).

    Example:
        >>> from bigviz.models import build
        >>> with torch.device("meta"):
        ...     spec = run_spec(build("gpt-tiny"))
        >>> w = Workload(batch_size=1, context_length=64)
        >>> spec.kv_cache(w)["transformer.h.0"], max(spec.activations(w).values())  # bytes
        (16384, 107008)
    """
    compute = canonical_dtype(dtype) if dtype is not None else compute_dtype(model)
    cpu = device_type == "cpu"
    if isinstance(model, GPT):
        return _reference_spec(model, compute, gpt=True)
    if isinstance(model, Llama):
        return _reference_spec(model, compute, gpt=False)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        if getattr(config, "is_encoder_decoder", False):
            raise UsageError(
                f"bigviz plans the run of decoder-only models; {type(model).__name__} is an "
                f"encoder-decoder: give kv_cache={{module: bytes}} and activations={{module: bytes}}"
            )
        spec = _hf_spec(model, config.get_text_config(decoder=True), compute, cpu)
        if hasattr(model, "can_generate") and not model.can_generate():  # an encoder: nothing is cached
            spec = RunSpec(
                spec.dtype,
                {n: (CacheSpec("none"),) for n in spec.caches},
                spec.steps,
                spec.carried,
                (*spec.notes, "no KV cache: the model does not generate"),
            )
        return spec
    raise UsageError(
        f"bigviz does not know the attention layout of {type(model).__name__}: it reads bigviz's "
        f"GPT and Llama and transformers models. Give the bytes per module yourself: "
        f"bigviz.plan(model, ..., kv_cache={{module: bytes}}, activations={{module: bytes}})"
    )


# ---- which module is layer i -------------------------------------------------------------------
def _layer_list(model: nn.Module, n_layers: int) -> str:
    """The ``nn.ModuleList`` of the decoder layers: ``n_layers`` long, holding the modules
    that carry a ``layer_idx`` (attention, mixers). The first such list in definition order."""
    for name, module in model.named_modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) == n_layers
            and any(isinstance(getattr(m, "layer_idx", None), int) for m in module.modules())
        ):
            return name
    for name, module in model.named_modules():  # layers without a layer_idx anywhere
        if isinstance(module, nn.ModuleList) and len(module) == n_layers:
            return name
    raise UsageError(
        f"cannot find the {n_layers} decoder layers of {type(model).__name__} (an nn.ModuleList of {n_layers} modules)"
    )


def _layer_names(model: nn.Module, n_layers: int) -> list[str]:
    base = _layer_list(model, n_layers)
    return [f"{base}.{i}" if base else str(i) for i in range(n_layers)]


def _head_name(model: nn.Module) -> str | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None
    return next((n for n, m in model.named_modules() if m is head), None)


# ---- bigviz's reference models -----------------------------------------------------------------
def _reference_spec(model: nn.Module, dtype: str, *, gpt: bool) -> RunSpec:
    """bigviz's GPT and Llama: every layer caches ``(B, kv_heads, T, head_dim)`` keys and
    values; ``generate`` computes the logits of every prompt token (``(B, T, vocab)``)."""
    cfg = model.config
    if gpt:
        hidden, heads, kv_heads, ffn, n = cfg.n_embd, cfg.n_head, cfg.n_head, 4 * cfg.n_embd, cfg.n_layer
        names = [f"transformer.h.{i}" for i in range(n)]
    else:
        hidden, heads, kv_heads, ffn, n = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.n_layers
        names = [f"model.layers.{i}" for i in range(n)]
    head_dim = hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    cache = (CacheSpec("full_attention", heads=kv_heads, k_dim=head_dim, v_dim=head_dim),)
    if gpt:  # c_attn's 3C output stays alive (q, k, v are views of it); tanh GELU is one op
        phases = ((Term(hidden), Term(3 * hidden), Term(2 * q)), (Term(2 * hidden), Term(2 * ffn)))
        carried = (Term(2 * hidden), Term(hidden, batched=False), Term(1, _INT64, batched=False))
    else:  # q, k, v projected, then rotated (x * cos + rotate_half(x) * sin); repeat_kv for the call
        rep = 2 * q if kv_heads != heads else 0
        phases = (
            (Term(hidden), Term(4 * q + 2 * kv)),
            (Term(hidden), Term(2 * q + rep)),
            (Term(hidden), Term(3 * q)),
            (Term(2 * hidden), Term(3 * ffn)),
        )
        carried = (Term(hidden), Term(2 * head_dim, batched=False), Term(1, _INT64, batched=False))
    layer = StepSpec(phases)
    steps: dict[str, StepSpec] = {name: layer for name in names}
    vocab = model.lm_head.out_features
    steps["lm_head"] = StepSpec(((Term(hidden), Term(vocab)),))  # the final norm and every logit
    return RunSpec(
        dtype,
        {name: cache for name in names},
        steps,
        carried,
        notes=("bigviz reference model: logits for every prompt token",),
    )


# ---- transformers models -----------------------------------------------------------------------
@dataclass(frozen=True)
class _Dims:
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
    def of(cls, config: Any) -> _Dims:
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


def _layer_types(config: Any, n_layers: int) -> tuple[list[str], list[dict[str, Any]]]:
    """transformers' own rule for each layer's cache type (and its sliding window)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # an older transformers: layer_types, else one sliding_window for all
        get_layer_types_and_kwargs = None
    if get_layer_types_and_kwargs is not None:
        types, kwargs = get_layer_types_and_kwargs(config)
        return list(types), list(kwargs)
    window = getattr(config, "sliding_window", None)
    types = list(
        getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * n_layers
    )
    return types, [{"sliding_window": window} if "sliding" in t else {} for t in types]


def _hf_caches(config: Any, dims: _Dims, names: Sequence[str]) -> dict[str, tuple[CacheSpec, ...]]:
    types, kwargs = _layer_types(config, dims.layers)
    out: dict[str, tuple[CacheSpec, ...]] = {}
    problems = []
    for name, kind, extra in zip(names, types, kwargs):
        specs: list[CacheSpec] = []
        if kind in ("full_attention", "sliding_attention", "chunked_attention", "hybrid", "hybrid_sliding"):
            specs.append(
                _attention_cache(
                    config,
                    dims,
                    extra.get("sliding_window") if "sliding" in kind or kind == "chunked_attention" else None,
                )
            )
        if kind in ("linear_attention", "conv", "hybrid", "hybrid_sliding"):
            state = _state_cache(config)
            if state is None:
                problems.append(f"{name}: layer type {kind!r} of model type {getattr(config, 'model_type', '?')!r}")
                continue
            specs.append(state)
        if kind == "dummy" or not specs:
            specs.append(CacheSpec("none"))
        out[name] = tuple(specs)
    if problems:
        raise UsageError(
            "bigviz does not know the recurrent state of: "
            + "; ".join(problems)
            + ". Give the bytes per module with kv_cache={module: bytes}"
        )
    return out


def _attention_cache(config: Any, dims: _Dims, window: int | None) -> CacheSpec:
    lora = getattr(config, "kv_lora_rank", None)
    if lora:  # MLA: transformers caches the shared latent and the rotary key, not the heads
        return CacheSpec("latent_attention", heads=1, k_dim=int(lora), v_dim=int(config.qk_rope_head_dim))
    if window:
        return CacheSpec(
            "sliding_attention", heads=dims.kv_heads, k_dim=dims.head_dim, v_dim=dims.head_dim, window=int(window)
        )
    return CacheSpec("full_attention", heads=dims.kv_heads, k_dim=dims.head_dim, v_dim=dims.head_dim)


def _state_cache(config: Any) -> CacheSpec | None:
    """Mamba: a conv state (inner x kernel, model dtype) and a float32 recurrent state
    (inner x state); Mamba-2: conv over inner + 2 x groups x state, recurrent per head."""
    kernel, state = getattr(config, "conv_kernel", None), getattr(config, "state_size", None)
    inner = getattr(config, "intermediate_size", None) or int(getattr(config, "expand", 0) * config.hidden_size)
    if not (kernel and state and inner):
        return None
    if getattr(config, "model_type", "") == "mamba2":
        conv = (inner + 2 * config.n_groups * state) * kernel
        return CacheSpec("state", state=((conv, None), (config.num_heads * config.head_dim * state, "float32")))
    return CacheSpec("state", state=((inner * kernel, None), (inner * state, "float32")))


def _hf_spec(model: nn.Module, config: Any, dtype: str, cpu: bool) -> RunSpec:
    dims = _Dims.of(config)
    names = _layer_names(model, dims.layers)
    caches = _hf_caches(config, dims, names)
    types, kwargs = _layer_types(config, dims.layers)
    if getattr(config, "model_type", "") in ("mamba", "mamba2"):
        carried, layer_steps, notes = _mamba_steps(config, dims, cpu)
    else:
        carried, layer_steps, notes = _decoder_steps(config, dims, types, kwargs, cpu)
    steps: dict[str, StepSpec] = dict(zip(names, layer_steps))
    head = _head_name(model)
    if head is not None:  # generate keeps the logits of the last token only (logits_to_keep=1)
        steps[head] = StepSpec(((Term(dims.hidden), Term(dims.vocab, per="fixed")),))
    return RunSpec(dtype, caches, steps, carried, notes=tuple(notes))


def _decoder_steps(
    config: Any, dims: _Dims, types: Sequence[str], kwargs: Sequence[Mapping[str, Any]], cpu: bool
) -> tuple[tuple[Term, ...], list[StepSpec], list[str]]:
    """Attention decoders (GPT-2, Llama, Mistral, Gemma 2, Qwen2, Mixtral, DeepSeek, ...)."""
    gpt2 = getattr(config, "model_type", "") == "gpt2"
    masks = _mask_terms(dims, types, kwargs)
    rope = () if gpt2 else (Term(2 * _rope_dim(config, dims), batched=False),)
    embeds = (Term(dims.hidden), Term(dims.hidden, batched=False)) if gpt2 else (Term(dims.hidden),)
    carried = (*embeds, Term(dims.hidden), *rope, *masks, Term(1, _INT64), Term(1, _INT64, batched=False))
    notes = [f"attention: {dims.attn}" + (" (reference kernels on CPU)" if cpu else " (fused kernels)")]
    attention = _attention_phases(config, dims, bool(masks), cpu)
    steps = []
    for index in range(dims.layers):
        mlp = _mlp_phase(config, dims, index, gpt2)
        if dims.attn == "eager":  # the layer keeps the returned attention weights (``h, _ = attn(...)``)
            mlp = (*mlp, Term(dims.heads, per="pair"))
        steps.append(StepSpec((*attention, mlp)))
    return carried, steps, notes


def _rope_dim(config: Any, dims: _Dims) -> int:
    return int(getattr(config, "qk_rope_head_dim", None) or dims.head_dim)


def _mask_terms(dims: _Dims, types: Sequence[str], kwargs: Sequence[Mapping[str, Any]]) -> tuple[Term, ...]:
    """The (B, 1, T, T) masks the model builds once per layer type and keeps all forward:
    eager attention adds a float mask to its scores; SDPA needs a boolean one only for a
    sliding window (a plain causal mask becomes ``is_causal``); flash attention none."""
    kinds = {t for t in types if t in ("full_attention", "sliding_attention", "chunked_attention")}
    if dims.attn == "eager":
        return tuple(Term(1, batched=True, per="pair") for _ in kinds)
    if dims.attn == "sdpa":
        return tuple(Term(1, 1.0, per="pair") for t in kinds if t != "full_attention")
    return ()


def _attention_phases(config: Any, dims: _Dims, masked: bool, cpu: bool) -> tuple[tuple[Term, ...], ...]:
    """What is alive at each peak of the attention, besides the carried tensors."""
    if getattr(config, "kv_lora_rank", None):
        return (_mla_phase(config, dims, cpu),)
    gpt2 = getattr(config, "model_type", "") == "gpt2"
    q, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    repeat = 2 * q if dims.kv_heads != dims.heads and (masked or dims.attn == "eager") else 0
    normed = Term(dims.hidden)
    if dims.attn == "eager":  # scores, then scores + mask next to their float32 softmax: 8 bytes each
        return ((normed, Term((3 * q if gpt2 else q) + repeat), Term(dims.heads, 8.0, per="pair")),)
    # SDPA turns a boolean mask into a float one for the call
    mask_copy = (Term(1, per="pair"),) if masked else ()
    if gpt2:  # the fused c_attn output (q, k, v are views of it), SDPA's output and its copy
        return ((normed, Term(3 * q + 2 * q)), (normed, Term(3 * q + q), *mask_copy))
    return (
        (normed, Term(4 * q + 2 * kv)),  # rotary on q: q, q * cos, rotate_half(q) * sin, their sum; k, v
        (normed, Term(2 * q + repeat), *mask_copy),  # the call: rotated q, (repeated k, v), output
        (normed, Term(3 * q + repeat)),  # the output made contiguous
    )


def _mla_phase(config: Any, dims: _Dims, cpu: bool) -> tuple[Term, ...]:
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


def _mlp_phase(config: Any, dims: _Dims, index: int, gpt2: bool) -> tuple[Term, ...]:
    """The feed-forward's peak: gated MLPs keep act(gate), up and their product (3 x F);
    GPT-2's tanh GELU keeps four 4H tensors; experts run on ``top_k`` copies of each token."""
    if gpt2:  # attn_output, residual and ln_2 out stay alive in GPT2Block
        return (Term(3 * dims.hidden), Term(4 * dims.ffn))
    experts = _experts(config, index)
    if experts is None:
        return (Term(2 * dims.hidden), Term(3 * dims.ffn))
    n, top_k, ffn, shared = experts
    routed = Term(top_k * (dims.hidden + 4 * ffn))  # gathered tokens, gate_up, act(gate), product
    router = (Term(n, 4.0), Term(n), Term(top_k * 4, _INT64))  # logits, probabilities, choices
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


def _mamba_steps(config: Any, dims: _Dims, cpu: bool) -> tuple[tuple[Term, ...], list[StepSpec], list[str]]:
    """Mamba's mixer: in_proj (2 x inner), the conv, dt, and the selective scan. PyTorch's
    reference scan keeps three (B, inner, T, state) float32 tensors; mamba-ssm's kernel none."""
    inner = int(getattr(config, "intermediate_size", None) or getattr(config, "expand", 2) * dims.hidden)
    state = int(config.state_size)
    phase: tuple[Term, ...] = (Term(3 * dims.hidden), Term(2 * inner), Term(6 * inner))
    if cpu:
        phase = (*phase, Term(3 * inner * state, 4.0))
    carried = (Term(3 * dims.hidden), Term(1, _INT64), Term(1, _INT64, batched=False))
    note = "selective scan: " + ("PyTorch reference (CPU)" if cpu else "fused kernel (mamba-ssm)")
    if getattr(config, "model_type", "") != "mamba":  # Mamba-2's chunked scan: the cache is exact, this is not
        note += "; activations: Mamba's formula, not checked against this model type"
    return carried, [StepSpec((phase,))] * dims.layers, [note]
