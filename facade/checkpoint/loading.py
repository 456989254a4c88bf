"""``checkpoint.load``: read a snapshot, check it, reshard it into the running optimizer, agree, restore.

See [Note: checkpoint layout] in ``zeroplan.facade.checkpoint`` (which re-exports
:func:`load`): every rank reads, memory-mapped, only the pieces the core's reshard
plan assigns it, verifies them, and nothing changes on any rank until every rank
read and agreed (see [Note: load agreement] in ``state.restore``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from zeroplan.core import (
    CheckpointError,
    IncompatiblePlanError,
    ReshardPlan,
    ZeroPlan,
    plan_reshard,
)
from zeroplan.facade.checkpoint import background
from zeroplan.facade.checkpoint.checks import (
    check_data_domain,
    check_expert_domain,
    check_expert_domains,
    check_expert_param_groups,
    check_frozen_file,
    check_shard_file,
    check_shard_files_present,
)
from zeroplan.facade.checkpoint.files import TensorFile, decode
from zeroplan.facade.checkpoint.manifest import (
    ExpertGroup,
    LeafKind,
    Manifest,
    SavedShards,
    ValueLeaf,
    read_manifest,
)
from zeroplan.facade.checkpoint.names import (
    FROZEN,
    expert_file,
    master_tensor,
    param_tensor,
    region_tensor,
    shard_file,
    snapshot_number,
    state_tensor,
)
from zeroplan.facade.checkpoint.root import held_snapshots, resolve
from zeroplan.facade.checkpoint.slices import SaveIdentity, agree_across_slices, identity_of
from zeroplan.facade.mechanisms.torch_dtypes import torch_dtype
from zeroplan.facade.state.dicts import Shards
from zeroplan.facade.state.restore import LoadedState, agreed_state
from zeroplan.facade.state.tree import (
    decode_parked,
    decode_state,
    tree_clone,
)

if TYPE_CHECKING:
    from zeroplan.facade.runtime.domain import DomainRuntime
    from zeroplan.facade.runtime.optimizer import ZeroOptimizer

__all__ = ["Source", "domain_shards", "load", "read_state", "saved_param"]


def domain_shards(opt: ZeroOptimizer) -> tuple[Shards, list[Shards]]:
    """What the data domain and each expert domain save and load (see [Note: expert domains])."""
    if len(opt.domains) == 1:
        return opt.shards(), []
    return opt.domains[0].shards(opt.scaler_state), [d.shards(opt.scaler_state) for d in opt.domains[1:]]


@torch.no_grad()
def load(opt: ZeroOptimizer, path: str | Path) -> dict[str, Any]:
    """Load the latest snapshot under ``path`` into ``opt`` and its parameters; collective.

    Works at any world size, shard-group size and strategy. With expert
    groups only the data-parallel state is elastic: the expert state loads at
    the world size, expert groups and expert partitions it was saved with.
    Returns the ``extra`` saved with it.

    Raises:
        CheckpointError: missing, incomplete, truncated, corrupted or edited
            files, a ``latest`` that names no snapshot of ``path``, or any
            other failure while reading; with expert groups also a snapshot
            without their state (or expert state for an optimizer without
            them), another world size, other expert groups or partitions.
        IncompatiblePlanError: a checkpoint of another model or optimizer
            class, or ranks that read different snapshots.
        In every case, on every rank, and the optimizer and parameters are unchanged.
    """
    background.finish_pending(opt)  # a save in flight is committed (or raises) first
    sh, experts = domain_shards(opt)
    domains = opt.domains[1:]
    extra: list[dict[str, Any]] = []
    expert_states: list[LoadedState] = []

    identity: list[SaveIdentity] = []

    def read() -> LoadedState:
        loaded, saved_extra, states, saved = _prepare(sh, opt.plan_with_cohorts, Path(path), domains, experts)
        extra.append(saved_extra)
        expert_states.extend(states)
        identity.append(saved)
        return loaded

    # One agreement over the world covers every domain: any rank's failure, expert files included,
    # raises on every rank before anything changes.
    problem: Exception | None = None
    agreed: LoadedState | None = None
    try:
        agreed = agreed_state(read, sh, what="checkpoint", wrap=CheckpointError)
    except Exception as exc:  # the other tp slices and pipeline stages must hear of it too
        problem = exc
    slices = opt.model_slices
    if slices:  # [Note: one save across slices]
        agree_across_slices(slices, _slice_label(opt), problem, identity[0] if identity else None)
    if problem is not None:
        raise problem
    if agreed is None:  # unreachable: agreed_state raised
        raise RuntimeError("checkpoint: nothing read and no error")
    opt.restore(agreed)
    for domain, state in zip(domains, expert_states, strict=True):
        domain.restore(state)
    return extra[0]


class Source(NamedTuple):
    """Where one domain's saved state lies in a snapshot, and which of its blocks this rank verifies.

    Every reader reads every parameter; shard ``q``'s blocks are verified by
    the reader with ``q % readers == checker``, frozen parameters by reader 0
    (a failure there fails the load on every rank, since all agree before
    committing).

    Attributes:
        shards: what was saved: the data domain's, or an expert group's.
        file_of: the file of saved shard ``q``.
        frozen_file: the file holding the frozen parameters, whole.
        checker: this rank's position among the readers.
        readers: how many ranks read the domain.
    """

    shards: SavedShards
    file_of: Callable[[int], str]
    frozen_file: str
    checker: int
    readers: int


def saved_param(
    source: Source, index: int, open_file: Callable[[str], TensorFile], *, master: bool = False
) -> list[torch.Tensor]:
    """Parameter ``index`` as saved, flat, in consecutive parts: its fragments, or its frozen copy.

    ``master``: its fp32 master where the shard files hold one apart from the parameters
    (``separate_master``); fp32 parameters and frozen ones are their own masters.
    """
    spec = source.shards.partition.specs[index]
    if not spec.trainable:
        return [
            open_file(source.frozen_file).read(param_tensor(index), 0, spec.numel, verify=source.checker == 0)
        ]
    separate = master and spec.dtype in source.shards.separate_master
    return [
        open_file(source.file_of(f.rank)).read(
            master_tensor(spec.dtype) if separate else region_tensor(spec.dtype),
            f.shard_offset,
            f.shard_span.stop,
            verify=f.rank % source.readers == source.checker,
        )
        for f in source.shards.partition.fragments[index]
    ]


def _slice_label(opt: ZeroOptimizer) -> str:
    """This rank's part of the model, for messages: "pp stage 1, tp slice 0", "tp slice 1"."""
    (index, degree), stage = opt.tensor_slice, opt.pipeline_stage
    parts = [] if stage is None else [f"pp stage {stage[0]}"]
    return ", ".join(parts + ([f"tp slice {index}"] if degree > 1 else []))


