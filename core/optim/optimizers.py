# zeroplan.core — pure planning: no torch, no I/O.
# What the planner needs to know about an inner optimizer: state, step temporaries, elementwise-ness.
"""``OptimizerSpec``: the state an optimizer keeps, what its step allocates, how it may be sharded.

An *elementwise* optimizer (SGD, Adam, AdamW, ...) updates each element from
that element's gradient and state alone, so any split of a parameter is exact.
A *non-elementwise* one (Adafactor's factored moments, Muon's orthogonalisation)
needs whole parameters on one rank: a plan that splits parameters is refused.

The temporaries of ``step()`` depend on the implementation torch runs (see
[Note: implementation resolution] in :mod:`zeroplan.core.optim.implementations`) and
are described in [Note: step temporaries] (:mod:`zeroplan.core.optim.temporaries`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zeroplan.core.errors import ConfigError, check_config
from zeroplan.core.optim.implementations import Implementation, resolve_implementation
from zeroplan.core.optim.step_tables import LOW_BIT_TEMPORARIES, UNKNOWN_TEMPORARIES, step_temporaries
from zeroplan.core.optim.temporaries import StepTemporaries

__all__ = ["LowBitState", "OptimizerSpec", "describe_optimizer", "known_optimizers"]

#: Bytes of a scalar state tensor (torch keeps ``step`` as a float32 scalar).
SCALAR_BYTES = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class LowBitState:
    """How torchao's low-bit Adam optimizers keep one moment of one tensor.

    [Note: low-bit optimizer state]
    torchao's ``AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8`` (and their ``Adam``
    twins, torchao 0.18) keep each moment of a tensor with at least
    ``min_numel`` elements, a multiple of ``block_size``, as codes of
    ``code_bits`` bits, one fp32 scale per block of ``block_size`` elements and
    a per-tensor fp32 code table of ``lookup`` entries (256 for 8 bits, 16 for 4,
    none for fp8). Smaller tensors keep plain moments of the tensor's dtype.
    Whether a tensor is quantized, and where its blocks start, depends on the
    whole tensor, so zeroplan plans these optimizers over whole parameters
    (``elementwise=False``): each rank steps the same tensors, block for block,
    as torchao does unsharded, and the state equals it bit for bit. Splitting a
    parameter at block boundaries would balance memory better for a few large
    tensors; it is not done.

    Example:
        >>> LowBitState(code_bits=8, block_size=256, lookup=256).moment_bytes(64 * 256, 4)
        17664
        >>> LowBitState(code_bits=8, block_size=256, lookup=256).moment_bytes(100, 4)   # plain
        400
    """

    code_bits: int
    block_size: int
    lookup: int
    min_numel: int = 4096

    def __post_init__(self) -> None:
        check_config(
            self.code_bits in (4, 8), f"LowBitState.code_bits must be 4 or 8, got {self.code_bits!r}"
        )
        for name in ("block_size", "lookup", "min_numel"):
            value = getattr(self, name)
            check_config(
                type(value) is int and value >= (1 if name == "block_size" else 0),
                f"LowBitState.{name} must be an int >= {1 if name == 'block_size' else 0}, got {value!r}",
            )

    def quantizes(self, numel: int) -> bool:
        """Whether a tensor of ``numel`` elements keeps quantized moments (torchao's rule)."""
        return numel >= self.min_numel and numel % self.block_size == 0

    def moment_bytes(self, numel: int, itemsize: int) -> int:
        """Bytes of one moment of a tensor of ``numel`` elements whose dtype has ``itemsize`` bytes."""
        if not self.quantizes(numel):
            return numel * itemsize
        return numel * self.code_bits // 8 + 4 * (numel // self.block_size) + 4 * self.lookup


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerSpec:
    """The state an optimizer keeps per tensor it steps.

    Attributes:
        name: the optimizer's class name.
        elementwise: whether any element split of a parameter is exact.
        per_element: state tensors shaped like the stepped tensor.
        scalars: 0-d state tensors per stepped tensor (``step``, ...).
        factored: Adafactor-style row and column statistics for tensors of two
            or more dimensions (one full-size statistic below that).
        known: whether the description comes from zeroplan's table; unknown
            optimizers are treated as non-elementwise with unknown state size.
        implementation: how torch steps a param group (for-loop, foreach or fused).
        temporaries: what that step allocates beyond the state; a spec built
            without it gets :data:`~zeroplan.core.optim.step_tables.UNKNOWN_TEMPORARIES`,
            more than any torch optimizer allocates.
        low_bit: how each per-element moment is quantized (torchao's low-bit
            optimizers, see [Note: low-bit optimizer state]); ``None``: plain moments.

    Example:
        >>> spec = describe_optimizer("AdamW")
        >>> spec.state_bytes((10, 10), 4)   # exp_avg + exp_avg_sq + step
        804
        >>> str(spec.implementation)   # torch's default for CUDA parameters
        'foreach'
        >>> spec.step_temporary_bytes([100, 28], 4)   # _foreach_sqrt(exp_avg_sqs)
        512
    """

    name: str
    elementwise: bool
    per_element: int
    scalars: int = 0
    factored: bool = False
    known: bool = True
    implementation: Implementation = Implementation.FOR_LOOP
    temporaries: StepTemporaries = UNKNOWN_TEMPORARIES
    low_bit: LowBitState | None = None

    def __post_init__(self) -> None:
        check_config(
            isinstance(self.implementation, Implementation),
            f"OptimizerSpec.implementation must be an Implementation, got {self.implementation!r}",
        )
        check_config(
            isinstance(self.temporaries, StepTemporaries),
            f"OptimizerSpec.temporaries must be a StepTemporaries, got {self.temporaries!r}",
        )
        check_config(
            self.low_bit is None or isinstance(self.low_bit, LowBitState),
            f"OptimizerSpec.low_bit must be a LowBitState or None, got {self.low_bit!r}",
        )
        check_config(
            self.low_bit is None or not (self.elementwise or self.factored),
            "OptimizerSpec: low-bit state is planned over whole parameters (elementwise=False, "
            "factored=False)",
        )

    def state_bytes(self, shape: tuple[int, ...], itemsize: int) -> int:
        """Bytes of state for one stepped tensor of ``shape`` (state dtype ``itemsize``)."""
        numel = math.prod(shape)
        if self.low_bit is not None:
            moments = self.per_element * self.low_bit.moment_bytes(numel, itemsize)
            return moments + self.scalars * SCALAR_BYTES
        full = self.per_element * numel
        if self.factored:
            if len(shape) >= 2:
                full += math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]
            else:
                full += numel
        return full * itemsize + self.scalars * SCALAR_BYTES

    def step_temporary_bytes(self, numels: Sequence[int], itemsize: int) -> int:
        """Peak bytes of temporaries while stepping ONE param group of flat tensors with these ``numels``.

        The tensors are 1-d (the flat windows an elementwise optimizer steps),
        of one dtype of ``itemsize`` bytes, stepped in this order (the
        for-loop's peak depends on it). Shaped tensors (Adafactor, Muon):
        :meth:`step_temporary_bytes_of_shapes`. Param groups are stepped one
        after the other, so a step's peak is the largest of its groups'.

        Raises:
            ConfigError: a numel that is not an int >= 0, or a bad ``itemsize``.

        Example:
            >>> loop = describe_optimizer("AdamW", device="cpu")
            >>> loop.step_temporary_bytes([3072, 1024], 4)   # sqrt + denom of the largest
            24576
            >>> loop.step_temporary_bytes([1024, 3072], 4)   # ... plus the previous denom, still held
            28672
        """
        check_config(
            all(type(n) is int and n >= 0 for n in numels), f"numels must be ints >= 0, got {list(numels)!r}"
        )
        return self.temporaries.bytes([(n,) for n in numels], itemsize)

    def step_temporary_bytes_of_shapes(self, shapes: Sequence[tuple[int, ...]], itemsize: int) -> int:
        """:meth:`step_temporary_bytes` for tensors of these ``shapes`` (whole parameters).

        Example:
            >>> muon = describe_optimizer("Muon")   # nesterov: fp32 update, bf16 iterates, Gram matrices
            >>> muon.step_temporary_bytes_of_shapes([(10, 100)], 4)
            8400
        """
        return self.temporaries.bytes(shapes, itemsize)


