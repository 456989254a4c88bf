"""Training runs with Hugging Face ``Trainer`` and ``accelerate``, launched by ``tests/facade/test_hf.py``.

    python -m torch.distributed.run --nproc-per-node 2 tests/facade/hf_runs.py OUT RUN [RUN ...]

Each run trains the same tiny random GPT-2 (no downloads) on the same in-memory
data, then every rank saves what the tests compare to ``OUT/RUN.rankR.pt``:
the losses and gradient norms ``Trainer`` logged (or the loop computed), the
learning rates, and the final parameters. ``ERROR`` runs save the message of the
error they raised instead.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import shutil
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

from zeroplan.facade import ZeroOptimizer
from zeroplan.facade.hf import ZeroTrainer

VOCAB, LENGTH, EXAMPLES = 61, 12, 48
STEPS = 6


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 without dropout (odd vocabulary: padded shards), the same on every rank."""
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).to(dtype)
    model.loss_type = "ForCausalLM"
    return model


class Stats(torch.nn.Module):
    """A tiny model with running statistics (a BatchNorm's buffers), which each rank updates from its
    own batches: what DDP's copy of rank 0's buffers before a step's first forward is for."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, VOCAB)
        self.to(dtype)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.norm(self.embed(input_ids).transpose(1, 2)).transpose(1, 2)
        logits = self.head(hidden)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return {"loss": loss, "logits": logits}


class Data(torch.utils.data.Dataset):
    """Arithmetic sequences modulo ``VOCAB``: learnable, deterministic, in memory."""

    def __len__(self) -> int:
        return EXAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start, stride = (7 * i) % VOCAB, 1 + i % 5
        ids = (start + stride * torch.arange(LENGTH)) % VOCAB
        return {"input_ids": ids, "labels": ids.clone()}


def training_args(out: Path, **overrides: Any) -> TrainingArguments:
    settings: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": 4,
        "max_steps": STEPS,
        "learning_rate": 3e-3,
        "weight_decay": 0.1,
        "warmup_steps": 2,
        "max_grad_norm": 0.0,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    settings.update(overrides)
    return TrainingArguments(**settings)


def _history(trainer: Trainer) -> dict[str, list[float]]:
    steps = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    return {
        "losses": [h["loss"] for h in steps],
        "grad_norms": [h.get("grad_norm") for h in steps],
        "lrs": [h["learning_rate"] for h in steps],
        "steps": [h["step"] for h in steps],
    }


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- Trainer runs
def trainer_run(
    out: Path,
    *,
    zero: dict[str, Any] | None,
    resume_from: str | bool | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    background: bool = False,
    model_class: Callable[[int, torch.dtype], torch.nn.Module] = make_model,
    frozen: tuple[str, ...] = (),
    **overrides: Any,
) -> dict[str, Any]:
    """``Trainer`` + ``torch.optim.AdamW`` under DDP (``zero=None``) or ``ZeroTrainer(zero_kwargs=zero)``
    (``background``: its checkpoints saved with ``background_saves=True``; ``frozen``: parameters
    whose ``requires_grad`` is off)."""
    model = model_class(seed, dtype)
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    args = training_args(out, **overrides)
    data = {"train_dataset": Data(), "eval_dataset": Data() if "eval_strategy" in overrides else None}
    if zero is None:
        trainer: Trainer = Trainer(model=model, args=args, **data)
    else:
        trainer = ZeroTrainer(model=model, args=args, zero_kwargs=zero, background_saves=background, **data)
    trainer.train(resume_from_checkpoint=resume_from)
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    wrapped = type(trainer.model_wrapped).__name__
    # Stage 3 holds shards between steps: the weights are read gathered (stages 1, 2: nothing to do).
    whole = trainer.zero_optimizer.gathered_params() if zero is not None else contextlib.nullcontext()
    with whole:
        params = _params(model)
    best = trainer.state.best_model_checkpoint
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return {
        **_history(trainer),
        "eval_losses": evals,
        "params": params,
        "buffers": buffers,
        "wrapped": wrapped,
        "best": best,
    }


def resumed_latest(out: Path, checkpoint: Path, **kwargs: Any) -> dict[str, Any]:
    """``trainer_run(out, resume_from=True)`` with ``checkpoint`` copied into ``out``: the latest there."""
    if dist.get_rank() == 0:
        shutil.copytree(checkpoint, out / checkpoint.name)
    dist.barrier()
    return trainer_run(out, resume_from=True, **kwargs)


def _committed(out: Path) -> dict[str, bool]:
    """Each ``checkpoint-N`` folder of ``out``: whether its optimizer snapshot is committed."""
    from zeroplan.facade import checkpoint

    folders = sorted(p for p in out.glob("checkpoint-*") if p.is_dir())
    return {p.name: checkpoint.latest(p / "zeroplan") is not None for p in folders}


@contextlib.contextmanager
def _background_writes(*, delay: float = 0.0, fail_in: str | None = None) -> Any:
    """Checkpoint files written by the background thread take ``delay`` seconds more (a big model's
    write); on rank 1, those of a path holding ``fail_in`` fail (a full disk)."""
    import time

    import zeroplan.facade.checkpoint as ckpt

    real = ckpt.write_tensors

    def write(path: Path, tensors: Any) -> int:
        time.sleep(delay)
        if fail_in is not None and fail_in in str(path) and dist.get_rank() == 1:
            raise OSError(28, "No space left on device")
        return real(path, tensors)

    ckpt.write_tensors = write
    try:
        yield
    finally:
        ckpt.write_tensors = real


def background_rotation_run(out: Path, *, fail_in: str | None = None) -> dict[str, Any]:
    """``ZeroTrainer(background_saves=True)`` with ``save_total_limit=1``, each write slowed: which
    checkpoint folders exist (and are committed) right after each save returned, and at the end."""
    from transformers import TrainerCallback

    seen: dict[int, dict[str, bool]] = {}

    class Look(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen[state.global_step] = _committed(out)

    args = training_args(out, save_strategy="steps", save_steps=2, save_total_limit=1)
    trainer = ZeroTrainer(
        model=make_model(), args=args, train_dataset=Data(), zero_kwargs={"stage": 2}, background_saves=True
    )
    trainer.add_callback(Look())
    with _background_writes(delay=1.0, fail_in=fail_in):
        trainer.train()
    dist.barrier()
    return {**_history(trainer), "at_save": seen, "at_end": _committed(out), "params": _params(trainer.model)}


def background_failure_resumed(out: Path) -> dict[str, Any]:
    """After ``background_rotation_run(out, fail_in="checkpoint-4")`` raised: what is left, and
    ``resume_from_checkpoint=True`` from it."""
    before = _committed(out)
    dist.barrier()
    result = trainer_run(
        out,
        zero={"stage": 2},
        seed=1,
        resume_from=True,
        background=True,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=1,
    )
    return {**result, "before": before}


def plain_trainer_with_zero_optimizer(out: Path) -> dict[str, Any]:
    """What a new user tries first: ``Trainer(optimizers=(ZeroOptimizer(...), scheduler))``."""
    model = make_model()
    opt = ZeroOptimizer(model.named_parameters(), torch.optim.AdamW, lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    trainer = Trainer(model=model, args=training_args(out), train_dataset=Data(), optimizers=(opt, scheduler))
    trainer.train()
    return {"trained": True}


# --------------------------------------------------------------------------- accelerate runs
def accelerate_run(*, zero: bool, accumulate: int, clip: float | None) -> dict[str, Any]:
    """An ``accelerate`` loop: DDP + ``torch.optim.AdamW``, or ``ZeroOptimizer`` as the README says."""
    from accelerate import Accelerator
    from transformers import get_linear_schedule_with_warmup

    accelerator = Accelerator(cpu=True)
    model = make_model()
    loader = torch.utils.data.DataLoader(Data(), batch_size=4)
    hyper = {"lr": 3e-3, "weight_decay": 0.1}
    if zero:
        model.to(accelerator.device)  # before the optimizer exists: it owns the parameters' storage
        # Rank-major: the clipping norm then sums the gradient in the order the 1e-6 comparison with
        # DDP was set for; an interleaved shard sums it in another order (fp32 rounding, ~1.4e-6).
        opt: Any = ZeroOptimizer(model.named_parameters(), torch.optim.AdamW, layout="rank_major", **hyper)
        model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)  # no DDP
        loader = accelerator.prepare(loader)
    else:
        opt = torch.optim.AdamW(model.parameters(), **hyper)
        model, opt, loader = accelerator.prepare(model, opt, loader)
    scheduler = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS)
    losses, norms = [], []
    batches = (batch for _ in range(STEPS * accumulate) for batch in loader)
    for _ in range(STEPS):
        total = torch.zeros(())
        for micro in range(accumulate):
            last = micro == accumulate - 1
            if last:
                context: Any = contextlib.nullcontext()
            else:
                context = opt.no_sync() if zero else accelerator.no_sync(model)
            with context:
                loss = model(**next(batches)).loss / accumulate
                accelerator.backward(loss)
            total += loss.detach()
        if zero:
            norm = opt.clip_grad_norm_(clip) if clip else opt.grad_norm()
        else:
            norm = accelerator.clip_grad_norm_(model.parameters(), clip or math.inf)
        norms.append(float(norm))
        opt.step()
        scheduler.step()
        opt.zero_grad()
        losses.append(float(accelerator.reduce(total, "mean")))
    return {"losses": losses, "grad_norms": norms, "params": _params(accelerator.unwrap_model(model))}


# --------------------------------------------------------------------------- the runs
def runs(out: Path) -> dict[str, Callable[[], dict[str, Any]]]:
    """Every run by name; ``*_resumed`` runs read the checkpoints of the run before them."""
    gas = {"gradient_accumulation_steps": 2}
    stats = {"gradient_accumulation_steps": 3, "eval_strategy": "steps", "eval_steps": 2}
    frozen = ("transformer.wpe.weight", "transformer.h.0.ln_1.weight")
    clip = {"max_grad_norm": 0.5, "gradient_accumulation_steps": 2}
    save = {"save_strategy": "steps", "save_steps": 3}
    evaluate = {"eval_strategy": "steps", "eval_steps": 3}
    bf16 = torch.bfloat16
    resumed: dict[str, Any] = {"zero": {"stage": 2}, "seed": 1}
    return {
        "ddp": lambda: trainer_run(out / "ddp", zero=None),
        "zero": lambda: trainer_run(out / "zero", zero={"stage": 2}),
        "ddp_gas": lambda: trainer_run(out / "ddp_gas", zero=None, **gas),
        "zero_gas": lambda: trainer_run(out / "zero_gas", zero={"stage": 2}, **gas),
        "zero3_frozen": lambda: trainer_run(
            out / "zero3_frozen", zero={"stage": 3}, frozen=frozen, **clip, **save
        ),
        "ddp_buffers": lambda: trainer_run(out / "ddp_buffers", zero=None, model_class=Stats, **stats),
        "zero_buffers": lambda: trainer_run(
            out / "zero_buffers", zero={"stage": 2}, model_class=Stats, **stats
        ),
        "ddp_clip": lambda: trainer_run(out / "ddp_clip", zero=None, **clip, **evaluate),
        "zero_clip": lambda: trainer_run(out / "zero_clip", zero={"stage": 2}, **clip, **save, **evaluate),
        "zero1_clip": lambda: trainer_run(out / "zero1_clip", zero={"stage": 1}, **clip),
        # Another initial model: what the resumed run ends with comes from the checkpoint alone.
        "zero_clip_resumed": lambda: trainer_run(
            out / "zero_clip_resumed",
            **resumed,
            resume_from=str(out / "zero_clip" / "checkpoint-3"),
            **clip,
            **evaluate,
        ),
        # bf16 parameters: the fp32 masters must come back from the checkpoint, not from the bf16 model.
        "zero_bf16": lambda: trainer_run(out / "zero_bf16", zero={"stage": 2}, dtype=bf16, **clip, **save),
        "zero_bf16_background": lambda: trainer_run(
            out / "zero_bf16_background", zero={"stage": 2}, dtype=bf16, background=True, **clip, **save
        ),
        "zero_bf16_resumed": lambda: trainer_run(
            out / "zero_bf16_resumed",
            **resumed,
            dtype=bf16,
            resume_from=str(out / "zero_bf16" / "checkpoint-3"),
            **clip,
        ),
        # Stage 3: the model is saved from gathered weights; resume_from_checkpoint=True finds checkpoint-3.
        "zero3": lambda: trainer_run(out / "zero3", zero={"stage": 3}),
        "zero3_clip": lambda: trainer_run(out / "zero3_clip", zero={"stage": 3}, **clip, **save, **evaluate),
        "zero3_clip_resumed": lambda: resumed_latest(
            out / "zero3_clip_resumed",
            out / "zero3_clip" / "checkpoint-3",
            zero={"stage": 3},
            seed=1,
            **clip,
            **save,
            **evaluate,
        ),
        # Picks checkpoint-3 (the higher loss): _load_best_model writes it back into the shards.
        "zero3_best": lambda: trainer_run(
            out / "zero3_best",
            zero={"stage": 3},
            load_best_model_at_end=True,
            metric_for_best_model="eval_loss",
            greater_is_better=True,
            **clip,
            **save,
            **evaluate,
        ),
        # torch_compile=True: the model compiled whole by Accelerate, DDP's and ZeroTrainer's alike.
        "ddp_compile": lambda: trainer_run(out / "ddp_compile", zero=None, torch_compile=True),
        "zero_compile": lambda: trainer_run(out / "zero_compile", zero={"stage": 2}, torch_compile=True),
        "zero3_compile": lambda: trainer_run(out / "zero3_compile", zero={"stage": 3}, torch_compile=True),
        "accelerate_ddp": lambda: accelerate_run(zero=False, accumulate=2, clip=None),
        "accelerate_zero": lambda: accelerate_run(zero=True, accumulate=2, clip=None),
        "accelerate_ddp_clip": lambda: accelerate_run(zero=False, accumulate=2, clip=0.5),
        "accelerate_zero_clip": lambda: accelerate_run(zero=True, accumulate=2, clip=0.5),
        "ERROR_plain_trainer": lambda: plain_trainer_with_zero_optimizer(out / "plain"),
        # Background saves: older checkpoints deleted once the newer one committed, never before.
        "zero_background_rotation": lambda: background_rotation_run(out / "zero_background_rotation"),
        "ERROR_background_failure": lambda: background_rotation_run(
            out / "background_failure", fail_in="checkpoint-4"
        ),
        "zero_background_failure_resumed": lambda: background_failure_resumed(out / "background_failure"),
    }


def main(argv: list[str]) -> int:
    out, names = Path(argv[0]), argv[1:]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    rank = dist.get_rank()
    table = runs(out)
    for name in names:
        try:
            result = table[name]()
        except Exception as exc:
            if not name.startswith("ERROR"):
                raise
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        torch.save(result, out / f"{name}.rank{rank}.pt")
        gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
