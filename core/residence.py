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
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from zeroplan.core.errors import ConfigError

__all__ = ["ALL_ON_DEVICE", "BufferRole", "Residence", "Residences"]


class BufferRole(enum.Enum):
    """What a buffer holds (see [Note: allocation plan] and [Note: residences]).

    The first six are the buffers of a dtype space (``SpaceAllocation``); the
    last three are planned beside them: the gradient staging arena
    (``core.arena``), the inner optimizer's state (its description's bytes) and
    the rooms of stage 3's encoded parameter gathers (``core.wire``).
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


class Residence(enum.Enum):
    """Where a buffer lives: the parameters' device, or host memory (pinned when the device is CUDA)."""

    DEVICE = "device"
    HOST = "host"


@dataclass(frozen=True, slots=True, kw_only=True)
class Residences:
    """Where each buffer role lives (see [Note: residences]): on the device, but for ``host``.

    Attributes:
        host: the roles placed in host memory, in role order (names or roles are accepted).

    Raises:
        ConfigError: ``host`` names something that is not a buffer role.

    Example:
        >>> where = Residences(host=("optimizer_state", "master"))
        >>> where.host, where.of(BufferRole.MASTER).value, where.of(BufferRole.GRAD_SHARD).value
        ((<BufferRole.MASTER: 'master'>, <BufferRole.OPTIMIZER_STATE: 'optimizer_state'>), 'host', 'device')
        >>> Residences().all_on_device
        True
    """

    host: tuple[BufferRole, ...] = ()

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
        object.__setattr__(self, "host", tuple(r for r in BufferRole if r in roles))

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
