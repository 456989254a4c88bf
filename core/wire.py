# zeroplan.core — pure planning: no torch, no I/O.
# Wire formats: what gradients (and parameters) travel as, their bytes, and the error each codec may add.
"""Wire formats: the encodings a collective's payload can travel in, their bytes and error bounds.

[Note: wire formats]
A wire format says how a tensor is encoded for the network and how the
receiver turns it back into numbers it accumulates in fp32:

* ``param``: the parameter dtype, as today (bf16 gradients are summed in bf16
  by a reduce-scatter on NCCL).
* ``fp32``: four bytes per element, exact for bf16/fp16 gradients.
* ``bf16``: two bytes per element; the receiver adds the pieces in fp32 (an
  exchange, not a reduce-scatter, so the sum does not round to bf16 at each
  hop): a bf16 reduce-scatter's bytes, an fp32 sum of the bf16 values.
* ``int8`` and ``fp8`` (e4m3): one byte per element plus one fp32 scale per
  block of ``block`` elements (qgZ / qwZ in DeepSpeed ZeRO++): each block is
  scaled so its largest magnitude maps to the format's largest value (127,
  448), rounded to nearest, and multiplied back by the scale on receipt.
  The round trip's error in a block is at most half a quantum: ``scale / 2``
  for int8; for e4m3 ``2**-4`` of the value's magnitude (3 mantissa bits),
  at least ``2**-10 * scale`` (its subnormal spacing is ``2**-9``)
  (:func:`round_trip_bound`).

Gradients (``ZeroOptimizer(reduce_dtype=...)``, ``ZeroPlan.grad_wire``):
every format but ``param`` reduces each bucket by an exchange, never a
reduce-scatter: the sender encodes each rank's piece of the staged bucket
(each piece in blocks of its own, so a block never straddles two pieces),
one ``all_to_all_single`` moves the elements (a second the scales), and the
receiver decodes every rank's copy of its piece into fp32 slots and adds them
in rank order, then writes (casts) the sum into its gradient shard. With
replicas (MiCS) the shard group's fp32 sum takes the same path over the
replica group, as a reduce-scatter and an all-gather would: it is split in
``R`` parts (:func:`replica_parts`), each encoded, exchanged all-to-all and
added in replica order by the replica owning that part, whose sum is encoded
once more and all-gathered; every replica, the part's owner included, decodes
every part, so all hold the same bits. That is ``2 (R - 1) / R`` of the piece
per rank, a ring all-reduce's bytes, at the cost of two more encodings. The
staging buffer holds the rooms (``WireRooms`` in ``zeroplan.core.arena``);
traffic counts the encoded bytes,
scales included. A block with an infinity or a NaN decodes to non-finite
values, so an fp16 overflow still reaches the loss scaler. The alignment
must be a multiple of the block (:func:`check_wire`). Not combined with
deterministic mode (an encoded rank sum is not the world-1 run's sum).
The bytes of an encoded piece are :func:`wire_bytes`.

Parameters (``ZeroOptimizer(gather_dtype=...)``, ``ZeroPlan.param_wire``:
``bf16``, ``int8`` or ``fp8``): every gather of updated parameters (stages
1-2 after ``step()``, stage 3 before each use) is encoded. Each rank encodes
its piece of the block into its *slot* of a room allocated for that gather
(:class:`GatherRoom`: the elements, then the piece's scales; blocks of the
codec start at the piece's first element) and decodes it back into its piece
at once, so **the owner holds the same decoded values as every other rank**
(ranks whose model copies differed would diverge silently). The slots move by
the block's own collectives, as bytes (an all-gather of equal slots, a
broadcast per owner, the exchange, or both hops of a two-hop gather: the
inter-node and the intra-node hop are both encoded, the encoding done once by
the owner). On completion each other slot is decoded into its piece and the
room is let go; pieces are encoded and decoded a chunk of whole blocks at a
time through an fp32 scratch. The fp32 masters stay exact: they are never
read back from the parameters, except where a user wrote them, which is told
apart from the wire's rounding by re-encoding the master and comparing bits
(``keep_param_writes``, ``gathered_params(writeback=True)``). So at stages 1
and 2 the parameters must be bf16/fp16 (fp32 parameters are their own master
there, stepped in place); stage 3's shard is exact for any dtype. Traffic
counts each slot's bytes; the rooms of every block of a step (stages 1-2: all
in flight from ``step()`` to the first read) and one scratch are in the planned
peak (``zeroplan.core.peak``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from zeroplan.core.dtypes import DTYPE_ITEMSIZE
from zeroplan.core.errors import ConfigError, check_config
from zeroplan.core.space import Block
from zeroplan.core.span import Span, round_up

__all__ = [
    "DEFAULT_WIRE_BLOCK",
    "WIRE_CHUNK",
    "GatherRoom",
    "WireCodec",
    "WireFormat",
    "check_wire",
    "gather_room",
    "replica_parts",
    "round_trip_bound",
    "wire_chunk",
    "wire_bytes",
    "wire_payload_bytes",
    "wire_scale_bytes",
]

#: Elements per scale of the blockwise codecs (int8, fp8).
DEFAULT_WIRE_BLOCK = 128
_SCALE_BYTES = 4  # one fp32 scale per block

#: Elements a gather encodes or decodes at a time through its fp32 scratch (rounded to whole blocks).
WIRE_CHUNK = 1 << 16


class WireFormat(str, Enum):
    """What a payload travels as ([Note: wire formats])."""

    PARAM = "param"
    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"
    FP8 = "fp8"

    @property
    def blockwise(self) -> bool:
        """Whether it carries one fp32 scale per block."""
        return self in (WireFormat.INT8, WireFormat.FP8)

    def __str__(self) -> str:
        return self.value


#: Largest magnitude each blockwise format represents: a block's largest value is scaled to it.
_LARGEST = {WireFormat.INT8: 127.0, WireFormat.FP8: 448.0}
_ELEMENT_BYTES = {WireFormat.FP32: 4, WireFormat.BF16: 2, WireFormat.INT8: 1, WireFormat.FP8: 1}


@dataclass(frozen=True)
class WireCodec:
    """A wire format with its block size (elements per scale; ignored by unscaled formats).

    Raises:
        ConfigError: an unknown format or a block size below 1.
    """

    format: WireFormat
    block: int = DEFAULT_WIRE_BLOCK

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "format", WireFormat(self.format))
        except ValueError:
            choices = ", ".join(repr(f.value) for f in WireFormat)
            raise ConfigError(f"unknown wire format {self.format!r}; use one of {choices}") from None
        check_config(
            type(self.block) is int and self.block >= 1, f"wire block must be an int >= 1, got {self.block!r}"
        )

    @property
    def largest(self) -> float:
        """The magnitude a block's largest element is scaled to (blockwise formats)."""
        return _LARGEST[self.format]

    @property
    def element_size(self) -> int:
        """Bytes per element on the wire (not for ``param``, whose size is the parameters')."""
        check_config(self.format is not WireFormat.PARAM, "the param wire's element size is the parameters'")
        return _ELEMENT_BYTES[self.format]

    def element_bytes(self, param_dtype: str) -> int:
        """Bytes per element on the wire, for parameters of ``param_dtype``."""
        if self.format is WireFormat.PARAM:
            return DTYPE_ITEMSIZE[param_dtype]
        return _ELEMENT_BYTES[self.format]

    def summary(self, param_dtype: str) -> dict[str, object]:
        """What travels, per element of ``param_dtype`` parameters: the wire dtype, its bytes and the
        scales' share (one fp32 scale per block), for reports.

        Example:
            >>> WireCodec(WireFormat.INT8, block=128).summary("bfloat16")["scale_bytes_per_element"]
            0.03125
        """
        scales = _SCALE_BYTES / self.block if self.format.blockwise else 0.0
        return {
            "format": self.format.value,
            "block": self.block if self.format.blockwise else None,
            "element_bytes": self.element_bytes(param_dtype),
            "scale_bytes_per_element": scales,
            "accumulated_in": "float32",
        }


