"""``FlatPieces``: a parameter-shaped tensor of which this rank holds flat ranges, in DCP's protocol.

What ``ZeroOptimizer.state_dict()["state"]`` holds per parameter (torch's layout, [Note: state dict
forms]) and what the model dicts of ``checkpoint.interchange`` hold: the tensor has the parameter's
shape; this rank holds the elements of its shard, each flat range a view of a 1-D tensor. torch's
distributed checkpoint (DCP) asks it for its boxes (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``: [Note: pieces as boxes] in
``zeroplan.core.boxes``) and reads and writes them in place: no gather.

Only what moves state around works on it (``detach``, ``clone``, ``to``, ``copy_``, ``torch.equal``,
pickling); arithmetic raises, since this rank does not hold the tensor.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.utils._pytree import tree_map_only

from zeroplan.core import ConfigError, Span
from zeroplan.core.boxes import Box, span_boxes

__all__ = ["FlatPieces", "flat_values"]

aten = torch.ops.aten


class FlatPieces(torch.Tensor):
    """Flat ranges of a tensor of shape ``shape`` this rank holds: ``parts`` of (range, 1-D values).

    Args:
        shape: the whole tensor's shape (the rank's local tensor's, for a tensor-parallel slice).
        parts: (element range of the flattened tensor, its values), ranges apart and in order.
        dtype, device: of an instance with no part (a rank that holds none of the tensor).
        refusal: why DCP may not save or load it (state of a class with no torch layout); ``None``.
        whole: with ``origin``, the global tensor of which ``shape`` is the slice at ``origin`` (a
            tensor-parallel parameter's, [Note: tensor-parallel parameters]): the instance has the
            global shape and DCP sees its boxes in global coordinates, while ``parts`` and
            :meth:`read` stay in the local tensor's.
        origin: where the local tensor starts in ``whole``, per dimension.
    """

    parts: tuple[tuple[Span, torch.Tensor], ...]
    boxes: tuple[tuple[Box, int], ...]
    refusal: str | None
    local_shape: tuple[int, ...]
    origin: tuple[int, ...] | None

    @staticmethod
    def __new__(
        cls: type[FlatPieces],
        shape: Sequence[int],
        parts: Sequence[tuple[Span, torch.Tensor]],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        refusal: str | None = None,
        whole: Sequence[int] | None = None,
        origin: Sequence[int] | None = None,
    ) -> FlatPieces:
        first = parts[0][1] if parts else None
        if (whole is None) != (origin is None):
            raise ValueError("give whole and origin together (a slice of a global tensor), or neither")
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            tuple(shape if whole is None else whole),
            dtype=first.dtype if first is not None else dtype,
            device=first.device if first is not None else device,
            requires_grad=False,
        )
        out.parts = tuple(parts)
        out.local_shape = tuple(shape)
        out.origin = None if origin is None else tuple(origin)
        out.boxes = tuple(
            (box if origin is None else _shifted(box, origin), k)
            for k, (span, _) in enumerate(out.parts)
            for box in span_boxes(tuple(shape), span)
        )
        out.refusal = refusal
        starts = [span.start for span, _ in out.parts]
        if starts != sorted(starts) or any(
            a.stop > b.start for (a, _), (b, _) in zip(out.parts, out.parts[1:], strict=False)
        ):
            raise ValueError(f"overlapping or unordered ranges {[s for s, _ in out.parts]}")
        for span, values in out.parts:
            if values.shape != (span.numel,):
                raise ValueError(f"range {span} holds values of shape {tuple(values.shape)}")
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:  # type: ignore[override]
        spans = ", ".join(f"[{s.start}, {s.stop})" for s, _ in self.parts) or "none"
        return f"FlatPieces(shape={tuple(self.shape)}, dtype={self.dtype}, elements {spans})"

    # ------------------------------------------------------------ reading
    def read(self, span: Span) -> torch.Tensor:
        """Elements ``span`` of the flattened tensor, as a view.

        Raises:
            ConfigError: this rank does not hold all of them.
        """
        k = bisect_right([s.start for s, _ in self.parts], span.start) - 1
        if k < 0 or not self.parts[k][0].contains(span):
            held = [f"[{s.start}, {s.stop})" for s, _ in self.parts]
            raise ConfigError(
                f"elements [{span.start}, {span.stop}) of a {tuple(self.shape)} tensor are not among the "
                f"ranges this rank holds ({', '.join(held) or 'none'}): a piece dict loads only into the "
                "optimizer it came from (get_optimizer_state_dict of this optimizer, filled by dcp.load)"
            )
        start, values = self.parts[k][0].start, self.parts[k][1]
        return values[span.start - start : span.stop - start]

    # ------------------------------------------------------------ DCP's protocol
    def _refuse(self) -> None:
        if self.refusal is not None:
            raise ConfigError(self.refusal)

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        """One write item per box this rank holds."""
        self._refuse()
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(box.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes)),
                    properties=TensorProperties(dtype=self.dtype),
                    size=self.shape,
                ),
            )
            for box, _ in self.boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """The boxes this rank holds (what DCP reads into)."""
        self._refuse()
        return [
            ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))
            for box, _ in self.boxes
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The box at ``index.offset``, as a view of this rank's values."""
        for box, k in self.boxes:
            if torch.Size(box.offsets) == index.offset:
                return self.parts[k][1][box.start : box.start + box.numel].view(box.sizes)
        raise ValueError(f"no box at offset {index.offset} of {index.fqn} on this rank ({self!r})")

    # ------------------------------------------------------------ the ops that move state
    def _map(self, fn: Any) -> FlatPieces:
        parts = [(span, fn(values)) for span, values in self.parts]
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        return FlatPieces(
            self.local_shape,
            parts,
            dtype=probe.dtype,
            device=probe.device,
            refusal=self.refusal,
            **self._placed(),
        )

    def _placed(self) -> dict[str, Any]:
        """``whole`` and ``origin`` for a tensor-parallel slice's copy; nothing otherwise."""
        return {} if self.origin is None else {"whole": tuple(self.shape), "origin": self.origin}

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._map(lambda t: t.detach())
        if func is aten.clone.default:
            return args[0]._map(lambda t: t.clone())
        if func is aten._to_copy.default:
            options = {k: v for k, v in kwargs.items() if k in ("dtype", "device", "non_blocking")}
            return args[0]._map(lambda t: t.to(**options, copy=True))
        if func is aten.is_pinned.default:
            return all(values.is_pinned() for _, values in args[0].parts)
        if func is aten.equal.default:
            a, b = args
            return (
                isinstance(b, FlatPieces)
                and a.shape == b.shape
                and [s for s, _ in a.parts] == [s for s, _ in b.parts]
                and all(torch.equal(x, y) for (_, x), (_, y) in zip(a.parts, b.parts, strict=True))
            )
        if func is aten.copy_.default:
            dest, src = args[0], args[1]
            if isinstance(src, FlatPieces) and [s for s, _ in dest.parts] == [s for s, _ in src.parts]:
                for (_, d), (_, s) in zip(dest.parts, src.parts, strict=True):
                    d.copy_(s, non_blocking=kwargs.get("non_blocking", False))
                return dest
        plain = tree_map_only(FlatPieces, repr, (args, kwargs))
        raise TypeError(
            f"{func} is not defined on FlatPieces {plain}: this rank holds only some elements of the "
            "tensor (its shard). Read them with .parts, take a full state dict "
            "(checkpoint.interchange.get_optimizer_state_dict with full_state_dict=True), or read a "
            "stage-3 parameter's values inside `with opt.gathered_params():` on every rank"
        )

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any, ...]]:
        spans = [(span.start, span.stop) for span, _ in self.parts]
        values = [values for _, values in self.parts]
        placed = self._placed()
        return _rebuild, (
            self.local_shape,
            spans,
            values,
            self.dtype,
            str(self.device),
            self.refusal,
            placed.get("whole"),
            placed.get("origin"),
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> FlatPieces:
        return self._map(lambda t: t.clone())


def _rebuild(
    shape: tuple[int, ...],
    spans: list[tuple[int, int]],
    values: list[torch.Tensor],
    dtype: torch.dtype,
    device: str,
    refusal: str | None,
    whole: tuple[int, ...] | None = None,
    origin: tuple[int, ...] | None = None,
) -> FlatPieces:
    """Unpickle a :class:`FlatPieces` (``torch.load`` with ``weights_only`` allows it)."""
    parts = [(Span(a, b), v) for (a, b), v in zip(spans, values, strict=True)]
    return FlatPieces(shape, parts, dtype=dtype, device=device, refusal=refusal, whole=whole, origin=origin)


def _shifted(box: Box, origin: Sequence[int]) -> Box:
    """``box`` of a local tensor, in the coordinates of the global tensor it starts at ``origin`` of."""
    return Box(
        offsets=tuple(o + d for o, d in zip(box.offsets, origin, strict=True)),
        sizes=box.sizes,
        start=box.start,
    )


torch.serialization.add_safe_globals([_rebuild])


def flat_values(value: torch.Tensor, span: Span) -> torch.Tensor:
    """Elements ``span`` of ``value`` flattened: a whole tensor's, or the pieces' this rank holds."""
    if isinstance(value, FlatPieces):
        return value.read(span)
    return value.reshape(-1)[span.as_slice()]
