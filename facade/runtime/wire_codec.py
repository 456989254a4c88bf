"""Encoding a tensor for the wire and back ([Note: wire formats] in ``zeroplan.core.wire``).

The arithmetic of each codec, on any device: blockwise int8 and fp8 (e4m3)
scale each block of ``codec.block`` elements so its largest magnitude maps to
the format's largest value, round to nearest, and multiply back on receipt;
bf16 and fp32 are casts. The receiver always gets fp32, to accumulate in.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from zeroplan.core.wire import WireCodec, WireFormat

__all__ = ["Encoded", "decode", "encode"]

_DTYPES = {WireFormat.FP32: torch.float32, WireFormat.BF16: torch.bfloat16, WireFormat.INT8: torch.int8}


class Encoded(NamedTuple):
    """A tensor on the wire: its elements, and one fp32 scale per block (``None`` unscaled)."""

    payload: torch.Tensor
    scales: torch.Tensor | None


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (flat) as rows of ``block`` elements, the last padded with zeros."""
    flat = x.reshape(-1)
    tail = -flat.numel() % block
    if tail:
        flat = torch.cat([flat, flat.new_zeros(tail)])
    return flat.view(-1, block)


def encode(x: torch.Tensor, codec: WireCodec) -> Encoded:
    """``x`` (any float dtype, flat or not) encoded by ``codec`` (``param``: as it is)."""
    fmt = codec.format
    if fmt is WireFormat.PARAM:
        return Encoded(x.reshape(-1), None)
    if not fmt.blockwise:
        return Encoded(x.reshape(-1).to(_DTYPES[fmt]), None)
    rows = _blocks(x.float(), codec.block)
    scales = rows.abs().amax(dim=1) / codec.largest
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block stays zero
    scaled = rows / scales[:, None]
    if fmt is WireFormat.INT8:
        payload = scaled.round_().clamp_(-codec.largest, codec.largest).to(torch.int8)
    else:
        payload = scaled.clamp_(-codec.largest, codec.largest).to(torch.float8_e4m3fn)
    return Encoded(payload.reshape(-1)[: x.numel()], scales)


def decode(encoded: Encoded, codec: WireCodec, numel: int) -> torch.Tensor:
    """The fp32 values of ``encoded`` (``numel`` elements): what the receiver accumulates."""
    payload, scales = encoded
    if scales is None:
        return payload.float()
    rows = _blocks(payload.float(), codec.block)
    return (rows * scales[:, None]).reshape(-1)[:numel]