def _prepare(
    sh: Shards,
    plan_with_cohorts: Callable[[Iterable[int]], ZeroPlan],
    path: Path,
    domains: Sequence[DomainRuntime] = (),
    experts: Sequence[Shards] = (),
) -> tuple[LoadedState, dict[str, Any], list[LoadedState], SaveIdentity]:
    """Read and check everything this rank needs; change nothing.

    Returns the data domain's state, ``extra``, each expert domain's state
    (``domains``, whose parts are ``experts``) and which save it read ([Note: one save across
    slices]). This rank's tp slice (``sh.tensor_slice``) must be the one that saved the snapshot.
    """
    snapshot = resolve(path)
    manifest = read_manifest(snapshot)  # [Note: manifest integrity]
    saved_slice = manifest.tensor_slice or (0, 1)
    tensor_slice = sh.tensor_slice
    if saved_slice != tensor_slice:
        raise CheckpointError(
            f"{str(snapshot)!r} was saved by tp slice {saved_slice[0]} of {saved_slice[1]}, and this rank is "
            f"tp slice {tensor_slice[0]} of {tensor_slice[1]}: load each slice's own root, or pass every "
            "slice's root, in tp order, to load at another tp degree ([Note: reslicing tensor-parallel "
            "checkpoints])"
        )
    check_data_domain(manifest, snapshot, sh.optimizer_name, sh.zp.partition)
    expert_groups = check_expert_domains(
        manifest, snapshot, [(d.name, d.world) for d in domains], sh.groups.world
    )
    saved = manifest.shards.partition
    target = plan_with_cohorts([s.cohort for s in saved.specs])
    reshard = plan_reshard(saved, target.partition)
    files: dict[str, TensorFile] = {}

    def open_file(name: str) -> TensorFile:
        if name not in files:
            size = manifest.size_of(name)
            if size is None:
                raise CheckpointError(f"{str(snapshot)!r}: the manifest lists no file {name!r}")
            files[name] = TensorFile(snapshot / name, size)
        return files[name]

    check_shard_files_present(manifest, snapshot)

    rank, world = sh.groups.rank, sh.groups.topology.world_size
    # Cross-check the files whose checksums this rank verifies against the manifest.
    for q in range(rank, saved.shard_size, world):
        check_shard_file(open_file(shard_file(q)), q, manifest.shards)
    if rank == 0 and FROZEN in manifest.names:
        check_frozen_file(open_file(FROZEN), saved)
    source = Source(manifest.shards, shard_file, FROZEN, rank, world)
    loaded = read_state(
        source, target, reshard, sh, open_file, scaler=manifest.scaler, digest=manifest.digest
    )
    states = [
        _read_experts(domain, esh, group, snapshot, open_file, manifest)
        for domain, esh, group in zip(domains, experts, expert_groups, strict=True)
    ]
    number = snapshot_number(snapshot.name)
    held = held_snapshots(snapshot.parent)  # a snapshot directory loads like its root
    saved = identity_of(path, snapshot, -1 if number is None else number, manifest.extra, held)
    return loaded, decode(manifest.extra), states, saved


