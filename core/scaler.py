# zeroplan.core — pure planning: no torch, no I/O.
# The dynamic loss scale as a pure transition: next_state = update(state, found_inf).
"""Dynamic loss scaling as a pure state transition.

[Note: loss scale]
``update`` implements, with ``H = config.hysteresis``::

    if found_inf:                       # the step is skipped
        growth_tracker = 0
        hysteresis_tracker += 1
        if hysteresis_tracker >= H:
            scale = max(f32(scale * backoff_factor), min_scale)
    else:
        growth_tracker += 1
        if growth_tracker == growth_interval:
            growth_tracker = 0
            hysteresis_tracker = 0
            grown = min(f32(scale * growth_factor), max_scale)
            if isfinite(grown):
                scale = grown

With ``H == 1`` this is ``torch.amp.GradScaler`` step for step (including its
float32 rounding of the scale); with ``H > 1`` it is InternLM's
``DynamicGradScaler``, which backs off only after ``H`` overflows since the last
growth and then on every further overflow until the scale grows again.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace

from zeroplan.core.errors import check_config

__all__ = ["ScalerConfig", "ScalerState", "initial_state", "update"]


def _f32(value: float) -> float:
    """Round to the nearest float32, as the scale tensor of GradScaler stores it."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScalerConfig:
    """Settings of the dynamic loss scale (defaults are ``torch.amp.GradScaler``'s).

    Example:
        >>> ScalerConfig(hysteresis=2).backoff_factor
        0.5
    """

    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1
    min_scale: float = 0.0
    max_scale: float = math.inf

    def __post_init__(self) -> None:
        check_config(
            math.isfinite(self.initial_scale) and self.initial_scale > 0,
            f"initial_scale must be finite and > 0, got {self.initial_scale!r}",
        )
        check_config(
            self.growth_factor > 1.0,
            f"growth_factor must be > 1, got {self.growth_factor!r}",
        )
        check_config(
            0.0 < self.backoff_factor < 1.0,
            f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}",
        )
        check_config(
            type(self.growth_interval) is int and self.growth_interval >= 1,
            f"growth_interval must be an int >= 1, got {self.growth_interval!r}",
        )
        check_config(
            type(self.hysteresis) is int and self.hysteresis >= 1,
            f"hysteresis must be an int >= 1, got {self.hysteresis!r}",
        )
        # The scale lives in float32 (as GradScaler's tensor does): so do its bounds.
        object.__setattr__(self, "min_scale", _f32(self.min_scale))
        object.__setattr__(self, "max_scale", _f32(self.max_scale))
        check_config(
            0.0 <= self.min_scale <= _f32(self.initial_scale) <= self.max_scale,
            "need 0 <= min_scale <= initial_scale <= max_scale, got "
            f"{self.min_scale!r} <= {self.initial_scale!r} <= {self.max_scale!r}",
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ScalerState:
    """The loss scale and its trackers; advance it with :func:`update`.

    Attributes:
        config: the settings.
        scale: current scale (a float32 value).
        growth_tracker: finite steps since the last growth or overflow.
        hysteresis_tracker: overflows since the last growth.
    """

    config: ScalerConfig
    scale: float
    growth_tracker: int = 0
    hysteresis_tracker: int = 0

    def __post_init__(self) -> None:
        check_config(
            self.scale >= 0 and math.isfinite(self.scale),
            f"loss scale must be finite and >= 0, got {self.scale!r}",
        )
        check_config(
            0 <= self.growth_tracker < self.config.growth_interval,
            f"growth_tracker {self.growth_tracker} outside 0..{self.config.growth_interval - 1}",
        )
        check_config(
            self.hysteresis_tracker >= 0,
            f"hysteresis_tracker must be >= 0, got {self.hysteresis_tracker!r}",
        )

    def as_dict(self) -> dict[str, float | int]:
        """Plain numbers, for checkpoints."""
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }


def initial_state(config: ScalerConfig) -> ScalerState:
    """The state before the first step.

    Example:
        >>> initial_state(ScalerConfig(initial_scale=1024.0)).scale
        1024.0
    """
    return ScalerState(config=config, scale=_f32(config.initial_scale))


def update(state: ScalerState, found_inf: bool) -> ScalerState:
    """The state after a step that found (or did not find) inf/NaN gradients.

    The step itself must be skipped exactly when ``found_inf`` is true. See
    [Note: loss scale] for the algorithm.

    Example:
        >>> s = initial_state(ScalerConfig(initial_scale=8.0, growth_interval=2, hysteresis=2))
        >>> s = update(s, True); s.scale          # first overflow: hysteresis absorbs it
        8.0
        >>> s = update(s, True); s.scale          # second overflow: back off
        4.0
        >>> s = update(update(s, False), False); s.scale   # two clean steps: grow
        8.0
    """
    config = state.config
    if found_inf:
        scale = state.scale
        hysteresis = state.hysteresis_tracker + 1
        if hysteresis >= config.hysteresis:
            scale = max(_f32(scale * config.backoff_factor), config.min_scale)
        return replace(state, scale=scale, growth_tracker=0, hysteresis_tracker=hysteresis)
    growth = state.growth_tracker + 1
    if growth < config.growth_interval:
        return replace(state, growth_tracker=growth)
    scale = min(_f32(state.scale * config.growth_factor), config.max_scale)
    if not math.isfinite(scale):  # float32 overflow with no (finite) max_scale: keep the scale
        scale = state.scale
    return replace(state, scale=scale, growth_tracker=0, hysteresis_tracker=0)
