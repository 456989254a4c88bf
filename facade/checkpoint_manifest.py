"""A snapshot's manifest: written sealed, read only if intact and consistent with its data files.

[Note: manifest integrity]
The manifest is the one file a shard checksum does not cover, and it carries
what the data files do not: hyper-parameters, scalar optimizer state (Adam's
``step``), the scaler, which dtypes have fp32 masters, which state leaves
exist. So it is checked three ways before anything is read from the data:

1. *Sealed*: ``digest`` is the sha256 of the rest of the document in
   canonical JSON (:func:`seal`); an edited or damaged manifest fails it.
2. *Well formed*: every field has its type, every state leaf its kind's form
   (:func:`read_manifest`), and ``separate_master`` and the file list are
   what the saved partition implies (:func:`check_against_partition`).
3. *Cross-checked*: each shard file holds exactly the tensors the manifest
   lists for it, with the listed dtypes and the shapes the partition implies
   (:func:`check_shard_file`, :func:`check_frozen_file`). Each rank checks the
   files whose checksums it verifies (shard ``q``: rank ``q % world``), and
   all ranks agree before committing, so every file is checked once.

A manifest rewritten and sealed again by a tool passes 1 and 2; 3 still
catches anything it says about the data (dtypes, keys, shapes, masters).

A snapshot of an optimizer with expert groups has format :data:`EXPERTS_FORMAT`
and an ``experts`` section (see [Note: checkpoint layout]); each expert group's
entry is checked the same three ways (:func:`check_expert_group`, and
:func:`check_shard_file` on each expert file by the rank that wrote it).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from zeroplan.core import (
    CheckpointError,
    Fragment,
    ParamSpec,
    PartitionPlan,
    Span,
    master_dtype,
    plan_from_assignment,
)
from zeroplan.facade.checkpoint_files import TensorFile, read_json
from zeroplan.facade.checkpoint_names import (
    FROZEN,
    MANIFEST,
    expert_file,
    master_tensor,
    param_tensor,
    region_tensor,
    shard_file,
    state_tensor,
)
from zeroplan.facade.state_tree import TensorMeta, dtype_name, torch_dtype

__all__ = [
    "EXPERTS_FORMAT",
    "FORMAT",
    "check_against_partition",
    "check_expert_group",
    "check_frozen_file",
    "check_shard_file",
    "expert_files",
    "partition_document",
    "partition_from",
    "read_manifest",
    "seal",
]

FORMAT = "zeroplan.checkpoint/v3"
#: The format of a snapshot with expert files: v3 plus ``experts`` (older readers refuse it by name).
EXPERTS_FORMAT = "zeroplan.checkpoint/v3+experts"

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
_MISMATCH = "the manifest does not match its data files; restore the snapshot from a copy or load another one"


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


def partition_document(partition: PartitionPlan) -> dict[str, Any]:
    """The saved partition as plain data (specs and fragments, and its fingerprint)."""
    return {
        "strategy": partition.strategy,
        "alignment": partition.alignment,
        "shard_size": partition.shard_size,
        "fingerprint": partition.fingerprint(),
        "specs": [[s.name, list(s.shape), s.dtype, s.group, s.trainable, s.cohort] for s in partition.specs],
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


def partition_from(document: dict[str, Any]) -> PartitionPlan:
    """Inverse of :func:`partition_document`, checked against the fingerprint.

    Raises:
        CheckpointError: the rebuilt partition does not match its fingerprint.
    """
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


def read_manifest(snapshot: Path) -> dict[str, Any]:
    """The manifest of ``snapshot``, sealed and well formed (see [Note: manifest integrity]).

    Raises:
        CheckpointError: missing, of another format, edited (digest) or malformed.
    """
    path = snapshot / MANIFEST
    document = read_json(path)
    found = document.get("format") if isinstance(document, dict) else None
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
            raise CheckpointError(f"{str(path)!r}: {key!r} is a {type(document[key]).__name__}: {_MISMATCH}")
    for leaf, described in document["state"].items():
        _check_leaf(path, leaf, described, document["shard_size"])
    if (found == EXPERTS_FORMAT) != ("experts" in document):
        raise CheckpointError(
            f"{str(path)!r} is of format {found!r} but {'lacks' if found == EXPERTS_FORMAT else 'has'} an "
            f"'experts' section: {_MISMATCH}"
        )
    if found == EXPERTS_FORMAT:
        _check_experts(path, document["experts"], document["world_size"])
    return document


def _check_experts(path: Path, experts: Any, world_size: int) -> None:
    """The ``experts`` section has its form: every domain's groups split the saving world's ranks."""

    def malformed(what: str) -> CheckpointError:
        return CheckpointError(f"{str(path)!r}: the 'experts' section {what}: {_MISMATCH}")

    if not (isinstance(experts, dict) and isinstance(experts.get("domains"), list) and experts["domains"]):
        raise malformed("lists no domains")
    world = experts.get("world_size")
    if world != world_size or type(world) is not int:
        raise malformed(f"has world_size {world!r}")
    names = [d.get("name") if isinstance(d, dict) else None for d in experts["domains"]]
    named = all(isinstance(n, str) and _DOMAIN_NAME.fullmatch(n) for n in names)
    if not named or len(set(names)) < len(names):
        raise malformed(f"names domains {names!r}")
    for name, domain in zip(names, experts["domains"], strict=True):
        groups = domain.get("groups")
        if not (isinstance(groups, list) and groups and all(isinstance(g, dict) for g in groups)):
            raise malformed(f"lists no groups of domain {name!r}")
        for group in groups:
            for key, types in _GROUP_FIELDS.items():
                if not isinstance(group.get(key), types):
                    raise malformed(f"gives domain {name!r} a group without a valid {key!r}")
            for leaf, described in group["state"].items():
                _check_leaf(path, leaf, described, len(group["ranks"]))
        ranks = [q for g in groups for q in g["ranks"]]
        if not all(type(q) is int for q in ranks) or sorted(ranks) != list(range(world)):
            raise malformed(f"splits ranks {ranks!r} into the groups of domain {name!r}, not 0..{world - 1}")


def expert_files(document: dict[str, Any]) -> set[str]:
    """Every expert file a (well formed) manifest implies: one per domain and rank of the saving world."""
    if "experts" not in document:
        return set()
    return {
        expert_file(domain["name"], q)
        for domain in document["experts"]["domains"]
        for group in domain["groups"]
        for q in group["ranks"]
    }


def _check_leaf(path: Path, leaf: str, described: Any, shard_size: int) -> None:
    """A state leaf's description has its kind's form (see [Note: checkpoint layout])."""
    kind = leaf.split("/", 1)[0]
    problem = None
    if not isinstance(described, dict) or kind not in ("flat", "scalars", "whole", "parked"):
        problem = "is no state leaf"
    elif "value" in described:
        problem = "must be a tensor" if kind == "flat" else None
    elif kind == "scalars":
        problem = "must be a value"
    elif not isinstance(described.get("dtype"), str):
        problem = "has no dtype"
    elif not (
        isinstance(described.get("ranks"), list)
        and described["ranks"]
        and all(type(q) is int and 0 <= q < shard_size for q in described["ranks"])
    ):
        problem = f"has ranks {described.get('ranks')!r}, not shard ranks of 0..{shard_size - 1}"
    elif kind in ("whole", "parked") and not (
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
        raise CheckpointError(f"{str(path)!r}: state leaf {leaf!r} {problem}: {_MISMATCH}")


def check_against_partition(document: dict[str, Any], saved: PartitionPlan, snapshot: Path) -> None:
    """``separate_master``, state leaves and the file list agree with the saved partition.

    Raises:
        CheckpointError: naming the field that disagrees.
    """
    _check_state_against(document, saved, repr(str(snapshot)))
    files = {shard_file(q) for q in range(saved.shard_size)}
    files |= {FROZEN} if any(not s.trainable for s in saved.specs) else set()
    files |= expert_files(document)
    if not files <= set(document["files"]):
        return  # which shard files are missing is reported when they are opened
    if set(document["files"]) != files or not all(type(n) is int for n in document["files"].values()):
        raise CheckpointError(
            f"{str(snapshot)!r}: the manifest lists files {sorted(document['files'])}, the partition "
            f"implies {sorted(files)}: {_MISMATCH}"
        )


def _check_state_against(document: dict[str, Any], saved: PartitionPlan, where: str) -> None:
    """``separate_master`` and the state leaves of a domain's entry agree with its saved partition."""
    dtypes = [space.dtype for space in saved.spaces]
    masters = sorted(d for d in dtypes if master_dtype(d) != d)
    if sorted(document["separate_master"]) != masters:
        raise CheckpointError(
            f"{where}: the manifest's separate_master is {document['separate_master']!r}, but "
            f"the saved partition has fp32 masters for {masters!r}: {_MISMATCH}"
        )
    for leaf in document["state"]:
        kind, first, _ = [*leaf.split("/", 2), "", ""][:3]
        known = first in dtypes if kind == "flat" else first.isdigit() and int(first) < len(saved.specs)
        if kind == "parked" and known and saved.specs[int(first)].trainable:
            known = False  # parked state belongs to frozen parameters only
        if kind != "scalars" and not known:
            raise CheckpointError(f"{where}: state leaf {leaf!r} names no saved {kind} space or parameter")


