"""The loop of ``train_gpt.py`` with a Hugging Face ``transformers`` GPT-2, randomly initialised.

    pip install transformers           # or: pip install 'zeroplan[hf]'
    torchrun --nproc-per-node 2 examples/train_hf_gpt2.py --steps 100

Nothing is downloaded: the model is built from a small ``GPT2Config``. Its
token embedding and output head are one tied parameter, which ZeroOptimizer
sees once, as ``model.parameters()`` yields it. Every option of
``train_gpt.py`` applies (accumulation, clipping, schedule, checkpoints).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_gpt import parse_args, run

from zeroplan.facade.cli.demo.model import IGNORE, SortTask


def build_gpt2(args, device: torch.device, dtype: torch.dtype):
    """A 2-layer GPT-2 (vocabulary 1000, of which the sorting task uses 32 tokens) and its loss."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise SystemExit("this example needs transformers: pip install transformers") from None
    task = SortTask()
    # bos/eos: GPT-2's 50256 lies outside this vocabulary (transformers warns); 0 is the task's separator.
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = GPT2LMHeadModel(config).to(device=device, dtype=dtype)
    model.loss_type = "ForCausalLM"  # what transformers picks anyway, without warning that it had to

    def loss_fn(sequences: torch.Tensor) -> torch.Tensor:
        labels = sequences.clone()
        labels[:, : task.length] = IGNORE  # the random digits are not predictable; the model shifts labels
        return model(input_ids=sequences, labels=labels).loss

    return model, loss_fn


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv, description=__doc__.splitlines()[0]), build=build_gpt2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
