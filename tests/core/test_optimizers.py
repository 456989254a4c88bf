"""``OptimizerSpec``: state per stepped tensor and elementwise-ness."""

from __future__ import annotations

import dataclasses

import pytest

from zeroplan.core import ConfigError, OptimizerSpec, describe_optimizer, known_optimizers


@pytest.mark.parametrize(
    ("name", "hyper", "per_element", "scalars", "elementwise"),
    [
        ("SGD", {}, 0, 0, True),
        ("sgd", {"momentum": 0.9}, 1, 0, True),
        ("Adam", {}, 2, 1, True),
        ("adamw", {}, 2, 1, True),
        ("AdamW", {"amsgrad": True}, 3, 1, True),
        ("RMSprop", {}, 1, 1, True),
        ("RMSprop", {"momentum": 0.9, "centered": True}, 3, 1, True),
        ("Adagrad", {}, 1, 1, True),
        ("NAdam", {}, 2, 2, True),
        ("ASGD", {}, 1, 3, True),
        ("Adafactor", {}, 0, 1, False),
        ("Muon", {}, 1, 0, False),
    ],
)
def test_table(name, hyper, per_element, scalars, elementwise):
    spec = describe_optimizer(name, **hyper)
    assert (spec.per_element, spec.scalars, spec.elementwise, spec.known) == (
        per_element,
        scalars,
        elementwise,
        True,
    )


def test_canonical_names_and_ignored_hyper_parameters():
    assert describe_optimizer("ADAMW", lr=1e-3, weight_decay=0.1).name == "AdamW"
    assert set(known_optimizers()) >= {"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adafactor", "Muon"}


def test_state_bytes():
    adamw = describe_optimizer("AdamW")
    assert adamw.state_bytes((17, 257), 4) == 2 * 4369 * 4 + 4  # exp_avg, exp_avg_sq, step
    assert adamw.state_bytes((0,), 4) == 4  # the step scalar even for an empty tensor
    assert describe_optimizer("SGD").state_bytes((17, 257), 4) == 0
    assert describe_optimizer("SGD", momentum=0.9).state_bytes((17, 257), 8) == 4369 * 8


def test_factored_state_is_row_plus_column():
    adafactor = describe_optimizer("Adafactor")
    assert adafactor.factored
    assert adafactor.state_bytes((17, 257), 4) == (17 + 257) * 4 + 4
    assert adafactor.state_bytes((3, 17, 257), 4) == (3 * 17 + 3 * 257) * 4 + 4
    assert adafactor.state_bytes((257,), 4) == 257 * 4 + 4


def test_unknown_optimizer():
    with pytest.raises(ConfigError) as info:
        describe_optimizer("Lion")
    assert "'Lion'" in str(info.value) and "AdamW" in str(info.value)
    spec = describe_optimizer("Lion", strict=False)
    assert (spec.name, spec.elementwise, spec.known, spec.per_element) == ("Lion", False, False, 0)


def test_optimizer_spec_is_frozen():
    spec = describe_optimizer("AdamW")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.per_element = 3  # type: ignore[misc]
    assert spec == OptimizerSpec(name="AdamW", elementwise=True, per_element=2, scalars=1)
