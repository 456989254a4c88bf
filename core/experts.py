# zeroplan.core — pure planning: no torch, no I/O.
# What one rank of an expert-parallel (mixture-of-experts) model holds, and its domains.
"""``expert_domains``: one rank's parameters and domains under expert parallelism.

[Note: one rank's experts]
With expert parallelism of size E on a data-parallel world of W (E divides W),
the expert-parallel groups are E consecutive ranks, as Megatron, DeepSpeed and
InternLM lay them out: rank r is expert-parallel rank j = r % E and holds
experts [j*n/E, (j+1)*n/E) of every MoE layer of n experts. The ranks holding
the same experts, {j, j+E, j+2E, ...}, are its expert-data-parallel group of
W/E ranks; process r is rank r // E of it. Every expert-parallel rank holds as
many expert elements as any other (the experts of a layer are alike, which is
checked), so expert-parallel rank 0, experts [0, n/E), stands for all.

Expert parameters are found by name (``is_expert``; by default, a name with
".experts." in it) and come in two forms:
 * one tensor per expert, ``...experts.<e>.w1.weight``: the first integer
   component after the first component containing "expert" is the expert; the
   name before it is the MoE layer (``...experts.wrapped_experts.<e>...`` works);
 * stacked, a tensor whose leading dimension is its layer's experts, as
   transformers >= 5 stores Mixtral (``mlp.experts.gate_up_proj``, (n, 2f, d)):
   a rank holds (n/E, ...) of it.

With R ranks per node, R/E members of each expert-data-parallel group share a
node when E divides R, one when R divides E (the expert-parallel group spans
nodes); other pairs do not lay out evenly and are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

from zeroplan.core.domains import Domain
from zeroplan.core.errors import check_config
from zeroplan.core.specs import ParamSpec, check_specs
from zeroplan.core.topology import Topology

__all__ = ["ExpertSplit", "expert_domains"]


#: The message when no parameter is an expert (``format`` with E and the number of parameters).
_NO_EXPERTS = (
    "expert parallel size {0} needs expert parameters, but none of the model's {1} parameters is one "
    "(by default an expert parameter has '.experts.' in its name, as in Mixtral's "
    "'model.layers.0.block_sparse_moe.experts.3.w1.weight'); name them so, pass is_expert, or use an "
    "expert parallel size of 1 for a dense model"
)


def _is_expert_name(name: str) -> bool:
    return ".experts." in name


class _ExpertName(NamedTuple):
    """An expert tensor's layer, its expert (``None``: stacked, every expert in one) and its part."""

    layer: str
    expert: int | None
    member: str


def _parse_expert_name(name: str) -> _ExpertName:
    """See [Note: one rank's experts].

    Example:
        >>> _parse_expert_name("model.layers.0.block_sparse_moe.experts.3.w1.weight")
        _ExpertName(layer='model.layers.0.block_sparse_moe.experts', expert=3, member='w1.weight')
        >>> _parse_expert_name("model.layers.0.mlp.experts.gate_up_proj").expert is None
        True
    """
    parts = name.split(".")
    start = next((i for i, part in enumerate(parts) if "expert" in part), len(parts))
    for i in range(start + 1, len(parts)):
        if parts[i].isascii() and parts[i].isdigit():
            return _ExpertName(".".join(parts[:i]), int(parts[i]), ".".join(parts[i + 1 :]))
    return _ExpertName(name, None, "")


def _expert_ranks_per_node(world: int, expert_parallel: int, ranks_per_node: int | None) -> int | None:
    """Ranks per node of an expert-data-parallel group (see [Note: one rank's experts])."""
    if ranks_per_node is None or ranks_per_node >= world:
        return None
    if ranks_per_node % expert_parallel == 0:
        return ranks_per_node // expert_parallel
    check_config(
        expert_parallel % ranks_per_node == 0,
        f"ranks per node {ranks_per_node} and expert parallel size {expert_parallel}: one must divide "
        "the other, so that every node holds whole expert-parallel groups or every expert-parallel "
        "group whole nodes",
    )
    return 1


def _expert_signature(specs: Sequence[ParamSpec]) -> list[tuple[object, ...]]:
    """What must be alike between the experts of a layer: their tensors' parts, shapes, dtypes, flags."""
    return [(_parse_expert_name(s.name).member, s.shape, s.dtype, s.trainable) for s in specs]


