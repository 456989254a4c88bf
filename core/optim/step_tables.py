# zeroplan.core — pure planning: no torch, no I/O.
# torch 2.13's step temporaries per optimizer, hyper-parameters and implementation, as measured.
"""The tables of [Note: step temporaries] (:mod:`zeroplan.core.optim.temporaries`) for torch 2.13.

Each entry was fitted to ``MemTracker`` measurements by
``benchmarks/optimizer_temporaries.py``, read against torch's source to name
what each moment holds, and is checked against the measurement by
``tests/facade/test_inner_temporaries.py``.
"""

from __future__ import annotations

from zeroplan.core.optim.implementations import Implementation
from zeroplan.core.optim.temporaries import Cost, Feature, Kind, Moment, Role, StepTemporaries, Term, Unit

__all__ = ["LOW_BIT_TEMPORARIES", "UNKNOWN_TEMPORARIES", "step_temporaries"]


def _each(items: int = 0, bytes: int = 0, feature: Feature = Feature.NUMEL, kind: Kind = Kind.ANY) -> Term:
    return Term(Role.EACH, feature, Cost(items, bytes), kind)


def _prev(items: int = 0, bytes: int = 0, feature: Feature = Feature.NUMEL, kind: Kind = Kind.ANY) -> Term:
    return Term(Role.PREVIOUS, feature, Cost(items, bytes), kind)


def _largest(items: int = 0, bytes: int = 0, feature: Feature = Feature.NUMEL, kind: Kind = Kind.ANY) -> Term:
    return Term(Role.LARGEST, feature, Cost(items, bytes), kind)


_NOTHING = Cost()


def _m(*terms: Term, fixed: Cost = _NOTHING, at: Kind = Kind.ANY, after: Kind = Kind.ANY) -> Moment:
    return Moment(terms=tuple(t for t in terms if t.cost != _NOTHING), fixed=fixed, at=at, after=after)


#: One element-sized scalar (``param.norm()``, a Python number wrapped as a tensor of the dtype).
_SCALAR = Cost(1)
#: The fp32 ``torch.tensor(1.0)`` that foreach implementations add to the CPU ``step`` counters.
_STEP_ONE = Cost(0, 4)

#: Unknown optimizers: more than any torch 2.13 optimizer allocates, for-loop or foreach (3 x the
#: group as foreach lists, 6 x its largest tensor as for-loop temporaries, one bool mask, 8 bytes of
#: scalars per tensor and 8 more).
UNKNOWN_TEMPORARIES = StepTemporaries(
    unit=Unit.GROUP,
    moments=(_m(_each(3), _each(0, 8, Feature.ONE), _largest(6, 1), fixed=Cost(0, 8)),),
)

#: torchao's low-bit Adam (0.18), one tensor at a time: six fp32 copies of the tensor and 8 bytes of
#: scalars, measured by MemTracker with the step run eagerly (``TORCHDYNAMO_DISABLE=1``). torchao
#: compiles the step, and MemTracker cannot run inside compiled code (a dispatch mode); inductor's
#: fused kernels keep at most the eager step's intermediates, so this bounds the compiled step.
LOW_BIT_TEMPORARIES = StepTemporaries(unit=Unit.TENSOR, moments=(_m(_each(6), fixed=Cost(0, 8)),))


def _for_loop(
    name: str, maximize: bool, decay: bool, momentum: bool, nesterov: bool, ns_steps: int
) -> tuple[Moment, ...]:
    grad = int(maximize or decay)  # a gradient-sized temporary: -grad or grad + weight_decay * param
    if name == "SGD":
        chain = int(maximize) + int(decay) + int(momentum and nesterov)
        held = (momentum and nesterov) or (not momentum and (maximize or decay))
        return (_m(_each(min(chain, 2))),) + ((_m(_each(1), _prev(1)),) if maximize and held else ())
    if name in ("Adam", "AdamW", "NAdam"):
        return (_m(_each(2 + grad), _prev(1)),)  # sqrt and denom; denom is held into the next tensor
    if name in ("RMSprop", "Adagrad"):
        return (_m(_each(1 + grad), _prev(1)),)  # avg / std, held into the next tensor
    if name == "Adamax":
        return (_m(_each(1 + grad)),)
    if name == "RAdam":
        return (_m(_each(5 + grad)),)  # the rectified update (steps >= 6 with the default betas)
    if name == "Adadelta":  # std and delta are held into the next tensor, then rebound one by one
        return (_m(_each(1 + grad), _prev(2)), _m(_each(2 + grad), _prev(1)))
    if name == "Rprop":
        return (
            _m(_each(3)),
            _m(_each(2 + int(maximize)), _prev(1)),
            _m(_each(2, 1), fixed=_SCALAR),  # sign, grad clone, bool mask, the wrapped 0
        )
    if name == "ASGD":
        return (
            _m(_each(1 + min(grad, 1)), _prev(0, 8, Feature.ONE)),  # param - ax (after t0 steps)
            _m(_each(grad), _prev(0, 4, Feature.ONE), fixed=Cost(0, 8)),  # new eta and mu (fp32)
        )
    if (
        name == "Muon"
    ):  # nesterov's update, then the bf16 Newton-Schulz iterate, its next value, 2 Gram matrices
        if ns_steps == 0:
            return (_m(_each(int(nesterov), 2), fixed=Cost(0, 4)),)
        return (_m(_each(int(nesterov), 4), _each(0, 4, Feature.GRAM)),)
    if name == "Adafactor":
        return _adafactor_for_loop(int(maximize))
    raise AssertionError(name)  # pragma: no cover - every name of the table is handled


