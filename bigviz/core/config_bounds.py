"""Check a model config's numbers before anything is built from them.

A ``config.json`` drives construction: ``num_hidden_layers: 10**12`` makes transformers (or
bigviz's reference models) build layers until the user gives up, ``-3`` builds a model with no
layers, ``"32"`` fails deep inside a constructor. transformers checks the types of some fields
and no bounds, so bigviz checks the config itself, as data, before any module exists:

* ``auto_map`` anywhere is refused: it names Python files in the checkpoint that transformers
  would run (after a ``[y/N]`` prompt); bigviz never runs code from a checkpoint.
* Every key that sizes a model, found by the names transformers and bigviz give them (layers,
  widths, heads, vocabulary, positions, experts; in the config and in every sub-config such as
  ``text_config``), must be a whole number (``null`` keeps the default): not a string, a float
  or a bool; at least 1 (experts: at least 0).
* Layers are bounded by what can be built on ``meta`` in reasonable time
  (:data:`MAX_LAYERS` per config, :data:`MAX_EXPERT_LAYERS` layers times experts), and the
  parameters estimated from these keys by :data:`MAX_PARAMETERS`.

The estimate is deliberately rough (attention, feed-forward times experts, embeddings): it
tells a planned model from an absurd one, a factor of two either way does not matter.

Pure Python: the data is the parsed JSON (or a ``to_dict()``).

Example:
    >>> for problem in config_problems({"model_type": "llama", "num_hidden_layers": -3, "hidden_size": "4096"}):
    ...     print(problem)
    num_hidden_layers = -3: must be at least 1
    hidden_size = '4096' (a string): write a whole number without quotes, e.g. 4096
    >>> estimate_parameters({"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 100}) > 0
    True
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from bigviz.core.errors import short_repr

__all__ = [
    "MAX_LAYERS",
    "MAX_EXPERT_LAYERS",
    "MAX_PARAMETERS",
    "MAX_DEPTH",
    "config_problems",
    "estimate_parameters",
    "REMOTE_CODE_KEYS",
]

MAX_LAYERS = 2048
"""Layers of one config (or sub-config). The deepest published models have a few hundred;
building one layer on ``meta`` takes milliseconds, so this bounds a config's build to seconds."""

MAX_EXPERT_LAYERS = 2**20
"""Layers times experts (Doge: 32 x 16,384 tiny experts; Switch-C: 15 x 2048; DeepSeek-V3: 58 x 256)."""

MAX_PARAMETERS = 10**14
"""A hundred trillion parameters, fifty times the largest model published."""

MAX_DEPTH = 16
"""Sub-configs nested deeper than this are not a model config."""

REMOTE_CODE_KEYS = ("auto_map",)
"""Keys that ask transformers to import Python files shipped with a checkpoint."""

# What each kind of key is called across transformers' and bigviz's configs, and its least
# value. A key matches by its whole name, so ``max_window_layers`` (how many layers slide) is
# not a layer count; a prefixed name (``type_vocab_size``, ``shared_expert_intermediate_size``)
# may be 0 (none of that part).
_KINDS: dict[str, re.Pattern[str]] = {
    "layers": re.compile(r"(num_|n_)(hidden_|encoder_|decoder_)?layers?|(encoder_|decoder_)layers"),
    "hidden": re.compile(r"hidden_size|hidden_dim|d_model|n_embd|n_embed|dim|embed_dim|embedding_size|model_dim"),
    "heads": re.compile(
        r"(num_|n_)(attention_|key_value_|kv_|query_|encoder_attention_|decoder_attention_)?heads?"
        r"|(encoder_|decoder_)attention_heads"
    ),
    "vocab": re.compile(r"vocab_size"),
    "width": re.compile(r"intermediate_size|ffn_dim|d_ff|n_inner|d_kv"),
    "positions": re.compile(r"max_position_embeddings|n_positions|n_ctx|block_size|max_seq_len|max_sequence_length"),
    "parts": re.compile(r"\w+_(vocab_size|intermediate_size|ffn_dim)|\w*head_dim|\w*lora_rank"),
    "experts": re.compile(r"(num_|n_)(local_|routed_|shared_)?experts|moe_num_experts"),
}
_MINIMUM = {"experts": 0, "parts": 0}  # 0 experts: dense; 0 of a part: none (head_dim 0: computed)
_FLOATS = ("positions",)  # some configs write positions as floats (1200.0); integral ones are accepted


