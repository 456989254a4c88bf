# zeroplan.core — pure planning: no torch, no I/O.
# Exact memory and traffic per rank, read off a ZeroPlan (never a separate formula).
"""Memory per rank and bytes sent per step, derived from a :class:`ZeroPlan`.

[Note: what is counted]
Every number is the size of a buffer the facade allocates (or, for stage 0,
that ``DistributedDataParallel`` + a ``torch.optim`` optimizer allocate), so
the facade's measured accounting can be compared with it exactly:

* ``params`` — the full parameter buffers (stages 0-2) or the rank's parameter
  shards (stage 3), plus frozen parameters, which every rank keeps whole.
* ``grads`` — stage 0: every gradient; stage 1: the full gradient buffer (with
  a rank-major layout the rank reduces into its own region of it, in place);
  the reduced shard (stages 2-3, and stage 1 when interleaved), in fp32 for
  bf16/fp16 parameters (reduced straight into it).
* ``master`` — fp32 copies of the rank's shard of bf16/fp16 parameters. fp32
  parameters need none: at stages 1-2 the rank steps its own pieces of the
  full buffer in place (one region, or one piece per block of an interleaved
  layout, see ``ZeroPlan.master_in_params``), at stage 3 its shard.
* ``optimizer_state`` — the inner optimizer's state for what the rank steps.
* ``buffers`` — stage 0: DDP's flat bucket copy of all gradients. Otherwise the
  gradient staging arena (see [Note: staging arena] in :mod:`zeroplan.core.arena`).

``total_bytes`` sums these, all persistent; ``host_bytes`` is the part the
plan places in host memory ([Note: residences]; none by default) and
``device_bytes`` the rest, on the parameters' device; with roles in host memory
the report also gives the device's and the host's share of the peak and the
bytes per step over the host link ([Note: offload, planned]). ``peak_bytes`` is what the rank
holds at the step's peak: ``total_bytes`` plus the transient memory of the
backward (autograd's gradients not staged yet; at stage 3, gathered blocks) or
of the step (the inner optimizer's temporaries; at stage 1 with bf16/fp16
parameters, the fp32 copy of the reduced shard), whichever is larger (see
[Note: the step's peak] in :mod:`zeroplan.core.peak`). Activations are not
counted. The transients are counted where the step makes them, beside the
persistent bytes, wherever those live.

Traffic follows the cost model of :mod:`zeroplan.core.comm`, per collective,
process group (``shard``, ``replica`` or ``world``) and link (``intra`` or
``inter``, see [Note: nodes and links]). On a hierarchical topology the shard
group's parameter all-gather is two hops, reported as two ``shard`` /
``all_gather`` entries, one per link ([Note: hierarchical all-gather]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from zeroplan.core.allocation import BufferRole, allocation, held_roles
from zeroplan.core.deterministic import exact_norm_transient, partial_sums_held
from zeroplan.core.dtypes import DTYPE_ITEMSIZE, LOW_PRECISION, master_dtype
from zeroplan.core.errors import ConfigError, require
from zeroplan.core.host_step import kept_tensors
from zeroplan.core.host_traffic import HostLink, host_links
from zeroplan.core.peak import PeakPhase, StepPeak, backward_peak, kept_temporaries, step_peak
from zeroplan.core.planner import InnerTensor, Stage, ZeroPlan
from zeroplan.core.residence import Residence
from zeroplan.core.traffic import CommCost, step_traffic

__all__ = ["MemoryReport", "RankReport", "accumulation_bytes", "memory_report", "save_staging_bytes"]

_FP32 = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class RankReport:
    """Memory and traffic of one world rank (see [Note: what is counted]).

    Attributes:
        host_bytes: the persistent bytes the plan places in host memory ([Note: residences]).
        device_bytes: the persistent bytes on the parameters' device (``total_bytes - host_bytes``).
        backward_transient_bytes: transient bytes at the backward's peak.
        step_transient_bytes: transient bytes at the peak inside ``step()``.
        peak_bytes: persistent bytes (``total_bytes``) plus the larger transient.
        peak_phase: where the peak happens.
        host_link: with roles in host memory, the bytes and copies per step between host and
            device, each way ([Note: offload, planned]); ``None`` with everything on the device.
        step_on_host: whether the inner optimizer steps in host memory (its masters live there), so
            the step's transients are host memory, not the device's.
        kept_step_transient_bytes: a partial offload's step of its kept part, on the device
            ([Note: kept on the device]), before the host steps the rest: its temporaries.
        device_peak_bytes: the device's share of the peak: ``device_bytes`` plus the backward's
            transients and the step's, or (the step on the host) the kept part's step's.
        host_peak_bytes: the host memory the rank needs at its peak: ``host_bytes``, plus the
            step's transients when it runs on the host.
        save_staging_bytes: host memory a background save stages (:func:`save_staging_bytes`);
            held only by jobs that save with ``blocking=False``, so not in the totals.
    """

    rank: int
    shard_rank: int
    params_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int
    comm: tuple[CommCost, ...]
    backward_transient_bytes: int = 0
    step_transient_bytes: int = 0
    host_bytes: int = 0
    host_link: HostLink | None = None
    step_on_host: bool = False
    kept_step_transient_bytes: int = 0
    save_staging_bytes: int = 0
    total_bytes: int = field(init=False)
    device_bytes: int = field(init=False)
    comm_bytes_per_step: int = field(init=False)
    peak_bytes: int = field(init=False)
    peak_phase: PeakPhase = field(init=False)
    device_peak_bytes: int = field(init=False)
    host_peak_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        parts = (
            self.params_bytes,
            self.grads_bytes,
            self.master_bytes,
            self.optimizer_state_bytes,
            self.buffer_bytes,
            self.backward_transient_bytes,
            self.step_transient_bytes,
            self.kept_step_transient_bytes,
        )
        require(min(parts) >= 0, f"negative byte count in report of rank {self.rank}: {parts}")
        object.__setattr__(self, "total_bytes", sum(parts[:5]))
        require(
            0 <= self.host_bytes <= self.total_bytes,
            f"rank {self.rank} holds {self.host_bytes} host bytes of {self.total_bytes} persistent ones",
        )
        object.__setattr__(self, "device_bytes", self.total_bytes - self.host_bytes)
        object.__setattr__(self, "comm_bytes_per_step", sum(c.bytes for c in self.comm))
        step, kept = self.step_transient_bytes, self.kept_step_transient_bytes
        transient = StepPeak(self.backward_transient_bytes, max(step, kept))  # kept first, then the rest
        object.__setattr__(self, "peak_bytes", sum(parts[:5]) + transient.bytes)
        object.__setattr__(self, "peak_phase", transient.phase)
        device_transient = max(self.backward_transient_bytes, kept if self.step_on_host else step)
        object.__setattr__(self, "device_peak_bytes", self.device_bytes + device_transient)
        object.__setattr__(self, "host_peak_bytes", self.host_bytes + (step if self.step_on_host else 0))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready mapping (the CLI's ``--json`` per-rank record)."""
        record: dict[str, Any] = {
            "rank": self.rank,
            "shard_rank": self.shard_rank,
            "params_bytes": self.params_bytes,
            "grads_bytes": self.grads_bytes,
            "master_bytes": self.master_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "buffer_bytes": self.buffer_bytes,
            "total_bytes": self.total_bytes,
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase.value,
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "save_staging_bytes": self.save_staging_bytes,
            "comm": [
                {
                    "group": c.group,
                    "collective": c.collective.value,
                    "link": c.link.value,
                    "calls": c.calls,
                    "bytes": c.bytes,
                }
                for c in self.comm
            ],
        }
        if self.host_link is not None:  # keys of offload only: plans on the device keep their documents
            record["device_peak_bytes"] = self.device_peak_bytes
            record["host_peak_bytes"] = self.host_peak_bytes
            record["step_on_host"] = self.step_on_host
            record["host_link"] = self.host_link._asdict()
            if self.kept_step_transient_bytes:  # [Note: kept on the device]
                record["kept_step_transient_bytes"] = self.kept_step_transient_bytes
        return record


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryReport:
    """Per-rank memory and traffic of a plan.

    Attributes:
        residences: per role a rank holds, where it lives (``"device"`` or
            ``"host"``, [Note: residences]), in role order; none at stage 0.
    """

    fingerprint: str
    world: int
    shard_size: int
    stage: int
    strategy: str
    total_params: int
    ranks: tuple[RankReport, ...]
    residences: tuple[tuple[str, str], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready mapping (the CLI's ``--json`` document)."""
        return {
            "fingerprint": self.fingerprint,
            "world": self.world,
            "shard_size": self.shard_size,
            "stage": self.stage,
            "strategy": self.strategy,
            "total_params": self.total_params,
            "residences": dict(self.residences),
            "ranks": [r.as_dict() for r in self.ranks],
        }


class _RankBytes(NamedTuple):
    """Memory of one shard rank by category (see [Note: what is counted])."""

    params: int
    grads: int
    master: int
    optimizer_state: int
    buffers: int
    host: int = 0  # of the above, in host memory ([Note: residences])


def _rank_memory(
    zp: ZeroPlan, shard_rank: int, staging: int, frozen: int, state_of: Callable[[int], tuple[int, int]]
) -> _RankBytes:
    """Bytes of a shard rank by category; ``staging``: its staging arena; ``state_of``: a rank's
    optimizer state (stages 1-3), and of it the part a partial offload keeps on the device ([Note:
    kept on the device]). Stages 1-3 sum the allocation plan ([Note: allocation plan])."""
    stage, specs = zp.stage, zp.specs
    if stage is not Stage.DDP:
        plan = allocation(zp, shard_rank, blocks=False)  # persistent buffers: blocks are transients
        (state, kept_state), where = state_of(shard_rank), zp.residences.of
        host = plan.bytes_in(Residence.HOST)
        host += state - kept_state if where(BufferRole.OPTIMIZER_STATE) is Residence.HOST else 0
        host += staging if where(BufferRole.STAGING) is Residence.HOST else 0
        return _RankBytes(
            plan.persistent_bytes(BufferRole.FULL_PARAMS, BufferRole.PARAM_SHARD) + frozen,
            plan.persistent_bytes(BufferRole.FULL_GRADS, BufferRole.GRAD_SHARD, BufferRole.KEPT_GRAD_SHARD),
            plan.persistent_bytes(BufferRole.MASTER, BufferRole.KEPT_MASTER),
            state,
            staging,
            host,
        )
    params = grads = master = state = 0
    for space in zp.partition.spaces:  # DDP: whole parameters, gradients and fp32 masters everywhere
        isz = DTYPE_ITEMSIZE[space.dtype]
        params += space.numel * isz
        grads += space.numel * isz
        master += space.numel * _FP32 if space.dtype in LOW_PRECISION else 0
    for spec in specs:
        if spec.trainable:
            state += zp.optimizers[spec.group].state_bytes(
                spec.shape, DTYPE_ITEMSIZE[master_dtype(spec.dtype)]
            )
    buffers = sum(space.numel * DTYPE_ITEMSIZE[space.dtype] for space in zp.partition.spaces)
    return _RankBytes(params + frozen, grads, master, state, buffers)


def _state_bytes(zp: ZeroPlan, tensors: Sequence[InnerTensor]) -> int:
    """The inner optimizer's state for ``tensors``."""
    state = 0
    for tensor in tensors:
        dtype = master_dtype(zp.partition.spaces[tensor.space].dtype)
        state += zp.optimizers[tensor.group].state_bytes(tensor.shape, DTYPE_ITEMSIZE[dtype])
    return state


def memory_report(
    zp: ZeroPlan,
    *,
    clipping: bool = False,
    arrivals: Sequence[int] | None = None,
) -> MemoryReport:
    """Memory per rank and traffic per step of every world rank of ``zp``.

    Ranks in one replica group hold identical shards and are computed once.

    Args:
        zp: the plan; its ``options`` (overlap, stage 3's resharding) change the
            backward's peak and the gathers ([Note: plan options]).
        clipping: include the all-reduce of ``ZeroOptimizer.clip_grad_norm_``.
        arrivals: the order gradients arrive in (see :func:`~zeroplan.core.peak.backward_peak`).

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(1024,)] * 4), Topology(world_size=2), alignment=128)
        >>> [r.optimizer_state_bytes for r in memory_report(zp).ranks]   # 2 fp32 states + step
        [16388, 16388]
    """
    topo = zp.topology
    frozen = zp.frozen_bytes
    n = topo.shard_size
    backward = None if zp.stage is Stage.DDP else backward_peak(zp, arrivals=arrivals)
    staging = [0] * n if backward is None else [p.staging for p in backward]
    # Ranks with equal inner tensors (often most of them) share one tuple: their state is summed once.
    # Ranks share a tuple only where their pieces are alike too (``ZeroPlan.inner_tensors_by_rank``),
    # so a partial offload's kept prefix is theirs alike as well ([Note: kept on the device]).
    tensors = () if zp.stage is Stage.DDP else zp.inner_tensors_by_rank()
    shared: dict[int, tuple[int, int, int]] = {}  # id of a tuple of tensors -> state, kept state, kept step
    partial = zp.stage is not Stage.DDP and zp.residences.partial

    def of_tensors(s: int) -> tuple[int, int, int]:
        """Rank ``s``'s state bytes, of them the kept part's, and the device's step of the kept part."""
        key = id(tensors[s])
        if key not in shared:
            listed = tensors[s]
            kept = [listed[i] for i in kept_tensors(zp, s, listed)] if partial else []
            step = kept_temporaries(zp, s, listed) if partial else 0
            shared[key] = (_state_bytes(zp, listed), _state_bytes(zp, kept), step)
        return shared[key]

    def state_of(s: int) -> tuple[int, int]:
        return of_tensors(s)[:2]

    if zp.stage is Stage.DDP:  # every rank holds everything: one rank's figures are every rank's
        per_shard = [_rank_memory(zp, 0, 0, frozen, state_of)] * n
    else:
        per_shard = [_rank_memory(zp, s, staging[s], frozen, state_of) for s in range(n)]
    transients = step_peak(zp, backward=backward, tensors=tensors or None)
    shard_staging = (
        [0] * n if zp.stage is Stage.DDP else [_shard_staging(zp, s, tensors[s]) for s in range(n)]
    )
    traffic = step_traffic(zp, clipping)
    offloaded = zp.stage is not Stage.DDP and not zp.residences.all_on_device
    links = host_links(zp) if offloaded else [None] * n
    step_on_host = offloaded and zp.residences.of(BufferRole.MASTER) is Residence.HOST
    ranks = []
    for rank in range(topo.world_size):
        s = topo.shard_rank(rank)
        memory = per_shard[s]
        step_transient = transients[s].step
        if zp.deterministic and clipping:  # the exact norm's chunk ([Note: deterministic mode])
            extents = [space.extent(s) for space in zp.partition.spaces]
            step_transient = max(step_transient, exact_norm_transient(extents))
        ranks.append(
            RankReport(
                rank=rank,
                shard_rank=s,
                params_bytes=memory.params,
                grads_bytes=memory.grads,
                master_bytes=memory.master,
                optimizer_state_bytes=memory.optimizer_state,
                buffer_bytes=memory.buffers,
                comm=traffic.costs(rank),
                backward_transient_bytes=transients[s].backward,
                step_transient_bytes=step_transient,
                host_bytes=memory.host,
                host_link=links[s],
                step_on_host=step_on_host,
                kept_step_transient_bytes=of_tensors(s)[2] if partial else 0,
                save_staging_bytes=0 if zp.stage is Stage.DDP else _rank_staging(zp, rank, shard_staging[s]),
            )
        )
    return MemoryReport(
        fingerprint=zp.fingerprint(),
        world=topo.world_size,
        shard_size=topo.shard_size,
        stage=int(zp.stage),
        strategy=zp.partition.strategy,
        total_params=sum(s.numel for s in zp.specs),
        ranks=tuple(ranks),
        residences=tuple(zp.residences.as_dict(held_roles(zp)).items()),
    )


def save_staging_bytes(zp: ZeroPlan, rank: int) -> int:
    """Host bytes a background save stages on world rank ``rank`` once the optimizer has state.

    What the rank's checkpoint files hold ([Note: background saves] in
    ``facade/checkpoint/background.py``): on replica rank 0 of its shard group,
    its shard of each dtype space's parameters, its fp32 masters and its
    optimizer state (per-element state over the shard; whole-parameter state of
    the parameters it owns); on rank 0 the frozen parameters too. Parked state
    (parameters frozen after training) and scalar state (written as values) are
    not counted. Stage 0 (DDP) saves through no shard file: 0.

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(1024,)] * 4), Topology(world_size=2), alignment=128)
        >>> save_staging_bytes(zp, 0)   # 2048 fp32 elements: parameters, exp_avg, exp_avg_sq
        24576
    """
    topo = zp.topology
    require(0 <= rank < topo.world_size, f"rank {rank} is not in a world of {topo.world_size}")
    if zp.stage is Stage.DDP:
        return 0
    s = topo.shard_rank(rank)
    shard = _shard_staging(zp, s, zp.inner_tensors_by_rank()[s])
    return _rank_staging(zp, rank, shard)


def _rank_staging(zp: ZeroPlan, rank: int, shard: int) -> int:
    """A world rank's staging: its shard file's ``shard`` bytes if it writes one; rank 0's frozen ones."""
    return (zp.frozen_bytes if rank == 0 else 0) + (shard if zp.topology.replica_rank(rank) == 0 else 0)


def _shard_staging(zp: ZeroPlan, s: int, tensors: Sequence[InnerTensor]) -> int:
    """The bytes of shard rank ``s``'s shard file: parameters, masters, state (``tensors``: its windows)."""
    total = 0
    for space in zp.partition.spaces:
        extent = space.extent(s)
        own_master = space.dtype in LOW_PRECISION
        state_itemsize = DTYPE_ITEMSIZE[master_dtype(space.dtype)]
        total += extent * (DTYPE_ITEMSIZE[space.dtype] + (_FP32 if own_master else 0))
        mine = [t for t in tensors if t.space == space.index]
        if zp.elementwise:
            per_element = max((zp.optimizers[t.group].per_element for t in mine), default=0)
            total += extent * state_itemsize * per_element
        else:
            total += sum(zp.optimizers[t.group].state_bytes(t.shape, state_itemsize) for t in mine)
    return total


def accumulation_bytes(zp: ZeroPlan, micro_batches: int) -> int:
    """Bytes of gradients a rank holds between the backward passes of a step of ``micro_batches``.

    What earlier micro-batches left for the last one, on top of the plan's
    persistent memory: in deterministic mode the partial sums of the tree
    (:func:`partial_sums_held` full gradients); otherwise autograd's ``.grad``
    (one full gradient at stages 2 and 3; stage 1 accumulates into its
    gradient buffer, already counted). Nothing for one micro-batch.

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(1024,)]), Topology(world_size=2), deterministic=True)
        >>> accumulation_bytes(zp, 4)   # two fp32 partial sums of 1024 elements
        8192
    """
    if micro_batches < 1:
        raise ConfigError(f"micro_batches must be >= 1, got {micro_batches}")
    grads = sum(s.nbytes for s in zp.specs if s.trainable)
    if zp.deterministic:
        return partial_sums_held(micro_batches) * grads
    if micro_batches == 1 or int(zp.stage) == 1:
        return 0
    return grads
