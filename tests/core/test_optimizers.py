"""``OptimizerSpec``: state per stepped tensor and elementwise-ness."""

from __future__ import annotations

import dataclasses

import pytest

from zeroplan.core import (
    ConfigError,
    ConfigTypeError,
    Implementation,
    OptimizerSpec,
    StepTemporaries,
    Topology,
    describe_optimizer,
    known_optimizers,
    plan,
    resolve_implementation,
    specs_from_shapes,
)
from zeroplan.core.optim.step_tables import UNKNOWN_TEMPORARIES, step_temporaries
from zeroplan.core.optim.temporaries import Cost, Feature, Kind, Moment, Role, Term, Unit


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
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.implementation = Implementation.FUSED  # type: ignore[misc]
    assert spec == OptimizerSpec(
        name="AdamW",
        elementwise=True,
        per_element=2,
        scalars=1,
        implementation=Implementation.FOREACH,
        temporaries=step_temporaries("AdamW", Implementation.FOREACH),
    )


# --- implementations (torch 2.13's _default_to_fused_or_foreach and functional APIs) ---------------

TORCH_OPTIMIZERS = [name for name in known_optimizers() if not name.startswith("torchao.")]


@pytest.mark.parametrize("name", TORCH_OPTIMIZERS)
def test_default_implementation_per_device(name):
    assert describe_optimizer(name, device="cpu").implementation is Implementation.FOR_LOOP
    on_cuda = Implementation.FOR_LOOP if name == "Muon" else Implementation.FOREACH  # Muon has no foreach
    assert describe_optimizer(name, device="cuda").implementation is on_cuda
    assert describe_optimizer(name).implementation is on_cuda  # the default device is "cuda"
    assert describe_optimizer(name, device="cuda:1").implementation is on_cuda
    assert describe_optimizer(name, device="meta").implementation is Implementation.FOR_LOOP


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_explicit_implementations(device):
    foreach, fused, loop = Implementation.FOREACH, Implementation.FUSED, Implementation.FOR_LOOP
    for name in ("Adam", "AdamW", "SGD", "Adagrad"):
        assert describe_optimizer(name, device=device, fused=True).implementation is fused
        assert describe_optimizer(name, device=device, foreach=True, fused=False).implementation is foreach
        assert describe_optimizer(name, device=device, fused=False).implementation is loop
    for name in ("RMSprop", "NAdam", "Adafactor"):
        assert describe_optimizer(name, device=device, foreach=True).implementation is foreach
        assert describe_optimizer(name, device=device, foreach=False).implementation is loop
    # Optimizers without fused kernels ignore a `fused=False` key in a param group, as torch does.
    expected = foreach if device == "cuda" else loop
    assert describe_optimizer("RMSprop", {"fused": False}, device=device).implementation is expected
    assert describe_optimizer("Muon", {"foreach": False}, device=device).implementation is loop


def test_defaults_that_keep_the_for_loop_on_cuda():
    loop, foreach = Implementation.FOR_LOOP, Implementation.FOREACH
    assert resolve_implementation("Adam", {"differentiable": True}) is loop
    assert resolve_implementation("SGD", {"differentiable": True}) is foreach  # SGD ignores it here
    tensor_lr = object()  # stands for a torch.Tensor lr
    assert resolve_implementation("AdamW", {"lr": tensor_lr}) is loop
    assert resolve_implementation("AdamW", {"lr": tensor_lr, "capturable": True}) is foreach
    assert resolve_implementation("RMSprop", {"lr": tensor_lr}) is foreach
    assert resolve_implementation("Adam", {"lr": 1e-3, "foreach": None, "fused": None}) is foreach


@pytest.mark.parametrize(
    ("name", "settings", "device", "message"),
    [
        ("SGD", {"foreach": True, "fused": True}, "cuda", "cannot be True together"),
        ("AdamW", {"foreach": True, "fused": True}, "cpu", "cannot be True together"),
        ("RMSprop", {"fused": True}, "cuda", "has no fused implementation"),
        ("Muon", {"fused": True}, "cuda", "has no fused implementation"),
        ("Adam", {"fused": True, "differentiable": True}, "cuda", "does not support `differentiable`"),
        ("Adam", {"fused": True}, "meta", "fused=True needs parameters on"),
        ("Muon", {"foreach": True}, "cuda", "has no foreach implementation"),
        ("Adam", {"foreach": True, "differentiable": True}, "cpu", "does not support differentiable"),
    ],
)
def test_combinations_torch_refuses(name, settings, device, message):
    with pytest.raises(ConfigError) as info:
        describe_optimizer(name, settings, device=device)
    assert message in str(info.value) and name in str(info.value)


