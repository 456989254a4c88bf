"""Every ``torch.distributed`` call of a step, issued here and logged with the core cost model.

[Note: one place for collectives]
Free functions in the style of FSDP2's ``foreach_all_gather``: the modules
that own a step's phases decide *when* (``grad_sync`` as buckets fill,
``params.gather`` and ``params.sharded`` after ``step()`` and around each module,
``lifecycle`` for norms, overflow verdicts and the step agreement); these
functions decide *how*: which collective, on which group, from which views,
in which order pieces are summed. No other facade module calls
``torch.distributed`` during a step, so a new wire format or summation order
changes this module only.

Takes: views of buffers and the process groups; gives: :class:`Pending` handles (or blocking
results). The policies choose which of these to call (``reduction`` for gradients, ``gathering``
for parameters, [Note: policies chosen once] in ``policies``); no function here asks the plan
which mode is on.

One naming rule for asynchronous work, after Megatron's pairs: ``start_*``
issues the calls and returns :class:`Pending` handles, and
:meth:`Pending.finish` completes one (waits, retires the tensors as below,
then runs what was to follow: a copy out of a staging buffer, a sum of
received pieces). The owners name their own phases the same way
(``start_param_sync``/``finish_param_sync``, ``finish_grad_sync``). Blocking
helpers (:func:`all_reduce`, :func:`all_reduce_shard`, :func:`all_reduce_world`, :func:`broadcast`,
:func:`all_gather_objects`) are plain verbs.

Every call of the step's traffic is recorded in a :class:`CommLog` with the
bytes :func:`zeroplan.core.send_elements` assigns to it, computed from the
sizes of the tensors actually passed, and the link of the group it ran on,
so measured traffic can be compared with the plan's.

[Note: retiring a collective]
gloo runs a collective on a worker thread of the process group, and that
thread lets go of the collective (and of the tensors it was given) a little
*after* ``work.wait()`` has returned. While C++ holds a tensor, torch holds
a reference to its Python object, and whoever drops the last C++ reference
drops that one too, which takes the GIL. When Python dropped its ``Work``
first, that is the worker thread; if the interpreter is finalizing by then
(a script that ends right after ``step()``), taking the GIL ends the thread
inside a ``noexcept`` destructor and the process dies with SIGABRT,
"terminate called without an active exception", after all its work is done.

So a collective is not finished when its work is. :func:`_start` gives the
backend fresh aliases of the tensors (views nothing else refers to) and
:meth:`Pending.finish` waits for the work, drops it, then waits, with the GIL
released, until the backend has dropped its reference to each alias's
Python object; the aliases themselves are freed later, by Python. Weaker
signals are not enough: the C++ reference count falls just *before* the
worker takes the GIL, and an alias freed by the worker thread is seen gone
while that thread still has to take the GIL again. When ``finish()``
returns, no backend thread has anything of the facade's left to release,
so returning from ``step()`` (or any collective method) and exiting is
safe. The blocking helpers (:func:`all_reduce_shard`, :func:`broadcast`,
:func:`all_gather_objects`) go through the same path.

[Note: streams]
One rule for CUDA streams, kept here; on the CPU every helper below is a no-op
and the same code runs. A collective runs on its backend's stream (NCCL's own,
or gloo's for CUDA tensors), which waits for the stream it was launched from;
``work.wait()`` makes the *current* stream wait for it, on the device, never
the host. Three rules on top, after FSDP2's copy-in and reduce-scatter streams:

1. *A gradient bucket completes on the side stream* (:func:`on_side_stream`):
   the wait for its reduction and the copy out of staging run there, after it
   waited for the compute stream, so no backward kernel queues behind a
   reduction. The gradients are copied into staging and the reduction is
   launched on the compute stream, as autograd made them (a copy per parameter
   costs no stream switch). Staging room is reused by later buckets: the compute
   stream waits for the last completion (:func:`mark_side_stream`,
   :func:`wait_for_mark`) before it opens a bucket, which holds it back only when
   reductions fall a window behind. ``finish_grad_sync`` ends with
   :func:`join_side_stream` (the compute stream waits for the side stream, on the
   device), before anything reads a gradient shard.
2. *The first reader of a gathered block makes every stream that matters
   wait*: :meth:`Pending.finish` waits on the current stream (a user's EMA
   stream, say) and, when that is not the stream the collective was started
   from, makes that home stream wait for it too: a first read on a side
   stream cannot leave the default stream reading stale parameters.
3. *A two-hop gather waits for its first hop on the side stream* and starts
   the second hop there, so the compute stream never waits for the cross-node
   hop of a block it does not read yet.

The side stream is one per device, shared by every optimizer of the process
(their buckets are ordered by the plan anyway).
"""

