"""The typed manifest ([Note: typed manifest]): parsed once, written back byte for byte, its parts valid.

In process, no workers: the multi-process checkpoint tests exercise the manifest through save and
load; these pin what those cannot see directly (the exact bytes, the typed value, the invariants).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import scenarios_old_checkpoints as old

from zeroplan.core import ParamSpec, PlanInvariantError, Replicate, Shard, Stage, Topology, plan
from zeroplan.facade.checkpoint.manifest import (
    EXPERTS_FORMAT,
    FORMAT,
    ExpertDomain,
    ExpertGroup,
    LeafKind,
    ListedFile,
    Manifest,
    SavedShards,
    TensorLeaf,
    ValueLeaf,
    read_manifest,
)
from zeroplan.facade.checkpoint.names import FROZEN, MANIFEST, expert_file, shard_file


@pytest.mark.parametrize("name", list(old.FIXTURES))
def test_an_old_manifest_parses_and_is_written_back_byte_for_byte(tmp_path, name):
    snapshot = old.copy_fixture(name, tmp_path) / "snapshot-00000001"
    text = (snapshot / MANIFEST).read_text()
    manifest = read_manifest(snapshot)
    assert json.dumps(manifest.sealed()) == text  # the digest verifies only if the content is the same
    assert manifest.digest == json.loads(text)["digest"]
    assert manifest.format == FORMAT and not manifest.expert_domains
    assert (manifest.world_size, manifest.shard_size, manifest.optimizer) == (2, 2, "AdamW")
    assert manifest.stage is Stage(old.FIXTURES[name]["stage"])
    assert manifest.names == {shard_file(0), shard_file(1), FROZEN}
    assert manifest.size_of(shard_file(1)) == (snapshot / shard_file(1)).stat().st_size
    assert manifest.size_of("shard-00002.pt") is None
    assert manifest.shards.partition.shard_size == 2
    kinds = {leaf.kind for leaf in manifest.shards.state}
    assert kinds == {LeafKind.FLAT, LeafKind.SCALARS}
    assert all(isinstance(leaf, ValueLeaf) for leaf in manifest.shards.leaves_of(LeafKind.SCALARS))


def _shards(world: int, *, leaves: tuple[TensorLeaf | ValueLeaf, ...]) -> SavedShards:
    specs = (
        ParamSpec(index=0, name="w", shape=(17, 5), dtype="bfloat16"),
        ParamSpec(index=1, name="b", shape=(5,), trainable=False),
    )
    zp = plan(specs, Topology(world_size=world), stage=2, alignment=4)
    return SavedShards(
        partition=zp.partition,
        separate_master=("bfloat16",),
        state=leaves,
        param_groups=({"lr": 0.1, "betas": {"__tuple__": [0.9, 0.999]}},),
    )


def _moe_manifest() -> Manifest:
    """A manifest with an expert domain of two groups at world 4, as the writer builds one."""
    data = _shards(
        4,
        leaves=(
            TensorLeaf(path="flat/bfloat16/exp_avg", dtype="float32", ranks=(0, 1, 2, 3)),
            ValueLeaf(
                path="scalars/0/0", value={"step": {"__tensor__": [2.0], "dtype": "float32", "shape": []}}
            ),
            TensorLeaf(path="parked/1/piece/0/exp_avg", dtype="float32", ranks=(1,), shape=(5,)),
        ),
    )
    groups = tuple(
        ExpertGroup(
            ranks=ranks,
            shards=_shards(
                2, leaves=(TensorLeaf(path="flat/bfloat16/exp_avg", dtype="float32", ranks=(0, 1)),)
            ),
        )
        for ranks in ((0, 2), (1, 3))
    )
    files = [shard_file(q) for q in range(4)] + [FROZEN] + [expert_file("experts", r) for r in range(4)]
    return Manifest(
        optimizer="AdamW",
        elementwise=True,
        world_size=4,
        shard_size=4,
        stage=Stage.GRADIENTS,
        shards=data,
        scaler={"scale": 1024.0, "growth_tracker": 1, "hysteresis_tracker": 0},
        files=tuple(ListedFile(name=n, size=100 + i) for i, n in enumerate(files)),
        extra={"step": 2},
        expert_domains=(ExpertDomain(name="experts", groups=groups),),
    )


def test_a_written_manifest_reads_back_as_the_same_value(tmp_path: Path):
    manifest = _moe_manifest()
    document = manifest.sealed()
    assert list(document) == [
        "format", "optimizer", "elementwise", "world_size", "shard_size", "stage", "partition",
        "separate_master", "state", "param_groups", "scaler", "files", "extra", "experts", "digest",
    ]  # fmt: skip
    assert list(document["experts"]["domains"][0]["groups"][0]) == [
        "ranks", "partition", "separate_master", "param_groups", "state",
    ]  # fmt: skip
    assert document["format"] == EXPERTS_FORMAT and document["experts"]["world_size"] == 4
    (tmp_path / MANIFEST).write_text(json.dumps(document))
    read = read_manifest(tmp_path)
    assert read.digest == document["digest"]
    assert dataclasses.replace(read, digest=None) == manifest
    assert read.expert_domains[0].group_of(3).ranks == (1, 3)
    assert json.dumps(read.sealed()) == (tmp_path / MANIFEST).read_text()


def test_the_leaves_are_selected_by_kind_owner_and_file():
    shards = _moe_manifest().shards
    assert [leaf.path for leaf in shards.flat_leaves("bfloat16")] == ["flat/bfloat16/exp_avg"]
    assert shards.flat_leaves("float32") == []
    assert [leaf.path for leaf in shards.leaves_of(LeafKind.PARKED, 1)] == ["parked/1/piece/0/exp_avg"]
    assert shards.leaves_of(LeafKind.PARKED, 0) == []
    assert [leaf.path for leaf in shards.leaves_in(1)] == [
        "flat/bfloat16/exp_avg",
        "parked/1/piece/0/exp_avg",
    ]
    assert shards.leaves_in(1)[1].owner == "1"


BAD_PARTS = {
    "value_of_flat": lambda: ValueLeaf(path="flat/float32/exp_avg", value=1),
    "tensor_of_scalars": lambda: TensorLeaf(path="scalars/0/0", dtype="float32", ranks=(0,)),
    "unknown_kind": lambda: TensorLeaf(path="bogus/0/x", dtype="float32", ranks=(0,)),
    "no_ranks": lambda: TensorLeaf(path="flat/float32/exp_avg", dtype="float32", ranks=()),
    "flat_with_shape": lambda: TensorLeaf(
        path="flat/float32/exp_avg", dtype="float32", ranks=(0,), shape=(3,)
    ),
    "whole_without_shape": lambda: TensorLeaf(path="whole/0/exp_avg", dtype="float32", ranks=(0,)),
    "leaf_twice": lambda: _shards(2, leaves=(ValueLeaf(path="scalars/0/0", value=1),) * 2),
    "domain_name": lambda: ExpertDomain(name="Experts", groups=_moe_manifest().expert_domains[0].groups),
    "no_groups": lambda: ExpertDomain(name="experts", groups=()),
    "file_twice": lambda: dataclasses.replace(_moe_manifest(), files=(ListedFile(name="a", size=1),) * 2),
}


@pytest.mark.parametrize("case", sorted(BAD_PARTS))
def test_parts_that_break_an_invariant_are_refused(case):
    with pytest.raises(PlanInvariantError):
        BAD_PARTS[case]()


def test_placed_specs_record_global_shape_and_placement_and_plain_ones_stay_six_entries(tmp_path: Path):
    """[Note: placements]: a placed spec's entry adds its global shape and placement (the shape is the
    local one); a plain spec's entry is the six fields every manifest wrote, so old manifests load."""
    specs = (
        ParamSpec(
            index=0,
            name="w",
            shape=(9, 5),
            global_shape=(17, 5),
            placement=(("tp", Shard(0)), ("dp", Replicate())),
        ),
        ParamSpec(index=1, name="b", shape=(5,)),
    )
    zp = plan(specs, Topology(world_size=2), stage=2, alignment=4)
    shards = SavedShards(partition=zp.partition, separate_master=(), state=(), param_groups=({"lr": 0.1},))
    manifest = dataclasses.replace(_moe_manifest(), shards=shards, expert_domains=())
    document = manifest.sealed()
    entries = document["partition"]["specs"]
    assert entries[0][:2] == ["w", [9, 5]] and entries[0][6:] == [
        [17, 5],
        [["tp", "shard", 0], ["dp", "replicate", -1]],
    ]
    assert entries[1] == ["b", [5], "float32", 0, True, 0]
    (tmp_path / MANIFEST).write_text(json.dumps(document))
    read = read_manifest(tmp_path)
    assert read.shards.partition.specs == specs
    assert read.shards.partition.fingerprint() == zp.partition.fingerprint()