def test_bad_flag_and_device_types():
    with pytest.raises(ConfigTypeError, match="foreach must be True, False or None"):
        resolve_implementation("Adam", {"foreach": "yes"})
    with pytest.raises(ConfigTypeError, match="fused must be True, False or None"):
        describe_optimizer("Adam", fused=1)
    for device in (3, "", ":0"):
        with pytest.raises(ConfigTypeError, match="device must be a device type"):
            describe_optimizer("Adam", device=device)  # type: ignore[arg-type]


def test_unknown_optimizers_get_a_guessed_implementation_and_conservative_temporaries():
    lion = describe_optimizer("Lion", {"foreach": "auto", "fused": 1}, strict=False, device="cuda")
    assert (lion.known, lion.implementation, lion.temporaries) == (
        False,
        Implementation.FOREACH,
        UNKNOWN_TEMPORARIES,
    )
    both = describe_optimizer("Lion", {"foreach": True, "fused": True}, strict=False, device="cpu")
    assert both.implementation is Implementation.FOR_LOOP
    assert describe_optimizer("Lion", strict=False, fused=True).implementation is Implementation.FUSED


# --- temporaries -------------------------------------------------------------------------------------


def test_foreach_for_loop_and_fused_temporaries():
    numels = [3072, 33, 2048, 35]  # (64, 48), (33,), (128, 16), (7, 5)
    foreach = describe_optimizer("AdamW", device="cuda")
    assert foreach.step_temporary_bytes(numels, 4) == sum(numels) * 4  # _foreach_sqrt(exp_avg_sqs)
    assert foreach.step_temporary_bytes(numels, 2) == sum(numels) * 2
    loop = describe_optimizer("AdamW", device="cpu")
    assert loop.step_temporary_bytes(numels, 4) == 2 * 3072 * 4  # sqrt + denom of the largest
    assert loop.step_temporary_bytes([2048, 3072, 33], 4) == (2048 + 2 * 3072) * 4  # + the held denom
    assert describe_optimizer("AdamW", fused=True).step_temporary_bytes(numels, 4) == 0
    assert loop.step_temporary_bytes([], 4) == 0
    # maximize adds -grad (and the foreach step counter's fp32 1.0 while it exists).
    assert describe_optimizer("Adam", maximize=True).step_temporary_bytes(numels, 8) == sum(numels) * 8 + 4


@pytest.mark.parametrize(
    ("name", "hyper", "device", "each", "held"),
    [
        ("SGD", {}, "cpu", 0, 0),
        ("SGD", {"momentum": 0.9, "nesterov": True}, "cpu", 1, 0),
        ("SGD", {"weight_decay": 0.1, "maximize": True}, "cpu", 2, 0),
        ("Adam", {"weight_decay": 0.1}, "cpu", 3, 1),
        ("Adam", {"weight_decay": 0.1, "decoupled_weight_decay": True}, "cpu", 2, 1),
        ("AdamW", {"weight_decay": 0.1}, "cpu", 2, 1),  # decoupled: param.mul_ in place
        ("RMSprop", {"centered": True, "momentum": 0.9}, "cpu", 1, 1),
        ("RAdam", {}, "cpu", 5, 0),
        ("Adadelta", {"maximize": True}, "cpu", 3, 1),
    ],
)
def test_for_loop_coefficients(name, hyper, device, each, held):
    spec = describe_optimizer(name, device=device, **hyper)
    big, small = 1000, 10
    assert spec.step_temporary_bytes([big], 4) == each * big * 4
    assert (
        spec.step_temporary_bytes([small, big], 4) - spec.step_temporary_bytes([big], 4) == held * small * 4
    )


def test_adadelta_for_loop_has_two_moments():
    spec = describe_optimizer("Adadelta", device="cpu")  # std and delta held, then rebound one by one
    assert spec.step_temporary_bytes([1000, 100], 4) == (2 * 1000 + 100) * 4
    assert spec.step_temporary_bytes([100, 1000], 4) == (100 + 2 * 1000) * 4


@pytest.mark.parametrize(
    ("name", "hyper", "per_element"),
    [
        ("SGD", {}, 0),
        ("SGD", {"weight_decay": 0.1}, 1),
        ("Adagrad", {}, 2),
        ("NAdam", {"weight_decay": 0.1}, 2),
    ],
)
def test_foreach_coefficients(name, hyper, per_element):
    spec = describe_optimizer(name, device="cuda", **hyper)
    assert spec.implementation is Implementation.FOREACH
    assert spec.step_temporary_bytes([1000, 30, 700], 4) == per_element * 1730 * 4


