"""Loading checkpoints saved at another tensor-parallel degree, by global coordinates.

[Note: reslicing tensor-parallel checkpoints]
A tensor-parallel job saves one checkpoint root per ``tp`` slice (each slice's optimizer over its
data-parallel group; ``checkpoint.save(opt, f"{root}/tp{t}")``). Loading at the same degree reads
the slice's own root at any dp size. Loading at another degree (or into a plain model: degree 1)
takes every slice's root, in tp order: ``checkpoint.load(opt, [f"{root}/tp{k}" for k in range(K)])``.

Each manifest records every parameter's local shape, global shape and placement ([Note: placements]
in ``zeroplan.core.placement``). For each parameter and each saved tensor (its values, its fp32
master where the files hold one apart, each per-element state leaf) this rank reads the parameter's
local tensor from every old slice, joins them along the split dimension into the global tensor
(``Replicate()``: slice 0's), and cuts its own local tensor from it by torch's ``chunk`` rule. The
result is presented to the ordinary loader as a checkpoint of one shard holding this rank's local
tensors whole (:class:`_Resliced`), so the reshard into the running plan, the checks and the
agreement are the loader's own ([Note: load agreement]); one verdict over the job then covers every
data-parallel group. Each rank holds its local tensors' saved values whole while it loads (the
model's slice, per state tensor): the loader's bounded reads do not apply here. Elementwise
optimizers only; the scalar state (Adam's ``step``) must agree across the slices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from zeroplan.core import (
    CheckpointError,
    IncompatiblePlanError,
    ParamSpec,
    Topology,
    chunk_rows,
    plan,
    plan_reshard,
    tensor_split,
)
from zeroplan.facade.checkpoint import background
from zeroplan.facade.checkpoint.checks import check_shard_files_present
from zeroplan.facade.checkpoint.files import TensorFile, decode
from zeroplan.facade.checkpoint.loading import Source, domain_shards, read_state
from zeroplan.facade.checkpoint.manifest import LeafKind, Manifest, ValueLeaf, read_manifest
from zeroplan.facade.checkpoint.names import (
    FROZEN,
    master_tensor,
    param_tensor,
    region_tensor,
    shard_file,
    state_tensor,
)
from zeroplan.facade.checkpoint.root import resolve
from zeroplan.facade.mechanisms.agreement import verdicts
from zeroplan.facade.mechanisms.torch_dtypes import torch_dtype
from zeroplan.facade.state.restore import LoadedState, agreed_state

if TYPE_CHECKING:
    from zeroplan.facade.runtime.optimizer import ZeroOptimizer

__all__ = ["load_resliced"]

_VIRTUAL = "resliced"


def load_resliced(opt: ZeroOptimizer, roots: Sequence[str | Path]) -> dict[str, Any]:
    """Load the checkpoint whose tp slice ``k`` was saved under ``roots[k]`` ([Note: reslicing
    tensor-parallel checkpoints]); collective over the job. Returns the ``extra`` of slice 0.

    Raises:
        CheckpointError: a root without a snapshot, files missing or corrupted, slices that do not
            form one model (other names, global shapes, placements, or local shapes that are not
            torch's ``chunk`` of ``len(roots)``), scalar state that differs between slices, state
            that is not per element, or expert groups.
        IncompatiblePlanError: another model or optimizer than this one.
        In every case, on every rank of the job, and nothing is changed.
    """
    background.finish_pending(opt)
    sh, experts = domain_shards(opt)
    extra: list[Any] = []

    def read() -> LoadedState:
        if experts:
            raise CheckpointError(
                "reslicing a tensor-parallel checkpoint with expert groups is not supported"
            )
        slices = [_Slice.open(Path(root)) for root in roots]
        if not slices:
            raise CheckpointError("no checkpoint roots given: pass every tp slice's root, in tp order")
        one_save(slices)
        extra.append(decode(slices[0].manifest.extra))
        saved_by = {s.manifest.optimizer for s in slices}
        if saved_by != {sh.optimizer_name}:
            raise IncompatiblePlanError(
                f"the checkpoint was saved by {sorted(saved_by)}, this optimizer steps {sh.optimizer_name}"
            )
        rank, degree = sh.tensor_slice
        target = opt.plan_with_cohorts([s.cohort for s in slices[0].manifest.shards.partition.specs])
        resliced = _Resliced.build(slices, target.specs, rank, degree)
        virtual = resliced.partition
        source = Source(
            dataclasses.replace(slices[0].manifest.shards, partition=virtual), _shard, FROZEN, 0, 1
        )
        return read_state(
            source,
            target,
            plan_reshard(virtual, target.partition),
            sh,
            resliced.open,
            scaler=slices[0].manifest.scaler,
            digest=None,
        )

    problem: Exception | None = None
    loaded = None
    try:
        loaded = agreed_state(read, sh, what="checkpoint", wrap=CheckpointError)
    except Exception as exc:  # another data-parallel group (tp slice) must hear of it too
        problem = exc
    verdicts(problem, dist.group.WORLD, failed="(in another tp slice) could not load the checkpoint")
    assert loaded is not None
    opt.restore(loaded)
    return extra[0]


def _shard(q: int) -> str:
    """The one file of the resliced checkpoint (every shard ``q`` is shard 0)."""
    del q
    return _VIRTUAL


@dataclasses.dataclass(frozen=True)
class _Slice:
    """One saved tp slice: its manifest and its files, opened on demand."""

    snapshot: Path
    manifest: Manifest
    files: dict[str, TensorFile]

    @classmethod
    def open(cls, root: Path) -> _Slice:
        snapshot = resolve(root)
        manifest = read_manifest(snapshot)
        check_shard_files_present(manifest, snapshot)
        if manifest.expert_domains:
            raise CheckpointError(f"{str(root)!r} holds expert groups: reslicing them is not supported")
        if not manifest.elementwise:
            raise CheckpointError(
                f"{str(root)!r} was saved by {manifest.optimizer}, whose state is not per element: "
                "reslicing takes elementwise optimizers only"
            )
        return cls(snapshot, manifest, {})

    def file(self, name: str) -> TensorFile:
        if name not in self.files:
            size = self.manifest.size_of(name)
            if size is None:
                raise CheckpointError(f"{str(self.snapshot)!r}: the manifest lists no file {name!r}")
            self.files[name] = TensorFile(self.snapshot / name, size)
        return self.files[name]

    def local(self, index: int, name: Callable[[str], str]) -> torch.Tensor:
        """Parameter ``index``'s saved local tensor ``name(dtype)`` (values, master or a state leaf)."""
        shards = self.manifest.shards
        spec = shards.partition.specs[index]
        if not spec.trainable:
            return self.file(FROZEN).read(param_tensor(index), 0, spec.numel).view(spec.shape)
        parts = [
            self.file(shard_file(f.rank)).read(name(spec.dtype), f.shard_offset, f.shard_span.stop)
            for f in shards.partition.fragments[index]
        ]
        return torch.cat(parts).view(spec.shape) if parts else torch.empty(spec.shape)


def one_save(slices: Sequence[_Slice]) -> None:
    """Raise unless the slices' snapshots are one save: the same number ([Note: one save across slices]
    in ``checkpoint.slices``)."""
    saves = {s.snapshot.name for s in slices}
    if len(saves) > 1:
        listing = "; ".join(f"slice {k}: {str(s.snapshot)!r}" for k, s in enumerate(slices))
        raise CheckpointError(
            f"the tp slices' roots hold different saves ({listing}; their snapshot numbers "
            "differ): a job stopped between the slices' commits leaves this. Pass the snapshot "
            "directories of one save, the same number in every root"
        )


def _check(slices: Sequence[_Slice], specs: Sequence[ParamSpec]) -> None:
    """Raise unless the slices are one model's, in tp order, and the running one is that model too."""
    degree = len(slices)
    for k, s in enumerate(slices):
        saved = s.manifest.tensor_slice or (0, 1)
        if saved != (k, degree):
            raise CheckpointError(
                f"{str(s.snapshot)!r} was saved by tp slice {saved[0]} of {saved[1]}, given as slice {k} of "
                f"{degree}: pass every slice's root, in tp order"
            )
    saved = [s.manifest.shards.partition.specs for s in slices]
    if any(len(s) != len(specs) for s in saved):
        raise IncompatiblePlanError(
            f"the slices hold {[len(s) for s in saved]} parameters, this optimizer {len(specs)}"
        )
    for i, spec in enumerate(specs):
        for k, mine in enumerate(s[i] for s in saved):
            if (mine.name, mine.dtype, mine.global_shape) != (spec.name, spec.dtype, spec.global_shape):
                raise IncompatiblePlanError(
                    f"parameter {i}: saved as {mine.name!r} {mine.dtype} of global shape {mine.global_shape} "
                    f"(tp slice {k}), here {spec.name!r} {spec.dtype} of global shape {spec.global_shape}"
                )
            d = tensor_split(mine)
            if d is not None and mine.shape[d] != chunk_rows(mine.global_shape[d], k, degree).numel:
                raise CheckpointError(
                    f"parameter {mine.name!r}: tp slice {k} holds {mine.shape[d]} rows of dimension {d}, not "
                    f"its part of {degree} slices: pass every slice's root, in tp order"
                )
        here, there = tensor_split(spec), tensor_split(saved[0][i])
        if here is not None and there is not None and here != there:
            raise IncompatiblePlanError(
                f"parameter {spec.name!r}: saved split along {there}, here along {here}"
            )
    for leaf in slices[0].manifest.shards.state:
        if leaf.kind in (LeafKind.WHOLE, LeafKind.PARKED):
            raise CheckpointError(
                f"state leaf {leaf.path!r} is not per element: reslicing takes elementwise optimizers only"
            )
        if isinstance(leaf, ValueLeaf):
            for k, other in enumerate(slices[1:], start=1):
                theirs = next((x for x in other.manifest.shards.state if x.path == leaf.path), None)
                if not isinstance(theirs, ValueLeaf) or decode(theirs.value) != decode(leaf.value):
                    raise CheckpointError(f"state {leaf.path!r} differs between tp slices 0 and {k}")


@dataclasses.dataclass(frozen=True)
class _Resliced:
    """This rank's local tensors cut from the saved slices, as a checkpoint of one shard: the loader
    reads it through :meth:`open` like the files of a snapshot."""

    partition: Any
    tensors: dict[str, torch.Tensor]

    @classmethod
    def build(cls, slices: Sequence[_Slice], specs: Sequence[ParamSpec], rank: int, degree: int) -> _Resliced:
        _check(slices, specs)
        shards = slices[0].manifest.shards
        virtual = plan(specs, Topology(world_size=1), stage=2).partition
        tensors: dict[str, torch.Tensor] = {}
        for space in virtual.spaces:
            names: list[tuple[Callable[[str], str], torch.dtype]] = [
                (region_tensor, torch_dtype(space.dtype))
            ]
            if space.dtype in shards.separate_master:
                names.append((master_tensor, torch.float32))
            leaves = shards.flat_leaves(space.dtype)
            names += [(_leaf_name(leaf.path), torch_dtype(leaf.dtype)) for leaf in leaves]
            for name, dtype in names:
                flat = torch.zeros(space.extent(0), dtype=dtype)
                for index in space.params:
                    whole = _cut(slices, specs[index], index, name, rank, degree).reshape(-1)
                    for f in virtual.fragments[index]:
                        flat[f.shard_offset : f.shard_span.stop] = whole[f.param_span.as_slice()]
                tensors[name(space.dtype)] = flat
        for spec in specs:
            if not spec.trainable:
                tensors[param_tensor(spec.index)] = _cut(
                    slices, spec, spec.index, region_tensor, rank, degree
                )
        return cls(virtual, tensors)

    def open(self, name: str) -> _ResolvedFile:
        """The one file of this checkpoint (``FROZEN`` and the shard are the same tensors)."""
        del name
        return _ResolvedFile(self.tensors)


@dataclasses.dataclass(frozen=True)
class _ResolvedFile:
    """What the loader reads of a file: named flat tensors, already verified (each slice's reads were)."""

    tensors: dict[str, torch.Tensor]
    path: Path = Path(_VIRTUAL) / _VIRTUAL

    def read(self, name: str, start: int, stop: int, *, verify: bool = True) -> torch.Tensor:
        del verify
        return self.tensors[name].reshape(-1)[start:stop]

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def _leaf_name(path: str) -> Callable[[str], str]:
    """The tensor name of state leaf ``path`` (the same in every space it belongs to)."""
    return lambda dtype: state_tensor(path)


def _cut(
    slices: Sequence[_Slice], spec: ParamSpec, index: int, name: Callable[[str], str], rank: int, degree: int
) -> torch.Tensor:
    """Parameter ``index``'s saved tensor ``name`` as tp rank ``rank`` of ``degree`` holds it."""
    saved = slices[0].manifest.shards.partition.specs[index]
    d = tensor_split(saved)
    if d is None:
        whole = slices[0].local(index, name)
    else:
        whole = torch.cat([s.local(index, name) for s in slices], dim=d)
    here = tensor_split(spec)
    if here is None:
        return whole.contiguous()
    rows = chunk_rows(whole.shape[here], rank, degree)
    return whole.narrow(here, rows.start, rows.numel).contiguous()
