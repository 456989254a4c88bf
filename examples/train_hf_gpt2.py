"""Train a Hugging Face GPT-2 with ``ZeroTrainer``: ``transformers.Trainer`` on a ``ZeroOptimizer``.

    pip install 'zeroplan[hf]'                       # transformers and accelerate
    torchrun --nproc-per-node 2 examples/train_hf_gpt2.py --steps 100
    torchrun --nproc-per-node 2 examples/train_hf_gpt2.py --steps 100 --ckpt-dir ckpt --ckpt-every 50
    torchrun --nproc-per-node 2 examples/train_hf_gpt2.py --steps 100 --ckpt-dir ckpt --resume

Nothing is downloaded: the model is built from a small ``GPT2Config`` and learns
zeroplan's demo task (sorting digits). Its token embedding and output head are
one tied parameter, which the optimizer sees once. The options of
``train_gpt.py`` become ``TrainingArguments``: ``--global-batch`` sequences per
step in ``--micro-batches`` accumulation steps, ``--clip`` is ``max_grad_norm``,
warmup then cosine decay to ``--min-lr-ratio`` of ``--lr``, and checkpoints are
``Trainer``'s ``checkpoint-N`` folders in ``--ckpt-dir`` (the optimizer's shards,
fp32 masters included, in ``checkpoint-N/zeroplan``). ``ZeroTrainer`` keeps the
model unwrapped (no DDP), reduces and clips gradients with zeroplan and logs
the norm it clipped; see [Note: Trainer integration] in ``zeroplan.facade.hf``.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config-built model: nothing to fetch

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_gpt import DTYPES, parse_args

from zeroplan.facade.cli.demo.model import IGNORE, SortTask

try:
    from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint
    from transformers.utils.logging import disable_progress_bar

    from zeroplan.facade.hf import ZeroTrainer
except ImportError:
    raise SystemExit("this example needs transformers and accelerate: pip install 'zeroplan[hf]'") from None


def build_gpt2(seed: int, dtype: torch.dtype) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 (vocabulary 1000, of which the sorting task uses 32 tokens), the same on every rank."""
    # bos/eos: GPT-2's 50256 lies outside this vocabulary (transformers warns); 0 is the task's separator.
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).to(dtype)
    model.loss_type = "ForCausalLM"  # what transformers picks anyway, without warning that it had to
    return model


class SortData(torch.utils.data.Dataset):
    """The demo task's sequences; the random digits are not predictable, so they are not scored."""

    def __init__(self, task: SortTask, size: int) -> None:
        self.task, self.size = task, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sequence = self.task.sequences(step=0, index=index, size=1)[0]
        labels = sequence.clone()
        labels[: self.task.length] = IGNORE  # the model shifts labels by one position itself
        return {"input_ids": sequence, "labels": labels}


class Report(TrainerCallback):
    """Prints, on rank 0, what ``train_gpt.py`` prints; stops at ``--stop-at`` as if preempted."""

    def __init__(self, args: argparse.Namespace, world: int) -> None:
        self.args, self.world = args, world
        self.trainer: ZeroTrainer | None = None
        self.first = self.last = math.nan
        self.start = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        del args, control, kwargs
        assert self.trainer is not None
        opt, rank = self.trainer.zero_optimizer, dist.get_rank()
        params = sum(p.numel() for p in self.trainer.model.parameters())
        mine = opt.memory_report(clipping=True).ranks[rank]
        self.start = state.global_step
        self.print(
            f"{params:,} parameters, {self.args.dtype}, world {self.world}, stage {self.args.stage}, shard "
            f"groups of {opt.plan.topology.shard_size}; rank 0 holds {mine.total_bytes / 2**20:.2f} MiB "
            f"(optimizer state {mine.optimizer_state_bytes / 2**20:.2f} MiB)"
        )
        if self.start:
            self.print(f"resumed from {self.args.ckpt_dir} at step {self.start}")

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        del args, control, kwargs
        if logs and "loss" in logs:
            self.last = logs["loss"]
            self.first = self.last if math.isnan(self.first) else self.first
            self.print(
                f"step {state.global_step:5d}/{state.max_steps} | loss {logs['loss']:.4f} | "
                f"lr {logs['learning_rate']:.2e} | grad norm {logs['grad_norm']:.3f}"
            )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        del args, kwargs
        if self.args.stop_at is not None and state.global_step >= self.args.stop_at:
            control.should_training_stop = control.should_log = True
            control.should_save = self.args.ckpt_dir is not None
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        del args, control, kwargs
        self.print(
            f"done: loss {self.first:.4f} -> {self.last:.4f} (steps {self.start + 1}-{state.global_step}); "
            f"final {self.last!r}"
        )

    @staticmethod
    def print(message: str) -> None:
        if dist.get_rank() == 0:
            print(message, flush=True)


def train(args: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.global_batch % (world * args.micro_batches):
        raise SystemExit(
            f"--global-batch {args.global_batch} must be a multiple of world {world} x --micro-batches "
            f"{args.micro_batches}"
        )
    output_dir = str(args.ckpt_dir) if args.ckpt_dir is not None else tempfile.mkdtemp(prefix="zeroplan-hf-")
    training = TrainingArguments(
        output_dir=output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.global_batch // (world * args.micro_batches),
        gradient_accumulation_steps=args.micro_batches,
        learning_rate=args.lr,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": args.min_lr_ratio},
        warmup_steps=min(args.warmup, args.steps - 1),
        adam_beta2=0.95,
        weight_decay=0.1,
        max_grad_norm=args.clip,
        logging_steps=args.log_every,
        logging_first_step=True,
        save_strategy="steps" if args.ckpt_dir is not None else "no",
        save_steps=args.ckpt_every,
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),  # Trainer's multi-process CPU mode (gloo)
        report_to=[],
        disable_tqdm=True,
        log_level="error",
    )
    model = build_gpt2(args.seed, DTYPES[args.dtype])  # bf16 parameters: fp32 masters in the optimizer
    report = Report(args, world)
    trainer = ZeroTrainer(
        model=model,
        args=training,
        train_dataset=SortData(SortTask(), args.steps * args.global_batch),
        callbacks=[report],
        zero_kwargs={
            "stage": args.stage,
            "shard_group_size": args.shard_size,
            "bucket_bytes": max(1, int(args.bucket_mb * 2**20)),
        },
    )
    trainer.remove_callback(PrinterCallback)  # Report prints the logs
    disable_progress_bar()  # "Writing model shards" at every checkpoint
    report.trainer = trainer
    resume = None
    if args.resume:
        resume = get_last_checkpoint(output_dir)
        if resume is None:
            report.print(f"no checkpoint in {args.ckpt_dir}: starting from step 0")
    trainer.train(resume_from_checkpoint=resume)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, description=__doc__.splitlines()[0])
    try:
        train(args)
    finally:
        gc.collect()  # free the optimizer (its hooks refer back to it) while torch is fully alive
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
