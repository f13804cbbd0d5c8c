"""Model configs: the ones bigviz ships, and a model built on ``meta`` from a ``config.json``.

A ``config.json`` is data bigviz builds a model from, so it is read as hostile input: one JSON
parser (``bigviz.core.serialize.parse_json``: bad UTF-8, deep nesting and keys given twice are
errors naming the file), a JSON object of at most :data:`MAX_CONFIG_BYTES`, and its sizing
numbers checked before any module is built (:mod:`bigviz.core.config_bounds`). A config that
asks for code shipped with the checkpoint (``auto_map``) is refused: bigviz never runs code
from a file, and passes ``trust_remote_code=False`` wherever it calls transformers.

Example:
    >>> "llama-3.1-70b" in shipped_configs()
    True
"""

from __future__ import annotations

import difflib
import os
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from bigviz.core.config_bounds import config_problems
from bigviz.core.errors import BigvizError, UsageError
from bigviz.core.serialize import parse_json

__all__ = [
    "ConfigError",
    "MAX_CONFIG_BYTES",
    "model_from_config",
    "reference_model_from_folder",
    "is_config_source",
    "shipped_configs",
    "config_path",
    "read_config",
    "checked_config",
    "hf_config",
    "NO_REMOTE_CODE",
    "building",
]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
MAX_CONFIG_BYTES = 16 * 2**20
"""A ``config.json`` larger than this is not one (the largest published are a few hundred KB)."""

NO_REMOTE_CODE = {"trust_remote_code": False}
"""What bigviz passes to every transformers factory: never import code from a checkpoint."""

_FIX = (
    "Fix: give the config.json of a model transformers has built in (as save_pretrained writes it), or of a "
    "bigviz model (bigviz.save_sharded(model, folder, config=model.config))"
)


class ConfigError(BigvizError, ValueError):
    """A model config bigviz will not build from: the file named, every problem listed."""


# ---- configs --------------------------------------------------------------------------------
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def shipped_configs() -> list[str]:
    """Names of the configs bigviz ships (published hyperparameters of well-known models).

    Example:
        >>> "llama-3.1-70b" in shipped_configs() and "deepseek-v3" in shipped_configs()
        True
    """
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def config_path(name: str) -> Path:
    """The path of a shipped config by name (``"llama-3.1-70b"``), to plan a model you do not have.

    Raises:
        ValueError: naming the configs there are.

    Example:
        >>> config_path("mixtral-8x7b").name
        'mixtral-8x7b.json'
    """
    path = CONFIG_DIR / f"{name.removesuffix('.json')}.json"
    if not path.is_file():
        raise UsageError(f"bigviz ships no config named {name!r}; it has: {', '.join(shipped_configs())}")
    return path


def is_config_source(source: object) -> bool:
    """True for a ``config.json`` path, or a folder that holds a ``config.json`` and no weights.

    Example:
        >>> import json, os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> _ = open(os.path.join(folder, "config.json"), "w").write("{}")
        >>> is_config_source(folder), is_config_source(os.path.join(folder, "nothing.json"))
        (True, False)
    """
    if not isinstance(source, (str, os.PathLike)):
        return False
    path = Path(source)
    if path.is_file():
        return path.suffix == ".json" and not path.name.endswith("index.json")
    if path.is_dir() and (path / "config.json").is_file():
        return not any(p.name.endswith(_WEIGHT_SUFFIXES) for p in path.iterdir())
    return False


def model_from_config(source: Any) -> nn.Module:
    """Build a transformers model on ``meta`` (no memory) from its config alone.

    ``source`` is a ``config.json`` path, a folder holding one, a dict of its contents, a
    ``PretrainedConfig`` or a bigviz ``GPTConfig`` / ``LlamaConfig``. The architecture named in
    the config is built (a causal LM when the config names one, else the base model), in the
    config's dtype, with its ties made. A config of one of bigviz's reference models (``bigviz.save_sharded(model, folder,
    config=model.config)`` writes one) builds that model, without transformers. The config is
    checked first (:func:`checked_config`); no code is ever run from the checkpoint.

    Raises:
        ConfigError: (a ``ValueError``) naming the file: not a JSON object, ``auto_map``, a
            sizing number out of range, no model type transformers knows (with the closest
            ones), a config transformers cannot build, or transformers not installed.

    Example:
        >>> model = model_from_config(config_path("mixtral-8x7b"))
        >>> type(model).__name__, round(sum(p.numel() for p in model.parameters()) / 1e9, 1)
        ('MixtralForCausalLM', 46.7)
    """
    data, where = checked_config(source)
    reference = _reference_model(data, where)
    if reference is not None:
        return reference
    config = source if _is_config_object(source) else hf_config(data, where)
    from transformers import AutoModel, AutoModelForCausalLM

    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = getattr(torch, str(dtype).removeprefix("torch."), None) if dtype is not None else None
    kwargs = {"dtype": dtype} if isinstance(dtype, torch.dtype) else {}
    with building(f"a {config.model_type!r} model", where), torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, **kwargs, **NO_REMOTE_CODE)
        except ValueError:  # no causal-LM head for this architecture: the base model
            model = AutoModel.from_config(config, **kwargs, **NO_REMOTE_CODE)
        model.tie_weights()
    return model.eval()


