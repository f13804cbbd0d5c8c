"""Read what a model's run keeps, from the model or its config: the bridge from an
``nn.Module`` (or a transformers config) into :mod:`bigviz.core.workload`.

The cache layout follows transformers' own rules (``cache_utils.get_layer_types_and_kwargs``):
each layer's type (``full_attention``, ``sliding_attention``, ``chunked_attention``,
``linear_attention``, ...), ``num_key_value_heads``, ``head_dim``, ``sliding_window``, and
DeepSeek's latent (``kv_lora_rank + qk_rope_head_dim``, which transformers caches in place of
the full keys and values from version 5.15 on; earlier versions cache the full keys and
values, and the rule follows the installed version). What the config does not say is read
from the model itself (:mod:`bigviz.modeling.cache_probe`, a short step on meta through the
model's own cache classes): recurrent and hybrid layers' fixed-size states (Mamba, Mamba-2,
Jamba, Bamba, Falcon-H1, Zamba2, Qwen3-Next, LFM2, RecurrentGemma) and the widths of the keys
and values those models and encoder-decoders cache (Zamba2's attention is twice as wide as its
hidden size suggests), an encoder-decoder's cross-attention cache over the encoder's tokens,
and the layers that cross-attend to vision states (Mllama).

The activation estimate is the peak of the tensors a prefill step keeps alive in
transformers' (or bigviz's) code: per layer, the largest of its phases (attention, MLP or
experts, state-space scan), plus what the whole forward carries (embeddings, residual
stream, masks, rotary tables). It depends on the kernels that run: on a GPU bigviz assumes
fused kernels (SDPA's flash or memory-efficient attention, mamba-ssm's scan); on the CPU,
PyTorch's reference paths (a (T x T) score matrix when SDPA falls back to its math kernel,
Mamba's (B x I x T x N) scan tensors). Eager attention materialises the scores anywhere.
The phases' terms are :mod:`bigviz.modeling.activation_phases`.

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
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from bigviz.core.dtypes import FLOATING_DTYPES, canonical_dtype
from bigviz.core.workload import CacheSpec, RunSpec, StepSpec, Term, Workload
from bigviz.modeling.activation_phases import (
    ATTENTION_TYPES,
    INT64,
    Dims,
    decoder_steps,
    mamba_steps,
    score_bytes,
    score_terms,
)
from bigviz.modeling.configs import model_from_config
from bigviz.modeling.cache_probe import LayerCache, probe_cache, source_layers
from bigviz.models.gpt import GPT
from bigviz.models.llama import Llama
from bigviz.core.errors import UsageError

__all__ = ["run_spec", "kv_cache_bytes", "compute_dtype", "latent_cached"]

ModelOrConfig = Any  # nn.Module, transformers PretrainedConfig, GPTConfig/LlamaConfig, config path


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
    model_or_config: ModelOrConfig,
    batch_size: int,
    context_length: int,
    dtype: torch.dtype | str | None = None,
    *,
    encoder_length: int | None = None,
) -> dict[str, int]:
    """Bytes of KV cache (or recurrent state) per layer module once a run is over: what a
    static cache allocates, and what transformers' dynamic cache holds at the end of
    ``generate`` (a plan charges each layer's peak, see :meth:`CacheSpec.peak_nbytes`).

    Args:
        model_or_config: an ``nn.Module`` (on meta is fine), a transformers config, a
            ``config.json`` path (or folder), or a bigviz ``GPTConfig`` / ``LlamaConfig``.
        batch_size: sequences decoded together.
        context_length: tokens each sequence's cache holds (an encoder-decoder: the decoder's).
        dtype: the cache's dtype (default: the model's compute dtype).
        encoder_length: tokens the cross-attention layers attend to (an encoder-decoder's
            encoder input; Mllama's vision states). Default: the model's own (Mllama: one
            image), else ``context_length``.

    Example:
        >>> from bigviz.models import GPTConfig
        >>> kv_cache_bytes(GPTConfig.preset("gpt-tiny"), 2, 10, dtype="float16")
        {'transformer.h.0': 2560, 'transformer.h.1': 2560}
    """
    model = _as_model(model_or_config)
    spec = run_spec(model)
    kv_dtype = canonical_dtype(dtype) if dtype is not None else None
    return spec.kv_cache(Workload(batch_size, context_length, kv_dtype, encoder_length))


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
            return _encdec_spec(model, config, compute, cpu)
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
    for name, module in _decoder_first(model):
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


def _decoder_first(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's modules, its decoder's first (a vision tower's layers are not the decoder's)."""
    modules = list(model.named_modules())
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    prefix = next((n for n, m in modules if m is decoder and n), None)
    if prefix is None:
        return modules
    inside = [(n, m) for n, m in modules if n == prefix or n.startswith(prefix + ".")]
    return inside + [(n, m) for n, m in modules if not (n == prefix or n.startswith(prefix + "."))]


def _layer_names(model: nn.Module, n_layers: int) -> list[str]:
    base = _layer_list(model, n_layers)
    return [f"{base}.{i}" if base else str(i) for i in range(n_layers)]


def _blocks(stack: nn.Module, prefix: str) -> list[str]:
    """The layers of an encoder or decoder stack: its first ``nn.ModuleList`` (T5's ``block``,
    BART's and Whisper's ``layers``), named from the model's root."""
    for name, module in stack.named_modules():
        if isinstance(module, nn.ModuleList) and len(module):
            base = f"{prefix}.{name}" if prefix and name else prefix or name
            return [f"{base}.{i}" for i in range(len(module))]
    return []


def _name_of(model: nn.Module, module: nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is module), None) if module is not None else None


