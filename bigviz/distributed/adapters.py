"""Stage modules for decoder-only language models: what a rank runs when its stage is cut
out of a model by name rather than by torch's tracer.

A decoder LM is embeddings -> blocks -> final norm -> head. A stage runs one contiguous run of
its blocks, with the embeddings in the first stage and the norm and head in the last; between
stages only the hidden states travel, and each stage recomputes what it needs besides
(positions, causal masks, rotary cos/sin) from their shape, as the whole model does, so the
pipelined logits equal the model's.

* bigviz's GPT (``transformer.wte/wpe/h/ln_f``, ``lm_head``) and Llama
  (``model.embed_tokens/layers/norm/rotary_emb``, ``lm_head``): a :class:`DecoderStage` calls
  their parts in order.
* transformers decoder-only LMs (a base model at ``model.base_model_prefix`` with
  ``embed_tokens`` or ``wte`` (+ learned ``wpe``), ``layers`` or ``h``, ``norm`` or ``ln_f``, and
  the causal LM's ``lm_head``: Llama, Mistral, Qwen, Phi-3, Gemma, GPT-2, ...): an
  :class:`HFStage` runs the model's *own* forward on a shallow copy in which the layers of
  other stages pass the hidden states through, the embedding is replaced by the hidden states
  (``inputs_embeds``), and the final norm and head run only in the last stage. Whatever the
  forward does besides (masks per layer type, sliding windows, logit soft-capping) is kept.

For generation every stage also has ``step(x, cache=..., start=...)``: the same forward with
a KV cache of its own layers (bigviz's :class:`~bigviz.models.cache.KVCache`, or
transformers' ``DynamicCache``: ``new_cache()``) and positions continuing from ``start``.

Example:
    >>> import torch
    >>> from bigviz.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig.preset("gpt-tiny")).eval()
    >>> layout = decoder_layout(model)
    >>> first = layout.stage(model, ["transformer.h.0"], first=True, last=False)
    >>> last = layout.stage(model, ["transformer.h.1"], first=False, last=True)
    >>> ids = torch.tensor([[1, 2, 3]])
    >>> torch.equal(last(first(ids)), model(ids)[0])
    True
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from bigviz.core.names import is_prefix, parent
from bigviz.core.pipeline import PipelineError
from bigviz.models.cache import KVCache
from bigviz.core.errors import ArgumentTypeError, StateError

__all__ = ["DecoderLayout", "DecoderStage", "HFStage", "decoder_layout", "cache_nbytes", "mask_positions"]


@dataclass(frozen=True)
class DecoderLayout:
    """Where a decoder LM's parts are, by module name, and how each is called.

    Attributes:
        family: ``"bigviz-gpt"``, ``"bigviz-llama"`` or ``"transformers"``.
        first: modules run before the blocks, in order (first stage).
        blocks: the module list holding the blocks (``"model.layers"``).
        last: modules run after the blocks, in order (last stage).
        context: modules every stage computes from, holding no checkpoint tensors
            (rotary embeddings).
    """

    family: str
    first: tuple[str, ...]
    blocks: str
    last: tuple[str, ...]
    context: tuple[str, ...] = ()

    def modules_for(self, blocks: Sequence[str], *, first: bool, last: bool) -> list[str]:
        """Every module a stage runs: its blocks, the context, and the ends it holds."""
        return [*(self.first if first else ()), *self.context, *blocks, *(self.last if last else ())]

    def problems(self, units: Sequence[tuple[str, str]]) -> list[str]:
        """Why this layout cannot run a stage's ``(unit, role)`` list (empty when it can)."""
        runs = (*self.first, *self.context, *self.last)
        out = []
        for name, role in units:
            if role == "block" and parent(name) != self.blocks:
                out.append(
                    f"block {name!r} is not one of the layers in {self.blocks!r}: the stage adapter runs "
                    f"whole layers (plan with the model's no-split classes)"
                )
            elif role != "block" and not any(is_prefix(r, name) for r in runs):
                out.append(
                    f"{name!r} runs outside the blocks, and the {self.family} stage adapter does not know "
                    f"how to run it (it runs {', '.join(runs)})"
                )
        return out

    def stage(self, model: nn.Module, blocks: Sequence[str], *, first: bool, last: bool) -> nn.Module:
        """The stage module running ``blocks`` (module names) of ``model``."""
        names = self.modules_for(blocks, first=first, last=last)
        return DecoderStage(self, {n: model.get_submodule(n) for n in names}, blocks, first=first, last=last)

    # ---- how each part is called (overridden per family) --------------------------
    def embed(self, stage: DecoderStage, ids: Tensor, start: int = 0) -> Tensor:
        """Token ids at positions ``start ..`` -> the first block's input (first stage). Each
        family whose stages are :class:`DecoderStage` overrides it; a layout that runs its own
        stage module (transformers) never calls it."""
        raise ArgumentTypeError(
            f"the {self.family!r} stage layout has no embed(): give it one, or a stage() of its own"
        )

    def context_of(self, stage: DecoderStage, hidden: Tensor, start: int = 0) -> dict[str, Any]:
        return {}

    def run_block(self, block: nn.Module, hidden: Tensor, context: Mapping[str, Any], cache: Any = None) -> Tensor:
        """One block's forward with what :meth:`context_of` computed, and the stage's cache
        (overridden per family, like :meth:`embed`)."""
        raise ArgumentTypeError(
            f"the {self.family!r} stage layout has no run_block(): give it one, or a stage() of its own"
        )

    def finish(self, stage: DecoderStage, hidden: Tensor) -> Tensor:
        for name in self.last:  # final norm, then head
            hidden = stage.part(name)(hidden)
        return hidden


