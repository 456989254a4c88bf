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
``state_loading``).

``torch.distributed.checkpoint`` is not used: its metadata file is a pickle of
its own classes, which the "plain data only" requirement rules out; the
resharding it would provide is the core's reshard plan here.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from zeroplan.core import (
    CheckpointError,
    ConfigError,
    IncompatiblePlanError,
    PartitionPlan,
    ReshardPlan,
    ZeroPlan,
    ZeroplanError,
    compare_specs,
    plan_reshard,
)
from zeroplan.facade.agreement import as_zeroplan_error, verdicts
from zeroplan.facade.checkpoint_files import TensorFile, decode, encode, write_json, write_tensors
from zeroplan.facade.checkpoint_manifest import (
    EXPERTS_FORMAT,
    FORMAT,
    check_against_partition,
    check_expert_group,
    check_frozen_file,
    check_shard_file,
    expert_file,
    partition_document,
    partition_from,
    read_manifest,
    seal,
)
from zeroplan.facade.checkpoint_root import PARTIAL, claim, cleanup, next_name, resolve
from zeroplan.facade.checkpoint_root import point_latest as _point_latest  # crash tests patch it here
from zeroplan.facade.groups import ProcessGroups
from zeroplan.facade.inner import hyperparameters
from zeroplan.facade.shard_state import export_state
from zeroplan.facade.state_dicts import Shards
from zeroplan.facade.state_loading import LoadedState, agreed_state
from zeroplan.facade.state_tree import (
    decode_parked,
    decode_state,
    encode_parked,
    encode_state,
    tensor_meta,
    torch_dtype,
    tree_clone,
)

if TYPE_CHECKING:
    from zeroplan.facade.domain import Domain
    from zeroplan.facade.optimizer import ZeroOptimizer

__all__ = ["FORMAT", "latest", "load", "save"]


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
    if not (root / "latest").is_file() and not (root / "manifest.json").is_file():
        return None
    return resolve(root)


# --------------------------------------------------------------------------- save
@torch.no_grad()
def save(opt: ZeroOptimizer, path: str | Path, *, extra: dict[str, Any] | None = None, keep: int = 1) -> Path:
    """Save ``opt``, its parameters and ``extra`` to ``path``; collective.

    Rank 0 becomes the one writer of ``path`` at the first save and stays it
    while its process lives (see [Note: checkpoint root]). With expert groups,
    every rank also writes its expert state (see [Note: checkpoint layout]).

    Args:
        opt: the optimizer; every parameter it manages is saved.
        path: checkpoint root directory (shared by all ranks).
        extra: plain data to store alongside (step number, scheduler state, ...).
        keep: committed snapshots to keep (the newest ones).

    Returns:
        The committed snapshot directory.

    Raises:
        CheckpointError: on every rank, if another job writes to ``path`` or a
            rank could not write; the previous snapshot stays ``latest``.
    """
    if not (type(keep) is int and keep >= 1):
        raise ConfigError(f"keep must be an int >= 1, got {keep!r}")
    root = Path(path)
    sh, experts = _shards(opt)
    groups = sh.groups
    leaves = _leaves(sh)
    expert_leaves = [_leaves(esh) for esh in experts]
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
    partial = root / (name + PARTIAL)

    info: dict[str, Any] = {"files": {}, "state": {}}
    try:
        if groups.replica_rank == 0:
            tensors, info["state"] = _shard_contents(sh, leaves)
            shard_file = f"shard-{groups.shard_rank:05d}.pt"
            info["files"][shard_file] = write_tensors(partial / shard_file, tensors)
        frozen = _frozen(sh)
        if groups.rank == 0 and frozen:
            info["files"]["frozen.pt"] = write_tensors(partial / "frozen.pt", frozen)
        if experts:
            info["experts"] = {}
        for domain, esh, eleaves in zip(opt.domains[1:], experts, expert_leaves, strict=True):
            info["experts"][domain.name] = _write_experts(partial, domain.name, esh, eleaves, groups, info)
    except Exception as exc:  # any I/O failure must reach every rank, not hang them
        problem = as_zeroplan_error(exc, CheckpointError, f"cannot write into {str(partial)!r}")
    try:
        failed = "could not write its checkpoint file"
        infos = verdicts(problem, groups.world, failed=failed, facts=info, error=CheckpointError)
    except ZeroplanError:
        if groups.rank == 0:  # our own partial: nothing references it
            shutil.rmtree(partial, ignore_errors=True)
        raise

    snapshot = root / name
    if groups.rank == 0:
        try:
            names = [d.name for d in opt.domains[1:]]
            write_json(partial / "manifest.json", seal(_manifest(sh, infos, encoded_extra, names)))
            partial.rename(snapshot)
            _point_latest(root, name)
            cleanup(root, keep, name)
        except Exception as exc:
            problem = as_zeroplan_error(exc, CheckpointError, f"rank 0 could not commit {str(snapshot)!r}")
    verdicts(problem, groups.world, failed="could not commit the snapshot", error=CheckpointError)
    return snapshot


