"""Torch dtypes by name: what plans, state descriptions and checkpoint files write, read back."""

from __future__ import annotations

import torch

__all__ = ["dtype_name", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name such as ``"bfloat16"`` or ``"torch.float32"``.

    Raises:
        ValueError: not a torch dtype.
    """
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The name :func:`torch_dtype` reads back, e.g. ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