from __future__ import annotations

import contextlib
import pickle
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from zeroplan.core import (
    Block,
    Bucket,
    BufferRole,
    Collective,
    CommCost,
    Link,
    ZeroPlan,
    send_elements,
    two_hop_gather,
)
from zeroplan.core.span import Span
from zeroplan.core.wire import GatherRoom, WireCodec
from zeroplan.facade.mechanisms.buffer_devices import device_for
from zeroplan.facade.mechanisms.groups import ProcessGroups
from zeroplan.facade.mechanisms.wire_codec import (
    decode_piece,
    encode_piece,
    wire_dtype,
)

__all__ = [
    "CommLog",
    "HostStaging",
    "Pending",
    "StreamMark",
    "all_gather_objects",
    "all_reduce",
    "all_reduce_shard",
    "all_reduce_world",
    "broadcast",
    "join_side_stream",
    "mark_side_stream",
    "on_side_stream",
    "exchange_replicas",
    "gather_replicas",
    "room_view",
    "start_block_gather",
    "start_bucket_reduce",
    "start_encoded_block_gather",
    "start_piece_exchange",
    "start_replica_reduce",
    "to_device",
    "wait_for_mark",
    "wait_on_host",
]

_REDUCE_TAG = 0x5A01
_GATHER_TAG = 0x5A02
"""Point-to-point tags of the two exchanges, apart from tag 0 (a user's own ``send``/``recv``)."""

_RELEASE_POLL_S = 1e-5
_RELEASE_LIMIT_S = 10.0
"""How long :meth:`Pending.finish` waits for the backend to let go of a finished collective's tensors.

It normally takes microseconds; past the limit the tensors are left to the backend (some other C++
owner keeps them alive, so the backend's release cannot be the one that touches Python)."""


class Pending:
    """An asynchronous collective and what to do once it completed; :meth:`finish` consumes it.

    See [Note: retiring a collective] and [Note: streams]. Build it with :func:`_start`.
    """

    __slots__ = ("_after", "_held", "_home", "_parts", "_work")

    def __init__(
        self,
        work: dist.Work | None,
        after: Callable[[], None] | None = None,
        held: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
        home: torch.cuda.Stream | None = None,
        parts: Sequence[Pending] | None = None,
    ) -> None:
        self._work = work
        self._after = after
        self._held = tuple(held)
        self._home = home
        self._parts = None if parts is None else list(parts)

    def abandon(self) -> None:
        """Wait for what was issued and drop ``after`` (a step given up: nothing more is sent or
        written). A ``Pending`` that does not list its ``parts`` finishes as :meth:`finish` does."""
        if self._parts is None:
            self.finish(home_waits=False)
            return
        parts, self._parts, self._after = self._parts, [], None
        for part in parts:
            part.finish(home_waits=False)

    def finish(self, *, home_waits: bool = True) -> None:
        """Block until the collective completed and the backend let go of its tensors, then run ``after``.

        On CUDA "completed" is for the current stream (the device waits, not the host), and with
        ``home_waits`` the stream it was started from waits too (rule 2 of [Note: streams]).
        A second call does nothing. Its ``parts`` (collectives ``after`` needs) finish first.
        """
        parts, self._parts = self._parts or [], None if self._parts is None else []
        for part in parts:
            part.finish(home_waits=False)  # the bucket's completion decides which streams wait
        work, self._work = self._work, None
        decoded_here = work is None  # a composite: ``after`` itself reads what its parts delivered
        held, self._held = self._held, ()
        after, self._after = self._after, None
        if work is not None:
            work.wait()
            del work  # the backend's reference is now the last one, or already gone
            _await_release(held)
            if home_waits and self._home is not None:
                current = torch.cuda.current_stream(self._home.device)
                if current != self._home:
                    self._home.wait_stream(current)
        if after is not None:
            after()
        if decoded_here and home_waits and self._home is not None:
            current = torch.cuda.current_stream(self._home.device)
            if current != self._home:
                self._home.wait_stream(current)