def read_config(source: Any) -> tuple[dict[str, Any], str]:
    """``(data, where)`` of a config: a ``config.json`` path (or a folder holding one), a dict,
    or a transformers config; ``where`` names it in errors.

    Raises:
        ConfigError: the file is missing, not a regular file, larger than
            :data:`MAX_CONFIG_BYTES`, not UTF-8 JSON, nested too deeply, names a key twice,
            or is not a JSON object.

    Example:
        >>> read_config({"model_type": "llama"})
        ({'model_type': 'llama'}, 'the config dict')
    """
    if _is_config_object(source):
        return source.to_dict(), f"the {type(source).__name__}"
    if isinstance(source, Mapping):
        return dict(source), "the config dict"
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"a model config is a config.json path, a dict or a transformers config, got {source!r}")
    path = Path(source) / "config.json" if Path(source).is_dir() else Path(source)
    try:
        data = parse_json(_config_bytes(path), path, "model config")
    except ConfigError:
        raise
    except ValueError as err:  # the one JSON parser's message names the file
        raise ConfigError(str(err), fix=_FIX) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: a model config is a JSON object {{key: value}}, got a {type(data).__name__}", fix=_FIX
        )
    return data, _described(source, path)


def _described(source: str | os.PathLike[str], path: Path) -> str:
    """The config as the user named it, in errors: ``the shipped config 'mixtral-8x7b' (path)``,
    ``'my-model' (my-model/config.json)`` for a folder, else the file's path."""
    if path.parent == CONFIG_DIR:
        return f"the shipped config {path.stem!r} ({path})"
    if Path(source) != path:
        return f"{str(source)!r} ({path})"
    return str(path)


def checked_config(source: Any) -> tuple[dict[str, Any], str]:
    """:func:`read_config`, then every problem of its keys and numbers (``auto_map``, sizing
    numbers that are not whole, not positive or absurd) in one :class:`ConfigError`.

    Example:
        >>> checked_config({"model_type": "llama", "num_hidden_layers": 0})
        Traceback (most recent call last):
        ...
        bigviz.modeling.configs.ConfigError: the config dict: cannot build a model from it (1 problem):
          - num_hidden_layers = 0: must be at least 1
        Fix: correct the config dict
    """
    data, where = read_config(source)
    ConfigError.check(config_problems(data), f"{where}: cannot build a model from it", fix=f"Fix: correct {where}")
    return data, where


def hf_config(data: Mapping[str, Any], where: str) -> Any:
    """The transformers config ``data`` describes (checked data: see :func:`checked_config`).

    Raises:
        ConfigError: no ``model_type``, one transformers does not know (the closest named),
            values transformers refuses, or transformers not installed.
    """
    try:
        from transformers import CONFIG_MAPPING
    except ImportError as err:  # an optional dependency: planning from checkpoints needs none
        raise ConfigError(
            f"{where} describes a transformers model: building it needs transformers (pip install transformers)"
        ) from err
    kwargs = _decoded_floats(dict(data))
    model_type = kwargs.pop("model_type", None)
    if not model_type:
        raise ConfigError(
            f'{where} has no \'model_type\' key: it must be a transformers config.json (e.g. "model_type": "llama")',
            fix=_FIX,
        )
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ConfigError(_unknown_type(model_type, where, list(CONFIG_MAPPING.keys())), fix=_FIX)
    with building(f"a {model_type!r} config", where):
        return CONFIG_MAPPING[model_type](**kwargs)


