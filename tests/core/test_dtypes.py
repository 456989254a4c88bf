"""Dtype names, sizes and master dtypes."""

from __future__ import annotations

import pytest

from zeroplan.core import ConfigError, canonical_dtype, itemsize, master_dtype


@pytest.mark.parametrize(
    ("name", "canonical", "size"),
    [
        ("fp32", "float32", 4),
        ("float", "float32", 4),
        ("torch.float32", "float32", 4),
        ("FLOAT32", "float32", 4),
        ("bf16", "bfloat16", 2),
        ("torch.bfloat16", "bfloat16", 2),
        ("fp16", "float16", 2),
        ("half", "float16", 2),
        ("double", "float64", 8),
        ("fp64", "float64", 8),
    ],
)
def test_aliases(name, canonical, size):
    assert canonical_dtype(name) == canonical
    assert itemsize(name) == size


@pytest.mark.parametrize(
    ("dtype", "master"),
    [("bf16", "float32"), ("fp16", "float32"), ("fp32", "float32"), ("float64", "float64")],
)
def test_master_dtype(dtype, master):
    assert master_dtype(dtype) == master


@pytest.mark.parametrize("bad", ["int8", "torch.int64", "fp8", "", "complex64"])
def test_unknown_dtype_is_a_config_error_naming_it_and_the_choices(bad):
    with pytest.raises(ConfigError) as info:
        canonical_dtype(bad)
    message = str(info.value)
    assert repr(bad) in message
    assert "bf16" in message and "float32" in message


def test_itemsize_and_master_dtype_reject_unknown_dtypes():
    with pytest.raises(ConfigError, match="'int8'"):
        itemsize("int8")
    with pytest.raises(ConfigError, match="'uint8'"):
        master_dtype("uint8")
