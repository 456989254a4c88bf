"""``FlatPieces``: a parameter-shaped tensor of which a rank holds flat ranges, in DCP's protocol."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from zeroplan.core import ConfigError, Span
from zeroplan.facade.mechanisms.flat_pieces import FlatPieces, flat_values


def _pieces() -> tuple[torch.Tensor, FlatPieces]:
    whole = torch.arange(24.0).reshape(2, 3, 4)
    flat = whole.reshape(-1)
    return whole, FlatPieces(
        (2, 3, 4), [(Span(2, 9), flat[2:9].clone()), (Span(13, 24), flat[13:24].clone())]
    )


def test_each_box_is_a_view_of_the_held_values_at_its_place_in_the_whole_tensor():
    whole, pieces = _pieces()
    items = pieces.__create_write_items__("w", pieces)
    chunks = pieces.__create_chunk_list__()
    assert [tuple(i.tensor_data.chunk.offsets) for i in items] == [tuple(c.offsets) for c in chunks]
    assert sum(c.sizes.numel() for c in chunks) == 7 + 11
    for item in items:
        box = pieces.__get_tensor_shard__(MetadataIndex("w", item.index.offset))
        offsets, sizes = item.tensor_data.chunk.offsets, item.tensor_data.chunk.sizes
        region = whole[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]
        assert torch.equal(box, region)
        box.fill_(-1.0)  # DCP's load writes into the box: the held values change in place
    assert all(bool((values == -1.0).all()) for _, values in pieces.parts)


def test_pieces_move_as_state_does_and_refuse_arithmetic():
    _, pieces = _pieces()
    buffer = io.BytesIO()
    torch.save({"exp_avg": pieces}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["exp_avg"]
    assert torch.equal(loaded, pieces) and torch.equal(copy.deepcopy(pieces), pieces)
    assert pieces.to(torch.bfloat16).dtype == torch.bfloat16 and pieces.shape == (2, 3, 4)
    assert torch.equal(flat_values(pieces, Span(14, 16)), torch.tensor([14.0, 15.0]))
    with pytest.raises(ConfigError, match="not among the ranges this rank holds"):
        flat_values(pieces, Span(8, 10))
    with pytest.raises(TypeError, match="this rank holds only some elements"):
        torch.add(pieces, 1)


def test_state_without_a_torch_layout_refuses_dcp_with_its_reason():
    pieces = FlatPieces((4,), [(Span(0, 4), torch.zeros(4))], refusal="low-bit state has no torch layout")
    with pytest.raises(ConfigError, match="low-bit state"):
        pieces.__create_write_items__("w", pieces)
    with pytest.raises(ConfigError, match="low-bit state"):
        pieces.__create_chunk_list__()