class DecoderStage(nn.Module):
    """One pipeline stage of a decoder LM: (embeddings ->) its blocks (-> final norm, head).

    The modules are the model's own (registered here, so ``.to()`` and ``parameters()`` see
    exactly this stage's tensors); only hidden states go in and out, except the first stage,
    which takes token ids, and the last, which returns logits.
    """

    def __init__(
        self, layout: DecoderLayout, modules: Mapping[str, nn.Module], blocks: Sequence[str], *, first: bool, last: bool
    ) -> None:
        super().__init__()
        self.layout = layout
        self.module_names = tuple(modules)
        self.parts = nn.ModuleDict({_key(n): m for n, m in modules.items()})
        self.block_names = tuple(blocks)
        self.first, self.last = first, last

    def part(self, name: str) -> nn.Module:
        return self.parts[_key(name)]

    def forward(self, x: Tensor) -> Tensor:
        return self.step(x)

    def step(self, x: Tensor, *, cache: Any = None, start: int = 0, attention_mask: Tensor | None = None) -> Tensor:
        """The stage's forward for tokens at positions ``start ..``, keys and values kept in
        ``cache`` (from :meth:`new_cache`) when given. bigviz's own models attend to every
        earlier token: an ``attention_mask`` that hides one (padding) is refused."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise PipelineError(
                f"bigviz's {self.layout.family} stages take no attention mask: every row must be a whole prompt",
                fix="Fix: give prompts of one length, without padding (run other lengths in separate calls)",
            )
        hidden = self.layout.embed(self, x, start) if self.first else x  # (B, T) ids -> (B, T, C)
        context = self.layout.context_of(self, hidden, start)
        for name in self.block_names:
            hidden = self.layout.run_block(self.part(name), hidden, context, cache)
        return self.layout.finish(self, hidden) if self.last else hidden  # (B, T, vocab) at the end

    def new_cache(self) -> KVCache:
        """An empty cache for this stage's layers (each writes its own ``layer_idx`` slot)."""
        return KVCache()

    def extra_repr(self) -> str:
        return f"blocks={list(self.block_names)}, first={self.first}, last={self.last}"


def cache_nbytes(cache: Any) -> int:
    """Bytes a stage's cache holds: bigviz's ``KVCache`` or a transformers ``Cache`` (each
    layer object once: the layers of other stages are aliases, see :meth:`HFStage.new_cache`).

    Example:
        >>> from bigviz.models.cache import KVCache
        >>> cache = KVCache()
        >>> _ = cache.update(3, torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4))
        >>> cache_nbytes(cache)
        320
    """
    if isinstance(cache, KVCache):
        return cache.nbytes
    layers = {id(layer): layer for layer in getattr(cache, "layers", ())}
    return sum(
        t.numel() * t.element_size()
        for layer in layers.values()
        for t in vars(layer).values()
        if isinstance(t, Tensor) and not t.is_meta and t.dim() > 0
    )


def mask_positions(attention_mask: Tensor) -> Tensor:
    """The position of each token of a padded batch, as transformers' ``generate`` numbers them:
    tokens count from 0 after the row's padding, and a pad gets 1 (it is masked out anyway).

    Example:
        >>> mask_positions(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]))
        tensor([[1, 1, 0, 1, 2],
                [0, 1, 2, 3, 4]])
    """
    mask = attention_mask.long()
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def _key(name: str) -> str:
    return name.replace(".", "/")  # module names may not contain dots


def _positions(x: Tensor, start: int = 0) -> Tensor:
    """Positions start..start+T-1 of ids (B, T) or hidden states (B, T, C), on their device."""
    return torch.arange(start, start + x.shape[1], dtype=torch.long, device=x.device)  # (T,)