def test_shaped_temporaries():
    muon = describe_optimizer("Muon", device="cuda")  # for-loop only: nesterov update + bf16 iterates + Gram
    assert muon.step_temporary_bytes_of_shapes([(20, 100), (64, 64)], 4) == max(
        20 * 100 * (4 + 4) + 4 * 20 * 20, 64 * 64 * (4 + 4) + 4 * 64 * 64
    )
    assert muon.step_temporary_bytes([2000], 4) >= muon.step_temporary_bytes_of_shapes([(20, 100)], 4)
    adafactor = describe_optimizer("Adafactor", device="cpu")
    # var_estimate, row and column statistics, the (1, 1) mean; a vector: grad**2, a copy, a norm.
    assert adafactor.step_temporary_bytes_of_shapes([(10, 100)], 4) == (1000 + 10 + 100 + 1) * 4
    assert adafactor.step_temporary_bytes_of_shapes([(1000,)], 4) == (2 * 1000 + 1) * 4
    assert adafactor.step_temporary_bytes([1000], 4) == (2 * 1000 + 1) * 4  # flat tensors are vectors
    foreach = describe_optimizer("Adafactor", device="cuda")
    assert foreach.temporaries.unit is Unit.KIND  # matrices and vectors are two lists


def test_unknown_temporaries_bound_every_known_optimizer():
    shapes = [(64, 48), (33,), (128, 16), (7, 5), (1,), (3, 1, 2)]
    bound = describe_optimizer("Lion", strict=False).step_temporary_bytes_of_shapes(shapes, 2)
    for name in known_optimizers():
        for implementation in Implementation:
            for flags in ({}, {"maximize": True, "decay": True, "momentum": True, "nesterov": True}):
                if name == "Muon" and implementation is Implementation.FOREACH:
                    continue
                temporaries = step_temporaries(name, implementation, **flags)
                assert temporaries.bytes(shapes, 2) <= bound, (name, implementation, flags)
    # A spec built by hand without temporaries is planned conservatively.
    manual = OptimizerSpec(name="AdamW", elementwise=True, per_element=2, scalars=1)
    assert manual.temporaries == UNKNOWN_TEMPORARIES
    assert manual.step_temporary_bytes([10], 4) == bound_of([10], 4)


def bound_of(numels, itemsize):
    return UNKNOWN_TEMPORARIES.bytes([(n,) for n in numels], itemsize)


def test_temporaries_validation():
    spec = describe_optimizer("AdamW")
    for numels in ([1.5], [-1], [True]):
        with pytest.raises(ConfigError, match="numels must be ints >= 0"):
            spec.step_temporary_bytes(numels, 4)
    for itemsize in (0, 2.0, None):
        with pytest.raises(ConfigError, match="itemsize must be an int >= 1"):
            spec.step_temporary_bytes([1], itemsize)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="shapes must be tuples of ints >= 0"):
        spec.step_temporary_bytes_of_shapes([(2, -1)], 4)
    with pytest.raises(ConfigError, match="Cost needs ints >= 0"):
        Cost(-1)
    with pytest.raises(ConfigError, match="Cost needs ints >= 0"):
        Cost(0, True)
    with pytest.raises(ConfigError, match="Term needs a Role"):
        Term("each", Feature.NUMEL, Cost(1))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"Term\.cost must be a Cost"):
        Term(Role.EACH, Feature.NUMEL, 4)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"Moment\.terms must be a tuple of Term"):
        Moment(terms=[Term(Role.EACH, Feature.NUMEL, Cost(1))])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"Moment\.at and \.after must be Kinds"):
        Moment(at="matrix")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"StepTemporaries\.unit must be a Unit"):
        StepTemporaries(unit="tensor")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"StepTemporaries\.moments must be a tuple of Moment"):
        StepTemporaries(unit=Unit.TENSOR, moments=(Cost(),))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"OptimizerSpec\.implementation must be an Implementation"):
        OptimizerSpec(name="X", elementwise=True, per_element=0, implementation="foreach")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"OptimizerSpec\.temporaries must be a StepTemporaries"):
        OptimizerSpec(name="X", elementwise=True, per_element=0, temporaries=None)  # type: ignore[arg-type]


def test_moment_conditions_on_kinds():
    matrix_after_vector = Moment(
        terms=(Term(Role.PREVIOUS, Feature.NUMEL, Cost(1)),), at=Kind.MATRIX, after=Kind.VECTOR
    )
    temporaries = StepTemporaries(unit=Unit.TENSOR, moments=(matrix_after_vector,))
    assert temporaries.bytes([(7,), (2, 2)], 1) == 7
    assert temporaries.bytes([(2, 2), (7,)], 1) == 0
    assert temporaries.bytes([(3, 3), (2, 2)], 1) == 0


def test_fingerprint_ignores_implementation_and_temporaries():
    specs = specs_from_shapes([(17, 257), (33,)])
    fingerprints = {
        plan(
            specs, Topology(world_size=2), optimizer=describe_optimizer("AdamW", device=device, **hyper)
        ).fingerprint()
        for device in ("cpu", "cuda")
        for hyper in ({}, {"fused": True}, {"maximize": True})
    }
    assert len(fingerprints) == 1
