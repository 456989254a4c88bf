"""A partial offload, planned ([Note: kept on the device] in ``core/residence.py``): the split the plan
chooses, the buffers and bytes on each side, the host link, the units, the refusals."""

from __future__ import annotations

import pytest

from zeroplan.core import (
    KEPT_ROLES,
    BufferRole,
    ConfigError,
    Residence,
    Residences,
    Topology,
    host_link,
    kept_tensors,
    memory_report,
    plan,
    step_units,
)
from zeroplan.core import specs_from_shapes as shapes
from zeroplan.core.allocation import allocation, held_roles
from zeroplan.core.dtypes import DTYPE_ITEMSIZE
from zeroplan.core.host_step import gather_release
from zeroplan.core.peak import kept_temporaries

R = BufferRole
SHAPES = [(64, 48), (17, 33), (96, 32), (31,), (40, 40), (128,)]
CASES = [
    (1, "bf16", "rank_major"),
    (2, "bf16", "auto"),
    (2, "float32", "rank_major"),
    (3, "bf16", "auto"),
    (3, "float32", "auto"),
]


def _plan(stage=2, dtype="bf16", fraction=None, layout="auto", world=4, **kwargs):
    return plan(
        shapes(SHAPES, dtype=dtype),
        Topology(world_size=world),
        stage=stage,
        alignment=8,
        bucket_bytes=2048,
        layout=layout,
        offload="optimizer",
        offload_fraction=fraction,
        **kwargs,
    )


@pytest.mark.parametrize(("stage", "dtype", "layout"), CASES)
@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.8])
def test_the_kept_prefix_is_the_bucket_edge_nearest_the_fraction(stage, dtype, layout, fraction):
    zp = _plan(stage, dtype, fraction, layout)
    for space in zp.partition.spaces:
        for r in range(4):
            extent = space.extent(r)
            edges = [start for start, _, _ in zp.bucket_pieces(space.index, r)] + [extent]
            kept = zp.kept_numel(space.index, r)
            assert kept in edges  # a bucket piece is kept or offloaded whole
            target = (1 - fraction) * extent
            assert abs(kept - target) == min(abs(e - target) for e in edges)
    assert _plan(stage, dtype, 1.0, layout).kept_numel(0, 0) == 0


@pytest.mark.parametrize(("stage", "dtype", "layout"), CASES)
def test_the_split_moves_bytes_from_host_to_device_and_keeps_the_total(stage, dtype, layout):
    full = memory_report(_plan(stage, dtype, None, layout)).ranks
    last_host = None
    for fraction in (1.0, 0.8, 0.5, 0.2):
        zp = _plan(stage, dtype, fraction, layout)
        ranks = memory_report(zp).ranks
        for whole, part in zip(full, ranks, strict=True):
            assert part.total_bytes == whole.total_bytes
            assert part.host_bytes + part.device_bytes == part.total_bytes
            assert part.optimizer_state_bytes == whole.optimizer_state_bytes
        host = [r.host_bytes for r in ranks]
        assert last_host is None or all(h <= g for h, g in zip(host, last_host, strict=True))
        last_host = host
        if fraction == 1.0:
            assert [r.as_dict() for r in ranks] == [r.as_dict() for r in full]


@pytest.mark.parametrize(("stage", "dtype", "layout"), CASES)
def test_kept_buffers_hold_the_prefix_on_the_device_and_the_host_buffers_the_rest(stage, dtype, layout):
    whole, zp = _plan(stage, dtype, None, layout), _plan(stage, dtype, 0.5, layout)
    assert set(KEPT_ROLES) <= set(held_roles(zp)) and not set(KEPT_ROLES) & set(held_roles(whole))
    for r in range(4):
        for before, after in zip(allocation(whole, r).spaces, allocation(zp, r).spaces, strict=True):
            kept = zp.kept_numel(after.space, r)
            for role, kept_role in ((R.GRAD_SHARD, R.KEPT_GRAD_SHARD), (R.MASTER, R.KEPT_MASTER)):
                host, device = after[role], after.get(kept_role)
                assert host.residence is Residence.HOST
                assert host.numel == before[role].numel - kept
                if kept:
                    assert device.residence is Residence.DEVICE and device.numel == kept
                    assert (device.dtype, device.view_of) == (host.dtype, None)
                else:
                    assert device is None


