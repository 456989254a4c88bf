"""A snapshot's manifest checked against its saved partitions and its data files.

Steps 2 (against the partition) and 3 (against the data) of [Note: manifest
integrity]: :func:`~zeroplan.facade.checkpoint.manifest.read_manifest` has
already checked the seal and the form and parsed the typed :class:`Manifest`.
"""

from __future__ import annotations

from pathlib import Path

from zeroplan.core import CheckpointError, PartitionPlan, master_dtype
from zeroplan.facade.checkpoint.files import TensorFile
from zeroplan.facade.checkpoint.manifest import MISMATCH, ExpertGroup, LeafKind, Manifest, SavedShards
from zeroplan.facade.checkpoint.names import (
    FROZEN,
    expert_file,
    master_tensor,
    param_tensor,
    region_tensor,
    shard_file,
    state_tensor,
)
from zeroplan.facade.mechanisms.torch_dtypes import dtype_name, torch_dtype
from zeroplan.facade.state.tree import TensorMeta

__all__ = ["check_against_partition", "check_expert_group", "check_frozen_file", "check_shard_file"]


def check_against_partition(manifest: Manifest, snapshot: Path) -> None:
    """``separate_master``, state leaves and the file list agree with the saved partition.

    Raises:
        CheckpointError: naming the field that disagrees.
    """
    saved = manifest.shards.partition
    _check_state_against(manifest.shards, repr(str(snapshot)))
    files = {shard_file(q) for q in range(saved.shard_size)}
    files |= {FROZEN} if any(not s.trainable for s in saved.specs) else set()
    files |= {
        expert_file(domain.name, q)
        for domain in manifest.expert_domains
        for group in domain.groups
        for q in group.ranks
    }
    if not files <= manifest.names:
        return  # which shard files are missing is reported when they are opened
    if manifest.names != files:
        raise CheckpointError(
            f"{str(snapshot)!r}: the manifest lists files {sorted(manifest.names)}, the partition "
            f"implies {sorted(files)}: {MISMATCH}"
        )


def _check_state_against(shards: SavedShards, where: str) -> None:
    """``separate_master`` and the state leaves of a domain's entry agree with its saved partition."""
    saved = shards.partition
    dtypes = [space.dtype for space in saved.spaces]
    masters = sorted(d for d in dtypes if master_dtype(d) != d)
    if sorted(shards.separate_master) != masters:
        raise CheckpointError(
            f"{where}: the manifest's separate_master is {list(shards.separate_master)!r}, but "
            f"the saved partition has fp32 masters for {masters!r}: {MISMATCH}"
        )
    for leaf in shards.state:
        first = leaf.owner  # a dtype (flat), else a parameter index (scalars: a param group, not checked)
        if leaf.kind is LeafKind.FLAT:
            known = first in dtypes
        else:
            known = first.isdigit() and int(first) < len(saved.specs)
        if leaf.kind is LeafKind.PARKED and known and saved.specs[int(first)].trainable:
            known = False  # parked state belongs to frozen parameters only
        if leaf.kind is not LeafKind.SCALARS and not known:
            raise CheckpointError(
                f"{where}: state leaf {leaf.path!r} names no saved {leaf.kind.value} space or parameter"
            )


def check_expert_group(group: ExpertGroup, snapshot: Path, domain: str) -> None:
    """An expert group's entry agrees with its saved partition.

    An expert domain is sharded over its whole group: group rank ``q`` wrote
    shard ``q`` into the file of world rank ``group.ranks[q]``.

    Raises:
        CheckpointError: a partition of another size than the group, or
            masters and state leaves it does not imply.
    """
    where = f"{str(snapshot)!r}, expert domain {domain!r}, group {list(group.ranks)}"
    saved = group.shards.partition
    if saved.shard_size != len(group.ranks):
        raise CheckpointError(
            f"{where}: the partition has {saved.shard_size} shards, the group {len(group.ranks)} ranks: "
            f"{MISMATCH}"
        )
    _check_state_against(group.shards, where)


def _compare(file: TensorFile, expected: dict[str, TensorMeta]) -> None:
    found = {name: file.meta(name) for name in file.names()}
    for name in sorted(found.keys() - expected.keys()):
        raise CheckpointError(
            f"{str(file.path)!r} holds {name!r}, which the manifest does not list: {MISMATCH}"
        )
    for name in sorted(expected.keys() - found.keys()):
        raise CheckpointError(f"{str(file.path)!r} lacks {name!r}, which the manifest lists: {MISMATCH}")
    for name, meta in expected.items():
        here = found[name]
        if here != meta:
            raise CheckpointError(
                f"{str(file.path)!r}: {name!r} is {here.dtype} of shape {here.shape} in the file, the "
                f"manifest says {meta.dtype} of shape {meta.shape}: {MISMATCH}"
            )


def check_shard_file(file: TensorFile, shard_rank: int, shards: SavedShards, *, frozen: bool = False) -> None:
    """Shard file ``shard_rank`` holds exactly what ``shards`` says, in dtypes and shapes.

    ``shards``: the data domain's, or an expert group's; ``frozen``: the file
    also holds the frozen parameters, whole (an expert group's first file).

    Raises:
        CheckpointError: an unlisted, missing or mismatched tensor (named).
    """
    owned = {space.dtype: (space.extent(shard_rank),) for space in shards.partition.spaces}
    expected = {region_tensor(dtype): TensorMeta(shape, dtype) for dtype, shape in owned.items()}
    for dtype in shards.separate_master:
        expected[master_tensor(dtype)] = TensorMeta(owned[dtype], master_dtype(dtype))
    for leaf in shards.leaves_in(shard_rank):
        shape = owned[leaf.owner] if leaf.kind is LeafKind.FLAT else leaf.shape
        expected[state_tensor(leaf.path)] = TensorMeta(shape, dtype_name(torch_dtype(leaf.dtype)))
    if frozen:
        expected.update(_frozen_metas(shards.partition))
    _compare(file, expected)


def check_frozen_file(file: TensorFile, saved: PartitionPlan) -> None:
    """``frozen.pt`` holds each frozen parameter, whole, in its saved dtype and shape."""
    _compare(file, _frozen_metas(saved))


def _frozen_metas(saved: PartitionPlan) -> dict[str, TensorMeta]:
    return {param_tensor(s.index): TensorMeta(s.shape, s.dtype) for s in saved.specs if not s.trainable}
