"""A flat tensor described by the views it is assembled from, copied once, where the caller says.

[Note: assembled file tensors]
A rank's shard of the parameters (when its pieces are not one run of the
buffer) and its per-element optimizer state (when the inner optimizer keeps
several windows) are flat tensors that exist only as several views of live
state. A save used to copy them into fresh tensors and then, for a background
save, copy those again into the reused host staging: two copies, and fresh
allocations whose page faults cost as much as a copy. An :class:`Assembly`
names the views and where each goes; :meth:`Assembly.into` copies them, in one
``_foreach_copy_``, straight into the staging buffer (or a fresh tensor for a
blocking save), and zeroes what no view covers (a shard's padding), so a file's
bytes do not depend on what a reused buffer held before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from zeroplan.core import Span

__all__ = ["Assembly", "FileTensor", "materialize"]


@dataclass(frozen=True, slots=True)
class Assembly:
    """``numel`` elements of ``dtype`` on ``device``: each part's view at its span, zeros elsewhere.

    A frozen dataclass, not a tuple, so tree utilities do not walk into its views.

    Attributes:
        numel: the flat tensor's length.
        dtype, device: its dtype and device.
        parts: (where in the tensor, a 1-D view of that many elements of live state), disjoint.
    """

    numel: int
    dtype: torch.dtype
    device: torch.device
    parts: tuple[tuple[Span, torch.Tensor], ...]

    @property
    def shape(self) -> tuple[int]:
        return (self.numel,)

    def into(self, out: torch.Tensor | None = None, *, non_blocking: bool = False) -> torch.Tensor:
        """The assembled tensor, in ``out`` (flat, ``numel`` long; any device) or a new one here."""
        if out is None:
            out = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        covered = 0
        for span in sorted((span for span, _ in self.parts), key=lambda s: s.start):
            if span.start > covered:
                out[covered : span.start].zero_()
            covered = max(covered, span.stop)
        if covered < self.numel:
            out[covered:].zero_()
        if self.parts:
            torch._foreach_copy_(
                [out[span.as_slice()] for span, _ in self.parts],
                [view for _, view in self.parts],
                non_blocking=non_blocking,
            )
        return out


#: What a checkpoint file holds under one name: a tensor, or one still to assemble.
FileTensor = torch.Tensor | Assembly


def materialize(tensors: Mapping[str, FileTensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every assembly copied into a tensor of its own."""
    return {k: v.into() if isinstance(v, Assembly) else v for k, v in tensors.items()}
