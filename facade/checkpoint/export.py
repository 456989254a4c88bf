"""A checkpoint read offline: what it holds, whether it is intact, and its weights as model files.

[Note: offline export]
``zeroplan inspect`` and ``zeroplan export`` read a committed snapshot in one
process, with no process group and no model. The manifest is read and checked
as ``load`` does (seal, form, partition fingerprints: [Note: manifest
integrity]); every data file is then cross-checked against it (tensor names,
dtypes, shapes) before anything is written. The saved partition says where
each parameter lies: its fragments, in order, in the shard files
(``checkpoint.loading.saved_param``, the reader ``load`` uses); frozen
parameters lie whole in ``frozen.pt``, expert parameters in their group's
expert files. Export walks the parameters in saved order and writes each as
it reads it, part by part, from the memory-mapped files, whose blocks are
checksum-verified as they are read (see [Note: streamed weight files]), and
gives the pages it read back to the kernel once the tensor is written (see
[Note: mapped pages]): the pages of a mapped file stay resident until then,
and the export would otherwise end holding every page of the checkpoint. So
it holds at most one tensor beside constant buffers, allocated or mapped,
whatever the world, stage, layout, shard groups or expert groups of the
saving job. Inspect verifies every block of every file, releasing each
tensor's pages once verified.

Names are those the checkpoint recorded (``named_parameters()`` names given to
``ZeroOptimizer``, else ``group<g>.param<i>``). A parameter is recorded once:
tied weights (GPT-2's ``lm_head.weight``, which is ``transformer.wte.weight``)
appear under their first name only, as ``save_pretrained`` writes them, and
``from_pretrained`` ties them again. Expert parameters keep their names unless
several expert groups use the same name (experts named per rank): those become
``<domain>.group<k>.<name>``, ``k`` the group's position by ranks.

``--dtype fp32`` writes the fp32 masters where the shard files hold them apart
from the parameters (bf16/fp16 parameters); fp32 parameters are their own
masters, and frozen parameters, which have none, are cast up exactly.

A tensor-parallel slice's checkpoint (its manifest records ``tensor_slice``)
is refused: its shard files hold the slice's local tensors under the global
parameter names, and export reads one root. The whole model comes from every
slice's root loaded in tp order into the model without tensor parallelism
(``checkpoint.load(opt, [root_0, ..., root_K-1])``, [Note: reslicing
tensor-parallel checkpoints]) and saved once more, then exported.

Output goes to ``OUT/.zeroplan-export.partial`` and is moved into ``OUT`` only
when every file is written: a damaged checkpoint leaves ``OUT`` as it was.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from zeroplan.core import CheckpointError, ConfigError, ParamSpec, ZeroplanError
from zeroplan.facade.checkpoint.checks import (
    check_against_partition,
    check_expert_group,
    check_frozen_file,
    check_shard_file,
)
from zeroplan.facade.checkpoint.files import TensorFile, decode
from zeroplan.facade.checkpoint.loading import Source, saved_param
from zeroplan.facade.checkpoint.manifest import LeafKind, Manifest, ValueLeaf, read_manifest
from zeroplan.facade.checkpoint.names import (
    FROZEN,
    LATEST,
    MANIFEST,
    TRAINER_DIR,
    expert_file,
    shard_file,
)
from zeroplan.facade.checkpoint.root import resolve
from zeroplan.facade.checkpoint.weight_files import Format, OutTensor, plan_files, write_file, write_index
from zeroplan.facade.mechanisms.torch_dtypes import torch_dtype

__all__ = ["ExportResult", "SavedParam", "Snapshot", "export"]

#: Where an export is written before it is moved into ``OUT``.
STAGING = ".zeroplan-export.partial"
#: The model configuration files copied from a ``ZeroTrainer`` checkpoint folder.
CONFIG_FILES = ("config.json", "generation_config.json")


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedParam:
    """A parameter of a snapshot: the name it is exported under and where its values lie.

    Attributes:
        name: its export name (see [Note: offline export]).
        spec: its saved spec (index within its domain's partition).
        source: the files of its domain (or expert group).
    """

    name: str
    spec: ParamSpec
    source: Source


_TP_SLICE = (
    "{path!r} was saved by tp slice {rank} of {degree}: its files hold that slice's local tensors "
    "under the global parameter names, not the model's weights, and export reads one slice's root. "
    "Load every slice's root in tp order into the model without tensor parallelism "
    "(checkpoint.load(opt, [f'ckpt/tp{{k}}' for k in range({degree})])), save it with "
    "checkpoint.save and export that root; or save the model's DTensors whole with torch's "
    "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))"
)


class Snapshot:
    """A committed snapshot opened offline: manifest checked, data files opened lazily (memory-mapped).

    Args:
        path: a checkpoint root, a snapshot directory, or a ``ZeroTrainer``
            ``checkpoint-N`` folder (its ``zeroplan/`` root).

    Raises:
        CheckpointError: no checkpoint there, or a manifest that is not intact
            or of another (newer) format.
    """

    def __init__(self, path: str | Path) -> None:
        given = Path(path)
        if not given.exists():
            raise CheckpointError(f"no zeroplan checkpoint at {str(given)!r}: the path does not exist")
        root = given
        if (
            not (given / LATEST).is_file()
            and not (given / MANIFEST).is_file()
            and (given / TRAINER_DIR).is_dir()
        ):
            root = given / TRAINER_DIR  # a Trainer checkpoint folder
        self.path = resolve(root)
        try:
            self.manifest: Manifest = read_manifest(self.path)
            check_against_partition(self.manifest, self.path)
            for domain in self.manifest.expert_domains:
                for group in domain.groups:
                    check_expert_group(group, self.path, domain.name)
        except ZeroplanError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as exc:  # sealed, yet not as zeroplan writes it
            raise CheckpointError(
                f"the checkpoint at {str(self.path)!r} has a malformed manifest ({type(exc).__name__}: "
                f"{exc}): it was edited or written by another tool; use an untouched snapshot"
            ) from exc
        #: The ``Trainer`` checkpoint folder the snapshot lies in, if any (its config is the model's).
        self.trainer_folder = root.parent if root.name == TRAINER_DIR else None
        self._files: dict[str, TensorFile] = {}

    def open(self, name: str) -> TensorFile:
        """Data file ``name``, opened once (size checked against the manifest).

        Raises:
            CheckpointError: unlisted, missing, truncated or unreadable.
        """
        if name not in self._files:
            size = self.manifest.size_of(name)
            if size is None:
                raise CheckpointError(
                    f"{str(self.path)!r}: the manifest lists no file {name!r}, which the saved partition "
                    "needs; the snapshot is incomplete"
                )
            self._files[name] = TensorFile(self.path / name, size)
        return self._files[name]

    def cross_check(self) -> None:
        """Every data file holds exactly what the manifest lists (names, dtypes, shapes); no data read.

        Raises:
            CheckpointError: a missing, truncated or mismatched file.
        """
        shards = self.manifest.shards
        for q in range(shards.partition.shard_size):
            check_shard_file(self.open(shard_file(q)), q, shards)
        if FROZEN in self.manifest.names:
            check_frozen_file(self.open(FROZEN), shards.partition)
        for domain in self.manifest.expert_domains:
            for group in domain.groups:
                for q, rank in enumerate(group.ranks):
                    check_shard_file(
                        self.open(expert_file(domain.name, rank)), q, group.shards, frozen=q == 0
                    )

    def verify(self) -> int:
        """Read every tensor of every data file, verifying each block's checksum; return the bytes read.

        Raises:
            CheckpointError: a checksum mismatch (naming file, tensor and elements).
        """
        verified = 0
        for listed in self.manifest.files:
            file = self.open(listed.name)
            for name in file.names():
                meta = file.meta(name)
                numel = 1
                for n in meta.shape:
                    numel *= n
                part = file.read(name, 0, numel)
                verified += part.numel() * part.element_size()
                file.release()  # [Note: mapped pages]
        return verified

    def params(self) -> list[SavedParam]:
        """Every saved parameter in saved order: the data domain's, then each expert group's.

        Raises:
            CheckpointError: two parameters of the data domain share a name.
        """
        data = Source(self.manifest.shards, shard_file, FROZEN, 0, 1)
        found = [SavedParam(name=s.name, spec=s, source=data) for s in self.manifest.shards.partition.specs]
        experts: list[tuple[str, int, SavedParam]] = []
        for domain in self.manifest.expert_domains:
            for k, group in enumerate(domain.groups):
                files = [expert_file(domain.name, rank) for rank in group.ranks]
                source = Source(group.shards, files.__getitem__, files[0], 0, 1)
                specs = group.shards.partition.specs
                experts += [(domain.name, k, SavedParam(name=s.name, spec=s, source=source)) for s in specs]
        names = [p.name for p in found]
        if len(set(names)) < len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise CheckpointError(
                f"{str(self.path)!r} records parameters named {twice} more than once: their weights cannot "
                "be told apart by name; build the optimizer from model.named_parameters()"
            )
        counts: dict[str, int] = {}
        for _, _, p in experts:
            counts[p.name] = counts.get(p.name, 0) + 1
        taken = set(names)
        for domain, k, p in experts:
            repeated = counts[p.name] > 1 or p.name in taken
            name = f"{domain}.group{k}.{p.name}" if repeated else p.name
            found.append(SavedParam(name=name, spec=p.spec, source=p.source))
        return found

    def parts(self, param: SavedParam, *, master: bool) -> Iterator[torch.Tensor]:
        """The values of ``param``, flat, in consecutive parts, each verified as it is read."""
        yield from saved_param(param.source, param.spec.index, self.open, master=master)

    def release(self) -> None:
        """Give the pages read so far from every open file back to the kernel ([Note: mapped pages])."""
        for file in self._files.values():
            file.release()

    def step(self) -> int | None:
        """The inner optimizer's largest ``step`` (scalar state), ``None`` if it keeps none."""
        steps = []
        for leaf in self.manifest.shards.leaves_of(LeafKind.SCALARS):
            values = decode(leaf.value) if isinstance(leaf, ValueLeaf) else None
            if isinstance(values, dict) and "step" in values:
                steps.append(int(float(values["step"])))
        return max(steps, default=None)

    def describe(self) -> dict[str, Any]:
        """What the snapshot holds, as plain data (``zeroplan inspect --json``)."""
        m = self.manifest
        partition = m.shards.partition

        def summary(specs: Iterable[ParamSpec]) -> dict[str, Any]:
            specs = list(specs)
            by_dtype: dict[str, int] = {}
            for s in specs:
                by_dtype[s.dtype] = by_dtype.get(s.dtype, 0) + s.numel
            frozen = sum(1 for s in specs if not s.trainable)
            return {
                "count": len(specs),
                "trainable": len(specs) - frozen,
                "frozen": frozen,
                "elements": sum(by_dtype.values()),
                "elements_by_dtype": by_dtype,
            }

        files = {f.name: f.size for f in m.files}
        manifest_bytes = (self.path / MANIFEST).stat().st_size
        return {
            "snapshot": str(self.path),
            "format": m.format,
            "world_size": m.world_size,
            "shard_size": m.shard_size,
            "stage": int(m.stage),
            "layout": partition.layout,
            "strategy": partition.strategy,
            "optimizer": m.optimizer,
            "step": self.step(),
            "parameters": summary(partition.specs),
            "separate_master": list(m.shards.separate_master),
            "loss_scaler": m.scaler is not None,
            "expert_domains": [
                {
                    "name": d.name,
                    "groups": [list(g.ranks) for g in d.groups],
                    "parameters": summary(s for g in d.groups for s in g.shards.partition.specs),
                }
                for d in m.expert_domains
            ],
            "files": files,
            "bytes": sum(files.values()) + manifest_bytes,
            "extra": sorted(decode(m.extra)),
            "digest": m.digest,
        }


class ExportResult(NamedTuple):
    """What :func:`export` wrote.

    Attributes:
        files: the files written into ``OUT``, by name (weights, index, copied config).
        tensors: how many tensors.
        nbytes: the tensors' bytes.
        largest: the bytes of the largest tensor.
    """

    files: tuple[str, ...]
    tensors: int
    nbytes: int
    largest: int


def export(
    checkpoint: str | Path,
    out: str | Path,
    *,
    fmt: Format = Format.SAFETENSORS,
    fp32: bool = False,
    max_shard_bytes: int = 5 * 10**9,
) -> ExportResult:
    """Write the weights of ``checkpoint`` into directory ``out`` (see [Note: offline export]).

    Args:
        checkpoint: a checkpoint root, snapshot or ``ZeroTrainer`` checkpoint folder.
        out: a directory that does not exist or is empty.
        fmt: safetensors (``model.safetensors``) or torch (``pytorch_model.bin``).
        fp32: write the fp32 masters instead of the parameters' dtype.
        max_shard_bytes: split into several files with an index above this size.

    Returns:
        What was written.

    Raises:
        ConfigError: ``out`` exists and is not an empty directory, or the checkpoint is one
            tensor-parallel slice's (nothing written; [Note: offline export]).
        CheckpointError: the checkpoint is missing, damaged or of a newer format
            (``out`` left as it was).
    """
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(
            f"{str(target)!r} exists and is not an empty directory: export writes into a new or empty "
            "directory and overwrites nothing; choose another OUT or empty it first"
        )
    snapshot = Snapshot(checkpoint)
    if snapshot.manifest.tensor_slice is not None:
        rank, degree = snapshot.manifest.tensor_slice
        raise ConfigError(_TP_SLICE.format(path=str(snapshot.path), rank=rank, degree=degree))
    snapshot.cross_check()  # every file's names, dtypes and shapes before anything is written
    params = {p.name: p for p in snapshot.params()}  # names are unique (see Snapshot.params)
    tensors = [
        OutTensor(name=p.name, shape=p.spec.shape, dtype=torch.float32 if fp32 else torch_dtype(p.spec.dtype))
        for p in params.values()
    ]

    def parts_of(t: OutTensor) -> Iterator[torch.Tensor]:
        yield from snapshot.parts(params[t.name], master=fp32)
        snapshot.release()  # t is written (or copied): its pages go back ([Note: mapped pages])

    created = not target.exists()
    staging = target / STAGING
    try:
        staging.mkdir(parents=True)
        groups = plan_files(tensors, max_shard_bytes)
        named = [(fmt.shard_name(i + 1, len(groups)), group) for i, group in enumerate(groups)]
        for name, group in named:
            write_file(staging / name, group, parts_of, fmt)
        if len(named) > 1:
            write_index(staging / fmt.index, named)
        if snapshot.trainer_folder is not None:
            for config in CONFIG_FILES:
                if (snapshot.trainer_folder / config).is_file():
                    shutil.copyfile(snapshot.trainer_folder / config, staging / config)
        written = sorted(path.name for path in staging.iterdir())
        for name in written:
            (staging / name).rename(target / name)
        staging.rmdir()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            shutil.rmtree(target, ignore_errors=True)
        raise
    sizes = [t.nbytes for t in tensors]
    return ExportResult(
        files=tuple(written), tensors=len(tensors), nbytes=sum(sizes), largest=max(sizes, default=0)
    )