def _config_bytes(path: Path) -> bytes:
    """The bytes of a config file: a regular file (a FIFO would block the read forever) of at
    most :data:`MAX_CONFIG_BYTES`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise ConfigError(f"cannot read {path} as a model config: {err.strerror or err}", fix=_FIX) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{path} is not a regular file: give a config.json", fix=_FIX)
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path} is larger than {MAX_CONFIG_BYTES // 2**20} MiB: not a model config (they are a few KB)", fix=_FIX
        )
    return data


def _unknown_type(model_type: object, where: str, known: list[str]) -> str:
    """A short message: the type, the file, a few close names, how to fix it."""
    from bigviz.models import MODEL_TYPES

    if not isinstance(model_type, str):
        return f"{where}: 'model_type' is {model_type!r}, not a name such as \"llama\""
    import transformers

    close = difflib.get_close_matches(model_type, [*known, *MODEL_TYPES], n=4, cutoff=0.6)
    hint = f"close: {', '.join(repr(c) for c in close)}; " if close else ""
    return (
        f"{where}: model_type {model_type!r} is not one transformers {transformers.__version__} knows "
        f"({len(known)} types; {hint}bigviz's own: {', '.join(MODEL_TYPES)}). Correct the name, or upgrade "
        "transformers (pip install -U transformers) if the model is newer"
    )


def _is_config_object(source: object) -> bool:
    """A transformers ``PretrainedConfig`` or a bigviz ``GPTConfig`` / ``LlamaConfig``."""
    return hasattr(source, "to_dict") and hasattr(source, "model_type") and not isinstance(source, Mapping)


def _decoded_floats(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the non-finite floats transformers writes as ``{"__float__": "Infinity"}``
    decoded, as its own ``from_pretrained`` decodes them (a Mamba-2 ``time_step_limit`` of
    ``(0.0, inf)``): the config class refuses the tagged form. Decoded here, not through
    transformers' decoder, which is private (``PretrainedConfig._decode_special_floats``) and
    absent from versions that never wrote the tags; the tag's three spellings are its.

    Example:
        >>> _decoded_floats({"time_step_limit": [0.0, {"__float__": "Infinity"}]})
        {'time_step_limit': [0.0, inf]}
    """
    decoded = _decode_floats(data)
    assert isinstance(decoded, dict)
    return decoded


_SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _decode_floats(value: object) -> object:
    """``value`` with every ``{"__float__": "Infinity" | "-Infinity" | "NaN"}`` made a float."""
    if isinstance(value, dict):
        if (
            set(value) == {"__float__"}
            and isinstance(value["__float__"], str)
            and value["__float__"] in _SPECIAL_FLOATS
        ):
            return _SPECIAL_FLOATS[value["__float__"]]
        return {k: _decode_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_floats(v) for v in value]
    return value


@contextmanager
def building(what: str, where: str) -> Iterator[None]:
    """Turn what transformers (or a reference model) raises on a config it cannot build
    (``TypeError``, ``ZeroDivisionError``, a validator's error from deep inside a constructor)
    into a :class:`ConfigError` naming ``what`` was built from ``where``.

    Example:
        >>> with building("a 'llama' model", "cfg/config.json"):
        ...     1 // 0
        Traceback (most recent call last):
        ...
        bigviz.modeling.configs.ConfigError: cfg/config.json: cannot build a 'llama' model from it: ZeroDivisionError: integer division or modulo by zero
        Fix: ...
    """
    try:
        yield
    except (BigvizError, MemoryError):
        raise
    except Exception as err:
        text = " ".join(line.strip() for line in str(err).splitlines()[:4] if line.strip())
        raise ConfigError(
            f"{where}: cannot build {what} from it: {type(err).__name__}: {text[:400]}", fix=_FIX
        ) from err


def reference_model_from_folder(folder: str | os.PathLike[str]) -> nn.Module | None:
    """The bigviz reference model (GPT, Llama) a checkpoint folder's ``config.json`` describes,
    on meta, or None: no config, or a config of any other model.

    Example:
        >>> import json, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> _ = open(os.path.join(folder, "config.json"), "w").write(json.dumps({"model_type": "llama"}))
        >>> reference_model_from_folder(folder) is None   # transformers' Llama, not bigviz's
        True
    """
    path = Path(folder)
    config = (path if path.is_dir() else path.parent) / "config.json"
    if not config.is_file():
        return None
    data, where = checked_config(config)
    return _reference_model(data, where)


def _reference_model(data: Mapping[str, Any], where: str) -> nn.Module | None:
    """The bigviz reference model a config describes (on meta, eval), or None for any other."""
    from bigviz.models import MODEL_TYPES, from_config

    if data.get("model_type") not in MODEL_TYPES:
        return None
    with building(f"a {data['model_type']!r} model", where), torch.device("meta"):
        return from_config(data).eval()
