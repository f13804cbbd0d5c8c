"""The run a plan must hold besides the weights: the KV cache and the activations.

A :class:`Workload` says what runs (batch size, context length, cache dtype). A model is
described, once, by a :class:`RunSpec`: per layer module, what its cache keeps per token
or per sequence (:class:`CacheSpec`), and what its largest step keeps alive at its peak
(:class:`StepSpec`, a few :class:`Term` per phase). Pure functions turn the two into bytes
per module, which the planner charges on the device each module runs on. Nothing here
knows torch: ``bigviz.modeling.workload`` reads the specs from a model or a config.

The cache formulas (``B`` batch, ``T`` context length, bytes of the cache dtype):

* full attention: ``B x T x kv_heads x (k_dim + v_dim)``;
* sliding window ``W``: the same with ``min(T, W)`` tokens once decoding (a dynamic cache keeps
  the whole prompt's keys and values from the prefill until the layer's first decode step:
  :meth:`CacheSpec.peak_nbytes` charges that);
* multi-head latent attention (DeepSeek): ``B x T x (kv_lora_rank + qk_rope_head_dim)``;
* cross-attention: ``B x S x kv_heads x (k_dim + v_dim)`` over the ``S`` tokens it attends to
  (an encoder's output, Mllama's vision states), whatever ``T``;
* state (Mamba, Jamba, Bamba, Falcon-H1, Zamba2, Qwen3-Next, LFM2, RecurrentGemma):
  ``B x (each fixed-size state)``, whatever ``T``;
* none (a layer without attention).

A layer can hold several (Falcon-H1 and Zamba2's hybrid layers: a state and keys and values;
an encoder-decoder's decoder layer: self- and cross-attention).

Example:
    >>> gqa = CacheSpec("full_attention", heads=8, k_dim=128, v_dim=128)   # Llama 3 70B layer
    >>> gqa.nbytes(Workload(batch_size=1, context_length=32768), "bfloat16") / 2**20
    128.0
    >>> window = CacheSpec("sliding_attention", heads=8, k_dim=128, v_dim=128, window=4096)
    >>> window.nbytes(Workload(context_length=32768), "bfloat16") / 2**20
    16.0
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from bigviz.core.errors import PlanError, UsageError
from bigviz.core.dtypes import canonical_dtype, itemsize

__all__ = [
    "Workload",
    "CacheSpec",
    "Term",
    "StepSpec",
    "RunSpec",
    "RunBytes",
    "CACHE_KINDS",
    "layer_cache_bytes",
    "activation_bytes",
    "longest_fit",
]

CACHE_KINDS = ("full_attention", "sliding_attention", "latent_attention", "cross_attention", "state", "none")
"""What a layer's cache can be; ``latent_attention`` keeps one shared latent per token."""


@dataclass(frozen=True)
class Workload:
    """What a plan must run besides holding the weights.

    Attributes:
        batch_size: sequences decoded together.
        context_length: tokens each sequence's cache holds at the end (prompt plus
            generated tokens; ``generate`` never caches its last token, so a prompt of ``P``
            and ``N`` new tokens hold ``P + N - 1``). The largest step is the prefill of
            this many tokens. ``0``: weights only.
        kv_dtype: dtype of the cache (``None``: the model's compute dtype).
        encoder_length: tokens the cross-attention layers attend to: an encoder-decoder's
            encoder input (T5, BART, Whisper: its encoder's output length), Mllama's vision
            states (images x tiles x (patches + 1)). ``None``: the model's own default
            (Mllama: one image; an encoder-decoder: ``context_length``).

    Example:
        >>> Workload(batch_size=4, context_length=8192, kv_dtype="fp16")
        Workload(batch_size=4, context_length=8192, kv_dtype='float16', encoder_length=None)
    """

    batch_size: int = 1
    context_length: int = 0
    kv_dtype: str | None = None
    encoder_length: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            problems.append(f"batch_size={self.batch_size!r} must be an integer >= 1")
        if isinstance(self.context_length, bool) or not isinstance(self.context_length, int) or self.context_length < 0:
            problems.append(f"context_length={self.context_length!r} must be an integer >= 0 (tokens the cache holds)")
        if self.encoder_length is not None and (
            isinstance(self.encoder_length, bool) or not isinstance(self.encoder_length, int) or self.encoder_length < 0
        ):
            problems.append(
                f"encoder_length={self.encoder_length!r} must be an integer >= 0 (tokens the cross-attention "
                f"layers attend to) or None"
            )
        if self.kv_dtype is not None:
            try:
                object.__setattr__(self, "kv_dtype", canonical_dtype(self.kv_dtype))
            except ValueError as err:
                problems.append(f"kv_dtype: {err}")
        PlanError.check(problems, "invalid workload")

    @property
    def active(self) -> bool:
        """True when there is a run to plan for (a context to hold)."""
        return self.context_length > 0

    @property
    def source_tokens(self) -> int:
        """Tokens the cross-attention layers attend to (``encoder_length``, else the context)."""
        return self.context_length if self.encoder_length is None else self.encoder_length


