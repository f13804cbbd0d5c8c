"""One dtype table: torch's names, safetensors' codes, bits per element, floating or not.

Every layer reads dtypes from here: the size tree (bytes of a tensor), the safetensors reader
and writer (header codes), loading (is it floating, so a ``dtype=`` cast applies), the
planner's what-ifs (``int8``, ``int4``). A checkpoint whose header names a dtype is planned
with the same table it is opened with, so what opens can be planned.

Sub-byte dtypes (4-bit, 6-bit) have fractional sizes: a tensor's bytes are its elements
times the bits, over 8, rounded up.

Example:
    >>> canonical_dtype("torch.bfloat16"), canonical_dtype("F16"), canonical_dtype("fp32")
    ('bfloat16', 'float16', 'float32')
    >>> from_safetensors("F8_E8M0"), itemsize("int4"), tensor_nbytes("int4", 3)
    ('float8_e8m0fnu', 0.5, 2)
"""

from __future__ import annotations

from dataclasses import dataclass
from bigviz.core.errors import UsageError

__all__ = [
    "DType",
    "DTYPES",
    "DTYPE_SIZES",
    "FLOATING_DTYPES",
    "canonical_dtype",
    "itemsize",
    "bits",
    "tensor_nbytes",
    "is_floating",
    "load_dtype",
    "LOADABLE_DTYPES",
    "from_safetensors",
    "to_safetensors",
    "SAFETENSORS_CODES",
]


@dataclass(frozen=True)
class DType:
    """One dtype: torch's name (without ``torch.``), its safetensors code, bits, floating."""

    name: str
    code: str | None
    bits: int
    floating: bool


_TABLE = (
    DType("float64", "F64", 64, True),
    DType("float32", "F32", 32, True),
    DType("float16", "F16", 16, True),
    DType("bfloat16", "BF16", 16, True),
    DType("float8_e4m3fn", "F8_E4M3", 8, True),
    DType("float8_e5m2", "F8_E5M2", 8, True),
    DType("float8_e4m3fnuz", "F8_E4M3FNUZ", 8, True),
    DType("float8_e5m2fnuz", "F8_E5M2FNUZ", 8, True),
    DType("float8_e8m0fnu", "F8_E8M0", 8, True),  # MX block scales
    DType("float6_e2m3", "F6_E2M3", 6, True),  # no torch dtype: sized and planned, not loaded
    DType("float6_e3m2", "F6_E3M2", 6, True),
    DType("float4_e2m1", "F4", 4, True),
    DType("float4_e2m1fn_x2", None, 8, True),  # torch's packed pair: one byte per element
    DType("int64", "I64", 64, False),
    DType("int32", "I32", 32, False),
    DType("int16", "I16", 16, False),
    DType("int8", "I8", 8, False),
    DType("int4", "I4", 4, False),
    DType("uint64", "U64", 64, False),
    DType("uint32", "U32", 32, False),
    DType("uint16", "U16", 16, False),
    DType("uint8", "U8", 8, False),
    DType("uint4", "U4", 4, False),
    DType("bool", "BOOL", 8, False),
    DType("complex64", "C64", 64, False),
    DType("complex128", "C128", 128, False),
)
DTYPES: dict[str, DType] = {d.name: d for d in _TABLE}
"""Canonical (torch) name -> :class:`DType`."""
SAFETENSORS_CODES: dict[str, DType] = {d.code: d for d in _TABLE if d.code is not None}
"""safetensors header code (``"F32"``, ``"F8_E8M0"``) -> :class:`DType`."""
_BITS: dict[str, int] = {d.name: d.bits for d in _TABLE}
DTYPE_SIZES: dict[str, float] = {d.name: d.bits / 8 for d in _TABLE}
"""Canonical name -> bytes per element (``0.5`` for 4-bit dtypes)."""
FLOATING_DTYPES = frozenset(d.name for d in _TABLE if d.floating)
"""Canonical names of the floating dtypes (the ones a ``dtype=`` cast converts)."""

_NOT_IN_TORCH = frozenset({"float6_e2m3", "float6_e3m2", "float4_e2m1"})  # sized and planned only
_NOT_A_CAST = {  # floating dtypes torch has that a cast of weights must not target
    "float8_e8m0fnu": "holds only powers of two with no sign (MX block scales): every weight would lose its sign",
    "float4_e2m1fn_x2": "packs two 4-bit values per byte: torch cannot cast weights to it",
}
LOADABLE_DTYPES = tuple(
    d.name for d in _TABLE if d.floating and d.name not in _NOT_IN_TORCH and d.name not in _NOT_A_CAST
)
"""The dtypes a loader's ``dtype=`` may cast floating weights to (floating, with a torch dtype, and
able to hold a weight: not the unsigned scale format ``float8_e8m0fnu`` nor a packed pair)."""

