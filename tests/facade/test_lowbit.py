"""torchao's low-bit optimizers as inner optimizers (issue 29, item 3; [Note: low-bit optimizer state]).

Planned over whole parameters, every rank steps the tensors torchao would step unsharded, block for
block: the parameters equal torchao's own optimizer on the averaged gradients bit for bit at stages
1-3, and the plan's optimizer state equals MemTracker's count of the codes, scales and code tables.
"""

from __future__ import annotations

import pytest
import scenarios_lowbit

pytest.importorskip("torchao.optim")

CASES = [
    {"optimizer": "AdamW8bit", "stage": 2},
    {"optimizer": "AdamW4bit", "stage": 1},
    {"optimizer": "AdamWFp8", "stage": 3},
    {"optimizer": "AdamW8bit", "stage": 3, "dtype": "bf16"},
    {"optimizer": "AdamW4bit", "stage": 2, "dtype": "bf16"},
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_trains_as_torchao_unsharded_and_its_state_is_planned(pools, cfg):
    results = pools(2).run(scenarios_lowbit.trains, cfg, timeout=300)
    for r in results:
        assert r["strategy"] == "lpt_whole"
        assert r["differ"] == [0, 0, 0], r
        assert r["measured_state"] == r["planned_state"], r
    assert sum(r["quantized"] for r in results) >= 2  # some moments are quantized, not all plain


@pytest.mark.parametrize("world", [1, 3])
def test_checkpoint_reloads_at_another_world(pools, tmp_path, world):
    cfg = {"optimizer": "AdamW8bit", "stage": 2}
    pools(2).run(scenarios_lowbit.save, cfg, str(tmp_path), timeout=300)
    results = pools(world).run(scenarios_lowbit.resume, {**cfg, "stage": 3}, str(tmp_path), 2, timeout=300)
    for r in results:
        assert r["loaded_same"]
        assert r["differ"] == 0, r
    assert sum(r["quantized"] for r in results) >= 2


def test_state_dict_round_trip_and_consolidation_to_plain_moments(pools):
    """``state_dict()`` keeps the quantized moments: a twin loading it steps the same bits.
    ``consolidated_state_dict()`` is a plain torch state dict: each moment dequantized to fp32."""
    results = pools(2).run(scenarios_lowbit.state_dicts, {"optimizer": "AdamW8bit", "stage": 2}, timeout=300)
    assert all(r["differ"] == 0 for r in results)
    assert sum(r["checked"] for r in results) == 29 * 3  # every parameter's step and two moments
    assert sum(r["dequantized"] for r in results) >= 2


def test_a_split_of_parameters_is_refused_on_every_rank(pools):
    for message in pools(2).run(scenarios_lowbit.refused_split, timeout=300):
        assert message.startswith("ConfigError: torchao.AdamW8bit is not elementwise"), message
        assert "'lpt_whole'" in message


def test_freezing_and_unfreezing_keeps_the_quantized_state(pools):
    results = pools(2).run(scenarios_lowbit.refreezes, {"optimizer": "AdamW8bit", "stage": 2}, timeout=300)
    for r in results:
        assert r["differ"] == 0, r
    assert sum(r["quantized"] for r in results) >= 2


def test_subclass_state_splits_into_plain_tensors_and_back_only_for_registered_classes():
    """[Note: subclass state]: a quantized moment becomes plain tensors and a description, and comes
    back equal; a class the checkpoint names but nobody registered is refused, nothing imported."""
    import torch
    from torchao.optim.subclass_8bit import OptimState8bit

    from zeroplan.core import CheckpointError
    from zeroplan.facade.state.subclasses import SUBCLASS, copy_tensor, join_subclasses, split_subclasses

    state = OptimState8bit.zeros((64, 64), True, 256)
    state.codes.copy_(torch.randint(0, 255, (64, 64), dtype=torch.uint8))
    state.scale.copy_(torch.rand(16))
    leaves = split_subclasses({"whole/3/exp_avg": state, "whole/3/step": torch.tensor(2.0)})
    assert all(type(v) is torch.Tensor for k, v in leaves.items() if not k.endswith(SUBCLASS))
    assert {"whole/3/exp_avg@codes", "whole/3/exp_avg@scale", "whole/3/exp_avg@qmap"} <= leaves.keys()
    back = join_subclasses(leaves)["whole/3/exp_avg"]
    assert type(back) is OptimState8bit and torch.equal(back.dequantize(), state.dequantize())
    assert torch.equal(copy_tensor(state).dequantize(), state.dequantize())
    forged = dict(leaves)
    forged["whole/3/exp_avg" + SUBCLASS] = {**leaves["whole/3/exp_avg" + SUBCLASS], "class": "os:system"}
    with pytest.raises(CheckpointError, match=r"not registered with torch\.serialization\.add_safe_globals"):
        join_subclasses(forged)
    del forged["whole/3/exp_avg@scale"]
    forged["whole/3/exp_avg" + SUBCLASS] = leaves["whole/3/exp_avg" + SUBCLASS]
    with pytest.raises(CheckpointError, match="lacks its part 'scale'"):
        join_subclasses(forged)
