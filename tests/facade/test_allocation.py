"""The facade allocates exactly the allocation plan ([Note: allocation plan] in ``core/allocation.py``).

``build_flat_buffers`` / ``build_block_buffers`` need no process group, so every shard rank of a world-4
plan is built here, in-process, and each tensor is checked against its planned buffer: elements,
dtype, and either storage of its own of the planned bytes or a view of the planned buffer at the
planned offset. ``memory_report`` sums the same value, so the report's parameter, gradient and master
bytes are what the facade holds (the MemTracker tests measure the rest of the step).
"""

from __future__ import annotations

import pytest
import torch

from zeroplan.core import Topology, memory_report, plan, specs_from_shapes
from zeroplan.core.allocation import BufferRole, allocation
from zeroplan.facade.params.buffers import BlockBuffers, FlatBuffers, build_block_buffers, build_flat_buffers

SHAPES = [(37, 16), (16,), (64, 9), (9,), (5,)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _tensors(buf: FlatBuffers | BlockBuffers) -> dict[BufferRole, torch.Tensor | None]:
    if isinstance(buf, BlockBuffers):
        return {
            BufferRole.PARAM_SHARD: buf.shard,
            BufferRole.MASTER: buf.master,
            BufferRole.GRAD_SHARD: buf.grad_shard,
        }
    return {
        BufferRole.FULL_PARAMS: buf.params,
        BufferRole.FULL_GRADS: buf.grads,
        BufferRole.GRAD_SHARD: buf.grad_shard,
        BufferRole.MASTER: buf.master,
    }


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize(
    ("stage", "layout"),
    [(1, "rank_major"), (1, "interleaved"), (2, "rank_major"), (2, "interleaved"), (3, "auto")],
)
def test_the_buffers_are_the_allocation_plan(stage, layout, dtype):
    specs = specs_from_shapes(SHAPES, dtype=dtype)
    zp = plan(specs, Topology(world_size=4), stage=stage, layout=layout, alignment=8, bucket_bytes=1024)
    report = memory_report(zp)
    for rank in range(4):
        params = [torch.nn.Parameter(torch.randn(s).to(DTYPES[dtype])) for s in SHAPES]
        build = build_block_buffers if stage == 3 else build_flat_buffers
        buffers = build(zp, params, rank, torch.device("cpu"))
        planned = allocation(zp, rank)
        for buf, space in zip(buffers, planned.spaces, strict=True):
            tensors = _tensors(buf)
            assert set(tensors) >= {spec.role for spec in space.buffers if spec.role is not BufferRole.BLOCK}
            for role, tensor in tensors.items():
                spec = space.get(role)
                if spec is None:
                    assert tensor is None, role
                    continue
                assert tensor is not None and tensor.numel() == spec.numel, (role, spec)
                assert str(tensor.dtype).removeprefix("torch.") == spec.dtype, (role, spec)
                if spec.view_of is None:
                    assert tensor.untyped_storage().nbytes() == spec.nbytes, (role, spec)
                    assert tensor.storage_offset() == 0
                else:
                    parent = tensors[spec.view_of]
                    assert tensor.untyped_storage().data_ptr() == parent.untyped_storage().data_ptr()
                    assert tensor.storage_offset() == spec.span.start, (role, spec)
            if isinstance(buf, BlockBuffers):
                assert [b.numel() for b in buf.blocks] == [s.numel for s in space.blocks]
                assert all(b.untyped_storage().nbytes() == 0 for b in buf.blocks)  # built sharded
        r = report.ranks[rank]
        held = planned.persistent_bytes(BufferRole.FULL_PARAMS, BufferRole.PARAM_SHARD)
        assert r.params_bytes == held
        assert r.grads_bytes == planned.persistent_bytes(BufferRole.FULL_GRADS, BufferRole.GRAD_SHARD)
        assert r.master_bytes == planned.persistent_bytes(BufferRole.MASTER)