@pytest.mark.parametrize(("stage", "dtype", "layout"), CASES)
def test_kept_tensors_step_on_the_device_and_the_units_step_the_rest(stage, dtype, layout):
    zp = _plan(stage, dtype, 0.5, layout)
    report = memory_report(zp)
    for r in range(4):
        tensors = zp.inner_tensors(r)
        kept = set(kept_tensors(zp, r))
        units = [t for unit in step_units(zp, r) for t in unit.tensors]
        assert kept.isdisjoint(units) and sorted([*kept, *units]) == list(range(len(tensors)))
        edge = {s.index: zp.kept_numel(s.index, r) for s in zp.partition.spaces}
        assert all(
            (tensors[t].shard_span.stop <= edge[tensors[t].space]) == (t in kept) for t in range(len(tensors))
        )
        rank = report.ranks[r]
        assert rank.kept_step_transient_bytes == kept_temporaries(zp, r) > 0
        assert rank.device_peak_bytes == rank.device_bytes + max(
            rank.backward_transient_bytes, rank.kept_step_transient_bytes
        )
        assert rank.peak_bytes == rank.total_bytes + max(
            rank.backward_transient_bytes, rank.step_transient_bytes, rank.kept_step_transient_bytes
        )


@pytest.mark.parametrize(("stage", "dtype", "layout"), CASES)
def test_kept_pieces_cross_the_host_link_neither_way(stage, dtype, layout):
    zp = _plan(stage, dtype, 0.5, layout)
    spaces = zp.partition.spaces
    for r in range(4):
        down = up = copies = 0
        for bucket in zp.buckets.buckets:
            piece = bucket.piece_of(r)
            if piece is None or not piece.shard_span.numel:
                continue
            if piece.shard_span.start < zp.kept_numel(bucket.space, r):
                assert piece.shard_span.stop <= zp.kept_numel(bucket.space, r)
                continue
            down += piece.shard_span.numel * 4  # fp32 gradient shards (bf16 and fp32 parameters alike)
            up += piece.shard_span.numel * DTYPE_ITEMSIZE[spaces[bucket.space].dtype]
            copies += 1
        link = host_link(zp, r)
        assert (link.to_host, link.to_device, link.to_host_copies, link.to_device_copies) == (
            down,
            up,
            copies,
            copies,
        )
        assert link.to_host < host_link(_plan(stage, dtype, None, layout), r).to_host


@pytest.mark.parametrize(("stage", "layout"), [(1, "rank_major"), (2, "auto"), (2, "rank_major")])
def test_blocks_kept_on_every_rank_gather_before_the_first_unit(stage, layout):
    zp, whole = _plan(stage, "bf16", 0.5, layout), _plan(stage, "bf16", None, layout)
    for space in zp.partition.spaces:
        released, before = gather_release(zp, space.index), gather_release(whole, space.index)
        assert len(released) == len(before) and -1 in released
        for k, block in enumerate(zp.gather_blocks(space)):
            holders = [(r, block.piece(r).shard_span) for r, _ in block.nonempty_pieces()]
            kept = all(span.stop <= zp.kept_numel(space.index, r) for r, span in holders)
            assert (released[k] == -1) == kept
            if not kept:  # the last unit of a holder with a piece it steps on the host
                assert released[k] is not None and released[k] <= before[k]


def test_the_fraction_is_part_of_the_layout_and_the_settings():
    half, most, whole = _plan(fraction=0.5), _plan(fraction=0.8), _plan()
    assert len({half.fingerprint(), most.fingerprint(), whole.fingerprint()}) == 3
    assert _plan(fraction=1.0).fingerprint() == whole.fingerprint()
    assert half.settings()["offload_fraction"] == 0.5 and "offload_fraction" not in whole.settings()
    assert half.settings()["offload"] == "optimizer"
    assert half.residences == Residences(host=whole.residences.host, host_fraction=0.5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"offload": None, "offload_fraction": 0.5}, "needs offload='optimizer'"),
        ({"stage": 3, "offload": "all", "offload_fraction": 0.5}, "parameter shards are offloaded whole"),
        ({"offload_fraction": 0.0}, "must be a number in (0, 1]"),
        ({"offload_fraction": 1.5}, "must be a number in (0, 1]"),
        ({"offload_fraction": True}, "must be a number in (0, 1]"),
    ],
)
def test_a_fraction_that_cannot_work_is_refused(kwargs, message):
    args = {"stage": 2, "offload": "optimizer", **kwargs}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan(shapes(SHAPES), Topology(world_size=2), **args)


def test_residences_refuse_kept_roles_in_host_memory_and_a_split_without_the_optimizer_roles():
    with pytest.raises(ConfigError, match="always live on the device"):
        Residences(host=("kept_master",))
    with pytest.raises(ConfigError, match="grad_shard, master and optimizer_state"):
        Residences(host=("master", "optimizer_state"), host_fraction=0.5)
    everything = (R.PARAM_SHARD, R.GRAD_SHARD, R.MASTER, R.OPTIMIZER_STATE)
    with pytest.raises(ConfigError, match="param_shard is placed in host memory"):
        plan(
            shapes(SHAPES),
            Topology(world_size=2),
            stage=3,
            residences=Residences(host=everything, host_fraction=0.5),
        )