def _sgd(momentum: float = 0.0, **_: Any) -> tuple[bool, int, int, bool]:
    return True, 1 if momentum else 0, 0, False


def _adam(amsgrad: bool = False, **_: Any) -> tuple[bool, int, int, bool]:
    return True, 3 if amsgrad else 2, 1, False


def _rmsprop(momentum: float = 0.0, centered: bool = False, **_: Any) -> tuple[bool, int, int, bool]:
    return True, 1 + (1 if momentum else 0) + (1 if centered else 0), 1, False


def _fixed(elementwise: bool, per_element: int, scalars: int, factored: bool = False) -> Any:
    def describe(**_: Any) -> tuple[bool, int, int, bool]:
        return elementwise, per_element, scalars, factored

    return describe


_TABLE = {
    "SGD": _sgd,
    "Adam": _adam,
    "AdamW": _adam,
    "RMSprop": _rmsprop,
    "Adagrad": _fixed(True, 1, 1),
    "Adamax": _fixed(True, 2, 1),
    "NAdam": _fixed(True, 2, 2),
    "RAdam": _fixed(True, 2, 1),
    "Adadelta": _fixed(True, 2, 1),
    "Rprop": _fixed(True, 2, 1),
    "ASGD": _fixed(True, 1, 3),
    "Adafactor": _fixed(False, 0, 1, True),
    "Muon": _fixed(False, 1, 0),
}