def config_problems(data: Mapping[str, Any], *, max_parameters: int = MAX_PARAMETERS) -> list[str]:
    """Every problem of a config's numbers and keys, one sentence each (empty: buildable).

    Args:
        data: the config as JSON data (``config.json`` parsed, or ``config.to_dict()``).
        max_parameters: the largest estimate accepted.

    Example:
        >>> config_problems({"num_hidden_layers": 10**12, "hidden_size": 8})[0]
        'num_hidden_layers = 1000000000000: more layers than bigviz builds (at most 2048)'
        >>> config_problems({"model_type": "x", "auto_map": {"AutoModel": "m.X"}})[0][:44]
        'auto_map: the config asks to run Python code'
    """
    problems: list[str] = []
    model_type = data.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        problems.append(f'model_type = {_short(model_type)}: write the model\'s type as a string, e.g. "llama"')
    for path, sub in _configs(data, "", 0, problems):
        problems += _remote_code(sub, path)
        if not _quantizer_settings(path):
            problems += _number_problems(sub, path)
    if problems:
        return problems
    for path, sub in _configs(data, "", 0, []):
        if not _quantizer_settings(path):
            problems += _build_problems(sub, path)
    estimate = estimate_parameters(data) if not problems else 0
    if estimate > max_parameters:
        keys = ", ".join(f"{k} = {_short(v)}" for k, v in _sizing_keys(data))
        problems.append(
            f"{_scientific(estimate)} parameters from {keys}: more than {_scientific(max_parameters)}, "
            "which no model comes near; check these values"
        )
    return problems


def _build_problems(data: Mapping[str, Any], path: str) -> list[str]:
    """Layers (and layers times experts) beyond what can be built on meta in seconds."""
    layers, experts = _largest(data, "layers"), _largest(data, "experts")
    if layers is None:
        return []
    if layers[1] > MAX_LAYERS:
        return [f"{path}{layers[0]} = {_short(layers[1])}: more layers than bigviz builds (at most {MAX_LAYERS})"]
    if experts is not None and layers[1] * experts[1] > MAX_EXPERT_LAYERS:
        return [
            f"{path}{experts[0]} = {_short(experts[1])} with {path}{layers[0]} = {layers[1]}: more expert layers "
            f"than bigviz builds (at most {MAX_EXPERT_LAYERS:,} layers x experts)"
        ]
    return []


def estimate_parameters(data: Mapping[str, Any]) -> int:
    """Parameters a config describes, roughly: per layer attention and feed-forward (times the
    experts), plus token and position embeddings; sub-configs added.

    Example:
        >>> estimate_parameters({"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 11008,
        ...                      "vocab_size": 32000}) // 10**8  # Llama 2 7B: 6.7e9
        67
    """
    total = 0
    for _path, sub in _configs(data, "", 0, []):
        hidden = _value(sub, "hidden")
        if hidden is None:
            continue
        layers = _value(sub, "layers") or 0
        width = _value(sub, "width", pattern="intermediate_size|ffn_dim|d_ff|n_inner") or 4 * hidden
        experts = max(_value(sub, "experts") or 1, 1)
        if experts > 1:  # experts have a width of their own (DeepSeek, Qwen-MoE: moe_intermediate_size)
            width = _value(sub, "parts", pattern=r"\w*(moe|expert)\w*_intermediate_size") or width
        heads = _value(sub, "heads", pattern="num_attention_heads|n_heads?|encoder_attention_heads")
        head_dim = _value(sub, "width", pattern="d_kv") or _value(sub, "parts", pattern="head_dim")
        query = heads * head_dim if heads and head_dim else hidden
        per_layer = 4 * hidden * query + 3 * hidden * width * experts
        embeddings = ((_value(sub, "vocab") or 0) + (_value(sub, "positions") or 0)) * hidden
        total += layers * per_layer + 2 * embeddings
    return total


# ---- walking the config ---------------------------------------------------------------------
def _quantizer_settings(path: str) -> bool:
    """A sub-config under ``quantization_config``: the quantizer's own settings (torchao writes
    ``dim = -1`` for per-row scales), no sizing numbers; the quantization is checked where
    it is read (:func:`bigviz.checkpoint.quantized.support_problems`)."""
    return ".quantization_config." in f".{path}"


