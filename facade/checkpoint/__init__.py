"""Elastic, crash-safe checkpoints of a ``ZeroOptimizer`` and its parameters.

[Note: checkpoint layout]
``save(opt, path)`` writes a *snapshot* directory and commits it atomically::

    path/
      latest                      # name of the committed snapshot (atomic rename)
      writer.lock                 # the one job that writes here (see [Note: checkpoint root])
      snapshot-00000007/
        manifest.json             # plan, specs, fragments, state leaves, hyper-parameters, extra,
                                  # and the digest that seals it (see [Note: manifest integrity])
        frozen.pt                 # frozen parameters, if any, whole (written by rank 0)
        shard-00000.pt ...        # per shard rank: its region of the parameters, its fp32
                                  # masters and the tensor leaves of its optimizer state
        experts-experts-00000.pt  # with expert groups: per expert domain and rank of the
        ...                       # world, that rank's shard of its expert group (below)

Every name above, and the names of the tensors in the files, comes from
``checkpoint.names`` (see [Note: checkpoint names]).

Optimizer state is written as the leaves of [Note: state codec]: tensors go to
the shard files under ``state/<leaf path>`` and the manifest records, per
leaf, its dtype, the ranks whose file holds it and (``whole/`` and
``parked/`` leaves) its shape, or, for plain values (the scalar state of a
cohort), the value itself. Parked state of frozen parameters (pieces in
parameter coordinates) loads at any world size: shard rank ``index % shard
size`` takes a parameter's pieces, which are exchanged when it is unfrozen.

Files hold tensors and plain data only (``torch.load(weights_only=True)``) with a
crc32 per 1 MiB block. Each snapshot is written under ``snapshot-N.partial``;
only when every rank has written and fsynced its file does rank 0 write the
manifest, rename the directory and point ``latest`` at it. Every shard rank
writes an equal share, parameters included, so saving runs in parallel. A save interrupted
at any point leaves the previous snapshot as ``latest`` and no directory that
loads as valid (a ``.partial`` one has no manifest and is never referenced).
Snapshot names are numbers, other names in the root are left alone, and only
the holder of ``writer.lock`` deletes (see [Note: checkpoint root]).

*Expert domains* (see [Note: expert domains]) are not elastic: which experts
a rank holds depends on the world and the expert groups. A snapshot of an
optimizer with expert groups has format ``EXPERTS_FORMAT`` (older readers
refuse it by name): the data domain is saved exactly as above, and every rank
``r`` of the world writes ``experts-<domain>-<r:05d>.pt`` for each expert
domain, into the same ``.partial`` directory before the commit: its expert
group's shard ``q`` (its group rank; an expert domain shards over its whole
group), laid out like a shard file (``region/``, ``master/``, ``state/``,
checksummed per block), plus, in group rank 0's file, the group's frozen
parameters whole (``param/<index>``). The manifest lists these files with the
others and adds ``experts``: the saving world size and, per domain, its name
and groups, each with its ranks (of the world, in group order), partition
(with its fingerprint), ``separate_master``, state leaves (``ranks`` are
group ranks) and hyper-parameters. Loading requires the same domains, world
size, expert groups and expert partitions; each rank cross-checks and
verifies the file it wrote, reads its group's regions for the parameters,
and every check runs before the one agreement over the world, so a missing
or damaged expert file on one rank raises on every rank and changes nothing.
The scaler lives in the manifest once and is restored once.

``load(opt, path)`` follows ``latest`` only to a snapshot of ``path`` itself,
checks the manifest's digest and form and cross-checks it against the data
files (see [Note: manifest integrity]), rebuilds the saved partition, asks the
core for a reshard plan to the running optimizer's plan (any world size, shard
size or strategy), and each rank reads, memory-mapped, only the pieces that
plan assigns it, verifying their blocks. Everything is read and checked before
anything changes; any exception on any rank becomes an error that every rank
agrees on before any of them commits (see [Note: load agreement] in
``state.restore``).

``torch.distributed.checkpoint`` is not used: its metadata file is a pickle of
its own classes, which the "plain data only" requirement rules out; the
resharding it would provide is the core's reshard plan here.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from zeroplan.core import (
    CheckpointError,
    ConfigError,
    Stage,
    ZeroplanError,
)
from zeroplan.facade.checkpoint import background, loading
from zeroplan.facade.checkpoint.background import SaveHandle
from zeroplan.facade.checkpoint.files import encode, write_json, write_tensors
from zeroplan.facade.checkpoint.loading import domain_shards
from zeroplan.facade.checkpoint.manifest import (
    FORMAT,
    Encoded,
    ExpertDomain,
    ExpertGroup,
    ListedFile,
    Manifest,
    SavedShards,
    StateLeaf,
    TensorLeaf,
    ValueLeaf,
)
from zeroplan.facade.checkpoint.names import (
    FROZEN,
    LATEST,
    MANIFEST,
    PARTIAL,
    expert_file,
    master_tensor,
    param_tensor,
    region_tensor,
    shard_file,
    state_tensor,
)
from zeroplan.facade.checkpoint.reslice import load_resliced
from zeroplan.facade.checkpoint.root import claim, cleanup, next_name, resolve
from zeroplan.facade.checkpoint.root import point_latest as _point_latest  # crash tests patch it here
from zeroplan.facade.mechanisms.agreement import as_zeroplan_error, verdicts
from zeroplan.facade.mechanisms.assembly import Assembly, FileTensor, materialize
from zeroplan.facade.mechanisms.groups import ProcessGroups
from zeroplan.facade.state.dicts import Shards
from zeroplan.facade.state.inner import hyperparameters
from zeroplan.facade.state.shards import export_state
from zeroplan.facade.state.tree import (
    encode_parked,
    encode_state,
    tensor_meta,
)

if TYPE_CHECKING:
    from zeroplan.facade.runtime.domain import DomainRuntime
    from zeroplan.facade.runtime.optimizer import ZeroOptimizer

__all__ = ["FORMAT", "SaveHandle", "latest", "load", "save"]


def load(opt: ZeroOptimizer, path: str | Path | Sequence[str | Path]) -> dict[str, Any]:
    """Load the latest snapshot under ``path`` into ``opt`` and its parameters; collective.

    At any world size, shard-group size and strategy (``loading.load`` says what is checked and
    raised). A list of roots is a tensor-parallel checkpoint saved one root per tp slice, in tp
    order, loaded at any tp degree ([Note: reslicing tensor-parallel checkpoints] in
    ``checkpoint.reslice``). Returns the ``extra`` saved with it.
    """
    if isinstance(path, (list, tuple)):
        return load_resliced(opt, path)
    return loading.load(opt, path)


def latest(path: str | Path) -> Path | None:
    """The committed snapshot under ``path``, or ``None`` if none was committed there (yet).

    ``None`` means there is nothing to resume from: ``path`` does not exist,
    or holds neither ``latest`` nor a manifest (an interrupted first save
    leaves only a ``.partial`` directory), so a job can start from scratch. A
    damaged checkpoint is not hidden: a ``latest`` that names a missing
    snapshot, or anything but a snapshot of ``path`` itself, raises. The
    snapshot's files are not read; ``load`` verifies them.

    Raises:
        CheckpointError: ``latest`` is damaged (see [Note: checkpoint root]).
    """
    root = Path(path)
    if not (root / LATEST).is_file() and not (root / MANIFEST).is_file():
        return None
    return resolve(root)


# --------------------------------------------------------------------------- save
@torch.no_grad()
def save(
    opt: ZeroOptimizer,
    path: str | Path,
    *,
    extra: dict[str, Any] | None = None,
    keep: int = 1,
    blocking: bool = True,
) -> Path | SaveHandle:
    """Save ``opt``, its parameters and ``extra`` to ``path``; collective.

    Rank 0 becomes the one writer of ``path`` at the first save and stays it
    while its process lives (see [Note: checkpoint root]). With expert groups,
    every rank also writes its expert state (see [Note: checkpoint layout]).
    A save in the background still running for ``opt`` is waited for first.

    Args:
        opt: the optimizer; every parameter it manages is saved.
        path: checkpoint root directory (shared by all ranks).
        extra: plain data to store alongside (step number, scheduler state, ...).
        keep: committed snapshots to keep (the newest ones).
        blocking: ``False``: copy this rank's state into a reused host buffer and return a
            :class:`SaveHandle` at once; a thread writes and seals the snapshot
            ([Note: background saves] in ``checkpoint.background``).

    Returns:
        The committed snapshot directory; with ``blocking=False`` a handle whose
        ``wait()`` returns it.

    Raises:
        CheckpointError: on every rank, if another job writes to ``path`` or a
            rank could not write (with ``blocking=False``: from ``wait()``, the
            next save or ``load``); the previous snapshot stays ``latest``.
    """
    if not (type(keep) is int and keep >= 1):
        raise ConfigError(f"keep must be an int >= 1, got {keep!r}")
    background.finish_pending(opt)
    job, problem = _begin(opt, Path(path), extra, keep)
    if not blocking and problem is None:
        try:
            job = job._replace(files=background.stage(opt, job.files, job.device))
        except Exception as exc:  # a rank that cannot stage must not leave the others' threads waiting
            problem = as_zeroplan_error(exc, CheckpointError, "cannot copy its state into host staging")
    try:
        verdicts(problem, job.groups.world, failed="could not take its state", error=CheckpointError)
    except ZeroplanError:
        if job.groups.rank == 0:  # our own partial: nothing references it
            shutil.rmtree(job.root / (job.name + PARTIAL), ignore_errors=True)
        raise
    if blocking:
        return _finish(job, job.groups.world)
    return background.start(opt, functools.partial(_finish, job), job.groups.world)


class _Job(NamedTuple):
    """A started snapshot: where it goes, this rank's files, and what the manifest needs of the optimizer.

    Attributes:
        root, name, keep: the checkpoint root, the snapshot's name, snapshots to keep.
        groups: the data domain's process groups.
        files: this rank's files, by name: their tensors.
        state: the state leaves of its shard file (none if it writes none).
        experts: by expert domain name, what it writes of the domain (state leaves, group).
        frame: the manifest but what the ranks write, taken at the save.
        expert_names: the expert domains' names.
        device: where the optimizer's tensors live.
    """

    root: Path
    name: str
    keep: int
    groups: ProcessGroups
    files: list[tuple[str, dict[str, FileTensor]]]
    state: tuple[StateLeaf, ...]
    experts: dict[str, _ExpertWritten]
    frame: Manifest
    expert_names: tuple[str, ...]
    device: torch.device


def _begin(
    opt: ZeroOptimizer, root: Path, extra: dict[str, Any] | None, keep: int
) -> tuple[_Job, ZeroplanError | None]:
    """Agree on the snapshot's name (rank 0 claims the root; collective), then take this rank's files;
    a failure to take them is returned, for the caller to agree on."""
    sh, experts = domain_shards(opt)
    groups = sh.groups
    problem: ZeroplanError | None = None
    start, encoded_extra = None, None
    if groups.rank == 0:
        try:
            encoded_extra = encode(extra or {})
            root.mkdir(parents=True, exist_ok=True)
            claim(root)
            start = next_name(root)
            (root / (start + PARTIAL)).mkdir()
        except Exception as exc:  # every failure must reach every rank, not hang them
            problem = as_zeroplan_error(exc, CheckpointError, f"cannot start a snapshot in {str(root)!r}")
    failed = "could not start the snapshot"
    name: str = verdicts(problem, groups.world, failed=failed, facts=start, error=CheckpointError)[0]
    files: list[tuple[str, dict[str, FileTensor]]] = []
    state: tuple[StateLeaf, ...] = ()
    written: dict[str, _ExpertWritten] = {}
    try:
        leaves, expert_leaves = _leaves(sh), [_leaves(esh) for esh in experts]
        files, state, written = _contents(sh, leaves, opt.domains[1:], experts, expert_leaves)
    except Exception as exc:  # agreed by the caller: every rank raises, none writes
        problem = as_zeroplan_error(exc, CheckpointError, "cannot take its state for the snapshot")
    names = tuple(d.name for d in opt.domains[1:])
    frame = _frame(sh, encoded_extra)
    return _Job(root, name, keep, groups, files, state, written, frame, names, sh.device), problem


def _finish(job: _Job, group: dist.ProcessGroup) -> Path:
    """Write this rank's files, agree over ``group``, rank 0 seals and commits; collective over ``group``."""
    root, groups = job.root, job.groups
    partial = root / (job.name + PARTIAL)
    problem: ZeroplanError | None = None
    written: _Written | None = None
    try:
        listed = tuple(_write_file(partial, name, materialize(tensors)) for name, tensors in job.files)
        written = _Written(files=listed, state=job.state, experts=job.experts)
    except Exception as exc:  # any I/O failure must reach every rank, not hang them
        problem = as_zeroplan_error(exc, CheckpointError, f"cannot write into {str(partial)!r}")
    try:
        failed = "could not write its checkpoint file"
        infos: list[_Written] = verdicts(problem, group, failed=failed, facts=written, error=CheckpointError)
    except ZeroplanError:
        if groups.rank == 0:  # our own partial: nothing references it
            shutil.rmtree(partial, ignore_errors=True)
        raise

    snapshot = root / job.name
    if groups.rank == 0:
        try:
            write_json(partial / MANIFEST, _manifest(job.frame, infos, job.expert_names).sealed())
            partial.rename(snapshot)
            _point_latest(root, job.name)
            cleanup(root, job.keep, job.name)
        except Exception as exc:
            problem = as_zeroplan_error(exc, CheckpointError, f"rank 0 could not commit {str(snapshot)!r}")
    verdicts(problem, group, failed="could not commit the snapshot", error=CheckpointError)
    return snapshot


