"""``examples/train_tensor_parallel.py`` and ``examples/train_pipeline.py`` under torchrun: tp=2 x dp=2
and pp=2 x dp=2 train the demo GPT as dp=2 does, and the tp run resumes from its per-slice checkpoints
at dp=1 ([Note: tensor-parallel parameters], [Note: pipeline stages])."""

from __future__ import annotations

import pytest
from test_examples import SHORT, losses, one_by_one, torchrun

FP32 = (*SHORT, "--dtype", "fp32")


@pytest.fixture(scope="module")
def data_parallel():
    """The dp=2 run (``train_gpt.py``) both examples are compared with: (first, final) loss."""
    return losses(torchrun("train_gpt.py", *FP32, nproc=2))


def test_tensor_parallel_example_trains_as_data_parallel_and_resumes_at_another_dp_size(
    tmp_path, data_parallel
):
    """Two launches beside the dp=2 run: tp=2 x dp=2 at stage 3 (the local shards sharded over dp)
    stopped half way with a checkpoint per slice, and tp=2 x dp=1 at stage 2 resuming it; the resumed
    run ends with the dp=2 run's loss (the same model, data and optimizer split another way: the same
    losses up to the sums' order)."""
    ckpt = str(tmp_path / "ckpt")
    stop = ("--ckpt-dir", ckpt, "--ckpt-every", "6", "--stop-at", "6")
    out = one_by_one(
        half=("train_tensor_parallel.py", *FP32, "--stage", "3", *stop, {"nproc": 4}),
        rest=("train_tensor_parallel.py", *FP32, "--ckpt-dir", ckpt, "--resume", {"nproc": 2}),
    )
    first_dp, final_dp = data_parallel
    first, _ = losses(out["half"])
    _, final = losses(out["rest"])
    assert "tp=2 x dp=2" in out["half"].stdout, out["half"].stdout
    assert "tp=2 x dp=1" in out["rest"].stdout and "resumed from" in out["rest"].stdout, out["rest"].stdout
    assert final < first - 0.3, out["rest"].stdout  # it learns
    assert abs(first - first_dp) < 1e-5, (out["half"].stdout, first_dp)
    assert abs(final - final_dp) < 1e-3 * final_dp, (out["rest"].stdout, final_dp)


def test_pipeline_example_trains_as_data_parallel(data_parallel):
    """One launch beside the dp=2 run: pp=2 x dp=2 at stage 3, torch's GPipe schedule over
    ``ZeroPipelineStage``s, ends with the dp=2 run's loss (each stage's checkpoints are
    ``test_mesh``'s)."""
    out = torchrun("train_pipeline.py", *FP32, "--stage", "3", nproc=4)
    first_dp, final_dp = data_parallel
    first, final = losses(out)
    assert "pp=2 x dp=2" in out.stdout, out.stdout
    assert abs(first - first_dp) < 1e-5, (out.stdout, first_dp)
    assert abs(final - final_dp) < 1e-3 * final_dp, (out.stdout, final_dp)