def wire_bytes(codec: WireCodec, numel: int, param_dtype: str) -> int:
    """Bytes of ``numel`` elements encoded by ``codec``: the elements, then a scale per started block.

    Example:
        >>> wire_bytes(WireCodec(WireFormat.INT8, block=128), 300, "bfloat16")   # 300 + 3 scales
        312
        >>> wire_bytes(WireCodec(WireFormat.BF16), 300, "float32")
        600
    """
    return wire_payload_bytes(codec, numel, param_dtype) + wire_scale_bytes(codec, numel)


def wire_payload_bytes(codec: WireCodec, numel: int, param_dtype: str) -> int:
    """Bytes of ``numel`` encoded elements, scales left out."""
    return numel * codec.element_bytes(param_dtype)


def wire_scale_bytes(codec: WireCodec, numel: int) -> int:
    """Bytes of the fp32 scales of ``numel`` elements: one per started block (none unscaled)."""
    return -(-numel // codec.block) * _SCALE_BYTES if codec.format.blockwise else 0


def check_wire(codec: WireCodec, alignment: int) -> None:
    """Refuse a blockwise codec whose blocks would straddle two ranks' pieces.

    Raises:
        ConfigError: ``alignment`` is not a multiple of the codec's block.
    """
    if codec.format.blockwise and alignment % codec.block:
        raise ConfigError(
            f"the {codec.format.value} wire's block of {codec.block} elements does not divide the "
            f"alignment ({alignment}): a block would straddle two ranks' pieces; use a block that "
            f"divides it (e.g. {_largest_divisor(alignment, codec.block)}) or alignment a multiple of "
            f"{codec.block}"
        )


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def round_trip_bound(codec: WireCodec, value: float, scale: float) -> float:
    """The most a value may change in an encode/decode round trip, given its block's ``scale``.

    ``scale`` is the block's largest magnitude divided by :attr:`WireCodec.largest`.
    Unscaled formats: half an ulp of ``value`` in that format (0 for fp32 and
    the parameter dtype, which the caller already holds exactly).

    Example:
        >>> round_trip_bound(WireCodec(WireFormat.INT8), 3.0, 0.5)
        0.25
        >>> round_trip_bound(WireCodec(WireFormat.FP8), 10.0, 1.0)
        0.625
    """
    magnitude = abs(value)
    if codec.format is WireFormat.INT8:
        return scale / 2
    if codec.format is WireFormat.FP8:
        return max(magnitude * 2**-4, scale * 2**-10)
    if codec.format is WireFormat.BF16:
        return magnitude * 2**-8
    return 0.0


@dataclass(frozen=True)
class GatherRoom:
    """The bytes of one block's encoded gather ([Note: wire formats]), allocated while it is in flight.

    One *slot* per shard rank, consecutive and in rank order: the rank's piece
    encoded (its elements, padded to 4 bytes when scales follow, then one fp32
    scale per block started at the piece's first element). Pieces are encoded
    and decoded ``chunk`` elements at a time through an fp32 scratch of
    ``scratch_bytes``, allocated only while that runs (none for the unscaled
    bf16 wire, a cast).

    Attributes:
        payloads: per rank, the bytes of its encoded elements.
        scales: per rank, the bytes of its scales (empty when unscaled).
        chunk: elements encoded or decoded at a time (a multiple of the block).
        scratch_numel: fp32 elements of the scratch.
    """

    payloads: tuple[Span, ...]
    scales: tuple[Span, ...]
    chunk: int
    scratch_numel: int

    @property
    def nbytes(self) -> int:
        """Bytes of the slots: what stays allocated while the gather is in flight."""
        return self.scales[-1].stop if self.scales else 0

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the scratch, alive only while a piece is encoded or decoded."""
        return _SCALE_BYTES * self.scratch_numel

    def slot(self, rank: int) -> Span:
        """Rank ``rank``'s slot: its elements, then its scales."""
        return Span(self.payloads[rank].start, self.scales[rank].stop)

    @property
    def slots(self) -> Block:
        """The slots as a block of bytes: what the gather's collectives move (every rank's slot)."""
        sizes = tuple(self.slot(q).numel for q in range(len(self.payloads)))
        return Block(start=0, pieces=sizes, shard_starts=(0,) * len(sizes))


@lru_cache(maxsize=256)
def gather_room(codec: WireCodec, pieces: tuple[int, ...], param_dtype: str) -> GatherRoom:
    """The room of an encoded gather of a block whose ranks hold ``pieces`` elements.

    Example:
        >>> room = gather_room(WireCodec(WireFormat.INT8, block=4), (6, 6), "bfloat16")
        >>> room.slot(1), room.scales[1]         # 6 int8 padded to 8 bytes, then 2 scales
        (Span(start=16, stop=32), Span(start=24, stop=32))
        >>> room.nbytes, room.scratch_bytes      # 6 fp32 elements at most in the scratch
        (32, 24)
    """
    payloads, scales = [], []
    at = 0
    for numel in pieces:
        nbytes = wire_payload_bytes(codec, numel, param_dtype)
        scaled = wire_scale_bytes(codec, numel)
        payloads.append(Span(at, at + nbytes))
        at = round_up(at + nbytes, _SCALE_BYTES) if scaled else at + nbytes
        scales.append(Span(at, at + scaled))
        at += scaled
    chunk = wire_chunk(codec)
    scratch = min(chunk, max(pieces, default=0)) if codec.format.blockwise else 0
    return GatherRoom(tuple(payloads), tuple(scales), chunk, scratch)


def wire_chunk(codec: WireCodec) -> int:
    """Elements a piece is encoded or decoded in at a time: :data:`WIRE_CHUNK`, in whole blocks."""
    return codec.block * max(1, WIRE_CHUNK // codec.block)


def replica_parts(numel: int, replicas: int) -> tuple[int, ...]:
    """How a rank's summed piece of ``numel`` elements is split over ``replicas`` for the encoded
    replica step ([Note: wire formats]): ``ceil(numel / replicas)`` each, the last ones shorter.

    Example:
        >>> replica_parts(10, 4), replica_parts(3, 4)
        ((3, 3, 3, 1), (1, 1, 1, 0))
    """
    sub = -(-numel // replicas)
    return tuple(min(sub, max(0, numel - k * sub)) for k in range(replicas))
