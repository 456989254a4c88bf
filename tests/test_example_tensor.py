"""``examples/train_tensor_parallel.py`` under torchrun: tp=2 x dp=2 trains the demo GPT as dp=2 does,
and resumes from its per-slice checkpoints at dp=1 ([Note: tensor-parallel parameters])."""

from __future__ import annotations

from test_examples import SHORT, losses, one_by_one

FP32 = (*SHORT, "--dtype", "fp32")


def test_tensor_parallel_example_trains_as_data_parallel_and_resumes_at_another_dp_size(tmp_path):
    """Three launches: dp=2 (``train_gpt.py``), tp=2 x dp=2 at stage 3 stopped half way with a
    checkpoint, and tp=2 x dp=1 at stage 2 resuming it; the resumed run ends with the dp=2 run's loss."""
    ckpt = str(tmp_path / "ckpt")
    out = one_by_one(
        dp=("train_gpt.py", *FP32, {"nproc": 2}),
        half=(
            "train_tensor_parallel.py",
            *FP32,
            "--stage",
            "3",  # the local shards sharded over dp; the resumed run is at stage 2
            "--ckpt-dir",
            ckpt,
            "--ckpt-every",
            "6",
            "--stop-at",
            "6",
            {"nproc": 4},
        ),
        rest=("train_tensor_parallel.py", *FP32, "--ckpt-dir", ckpt, "--resume", {"nproc": 2}),
    )
    first_dp, final_dp = losses(out["dp"])
    first_tp, _ = losses(out["half"])
    _, final_tp = losses(out["rest"])
    assert "tp=2 x dp=2" in out["half"].stdout and "resumed from" in out["rest"].stdout, out["rest"].stdout
    assert "tp=2 x dp=1" in out["rest"].stdout, out["rest"].stdout
    assert final_tp < first_tp - 0.3, out["rest"].stdout  # it learns
    # the same model, data and optimizer split another way: the same losses up to the sums' order
    assert abs(first_tp - first_dp) < 1e-5, (out["half"].stdout, out["dp"].stdout)
    assert abs(final_tp - final_dp) < 1e-3 * final_dp, (out["rest"].stdout, out["dp"].stdout)
