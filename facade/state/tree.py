"""One codec for a rank's shard state, and the tree operations every state path uses.

[Note: state codec]
A rank's optimizer state (``ShardState``, see [Note: shard state]) crosses a
boundary in three places: ``state_dict()``, checkpoints and consolidation.
All three use the same *leaves*, keyed by a path string:

* ``flat/<dtype>/<key>`` — per-element state over the rank's shard of a dtype
  space (a 1-D tensor, e.g. ``flat/bfloat16/exp_avg``);
* ``scalars/<group>/<cohort>`` — the scalar state shared by the windows of a
  (param group, cohort), a dict such as ``{"step": tensor(3.)}``;
* ``whole/<param>/<key>`` — state of a whole parameter (non-elementwise
  optimizers), a tensor of any shape or a plain value.

* ``parked/<param>/…`` — state of a parameter frozen after training (see
  [Note: parked state]), in the parameter's own coordinates.

A leaf held in a tensor subclass (torchao's quantized moments) is split into
plain tensors ``<path>@<attr>`` and a description ``<path>@subclass`` (see
[Note: subclass state]).

:func:`encode_state` and :func:`decode_state` convert between ``ShardState``
and leaves (:func:`encode_parked` and :func:`decode_parked` for parked
state); :func:`describe_state` gives the leaves' descriptions (a
:class:`TensorMeta` for a tensor, the value itself otherwise) without copying
anything, which is what consolidation exchanges. State values may be nested
(tuples, lists, dicts of tensors): :func:`tree_clone` walks them with
``optree``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import optree
import torch

from zeroplan.core import Space, Span, ZeroPlan
from zeroplan.facade.mechanisms.assembly import Assembly
from zeroplan.facade.mechanisms.torch_dtypes import dtype_name
from zeroplan.facade.state.subclasses import copy_tensor, join_subclasses, split_subclasses

if TYPE_CHECKING:  # inner imports buffers, which imports this module
    from zeroplan.facade.state.inner import Inner

__all__ = [
    "MASTER",
    "ParkedParam",
    "ShardState",
    "StateDescription",
    "TensorMeta",
    "decode_parked",
    "decode_state",
    "tensor_meta",
    "describe_state",
    "encode_parked",
    "encode_state",
    "is_per_element",
    "tree_clone",
]


class TensorMeta(NamedTuple):
    """A tensor described by its shape and dtype name (what ranks exchange instead of data)."""

    shape: tuple[int, ...]
    dtype: str


def tree_clone(tree: Any, device: torch.device | None = None) -> Any:
    """``tree`` with every tensor cloned (onto ``device`` if given); other leaves are shared."""

    def clone(leaf: Any) -> Any:
        return copy_tensor(leaf, device) if torch.is_tensor(leaf) else leaf

    return optree.tree_map(clone, tree, none_is_leaf=True)


def tensor_meta(tensor: torch.Tensor | Assembly) -> TensorMeta:
    """The shape and dtype name of ``tensor``."""
    return TensorMeta(tuple(tensor.shape), dtype_name(tensor.dtype))


class ShardState(NamedTuple):
    """This rank's optimizer state (see [Note: shard state] in ``state.shards``).

    Attributes:
        flat: ``(space, key)`` -> per-element state over the rank's owned elements.
        scalars: ``(group, cohort)`` -> scalar state shared by the windows.
        whole: parameter index -> state dict (non-elementwise optimizers).
    """

    flat: dict[tuple[int, str], torch.Tensor]
    scalars: dict[tuple[int, int], dict[str, Any]]
    whole: dict[int, dict[str, Any]]


#: The key of fp32 master pieces among a parked parameter's pieces.
MASTER = "zeroplan_master"


class ParkedParam(NamedTuple):
    """What one rank keeps of a frozen parameter's optimizer state (see [Note: parked state]).

    Attributes:
        scalars: the scalar state of its cohort when it was frozen (e.g. ``step``).
        pieces: per state key (and :data:`MASTER`), this rank's pieces as
            (span of the flattened parameter, values).
        whole: its whole state (non-elementwise optimizers), on the rank that held it.
    """

    scalars: dict[str, Any]
    pieces: dict[str, list[tuple[Span, torch.Tensor]]]
    whole: dict[str, Any] | None = None


def is_per_element(value: Any, window: torch.Tensor) -> bool:
    """Whether an inner optimizer state ``value`` of ``window`` has one element per window element."""
    return torch.is_tensor(value) and value.dim() == 1 and value.numel() == window.numel()


def encode_state(state: ShardState, spaces: Sequence[Space]) -> dict[str, Any]:
    """The leaves of ``state`` (see [Note: state codec]); tensors are shared, not copied."""
    leaves: dict[str, Any] = {}
    for (space, key), tensor in state.flat.items():
        leaves[f"flat/{spaces[space].dtype}/{key}"] = tensor
    for (group, cohort), values in state.scalars.items():
        leaves[f"scalars/{group}/{cohort}"] = values
    for param, entry in state.whole.items():
        for key, value in entry.items():
            leaves[f"whole/{param}/{key}"] = value
    return split_subclasses(leaves)


def decode_state(leaves: Mapping[str, Any], spaces: Sequence[Space]) -> ShardState:
    """Inverse of :func:`encode_state`; leaves of dtype spaces not in ``spaces`` are dropped.

    Raises:
        ValueError: a path of no known kind.
    """
    index = {space.dtype: space.index for space in spaces}
    state = ShardState(flat={}, scalars={}, whole={})
    for path, leaf in join_subclasses(leaves).items():
        kind, first, rest = [*path.split("/", 2), "", ""][:3]
        if kind == "flat" and rest:
            if first in index:
                state.flat[index[first], rest] = leaf
        elif kind == "scalars" and rest.isdigit() and first.isdigit():
            state.scalars[int(first), int(rest)] = leaf
        elif kind == "whole" and first.isdigit() and rest:
            state.whole.setdefault(int(first), {})[rest] = leaf
        else:
            raise ValueError(f"{path!r} is not a shard state path")
    return state


def encode_parked(parked: Mapping[int, ParkedParam]) -> dict[str, Any]:
    """The leaves of this rank's parked state (see [Note: state codec]).

    ``parked/<param>/scalars``, ``parked/<param>/piece/<start>/<key>`` (values of
    the flattened parameter from ``start``) and ``parked/<param>/whole/<key>``.
    """
    leaves: dict[str, Any] = {}
    for param, part in parked.items():
        leaves[f"parked/{param}/scalars"] = part.scalars
        for key, pieces in part.pieces.items():
            for span, values in pieces:
                leaves[f"parked/{param}/piece/{span.start}/{key}"] = values
        for key, value in (part.whole or {}).items():
            leaves[f"parked/{param}/whole/{key}"] = value
    return split_subclasses(leaves)


def decode_parked(leaves: Mapping[str, Any]) -> dict[int, ParkedParam]:
    """Inverse of :func:`encode_parked` (leaves of other kinds are ignored).

    Raises:
        ValueError: a ``parked/`` path of no known form.
    """
    parked: dict[int, ParkedParam] = {}
    for path, leaf in join_subclasses(leaves).items():
        if not path.startswith("parked/"):
            continue
        _, param, kind, *rest = [*path.split("/", 4), ""]
        if not param.isdigit():
            raise ValueError(f"{path!r} is not a parked state path")
        part = parked.setdefault(int(param), ParkedParam(scalars={}, pieces={}))
        if kind == "scalars":
            part.scalars.update(leaf)
        elif kind == "piece" and rest[0].isdigit() and rest[1]:
            start = int(rest[0])
            part.pieces.setdefault(rest[1], []).append((Span(start, start + leaf.numel()), leaf))
        elif kind == "whole" and rest[0]:
            whole = part.whole if part.whole is not None else {}
            whole["/".join(r for r in rest if r)] = leaf
            parked[int(param)] = part._replace(whole=whole)
        else:
            raise ValueError(f"{path!r} is not a parked state path")
    return parked


class StateDescription(NamedTuple):
    """What :func:`encode_state` of this rank's state would hold, without its data.

    Attributes:
        leaves: path -> :class:`TensorMeta` (tensors, nested ones included) or value.
        order: per (group, cohort), the inner optimizer's state keys in its own order.
    """

    leaves: dict[str, Any]
    order: dict[tuple[int, int], list[str]]


def describe_state(zp: ZeroPlan, inner: Inner, shard_rank: int) -> StateDescription:
    """Describe this rank's state leaves, copying no tensor data (consolidation exchanges this)."""
    leaves: dict[str, Any] = {}
    order: dict[tuple[int, int], list[str]] = {}
    spaces = zp.partition.spaces
    for spec, tensor in zip(inner.specs, inner.tensors, strict=True):
        state = inner.optimizer.state.get(tensor)
        if not state:
            continue
        if not zp.elementwise:
            for key, value in state.items():
                described = tensor_meta(value) if torch.is_tensor(value) else tree_clone(value)
                leaves[f"whole/{spec.param}/{key}"] = described
            continue
        order.setdefault((spec.group, spec.cohort), list(state))
        scalars = leaves.setdefault(f"scalars/{spec.group}/{spec.cohort}", {})
        owned = spaces[spec.space].extent(shard_rank)
        for key, value in state.items():
            if is_per_element(value, tensor):
                meta = TensorMeta((owned,), dtype_name(value.dtype))
                leaves.setdefault(f"flat/{spaces[spec.space].dtype}/{key}", meta)
            else:
                scalars[key] = tree_clone(value, torch.device("cpu"))
    return StateDescription(leaves=leaves, order=order)