def check_expert_group(group: dict[str, Any], snapshot: Path, domain: str) -> PartitionPlan:
    """The saved partition of an expert group's entry, checked against the entry.

    An expert domain is sharded over its whole group: group rank ``q`` wrote
    shard ``q`` into the file of world rank ``group["ranks"][q]``.

    Raises:
        CheckpointError: a partition that does not match its fingerprint or
            group size, or masters and state leaves it does not imply.
    """
    where = f"{str(snapshot)!r}, expert domain {domain!r}, group {group['ranks']}"
    saved = partition_from(group["partition"])
    if saved.shard_size != len(group["ranks"]):
        raise CheckpointError(
            f"{where}: the partition has {saved.shard_size} shards, the group {len(group['ranks'])} ranks: "
            f"{_MISMATCH}"
        )
    _check_state_against(group, saved, where)
    return saved


def _compare(file: TensorFile, expected: dict[str, TensorMeta]) -> None:
    found = {name: file.meta(name) for name in file.names()}
    for name in sorted(found.keys() - expected.keys()):
        raise CheckpointError(
            f"{str(file.path)!r} holds {name!r}, which the manifest does not list: {_MISMATCH}"
        )
    for name in sorted(expected.keys() - found.keys()):
        raise CheckpointError(f"{str(file.path)!r} lacks {name!r}, which the manifest lists: {_MISMATCH}")
    for name, meta in expected.items():
        here = found[name]
        if here != meta:
            raise CheckpointError(
                f"{str(file.path)!r}: {name!r} is {here.dtype} of shape {here.shape} in the file, the "
                f"manifest says {meta.dtype} of shape {meta.shape}: {_MISMATCH}"
            )


