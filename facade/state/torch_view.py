"""A rank's optimizer state in torch's layout: per parameter, its state shaped like it, held in pieces.

[Note: torch layout of shard state]
``ZeroOptimizer.state_dict()["state"]`` is what ``torch.optim`` keeps: integer
parameter ids (``param_groups`` order), each a dict of the parameter's state
(``step``, ``exp_avg``, ...). A per-element value is a :class:`FlatPieces` of
the parameter's shape whose parts are views of this rank's shard state (its
fragments of the parameter, [Note: pieces as boxes]); scalars are per parameter
(each a copy of its cohort's, named by the ranks that hold some of it); a parameter
frozen here with parked state is held whole by the rank that parks it. This is what
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` maps to
parameter names and ``dcp.save`` / ``dcp.load`` write and fill in place, so a
zeroplan run and an FSDP2 run read each other's checkpoints.

A cohort with no state yet gets fresh entries ([Note: fresh entries]). State
of a tensor subclass (torchao's low-bit moments) has no torch layout: its
pieces refuse to be saved or loaded by DCP.

[Note: fresh entries]
A cohort that has not stepped (a fresh optimizer, a group just added, a
parameter just unfrozen) has no state, but ``dcp.load`` needs tensors to fill:
it gets the state the inner optimizer's class makes before its first update,
recorded from one step on a two-element scratch tensor (``step`` 0, zero
moments for the Adam family, NAdam's ``mu_product`` 1, Rprop's step sizes at
the learning rate, ...). The real optimizer is left as it is, unlike torch's
``_init_optim_state``, which steps it once at learning rate zero so that its
own ``step`` reads 1. Loading reads an entry with ``step`` 0 as no state: the
cohort starts fresh, so a resumed run steps as the continued run does, bit for
bit, and an FSDP2 run that loads the entries starts as torch does from that
state. SGD keeps no ``step``: its fresh entry is a zero ``momentum_buffer``,
what torch's helper writes too, exact with ``dampening=0`` (the default);
with ``dampening`` above 0 a fresh buffer (the first gradient) and a zero one
differ, and the torch layout has no way to say "none yet".
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from zeroplan.core import ConfigError, ParamSpec
from zeroplan.facade.mechanisms.flat_pieces import FlatPieces
from zeroplan.facade.params.local_shards import global_place
from zeroplan.facade.state.inner import split_arguments
from zeroplan.facade.state.parts import Shards
from zeroplan.facade.state.tree import MASTER, ParkedParam, ShardState, is_per_element, tree_clone

__all__ = ["ParamStates", "torch_state"]

_SUBCLASS = (
    "optimizer state of tensor class {cls} (a low-bit optimizer's moments) has no torch layout: "
    "torch.distributed.checkpoint cannot save or load it; use zeroplan.facade.checkpoint, or an "
    "optimizer with plain tensor state for DCP interchange"
)


def torch_state(
    sh: Shards, state: ShardState, parked: Mapping[int, ParkedParam]
) -> dict[int, dict[str, Any]]:
    """This rank's state in torch's layout ([Note: torch layout of shard state]): views of ``state``.

    Args:
        sh: the optimizer's parts (``state.dicts.Shards``).
        state: this rank's shard state (copies the caller keeps).
        parked: this rank's parked state of frozen parameters.
    """
    zp, rank = sh.zp, sh.groups.shard_rank
    out: dict[int, dict[str, Any]] = {}

    def placed(spec: ParamSpec) -> dict[str, tuple[int, ...]]:  # a tp slice's pieces in global coordinates
        return global_place(spec, sh.tensor_slice)

    if not zp.elementwise:
        return {p: dict(entry) for p, entry in state.whole.items()}
    held = zp.partition.held_fragments(rank)
    space_of = {space.dtype: space.index for space in zp.partition.spaces}
    fresh = _FreshEntries(sh)
    for spec in zp.specs:
        if not spec.trainable:
            continue
        si = space_of[spec.dtype]
        buf = sh.buffers[si]
        device = buf.master_device
        scalars = state.scalars.get((spec.group, spec.cohort))
        flat: dict[str, torch.Tensor | float]
        if scalars is None:
            scalars, flat = fresh.entry(spec.group)
        else:
            flat = {k: values for (space, k), values in state.flat.items() if space == si}
        frags = held[spec.index]
        # A rank that holds none of the parameter does not know its cohort's scalars: it names none.
        entry: dict[str, Any] = tree_clone(dict(scalars)) if frags else {}
        for key, values in flat.items():
            if not torch.is_tensor(values):  # a fresh cohort's start ([Note: fresh entries])
                dtype = buf.master_dtype
                parts = [
                    (f.param_span, torch.full((f.param_span.numel,), values, dtype=dtype, device=device))
                    for f in frags
                ]
            else:
                dtype = values.dtype
                parts = [(f.param_span, values[f.shard_span.as_slice()]) for f in frags]
            plain = not torch.is_tensor(values) or type(values) is torch.Tensor
            refusal = None if plain else _SUBCLASS.format(cls=type(values))
            entry[key] = FlatPieces(
                spec.shape, parts, dtype=dtype, device=device, refusal=refusal, **placed(spec)
            )
        out[spec.index] = entry
    for p, park in parked.items():
        entry = tree_clone(dict(park.scalars))
        for key, pieces in park.pieces.items():
            if key != MASTER:
                pieces_ = sorted(pieces, key=lambda piece: piece[0].start)
                entry[key] = FlatPieces(zp.specs[p].shape, pieces_, **placed(zp.specs[p]))
        out[p] = {**entry, **tree_clone(dict(park.whole or {}))}
    return out


class _FreshEntries:
    """The state a fresh cohort holds before its first update, per param group ([Note: fresh entries])."""

    def __init__(self, sh: Shards) -> None:
        self._sh = sh
        self._groups: dict[int, tuple[dict[str, Any], dict[str, float]]] = {}

    def entry(self, group: int) -> tuple[dict[str, Any], dict[str, float]]:
        """(scalars, per-element key -> the value every element starts at) of a fresh cohort of ``group``."""
        if group not in self._groups:
            self._groups[group] = self._scratch(group)
        return self._groups[group]

    def _scratch(self, group: int) -> tuple[dict[str, Any], dict[str, float]]:
        inner = self._sh.inner.optimizer
        settings = next(
            (g for g in inner.param_groups if any(s.group == group for s in self._windows(g))),
            self._sh.param_groups[group],
        )
        tensor = torch.zeros(2, device=self._sh.device, requires_grad=True)
        kwargs, extra = split_arguments(type(inner), settings)  # the real learning rate: Rprop, ASGD
        scratch = type(inner)([{"params": [tensor], **extra}], **kwargs)
        made = dict(scratch.state.get(tensor, {}))  # Adagrad makes its state when constructed, from kwargs
        if not made:
            scratch.state = defaultdict(_FirstValues)
            tensor.grad = torch.zeros_like(tensor)
            scratch.step()
            made = scratch.state[tensor].first
        scalars = {k: tree_clone(v) for k, v in made.items() if not is_per_element(v, tensor)}
        starts = {k: v.reshape(-1)[0].item() for k, v in made.items() if is_per_element(v, tensor)}
        return scalars, starts

    def _windows(self, group: dict[str, Any]) -> list[Any]:
        ids = {id(t) for t in group["params"]}
        return [s for t, s in zip(self._sh.inner.tensors, self._sh.inner.specs, strict=True) if id(t) in ids]


class _FirstValues(dict[str, Any]):
    """A scratch optimizer's state of one tensor that keeps a copy of each key's first value: what the
    optimizer makes before it updates the values in place (SGD's momentum buffer, made after the update
    from a zero gradient, is zero)."""

    def __init__(self) -> None:
        super().__init__()
        self.first: dict[str, Any] = {}

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self.first:
            self.first[key] = tree_clone(value)
        super().__setitem__(key, value)


class ParamStates(Mapping[torch.Tensor, dict[str, Any]]):
    """``ZeroOptimizer.state``: the inner optimizer's state on this rank; a parameter's in torch's layout.

    Iterating gives what this rank holds, as the inner optimizer keeps it (its
    windows of the shard and their state: real tensors, which memory meters
    such as ``MemTracker`` count once). Indexing by a parameter gives its state
    in torch's layout (from ``state_dict()``: copies). It is true whenever
    something trains, also before the first step: torch's
    ``_init_optim_state`` then leaves the optimizer alone instead of stepping it
    with zero gradients (a fresh optimizer's ``state_dict()`` already names the
    state its first step makes, [Note: torch layout of shard state]).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        inner: Mapping[torch.Tensor, dict[str, Any]],
        state_dict: Callable[[], dict[str, Any]],
    ) -> None:
        self._params = list(params)
        self._position = {id(p): i for i, p in enumerate(self._params)}
        self._inner = inner
        self._state_dict = state_dict

    def __bool__(self) -> bool:
        return any(p.requires_grad for p in self._params)

    def __getitem__(self, key: torch.Tensor) -> dict[str, Any]:
        position = self._position.get(id(key))
        if position is None:
            return self._inner[key]
        whole = self._state_dict()
        if "state" not in whole:
            raise ConfigError(
                "optimizer state in torch's layout is not available with expert groups: read "
                "state_dict()['domains'] or save with zeroplan.facade.checkpoint"
            )
        return whole["state"].get(position, {})

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)
