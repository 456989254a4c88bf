"""Tensor-parallel parameters: the local shards zeroplan shards again over data parallelism.

[Note: tensor-parallel parameters]
A parameter that torch's tensor parallel made a ``DTensor`` on the mesh's ``tp``
dimension is, on each rank, a *local tensor* (its spec's ``shape``, beside its
``global_shape`` and ``placement``: [Note: placements] in ``core.placement``): a slice of the global parameter
(``Shard(d)``: torch's ``chunk`` rule, so the last ranks' slices may be shorter
or empty) or all of it (``Replicate()``). zeroplan plans and shards the local
tensors over the data-parallel group as it would plain parameters: every rank
of one ``tp`` coordinate holds the same local shapes, so its data-parallel
group agrees on one plan, and each ``tp`` coordinate has its own.

What the model-parallel placement changes is accounted here, not guessed in
the facade:

* a gradient arrives in the placement autograd gives it (``Partial`` over
  ``tp`` for a sequence-parallel norm's weight, ``Replicate`` at full size for
  a row-split embedding): it is brought to its parameter's placement before
  the data-parallel reduction (a sum over ``tp``, or a slice);
* the gradient norm counts every element of the global model once: a
  ``tp``-sharded local tensor's elements on every ``tp`` rank (their powers
  summed over ``tp``), a replicated one's on ``tp`` rank 0 only
  (:func:`tensor_replicas` names them, :func:`norm_windows` gives the
  windows of the shard each rank counts); plain tensors in a tensor-parallel
  model are replicas too (Megatron counts such "tensor-parallel duplicates" once);
* the overflow verdict is joined over ``tp`` (one verdict for the model).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from zeroplan.core.partition import PartitionPlan
from zeroplan.core.placement import Shard
from zeroplan.core.span import Span
from zeroplan.core.specs import ParamSpec

__all__ = ["TENSOR_DIM", "norm_windows", "tensor_replicas"]

#: The name of the tensor-parallel mesh dimension.
TENSOR_DIM = "tp"


def tensor_replicas(specs: Sequence[ParamSpec]) -> frozenset[int]:
    """The parameters every ``tp`` rank holds whole (no ``Shard`` on ``tp``; plain ones included).

    Example:
        >>> from zeroplan.core import Replicate, Shard
        >>> split = (("tp", Shard(0)),)
        >>> specs = [ParamSpec(index=0, name="w", shape=(2, 4), global_shape=(4, 4), placement=split),
        ...          ParamSpec(index=1, name="n", shape=(4,), placement=(("tp", Replicate()),)),
        ...          ParamSpec(index=2, name="b", shape=(4,))]
        >>> sorted(tensor_replicas(specs))
        [1, 2]
    """
    return frozenset(
        s.index
        for s in specs
        if not any(name == TENSOR_DIM and isinstance(p, Shard) for name, p in s.placement)
    )


def norm_windows(
    partition: PartitionPlan, shard_rank: int, extents: Sequence[int], skip: Collection[int]
) -> tuple[tuple[Span, ...], ...]:
    """Per space, the windows of this rank's shard whose elements it counts in the gradient norm.

    Everything up to the space's ``extent`` but the fragments of the parameters in ``skip`` (the
    replicas another ``tp`` rank counts, [Note: tensor-parallel parameters]); adjacent windows merge,
    so a space without such parameters is one window.
    """
    skipped = frozenset(skip)
    out: list[tuple[Span, ...]] = []
    for s, extent in enumerate(extents):
        windows: list[Span] = []
        cursor = 0
        fragments = sorted(partition.rank_fragments(s, shard_rank), key=lambda f: f.shard_offset)
        for frag in fragments:
            if frag.param not in skipped or not frag.param_span.numel:
                continue
            span = frag.shard_span
            if span.start > cursor:
                windows.append(Span(cursor, min(span.start, extent)))
            cursor = max(cursor, span.stop)
        if cursor < extent:
            windows.append(Span(cursor, extent))
        out.append(tuple(w for w in windows if w.numel > 0))
    return tuple(out)