def check_shard_file(
    file: TensorFile, shard_rank: int, saved: PartitionPlan, document: dict[str, Any], *, frozen: bool = False
) -> None:
    """Shard file ``shard_rank`` holds exactly what the manifest says, in dtypes and shapes.

    ``document`` is the manifest, or an expert group's entry; ``frozen``: the
    file also holds the frozen parameters, whole (an expert group's first file).

    Raises:
        CheckpointError: an unlisted, missing or mismatched tensor (named).
    """
    owned = {space.dtype: (space.extent(shard_rank),) for space in saved.spaces}
    expected = {region_tensor(dtype): TensorMeta(shape, dtype) for dtype, shape in owned.items()}
    for dtype in document["separate_master"]:
        expected[master_tensor(dtype)] = TensorMeta(owned[dtype], master_dtype(dtype))
    for leaf, described in document["state"].items():
        if shard_rank in described.get("ranks", ()):
            kind, first = leaf.split("/", 2)[:2]
            shape = owned[first] if kind == "flat" else tuple(described["shape"])
            expected[state_tensor(leaf)] = TensorMeta(shape, dtype_name(torch_dtype(described["dtype"])))
    if frozen:
        expected.update(_frozen_metas(saved))
    _compare(file, expected)


def check_frozen_file(file: TensorFile, saved: PartitionPlan) -> None:
    """``frozen.pt`` holds each frozen parameter, whole, in its saved dtype and shape."""
    _compare(file, _frozen_metas(saved))


def _frozen_metas(saved: PartitionPlan) -> dict[str, TensorMeta]:
    return {param_tensor(s.index): TensorMeta(s.shape, s.dtype) for s in saved.specs if not s.trainable}
