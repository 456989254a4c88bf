# zeroplan.core — pure planning: no torch at module level, no I/O.
# Parameters enter the planner as descriptions, never as tensors.
"""``ParamSpec``: the planner's description of one parameter.

Specs are built from shapes (:func:`specs_from_shapes`) or from a live
``torch.nn.Module`` (:func:`specs_from_module`, which imports torch lazily and
reads only shapes, dtypes and ``requires_grad``; meta-device modules work).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from zeroplan.core.dtypes import canonical_dtype, itemsize
from zeroplan.core.errors import ConfigError, check_config
from zeroplan.core.fingerprint import digest
from zeroplan.core.placement import MeshPlacement, check_placement, placement_key, sharded_dims

__all__ = ["ParamSpec", "check_specs", "specs_fingerprint", "specs_from_module", "specs_from_shapes"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSpec:
    """Description of one parameter, as the planner sees it.

    Attributes:
        index: position of the parameter in the optimizer's flat parameter list
            (``0..n-1``; plans key everything by it).
        name: human-readable name, used in messages and reports.
        shape: the local shape, the part of the tensor this rank holds (the whole
            tensor unless ``placement`` shards it); every plan, report and
            checkpoint computes from it. ``()`` is a scalar, a ``0`` dimension is legal.
        dtype: canonical dtype name (``"float32"``, ``"bfloat16"``, ...).
        group: index of the optimizer param group the parameter belongs to.
        trainable: ``requires_grad``; frozen parameters are owned by no rank.
        cohort: parameters whose optimizer state started together. Elementwise
            optimizers step one flat window per (dtype, group, cohort) run (cut
            where fp32 pieces stepped in place are not contiguous), so a
            parameter unfrozen mid-run (a new cohort) keeps its own ``step``
            counter, as it would in ``torch.optim``.
        global_shape: the whole tensor's shape across the mesh; ``None`` (the
            default) stands for ``shape``, and is replaced by it. A plain spec
            (``placement=()``) is whole on every rank: its global shape is
            always its ``shape``, so ``dataclasses.replace(spec, shape=...)``
            describes the new shape whole.
        placement: how the global tensor lies on named mesh dimensions (see
            [Note: placements] in ``zeroplan.core.placement``): ``(name, Shard(d))``
            or ``(name, Replicate())`` pairs; ``()``, a plain tensor, is
            replicated everywhere. Along a dimension some ``Shard`` splits, the
            local size is at most the global one; along every other it is equal.
        numel: number of local elements (derived).

    Example:
        >>> ParamSpec(index=0, name="w", shape=(3, 4), dtype="bf16").numel
        12
        >>> from zeroplan.core import Shard
        >>> tp = ParamSpec(index=0, name="w", shape=(3, 4), global_shape=(6, 4),
        ...                placement=(("tp", Shard(0)),))
        >>> tp.numel, tp.global_shape
        (12, (6, 4))
    """

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    group: int = 0
    trainable: bool = True
    cohort: int = 0
    global_shape: tuple[int, ...] | None = None
    placement: MeshPlacement = ()
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        check_config(
            type(self.index) is int and self.index >= 0,
            f"ParamSpec.index must be an int >= 0, got {self.index!r}",
        )
        check_config(
            isinstance(self.shape, tuple) and all(type(d) is int and d >= 0 for d in self.shape),
            f"ParamSpec {self.name!r}: shape must be a tuple of ints >= 0, got {self.shape!r}; "
            "pass e.g. shape=(768, 3072)",
        )
        check_config(
            type(self.group) is int and self.group >= 0,
            f"ParamSpec {self.name!r}: group must be an int >= 0, got {self.group!r}",
        )
        check_config(
            type(self.cohort) is int and self.cohort >= 0,
            f"ParamSpec {self.name!r}: cohort must be an int >= 0, got {self.cohort!r}",
        )
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        object.__setattr__(self, "numel", math.prod(self.shape))
        if self.placement == ():
            # A plain tensor is whole on every rank: its global shape is its shape, so that
            # ``dataclasses.replace(spec, shape=...)`` keeps working on plain specs.
            object.__setattr__(self, "global_shape", self.shape)
            return
        if self.global_shape is None:
            object.__setattr__(self, "global_shape", self.shape)
        self._check_placement()

    def _check_placement(self) -> None:
        """Global shape and placement well formed, and the local shape one of the placement's pieces."""
        glob = self.global_shape or ()  # None was replaced by the local shape
        check_config(
            isinstance(glob, tuple) and all(type(d) is int and d >= 0 for d in glob),
            f"ParamSpec {self.name!r}: global_shape must be a tuple of ints >= 0 (or None for the local "
            f"shape), got {glob!r}",
        )
        problem = check_placement(self.placement, len(glob))
        check_config(problem is None, f"ParamSpec {self.name!r}: {problem}")
        check_config(
            len(glob) == len(self.shape),
            f"ParamSpec {self.name!r}: local shape {self.shape} and global shape {glob} have different "
            "numbers of dimensions; a shard keeps every dimension of the global tensor",
        )
        split = sharded_dims(self.placement)
        for d, (here, whole) in enumerate(zip(self.shape, glob, strict=True)):
            if d in split:
                check_config(
                    here <= whole,
                    f"ParamSpec {self.name!r}: local shape {self.shape} is larger than global shape {glob} "
                    f"along dimension {d}, which placement {self.placement} shards; a shard holds at most "
                    "the whole dimension",
                )
            else:
                check_config(
                    here == whole,
                    f"ParamSpec {self.name!r}: local shape {self.shape} differs from global shape {glob} "
                    f"along dimension {d}, which placement {self.placement} does not shard; pass "
                    f"Shard({d}) on the mesh dimension that splits it, or global_shape equal to shape "
                    "for a replicated tensor",
                )

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole parameter."""
        return self.numel * self.itemsize

    def key(self) -> tuple[Any, ...]:
        """Stable tuple identifying the spec (for fingerprints and comparisons).

        A plain spec (``placement=()``) has the key it always had; a placed one
        adds its global shape and placement.
        """
        key = (self.index, self.name, self.shape, self.dtype, self.group, self.trainable, self.cohort)
        if self.placement:
            return (*key, self.global_shape, placement_key(self.placement))
        return key


def check_specs(specs: Sequence[ParamSpec]) -> tuple[ParamSpec, ...]:
    """Validate a spec list: indices ``0..n-1`` in order, groups non-decreasing.

    Param groups are contiguous in the flat parameter list (as in
    ``torch.optim``), which keeps every group's elements contiguous in a shard.

    Raises:
        ConfigError: the list is not a valid parameter list.
    """
    specs = tuple(specs)
    group = 0
    for position, spec in enumerate(specs):
        # Checked cheaply first (this runs on every plan); messages are built only on failure.
        fine = isinstance(spec, ParamSpec) and spec.index == position
        if not (fine and (not position or spec.group >= group)):
            check_config(
                isinstance(spec, ParamSpec),
                f"specs[{position}] is {type(spec).__name__}, expected ParamSpec",
            )
            check_config(
                spec.index == position,
                f"specs[{position}] has index {spec.index}; indices must be 0..n-1 in list order "
                "(build specs with specs_from_shapes or specs_from_module)",
            )
            if position:
                check_config(
                    spec.group >= specs[position - 1].group,
                    f"spec {spec.name!r} (group {spec.group}) follows group "
                    f"{specs[position - 1].group}; list parameters group by group",
                )
        group = spec.group
    return specs


def specs_fingerprint(specs: Iterable[ParamSpec]) -> str:
    """Stable digest of a parameter list: every spec's :meth:`ParamSpec.key`, in order.

    Ranks exchange it to check that they describe the same parameters (order,
    names, shapes, dtypes, groups, ``requires_grad`` and cohorts) before
    comparing plans; it does not depend on any planning setting.

    Example:
        >>> a = specs_from_shapes([(2, 3), (4,)])
        >>> specs_fingerprint(a) == specs_fingerprint(specs_from_shapes([(2, 3), (4,)]))
        True
        >>> specs_fingerprint(a) == specs_fingerprint(specs_from_shapes([(3, 2), (4,)]))
        False
    """
    return digest("specs", [s.key() for s in specs])


def specs_from_shapes(
    shapes: Iterable[Sequence[int]],
    *,
    dtype: str = "float32",
    names: Sequence[str] | None = None,
    trainable: Sequence[bool] | None = None,
) -> tuple[ParamSpec, ...]:
    """Specs for a list of shapes, all in one group.

    Example:
        >>> [s.numel for s in specs_from_shapes([(2, 3), (4,), ()])]
        [6, 4, 1]
    """
    shapes = [tuple(int(d) for d in shape) for shape in shapes]
    if names is not None and len(names) != len(shapes):
        raise ConfigError(f"got {len(names)} names for {len(shapes)} shapes; pass one name per shape")
    if trainable is not None and len(trainable) != len(shapes):
        raise ConfigError(
            f"got {len(trainable)} trainable flags for {len(shapes)} shapes; pass one flag per shape"
        )
    return tuple(
        ParamSpec(
            index=i,
            name=names[i] if names is not None else f"p{i}",
            shape=shape,
            dtype=dtype,
            trainable=True if trainable is None else bool(trainable[i]),
        )
        for i, shape in enumerate(shapes)
    )


def specs_from_module(module: Any) -> tuple[ParamSpec, ...]:
    """Specs for ``module.named_parameters()`` (torch imported lazily).

    Shared (tied) parameters appear once, as in ``module.parameters()``. Only
    metadata is read, so a module on the ``meta`` device costs no memory.
    """
    return tuple(
        ParamSpec(
            index=i,
            name=name,
            shape=tuple(param.shape),
            dtype=str(param.dtype),
            trainable=bool(param.requires_grad),
        )
        for i, (name, param) in enumerate(module.named_parameters())
    )
