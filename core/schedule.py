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

* An arriving gradient is queued on each of its buckets. Queued gradients of
  the ``max_inflight_buckets`` buckets next to launch are staged (copied into
  the bucket's staging buffer, ``OPEN`` ed on its first gradient); at stage 2
  (and 3) a gradient is ``RELEASE`` d once all its buckets are staged.
* Opening bucket ``b`` first ``RETIRE`` s the oldest reduction in flight while
  ``b`` and it would be ``max_inflight_buckets`` or more buckets apart, so at
  most that many consecutive buckets are ever alive.
* A bucket whose gradients are all staged is ``LAUNCH`` ed, strictly in plan
  order (every rank issues the same collectives in the same order).
* Without overlap, arrivals are only queued. ``None`` (finish) queues every
  trainable parameter that got no gradient (it is staged as zeros, or as what
  ``no_sync`` accumulated), stages and launches everything, and retires every
  reduction in flight.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Generator
from typing import NamedTuple

from zeroplan.core.planner import Stage, ZeroPlan

__all__ = ["Action", "ActionKind", "staging_schedule"]


class ActionKind(enum.Enum):
    """What an :class:`Action` asks for (see [Note: staging schedule])."""

    RETIRE = "retire"
    """Complete the oldest reduction in flight; its staging buffer's room is free again."""
    OPEN = "open"
    """Take the staging buffer of ``bucket`` from the arena ([Note: staging arena] in ``arena``)."""
    STAGE = "stage"
    """Copy ``param``'s gradient parts of ``bucket`` into its staging buffer."""
    RELEASE = "release"
    """Free ``param``'s ``.grad``: all its buckets are staged (stages 2 and 3)."""
    LAUNCH = "launch"
    """Start the reduction of ``bucket`` (all its gradients are staged)."""


class Action(NamedTuple):
    """One step of the schedule; ``bucket`` and ``param`` are -1 where they do not apply."""

    kind: ActionKind
    bucket: int = -1
    param: int = -1


def staging_schedule(zp: ZeroPlan, *, overlap: bool = True) -> Generator[list[Action], int | None, None]:
    """The schedule of one step's reduction (see [Note: staging schedule]); prime it with ``next()``.

    Args:
        zp: the plan.
        overlap: stage and launch while gradients arrive (``overlap_grad_reduce``);
            otherwise everything happens at finish.

    Example:
        >>> from zeroplan.core import Topology, plan, specs_from_shapes
        >>> zp = plan(specs_from_shapes([(256,)] * 2), Topology(world_size=1), alignment=8, bucket_bytes=1024)
        >>> schedule = staging_schedule(zp)
        >>> next(schedule)
        []
        >>> [(a.kind.value, a.bucket, a.param) for a in schedule.send(1)]   # the last parameter arrives first
        [('open', 0, -1), ('stage', 0, 1), ('release', -1, 1), ('launch', 0, -1)]
        >>> [a.kind.value for a in schedule.send(0)]
        ['open', 'stage', 'release', 'launch']
        >>> [a.kind.value for a in schedule.send(None)]   # finish: complete both reductions
        ['retire', 'retire']
    """
    buckets = zp.buckets.buckets
    k = zp.max_inflight_buckets
    release = zp.stage is not Stage.OPTIMIZER  # stage 1 keeps .grad as a view of its buffer
    unstaged = [len(zp.buckets.buckets_of(s.index)) for s in zp.specs]
    ready = [False] * len(zp.specs)
    queued: list[deque[int]] = [deque() for _ in buckets]
    staged = [0] * len(buckets)
    opened: set[int] = set()
    inflight: deque[int] = deque()
    nxt = 0
    actions: list[Action] = []

    def arrive(param: int) -> None:
        ready[param] = True
        if release and unstaged[param] == 0:  # in no bucket (no elements)
            actions.append(Action(ActionKind.RELEASE, param=param))
        for b in zp.buckets.buckets_of(param):
            queued[b].append(param)

    def pump() -> None:
        nonlocal nxt
        while True:
            for b in range(nxt, min(nxt + k, len(buckets))):
                while queued[b]:
                    param = queued[b].popleft()
                    if b not in opened:
                        while inflight and b - inflight[0] >= k:
                            inflight.popleft()
                            actions.append(Action(ActionKind.RETIRE))
                        opened.add(b)
                        actions.append(Action(ActionKind.OPEN, bucket=b))
                    actions.append(Action(ActionKind.STAGE, bucket=b, param=param))
                    staged[b] += 1
                    unstaged[param] -= 1
                    if release and unstaged[param] == 0:
                        actions.append(Action(ActionKind.RELEASE, param=param))
            if nxt < len(buckets) and staged[nxt] == len(buckets[nxt].params):
                opened.discard(nxt)
                inflight.append(nxt)
                actions.append(Action(ActionKind.LAUNCH, bucket=nxt))
                nxt += 1
                continue
            return

    message = yield []
    while message is not None:
        actions = []
        arrive(message)
        if overlap:
            pump()
        message = yield actions
    actions = []
    for index in sorted(zp.trainable_indices):
        if not ready[index]:
            arrive(index)
    pump()
    actions.extend(Action(ActionKind.RETIRE) for _ in inflight)
    yield actions
