"""The shard-state codec ([Note: state codec]) and tree helpers, in one process."""

from __future__ import annotations

import pytest
import torch

from zeroplan.core import ParamSpec, Space, Topology, ZeroPlan, plan
from zeroplan.facade.mechanisms.torch_dtypes import torch_dtype
from zeroplan.facade.state.shards import state_beside
from zeroplan.facade.state.tree import (
    ShardState,
    TensorMeta,
    decode_state,
    encode_state,
    tensor_meta,
    tree_clone,
)


def _spaces() -> tuple[Space, ...]:
    specs = (
        ParamSpec(index=0, name="w", shape=(17, 3), dtype="bfloat16"),
        ParamSpec(index=1, name="b", shape=(5,), dtype="float32"),
    )
    zp: ZeroPlan = plan(specs, Topology(world_size=2, shard_size=2), stage=2, optimizer="AdamW")
    return zp.partition.spaces


def _state(spaces: tuple[Space, ...]) -> ShardState:
    bf16 = next(s.index for s in spaces if s.dtype == "bfloat16")
    return ShardState(
        flat={(bf16, "exp_avg"): torch.arange(8.0), (bf16, "exp_avg_sq"): torch.ones(8)},
        scalars={(0, 0): {"step": torch.tensor(3.0)}, (0, 1): {}},  # a cohort with only per-element state
        whole={4: {"row_var": torch.ones(2, 3), "factors": (torch.zeros(2), 7), "lr": 0.5}},
    )


def test_round_trip_keeps_every_leaf_and_empty_cohorts():
    spaces = _spaces()
    state = _state(spaces)
    leaves = encode_state(state, spaces)
    assert set(leaves) == {
        "flat/bfloat16/exp_avg",
        "flat/bfloat16/exp_avg_sq",
        "scalars/0/0",
        "scalars/0/1",
        "whole/4/row_var",
        "whole/4/factors",
        "whole/4/lr",
    }
    back = decode_state(leaves, spaces)
    assert set(back.flat) == set(state.flat) and set(back.scalars) == {(0, 0), (0, 1)}
    assert all(torch.equal(back.flat[k], v) for k, v in state.flat.items())
    assert back.scalars[0, 1] == {} and torch.equal(back.scalars[0, 0]["step"], torch.tensor(3.0))
    assert back.whole[4]["lr"] == 0.5 and back.whole[4]["factors"][1] == 7


def test_decode_drops_spaces_the_plan_lacks_and_rejects_unknown_paths():
    spaces = _spaces()
    leaves = {"flat/float16/exp_avg": torch.zeros(2), "scalars/0/0": {}}
    assert decode_state(leaves, spaces).flat == {}
    for bad in ("flat/bfloat16", "scalars/x/0", "whole/3", "other/1/2"):
        with pytest.raises(ValueError, match="not a shard state path"):
            decode_state({bad: 1}, spaces)


def test_tree_clone_copies_nested_tensors_and_moves_them():
    value = {"a": [torch.ones(2), 3], "b": (torch.zeros(1), None)}
    copy = tree_clone(value, torch.device("cpu"))
    assert copy["a"][1] == 3 and copy["b"][1] is None and isinstance(copy["b"], tuple)
    copy["a"][0].add_(1)
    assert torch.equal(value["a"][0], torch.ones(2))  # the original is untouched


def test_dtype_helpers():
    assert torch_dtype("bfloat16") is torch.bfloat16 and torch_dtype("torch.float32") is torch.float32
    with pytest.raises(ValueError, match="not a torch dtype"):
        torch_dtype("Tensor")
    assert tensor_meta(torch.zeros(2, 3, dtype=torch.float16)) == TensorMeta((2, 3), "float16")


@pytest.mark.parametrize(
    ("group", "step_there"),
    [({"fused": True}, True), ({"capturable": True}, True), ({"fused": False, "capturable": False}, False)],
)
def test_state_beside_a_device_master_puts_step_there_for_fused_and_capturable_kernels(group, step_there):
    """A partial offload's kept master on the device gets loaded state from host memory: its moments
    move beside it, and ``step`` too where the group's kernel reads it on the device (as torch.optim's
    loading puts it); the meta device stands in for a GPU."""
    master = torch.empty(4, device="meta")
    state = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4), "factor": 0.5}
    placed = state_beside(state, master, group)
    assert placed["exp_avg"].device.type == "meta"
    assert placed["step"].device.type == ("meta" if step_there else "cpu")
    assert placed["factor"] == 0.5
