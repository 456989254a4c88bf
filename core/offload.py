# zeroplan.core — pure planning: no torch, no I/O.
# CPU offload as a plan option: which buffer roles each mode places in host memory.
"""Offload modes and the placements they give: :class:`Offload`, :func:`offload_residences`.

[Note: offload, planned]
An offload mode is a recipe for :class:`~zeroplan.core.residence.Residences`
([Note: residences]), chosen by name (``plan(..., offload="optimizer")``,
``zeroplan plan --offload optimizer``):

* ``none`` — everything on the device (the default; plans are unchanged).
* ``optimizer`` (stages 1-3) — the fp32 masters, the inner optimizer's state
  and the fp32 gradient shard live in host memory: the step runs on the CPU.
  Each bucket's reduced gradient shard goes device→host, the updated
  parameters (the rank's shard, in the parameter dtype) host→device.
* ``all`` (stage 3 only) — the parameter shards too: the step updates them on
  the host, and each block's shard goes host→device just before its gather
  (before the forward, and again before the backward when resharded).

``offload_fraction`` (``optimizer`` only) places that share of each rank's
optimizer elements in host memory and keeps the rest on the device, the split
chosen by the plan ([Note: kept on the device]).

Where a role is otherwise a *view* of a device buffer (fp32 parameters are
their own masters; stage 1 reduces a rank-major gradient shard in place in the
full gradient buffer), a host placement gives it a buffer of its own
(``ZeroPlan.master_in_params``, ``ZeroPlan.reduces_in_place``), counted in
host memory. The bytes each step moves over the host link each way are
planned by :func:`zeroplan.core.host_traffic.host_link`; ``memory_report`` shows
them with the device and host peaks. How the facade executes it:
[Note: offload, executed] in ``zeroplan.core.host_step``.
"""

from __future__ import annotations

import enum

from zeroplan.core.errors import ConfigError
from zeroplan.core.residence import ALL_ON_DEVICE, BufferRole, Residences

__all__ = ["Offload", "offload_name", "offload_residences"]


class Offload(enum.Enum):
    """What CPU offload places in host memory (see [Note: offload, planned])."""

    NONE = "none"
    OPTIMIZER = "optimizer"
    ALL = "all"

    @classmethod
    def parse(cls, mode: Offload | str | None) -> Offload:
        """``mode`` as an :class:`Offload` (``None`` is ``NONE``).

        Raises:
            ConfigError: ``mode`` names no offload mode.

        Example:
            >>> Offload.parse("optimizer"), Offload.parse(None)
            (<Offload.OPTIMIZER: 'optimizer'>, <Offload.NONE: 'none'>)
        """
        if mode is None:
            return cls.NONE
        try:
            return cls(mode)
        except ValueError:
            names = ", ".join(repr(m.value) for m in cls)
            raise ConfigError(f"offload: {mode!r} is not an offload mode; use one of {names}") from None


#: The roles ``Offload.OPTIMIZER`` places in host memory.
OPTIMIZER_ROLES = (BufferRole.GRAD_SHARD, BufferRole.MASTER, BufferRole.OPTIMIZER_STATE)


def offload_residences(mode: Offload | str | None, stage: int, fraction: float | None = None) -> Residences:
    """Where each buffer role lives under offload ``mode`` at ``stage`` ([Note: offload, planned]).

    Args:
        mode: ``"none"`` (or ``None``), ``"optimizer"`` or ``"all"``.
        stage: the plan's stage, 0-3.
        fraction: ``offload_fraction``: the share of the optimizer's elements in host memory,
            the rest kept on the device ([Note: kept on the device]); ``None`` (or 1): all.

    Raises:
        ConfigError: offload at stage 0, ``"all"`` below stage 3, a fraction without
            ``"optimizer"``, or a fraction outside (0, 1].

    Example:
        >>> [r.value for r in offload_residences("optimizer", 2).host]
        ['grad_shard', 'master', 'optimizer_state']
        >>> [r.value for r in offload_residences("all", 3).host]
        ['param_shard', 'grad_shard', 'master', 'optimizer_state']
    """
    mode = Offload.parse(mode)
    if fraction is not None and mode is not Offload.OPTIMIZER:
        raise ConfigError(
            f"offload_fraction={fraction!r} needs offload='optimizer' (it splits the masters, their state "
            f"and the gradient shard between host memory and the device), got offload={mode.value!r}"
            + ("; with offload='all' the parameter shards are offloaded whole" if mode is Offload.ALL else "")
        )
    if mode is Offload.NONE:
        return ALL_ON_DEVICE
    if int(stage) == 0:
        raise ConfigError(
            f"offload={mode.value!r} needs stage 1, 2 or 3: a stage-0 (DDP) plan allocates nothing of "
            "zeroplan's to place in host memory; use stage=1, 2 or 3, or offload='none'"
        )
    if mode is Offload.ALL:
        if int(stage) != 3:
            raise ConfigError(
                f"offload='all' needs stage 3 (the parameter shards go to host memory), got stage "
                f"{int(stage)}, where every rank holds the full parameters on the device; use stage=3, "
                "or offload='optimizer'"
            )
        return Residences(host=(BufferRole.PARAM_SHARD, *OPTIMIZER_ROLES))
    if fraction is None:
        return Residences(host=OPTIMIZER_ROLES)
    try:
        return Residences(host=OPTIMIZER_ROLES, host_fraction=fraction)
    except ConfigError:
        raise ConfigError(
            f"offload_fraction must be a number in (0, 1] (the share of the optimizer's elements in host "
            f"memory), got {fraction!r}; for none, use offload='none'"
        ) from None


def offload_name(where: Residences, stage: int) -> str | tuple[str, ...]:
    """The offload mode that places roles as ``where`` does at ``stage`` (its name, as the user gave
    it), or the roles in host memory when no mode does. ``where.host_fraction`` is not part of it.

    Example:
        >>> offload_name(offload_residences("optimizer", 2), 2), offload_name(ALL_ON_DEVICE, 2)
        ('optimizer', 'none')
        >>> offload_name(Residences(host=("staging",)), 2)
        ('staging',)
    """
    for mode in Offload:
        try:
            if offload_residences(mode, stage).host == where.host:
                return mode.value
        except ConfigError:
            continue
    return tuple(role.value for role in where.host)