def _head_name(model: nn.Module) -> str | None:
    return _name_of(model, model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None)


def _embedding_name(model: nn.Module) -> str | None:
    """The input embeddings' module: its output stays alive, on its device, all forward."""
    return _name_of(model, model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None)


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
        carried = (Term(2 * hidden), Term(hidden, batched=False), Term(1, INT64, batched=False))
    else:  # q, k, v projected, then rotated (x * cos + rotate_half(x) * sin); repeat_kv for the call
        rep = 2 * q if kv_heads != heads else 0
        phases = (
            (Term(hidden), Term(4 * q + 2 * kv)),
            (Term(hidden), Term(2 * q + rep)),
            (Term(hidden), Term(3 * q)),
            (Term(2 * hidden), Term(3 * ffn)),
        )
        carried = (Term(hidden), Term(2 * head_dim, batched=False), Term(1, INT64, batched=False))
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


_PLAIN_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "dummy")  # the config says it all


def _hf_caches(
    model: nn.Module, config: Any, dims: Dims, names: Sequence[str]
) -> tuple[dict[str, tuple[CacheSpec, ...]], int | None]:
    """Each layer's caches, and the tokens its cross-attention layers attend to by default.

    Layer kinds and windows follow transformers' layer types. What each layer holds is asked
    of the model (:func:`bigviz.modeling.cache_probe.probe_cache`, a step on meta through its
    own cache classes): the widths of its keys and values as its cache allocates them (Zamba2's
    are twice as wide as its hidden size suggests, Falcon's multi-query layers keep one head
    where its config counts all), and the states of recurrent, convolutional and hybrid layers.
    Where the model cannot be stepped on meta, attention layers follow the config's rule
    (``kv_heads x head_dim`` per token) and other layers are refused. DeepSeek's latent follows
    the installed version's rule. Layers the model's static cache sizes by the vision states
    (Mllama's cross-attention) cache those, whatever the context.
    """
    types, kwargs = _layer_types(config, dims.layers)
    kinds = tuple(f"{kind} {sorted(extra.items())}" for kind, extra in zip(types, kwargs))
    probe = probe_cache(model, dims.layers, layer_names=tuple(names), layer_kinds=kinds)
    if probe is None:
        if any(t not in _PLAIN_TYPES for t in types):  # the config does not say it all, and the model cannot
            raise UsageError(
                f"bigviz reads the recurrent state of {type(model).__name__} from a step of the model "
                f"on meta, and that step failed here (layer types {sorted(set(types))}): give the bytes "
                f"per module with kv_cache={{module: bytes}}"
            )
    sources = source_layers(model, dims.layers)
    out: dict[str, tuple[CacheSpec, ...]] = {}
    for index, (name, kind, extra) in enumerate(zip(names, types, kwargs)):
        layer = probe.layers[index] if probe is not None else LayerCache()
        if index in sources:  # cross-attention: it caches the vision states, not the text
            base = _attention_cache(config, dims, None)
            out[name] = (CacheSpec("cross_attention", heads=base.heads, k_dim=base.k_dim, v_dim=base.v_dim),)
            continue
        specs: list[CacheSpec] = []
        if kind in ATTENTION_TYPES or layer.per_token:
            window = extra.get("sliding_window") if "sliding" in kind or kind == "chunked_attention" else None
            specs.append(_attention_cache(config, dims, window, layer.per_token))
        if layer.states and kind not in _PLAIN_TYPES:  # plain attention keeps no state (a window under
            specs.append(CacheSpec("state", state=layer.states))  # the probe's tokens merely looks like one)
        out[name] = tuple(specs) or (CacheSpec("none"),)
    return out, (max(sources.values()) if sources else None)