def _adafactor_for_loop(neg: int) -> tuple[Moment, ...]:
    """Adafactor's for-loop; each moment is named after the statement that allocates.

    A matrix step allocates ``row_mean``, ``col_mean``, ``var_estimate`` and a
    ``mean`` of ``MATRICES`` elements; a vector step ``grad_squared`` and a copy
    of ``variance``; both a ``norm`` scalar, and ``-grad`` for ``maximize``. The
    previous tensor's ``var_estimate`` (and ``-grad``) is held until rebound, so
    are ``row_mean``/``col_mean`` of the last matrix and ``grad_squared`` of the
    last vector: from the previous tensor when it has that kind, else bounded by
    the largest one.
    """
    rows, cols, mats = Feature.ROWS, Feature.COLS, Feature.MATRICES
    M, V = Kind.MATRIX, Kind.VECTOR
    stale_vector = _largest(1, kind=V)
    stale_matrix = (_largest(1, feature=rows), _largest(1, feature=cols))
    held_matrix = (_prev(1 + neg), _prev(1, feature=rows), _prev(1, feature=cols))
    held_vector = (_prev(2 + neg),)
    moments = [
        _m(_each(1 + neg), _each(1, feature=rows), _each(1, feature=cols), _each(1, feature=mats), at=M),
        _m(_each(2 + neg), fixed=_SCALAR, at=V),
    ]
    if neg:
        moments += [
            _m(*held_matrix, stale_vector, _each(1), at=M, after=M),
            _m(*held_vector, *stale_matrix, _each(1), at=M, after=V),
            _m(*held_vector, *stale_matrix, _each(1), at=V, after=V),
            _m(*held_matrix, stale_vector, _each(1), at=V, after=M),
        ]
    held_m = (_prev(1), _prev(1, feature=rows), _prev(1, feature=cols))
    moments += [  # a matrix after a matrix
        _m(*held_m, stale_vector, _each(neg), fixed=_SCALAR, at=M, after=M),
        _m(*held_m, stale_vector, _each(neg), _each(1, feature=rows), at=M, after=M),
        _m(
            _prev(1),
            _prev(1, feature=cols),
            stale_vector,
            _each(neg),
            _each(1, feature=rows),
            _each(1, feature=cols),
            at=M,
            after=M,
        ),
        _m(
            _prev(1),
            stale_vector,
            _each(1 + neg),
            _each(1, feature=rows),
            _each(1, feature=cols),
            _each(1, feature=mats),
            at=M,
            after=M,
        ),
        _m(
            stale_vector,
            _each(1 + neg),
            _each(1, feature=rows),
            _each(1, feature=cols),
            fixed=_SCALAR,
            at=M,
            after=M,
        ),
    ]
    moments += [  # a matrix after a vector (whose grad_squared is the last one)
        _m(_prev(2), *stale_matrix, _each(neg), fixed=_SCALAR, at=M, after=V),
        _m(_prev(2), *stale_matrix, _each(neg), _each(1, feature=rows), at=M, after=V),
        _m(
            _prev(2),
            stale_matrix[1],
            _each(neg),
            _each(1, feature=rows),
            _each(1, feature=cols),
            at=M,
            after=V,
        ),
        _m(
            _prev(2),
            _each(1 + neg),
            _each(1, feature=rows),
            _each(1, feature=cols),
            _each(1, feature=mats),
            at=M,
            after=V,
        ),
        _m(
            _prev(1),
            _each(1 + neg),
            _each(1, feature=rows),
            _each(1, feature=cols),
            fixed=_SCALAR,
            at=M,
            after=V,
        ),
    ]
    moments += [  # a vector after a vector
        _m(_prev(2), *stale_matrix, _each(neg), fixed=_SCALAR, at=V, after=V),
        _m(_prev(2), *stale_matrix, _each(1 + neg), at=V, after=V),
        _m(_prev(1), *stale_matrix, _each(2 + neg), at=V, after=V),
        _m(*stale_matrix, _each(2 + neg), fixed=_SCALAR, at=V, after=V),
    ]
    moments += [  # a vector after a matrix (whose row_mean and col_mean are the last ones)
        _m(*held_m, stale_vector, _each(neg), fixed=_SCALAR, at=V, after=M),
        _m(*held_m, stale_vector, _each(1 + neg), at=V, after=M),
        _m(*held_m, _each(2 + neg), at=V, after=M),
        _m(_prev(1, feature=rows), _prev(1, feature=cols), _each(2 + neg), fixed=_SCALAR, at=V, after=M),
    ]
    return tuple(moments)


