# zeroplan.core — pure planning: no torch, no I/O.
# The order in which gradients are staged, buckets opened, launched and retired during backward.
"""The gradient-staging schedule, one coroutine shared by the facade and the planner.

[Note: staging schedule]
:func:`staging_schedule` is a coroutine: it is sent the index of each parameter
whose gradient arrives (and was admitted for reduction), then ``None`` when the
step's reduction finishes, and answers each with the :class:`Action` s to carry
out, in order. The facade's gradient hook executes them on tensors
(``facade/runtime/grad_sync.py``); :func:`zeroplan.core.peak.backward_peak` executes
them on byte counts. One schedule, so the planned peak is the executed one.

* An arriving gradient only counts down its buckets: the hook does no tensor
  work for it (see [Note: gradient path] in ``grad_sync``).
* The next bucket to launch, once all its gradients arrived, is ``OPEN`` ed
  (its staging buffer taken from the arena), ``STAGE`` d whole (every
  gradient part it holds copied in one batched copy) and ``LAUNCH`` ed,
  strictly in plan order (every rank issues the same collectives in the same
  order); a bucket complete before its predecessors waits for them. Each
  gradient whose last bucket that was is ``RELEASE`` d, freed, at stages 2 and
  3; at stage 1 each whose first bucket it was is moved into its view of the
  full gradient buffer (before the launch, which reduces into that buffer).
* Opening bucket ``b`` first ``RETIRE`` s the oldest reduction in flight while
  ``b`` and it would be ``max_inflight_buckets`` or more buckets apart, so at
  most that many consecutive buckets are ever alive.
* Without overlap, arrivals are only counted (at stage 1 each gradient is
  still moved into the gradient buffer as it arrives, so only one is alive
  at a time). ``None`` (finish) counts every
  trainable parameter that got no gradient (it is staged as zeros, or as what
  ``no_sync`` accumulated), stages and launches everything, and retires every
  reduction in flight.

Which actions a bucket's completion brings is fixed by the plan
(:class:`ScheduleTables`, built once per plan): a step builds no object per
parameter, and an arrival that completes no bucket answers a shared empty
tuple. A gradient now lives until its bucket is complete, where it was staged
as it arrived: at most one bucket of gradients more in backward (the planner
replays the same schedule, so the planned peak says so), for one copy per
bucket instead of one per parameter.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from zeroplan.core.errors import require
from zeroplan.core.planner import Stage, ZeroPlan

__all__ = ["Action", "ActionKind", "ScheduleTables", "schedule_tables", "staging_schedule"]


class ActionKind(enum.Enum):
    """What an :class:`Action` asks for (see [Note: staging schedule])."""

    RETIRE = "retire"
    """Complete the oldest reduction in flight; its staging buffer's room is free again."""
    OPEN = "open"
    """Take the staging buffer of ``bucket`` from the arena ([Note: staging arena] in ``arena``)."""
    STAGE = "stage"
    """Copy every gradient part of ``bucket`` into its staging buffer (all have arrived)."""
    RELEASE = "release"
    """All of ``param``'s buckets are staged: free its ``.grad`` (stages 2 and 3); or its first is:
    move it into its view of the gradient buffer (stage 1, whose ``.grad`` is that view between steps;
    the later buckets stage from there)."""
    LAUNCH = "launch"
    """Start the reduction of ``bucket`` (all its gradients are staged)."""


class Action(NamedTuple):
    """One step of the schedule; ``bucket`` and ``param`` are -1 where they do not apply."""

    kind: ActionKind
    bucket: int = -1
    param: int = -1


_RETIRE = Action(ActionKind.RETIRE)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleTables:
    """What the schedule reads of a plan, computed once (see [Note: staging schedule]).

    Attributes:
        buckets_of: per parameter, the buckets that hold its gradient.
        sizes: per bucket, how many parameters it waits for.
        completion: per bucket, the actions its turn brings: open, stage,
            the releases of the gradients it is the last bucket of (stage 1: the first), launch.
        lone: per parameter, the actions its arrival brings by itself: the
            release of a gradient no bucket holds (no elements), else none.
        trainable: the trainable parameters, in order.
        at_once: stage 1 without overlap, which moves each gradient into the gradient buffer as it
            arrives (nothing is staged before the end of backward): every parameter's ``lone``
            is its release, and ``completion`` has none.
    """

    buckets_of: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]
    completion: tuple[tuple[Action, ...], ...]
    lone: tuple[tuple[Action, ...], ...]
    trainable: tuple[int, ...]
    at_once: bool

    def __post_init__(self) -> None:
        require(len(self.completion) == len(self.sizes), "one completion per bucket")
        require(len(self.lone) == len(self.buckets_of), "one entry per parameter")