def _attention_cache(config: Any, dims: Dims, window: int | None, measured: Sequence[int] = ()) -> CacheSpec:
    """One layer's keys and values: ``kv_heads x (head_dim + head_dim)`` per token from the
    config, or the widths the model's own cache allocated (``measured``: elements per token
    of its keys and of its values); MLA's latent where the installed transformers caches it."""
    lora = getattr(config, "kv_lora_rank", None)
    if lora:  # the probe agrees on the installed version; the rule says so where it cannot run
        rope = int(config.qk_rope_head_dim)
        if latent_cached():  # transformers caches the shared latent and the rotary key
            return CacheSpec("latent_attention", heads=1, k_dim=int(lora), v_dim=rope)
        qk, v = int(config.qk_nope_head_dim) + rope, int(getattr(config, "v_head_dim", 0) or config.qk_nope_head_dim)
        return CacheSpec("full_attention", heads=dims.heads, k_dim=qk, v_dim=v)  # every head's key and value
    heads, k_dim, v_dim = (dims.kv_heads, dims.head_dim, dims.head_dim)
    if measured:  # whole elements per token: Zamba2's wider heads, anything the config does not say
        heads, k_dim, v_dim = 1, int(measured[0]), int(sum(measured[1:]))
    if window:
        return CacheSpec("sliding_attention", heads=heads, k_dim=k_dim, v_dim=v_dim, window=int(window))
    return CacheSpec("full_attention", heads=heads, k_dim=k_dim, v_dim=v_dim)


LATENT_CACHE_SINCE = (5, 15)
"""The transformers version from which DeepSeek's attention caches its latent, not every head's
keys and values (71x less for DeepSeek-V3)."""


def latent_cached(version: str | None = None) -> bool:
    """True when the installed transformers (or ``version``) caches MLA's latent.

    Example:
        >>> latent_cached("5.14.2"), latent_cached("5.15.0"), latent_cached("4.57.1")
        (False, True, False)
    """
    if version is None:
        try:
            import transformers
        except ImportError:
            return True
        version = transformers.__version__
    parts = [int("".join(c for c in part if c.isdigit()) or 0) for part in version.split(".")[:2]]
    return tuple(parts + [0] * (2 - len(parts))) >= LATENT_CACHE_SINCE


def _hf_spec(model: nn.Module, config: Any, dtype: str, cpu: bool) -> RunSpec:
    dims = Dims.of(config)
    names = _layer_names(model, dims.layers)
    caches, source_tokens = _hf_caches(model, config, dims, names)
    types, kwargs = _layer_types(config, dims.layers)
    held: dict[str, tuple[Term, ...]] = {}
    if getattr(config, "model_type", "") in ("mamba", "mamba2"):
        carried, layer_steps, notes = mamba_steps(config, dims, cpu)
    else:
        states = [tuple(st for spec in caches[name] for st in spec.state) for name in names]
        carried, layer_steps, notes = decoder_steps(config, dims, types, kwargs, cpu, dtype, states)
        embeddings = _embedding_name(model)
        if embeddings is not None:  # the input embeddings stay alive where they are computed
            held[embeddings] = (Term(dims.hidden),)
        else:
            carried = (Term(dims.hidden), *carried)
    steps: dict[str, StepSpec] = dict(zip(names, layer_steps))
    head = _head_name(model)
    if head is not None:  # generate keeps the logits of the last token only (logits_to_keep=1)
        steps[head] = StepSpec(((Term(dims.hidden), Term(dims.vocab, per="fixed")),))
    if source_tokens is not None:
        notes.append(f"cross-attention layers cache {source_tokens:,} vision tokens per image (one image by default)")
    return RunSpec(dtype, caches, steps, carried, notes=tuple(notes), held=held, source_tokens=source_tokens)