def _leaves(sh: Shards) -> dict[str, Any]:
    """A domain's optimizer state as the leaves of [Note: state codec], parked state included; flat
    state of several windows not yet copied ([Note: assembled file tensors])."""
    state = export_state(sh.zp, sh.inner, sh.buffers, assemble=False)
    leaves = encode_state(state, sh.zp.partition.spaces)
    leaves.update(encode_parked(sh.parked))  # [Note: parked state]
    return leaves


def _frozen(sh: Shards) -> dict[str, torch.Tensor]:
    """A domain's frozen parameters, whole, by name in the file."""
    return {param_tensor(s.index): sh.params[s.index].detach() for s in sh.zp.specs if not s.trainable}


class _ExpertWritten(NamedTuple):
    """What one rank wrote of an expert domain.

    Attributes:
        ranks: its expert group's ranks in the world, in group order.
        state: the state leaves of its file.
        group: group rank 0's: what the group saved, state aside; ``None`` on the others.
    """

    ranks: tuple[int, ...]
    state: tuple[StateLeaf, ...]
    group: SavedShards | None


class _Written(NamedTuple):
    """What one rank wrote into a snapshot, for rank 0's manifest.

    Attributes:
        files: the files it wrote, in order, with their sizes.
        state: the state leaves of its shard file (none if it wrote none).
        experts: by expert domain name, what it wrote of the domain.
    """

    files: tuple[ListedFile, ...]
    state: tuple[StateLeaf, ...]
    experts: dict[str, _ExpertWritten]