@dataclass(frozen=True)
class CacheSpec:
    """What one layer's cache keeps, per token (attention) or per sequence (state).

    Attributes:
        kind: one of :data:`CACHE_KINDS`.
        heads: key/value heads the cache keeps (1 for a shared latent, or for widths read
            from the model's own cache, which give elements per token whole).
        k_dim: width of a cached key per head (the latent's width for MLA).
        v_dim: width of a cached value per head (the rotary key's width for MLA).
        window: tokens a sliding-window layer keeps at most.
        state: ``(elements per sequence, dtype)`` of each fixed-size state; dtype ``None``
            means the cache dtype (Mamba: the conv state; its recurrent state is float32).
    """

    kind: str
    heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    window: int | None = None
    state: tuple[tuple[int, str | None], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in CACHE_KINDS:
            raise UsageError(f"unknown cache kind {self.kind!r}: use one of {', '.join(CACHE_KINDS)}")
        if self.kind == "sliding_attention" and not self.window:
            raise UsageError("a sliding_attention cache needs its window (tokens kept), e.g. window=4096")

    def tokens(self, context_length: int, source_length: int | None = None) -> int:
        """Tokens this layer keeps for a context of ``context_length`` (a cross-attention:
        for ``source_length`` tokens attended to, else the context)."""
        if self.kind in ("state", "none"):
            return 0
        if self.kind == "sliding_attention":
            return min(context_length, int(self.window or 0))
        if self.kind == "cross_attention":
            return context_length if source_length is None else source_length
        return context_length

    def per_token(self) -> int:
        """Elements cached per token per sequence (keys and values together)."""
        return self.heads * (self.k_dim + self.v_dim)

    def nbytes(self, workload: Workload, dtype: str) -> int:
        """Bytes this layer's cache holds under ``workload`` (``dtype``: the cache's, unless
        the workload names one)."""
        return self._bytes(workload, dtype, self.tokens(workload.context_length, workload.source_tokens))

    def peak_nbytes(self, workload: Workload, dtype: str) -> int:
        """The most this layer's cache holds during a run whose prefill is the whole context,
        with transformers' dynamic cache: a sliding-window layer keeps views of the whole
        prompt's keys and values from the prefill until its first decode step, so its peak is
        the full context; every other kind peaks at :meth:`nbytes`."""
        if self.kind != "sliding_attention":
            return self.nbytes(workload, dtype)
        return self._bytes(workload, dtype, workload.context_length)

    def _bytes(self, workload: Workload, dtype: str, tokens: int) -> int:
        if not workload.active or self.kind == "none":
            return 0
        size = itemsize(workload.kv_dtype or dtype)
        total = workload.batch_size * tokens * self.per_token() * size
        for elements, state_dtype in self.state:
            total += workload.batch_size * elements * (itemsize(state_dtype) if state_dtype else size)
        return int(total)


@dataclass(frozen=True)
class Term:
    """Elements alive at a step's peak, scaled by the workload.

    ``elements`` x (batch, if ``batched``) x (tokens, or tokens squared for ``per="pair"``
    such as attention scores and masks, or 1 for ``per="fixed"``) x bytes per element
    (``itemsize``; ``None``: the compute dtype's). An encoder counts the tokens it reads
    (``per="source"``, and ``"source_pair"`` for its scores); a cross-attention's scores are
    ``per="cross"`` (tokens x tokens attended to).

    Example:
        >>> Term(3 * 14336).nbytes(Workload(1, 8192), "bfloat16") / 2**20   # a SwiGLU MLP's peak
        672.0
    """

    elements: float
    itemsize: float | None = None
    batched: bool = True
    per: str = "token"  # "token", "pair", "fixed", "source", "source_pair" or "cross"

    def nbytes(self, workload: Workload, dtype: str) -> int:
        tokens, source = workload.context_length, workload.source_tokens
        scale = {
            "token": tokens,
            "pair": tokens * tokens,
            "fixed": 1,
            "source": source,
            "source_pair": source * source,
            "cross": tokens * source,
        }[self.per]
        batch = workload.batch_size if self.batched else 1
        size = self.itemsize if self.itemsize is not None else itemsize(dtype)
        return int(self.elements * batch * scale * size)


@dataclass(frozen=True)
class StepSpec:
    """A module's part of the prefill: what is alive at the peak of each of its phases
    (attention, MLP, ...); the step's peak is its largest phase."""

    phases: tuple[tuple[Term, ...], ...]

    def nbytes(self, workload: Workload, dtype: str) -> int:
        if not workload.active:
            return 0
        return max((sum(t.nbytes(workload, dtype) for t in phase) for phase in self.phases), default=0)


@dataclass(frozen=True)
class RunSpec:
    """Everything a plan needs to charge a run on a model, per module.

    Attributes:
        dtype: the compute dtype (activations; the cache too unless the workload names one).
        caches: layer module -> what its cache keeps.
        steps: module -> its step's phases (layers, the head).
        carried: what the whole forward keeps alive on every device it runs on (the
            residual stream, masks, rotary tables).
        notes: how the estimate was made (attention kernel, assumptions), for reports.
        held: module -> what its output keeps alive on the device it runs on for the whole
            forward (the input embeddings: on their device only, not on every device).
        source_tokens: tokens the cross-attention layers attend to when the workload does
            not say (Mllama: one image's vision states); ``None``: the context length.
    """

    dtype: str
    caches: Mapping[str, tuple[CacheSpec, ...]] = field(default_factory=dict)
    steps: Mapping[str, StepSpec] = field(default_factory=dict)
    carried: tuple[Term, ...] = ()
    notes: tuple[str, ...] = ()
    held: Mapping[str, tuple[Term, ...]] = field(default_factory=dict)
    source_tokens: int | None = None

    def resolved(self, workload: Workload) -> Workload:
        """``workload`` with the tokens its cross-attention layers attend to filled in."""
        if workload.encoder_length is not None or self.source_tokens is None:
            return workload
        return replace(workload, encoder_length=self.source_tokens)

    def kv_cache(self, workload: Workload) -> dict[str, int]:
        """Bytes of cache per layer module once the run is over (what a static cache holds)."""
        return layer_cache_bytes(self.caches, self.resolved(workload), self.dtype)

    def kv_peak(self, workload: Workload) -> dict[str, int]:
        """The most each layer's cache holds during the run (see :meth:`CacheSpec.peak_nbytes`):
        what a plan charges."""
        workload = self.resolved(workload)
        return {name: sum(s.peak_nbytes(workload, self.dtype) for s in specs) for name, specs in self.caches.items()}

    def activations(self, workload: Workload) -> dict[str, int]:
        """Peak activation bytes per module step, carried tensors included."""
        return activation_bytes(self.steps, self.carried, self.resolved(workload), self.dtype)

    def held_bytes(self, workload: Workload) -> dict[str, int]:
        """Bytes each module's output keeps alive on its device for the whole forward."""
        workload = self.resolved(workload)
        if not workload.active:
            return {}
        return {name: sum(t.nbytes(workload, self.dtype) for t in terms) for name, terms in self.held.items()}


@dataclass(frozen=True)
class RunBytes:
    """A run's bytes per module, as the planner charges them (``PlanOptions`` fields).

    Attributes:
        kv_cache: each layer's cache at its peak during the run.
        activations: each module's step at its peak, what every step carries included.
        held: what a module's output keeps alive all forward on its device (input embeddings).
    """

    kv_cache: dict[str, int] = field(default_factory=dict)
    activations: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, spec: RunSpec, workload: Workload) -> RunBytes:
        """What ``spec`` charges for ``workload`` (nothing without a context)."""
        if not workload.active:
            return cls()
        return cls(spec.kv_peak(workload), spec.activations(workload), spec.held_bytes(workload))


