# zeroplan.core — pure planning: no torch, no I/O.
# A parameter's placement on a device mesh, described by value (torch's DTensor placements, torch-free).
"""Where a parameter's global tensor lives on named mesh dimensions (``Shard``, ``Replicate``).

[Note: placements]
A parameter the planner sees may be one rank's piece of a larger tensor (a
tensor-parallel shard, as a ``DTensor`` holds it). Its :class:`~zeroplan.core.ParamSpec`
then carries three things: ``shape``, the *local* shape this rank holds, from
which every plan, report and checkpoint computes; ``global_shape``, the whole
tensor's; and ``placement``, a :data:`MeshPlacement` saying, per named mesh
dimension, whether the tensor is split there (``Shard(dim)``) or copied
(``Replicate()``). A plain tensor is replicated on every mesh dimension: its
placement is the empty tuple (or lists ``Replicate()`` only) and its global
shape is its local shape. Data parallelism then shards the local tensor
(ZeRO on top of tensor parallel, as FSDP2 2D and InternLM's hybrid ZeRO do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

__all__ = [
    "MeshPlacement",
    "Placement",
    "Replicate",
    "Shard",
    "check_placement",
    "placement_from_key",
    "placement_key",
    "sharded_dims",
]


@dataclass(frozen=True, slots=True)
class Shard:
    """The tensor is split along its dimension ``dim`` over a mesh dimension.

    Example:
        >>> Shard(0)
        Shard(dim=0)
    """

    dim: int


@dataclass(frozen=True, slots=True)
class Replicate:
    """The tensor is copied whole on every rank of a mesh dimension.

    Example:
        >>> Replicate() == Replicate()
        True
    """


Placement: TypeAlias = Shard | Replicate
#: ``(mesh dimension name, placement)`` pairs; ``()`` is replicated on every dimension.
MeshPlacement: TypeAlias = tuple[tuple[str, Placement], ...]


def check_placement(placement: object, ndim: int) -> str | None:
    """What is wrong with ``placement`` for a tensor of ``ndim`` dimensions, or ``None``.

    Example:
        >>> check_placement((("tp", Shard(0)), ("dp", Replicate())), 2) is None
        True
        >>> check_placement((("tp", Shard(2)),), 2)
        "mesh dimension 'tp' shards dimension 2 of a 2-dimensional tensor; pass Shard(d) with 0 <= d < 2"
    """
    if not isinstance(placement, tuple):
        return (
            f"placement must be a tuple of (mesh dimension name, Shard(d) or Replicate()) pairs, got "
            f"{placement!r}; pass e.g. placement=(('tp', Shard(0)),), or () for a plain tensor"
        )
    names: set[str] = set()
    for pair in placement:
        if not (
            isinstance(pair, tuple)
            and len(pair) == 2
            and isinstance(pair[0], str)
            and pair[0]
            and isinstance(pair[1], Shard | Replicate)
        ):
            return (
                f"placement entry {pair!r} is not a (mesh dimension name, Shard(d) or Replicate()) pair; "
                "pass e.g. ('tp', Shard(0))"
            )
        name, where = pair
        if name in names:
            return f"mesh dimension {name!r} appears twice in the placement; list each mesh dimension once"
        names.add(name)
        if isinstance(where, Shard) and not (type(where.dim) is int and 0 <= where.dim < ndim):
            return (
                f"mesh dimension {name!r} shards dimension {where.dim!r} of a {ndim}-dimensional tensor; "
                f"pass Shard(d) with 0 <= d < {ndim}"
            )
    return None


def sharded_dims(placement: MeshPlacement) -> frozenset[int]:
    """The tensor dimensions some mesh dimension splits.

    Example:
        >>> sorted(sharded_dims((("dp", Replicate()), ("tp", Shard(1)), ("sp", Shard(0)))))
        [0, 1]
    """
    return frozenset(p.dim for _, p in placement if isinstance(p, Shard))


def placement_key(placement: MeshPlacement) -> tuple[tuple[str, str, int], ...]:
    """``placement`` as plain data: ``(mesh dim, "shard", dim)`` or ``(mesh dim, "replicate", -1)``.

    For fingerprints (ints and strings only) and checkpoint manifests (JSON).

    Example:
        >>> placement_key((("tp", Shard(0)), ("dp", Replicate())))
        (('tp', 'shard', 0), ('dp', 'replicate', -1))
    """
    return tuple(
        (name, "shard", p.dim) if isinstance(p, Shard) else (name, "replicate", -1) for name, p in placement
    )


def placement_from_key(key: object) -> MeshPlacement:
    """Inverse of :func:`placement_key` (lists accepted, as JSON gives them back).

    Raises:
        ValueError: ``key`` is not what :func:`placement_key` writes.

    Example:
        >>> placement_from_key([["tp", "shard", 1], ["dp", "replicate", -1]])
        (('tp', Shard(dim=1)), ('dp', Replicate()))
    """
    if not isinstance(key, list | tuple):
        raise ValueError(f"a placement is a list of [mesh dimension, kind, dim] entries, got {key!r}")
    out: list[tuple[str, Placement]] = []
    for entry in key:
        if not (isinstance(entry, list | tuple) and len(entry) == 3 and isinstance(entry[0], str)):
            raise ValueError(f"placement entry {entry!r} is not [mesh dimension, kind, dim]")
        name, kind, dim = entry
        if kind == "shard" and type(dim) is int:
            out.append((name, Shard(dim)))
        elif kind == "replicate":
            out.append((name, Replicate()))
        else:
            raise ValueError(f"placement entry {entry!r} is neither a shard nor a replicate")
    return tuple(out)
