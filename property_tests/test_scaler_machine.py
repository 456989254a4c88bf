"""The pure loss-scale transition against ``torch.amp.GradScaler`` and InternLM's hysteresis.

* :class:`GradScalerParity` drives a real ``torch.amp.GradScaler("cpu")`` through its public
  flow (``scale(loss).backward()``, ``step``, ``update``) on a one-element parameter, injecting
  inf / NaN gradients on overflow steps, and compares ``get_scale()`` and the growth tracker with
  ``zeroplan.core.update`` after every step (hysteresis 1, default min / max scale).
* :class:`HysteresisModel` compares ``update`` with hysteresis > 1 against a small independent
  model of InternLM's ``DynamicGradScaler.update`` (see [Note: loss scale]).
"""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from property_tests.strategies import budget, scaler_configs
from zeroplan.core import initial_state, update

# Below this scale 1 / scale overflows float32 in GradScaler's unscale (and a clean step would
# "overflow"); overflow steps are only taken while the backed-off scale stays above it.
_SMALLEST = 2.0**-100


class GradScalerParity(RuleBasedStateMachine):
    @initialize(config=scaler_configs())
    def start(self, config):
        self.config = config
        self.state = initial_state(config)
        self.steps = 0
        self.param = torch.zeros(1, requires_grad=True)
        self.optimizer = torch.optim.SGD([self.param], lr=1.0)
        self.scaler = torch.amp.GradScaler(
            "cpu",
            init_scale=config.initial_scale,
            growth_factor=config.growth_factor,
            backoff_factor=config.backoff_factor,
            growth_interval=config.growth_interval,
        )

    def _step(self, bad_value):
        self.optimizer.zero_grad()
        self.scaler.scale((self.param * 1.0).sum()).backward()
        if bad_value is not None:
            self.param.grad.fill_(bad_value)
        before = self.param.detach().clone()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        stepped = not torch.equal(before, self.param.detach())
        assert stepped == (bad_value is None), "GradScaler skipped a clean step or took an overflowing one"
        self.state = update(self.state, found_inf=bad_value is not None)
        self.steps += 1

    @rule()
    def clean_step(self):
        self._step(None)

    @precondition(lambda self: self.state.scale * self.config.backoff_factor > _SMALLEST)
    @rule(bad_value=st.sampled_from([math.inf, -math.inf, math.nan]))
    def overflow_step(self, bad_value):
        self._step(bad_value)

    @invariant()
    def same_scale(self):
        # Before its first step GradScaler reports the unrounded ``init_scale`` (its float32
        # scale tensor is created lazily), so the comparison starts after the first step.
        if getattr(self, "steps", 0) == 0:
            return
        assert self.scaler.get_scale() == self.state.scale, (self.scaler.get_scale(), self.state)
        assert self.scaler.state_dict()["_growth_tracker"] == self.state.growth_tracker


TestGradScalerParity = GradScalerParity.TestCase
TestGradScalerParity.settings = budget(2.0)


def _f32(value):
    """float32 rounding (overflow to inf), done with torch rather than zeroplan's helper."""
    return torch.tensor(value, dtype=torch.float64).to(torch.float32).item()


class InternLMScaler:
    """InternLM's ``DynamicGradScaler.update``, scale kept as a float32 value.

    Rounding follows [Note: loss scale] (the exact product rounded to float32, as GradScaler
    does) and, as GradScaler, a growth that would overflow float32 is not taken.
    """

    def __init__(self, config):
        self.config = config
        self.scale = _f32(config.initial_scale)
        self.growth_step = 0
        self.hysteresis_step = 0

    def update(self, overflow):
        c = self.config
        if overflow:
            self.hysteresis_step += 1
            self.growth_step = 0
            if self.hysteresis_step >= c.hysteresis:
                self.scale = max(_f32(self.scale * c.backoff_factor), c.min_scale)
        else:
            self.growth_step += 1
            if self.growth_step == c.growth_interval:
                self.growth_step = 0
                self.hysteresis_step = 0
                grown = _f32(self.scale * c.growth_factor)
                if not math.isinf(grown):
                    self.scale = min(grown, c.max_scale)


class HysteresisModel(RuleBasedStateMachine):
    @initialize(config=scaler_configs(hysteresis=st.integers(2, 5), bounds=True))
    def start(self, config):
        self.model = InternLMScaler(config)
        self.state = initial_state(config)

    @rule(overflow=st.booleans())
    def step(self, overflow):
        self.model.update(overflow)
        self.state = update(self.state, found_inf=overflow)

    @rule(count=st.integers(2, 6))
    def overflow_burst(self, count):
        for _ in range(count):
            self.step(True)

    @invariant()
    def agrees(self):
        if not hasattr(self, "state"):
            return
        model, state = self.model, self.state
        assert (state.scale, state.growth_tracker, state.hysteresis_tracker) == (
            model.scale,
            model.growth_step,
            model.hysteresis_step,
        ), (state, vars(model))
        assert state.config.min_scale <= state.scale <= state.config.max_scale


TestHysteresisModel = HysteresisModel.TestCase
TestHysteresisModel.settings = budget(2.0)