_SIDE: dict[torch.device, torch.cuda.Stream] = {}

StreamMark = torch.cuda.Event
"""A point in a stream's queue that another stream can wait for (:func:`mark_side_stream`)."""


def _side(device: torch.device) -> torch.cuda.Stream | None:
    """The side stream of ``device`` (made on first use); ``None`` off CUDA ([Note: streams])."""
    if device.type != "cuda":
        return None
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    stream = _SIDE.get(device)
    if stream is None:
        stream = _SIDE[device] = torch.cuda.Stream(device)
    return stream


def _current_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The current stream of ``device``; ``None`` on a device without streams."""
    side = _side(device)
    return None if side is None else torch.cuda.current_stream(side.device)


@contextlib.contextmanager
def on_side_stream(device: torch.device) -> Any:
    """Run the block on ``device``'s side stream, after it waited for the current stream; CPU: as is."""
    side = _side(device)
    if side is None:
        yield
        return
    side.wait_stream(torch.cuda.current_stream(side.device))
    with torch.cuda.stream(side):
        yield


def join_side_stream(device: torch.device) -> None:
    """The current stream waits (on the device) for everything queued on the side stream so far."""
    side = _side(device)
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)


def mark_side_stream(device: torch.device) -> StreamMark | None:
    """An event after everything queued on the side stream so far; ``None`` off CUDA."""
    side = _side(device)
    return None if side is None else side.record_event()


def wait_for_mark(device: torch.device, mark: StreamMark | None) -> None:
    """The current stream of ``device`` waits (on the device) for ``mark``; nothing for ``None``."""
    side = _side(device)
    if side is not None and mark is not None:
        torch.cuda.current_stream(side.device).wait_event(mark)


def wait_on_host(device: torch.device) -> None:
    """The host waits until everything queued on ``device``'s side stream so far ran; nothing off CUDA.

    A host synchronisation: only where the host reads what the side stream wrote into host memory
    (gradients copied to host memory, [Note: offload, executed] in ``zeroplan.core.host_step``).
    """
    side = _side(device)
    if side is not None:
        side.synchronize()


