"""Flat buffers laid out by the plan; parameters become views into them.

Takes: a plan and the parameters; gives: the buffers every path ends in (the gradient shard the
reduction sums into, [Note: gradient path]; the full buffers the gathers fill, [Note: parameter
path] in ``mechanisms.gathering``).

[Note: flat buffers]
For every dtype space of the plan this rank allocates, at stages 1 and 2
(:class:`FlatBuffers`):

* ``params`` — the full parameter buffer (``buffer_numel`` elements, padding
  included, zero); each trainable parameter's ``.data`` becomes a view of it
  (no second full copy);
* ``grads`` — stage 1 only: the full gradient buffer, parameter ``.grad`` views;
* ``grad_shard`` — this rank's reduced gradients: at stage 1 with a rank-major
  layout its region of ``grads`` (reduced in place), otherwise ``shard_numel``
  elements of ``grad_shard_dtype`` (fp32 for bf16/fp16 parameters);
* ``master`` — what the inner optimizer steps: fp32 copies of bf16/fp16
  parameters, a tensor of its own. Parameters of the master dtype are stepped
  in place (``ZeroPlan.master_in_params``): ``master`` is the rank's region of
  ``params`` with a rank-major layout, and ``None`` with an interleaved one,
  whose pieces are not contiguous in ``params`` (see [Note: layout]): the
  inner optimizer's windows are cut where a piece does not follow the last in
  ``params`` and each is a view of ``params`` (:meth:`SpaceBuffers.master_window`).

At stage 3 (:class:`BlockBuffers`) no full buffer lives between steps:
``blocks`` holds one full buffer per block of the plan, whose
storage is allocated only while the block is gathered ([Note: stage 3] in
``params.sharded``), parameters are views of their block, and ``shard`` holds
the rank's pieces of every block for good (its ``master`` when the parameters
have the master dtype).

Each buffer is allocated where the plan places its role (the parameters'
device or host memory, [Note: residences]; :func:`buffer_device`); by default
all of them on the parameters' device.

The rank's shard in the full buffer is its *pieces*; :func:`read_pieces` and
:func:`write_pieces` move a flat shard out of and into them. All offsets come
from the plan; nothing here computes a layout.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zeroplan.core import Space, Span, ZeroPlan, master_dtype
from zeroplan.core.allocation import BufferRole, BufferSpec, SpaceAllocation, allocation
from zeroplan.facade.mechanisms.assembly import Assembly
from zeroplan.facade.mechanisms.buffer_devices import buffer_device
from zeroplan.facade.mechanisms.torch_dtypes import torch_dtype
from zeroplan.facade.mechanisms.wire_codec import PublishedPieces

__all__ = [
    "BlockBuffers",
    "FlatBuffers",
    "SpaceBuffers",
    "block_positions",
    "block_views",
    "build_block_buffers",
    "build_flat_buffers",
    "cut_kept",
    "kept_window",
    "param_views",
    "read_pieces",
    "write_pieces",
]


#: Elements compared at a time by :meth:`SpaceBuffers.keep_param_writes` (its temporaries stay small).
_COMPARE_CHUNK = 2**16


class SpaceBuffers:
    """This rank's buffers of one dtype space (see [Note: flat buffers]): what both kinds share.

    :class:`FlatBuffers` (stages 1 and 2: a full buffer lives between steps) and
    :class:`BlockBuffers` (stage 3: blocks gathered on demand, a shard of its own) are the two kinds;
    ``install`` builds the one the plan's stage asks for (:func:`build_flat_buffers`,
    :func:`build_block_buffers`).

    ``extent`` is the length of the rank's shard in the full buffer (its
    pieces, padding included): ``grad_shard[:extent]`` and the master's first
    ``extent`` elements (:meth:`master_window`) hold everything the rank steps,
    the rest is allocation padding. ``master`` is ``None`` where the rank steps
    its pieces of ``params`` in place.
    """

    __slots__ = (
        "extent",
        "grad_shard",
        "kept",
        "kept_grad",
        "kept_master",
        "master",
        "owns_master",
        "shard_rank",
        "space",
    )

    def __init__(
        self,
        *,
        space: Space,
        grad_shard: torch.Tensor,
        master: torch.Tensor | None,
        extent: int,
        shard_rank: int,
        owns_master: bool,
        kept: int = 0,
        kept_grad: torch.Tensor | None = None,
        kept_master: torch.Tensor | None = None,
    ) -> None:
        self.space = space
        self.grad_shard = grad_shard
        self.master = master
        self.extent = extent
        self.shard_rank = shard_rank
        self.owns_master = owns_master
        """Whether the master is a buffer of its own (``ZeroPlan.own_master``), which values are copied
        into and out of: fp32 copies of bf16/fp16 parameters, or masters placed apart from fp32
        parameters ([Note: offload, planned])."""
        self.kept = kept
        """A partial offload's kept prefix ([Note: kept on the device]): the shard's first ``kept``
        elements have their gradients and masters in ``kept_grad`` and ``kept_master`` (on the device);
        ``grad_shard`` and ``master`` (host memory) hold the rest, from element ``kept`` on."""
        self.kept_grad = kept_grad
        self.kept_master = kept_master

    #: Stage 1's full gradient buffer (parameter ``.grad`` are views of it); ``None`` elsewhere.
    grads: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' dtype."""
        return torch_dtype(self.space.dtype)

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype the inner optimizer steps (fp32 for bf16/fp16 parameters)."""
        return torch_dtype(master_dtype(self.space.dtype))

    @property
    def carries_master(self) -> bool:
        """Whether the master is a tensor of its own (fp32 copies of bf16/fp16 parameters): saved, moved."""
        return self.master_dtype != self.dtype

    @property
    def master_copy(self) -> torch.Tensor:
        """The master of bf16/fp16 parameters (``carries_master``), one tensor.

        Raises:
            RuntimeError: the rank steps its parameters in place: they are the master; or a partial
                offload keeps the master in two parts (read :meth:`master_source`, write
                :meth:`write_master`).
        """
        if self.master is None or not self.carries_master:
            raise RuntimeError(f"the {self.space.dtype} parameters are their own master: no master copy")
        if self.kept:
            raise RuntimeError(
                f"the {self.space.dtype} master is kept in two parts ([Note: kept on the device])"
            )
        return self.master

    def master_source(self) -> torch.Tensor | Assembly:
        """The rank's masters of bf16/fp16 parameters (``carries_master``), ``extent`` elements: a view,
        or (a partial offload) its two parts to assemble in host memory ([Note: assembled file tensors])."""
        if not self.kept or self.master is None or self.kept_master is None:
            return self.master_copy[: self.extent]
        parts = ((Span(0, self.kept), self.kept_master[: self.kept]),)
        if self.extent > self.kept:
            parts += ((Span(self.kept, self.extent), self.master[: self.extent - self.kept]),)
        return Assembly(self.extent, self.master.dtype, self.master.device, parts)

    def master_values(self) -> torch.Tensor:
        """A copy of the rank's masters of bf16/fp16 parameters (``carries_master``), ``extent`` elements."""
        source = self.master_source()
        return source.into() if isinstance(source, Assembly) else source.clone()

    def write_master(self, values: torch.Tensor, span: Span | None = None) -> None:
        """Copy ``values`` into elements ``span`` (all ``extent`` by default) of the rank's master (its
        own, or the parameters it steps in place), across a partial offload's two parts."""
        span = Span(0, self.extent) if span is None else span
        for part, view in self._master_parts(span):
            view.copy_(values[part.shift(-span.start).as_slice()])

    def read_master(self, span: Span) -> torch.Tensor:
        """Elements ``span`` of the rank's master: a view, or a copy where ``span`` crosses the kept
        prefix's end."""
        parts = self._master_parts(span)
        if len(parts) == 1:
            return parts[0][1]
        return torch.cat([view.to(parts[-1][1].device) for _, view in parts])

    def _master_parts(self, span: Span) -> list[tuple[Span, torch.Tensor]]:
        """``span`` of the master as (its elements, a view of them), cut at the kept prefix's end."""
        return [(part, self.master_window(part)) for part in cut_kept(span, self.kept)]

    def grad_window(self, span: Span) -> torch.Tensor:
        """Elements ``span`` of the rank's gradient shard, as a view (in the kept part or the rest).

        Raises:
            RuntimeError: ``span`` crosses the end of a partial offload's kept prefix.
        """
        return kept_window(span, self.kept, self.kept_grad, self.grad_shard)

    @property
    def master_device(self) -> torch.device:
        """Where the rank's master values live: its own master, or the parameters it steps in place."""
        return (self.master if self.master is not None else self.param_target).device

    @property
    def param_bytes(self) -> int:
        """Bytes of parameters held between steps: the full buffer, or the shard at stage 3."""
        raise NotImplementedError

    @property
    def param_target(self) -> torch.Tensor:
        """Where the rank's updated values go: the full parameter buffer (stages 1-2; the rank's
        pieces of it), or the parameter shard (stage 3)."""
        raise NotImplementedError

    def master_window(self, span: Span) -> torch.Tensor:
        """Elements ``span`` of the rank's master, as a view (in the kept part or the rest).

        Raises:
            RuntimeError: no master of its own, or ``span`` crosses the end of the kept prefix.
        """
        if self.master is None:
            raise RuntimeError(f"the {self.space.dtype} space has no master of its own here")
        return kept_window(span, self.kept, self.kept_master, self.master)

    def shard_values(self) -> torch.Tensor:
        """The rank's shard of the parameters, flat: a view or a copy."""
        source = self.shard_source()
        return source.into() if isinstance(source, Assembly) else source

    def shard_source(self) -> torch.Tensor | Assembly:
        """The rank's shard of the parameters, flat: a view, or views to assemble ([Note: assembled
        file tensors])."""
        raise NotImplementedError

    def load_master(self) -> None:
        """Copy the rank's shard of the parameters into a separate master."""
        raise NotImplementedError

    def publish_master(self) -> None:
        """Copy a separate master into the rank's pieces of the parameters (cast)."""
        raise NotImplementedError

    def keep_param_writes(self) -> None:
        """Take into the master what was written into the rank's pieces of the parameters."""

    def write_shard(self, values: torch.Tensor) -> None:
        """Copy flat shard values (``extent`` elements) into the rank's pieces of the parameters (cast)."""
        raise NotImplementedError

    def settle_from_rank_zero(self, broadcast: Callable[[torch.Tensor], None]) -> None:
        """Take rank 0's parameter values (``broadcast`` sends a tensor from rank 0 to all)."""
        raise NotImplementedError


