"""``mesh_roles``: which mesh dimensions zeroplan shards over ([Note: mesh roles]); pure."""

from __future__ import annotations

import pytest

from zeroplan.core import ConfigError, MeshRoles, mesh_roles, pipeline_stages, preset_specs


def test_data_pipeline_and_replicated_shard_groups():
    roles = mesh_roles(("pp", "dp"), (2, 4))
    assert roles.data == ("dp",) and roles.data_size == 4 and roles.stages == "pp"
    assert roles.shard_group_size is None
    mics = mesh_roles(("dp_replicate", "dp_shard"), (2, 4))
    assert mics.data_size == 8 and mics.shard_group_size == 4 and mics.stages is None
    assert mesh_roles(("dp_shard",), (8,)).shard_group_size is None  # one shard group: plain ZeRO
    assert mesh_roles(("pp", "dp", "tp"), (1, 4, 1)).stages is None  # dimensions of size 1 are ignored
    assert mesh_roles(("dp",), (8,), shard_group_size=2).data_size == 8  # MiCS by argument
    staged = mesh_roles(("pp", "dp_replicate", "dp_shard"), (2, 2, 2))  # MiCS inside pipeline stages
    assert staged.stages == "pp" and staged.shard_group_size == 2 and staged.data_size == 4
    tensor = mesh_roles(("pp", "dp", "tp"), (2, 2, 2))  # [Note: tensor-parallel parameters]
    assert tensor.tensor == "tp" and tensor.data == ("dp",) and tensor.stages == "pp"
    assert mesh_roles(("dp", "tp"), (4, 1)).tensor is None


@pytest.mark.parametrize(
    ("names", "sizes", "kwargs", "says"),
    [
        (None, (4,), {}, "mesh_dim_names"),
        (("pp", "x"), (2, 2), {}, "no data-parallel dimension"),
        (("dp", "dp_shard"), (2, 2), {}, 'beside "dp_replicate"/"dp_shard"'),
        (("dp_shard", "dp_replicate"), (2, 2), {}, 'before "dp_shard"'),
        (("ep", "dp"), (2, 4), {}, "('ep', 2)"),
        (("cp", "dp"), (2, 4), {}, "not supported"),
        (("dp_replicate", "dp_shard"), (2, 4), {"shard_group_size": 2}, "disagrees"),
        (("dp", "dp"), (2, 2), {}, "distinct"),
        (("dp",), (0,), {}, "positive"),
    ],
)
def test_meshes_it_cannot_use_are_named(names, sizes, kwargs, says):
    with pytest.raises(ConfigError) as info:
        mesh_roles(names, sizes, **kwargs)
    assert says in str(info.value)


def test_roles_are_frozen():
    roles = MeshRoles(("dp",), (2,))
    with pytest.raises(AttributeError):
        roles.names = ("pp",)  # type: ignore[misc]


def test_pipeline_stages_cut_whole_blocks_in_order():
    specs = preset_specs("llama-7b", "bf16")
    stages = pipeline_stages(specs, 4)
    assert [s.name for stage in stages for s in stage] == [s.name for s in specs]  # every one, once
    assert stages[0][0].name == "model.embed_tokens.weight" and stages[-1][-1].name == "lm_head.weight"
    assert stages[1][0].name == "model.layers.8.self_attn.q_proj.weight"  # 32 blocks: 8 per stage
    assert all([s.index for s in stage] == list(range(len(stage))) for stage in stages)
    assert pipeline_stages(specs, 1) == (specs,)
    uneven = pipeline_stages(preset_specs("gpt2", "fp32"), 5)  # 12 blocks over 5 stages: 2 or 3 each
    blocks = [
        sorted({int(s.name.split(".")[2]) for s in stage if s.name.startswith("transformer.h.")})
        for stage in uneven
    ]
    assert [len(b) for b in blocks] == [3, 2, 3, 2, 2] and blocks[0] == [0, 1, 2]


def test_more_stages_than_blocks_is_refused():
    with pytest.raises(ConfigError, match="at least as many blocks"):
        pipeline_stages(preset_specs("gpt2", "fp32"), 13)
    with pytest.raises(ConfigError, match=">= 1"):
        pipeline_stages(preset_specs("gpt2", "fp32"), 0)