def _await_release(held: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Wait, with the GIL released, until the backend dropped every alias it was given.

    ``given`` and its ``twin`` are alike views, referenced alike, but only ``given`` went to the
    backend, and torch adds one reference to ``given``'s Python object while C++ holds it. The
    backend's thread removes that reference, under the GIL, as its last use of Python for the
    tensor; equal reference counts mean it is done.
    """
    deadline = time.monotonic() + _RELEASE_LIMIT_S
    for given, twin in held:
        while sys.getrefcount(given) > sys.getrefcount(twin) and time.monotonic() < deadline:
            time.sleep(_RELEASE_POLL_S)


def _start(
    start: Callable[..., dist.Work | None],
    *tensors: Any,
    after: Callable[[], None] | None = None,
    home: torch.cuda.Stream | None = None,
) -> Pending:
    """``start(*aliases)`` with a fresh alias of each tensor (or list of tensors); its :class:`Pending`.

    ``start`` issues one collective with ``async_op=True`` (see [Note: retiring a collective]).
    ``home``: the stream a first reader makes wait (default: the current one, on CUDA).
    """
    held: list[tuple[torch.Tensor, torch.Tensor]] = []

    def alias(t: torch.Tensor) -> torch.Tensor:
        held.append((t.view(t.shape), t.view(t.shape)))
        return held[-1][0]

    args = [[alias(t) for t in x] if isinstance(x, list) else alias(x) for x in tensors]
    if home is None and held:
        home = _current_stream(held[0][0].device)
    return Pending(start(*args), after, held, home)


def all_gather_objects(obj: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's ``obj`` (picklable, small: verdicts and metadata), in group rank order.

    ``torch.distributed.all_gather_object``'s protocol (sizes, then padded bytes),
    with collectives retired as [Note: retiring a collective] says. Not logged:
    control traffic is not part of a step's planned bytes.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return [obj]
    device = torch.device(dist.distributed_c10d._get_object_coll_device(group))
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    sizes = torch.zeros(size, dtype=torch.int64, device=device)
    mine = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    _start(partial(dist.all_gather, group=group, async_op=True), list(sizes.split(1)), mine).finish()
    lengths = sizes.tolist()
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    gathered = torch.empty(size, longest, dtype=torch.uint8, device=device)
    _start(partial(dist.all_gather, group=group, async_op=True), list(gathered.unbind()), padded).finish()
    rows = gathered.cpu()
    return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]


class CommLog:
    """Collective calls since the last :meth:`clear`, aggregated per (group, collective, link)."""

    def __init__(self) -> None:
        self._totals: dict[tuple[str, Collective, Link], list[int]] = {}

    def record(
        self,
        group: str,
        collective: Collective,
        pieces: Sequence[int],
        position: int,
        itemsize: int,
        *,
        link: Link,
    ) -> None:
        """Log one call in which this rank sat at ``position`` of a group with ``pieces``, on ``link``."""
        entry = self._totals.setdefault((group, collective, link), [0, 0])
        entry[0] += 1
        entry[1] += send_elements(collective, pieces, position) * itemsize

    def summary(self) -> tuple[CommCost, ...]:
        """Calls and bytes sent per (group, collective, link), sorted by group, collective, link."""
        return tuple(
            CommCost(group=group, collective=collective, link=link, calls=calls, bytes=nbytes)
            for (group, collective, link), (calls, nbytes) in sorted(
                self._totals.items(), key=lambda item: (item[0][0], item[0][1].value, item[0][2].value)
            )
        )

    def clear(self) -> None:
        """Forget every call."""
        self._totals.clear()


def start_bucket_reduce(
    staging: torch.Tensor,
    output: torch.Tensor | None,
    bucket: Bucket,
    groups: ProcessGroups,
    log: CommLog,
    received: torch.Tensor | None = None,
) -> Pending:
    """Launch the reduction of one bucket's ``staging`` buffer into this rank's ``output`` piece.

    ``staging`` holds the bucket's gradients laid out piece after piece, in rank
    order (see [Note: buckets] in ``zeroplan.core.buckets``); it is scratch
    space afterwards. ``output`` is ``None`` when this rank owns no piece; it
    may be the piece's own window of ``staging``, where a reduce or all-reduce
    leaves it anyway. ``received`` is the room for the other ranks' pieces when
    the plan reduce-scatters by point-to-point exchange (``StagingLayout.received``,
    [Note: collective policy]).
    """
    n = groups.topology.shard_size
    s = groups.shard_rank
    itemsize = staging.element_size()
    if received is not None:
        if output is None:
            raise RuntimeError(f"bucket {bucket.index} is exchanged but rank {s} has no piece of it")
        sizes = list(bucket.piece_sizes(n))
        log.record("shard", bucket.collective, sizes, s, itemsize, link=groups.shard_link)
        return _exchange_reduce(staging, received, output, bucket, groups)
    if bucket.collective is Collective.ALL_REDUCE:  # GLOO policy: sum over the world, keep the piece
        world = groups.topology.world_size
        piece = bucket.piece_of(s)
        keep = None if output is None or piece is None else staging[piece.staging_span.as_slice()]
        after = None if keep is None else _copier(output, keep)
        if world == 1:
            return Pending(None, after)
        link = groups.topology.world_link
        log.record(
            "world", Collective.ALL_REDUCE, [staging.numel()] * world, groups.rank, itemsize, link=link
        )
        return _start(partial(dist.all_reduce, group=groups.world, async_op=True), staging, after=after)
    if n == 1:
        if output is not None:
            copy = _copier(output, staging)
            if copy is not None:
                copy()
        return Pending(None)
    # gloo's reduce_scatter_tensor copies its whole input into a temporary (measured with MemTracker:
    # one bucket more than planned); its list form reduces from the pieces themselves.
    if bucket.collective is Collective.REDUCE_SCATTER and dist.get_backend(groups.shard) != "gloo":
        if output is None:
            raise RuntimeError(f"bucket {bucket.index} is reduce-scattered but rank {s} has no piece of it")
        log.record(
            "shard", bucket.collective, [staging.numel() // n] * n, s, itemsize, link=groups.shard_link
        )
        return _start(partial(dist.reduce_scatter_single, group=groups.shard, async_op=True), output, staging)
    if bucket.collective is Collective.REDUCE:
        owner = bucket.pieces[0].rank
        sizes = [staging.numel() if q == owner else 0 for q in range(n)]
        log.record("shard", bucket.collective, sizes, s, itemsize, link=groups.shard_link)
        after = None if output is None else _copier(output, staging)
        reduce = partial(dist.reduce, group_dst=owner, group=groups.shard, async_op=True)
        return _start(reduce, staging, after=after)
    inputs = list(staging.split(list(bucket.piece_sizes(n))))
    log.record("shard", bucket.collective, [t.numel() for t in inputs], s, itemsize, link=groups.shard_link)
    target = output if output is not None else staging.new_empty(0)
    return _start(partial(dist.reduce_scatter, group=groups.shard, async_op=True), target, inputs)


def _exchange_reduce(
    staging: torch.Tensor, received: torch.Tensor, output: torch.Tensor, bucket: Bucket, groups: ProcessGroups
) -> Pending:
    """Send each peer its piece of ``staging``, receive this rank's piece from each peer; sum on finish.

    The sum is this rank's own piece, then the received ones in rank order
    (``output`` may be the own piece's window of ``staging``, which is never sent).
    """
    n, s = groups.topology.shard_size, groups.shard_rank
    pieces = staging.split(list(bucket.piece_sizes(n)))
    peers = [q for q in range(n) if q != s]
    rooms = received.split(pieces[s].numel())
    parts = _start_exchange(
        [(q, pieces[q]) for q in peers], list(zip(peers, rooms, strict=True)), groups.shard, _REDUCE_TAG
    )
    return Pending(None, after=partial(_sum_after, parts, pieces[s], rooms, output))


def _sum_after(
    parts: Sequence[Pending], own: torch.Tensor, others: Sequence[torch.Tensor], output: torch.Tensor
) -> None:
    """Wait for ``parts``, then ``output = own + others[0] + others[1] + ...`` (``output`` may be ``own``)."""
    for part in parts:
        part.finish(home_waits=False)  # the bucket's completion decides which streams wait
    torch.add(own, others[0], out=output)
    for other in others[1:]:
        output.add_(other)


def _start_exchange(
    sends: Sequence[tuple[int, torch.Tensor]],
    receives: Sequence[tuple[int, torch.Tensor]],
    group: dist.ProcessGroup,
    tag: int,
) -> list[Pending]:
    """Launch an ``irecv`` per ``(peer, tensor)`` of ``receives``, then an ``isend`` per one of ``sends``.

    Peers are ranks of ``group``. Every rank posts its exchanges in the plan's
    order, so sends and receives between two ranks with the same ``tag`` pair
    up first to first ([Note: collective policy] in ``zeroplan.core.comm``).
    """
    pending = [_start(partial(dist.irecv, group_src=q, group=group, tag=tag), t) for q, t in receives]
    pending += [_start(partial(dist.isend, group_dst=q, group=group, tag=tag), t) for q, t in sends]
    return pending


def _copier(output: torch.Tensor, source: torch.Tensor) -> Callable[[], None] | None:
    """``output.copy_(source)`` to run later, or ``None`` when ``output`` is ``source``'s own memory."""
    same = output.data_ptr() == source.data_ptr() and output.dtype == source.dtype
    if same and output.shape == source.shape:
        return None
    return partial(output.copy_, source)


def _start_exchange_gather(
    places: Sequence[torch.Tensor], groups: ProcessGroups, log: CommLog
) -> list[Pending]:
    """Gather a block of equal pieces by point-to-point exchange ([Note: collective policy]).

    ``places[q]`` is shard rank ``q``'s piece of the block; this rank's already
    holds its values. It is sent to every peer, and each peer's lands in place.
    """
    n, s = groups.topology.shard_size, groups.shard_rank
    sizes = [t.numel() for t in places]
    log.record("shard", Collective.ALL_GATHER, sizes, s, places[s].element_size(), link=groups.shard_link)
    peers = [q for q in range(n) if q != s]
    sends = [(q, places[s]) for q in peers]
    return _start_exchange(sends, [(q, places[q]) for q in peers], groups.shard, _GATHER_TAG)


def exchange_replicas(
    send: torch.Tensor, received: torch.Tensor, sizes: Sequence[int], groups: ProcessGroups, log: CommLog
) -> None:
    """A logged, blocking ``all_to_all_single`` over the replica group: replica ``q`` gets part
    ``q`` of ``send`` (``sizes``), this rank every replica's copy of its part in ``received``."""
    at = (groups.replica, groups.topology.replica_size, groups.replica_rank, groups.replica_link)
    _start_all_to_all("replica", *at, send, received, sizes, log).finish(home_waits=False)


def start_piece_exchange(
    send: torch.Tensor, received: torch.Tensor, sizes: Sequence[int], groups: ProcessGroups, log: CommLog
) -> Pending:
    """One logged ``all_to_all_single`` over the shard group: each shard rank gets its piece of
    ``send`` (``sizes``, in rank order), this rank every peer's copy of its own in ``received``'s
    equal slots (empty when it has none)."""
    at = (groups.shard, groups.topology.shard_size, groups.shard_rank, groups.shard_link)
    return _start_all_to_all("shard", *at, send, received, sizes, log)


def _start_all_to_all(
    name: str,
    group: dist.ProcessGroup | None,
    size: int,
    position: int,
    link: Link,
    send: torch.Tensor,
    received: torch.Tensor,
    sizes: Sequence[int],
    log: CommLog,
) -> Pending:
    """A logged ``all_to_all_single`` over ``group`` (``size`` ranks, this one at ``position``):
    rank ``q`` gets part ``q`` of ``send`` (``sizes``), this rank ``received``'s equal slots."""
    log.record(name, Collective.ALL_TO_ALL, list(sizes), position, send.element_size(), link=link)
    exchange = partial(
        dist.all_to_all_single,
        output_split_sizes=[received.numel() // size] * size,
        input_split_sizes=list(sizes),
        group=group,
        async_op=True,
    )
    return _start(exchange, _as_bytes_if_fp8(received), _as_bytes_if_fp8(send))


def gather_replicas(mine: torch.Tensor, gathered: torch.Tensor, groups: ProcessGroups, log: CommLog) -> None:
    """A logged, blocking ``all_gather_single`` of ``mine`` over the replica group into ``gathered``."""
    r = groups.topology.replica_size
    log.record(
        "replica",
        Collective.ALL_GATHER,
        [mine.numel()] * r,
        groups.replica_rank,
        mine.element_size(),
        link=groups.replica_link,
    )
    gather = partial(dist.all_gather_single, group=groups.replica, async_op=True)
    _start(gather, _as_bytes_if_fp8(gathered), _as_bytes_if_fp8(mine)).finish(home_waits=False)


def room_view(raw: torch.Tensor, span: Span, dtype: torch.dtype) -> torch.Tensor:
    """The bytes ``span`` of a staging buffer ``raw`` as ``dtype`` ([Note: wire formats])."""
    return raw[span.as_slice()].view(dtype)


def _as_bytes_if_fp8(t: torch.Tensor) -> torch.Tensor:
    """fp8 travels as its bytes: backends need not know the dtype (gloo does not)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def start_replica_reduce(piece: torch.Tensor, groups: ProcessGroups, log: CommLog) -> Pending:
    """Sum a reduced shard piece over the replica group (MiCS); nothing without replicas."""
    if groups.replica is None or piece.numel() == 0:
        return Pending(None)
    r = groups.topology.replica_size
    log.record(
        "replica",
        Collective.ALL_REDUCE,
        [piece.numel()] * r,
        groups.replica_rank,
        piece.element_size(),
        link=groups.replica_link,
    )
    return _start(partial(dist.all_reduce, group=groups.replica, async_op=True), piece)


def all_reduce_shard(value: torch.Tensor, op: dist.ReduceOp, groups: ProcessGroups, log: CommLog) -> None:
    """Blocking all-reduce of a small control tensor over the shard group (norms, overflow flags)."""
    n = groups.topology.shard_size
    if n == 1:
        return
    size = value.element_size()
    log.record(
        "shard", Collective.ALL_REDUCE, [value.numel()] * n, groups.shard_rank, size, link=groups.shard_link
    )
    _start(partial(dist.all_reduce, op=op, group=groups.shard, async_op=True), value).finish()


def all_reduce_world(value: torch.Tensor, op: dist.ReduceOp, groups: ProcessGroups, log: CommLog) -> None:
    """Blocking all-reduce of a small control tensor over the world (the step agreement, planned as
    [Note: control calls] in ``zeroplan.core.comm`` says)."""
    world = groups.topology.world_size
    if world == 1:
        return
    link = groups.topology.world_link
    size = value.element_size()
    log.record("world", Collective.ALL_REDUCE, [value.numel()] * world, groups.rank, size, link=link)
    _start(partial(dist.all_reduce, op=op, group=groups.world, async_op=True), value).finish()


def to_device(values: Sequence[int | float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, without the host waiting for the device.

    ``torch.tensor(values, device=cuda)`` copies from pageable memory, which waits for every kernel
    queued before it; a pinned buffer and a non-blocking copy queue the copy instead (the caching host
    allocator keeps the buffer until the copy ran). On the CPU it is the tensor itself.
    """
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class HostStaging:
    """Copies device tensors to the host through one reused pinned buffer per dtype.

    A copy into pageable memory is staged by the driver anyway; a pinned buffer that grows to the
    largest chunk seen and is reused keeps the host memory pinned by a consolidation at one chunk.
    Each copy completes before it returns (the caller reads the values at once). On the CPU the
    tensor itself is returned.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host view holding ``tensor``'s values, valid until the next call with its dtype."""
        if self._device.type == "cpu":
            return tensor
        buf = self._buffers.get(tensor.dtype)
        if buf is None or buf.numel() < tensor.numel():
            buf = self._buffers[tensor.dtype] = torch.empty(
                tensor.numel(), dtype=tensor.dtype, pin_memory=True
            )
        host = buf[: tensor.numel()].view(tensor.shape)
        host.copy_(tensor)
        return host


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup) -> None:
    """Blocking all-reduce of a small control tensor over ``group`` (not logged: not a step's bytes)."""
    _start(partial(dist.all_reduce, op=op, group=group, async_op=True), tensor).finish()


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> None:
    """Blocking broadcast of ``tensor`` from ``group`` rank ``src`` (not logged: setup and state moves)."""
    _start(partial(dist.broadcast, group_src=src, group=group, async_op=True), tensor).finish()


def start_block_gather(
    full: torch.Tensor, block: Block, zp: ZeroPlan, groups: ProcessGroups, log: CommLog
) -> list[Pending]:
    """Start the gather of ``block`` in ``full`` by the collectives ``zp`` gives it, its values as
    they are; this rank's piece holds its values (the plain gather policy, [Note: parameter path])."""
    if groups.topology.shard_size == 1:
        return []
    return _start_gather(full, block, block, zp, groups, log)


def start_encoded_block_gather(
    full: torch.Tensor,
    block: Block,
    room: GatherRoom,
    codec: WireCodec,
    zp: ZeroPlan,
    groups: ProcessGroups,
    log: CommLog,
) -> list[Pending]:
    """:func:`start_block_gather` with the pieces encoded by ``codec`` in ``room`` ([Note: wire
    formats]): one :class:`Pending` decodes every piece (the encoded gather policy)."""
    if groups.topology.shard_size == 1:
        return []
    return [_start_encoded_gather(full, block, room, codec, zp, groups, log)]


def _start_gather(
    moved: torch.Tensor, layout: Block, block: Block, zp: ZeroPlan, groups: ProcessGroups, log: CommLog
) -> list[Pending]:
    """The collectives ``zp`` gathers ``block`` with, moving ``moved`` laid out as ``layout`` (the
    block itself, or the slots of its encoded pieces, in bytes)."""
    n, s = groups.topology.shard_size, groups.shard_rank
    itemsize = moved.element_size()
    collective = zp.gather_collective(block)
    if zp.gathers_in_two_hops(block):
        return _start_two_hop_gather(moved, layout, groups, log)
    if zp.exchanges(collective):
        return _start_exchange_gather(
            [moved[layout.piece(q).buffer_span.as_slice()] for q in range(n)], groups, log
        )
    if collective is Collective.ALL_GATHER:
        mine = moved[layout.piece(s).buffer_span.as_slice()]
        log.record("shard", Collective.ALL_GATHER, list(layout.pieces), s, itemsize, link=groups.shard_link)
        out = moved[layout.span.as_slice()]
        return [_start(partial(dist.all_gather_single, group=groups.shard, async_op=True), out, mine)]
    pending = []
    for q in range(n):
        if not block.pieces[q]:
            continue
        sizes = [layout.pieces[q] if p == q else 0 for p in range(n)]
        log.record("shard", Collective.BROADCAST, sizes, s, itemsize, link=groups.shard_link)
        start = partial(dist.broadcast, group_src=q, group=groups.shard, async_op=True)
        pending.append(_start(start, moved[layout.piece(q).buffer_span.as_slice()]))
    return pending


def _start_encoded_gather(
    full: torch.Tensor,
    block: Block,
    room: GatherRoom,
    codec: WireCodec,
    zp: ZeroPlan,
    groups: ProcessGroups,
    log: CommLog,
) -> Pending:
    """A block's gather under a parameter wire ([Note: wire formats] in ``zeroplan.core``).

    This rank encodes its piece into its slot of a room allocated for the
    gather, and decodes it back into its piece at once: the owner holds what
    every other rank will decode. The slots travel by the block's own
    collectives (as bytes); on completion every other piece is decoded into
    place and the room is let go.
    """
    s = groups.shard_rank
    raw = device_for(zp, BufferRole.GATHER_ROOM, full.device).empty(room.nbytes, torch.uint8)
    own = full[block.piece(s).buffer_span.as_slice()]
    if own.numel():
        payload, scales = _slot(raw, room, s, codec)
        scratch = _scratch(room, full.device)
        encode_piece(own, codec, payload, scales, scratch, room.chunk)
        decode_piece(payload, scales, codec, own, scratch, room.chunk)
        del scratch
    parts = _start_gather(raw, room.slots, block, zp, groups, log)
    decode = partial(_decode_gathered, full, block, room, raw, codec, s)
    return Pending(None, after=decode, parts=parts, home=_current_stream(full.device))


def _slot(
    raw: torch.Tensor, room: GatherRoom, rank: int, codec: WireCodec
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s encoded elements and scales (none unscaled) in a gather's room."""
    scales = room.scales[rank]
    return (
        room_view(raw, room.payloads[rank], wire_dtype(codec)),
        room_view(raw, scales, torch.float32) if scales.numel else raw.new_empty(0, dtype=torch.float32),
    )


def _scratch(room: GatherRoom, device: torch.device) -> torch.Tensor:
    """The fp32 scratch pieces are encoded and decoded through, for as long as the caller holds it."""
    return torch.empty(room.scratch_numel, dtype=torch.float32, device=device)


def _decode_gathered(
    full: torch.Tensor, block: Block, room: GatherRoom, raw: torch.Tensor, codec: WireCodec, mine: int
) -> None:
    """Decode every other rank's slot into its piece of ``full`` (on the stream that waited)."""
    if raw.is_cuda:  # the room is freed after this, maybe on another stream than it was made on
        raw.record_stream(torch.cuda.current_stream(raw.device))
    scratch = _scratch(room, full.device)
    for q, numel in enumerate(block.pieces):
        if q != mine and numel:
            payload, scales = _slot(raw, room, q, codec)
            piece = full[block.piece(q).buffer_span.as_slice()]
            decode_piece(payload, scales, codec, piece, scratch, room.chunk)


def _start_two_hop_gather(
    full: torch.Tensor, block: Block, groups: ProcessGroups, log: CommLog
) -> list[Pending]:  # ``block``: how ``full`` is laid out (the block, or its encoded slots)
    """Gather a block of equal pieces across nodes, wait, then start the gather inside the node.

    See [Note: hierarchical all-gather]: the first hop lands each piece in its
    own place (a list all-gather); the second fills each node chunk in place.
    """
    if groups.node is None or groups.cross_node is None:
        raise RuntimeError(f"{groups.topology} gathers in two hops but its node groups were not made")
    hops = two_hop_gather(block, groups.topology, groups.shard_rank)
    itemsize = full.element_size()
    across = hops.across
    log.record("shard", Collective.ALL_GATHER, across.sizes, across.position, itemsize, link=across.link)
    places = [full[p.as_slice()] for p in across.pieces]
    start = partial(dist.all_gather, group=groups.cross_node, async_op=True)
    first = _start(start, places, full[across.own.as_slice()])
    home = _current_stream(full.device)
    pending = []
    with on_side_stream(full.device):  # rule 3 of [Note: streams]: the compute stream does not wait
        first.finish(home_waits=False)  # the second hop sends what arrived
        for call in hops.within:
            log.record("shard", Collective.ALL_GATHER, call.sizes, call.position, itemsize, link=call.link)
            start = partial(dist.all_gather_single, group=groups.node, async_op=True)
            pending.append(_start(start, full[call.span.as_slice()], full[call.own.as_slice()], home=home))
    return pending
