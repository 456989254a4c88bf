"""The inner optimizer's step temporaries: measured (``MemTracker``) = ``step_temporary_bytes``.

One process, no ``torch.distributed``: each case builds a ``torch.optim`` optimizer on CPU tensors,
takes 2 warm-up steps (the state exists; RAdam takes 6, to be past its un-rectified first steps), registers
parameters, gradients and state with ``MemTracker`` (it counts every tensor an operator *returns*,
``param.add_()`` included, so unregistered inputs would count as allocations) and measures one
``step()``: the tracker's peak minus its total on entry. See [Note: step temporaries] in
``zeroplan.core.optim.temporaries``; ``benchmarks/optimizer_temporaries.py`` prints the whole table.

Exact for every case but two documented bounds:

* ASGD with its default ``t0`` (1e6): the model counts the averaging step after ``t0`` steps,
  ``param - ax``, which the measured early steps do not allocate (< one tensor more).
* Adafactor's for-loop on a group mixing matrices and vectors: what an earlier tensor of the other
  kind still holds is bounded by the largest such tensor (< its numel plus rows and columns more).

and Muon on bf16 parameters with ``ns_steps <= 1``, where torch skips the bf16 copy the model
counts (2 bytes per element more).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._foreach_utils import (
    _get_foreach_kernels_supported_devices,
    _get_fused_kernels_supported_devices,
)

from zeroplan.core import ConfigError, Implementation, Topology, describe_optimizer, known_optimizers
from zeroplan.core.optim.implementations import FOREACH_DEVICES, FUSED_DEVICES
from zeroplan.facade.diagnostics.meter import step_temporaries
from zeroplan.facade.runtime.inputs import collect_params
from zeroplan.facade.runtime.registry import ParamRegistry, PlanSettings

#: Hyper-parameter variants that change what a step allocates.
VARIANTS: dict[str, list[dict[str, Any]]] = {
    "SGD": [
        {},
        {"momentum": 0.9, "nesterov": True},
        {"weight_decay": 0.1},
        {"maximize": True},
        {"momentum": 0.9, "maximize": True},
        {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1, "maximize": True},
    ],
    "Adam": [
        {},
        {"weight_decay": 0.1},
        {"weight_decay": 0.1, "decoupled_weight_decay": True},
        {"amsgrad": True, "maximize": True},
    ],
    "AdamW": [{}, {"amsgrad": True}, {"maximize": True}],
    "RMSprop": [{}, {"momentum": 0.9, "centered": True}, {"weight_decay": 0.1, "maximize": True}],
    "Adagrad": [{}, {"weight_decay": 0.1}, {"maximize": True}],
    "Adamax": [{}, {"weight_decay": 0.1}, {"maximize": True}],
    "NAdam": [
        {},
        {"weight_decay": 0.1},
        {"weight_decay": 0.1, "decoupled_weight_decay": True},
        {"maximize": True},
    ],
    "RAdam": [{}, {"weight_decay": 0.1}, {"maximize": True}],
    "Adadelta": [{}, {"weight_decay": 0.1}, {"maximize": True}],
    "Rprop": [{}, {"maximize": True}],
    "ASGD": [{"t0": 0.0}, {"t0": 0.0, "weight_decay": 0.1}, {"t0": 0.0, "maximize": True}, {}],
    "Adafactor": [{}, {"maximize": True}, {"weight_decay": 0.1}],
    "Muon": [{}, {"nesterov": False}, {"ns_steps": 0}],
}

#: How torch is asked for each implementation (no flag: test_default_implementation_on_cpu_is_the_for_loop).
FLAGS = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}

SHAPES = [(64, 48), (33,), (128, 16), (7, 5)]
SHAPES_CHECK = [(17, 257), (100,), (31, 3), (40, 40), (5,)]
MATRICES = [(64, 48), (7, 5), (40, 40), (31, 3)]
VECTORS = [(100,), (2048,), (5,), (33,)]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is faster on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _accepts(cls: type[torch.optim.Optimizer], key: str) -> bool:
    return key in inspect.signature(cls).parameters


#: The ``torch.optim`` optimizers the planner knows (torchao's are measured in their own test).
TORCH_OPTIMIZERS = [name for name in known_optimizers() if not name.startswith("torchao.")]


def _cases() -> list[Any]:
    cases = []
    for name in TORCH_OPTIMIZERS:
        cls = getattr(torch.optim, name)
        for impl, flags in FLAGS.items():
            if not _accepts(cls, "foreach"):  # Muon: only the for-loop, asked for without a flag
                flags = {} if impl == "for_loop" else {"foreach": True}
            if any(not _accepts(cls, key) for key in flags):
                continue  # torch has no such implementation
            cases += [
                pytest.param(name, {**v, **flags}, id=f"{name}-{impl}-{_id(v)}") for v in VARIANTS[name]
            ]
    return cases


def _id(variant: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in variant.items()) or "plain"


def measure(
    cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    shapes: list[tuple[int, ...]],
    dtype: torch.dtype = torch.float32,
) -> int:
    """Bytes of temporaries of one ``step()`` (MemTracker's peak over what existed before)."""
    warmup = 6 if cls is torch.optim.RAdam else 2
    return step_temporaries(cls, kwargs, shapes, dtype=dtype, warmup=warmup)


def _slack(name: str, kwargs: dict[str, Any], shapes: list[tuple[int, ...]], itemsize: int) -> int:
    """How much the model may exceed the measurement (0: exact), per the module docstring."""
    numels = [math.prod(s) for s in shapes]
    if name == "ASGD" and "t0" not in kwargs and not kwargs.get("foreach"):
        return max(numels) * itemsize
    kinds = {len(s) >= 2 for s in shapes}
    if name == "Adafactor" and not kwargs.get("foreach") and len(kinds) == 2:
        vector = max(n for s, n in zip(shapes, numels, strict=True) if len(s) < 2)
        rows = max(math.prod(s[:-1]) for s in shapes if len(s) >= 2)
        cols = max(math.prod(s[:-2]) * s[-1] for s in shapes if len(s) >= 2)
        return (vector + rows + cols) * itemsize
    if name == "Muon" and itemsize == 2 and kwargs.get("ns_steps", 5) <= 1:
        return 2 * max(numels)
    return 0


def _check(name: str, kwargs: dict[str, Any], shapes: list[tuple[int, ...]], dtype: torch.dtype) -> None:
    itemsize = torch.empty((), dtype=dtype).element_size()
    measured = measure(getattr(torch.optim, name), kwargs, shapes, dtype)
    spec = describe_optimizer(name, kwargs, device="cpu")
    modelled = spec.step_temporary_bytes_of_shapes(shapes, itemsize)
    if spec.elementwise:  # the flat windows the facade steps: numels are all that matters
        assert spec.step_temporary_bytes([math.prod(s) for s in shapes], itemsize) == modelled
    slack = _slack(name, kwargs, shapes, itemsize)
    where = f"{name} {kwargs} {shapes} {dtype}: measured {measured}, modelled {modelled}"
    if slack:
        assert measured <= modelled <= measured + slack, where
    else:
        assert modelled == measured, where


@pytest.mark.parametrize(("name", "kwargs"), _cases())
def test_measured_temporaries_equal_the_model(name, kwargs):
    sets = [SHAPES, SHAPES_CHECK]
    if name == "Muon":
        sets = [[s for s in shapes if len(s) == 2] for shapes in sets]
    if name == "Adafactor":
        sets += [MATRICES, VECTORS]  # exact for one kind; the mixed sets are bounded
    for shapes in sets:
        _check(name, kwargs, shapes, torch.float32)
    shapes = sets[0]
    _check(name, kwargs, shapes, torch.float64)  # itemsize 8
    _check(name, kwargs, shapes, torch.bfloat16)  # itemsize 2 (bool masks and fp32 scalars do not scale)


def test_default_implementation_on_cpu_is_the_for_loop():
    for name in ("SGD", "Adam"):
        cls = getattr(torch.optim, name)
        variant = {"weight_decay": 0.1, "maximize": True}
        spec = describe_optimizer(name, variant, device="cpu")
        assert spec.implementation is Implementation.FOR_LOOP
        measured = measure(cls, variant, SHAPES)
        assert measured == measure(cls, {**variant, "foreach": False}, SHAPES)
        assert measured == spec.step_temporary_bytes([math.prod(s) for s in SHAPES], 4)
        assert measured != measure(cls, {**variant, "foreach": True}, SHAPES)


def test_resolution_tables_match_torch():
    extra = torch._C._get_privateuse1_backend_name()
    assert set(_get_fused_kernels_supported_devices()) - {extra} == FUSED_DEVICES
    assert set(_get_foreach_kernels_supported_devices()) - {extra} == FOREACH_DEVICES
    classes = {name: getattr(torch.optim, name) for name in TORCH_OPTIMIZERS}
    assert {n for n, c in classes.items() if _accepts(c, "fused")} == {"Adam", "AdamW", "SGD", "Adagrad"}
    assert {n for n, c in classes.items() if not _accepts(c, "foreach")} == {"Muon"}


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("SGD", {"foreach": True, "fused": True}),
        ("Adagrad", {"foreach": True, "fused": True}),
        ("AdamW", {"fused": True, "differentiable": True}),
        ("RMSprop", {"fused": True}),
        ("Muon", {"foreach": True}),
        ("Adam", {"foreach": True, "differentiable": True}),
    ],
)
def test_combinations_refused_by_torch_are_refused_by_the_planner(name, kwargs):
    param = torch.zeros(4, 4, requires_grad=True)
    with pytest.raises((RuntimeError, TypeError, AssertionError)):
        opt = getattr(torch.optim, name)([param], **kwargs)
        param.grad = torch.ones(4, 4)
        opt.step()
    with pytest.raises(ConfigError):
        describe_optimizer(name, kwargs, device="cpu")