def _contents(
    sh: Shards,
    leaves: dict[str, Any],
    domains: Sequence[DomainRuntime],
    experts: Sequence[Shards],
    expert_leaves: Sequence[dict[str, Any]],
) -> tuple[list[tuple[str, dict[str, FileTensor]]], tuple[StateLeaf, ...], dict[str, _ExpertWritten]]:
    """This rank's files (its shard file on replica rank 0, ``frozen.pt`` on rank 0, its file of each
    expert domain) as tensors by name, and what the manifest records of them; nothing is written."""
    groups = sh.groups
    files: list[tuple[str, dict[str, FileTensor]]] = []
    state: tuple[StateLeaf, ...] = ()
    if groups.replica_rank == 0:
        tensors, state = _shard_contents(sh, leaves)
        files.append((shard_file(groups.shard_rank), tensors))
    frozen = _frozen(sh)
    if groups.rank == 0 and frozen:
        files.append((FROZEN, frozen))
    written: dict[str, _ExpertWritten] = {}
    for domain, esh, eleaves in zip(domains, experts, expert_leaves, strict=True):
        file, written[domain.name] = _expert_contents(domain.name, esh, eleaves, groups)
        files.append(file)
    return files, state, written


def _write_file(partial: Path, name: str, tensors: dict[str, torch.Tensor]) -> ListedFile:
    """Write file ``name`` of the snapshot (through ``write_tensors``, which crash tests patch here)."""
    return ListedFile(name=name, size=write_tensors(partial / name, tensors))


