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

import math
from collections.abc import Collection, Sequence
from dataclasses import replace

from zeroplan.core.comm import Collective, all_reduce_send
from zeroplan.core.errors import ConfigError
from zeroplan.core.partition import PartitionPlan
from zeroplan.core.placement import Replicate, Shard
from zeroplan.core.span import Span
from zeroplan.core.specs import ParamSpec
from zeroplan.core.traffic import CommCost

__all__ = [
    "TENSOR_DIM",
    "chunk_rows",
    "norm_windows",
    "tensor_parallel_specs",
    "tensor_replicas",
    "tensor_split",
    "tensor_traffic",
]

#: The name of the tensor-parallel mesh dimension.
TENSOR_DIM = "tp"


def tensor_split(spec: ParamSpec) -> int | None:
    """The dimension of ``spec`` its placement splits over ``tp``, or ``None`` (a replica).

    Example:
        >>> tensor_split(ParamSpec(index=0, name="w", shape=(4, 2), global_shape=(4, 4),
        ...                        placement=(("tp", Shard(1)),)))
        1
    """
    return next((p.dim for name, p in spec.placement if name == TENSOR_DIM and isinstance(p, Shard)), None)


def chunk_rows(size: int, rank: int, degree: int) -> Span:
    """The rows ``rank`` of ``degree`` holds of a dimension of ``size``: torch's ``chunk`` rule
    (``ceil(size / degree)`` each, the last ranks fewer or none).

    Example:
        >>> [chunk_rows(5, r, 3) for r in range(3)]
        [Span(start=0, stop=2), Span(start=2, stop=4), Span(start=4, stop=5)]
        >>> chunk_rows(2, 2, 3)
        Span(start=2, stop=2)
    """
    step = math.ceil(size / degree) if size else 0
    start = min(size, step * rank)
    return Span(start, min(size, start + step))


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
    return frozenset(s.index for s in specs if tensor_split(s) is None)


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


#: Megatron's split of a transformer by parameter name (the suffixes of Hugging Face and torchtitan
#: names): ``(suffixes, dimension split)``. Column-parallel linears split their output features
#: (dimension 0 of ``nn.Linear``'s weight, dimension 1 of GPT-2's transposed ``Conv1D``) and their
#: bias; row-parallel ones their input features (their bias is whole on every rank); token
#: embeddings and the output head split the vocabulary. Everything else (norms, position
#: embeddings, routers, row-parallel biases) is replicated.
_SPLITS: tuple[tuple[tuple[str, ...], int], ...] = (
    (
        (
            "q_proj.weight",
            "k_proj.weight",
            "v_proj.weight",
            "gate_proj.weight",
            "up_proj.weight",
            "w1.weight",
            "w3.weight",
            "lm_head.weight",
            "head.weight",
            "qkv.weight",
            "fc.weight",
            "embed_tokens.weight",
            "wte.weight",
            "tok.weight",
            "c_attn.bias",
            "c_fc.bias",
            "qkv.bias",
            "fc.bias",
            "q_proj.bias",
            "k_proj.bias",
            "v_proj.bias",
        ),
        0,
    ),
    (("o_proj.weight", "down_proj.weight", "w2.weight", "proj.weight", "out.weight"), 1),
    (("attn.c_attn.weight", "mlp.c_fc.weight"), 1),  # GPT-2 Conv1D: (in, out), column-parallel
    (("attn.c_proj.weight", "mlp.c_proj.weight"), 0),  # GPT-2 Conv1D: (in, out), row-parallel
)


def _split_dim(spec: ParamSpec) -> int | None:
    """The dimension Megatron's split cuts over ``tp`` for ``spec`` (its name's longest listed
    suffix of whole components decides), or ``None``."""
    best: tuple[int, int] | None = None  # (suffix length, dimension)
    for suffixes, dim in _SPLITS:
        for suffix in suffixes:
            whole = spec.name == suffix or spec.name.endswith("." + suffix)
            if whole and dim < len(spec.shape) and (best is None or len(suffix) > best[0]):
                best = (len(suffix), dim)
    return None if best is None else best[1]


