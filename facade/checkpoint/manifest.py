"""A snapshot's manifest as a typed value: written sealed, read only if intact and well formed.

[Note: manifest integrity]
The manifest is the one file a shard checksum does not cover, and it carries
what the data files do not: hyper-parameters, scalar optimizer state (Adam's
``step``), the scaler, which dtypes have fp32 masters, which state leaves
exist. So it is checked three ways before anything is read from the data:

1. *Sealed*: ``digest`` is the sha256 of the rest of the document in
   canonical JSON (:func:`seal`); an edited or damaged manifest fails it.
2. *Well formed*: every field has its type, every state leaf its kind's form
   and every partition its fingerprint (:func:`read_manifest`), and
   ``separate_master``, the state leaves and the file list are what the saved
   partition implies (:func:`~zeroplan.facade.checkpoint.checks.check_against_partition`).
3. *Cross-checked*: each shard file holds exactly the tensors the manifest
   lists for it, with the listed dtypes and the shapes the partition implies
   (``check_shard_file``, ``check_frozen_file`` in ``checkpoint.checks``). Each
   rank checks the files whose checksums it verifies (shard ``q``: rank
   ``q % world``), and all ranks agree before committing, so every file is
   checked once.

A manifest rewritten and sealed again by a tool passes 1 and 2; 3 still
catches anything it says about the data (dtypes, keys, shapes, masters).

A snapshot of an optimizer with expert groups has format :data:`EXPERTS_FORMAT`
and an ``experts`` section (see [Note: checkpoint layout]); each expert group's
entry is checked the same three ways (``check_expert_group``, and
``check_shard_file`` on each expert file by the rank that wrote it).

[Note: typed manifest]
This module is the only one that reads or writes the manifest's JSON.
:func:`read_manifest` checks 1 and the form of 2 on the document and parses
it once into a :class:`Manifest` (partitions rebuilt into ``PartitionPlan``);
the loader and the checks read its attributes. The writer builds a
``Manifest`` and writes :meth:`Manifest.sealed`. The order of the keys in
:meth:`Manifest.document` is part of the format: the digest does not depend on
it (canonical JSON), but the manifest's bytes do, and a manifest saved twice
from the same state must be the same file. Opaque payloads (hyper-parameters,
plain state values, ``extra``, the scaler) stay in their encoded JSON form
(:func:`~zeroplan.facade.checkpoint.files.encode`); their readers decode them.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeAlias

from zeroplan.core import (
    CheckpointError,
    Fragment,
    ParamSpec,
    PartitionPlan,
    Span,
    Stage,
    plan_from_assignment,
)
from zeroplan.core.errors import require
from zeroplan.core.placement import placement_from_key, placement_key
from zeroplan.facade.checkpoint.files import read_json
from zeroplan.facade.checkpoint.names import MANIFEST
from zeroplan.facade.mechanisms.torch_dtypes import torch_dtype

__all__ = [
    "EXPERTS_FORMAT",
    "FORMAT",
    "MISMATCH",
    "Encoded",
    "ExpertDomain",
    "ExpertGroup",
    "LeafKind",
    "ListedFile",
    "Manifest",
    "SavedShards",
    "StateLeaf",
    "TensorLeaf",
    "ValueLeaf",
    "read_manifest",
    "seal",
]

FORMAT = "zeroplan.checkpoint/v3"
#: The format of a snapshot with expert files: v3 plus ``experts`` (older readers refuse it by name).
EXPERTS_FORMAT = "zeroplan.checkpoint/v3+experts"
#: How an error about a manifest that contradicts itself or its data ends.
MISMATCH = "the manifest does not match its data files; restore the snapshot from a copy or load another one"

#: Plain JSON data as ``checkpoint_files.encode`` makes it (hyper-parameters, state values, ``extra``).
Encoded: TypeAlias = Any

#: Top-level fields of a manifest and their JSON types.
_FIELDS: dict[str, tuple[type, ...]] = {
    "format": (str,),
    "digest": (str,),
    "optimizer": (str,),
    "elementwise": (bool,),
    "world_size": (int,),
    "shard_size": (int,),
    "stage": (int,),
    "partition": (dict,),
    "separate_master": (list,),
    "state": (dict,),
    "param_groups": (list,),
    "scaler": (dict, type(None)),
    "files": (dict,),
    "extra": (dict,),
}
#: Fields of an expert group's entry in ``experts.domains[i].groups`` and their JSON types.
_GROUP_FIELDS: dict[str, tuple[type, ...]] = {
    "ranks": (list,),
    "partition": (dict,),
    "separate_master": (list,),
    "state": (dict,),
    "param_groups": (list,),
}
_DOMAIN_NAME = re.compile(r"[a-z][a-z0-9_]*")
#: This reader's format version, and the form of any version's format name.
_VERSION = int(FORMAT.rsplit("/v", 1)[1])
_NEWER = re.compile(r"zeroplan\.checkpoint/v(\d+)(\+[a-z]+)?")


# --------------------------------------------------------------------------- the typed manifest
class LeafKind(str, Enum):
    """The kind of a state leaf: the first part of its path (see [Note: state codec])."""

    FLAT = "flat"
    SCALARS = "scalars"
    WHOLE = "whole"
    PARKED = "parked"


_KINDS = {kind.value for kind in LeafKind}


def _kind_and_owner(path: str) -> tuple[str, str]:
    """The first two parts of a leaf path (the second is ``""`` if there is none)."""
    kind, owner = [*path.split("/", 2), ""][:2]
    return kind, owner


@dataclass(frozen=True, slots=True, kw_only=True)
class _Leaf:
    """A state leaf's path and what it tells (see [Note: state codec])."""

    path: str

    def __post_init__(self) -> None:
        require(_kind_and_owner(self.path)[0] in _KINDS, f"state leaf {self.path!r} is of no known kind")

    @property
    def kind(self) -> LeafKind:
        """The kind of state the leaf holds."""
        return LeafKind(_kind_and_owner(self.path)[0])

    @property
    def owner(self) -> str:
        """The second part of the path: a dtype (flat), a param group (scalars) or a parameter index."""
        return _kind_and_owner(self.path)[1]


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorLeaf(_Leaf):
    """A state leaf saved as tensor ``state/<path>`` in the shard files of ``ranks``.

    Attributes:
        dtype: the tensor's dtype name.
        ranks: the shard ranks whose files hold it.
        shape: its shape for ``whole/`` and ``parked/`` leaves; ``None`` for
            ``flat/`` ones, whose shape is their shard's extent.
    """

    dtype: str
    ranks: tuple[int, ...]
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _Leaf.__post_init__(self)
        require(bool(self.ranks), f"state leaf {self.path!r} lies in no shard file")
        require(self.kind is not LeafKind.SCALARS, f"state leaf {self.path!r} must be a plain value")
        flat = self.kind is LeafKind.FLAT
        require((self.shape is None) == flat, f"state leaf {self.path!r} has a shape iff it is not flat")

    def document(self) -> dict[str, Any]:
        """The leaf's entry in the manifest's ``state``."""
        shape = {} if self.shape is None else {"shape": list(self.shape)}
        return {"dtype": self.dtype, "ranks": list(self.ranks), **shape}


