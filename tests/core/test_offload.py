"""CPU offload, planned ([Note: offload, planned] in ``core/offload.py``): the placement of each mode,
the host buffers it adds, the device and host bytes, the bytes over the host link, the refusals."""

from __future__ import annotations

import pytest

from zeroplan.core import (
    BufferRole,
    ConfigError,
    HostLink,
    Offload,
    Residence,
    Residences,
    StepOptions,
    Topology,
    host_link,
    memory_report,
    offload_residences,
    plan,
)
from zeroplan.core import specs_from_shapes as shapes
from zeroplan.core.allocation import allocation
from zeroplan.core.sizing.fit import fit_report

R = BufferRole
ODD_SHAPES = [(17, 257), (3,), (1000, 7), (31,), (257, 17)]
OPTIMIZER_ROLES = {R.GRAD_SHARD, R.MASTER, R.OPTIMIZER_STATE}


def _plan(stage=2, dtype="bf16", offload=None, sizes=ODD_SHAPES, world=4, **kwargs):
    return plan(
        shapes(sizes, dtype=dtype), Topology(world_size=world), stage=stage, offload=offload, **kwargs
    )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_offload_places_masters_state_and_gradient_shard_in_host_memory(stage):
    assert set(offload_residences("optimizer", stage).host) == OPTIMIZER_ROLES
    assert set(offload_residences(Offload.ALL, 3).host) == OPTIMIZER_ROLES | {R.PARAM_SHARD}
    assert offload_residences("none", stage) == Residences() == offload_residences(None, stage)
    assert _plan(stage, offload="optimizer").residences == offload_residences("optimizer", stage)


def test_no_offload_keeps_the_plan_and_its_report():
    default, none = _plan(), _plan(offload="none")
    assert none == default and none.fingerprint() == default.fingerprint()
    assert memory_report(none).as_dict() == memory_report(default).as_dict()
    assert "host_link" not in memory_report(default).as_dict()["ranks"][0]
    assert default.split_views() == () and host_link(default, 0) == HostLink()


@pytest.mark.parametrize(
    ("stage", "dtype", "layout"),
    [
        (1, "bf16", "rank_major"),
        (1, "float32", "rank_major"),
        (2, "bf16", "auto"),
        (2, "float32", "auto"),
        (3, "bf16", "auto"),
        (3, "float32", "auto"),
    ],
)
def test_host_bytes_are_the_masters_state_and_gradient_shard_and_leave_the_device(stage, dtype, layout):
    zp = _plan(stage, dtype, "optimizer", layout=layout)
    base = memory_report(_plan(stage, dtype, layout=layout)).ranks
    for before, after in zip(base, memory_report(zp).ranks, strict=True):
        grad_shard = allocation(zp, after.shard_rank).spaces[0][R.GRAD_SHARD].nbytes
        assert after.host_bytes == after.master_bytes + after.optimizer_state_bytes + grad_shard > 0
        assert after.device_bytes == after.total_bytes - after.host_bytes
        added = after.total_bytes - before.total_bytes  # views that became buffers of their own
        # The reduced piece lands in staging room before it goes to host memory ([Note: offload,
        # executed]): new room where the gradients were not already reduced into room to be cast.
        staged = after.buffer_bytes - before.buffer_bytes
        split = allocation(zp, after.shard_rank).spaces[0]
        assert added - staged == sum(split[role].nbytes for role in zp.split_views())  # bf16 2-3: 0
        assert (staged > 0) == (stage == 1 or dtype == "float32")
        assert before.device_bytes - after.device_bytes == after.host_bytes - added


def test_views_placed_apart_get_host_buffers_of_their_own():
    fp32 = _plan(2, "float32", "optimizer")
    assert fp32.split_views() == (R.MASTER,)
    master = allocation(fp32, 0).spaces[0][R.MASTER]
    assert master.view_of is None and master.residence is Residence.HOST
    assert master.numel == fp32.partition.spaces[0].shard_numel[0]
    stage1 = _plan(1, "bf16", "optimizer", layout="rank_major")
    assert stage1.split_views() == (R.GRAD_SHARD,)
    shard = allocation(stage1, 0).spaces[0][R.GRAD_SHARD]
    assert (shard.view_of, shard.dtype, shard.residence) == (None, "float32", Residence.HOST)
    # reduced straight into fp32 in host memory: no fp32 copy at the step
    assert (
        memory_report(stage1).ranks[0].step_transient_bytes
        < memory_report(_plan(1, "bf16", layout="rank_major")).ranks[0].step_transient_bytes
    )
    assert _plan(3, "float32", "all").split_views() == ()  # the shard is its master, both on the host