def test_the_facade_plans_with_the_parameters_device():
    inputs = collect_params([torch.nn.Parameter(torch.zeros(8, 4)), torch.nn.Parameter(torch.zeros(3))])
    settings = PlanSettings(
        topology=Topology(world_size=1),
        optimizer_class=torch.optim.AdamW,
        stage=1,
        strategy="auto",
        alignment=1,
        bucket_bytes=1 << 20,
        loss_scaling=False,
        max_inflight_buckets=1,
        policy="min_bytes",
    )
    groups = [{**group, "lr": 1e-3} for group in inputs.groups]
    zp = settings.plan(ParamRegistry.of(inputs), groups)
    assert [o.implementation for o in zp.optimizers] == [Implementation.FOR_LOOP]  # CPU, not CUDA's foreach
    assert zp.optimizers[0] == describe_optimizer("AdamW", groups[0], device="cpu")


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_torchao_low_bit_temporaries_equal_the_model_run_eagerly(name):
    """torchao compiles its step, inside which MemTracker (a dispatch mode) cannot run; eagerly
    (``set_stance("force_eager")``) the step allocates exactly the model, which bounds the fused,
    compiled step (see ``LOW_BIT_TEMPORARIES``). Quantized and plain moments both."""
    optim = pytest.importorskip("torchao.optim")
    shapes = [(64, 256), (100,), (128, 64), (33, 7)]
    spec = describe_optimizer(f"torchao.{name}", device="cpu")
    with torch.compiler.set_stance("force_eager"):
        measured = step_temporaries(getattr(optim, name), {"lr": 1e-2}, shapes)
    assert measured == spec.step_temporary_bytes_of_shapes(shapes, 4), measured
