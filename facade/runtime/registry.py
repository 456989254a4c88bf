"""What a ``ZeroOptimizer`` asks the planner to lay out: its parameters and its settings.

[Note: optimizer parts]
``ZeroOptimizer`` is assembled from typed parts, passed explicitly to the
modules that work on them (none of them reads the optimizer itself):

* :class:`ParamRegistry` (frozen): the user's parameters, their names, param
  group membership and cohorts. Re-planning builds a *new* registry and the
  optimizer swaps it in only after every rank agreed, so a rejected change
  needs no undo.
* :class:`PlanSettings` (frozen): everything else the planner is given
  (topology, stage, strategy, bucket size, ...); fixed at construction.
* ``Installed`` (``installed.py``): what one plan is executed with: the plan,
  process groups, flat buffers, the inner optimizer and the gradient sync.
* ``StepLifecycle`` (``lifecycle.py``): the phase of the current step and the
  state that lives for one step (see [Note: step lifecycle]).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from zeroplan.core import (
    ConfigError,
    Offload,
    ParamSpec,
    StepOptions,
    Topology,
    ZeroPlan,
    describe_optimizer,
    offload_residences,
    plan,
)
from zeroplan.core.errors import ConfigTypeError
from zeroplan.core.wire import WireCodec, WireFormat
from zeroplan.facade.params.blocks import check_shardable
from zeroplan.facade.runtime.inputs import ParamList, collect_params, describe_params
from zeroplan.facade.state.inner import check_hyperparameters, check_keywords, host_kernel

__all__ = ["Configured", "ParamRegistry", "PlanSettings", "configure", "scale_mode"]


@dataclass(frozen=True, slots=True, eq=False)
class ParamRegistry:
    """The parameters an optimizer manages; a parameter's position is its plan index.

    Attributes:
        params: every parameter, in the order of the user's groups.
        names: one name per parameter (for error messages and checkpoints).
        members: per param group, the indices of its parameters.
        cohorts: per parameter, its cohort: parameters of one group and cohort
            share scalar optimizer state such as Adam's ``step``.
        next_cohort: the cohort the next newly trainable parameters get.
        device: the one device every parameter lives on.
        user_params: per parameter, the user's tensor: the parameter itself, or the ``DTensor`` whose
            local tensor ``params`` holds ([Note: tensor-parallel parameters] in
            ``zeroplan.core.tensor_parallel``); param groups, hooks and ``requires_grad`` are its.
        tensor_mesh: the mesh DTensor parameters lie on (the optimizer mesh's ``tp`` dimension), for
            the groups ``add_param_group`` brings; ``None`` without one.
    """

    params: tuple[torch.Tensor, ...]
    names: tuple[str, ...]
    members: tuple[tuple[int, ...], ...]
    cohorts: tuple[int, ...]
    next_cohort: int
    device: torch.device
    user_params: tuple[torch.Tensor, ...]
    tensor_mesh: Any = None

    @classmethod
    def of(cls, inputs: ParamList, tensor_mesh: Any = None) -> ParamRegistry:
        """The registry of freshly collected parameters (every one in cohort 0)."""
        return cls(
            params=inputs.params,
            names=inputs.names,
            members=tuple(tuple(g["params"]) for g in inputs.groups),
            cohorts=(0,) * len(inputs.params),
            next_cohort=1,
            device=inputs.device,
            user_params=inputs.user_params,
            tensor_mesh=tensor_mesh,
        )

    @property
    def placed(self) -> bool:
        """Whether any parameter is a ``DTensor`` (placed on ``tensor_mesh``)."""
        return any(u is not p for u, p in zip(self.user_params, self.params, strict=True))

    def specs(self) -> tuple[ParamSpec, ...]:
        """Planner descriptions of the parameters (trainability read from ``requires_grad`` now)."""
        groups = tuple({"params": members} for members in self.members)
        return describe_params(self.params, self.names, groups, self.cohorts, self.user_params)

    def with_cohorts(self, cohorts: Sequence[int]) -> ParamRegistry:
        """The same parameters in other cohorts (e.g. those of a plan being adopted)."""
        cohorts = tuple(cohorts)
        return dataclasses.replace(self, cohorts=cohorts, next_cohort=max(cohorts, default=0) + 1)

    def with_newly_trainable(self, trainable: frozenset[int], revived: Collection[int] = ()) -> ParamRegistry:
        """Parameters that require grad now but are not in ``trainable`` move to new cohorts.

        They share one fresh cohort, except those in ``revived`` (parameters with
        parked state, see [Note: parked state]), which get one each: each
        continues with its own parked scalar state.
        """
        fresh, following = self.next_cohort, self.next_cohort + 1
        cohorts = []
        for index, (param, cohort) in enumerate(zip(self.user_params, self.cohorts, strict=True)):
            if param.requires_grad and index not in trainable:
                if index in revived:
                    cohort, following = following, following + 1
                else:
                    cohort = fresh
            cohorts.append(cohort)
        return dataclasses.replace(self, cohorts=tuple(cohorts), next_cohort=following)

    def with_group(self, inputs: ParamList) -> ParamRegistry:
        """The registry with one more param group (``inputs``, indexed after the existing ones)."""
        return dataclasses.replace(
            self,
            params=self.params + inputs.params,
            user_params=self.user_params + inputs.user_params,
            names=self.names + inputs.names,
            members=(*self.members, tuple(inputs.groups[0]["params"])),
            cohorts=self.cohorts + (self.next_cohort,) * len(inputs.params),
            next_cohort=self.next_cohort + 1,
        )


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """What the planner is told besides the parameters; fixed for the optimizer's lifetime."""

    topology: Topology
    optimizer_class: type[torch.optim.Optimizer]
    stage: int
    strategy: str
    alignment: int
    bucket_bytes: int
    loss_scaling: bool
    max_inflight_buckets: int
    policy: str
    layout: str = "auto"
    deterministic: bool = False
    grad_wire: WireCodec | None = None
    param_wire: WireCodec | None = None
    options: StepOptions = dataclasses.field(default_factory=StepOptions)
    offload: Offload = Offload.NONE
    offload_fraction: float | None = None
    #: The user's keyword arguments of the inner optimizer, as given: its constructor takes them
    #: (state made at construction reads them, e.g. Adagrad's ``initial_accumulator_value``).
    optimizer_kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def optimizer_name(self) -> str:
        """The inner optimizer's class name (what checkpoints and state dicts record)."""
        return self.optimizer_class.__name__

    @property
    def planned_name(self) -> str:
        """The name the planner describes the inner optimizer by.

        torchao's classes are qualified (``torchao.AdamW8bit``): bitsandbytes has
        an ``AdamW8bit`` too, whose state is laid out differently.
        """
        package = self.optimizer_class.__module__.partition(".")[0]
        return f"torchao.{self.optimizer_name}" if package == "torchao" else self.optimizer_name

    def plan(self, registry: ParamRegistry, groups: Sequence[dict[str, Any]]) -> ZeroPlan:
        """The plan of ``registry`` with the hyper-parameters of ``groups`` (pure: changes nothing)."""
        # The inner optimizer steps where the masters live: the parameters' device, or the CPU.
        device = "cpu" if self.offload is not Offload.NONE else registry.device.type
        optimizers = tuple(
            describe_optimizer(self.planned_name, g, strict=False, device=device) for g in groups
        )
        zp = plan(
            registry.specs(),
            self.topology,
            stage=self.stage,
            optimizer=optimizers,
            options=self.options,
            **self.plan_options(),
        )
        check_shardable(zp, registry.params)  # stage 3 shards nn.Parameter objects only
        return zp

    def plan_options(self) -> dict[str, Any]:
        """The keywords of ``zeroplan.core.plan`` besides specs, topology, stage, optimizer and options."""
        return {
            "strategy": self.strategy,
            "alignment": self.alignment,
            "bucket_bytes": self.bucket_bytes,
            "loss_scaling": self.loss_scaling,
            "max_inflight_buckets": self.max_inflight_buckets,
            "policy": self.policy,
            "layout": self.layout,
            "deterministic": self.deterministic,
            "grad_wire": self.grad_wire,
            "param_wire": self.param_wire,
            "offload": self.offload,
            "offload_fraction": self.offload_fraction,
        }


class Configured(NamedTuple):
    """A validated ``ZeroOptimizer(...)`` call: what construction needs once every rank agreed."""

    mode: float | str | None
    groups: list[dict[str, Any]]
    settings: PlanSettings
    registry: ParamRegistry


#: Inner optimizers that cannot work on a shard: they need the whole model or sparse gradients.
_REFUSED = {
    "LBFGS": "needs every parameter of the model and a closure re-evaluating the loss within step()",
    "SparseAdam": "needs sparse gradients, and ZeroOptimizer reduces dense flat buckets",
}


def configure(
    params: Any,
    optimizer_class: type[torch.optim.Optimizer],
    optimizer_defaults: dict[str, Any],
    *,
    world: dist.ProcessGroup,
    stage: int,
    shard_group_size: int | None,
    strategy: str,
    alignment: int,
    bucket_bytes: int,
    loss_scale: float | str | None,
    max_inflight_buckets: int,
    collectives: str,
    layout: str = "auto",
    ranks_per_node: int | None = None,
    deterministic: bool = False,
    grad_wire: WireCodec | None = None,
    param_wire: WireCodec | None = None,
    options: StepOptions | None = None,
    offload: Offload | str | None = None,
    offload_fraction: float | None = None,
    tensor_mesh: Any = None,
) -> Configured:
    """Validate the arguments of ``ZeroOptimizer(...)``; touches no tensor.

    ``tensor_mesh``: the mesh's ``tp`` dimension, which DTensor parameters must be placed on.

    Raises:
        ConfigError: a bad value (a ``ConfigTypeError``, also a ``TypeError``,
            for an argument of the wrong kind, as ``torch.optim`` raises).
    """
    if type(stage) is not int or stage not in (1, 2, 3):
        raise ConfigError(f"stage must be 1, 2 or 3, got {stage!r} (use DistributedDataParallel for stage 0)")
    refused = _REFUSED.get(getattr(optimizer_class, "__name__", ""))
    if refused is not None:
        raise ConfigError(f"{optimizer_class.__name__} cannot be sharded: it {refused}")
    mode = scale_mode(loss_scale)
    inputs = collect_params(
        params, tensor_mesh=tensor_mesh
    )  # none placed: the mesh decides (agree_over_mesh)
    groups = [{**optimizer_defaults, **group} for group in inputs.groups]
    check_hyperparameters(optimizer_class, groups)
    check_keywords(optimizer_class, optimizer_defaults)
    if shard_group_size is not None and (type(shard_group_size) is not int or shard_group_size < 1):
        raise ConfigError(f"shard_group_size must be an int >= 1, got {shard_group_size!r}")
    if ranks_per_node is not None and (type(ranks_per_node) is not int or ranks_per_node < 1):
        raise ConfigError(f"ranks_per_node must be an int >= 1 or None, got {ranks_per_node!r}")
    if type(deterministic) is not bool:
        raise ConfigTypeError(f"deterministic must be True or False, got {deterministic!r}")
    offloaded = Offload.parse(offload)  # [Note: offload, executed]
    offload_residences(offloaded, stage, offload_fraction)  # refused here, before anything is read
    if offloaded is not Offload.NONE:
        host_kernel(optimizer_class, groups)  # the step runs on the CPU: its fused kernel, if any
    world_size = dist.get_world_size(world)
    if collectives == "auto":
        collectives = "gloo" if dist.get_backend(world) == "gloo" else "min_bytes"
    settings = PlanSettings(
        topology=Topology(
            world_size=world_size, shard_size=shard_group_size or world_size, ranks_per_node=ranks_per_node
        ),
        optimizer_class=optimizer_class,
        stage=stage,
        strategy=strategy,
        alignment=alignment,
        bucket_bytes=bucket_bytes,
        loss_scaling=mode is not None,
        max_inflight_buckets=max_inflight_buckets,
        policy=collectives,
        layout=layout,
        deterministic=deterministic,
        grad_wire=grad_wire,
        param_wire=param_wire,
        options=StepOptions() if options is None else options,
        offload=offloaded,
        offload_fraction=None if offload_fraction is None else float(offload_fraction),
        optimizer_kwargs=tuple(optimizer_defaults.items()),
    )
    return Configured(
        mode=mode, groups=groups, settings=settings, registry=ParamRegistry.of(inputs, tensor_mesh)
    )


def scale_mode(loss_scale: float | str | None) -> float | str | None:
    """Validate ``ZeroOptimizer(loss_scale=...)``: ``None``, a static scale or ``"dynamic"``.

    Raises:
        ConfigError: anything else.
    """
    if loss_scale is None or loss_scale == "dynamic":
        return loss_scale
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        if math.isfinite(loss_scale) and loss_scale > 0:
            return float(loss_scale)
    raise ConfigError(f"loss_scale must be None, a finite number > 0 or 'dynamic', got {loss_scale!r}")


#: ``ZeroOptimizer(reduce_dtype=...)``: torch dtypes and names of the wire formats ([Note: wire formats]).
_WIRES: dict[Any, WireFormat] = {
    torch.float32: WireFormat.FP32,
    torch.bfloat16: WireFormat.BF16,
    torch.int8: WireFormat.INT8,
    torch.float8_e4m3fn: WireFormat.FP8,
    "fp32": WireFormat.FP32,
    "float32": WireFormat.FP32,
    "bf16": WireFormat.BF16,
    "bfloat16": WireFormat.BF16,
    "int8": WireFormat.INT8,
    "fp8": WireFormat.FP8,
    "float8_e4m3fn": WireFormat.FP8,
}


def grad_wire(reduce_dtype: Any, block: int) -> WireCodec | None:
    """The gradient wire of ``ZeroOptimizer(reduce_dtype=..., wire_block=...)`` (``None``: today's).

    Raises:
        ConfigError: an unknown format, or a bad block size (the message lists what works).
    """
    return _codec("reduce_dtype", reduce_dtype, block, "a gradient")


def param_wire(gather_dtype: Any, block: int) -> WireCodec | None:
    """The parameter wire of ``ZeroOptimizer(gather_dtype=..., wire_block=...)`` (``None``: today's).

    Raises:
        ConfigError: an unknown format (fp32 included: never smaller than the parameters), or a bad
            block size.
    """
    codec = _codec("gather_dtype", gather_dtype, block, "a parameter")
    if codec is not None and codec.format is WireFormat.FP32:
        raise ConfigError(
            f"gather_dtype={gather_dtype!r} sends at least the parameters' bytes and changes nothing; use "
            "None (the parameter dtype), torch.bfloat16 or 'bf16', 'int8' or 'fp8'"
        )
    return codec


def _codec(keyword: str, value: Any, block: int, what: str) -> WireCodec | None:
    if value is None:
        return None
    fmt = _WIRES.get(value)
    if fmt is None:
        names = "None, torch.float32 or 'fp32', torch.bfloat16 or 'bf16', 'int8', 'fp8'"
        if keyword == "gather_dtype":
            names = "None, torch.bfloat16 or 'bf16', 'int8', 'fp8'"
        raise ConfigError(f"{keyword}={value!r} is not {what} wire format; use one of {names}")
    return WireCodec(fmt, block=block)
