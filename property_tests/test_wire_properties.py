"""Each wire codec's round trip stays within its analytic bound ([Note: wire formats]).

Hypothesis draws values (magnitudes from 1e-30 to 1e30, zeros, blocks of one sign, a lone large
value among small ones), a block size and a codec; every element's error after encode and decode is
at most :func:`~zeroplan.core.wire.round_trip_bound` for its block's scale (plus the rounding of the
fp32 division and multiplication by the scale: a few ulps of fp32).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zeroplan.core.wire import WireCodec, WireFormat, gather_room, round_trip_bound, wire_bytes
from zeroplan.facade.mechanisms.wire_codec import decode, decode_piece, encode, encode_piece, wire_dtype

pytestmark = pytest.mark.property


@given(
    seed=st.integers(0, 2**32 - 1),
    numel=st.integers(1, 700),
    exponent=st.integers(-30, 30),
    outliers=st.sampled_from([0, 1, 5]),
    zeros=st.floats(0.0, 0.5),
    fmt=st.sampled_from([WireFormat.INT8, WireFormat.FP8, WireFormat.BF16, WireFormat.FP32]),
    block=st.sampled_from([1, 2, 16, 128, 256]),
)
def test_round_trip_error_is_within_half_a_quantum(seed, numel, exponent, outliers, zeros, fmt, block):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * 10.0**exponent
    x[torch.rand(numel, generator=g) < zeros] = 0.0
    if outliers:  # a few large values among small ones: the rest of their block is coarse
        x[torch.randint(numel, (outliers,), generator=g)] *= 1e4
    codec = WireCodec(fmt, block=block)
    encoded = encode(x, codec)
    back = decode(encoded, codec, x.numel())
    assert back.dtype == torch.float32 and back.shape == x.shape
    padded = torch.cat([x, x.new_zeros(-x.numel() % block)]).view(-1, block)
    scales = (
        padded.abs().amax(dim=1).double() / (codec.largest if fmt.blockwise else 1.0)
    ).repeat_interleave(block)
    for i, (v, b) in enumerate(zip(x.double().tolist(), back.double().tolist(), strict=True)):
        bound = round_trip_bound(codec, v, scales[i].item())
        slack = 4 * 2**-24 * (abs(v) + scales[i].item() * (codec.largest if fmt.blockwise else 0.0))
        assert abs(b - v) <= bound + slack, (i, v, b, bound, codec)
    payload_bytes = encoded.payload.numel() * encoded.payload.element_size()
    scale_bytes = 0 if encoded.scales is None else encoded.scales.numel() * 4
    assert payload_bytes + scale_bytes == wire_bytes(codec, x.numel(), "float32")


def test_an_all_zero_block_decodes_to_zeros():
    for fmt in (WireFormat.INT8, WireFormat.FP8):
        codec = WireCodec(fmt, block=4)
        x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -2.0, 0.5, 0.0])
        assert torch.equal(decode(encode(x, codec), codec, 8)[:4], torch.zeros(4))


def test_a_non_finite_value_makes_its_whole_block_non_finite():
    """An fp16 overflow must reach the loss scaler's check: it is never rounded into a finite value."""
    for fmt in (WireFormat.INT8, WireFormat.FP8):
        codec = WireCodec(fmt, block=4)
        for bad in (float("inf"), float("nan")):
            x = torch.tensor([1.0, bad, 0.5, 0.0, 1.0, 2.0, 3.0, 4.0])
            back = decode(encode(x, codec), codec, 8)
            assert not torch.isfinite(back[:4]).any(), (fmt, bad, back)
            assert torch.isfinite(back[4:]).all()


@given(
    seed=st.integers(0, 2**32 - 1),
    pieces=st.lists(st.integers(0, 300), min_size=1, max_size=5),
    fmt=st.sampled_from([WireFormat.INT8, WireFormat.FP8, WireFormat.BF16]),
    block=st.sampled_from([1, 4, 16]),
    chunk_blocks=st.integers(1, 5),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
)
def test_a_gather_room_encodes_each_piece_as_a_whole_encoding_would(
    seed, pieces, fmt, block, chunk_blocks, dtype
):
    """A parameter gather's slots are disjoint, consecutive and aligned for their scales, and a piece
    encoded and decoded chunk by chunk through the scratch ends in the bits of a whole encoding."""
    codec = WireCodec(fmt, block=block)
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    room = gather_room(codec, tuple(pieces), name)
    at = 0
    for q, numel in enumerate(pieces):
        slot = room.slot(q)
        assert slot.start == at and (room.scales[q].numel == 0 or room.scales[q].start % 4 == 0)
        assert room.payloads[q].numel == numel * codec.element_bytes(name)
        at = slot.stop
    assert room.nbytes == at and room.slots.numel == at
    g = torch.Generator().manual_seed(seed)
    chunk = block * chunk_blocks  # small chunks: several per piece
    raw = torch.empty(room.nbytes, dtype=torch.uint8)
    for q, numel in enumerate(pieces):
        x = (torch.randn(numel, generator=g) * 3).to(dtype)
        payload = raw[room.payloads[q].as_slice()].view(wire_dtype(codec))
        scales = raw[room.scales[q].as_slice()].view(torch.float32) if fmt.blockwise else None
        scratch = torch.empty(min(chunk, numel), dtype=torch.float32)
        encode_piece(x, codec, payload, scales, scratch, chunk)
        out = torch.empty_like(x)
        decode_piece(payload, scales, codec, out, scratch, chunk)
        whole = decode(encode(x.float(), codec), codec, numel).to(dtype)
        assert torch.equal(out.view(torch.uint8), whole.view(torch.uint8))
