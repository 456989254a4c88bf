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

__all__ = [
    "Encoded",
    "decode",
    "decode_into",
    "decode_slots",
    "encode",
    "encode_into",
    "encode_pieces",
    "wire_dtype",
]

_DTYPES = {
    WireFormat.FP32: torch.float32,
    WireFormat.BF16: torch.bfloat16,
    WireFormat.INT8: torch.int8,
    WireFormat.FP8: torch.float8_e4m3fn,
}


def wire_dtype(codec: WireCodec) -> torch.dtype:
    """The dtype of ``codec``'s elements on the wire."""
    return _DTYPES[codec.format]


def encode_into(
    x: torch.Tensor, codec: WireCodec, payload: torch.Tensor, scales: torch.Tensor, scratch: torch.Tensor
) -> None:
    """:func:`encode` into given memory: ``payload`` (``x.numel()`` wire elements), ``scales`` (one
    fp32 per started block), with ``scratch`` (``x.numel()`` fp32; may be ``x`` itself when fp32).

    Blocks start at ``x``'s first element; the last may be partial. Only per-block temporaries are
    allocated. A block holding an infinity or a NaN gets a non-finite scale, so its decoded values
    are non-finite too: an overflow is never hidden.
    """
    if not codec.format.blockwise:
        payload.copy_(x.reshape(-1))
        return
    flat = scratch.reshape(-1)
    flat.copy_(x.reshape(-1))
    for rows, row_scales in _row_groups(flat, scales, codec.block):
        low, high = torch.aminmax(rows, dim=1)
        torch.maximum(low.abs_(), high.abs_(), out=row_scales).div_(codec.largest)
        row_scales.masked_fill_(row_scales == 0, 1.0)  # an all-zero block stays zero; NaN and inf stay
        rows.div_(row_scales[:, None])
        if codec.format is WireFormat.INT8:
            rows.round_()
        rows.clamp_(-codec.largest, codec.largest)
    payload.copy_(flat)


def decode_into(payload: torch.Tensor, scales: torch.Tensor, codec: WireCodec, out: torch.Tensor) -> None:
    """:func:`decode` into ``out`` (fp32, ``payload.numel()`` elements), allocating nothing."""
    out.copy_(payload)
    if codec.format.blockwise:
        for rows, row_scales in _row_groups(out, scales, codec.block):
            rows.mul_(row_scales[:, None])


def _row_groups(
    flat: torch.Tensor, scales: torch.Tensor, block: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``flat`` as rows of ``block`` elements with their scales, then its partial last block (if any)."""
    whole = flat.numel() // block
    groups = [(flat[: whole * block].view(whole, block), scales[:whole])] if whole else []
    if flat.numel() > whole * block:
        groups.append((flat[whole * block :].view(1, -1), scales[whole : whole + 1]))
    return groups


class Encoded(NamedTuple):
    """A tensor on the wire: its elements, and one fp32 scale per block (``None`` unscaled)."""

    payload: torch.Tensor
    scales: torch.Tensor | None


def encode(x: torch.Tensor, codec: WireCodec) -> Encoded:
    """``x`` (any float dtype, flat or not) encoded by ``codec`` (``param``: as it is)."""
    fmt = codec.format
    if fmt is WireFormat.PARAM:
        return Encoded(x.reshape(-1), None)
    if not fmt.blockwise:
        return Encoded(x.reshape(-1).to(_DTYPES[fmt]), None)
    payload = torch.empty(x.numel(), dtype=_DTYPES[fmt], device=x.device)
    scales = torch.empty(-(-x.numel() // codec.block), dtype=torch.float32, device=x.device)
    encode_into(x, codec, payload, scales, torch.empty(x.numel(), dtype=torch.float32, device=x.device))
    return Encoded(payload, scales)


def decode(encoded: Encoded, codec: WireCodec, numel: int) -> torch.Tensor:
    """The fp32 values of ``encoded`` (``numel`` elements): what the receiver accumulates."""
    payload, scales = encoded
    if scales is None:
        return payload.float()
    out = torch.empty(numel, dtype=torch.float32, device=payload.device)
    decode_into(payload, scales, codec, out)
    return out


def encode_pieces(
    x: torch.Tensor,
    sizes: list[int],
    codec: WireCodec,
    payload: torch.Tensor,
    scales: torch.Tensor,
    scratch: torch.Tensor,
) -> None:
    """:func:`encode_into` of consecutive pieces of ``x`` (``sizes``), each with blocks of its own, so
    that each piece travels with its own scales."""
    if not codec.format.blockwise:
        payload.copy_(x.reshape(-1))
        return
    at = scale_at = 0
    for size in sizes:
        blocks = -(-size // codec.block)
        part = slice(at, at + size)
        encode_into(x[part], codec, payload[part], scales[scale_at : scale_at + blocks], scratch[part])
        at, scale_at = at + size, scale_at + blocks


def decode_slots(
    payload: torch.Tensor, scales: torch.Tensor, codec: WireCodec, out: torch.Tensor, slots: int
) -> None:
    """:func:`decode_into` of ``slots`` equal pieces, each with blocks of its own."""
    if not codec.format.blockwise or slots == 0:
        out.copy_(payload)
        return
    size = payload.numel() // slots
    blocks = scales.numel() // slots
    for q in range(slots):
        part = slice(q * size, (q + 1) * size)
        decode_into(payload[part], scales[q * blocks : (q + 1) * blocks], codec, out[part])
