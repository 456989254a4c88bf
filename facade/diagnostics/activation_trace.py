"""Trace one micro-batch's activations under fake tensors: :func:`trace_activations`.

See [Note: traced activations] in ``zeroplan.core.sizing.trace``: the model is
built and run under torch's ``FakeTensorMode`` (shapes and dtypes, no data, no
memory), torch's ``MemTracker`` counts what each tensor would hold, and a
``ModTracker`` of torch's marks every module's entry and exit in forward and
backward. The same function with ``fake=False`` runs for real: the tests
compare the two point by point.

[Note: stage 3 traced]
At stage 3 a rank also holds, for a while, the blocks it gathered: each
module's before it runs and the next one's prefetched, in backward again as
autograd needs their values, until their gradients are in. When those blocks
arrive and leave is decided by the facade's own hooks (``ForwardHooks`` and
``ShardedParams``, [Note: stage 3]), not by a copy of their rules: traced with
a stage-3 plan, the model is attached to a ``ShardedParams`` over
``TracedBlocks``, which allocates a block where ``BlockTable`` would gather it
and drops it where it would free it, so the meter sees the blocks at every
moment of the forward and backward, and activation checkpointing's
recomputed forwards gather what they gather in a real step. Each point says
how many of its bytes are blocks (``TracePoint.gathered``; a module's
``enter`` point is read before its blocks are gathered, torch running the
meter's global hooks first, while the peaks see them). A parameter read
outside its modules (which a real step gathers on use) is not seen. Under a
parameter wire each gather also holds its encoded room and scratch, as
``start_block_gather`` does, for shard rank 0 (whose own piece it encodes).

What a fake batch of transformers is taken for: [Note: packed rows under fake tensors] in
``zeroplan.facade.diagnostics.fake_rows``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
from torch.distributed._tools.mem_tracker import _MemRefType, _ModState
from torch.distributed._tools.mod_tracker import ModTracker

from zeroplan.core import ConfigError, Stage, ZeroPlan, canonical_dtype
from zeroplan.core.schedule import ActionKind, staging_schedule
from zeroplan.core.sizing.repeat import (
    SHORT_BLOCKS,
    ShortTrace,
    TraceMark,
    depth,
    replicate_trace,
    trace_of_marks,
)
from zeroplan.core.sizing.trace import ActivationTrace, TracePhase, TracePoint
from zeroplan.facade.diagnostics.fake_rows import one_sequence_per_row, unpadded_rows
from zeroplan.facade.diagnostics.repeated import RepeatedBlocks, repeated_blocks, split_name
from zeroplan.facade.diagnostics.trace_meter import StretchTracker
from zeroplan.facade.params.blocks import TracedBlocks
from zeroplan.facade.params.sharded import ShardedParams

__all__ = ["TraceError", "one_sequence_per_row", "trace_activations", "unpadded_rows"]

#: What MemTracker counts that is not an activation or a temporary of autograd.
_NOT_ACTIVATIONS = (_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.GRAD, _MemRefType.OPT)


class TraceError(ConfigError):
    """A model cannot be traced under fake tensors; the message names the module and the operation."""


def _fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def _untraceable() -> tuple[type[Exception], ...]:
    """What fake tensors raise for an operation they cannot run (anything else is the model's own)."""
    from torch._subclasses import fake_tensor

    names = (
        "DataDependentOutputException",
        "DynamicOutputShapeException",
        "UnsupportedOperatorException",
        "UnsupportedFakeTensorException",
        "UnsupportedMutationAliasingException",
    )
    return tuple(getattr(fake_tensor, n) for n in names if hasattr(fake_tensor, n))


def _activation_bytes(snapshot: dict[Any, int], gradients: bool = False) -> int:
    """Activations and autograd temporaries (and the gradients autograd holds, with ``gradients``)."""
    kinds = [k for k in _NOT_ACTIVATIONS if not (gradients and k is _MemRefType.GRAD)]
    return snapshot.get("Total", 0) - sum(snapshot.get(kind, 0) for kind in kinds)


class _Recorder:
    """The points of the trace, as torch's module hooks and gradient hooks fire, and the marks of
    the stretches between them ([Note: repeated blocks traced once])."""

    def __init__(self, tracker: StretchTracker, device: torch.device, gradients: bool, prefix: str) -> None:
        self.tracker = tracker
        self.blocks: TracedBlocks | None = None  # stage 3's gathered blocks, traced with the plan
        self.device = device
        self.gradients = gradients
        self.prefix = prefix  # the repeated blocks' ModuleList ("": the marks name no block)
        self.points: list[TracePoint] = []
        self.marks: list[TraceMark] = []
        self.seen: dict[str, int] = {}  # modules, in the order they first ran (the meter's)
        self.stack: list[str] = []
        self.phase = TracePhase.FORWARD
        self.failed_in: str | None = None
        self.forward_peak = 0

    def bytes_now(self) -> int:
        return self.read("current")

    def read(self, kind: str) -> int:
        return _activation_bytes(self.tracker.get_tracker_snapshot(kind).get(self.device, {}), self.gradients)

    def mark(self, module: str, event: str) -> None:
        gathered = 0 if self.blocks is None else self.blocks.held_bytes()
        point = TracePoint(self.phase, module, event, self.bytes_now(), gathered)
        self.points.append(point)
        if event == "enter":
            self.seen.setdefault(module, len(self.seen))
        self.cut(module, event, point.bytes, gathered)

    def cut(self, module: str = "", event: str = "cut", nbytes: int = 0, gathered: int = 0) -> None:
        """Close the meter's stretch at a point (or at the end of a pass: ``event`` "cut")."""
        stretch = self.tracker.cut()
        block, name = split_name(self.prefix, module)
        named = None  # the module the meter's reading would name, had the pass peaked here
        best = None
        for fqn, where in stretch.modules:
            relative = _relative(fqn)
            rank = (-depth(relative), self.seen.get(relative, len(self.seen)), where == "backward")
            if best is None or rank < best:
                best, named = rank, (*split_name(self.prefix, relative), TracePhase(where))
        self.marks.append(
            TraceMark(
                self.phase, event, block, name, nbytes, gathered, stretch.total, stretch.activations, named
            )
        )

    def fqn(self, tracker: ModTracker, module: torch.nn.Module | None) -> str:
        return _relative(tracker.get_known_fqn(module)) if module is not None else ""


def trace_activations(
    build: Callable[[], torch.nn.Module],
    loss_of: Callable[[torch.nn.Module], torch.Tensor],
    *,
    fake: bool = True,
    device: torch.device | str = "cpu",
    plan: ZeroPlan | None = None,
    packed: bool = False,
    padded: bool = False,
    replicate: bool | None = None,
) -> ActivationTrace:
    """The activation timeline of ``loss_of(build())`` and its backward (see [Note: traced activations]).

    Args:
        build: makes the model (called under fake tensors: build it the usual way, weights included,
            on ``device``; nothing is allocated).
        loss_of: runs the forward on a micro-batch it makes (on ``device``) and returns the loss;
            autocast, activation checkpointing and the attention kernel are whatever it and the model
            use.
        fake: ``False`` runs for real (to check a trace against the same meter on real tensors).
        device: where the model and batch live; the meter's figures of that device are read.
        plan: the plan of the model's parameters (in the model's order): each gradient is then kept
            until that plan's staging schedule releases it, and counted, so that the trace holds the
            backward's gradients as ``ZeroOptimizer`` would ([Note: one timeline]), with the plan's
            ``options`` (``overlap_grad_reduce``; at stage 3 ``reshard_after_forward``, the gathered
            blocks then held as a step would: [Note: stage 3 traced]); without it every gradient is
            dropped as it arrives.
        packed: a transformers model's batch rows pack several sequences each ([Note: packed rows
            under fake tensors]; a real step decides it from the position ids' values).
        padded: a transformers model's batch pads some rows (its ``attention_mask`` holds zeros);
            by default a fake padding mask is taken for all ones, the usual batch ([Note: packed rows
            under fake tensors]; a real step decides it from the mask's values).
        replicate: trace the model's repeated blocks once ([Note: repeated blocks traced once] in
            ``zeroplan.core.sizing.repeat``): ``None`` (the default) when it has at least
            ``AUTO_REPLICATE_BLOCKS`` of them, ``True`` from 6, ``False`` never (the whole model:
            what the tests compare with). Not with a stage-3 plan (nor a stage-2 one off the CPU), nor
            for real.

    Raises:
        TraceError: an operation that fake tensors cannot run (a data-dependent shape, a custom
            kernel without a fake implementation), naming the module and the operation.
    """
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:  # the meter names devices with their index
        device = torch.device(device.type, torch.accelerator.current_device_index())
    with _fake_mode() if fake else _Null(), contextlib.ExitStack() as rows:
        if fake and not packed:
            rows.enter_context(one_sequence_per_row())
        if fake and not padded:
            rows.enter_context(unpadded_rows())
        model = build()
        if plan is not None:
            _check_matches(plan, model)
        if fake and replicate is not False and _replicable(plan, model, device):
            least = SHORT_BLOCKS[-1] + 1 if replicate else AUTO_REPLICATE_BLOCKS
            repeated = repeated_blocks(model, least=least)
            if repeated is not None:
                trace = _replicated(model, loss_of, device, plan, repeated)
                if trace is not None:
                    return trace
                model = build()  # afresh: the short traces ran it
        return _traced(model, loss_of, device, plan).trace


#: Repeated blocks from which ``trace_activations`` traces 3, 4 and 5 of them by default (fewer: all).
AUTO_REPLICATE_BLOCKS = 16


def _replicable(plan: ZeroPlan | None, model: torch.nn.Module, device: torch.device) -> bool:
    """Whether a trace with ``plan`` can be replicated ([Note: repeated blocks traced once]): without
    a plan; at stages 1 and 2 on the CPU, each gradient of its spec's dtype (the meter then counts
    the spec's bytes); never at stage 3 (its blocks are gathered by its own hooks)."""
    if plan is None:
        return True
    if plan.stage not in (Stage.OPTIMIZER, Stage.GRADIENTS) or device.type != "cpu":
        return False
    return all(
        canonical_dtype(str(p.dtype).removeprefix("torch.")) == spec.dtype
        for spec, p in zip(plan.specs, model.parameters(), strict=True)
    )


class _Run(NamedTuple):
    """One pass traced: its trace, and the marks of its stretches."""

    trace: ActivationTrace
    marks: tuple[TraceMark, ...]


def _traced(
    model: torch.nn.Module,
    loss_of: Callable[[torch.nn.Module], torch.Tensor],
    device: torch.device,
    plan: ZeroPlan | None,
    prefix: str = "",
    gradients: bool | None = None,
) -> _Run:
    """Trace ``loss_of(model)`` and its backward (``gradients``: count them, as with a plan)."""
    tracker = StretchTracker(
        device, partial(_activation_bytes, gradients=plan is not None or bool(gradients))
    )
    tracker.track_external(model)
    recorder = _Recorder(tracker, device, plan is not None or bool(gradients), prefix)
    marks = ModTracker()
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    staging = _Staging(recorder, [p for _, p in trainable], plan)
    handles: list[torch.utils.hooks.RemovableHandle] = []
    residency = None
    marks.register_user_hooks(
        lambda m, i: _enter(recorder, marks, m),
        lambda m, i, o: _exit(recorder, marks, m),
        lambda m, g: _enter(recorder, marks, m),
        lambda m, g: _exit(recorder, marks, m),
    )
    try:
        for i, (name, p) in enumerate(trainable):
            handles.append(p.register_post_accumulate_grad_hook(staging.hook(i, name)))
        if _holds_blocks(plan):  # after the staging's hooks, as ZeroOptimizer registers them
            residency = _blocks_of(plan, model, device)
            recorder.blocks = residency.blocks
        with tracker, marks:
            try:
                loss = loss_of(model)
                recorder.cut()
                recorder.forward_peak = recorder.read("peak")
                recorder.phase = TracePhase.BACKWARD
                loss.backward()
                recorder.cut()
            except _untraceable() as exc:
                raise _trace_error(exc, recorder) from exc
    finally:
        for handle in handles:
            handle.remove()
        if residency is not None:
            residency.sharded.retire()
    names = tuple(name for name, _ in trainable)
    resharded = None if residency is None or plan is None else plan.options.reshard_after_forward
    fingerprint = "" if plan is None else plan.fingerprint()
    return _Run(_finish(tracker, recorder, names, fingerprint, resharded), tuple(recorder.marks))


def _replicated(
    model: torch.nn.Module,
    loss_of: Callable[[torch.nn.Module], torch.Tensor],
    device: torch.device,
    plan: ZeroPlan | None,
    repeated: RepeatedBlocks,
) -> ActivationTrace | None:
    """The trace of ``model``, from its traces cut to 3, 4 and 5 repeated blocks ([Note: repeated
    blocks traced once]); ``None``: trace it whole."""
    names = tuple(name for name, p in model.named_parameters() if p.requires_grad)
    runs = []
    for k in SHORT_BLOCKS:
        with repeated.cut_to(model, k) as short:
            try:
                runs.append(_traced(short, loss_of, device, None, repeated.prefix, plan is not None))
            except Exception:  # a model that cannot run cut short (its own check of its depth): whole
                return None
    shorts = [
        ShortTrace(k, run.marks, run.trace.buffer_bytes) for k, run in zip(SHORT_BLOCKS, runs, strict=True)
    ]
    last = runs[-1].trace
    read = trace_of_marks(
        shorts[-1].marks, prefix=repeated.prefix, params=last.params, buffer_bytes=last.buffer_bytes
    )
    if read != last:
        return None  # the marks do not read as the meter does ([Note: the trace's meter])
    return replicate_trace(shorts, blocks=repeated.count, prefix=repeated.prefix, params=names, plan=plan)


class _TracedResidency(NamedTuple):
    """Stage 3's residency in a trace: the facade's hooks, and the table that allocates the blocks."""

    sharded: ShardedParams
    blocks: TracedBlocks


def _check_matches(plan: ZeroPlan, model: torch.nn.Module) -> None:
    """Refuse a plan made for other parameters (its specs in ``model.parameters()``' order)."""
    params = list(model.parameters())
    if len(params) != len(plan.specs):
        raise ConfigError(
            f"the plan has {len(plan.specs)} parameters, the model {len(params)}: trace the model the "
            "plan was made for"
        )
    for spec, (name, p) in zip(plan.specs, model.named_parameters(), strict=True):
        mine = (tuple(p.shape), p.requires_grad)  # not the dtype: the CLI plans a config in one
        if mine != (tuple(spec.shape), spec.trainable):
            raise ConfigError(
                f"the plan's parameter {spec.index} ({spec.name!r}: shape, trainable "
                f"{(tuple(spec.shape), spec.trainable)}) is not the model's {name!r} ({mine}): "
                "plan the model's parameters, in model.parameters() order"
            )


def _holds_blocks(plan: ZeroPlan | None) -> bool:
    """Whether the trace holds ``plan``'s gathered blocks (stage 3)."""
    return plan is not None and plan.stage is Stage.PARAMETERS


def _blocks_of(plan: ZeroPlan, model: torch.nn.Module, device: torch.device) -> _TracedResidency:
    """Stage 3's residency over ``model``'s parameters, allocating its blocks ([Note: stage 3 traced])."""
    params = list(model.parameters())
    blocks = TracedBlocks(plan, params, device)
    sharded = ShardedParams(zp=plan, params=params, blocks=blocks, buffers=(), shard_rank=0)
    try:
        sharded.attach(model)
    except BaseException:
        sharded.retire()  # its claims on the parameters and its gradient hooks
        raise
    return _TracedResidency(sharded, blocks)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _relative(fqn: str | None) -> str:
    """``ModTracker``'s name (the root's class name first) as ``named_modules`` gives it."""
    return (fqn or "").partition(".")[2]


class _Staging:
    """What becomes of each gradient as it arrives: dropped at once (no plan: the plan counts
    gradients itself), or kept until ``plan``'s staging schedule releases it (frees it, or at stage 1
    moves it into the gradient buffer the plan counts)."""

    def __init__(self, recorder: _Recorder, params: list[torch.Tensor], plan: ZeroPlan | None) -> None:
        self.recorder = recorder
        self.params = params
        self.schedule = None
        self.index: list[int] = []
        self.position: dict[int, int] = {}
        if plan is not None:
            self.index = sorted(plan.trainable_indices)  # the model's, in order (``_check_matches``)
        if plan is not None and plan.stage is not Stage.DDP:
            self.schedule = staging_schedule(plan)
            next(self.schedule)
            self.position = {spec: i for i, spec in enumerate(self.index)}

    def hook(self, i: int, name: str) -> Callable[[torch.Tensor], None]:
        def arrived(param: torch.Tensor) -> None:
            if self.schedule is None:
                param.grad = None
            else:
                for action in self.schedule.send(self.index[i]):
                    if action.kind is ActionKind.RELEASE:
                        self.params[self.position[action.param]].grad = None
            self.recorder.mark(name, "grad")

        return arrived


def _enter(recorder: _Recorder, marks: ModTracker, module: torch.nn.Module | None) -> None:
    name = recorder.fqn(marks, module)
    recorder.stack.append(name)
    recorder.mark(name, "enter")


def _exit(recorder: _Recorder, marks: ModTracker, module: torch.nn.Module | None) -> None:
    name = recorder.fqn(marks, module)
    if sys.exc_info()[1] is not None and recorder.failed_in is None:
        recorder.failed_in = name  # the innermost module an exception leaves (hooks run while it unwinds)
    if recorder.stack and recorder.stack[-1] == name:
        recorder.stack.pop()
    recorder.mark(name, "exit")


def _trace_error(exc: Exception, recorder: _Recorder) -> TraceError:
    module = recorder.failed_in if recorder.failed_in is not None else (recorder.stack or ["(the loss)"])[-1]
    op = getattr(exc, "func", None)
    what = f"operation {op}" if op is not None else "an operation"
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return TraceError(
        f"cannot trace {recorder.phase} under fake tensors: module {module!r} runs {what} that fake "
        f"tensors cannot run ({type(exc).__name__}: {first[:200]}); give it a fake implementation "
        "(torch.library.register_fake), or plan activations by formula (--activations formula)"
    )


def _finish(
    tracker: StretchTracker,
    recorder: _Recorder,
    names: tuple[str, ...],
    fingerprint: str,
    resharded: bool | None,
) -> ActivationTrace:
    device = recorder.device
    peak = recorder.read("peak")
    peak = max(peak, *(p.bytes for p in recorder.points))
    forward = max(recorder.forward_peak, *(p.bytes for p in recorder.points if p.phase is TracePhase.FORWARD))
    total = tracker.get_tracker_snapshot("peak").get(device, {}).get("Total", 0)
    phase, module = TracePhase.FORWARD, ""
    depth = -1
    for stats in tracker.memory_tracking.values():
        for state, where in (
            (_ModState.PEAK_FW, TracePhase.FORWARD),
            (_ModState.PEAK_BW, TracePhase.BACKWARD),
        ):
            snaps = stats.snapshots.get(state, [])
            if any(s.get(device, {}).get("Total") == total for s in snaps):
                fqn = stats.mod_fqn
                if fqn.count(".") > depth:
                    phase, module, depth = where, _relative(fqn), fqn.count(".")
    buffers = tracker.get_tracker_snapshot("current").get(device, {}).get(_MemRefType.BUFFER, 0)
    return ActivationTrace(
        points=tuple(recorder.points),
        peak_bytes=peak,
        peak_phase=phase,
        peak_module=module,
        forward_peak_bytes=min(forward, peak),
        params=names,
        plan_fingerprint=fingerprint,
        reshard_after_forward=resharded,
        buffer_bytes=buffers,
    )