def _encdec_spec(model: nn.Module, config: Any, dtype: str, cpu: bool) -> RunSpec:
    """Encoder-decoders (T5, UMT5, BART, Pegasus, LED, Marian, Whisper). Each decoder layer
    caches its self-attention over the generated tokens and its cross-attention over the
    encoder's ``S`` tokens (transformers' ``EncoderDecoderCache``), both as wide as the
    model's own cache allocates them; the encoder runs once, over ``S`` tokens, on the
    devices that hold its layers, and its output stays alive while the decoder runs."""
    encoder, decoder = model.get_encoder(), model.get_decoder()
    encoder_names = _blocks(encoder, _name_of(model, encoder) or "")
    decoder_names = _blocks(decoder, _name_of(model, decoder) or "")
    probe = probe_cache(model, len(decoder_names)) if decoder_names else None
    if probe is None or not all(layer.per_token and layer.per_source_token for layer in probe.layers):
        raise UsageError(
            f"bigviz reads the caches of {type(model).__name__} from a decoder step on meta, and that "
            f"step failed here: give the bytes per module with kv_cache={{module: bytes}} and "
            f"activations={{module: bytes}}"
        )
    caches = {
        name: (_attention_cache(config, Dims.of(config), None, layer.per_token), _cross_cache(layer))
        for name, layer in zip(decoder_names, probe.layers)
    }
    hidden, inner = int(config.hidden_size), probe.layers[0].per_token[0]
    heads = int(getattr(config, "num_attention_heads", 0) or 1)
    ffn = int(getattr(config, "d_ff", None) or getattr(config, "encoder_ffn_dim", None) or 4 * hidden)
    attn = str(getattr(config, "_attn_implementation", None) or "eager")
    scores = score_bytes(dtype) if attn == "eager" else 0.0

    def attention(q_per: str, kv_per: str, pair: str, self_kv: bool) -> tuple[Term, ...]:
        kv = (Term(2 * inner, per=kv_per),) if self_kv else ()
        return (Term(hidden, per=q_per), Term(2 * inner, per=q_per), *kv, *score_terms(heads, scores, pair))

    mlp = (Term(2 * hidden + 2 * ffn, per="source"),)
    encoder_step = StepSpec((attention("source", "source", "source_pair", True), mlp))
    decoder_mlp = (Term(2 * hidden + 2 * ffn),)
    decoder_step = StepSpec(
        (attention("token", "token", "pair", True), attention("token", "source", "cross", False), decoder_mlp)
    )
    steps = {**dict.fromkeys(encoder_names, encoder_step), **dict.fromkeys(decoder_names, decoder_step)}
    head = _head_name(model)
    if head is not None:
        steps[head] = StepSpec(((Term(hidden), Term(int(getattr(config, "vocab_size", 0) or 0), per="fixed")),))
    masks = (Term(1, per="source_pair"), Term(1, per="pair"), Term(1, per="cross")) if attn == "eager" else ()
    carried = (Term(hidden, per="source"), Term(hidden), *masks, Term(1, INT64), Term(1, INT64, per="source"))
    notes = (
        f"attention: {attn}; the encoder reads encoder_length tokens (default: context_length), "
        "the decoder caches them in every layer's cross-attention",
    )
    return RunSpec(dtype, caches, steps, carried, notes=notes)


def _cross_cache(layer: LayerCache) -> CacheSpec:
    keys, *values = layer.per_source_token
    return CacheSpec("cross_attention", heads=1, k_dim=int(keys), v_dim=int(sum(values)))
