"""A partial offload ([Note: kept on the device] in ``core/residence.py``), for any parameters, shard
size, stage, layout and fraction:

* each rank keeps a prefix of each space's shard, ending at one of its bucket pieces' starts (or the
  extent), the nearest to ``1 - fraction`` of it; an optimizer of whole parameters cuts none;
* the kept and host buffers of each role add up to the full offload's, and the report's totals are
  the full offload's, its host bytes never more;
* the inner tensors stepped on the device and those of the host units are all of them, once each;
* what crosses the host link is the full offload's less the kept bucket pieces.
"""

from __future__ import annotations

from hypothesis import event, given
from hypothesis import strategies as st

from property_tests.strategies import alignments, bucket_caps, param_specs
from zeroplan.core import (
    BufferRole,
    ConfigError,
    Topology,
    host_link,
    kept_tensors,
    memory_report,
    plan,
    step_units,
)
from zeroplan.core.allocation import allocation
from zeroplan.core.arena import grad_shard_dtype
from zeroplan.core.dtypes import DTYPE_ITEMSIZE

R = BufferRole


@given(
    specs=param_specs(min_size=1, max_size=6, many=False),
    shard_size=st.integers(1, 5),
    stage=st.sampled_from([1, 2, 3]),
    layout=st.sampled_from(["auto", "rank_major", "interleaved"]),
    fraction=st.floats(0.05, 1.0),
    alignment=alignments,
    bucket_bytes=bucket_caps,
    optimizer=st.sampled_from(["AdamW", "Adafactor"]),
)
def test_a_partial_offload_splits_each_shard_at_a_bucket_edge(
    specs, shard_size, stage, layout, fraction, alignment, bucket_bytes, optimizer
):
    settings = {
        "stage": stage,
        "layout": layout,
        "alignment": alignment,
        "bucket_bytes": bucket_bytes,
        "optimizer": optimizer,
        "offload": "optimizer",
    }
    try:
        whole = plan(specs, Topology(world_size=shard_size), **settings)
    except ConfigError as exc:  # e.g. a layout or strategy the parameters do not allow
        event(f"refused: {str(exc)[:40]}")
        return
    zp = plan(specs, Topology(world_size=shard_size), offload_fraction=fraction, **settings)
    event(f"stage {stage}, {zp.partition.layout}, {'elementwise' if zp.elementwise else 'whole'}")
    full_report, report = memory_report(whole), memory_report(zp)
    for r in range(shard_size):
        tensors = zp.inner_tensors(r)
        for space in zp.partition.spaces:
            extent, kept = space.extent(r), zp.kept_numel(space.index, r)
            edges = [start for start, _, _ in zp.bucket_pieces(space.index, r)] + [extent]
            if not zp.elementwise:
                frags = [(f.shard_offset, f.shard_offset + f.param_span.numel) for f in space.by_rank[r]]
                edges = [e for e in edges if not any(a < e < b for a, b in frags)]
            assert kept in edges
            target = (1 - fraction) * extent
            assert abs(kept - target) == min(abs(e - target) for e in edges)
        for before, after in zip(allocation(whole, r).spaces, allocation(zp, r).spaces, strict=True):
            for role, kept_role in ((R.GRAD_SHARD, R.KEPT_GRAD_SHARD), (R.MASTER, R.KEPT_MASTER)):
                split = after[role].numel + (after.get(kept_role).numel if after.get(kept_role) else 0)
                assert split == before[role].numel
        on_device = set(kept_tensors(zp, r, tensors))
        on_host = [t for unit in step_units(zp, r, tensors) for t in unit.tensors]
        assert on_device.isdisjoint(on_host) and sorted([*on_device, *on_host]) == list(range(len(tensors)))
        kept_bytes = 0
        for bucket in zp.buckets.buckets:
            piece = bucket.piece_of(r)
            if piece is not None and piece.shard_span.stop <= zp.kept_numel(bucket.space, r):
                space = zp.partition.spaces[bucket.space]
                kept_bytes += piece.shard_span.numel * DTYPE_ITEMSIZE[grad_shard_dtype(zp, space)]
        assert host_link(zp, r).to_host == host_link(whole, r).to_host - kept_bytes
    for a, b in zip(full_report.ranks, report.ranks, strict=True):
        assert b.total_bytes == a.total_bytes and b.host_bytes <= a.host_bytes
        assert b.host_bytes + b.device_bytes == b.total_bytes