class _GPTLayout(DecoderLayout):
    """bigviz's GPT: token + learned position embeddings, dropout, Blocks, ln_f, tied head."""

    def embed(self, stage: DecoderStage, ids: Tensor, start: int = 0) -> Tensor:
        tok = stage.part("transformer.wte")(ids)  # (B, T, C)
        pos = stage.part("transformer.wpe")(_positions(ids, start))  # (T, C)
        return stage.part("transformer.drop")(tok + pos.to(tok.device))

    def run_block(self, block: nn.Module, hidden: Tensor, context: Mapping[str, Any], cache: Any = None) -> Tensor:
        return block(hidden, cache=cache)


class _LlamaLayout(DecoderLayout):
    """bigviz's Llama: token embeddings, rotary cos/sin shared by every layer, RMSNorm, head."""

    def embed(self, stage: DecoderStage, ids: Tensor, start: int = 0) -> Tensor:
        return stage.part("model.embed_tokens")(ids)

    def context_of(self, stage: DecoderStage, hidden: Tensor, start: int = 0) -> dict[str, Any]:
        cos, sin = stage.part("model.rotary_emb")(_positions(hidden, start), dtype=hidden.dtype)
        return {"cos": cos, "sin": sin}

    def run_block(self, block: nn.Module, hidden: Tensor, context: Mapping[str, Any], cache: Any = None) -> Tensor:
        return block(hidden, context["cos"], context["sin"], cache=cache)


class _HFLayout(DecoderLayout):
    """A transformers decoder-only LM: stages run the model's own forward (see :class:`HFStage`)."""

    def stage(self, model: nn.Module, blocks: Sequence[str], *, first: bool, last: bool) -> nn.Module:
        return HFStage(model, self, blocks, first=first, last=last)


class _PassThrough(nn.Module):
    """A layer of another stage: the hidden states go through unchanged."""

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return hidden_states


class _NotHere(nn.Module):
    """A module another stage runs (this stage's input is already past it)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        raise StateError(f"{self.name} runs in another pipeline stage")


class _NoPositions(nn.Module):
    """Learned position embeddings, added once, by the first stage: later stages add nothing
    (a boolean zero adds exactly 0 and keeps the hidden states' dtype)."""

    def forward(self, position_ids: Tensor) -> Tensor:
        return torch.zeros(*position_ids.shape, 1, dtype=torch.bool, device=position_ids.device)


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its submodules and tensors, whose children can be swapped
    without touching the original."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)  # type: ignore[assignment]
    return clone


class HFStage(nn.Module):
    """One pipeline stage of a transformers decoder-only LM, run by the model's own forward.

    The first stage takes token ids; the others take hidden states as ``inputs_embeds``; the
    last returns logits (``CausalLM.forward``: head and any soft-capping), the others the base
    model's last hidden states (before the final norm, which only the last stage applies).
    """

    def __init__(
        self, model: nn.Module, layout: DecoderLayout, blocks: Sequence[str], *, first: bool, last: bool
    ) -> None:
        super().__init__()
        prefix, layers_name = layout.blocks.split(".", 1)
        base = _shallow(getattr(model, prefix))
        keep = set(blocks)
        layers = getattr(base, layers_name)
        setattr(
            base,
            layers_name,
            nn.ModuleList(
                layer if f"{layout.blocks}.{i}" in keep else _PassThrough() for i, layer in enumerate(layers)
            ),
        )
        if not first:  # the token embedding is not called on inputs_embeds; positions are already in
            setattr(base, layout.first[0].split(".", 1)[1], _NotHere(layout.first[0]))
            if f"{prefix}.wpe" in layout.first:
                base.wpe = _NoPositions()
        if not last:
            setattr(base, layout.last[0].split(".", 1)[1], nn.Identity())  # the final norm
        self.first, self.last = first, last
        self.block_names = tuple(blocks)
        self.layer_ids = tuple(i for i in range(len(layers)) if f"{layout.blocks}.{i}" in keep)
        self.config = model.config
        if last:
            top = _shallow(model)
            setattr(top, prefix, base)
            self.model: nn.Module = top
        else:
            self.model = base

    def forward(self, x: Tensor) -> Tensor:
        inputs = {"input_ids" if self.first else "inputs_embeds": x, "use_cache": False}
        out = self.model(**inputs)
        return out.logits if self.last else out.last_hidden_state  # (B, T, vocab) or (B, T, C)

    def step(self, x: Tensor, *, cache: Any = None, start: int = 0, attention_mask: Tensor | None = None) -> Tensor:
        """The model's own forward with ``cache`` (from :meth:`new_cache`), positions from
        ``start``; the last stage computes the last position's logits only, as ``generate``
        does (``logits_to_keep=1``). ``attention_mask`` ``(B, start + T)``, 1 for a token and
        0 for padding (left padding, as a tokenizer gives for ``generate``), goes to the model,
        and the positions count the tokens only, as ``generate`` numbers them."""
        inputs: dict[str, Any] = {"input_ids" if self.first else "inputs_embeds": x}
        if cache is not None:
            inputs |= {_cache_argument(self.model): cache, "use_cache": True}
            inputs["position_ids"] = _positions(x, start)[None]  # (1, T)
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
            inputs["position_ids"] = mask_positions(attention_mask)[:, -x.shape[1] :]  # (B, T)
        if self.last and "logits_to_keep" in _parameters(self.model):
            inputs["logits_to_keep"] = 1
        out = self.model(**inputs)
        return out.logits if self.last else out.last_hidden_state  # (B, T', vocab) or (B, T, C)

    def new_cache(self) -> Any:
        """transformers' ``DynamicCache`` for the model, in which the layers of other stages
        are aliases of this stage's first layer of the same kind.

        Why: the model's forward sizes its masks and numbers its positions from a cache layer
        it picks by index (the first, or the first sliding one), which may belong to another
        stage and would stay empty here. An alias answers for the tokens this stage has seen
        and holds nothing of its own (the other stages' layers never write to it: they pass
        the hidden states through), so the cache holds this stage's layers only.
        """
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) <= max(self.layer_ids, default=-1):
            raise PipelineError(
                "pipelined generation of transformers models needs a DynamicCache built from the config, one "
                "layer per decoder layer (transformers >= 4.56)",
                fix="Fix: pip install -U transformers",
            )
        mine = set(self.layer_ids)
        for i, layer in enumerate(layers):
            if i not in mine:
                twin = next((j for j in self.layer_ids if _same_kind(layers[j], layer)), None)
                if twin is not None:
                    layers[i] = layers[twin]
        return cache

    def extra_repr(self) -> str:
        return f"blocks={list(self.block_names)}, first={self.first}, last={self.last}"


