"""The gradient norm summed exactly, so the same bits whatever holds which element (deterministic mode).

See [Note: deterministic mode] in ``zeroplan.core.deterministic``: each ``|g|^p``
(fp64) is cut into :data:`~zeroplan.core.deterministic.NORM_LIMBS` integer limbs
of :data:`~zeroplan.core.deterministic.NORM_LIMB_BITS` bits below the power of
two of the largest value over all ranks, and the limbs are summed as int64,
which is associative: over elements, shards and ranks in any order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch

from zeroplan.core.deterministic import EXACT_NORM_CHUNK, EXACT_NORM_ELEMENTS, NORM_LIMB_BITS, NORM_LIMBS

__all__ = ["exact_norm"]


def _powers(part: torch.Tensor, p: float) -> Iterator[torch.Tensor]:
    """``|g|^p`` of ``part`` in fp64, chunk by chunk (nothing for an empty part); one chunk alive."""
    if part.numel() == 0:
        return
    for chunk in part.reshape(-1).split(EXACT_NORM_CHUNK):
        v = chunk.to(torch.float64, copy=True).abs_()  # a copy: fp64 gradients are never written
        yield v if p in (1, math.inf) else v.square_() if p == 2 else v.pow_(p)


def exact_norm(
    parts: Sequence[torch.Tensor],
    p: float,
    device: torch.device,
    all_max: Callable[[torch.Tensor], None],
    all_sum: Callable[[torch.Tensor], None],
) -> torch.Tensor:
    """The ``p``-norm of the elements of ``parts`` on every rank, as float32; the same bits for any split.

    ``device`` holds the small tensors; ``all_max`` and ``all_sum`` combine a small tensor over the
    ranks that together hold every element once (in place). A NaN anywhere gives NaN, an infinity
    (and no NaN) gives infinity, as ``torch.linalg.vector_norm`` does. At most
    ``EXACT_NORM_BYTES_PER_ELEMENT`` bytes per element of one chunk are alive at once (planned:
    :func:`~zeroplan.core.deterministic.exact_norm_transient`).
    """
    # The largest finite value, then whether any is NaN, whether any is infinite.
    peak = torch.zeros(EXACT_NORM_ELEMENTS, dtype=torch.float64, device=device)
    for part in parts:
        for v in _powers(part, p):
            peak[1] = torch.maximum(peak[1], torch.isnan(v).any().double())
            peak[2] = torch.maximum(peak[2], torch.isinf(v).any().double())
            peak[0] = torch.maximum(peak[0], v.nan_to_num_(0.0, 0.0, 0.0).amax())
    all_max(peak)
    if p == math.inf:  # the largest magnitude: exact already; the second call keeps the planned traffic
        all_sum(torch.zeros(NORM_LIMBS, dtype=torch.int64, device=device))
        norm = torch.where(peak[2] > 0, torch.inf, peak[0])
        return torch.where(peak[1] > 0, torch.nan, norm).float()
    # Every finite value < 2**exponent; at least 2**-1000, so that the scale below stays finite.
    exponent = torch.frexp(peak[0]).exponent.clamp_(min=-1000)
    one = torch.ones((), dtype=torch.float64, device=device)
    scale = torch.ldexp(one, NORM_LIMB_BITS - exponent)
    step = float(1 << NORM_LIMB_BITS)
    limbs = torch.zeros(NORM_LIMBS, dtype=torch.int64, device=device)
    for part in parts:
        # Parts in host memory beside a GPU (CPU offload): the scale read once to where they are.
        here = scale if part.device == scale.device else scale.to(part.device)
        for v in _powers(part, p):
            v.nan_to_num_(0.0, 0.0, 0.0).mul_(here)  # exact: a power of two; every value < 2**bits
            for i in range(NORM_LIMBS):
                whole = v.to(torch.int64)  # the integer part (values are >= 0)
                limbs[i] += whole.sum()
                v.sub_(whole).mul_(step)  # exact: the fraction, shifted up
                del whole
    all_sum(limbs)
    total = limbs[0].double()
    for i in range(1, NORM_LIMBS):
        total = total + limbs[i].double() / step**i
    total = torch.ldexp(total, exponent - NORM_LIMB_BITS)
    norm = total if p == 1 else total.pow(1.0 / p)
    norm = torch.where(peak[2] > 0, torch.inf, norm)
    return torch.where(peak[1] > 0, torch.nan, norm).float()
