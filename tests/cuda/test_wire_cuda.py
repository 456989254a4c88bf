"""The wire codecs on a GPU ([Note: wire formats]): the CUDA kernels encode and decode to the same bits
as the CPU, chunk by chunk through a gather's scratch, and a block with an infinity stays non-finite.
Skipped without a GPU; the CPU suite never depends on it.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from zeroplan.core.wire import WireCodec, WireFormat, gather_room  # noqa: E402
from zeroplan.facade.mechanisms.wire_codec import decode_piece, encode_piece, round_trip, wire_dtype  # noqa: E402


def _through_room(x: torch.Tensor, codec: WireCodec, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` encoded into a room's slot and decoded back, on ``x``'s device: (slot bytes, decoded)."""
    room = gather_room(codec, (x.numel(),), "bfloat16" if x.dtype == torch.bfloat16 else "float32")
    raw = torch.zeros(room.nbytes, dtype=torch.uint8, device=x.device)
    payload = raw[room.payloads[0].as_slice()].view(wire_dtype(codec))
    scales = raw[room.scales[0].as_slice()].view(torch.float32) if codec.format.blockwise else None
    scratch = torch.empty(min(chunk, x.numel()), dtype=torch.float32, device=x.device)
    encode_piece(x, codec, payload, scales, scratch, chunk)
    out = torch.empty_like(x)
    decode_piece(payload, scales, codec, out, scratch, chunk)
    return raw, out


@pytest.mark.parametrize("fmt", [WireFormat.INT8, WireFormat.FP8, WireFormat.BF16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("numel", [1, 127, 4096, 200_003])
def test_cuda_encodes_and_decodes_the_bits_the_cpu_does(fmt, dtype, numel):
    g = torch.Generator().manual_seed(numel)
    x = (torch.randn(numel, generator=g) * torch.logspace(-3, 3, numel)).to(dtype)
    codec = WireCodec(fmt, block=128)
    chunk = 128 * 64
    cpu_raw, cpu_out = _through_room(x, codec, chunk)
    gpu_raw, gpu_out = _through_room(x.cuda(), codec, chunk)
    assert torch.equal(gpu_raw.cpu(), cpu_raw)
    assert torch.equal(gpu_out.cpu().view(torch.uint8), cpu_out.view(torch.uint8))
    assert torch.equal(round_trip(x.cuda(), codec).cpu().view(torch.uint8), cpu_out.view(torch.uint8))


def test_an_infinity_makes_its_block_non_finite_on_the_gpu():
    x = torch.ones(256, device="cuda")
    x[5] = float("inf")
    _, out = _through_room(x, WireCodec(WireFormat.INT8, block=128), 1024)
    assert not out[:128].isfinite().all() and out[128:].isfinite().all()
