"""Shared Hypothesis strategies: valid planner inputs built by construction (no ``.filter``).

* :func:`shapes` — parameter shapes: scalars, one-element and zero-size parameters, odd sizes;
* :func:`param_specs` — ``ParamSpec`` lists with several dtype spaces, frozen parameters and
  param groups (group indices non-decreasing by construction); occasionally thousands of
  tiny parameters (derived from a drawn seed so they stay cheap to generate);
* :func:`topologies` — world sizes built as ``shard x replica`` so the shard size always divides;
* :data:`alignments`, :data:`bucket_caps`, :data:`seeds`;
* :func:`optimizer_setups` — a ``torch.optim`` class name with per-group hyper-parameters;
* :func:`scaler_configs` — loss-scaler settings, including non-power-of-two factors.

Randomness inside tests comes only from :data:`seeds` drawn here (``torch.Generator`` /
``random.Random`` seeded with them), so every failure replays from its Hypothesis example.
"""

from __future__ import annotations

import random

import torch
from hypothesis import event, settings
from hypothesis import strategies as st

from zeroplan.core import DEFAULT_BUCKET_BYTES, ParamSpec, ScalerConfig, Topology

__all__ = [
    "DTYPES",
    "alignments",
    "bucket_caps",
    "budget",
    "many_specs",
    "param_specs",
    "scaler_configs",
    "seeds",
    "shapes",
    "small_shapes",
    "topologies",
]

DTYPES = ("float32", "bfloat16", "float16")

seeds = st.integers(0, 2**32 - 1)

#: Alignments in elements: 1 (none), odd (3), powers of two and the default 128.
alignments = st.sampled_from([1, 2, 3, 4, 8, 16, 128])

#: Bucket caps in bytes: below one element, a few elements, a few KiB and the DDP default.
bucket_caps = st.one_of(
    st.integers(1, 64),
    st.integers(65, 4096),
    st.just(DEFAULT_BUCKET_BYTES),
)


def budget(fraction: float) -> settings:
    """Settings that run ``fraction`` of the active profile's examples (for expensive tests)."""
    return settings(max_examples=max(5, round(settings.default.max_examples * fraction)))


def shapes(max_dim: int = 9, max_len: int = 300) -> st.SearchStrategy[tuple[int, ...]]:
    """Parameter shapes: scalars, vectors up to ``max_len``, small 2-D and 3-D tensors, zero dims."""
    dim = st.integers(0, max_dim)
    return st.one_of(
        st.just(()),
        st.sampled_from([(1,), (1, 1), (0,), (3, 0), (2, 0, 5), (17, 13), (7,), (129,)]),
        st.tuples(st.integers(0, max_len)),
        st.tuples(dim, dim),
        st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 5)),
    )


