"""What transformers takes a fake batch for: one sequence per row, no padding.

[Note: packed rows under fake tensors]
transformers decides from the position ids' values whether a batch row packs
several sequences (positions restarting at 0), and then builds an attention
mask it otherwise leaves to SDPA's ``is_causal``. Fake tensors have no values:
it takes them for packed, builds the mask, and SDPA given a mask keeps more
(on the CPU its math path keeps the scores): a tiny Llama with gradient
checkpointing traced 10% over its real run. The trace tells it what the
caller says instead (``packed``, default one sequence per row, what
``zeroplan plan --hf-config`` assumes), and then reads what the real step
reads (transformers imported before the trace, as building its models
needs).

The same holds for a padding mask (``attention_mask``, 2-D): with SDPA,
transformers skips the mask when all its values are ones (``is_causal``
then), which it cannot see in a fake mask, so it built the 4-D mask and the
trace was 3-8% over a real step whose batch passes ``torch.ones`` (GPT-NeoX,
OPT, Llama). The trace takes a fake padding mask for all ones
(:func:`unpadded_rows`: the two decisions that read its values see no mask,
which they treat as all ones) unless told ``padded=True``, and then equals
the meter on a real step to the byte (``tests/facade/test_trace.py``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["one_sequence_per_row", "unpadded_rows"]


@contextlib.contextmanager
def one_sequence_per_row() -> Iterator[None]:
    """Inside, transformers takes each row of a fake batch for one sequence ([Note: packed rows under
    fake tensors]); real tensors are looked at as usual. Nothing happens without transformers."""
    masking_utils = None
    if "transformers" in sys.modules:  # a model of transformers needs it imported to be built
        try:
            from transformers import masking_utils
        except ImportError:
            masking_utils = None
    find = getattr(masking_utils, "find_packed_sequence_indices", None)
    if find is None:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    def unpacked(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if isinstance(position_ids, FakeTensor) else find(position_ids)

    masking_utils.find_packed_sequence_indices = unpacked
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = find


@contextlib.contextmanager
def unpadded_rows() -> Iterator[None]:
    """Inside, transformers takes a fake padding mask for all ones ([Note: packed rows under fake
    tensors]): its decisions that read the mask's values see no mask instead, as they would see one
    of all ones; real tensors are looked at as usual. Nothing happens without transformers."""
    masking_utils = None
    if "transformers" in sys.modules:
        try:
            from transformers import masking_utils
        except ImportError:
            masking_utils = None
    names = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
    originals = {n: getattr(masking_utils, n, None) for n in names}
    if any(f is None for f in originals.values()):
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    def all_ones(decide: Callable[..., bool]) -> Callable[..., bool]:
        def decided(padding_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> bool:
            return decide(None if isinstance(padding_mask, FakeTensor) else padding_mask, *args, **kwargs)

        return decided

    for n, f in originals.items():
        setattr(masking_utils, n, all_ones(f))
    try:
        yield
    finally:
        for n, f in originals.items():
            setattr(masking_utils, n, f)