# Names users and other libraries write for the same dtypes.
_ALIASES = {
    "float": "float32", "half": "float16", "double": "float64", "fp32": "float32", "fp16": "float16",
    "bf16": "bfloat16", "long": "int64", "int": "int32", "short": "int16", "fp64": "float64",
    **{code: d.name for code, d in SAFETENSORS_CODES.items()},
}  # fmt: skip


def canonical_dtype(dtype: object) -> str:
    """``"float32"`` for ``torch.float32``, ``"F32"``, ``"fp32"`` or ``"float"``.

    Raises:
        ValueError: quoting the dtype and listing the known ones.

    Example:
        >>> canonical_dtype("torch.bfloat16"), canonical_dtype("F16"), canonical_dtype("int8")
        ('bfloat16', 'float16', 'int8')
    """
    text = str(dtype).removeprefix("torch.")
    text = _ALIASES.get(text, text)
    if text not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}: use one of {', '.join(sorted(DTYPES))}")
    return text


def itemsize(dtype: object) -> float:
    """Bytes per element of a dtype (``0.5`` for 4-bit dtypes).

    Example:
        >>> itemsize("float16"), itemsize("F8_E8M0")
        (2.0, 1.0)
    """
    return DTYPE_SIZES[canonical_dtype(dtype)]


def bits(dtype: object) -> int:
    """Bits per element of a dtype.

    Example:
        >>> bits("bfloat16"), bits("F6_E2M3")
        (16, 6)
    """
    return DTYPES[canonical_dtype(dtype)].bits


def tensor_nbytes(dtype: object, numel: int) -> int:
    """Bytes ``numel`` elements of ``dtype`` take, sub-byte dtypes packed (rounded up).

    Example:
        >>> tensor_nbytes("float32", 10), tensor_nbytes("uint4", 5), tensor_nbytes("F6_E3M2", 4)
        (40, 3, 3)
    """
    found = _BITS.get(dtype)  # type: ignore[call-overload]  # fast path: a canonical name
    return -(-numel * (found if found is not None else bits(dtype)) // 8)


def is_floating(dtype: object) -> bool:
    """True for floating dtypes (the ones a ``dtype=`` cast converts).

    Example:
        >>> is_floating("bfloat16"), is_floating("int8"), is_floating("F8_E8M0")
        (True, False, True)
    """
    return DTYPES[canonical_dtype(dtype)].floating


def load_dtype(dtype: object, *, name: str = "dtype") -> str | None:
    """The canonical name of the dtype a loader casts floating weights to (None for None).

    One check for every loader's ``dtype=``: a floating dtype torch has, given as a
    ``torch.dtype`` or a name (``"bfloat16"``, ``"torch.float16"``, ``"fp16"``). A planner may
    size a model in ``int8`` (a what-if); a load cannot cast floating weights to it (every
    weight would become an integer, a layer of small weights all zeros).

    Raises:
        ValueError: quoting the value: not a dtype (``3``), an unknown name (``"float17"``),
            or not floating (``torch.int8``).

    Example:
        >>> load_dtype("bf16"), load_dtype(None)
        ('bfloat16', None)
        >>> load_dtype("int8")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        bigviz.core.errors.UsageError: dtype='int8' is not a floating dtype: ...
    """
    if dtype is None:
        return None
    choices = ", ".join(LOADABLE_DTYPES[:4]) + ", ..."
    if not isinstance(dtype, str) and all(c.__name__ != "dtype" for c in type(dtype).__mro__):  # torch's, numpy's
        raise UsageError(f"{name}={dtype!r} is not a dtype: give a floating dtype such as torch.bfloat16 or 'float16'")
    try:
        canonical = canonical_dtype(dtype)
    except ValueError:
        raise UsageError(f"{name}={dtype!r} is not a dtype bigviz knows: give a floating dtype ({choices})") from None
    if canonical not in LOADABLE_DTYPES:
        what = _NOT_A_CAST.get(canonical) or (
            "has no torch dtype to load into" if DTYPES[canonical].floating else "is not a floating dtype"
        )
        raise UsageError(
            f"{name}={dtype!r} {what}: a load casts every floating weight to it; give one of "
            f"{', '.join(LOADABLE_DTYPES)} (a planner sizes other dtypes as a what-if)"
        )
    return canonical


def from_safetensors(code: str) -> str:
    """The canonical name of a safetensors header code.

    Raises:
        ValueError: for a code safetensors does not define.

    Example:
        >>> from_safetensors("BF16"), from_safetensors("F8_E4M3")
        ('bfloat16', 'float8_e4m3fn')
    """
    found = SAFETENSORS_CODES.get(code)
    if found is None:
        raise UsageError(f"unknown safetensors dtype {code!r}: one of {', '.join(SAFETENSORS_CODES)}")
    return found.name


def to_safetensors(dtype: object) -> str | None:
    """The safetensors header code of a dtype (None: safetensors cannot store it).

    Example:
        >>> to_safetensors("torch.float8_e8m0fnu"), to_safetensors("float32")
        ('F8_E8M0', 'F32')
    """
    return DTYPES[canonical_dtype(dtype)].code
