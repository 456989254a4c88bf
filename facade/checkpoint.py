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
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from zeroplan.core import (
    CheckpointError,
    ConfigError,
    IncompatiblePlanError,
    PartitionPlan,
    ZeroPlan,
    ZeroplanError,
    compare_specs,
    plan_reshard,
)
from zeroplan.facade.agreement import as_zeroplan_error, verdicts
from zeroplan.facade.checkpoint_files import TensorFile, decode, encode, write_json, write_tensors
from zeroplan.facade.checkpoint_manifest import (
    FORMAT,
    check_against_partition,
    check_frozen_file,
    check_shard_file,
    partition_document,
    partition_from,
    read_manifest,
    seal,
)
from zeroplan.facade.checkpoint_root import PARTIAL, claim, cleanup, next_name, resolve
from zeroplan.facade.checkpoint_root import point_latest as _point_latest  # crash tests patch it here
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
    while its process lives (see [Note: checkpoint root]).

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
    sh = opt.shards()
    groups, zp = sh.groups, sh.zp
    leaves = encode_state(export_state(zp, sh.inner, sh.buffers), zp.partition.spaces)
    leaves.update(encode_parked(sh.parked))  # [Note: parked state]
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
            tensors = {f"region/{b.space.dtype}": b.shard_values() for b in sh.buffers}
            tensors.update(
                {f"master/{b.space.dtype}": b.master[: b.extent] for b in sh.buffers if b.carries_master}
            )
            for leaf_path, leaf in leaves.items():  # [Note: state codec]
                if torch.is_tensor(leaf):
                    tensors[f"state/{leaf_path}"] = leaf
                    meta = tensor_meta(leaf)
                    described: dict[str, Any] = {"dtype": meta.dtype, "ranks": [groups.shard_rank]}
                    if not leaf_path.startswith("flat/"):
                        described["shape"] = list(meta.shape)
                    info["state"][leaf_path] = described
                else:
                    info["state"][leaf_path] = {"value": encode(leaf)}
            shard_file = f"shard-{groups.shard_rank:05d}.pt"
            info["files"][shard_file] = write_tensors(partial / shard_file, tensors)
        frozen = {f"param/{s.index}": sh.params[s.index].detach() for s in zp.specs if not s.trainable}
        if groups.rank == 0 and frozen:
            info["files"]["frozen.pt"] = write_tensors(partial / "frozen.pt", frozen)
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
            write_json(partial / "manifest.json", seal(_manifest(sh, infos, encoded_extra)))
            partial.rename(snapshot)
            _point_latest(root, name)
            cleanup(root, keep, name)
        except Exception as exc:
            problem = as_zeroplan_error(exc, CheckpointError, f"rank 0 could not commit {str(snapshot)!r}")
    verdicts(problem, groups.world, failed="could not commit the snapshot", error=CheckpointError)
    return snapshot