def test_host_link_bytes_equal_a_hand_computation():
    # 64 + 32 bf16 elements over 2 ranks, alignment 8: each rank's shard is 48 elements, one bucket.
    zp = _plan(2, "bf16", "optimizer", sizes=[(64,), (32,)], world=2, alignment=8)
    assert zp.partition.spaces[0].shard_numel == (48, 48)
    assert host_link(zp, 1) == HostLink(
        to_host=48 * 4, to_device=48 * 2, to_host_copies=1, to_device_copies=1
    )
    rank = memory_report(zp).ranks[1]
    assert rank.host_link == host_link(zp, 1)
    assert rank.host_bytes == 48 * 4 + 48 * 4 + rank.optimizer_state_bytes  # grad shard, master, state
    assert rank.as_dict()["host_link"] == {"to_host": 192, "to_device": 96, "to_host_copies": 1,
                                           "to_device_copies": 1}  # fmt: skip
    # offload all at stage 3: the shard goes up before the forward and again before the backward.
    zp3 = _plan(3, "bf16", "all", sizes=[(64,), (32,)], world=2, alignment=8)
    blocks = sum(1 for space in zp3.partition.spaces for _ in zp3.gather_blocks(space))
    assert host_link(zp3, 0) == HostLink(192, 2 * 48 * 2, 1, 2 * blocks)
    once = _plan(3, "bf16", "all", sizes=[(64,), (32,)], world=2, alignment=8,
                 options=StepOptions(reshard_after_forward=False))  # fmt: skip
    assert host_link(once, 0) == HostLink(192, 48 * 2, 1, blocks)
    # offload optimizer at stage 3: the updated shard goes up once, after the step.
    assert host_link(_plan(3, "bf16", "optimizer", sizes=[(64,), (32,)], world=2, alignment=8), 0) == (
        HostLink(192, 96, 1, 1)
    )


def test_the_device_peak_leaves_out_host_roles_and_the_host_step():
    off = memory_report(_plan(2, "bf16", "optimizer")).ranks[0]
    assert off.step_on_host
    assert off.device_peak_bytes == off.device_bytes + off.backward_transient_bytes
    assert off.host_peak_bytes == off.host_bytes + off.step_transient_bytes
    assert off.peak_bytes == off.total_bytes + max(off.backward_transient_bytes, off.step_transient_bytes)
    base = memory_report(_plan(2, "bf16")).ranks[0]
    assert base.device_peak_bytes == base.peak_bytes and base.host_peak_bytes == 0
    fit = fit_report(memory_report(_plan(2, "bf16", "optimizer")), activation_bytes=0, device_bytes=2**40)
    assert fit.worst.need_bytes == off.device_peak_bytes


@pytest.mark.parametrize(
    ("stage", "mode", "message"),
    [
        (0, "optimizer", "needs stage 1, 2 or 3"),
        (2, "all", "offload='all' needs stage 3"),
        (1, "all", "offload='all' needs stage 3"),
        (2, "cpu", "'cpu' is not an offload mode"),
    ],
)
def test_combinations_that_cannot_work_are_refused(stage, mode, message):
    with pytest.raises(ConfigError, match=message):
        _plan(stage, offload=mode)


def test_offload_and_residences_are_one_placement():
    with pytest.raises(ConfigError, match="not both"):
        _plan(2, offload="optimizer", residences=Residences(host=("master", "optimizer_state")))


@pytest.mark.parametrize("stage", [1, 2])
def test_a_parameter_wire_over_fp32_parameters_is_refused_with_offload_too(stage):
    """Offloaded fp32 parameters get host masters, but checkpoints and re-plans read the parameters
    (their own master at stages 1-2): under a lossy wire they would hold the decoded values."""
    for offload in (None, "optimizer"):
        with pytest.raises(ConfigError, match="are their own master"):
            _plan(stage, dtype="fp32", offload=offload, param_wire="int8")
    assert _plan(stage, dtype="bf16", offload="optimizer", param_wire="int8").param_wire is not None
    assert _plan(3, dtype="fp32", offload="optimizer", param_wire="int8").param_wire is not None
