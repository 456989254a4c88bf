"""The plan carries its execution options; memory, peak, traffic and schedule read them there."""

import pytest

from zeroplan.core import ConfigError, StepOptions, Topology, memory_report, plan, specs_from_shapes
from zeroplan.core.peak import backward_peak, gathered_bytes

SPECS = specs_from_shapes([(64, 64)] * 6, dtype="bf16")


def _plan(stage: int, **options: bool):
    return plan(SPECS, Topology(world_size=4), stage=stage, alignment=8, bucket_bytes=8192,
                options=StepOptions(**options))  # fmt: skip


def test_options_are_bools_and_named():
    with pytest.raises(ConfigError, match="reshard_after_forward must be True or False"):
        StepOptions(reshard_after_forward=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown step options \\['overlap'\\]"):
        _plan(2).with_options(overlap=False)
    with pytest.raises(ConfigError, match="options must be a StepOptions"):
        plan(SPECS, Topology(world_size=2), options={"overlap_grad_reduce": False})  # type: ignore[arg-type]


def test_options_change_no_layout_so_no_fingerprint():
    # A sharded state dict saved under one overlap setting loads under another.
    assert (
        _plan(3).fingerprint()
        == _plan(3, reshard_after_forward=False, overlap_grad_reduce=False).fingerprint()
    )
    assert _plan(3).settings() != _plan(3, reshard_after_forward=False).settings()
    assert _plan(3, reshard_after_forward=False).settings()["reshard_after_forward"] is False


def test_stage_3_resharding_is_read_from_the_plan():
    kept = _plan(3, reshard_after_forward=False)
    assert gathered_bytes(kept) > gathered_bytes(_plan(3))
    again, once = memory_report(_plan(3)).ranks[0], memory_report(kept).ranks[0]
    gathers = {c.collective.value: c.bytes for c in again.comm if c.group == "shard"}
    gathers_once = {c.collective.value: c.bytes for c in once.comm if c.group == "shard"}
    assert gathers["all_gather"] == 2 * gathers_once["all_gather"] > 0  # gathered again in backward
    assert once.peak_bytes > again.peak_bytes


def test_overlap_is_read_from_the_plan():
    overlapped, at_end = _plan(2), _plan(2, overlap_grad_reduce=False)
    assert backward_peak(at_end)[0].total > backward_peak(overlapped)[0].total
    assert backward_peak(overlapped.with_options(overlap_grad_reduce=False)) == backward_peak(at_end)
