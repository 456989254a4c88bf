"""Hugging Face ``transformers.Trainer`` on a ``ZeroOptimizer``: :class:`ZeroTrainer` (extra ``hf``).

[Note: Trainer integration]
``Trainer`` assumes DDP: it moves the model to ``args.device`` (on CPU,
``cpu:0``: every tensor is copied), lets Accelerate wrap it in
``DistributedDataParallel`` (gradients reduced twice), clips and logs the norm
of ``.grad`` (``None`` at stage 2), accumulates gradients inside the DDP
wrapper's ``no_sync`` and saves ``optimizer.state_dict()`` from rank 0 only.
:class:`ZeroTrainer` changes exactly those points and nothing else:

* ``create_optimizer`` builds a ``ZeroOptimizer`` over the param groups
  ``Trainer`` builds from ``args`` (weight decay on ``get_decay_parameter_names``,
  ``0.0`` on the rest, trainable parameters only) around the optimizer class
  and keyword arguments of ``args.optim`` (``get_optimizer_cls_and_kwargs``) or
  ``optimizer_cls_and_kwargs``. It runs after ``Trainer`` moved the model and
  before Accelerate sees it, so the parameters stay views of its buffers.
* ``_wrap_model`` hands the model to Accelerate in evaluation mode, which
  applies autocast and ``torch.compile`` but neither moves it nor wraps it in
  DDP, and marks it prepared, so ``accelerator.prepare`` leaves it alone.
* ``training_step`` runs the backward passes of every micro-batch but the last
  inside ``opt.no_sync()`` (the micro-batches after which ``Trainer`` does not
  step), and copies rank 0's buffers to every rank before the first
  micro-batch of each step, as DDP does before a forward that follows a
  synchronised backward (:func:`~zeroplan.facade.broadcast_buffers`, unless
  ``args.ddp_broadcast_buffers`` is ``False``).
* ``_clip_grad_norm`` is ``opt.clip_grad_norm_(args.max_grad_norm)`` and the
  logged ``grad_norm`` without clipping is ``opt.grad_norm()``.
* Checkpoints: every rank saves the optimizer (parameters, fp32 masters,
  state) with ``zeroplan.facade.checkpoint`` into ``zeroplan/`` inside
  ``Trainer``'s ``checkpoint-N`` folder, which also holds the model, scheduler,
  RNG and trainer state as usual; ``train(resume_from_checkpoint=...)`` loads
  it back on every rank, so a resumed run continues exactly. With
  ``background_saves=True`` see [Note: background saves and rotation].
* Stage 3 (``zero_kwargs={"stage": 3}``): ``create_optimizer`` attaches the
  model (``opt.attach``), so its forward and backward gather what they use
  (evaluation and prediction are forwards too). ``save_model`` (hence
  ``_save_checkpoint``), ``_load_from_checkpoint`` and ``_load_best_model``,
  the places where ``Trainer`` reads or writes weights outside a forward, run
  inside ``opt.gathered_params()`` on every rank (rank 0 alone writes the
  files), loads with ``writeback=True`` so the loaded weights reach the shards
  and masters. ``trainer.save_model()`` is therefore collective at stage 3:
  call it on every rank, as ``Trainer`` itself does; other code reading the
  model's weights after training does so inside
  ``trainer.zero_optimizer.gathered_params()``.

What cannot work is refused when the trainer is built: an optimizer passed in
``optimizers``, fp16 mixed precision (Accelerate's ``GradScaler`` unscales
``.grad``), DeepSpeed, FSDP, ``DataParallel`` over several GPUs of one process,
a data-parallel group other than the processes ``Trainer`` shards the data over
(on CPU ``TrainingArguments(use_cpu=True)`` makes ``Trainer`` distributed),
optimizers that ``Trainer`` builds from the model itself (GaLore, LOMO,
layer-wise and factory optimizers) and a loss scale in ``zero_kwargs``. A plain
``Trainer`` given a ``ZeroOptimizer`` fails at its first step with an error that
names :class:`ZeroTrainer` (the model it moved no longer shares the optimizer's
storage).

[Note: background saves and rotation]
``Trainer`` deletes older ``checkpoint-N`` folders (``save_total_limit``) at the
end of ``_save_checkpoint``, right after ``_save_optimizer_and_scheduler``. A
background save has not committed then: a crash or a failed write would leave
the newest folder without an optimizer snapshot and the previous one deleted.
So with ``background_saves=True``, ``_save_checkpoint`` runs with the limit
lifted and the rotation waits for the save to commit: it runs as soon as the
save is seen committed (checked at each ``training_step``, no collective), or
when the save is waited for, at the next save and at the end of training (every
rank waits there, so a failed background save raises the same error on every
rank, and nothing is rotated). ``train(resume_from_checkpoint=True)`` resumes from
the newest folder whose optimizer save committed, passing over one whose save
did not.

[Note: Accelerate]
In a hand-written ``accelerate`` loop the same points apply (see docs/huggingface.md):
move the model to ``accelerator.device`` *before* building the optimizer; pass
the model to ``accelerator.prepare_model(model, device_placement=False,
evaluation_mode=True)`` (autocast and compile, no DDP, no move), never to
``prepare``; prepare the data loader; keep the optimizer out of ``prepare``
(``save_state`` would save one rank's shard); accumulate inside
``opt.no_sync()`` (``accelerator.accumulate`` only knows DDP's ``no_sync``: the
second backward raises ``StepOrderError``); clip with ``opt.clip_grad_norm_``
(``accelerator.clip_grad_norm_`` reads ``.grad``, ``None`` at stage 2, and
returns 0); checkpoint with ``zeroplan.facade.checkpoint``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

try:
    from transformers import Trainer, trainer_utils
    from transformers.trainer import SCHEDULER_NAME
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "zeroplan.facade.hf needs transformers and accelerate: pip install 'zeroplan[hf]'"
    ) from exc

from zeroplan.core import CheckpointError, ConfigError
from zeroplan.facade import checkpoint
from zeroplan.facade.checkpoint import background
from zeroplan.facade.checkpoint.names import TRAINER_DIR
from zeroplan.facade.params.module_buffers import broadcast_buffers
from zeroplan.facade.runtime.optimizer import ZeroOptimizer

__all__ = ["CHECKPOINT_DIR", "ZeroTrainer"]

_log = logging.getLogger(__name__)

_NOT_COMMITTED = (
    "{folder!r} holds no committed optimizer snapshot in {root}/: its save did not complete (the job "
    "ended, or a background save failed, before it committed). Resume from the checkpoint before it, or "
    "pass resume_from_checkpoint=True to take the newest complete one"
)

#: The folder inside each of ``Trainer``'s ``checkpoint-N`` folders that holds the optimizer.
CHECKPOINT_DIR = TRAINER_DIR

#: ``ZeroOptimizer`` settings ``zero_kwargs`` may hold (hyper-parameters come from ``args``).
ZERO_SETTINGS = frozenset(
    {
        "stage",
        "process_group",
        "shard_group_size",
        "strategy",
        "bucket_bytes",
        "overlap_grad_reduce",
        "alignment",
        "max_inflight_buckets",
        "collectives",
        "reshard_after_forward",
        "offload",
        "offload_fraction",
        "ranks_per_node",
        "layout",
        "reduce_dtype",
        "gather_dtype",
        "wire_block",
        "overlap_param_gather",
        "strict_memory",
    }
)

#: ``ZeroOptimizer`` settings ``ZeroTrainer`` refuses, and why.
_NOT_UNDER_TRAINER = {
    "device_mesh": "Trainer shards the data over every process as one data-parallel group; build the "
    "ZeroOptimizer over a mesh in your own loop (or with accelerate) for tensor or pipeline parallel",
    "deterministic": "it needs a power of two of micro-batches a step and the loss divided by the world "
    "in opt.backward(loss), while Trainer calls loss.backward() itself",
}

_PASSED_OPTIMIZER = (
    "ZeroTrainer builds its ZeroOptimizer from args (optimizer class, learning rate, weight decay and "
    "its decay/no-decay param groups) and zero_kwargs; pass optimizers=(None, None), choose the "
    "optimizer with args.optim or optimizer_cls_and_kwargs, and the schedule with args.lr_scheduler_type "
    "(or override create_scheduler)"
)
_FROM_MODEL = (
    "ZeroTrainer cannot shard args.optim={optim!r}: Trainer builds it from the model itself ({keys}), "
    "not from param groups; choose an optimizer class such as 'adamw_torch' or pass "
    "optimizer_cls_and_kwargs=(cls, kwargs)"
)


def _check_zero_kwargs(zero_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    settings = dict(zero_kwargs or {})
    if "loss_scale" in settings or "scaler" in settings:
        raise ConfigError(
            "zero_kwargs: ZeroTrainer applies no loss scale (Trainer calls loss.backward(), not "
            "opt.backward(loss)); train with fp32 or bf16 parameters, or bf16=True mixed precision"
        )
    refused = sorted(settings.keys() & _NOT_UNDER_TRAINER.keys())
    if refused:
        raise ConfigError(
            f"zero_kwargs: ZeroTrainer does not take {refused[0]!r}: {_NOT_UNDER_TRAINER[refused[0]]}"
        )
    unknown = sorted(settings.keys() - ZERO_SETTINGS)
    if unknown:
        raise ConfigError(
            f"zero_kwargs: {unknown} are not ZeroOptimizer settings ZeroTrainer passes on; allowed: "
            f"{sorted(ZERO_SETTINGS)}. Hyper-parameters (learning rate, betas, weight decay) come from "
            "TrainingArguments"
        )
    return settings


class ZeroTrainer(Trainer):
    """A ``transformers.Trainer`` whose optimizer is a ``ZeroOptimizer`` (see [Note: Trainer integration]).

    Takes every argument of ``Trainer`` and ``zero_kwargs``, the settings of the
    ``ZeroOptimizer`` (``stage``, ``shard_group_size``, ``bucket_bytes``, ...).
    Launch with ``torchrun``; the model is neither moved after the optimizer
    exists nor wrapped in DDP.

    Args:
        *args: positional arguments of ``Trainer`` (``model``, ``args``, ...).
        zero_kwargs: ``ZeroOptimizer`` settings; hyper-parameters come from ``args``.
        background_saves: write each checkpoint's optimizer state in the background
            (``checkpoint.save(blocking=False)``, [Note: background saves]): training goes on
            while it is written; the next save, a resume and the end of ``train()`` wait for it.
        **kwargs: keyword arguments of ``Trainer``; ``optimizers`` may only hold ``None``.

    Raises:
        ConfigError: an optimizer was passed, or ``args``/``zero_kwargs`` ask for
            what cannot work (fp16 mixed precision, DeepSpeed, FSDP, several GPUs
            per process, an optimizer built from the model, a loss scale).

    Example::

        trainer = ZeroTrainer(model=model, args=TrainingArguments(..., max_grad_norm=1.0),
                              train_dataset=data, zero_kwargs={"stage": 2})
        trainer.train()                                   # or resume_from_checkpoint=True
    """

    def __init__(
        self,
        *args: Any,
        zero_kwargs: Mapping[str, Any] | None = None,
        background_saves: bool = False,
        **kwargs: Any,
    ) -> None:
        self.zero_kwargs = _check_zero_kwargs(zero_kwargs)
        self.background_saves = bool(background_saves)
        self._zero: ZeroOptimizer | None = None
        self._rotation: str | None = None
        """The run directory whose older checkpoints are deleted once the save in flight commits."""
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers[0] is not None:
            raise ConfigError(f"optimizers: {_PASSED_OPTIMIZER}")
        if optimizers[1] is not None:
            raise ConfigError(
                f"optimizers: a scheduler needs the optimizer, built later; {_PASSED_OPTIMIZER}"
            )
        super().__init__(*args, **kwargs)
        refused = {
            "fp16 mixed precision (GradScaler reads .grad); use bf16=True": self.args.fp16,
            "DeepSpeed": self.is_deepspeed_enabled,
            "FSDP": self.is_fsdp_enabled or bool(self.args.fsdp),
            "several GPUs per process (DataParallel); launch one process per GPU": self.args.n_gpu > 1,
        }
        for what, present in refused.items():
            if present:
                raise ConfigError(f"ZeroTrainer does not support {what}")
        ranks = dist.get_world_size(self.zero_kwargs.get("process_group")) if dist.is_initialized() else 1
        if ranks != self.args.world_size:
            raise ConfigError(
                f"the ZeroOptimizer would average gradients over {ranks} ranks but Trainer shards the data "
                f"over {self.args.world_size} ({self.args.parallel_mode.value}): every rank would train on "
                "the same batches. On CPU, pass TrainingArguments(use_cpu=True) under torchrun; "
                "zero_kwargs['process_group'] must span every process"
            )
        self._buffers_from_rank_zero = self.args.ddp_broadcast_buffers is not False
        self._after_synced_backward = True  # DDP copies buffers before a forward that follows one

    @property
    def zero_optimizer(self) -> ZeroOptimizer:
        """The ``ZeroOptimizer`` (``self.optimizer`` may be Accelerate's wrapper around it)."""
        if self._zero is None:
            raise ConfigError("the ZeroOptimizer is built by train() or create_optimizer(); none exists yet")
        return self._zero

    # ------------------------------------------------------------ optimizer
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Build the ``ZeroOptimizer`` over ``Trainer``'s decay/no-decay groups (once)."""
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            if self.optimizer_cls_and_kwargs is not None:
                optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
            else:
                optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            built_from_model = sorted({"params", "model", "optimizer_dict"} & optimizer_kwargs.keys())
            if built_from_model or not isinstance(optimizer_cls, type):
                keys = ", ".join(built_from_model) or "a factory"
                raise ConfigError(_FROM_MODEL.format(optim=str(self.args.optim), keys=keys))
            decay = set(self.get_decay_parameter_names(opt_model))
            named = list(opt_model.named_parameters())  # frozen too: checkpoints hold the whole model
            groups = [
                {"params": [(n, p) for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                {"params": [(n, p) for n, p in named if n not in decay], "weight_decay": 0.0},
            ]
            self._zero = ZeroOptimizer(
                [g for g in groups if g["params"]], optimizer_cls, **self.zero_kwargs, **optimizer_kwargs
            )
            self._zero.attach(opt_model)  # stage 3: the forward gathers parameters (no-op at stages 1, 2)
            self.optimizer = self._zero
        return self.optimizer

    def _whole_weights(self, *, writeback: bool = False) -> contextlib.AbstractContextManager[None]:
        """Every parameter whole inside (collective at stage 3); nothing to do before the optimizer exists."""
        if self._zero is None:
            return contextlib.nullcontext()
        return self._zero.gathered_params(writeback=writeback)

    # ------------------------------------------------------------ model
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if self._zero is None and not training:
            return super()._wrap_model(model, training, dataloader)
        # Autocast and torch.compile only: no device placement (the optimizer owns the parameters'
        # storage) and no DDP (the optimizer reduces gradients). Accelerate then sees it as prepared.
        return self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> tuple[nn.Module, Any]:
        model, dataloader = super()._prepare_for_training(*args, **kwargs)
        ddp = nn.parallel.DistributedDataParallel
        if isinstance(model, ddp) or isinstance(self.accelerator.unwrap_model(model), ddp):
            raise ConfigError(
                "Accelerate wrapped the model in DistributedDataParallel despite ZeroTrainer; this version "
                "of accelerate/transformers is not supported by zeroplan.facade.hf"
            )
        return model, dataloader

    # ------------------------------------------------------------ step
    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """``Trainer.training_step``, inside ``no_sync()`` unless the optimizer steps after it."""
        opt = self.zero_optimizer
        if self._rotation is not None and background.committed(opt):
            self._rotate()  # [Note: background saves and rotation]
        if self._buffers_from_rank_zero and self._after_synced_backward:  # the cycle's first micro-batch
            broadcast_buffers(self.model, opt.process_groups.world)
        step = functools.partial(super().training_step, model, inputs, num_items_in_batch)
        self._after_synced_backward = self.accelerator.sync_gradients
        if self.accelerator.sync_gradients:
            return step()
        with opt.no_sync():
            return step()

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        del model
        return self.zero_optimizer.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        del model
        return self.zero_optimizer.grad_norm() if grad_norm is None else grad_norm

    # ------------------------------------------------------------ checkpoints
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` with every parameter whole; collective at stage 3 (call on every rank)."""
        with self._whole_weights():
            super().save_model(output_dir, _internal_call)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        with self._whole_weights(writeback=True):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        with self._whole_weights(writeback=True):
            super()._load_best_model()

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; a background save still running at the end is waited for (its error raised).

        ``resume_from_checkpoint=True`` resumes from the newest ``checkpoint-N`` whose optimizer save
        committed ([Note: background saves and rotation]).
        """
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._last_committed_checkpoint() or True
        result = super().train(resume_from_checkpoint, *args, **kwargs)
        self._finish_background_save()
        return result

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        # Before Trainer's own deletions at the end (save_total_limit=1 with a best checkpoint).
        self._finish_background_save()
        return super()._finalize_training(*args, **kwargs)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """``Trainer._save_checkpoint``; with background saves, older checkpoints are deleted only once
        this one's optimizer save committed ([Note: background saves and rotation])."""
        if not self.background_saves:
            super()._save_checkpoint(model, trial)
            return
        self._finish_background_save()  # every rank: the previous save's error raises here
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self._rotation = self._get_output_dir(trial=trial)
        if self._zero is None or background.committed(self._zero):  # nothing in flight (save_only_model)
            self._rotate()

    def _finish_background_save(self) -> None:
        """Wait for the save in flight (its error raised, the same on every rank), then rotate."""
        if self._zero is not None:
            background.finish_pending(self._zero)
        if self._rotation is not None:
            self._rotate()

    def _rotate(self) -> None:
        """Delete the checkpoints ``save_total_limit`` leaves out, as ``Trainer`` would have."""
        run_dir, self._rotation = self._rotation, None
        if run_dir is None or not self.args.should_save:
            return
        rotate = getattr(trainer_utils, "rotate_checkpoints", None)
        if rotate is None:  # transformers 4: a method of Trainer
            self._rotate_checkpoints(use_mtime=True, output_dir=run_dir)
            return
        rotate(
            output_dir=run_dir,
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
            use_mtime=True,
        )

    def _last_committed_checkpoint(self) -> str | None:
        """The newest ``checkpoint-N`` of ``args.output_dir`` whose optimizer save committed (or that
        holds no ``zeroplan/`` at all), ``None`` if there is none."""
        found = []
        for folder in Path(self.args.output_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
            number = re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", folder.name)
            if number is not None and folder.is_dir():
                found.append((int(number.group(1)), folder))
        for _, folder in sorted(found, reverse=True):
            root = folder / CHECKPOINT_DIR
            if not root.exists() or checkpoint.latest(root) is not None:
                return str(folder)
            _log.warning(
                "passing over %s: its optimizer save did not commit (the job ended, or the background save "
                "failed, before it did)",
                folder,
            )
        return None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        root = Path(output_dir) / CHECKPOINT_DIR
        checkpoint.save(self.zero_optimizer, root, blocking=not self.background_saves)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), Path(output_dir) / SCHEDULER_NAME)

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            return
        root = Path(checkpoint_dir) / CHECKPOINT_DIR
        if checkpoint.latest(root) is None and root.is_dir():
            raise CheckpointError(_NOT_COMMITTED.format(folder=checkpoint_dir, root=CHECKPOINT_DIR))
        if checkpoint.latest(root) is None:
            raise CheckpointError(
                f"{checkpoint_dir!r} holds no zeroplan optimizer checkpoint ({CHECKPOINT_DIR}/): it was not "
                "saved by ZeroTrainer (or with save_only_model=True). A plain torch.optim state dict loads "
                "with trainer.zero_optimizer.load_state_dict(...) after create_optimizer()"
            )
        checkpoint.load(self.zero_optimizer, root)
        scheduler = Path(checkpoint_dir) / SCHEDULER_NAME
        if scheduler.is_file():
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