def _configs(
    data: Mapping[str, Any], path: str, depth: int, problems: list[str]
) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """The config and every sub-config (a dict value), with the key path to it (``text_config.``)."""
    if depth > MAX_DEPTH:
        problems.append(f"{path or 'the config'}: nested more than {MAX_DEPTH} deep; this is not a model config")
        return
    yield path, data
    for key, value in data.items():
        if isinstance(value, Mapping):
            yield from _configs(value, f"{path}{key}.", depth + 1, problems)


def _kind(key: object) -> str | None:
    if not isinstance(key, str):
        return None
    return next((kind for kind, pattern in _KINDS.items() if pattern.fullmatch(key)), None)


def _remote_code(data: Mapping[str, Any], path: str) -> list[str]:
    return [
        f"{path}{key}: the config asks to run Python code shipped with the checkpoint ({_short(data[key])}); "
        "bigviz never runs code from a checkpoint. Use a model transformers has built in: remove "
        f"{key!r} from a copy of the config and set 'model_type' to that model's type"
        for key in REMOTE_CODE_KEYS
        if key in data
    ]


def _number_problems(data: Mapping[str, Any], path: str) -> list[str]:
    """Each sizing key: a whole number (or a list of them, one per layer), at least its minimum."""
    problems = []
    for key, value in data.items():
        kind = _kind(key)
        if kind is None or value is None:
            continue
        for item in _items(value):
            problem = _number_problem(item, _MINIMUM.get(kind, 1), floats=kind in _FLOATS)
            if problem:
                problems.append(f"{path}{key} = {_short(value)}{problem}")
                break
    return problems


def _items(value: object) -> list[object]:
    """A sizing value's numbers: one, one per layer (a list), or one per part (lxmert's layers)."""
    if isinstance(value, list):
        return value
    return list(value.values()) if isinstance(value, Mapping) else [value]


def _number_problem(value: object, minimum: int, *, floats: bool = False) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return f" (a {type(value).__name__}): must be a whole number >= {minimum}"
    if isinstance(value, str):
        hint = value.strip() if value.strip().lstrip("-").isdigit() else "4096"
        return f" (a string): write a whole number without quotes, e.g. {hint}"
    if isinstance(value, float) and floats and value.is_integer():
        value = int(value)
    if isinstance(value, float):
        hint = f", e.g. {int(value)}" if value.is_integer() else ""
        return f" (a float): must be a whole number{hint}"
    if value < minimum:
        return f": must be at least {minimum}"
    return ""


def _value(data: Mapping[str, Any], kind: str, *, pattern: str | None = None) -> int | None:
    found = _largest(data, kind, pattern=pattern)
    return None if found is None else found[1]


def _largest(data: Mapping[str, Any], kind: str, *, pattern: str | None = None) -> tuple[str, int] | None:
    """The key of ``kind`` with the largest whole value (a per-layer list: its largest)."""
    match = re.compile(pattern) if pattern else _KINDS[kind]
    best: tuple[str, int] | None = None
    for key, value in data.items():
        if not isinstance(key, str) or _kind(key) != kind or not match.fullmatch(key):
            continue
        numbers = [int(v) for v in _items(value) if isinstance(v, (int, float)) and _whole_or_integral(v)]
        if numbers and (best is None or max(numbers) > best[1]):
            best = (key, max(numbers))
    return best


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _whole_or_integral(value: int | float) -> bool:
    return _whole(value) or (isinstance(value, float) and value.is_integer())


def _sizing_keys(data: Mapping[str, Any]) -> list[tuple[str, int]]:
    """The sizing keys of the config and its sub-configs, largest first (what an error names)."""
    found = []
    for path, sub in _configs(data, "", 0, []):
        for kind in ("layers", "hidden", "width", "vocab", "experts", "positions", "heads"):
            best = _largest(sub, kind)
            if best is not None:
                found.append((f"{path}{best[0]}", best[1]))
    return sorted(found, key=lambda kv: -kv[1])[:4]


def _scientific(n: int) -> str:
    """``1.2e+15``; an int too large for a float (or for ``str``) by its power of ten."""
    return f"{n:.1e}" if n < 10**300 else f"about 10**{int(n.bit_length() * 0.30103)}"


def _short(value: object) -> str:
    return short_repr(value) if not (isinstance(value, int) and abs(value) >= 10**30) else _scientific(abs(value))
