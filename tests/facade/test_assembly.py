"""``Assembly``: a flat file tensor copied once from views of live state ([Note: assembled file tensors])."""

from __future__ import annotations

import torch

from zeroplan.core import Span
from zeroplan.facade.mechanisms.assembly import Assembly, materialize


def _assembly() -> tuple[Assembly, torch.Tensor]:
    live = torch.arange(20, dtype=torch.float32)
    parts = ((Span(6, 9), live[10:13]), (Span(1, 4), live[0:3]))  # out of order, gaps at 0, 4-5, 9-11
    expected = torch.zeros(12)
    expected[6:9], expected[1:4] = live[10:13], live[0:3]
    return Assembly(12, torch.float32, live.device, parts), expected


def test_into_a_reused_buffer_zeroes_what_no_view_covers():
    assembly, expected = _assembly()
    stale = torch.full((12,), float("nan"))
    out = assembly.into(stale)
    assert out is stale
    assert torch.equal(out, expected)
    assert torch.equal(assembly.into(), expected)


def test_into_copies_the_views_at_call_time():
    assembly, expected = _assembly()
    taken = assembly.into()
    assembly.parts[0][1].add_(100)  # live state moves on; the taken copy does not
    assert torch.equal(taken, expected)
    assert not torch.equal(assembly.into(), expected)


def test_materialize_leaves_tensors_and_copies_assemblies():
    assembly, expected = _assembly()
    whole = torch.ones(3)
    out = materialize({"a": assembly, "b": whole})
    assert out["b"] is whole and torch.equal(out["a"], expected)
    assert Assembly(0, torch.float32, whole.device, ()).into().shape == (0,)
