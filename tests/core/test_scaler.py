"""The loss scale as a pure transition: GradScaler agreement and InternLM hysteresis."""

from __future__ import annotations

import dataclasses
import math

import pytest

from zeroplan.core import ConfigError, ScalerConfig, ScalerState, initial_state, update

#: A fixed overflow pattern: isolated overflows, a burst, and long clean runs that grow the scale.
SEQUENCE = [i % 7 == 3 or i in (20, 21, 22) or i % 11 == 10 for i in range(80)]


def _torch_scales(config: ScalerConfig, sequence: list[bool]) -> list[float]:
    """Scale after each step of a real ``torch.amp.GradScaler`` fed ``sequence``."""
    torch = pytest.importorskip("torch")
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=config.initial_scale,
        growth_factor=config.growth_factor,
        backoff_factor=config.backoff_factor,
        growth_interval=config.growth_interval,
    )
    assert scaler.is_enabled()
    scales = []
    for overflow in sequence:
        scaler.scale(torch.ones(()))  # materialises the scale tensor
        param.grad = torch.full((3,), math.inf if overflow else 1.0)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def _our_scales(config: ScalerConfig, sequence: list[bool]) -> list[float]:
    state, scales = initial_state(config), []
    for overflow in sequence:
        state = update(state, overflow)
        scales.append(state.scale)
    return scales


@pytest.mark.parametrize(
    "config",
    [
        ScalerConfig(initial_scale=2.0**16, growth_interval=4),
        # Factors that are not powers of two exercise GradScaler's float32 rounding.
        ScalerConfig(initial_scale=1000.3, growth_factor=1.7, backoff_factor=0.3, growth_interval=3),
        ScalerConfig(initial_scale=3.0, growth_factor=1.1, backoff_factor=0.9, growth_interval=1),
    ],
)
def test_hysteresis_one_agrees_with_grad_scaler_step_for_step(config):
    ours, theirs = _our_scales(config, SEQUENCE), _torch_scales(config, SEQUENCE)
    assert ours == theirs
    assert len(set(ours)) > 5  # the sequence really moved the scale both ways


def test_growth_to_infinity_keeps_the_scale_like_grad_scaler():
    config = ScalerConfig(initial_scale=2.0**127, growth_interval=1)
    sequence = [False, False, True, False]
    assert (
        _our_scales(config, sequence)
        == _torch_scales(config, sequence)
        == [2.0**127, 2.0**127, 2.0**126, 2.0**127]
    )


def test_hysteresis_follows_internlm():
    config = ScalerConfig(initial_scale=1024.0, growth_interval=3, hysteresis=2)
    steps = [
        (True, 1024.0, 0, 1),  # the first overflow is absorbed
        (True, 512.0, 0, 2),  # the second backs off
        (True, 256.0, 0, 3),  # and every further one until the scale grows again
        (False, 256.0, 1, 3),
        (False, 256.0, 2, 3),
        (False, 512.0, 0, 0),  # growth resets the hysteresis tracker
        (True, 512.0, 0, 1),  # absorbed again
        (False, 512.0, 1, 1),
        (False, 512.0, 2, 1),
        (True, 256.0, 0, 2),  # second overflow since the last growth
    ]
    state = initial_state(config)
    for overflow, scale, growth, hysteresis in steps:
        state = update(state, overflow)
        assert (state.scale, state.growth_tracker, state.hysteresis_tracker) == (scale, growth, hysteresis)


def test_min_and_max_scale_clamp():
    config = ScalerConfig(initial_scale=4.0, min_scale=2.0, max_scale=8.0, growth_interval=1)
    assert _our_scales(config, [True, True, False, False, False]) == [2.0, 2.0, 4.0, 8.0, 8.0]


def test_update_returns_a_new_state_and_leaves_the_old_one():
    state = initial_state(ScalerConfig(initial_scale=8.0, growth_interval=2))
    after = update(state, True)
    assert (state.scale, after.scale) == (8.0, 4.0)
    assert after.config is state.config
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.scale = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.config.hysteresis = 3  # type: ignore[misc]
    assert after.as_dict() == {"scale": 4.0, "growth_tracker": 0, "hysteresis_tracker": 1}


def test_initial_scale_is_rounded_to_float32():
    assert initial_state(ScalerConfig(initial_scale=0.1)).scale == 0.10000000149011612


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"initial_scale": 0.0}, "initial_scale must be finite and > 0, got 0.0"),
        ({"initial_scale": -1.0}, "got -1.0"),
        ({"initial_scale": math.inf}, "got inf"),
        ({"initial_scale": math.nan}, "got nan"),
        ({"growth_factor": 1.0}, "growth_factor must be > 1, got 1.0"),
        ({"backoff_factor": 1.0}, "backoff_factor must be in (0, 1), got 1.0"),
        ({"backoff_factor": 0.0}, "got 0.0"),
        ({"growth_interval": 0}, "growth_interval must be an int >= 1, got 0"),
        ({"growth_interval": 2.0}, "got 2.0"),
        ({"hysteresis": 0}, "hysteresis must be an int >= 1, got 0"),
        ({"min_scale": -1.0}, "-1.0 <= 65536.0"),
        ({"max_scale": 10.0}, "65536.0 <= 10.0"),
    ],
)
def test_bad_config_is_a_config_error_naming_the_value(kwargs, needle):
    with pytest.raises(ConfigError) as info:
        ScalerConfig(**kwargs)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"scale": -1.0}, "got -1.0"),
        ({"scale": math.inf}, "got inf"),
        ({"scale": 1.0, "growth_tracker": 5}, "growth_tracker 5 outside 0..4"),
        ({"scale": 1.0, "growth_tracker": -1}, "growth_tracker -1 outside 0..4"),
        ({"scale": 1.0, "hysteresis_tracker": -1}, "hysteresis_tracker must be >= 0, got -1"),
    ],
)
def test_bad_state_is_a_config_error(kwargs, needle):
    with pytest.raises(ConfigError) as info:
        ScalerState(config=ScalerConfig(growth_interval=5), **kwargs)
    assert needle in str(info.value)
