# zeroplan.core — pure planning: no torch, no I/O.
# What a torch.optim step allocates beyond the optimizer's state, measured per implementation.
"""``StepTemporaries``: the peak of the tensors an optimizer's ``step()`` allocates and frees.

[Note: step temporaries]
Inside ``step()`` a ``torch.optim`` optimizer allocates temporaries on top of
its persistent state: ``-grad`` for ``maximize``, ``grad + weight_decay * param``,
``sqrt(exp_avg_sq)``, ... How many are alive at once depends on the optimizer,
its hyper-parameters and the implementation (see [Note: implementation
resolution] in :mod:`zeroplan.core.optim.implementations`):

* the *for-loop* steps one tensor at a time, so its peak follows the largest
  tensor, plus what the previous iteration still holds (Python keeps a local
  such as Adam's ``denom`` until the next iteration rebinds it);
* *foreach* allocates whole lists (Adam's ``_foreach_sqrt(exp_avg_sqs)``), so its
  peak follows the sum over the group;
* *fused* kernels allocate no tensor at all.

The model: torch walks the group in *units* (one tensor, the whole group, or,
for Adafactor's foreach, the matrices and the vectors in the order they first
appear). A :class:`Moment` is one instant of a unit's step: a sum of
:class:`Term` s, each a :class:`Cost` (elements of the stepped dtype plus bytes)
times a :class:`Feature` (numel, rows, columns, ...) of the current unit, the
previous unit or the group's largest tensor. The peak is the largest moment over
all units.

The coefficients of torch 2.13's optimizers (:mod:`zeroplan.core.optim.step_tables`)
were measured, not derived: ``benchmarks/optimizer_temporaries.py`` steps each
optimizer under ``torch.distributed._tools.mem_tracker.MemTracker`` with the
step's inputs and state registered beforehand, and
``tests/facade/test_inner_temporaries.py`` checks every entry against that
measurement. What MemTracker cannot see is left out: buffers a kernel allocates
internally (Rprop's boolean-mask indexing builds an int64 index of the selected
elements; fused kernels' workspaces) and the CUDA caching allocator's rounding
of every tensor to 512 bytes.

Tables are for torch 2.13 and describe the largest step of a run: RAdam's
rectified update (from step 6 with the default betas) and ASGD's averaging
(after ``t0`` steps) are counted although earlier steps allocate less.
Adafactor and Muon depend on shapes (rows, columns, Gram matrices): they are
exact for groups of only matrices or only vectors; a group mixing both is
bounded from above (what an earlier tensor of the other kind still holds is
taken from the largest one). Muon's ``bfloat16`` copy of the gradient is
counted even for bf16 parameters, where torch skips it: with ``ns_steps <= 1``
(no iteration frees a copy) that overestimates by 2 bytes per element.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from zeroplan.core.errors import check_config

__all__ = [
    "Cost",
    "Feature",
    "Kind",
    "Moment",
    "Role",
    "StepTemporaries",
    "Term",
    "Unit",
]


class Unit(str, Enum):
    """What torch steps at once."""

    TENSOR = "tensor"
    """One tensor after another (for-loop)."""
    GROUP = "group"
    """The whole group (foreach, fused)."""
    KIND = "kind"
    """The matrices, then the vectors, or the reverse (whichever comes first; Adafactor's foreach)."""

    def __str__(self) -> str:
        return self.value


class Kind(str, Enum):
    """Which tensors a term or moment applies to: 1-d (and 0-d) *vectors* or *matrices* of 2+ dims."""

    ANY = "any"
    VECTOR = "vector"
    MATRIX = "matrix"

    def __str__(self) -> str:
        return self.value


class Role(str, Enum):
    """Whose feature a term counts."""

    EACH = "each"
    """The unit being stepped."""
    PREVIOUS = "previous"
    """The unit stepped just before (nothing for the first)."""
    LARGEST = "largest"
    """The group's tensor with the largest feature."""

    def __str__(self) -> str:
        return self.value


class Feature(str, Enum):
    """A size of a tensor of shape ``s`` (summed over the tensors of a unit)."""

    NUMEL = "numel"
    """``prod(s)``."""
    ROWS = "rows"
    """``prod(s[:-1])`` for matrices (Adafactor's row statistics), 0 for vectors."""
    COLS = "cols"
    """``prod(s[:-2]) * s[-1]`` for matrices (column statistics), 0 for vectors."""
    MATRICES = "matrices"
    """``prod(s[:-2])`` for matrices (one per stacked matrix), 0 for vectors."""
    GRAM = "gram"
    """``prod(s[:-2]) * min(s[-2], s[-1]) ** 2`` for matrices (Muon's Gram matrix); for a
    vector its numel, a bound for any matrix of that many elements."""
    ONE = "one"
    """1 per tensor (scalars allocated once per tensor)."""

    def __str__(self) -> str:
        return self.value


def _kind(shape: tuple[int, ...]) -> Kind:
    return Kind.MATRIX if len(shape) >= 2 else Kind.VECTOR


def _features(shape: tuple[int, ...]) -> dict[Feature, int]:
    numel = math.prod(shape)
    if len(shape) < 2:
        return {Feature.NUMEL: numel, Feature.GRAM: numel, Feature.ONE: 1}
    stacked = math.prod(shape[:-2])
    return {
        Feature.NUMEL: numel,
        Feature.ROWS: stacked * shape[-2],
        Feature.COLS: stacked * shape[-1],
        Feature.MATRICES: stacked,
        Feature.GRAM: stacked * min(shape[-2], shape[-1]) ** 2,
        Feature.ONE: 1,
    }


def _natural(value: object) -> bool:
    return type(value) is int and value >= 0


@dataclass(frozen=True, slots=True)
class Cost:
    """``items`` elements of the stepped dtype plus ``bytes`` bytes (bool masks, fp32 scalars, bf16 copies).

    Example:
        >>> Cost(2, 1).bytes_at(4)   # two fp32 elements and a bool
        9
    """

    items: int = 0
    bytes: int = 0

    def __post_init__(self) -> None:
        check_config(
            _natural(self.items) and _natural(self.bytes),
            f"Cost needs ints >= 0, got items={self.items!r}, bytes={self.bytes!r}",
        )

    def bytes_at(self, itemsize: int) -> int:
        """Bytes for elements of ``itemsize`` bytes."""
        return self.items * itemsize + self.bytes


@dataclass(frozen=True, slots=True)
class Term:
    """``cost`` per unit of ``feature`` of the tensors of ``kind`` in the unit ``role`` names."""

    role: Role
    feature: Feature
    cost: Cost
    kind: Kind = Kind.ANY

    def __post_init__(self) -> None:
        check_config(
            isinstance(self.role, Role) and isinstance(self.feature, Feature) and isinstance(self.kind, Kind),
            f"Term needs a Role, a Feature and a Kind, got {self.role!r}, {self.feature!r}, {self.kind!r}",
        )
        check_config(isinstance(self.cost, Cost), f"Term.cost must be a Cost, got {self.cost!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Moment:
    """One instant of a unit's step: ``fixed`` plus the sum of ``terms``.

    It is counted at units of kind ``at`` stepped after a unit of kind ``after``
    (``Kind.ANY``: any unit, the first included).
    """

    terms: tuple[Term, ...] = ()
    fixed: Cost = Cost()
    at: Kind = Kind.ANY
    after: Kind = Kind.ANY

    def __post_init__(self) -> None:
        check_config(
            isinstance(self.terms, tuple) and all(isinstance(t, Term) for t in self.terms),
            f"Moment.terms must be a tuple of Term, got {self.terms!r}",
        )
        check_config(isinstance(self.fixed, Cost), f"Moment.fixed must be a Cost, got {self.fixed!r}")
        check_config(
            isinstance(self.at, Kind) and isinstance(self.after, Kind),
            f"Moment.at and .after must be Kinds, got {self.at!r}, {self.after!r}",
        )


class _Unit(NamedTuple):
    kind: Kind
    features: dict[tuple[Feature, Kind], int]


def _units(features: Sequence[dict[Feature, int]], kinds: Sequence[Kind], unit: Unit) -> list[_Unit]:
    """The units torch steps, in order, each with its features summed per kind filter."""
    if unit is Unit.TENSOR:
        parts = [[i] for i in range(len(kinds))]
    elif unit is Unit.GROUP:
        parts = [list(range(len(kinds)))]
    else:
        by_kind: dict[Kind, list[int]] = {}
        for i, kind in enumerate(kinds):
            by_kind.setdefault(kind, []).append(i)
        parts = list(by_kind.values())
    units = []
    for part in parts:
        summed: dict[tuple[Feature, Kind], int] = {}
        for i in part:
            for feature, value in features[i].items():
                for key in ((feature, Kind.ANY), (feature, kinds[i])):
                    summed[key] = summed.get(key, 0) + value
        unit_kinds = {kinds[i] for i in part}
        units.append(_Unit(unit_kinds.pop() if len(unit_kinds) == 1 else Kind.ANY, summed))
    return units


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTemporaries:
    """The temporaries of one param group's ``step()``: the largest of ``moments`` over ``unit`` s.

    See [Note: step temporaries].

    Example:
        >>> sqrt_and_denom = Term(Role.EACH, Feature.NUMEL, Cost(2))
        >>> held_denom = Term(Role.PREVIOUS, Feature.NUMEL, Cost(1))
        >>> adam = StepTemporaries(unit=Unit.TENSOR, moments=(Moment(terms=(sqrt_and_denom, held_denom)),))
        >>> adam.bytes([(300,), (1000,)], 4)   # 300 held over + 2 x 1000, fp32
        9200
    """

    unit: Unit
    moments: tuple[Moment, ...] = ()

    def __post_init__(self) -> None:
        check_config(isinstance(self.unit, Unit), f"StepTemporaries.unit must be a Unit, got {self.unit!r}")
        check_config(
            isinstance(self.moments, tuple) and all(isinstance(m, Moment) for m in self.moments),
            f"StepTemporaries.moments must be a tuple of Moment, got {self.moments!r}",
        )

    def bytes(self, shapes: Sequence[tuple[int, ...]], itemsize: int) -> int:
        """Peak bytes of temporaries while stepping tensors of ``shapes`` (in order), of ``itemsize`` bytes.

        Raises:
            ConfigError: a shape that is not a tuple of ints >= 0, or an
                ``itemsize`` that is not an int >= 1.
        """
        check_config(
            type(itemsize) is int and itemsize >= 1, f"itemsize must be an int >= 1, got {itemsize!r}"
        )
        shapes = [tuple(shape) for shape in shapes]
        check_config(
            all(_natural(d) for shape in shapes for d in shape),
            f"shapes must be tuples of ints >= 0, got {shapes!r}",
        )
        if not shapes or not self.moments:
            return 0
        features = [_features(shape) for shape in shapes]
        kinds = [_kind(shape) for shape in shapes]
        largest: dict[tuple[Feature, Kind], int] = {}
        for values, kind in zip(features, kinds, strict=True):
            for feature, value in values.items():
                for key in ((feature, Kind.ANY), (feature, kind)):
                    largest[key] = max(largest.get(key, 0), value)
        units = _units(features, kinds, self.unit)
        peak = 0
        for moment in self.moments:
            constant = moment.fixed.bytes_at(itemsize)
            varying = []
            for term in moment.terms:
                key, cost = (term.feature, term.kind), term.cost.bytes_at(itemsize)
                if term.role is Role.LARGEST:
                    constant += largest.get(key, 0) * cost
                else:
                    varying.append((term.role is Role.PREVIOUS, key, cost))
            for position, current in enumerate(units):
                previous = units[position - 1] if position else None
                if moment.at is not Kind.ANY and moment.at is not current.kind:
                    continue
                if moment.after is not Kind.ANY and (previous is None or moment.after is not previous.kind):
                    continue
                total = constant
                for held, key, cost in varying:
                    unit = previous if held else current
                    total += unit.features.get(key, 0) * cost if unit else 0
                peak = max(peak, total)
        return peak