def schedule_tables(zp: ZeroPlan) -> ScheduleTables:
    """The tables :func:`staging_schedule` runs on, for plan ``zp`` (build once, reuse every step).

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(256,)] * 2), Topology(world_size=1), alignment=8, bucket_bytes=1024)
        >>> schedule_tables(zp).sizes
        (1, 1)
    """
    buckets = zp.buckets.buckets
    nparams = len(zp.specs)
    buckets_of = tuple(zp.buckets.buckets_of(i) for i in range(nparams))
    released_at: list[list[int]] = [[] for _ in buckets]
    for param, of in enumerate(buckets_of):
        if of:  # buckets are staged in order: stage 2 frees a gradient at its last, stage 1 moves it at its
            # first (before that bucket's reduction writes into the buffer it moves into)
            released_at[min(of) if zp.stage is Stage.OPTIMIZER else max(of)].append(param)
    at_once = zp.stage is Stage.OPTIMIZER and not zp.options.overlap_grad_reduce
    completion = tuple(
        (
            Action(ActionKind.OPEN, bucket=b.index),
            Action(ActionKind.STAGE, bucket=b.index),
            *(() if at_once else (Action(ActionKind.RELEASE, param=p) for p in released_at[b.index])),
            Action(ActionKind.LAUNCH, bucket=b.index),
        )
        for b in buckets
    )
    lone = tuple(
        (Action(ActionKind.RELEASE, param=p),) if at_once or not of else () for p, of in enumerate(buckets_of)
    )
    return ScheduleTables(
        buckets_of=buckets_of,
        sizes=tuple(len(b.params) for b in buckets),
        completion=completion,
        lone=lone,
        trainable=tuple(sorted(zp.trainable_indices)),
        at_once=at_once,
    )


def staging_schedule(
    zp: ZeroPlan, *, tables: ScheduleTables | None = None
) -> Generator[Sequence[Action], int | None, None]:
    """The schedule of one step's reduction (see [Note: staging schedule]); prime it with ``next()``.

    Args:
        zp: the plan; with ``zp.options.overlap_grad_reduce`` buckets are staged
            and launched while gradients arrive, otherwise everything happens at finish.
        tables: ``schedule_tables(zp)``, when the caller keeps them from step to step.

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(256,)] * 2), Topology(world_size=1), alignment=8, bucket_bytes=1024)
        >>> schedule = staging_schedule(zp)
        >>> next(schedule)
        ()
        >>> [(a.kind.value, a.bucket, a.param) for a in schedule.send(1)]   # the last parameter arrives first
        [('open', 0, -1), ('stage', 0, -1), ('release', -1, 1), ('launch', 0, -1)]
        >>> [a.kind.value for a in schedule.send(0)]
        ['open', 'stage', 'release', 'launch']
        >>> [a.kind.value for a in schedule.send(None)]   # finish: complete both reductions
        ['retire', 'retire']
    """
    t = schedule_tables(zp) if tables is None else tables
    overlap = zp.options.overlap_grad_reduce
    require(t.at_once == (zp.stage is Stage.OPTIMIZER and not overlap), "tables built for another overlap")
    nbuckets = len(t.sizes)
    k = zp.max_inflight_buckets
    missing = list(t.sizes)
    ready = [False] * len(t.buckets_of)
    inflight: deque[int] = deque()
    nxt = 0

    def pump(actions: list[Action]) -> None:
        nonlocal nxt
        while nxt < nbuckets and missing[nxt] == 0:
            while inflight and nxt - inflight[0] >= k:
                inflight.popleft()
                actions.append(_RETIRE)
            actions.extend(t.completion[nxt])
            inflight.append(nxt)
            nxt += 1

    message = yield ()
    while message is not None:
        ready[message] = True
        for b in t.buckets_of[message]:
            missing[b] -= 1
        lone = t.lone[message]
        if overlap and nxt < nbuckets and missing[nxt] == 0:
            actions = list(lone)
            pump(actions)
            message = yield actions
        else:
            message = yield lone
    for index in t.trainable:
        if not ready[index]:
            for b in t.buckets_of[index]:
                missing[b] -= 1
    finish: list[Action] = [a for index in t.trainable if not ready[index] for a in t.lone[index]]
    pump(finish)
    finish.extend(_RETIRE for _ in inflight)
    yield finish
