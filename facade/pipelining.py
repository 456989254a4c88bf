"""A pipeline stage whose parameters a ``ZeroOptimizer`` steps, for torch's pipelining schedules.

[Note: pipeline stages]
``torch.distributed.pipelining`` runs every micro-batch's backward inside
``schedule.step()`` and tells a DDP or FSDP2 module which backward is the last
of the step, so the others accumulate without reducing. :class:`ZeroPipelineStage`
is torch's ``PipelineStage`` doing the same for a ``ZeroOptimizer``: every
backward but the last runs inside ``opt.no_sync()``, so the gradients accumulate
on each rank and the last backward reduces them once, bucket by bucket, as
without a pipeline. The optimizer is built over the stage's mesh slice
(``device_mesh=`` with ``pp`` and ``dp`` dimensions, [Note: mesh roles] in
``zeroplan.core.mesh``), which joins the norm and the overflow verdict over the
stages.

A schedule's ``scale_grads=True`` (torch's default) divides ``.grad`` by the
number of micro-batches after the last backward, when zeroplan's reduction owns
the gradients (at stages 2 and 3 ``.grad`` is empty by then: the division would
silently do nothing); the stage hands the division to the optimizer instead
(``opt.divide_gradients``), which applies it when the step averages the reduced
gradients. One stage per optimizer, one stage per rank: schedules that put
several stages on a rank (interleaved, looped, zero-bubble V) would need the
last backward of every stage of the rank before one reduction, and one norm over
them; a second stage on the same optimizer is refused.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

from zeroplan.core import ConfigError
from zeroplan.facade.runtime.optimizer import ZeroOptimizer

__all__ = ["ZeroPipelineStage"]


class ZeroPipelineStage(PipelineStage):
    """torch's ``PipelineStage`` for a module whose parameters ``opt`` steps ([Note: pipeline stages]).

    Args:
        submodule, stage_index, num_stages, device: as ``PipelineStage``'s.
        opt: the stage's optimizer.
        **kwargs: ``PipelineStage``'s other arguments (``group``: the mesh's ``pp`` group).
    """

    def __init__(
        self,
        submodule: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        opt: ZeroOptimizer,
        **kwargs: Any,
    ) -> None:
        if opt in _STAGED:
            raise ConfigError(
                "this ZeroOptimizer already has a ZeroPipelineStage: one stage per optimizer and per rank "
                "(schedules with several stages per rank are not supported)"
            )
        super().__init__(submodule, stage_index, num_stages, device, **kwargs)
        self.opt = opt
        _STAGED.add(opt)

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> Any:
        """The micro-batch's backward: inside ``opt.no_sync()`` unless it is the step's last."""
        if last_backward:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        with self.opt.no_sync():
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divide the step's gradients by ``grad_scale_factor``, through the optimizer ([Note: pipeline
        stages]): ``.grad`` belongs to zeroplan's reduction by now."""
        if grad_scale_factor != 1:
            self.opt.divide_gradients(grad_scale_factor)


#: Optimizers that have a stage (held weakly: a dropped optimizer frees its entry).
_STAGED: weakref.WeakSet[ZeroOptimizer] = weakref.WeakSet()