@dataclass(frozen=True, slots=True, kw_only=True)
class ValueLeaf(_Leaf):
    """A state leaf saved in the manifest itself: a plain value (a cohort's ``step``), encoded.

    Attributes:
        value: the value, encoded (never of a ``flat/`` leaf).
    """

    value: Encoded

    def __post_init__(self) -> None:
        _Leaf.__post_init__(self)
        require(self.kind is not LeafKind.FLAT, f"state leaf {self.path!r} cannot be a plain value")

    def document(self) -> dict[str, Any]:
        """The leaf's entry in the manifest's ``state``."""
        return {"value": self.value}


#: A leaf of saved optimizer state: a tensor in shard files or a value in the manifest.
StateLeaf: TypeAlias = TensorLeaf | ValueLeaf


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedShards:
    """What a domain's shard group saved: the data domain's, or one expert group's.

    Attributes:
        partition: the saved partition (its fingerprint checked).
        separate_master: the dtypes whose fp32 masters the shard files hold.
        state: the state leaves, in the order they are written.
        param_groups: the hyper-parameters of each param group, encoded.
    """

    partition: PartitionPlan
    separate_master: tuple[str, ...]
    state: tuple[StateLeaf, ...]
    param_groups: tuple[Encoded, ...]

    def __post_init__(self) -> None:
        paths = [leaf.path for leaf in self.state]
        require(len(set(paths)) == len(paths), f"state leaves listed twice in {paths}")

    def leaves_of(self, kind: LeafKind, owner: str | int | None = None) -> list[StateLeaf]:
        """The leaves of ``kind`` (and ``owner``: a dtype, param group or parameter index), in order."""
        prefix = f"{kind.value}/" if owner is None else f"{kind.value}/{owner}/"
        return [leaf for leaf in self.state if leaf.path.startswith(prefix)]

    def flat_leaves(self, dtype: str) -> list[TensorLeaf]:
        """The per-element leaves of dtype space ``dtype``, in order."""
        return [leaf for leaf in self.leaves_of(LeafKind.FLAT, dtype) if isinstance(leaf, TensorLeaf)]

    def leaves_in(self, shard_rank: int) -> list[TensorLeaf]:
        """The tensor leaves shard ``shard_rank``'s file holds, in order."""
        return [leaf for leaf in self.state if isinstance(leaf, TensorLeaf) and shard_rank in leaf.ranks]

    def fields(self) -> dict[str, Any]:
        """As JSON data, in the order of an expert group's entry (the manifest's top level has its own)."""
        return {
            "partition": _partition_document(self.partition),
            "separate_master": list(self.separate_master),
            "param_groups": list(self.param_groups),
            "state": {leaf.path: leaf.document() for leaf in self.state},
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertGroup:
    """An expert group's entry: its ranks and what it saved (group rank ``q`` wrote shard ``q``).

    Attributes:
        ranks: the group's ranks in the saving world, in group order.
        shards: what the group saved, sharded over all its ranks.
    """

    ranks: tuple[int, ...]
    shards: SavedShards

    def document(self) -> dict[str, Any]:
        """The group's entry in its domain's ``groups``."""
        return {"ranks": list(self.ranks), **self.shards.fields()}


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertDomain:
    """An expert domain's entry (see [Note: checkpoint layout]): its groups split the saving world.

    Attributes:
        name: the domain's name.
        groups: its expert groups, by increasing ranks.
    """

    name: str
    groups: tuple[ExpertGroup, ...]

    def __post_init__(self) -> None:
        require(_DOMAIN_NAME.fullmatch(self.name) is not None, f"expert domain name {self.name!r}")
        require(bool(self.groups), f"expert domain {self.name!r} has no groups")

    def group_of(self, rank: int) -> ExpertGroup:
        """The group that world rank ``rank`` belongs to.

        Raises:
            PlanInvariantError: no group holds ``rank``.
        """
        found = [group for group in self.groups if rank in group.ranks]
        require(bool(found), f"no expert group of domain {self.name!r} holds rank {rank}")
        return found[0]

    def document(self) -> dict[str, Any]:
        """The domain's entry in the ``experts`` section."""
        return {"name": self.name, "groups": [group.document() for group in self.groups]}


@dataclass(frozen=True, slots=True, kw_only=True)
class ListedFile:
    """A data file of the snapshot and its size in bytes (a shorter file is truncated)."""

    name: str
    size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """A snapshot's manifest (see [Note: typed manifest]).

    Attributes:
        optimizer: the inner optimizer's class name.
        elementwise: whether the saving plan was elementwise.
        world_size: ranks of the saving world.
        shard_size: ranks of the saving shard group (data domain).
        stage: the saving stage.
        shards: what the data domain saved.
        scaler: the dynamic loss scaler's fields, or ``None``.
        files: the data files, in the order they are listed.
        extra: the caller's ``extra``, encoded.
        expert_domains: each expert domain's entry; none without expert groups.
        tensor_slice: ``(rank, degree)`` of the tp slice that saved it ([Note: reslicing
            tensor-parallel checkpoints] in ``checkpoint.reslice``); ``None`` without tensor
            parallelism (the field is then absent from the document).
        digest: the digest the manifest was read with; ``None`` for one not written yet.
        names: the names of ``files`` (derived).
    """

    optimizer: str
    elementwise: bool
    world_size: int
    shard_size: int
    stage: Stage
    shards: SavedShards
    scaler: dict[str, Encoded] | None
    files: tuple[ListedFile, ...]
    extra: Encoded
    expert_domains: tuple[ExpertDomain, ...] = ()
    tensor_slice: tuple[int, int] | None = None
    digest: str | None = None
    names: frozenset[str] = field(init=False, repr=False, compare=False)
    _sizes: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = {file.name: file.size for file in self.files}
        object.__setattr__(self, "_sizes", sizes)
        object.__setattr__(self, "names", frozenset(sizes))
        require(len(sizes) == len(self.files), "the manifest lists a file twice")
        names = [domain.name for domain in self.expert_domains]
        require(len(set(names)) == len(names), f"expert domains named twice in {names}")

    @property
    def format(self) -> str:
        """:data:`EXPERTS_FORMAT` with expert domains, else :data:`FORMAT`."""
        return EXPERTS_FORMAT if self.expert_domains else FORMAT

    def size_of(self, name: str) -> int | None:
        """The listed size of data file ``name``; ``None`` if the manifest does not list it."""
        return self._sizes.get(name)

    def document(self) -> dict[str, Any]:
        """The manifest as JSON data, without its digest, in the order it is written."""
        shards = self.shards.fields()
        document = {
            "format": self.format,
            "optimizer": self.optimizer,
            "elementwise": self.elementwise,
            "world_size": self.world_size,
            "shard_size": self.shard_size,
            "stage": int(self.stage),
            "partition": shards["partition"],
            "separate_master": shards["separate_master"],
            "state": shards["state"],
            "param_groups": shards["param_groups"],
            "scaler": self.scaler,
            "files": {file.name: file.size for file in self.files},
            "extra": self.extra,
        }
        if self.expert_domains:
            domains = [domain.document() for domain in self.expert_domains]
            document["experts"] = {"world_size": self.world_size, "domains": domains}
        if self.tensor_slice is not None:
            document["tensor_slice"] = list(self.tensor_slice)
        return document

    def sealed(self) -> dict[str, Any]:
        """:meth:`document` with its digest: what is written (see [Note: manifest integrity])."""
        return seal(self.document())


# --------------------------------------------------------------------------- JSON
def _digest(document: dict[str, Any]) -> str:
    body = {k: v for k, v in document.items() if k != "digest"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def seal(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` with its ``digest`` (replacing any previous one).

    Example:
        >>> sealed = seal({"format": FORMAT, "a": [1, 2.5]})
        >>> sealed["digest"] == seal({"a": [1, 2.5], "format": FORMAT})["digest"]
        True
    """
    return {**{k: v for k, v in document.items() if k != "digest"}, "digest": _digest(document)}


def _partition_document(partition: PartitionPlan) -> dict[str, Any]:
    """The saved partition as plain data (specs and fragments, and its fingerprint)."""
    return {
        "strategy": partition.strategy,
        "alignment": partition.alignment,
        "shard_size": partition.shard_size,
        "fingerprint": partition.fingerprint(),
        "specs": [_spec_document(s) for s in partition.specs],
        "fragments": [
            [[f.rank, f.param_span.start, f.param_span.stop] for f in frags] for frags in partition.fragments
        ],
        # Interleaved layouts (rank-major ones derive both from the fragments, as checkpoints always did).
        **(
            {
                "blocks": [[list(b) for b in blocks] for blocks in partition.block_pieces],
                "shard_offsets": [[f.shard_offset for f in frags] for frags in partition.fragments],
            }
            if partition.block_pieces
            else {}
        ),
    }


def _spec_document(spec: ParamSpec) -> list[Any]:
    """A spec as a manifest entry: ``[name, shape, dtype, group, trainable, cohort]``, the local shape;
    a placed spec (see [Note: placements] in ``zeroplan.core.placement``) adds its global shape and
    placement, so plain specs are written as they always were."""
    entry = [spec.name, list(spec.shape), spec.dtype, spec.group, spec.trainable, spec.cohort]
    if spec.placement:
        entry += [list(spec.global_shape or ()), [list(p) for p in placement_key(spec.placement)]]
    return entry


def _spec_from(index: int, entry: list[Any]) -> ParamSpec:
    """Inverse of :func:`_spec_document` (six entries, as every manifest before placements wrote)."""
    name, shape, dtype, group, trainable, cohort, *placed = entry
    global_shape, placement = placed if placed else (None, [])
    try:
        where = placement_from_key(placement)
    except ValueError as exc:
        raise CheckpointError(f"the manifest's spec {name!r} has a malformed placement: {exc}") from None
    return ParamSpec(
        index=index,
        name=name,
        shape=tuple(shape),
        dtype=dtype,
        group=group,
        trainable=trainable,
        cohort=cohort,
        global_shape=None if global_shape is None else tuple(global_shape),
        placement=where,
    )


def _partition_from(document: dict[str, Any]) -> PartitionPlan:
    """Inverse of :func:`_partition_document`, checked against the fingerprint.

    Raises:
        CheckpointError: the rebuilt partition does not match its fingerprint.
    """
    specs = tuple(_spec_from(i, entry) for i, entry in enumerate(document["specs"]))
    if "blocks" in document:
        partition = PartitionPlan(
            specs=specs,
            shard_size=document["shard_size"],
            alignment=document["alignment"],
            strategy=document["strategy"],
            fragments=tuple(
                tuple(
                    Fragment(p, rank, Span(start, stop), offset)
                    for (rank, start, stop), offset in zip(frags, offsets, strict=True)
                )
                for p, (frags, offsets) in enumerate(
                    zip(document["fragments"], document["shard_offsets"], strict=True)
                )
            ),
            block_pieces=document["blocks"],
        )
    else:
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


def read_manifest(snapshot: Path) -> Manifest:
    """The manifest of ``snapshot``, sealed and well formed (see [Note: manifest integrity]).

    Raises:
        CheckpointError: missing, of another format, edited (digest), malformed,
            or with a partition that does not match its fingerprint.
    """
    path = snapshot / MANIFEST
    document = read_json(path)
    found = document.get("format") if isinstance(document, dict) else None
    newer = _NEWER.fullmatch(found) if isinstance(found, str) else None
    if newer is not None and int(newer.group(1)) > _VERSION:
        raise CheckpointError(
            f"{str(snapshot)!r} has checkpoint format {found!r}, written by a newer zeroplan; this version "
            f"reads {FORMAT!r} and {EXPERTS_FORMAT!r}: upgrade zeroplan to read it"
        )
    if found not in (FORMAT, EXPERTS_FORMAT):
        raise CheckpointError(
            f"{str(snapshot)!r}: unknown checkpoint format {found!r}; this version of zeroplan reads "
            f"{FORMAT!r} and {EXPERTS_FORMAT!r}"
        )
    if document.get("digest") != _digest(document):
        raise CheckpointError(
            f"{str(path)!r} does not match its digest: the manifest was edited or damaged after the save "
            "(hyper-parameters, optimizer state and dtypes live there); restore it from a copy or load "
            "another snapshot"
        )
    for key, types in _FIELDS.items():
        if key not in document:
            raise CheckpointError(
                f"{str(path)!r} lacks {key!r}: the manifest is incomplete; restore the snapshot from a "
                "copy or load another one"
            )
        if not isinstance(document[key], types) or (int in types and isinstance(document[key], bool)):
            raise CheckpointError(f"{str(path)!r}: {key!r} is a {type(document[key]).__name__}: {MISMATCH}")
    state = tuple(_leaf_from(path, *entry, document["shard_size"]) for entry in document["state"].items())
    if (found == EXPERTS_FORMAT) != ("experts" in document):
        raise CheckpointError(
            f"{str(path)!r} is of format {found!r} but {'lacks' if found == EXPERTS_FORMAT else 'has'} an "
            f"'experts' section: {MISMATCH}"
        )
    domains = (
        _experts_from(path, document["experts"], document["world_size"]) if found == EXPERTS_FORMAT else ()
    )
    if document["stage"] not in {int(stage) for stage in Stage}:
        raise CheckpointError(
            f"{str(path)!r}: 'stage' is {document['stage']!r}, which is no stage: {MISMATCH}"
        )
    for name, size in document["files"].items():
        if type(size) is not int:
            raise CheckpointError(f"{str(path)!r}: file {name!r} has size {size!r}: {MISMATCH}")
    tensor_slice = document.get("tensor_slice")
    if tensor_slice is not None and not (
        isinstance(tensor_slice, list)
        and len(tensor_slice) == 2
        and all(type(v) is int for v in tensor_slice)
        and 0 <= tensor_slice[0] < tensor_slice[1]
    ):
        raise CheckpointError(f"{str(path)!r}: 'tensor_slice' is {tensor_slice!r}: {MISMATCH}")
    return Manifest(
        tensor_slice=None if tensor_slice is None else (tensor_slice[0], tensor_slice[1]),
        optimizer=document["optimizer"],
        elementwise=document["elementwise"],
        world_size=document["world_size"],
        shard_size=document["shard_size"],
        stage=Stage(document["stage"]),
        shards=_shards_from(document, state),
        scaler=document["scaler"],
        files=tuple(ListedFile(name=name, size=size) for name, size in document["files"].items()),
        extra=document["extra"],
        expert_domains=domains,
        digest=document["digest"],
    )


def _shards_from(document: dict[str, Any], state: tuple[StateLeaf, ...]) -> SavedShards:
    """What a well-formed manifest or expert group entry says its shard group saved."""
    return SavedShards(
        partition=_partition_from(document["partition"]),
        separate_master=tuple(document["separate_master"]),
        state=state,
        param_groups=tuple(document["param_groups"]),
    )


def _leaf_from(path: Path, leaf: str, described: Any, shard_size: int) -> StateLeaf:
    """A state leaf's entry, checked for its kind's form (see [Note: checkpoint layout]).

    Keys its kind does not use are ignored, as they always were.
    """
    kind = _kind_and_owner(leaf)[0]
    problem = None
    if not isinstance(described, dict) or kind not in _KINDS:
        problem = "is no state leaf"
    elif "value" in described:
        problem = "must be a tensor" if kind == LeafKind.FLAT else None
    elif kind == LeafKind.SCALARS:
        problem = "must be a value"
    elif not isinstance(described.get("dtype"), str):
        problem = "has no dtype"
    elif not (
        isinstance(described.get("ranks"), list)
        and described["ranks"]
        and all(type(q) is int and 0 <= q < shard_size for q in described["ranks"])
    ):
        problem = f"has ranks {described.get('ranks')!r}, not shard ranks of 0..{shard_size - 1}"
    elif kind in (LeafKind.WHOLE, LeafKind.PARKED) and not (
        isinstance(described.get("shape"), list)
        and all(type(n) is int and n >= 0 for n in described["shape"])
    ):
        problem = "has no shape"
    if problem is None and "dtype" in described:
        try:
            torch_dtype(described["dtype"])
        except ValueError:
            problem = f"has dtype {described['dtype']!r}"
    if problem is not None:
        raise CheckpointError(f"{str(path)!r}: state leaf {leaf!r} {problem}: {MISMATCH}")
    if "value" in described:
        return ValueLeaf(path=leaf, value=described["value"])
    shape = None if kind == LeafKind.FLAT else tuple(described["shape"])
    return TensorLeaf(path=leaf, dtype=described["dtype"], ranks=tuple(described["ranks"]), shape=shape)


def _experts_from(path: Path, experts: Any, world_size: int) -> tuple[ExpertDomain, ...]:
    """The ``experts`` section, checked for its form: every domain's groups split the saving world's ranks."""

    def malformed(what: str) -> CheckpointError:
        return CheckpointError(f"{str(path)!r}: the 'experts' section {what}: {MISMATCH}")

    if not (isinstance(experts, dict) and isinstance(experts.get("domains"), list) and experts["domains"]):
        raise malformed("lists no domains")
    world = experts.get("world_size")
    if world != world_size or type(world) is not int:
        raise malformed(f"has world_size {world!r}")
    names = [d.get("name") if isinstance(d, dict) else None for d in experts["domains"]]
    named = all(isinstance(n, str) and _DOMAIN_NAME.fullmatch(n) for n in names)
    if not named or len(set(names)) < len(names):
        raise malformed(f"names domains {names!r}")
    domains = []
    for name, domain in zip(names, experts["domains"], strict=True):
        groups = domain.get("groups")
        if not (isinstance(groups, list) and groups and all(isinstance(g, dict) for g in groups)):
            raise malformed(f"lists no groups of domain {name!r}")
        states = []
        for group in groups:
            for key, types in _GROUP_FIELDS.items():
                if not isinstance(group.get(key), types):
                    raise malformed(f"gives domain {name!r} a group without a valid {key!r}")
            states.append(
                tuple(_leaf_from(path, *entry, len(group["ranks"])) for entry in group["state"].items())
            )
        ranks = [q for g in groups for q in g["ranks"]]
        if not all(type(q) is int for q in ranks) or sorted(ranks) != list(range(world)):
            raise malformed(f"splits ranks {ranks!r} into the groups of domain {name!r}, not 0..{world - 1}")
        entries = zip(groups, states, strict=True)
        saved = (ExpertGroup(ranks=tuple(g["ranks"]), shards=_shards_from(g, state)) for g, state in entries)
        domains.append(ExpertDomain(name=name, groups=tuple(saved)))
    return tuple(domains)
