"""Where each buffer role lives ([Note: residences] in ``core/residence.py``): the plan's placement,
its validation, the allocation plan's labels and the report's device and host bytes."""

from __future__ import annotations

import pytest

from zeroplan.core import BufferRole, ConfigError, Residence, Residences, Topology, memory_report, plan
from zeroplan.core import specs_from_shapes as shapes
from zeroplan.core.allocation import allocation, held_roles

ODD_SHAPES = [(17, 257), (3,), (1000, 7), (31,), (257, 17)]
R = BufferRole


def _plan(stage=2, dtype="bf16", host=(), **kwargs):
    return plan(
        shapes(ODD_SHAPES, dtype=dtype),
        Topology(world_size=4, shard_size=2),
        stage=stage,
        residences=Residences(host=host),
        **kwargs,
    )


def test_residences_default_to_the_device_and_read_role_names():
    assert Residences().all_on_device and Residences().host == ()
    where = Residences(host=["optimizer_state", R.MASTER, "master"])
    assert where.host == (R.MASTER, R.OPTIMIZER_STATE)  # role order, once each
    assert where.of(R.MASTER) is Residence.HOST and where.of(R.FULL_PARAMS) is Residence.DEVICE
    assert where.as_dict((R.FULL_PARAMS, R.MASTER)) == {"full_params": "device", "master": "host"}
    with pytest.raises(ConfigError, match="'masters' is not a buffer role; use one of 'full_params'"):
        Residences(host=("masters",))
    with pytest.raises(ConfigError, match="host must be a tuple of buffer roles"):
        Residences(host="master")  # type: ignore[arg-type]


def test_default_plans_keep_their_fingerprint_and_a_placement_changes_it():
    default = _plan()
    assert default.residences == Residences()
    assert default.fingerprint() == _plan(host=()).fingerprint()
    assert _plan(host=("grad_shard",)).fingerprint() != default.fingerprint()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_masters_and_their_state_in_host_memory_move_their_bytes_off_the_device(stage):
    default = memory_report(_plan(stage))
    moved = memory_report(_plan(stage, host=("master", "optimizer_state")))
    assert dict(moved.residences)["master"] == "host" and dict(default.residences)["master"] == "device"
    for before, after in zip(default.ranks, moved.ranks, strict=True):
        assert before.host_bytes == 0 and before.device_bytes == before.total_bytes
        held = after.master_bytes + after.optimizer_state_bytes
        assert held > 0 and after.host_bytes == held
        assert after.device_bytes == before.device_bytes - held
        assert (after.total_bytes, after.peak_bytes) == (before.total_bytes, before.peak_bytes)
        record = after.as_dict()
        assert (record["host_bytes"], record["device_bytes"]) == (held, after.total_bytes - held)


@pytest.mark.parametrize(
    ("stage", "role", "category"),
    [(2, "grad_shard", "grads_bytes"), (2, "staging", "buffer_bytes"), (3, "param_shard", "params_bytes")],
)
def test_one_role_in_host_memory_is_its_own_bytes(stage, role, category):
    report = memory_report(_plan(stage, host=(role,)))
    assert all(r.host_bytes == getattr(r, category) > 0 for r in report.ranks)


def test_the_allocation_plan_labels_each_buffer_and_a_view_lives_with_its_buffer():
    zp = _plan(1, dtype="float32", host=("full_params", "master", "optimizer_state"), layout="rank_major")
    for space in allocation(zp, 1).spaces:
        where = {spec.role: spec.residence for spec in space.buffers}
        assert where[R.FULL_PARAMS] is where[R.MASTER] is Residence.HOST  # master: a view of the params
        assert where[R.FULL_GRADS] is where[R.GRAD_SHARD] is Residence.DEVICE
        assert space[R.MASTER].view_of is R.FULL_PARAMS
    assert allocation(zp, 1).bytes_in(Residence.HOST) == allocation(zp, 1).persistent_bytes(R.FULL_PARAMS)


def test_held_roles_are_what_a_rank_of_the_stage_holds():
    assert held_roles(_plan(0)) == ()
    assert held_roles(_plan(1, layout="rank_major")) == (
        R.FULL_PARAMS,
        R.FULL_GRADS,
        R.GRAD_SHARD,
        R.MASTER,
        R.STAGING,
        R.OPTIMIZER_STATE,
    )
    assert R.GATHER_ROOM in held_roles(_plan(3, param_wire="int8"))
    assert dict(memory_report(_plan(3)).residences) == {
        "param_shard": "device",
        "grad_shard": "device",
        "master": "device",
        "block": "device",
        "staging": "device",
        "optimizer_state": "device",
    }


@pytest.mark.parametrize(
    ("stage", "dtype", "host", "kwargs", "message"),
    [
        (2, "bf16", ("master",), {}, "the inner optimizer makes its state beside the masters"),
        (0, "bf16", ("staging",), {}, "stage-0 \\(DDP\\) plan allocates nothing"),
    ],
)
def test_a_placement_that_cannot_work_is_refused(stage, dtype, host, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        _plan(stage, dtype=dtype, host=host, **kwargs)


@pytest.mark.parametrize(
    ("stage", "dtype", "host", "kwargs", "role"),
    [
        (2, "float32", ("master", "optimizer_state"), {}, R.MASTER),
        (1, "float32", ("master", "optimizer_state"), {"layout": "rank_major"}, R.MASTER),
        (3, "float32", ("master", "optimizer_state"), {}, R.MASTER),
        (1, "bf16", ("grad_shard",), {"layout": "rank_major"}, R.GRAD_SHARD),
    ],
)
def test_a_role_placed_apart_from_the_buffer_it_would_view_gets_its_own(stage, dtype, host, kwargs, role):
    zp = _plan(stage, dtype=dtype, host=host, **kwargs)  # [Note: offload, planned]
    spec = allocation(zp, 0).spaces[0][role]
    assert spec.view_of is None and spec.residence is Residence.HOST and spec.nbytes > 0


def test_placements_that_split_nothing_are_planned():
    _plan(1, host=("grad_shard",), layout="interleaved", bucket_bytes=4096)  # a gradient shard of its own
    _plan(2, dtype="float32", host=("full_params", "master", "optimizer_state"))
    _plan(3, host=("block", "gather_room"), param_wire="int8")