def _shard_contents(
    sh: Shards, leaves: dict[str, Any]
) -> tuple[dict[str, FileTensor], tuple[StateLeaf, ...]]:
    """A shard file's tensors (region, masters, tensor leaves) and the manifest's entries of its leaves."""
    shard_rank = sh.groups.shard_rank
    tensors: dict[str, FileTensor] = {region_tensor(b.space.dtype): b.shard_source() for b in sh.buffers}
    tensors.update({master_tensor(b.space.dtype): b.master_source() for b in sh.buffers if b.carries_master})
    state: list[StateLeaf] = []
    for leaf_path, leaf in leaves.items():  # [Note: state codec]
        if torch.is_tensor(leaf) or isinstance(leaf, Assembly):
            tensors[state_tensor(leaf_path)] = leaf
            meta = tensor_meta(leaf)
            shape = None if leaf_path.startswith("flat/") else tuple(meta.shape)
            state.append(TensorLeaf(path=leaf_path, dtype=meta.dtype, ranks=(shard_rank,), shape=shape))
        else:
            state.append(ValueLeaf(path=leaf_path, value=encode(leaf)))
    return tensors, tuple(state)


def _saved_shards(sh: Shards, state: tuple[StateLeaf, ...]) -> SavedShards:
    """What a domain's shard group saves besides the data: partition, masters, ``state``, hyper-parameters."""
    return SavedShards(
        partition=sh.zp.partition,
        separate_master=tuple(b.space.dtype for b in sh.buffers if b.carries_master),
        state=state,
        param_groups=tuple(encode([hyperparameters(g) for g in sh.param_groups])),
    )