#: torchao's low-bit Adam optimizers (torchao 0.18): code bits, default block size, code table entries.
_LOW_BIT = {
    "torchao.AdamW8bit": (8, 256, 256),
    "torchao.Adam8bit": (8, 256, 256),
    "torchao.AdamW4bit": (4, 128, 16),
    "torchao.Adam4bit": (4, 128, 16),
    "torchao.AdamWFp8": (8, 256, 0),
    "torchao.AdamFp8": (8, 256, 0),
}
for _name in _LOW_BIT:
    _TABLE[_name] = _adam

_ALIASES = {name.lower(): name for name in _TABLE}


def known_optimizers() -> tuple[str, ...]:
    """Names :func:`describe_optimizer` knows."""
    return tuple(_TABLE)


#: Optimizers whose weight decay allocates ``grad + weight_decay * param`` (unless decoupled).
_COUPLED_DECAY = frozenset(
    {"SGD", "Adam", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "Adadelta", "ASGD"}
)
#: Optimizers that take ``decoupled_weight_decay`` (AdamW always decouples).
_DECOUPLABLE = frozenset({"Adam", "NAdam", "RAdam"})


def _temporaries(name: str, implementation: Implementation, hyper: Mapping[str, Any]) -> StepTemporaries:
    """Read the hyper-parameters that change the step's temporaries (torch 2.13's defaults otherwise)."""
    decay = hyper.get("weight_decay", 0)
    decay_nonzero = not (isinstance(decay, (int, float)) and decay == 0)  # a tensor counts as non-zero
    coupled = name in _COUPLED_DECAY and not (name in _DECOUPLABLE and hyper.get("decoupled_weight_decay"))
    momentum = hyper.get("momentum", 0)
    return step_temporaries(
        name,
        implementation,
        maximize=bool(hyper.get("maximize", False)),
        decay=coupled and decay_nonzero,
        momentum=not (isinstance(momentum, (int, float)) and momentum == 0),
        nesterov=bool(hyper.get("nesterov", name == "Muon")),
        ns_steps=int(hyper.get("ns_steps", 5)),
    )


def _guess_implementation(name: str, hyper: Mapping[str, Any], device: str) -> Implementation:
    """torch's rules applied to an optimizer outside torch, whose settings may mean something else."""
    flags = {k: hyper[k] for k in ("foreach", "fused") if isinstance(hyper.get(k), bool)}
    if flags.get("foreach") and flags.get("fused"):
        flags = {}
    return resolve_implementation(name, flags, device=device)


