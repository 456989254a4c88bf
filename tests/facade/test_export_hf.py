"""``zeroplan export`` of ``ZeroTrainer`` checkpoints loads with ``from_pretrained``, bit for bit.

One ``torchrun --nproc-per-node 2`` launch of ``hf_runs.py`` trains the tiny GPT-2 (``lm_head``
tied to ``transformer.wte``) with ``ZeroTrainer`` at stages 2 and 3, saving ``checkpoint-3`` and
``checkpoint-6``; each ``checkpoint-6`` is exported here, offline, and loaded with
``GPT2LMHeadModel.from_pretrained``: it equals the model gathered in the live run at the end of
training, and ``Trainer``'s own ``model.safetensors`` (written from gathered weights).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
from hf_launch import launch_hf_runs

from zeroplan.facade.cli import main

HAS_HF = all(importlib.util.find_spec(m) is not None for m in ("transformers", "accelerate", "safetensors"))
pytestmark = pytest.mark.skipif(not HAS_HF, reason="needs transformers and accelerate (pip install '.[hf]')")

#: stage 2 and stage 3, checkpoints at steps 3 and 6; at stage 3 with two parameters frozen too
RUNS = ("zero_clip", "zero3_clip", "zero3_frozen")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """The runs' output folder and rank 0's results (final gathered parameters)."""
    import torch

    out = tmp_path_factory.mktemp("hf_export")
    launch_hf_runs(out, RUNS)
    return out, {name: torch.load(out / f"{name}.rank0.pt", weights_only=False) for name in RUNS}


@pytest.mark.parametrize("run", RUNS)
def test_exported_trainer_checkpoint_loads_with_from_pretrained_bit_for_bit(trained, tmp_path, run):
    import torch
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    folder, results = trained
    checkpoint = folder / run / "checkpoint-6"
    out = tmp_path / "exported"
    assert main(["export", str(checkpoint), str(out)]) == 0  # the Trainer folder: its zeroplan/ root
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    model = GPT2LMHeadModel.from_pretrained(out)
    live = results[run]["params"]  # gathered after the last step (= checkpoint-6)
    loaded = dict(model.named_parameters())
    assert loaded.keys() == live.keys() and "lm_head.weight" not in live  # tied: one parameter
    assert all(torch.equal(loaded[n], live[n]) for n in live)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied again by from_pretrained
    # The same file content as Trainer's own save_model from gathered weights.
    ours, theirs = load_file(out / "model.safetensors"), load_file(checkpoint / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
