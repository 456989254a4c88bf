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

from zeroplan.core.wire import WireCodec, WireFormat, round_trip_bound, wire_bytes
from zeroplan.facade.runtime.wire_codec import decode, encode

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