def layer_cache_bytes(caches: Mapping[str, Iterable[CacheSpec]], workload: Workload, dtype: str) -> dict[str, int]:
    """Bytes of cache per layer module.

    Example:
        >>> specs = {f"layers.{i}": (CacheSpec("full_attention", heads=2, k_dim=4, v_dim=4),) for i in range(2)}
        >>> layer_cache_bytes(specs, Workload(batch_size=2, context_length=10), "float16")
        {'layers.0': 640, 'layers.1': 640}
    """
    return {name: sum(spec.nbytes(workload, dtype) for spec in specs) for name, specs in caches.items()}


def activation_bytes(
    steps: Mapping[str, StepSpec], carried: Iterable[Term], workload: Workload, dtype: str
) -> dict[str, int]:
    """Peak bytes alive while each module's step runs: its largest phase plus what the
    forward carries (0 for every module without a context).

    Example:
        >>> step = StepSpec(((Term(4),), (Term(10),)))        # attention 4, MLP 10 per token
        >>> activation_bytes({"h.0": step}, (Term(2),), Workload(1, 100), "float32")
        {'h.0': 4800}
    """
    if not workload.active:
        return {name: 0 for name in steps}
    base = sum(t.nbytes(workload, dtype) for t in carried)
    return {name: base + step.nbytes(workload, dtype) for name, step in steps.items()}


def longest_fit(fits: Callable[[int], bool], limit: int) -> int:
    """The largest ``n <= limit`` with ``fits(n)``, for a ``fits`` that holds up to some
    point and fails after it (0 when ``fits(0)`` fails too): doubling, then bisection, so
    about ``2 log2(n)`` calls.

    Example:
        >>> calls = []
        >>> longest_fit(lambda n: calls.append(n) or n <= 1000, 10**6), len(calls)
        (1000, 21)
        >>> longest_fit(lambda n: True, 64), longest_fit(lambda n: False, 64)
        (64, 0)
    """
    if not fits(0):
        return 0
    low, high = 0, 1
    while high <= limit and fits(high):  # double until a length that does not fit
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:  # low fits, high does not
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low
