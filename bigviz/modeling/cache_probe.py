"""What a transformers model's cache keeps per layer, read from the model itself.

A run's cache has two kinds of tensors: those that grow with the tokens (keys and values, over
the generated tokens or over an encoder's) and fixed-size states (Mamba's conv and SSM states,
Gated DeltaNet's, LFM2's conv, RecurrentGemma's RG-LRU). Neither shape depends on the context
length except along the token axis, so bigviz reads them from the architecture instead of a
table of config field names: a twin of the model (:func:`bigviz.modeling.twin.meta_twin`, in
bfloat16, on ``meta``: no memory) runs a short prefill and one decode step through its own
forward and its own cache classes (transformers 5's ``DynamicCache`` layers,
``EncoderDecoderCache``, or states an architecture keeps on its modules), for two prompt
lengths; every tensor the cache then holds (the storage it keeps alive, as memory counts it)
is sorted by how it grows:

* with the prompt: keys and values (elements per token);
* with the encoder's tokens (encoder-decoders are given ``encoder_outputs`` of two lengths):
  the cross-attention cache;
* not at all: a fixed-size state; in the compute dtype when the bfloat16 twin keeps it in
  bfloat16, else in its own dtype (recurrent states are float32).

Every transformers model is probed (a config's rule can be wrong: Falcon's multi-query layers
keep one key/value head where its config counts all). Layers alike (same cache kind, same
modules and parameter shapes) are stepped once: an 80-layer model steps its first layer only,
a second instead of tens on meta.

The prompts are shorter than any sliding window and any convolution kernel, so a state that is a
view of a longer prefill's input (RecurrentGemma's conv state keeps the prompt's storage until
its first decode step) is counted at its steady size.

Layers that cross-attend inside a decoder (Mllama's) cache the vision states. The model's own
``_prepare_static_cache`` re-allocates them with that length (images x tiles x (patches + 1),
one image by default); :func:`source_layers` asks it which layers it re-sizes, and to what.

Example:
    >>> import transformers
    >>> config = transformers.MambaConfig(hidden_size=16, state_size=4, num_hidden_layers=2, vocab_size=32,
    ...                                   expand=2, conv_kernel=3)
    >>> with torch.device("meta"):
    ...     model = transformers.MambaForCausalLM(config)
    >>> probe_cache(model, 2).layers[0].states  # conv (inner x kernel), SSM state (inner x state, float32)
    ((96, None), (128, 'float32'))
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from bigviz.core.dtypes import canonical_dtype
from bigviz.modeling.memory import output_cache
from bigviz.modeling.twin import meta_twin

__all__ = ["LayerCache", "CacheProbe", "probe_cache", "source_layers"]

_TOKENS = (2, 3)  # prompt tokens of the two runs: under any sliding window, so keys and values grow
_SOURCE = (4, 7)  # encoder tokens of the encoder-decoders' runs
_PROBE_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class LayerCache:
    """What one decoder layer's cache keeps for one sequence.

    Attributes:
        per_token: elements per decoder token of each tensor that grows with them (keys, values).
        per_source_token: elements per encoder token of each tensor that grows with those
            (the cross-attention keys and values).
        states: ``(elements, dtype)`` of each fixed-size state; dtype ``None`` when it follows
            the compute dtype.
    """

    per_token: tuple[int, ...] = ()
    per_source_token: tuple[int, ...] = ()
    states: tuple[tuple[int, str | None], ...] = ()


@dataclass(frozen=True)
class CacheProbe:
    """A model's cache, layer by layer (``layers[i]`` is decoder layer ``i``)."""

    layers: tuple[LayerCache, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class _Held:
    """One cached tensor after a probe run: its layer (-1: none found), the elements of the
    storage it keeps alive, and its dtype."""

    layer: int
    elements: int
    dtype: str


def probe_cache(
    model: nn.Module, n_layers: int, *, layer_names: tuple[str, ...] = (), layer_kinds: tuple[str, ...] = ()
) -> CacheProbe | None:
    """Run short steps on a meta twin of ``model`` and sort what its cache holds, per layer.

    Args:
        model: a transformers model (on meta is fine; it is not run, its twin is).
        n_layers: decoder layers (the cache's layers).
        layer_names: the decoder layers' module names, to give each state a model keeps on
            a module (RecurrentGemma) to the layer holding that module.
        layer_kinds: each layer's cache kind as transformers names it (with its window), when
            known: with ``layer_names``, layers alike in kind and in their modules' classes and
            shapes are stepped once (see :func:`representatives`).

    Returns:
        The per-layer caches, or None when the architecture cannot be stepped on meta (the
        caller then says so, or falls back to the config's rule). Kept per class and config:
        ``max_context`` plans the same model many times.
    """
    key = (type(model), _config_key(model), n_layers, layer_names, layer_kinds)
    if key[1] is not None and key in _PROBES:
        return _PROBES[key]
    probe = _probe(model, n_layers, layer_names, layer_kinds)
    if key[1] is not None:
        _PROBES[key] = probe
        while len(_PROBES) > 32:
            _PROBES.pop(next(iter(_PROBES)))
    return probe


_PROBES: dict[tuple[Any, ...], CacheProbe | None] = {}


def _config_key(model: nn.Module) -> str | None:
    try:
        return str(model.config.to_json_string(use_diff=False))
    except Exception:  # noqa: BLE001 - no config, or one that does not serialise: not cached
        return None


def _probe(
    model: nn.Module, n_layers: int, layer_names: tuple[str, ...], layer_kinds: tuple[str, ...]
) -> CacheProbe | None:
    twin = meta_twin(model, _PROBE_DTYPE, attn_implementation="eager", probe=True)
    if twin is None:
        return None
    encdec = bool(getattr(twin.config, "is_encoder_decoder", False))
    steps = [(_TOKENS[0], _SOURCE[0]), (_TOKENS[1], _SOURCE[0])] + ([(_TOKENS[0], _SOURCE[1])] if encdec else [])
    same = representatives(twin, layer_names, layer_kinds) if len(layer_kinds) == n_layers else None
    cuts = [same, None] if same is not None else [None]  # the whole model when its cut one cannot step
    for cut, given in ((cut, given) for cut in cuts for given in (True, False)):
        # generate's cache first, then the one the model makes itself
        try:
            with torch.no_grad(), _first_layers(twin, layer_names, cut):
                runs = [_run(twin, t, source, encdec, n_layers, layer_names, given) for t, source in steps]
        except Exception:  # noqa: BLE001 - an op without a meta kernel, a model needing other inputs
            continue
        if all(run.keys() == runs[0].keys() for run in runs):
            return CacheProbe(tuple(_layer(runs, index if cut is None else cut[index]) for index in range(n_layers)))
    return None


def representatives(model: nn.Module, layer_names: Sequence[str], layer_kinds: Sequence[str]) -> list[int] | None:
    """For each decoder layer, the first layer alike: same cache kind, same modules' classes,
    same parameter shapes and dtypes. A layer's cache depends on nothing else, so a model of
    80 identical layers is stepped through the first one only (a step on meta costs some
    milliseconds per op: 80 layers take tens of seconds). None when no layer repeats an
    earlier one within the first layers alike (nothing to save), or the layers are not found.

    Example:
        >>> import transformers
        >>> config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        ...                                   num_attention_heads=2, vocab_size=10)
        >>> with torch.device("meta"):
        ...     model = transformers.LlamaForCausalLM(config)
        >>> names = [f"model.layers.{i}" for i in range(3)]
        >>> representatives(model, names, ["full_attention"] * 3)
        [0, 0, 0]
    """
    try:
        layers = [model.get_submodule(name) for name in layer_names]
    except AttributeError:
        return None
    first: dict[tuple[Any, ...], int] = {}
    out = [
        first.setdefault((kind, _signature(layer)), index)
        for index, (layer, kind) in enumerate(zip(layers, layer_kinds))
    ]
    return out if max(out, default=0) + 1 < len(out) else None


def _signature(layer: nn.Module) -> tuple[Any, ...]:
    classes = tuple((name, type(module).__qualname__) for name, module in layer.named_modules())
    shapes = tuple((name, tuple(p.shape), p.dtype) for name, p in layer.named_parameters())
    return classes, shapes


@contextmanager
def _first_layers(model: nn.Module, layer_names: Sequence[str], same: list[int] | None) -> Iterator[None]:
    """The model with its decoder's layer list cut to the layers up to the last representative
    (the forward runs over what the list holds; the cache keeps one entry per configured layer,
    the others staying empty); put back after."""
    if same is None:
        yield
        return
    parent_name, _, _ = layer_names[0].rpartition(".")
    parent = model.get_submodule(parent_name)
    owner_name, _, attr = parent_name.rpartition(".")
    owner = model.get_submodule(owner_name)
    setattr(owner, attr, nn.ModuleList(list(parent)[: max(same) + 1]))
    try:
        yield
    finally:
        setattr(owner, attr, parent)


def _layer(runs: list[dict[tuple[Any, ...], _Held]], index: int) -> LayerCache:
    per_token, per_source, states = [], [], []
    tokens, sources = _TOKENS[1] - _TOKENS[0], _SOURCE[1] - _SOURCE[0]
    for path, held in runs[0].items():
        if held.layer != index:
            continue
        grown = runs[1][path].elements - held.elements
        if grown:
            per_token.append(grown // tokens)
        elif len(runs) > 2 and runs[2][path].elements != held.elements:
            per_source.append((runs[2][path].elements - held.elements) // sources)
        else:
            states.append((held.elements, None if held.dtype == canonical_dtype(_PROBE_DTYPE) else held.dtype))
    return LayerCache(tuple(per_token), tuple(per_source), tuple(states))


def _run(
    twin: nn.Module, tokens: int, source: int, encdec: bool, n_layers: int, layer_names: tuple[str, ...], given: bool
) -> dict[tuple[Any, ...], _Held]:
    """A prefill of ``tokens`` on meta, then one decode step: what the cache (and the modules,
    for states kept there) hold then, per tensor (after a decode step, as generate leaves them)."""
    kwargs: dict[str, Any] = {"use_cache": True}
    if encdec:
        width = int(twin.config.hidden_size)
        kwargs["encoder_outputs"] = (torch.zeros(1, source, width, dtype=_PROBE_DTYPE, device="meta"),)
    ids = "decoder_input_ids" if encdec else "input_ids"
    before = _module_tensors(twin)
    cache = _new_cache(twin, encdec) if given else None
    name = "cache" if "cache" in inspect.signature(twin.forward).parameters else "past_key_values"
    if cache is not None:  # generate's own cache, as it makes it; the model makes one otherwise
        kwargs[name] = cache
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = twin(**kwargs, **{ids: torch.zeros(1, tokens, dtype=torch.long, device="meta")})
        cache = _either(output_cache(out), cache)
        if cache is not None:
            kwargs[name] = cache
        out = twin(**kwargs, **{ids: torch.zeros(1, 1, dtype=torch.long, device="meta")})
    decoded = _held(_either(output_cache(out), cache), twin, before, n_layers, layer_names)
    return {
        path: _Held(-1 if layer is None else layer, _elements(t), canonical_dtype(t.dtype))
        for path, (t, layer) in decoded.items()
    }


def _either(first: Any, second: Any) -> Any:
    return first if first is not None else second  # a cache's truth is its length: not what is meant


def _new_cache(twin: nn.Module, encdec: bool) -> Any:
    """The cache ``generate`` gives this model (transformers' ``DynamicCache`` built from its
    config; an ``EncoderDecoderCache`` of two for an encoder-decoder), or None for a model that
    makes its own."""
    supports = getattr(type(twin), "_supports_default_dynamic_cache", None)
    if supports is None or not supports():
        return None
    from transformers import DynamicCache, EncoderDecoderCache

    config = twin.config.get_text_config(decoder=True)
    if encdec:
        return EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
    return DynamicCache(config=config)


def _held(
    cache: Any, twin: nn.Module, before: dict[tuple[str, str], torch.Tensor], n_layers: int, names: tuple[str, ...]
) -> dict[tuple[Any, ...], tuple[torch.Tensor, int | None]]:
    """Every tensor the cache holds, and the states the steps left on the modules."""
    found: dict[tuple[Any, ...], tuple[torch.Tensor, int | None]] = {}
    _walk(cache, ("cache",), None, n_layers, found, 0)
    for key, tensor in _module_tensors(twin).items():
        if before.get(key) is not tensor and tensor.ndim:
            found[("module", *key)] = (tensor, _owner(key[0], names))
    return found


def _elements(tensor: torch.Tensor) -> int:
    """Elements of the storage a tensor keeps alive (a sliding layer's view keeps the whole prompt)."""
    return tensor.untyped_storage().nbytes() // tensor.element_size()


def _walk(
    obj: Any,
    path: tuple[Any, ...],
    layer: int | None,
    n_layers: int,
    out: dict[tuple[Any, ...], tuple[torch.Tensor, int | None]],
    depth: int,
) -> None:
    """Every tensor a cache object holds, with the layer it belongs to: the index in the first
    ``n_layers``-long list on its path (``cache.layers[i]``, ``key_cache[i]``)."""
    if depth > 6 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        if obj.ndim:  # 0-d tensors are bookkeeping (a window, a length), not cache
            out[path] = (obj, layer)
        return
    items: list[tuple[Any, Any]]
    if isinstance(obj, Mapping):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    elif type(obj).__module__.startswith("transformers.cache_utils") or hasattr(obj, "layers"):
        items = [(k, v) for k, v in vars(obj).items() if not k.startswith("_")]
    else:
        return
    per_layer = layer is None and isinstance(obj, (list, tuple)) and len(obj) == n_layers
    for key, value in items:
        _walk(value, (*path, key), key if per_layer else layer, n_layers, out, depth + 1)


def _module_tensors(model: nn.Module) -> dict[tuple[str, str], torch.Tensor]:
    """Plain tensor attributes of every module (not its parameters or buffers)."""
    out = {}
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not attr.startswith("_"):
                out[(name, attr)] = value
    return out


def _owner(module: str, layer_names: tuple[str, ...]) -> int | None:
    for index, name in enumerate(layer_names):
        if module == name or module.startswith(name + "."):
            return index
    return None


def source_layers(model: nn.Module, n_layers: int) -> dict[int, int]:
    """Decoder layers whose cache holds another sequence than the generated tokens (a
    cross-attention over vision states), with the tokens it holds by default: what the
    model's own ``_prepare_static_cache`` allocates differently from the text layers (empty
    for a model without such layers or without that hook).

    Example:
        >>> import transformers
        >>> config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...                                   num_attention_heads=2, vocab_size=10)
        >>> with torch.device("meta"):
        ...     model = transformers.LlamaForCausalLM(config)
        >>> source_layers(model, 2)
        {}
    """
    prepare = getattr(model, "_prepare_static_cache", None)
    if prepare is None or getattr(model.config, "is_encoder_decoder", False):
        return {}
    text = 7919  # a length no model allocates by itself: every layer sized otherwise is not a text layer
    previous = model.__dict__.get("_previous_max_cache_length", _UNSET)
    try:
        cache = prepare("static", 1, text, None, model_kwargs={})
        lengths = [
            None if getattr(layer, "is_sliding", False) else getattr(layer, "max_cache_len", None)
            for layer in getattr(cache, "layers", ())
        ]
    except Exception:  # noqa: BLE001 - a model whose hook needs more (its inputs): no such layers known
        return {}
    finally:  # the hook remembers the length on the model; it is not ours to change
        if previous is _UNSET:
            model.__dict__.pop("_previous_max_cache_length", None)
        else:
            model._previous_max_cache_length = previous
    if len(lengths) != n_layers:
        return {}
    return {i: int(n) for i, n in enumerate(lengths) if n is not None and n != text}


_UNSET = object()
