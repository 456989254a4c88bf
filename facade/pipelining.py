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

A schedule's ``scale_grads=True`` divides ``.grad`` by the number of
micro-batches after the last backward, when zeroplan's reduction owns the
gradients (at stages 2 and 3 ``.grad`` is empty by then, and the division would
silently do nothing): the stage refuses it on every rank before the step. Build
the schedule with ``scale_grads=False`` and divide the loss by the number of
micro-batches in ``loss_fn``.
"""

from __future__ import annotations

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
        super().__init__(submodule, stage_index, num_stages, device, **kwargs)
        self.opt = opt

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> Any:
        """The micro-batch's backward: inside ``opt.no_sync()`` unless it is the step's last."""
        if last_backward:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        with self.opt.no_sync():
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Refuse dividing ``.grad`` after the reduction (see [Note: pipeline stages]).

        Raises:
            ConfigError: ``grad_scale_factor`` is not 1 (on every rank: every stage's schedule calls it).
        """
        if grad_scale_factor != 1:
            raise ConfigError(
                f"the pipeline schedule divides gradients by {grad_scale_factor} after zeroplan reduced "
                "them: build it with scale_grads=False and divide the loss by the number of "
                "micro-batches in loss_fn"
            )