def _expert_contents(
    name: str, sh: Shards, leaves: dict[str, Any], world: ProcessGroups
) -> tuple[tuple[str, dict[str, FileTensor]], _ExpertWritten]:
    """This rank's file of expert domain ``name`` (name, tensors) and what the manifest records of it.

    Group rank 0 adds what its group saved (partition, masters,
    hyper-parameters) and its frozen parameters; every rank its state leaves.
    """
    if sh.zp.topology.replica_size != 1:  # expert domains shard over their whole group
        raise CheckpointError(f"expert domain {name!r} has replica groups: its files would not be per rank")
    ranks = tuple(dist.get_group_rank(world.world, q) for q in dist.get_process_group_ranks(sh.groups.world))
    tensors, state = _shard_contents(sh, leaves)
    group = None
    if sh.groups.rank == 0:
        tensors.update(_frozen(sh))
        group = _saved_shards(sh, state=())
    return (expert_file(name, world.rank), tensors), _ExpertWritten(ranks=ranks, state=state, group=group)


def _merge_leaves(parts: Iterable[tuple[StateLeaf, ...]]) -> tuple[StateLeaf, ...]:
    """The ranks' state leaves in the order first seen; a tensor leaf several ranks hold lists all of them."""
    merged: dict[str, StateLeaf] = {}
    for leaves in parts:
        for leaf in leaves:
            known = merged.setdefault(leaf.path, leaf)
            if known is not leaf and isinstance(known, TensorLeaf) and isinstance(leaf, TensorLeaf):
                merged[leaf.path] = dataclasses.replace(
                    known, ranks=tuple(sorted({*known.ranks, *leaf.ranks}))
                )
    return tuple(merged.values())


def _frame(sh: Shards, extra: Encoded) -> Manifest:
    """The manifest as far as the save's start knows it: the plan, hyper-parameters, scaler,
    ``extra`` and the tp slice as they are now; the ranks' files and state leaves come with
    :func:`_manifest`."""
    zp = sh.zp
    return Manifest(
        tensor_slice=sh.tensor_slice if sh.tensor_slice[1] > 1 else None,
        optimizer=sh.optimizer_name,
        elementwise=zp.elementwise,
        world_size=zp.topology.world_size,
        shard_size=zp.topology.shard_size,
        stage=Stage(zp.stage),
        shards=_saved_shards(sh, ()),
        scaler=None if sh.scaler is None else sh.scaler.as_dict(),
        files=(),
        extra=extra,
    )


def _manifest(frame: Manifest, infos: list[_Written], experts: Sequence[str]) -> Manifest:
    """The manifest: ``frame`` with every rank's files and state leaves.

    With expert domains (their names in ``experts``) it has their entries (see
    [Note: checkpoint layout]) and format ``EXPERTS_FORMAT``.
    """
    return dataclasses.replace(
        frame,
        shards=dataclasses.replace(frame.shards, state=_merge_leaves(w.state for w in infos)),
        files=tuple(file for w in infos for file in w.files),
        expert_domains=tuple(_domain(name, infos) for name in experts),
    )


def _domain(name: str, infos: list[_Written]) -> ExpertDomain:
    """An expert domain's entry: its groups, each with what it saved and its ranks' state leaves."""
    heads = {w.experts[name].ranks: w.experts[name].group for w in infos if w.experts[name].group is not None}
    states: dict[tuple[int, ...], list[tuple[StateLeaf, ...]]] = {ranks: [] for ranks in heads}
    for w in infos:
        states[w.experts[name].ranks].append(w.experts[name].state)
    groups = [
        ExpertGroup(ranks=ranks, shards=dataclasses.replace(head, state=_merge_leaves(states[ranks])))
        for ranks, head in heads.items()
        if head is not None
    ]
    return ExpertDomain(name=name, groups=tuple(sorted(groups, key=lambda g: g.ranks)))