def _foreach(name: str, maximize: bool, decay: bool) -> tuple[Moment, ...]:
    grad = int(maximize or decay)
    step_one = _m(fixed=_STEP_ONE)
    negated_step_one = _m(_each(int(maximize)), fixed=_STEP_ONE)  # -grads exist before steps are counted
    if name == "SGD":
        return (_m(_each(grad)),)
    if name in ("Adam", "AdamW", "Adamax"):  # the gradients are released before _foreach_sqrt / abs
        return (_m(_each(1)), negated_step_one)
    if name in ("RMSprop", "NAdam"):
        return (_m(_each(1 + grad)), negated_step_one)
    if name == "Adagrad":
        return (_m(_each(2)), negated_step_one)
    if name == "RAdam":
        return (_m(_each(1)), step_one)
    if name == "Adadelta":
        return (_m(_each(2 + grad)), step_one)
    if name == "Rprop":  # signs, then per tensor a bool mask and torch.where's result
        return (_m(_each(1), _largest(1, 1), fixed=_SCALAR), step_one)
    if name == "ASGD":  # new etas (built with up to 3 fp32 scalars alive) and mus, one per tensor
        neg = int(maximize)
        return (
            _m(_each(1 + neg)),
            _m(_each(neg), _each(0, 8, Feature.ONE)),
            _m(_each(neg), _each(0, 4, Feature.ONE), fixed=Cost(0, 8)),
        )
    if name == "Adafactor":
        return _adafactor_foreach(int(maximize))
    raise AssertionError(name)  # pragma: no cover - Muon has no foreach (refused on resolution)


def _adafactor_foreach(neg: int) -> tuple[Moment, ...]:
    """Adafactor's foreach: matrices and vectors are two lists, stepped one after the other.

    Each list holds ``-grad`` (``maximize``) and the previous list's
    ``var_estimates`` while it builds its own statistics.
    """
    M, V = Kind.MATRIX, Kind.VECTOR
    return (
        _m(_each(neg), _each(1, feature=Feature.ROWS), _prev(1), at=M),
        _m(_each(neg), _each(1, feature=Feature.COLS), _prev(1), at=M),
        _m(_each(1 + neg), _each(1, feature=Feature.MATRICES), _prev(1), at=M),
        _m(_each(1 + neg), fixed=_SCALAR, at=M),
        _m(_each(1 + neg), _prev(1), at=V),
        _m(_each(1 + neg), fixed=_SCALAR, at=V),
        _m(fixed=_STEP_ONE),
    )


def step_temporaries(
    name: str,
    implementation: Implementation,
    *,
    maximize: bool = False,
    decay: bool = False,
    momentum: bool = False,
    nesterov: bool = False,
    ns_steps: int = 5,
) -> StepTemporaries:
    """The measured temporaries of torch 2.13's optimizer ``name`` (see [Note: step temporaries]).

    Args:
        name: a class name of ``torch.optim`` (canonical spelling); others get
            :data:`UNKNOWN_TEMPORARIES`.
        implementation: the implementation that runs.
        maximize: the ``maximize`` setting.
        decay: whether weight decay allocates ``grad + weight_decay * param``
            (non-zero and coupled: not AdamW's, nor ``decoupled_weight_decay``).
        momentum: SGD's ``momentum`` is non-zero.
        nesterov: SGD's or Muon's ``nesterov``.
        ns_steps: Muon's Newton-Schulz iterations.

    Example:
        >>> foreach = step_temporaries("AdamW", Implementation.FOREACH)
        >>> foreach.bytes([(64, 48), (33,)], 4)   # one _foreach_sqrt over the group
        12420
        >>> step_temporaries("AdamW", Implementation.FOR_LOOP).bytes([(64, 48), (33,)], 4)
        24576
        >>> step_temporaries("AdamW", Implementation.FUSED).bytes([(64, 48), (33,)], 4)
        0
    """
    if implementation is Implementation.FUSED:
        return StepTemporaries(unit=Unit.GROUP)
    known = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "Adadelta", "Rprop",
             "ASGD", "Adafactor", "Muon")  # fmt: skip
    if name not in known:
        return UNKNOWN_TEMPORARIES
    if implementation is Implementation.FOR_LOOP:
        moments = _for_loop(name, maximize, decay, momentum, nesterov, ns_steps)
        return StepTemporaries(unit=Unit.TENSOR, moments=moments)
    unit = Unit.KIND if name == "Adafactor" else Unit.GROUP
    return StepTemporaries(unit=unit, moments=_foreach(name, maximize, decay))