def read_state(
    source: Source,
    target: ZeroPlan,
    reshard: ReshardPlan,
    sh: Shards,
    open_file: Callable[[str], TensorFile],
    *,
    scaler: dict[str, Any] | None,
    digest: str | None,
) -> LoadedState:
    """One domain's parameters and this rank's state in ``target``'s layout, read through ``reshard``."""
    saved, shards = source.shards.partition, source.shards
    params = [saved_param(source, spec.index, open_file) for spec in saved.specs]
    for i, (parts, p) in enumerate(zip(params, sh.params, strict=True)):
        if any(part.dtype != p.dtype for part in parts):
            raise IncompatiblePlanError(
                f"parameter {i} is {parts[0].dtype} in the checkpoint, {p.dtype} here"
            )

    shard_rank = sh.groups.shard_rank
    copies = reshard.reads(shard_rank)
    device = sh.device
    masters: dict[str, torch.Tensor] = {}
    leaves: dict[str, Any] = {}
    for space in target.partition.spaces:
        mine = [c for c in copies if c.dtype == space.dtype]
        flat = shards.flat_leaves(space.dtype)
        kinds = [(state_tensor(leaf.path), leaf.path, torch_dtype(leaf.dtype)) for leaf in flat]
        if space.dtype in shards.separate_master:
            kinds.insert(0, (master_tensor(space.dtype), "", torch.float32))
        for name, leaf_path, dtype in kinds:
            out = torch.zeros(space.extent(shard_rank), dtype=dtype, device=device)  # padding stays zero
            for c in mine:
                if c.dst_span.numel:
                    file = open_file(source.file_of(c.src_rank))
                    piece = file.read(name, c.src_span.start, c.src_span.stop)
                    if piece.dtype != dtype:  # never cast silently (its checking rank reports why)
                        raise CheckpointError(
                            f"{str(file.path.parent)!r}: {name!r} of shard {c.src_rank} is {piece.dtype}"
                        )
                    out[c.dst_span.as_slice()] = piece
            if leaf_path:
                leaves[leaf_path] = out
            else:
                masters[space.dtype] = out
    if not target.elementwise:
        for t in target.inner_tensors(shard_rank):
            for leaf in shards.leaves_of(LeafKind.WHOLE, t.param):
                if isinstance(leaf, ValueLeaf):
                    leaves[leaf.path] = decode(leaf.value)
                    continue
                stored = open_file(source.file_of(leaf.ranks[0])).tensor(state_tensor(leaf.path))
                leaves[leaf.path] = stored.to(device, copy=True)
    for leaf in shards.leaves_of(LeafKind.SCALARS):
        if isinstance(leaf, ValueLeaf):  # always: scalar state is never a tensor leaf
            leaves[leaf.path] = tree_clone(decode(leaf.value), device)
    # Parked state of frozen parameters: each parameter's, whole, on shard rank ``index % shard size``
    # (see [Note: parked state]); it is exchanged when the parameter is unfrozen.
    parked_leaves: dict[str, Any] = {}
    for leaf in shards.leaves_of(LeafKind.PARKED):
        if int(leaf.owner) % target.topology.shard_size != shard_rank:
            continue
        if isinstance(leaf, ValueLeaf):
            parked_leaves[leaf.path] = tree_clone(decode(leaf.value), device)
            continue
        stored = open_file(source.file_of(leaf.ranks[0])).tensor(state_tensor(leaf.path))
        parked_leaves[leaf.path] = stored.to(device, copy=True)
    shard_state = decode_state(leaves, target.partition.spaces)
    stateful = set(shard_state.scalars) | {
        (target.specs[p].group, target.specs[p].cohort) for p in shard_state.whole
    }
    return LoadedState(
        target=target,
        state=shard_state,
        stateful=stateful,
        masters=masters,
        param_groups=decode(list(shards.param_groups)),
        scaler=scaler,
        param_values=params,
        parked=decode_parked(parked_leaves),
        source=digest,
    )


# --------------------------------------------------------------------------- load: expert domains
def _read_experts(
    domain: DomainRuntime,
    sh: Shards,
    group: ExpertGroup,
    snapshot: Path,
    open_file: Callable[[str], TensorFile],
    manifest: Manifest,
) -> LoadedState:
    """This rank's state of expert domain ``domain``, saved by its group in ``group``'s files.

    The domain loads only into the partition it was saved with; each rank
    verifies the file its group rank wrote (and group rank 0 the frozen
    parameters in it) and reads its peers' regions for the parameters.
    """
    saved = group.shards.partition
    target = domain.plan_with_cohorts([s.cohort for s in saved.specs])
    check_expert_domain(manifest, snapshot, domain.name, group, sh.zp.partition, target.partition)
    names = [expert_file(domain.name, q) for q in group.ranks]
    me = sh.groups.rank  # an expert domain shards over its whole group: its shard rank
    check_shard_file(open_file(names[me]), me, group.shards, frozen=me == 0)
    source = Source(group.shards, names.__getitem__, names[0], me, len(names))
    reshard = plan_reshard(saved, target.partition)  # the identity: each rank reads its own shard
    loaded = read_state(source, target, reshard, sh, open_file, scaler=None, digest=manifest.digest)
    check_expert_param_groups(snapshot, domain.name, len(loaded.param_groups), len(sh.param_groups))
    return loaded
