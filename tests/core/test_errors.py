"""The error hierarchy: one base type, config vs invariant vs incompatibility."""

from __future__ import annotations

import pytest

from zeroplan.core import (
    ConfigError,
    IncompatiblePlanError,
    PlanInvariantError,
    ZeroplanError,
)
from zeroplan.core.errors import check_config, require


@pytest.mark.parametrize("error", [ConfigError, PlanInvariantError, IncompatiblePlanError])
def test_every_error_is_a_zeroplan_error_and_a_value_error(error):
    assert issubclass(error, ZeroplanError)
    assert issubclass(error, ValueError)


def test_the_three_kinds_are_distinct():
    assert not issubclass(ConfigError, PlanInvariantError)
    assert not issubclass(PlanInvariantError, ConfigError)
    assert not issubclass(IncompatiblePlanError, ConfigError)
    assert not issubclass(IncompatiblePlanError, PlanInvariantError)


def test_require_raises_plan_invariant_error_with_the_message():
    require(True, "never shown")
    with pytest.raises(PlanInvariantError, match=r"^fragment 7 overlaps$"):
        require(False, "fragment 7 overlaps")


def test_check_config_raises_config_error_with_the_message():
    check_config(True, "never shown")
    with pytest.raises(ConfigError, match=r"^world size -3 is negative$"):
        check_config(False, "world size -3 is negative")


def test_require_is_not_an_assert():
    # Validation must survive `python -O`; `require` is a plain function call.
    with pytest.raises(PlanInvariantError):
        require(0, "zero is falsy")
