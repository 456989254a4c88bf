"""Elastic, crash-safe checkpoints of a ``ZeroOptimizer`` and its parameters.

[Note: checkpoint layout]
``save(opt, path)`` writes a *snapshot* directory and commits it atomically::

    path/
      latest                      # name of the committed snapshot (atomic rename)
      snapshot-00000007/
        manifest.json             # plan, specs, fragments, state leaves, hyper-parameters, extra
        frozen.pt                 # frozen parameters, if any, whole (written by rank 0)
        shard-00000.pt ...        # per shard rank: its region of the parameters, its fp32
                                  # masters and the tensor leaves of its optimizer state

Optimizer state is written as the leaves of [Note: state codec]: tensors go to
the shard files under ``state/<leaf path>`` and the manifest records, per
leaf, its dtype and the ranks whose file holds it, or, for plain values (the
scalar state of a cohort), the value itself.

Files hold tensors and plain data only (``torch.load(weights_only=True)``) with a
crc32 per 1 MiB block. Each snapshot is written under ``snapshot-N.partial``;
only when every rank has written and fsynced its file does rank 0 write the
manifest, rename the directory and point ``latest`` at it. Every shard rank
writes an equal share, parameters included, so saving runs in parallel. A save interrupted
at any point leaves the previous snapshot as ``latest`` and no directory that
loads as valid (a ``.partial`` one has no manifest and is never referenced).

``load(opt, path)`` rebuilds the saved partition from the manifest, asks the
core for a reshard plan to the running optimizer's plan (any world size, shard
size or strategy), and each rank reads, memory-mapped, only the pieces that
plan assigns it, verifying their blocks. Everything is read and checked before
anything changes, and all ranks agree on success before any of them commits.

``torch.distributed.checkpoint`` is not used: its metadata file is a pickle of
its own classes, which the "plain data only" requirement rules out; the
resharding it would provide is the core's reshard plan here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from zeroplan.core import (
    CheckpointError,
    ConfigError,
    IncompatiblePlanError,
    ParamSpec,
    PartitionPlan,
    Span,
    ZeroPlan,
    ZeroplanError,
    compare_specs,
    plan_from_assignment,
    plan_reshard,
)
from zeroplan.facade.checkpoint_files import TensorFile, decode, encode, read_json, write_json, write_tensors
from zeroplan.facade.collectives import all_gather_objects
from zeroplan.facade.groups import ProcessGroups
from zeroplan.facade.inner import hyperparameters
from zeroplan.facade.shard_state import export_state
from zeroplan.facade.state_dicts import Shards
from zeroplan.facade.state_loading import LoadedState
from zeroplan.facade.state_tree import decode_state, encode_state, tensor_meta, torch_dtype, tree_clone

if TYPE_CHECKING:
    from zeroplan.facade.optimizer import ZeroOptimizer

__all__ = ["latest", "load", "save"]

FORMAT = "zeroplan.checkpoint/v2"
_PARTIAL = ".partial"


# --------------------------------------------------------------------------- helpers
def _world_objects(obj: Any, groups: ProcessGroups) -> list[Any]:
    return all_gather_objects(obj, groups.world)


def _raise_first(statuses: list[Any], mine: BaseException | None) -> None:
    """Raise on every rank if any rank failed (the failing rank re-raises its own error)."""
    if mine is not None:
        raise mine
    for rank, status in enumerate(statuses):
        if status is not None:
            raise CheckpointError(f"rank {rank} failed: {status}")


def _snapshots(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("snapshot-*") if p.is_dir() and not p.name.endswith(_PARTIAL))


def _resolve(path: Path) -> Path:
    """The committed snapshot ``path`` refers to (a checkpoint root or a snapshot directory)."""
    if path.name.endswith(_PARTIAL):
        raise CheckpointError(f"{str(path)!r} is an interrupted save, not a checkpoint")
    if (path / "latest").is_file():
        name = (path / "latest").read_text().strip()
        snapshot = path / name
        if not snapshot.is_dir():
            raise CheckpointError(f"{str(path)!r}: 'latest' names {name!r}, which does not exist")
        return snapshot
    if (path / "manifest.json").is_file():
        return path
    raise CheckpointError(f"no zeroplan checkpoint at {str(path)!r} (no 'latest' and no manifest.json)")


def _partition_document(partition: PartitionPlan) -> dict[str, Any]:
    return {
        "strategy": partition.strategy,
        "alignment": partition.alignment,
        "shard_size": partition.shard_size,
        "fingerprint": partition.fingerprint(),
        "specs": [[s.name, list(s.shape), s.dtype, s.group, s.trainable, s.cohort] for s in partition.specs],
        "fragments": [
            [[f.rank, f.param_span.start, f.param_span.stop] for f in frags] for frags in partition.fragments
        ],
    }


def _partition_from(document: dict[str, Any]) -> PartitionPlan:
    specs = tuple(
        ParamSpec(
            index=i,
            name=name,
            shape=tuple(shape),
            dtype=dtype,
            group=group,
            trainable=trainable,
            cohort=cohort,
        )
        for i, (name, shape, dtype, group, trainable, cohort) in enumerate(document["specs"])
    )
    pieces = [
        (p, Span(start, stop), rank)
        for p, frags in enumerate(document["fragments"])
        for rank, start, stop in frags
    ]
    partition = plan_from_assignment(
        specs, document["shard_size"], document["alignment"], document["strategy"], pieces
    )
    if partition.fingerprint() != document["fingerprint"]:
        raise CheckpointError(
            "the manifest's partition does not match its fingerprint: the manifest is corrupted"
        )
    return partition


def _remove(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def _point_latest(root: Path, name: str) -> None:
    """Atomically make ``root/latest`` name snapshot ``name``."""
    temporary = root / "latest.tmp"
    with open(temporary, "w") as handle:
        handle.write(name)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, root / "latest")


def latest(path: str | Path) -> Path | None:
    """The committed snapshot under ``path``, or ``None`` if there is none (yet).

    An interrupted first save (only a ``.partial`` directory) counts as none,
    so a job can start from scratch. A damaged checkpoint is not hidden: this
    does not read its files, ``load`` verifies them.
    """
    root = Path(path)
    try:
        return _resolve(root)
    except CheckpointError:
        return None


# --------------------------------------------------------------------------- save
@torch.no_grad()
def save(opt: ZeroOptimizer, path: str | Path, *, extra: dict[str, Any] | None = None, keep: int = 1) -> Path:
    """Save ``opt``, its parameters and ``extra`` to ``path``; collective.

    Args:
        opt: the optimizer; every parameter it manages is saved.
        path: checkpoint root directory (shared by all ranks).
        extra: plain data to store alongside (step number, scheduler state, ...).
        keep: committed snapshots to keep (the newest ones).

    Returns:
        The committed snapshot directory.

    Raises:
        CheckpointError: a rank could not write; the previous snapshot stays ``latest``.
    """
    if not (type(keep) is int and keep >= 1):
        raise ConfigError(f"keep must be an int >= 1, got {keep!r}")
    root = Path(path)
    sh = opt.shards()
    groups, zp = sh.groups, sh.zp
    name: list[Any] = [None]
    if groups.rank == 0:
        with contextlib.suppress(OSError):
            root.mkdir(parents=True, exist_ok=True)
        existing = [
            int(p.name.split("-")[1].split(".")[0])
            for p in root.glob("snapshot-*")
            if p.name.split("-")[1].split(".")[0].isdigit()
        ]
        name = [f"snapshot-{max(existing, default=0) + 1:08d}"]
    dist.broadcast_object_list(name, group_src=0, group=groups.world)
    partial = root / (name[0] + _PARTIAL)
    problem: BaseException | None = None
    leaves = encode_state(export_state(zp, sh.inner, sh.buffers), zp.partition.spaces)
    try:
        if groups.rank == 0:
            partial.mkdir(parents=True)
    except OSError as exc:
        problem = CheckpointError(f"cannot create {str(partial)!r}: {exc}")
    _raise_first(_world_objects(None if problem is None else str(problem), groups), problem)

    info: dict[str, Any] = {"files": {}, "state": {}}
    try:
        if groups.replica_rank == 0:
            tensors = {f"region/{b.space.dtype}": b.region(groups.shard_rank) for b in sh.buffers}
            tensors.update(
                {f"master/{b.space.dtype}": b.master[: b.owned] for b in sh.buffers if b.separate_master}
            )
            for leaf_path, leaf in leaves.items():  # [Note: state codec]
                if torch.is_tensor(leaf):
                    tensors[f"state/{leaf_path}"] = leaf
                    info["state"][leaf_path] = {
                        "dtype": tensor_meta(leaf).dtype,
                        "ranks": [groups.shard_rank],
                    }
                else:
                    info["state"][leaf_path] = {"value": encode(leaf)}
            shard_file = f"shard-{groups.shard_rank:05d}.pt"
            info["files"][shard_file] = write_tensors(partial / shard_file, tensors)
        frozen = {f"param/{s.index}": sh.params[s.index].detach() for s in zp.specs if not s.trainable}
        if groups.rank == 0 and frozen:
            info["files"]["frozen.pt"] = write_tensors(partial / "frozen.pt", frozen)
    except Exception as exc:  # any I/O failure must reach every rank, not hang them
        problem = CheckpointError(f"rank {groups.rank} could not write its checkpoint file: {exc}")
    everyone = _world_objects({"problem": None if problem is None else str(problem), "info": info}, groups)
    if groups.rank == 0 and any(e["problem"] for e in everyone):
        shutil.rmtree(partial, ignore_errors=True)
    _raise_first([e["problem"] for e in everyone], problem)

    snapshot = root / name[0]
    try:
        if groups.rank == 0:
            write_json(partial / "manifest.json", _manifest(sh, [e["info"] for e in everyone], extra))
            partial.rename(snapshot)
            _point_latest(root, name[0])
            doomed = _snapshots(root)[:-keep] + list(root.glob(f"snapshot-*{_PARTIAL}"))
            # Old snapshots are no longer referenced: delete them without holding up training.
            threading.Thread(target=_remove, args=(doomed,), daemon=True).start()
    except (OSError, ZeroplanError) as exc:
        problem = CheckpointError(f"rank 0 could not commit {str(snapshot)!r}: {exc}")
    _raise_first(_world_objects(None if problem is None else str(problem), groups), problem)
    return snapshot


def _manifest(sh: Shards, infos: list[dict[str, Any]], extra: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest: the plan, every rank's files and state leaves, hyper-parameters and ``extra``."""
    zp = sh.zp
    files: dict[str, str] = {}
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
        "partition": _partition_document(zp.partition),
        "separate_master": [b.space.dtype for b in sh.buffers if b.separate_master],
        "state": state,
        "param_groups": encode([hyperparameters(g) for g in sh.param_groups]),
        "scaler": None if sh.scaler is None else sh.scaler.as_dict(),
        "files": files,
        "extra": encode(extra or {}),
    }


