# zeroplan.core — pure planning: no torch, no I/O.
# Where each buffer role lives (the device or host memory), as one small frozen value of the plan.
"""Buffer roles and where each lives: :class:`BufferRole`, :class:`Residence`, :class:`Residences`.

[Note: residences]
Every buffer a rank holds has a *role* (what it holds: the full parameters,
the gradient shard, the masters, the optimizer state, the staging arena, …)
and a *residence*: ``DEVICE`` (the parameters' device) or ``HOST`` (host
memory: pinned CPU memory when the parameters are on CUDA, where copies to and
from the GPU can run asynchronously; the same memory as ``DEVICE`` when the
parameters are on the CPU). :class:`Residences` maps each role to its
residence, everything on the device by default; the plan holds it
(``ZeroPlan.residences``), the allocation plan labels each buffer with it
([Note: allocation plan]), ``memory_report`` sums device and host bytes apart
and the facade allocates each role where it says (``facade.mechanisms.buffer_devices``).
CPU offload places roles there ([Note: offload, planned]; how the facade runs
it: [Note: offload, executed]); nothing plans host residence by default.

A buffer that is a view of another lives where that one does: the plan refuses
a placement that would split them (``ZeroPlan`` validates it), and the inner
optimizer's state lives with the masters it steps (``torch.optim`` makes it
beside them).

[Note: kept on the device]
``Residences.host_fraction`` below 1 (``offload_fraction``, Megatron's idea)
places only part of the optimizer's roles in host memory: of each rank's shard
of each space, a prefix ``[0, k)`` keeps its gradient shard, masters and
optimizer state on the device (the ``KEPT_*`` roles, always on the device) and
the rest lives in host memory as under full offload. ``ZeroPlan.kept_numel``
chooses ``k`` by rule: the start of one of the rank's bucket pieces (or its
extent), the one nearest ``(1 - host_fraction)`` of the shard, so every bucket
piece is wholly kept or wholly offloaded and a bucket's reduction lands in one
place. The prefix holds the buckets launched last (the model's first layers,
whose gradients arrive at the end of backward and whose parameters the next
forward needs first), so their copies down and up, which nothing could hide,
are the ones that go. The kept part steps on the device; the rest on the host,
unit by unit ([Note: offload, executed]). The kept masters are a buffer of their
own, as the offloaded part's: for fp32 parameters that is a copy on the device
that a view of the parameters could spare (not done: the plan counts it).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from zeroplan.core.errors import ConfigError

__all__ = ["ALL_ON_DEVICE", "KEPT_ROLES", "BufferRole", "Residence", "Residences"]


class BufferRole(enum.Enum):
    """What a buffer holds (see [Note: allocation plan] and [Note: residences]).

    The first six are the buffers of a dtype space (``SpaceAllocation``); the
    next three are planned beside them: the gradient staging arena
    (``core.arena``), the inner optimizer's state (its description's bytes) and
    the rooms of stage 3's encoded parameter gathers (``core.wire``). The
    ``KEPT_*`` roles are the device part of a partial offload
    ([Note: kept on the device]): always on the device.
    """

    FULL_PARAMS = "full_params"
    FULL_GRADS = "full_grads"
    PARAM_SHARD = "param_shard"
    GRAD_SHARD = "grad_shard"
    MASTER = "master"
    BLOCK = "block"
    STAGING = "staging"
    OPTIMIZER_STATE = "optimizer_state"
    GATHER_ROOM = "gather_room"
    KEPT_GRAD_SHARD = "kept_grad_shard"
    KEPT_MASTER = "kept_master"
    KEPT_OPTIMIZER_STATE = "kept_optimizer_state"


#: The roles of the part of a shard a partial offload keeps on the device ([Note: kept on the device]).
KEPT_ROLES = (BufferRole.KEPT_GRAD_SHARD, BufferRole.KEPT_MASTER, BufferRole.KEPT_OPTIMIZER_STATE)


class Residence(enum.Enum):
    """Where a buffer lives: the parameters' device, or host memory (pinned when the device is CUDA)."""

    DEVICE = "device"
    HOST = "host"


@dataclass(frozen=True, slots=True, kw_only=True)
class Residences:
    """Where each buffer role lives (see [Note: residences]): on the device, but for ``host``.

    Attributes:
        host: the roles placed in host memory, in role order (names or roles are accepted).
        host_fraction: the share of each rank's optimizer elements (gradient shard, masters,
            state) in host memory when those roles are placed there; the rest is kept on the
            device ([Note: kept on the device]). 1.0: all of them.

    Raises:
        ConfigError: ``host`` names something that is not a buffer role, or a role that always
            lives on the device; ``host_fraction`` outside (0, 1], or below 1 without the masters,
            their state and the gradient shard in host memory.

    Example:
        >>> where = Residences(host=("optimizer_state", "master"))
        >>> where.host, where.of(BufferRole.MASTER).value, where.of(BufferRole.GRAD_SHARD).value
        ((<BufferRole.MASTER: 'master'>, <BufferRole.OPTIMIZER_STATE: 'optimizer_state'>), 'host', 'device')
        >>> Residences().all_on_device
        True
    """

    host: tuple[BufferRole, ...] = ()
    host_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.host, Iterable) or isinstance(self.host, str):
            raise ConfigError(f"residences: host must be a tuple of buffer roles, got {self.host!r}")
        roles = set()
        for role in self.host:
            try:
                roles.add(BufferRole(role))
            except ValueError:
                names = ", ".join(repr(r.value) for r in BufferRole)
                raise ConfigError(f"residences: {role!r} is not a buffer role; use one of {names}") from None
        kept = [role.value for role in KEPT_ROLES if role in roles]
        if kept:
            raise ConfigError(
                f"residences: {', '.join(kept)} always live on the device (the part of a shard a partial "
                "offload keeps there); set host_fraction instead"
            )
        object.__setattr__(self, "host", tuple(r for r in BufferRole if r in roles))
        f = self.host_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ConfigError(
                f"residences: host_fraction must be a number in (0, 1] (the share of the optimizer's "
                f"elements in host memory), got {f!r}; for none, place nothing in host memory"
            )
        object.__setattr__(self, "host_fraction", float(f))
        optimizer = {BufferRole.GRAD_SHARD, BufferRole.MASTER, BufferRole.OPTIMIZER_STATE}
        if self.host_fraction < 1 and not optimizer <= roles:
            raise ConfigError(
                f"residences: host_fraction={f!r} splits the optimizer's elements between host memory and "
                "the device, so grad_shard, master and optimizer_state must be placed in host memory; "
                "use offload='optimizer' with offload_fraction"
            )

    @property
    def partial(self) -> bool:
        """Whether part of each shard is kept on the device ([Note: kept on the device])."""
        return self.host_fraction < 1

    def of(self, role: BufferRole) -> Residence:
        """Where ``role`` lives."""
        return Residence.HOST if role in self.host else Residence.DEVICE

    @property
    def all_on_device(self) -> bool:
        """Whether every role lives on the device (the default)."""
        return not self.host

    def as_dict(self, roles: Iterable[BufferRole] = tuple(BufferRole)) -> dict[str, str]:
        """``{role: residence}`` names of ``roles`` (every role by default), JSON-ready."""
        return {role.value: self.of(role).value for role in roles}


#: The default placement: every buffer role on the parameters' device.
ALL_ON_DEVICE = Residences()
