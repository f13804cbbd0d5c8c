"""Quantized weights, sized before anything is loaded: what a weight costs once a quantizer
packs it, which checkpoint keys carry a quantization role, and which checkpoint formats bigviz
runs on a CPU. Pure Python (no torch): the planner sizes an int8 what-if for hardware you do
not own exactly as it sizes a float one.

**What bigviz quantizes with** (``quantization="int8"`` or ``"int4"``; the libraries that run
the packed weights on a CPU, as transformers uses them, so the bytes are the same):

========  =========================================  ==============================================
method    library and format                         stored per weight ``[out, in]``
========  =========================================  ==============================================
``int8``  torchao ``Int8WeightOnlyConfig`` (one      ``out x in`` int8 values, ``out`` scales in
          scale per output row, symmetric)           the compute dtype, ``out`` int8 zero points
``int4``  bitsandbytes 4-bit (``nf4``; ``fp4`` by    ``out x in / 2`` packed bytes, one float32
          config), blocks of 64 values               absmax per block, a 16-value float32 code
========  =========================================  ==============================================

Which weights: the 2-D weights of linear layers (``nn.Linear``), except the modules
transformers keeps in high precision (its ``get_keys_to_not_convert``: the output embeddings
(``lm_head``), tied weights, the last module) and those named in ``modules_to_not_convert``.
Embeddings, norms and biases stay as they are. The rule needs the model (module classes), so
:mod:`bigviz.modeling.quant` finds the names; this module sizes them.

Example:
    >>> config = QuantConfig("int8")
    >>> packed_nbytes(config, (4096, 4096)), 4096 * 4096 * 4  # int8 + scales, against float32
    (16797696, 67108864)
    >>> packed_nbytes(QuantConfig("int4"), (4096, 4096))
    9437248
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace

from bigviz.core.errors import UsageError
from bigviz.core.dtypes import FLOATING_DTYPES as _FLOATING
from bigviz.core.names import owner
from bigviz.core.tree import SizeTree, TensorSpec

__all__ = [
    "QUANT_METHODS",
    "INT4_BLOCK",
    "QuantConfig",
    "as_quant_config",
    "packed_nbytes",
    "quantized_tree",
    "default_targets",
    "with_stored",
    "quantization_role_keys",
    "PrequantizedFormat",
    "PREQUANTIZED",
    "prequantized_format",
]

QUANT_METHODS = ("int8", "int4")
"""The methods ``quantization=`` takes (a string, or a :class:`QuantConfig`)."""

_INT4_TYPES = ("nf4", "fp4")
INT4_BLOCK = 64
"""Values per float32 absmax in bitsandbytes' 4-bit format (its default, what transformers uses)."""


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize a model's weights while loading it (or what-if, in a plan).

    Attributes:
        method: ``"int8"`` (torchao, per-row scales) or ``"int4"`` (bitsandbytes 4-bit).
        quant_type: for ``int4``: ``"nf4"`` (default) or ``"fp4"`` (bitsandbytes' two 4-bit
            codes; blocks of :data:`INT4_BLOCK` values share one float32 absmax).
        modules_to_not_convert: modules kept in high precision, beside the quantizer's own
            defaults (``lm_head``, tied weights): dotted module names (``"model.layers.0"``
            keeps a whole block) or, without a dot, any name component (``"o_proj"``).

    Example:
        >>> QuantConfig("int4").describe()
        'int4 (bitsandbytes nf4, blocks of 64, float32 absmax)'
    """

    method: str
    quant_type: str = "nf4"
    modules_to_not_convert: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems = []
        if self.method not in QUANT_METHODS:
            problems.append(f"quantization method {self.method!r}: use one of {', '.join(QUANT_METHODS)}")
        if self.method == "int4" and self.quant_type not in _INT4_TYPES:
            problems.append(f"int4 quant_type {self.quant_type!r}: use one of {', '.join(_INT4_TYPES)}")
        if problems:
            raise UsageError("; ".join(problems))
        object.__setattr__(self, "modules_to_not_convert", tuple(self.modules_to_not_convert))

    @property
    def library(self) -> str:
        """The library whose kernels run the packed weights (an optional extra of bigviz)."""
        return "torchao" if self.method == "int8" else "bitsandbytes"

    def describe(self) -> str:
        """One line a person reads: the method, the library, the format."""
        if self.method == "int8":
            return "int8 (torchao weight-only, one scale per output row in the compute dtype)"
        return f"int4 (bitsandbytes {self.quant_type}, blocks of {INT4_BLOCK}, float32 absmax)"

    def skips(self, module: str) -> bool:
        """True when ``module`` (or a module above it) is kept in high precision by this config.

        Example:
            >>> QuantConfig("int8", modules_to_not_convert=("o_proj", "model.layers.0")).skips("model.layers.0.mlp")
            True
        """
        names = self.modules_to_not_convert
        parts = set(module.split("."))
        return owner(module, set(names)) is not None or any("." not in m and m in parts for m in names)


def as_quant_config(value: object) -> QuantConfig | None:
    """``"int8"``, ``"int4"``, ``None``/``"none"`` or a :class:`QuantConfig` as a config.

    Raises:
        ValueError: quoting the value and saying what is taken.

    Example:
        >>> as_quant_config("INT8").method, as_quant_config(None), as_quant_config("none")
        ('int8', None, None)
    """
    if value is None or isinstance(value, QuantConfig):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "none", "no", "off"):
            return None
        if text in QUANT_METHODS:
            return QuantConfig(text)
    raise UsageError(
        f"quantization={value!r}: use 'int8', 'int4', None, a bigviz.QuantConfig, or a transformers "
        "TorchAoConfig(Int8WeightOnlyConfig()) / BitsAndBytesConfig(load_in_4bit=True)"
    )


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def packed_nbytes(config: QuantConfig, shape: tuple[int, ...]) -> int:
    """Bytes a weight of ``shape`` takes once ``config`` packs it (values, scales, zero points,
    codes), as the library stores it in memory and in a checkpoint.

    Example:
        >>> packed_nbytes(QuantConfig("int8"), (3, 8)), packed_nbytes(QuantConfig("int4"), (3, 8))
        (39, 80)
    """
    numel = _numel(shape)
    if config.method == "int8":
        rows = numel // shape[-1] if shape and shape[-1] else 0
        return numel + rows * 4 + rows  # int8 values, float32 scale and int8 zero point per row
    blocks = -(-numel // INT4_BLOCK)
    return -(-numel // 2) + blocks * 4 + 16 * 4  # two values a byte, float32 absmax a block, the code


def quantized_tree(tree: SizeTree, config: QuantConfig, targets: Collection[str]) -> SizeTree:
    """``tree`` with each tensor of ``targets`` sized as ``config`` packs it (its dtype and
    shape stay the logical ones the model computes with).

    Example:
        >>> tree = SizeTree.build([TensorSpec("fc.weight", 64, "float32", (8, 8)), TensorSpec("fc.bias", 8, "float32")])
        >>> quantized_tree(tree, QuantConfig("int8"), ["fc.weight"]).total("")  # 64 + 8 * 5 + 32
        136
    """
    wanted = set(targets)
    stored = {
        name: (packed_nbytes(config, spec.shape or (spec.numel,)), config.method)
        for name, spec in tree.tensors.items()
        if name in wanted
    }
    return with_stored(tree, stored)


def with_stored(tree: SizeTree, stored: Mapping[str, tuple[int, str]]) -> SizeTree:
    """``tree`` with the given tensors' bytes as stored: name -> (bytes, format).

    Example:
        >>> tree = SizeTree.build([TensorSpec("w", 4, "float32")])
        >>> with_stored(tree, {"w": (5, "int8")}).total("")
        5
    """
    if not stored:
        return tree
    specs: list[TensorSpec] = [
        replace(spec, stored=stored[name][0], quant=stored[name][1]) if name in stored else spec
        for name, spec in tree.tensors.items()
    ]
    classes = {name: node.class_name for name, node in tree.nodes.items()}
    return SizeTree.build(specs, classes, tree.ties, containers=tree.containers)


_NOT_LINEAR = re.compile(r"(?:^|\.)(?:\w*embed\w*|wte|wpe|lm_head|embed_out|output|head)(?:\.|$)")


def default_targets(tree: SizeTree, config: QuantConfig) -> list[str]:
    """The weights :func:`quantized_tree` packs when only tensor names and shapes are known (a
    checkpoint planned from its headers, with no model to ask): 2-D floating ``weight``
    tensors of modules of class ``Linear`` (or of no known class), but embeddings and output
    heads (``embed``, ``wte``, ``wpe``, ``lm_head``, ``output``), tied weights, the module of
    the last weight and the config's ``modules_to_not_convert``.

    Example:
        >>> specs = [TensorSpec("wte.weight", 20, "float32", (5, 4)), TensorSpec("h.0.fc.weight", 16, "float32", (4, 4)),
        ...          TensorSpec("h.0.fc.bias", 4, "float32", (4,)), TensorSpec("ln_f.weight", 4, "float32", (4,))]
        >>> default_targets(SizeTree.build(specs), QuantConfig("int8"))
        ['h.0.fc.weight']
    """
    tied = {n for group in tree.ties for n in group}
    weights = [n for n, s in tree.tensors.items() if n.endswith("weight") and len(s.shape) == 2]
    last = (
        next(reversed(tree.tensors)).rpartition(".")[0] if tree.tensors else None
    )  # transformers: the last parameter's
    out = []
    for name in weights:
        module = name.rpartition(".")[0]
        node = tree.nodes.get(module)
        spec = tree.tensors[name]
        if node is not None and node.class_name not in ("", "Linear", "Linear4bit"):
            continue
        if spec.dtype not in _FLOATING or name in tied or module == last or _NOT_LINEAR.search(module):
            continue
        if not name.endswith(".weight") or config.skips(module):
            continue
        out.append(name)
    return out


# ---- checkpoint keys that carry a quantization role -------------------------------------
_ROLE = re.compile(
    r"(?:^|\.)(?:"
    r"_[A-Za-z0-9]+_(?:qdata|scale|zero_point|scale_and_zero|per_tensor_scale|act_pre_scale)"  # torchao
    r"|SCB|weight_format"  # bitsandbytes 8-bit
    r"|(?:weight\.)?(?:absmax|quant_map|nested_absmax|nested_quant_map)"  # bitsandbytes 4-bit
    r"|(?:weight\.)?quant_state\.bitsandbytes__[a-z0-9]+"
    r"|weight_(?:scale_inv|scale|scale_2|packed|shape|zero_point|global_scale|g_idx)"  # fp8, compressed-tensors
    r"|(?:input|output|activation)_(?:scale|global_scale|zero_point)"
    r"|qweight|qzeros|scales|g_idx"  # GPTQ, AWQ
    r"|weight\._data|weight\._scale"  # optimum-quanto
    r"|W_q|(?:gate_up_proj|down_proj)_(?:blocks|scales)"  # HQQ, MXFP4
    r")$"
)


def quantization_role_keys(keys: Iterable[str]) -> list[str]:
    """The keys of ``keys`` named as a quantizer names its packed data, scales and zero
    points (torchao, bitsandbytes, compressed-tensors, FP8 block scales, GPTQ/AWQ, quanto,
    HQQ, MXFP4). A loader must never drop those silently: without them the weights they
    belong to are garbage.

    Example:
        >>> quantization_role_keys(["h.0.q._weight_qdata", "h.0.q.SCB", "h.0.q.weight_scale_inv", "h.0.q.bias"])
        ['h.0.q._weight_qdata', 'h.0.q.SCB', 'h.0.q.weight_scale_inv']
    """
    return [k for k in keys if _ROLE.search(k)]


# ---- pre-quantized checkpoints -----------------------------------------------------------
@dataclass(frozen=True)
class PrequantizedFormat:
    """What bigviz knows of a ``quant_method`` a checkpoint's ``config.json`` names.

    Attributes:
        quant_method: the name transformers writes (``"torchao"``, ``"bitsandbytes"``, ``"fp8"``).
        runs: True when bigviz loads and runs it on a CPU.
        library: the package it needs (``""``: none).
        how: one line: how bigviz runs it, or why it cannot and what to do instead.
    """

    quant_method: str
    runs: bool
    library: str
    how: str


_USE_FLOAT = (
    "load a float checkpoint of the model with quantization='int8' (or 'int4') instead, or load this "
    "one with transformers' from_pretrained on a machine with the quantizer's kernels"
)
PREQUANTIZED: dict[str, PrequantizedFormat] = {
    f.quant_method: f
    for f in (
        PrequantizedFormat("torchao", True, "torchao", "torchao tensor subclasses, run packed (torchao's kernels)"),
        PrequantizedFormat("bitsandbytes", True, "bitsandbytes", "bitsandbytes 8-bit and 4-bit, run packed"),
        PrequantizedFormat("fp8", True, "", "FP8 with block scales, dequantized to the compute dtype when fetched"),
        PrequantizedFormat("mxfp4", True, "", "MXFP4 experts (gpt-oss), dequantized to the compute dtype when fetched"),
        PrequantizedFormat(
            "compressed-tensors",
            True,
            "compressed-tensors",
            "weight-only compressed-tensors schemes, decompressed by the compressed-tensors package when fetched",
        ),
    )
}
"""The ``quant_method`` values bigviz knows; any other is refused, named, with what to do."""


def prequantized_format(quant_method: str) -> PrequantizedFormat:
    """What bigviz does with ``quant_method``: a known format, or a refusal saying what to do.

    Example:
        >>> prequantized_format("fp8").runs, prequantized_format("mxfp4").runs, prequantized_format("gptq").runs
        (True, True, False)
        >>> prequantized_format("gptq").how[:40]
        'bigviz has no CPU path for gptq: load a '
    """
    known = PREQUANTIZED.get(quant_method)
    if known is not None:
        return known
    return PrequantizedFormat(quant_method, False, "", f"bigviz has no CPU path for {quant_method}: {_USE_FLOAT}")