def _local_experts(experts: Sequence[ParamSpec], expert_parallel: int) -> list[ParamSpec]:
    """The expert tensors expert-parallel rank 0 holds, in the user's order, stacked ones cut."""
    e = expert_parallel
    layers: dict[str, dict[int, list[ParamSpec]]] = {}
    kept: dict[int, ParamSpec] = {}
    for spec in experts:
        where = _parse_expert_name(spec.name)
        if where.expert is not None:
            layers.setdefault(where.layer, {}).setdefault(where.expert, []).append(spec)
            continue
        check_config(
            len(spec.shape) >= 1 and spec.shape[0] % e == 0,
            f"expert parameter {spec.name!r} of shape {spec.shape} has no expert index in its name, so it "
            f"is taken as its layer's experts stacked on the leading dimension ({spec.shape[:1]}), which "
            f"expert parallel size {e} does not divide; pick a divisor of the number of experts",
        )
        kept[spec.index] = dataclasses.replace(spec, shape=(spec.shape[0] // e, *spec.shape[1:]))
    for layer, members in layers.items():
        numbers = sorted(members)
        check_config(
            len(numbers) % e == 0,
            f"MoE layer {layer!r} has {len(numbers)} experts, which expert parallel size {e} does not "
            f"divide; pick a divisor of {len(numbers)}",
        )
        first = _expert_signature(members[numbers[0]])
        for number in numbers[1:]:
            check_config(
                _expert_signature(members[number]) == first,
                f"MoE layer {layer!r}: expert {number}'s parameters (names, shapes, dtypes) differ from "
                f"expert {numbers[0]}'s; expert parallelism needs alike experts",
            )
        for number in numbers[: len(numbers) // e]:
            kept.update((s.index, s) for s in members[number])
    return [kept[s.index] for s in experts if s.index in kept]


class ExpertSplit(NamedTuple):
    """What one rank of an expert-parallel model plans (:func:`expert_domains`).

    Attributes:
        specs: the rank's parameters: the dense ones in group 0, then its experts in group 1.
        domains: ``"data"`` (group 0, the whole world) and ``"experts"`` (group 1,
            an expert-data-parallel group).
    """

    specs: tuple[ParamSpec, ...]
    domains: tuple[Domain, Domain]


def expert_domains(
    specs: Sequence[ParamSpec],
    *,
    world_size: int,
    expert_parallel: int,
    shard_size: int | None = None,
    ranks_per_node: int | None = None,
    is_expert: Callable[[str], bool] = _is_expert_name,
) -> ExpertSplit:
    """One rank's parameters and its domains under expert parallelism ([Note: one rank's experts]).

    Args:
        specs: the whole model, every expert of every MoE layer, in param group 0.
        world_size: data-parallel ranks (``W``).
        expert_parallel: ranks splitting each MoE layer's experts (``E``, divides ``W``).
        shard_size: the dense parameters' shard groups (MiCS; default: the world).
        ranks_per_node: ranks sharing a node (default: the world).
        is_expert: whether a parameter name is an expert's (default: it contains ``".experts."``).

    Returns:
        The rank's specs, indexed ``0..m-1``: every dense parameter (group 0),
        then the experts of expert-parallel rank 0 (group 1); and the domains
        ``"data"`` over ``W`` ranks and ``"experts"`` over ``W // E``, for
        :func:`plan_domains`.

    Raises:
        ConfigError: ``E`` does not divide ``W`` or a layer's experts, no parameter
            is an expert, specs in several groups, or unlike experts in a layer.

    Example:
        Two MoE layers of 4 experts over a world of 8, 2 experts per rank:

        >>> from zeroplan.core.specs import specs_from_shapes
        >>> names = ["embed"] + [f"layers.{i}.experts.{e}.w" for i in range(2) for e in range(4)]
        >>> split = expert_domains(specs_from_shapes([(8, 4)] * 9, names=names),
        ...                        world_size=8, expert_parallel=4)
        >>> [(s.index, s.name, s.group) for s in split.specs]
        [(0, 'embed', 0), (1, 'layers.0.experts.0.w', 1), (2, 'layers.1.experts.0.w', 1)]
        >>> [(d.name, d.groups, d.topology.world_size) for d in split.domains]
        [('data', (0,), 8), ('experts', (1,), 2)]
    """
    specs = check_specs(specs)
    e = expert_parallel
    check_config(
        type(e) is int and e >= 1,
        f"expert parallel size must be an int >= 1 (1: no expert parallelism), got {e!r}",
    )
    data = Topology(world_size=world_size, shard_size=shard_size, ranks_per_node=ranks_per_node)
    check_config(
        world_size % e == 0,
        f"expert parallel size {e} does not divide the data-parallel world of {world_size}; pick a "
        f"divisor of {world_size} (each expert-data-parallel group has world / expert parallel ranks)",
    )
    grouped = sorted({s.group for s in specs} - {0})
    check_config(
        not grouped,
        f"expert_domains puts dense parameters in group 0 and experts in group 1 itself; pass every "
        f"spec in group 0 (got groups {grouped})",
    )
    dense = [s for s in specs if not is_expert(s.name)]
    experts = [s for s in specs if is_expert(s.name)]
    check_config(len(experts) > 0, _NO_EXPERTS.format(e, len(specs)))
    local = [*dense, *(dataclasses.replace(s, group=1) for s in _local_experts(experts, e))]
    rank_specs = tuple(dataclasses.replace(s, index=i) for i, s in enumerate(local))
    expert_topology = Topology(
        world_size=world_size // e,
        ranks_per_node=_expert_ranks_per_node(world_size, e, data.ranks_per_node),
    )
    domains = (
        Domain(name="data", groups=(0,), topology=data),
        Domain(name="experts", groups=(1,), topology=expert_topology),
    )
    return ExpertSplit(check_specs(rank_specs), domains)