def _shards(opt: ZeroOptimizer) -> tuple[Shards, list[Shards]]:
    """What the data domain and each expert domain save and load (see [Note: expert domains])."""
    if len(opt.domains) == 1:
        return opt.shards(), []
    return opt.domains[0].shards(opt.scaler_state), [d.shards(opt.scaler_state) for d in opt.domains[1:]]


def _leaves(sh: Shards) -> dict[str, Any]:
    """A domain's optimizer state as the leaves of [Note: state codec], parked state included."""
    leaves = encode_state(export_state(sh.zp, sh.inner, sh.buffers), sh.zp.partition.spaces)
    leaves.update(encode_parked(sh.parked))  # [Note: parked state]
    return leaves


def _frozen(sh: Shards) -> dict[str, torch.Tensor]:
    """A domain's frozen parameters, whole, by name in the file."""
    return {f"param/{s.index}": sh.params[s.index].detach() for s in sh.zp.specs if not s.trainable}


def _shard_contents(sh: Shards, leaves: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A shard file's tensors (region, masters, tensor leaves) and the manifest's entries of its leaves."""
    shard_rank = sh.groups.shard_rank
    tensors = {f"region/{b.space.dtype}": b.shard_values() for b in sh.buffers}
    tensors.update({f"master/{b.space.dtype}": b.master[: b.extent] for b in sh.buffers if b.carries_master})
    state: dict[str, Any] = {}
    for leaf_path, leaf in leaves.items():  # [Note: state codec]
        if torch.is_tensor(leaf):
            tensors[f"state/{leaf_path}"] = leaf
            meta = tensor_meta(leaf)
            described: dict[str, Any] = {"dtype": meta.dtype, "ranks": [shard_rank]}
            if not leaf_path.startswith("flat/"):
                described["shape"] = list(meta.shape)
            state[leaf_path] = described
        else:
            state[leaf_path] = {"value": encode(leaf)}
    return tensors, state


def _write_experts(
    partial: Path, name: str, sh: Shards, leaves: dict[str, Any], world: ProcessGroups, info: dict[str, Any]
) -> dict[str, Any]:
    """Write this rank's file of expert domain ``name``; return what the manifest records of it.

    Group rank 0 adds the group's entry (partition, masters, hyper-parameters)
    and its frozen parameters; every rank the entries of its state leaves.
    """
    if sh.zp.topology.replica_size != 1:  # expert domains shard over their whole group
        raise CheckpointError(f"expert domain {name!r} has replica groups: its files would not be per rank")
    ranks = [dist.get_group_rank(world.world, q) for q in dist.get_process_group_ranks(sh.groups.world)]
    tensors, state = _shard_contents(sh, leaves)
    mine: dict[str, Any] = {"ranks": ranks, "state": state}
    if sh.groups.rank == 0:
        tensors.update(_frozen(sh))
        mine["group"] = {
            "partition": partition_document(sh.zp.partition),
            "separate_master": [b.space.dtype for b in sh.buffers if b.carries_master],
            "param_groups": encode([hyperparameters(g) for g in sh.param_groups]),
        }
    file = expert_file(name, world.rank)
    info["files"][file] = write_tensors(partial / file, tensors)
    return mine


def _merge_state(into: dict[str, dict[str, Any]], state: dict[str, dict[str, Any]]) -> None:
    """Add one rank's state leaf entries; a tensor leaf several ranks hold lists all of them."""
    for leaf_path, described in state.items():
        known = into.setdefault(leaf_path, described)
        if known is not described and "ranks" in described:
            known["ranks"] = sorted({*known["ranks"], *described["ranks"]})


def _manifest(
    sh: Shards, infos: list[dict[str, Any]], extra: Any, experts: list[str] | None = None
) -> dict[str, Any]:
    """The manifest: the plan, every rank's files and state leaves, hyper-parameters and ``extra``.

    With expert domains (their names in ``experts``) it adds the ``experts``
    section (see [Note: checkpoint layout]) and has format ``EXPERTS_FORMAT``.
    """
    zp = sh.zp
    files: dict[str, int] = {}
    state: dict[str, dict[str, Any]] = {}
    for info in infos:
        files.update(info["files"])
        _merge_state(state, info["state"])
    document = {
        "format": FORMAT,
        "optimizer": sh.optimizer_name,
        "elementwise": zp.elementwise,
        "world_size": zp.topology.world_size,
        "shard_size": zp.topology.shard_size,
        "stage": int(zp.stage),
        "partition": partition_document(zp.partition),
        "separate_master": [b.space.dtype for b in sh.buffers if b.carries_master],
        "state": state,
        "param_groups": encode([hyperparameters(g) for g in sh.param_groups]),
        "scaler": None if sh.scaler is None else sh.scaler.as_dict(),
        "files": files,
        "extra": extra,
    }
    if experts:
        document["format"] = EXPERTS_FORMAT
        document["experts"] = {"world_size": len(infos), "domains": [_domain(n, infos) for n in experts]}
    return document


def _domain(name: str, infos: list[dict[str, Any]]) -> dict[str, Any]:
    """An expert domain's manifest entry: its groups, each with its partition and its ranks' state leaves."""
    groups: dict[tuple[int, ...], dict[str, Any]] = {}
    for info in infos:
        mine = info["experts"][name]
        if "group" in mine:
            groups[tuple(mine["ranks"])] = {"ranks": mine["ranks"], **mine["group"], "state": {}}
    for info in infos:
        mine = info["experts"][name]
        _merge_state(groups[tuple(mine["ranks"])]["state"], mine["state"])
    return {"name": name, "groups": sorted(groups.values(), key=lambda g: g["ranks"])}


# --------------------------------------------------------------------------- load
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
    sh, experts = _shards(opt)
    domains = opt.domains[1:]
    extra: list[dict[str, Any]] = []
    expert_states: list[LoadedState] = []

    def read() -> LoadedState:
        loaded, saved_extra, states = _prepare(sh, opt.plan_with_cohorts, Path(path), domains, experts)
        extra.append(saved_extra)
        expert_states.extend(states)
        return loaded

    # One agreement over the world covers every domain: any rank's failure, expert files included,
    # raises on every rank before anything changes.
    opt.restore(agreed_state(read, sh, what="checkpoint", wrap=CheckpointError))
    for domain, state in zip(domains, expert_states, strict=True):
        domain.restore(state)
    return extra[0]


class _Source(NamedTuple):
    """Where one domain's saved state lies in a snapshot, and which of its blocks this rank verifies.

    Every reader reads every parameter; shard ``q``'s blocks are verified by
    the reader with ``q % readers == checker``, frozen parameters by reader 0
    (a failure there fails the load on every rank, since all agree before
    committing).

    Attributes:
        doc: the manifest, or an expert group's entry (``separate_master``,
            ``state``, ``param_groups``).
        partition: the saved partition.
        file_of: the file of saved shard ``q``.
        frozen_file: the file holding the frozen parameters, whole.
        checker: this rank's position among the readers.
        readers: how many ranks read the domain.
    """

    doc: dict[str, Any]
    partition: PartitionPlan
    file_of: Callable[[int], str]
    frozen_file: str
    checker: int
    readers: int


def _saved_param(source: _Source, index: int, open_file: Callable[[str], TensorFile]) -> list[torch.Tensor]:
    """Parameter ``index`` as saved, flat, in consecutive parts: its fragments, or its frozen copy."""
    spec = source.partition.specs[index]
    if not spec.trainable:
        return [
            open_file(source.frozen_file).read(f"param/{index}", 0, spec.numel, verify=source.checker == 0)
        ]
    return [
        open_file(source.file_of(f.rank)).read(
            f"region/{spec.dtype}",
            f.shard_offset,
            f.shard_span.stop,
            verify=f.rank % source.readers == source.checker,
        )
        for f in source.partition.fragments[index]
    ]


def _prepare(
    sh: Shards,
    plan_with_cohorts: Callable[[Iterable[int]], ZeroPlan],
    path: Path,
    domains: Sequence[Domain] = (),
    experts: Sequence[Shards] = (),
) -> tuple[LoadedState, dict[str, Any], list[LoadedState]]:
    """Read and check everything this rank needs; change nothing.

    Returns the data domain's state, ``extra`` and each expert domain's state
    (``domains``, whose parts are ``experts``).
    """
    snapshot = resolve(path)
    manifest = read_manifest(snapshot)  # [Note: manifest integrity]
    if manifest["optimizer"] != sh.optimizer_name:
        raise IncompatiblePlanError(
            f"checkpoint of optimizer {manifest['optimizer']!r}, "
            f"but this ZeroOptimizer wraps {sh.optimizer_name!r}"
        )
    expert_groups = _expert_groups(manifest, domains, sh.groups, snapshot)
    saved = partition_from(manifest["partition"])
    check_against_partition(manifest, saved, snapshot)
    compare_specs(saved, sh.zp.partition, allow_trainable_change=False)
    for spec_saved, spec_here in zip(saved.specs, sh.zp.specs, strict=True):
        if spec_saved.group != spec_here.group:
            raise IncompatiblePlanError(
                f"parameter {spec_here.index} ({spec_here.name!r}) is in param group "
                f"{spec_saved.group} in the checkpoint but in group {spec_here.group} here"
            )
    target = plan_with_cohorts([s.cohort for s in saved.specs])
    reshard = plan_reshard(saved, target.partition)
    files: dict[str, TensorFile] = {}

    def open_file(name: str) -> TensorFile:
        if name not in files:
            if name not in manifest["files"]:
                raise CheckpointError(f"{str(snapshot)!r}: the manifest lists no file {name!r}")
            files[name] = TensorFile(snapshot / name, manifest["files"][name])
        return files[name]

    missing = [
        f"shard-{q:05d}.pt"
        for q in range(saved.shard_size)
        if f"shard-{q:05d}.pt" in manifest["files"] and not (snapshot / f"shard-{q:05d}.pt").is_file()
    ]
    listed = {f"shard-{q:05d}.pt" for q in range(saved.shard_size)}
    missing += sorted(listed - set(manifest["files"]))
    if missing:
        raise CheckpointError(
            f"{str(snapshot)!r} is missing shard files of saved ranks: {', '.join(missing)}"
        )

    rank, world = sh.groups.rank, sh.groups.topology.world_size
    # Cross-check the files whose checksums this rank verifies against the manifest.
    for q in range(rank, saved.shard_size, world):
        check_shard_file(open_file(f"shard-{q:05d}.pt"), q, saved, manifest)
    if rank == 0 and "frozen.pt" in manifest["files"]:
        check_frozen_file(open_file("frozen.pt"), saved)
    source = _Source(manifest, saved, lambda q: f"shard-{q:05d}.pt", "frozen.pt", rank, world)
    scaler, digest = manifest["scaler"], manifest["digest"]
    loaded = _read(source, target, reshard, sh, open_file, scaler=scaler, digest=digest)
    states = [
        _read_experts(domain, esh, group, snapshot, open_file, manifest)
        for domain, esh, group in zip(domains, experts, expert_groups, strict=True)
    ]
    return loaded, decode(manifest["extra"]), states


def _read(
    source: _Source,
    target: ZeroPlan,
    reshard: ReshardPlan,
    sh: Shards,
    open_file: Callable[[str], TensorFile],
    *,
    scaler: dict[str, Any] | None,
    digest: str,
) -> LoadedState:
    """One domain's parameters and this rank's state in ``target``'s layout, read through ``reshard``."""
    saved, doc = source.partition, source.doc
    params = [_saved_param(source, spec.index, open_file) for spec in saved.specs]
    for i, (parts, p) in enumerate(zip(params, sh.params, strict=True)):
        if any(part.dtype != p.dtype for part in parts):
            raise IncompatiblePlanError(
                f"parameter {i} is {parts[0].dtype} in the checkpoint, {p.dtype} here"
            )

    shard_rank = sh.groups.shard_rank
    copies = reshard.reads(shard_rank)
    device = sh.device
    state: dict[str, dict[str, Any]] = doc["state"]
    masters: dict[str, torch.Tensor] = {}
    leaves: dict[str, Any] = {}
    for space in target.partition.spaces:
        mine = [c for c in copies if c.dtype == space.dtype]
        flat = [p for p in state if p.startswith(f"flat/{space.dtype}/")]
        kinds = [(f"state/{p}", p, torch_dtype(state[p]["dtype"])) for p in flat]
        if space.dtype in doc["separate_master"]:
            kinds.insert(0, (f"master/{space.dtype}", "", torch.float32))
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
            for leaf_path in (p for p in state if p.startswith(f"whole/{t.param}/")):
                described = state[leaf_path]
                if "value" in described:
                    leaves[leaf_path] = decode(described["value"])
                    continue
                stored = open_file(source.file_of(described["ranks"][0])).tensor(f"state/{leaf_path}")
                leaves[leaf_path] = stored.to(device, copy=True)
    for leaf_path in (p for p in state if p.startswith("scalars/")):
        leaves[leaf_path] = tree_clone(decode(state[leaf_path]["value"]), device)
    # Parked state of frozen parameters: each parameter's, whole, on shard rank ``index % shard size``
    # (see [Note: parked state]); it is exchanged when the parameter is unfrozen.
    parked_leaves: dict[str, Any] = {}
    for leaf_path, described in state.items():
        kind, param = [*leaf_path.split("/", 2), ""][:2]
        if kind != "parked" or int(param) % target.topology.shard_size != shard_rank:
            continue
        if "value" in described:
            parked_leaves[leaf_path] = tree_clone(decode(described["value"]), device)
            continue
        stored = open_file(source.file_of(described["ranks"][0])).tensor(f"state/{leaf_path}")
        parked_leaves[leaf_path] = stored.to(device, copy=True)
    shard_state = decode_state(leaves, target.partition.spaces)
    stateful = set(shard_state.scalars) | {
        (target.specs[p].group, target.specs[p].cohort) for p in shard_state.whole
    }
    return LoadedState(
        target=target,
        state=shard_state,
        stateful=stateful,
        masters=masters,
        param_groups=decode(doc["param_groups"]),
        scaler=scaler,
        param_values=params,
        parked=decode_parked(parked_leaves),
        source=digest,
    )


# --------------------------------------------------------------------------- load: expert domains
def _expert_groups(
    manifest: dict[str, Any], domains: Sequence[Domain], world: ProcessGroups, snapshot: Path
) -> list[dict[str, Any]]:
    """This rank's group entry of each expert domain ([Note: checkpoint layout]); reads no data file.

    Raises:
        CheckpointError: the snapshot holds expert state and the optimizer has
            no expert groups, or the reverse, or other domains, another world
            size or other expert groups.
    """
    saved = manifest.get("experts")
    if saved is None and not domains:
        return []
    where, names = repr(str(snapshot)), [d.name for d in domains]
    if saved is None:
        raise CheckpointError(
            f"{where} holds no expert state (the optimizer that saved it had no expert param groups), but "
            f"this optimizer has expert domains {names}: nothing says which experts a rank holds. Load it "
            "into an optimizer without expert groups, or load a checkpoint saved with these expert groups"
        )
    saved_names = [d["name"] for d in saved["domains"]]
    sizes = " or ".join(
        str(n) for n in sorted({len(g["ranks"]) for d in saved["domains"] for g in d["groups"]})
    )
    if not domains:
        raise CheckpointError(
            f"{where} holds expert state (domains {saved_names}, saved at world size {saved['world_size']} "
            f"with expert groups of {sizes} ranks), but this optimizer has no expert param groups: build it "
            "as the job that saved it did, each expert param group with its 'process_group'"
        )
    if saved_names != names:
        raise CheckpointError(
            f"{where} holds expert domains {saved_names}, this optimizer has {names}: build it with the same "
            "expert param groups (a 'process_group' each) as the job that saved it"
        )
    if saved["world_size"] != world.topology.world_size:
        raise CheckpointError(
            f"{where} holds expert state saved at world size {saved['world_size']}, this job runs at world "
            f"size {world.topology.world_size}: a rank's experts load only at the world size and with the "
            f"expert groups they were saved with; resume at world size {saved['world_size']} (checkpoints "
            "without expert groups load at any world size)"
        )
    entries = []
    for domain, saved_domain in zip(domains, saved["domains"], strict=True):
        here = [dist.get_group_rank(world.world, q) for q in dist.get_process_group_ranks(domain.world)]
        mine = next(g for g in saved_domain["groups"] if world.rank in g["ranks"])
        if mine["ranks"] != here:
            raise CheckpointError(
                f"{where}: expert domain {domain.name!r} was saved with expert groups "
                f"{[g['ranks'] for g in saved_domain['groups']]} (ranks of the world), but rank {world.rank} "
                f"is in expert group {here} here: a rank's experts load only with the expert groups they "
                "were saved with; create the expert groups (each param group's 'process_group') as the job "
                "that saved it did"
            )
        entries.append(mine)
    return entries


def _read_experts(
    domain: Domain,
    sh: Shards,
    group: dict[str, Any],
    snapshot: Path,
    open_file: Callable[[str], TensorFile],
    manifest: dict[str, Any],
) -> LoadedState:
    """This rank's state of expert domain ``domain``, saved by its group in ``group``'s files.

    The domain loads only into the partition it was saved with; each rank
    verifies the file its group rank wrote (and group rank 0 the frozen
    parameters in it) and reads its peers' regions for the parameters.
    """
    where = f"{str(snapshot)!r}, expert domain {domain.name!r}"
    saved = check_expert_group(group, snapshot, domain.name)
    try:
        compare_specs(saved, sh.zp.partition, allow_trainable_change=False)
    except IncompatiblePlanError as exc:
        raise CheckpointError(
            f"{where}: {exc}; expert state loads only into the expert parameters it was saved from"
        ) from None
    target = domain.plan_with_cohorts([s.cohort for s in saved.specs])
    if target.partition.fingerprint() != saved.fingerprint():
        raise CheckpointError(
            f"{where}: saved with another partition of the expert parameters ({_describe(saved)}) than this "
            f"optimizer's ({_describe(target.partition)}): expert state loads only into the partition it was "
            "saved with; build the optimizer with the same param groups, strategy, alignment and layout"
        )
    names = [expert_file(domain.name, q) for q in group["ranks"]]
    missing = [n for n in names if n not in manifest["files"] or not (snapshot / n).is_file()]
    if missing:
        raise CheckpointError(
            f"{str(snapshot)!r} is missing expert files of domain {domain.name!r}, which the ranks of expert "
            f"group {group['ranks']} read: {', '.join(missing)}; restore them from a copy or load another "
            "snapshot"
        )
    me = sh.groups.rank  # an expert domain shards over its whole group: its shard rank
    check_shard_file(open_file(names[me]), me, saved, group, frozen=me == 0)
    source = _Source(group, saved, names.__getitem__, names[0], me, len(names))
    reshard = plan_reshard(saved, target.partition)  # the identity: each rank reads its own shard
    loaded = _read(source, target, reshard, sh, open_file, scaler=None, digest=manifest["digest"])
    if len(loaded.param_groups) != len(sh.param_groups):
        raise CheckpointError(
            f"{where}: {len(loaded.param_groups)} param groups saved, {len(sh.param_groups)} here: build the "
            "optimizer with the same expert param groups as the job that saved it"
        )
    return loaded


def _describe(partition: PartitionPlan) -> str:
    return (
        f"strategy {partition.strategy!r}, alignment {partition.alignment}, {partition.shard_size} shards, "
        f"fingerprint {partition.fingerprint()}"
    )