def small_shapes() -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes of at most 81 elements, mostly non-empty (for tests that run real optimizers)."""
    positive = st.integers(1, 9)
    return st.one_of(
        st.just(()),
        st.sampled_from([(1,), (1, 1), (0,), (3, 0), (17, 3), (7,)]),
        st.tuples(st.integers(1, 60)),
        st.tuples(positive, positive),
        st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5)),
    )


def many_specs(
    count: int, seed: int, space_dtypes: tuple[str, ...] = DTYPES, frozen: bool = True
) -> tuple[ParamSpec, ...]:
    """``count`` tiny parameters derived from ``seed`` (cheap: no per-parameter draws)."""
    rng = random.Random(seed)
    specs = []
    group = 0
    for index in range(count):
        if rng.random() < 0.002:
            group += 1
        numel = rng.choice((0, 1, 1, 2, 3, 4, 5, 8, 13))
        shape = () if numel == 1 and rng.random() < 0.3 else (numel,)
        specs.append(
            ParamSpec(
                index=index,
                name=f"p{index}",
                shape=shape,
                dtype=rng.choice(space_dtypes),
                group=group,
                trainable=not frozen or rng.random() < 0.9,
            )
        )
    return tuple(specs)


@st.composite
def param_specs(
    draw,
    *,
    shape: st.SearchStrategy[tuple[int, ...]] | None = None,
    min_size: int = 0,
    max_size: int = 8,
    dtypes: tuple[str, ...] = DTYPES,
    frozen: bool = True,
    groups: bool = True,
    many: bool = True,
    cohorts: bool = False,
) -> tuple[ParamSpec, ...]:
    """A valid parameter list (indices ``0..n-1``, groups non-decreasing).

    Args:
        shape: strategy for each parameter's shape (default :func:`shapes`).
        min_size: fewest parameters.
        max_size: most parameters (except in the occasional "thousands" case).
        dtypes: dtype names to draw the spaces from.
        frozen: whether some parameters may be frozen.
        groups: whether several param groups may appear.
        many: whether to occasionally return 1,000-3,000 tiny parameters.
        cohorts: whether to draw ``cohort`` (0 or 1) for each parameter.
    """
    space_dtypes = draw(st.lists(st.sampled_from(dtypes), min_size=1, max_size=len(dtypes), unique=True))
    if many and draw(st.integers(0, 11)) == 5:  # about one example in 12 (5 is no boundary value)
        event("thousands of parameters")
        return many_specs(draw(st.integers(1000, 3000)), draw(seeds), space_dtypes, frozen)
    rows = draw(
        st.lists(
            st.tuples(
                shape if shape is not None else shapes(),
                st.sampled_from(space_dtypes),
                st.sampled_from([True, True, True, False]) if frozen else st.just(True),
                st.sampled_from([False, False, False, True]) if groups else st.just(False),
                st.integers(0, 1) if cohorts else st.just(0),
            ),
            min_size=min_size,
            max_size=max_size,
        )
    )
    specs = []
    group = 0
    for index, (dims, dtype, trainable, new_group, cohort) in enumerate(rows):
        group += int(new_group and index > 0)
        specs.append(
            ParamSpec(
                index=index,
                name=f"p{index}",
                shape=dims,
                dtype=dtype,
                group=group,
                trainable=trainable,
                cohort=cohort,
            )
        )
    return tuple(specs)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def topologies(draw, *, max_shard: int = 8, max_replica: int = 3) -> Topology:
    """``world = shard x replica``, so the shard size divides the world by construction."""
    shard = draw(st.integers(1, max_shard))
    replica = draw(st.integers(1, max_replica))
    world = shard * replica
    per_node = draw(st.one_of(st.none(), st.sampled_from(_divisors(world))))
    return Topology(world_size=world, shard_size=shard, ranks_per_node=per_node)


# ----------------------------------------------------------------- optimizers
_lr = st.one_of(st.sampled_from([1e-3, 0.01, 0.1]), st.floats(1e-4, 0.5))
_decay = st.one_of(st.just(0.0), st.sampled_from([1e-2, 0.1]), st.floats(0.0, 0.2))
_beta = st.floats(0.5, 0.999)
_eps = st.sampled_from([1e-8, 1e-6, 1e-3])


@st.composite
def _sgd(draw) -> dict:
    if draw(st.booleans()):  # Nesterov needs momentum > 0 and no dampening
        return {
            "lr": draw(_lr),
            "momentum": draw(st.floats(0.1, 0.99)),
            "nesterov": True,
            "weight_decay": draw(_decay),
        }
    return {
        "lr": draw(_lr),
        "momentum": draw(st.one_of(st.just(0.0), st.floats(0.0, 0.99))),
        "dampening": draw(st.one_of(st.just(0.0), st.floats(0.0, 0.5))),
        "weight_decay": draw(_decay),
        "maximize": draw(st.booleans()),
    }


@st.composite
def _adam(draw) -> dict:
    return {
        "lr": draw(_lr),
        "betas": (draw(_beta), draw(_beta)),
        "eps": draw(_eps),
        "weight_decay": draw(_decay),
        "amsgrad": draw(st.booleans()),
        "maximize": draw(st.booleans()),
    }


@st.composite
def _adagrad(draw) -> dict:
    return {
        "lr": draw(_lr),
        "lr_decay": draw(st.one_of(st.just(0.0), st.floats(0.0, 0.1))),
        "weight_decay": draw(_decay),
        "initial_accumulator_value": draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
        "eps": draw(st.sampled_from([1e-10, 1e-6])),
    }


@st.composite
def _rmsprop(draw) -> dict:
    return {
        "lr": draw(_lr),
        "alpha": draw(_beta),
        "eps": draw(_eps),
        "weight_decay": draw(_decay),
        "momentum": draw(st.one_of(st.just(0.0), st.floats(0.0, 0.95))),
        "centered": draw(st.booleans()),
    }


@st.composite
def _adafactor(draw) -> dict:
    return {
        "lr": draw(_lr),
        "beta2_decay": draw(st.sampled_from([-0.8, -0.5])),
        "weight_decay": draw(_decay),
        "maximize": draw(st.booleans()),
    }


_HYPER = {
    "SGD": _sgd,
    "Adam": _adam,
    "AdamW": _adam,
    "Adagrad": _adagrad,
    "RMSprop": _rmsprop,
    "Adafactor": _adafactor,
}

#: Elementwise ``torch.optim`` classes the plan must reproduce bit for bit.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop")


@st.composite
def optimizer_setups(draw, name: str, groups: int) -> list[dict]:
    """Hyper-parameters of ``torch.optim.<name>`` for each of ``groups`` param groups."""
    return [draw(_HYPER[name]()) for _ in range(groups)]


# ----------------------------------------------------------------- loss scale


@st.composite
def scaler_configs(draw, *, hysteresis: st.SearchStrategy[int] | None = None, bounds: bool = False):
    """Scaler settings with powers of two and arbitrary factors (exercising float32 rounding).

    With ``bounds`` the min / max scales are drawn too (float32 values around the initial scale).
    """
    initial = draw(
        st.one_of(
            st.integers(-20, 40).map(lambda k: 2.0**k),
            st.floats(1e-4, 1e9),
        )
    )
    growth = draw(st.one_of(st.sampled_from([2.0, 4.0, 1.5, 3.0]), st.floats(1.0, 8.0, exclude_min=True)))
    backoff = draw(
        st.one_of(
            st.sampled_from([0.5, 0.25, 0.1, 0.9]),
            st.floats(0.0, 1.0, exclude_min=True, exclude_max=True).map(lambda b: max(b, 1e-3)),
        )
    )
    extra = {}
    if bounds:
        below = st.floats(0.0, 1.0).map(lambda f: _f32_toward(initial * f, 0.0))
        above = st.floats(1.0, 1e6).map(lambda f: _f32_toward(initial * f, float("inf")))
        extra["min_scale"] = draw(st.one_of(st.just(0.0), below))
        extra["max_scale"] = draw(st.one_of(st.just(float("inf")), above))
    return ScalerConfig(
        initial_scale=initial,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=draw(st.integers(1, 6)),
        hysteresis=1 if hysteresis is None else draw(hysteresis),
        **extra,
    )


def _f32_toward(value: float, direction: float) -> float:
    """The float32 value nearest ``value`` on the side of ``direction`` (or ``value`` itself)."""
    v = torch.tensor(value, dtype=torch.float64).to(torch.float32)
    if (float(v) > value and direction < value) or (float(v) < value and direction > value):
        v = torch.nextafter(v, torch.tensor(direction, dtype=torch.float32))
    return float(v)
