"""``mesh_roles``: which mesh dimensions zeroplan shards over ([Note: mesh roles]); pure."""

from __future__ import annotations

import pytest

from zeroplan.core import ConfigError, MeshRoles, mesh_roles


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


@pytest.mark.parametrize(
    ("names", "sizes", "kwargs", "says"),
    [
        (None, (4,), {}, "mesh_dim_names"),
        (("pp", "x"), (2, 2), {}, "no data-parallel dimension"),
        (("dp", "dp_shard"), (2, 2), {}, 'beside "dp_replicate"/"dp_shard"'),
        (("dp_shard", "dp_replicate"), (2, 2), {}, 'before "dp_shard"'),
        (("tp", "dp"), (2, 4), {}, "('tp', 2)"),
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