class FlatBuffers(SpaceBuffers):
    """Stages 1 and 2: the full parameter buffer (``params``) lives between steps ([Note: flat buffers])."""

    __slots__ = ("grads", "params")

    def __init__(self, *, params: torch.Tensor, grads: torch.Tensor | None, **common: Any) -> None:
        super().__init__(**common)
        self.params = params
        self.grads = grads

    @property
    def param_bytes(self) -> int:
        """Bytes of the full parameter buffer."""
        return self.params.untyped_storage().nbytes()

    @property
    def param_target(self) -> torch.Tensor:
        """The full parameter buffer, where the rank's pieces take its updated values."""
        return self.params

    def master_window(self, span: Span) -> torch.Tensor:
        """Elements ``span`` of the rank's master, as a view: of ``master``, or of its run of ``params``."""
        if self.master is not None:
            return super().master_window(span)
        return self.params[self.space.buffer_span(self.shard_rank, span).as_slice()]

    def shard_source(self) -> torch.Tensor | Assembly:
        """The rank's shard of the parameters, flat: a view of its region, or its pieces to assemble."""
        if self.space.shard_is_region:
            return self.params[self.space.region(self.shard_rank).as_slice()]
        pieces = self.space.pieces_of(self.shard_rank)
        parts = tuple((p.shard_span, self.params[p.buffer_span.as_slice()]) for p in pieces)
        return Assembly(self.extent, self.params.dtype, self.params.device, parts)

    def load_master(self) -> None:
        """Copy the rank's pieces of the parameters into a separate master."""
        if self.owns_master and self.master is not None:
            if not self.kept:
                read_pieces(self.params, self.space, self.shard_rank, self.master)
                return
            masters, fulls = self._kept_pieces()
            torch._foreach_copy_(masters, fulls)

    def publish_master(self) -> None:
        """Copy a separate master into the rank's pieces of the parameters (cast)."""
        if self.owns_master and self.master is not None:
            if not self.kept:
                write_pieces(self.master, self.params, self.space, self.shard_rank)
                return
            masters, fulls = self._kept_pieces()
            torch._foreach_copy_(fulls, masters)

    def _kept_pieces(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The rank's pieces cut at a partial offload's kept prefix: views of the master's two parts
        and of the full buffer where they go."""
        masters, fulls = [], []
        for p in self.space.pieces_of(self.shard_rank):
            shift = p.buffer_span.start - p.shard_span.start
            for part in cut_kept(p.shard_span, self.kept):
                masters.append(self.master_window(part))
                fulls.append(self.params[part.shift(shift).as_slice()])
        return masters, fulls

    def write_shard(self, values: torch.Tensor) -> None:
        """Copy flat shard values into the rank's pieces of the full buffer (cast)."""
        write_pieces(values, self.params, self.space, self.shard_rank)

    def settle_from_rank_zero(self, broadcast: Callable[[torch.Tensor], None]) -> None:
        """Take rank 0's full buffer, then the master from it."""
        broadcast(self.params)
        self.load_master()

    def keep_param_writes(self, published: PublishedPieces | None = None) -> None:
        """Take into the master what was written into the rank's pieces of bf16/fp16 parameters.

        Stages 1 and 2 (see [Note: parameter writes]): every element of the
        rank's pieces whose parameter no longer holds the cast of its master
        (``model.load_state_dict(...)``, an in-place edit) gets the parameter's
        value as its master; the others keep their fp32 bits. Compared in
        chunks, as bits (a NaN equals itself), on the device: nothing is read
        on the host ([Note: one host read] in ``joint``). Under a parameter
        wire (``published``) the parameters hold what the master publishes as
        (encoded and decoded), and that is compared instead.
        """
        if not self.carries_master:
            self.load_master()  # an fp32 master of its own takes the parameters' values exactly
            return
        full = self.params
        if published is not None:
            for piece in published.pieces:
                shift = piece.buffer_span.start - piece.shard_span.start
                for part in cut_kept(piece.shard_span, self.kept):
                    published.take_written(self.master_window(part), full[part.shift(shift).as_slice()])
            return
        bits = torch.int16  # bf16 and fp16 alike
        for piece in self.space.pieces_of(self.shard_rank):
            shift = piece.buffer_span.start - piece.shard_span.start
            for chunk in (
                c for part in cut_kept(piece.shard_span, self.kept) for c in part.chunks(_COMPARE_CHUNK)
            ):
                held = full[chunk.shift(shift).as_slice()]
                values = self.master_window(chunk)
                written = values.to(self.dtype).view(bits) != held.view(bits)
                values.copy_(torch.where(written, held.to(values.dtype), values))


class BlockBuffers(SpaceBuffers):
    """Stage 3: a buffer per block, allocated while gathered, and the rank's shard ([Note: flat buffers])."""

    __slots__ = ("blocks", "shard")

    def __init__(self, *, blocks: tuple[torch.Tensor, ...], shard: torch.Tensor, **common: Any) -> None:
        super().__init__(**common)
        self.blocks = blocks
        self.shard = shard

    @property
    def param_bytes(self) -> int:
        """Bytes of the shard (the blocks are the step's transients)."""
        return self.shard.untyped_storage().nbytes()

    @property
    def param_target(self) -> torch.Tensor:
        """The parameter shard, which takes the rank's updated values."""
        return self.shard

    def shard_source(self) -> torch.Tensor:
        """The rank's shard of the parameters, a view."""
        return self.shard[: self.extent]

    def load_master(self) -> None:
        """Copy the shard into a separate master (its two parts under a partial offload)."""
        if self.owns_master and self.master is not None:
            if self.kept_master is not None:
                self.kept_master.copy_(self.shard[: self.kept])
            self.master.copy_(self.shard[self.kept :])

    def publish_master(self) -> None:
        """Copy a separate master into the shard (cast)."""
        if self.owns_master and self.master is not None:
            if self.kept_master is not None:
                self.shard[: self.kept].copy_(self.kept_master)
            self.shard[self.kept :].copy_(self.master)

    def write_shard(self, values: torch.Tensor) -> None:
        """Copy flat shard values into the parameter shard (cast)."""
        self.shard[: self.extent].copy_(values)

    def settle_from_rank_zero(self, broadcast: Callable[[torch.Tensor], None]) -> None:
        """Nothing: construction took rank 0's values block by block (``build_block_buffers``)."""

    def load_shard(self, published: PublishedPieces | None = None) -> None:
        """Copy the rank's pieces of every (gathered) block into its shard; under a parameter wire
        (``published``) only the elements that differ from what the shard publishes as."""
        for block, full in zip(self.space.blocks, self.blocks, strict=True):
            piece = block.piece(self.shard_rank)
            start = piece.buffer_span.start - block.start
            held, shard = (
                full[start : start + piece.shard_span.numel],
                self.shard[piece.shard_span.as_slice()],
            )
            if published is None:
                shard.copy_(held)
            else:
                published.take_written(shard, held)

    def write_piece(self, k: int) -> None:
        """Copy the rank's piece of block ``k`` from its shard into the block's buffer.

        Asynchronous from a shard in pinned host memory (``offload="all"``): the host writes that
        shard again only in the step, after it waited for the side stream, which waited for every
        such copy ([Note: offload, executed]).
        """
        block = self.space.blocks[k]
        piece = block.piece(self.shard_rank)
        start = piece.buffer_span.start - block.start
        piece_view = self.blocks[k][start : start + piece.shard_span.numel]
        piece_view.copy_(self.shard[piece.shard_span.as_slice()], non_blocking=True)


def cut_kept(span: Span, kept: int) -> list[Span]:
    """``span`` cut where a partial offload's kept prefix ends (``kept``; 0: none), empty parts left out."""
    if not kept or span.stop <= kept or span.start >= kept:
        return [span]
    return [Span(span.start, kept), Span(kept, span.stop)]


def kept_window(span: Span, kept: int, head: torch.Tensor | None, rest: torch.Tensor) -> torch.Tensor:
    """A view of elements ``span`` of a shard whose first ``kept`` elements are ``head``, the others
    ``rest`` (from its start)."""
    if span.start >= kept:
        return rest[span.shift(-kept).as_slice()] if kept else rest[span.as_slice()]
    if span.stop > kept or head is None:
        raise RuntimeError(f"elements {span} cross the end of the kept prefix ({kept}) of a partial offload")
    return head[span.as_slice()]


def read_pieces(full: torch.Tensor, space: Space, shard_rank: int, out: torch.Tensor) -> None:
    """``out[shard span] = full[buffer span]`` for each of the rank's pieces (cast to ``out``'s dtype).

    One ``_foreach_copy_`` for all of them: an interleaved shard has a piece per block (thousands for
    a large model over many ranks), and a copy each would be a kernel launch each on a GPU.
    """
    pieces = space.pieces_of(shard_rank)
    if pieces:
        torch._foreach_copy_(
            [out[p.shard_span.as_slice()] for p in pieces], [full[p.buffer_span.as_slice()] for p in pieces]
        )


def write_pieces(flat: torch.Tensor, full: torch.Tensor, space: Space, shard_rank: int) -> None:
    """``full[buffer span] = flat[shard span]`` for each of the rank's pieces (cast to ``full``'s dtype);
    one ``_foreach_copy_``, as :func:`read_pieces`."""
    pieces = space.pieces_of(shard_rank)
    if pieces:
        torch._foreach_copy_(
            [full[p.buffer_span.as_slice()] for p in pieces], [flat[p.shard_span.as_slice()] for p in pieces]
        )


def param_views(flat: torch.Tensor, space: Space, params: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Per parameter index of ``space``, its view of the full buffer ``flat``, shaped like the parameter."""
    return {
        index: flat[start : start + params[index].numel()].view(params[index].shape)
        for index, start in zip(space.params, space.buffer_offsets, strict=True)
    }


def block_positions(space: Space) -> dict[int, tuple[int, int]]:
    """Stage 3: per parameter index of ``space``, its block and where it starts inside that block.

    Stage-3 plans never cut a parameter at a block boundary (``whole_blocks``).
    """
    starts = [b.start for b in space.blocks]
    positions = {}
    for index, offset in zip(space.params, space.buffer_offsets, strict=True):
        k = max(bisect_right(starts, offset) - 1, 0)
        positions[index] = (k, offset - starts[k])
    return positions


def block_views(
    blocks: Sequence[torch.Tensor], space: Space, params: Sequence[torch.Tensor]
) -> dict[int, torch.Tensor]:
    """Stage 3: per parameter index of ``space``, its view of its block's buffer, shaped like it."""
    return {
        index: blocks[k][local : local + params[index].numel()].view(params[index].shape)
        for index, (k, local) in block_positions(space).items()
    }


def build_block_buffers(
    zp: ZeroPlan,
    params: Sequence[torch.Tensor],
    shard_rank: int,
    device: torch.device,
    settle_block: Callable[[torch.Tensor], None] | None = None,
) -> tuple[BlockBuffers, ...]:
    """Stage 3: this rank's shard and blocks per space, built block by block (:func:`_stage3_buffers`).

    ``settle_block`` is called on each block once its parameters' values are in it, before the
    rank's piece is kept and the block freed (construction broadcasts rank 0's values there).
    """
    plan = allocation(zp, shard_rank)  # [Note: allocation plan] in zeroplan.core.allocation
    return tuple(
        _stage3_buffers(space, planned, params, shard_rank, device, settle_block)
        for space, planned in zip(zp.partition.spaces, plan.spaces, strict=True)
    )


def build_flat_buffers(
    zp: ZeroPlan, params: Sequence[torch.Tensor], shard_rank: int, device: torch.device
) -> tuple[FlatBuffers, ...]:
    """Stages 1-2: allocate this rank's flat buffers, copy parameter values in, make parameters views.

    The values of every parameter are unchanged; only their storage moves.
    """
    result = []
    plan = allocation(zp, shard_rank)  # [Note: allocation plan] in zeroplan.core.allocation
    for space, planned in zip(zp.partition.spaces, plan.spaces, strict=True):
        made: dict[BufferRole, torch.Tensor] = {}
        full = _allocate(planned[BufferRole.FULL_PARAMS], made, device)  # padding stays zero
        views = param_views(full, space, params)
        for index, view in views.items():
            view.copy_(params[index].detach())
        grads_spec = planned.get(BufferRole.FULL_GRADS)
        grads = None if grads_spec is None else _allocate(grads_spec, made, device)
        grad_views = param_views(grads, space, params) if grads is not None else {}
        for index, view in views.items():
            param = params[index]
            previous = param.grad
            param.data = view
            if grads is not None:
                param.grad = grad_views[index]
                if previous is not None:
                    param.grad.copy_(previous)
        grad_shard = _allocate(planned[BufferRole.GRAD_SHARD], made, device)  # stage 1: maybe a view
        master_spec = planned.get(BufferRole.MASTER)  # none: interleaved and in place, the pieces of full
        master = None if master_spec is None else _allocate(master_spec, made, device)
        buf = FlatBuffers(
            space=space,
            params=full,
            grads=grads,
            grad_shard=grad_shard,
            master=master,
            extent=space.extent(shard_rank),
            shard_rank=shard_rank,
            owns_master=master_spec is not None and master_spec.view_of is None,
            **_kept_buffers(planned, made, device),
        )
        buf.load_master()
        result.append(buf)
    return tuple(result)


def _kept_buffers(
    planned: SpaceAllocation, made: dict[BufferRole, torch.Tensor], device: torch.device
) -> dict[str, Any]:
    """A partial offload's kept gradient shard and master on the device ([Note: kept on the device]),
    as keywords of :class:`SpaceBuffers` (none without one)."""
    grad, master = planned.get(BufferRole.KEPT_GRAD_SHARD), planned.get(BufferRole.KEPT_MASTER)
    if grad is None or master is None:
        return {}
    return {
        "kept": grad.numel,
        "kept_grad": _allocate(grad, made, device),
        "kept_master": _allocate(master, made, device),
    }


def _allocate(spec: BufferSpec, made: dict[BufferRole, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensor ``spec`` plans: zeros of its own where it lives (beside parameters on ``device``), or
    its view of a buffer ``made`` before it (which lives there too)."""
    if spec.view_of is None or spec.span is None:
        tensor = buffer_device(spec.residence, device).zeros(spec.numel, torch_dtype(spec.dtype))
    else:
        tensor = made[spec.view_of][spec.span.as_slice()]
    made[spec.role] = tensor
    return tensor


def _stage3_buffers(
    space: Space,
    planned: SpaceAllocation,
    params: Sequence[torch.Tensor],
    shard_rank: int,
    device: torch.device,
    settle_block: Callable[[torch.Tensor], None] | None,
) -> BlockBuffers:
    """Stage 3: the rank's shard and master, and a buffer per block, built one block at a time.

    Each block is allocated, its parameters' values copied in (each parameter then views it, and its
    old storage is released), settled (``settle_block``), its piece copied into the shard, and freed;
    the master and gradient shard come after. Construction holds the parameter shard and one block
    beyond the model's own parameters, never the model twice. The parameters start sharded
    ([Note: stage 3]); the first use gathers each block.
    """
    made: dict[BufferRole, torch.Tensor] = {}
    shard = _allocate(planned[BufferRole.PARAM_SHARD], made, device)
    members: dict[int, list[tuple[int, int]]] = {}
    for index, (k, local) in block_positions(space).items():
        members.setdefault(k, []).append((index, local))
    blocks = []
    for k, (block, spec) in enumerate(zip(space.blocks, planned.blocks, strict=True)):
        buffer = buffer_device(spec.residence, device).zeros(spec.numel, torch_dtype(spec.dtype))
        for index, local in members.get(k, ()):
            param = params[index]
            view = buffer[local : local + param.numel()].view(param.shape)
            view.copy_(param.detach())
            param.data = view
        if settle_block is not None:
            settle_block(buffer)
        piece = block.piece(shard_rank)
        start = piece.buffer_span.start - block.start
        shard[piece.shard_span.as_slice()].copy_(buffer[start : start + piece.shard_span.numel])
        buffer.untyped_storage().resize_(0)  # sharded: gathered again where it is used
        blocks.append(buffer)
    # Only now, with the parameters' old storage released: the master and the gradient shard.
    master = _allocate(planned[BufferRole.MASTER], made, device)
    grad_shard = _allocate(planned[BufferRole.GRAD_SHARD], made, device)
    buf = BlockBuffers(
        **_kept_buffers(planned, made, device),
        space=space,
        grad_shard=grad_shard,
        master=master,
        extent=space.extent(shard_rank),
        shard_rank=shard_rank,
        owns_master=planned[BufferRole.MASTER].view_of is None,
        blocks=tuple(blocks),
        shard=shard,
    )
    buf.load_master()
    return buf