def describe_optimizer(
    name: str,
    /,
    settings: Mapping[str, Any] | None = None,
    *,
    strict: bool = True,
    device: str = "cuda",
    **hyper: Any,
) -> OptimizerSpec:
    """The spec of the ``torch.optim`` optimizer called ``name`` with ``hyper`` settings on ``device``.

    Hyper-parameters that change the state (``momentum``, ``amsgrad``,
    ``centered``) or the step's temporaries (``foreach``, ``fused``,
    ``maximize``, ``weight_decay``, ``decoupled_weight_decay``, ``nesterov``,
    ``ns_steps``, ``differentiable``) are read; others are ignored.

    Args:
        name: class name, case-insensitive (``"adamw"`` works).
        strict: raise for unknown names; otherwise return a conservative
            non-elementwise spec with ``known=False``.
        settings: the optimizer's keyword arguments as a mapping (a param
            group's settings, which may hold any key, ``name`` and ``strict``
            included).
        device: the parameters' device type, ``"cpu"`` or ``"cuda"`` (other torch
            device types work too), which decides torch's default
            implementation. The default, ``"cuda"``, describes the usual
            training setup; the facade passes its parameters' device.
        **hyper: more keyword arguments.

    Raises:
        ConfigError: unknown ``name`` with ``strict``, or ``foreach``/``fused``
            settings torch refuses (see :func:`~zeroplan.core.optim.implementations.resolve_implementation`).

    Example:
        >>> describe_optimizer("sgd", momentum=0.9).per_element
        1
        >>> describe_optimizer("Adafactor").elementwise
        False
        >>> [str(describe_optimizer("Adam", device=d).implementation) for d in ("cpu", "cuda")]
        ['for_loop', 'foreach']
        >>> describe_optimizer("Adam", fused=True).step_temporary_bytes([1000], 4)
        0
        >>> lion = describe_optimizer("Lion", strict=False, device="cpu")   # unknown: conservative
        >>> lion.step_temporary_bytes([1000], 4) > describe_optimizer("RAdam").step_temporary_bytes([1000], 4)
        True
    """
    merged = {**(settings or {}), **hyper}
    canonical = _ALIASES.get(str(name).lower())
    if canonical is None:
        if strict:
            raise ConfigError(
                f"unknown optimizer {name!r}; known: {', '.join(_TABLE)} "
                "(other optimizers are planned as non-elementwise with unknown state)"
            )
        return OptimizerSpec(
            name=str(name),
            elementwise=False,
            per_element=0,
            known=False,
            implementation=_guess_implementation(str(name), merged, device),
        )
    elementwise, per_element, scalars, factored = _TABLE[canonical](**merged)
    if canonical in _LOW_BIT:
        return _low_bit(canonical, merged, per_element, scalars)
    implementation = resolve_implementation(canonical, merged, device=device)
    return OptimizerSpec(
        name=canonical,
        elementwise=elementwise,
        per_element=per_element,
        scalars=scalars,
        factored=factored,
        implementation=implementation,
        temporaries=_temporaries(canonical, implementation, merged),
    )


def _low_bit(name: str, hyper: Mapping[str, Any], moments: int, scalars: int) -> OptimizerSpec:
    """The spec of torchao's low-bit optimizer ``name`` (see [Note: low-bit optimizer state])."""
    bits, block, lookup = _LOW_BIT[name]
    block = hyper.get("block_size", block)
    check_config(type(block) is int and block >= 1, f"{name}: block_size must be an int >= 1, got {block!r}")
    return OptimizerSpec(
        name=name,
        elementwise=False,
        per_element=moments,
        scalars=scalars,
        implementation=Implementation.FOR_LOOP,  # one compiled step per tensor
        temporaries=LOW_BIT_TEMPORARIES,
        low_bit=LowBitState(code_bits=bits, block_size=block, lookup=lookup),
    )