def tensor_parallel_specs(
    specs: Sequence[ParamSpec], degree: int, rank: int = 0, dims: Sequence[int | None] | None = None
) -> tuple[ParamSpec, ...]:
    """``specs`` (whole parameters) as tensor-parallel rank ``rank`` of ``degree`` holds them.

    Split as Megatron and torchtitan split a transformer (:data:`_SPLITS`, by parameter name), or
    along ``dims`` (per spec, the dimension split over tp, ``None`` for a replica) when given; each
    split dimension cut by torch's ``chunk`` rule (``ceil(n / degree)`` rows per rank, the last ranks
    possibly fewer), so rank 0 holds the most; every spec carries its global shape and placement.

    Raises:
        ConfigError: ``degree`` below 1, a rank outside it, specs already placed, or ``dims`` of
            another length than ``specs`` or naming a dimension a spec does not have.

    Example:
        >>> from zeroplan.core import preset_specs
        >>> local = tensor_parallel_specs(preset_specs("llama-7b")[:9], 4)
        >>> [(s.name.split(".")[-2], s.shape) for s in local[4:8:3]]
        [('o_proj', (4096, 1024)), ('down_proj', (4096, 2752))]
        >>> local[5].shape, local[5].global_shape, local[5].placement
        ((2752, 4096), (11008, 4096), (('tp', Shard(dim=0)),))
    """
    if type(degree) is not int or degree < 1:
        raise ConfigError(f"the tensor-parallel degree must be an int >= 1, got {degree!r}")
    if not 0 <= rank < degree:
        raise ConfigError(f"tensor-parallel rank {rank!r} is not one of the {degree} ranks")
    if dims is not None and len(dims) != len(specs):
        raise ConfigError(f"dims has {len(dims)} entries for {len(specs)} specs: give one per spec")
    out = []
    for i, spec in enumerate(specs):
        if spec.placement:
            raise ConfigError(f"{spec.name!r} is placed already ({spec.placement}): pass whole parameters")
        dim = (_split_dim(spec) if dims is None else dims[i]) if degree > 1 else None
        if dim is not None and not 0 <= dim < len(spec.shape):
            raise ConfigError(f"{spec.name!r} of shape {spec.shape} has no dimension {dim} to split")
        if dim is None:
            out.append(replace(spec, global_shape=spec.shape, placement=((TENSOR_DIM, Replicate()),)))
            continue
        shape = list(spec.shape)
        shape[dim] = chunk_rows(spec.shape[dim], rank, degree).numel
        out.append(
            replace(spec, shape=tuple(shape), global_shape=spec.shape, placement=((TENSOR_DIM, Shard(dim)),))
        )
    return tuple(out)


def tensor_traffic(
    specs: Sequence[ParamSpec],
    degree: int,
    *,
    clipping: bool,
    loss_scaling: bool,
    sequence_parallel: bool,
    rank: int = 0,
) -> tuple[CommCost, ...]:
    """What zeroplan sends over the ``tp`` group per step, by this rank ([Note: tensor-parallel parameters]).

    With ``sequence_parallel`` the gradients of the replicated trainable parameters (norms, row-parallel
    biases) arrive ``Partial`` and are all-reduced over ``tp`` before the data-parallel reduction, one
    call per parameter; the gradient norm (with ``clipping``) and the overflow verdict (with
    ``loss_scaling``) add one float32 scalar each. The model's own tensor-parallel collectives (its
    activations and their gradients) are not zeroplan's and not counted.

    Example:
        >>> from zeroplan.core import preset_specs
        >>> local = tensor_parallel_specs(preset_specs("llama-7b"), 2)
        >>> [(c.collective.value, c.calls, c.bytes) for c in tensor_traffic(
        ...     local, 2, clipping=True, loss_scaling=False, sequence_parallel=True)]
        [('all_reduce', 65, 1064960), ('all_reduce', 1, 4)]
    """
    if degree == 1:
        return ()
    out = []
    replicas = tensor_replicas(specs)
    if sequence_parallel:
        grads = [s for s in specs if s.index in replicas and s.trainable]
        sent = sum(all_reduce_send(s.numel, degree, rank) * s.itemsize for s in grads)
        if grads:
            out.append(
                CommCost(group="tensor", collective=Collective.ALL_REDUCE, calls=len(grads), bytes=sent)
            )
    controls = int(clipping) + int(loss_scaling)
    if controls:
        out.append(
            CommCost(
                group="tensor",
                collective=Collective.ALL_REDUCE,
                calls=controls,
                bytes=controls * all_reduce_send(1, degree, rank) * 4,
            )
        )
    return tuple(out)