def _same_kind(a: Any, b: Any) -> bool:
    """Two cache layers that answer the same way for the same tokens (class and window)."""
    return type(a) is type(b) and getattr(a, "sliding_window", None) == getattr(b, "sliding_window", None)


def _parameters(module: nn.Module) -> Mapping[str, Any]:
    return inspect.signature(module.forward).parameters


def _cache_argument(module: nn.Module) -> str:
    """The forward's name for the cache: ``cache`` (transformers 5), else ``past_key_values``."""
    return "cache" if "cache" in _parameters(module) else "past_key_values"


def decoder_layout(model: nn.Module) -> DecoderLayout:
    """The layout of a decoder LM, from its class (bigviz) or standard attributes (transformers).

    Raises:
        PipelineError: naming the parts it could not find, and the way out (``example_args``
            for torch's tracer).
    """
    from bigviz.models import GPT, Llama

    if isinstance(model, GPT):
        return _GPTLayout(
            "bigviz-gpt",
            ("transformer.wte", "transformer.wpe", "transformer.drop"),
            "transformer.h",
            ("transformer.ln_f", "lm_head"),
        )
    if isinstance(model, Llama):
        return _LlamaLayout(
            "bigviz-llama", ("model.embed_tokens",), "model.layers", ("model.norm", "lm_head"), ("model.rotary_emb",)
        )
    return _hf_layout(model)


def _hf_layout(model: nn.Module) -> DecoderLayout:
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    roles = {"embeddings": ("embed_tokens", "wte"), "blocks": ("layers", "h"), "final norm": ("norm", "ln_f")}
    found = {role: _first_attr(base, names) for role, names in roles.items()}
    head = "lm_head" if isinstance(getattr(model, "lm_head", None), nn.Module) else None
    missing = [f"{role} ({' or '.join(names)})" for role, names in roles.items() if found[role] is None]
    if base is None or missing or head is None:
        what = (["a base model (base_model_prefix)"] if base is None else missing) + ([] if head else ["lm_head"])
        raise PipelineError(
            f"cannot cut {type(model).__name__} into stages by name",
            [
                f"the stage adapter runs decoder-only LMs (embeddings -> blocks -> norm -> lm_head); "
                f"{type(model).__name__} lacks {', '.join(what)}: pass example_args so torch's tracer cuts it instead"
            ],
            fix="Fix: pass example_args so torch's tracer (torch.distributed.pipelining.pipeline) splits it",
        )
    first = [f"{prefix}.{found['embeddings']}"] + [f"{prefix}.{n}" for n in ("wpe", "drop") if _is_module(base, n)]
    context = (f"{prefix}.rotary_emb",) if _is_module(base, "rotary_emb") else ()
    return _HFLayout(
        "transformers", tuple(first), f"{prefix}.{found['blocks']}", (f"{prefix}.{found['final norm']}", head), context
    )


def _first_attr(obj: Any, names: Sequence[str]) -> str | None:
    return next((n for n in names if _is_module(obj, n)), None)


def _is_module(obj: Any, name: str) -> bool:
    return obj is not None and isinstance(getattr(obj, name, None), nn.Module)