def _manifest(sh: Shards, infos: list[dict[str, Any]], extra: Any) -> dict[str, Any]:
    """The manifest: the plan, every rank's files and state leaves, hyper-parameters and ``extra``."""
    zp = sh.zp
    files: dict[str, int] = {}
    state: dict[str, dict[str, Any]] = {}
    for info in infos:
        files.update(info["files"])
        for leaf_path, described in info["state"].items():
            known = state.setdefault(leaf_path, described)
            if known is not described and "ranks" in described:
                known["ranks"] = sorted({*known["ranks"], *described["ranks"]})
    return {
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


# --------------------------------------------------------------------------- load
@torch.no_grad()
def load(opt: ZeroOptimizer, path: str | Path) -> dict[str, Any]:
    """Load the latest snapshot under ``path`` into ``opt`` and its parameters; collective.

    Works at any world size, shard-group size and strategy. Returns the
    ``extra`` saved with it.

    Raises:
        CheckpointError: missing, incomplete, truncated, corrupted or edited
            files, a ``latest`` that names no snapshot of ``path``, or any
            other failure while reading.
        IncompatiblePlanError: a checkpoint of another model or optimizer
            class, or ranks that read different snapshots.
        In every case, on every rank, and the optimizer and parameters are unchanged.
    """
    sh = opt.shards()
    extra: list[dict[str, Any]] = []

    def read() -> LoadedState:
        loaded, saved_extra = _prepare(sh, opt.plan_with_cohorts, Path(path))
        extra.append(saved_extra)
        return loaded

    opt.restore(agreed_state(read, sh, what="checkpoint", wrap=CheckpointError))
    return extra[0]


def _saved_param(
    saved: PartitionPlan, index: int, open_file: Any, rank: int, world: int
) -> list[torch.Tensor]:
    """Parameter ``index`` as saved, flat, in consecutive parts: its fragments, or ``frozen.pt``.

    Every rank reads every parameter; the checksums of saved shard ``q``'s
    region are verified by rank ``q % world`` only (a failure there fails the
    load on every rank, since all ranks agree before committing).
    """
    spec = saved.specs[index]
    if not spec.trainable:
        return [open_file("frozen.pt").read(f"param/{index}", 0, spec.numel, verify=rank == 0)]
    return [
        open_file(f"shard-{f.rank:05d}.pt").read(
            f"region/{spec.dtype}", f.shard_offset, f.shard_span.stop, verify=f.rank % world == rank
        )
        for f in saved.fragments[index]
    ]


def _prepare(
    sh: Shards, plan_with_cohorts: Callable[[Iterable[int]], ZeroPlan], path: Path
) -> tuple[LoadedState, dict[str, Any]]:
    """Read and check everything this rank needs; change nothing. Returns the state and ``extra``."""
    snapshot = resolve(path)
    manifest = read_manifest(snapshot)  # [Note: manifest integrity]
    if manifest["optimizer"] != sh.optimizer_name:
        raise IncompatiblePlanError(
            f"checkpoint of optimizer {manifest['optimizer']!r}, "
            f"but this ZeroOptimizer wraps {sh.optimizer_name!r}"
        )
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
    shard_rank = sh.groups.shard_rank
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
    params = [_saved_param(saved, spec.index, open_file, rank, world) for spec in saved.specs]
    for i, (parts, p) in enumerate(zip(params, sh.params, strict=True)):
        if any(part.dtype != p.dtype for part in parts):
            raise IncompatiblePlanError(
                f"parameter {i} is {parts[0].dtype} in the checkpoint, {p.dtype} here"
            )

    copies = reshard.reads(shard_rank)
    device = sh.device
    state: dict[str, dict[str, Any]] = manifest["state"]
    masters: dict[str, torch.Tensor] = {}
    leaves: dict[str, Any] = {}
    for space in target.partition.spaces:
        mine = [c for c in copies if c.dtype == space.dtype]
        flat = [p for p in state if p.startswith(f"flat/{space.dtype}/")]
        kinds = [(f"state/{p}", p, torch_dtype(state[p]["dtype"])) for p in flat]
        if space.dtype in manifest["separate_master"]:
            kinds.insert(0, (f"master/{space.dtype}", "", torch.float32))
        for name, leaf_path, dtype in kinds:
            out = torch.zeros(space.extent(shard_rank), dtype=dtype, device=device)  # padding stays zero
            for c in mine:
                if c.dst_span.numel:
                    piece = open_file(f"shard-{c.src_rank:05d}.pt").read(
                        name, c.src_span.start, c.src_span.stop
                    )
                    if piece.dtype != dtype:  # never cast silently (its checking rank reports why)
                        raise CheckpointError(
                            f"{str(snapshot)!r}: {name!r} of shard {c.src_rank} is {piece.dtype}"
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
                stored = open_file(f"shard-{described['ranks'][0]:05d}.pt").tensor(f"state/{leaf_path}")
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
        stored = open_file(f"shard-{described['ranks'][0]:05d}.pt").tensor(f"state/{leaf_path}")
        parked_leaves[leaf_path] = stored.to(device, copy=True)
    shard_state = decode_state(leaves, target.partition.spaces)
    stateful = set(shard_state.scalars) | {
        (target.specs[p].group, target.specs[p].cohort) for p in shard_state.whole
    }
    loaded = LoadedState(
        target=target,
        state=shard_state,
        stateful=stateful,
        masters=masters,
        param_groups=decode(manifest["param_groups"]),
        scaler=manifest["scaler"],
        param_values=params,
        parked=decode_parked(parked_leaves),
        source=manifest["digest"],
    )
    return loaded, decode(manifest["extra"])
