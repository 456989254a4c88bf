# zeroplan.core — pure planning: no torch, no I/O.
# Dtypes are strings here; torch dtypes are translated at the facade boundary.
"""Names and sizes of the floating-point dtypes zeroplan plans for."""

from __future__ import annotations

from zeroplan.core.errors import ConfigError

__all__ = [
    "DTYPE_ITEMSIZE",
    "LOW_PRECISION",
    "canonical_dtype",
    "itemsize",
    "master_dtype",
]

#: Bytes per element of every dtype a parameter may have.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
}

#: Dtypes whose optimizer step runs on fp32 master copies.
LOW_PRECISION: frozenset[str] = frozenset({"bfloat16", "float16"})

_ALIASES: dict[str, str] = {
    "fp64": "float64",
    "double": "float64",
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}


def canonical_dtype(name: str) -> str:
    """Canonical dtype name for ``name`` (accepts ``fp32``, ``torch.bfloat16``, ...).

    Example:
        >>> canonical_dtype("bf16")
        'bfloat16'
        >>> canonical_dtype("torch.float32")
        'float32'

    Raises:
        ConfigError: ``name`` is not a supported floating-point dtype.
    """
    key = str(name).removeprefix("torch.").lower()
    key = _ALIASES.get(key, key)
    if key not in DTYPE_ITEMSIZE:
        known = ", ".join(sorted(set(DTYPE_ITEMSIZE) | set(_ALIASES)))
        raise ConfigError(f"dtype {name!r} is not supported; use one of: {known}")
    return key


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a canonical or alias name)."""
    return DTYPE_ITEMSIZE[canonical_dtype(dtype)]


def master_dtype(dtype: str) -> str:
    """Dtype in which the optimizer steps parameters of ``dtype``.

    bf16 and fp16 parameters are stepped on fp32 master copies; other dtypes
    are stepped in place.

    Example:
        >>> master_dtype("bfloat16"), master_dtype("float32")
        ('float32', 'float32')
    """
    dtype = canonical_dtype(dtype)
    return "float32" if dtype in LOW_PRECISION else dtype
