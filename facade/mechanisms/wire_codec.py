"""Encoding a tensor for the wire and back ([Note: wire formats] in ``zeroplan.core.wire``).

The arithmetic of each codec, on any device: blockwise int8 and fp8 (e4m3)
scale each block of ``codec.block`` elements so its largest magnitude maps to
the format's largest value, round to nearest, and multiply back on receipt;
bf16 and fp32 are casts. The receiver always gets fp32, to accumulate in.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from zeroplan.core import ShardPiece
from zeroplan.core.wire import WireCodec, WireFormat, wire_chunk

__all__ = [
    "Encoded",
    "PublishedPieces",
    "decode",
    "decode_into",
    "decode_piece",
    "decode_slots",
    "encode",
    "encode_into",
    "encode_piece",
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
        # Divided by a tensor, not a number: CUDA divides by a number as a multiplication by its
        # reciprocal, whose rounding differs from the CPU's (a scale one ulp apart).
        torch.maximum(low.abs_(), high.abs_(), out=row_scales).div_(torch.full_like(low, codec.largest))
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


def encode_piece(
    x: torch.Tensor,
    codec: WireCodec,
    payload: torch.Tensor,
    scales: torch.Tensor,
    scratch: torch.Tensor,
    chunk: int,
) -> None:
    """:func:`encode_into` of ``x`` (one piece: blocks from its first element) ``chunk`` elements at a
    time through ``scratch`` (fp32, at least ``min(chunk, x.numel())``); a cast when unscaled."""
    if not codec.format.blockwise:
        payload.copy_(x.reshape(-1))
        return
    flat, per_chunk = x.reshape(-1), chunk // codec.block
    for i, at in enumerate(range(0, flat.numel(), chunk)):
        part = flat[at : at + chunk]
        first = i * per_chunk
        blocks = scales[first : first + -(-part.numel() // codec.block)]
        encode_into(part, codec, payload[at : at + part.numel()], blocks, scratch[: part.numel()])


def decode_piece(
    payload: torch.Tensor,
    scales: torch.Tensor,
    codec: WireCodec,
    out: torch.Tensor,
    scratch: torch.Tensor,
    chunk: int,
) -> None:
    """:func:`encode_piece` undone into ``out`` (any float dtype: the decoded fp32 values are cast),
    ``chunk`` elements at a time through ``scratch``; a cast when unscaled."""
    flat = out.reshape(-1)
    if not codec.format.blockwise:
        flat.copy_(payload)
        return
    per_chunk = chunk // codec.block
    for i, at in enumerate(range(0, flat.numel(), chunk)):
        part = flat[at : at + chunk]
        first = i * per_chunk
        blocks = scales[first : first + -(-part.numel() // codec.block)]
        values = part if part.dtype == torch.float32 else scratch[: part.numel()]
        decode_into(payload[at : at + part.numel()], blocks, codec, values)
        if values is not part:
            part.copy_(values)


def round_trip(x: torch.Tensor, codec: WireCodec) -> torch.Tensor:
    """``x`` (one piece, flat) encoded and decoded as a parameter gather does, in ``x``'s dtype."""
    chunk = wire_chunk(codec)
    if not codec.format.blockwise:
        return x.to(_DTYPES[codec.format]).to(x.dtype)
    payload = torch.empty(x.numel(), dtype=_DTYPES[codec.format], device=x.device)
    scales = torch.empty(-(-x.numel() // codec.block), dtype=torch.float32, device=x.device)
    scratch = torch.empty(min(chunk, x.numel()), dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    encode_piece(x, codec, payload, scales, scratch, chunk)
    decode_piece(payload, scales, codec, out, scratch, chunk)
    return out


_BITS = {2: torch.int16, 4: torch.int32}


class PublishedPieces(NamedTuple):
    """A rank's pieces of a space as its parameter gathers encode them ([Note: wire formats]): each
    gather block's piece is encoded on its own, blocks of the codec from its first element.

    Every rank holds the decoded values, the owner too, so a parameter no longer equals the cast of
    its master; :meth:`take_written` tells a user's write from the wire's rounding.
    """

    codec: WireCodec
    pieces: tuple[ShardPiece, ...]

    def take_written(self, values: torch.Tensor, held: torch.Tensor) -> None:
        """Where ``held`` (a piece of the parameters) differs, as bits, from what ``values`` (its
        master or shard) publishes as, ``values`` takes ``held``'s value; the rest keep theirs.

        Compared a chunk of whole blocks at a time: temporaries stay small.
        """
        bits = _BITS[held.element_size()]
        chunk = wire_chunk(self.codec)
        for at in range(0, held.numel(), chunk):
            mine, theirs = values[at : at + chunk], held[at : at + chunk]
            written = round_trip(mine.to(held.dtype), self.codec).view(bits) != theirs.view(bits)
            mine.copy_(torch.where(written, theirs.to(mine.dtype), mine))