# --------------------------------------------------------------------------- load
@torch.no_grad()
def load(opt: ZeroOptimizer, path: str | Path) -> dict[str, Any]:
    """Load the latest snapshot under ``path`` into ``opt`` and its parameters; collective.

    Works at any world size, shard-group size and strategy. Returns the
    ``extra`` saved with it.

    Raises:
        CheckpointError: missing, incomplete, truncated or corrupted files.
        IncompatiblePlanError: a checkpoint of another model or optimizer class.
        In every case, on every rank, and the optimizer and parameters are unchanged.
    """
    problem: BaseException | None = None
    loaded, extra = None, None
    sh = opt.shards()
    try:
        loaded, extra = _prepare(sh, opt.plan_with_cohorts, Path(path))
    except (ZeroplanError, OSError) as exc:
        problem = exc if isinstance(exc, ZeroplanError) else CheckpointError(str(exc))
    verdict = None if problem is None else f"{type(problem).__name__}: {problem}"
    _raise_first(_world_objects(verdict, sh.groups), problem)
    if loaded is None:  # unreachable: _raise_first raised
        raise RuntimeError("checkpoint load prepared nothing")
    opt.restore(loaded)
    return extra


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
    snapshot = _resolve(path)
    manifest = read_json(snapshot / "manifest.json")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{str(snapshot)!r}: unknown checkpoint format {manifest.get('format')!r}")
    if manifest["optimizer"] != sh.optimizer_name:
        raise IncompatiblePlanError(
            f"checkpoint of optimizer {manifest['optimizer']!r}, "
            f"but this ZeroOptimizer wraps {sh.optimizer_name!r}"
        )
    saved = _partition_from(manifest["partition"])
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
    params = [_saved_param(saved, spec.index, open_file, rank, world) for spec in saved.specs]
    for i, (parts, p) in enumerate(zip(params, sh.params, strict=True)):
        if any(part.dtype != p.dtype for part in parts):
            raise IncompatiblePlanError(
                f"parameter {i} is {parts[0].dtype} in the checkpoint, {p.dtype} here"
            )

    copies = reshard.reads(shard_rank)
    device = sh.buffers[0].params.device if sh.buffers else torch.device("cpu")
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
            out = torch.empty(space.owned[shard_rank], dtype=dtype, device=device)  # the copies tile it
            for c in mine:
                if c.dst_span.numel:
                    out[c.dst_span.as_slice()] = open_file(f"shard-{c.src_rank:05d}.pt").read(
                        name, c.src_span.start, c.src_span.stop
                    )
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
    )
    return loaded, decode(manifest["extra"])
