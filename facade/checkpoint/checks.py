"""Every check of a snapshot before it is read: ``checkpoint.load`` calls them, nothing else checks.

Steps 2 (against the partition) and 3 (against the data) of [Note: manifest
integrity]: :func:`~zeroplan.facade.checkpoint.manifest.read_manifest` has
already checked the seal and the form and parsed the typed :class:`Manifest`.
Then against the optimizer that loads it: the inner optimizer, the parameters
and their param groups (:func:`check_data_domain`), the files its ranks read
(:func:`check_shard_files_present`), the expert domains, their groups and
partitions (:func:`check_expert_domains`, :func:`check_expert_domain`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch.distributed as dist

from zeroplan.core import CheckpointError, IncompatiblePlanError, PartitionPlan, compare_specs, master_dtype
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

__all__ = [
    "check_against_partition",
    "check_data_domain",
    "check_expert_domain",
    "check_expert_domains",
    "check_expert_group",
    "check_expert_param_groups",
    "check_frozen_file",
    "check_shard_file",
    "check_shard_files_present",
]


def check_data_domain(manifest: Manifest, snapshot: Path, optimizer: str, partition: PartitionPlan) -> None:
    """The snapshot's data domain against the optimizer loading it: its inner optimizer, its parameters
    (shapes, dtypes, order: any partition of them loads) and their param groups.

    Raises:
        IncompatiblePlanError: another inner optimizer, other parameters or other param groups.
        CheckpointError: the manifest disagrees with its own partition.
    """
    if manifest.optimizer != optimizer:
        raise IncompatiblePlanError(
            f"checkpoint of optimizer {manifest.optimizer!r}, but this ZeroOptimizer wraps {optimizer!r}"
        )
    saved = manifest.shards.partition
    check_against_partition(manifest, snapshot)
    compare_specs(saved, partition, allow_trainable_change=False)
    for spec_saved, spec_here in zip(saved.specs, partition.specs, strict=True):
        if spec_saved.group != spec_here.group:
            raise IncompatiblePlanError(
                f"parameter {spec_here.index} ({spec_here.name!r}) is in param group "
                f"{spec_saved.group} in the checkpoint but in group {spec_here.group} here"
            )


def check_shard_files_present(manifest: Manifest, snapshot: Path) -> None:
    """Every saved rank's shard file is listed and on disk (before any rank reads one).

    Raises:
        CheckpointError: naming the missing files.
    """
    shard_files = [shard_file(q) for q in range(manifest.shards.partition.shard_size)]
    missing = [n for n in shard_files if n in manifest.names and not (snapshot / n).is_file()]
    missing += sorted(set(shard_files) - manifest.names)
    if missing:
        raise CheckpointError(
            f"{str(snapshot)!r} is missing shard files of saved ranks: {', '.join(missing)}"
        )


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


def check_expert_domains(
    manifest: Manifest,
    snapshot: Path,
    domains: Sequence[tuple[str, dist.ProcessGroup]],
    world: dist.ProcessGroup,
) -> list[ExpertGroup]:
    """This rank's group entry of each expert domain ([Note: checkpoint layout]); reads no data file.

    ``domains``: the loading optimizer's expert domains, by name and process group; ``world``: its
    data-parallel group.

    Raises:
        CheckpointError: the snapshot holds expert state and the optimizer has
            no expert groups, or the reverse, or other domains, another world
            size or other expert groups.
    """
    saved = manifest.expert_domains
    if not saved and not domains:
        return []
    where, names = repr(str(snapshot)), [name for name, _ in domains]
    rank, world_size = dist.get_rank(world), dist.get_world_size(world)
    if not saved:
        raise CheckpointError(
            f"{where} holds no expert state (the optimizer that saved it had no expert param groups), but "
            f"this optimizer has expert domains {names}: nothing says which experts a rank holds. Load it "
            "into an optimizer without expert groups, or load a checkpoint saved with these expert groups"
        )
    saved_names = [d.name for d in saved]
    sizes = " or ".join(str(n) for n in sorted({len(g.ranks) for d in saved for g in d.groups}))
    if not domains:
        raise CheckpointError(
            f"{where} holds expert state (domains {saved_names}, saved at world size {manifest.world_size} "
            f"with expert groups of {sizes} ranks), but this optimizer has no expert param groups: build it "
            "as the job that saved it did, each expert param group with its 'process_group'"
        )
    if saved_names != names:
        raise CheckpointError(
            f"{where} holds expert domains {saved_names}, this optimizer has {names}: build it with the same "
            "expert param groups (a 'process_group' each) as the job that saved it"
        )
    if manifest.world_size != world_size:
        raise CheckpointError(
            f"{where} holds expert state saved at world size {manifest.world_size}, this job runs at world "
            f"size {world_size}: a rank's experts load only at the world size and with the "
            f"expert groups they were saved with; resume at world size {manifest.world_size} (checkpoints "
            "without expert groups load at any world size)"
        )
    entries = []
    for (name, group), saved_domain in zip(domains, saved, strict=True):
        here = [dist.get_group_rank(world, q) for q in dist.get_process_group_ranks(group)]
        mine = saved_domain.group_of(rank)
        if list(mine.ranks) != here:
            raise CheckpointError(
                f"{where}: expert domain {name!r} was saved with expert groups "
                f"{[list(g.ranks) for g in saved_domain.groups]} (ranks of the world), but rank {rank} "
                f"is in expert group {here} here: a rank's experts load only with the expert groups they "
                "were saved with; create the expert groups (each param group's 'process_group') as the job "
                "that saved it did"
            )
        entries.append(mine)
    return entries


def check_expert_domain(
    manifest: Manifest,
    snapshot: Path,
    name: str,
    group: ExpertGroup,
    partition: PartitionPlan,
    target: PartitionPlan,
) -> None:
    """Expert domain ``name``'s saved state against the loading optimizer's: its group's files, its
    parameters (``partition``), the partition it loads into (``target``, which must be the saved one:
    expert state is not elastic), and every file its group's ranks read.

    Raises:
        CheckpointError: saying which and how to fix it.
    """
    where = f"{str(snapshot)!r}, expert domain {name!r}"
    check_expert_group(group, snapshot, name)
    saved = group.shards.partition
    try:
        compare_specs(saved, partition, allow_trainable_change=False)
    except IncompatiblePlanError as exc:
        raise CheckpointError(
            f"{where}: {exc}; expert state loads only into the expert parameters it was saved from"
        ) from None
    if target.fingerprint() != saved.fingerprint():
        raise CheckpointError(
            f"{where}: saved with another partition of the expert parameters ({_describe(saved)}) than this "
            f"optimizer's ({_describe(target)}): expert state loads only into the partition it was "
            "saved with; build the optimizer with the same param groups, strategy, alignment and layout"
        )
    names = [expert_file(name, q) for q in group.ranks]
    missing = [n for n in names if n not in manifest.names or not (snapshot / n).is_file()]
    if missing:
        raise CheckpointError(
            f"{str(snapshot)!r} is missing expert files of domain {name!r}, which the ranks of expert "
            f"group {list(group.ranks)} read: {', '.join(missing)}; restore them from a copy or load another "
            "snapshot"
        )


def check_expert_param_groups(snapshot: Path, name: str, saved: int, here: int) -> None:
    """Expert domain ``name`` saved ``saved`` param groups; the loading optimizer has ``here``.

    Raises:
        CheckpointError: they differ.
    """
    if saved != here:
        raise CheckpointError(
            f"{str(snapshot)!r}, expert domain {name!r}: {saved} param groups saved, {here} here: build the "
            "optimizer with the same expert param groups as the job that saved it"
        )


def _describe(partition: PartitionPlan) -> str:
    return (
        f"strategy {partition.strategy!r}, alignment {partition.alignment}, {partition.shard_size} shards, "
        f"fingerprint {partition.fingerprint()}"
    )
